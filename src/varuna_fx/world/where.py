"""Where am I running: the one place that answers "launched as one rank of several?", the world
size and this process's rank, and that joins the process group torchrun described.

Everything else (planning, the runtimes, ``Cluster.local``, profiling) asks here, so the answer
cannot drift between them. Bottom layer: imports nothing from the package but ``errors``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import DistributedError, PeerTimeoutError, env_int
from .membership import in_place, membership
from .switches import SWITCHES, check_seconds, read

TIMEOUT_ENV = "VARUNA_FX_TIMEOUT"
# seconds; generous: a slow first step (allocator, lazy init) is fine
DEFAULT_TIMEOUT = float(SWITCHES[TIMEOUT_ENV].default)


def resolve_timeout(timeout: float | None) -> float:
    """The ``timeout=`` keyword, else ``$VARUNA_FX_TIMEOUT``, else 300 s: every wait on a peer,
    the rendezvous included."""
    if timeout is None:
        return read(TIMEOUT_ENV)
    return check_seconds("timeout", timeout)


def launched_distributed() -> bool:
    """True when this process is one rank of several (initialised, or torchrun's env)."""
    if not dist.is_available():
        return False
    if in_place():  # an in-place job: even one process alone keeps its group (others may join)
        return True
    if dist.is_initialized():
        return dist.get_world_size() > 1
    return env_int("WORLD_SIZE", 1, minimum=1) > 1


def in_process_group() -> bool:
    """A process group of more than one rank is formed (collectives can run now)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Ranks in the job: the process group's, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return env_int("WORLD_SIZE", 1, minimum=1)


_ASSUMED: list[int] = []  # assumed_world's, innermost last


def running_world() -> int | None:
    """The world size of a distributed run (every rank needs a stage), None in one process;
    inside ``assumed_world(n)``: n."""
    if _ASSUMED:
        return _ASSUMED[-1]
    return world_size() if launched_distributed() else None


@contextlib.contextmanager
def assumed_world(world: int) -> Iterator[None]:
    """Plan as a job of ``world`` ranks would (``running_world``): a pre-plan for a world an
    in-place job may morph to (``morph/preplan.py``)."""
    _ASSUMED.append(world)
    try:
        yield
    finally:
        _ASSUMED.pop()


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_int("RANK", 0)


def local_world_size() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``), at most the world."""
    world = world_size()
    return max(1, min(env_int("LOCAL_WORLD_SIZE", world, minimum=1), world))


def init_process_group(timeout: float) -> None:
    """Join the job torchrun described (env://) unless the user already did: gloo on CPU,
    NCCL on GPU. The rendezvous waits at most ``timeout`` for the other ranks. In an in-place
    job (``world/membership.py``) the process registers in the membership store instead and
    forms the group of the generation that admits it."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = env_int("LOCAL_RANK", 0)
    if in_place():
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        joining = membership(timeout)
        joining.form(joining.join(), backend)
        _release_at_exit()
        return

    def join() -> None:
        if backend == "nccl":  # the current device is per thread: set it where NCCL starts too
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    try:
        _with_deadline(join, timeout)
    except TimeoutError:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} could "
            f"not join the rendezvous at {where} within {timeout:.1f} s: nothing there answered "
            "as torch.distributed's store. Another program may hold that port (choose a free "
            "one: --master-port / MASTER_PORT), or rank 0 did not start"
        ) from None
    except (RuntimeError, dist.DistError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise DistributedError(
                f"rank {os.environ.get('RANK', '?')} could not listen on {where}: another "
                "program holds that port; choose a free one (--master-port / MASTER_PORT)"
            ) from exc
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} could "
            f"not form the process group at {where} within {timeout:.1f} s: some rank did not "
            f"start or crashed before vf.compile; see its log ({str(exc).splitlines()[0]})"
        ) from exc
    _release_at_exit()


RELEASE_SECONDS = 10.0  # at exit, how long releasing the group may take before it is left


def _release_at_exit() -> None:
    """Release the process group this module formed when the interpreter exits, while it is
    still whole. Left to the interpreter's finalisation, gloo's worker threads can still hold
    finished work whose tensors reference Python objects; freeing them then takes the GIL of a
    dying interpreter and the rank dies with SIGABRT ("terminate called without an active
    exception") after its work is done, failing the job under torchrun. A group the user
    formed is theirs to release. Registered once however many groups are formed (unregister
    first); a no-op when the group is gone already."""
    atexit.unregister(release_process_group)
    atexit.register(release_process_group)


def release_process_group() -> None:
    """Destroy the default process group, if any, within :data:`RELEASE_SECONDS`: a peer that
    died mid-collective must not hold this process at exit (the call is then abandoned)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):  # at exit, a failure to release changes nothing
        _with_deadline(dist.destroy_process_group, RELEASE_SECONDS, name="varuna_fx-release")


def _with_deadline(join: Callable[[], None], timeout: float,
                   name: str = "varuna_fx-rendezvous") -> None:
    """Run ``join`` but give up after ``timeout`` (+ a little): the store client's own timeout
    does not cover a peer that accepts the connection and never answers (another program on
    the master port), where it would block for minutes. The call runs in a daemon thread that
    is abandoned on timeout; the process is expected to exit on the error."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            join()
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread below
            outcome.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    if not outcome:
        raise TimeoutError
    if outcome[0] is not None:
        raise outcome[0]


def comm_device() -> torch.device:
    """Where collectives' tensors live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
