"""docs/multi_node.md's recipes cannot rot (issue 44 item 7): every command the page shows is
read by the command's real parser, checked as the command checks it, and turned into the
torchrun invocation it would launch (parsed by torchrun's own parser), without starting
anything. The Slurm script's command too, its shell variables given example values."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from varuna_fx.launch.cli import _subcommand, build_parser, ranks_of_args, split_at_script
from varuna_fx.launch.elastic import parse_nnodes
from varuna_fx.launch.torchrun import Ranks, torchrun_setup
from varuna_fx.launch.train import ranks_of
from varuna_fx.train.checks import resolve

PAGE = Path(__file__).parents[2] / "docs" / "multi_node.md"
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
# what the batch script's shell would put in its command on a 2-machine allocation
SLURM = {"$SLURM_NNODES": "2", "$SLURM_JOB_ID": "1234", "$head": "node001"}


def page_commands() -> list[list[str]]:
    """Every ``varuna-fx`` command of the page's code blocks, as argv (after the program)."""
    found = []
    for _, body in FENCE.findall(PAGE.read_text()):
        for line in body.replace("\\\n", " ").splitlines():
            at = line.find("varuna-fx ")
            if at < 0 or line.lstrip().startswith("#"):
                continue
            for name, value in SLURM.items():
                line = line.replace(name, value)
            found.append(shlex.split(line[at:])[1:])
    return found


def torchrun_of(ranks: Ranks) -> Any:
    """torchrun's parsed arguments for these ranks (what start_ranks hands torchrun)."""
    from torch.distributed.run import parse_args

    flags, _ = torchrun_setup(ranks)
    return parse_args([*flags, "train.py"])


def ranks_of_command(argv: list[str], where: Path) -> Ranks:
    if argv[0] == "train":
        (where / "job.toml").write_text("steps = 10\n")
        cfg, _ = resolve(argv[1:])  # every check `varuna-fx train` makes before launching
        return ranks_of(cfg)
    words, _ = split_at_script(argv, _subcommand(build_parser(), "run"))
    return ranks_of_args(build_parser().parse_args(words))


def test_every_recipe_on_the_page_parses_and_makes_its_torchrun_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # which of this machine's interfaces holds --local-addr (`ip addr`): not these machines'
    monkeypatch.setattr("varuna_fx.launch.elastic.interface_of", lambda _: None)
    commands = page_commands()
    assert len(commands) >= 10, commands
    fixed_ranks: set[int] = set()
    kinds: set[str] = set()
    for argv in commands:
        ranks = ranks_of_command(argv, tmp_path)
        assert ranks.nproc in (0, 4), argv
        if ranks.in_place:  # varuna_fx's own launcher: the machines' range is checked
            kinds.add("in place")
            assert parse_nnodes(ranks.nnodes or "") == (1, 4)
            continue
        run = torchrun_of(ranks)
        assert run.nproc_per_node == "4"
        if ranks.elastic:
            kinds.add("elastic")
            assert (run.nnodes, run.rdzv_backend, run.rdzv_endpoint) == \
                ("1:4", "c10d", "10.0.0.1:29400")
            assert run.local_addr in ("10.0.0.1", "10.0.0.2")
        else:
            kinds.add("fixed")
            assert run.nnodes == "2", argv
            if run.rdzv_backend == "static":  # node ranks given, torchrun's master address
                fixed_ranks.add(run.node_rank)
                assert (run.master_addr, run.master_port) == ("10.0.0.1", 29500)
            else:  # c10d numbers the machines: one command for all (Slurm's srun)
                assert run.rdzv_endpoint in ("10.0.0.1:29400", "node001:29400")
    assert kinds == {"fixed", "elastic", "in place"}
    assert fixed_ranks == {0, 1}  # both machines of the fixed recipe


def test_the_slurm_script_runs_one_task_per_machine_with_a_shared_out() -> None:
    script = next(body for _, body in FENCE.findall(PAGE.read_text()) if "#SBATCH" in body)
    options = dict(re.findall(r"#SBATCH --([\w-]+)(?:=(\S+))?", script))
    assert options["ntasks-per-node"] == "1" and options["nodes"] == "2"
    assert options["signal"].startswith("TERM@")  # the command saves on SIGTERM
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--nproc 4" in srun and options["gpus-per-node"] == "4"
    assert "--out /nfs/" in srun and "node-rank" not in srun  # one command on every machine
