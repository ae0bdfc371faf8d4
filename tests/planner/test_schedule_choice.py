"""Issue 10: schedule="auto" -- the planner picks the schedule as well as P, D and b."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.planner import Analyzed, analyze, plan_for
from varuna_fx.schedule import schedule_names

GB = 32


@pytest.fixture(scope="module")
def gpt() -> Analyzed:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=128, vocab_size=2000))
    return analyze(model, (torch.zeros(4, 128, dtype=torch.long),))


def cluster(bandwidth: str, memory: str) -> vf.Cluster:
    return vf.Cluster(gpus=8, gpus_per_node=4, gpu_memory=memory, flops="1TFLOP/s",
                      inter_node_bandwidth=bandwidth)


# (link between nodes, memory per device, fixed P/D/b, what wins)
CASES = [
    ("1Gbit/s", "60MiB", {}, "varuna"),  # a slow link: Varuna's order
    ("100GB/s", "60MiB", {}, "-zb"),  # fast links: a split backward fills the bubbles
    ("100GB/s", "1GiB", {"stages": 4, "data_parallel": 2, "micro_batch_size": 1}, "varuna-zb"),
    # varuna-zb (the fastest above) holds 69 MiB on its largest stage here: memory rules it
    # out, and a schedule holding fewer micro-batches wins
    ("100GB/s", "65MiB", {"stages": 4, "data_parallel": 2, "micro_batch_size": 1}, "1f1b-zb"),
]


@pytest.mark.slow  # seven searches per case
@pytest.mark.parametrize(("bandwidth", "memory", "fixed", "winner"), CASES)
def test_auto_picks_the_fastest_schedule_that_fits(gpt: Analyzed, bandwidth: str, memory: str,
                                                   fixed: dict[str, int], winner: str) -> None:
    per_schedule = {}
    for name in schedule_names():
        try:
            best = plan_for(gpt, cluster(bandwidth, memory), global_batch_size=GB,
                            schedule=name, recompute=False, top=1, **fixed).best
        except vf.PlanError:
            continue  # nothing fits with this schedule
        per_schedule[name] = best
    fastest = min(per_schedule, key=lambda n: per_schedule[n].step_time
                  / per_schedule[n].samples)
    auto = plan_for(gpt, cluster(bandwidth, memory), global_batch_size=GB, schedule="auto",
                    recompute=False, top=3, **fixed)
    best = auto.best
    assert best.schedule == fastest and winner in fastest
    assert best.step_time == pytest.approx(per_schedule[fastest].step_time, rel=1e-9)
    assert (best.stages, best.data_parallel, best.micro_batch_size) == (
        per_schedule[fastest].stages, per_schedule[fastest].data_parallel,
        per_schedule[fastest].micro_batch_size)
    assert max(best.memory) <= cluster(bandwidth, memory).gpu_memory
    assert auto.alternatives[0].schedule == fastest and auto.alternatives[0].chosen
    if fixed.get("stages") == 4 and memory == "65MiB":
        # the memory model, not the clock, ruled varuna-zb out
        roomy = plan_for(gpt, cluster(bandwidth, "1GiB"), global_batch_size=GB,
                         schedule="varuna-zb", recompute=False, top=1, **fixed).best
        assert roomy.step_time < best.step_time and max(roomy.memory) > 65 * 2**20


@pytest.mark.slow  # compiles and runs a pipeline
def test_compiled_auto_pipeline_runs_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=8))
    tokens = torch.randint(0, 64, (8, 8))
    lm_loss(model(tokens), tokens).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2,
                      schedule="auto", recompute=False)
    assert pipe.plan.schedule.name in schedule_names()
    assert f"schedule {pipe.plan.schedule.name}" in str(pipe.plan)
    pipe.step(tokens, target=tokens)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=lambda m, n=n: f"{n}: {m}")


def test_an_unknown_schedule_lists_auto_among_the_choices() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(vf.VarunaFxError, match=r"schedule='zigzag' is unknown.*'auto'"):
        vf.compile(model, example_inputs=(torch.zeros(2, 4),), schedule="zigzag")


def test_one_stage_is_not_weighed_once_per_schedule() -> None:
    """On one device every schedule runs the micro-batches in order: auto must not list the
    same configuration once per schedule name, and the table shows no schedule for P=1."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=8))
    tokens = torch.randint(0, 64, (8, 8))
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, global_batch_size=8,
                      schedule="auto")
    rows = pipe.plan.alternatives
    assert pipe.plan.stages == 1 and rows
    configs = [(r.stages, r.data_parallel, r.micro_batch_size) for r in rows]
    assert len(configs) == len(set(configs)), configs
    table = str(pipe.plan)
    assert not any(name in line for line in table.splitlines()[-12:]
                   for name in ("1f1b", "gpipe", "-zb"))
