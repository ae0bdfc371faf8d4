"""``varuna-fx run``'s flags and ``varuna-fx train``'s ``[launch]`` keys come from one
declaration (world/launch_options.py): the same names, the same help."""

from __future__ import annotations

import argparse

from varuna_fx.launch.cli import _subcommand, build_parser
from varuna_fx.launch.torchrun import Ranks
from varuna_fx.train.config import FIELDS
from varuna_fx.world.launch_options import LAUNCH_OPTIONS


def test_run_flags_and_train_launch_keys_are_the_declared_options_with_their_help() -> None:
    run = _subcommand(build_parser(), "run")
    flags = {a.option_strings[0]: a.help for a in run._actions
             if a.option_strings and not isinstance(a, argparse._HelpAction)}
    assert flags == {o.flag: o.help for o in LAUNCH_OPTIONS if o.run}
    launch = {n: f.metadata["help"] for n, f in FIELDS.items()
              if f.metadata["group"] == "launch"}
    assert launch == {o.name: o.help for o in LAUNCH_OPTIONS if o.train}
    assert {FIELDS[o.name].default for o in LAUNCH_OPTIONS if o.train} == \
        {o.default for o in LAUNCH_OPTIONS if o.train}
    ranks = set(Ranks.__dataclass_fields__)  # the launcher takes the same names
    assert {o.name for o in LAUNCH_OPTIONS} - {"torchrun_args"} <= ranks


def test_docs_launch_table_says_what_the_declaration_says() -> None:
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `[^`]*` \| (.*) \|$", docs, re.M))
    for option in LAUNCH_OPTIONS:
        if option.train:
            assert rows[option.name] == option.help, option.name


def test_ranks_are_built_from_the_options_by_name() -> None:
    import dataclasses

    from varuna_fx.train.config import TrainConfig

    cfg = TrainConfig(elastic=True, nnodes="1:3", torchrun_args="")
    ranks = Ranks.of(dataclasses.asdict(cfg))
    assert ranks == Ranks(nproc=2, elastic=True, nnodes="1:3")  # "" and auto: the defaults
    parsed = _subcommand(build_parser(), "run").parse_args(
        ["--nproc", "3", "--torchrun-args=--nnodes=2 --node-rank=1", "x.py"])
    assert Ranks.of(vars(parsed)) == Ranks(nproc=3, flags=("--nnodes=2", "--node-rank=1"))
