"""The command line: help everywhere, plain unwrapped output in logs, JSON, stage files, the
note on idle devices, and the demo's first loss."""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
from pathlib import Path

import pytest
import torch

from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.launch.cli import _SCHEDULE_HELP, build_parser, main
from varuna_fx.schedule import schedule_names


def tiny() -> tuple[GPT, tuple[torch.Tensor]]:
    """The factory the tests pass as --model test_cli:tiny (pytest puts this file's folder on sys.path)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    return model, (torch.randint(0, 64, (4, 8)),)


def stage_sources(out: str) -> list[str]:
    """Each stage's code as printed: from its '# Stage i of P' header to the next one."""
    starts = [m.start() for m in re.finditer(r"^# Stage \d+ of \d+", out, re.M)]
    return [out[a:b] for a, b in zip(starts, [*starts[1:], len(out)])]


def test_every_subcommand_and_option_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helped = {choice.dest: choice.help for choice in sub._choices_actions}
    assert set(helped) == {"demo", "inspect", "plan", "run", "train", "report"} and \
        all(helped.values())
    for name, command in sub.choices.items():
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_inspect_output_in_a_log_is_unwrapped_and_its_code_is_valid_python(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "test_cli:tiny", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    # whole table headers (an 80-column console cut them to "paramet…")
    assert "parameters" in out and "activations/mb" in out and "…" not in out
    sources = stage_sources(out)
    assert len(sources) == 2
    for source in sources:
        ast.parse(source)  # copied from a log, it still compiles


@pytest.mark.slow  # inspects again; the fast tier checks the text output
def test_inspect_json_and_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "test_cli:tiny", "--stages", "2", "--json",
                 "--out", str(tmp_path / "code")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stages"] == 2 and len(result["stage_costs"]) == 2
    assert [s["index"] for s in result["stage_code"]] == [0, 1]
    assert result["predicted_step_time"] > 0
    for stage in result["stage_code"]:
        path = tmp_path / "code" / f"stage{stage['index']}.py"
        assert path.read_text() == stage["code"]
        ast.parse(path.read_text())
    assert result["written"] == [str(tmp_path / "code" / f"stage{i}.py") for i in (0, 1)]


@pytest.mark.slow  # plans a model afresh
def test_plan_says_when_the_global_batch_limits_data_parallelism(
        capsys: pytest.CaptureFixture[str]) -> None:
    # slow devices, so that every replica pays for itself and only the batch limits D
    args = ["plan", "--model", "test_cli:tiny", "--gpus", "16", "--gpus-per-node", "8",
            "--flops", "1GFLOP/s", "--global-batch-size", "4", "--stages", "1", "--top", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "uses 4 of 16 devices" in out and "--global-batch-size" in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["choice"]["devices_used"] == 4 == result["choice"]["global_batch_size"]
    assert "at most 4 replicas" in result["note"]
    assert len(result["alternatives"]) == 2 and len(result["stages"]) == 1
    # a batch that lets every device work: no note
    assert main([*args[:-4], "--global-batch-size", "16", "--stages", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["note"] is None


def test_plan_with_schedule_auto_names_the_chosen_schedule(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "test_cli:tiny", "--gpus", "4", "--gpus-per-node", "2",
            "--global-batch-size", "8", "--stages", "2", "--schedule", "auto", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["choice"]["schedule"] in schedule_names()
    assert result["alternatives"][0]["schedule"] == result["choice"]["schedule"]
    assert "auto" in _SCHEDULE_HELP


def test_plan_takes_a_schedule_of_several_stages_per_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Its help listed zbv, and until issue 27 the command refused it: planned as compile
    plans it, two stages on each of the 4 devices of one replica."""
    args = ["plan", "--model", "test_cli:tiny", "--gpus", "4", "--gpus-per-node", "2",
            "--global-batch-size", "8", "--schedule", "zbv", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    choice = result["choice"]
    assert (choice["schedule"], choice["stages"], choice["data_parallel"]) == ("zbv", 8, 1)
    assert choice["devices_used"] == 4 and result["note"] is None
    assert [a["schedule"] for a in result["alternatives"]] == ["zbv"]
    assert len(result["stages"]) == 8 and choice["predicted_step_time"] > 0
    assert main([*args[:-1], "--stages", "3"]) == 1
    assert "a multiple of 2" in capsys.readouterr().err


@pytest.mark.slow  # plans a model afresh
def test_plan_says_when_more_replicas_are_predicted_slower(
        capsys: pytest.CaptureFixture[str]) -> None:
    # fast devices and a tiny model: the all-reduce costs more than a replica adds
    assert main(["plan", "--model", "test_cli:tiny", "--gpus", "16", "--gpus-per-node", "8",
                 "--global-batch-size", "4", "--stages", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    chosen = result["choice"]["samples_per_second"]
    assert result["choice"]["devices_used"] < 4
    wider = re.search(r"P=1 x D=4 is predicted at ([\d.]+)(\w?) samples/s", result["note"])
    assert wider is not None
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[wider.group(2)]
    assert float(wider.group(1)) * scale < chosen


def test_a_user_error_prints_what_to_change_without_a_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "test_cli:tiny", "--gpus", "8", "--global-batch-size", "6",
                 "--data-parallel", "4"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    # it names the command's options, not compile()'s keyword arguments
    assert "--global-batch-size=6" in err and "--data-parallel=4" in err
    assert "global_batch_size" not in err and "data_parallel=" not in err


def test_planner_messages_name_the_command_line_options() -> None:
    from varuna_fx.launch.plan_command import as_options

    assert as_options("fixed stages=3, micro_batch_size=2; try recompute=True") == (
        "fixed --stages=3, --micro-batch-size=2; try --recompute true")
    assert as_options("stages_per_rank=2 with shard_optimizer=False") == (
        "--stages-per-rank=2 with --shard-optimizer false")
    assert as_options("num_stages=3 stays") == "num_stages=3 stays"


@pytest.mark.slow  # compiles the 1000-token demo GPT and runs a step (~5 s)
def test_demo_first_loss_is_about_ln_vocab(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layers", "2", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    loss = float(re.search(r"loss (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    assert abs(loss - math.log(1000)) < 0.1
    ast.parse(stage_sources(out)[0].split("\none training step")[0])


def test_str_of_a_plan_is_the_table_even_inside_jupyter(monkeypatch: pytest.MonkeyPatch) -> None:
    import rich.console

    import varuna_fx as vf
    from varuna_fx.examples import lm_loss

    model, (tokens,) = tiny()
    plan = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2).plan
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)  # as in a notebook kernel
    assert "balance max/mean" in str(plan) and "activations/mb" in str(plan)


def launches(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """What ``varuna-fx run`` hands torchrun, as torchrun's own parser read it: its ``run`` is
    replaced, its parser is not."""
    import torch.distributed.run

    calls: list[argparse.Namespace] = []
    monkeypatch.setattr(torch.distributed.run, "run", calls.append)
    return calls


def script_argv(parsed: argparse.Namespace) -> list[str]:
    return [parsed.training_script, *parsed.training_script_args]


@pytest.mark.parametrize("given", [
    ["--torchrun-args=--nnodes=2 --node-rank=1 --rdzv-endpoint=h:29400"],
    ["--torchrun-args", "--nnodes=2 --node-rank=1 --rdzv-endpoint=h:29400"],
    ["--torchrun-args", "--nnodes=2", "--torchrun-args", "--node-rank=1",
     "--torchrun-args=--rdzv-endpoint=h:29400"],
], ids=["equals", "quoted", "repeated"])
def test_run_passes_torchrun_flags_through(given: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls = launches(monkeypatch)
    assert main(["run", "--nproc", "4", *given, "train.py", "--lr", "1e-3"]) == 0
    parsed = calls[0]
    # multi-node flags: no loopback standalone rendezvous added
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint) == ("2", 1, "h:29400")
    assert not parsed.standalone and parsed.nproc_per_node == "4"
    assert script_argv(parsed) == ["train.py", "--lr", "1e-3"]
    # after the script, the same words are the script's own
    calls.clear()
    assert main(["run", "--nproc", "2", "x.py", "--torchrun-args", "--y"]) == 0
    assert script_argv(calls[0]) == ["x.py", "--torchrun-args", "--y"]
    assert calls[0].rdzv_endpoint == "127.0.0.1:0"  # one machine: the loopback rendezvous


# each would be read as an abbreviation of one of torchrun's options (--log-dir, --node-rank,
# --max-restarts, --monitor-interval) or of run's own (--nproc, --max-restarts, --elastic)
SCRIPT_FLAGS = ["--log", "ref.jsonl", "--node", "3", "--max", "5", "--monitor", "--np", "2",
                "--el", "--nproc", "7", "--standalone", "--", "-h", "--help", "--torchrun-args",
                "x", "--rdzv-endpoint=far:1"]


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.parametrize("dashes", [[], ["--"]], ids=["script", "dashdash-script"])
def test_run_passes_every_argument_after_the_script_untouched(
        elastic: bool, dashes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Until issue 28, `varuna-fx run --nproc 4 train.py --log ref.jsonl` printed torchrun's
    usage and "ambiguous option: --log could match --log-dir, ..." (also --node, --max,
    --monitor), and `--` did not help."""
    calls = launches(monkeypatch)
    ours = ["--elastic", "--max-restarts", "3"] if elastic else []
    assert main(["run", "--nproc", "2", *ours, *dashes, "train.py", *SCRIPT_FLAGS]) == 0
    parsed = calls[0]
    assert parsed.training_script == "train.py"
    assert parsed.training_script_args == SCRIPT_FLAGS
    assert parsed.nproc_per_node == "2"  # the script's --nproc 7 is not ours
    assert parsed.nnodes == ("1:1" if elastic else "1")
    assert parsed.max_restarts == (3 if elastic else 0)  # nor its --max 5
    assert parsed.log_dir is None and parsed.monitor_interval == 0.1  # nor --log, --monitor


def test_run_refuses_an_abbreviated_option_of_its_own(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the script nothing is guessed: `--np 4` is not `--nproc 4`."""
    calls = launches(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--nproc", "2", "--np", "4", "train.py"])
    assert exit_.value.code == 2 and not calls
    assert "unrecognized arguments: --np" in capsys.readouterr().err


def test_run_says_how_to_pass_several_torchrun_flags(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = launches(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--nproc", "2", "--torchrun-args", "--nnodes=2", "--node-rank=0",
              "train.py"])
    assert exit_.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert "--node-rank=0" in err and '--torchrun-args="--nnodes=2 --node-rank=0"' in err
