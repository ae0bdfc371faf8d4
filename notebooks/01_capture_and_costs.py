# %% [markdown]
# # 01 · Capture and costs
#
# `vf.compile` starts by tracing the model into a torch.fx graph and annotating every node with
# what it costs. Sizes are **symbolic in the micro-batch size `b`**: each node's FLOPs and bytes
# are `const + per_sample * b`, kept as sympy expressions, so the planner can price any
# micro-batch size without tracing again. Everything here runs on a laptop CPU in seconds.

# %%
import matplotlib.pyplot as plt
import sympy

import varuna_fx as vf
from varuna_fx.examples import demo_gpt, lm_loss
from varuna_fx.ir.nodes import ZERO, info
from varuna_fx.planner import analyze

model, tokens, targets = demo_gpt(n_layer=2)
graph = analyze(model, (tokens,))  # capture + annotate, exactly as compile does; no stages yet
nodes = [n for n in graph.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
print(f"traced with {graph.tracer}: {len(nodes)} operations, example batch {tokens.shape[0]}")

# %% [markdown]
# ## The graph, node by node
#
# The first operations of the graph with the module they come from, their symbolic output shape
# and their forward+backward FLOPs and output bytes as expressions in `b`.

# %%
# deterministic
for n in [n for n in nodes if info(n).module_path][:14]:
    meta = info(n)
    shape = meta.outputs[0].shape if meta.outputs else "-"
    print(f"{n.name:14s} {meta.module_path or '-':18s} {str(shape):16s} "
          f"FLOPs {str(meta.flops.expr):14s} bytes {meta.out_bytes.expr}")

# %% [markdown]
# Summing the annotations gives the whole model's cost per micro-batch as a function of `b`:

# %%
# deterministic
total_flops = sum((info(n).flops for n in nodes), start=ZERO)
activations = sum((info(n).out_bytes for n in nodes), start=ZERO)
print("forward + backward FLOPs:", sympy.N(total_flops.expr, 4))
print("bytes of all activations:", sympy.N(activations.expr, 4))
print("at b = 8:", f"{total_flops(8) / 1e9:.2f} GFLOP, {activations(8) / 2**20:.1f} MiB")

# %% [markdown]
# ## Where the FLOPs and the bytes are
#
# Per module (nodes grouped by the module they came from) at `b = 1`: the attention and MLP
# matrix multiplies dominate the FLOPs, while softmax, GELU and the attention scores produce a
# large share of the bytes for few FLOPs. That difference is why the partitioner balances
# *time* and checks *memory* separately.

# %%
groups: dict[str, list[float]] = {}
for n in nodes:
    path = info(n).module_path or "(top)"
    key = ".".join(path.split(".")[:3]) if path.startswith("h.") else path
    flops, nbytes = groups.setdefault(key, [0.0, 0.0])
    groups[key] = [flops + info(n).flops(1), nbytes + info(n).out_bytes(1)]
names = list(groups)
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True, layout="constrained")
axes[0].barh(names, [groups[k][0] / 1e6 for k in names], color="#0072B2")
axes[0].set_xlabel("forward + backward MFLOP per sample")
axes[1].barh(names, [groups[k][1] / 2**10 for k in names], color="#E69F00")
axes[1].set_xlabel("output KiB per sample")
axes[0].invert_yaxis()
fig.suptitle("demo GPT (2 layers): cost of each module at b = 1")
plt.show()

# %% [markdown]
# ## From the annotated graph to stages
#
# `vf.compile` cuts the graph where the stages' times balance and generates one readable module
# per stage. Its header lists the passes that made it; every operation carries a comment with
# its module, source line, symbolic shape and FLOPs.

# %%
pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)
print(pipe.plan)
print(pipe.stages[1].code[:1800])

# %% [markdown]
# ## A training step equals eager PyTorch
#
# The pipeline splits the batch into micro-batches and runs the schedule with recomputation;
# the loss and every gradient equal eager `loss.backward()` on the whole batch.

# %%
pipe.zero_grad()
loss = pipe.step(tokens, target=targets)
grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
model.zero_grad()
eager = lm_loss(model(tokens), targets)
eager.backward()
print(f"pipeline loss {float(loss):.6f}, eager loss {eager.item():.6f}")
print("largest gradient difference:",
      max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()))
