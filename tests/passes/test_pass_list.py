"""The pass list as data (names, checks, dumps, the stage header's provenance; configure a step
of it; the eval-mode recompile running it too) and pipelines that stay independent of each
other when compiled from one cached graph."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import varuna_fx as vf
import varuna_fx.codegen.modes as modes
import varuna_fx.codegen.pass_list as pass_list
from varuna_fx.api import PASSES
from varuna_fx.codegen.pass_list import CONFIGURE, PASS_LIST
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.ir.nodes import copy_graph_module, info
from varuna_fx.passes.assign_stages import compute_nodes
from varuna_fx.passes.check import InvariantError, check_graph
from varuna_fx.schedule import with_micro_batches
from varuna_fx.schedule.placement import Placement


def small_gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=8))
    return model, torch.randint(0, 64, (8, 8))


def test_pass_list_names_every_pass_in_order() -> None:
    assert [p.name for p in PASSES] == [
        "capture", "annotate_shapes", "specialize_sizes", "annotate_backward", "mark_replicable",
        "mark_sample_mixing",
        "assign_stages", "split_stages", "codegen"]
    assert all(p.guarantees for p in PASSES)


def test_configure_is_a_step_of_the_one_list_neither_numbered_nor_dumped() -> None:
    names = [p.name for p in PASS_LIST]
    assert names[names.index("mark_sample_mixing") + 1] == "configure"
    assert names[names.index("configure") + 1] == "assign_stages"
    assert [p for p in PASS_LIST if not p.graph] == [CONFIGURE] and CONFIGURE.guarantees
    assert PASSES == tuple(p for p in PASS_LIST if p is not CONFIGURE)


class ModeDependent(nn.Module):
    """Eval mode centres the hidden batch: another graph, and one that mixes samples."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.training:
            h = h - h.mean(0)
        return self.c(torch.relu(self.b(h)))


def test_eval_mode_recompile_runs_the_list_with_its_one_substitution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = ModeDependent(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4,
                      loss_fn=lambda out, target: out.pow(2).mean(), dump=str(tmp_path))
    checked: list[str] = []

    def spy(module: object, name: str) -> None:
        original = getattr(module, name)

        def checker(*args: object) -> None:
            checked.append(name)
            original(*args)
        monkeypatch.setattr(module, name, checker)

    spy(modes, "check_assignment")
    spy(pass_list, "check_split")
    pipe.eval()
    with torch.no_grad():
        out = pipe(x)
    torch.testing.assert_close(out, copy.deepcopy(model).eval()(x))
    served = pipe.other_modes[modes.module_modes(model)]
    assert served is not None
    _, stages = served
    # the same list: no configure, the partition replaced by the holders of the parameters
    names = ["assign_by_holders" if p.name == "assign_stages" else p.name for p in PASSES]
    assert f"(passes: {', '.join(names)})" in stages[0].code.splitlines()[0]
    assert checked == ["check_assignment", "check_split"]  # its checkers ran
    assert any(info(n).mixes_samples for s in stages for n in s.module.graph.nodes)
    dumped = sorted(f.stem for f in (tmp_path / "eval").glob("*.py"))
    assert dumped == [f"{k + 1:02d}_{n}" for k, n in enumerate(names)]
    assert len(list(tmp_path.glob("*.py"))) == len(PASSES)  # compile's own dumps beside


@pytest.fixture(scope="module")
def two_stages() -> vf.Pipeline:
    """One small GPT at P=2 for the tests that only read it (a compile each costs ~0.4 s)."""
    model, tokens = small_gpt()
    return vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)


def test_stage_header_names_the_pass_list(two_stages: vf.Pipeline) -> None:
    pipe = two_stages
    header = pipe.stages[0].code.splitlines()[0]
    assert f"(passes: {', '.join(p.name for p in PASSES)})" in header


