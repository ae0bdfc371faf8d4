"""How ranks are launched, declared once: ``varuna-fx run``'s flags and ``varuna-fx train``'s
``[launch]`` keys are both built from :data:`LAUNCH_OPTIONS`.

Each option has one name (``rdzv_endpoint``: the flag ``--rdzv-endpoint`` of both commands, the
TOML key of train), one help text (``varuna-fx run --help``, ``varuna-fx train --help``,
``--print-config`` and docs/API.md's ``[launch]`` table all show it) and train's default. The
launchers themselves (``launch/torchrun.py``'s ``Ranks``) take the same names. It lives in the
base layer because both the train layer's configuration and the launch layer's command line
read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class LaunchOption:
    """One launch setting. ``kind``: int, bool, str, or bool|auto (train's config kinds);
    ``train``/``run``: whether ``varuna-fx train`` (a ``[launch]`` key) and ``varuna-fx run``
    (a flag) take it."""

    name: str
    default: Any
    kind: str
    help: str
    low: int | None = None
    train: bool = True
    run: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


LAUNCH_OPTIONS: tuple[LaunchOption, ...] = (
    LaunchOption("nproc", 2, "int", "processes on this machine, one per device (train: 1 runs "
                 "in this process, no torchrun; 0: with in_place, a machine that only hosts "
                 "the membership store)", low=0),
    LaunchOption("elastic", False, "bool", "machines may leave and join (torchrun's elastic "
                 "agent, c10d rendezvous); every restart resumes from the latest checkpoint"),
    LaunchOption("in_place", False, "bool", "with elastic: survivors keep running when a "
                 "machine leaves or joins (they re-plan and move only what changed) instead of "
                 "every process restarting from the latest checkpoint; a script's state must "
                 "be the pipeline's (pipe.optimizer, pipe.data_loader, pipe.track): see "
                 "docs/API.md 'Morphing in place'"),
    LaunchOption("store_host", AUTO, "bool|auto", "with in_place: this machine hosts the "
                 "membership store, which must stay up, so it may run nproc 0 on a machine "
                 "that is not spot (auto: the machine whose local_addr is the rdzv_endpoint's "
                 "host; one machine alone hosts it)"),
    LaunchOption("nnodes", "", "str", "with elastic: MIN:MAX machines"),
    LaunchOption("rdzv_endpoint", "", "str", "with elastic: HOST:PORT of the machine hosting "
                 "the rendezvous"),
    LaunchOption("rdzv_id", "varuna-fx", "str", "with elastic: the job's name"),
    LaunchOption("local_addr", "", "str", "with elastic: this machine's address (the "
                 "rendezvous host is the machine whose address is the endpoint's)"),
    LaunchOption("max_restarts", 100, "int", "with elastic: restarts after worker failures "
                 "(joins are free)", low=0),
    LaunchOption("rdzv_conf", "", "str", "with elastic: extra rendezvous settings "
                 "key=value[,key=value]", train=False),
    LaunchOption("torchrun_args", "", "str", "extra torchrun flags, one or several in one "
                 "quoted string split as a shell would (a fixed multi-machine job: "
                 "\"--nnodes=2 --node-rank=0 --rdzv-endpoint=host:29400\"); run: may be "
                 "repeated"),
)

OPTIONS = {o.name: o for o in LAUNCH_OPTIONS}
