"""An in-place job's step closes through the membership store (``closing_sum``), so the
survivors of a kill agree on whether the step in flight was done.

Over gloo, a process killed while the step's closing all-reduce (loss, overflow flag, notices)
went round could leave some survivors with the sums and others without: the first went on to
the next step while the others ran this one again after the morph, and the job was silently a
step apart (measured on 4 machines: every later loss off by ~1e-4, then a checkpoint's
collectives hung). The store is the one place that outlives the processes. Base layer: imports
``membership``, ``heartbeats`` and ``errors``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

import torch.distributed as dist

from ..errors import PeerTimeoutError
from . import safe_json
from .heartbeats import Stopped
from .membership import Membership


def store_closer(m: Membership, rank: int) -> Callable[[list[float]], list[float]]:
    """The closing sum of one generation's runtime (``DistributedRuntime.closer``): its steps
    numbered from 0."""
    steps = itertools.count()
    return lambda values: closing_sum(m, next(steps), rank, values)


def closing_sum(m: Membership, index: int, rank: int, values: list[float]) -> list[float]:
    """The ``index``-th step of this generation closes: every rank's ``values`` summed, read
    from the store (``gen/<g>/sum/<index>/<rank>``) in place of the world all-reduce. Each rank
    writes only after its own gradient reductions completed, so either every rank's value is
    there and every survivor finishes the step, or one is missing and none does: a survivor
    that failed says so (``gen/<g>/failed``, ``Membership.recover``), a writer that died stops
    beating. Three store round trips a step; each rank deletes its own value of two steps
    before (by then every rank has read it)."""
    gen = m.generation
    assert gen is not None
    prefix = f"gen/{gen.number}/sum/"
    keys = [f"{prefix}{index}/{r}" for r in range(len(gen.members))]
    failed = f"gen/{gen.number}/failed"
    try:
        m.store.set(keys[rank], json.dumps(values))
        if index >= 2:
            m.store.delete_key(f"{prefix}{index - 2}/{rank}")
        pause, start = 1e-4, time.monotonic()
        watch: Stopped | None = None
        while not m.store.check(keys):
            if m.store.check([failed]):
                raise PeerTimeoutError(
                    f"{m.member} was closing step {index} of generation {gen.number} "
                    f"when {m.store.get(failed).decode()} lost a peer")
            if time.monotonic() - start > 2 * m.window:  # (a slow peer is no news)
                watch = watch or Stopped(m.beats, list(gen.members), m.window)
                gone = watch.gone()
                if gone:
                    raise PeerTimeoutError(
                        f"{m.member} was closing step {index} of generation "
                        f"{gen.number}: {', '.join(sorted(gone))} stopped beating")
            if time.monotonic() - start > m.timeout:
                raise PeerTimeoutError(
                    f"{m.member} waited {m.timeout:.0f} s for every rank to close "
                    f"step {index} of generation {gen.number} and gave up")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        got = [safe_json.loads(v) for v in m.store.multi_get(keys)]
    except (RuntimeError, dist.DistError) as exc:  # the store itself went away
        raise PeerTimeoutError(f"{m.member} lost the membership store at "
                               f"{m.address} while closing a step ({exc})") from exc
    return [float(sum(column)) for column in zip(*got)]

