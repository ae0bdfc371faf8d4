"""``varuna-fx plan`` takes what ``vf.compile`` takes and makes compile's choice with it; its
tables show every stage and say what a launched run does with the optimizer (issue 28)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from test_cli import tiny

import varuna_fx as vf
from tiers import tiered
from varuna_fx.examples import lm_loss
from varuna_fx.launch.cli import main
from varuna_fx.planner.plan import optimizer_note

# small devices, so that the tiny model is cut into stages (P = 4 with the defaults)
CLUSTER = {"gpus": 4, "gpus_per_node": 2, "gpu_memory": "400KiB", "flops": "100GFLOP/s"}
BATCH = 8
FAST_LINKS = {"gpus_per_node": 4, "flops": "10TFLOP/s", "intra_node_bandwidth": "1000GB/s"}
TIGHT = {"gpu_memory": "300KiB", "flops": "1GFLOP/s"}
# where only sharded optimizer state fits D=2 (the price of sharding includes the parameters'
# all-gather since issue 31, so at 300KiB an unsharded configuration that fits is faster)
TIGHTER = {"gpu_memory": "260KiB", "flops": "1GFLOP/s"}

# (command-line options, the same as compile's keywords, the cluster's differences)
CASES: dict[str, tuple[list[str], dict[str, Any], dict[str, str]]] = {
    "defaults": ([], {}, {}),
    "zbv": (["--schedule", "zbv"], {"schedule": "zbv", "stages_per_rank": None}, {}),
    "interleaved, 2 per rank, P=4": (
        ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--stages", "4"],
        {"schedule": "interleaved-1f1b", "stages_per_rank": 2, "stages": 4}, {}),
    "auto weighs virtual stages, keeps one per rank": (
        ["--stages-per-rank", "auto"], {"stages_per_rank": None}, {}),
    "auto weighs virtual stages, picks zbv": (
        ["--stages-per-rank", "auto"], {"stages_per_rank": None}, FAST_LINKS),
    "auto shards the optimizer to fit": ([], {}, TIGHTER),
    "sharded, recompute, bf16, D=2": (
        ["--shard-optimizer", "true", "--recompute", "true", "--precision", "bf16",
         "--data-parallel", "2", "--schedule", "1f1b"],
        {"shard_optimizer": True, "recompute": True, "precision": "bf16", "data_parallel": 2,
         "schedule": "1f1b"}, {}),
    "no recompute, unsharded": (["--recompute", "false", "--shard-optimizer", "false"],
                                {"recompute": False, "shard_optimizer": False}, TIGHT),
}


def planned(capsys: pytest.CaptureFixture[str], cluster: dict[str, Any], *options: str
            ) -> dict[str, Any]:
    described = [w for key, value in cluster.items()
                 for w in (f"--{key.replace('_', '-')}", str(value))]
    args = ["plan", "--model", "test_cli:tiny", *described, "--global-batch-size", str(BATCH),
            *options, "--json"]
    assert main(args) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", tiered(list(CASES), fast=[
    "defaults", "zbv", "auto weighs virtual stages, picks zbv", "auto shards the optimizer to fit"]))
def test_plan_makes_the_choice_compile_makes_with_the_same_options(
        case: str, capsys: pytest.CaptureFixture[str]) -> None:
    options, keywords, differences = CASES[case]
    cluster = {**CLUSTER, **differences}
    result = planned(capsys, cluster, *options)
    model, (tokens,) = tiny()
    plan = vf.compile(model, vf.Cluster(**cluster), example_inputs=(tokens,), loss_fn=lm_loss,
                      global_batch_size=BATCH, **keywords).plan
    choice = result["choice"]
    assert (choice["stages"], choice["data_parallel"], choice["micro_batch_size"],
            choice["num_micro_batches"], choice["schedule"]) == (
        plan.stages, plan.data_parallel, plan.micro_batch_size, plan.num_micro_batches,
        plan.schedule.name)
    assert result["options"]["stages_per_rank"] == plan.stages_per_rank
    assert result["options"]["optimizer_state_priced_sharded"] == plan.shard_optimizer
    assert len(result["stages"]) == plan.stages  # every stage, virtual ones included
    assert result["options"]["optimizer"] == optimizer_note(
        keywords.get("shard_optimizer", "auto"), plan.data_parallel, plan.shard_optimizer)
    assert result["options"]["precision"] == keywords.get("precision", "fp32")
    if case.endswith("picks zbv"):
        assert plan.stages_per_rank == 2 and plan.schedule.name == "zbv"
    if case == "auto shards the optimizer to fit":
        assert plan.shard_optimizer and plan.data_parallel > 1
        assert "the plan needs it to fit" in result["options"]["optimizer"]


def test_plan_shows_every_stage_row(capsys: pytest.CaptureFixture[str]) -> None:
    """Until issue 28 a pipeline of more than 12 stages printed 7 of them, unmarked."""
    args = ["plan", "--model", "test_cli:tiny", "--gpus", "16", "--gpus-per-node", "8",
            "--stages", "16", "--data-parallel", "1", "--top", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = out.split("stages of the chosen configuration")[1]
    rows = [int(m.group(1)) for m in re.finditer(r"^│\s+(\d+) │", table, re.M)]
    assert rows == list(range(16))


def test_the_optimizer_note_says_what_a_launched_run_does() -> None:
    assert optimizer_note("auto", 1, False) is None  # one replica: nothing to shard
    auto = optimizer_note("auto", 4, False)
    assert auto is not None and "pipe.optimizer over the D=4 replicas" in auto
    assert "pipe.parameters() runs unsharded, as memory counts it" in auto
    needed = optimizer_note("auto", 4, True)
    assert needed is not None and "the plan needs it to fit" in needed
    assert "is refused" in needed and "1/D" in needed
    forced = optimizer_note(True, 2, True)
    assert forced is not None and "shard_optimizer=True" in forced and "is refused" in forced
    never = optimizer_note(False, 2, False)
    assert never is not None and "not sharded" in never and "all of it" in never


def test_the_plan_table_of_a_compiled_pipeline_carries_the_note() -> None:
    model, (tokens,) = tiny()
    plan = vf.compile(model, vf.Cluster(gpus=4, device="cpu"), example_inputs=(tokens,),
                      loss_fn=lm_loss, stages=2, data_parallel=2, shard_optimizer=False).plan
    assert plan.shard_optimizer_setting is False
    assert "not sharded (shard_optimizer=False)" in " ".join(str(plan).split())


@pytest.mark.parametrize("given, says", [
    (["--recompute", "maybe"], "choose auto, true or false"),
    (["--shard-optimizer", "yes"], "choose auto, true or false"),
    (["--stages-per-rank", "0"], "a positive number of stages, or auto"),
    (["--precision", "fp8"], "invalid choice"),
])
def test_plan_refuses_a_bad_option(given: list[str], says: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "test_cli:tiny", *given])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_plan_says_when_a_model_cannot_be_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "no_such_module_here:make"]) == 1
    err = capsys.readouterr().err
    assert "no module named 'no_such_module_here'" in err and "Traceback" not in err
    assert main(["plan", "--model", "test_cli:no_such_factory"]) == 1
    assert "has no function 'no_such_factory'" in capsys.readouterr().err


def test_a_virtual_stage_count_the_schedule_cannot_run_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "test_cli:tiny", "--gpus", "4",
                 "--stages-per-rank", "2", "--schedule", "1f1b"]) == 1
    err = capsys.readouterr().err
    assert "--stages-per-rank=2 needs a schedule that runs several stages per rank" in err
