"""Starting ranks under torchrun, the one way ``varuna-fx run`` and ``varuna-fx train`` do it.

On one machine (no ``--nnodes``/``--rdzv``/``--standalone`` among the extra torchrun flags) the
job is torchrun's ``--standalone`` made reachable from this machine only (``standalone.py``);
with ``elastic`` it is torchrun's elastic agent set up for morphing (``elastic.py``), and with
``in_place`` too varuna_fx's own launcher instead (``in_place.py``: survivors keep running
when a machine leaves or joins); otherwise the extra flags describe a fixed multi-machine job
and pass through. The target (a script, or
with ``module`` a module run as ``python -m``) gets its arguments exactly as given: torchrun's
parser reads only the flags and the target.

A signal to the launching process (a spot supervisor's SIGTERM, Ctrl-C) is passed on to the
ranks by torchrun, which then raises ``SignalException``: the callers say what happened and
exit with 128 + the signal's number.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..world.launch_options import AUTO, LAUNCH_OPTIONS
from .elastic import elastic_launch
from .in_place import InPlaceLaunch
from .standalone import loopback_interfaces, loopback_stores, standalone_args


@dataclass(frozen=True)
class Ranks:
    """Where the ranks run: ``nproc`` on this machine, torchrun's own ``flags`` (a fixed
    multi-machine job), or an elastic job's settings."""

    nproc: int
    flags: tuple[str, ...] = ()
    elastic: bool = False
    nnodes: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "varuna-fx"
    local_addr: str | None = None
    max_restarts: int = 100
    rdzv_conf: str | None = None
    in_place: bool = False  # with elastic: the in-place launcher (launch/in_place.py)
    store_host: bool | None = None  # in place: this machine hosts the membership store

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Ranks:
        """From the launch options' values by name (world/launch_options.py: ``varuna-fx
        run``'s parsed flags or ``varuna-fx train``'s ``[launch]`` keys): unset ones (None,
        "", auto, absent) keep the defaults here; ``torchrun_args`` are split into flags."""
        given: dict[str, Any] = {}
        for option in LAUNCH_OPTIONS:
            value = values.get(option.name)
            if option.name == "torchrun_args":
                given["flags"] = tuple(split_flags(
                    [value] if isinstance(value, str) else list(value or [])))
            elif value is not None and value not in ("", AUTO):
                given[option.name] = value
        return cls(**given)

    def __post_init__(self) -> None:
        if self.in_place and (not self.elastic or self.flags or self.rdzv_conf):
            raise InputError(
                "in-place morphing goes with elastic (--elastic --in-place, or elastic = true "
                "with in_place = true) and takes no torchrun flags or rendezvous settings: its "
                "launcher is varuna_fx's, not torchrun")


def split_flags(values: Sequence[str]) -> list[str]:
    """torchrun flags from strings each split as a shell would ("--nnodes=2 --node-rank=0"
    gives two flags)."""
    return [flag for value in values for flag in shlex.split(value)]


def one_machine(ranks: Ranks) -> bool:
    return not ranks.elastic and not any(
        a.startswith(("--nnodes", "--rdzv", "--standalone")) for a in ranks.flags)


def torchrun_setup(ranks: Ranks) -> tuple[list[str], dict[str, str]]:
    """torchrun's flags (before the target) and the environment the ranks need."""
    if ranks.elastic:
        launch = elastic_launch(
            nproc=ranks.nproc, nnodes=ranks.nnodes or "1:1", rdzv_endpoint=ranks.rdzv_endpoint,
            rdzv_id=ranks.rdzv_id, local_addr=ranks.local_addr,
            max_restarts=ranks.max_restarts, rdzv_conf=ranks.rdzv_conf)
        # the environment is read by torchrun's rendezvous and inherited by the ranks
        return [*launch.argv, *ranks.flags], launch.env
    if one_machine(ranks):  # as --standalone, but reachable from this machine only
        return ([f"--nproc-per-node={ranks.nproc}", *standalone_args(), *ranks.flags],
                loopback_interfaces())  # the ranks' gloo/NCCL sockets too
    return [f"--nproc-per-node={ranks.nproc}", *ranks.flags], {}


def start_ranks(ranks: Ranks, target: str, target_args: Sequence[str], *,
                module: bool = False, quiet: bool = False) -> int:
    """Run ``target`` (a script, or a module) with ``target_args`` on the ranks; returns when
    they all finished, with 0 (torchrun), or the in-place launcher's exit status (128 + the
    signal's number when a signal stopped it). Raises torchrun's ``SignalException`` (a signal
    reached this process) or ``ChildFailedError`` (a rank failed; ``record`` has printed its
    summary). ``quiet``: torchrun's agent does not log the failures (the caller reports
    them)."""
    if ranks.in_place:
        return InPlaceLaunch(
            nproc=ranks.nproc, nnodes=ranks.nnodes or "1:1", rdzv_endpoint=ranks.rdzv_endpoint,
            rdzv_id=ranks.rdzv_id, local_addr=ranks.local_addr,
            max_restarts=ranks.max_restarts,
            argv=[*(["-m"] if module else []), target, *target_args],
            store_host=ranks.store_host).run()
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    flags, env = torchrun_setup(ranks)
    env = {**env, **thread_setting(ranks.nproc)}
    parsed = parse_args([*flags, *(["--module"] if module else []), target])
    parsed.training_script_args = list(target_args)  # set after parsing: torchrun never reads them
    with loopback_stores() if one_machine(ranks) else nullcontext(), environment(env), \
            quiet_agent() if quiet else nullcontext():
        record(run)(parsed)
    return 0


def thread_setting(nproc: int) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for the ranks when it is unset and several share this machine:
    torchrun sets the same, but with a four-line banner at every launch; said here in one."""
    if nproc <= 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    print(f"varuna-fx: OMP_NUM_THREADS=1 in each of the {nproc} processes (it was unset; "
          "export OMP_NUM_THREADS=N to choose)", file=sys.stderr, flush=True)
    return {"OMP_NUM_THREADS": "1"}


# torchrun's agent logs a rank's failure ("failed (exitcode: 1) ...") and the signals it then
# sends the others: said again after the rank's own error, so a command that reports its ranks'
# errors itself (varuna-fx train) mutes them
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


@contextmanager
def quiet_agent() -> Iterator[None]:
    logger = logging.getLogger(_AGENT_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (the ranks inherit them) while the body runs,
    then the environment as it was: a command may run inside a longer-lived process (a test, a
    notebook), whose later launches must not inherit them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
