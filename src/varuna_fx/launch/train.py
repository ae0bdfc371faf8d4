"""``varuna-fx train [CONFIG.toml] [--key value ...]``: a whole training job, one command.

The command checks the configuration (``train_config.py``), then trains: in this process when
``nproc = 1`` (and not elastic), else under torchrun with ``nproc`` ranks running the module
``varuna_fx.launch.train_worker`` -- launched the way ``varuna-fx run`` launches a script
(standalone on 127.0.0.1, or torchrun's elastic agent with ``elastic = true``), so the user
writes no script. The ranks get the checked configuration as JSON.

Exit status: 0 when the run reached ``steps`` (or ``stop_at``); 128 + the signal's number when
a signal stopped it (143 for SIGTERM, 130 for Ctrl-C) -- the ranks saved a checkpoint first and
the same command resumes; 1 when a rank failed; 2 for a configuration refused before anything
ran.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..errors import VarunaFxError
from .elastic import elastic_launch
from .standalone import loopback_interfaces, loopback_stores, standalone_args
from .train_config import TrainConfig, help_text, resolve, to_toml
from .train_worker import SUMMARY, encode, run_training

WORKER = "varuna_fx.launch.train_worker"
PREEMPTED = 128 + signal.SIGTERM


def train_command(argv: Sequence[str]) -> int:
    """``varuna-fx train``'s whole life; returns the exit status."""
    launched_at = time.time()
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    show = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    try:
        cfg, source = resolve(argv)
    except VarunaFxError as exc:
        print(f"varuna-fx train: error: {exc}", file=sys.stderr)
        return 2
    if show:
        print(to_toml(cfg, source), end="")
        return 0
    if cfg.nproc == 1 and not cfg.elastic and not cfg.torchrun_args:
        try:
            return run_training(cfg, launched_at, source)
        except VarunaFxError as exc:
            print(f"varuna-fx train: error: {exc}", file=sys.stderr)
            return 1
    return launch_ranks(cfg, encode(cfg, launched_at, source), launched_at)


def torchrun_argv(cfg: TrainConfig) -> tuple[list[str], dict[str, str], bool]:
    """torchrun's flags (before the module), the workers' environment additions, and whether
    the run is on this machine only (then every store listens on 127.0.0.1)."""
    extra = shlex.split(cfg.torchrun_args)
    if cfg.elastic:
        launch = elastic_launch(nproc=cfg.nproc, nnodes=cfg.nnodes or "1:1",
                                rdzv_endpoint=cfg.rdzv_endpoint or None, rdzv_id=cfg.rdzv_id,
                                local_addr=cfg.local_addr or None,
                                max_restarts=cfg.max_restarts)
        return [*launch.argv, *extra], launch.env, False
    one_machine = not any(a.startswith(("--nnodes", "--rdzv", "--standalone")) for a in extra)
    flags = [f"--nproc-per-node={cfg.nproc}", *(standalone_args() if one_machine else []),
             *extra]
    return flags, loopback_interfaces() if one_machine else {}, one_machine


def launch_ranks(cfg: TrainConfig, payload: str, launched_at: float) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    flags, env, one_machine = torchrun_argv(cfg)
    parsed = parse_args([*flags, "--module", WORKER])
    parsed.training_script_args = [payload]  # set after parsing: torchrun never reads it
    try:
        with loopback_stores() if one_machine else nullcontext(), _environment(env):
            run(parsed)
    except SignalException as stop:
        # torchrun passed the signal on to the ranks, which saved a checkpoint and exited
        name = signal.Signals(stop.sigval).name
        print(f"varuna-fx train: stopped by {name}; the ranks saved a checkpoint in "
              f"{cfg.out}/checkpoints; the same command resumes", file=sys.stderr)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        print(f"varuna-fx train: a rank failed ({len(failed.failures)} of {cfg.nproc}; its "
              "error is above)", file=sys.stderr)
        return 1
    return PREEMPTED if _ranks_were_preempted(cfg, launched_at) else 0


def _ranks_were_preempted(cfg: TrainConfig, launched_at: float) -> bool:
    """Whether this launch's ranks stopped on a signal sent to them (not to the command):
    rank 0's summary, when it ran on this machine, says so."""
    path = Path(cfg.out) / SUMMARY
    try:
        if path.stat().st_mtime < launched_at:
            return False
        return bool(json.loads(path.read_text()).get("preempted"))
    except (OSError, ValueError):
        return False


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment while torchrun runs (its workers inherit them), then the
    environment as it was (the command may run inside a longer-lived process: a test)."""
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
