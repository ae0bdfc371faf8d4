"""``varuna-fx train [CONFIG.toml] [--key value ...]``: a whole training job, one command.

The command checks the configuration (``train/config.py``), then trains: in this process when
``nproc = 1`` (and not elastic), else under torchrun with ``nproc`` ranks running the module
``varuna_fx.train.worker`` -- started as ``varuna-fx run`` starts a script
(launch/torchrun.py: standalone on 127.0.0.1, torchrun's elastic agent with ``elastic =
true``, or with ``in_place = true`` too varuna_fx's in-place launcher, launch/in_place.py, whose
survivors keep training when a machine leaves or joins), so the user writes no script. The
ranks get the checked configuration as JSON.

Exit status: 0 when the run reached ``steps`` (or ``stop_at``); 128 + the signal's number when
a signal stopped it (143 for SIGTERM, 130 for Ctrl-C) -- the ranks saved a checkpoint first and
the same command resumes; 1 when a rank failed; 2 for a configuration refused before anything
ran.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import VarunaFxError
from ..train.checks import resolve
from ..train.config import TrainConfig, help_text, to_toml
from ..train.data import prepare_data
from ..train.worker import SUMMARY, encode, rank_errors, run_training
from ..world import safe_json
from .in_place import REFUSED_EXIT
from .torchrun import Ranks, start_ranks

WORKER = "varuna_fx.train.worker"
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
    try:  # documents are tokenized here, once, with a progress bar; the ranks read the cache
        made = prepare_data(cfg)
        if made is not None and not made.cached:
            print(f"varuna-fx train: tokenized {cfg.data} with {cfg.tokenizer}: "
                  f"{made.documents:,} documents, {made.count:,} tokens, cached in {made.path}",
                  flush=True)
    except VarunaFxError as exc:
        print(f"varuna-fx train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.nproc == 1 and not cfg.elastic and not cfg.torchrun_args:
        try:
            return run_training(cfg, launched_at, source)
        except VarunaFxError as exc:
            print(f"varuna-fx train: error: {exc}", file=sys.stderr)
            return 1
    return launch_ranks(cfg, encode(cfg, launched_at, source), launched_at)


def ranks_of(cfg: TrainConfig) -> Ranks:
    return Ranks.of(dataclasses.asdict(cfg))  # the [launch] keys, by their names


def launch_ranks(cfg: TrainConfig, payload: str, launched_at: float) -> int:
    """The ranks under torchrun, as ``varuna-fx run`` starts a script (launch/torchrun.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        status = start_ranks(ranks_of(cfg), WORKER, [payload], module=True, quiet=True)
    except SignalException as stop:
        # torchrun passed the signal on to the ranks, which saved a checkpoint and exited
        name = signal.Signals(stop.sigval).name
        print(f"varuna-fx train: stopped by {name}; the ranks saved a checkpoint in "
              f"{cfg.out}/checkpoints; the same command resumes", file=sys.stderr)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        if not _print_rank_errors(cfg, launched_at):  # (no error filed: a crash's own output)
            codes = sorted({f.exitcode for f in failed.failures.values()})
            print(f"varuna-fx train: {len(failed.failures)} of {cfg.nproc} rank(s) failed "
                  f"(exit status {', '.join(map(str, codes))}; their output is above)",
                  file=sys.stderr)
        return 1
    if status:  # the in-place launcher's own status (torchrun's raises instead)
        return _in_place_stopped(cfg, status, launched_at)
    return PREEMPTED if _ranks_were_preempted(cfg, launched_at) else 0


def _print_rank_errors(cfg: TrainConfig, launched_at: float) -> bool:
    """Print the errors this machine's ranks filed that rank 0 has not printed already (each
    distinct one once); whether any rank filed one."""
    errors = rank_errors(cfg.out, launched_at)
    shown = {errors[0]} if 0 in errors else set()
    for number, text in sorted(errors.items()):
        if text not in shown:
            shown.add(text)
            print(f"varuna-fx train: error (rank {number}): {text}", file=sys.stderr)
    return bool(errors)


def _in_place_stopped(cfg: TrainConfig, status: int, launched_at: float) -> int:
    """What the in-place launcher's non-zero status means: a signal to it (passed on to every
    worker here, which saved and exited: 128 + the signal), or a worker that failed for good."""
    if status == REFUSED_EXIT:
        print("varuna-fx train: the running in-place job refused this machine's process(es): "
              "they run another model or configuration than the job (the differences are "
              "above); the job runs on without them. Start them with the job's command",
              file=sys.stderr)
        return 1
    if status > 128 and status - 128 in signal.valid_signals():
        name = signal.Signals(status - 128).name
        print(f"varuna-fx train: stopped by {name}; the ranks saved a checkpoint in "
              f"{cfg.out}/checkpoints; the same command resumes", file=sys.stderr)
        return status
    if not _print_rank_errors(cfg, launched_at):
        print(f"varuna-fx train: a rank failed (exit status {status}; its output is above) "
              f"after --max-restarts {cfg.max_restarts} restarts", file=sys.stderr)
    return 1


def _ranks_were_preempted(cfg: TrainConfig, launched_at: float) -> bool:
    """Whether this launch's ranks stopped on a signal sent to them (not to the command):
    rank 0's summary, when it ran on this machine, says so."""
    path = Path(cfg.out) / SUMMARY
    try:
        if path.stat().st_mtime < launched_at:
            return False
        return bool(safe_json.loads(path.read_text()).get("preempted"))
    except (OSError, ValueError):
        return False
