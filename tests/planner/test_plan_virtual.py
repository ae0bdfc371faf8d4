"""``plan_for`` with a schedule of several stages per rank plans what ``vf.compile`` plans with
it (issue 27: ``varuna-fx plan --schedule zbv`` was refused)."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from varuna_fx.errors import PlanError
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.planner import analyze, plan_for


@pytest.mark.slow  # compiles 8 stages
@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b", "dualpipev"])
def test_plan_for_a_virtual_schedule_is_compiles_configuration(schedule: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    tokens = torch.randint(0, 64, (8, 8))
    cluster = vf.Cluster(gpus=4, gpus_per_node=2, device="cpu")
    result = plan_for(analyze(model, (tokens,)), cluster, schedule=schedule,
                      stages_per_rank=None)  # the schedule's own v, as compile is given
    best = result.best
    plan = vf.compile(model, cluster, example_inputs=(tokens,), schedule=schedule,
                      stages_per_rank=None).plan
    assert (best.stages, best.data_parallel, best.micro_batch_size, best.num_micro_batches,
            result.stages_per_rank) == (plan.stages, plan.data_parallel,
                                        plan.micro_batch_size, plan.num_micro_batches,
                                        plan.stages_per_rank) == (8, 1, 1, 8, 2)
    assert best.schedule == plan.schedule.name == schedule
    assert [a.schedule for a in result.alternatives] == [schedule]
    assert result.alternatives[0].chosen and best.step_time > 0
    with pytest.raises(PlanError, match="needs 8 devices, more than the 4"):
        plan_for(analyze(model, (tokens,)), cluster, schedule=schedule, stages=8,
                 data_parallel=2, global_batch_size=8, stages_per_rank=None)
