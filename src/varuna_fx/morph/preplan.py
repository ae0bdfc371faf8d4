"""Planning the worlds an in-place job may morph to next, before it does.

A morph re-plans for the new world (``api.Replan``), and the planner's search is most of that:
for a 70B Llama on 56 A100-class GPUs after 64, ~25-35 CPU s, while every survivor stalls. Varuna
computed the best configuration of every world size ahead of time; this does the same for the
likely next ones. After compile and after each morph, one process per machine (``LOCAL_RANK``
0) forks a child that runs only the search (``Replan.search``, under ``assumed_world``) for a
machine lost, a machine joining and one process lost: ``world - gpus_per_node``,
``world + gpus_per_node`` and ``world - 1``. The search's answer goes to the plan cache on disk
(``planner/cache.py``), keyed by everything the search reads, so the re-plan of a morph to one
of those worlds finds it there and skips its search; for any other world it simply searches.
The cache is what makes this exact: a pre-plan can only save time, never change a plan.

The child runs pure planning code (numpy and Python on the captured graph, no device and no
process group: a measured profile, ``profile=True``, which coordinates the ranks, turns this
off), at low priority, and ends itself after ``$VARUNA_FX_PREPLAN_SECONDS`` (default 600);
the parent never waits for it, and kills it when the next morph starts (its CPU is then the
morph's) or a new pre-plan replaces it. It runs on GPU clusters by default (their cores are
free while the devices train; on CPU the loop needs them): ``$VARUNA_FX_PREPLAN=1`` turns it on
anywhere, ``0`` off; it is off where the plan cache keeps nothing on disk
(``VARUNA_FX_PLAN_CACHE=0`` or ``memory``).
"""

from __future__ import annotations

import atexit
import os
import signal
import time

from ..planner import cache as plan_cache
from ..planner.cluster import Cluster
from ..world.switches import SWITCHES, read
from ..world.where import assumed_world
from .morphable import Replanner

DEFAULT_SECONDS = float(SWITCHES["VARUNA_FX_PREPLAN_SECONDS"].default)


def enabled(replan: Replanner) -> bool:
    """Whether this process pre-plans (see the module doc): ``$VARUNA_FX_PREPLAN`` "1" or
    "0"; by default ("auto") on a GPU cluster only: on CPU the training loop uses the cores
    the child would take."""
    setting = read("VARUNA_FX_PREPLAN")  # "auto", "on" or "off"
    if setting == "off":
        return False
    if setting != "on" and replan.cluster.device == "cpu":
        return False
    return hasattr(os, "fork") and plan_cache.mode() == "disk" and \
        os.environ.get("LOCAL_RANK", "0") == "0" and replan.options.profile is not True


def _let_go_of_the_parents_files() -> None:
    """In the child: output to /dev/null and every other inherited descriptor closed. Its
    sockets (the process group's, the membership store's) held open here would hide the
    parent's death from its peers, and its pipes would keep a caller reading its output
    waiting for the child."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 1 << 16)


def next_worlds(world: int, per_node: int) -> list[int]:
    """The worlds a morph from ``world`` most likely goes to: a machine lost or joining, one
    process lost (most likely first)."""
    found: list[int] = []
    for w in (world - per_node, world + per_node, world - 1):
        if w >= 1 and w != world and w not in found:
            found.append(w)
    return found


class Preplanner:
    """The one pre-planning child of a process (see the module doc)."""

    def __init__(self, replan: Replanner) -> None:
        self.replan = replan
        self.pid: int | None = None
        self._stop_at_exit = False

    def start(self, cluster: Cluster, global_batch_size: int,
              worlds: list[int] | None = None) -> int | None:
        """Fork a child searching the likely next worlds of ``cluster`` (or ``worlds``);
        its pid, or None where this process does not pre-plan."""
        self.stop()
        if not enabled(self.replan):
            return None
        worlds = next_worlds(cluster.gpus, cluster.gpus_per_node) if worlds is None else worlds
        seconds = read("VARUNA_FX_PREPLAN_SECONDS")
        pid = os.fork()
        if pid:
            self.pid = pid
            if not self._stop_at_exit:
                atexit.register(self.stop)  # (never outlive the job's process)
                self._stop_at_exit = True
            return pid
        code = 0
        try:  # the child: plan, and never return into the parent's code
            _let_go_of_the_parents_files()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the parent's handler saves)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.alarm(max(1, int(seconds)))  # SIGALRM's default ends the process
            os.nice(10)
            for world in worlds:
                resized = Cluster.from_dict({**cluster.to_dict(), "gpus": world})
                with assumed_world(world):
                    try:
                        self.replan.search(resized, global_batch_size)
                    except Exception:  # noqa: BLE001 - a world nothing fits: the next one
                        continue
        except BaseException:  # noqa: BLE001 - the child exits, whatever happened
            code = 1
        finally:
            os._exit(code)

    def stop(self) -> None:
        """End the child if it still runs, and reap it."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the child to finish (tests, benchmarks); True
        when it did."""
        if self.pid is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.pid = None
                return True
            time.sleep(0.05)
        return False
