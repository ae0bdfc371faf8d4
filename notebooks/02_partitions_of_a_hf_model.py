# %% [markdown]
# # 02 · Partitions of a Hugging Face model
#
# A GPT-2 built from a `transformers` config (random weights, nothing downloaded), cut into
# P = 2..8 stages. We compare the stage times of varuna_fx's cost-balanced cut with the two
# usual heuristics, on the *same* per-operation cost estimates:
#
# * **equal layers**: n_layer / P transformer blocks per stage, embeddings on the first stage,
#   the final norm and LM head on the last (torch.distributed.pipelining's `split_spec` style);
# * **parameter count**: the layer cut whose largest stage holds the fewest parameters
#   (DeepSpeed's `partition_method="parameters"`).
#
# The pipeline's speed is set by its slowest stage, so the chart shows each split's slowest
# stage over the mean (1.0 = perfect balance). `bench/bench_balance.py` does the same at
# GPT-2-XL scale.

# %%
import re

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import varuna_fx as vf
from varuna_fx.ir.nodes import info
from varuna_fx.passes.assign_stages import CostSetting, compute_nodes, partition_problem

torch.manual_seed(0)
config = GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=1000, n_positions=32,
                    use_cache=False, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # eager == pipeline below
model = GPT2LMHeadModel(config)
ids = torch.randint(0, config.vocab_size, (4, 32))
example = {"input_ids": ids, "labels": ids}  # the model computes its own loss
# recompute=True (Varuna's setting): every split below is priced with the same recompute costs;
# a stated CPU (no measured costs: the FLOP roofline), so the cuts are the same on any machine
cluster = vf.Cluster(gpus=1, device="cpu")
pipes = {p: vf.compile(model, cluster, example_inputs=example, stages=p, recompute=True)
         for p in range(2, 9)}
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
      f"traced with {pipes[2].plan.tracer}")

# %% [markdown]
# Every split is evaluated on the partitioner's own cost arrays (`partition_problem`): the
# estimated forward + recompute + backward time of each operation at the plan's micro-batch
# size, in graph order, plus the time to send what crosses a stage's right edge; the last stage
# never recomputes.

# %%
gm = pipes[2].captured.gm
nodes = compute_nodes(gm)
setting = CostSetting(pipes[2].plan.micro_batch_size, cluster.spec,
                      float(cluster.intra_node_bandwidth), float(cluster.gpu_memory), 1, True)
costs = partition_problem(gm, setting)
send = costs.cut_bytes / setting.bandwidth


def unit(path: str, seen_block: bool) -> int:
    """0: embeddings; 1..L: transformer block i-1; L + 1: final norm and LM head."""
    match = re.search(r"\.h\.(\d+)(\.|$)", path)
    return 1 + int(match.group(1)) if match else (config.n_layer + 1 if seen_block else 0)


units, seen = [], False
for n in nodes:
    units.append(unit(info(n).module_path, seen))
    seen = seen or 1 <= units[-1] <= config.n_layer
units = np.maximum.accumulate(np.array(units))  # graph order follows the layers
params = np.zeros(config.n_layer + 2)
for name, p in model.named_parameters():
    match = re.search(r"\.h\.(\d+)\.", name)
    params[1 + int(match.group(1)) if match else (0 if "wte" in name or "wpe" in name
                                                  else config.n_layer + 1)] += p.numel()


def bounds_at_units(first_units: list[int]) -> list[int]:
    """Node positions where each stage's first layer unit begins."""
    return [0, *(int(np.argmax(units >= u)) for u in first_units[1:]), len(nodes)]


def equal_layers(p: int) -> list[int]:
    blocks = np.array_split(np.arange(1, config.n_layer + 1), p)
    return bounds_at_units([0, *(int(chunk[0]) for chunk in blocks[1:])])


def parameter_split(p: int) -> list[int]:
    """Contiguous layer units, minimising the largest stage's parameter count (exact DP)."""
    k = len(params)
    prefix = np.concatenate([[0.0], np.cumsum(params)])
    best = {(0, 0): (0.0, [])}
    for s in range(1, p + 1):
        for j in range(s, k + 1):
            options = [(max(best[(s - 1, i)][0], prefix[j] - prefix[i]), best[(s - 1, i)][1] + [i])
                       for i in range(s - 1, j) if (s - 1, i) in best]
            best[(s, j)] = min(options)
    return bounds_at_units(best[(p, k)][1])


def stage_times(bounds: list[int]) -> np.ndarray:
    last = costs.last_stage_compute if costs.last_stage_compute is not None else costs.compute
    inner = [costs.compute[a:b].sum() + send[b] for a, b in zip(bounds[:-2], bounds[1:-1])]
    return np.array([*inner, last[bounds[-2]:].sum()])


splits = {p: {"varuna_fx": list(pipes[p].plan.bounds), "equal layers": equal_layers(p),
              "parameter count": parameter_split(p)} for p in pipes}
imbalance = {p: {name: stage_times(b).max() / stage_times(b).mean() for name, b in s.items()}
             for p, s in splits.items()}
# deterministic
for p, row in imbalance.items():
    print(f"P={p}: " + ", ".join(f"{name} {v:.3f}" for name, v in row.items()))

# %%
fig, ax = plt.subplots(figsize=(10, 4), layout="constrained")
width = 0.27
COLOURS = {"varuna_fx": "#0072B2", "equal layers": "#E69F00", "parameter count": "#009E73"}
for k, (name, colour) in enumerate(COLOURS.items()):
    ax.bar(np.array(list(pipes)) + (k - 1) * width, [imbalance[p][name] for p in pipes],
           width, label=name, color=colour)
ax.axhline(1.0, color="grey", lw=0.8)
ax.set_xlabel("pipeline stages P")
ax.set_ylabel("slowest stage / mean (1 = balanced)")
ax.set_title("GPT-2 (8 layers): balance of three ways to cut it")
ax.legend(frameon=False)
plt.show()

# %% [markdown]
# ## Stage by stage, and what crosses each cut
#
# At P = 4: each stage's estimated time under the three splits, and the bytes that cross each
# cut per micro-batch sample in varuna_fx's partition (`plan.stage_costs[s].boundary_bytes`).
# Cutting inside a block can send more than one tensor (e.g. the residual stream and an
# attention intermediate); the partitioner prices those bytes with the link bandwidth.

# %%
P = 4
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
for k, (name, bounds) in enumerate(splits[P].items()):
    left.bar(np.arange(P) + (k - 1) * width, stage_times(bounds) * 1e3, width, label=name,
             color=COLOURS[name])
left.set_xticks(range(P), [f"stage {s}" for s in range(P)])
left.set_ylabel("estimated ms per micro-batch")
left.set_title(f"P = {P}: stage times")
left.legend(frameon=False)
plan = pipes[P].plan
cut_bytes = [s.boundary_bytes / plan.micro_batch_size / 2**10 for s in plan.stage_costs[:-1]]
right.bar([f"{s}→{s + 1}" for s in range(P - 1)], cut_bytes, color="#0072B2")
right.set_ylabel("KiB per sample")
right.set_title("bytes crossing each cut (varuna_fx)")
plt.show()
print(plan)

# %% [markdown]
# The compiled pipeline trains the Hugging Face model with the same numbers as eager PyTorch:

# %%
pipe = pipes[P]
pipe.zero_grad()
loss = pipe.step(**example)
model.zero_grad()
eager = model(**example).loss
eager.backward()
print(f"pipeline loss {float(loss):.6f}, eager loss {eager.item():.6f}")
