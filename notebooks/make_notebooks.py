"""Build and execute the notebooks in this folder (needs nbformat, nbclient, ipykernel).

    python notebooks/make_notebooks.py

The executed .ipynb files are committed; tests/test_notebooks.py re-runs their code cells in
CI without a Jupyter kernel, so they cannot rot.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent

EXPLORE = [
    ("md", "# Exploring partitions and schedules\n\nCompile the demo GPT at several pipeline "
           "depths, look at the plan and the generated stage code, then compare schedules with "
           "the simulator. Everything here runs on a laptop CPU."),
    ("code", "import torch\nimport varuna_fx as vf\nfrom varuna_fx.examples import demo_gpt, "
             "lm_loss\n\nmodel, tokens, targets = demo_gpt(n_layer=6)\n"
             "pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=3)\n"
             "print(pipe.plan)"),
    ("md", "Each stage is a module that runs on its own, and its source is readable: a header "
           "with the stage's totals and boundaries, and a comment per operation with the module, "
           "source line, symbolic shape (in the micro-batch size `b`) and FLOPs."),
    ("code", "print(pipe.stages[1].code[:2500])"),
    ("md", "## How balance changes with depth\n\n`plan.balance` is the slowest stage over the "
           "mean: 1.0 is perfect."),
    ("code", "for p in (1, 2, 3, 4, 6):\n"
             "    plan = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, "
             "stages=p).plan\n"
             "    print(f'P={p}: balance {plan.balance:.3f}, nodes per stage "
             "{[s.nodes for s in plan.stage_costs]}')"),
    ("md", "## A training step equals eager PyTorch\n\nThe pipeline splits the batch into "
           "micro-batches and runs the Varuna schedule with recomputation; loss and gradients "
           "are those of eager `loss.backward()` on the whole batch."),
    ("code", "pipe.zero_grad()\nloss = pipe.step(tokens, target=targets)\n"
             "grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}\n"
             "model.zero_grad()\neager = lm_loss(model(tokens), targets)\neager.backward()\n"
             "print(float(loss), eager.item())\n"
             "print(max((grads[n] - p.grad).abs().max().item() for n, p in "
             "model.named_parameters()))"),
    ("md", "## Schedules\n\nA schedule is data: one action list per stage (`1F3` = stage 1, "
           "forward, micro-batch 3). The simulator replays it with per-stage times."),
    ("code", "from varuna_fx.schedule import build_schedule, simulate, text_grid\n"
             "for name in ('gpipe', '1f1b', 'varuna'):\n"
             "    s = build_schedule(name, num_stages=4, num_micro_batches=8, recompute=True)\n"
             "    r = simulate(s, forward=[1.0] * 4, backward=[2.0] * 4)\n"
             "    print(f'{name:7s} step {r.step_time:5.1f}  bubble {r.bubble_fraction:.1%}  "
             "peak stash at stage 0: {r.peak_stash_count[0]}')\n"
             "print(text_grid(build_schedule('varuna', 4, 8, True)))"),
    ("code", "from varuna_fx.schedule import gantt\n"
             "fig = gantt(simulate(build_schedule('varuna', 4, 8, True), [1.0] * 4, [2.0] * 4), "
             "path='varuna_P4_m8.png', title='varuna, P=4, m=8')"),
    ("md", "![Gantt chart of the Varuna schedule](varuna_P4_m8.png)"),
]


def build(cells: list[tuple[str, str]], path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else
                nbformat.v4.new_code_cell(src) for kind, src in cells]
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, path)


if __name__ == "__main__":
    build(EXPLORE, HERE / "explore_partitions.ipynb")
    print("wrote", HERE / "explore_partitions.ipynb")
