# %% [markdown]
# # 04 · Planning for a cluster you describe
#
# The planner needs no cluster to plan for one: describe the devices, their memory and the
# links, and it searches stages P x replicas D x micro-batch size, simulating the best
# candidates. Here a 12-layer GPT (~10 M parameters) on 16 devices, 4 per machine, with a
# global batch of 64, swept over the link between machines and the memory per device.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import LogNorm

import varuna_fx as vf
from varuna_fx.errors import PlanError
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.planner import analyze, plan_for

torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=12, n_embd=256, n_head=8, vocab_size=4000, block_size=128))
tokens = torch.randint(0, 4000, (1, 128))
graph = analyze(model, (tokens,))  # captured once; every plan below reuses it
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

# %%
bandwidths = ["1Gbit/s", "10Gbit/s", "25Gbit/s", "100Gbit/s"]
memories = ["128MiB", "192MiB", "256MiB", "512MiB", "2GiB"]
chosen = {}
for bw in bandwidths:
    for mem in memories:
        cluster = vf.Cluster(gpus=16, gpus_per_node=4, gpu_memory=mem, device_type="a100",
                             inter_node_bandwidth=bw)
        try:
            best = plan_for(graph, cluster, global_batch_size=64, top=1).best
            chosen[bw, mem] = (best.stages, best.data_parallel, best.micro_batch_size,
                               best.step_time)
        except PlanError:
            chosen[bw, mem] = None  # nothing fits in that memory
# deterministic
for (bw, mem), c in chosen.items():
    print(f"{bw:>9s} {mem:>7s}: " + ("nothing fits" if c is None else
                                      f"P={c[0]} x D={c[1]}, micro-batch {c[2]}, "
                                      f"step {c[3] * 1e3:.2f} ms"))

# %% [markdown]
# ## The choice as a map
#
# Colour: predicted step time (log scale, darker is slower); label: the chosen P x D. Where
# P x D is at most 4 the job stays inside one machine and the other 12 devices idle: crossing
# the link between machines would cost more than they add. Fast links make deep pipelines
# across machines pay; little memory forces the model over more stages.

# %%
grid = np.full((len(bandwidths), len(memories)), np.nan)
for i, bw in enumerate(bandwidths):
    for j, mem in enumerate(memories):
        if chosen[bw, mem] is not None:
            grid[i, j] = chosen[bw, mem][3] * 1e3
fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
image = ax.imshow(grid, cmap="viridis_r", aspect="auto", norm=LogNorm())
for i, bw in enumerate(bandwidths):
    for j, mem in enumerate(memories):
        c = chosen[bw, mem]
        text = "none fits" if c is None else f"{c[0]} x {c[1]}\n{c[3] * 1e3:.1f} ms"
        ax.text(j, i, text, ha="center", va="center", fontsize=9,
                color="black" if c is None or grid[i, j] < np.sqrt(np.nanmin(grid) * np.nanmax(grid))
                else "white")
ax.set_xticks(range(len(memories)), memories)
ax.set_yticks(range(len(bandwidths)), bandwidths)
ax.set_xlabel("memory per device")
ax.set_ylabel("bandwidth between machines")
ax.set_title("chosen P x D and predicted step time (16 x A100-class, 4 per machine, batch 64)")
fig.colorbar(image, ax=ax, label="predicted step (ms)")
plt.show()

# %% [markdown]
# The same search from the command line, for one cell:
#
# ```
# varuna-fx plan --gpus 16 --gpus-per-node 4 --gpu-memory 256MiB --inter-node-bandwidth 10Gbit/s \
#                --device-type a100 --global-batch-size 64 --model mypkg.models:make
# ```
#
# `vf.compile(model, cluster=cluster, ...)` makes the same choice when the job runs.

# %%
throughput = {k: 64 / c[3] for k, c in chosen.items() if c is not None}
fastest = max(throughput, key=throughput.get)
print(f"fastest: {fastest}: {throughput[fastest]:,.0f} samples/s; "
      f"{sum(c is None for c in chosen.values())} of {len(chosen)} cells fit nothing; "
      f"ln(step) spread {math.log(max(throughput.values()) / min(throughput.values())):.2f}")