@pytest.mark.slow  # front passes afresh plus a file per pass
@pytest.mark.parametrize("how", ["env", "option"])
def test_dump_writes_every_pass_with_its_provenance(how: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokens = small_gpt()
    target = tmp_path / "dump"
    if how == "env":
        monkeypatch.setenv("VARUNA_FX_DUMP", str(target))
        pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)
    else:
        pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2,
                          dump=str(target))
    files = sorted(target.glob("*.py"))
    assert [f.stem for f in files] == [f"{k + 1:02d}_{p.name}" for k, p in enumerate(PASSES)]
    shapes = (target / "02_annotate_shapes.py").read_text()
    assert "1. capture:" in shapes and "2. annotate_shapes:" in shapes
    assert "3. specialize_sizes" not in shapes  # provenance: only the passes run so far
    assert "f32[b, 8, 32]" in shapes  # annotations are in the dumped code
    number = {p.name: k + 1 for k, p in enumerate(PASSES)}
    assigned = (target / f"{number['assign_stages']:02d}_assign_stages.py").read_text()
    assert "stage 0" in assigned and "stage 1" in assigned
    split = (target / f"{number['split_stages']:02d}_split_stages.py").read_text()
    assert "# ---- stage 0 ----" in split and "# ---- stage 1 ----" in split
    compile(assigned, "dump", "exec")  # readable code: at least valid Python
    assert len(pipe.stages) == 2


def test_checker_rejects_shared_annotations(two_stages: vf.Pipeline) -> None:
    gm = copy_graph_module(two_stages.captured.gm)
    check_graph(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[1].meta["varuna"] = nodes[0].meta["varuna"]
    with pytest.raises(InvariantError, match="share one NodeInfo"):
        check_graph(gm)


def test_a_later_compile_leaves_an_earlier_pipeline_unchanged() -> None:
    model, tokens = small_gpt()
    eager = copy.deepcopy(model)
    two = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)
    before = [[(n.name, info(n).stage) for n in s.module.graph.nodes] for s in two.stages]
    cached = [(n.name, n.meta["varuna"].stage) for n in two.captured.gm.graph.nodes
              if "varuna" in n.meta]
    four = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=4)
    assert four.captured is two.captured  # one cached graph...
    after = [[(n.name, info(n).stage) for n in s.module.graph.nodes] for s in two.stages]
    assert after == before  # ...and the P=4 compile did not re-stage P=2's nodes
    assert [(n.name, n.meta["varuna"].stage) for n in two.captured.gm.graph.nodes
            if "varuna" in n.meta] == cached
    assert {info(n).stage for s in two.stages for n in s.module.graph.nodes} <= {0, 1, None}
    assert {info(n).stage for s in four.stages for n in s.module.graph.nodes} >= {2, 3}

    # and the earlier pipeline still computes eager's loss and gradients
    eager_loss = lm_loss(eager(tokens), tokens)
    eager_loss.backward()
    two.zero_grad()
    loss = two.step(tokens, target=tokens)
    torch.testing.assert_close(torch.as_tensor(loss), eager_loss.detach())
    grads = dict(eager.named_parameters())
    for name, p in two.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # one more compile; the fast tier checks isolation in the test above
def test_profiling_chunks_do_not_touch_the_cached_graph() -> None:
    from varuna_fx.planner.measure import _build_chunks  # the profiler's splitter

    model, tokens = small_gpt()
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)
    gm = pipe.captured.gm
    stages = {n.name: n.meta["varuna"].stage for n in gm.graph.nodes if "varuna" in n.meta}
    count = len(compute_nodes(gm))
    chunks = _build_chunks(gm, [0, count // 2, count])
    assert len(chunks) == 2
    assert {n.name: n.meta["varuna"].stage for n in gm.graph.nodes if "varuna" in n.meta} \
        == stages


def test_plan_carries_what_was_decided() -> None:
    """The schedule object that was simulated, the bounds assign_stages made, the placement and
    a recompute flag per stage -- and the runtime runs exactly those."""
    model, tokens = small_gpt()
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=3,
                      schedule="1f1b", recompute=False)
    plan = pipe.plan
    assert plan.schedule.name == "1f1b" and plan.schedule.num_stages == 3
    assert plan.schedule.num_micro_batches == plan.num_micro_batches
    assert repr(plan.schedule) == f"Schedule('1f1b', P=3, m={plan.num_micro_batches}, " \
        "recompute=False)"
    assert plan.recompute == (False, False, False)
    assert plan.placement == Placement(3, 1)
    bounds = plan.bounds
    assert len(bounds) == 4 and bounds[0] == 0 and list(bounds) == sorted(set(bounds))
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [s.nodes for s in plan.stage_costs]
    assert with_micro_batches(plan.schedule, plan.num_micro_batches) is plan.schedule
    assert [w.recompute for w in pipe.runtime.workers] == [False, False, False]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages = 4  # type: ignore[misc]

    again = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=3,
                       recompute=True)
    # the last stage never recomputes, whatever the flag says, and the plan says so
    assert again.plan.recompute == (True, True, False)
    assert [w.recompute for w in again.runtime.workers] == [True, True, False]
