"""Launch a script on N local ranks (gloo on CPU) and collect what each rank saved.

The jobs protocol, both halves here: :func:`run_jobs` (the test) starts a ``dist_scripts/``
script with ``OUT_DIR JOBS_JSON`` and loads ``OUT_DIR/<name>_rank<r>.pt`` per job and rank;
:func:`serve_jobs` (the script's main, on every rank) runs each job and saves that file.

Each rank is a plain subprocess given the environment torchrun would set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Unlike torchrun this lets one rank die
without the launcher killing the others, which the peer-failure tests need, and it starts
faster. ``varuna-fx run`` (torchrun) is exercised separately. The environment and the port
come from :mod:`support.ranks`, which bench/ shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from support.ranks import free_port, rank_env
from varuna_fx.errors import VarunaFxError

SCRIPTS = Path(__file__).parents[1] / "dist_scripts"


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    output: str


def cpu_rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """:func:`support.ranks.rank_env` for a test's rank: no GPU, and the test's own timeout
    rather than one inherited from the shell."""
    return rank_env(rank, world, port, drop=("VARUNA_FX_TIMEOUT",), CUDA_VISIBLE_DEVICES="")


def launch(script: str, nproc: int, args: list[str], *, timeout: float = 120.0) -> list[RankResult]:
    """Run ``dist_scripts/<script>`` on ``nproc`` ranks; kill all at ``timeout`` seconds."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / script), *args],
                              env=cpu_rank_env(r, nproc, port), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(nproc)]
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append(RankResult(rank, proc.returncode, out))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            results.append(RankResult(rank, None, out))
    return results


def launch_ok(script: str, nproc: int, args: list[str], *,
              timeout: float = 120.0) -> list[RankResult]:
    """:func:`launch`, failing the test with every rank's output unless all ranks exit 0."""
    ranks = launch(script, nproc, args, timeout=timeout)
    logs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-2000:]}" for r in ranks)
    assert all(r.returncode == 0 for r in ranks), logs
    return ranks


def run_jobs(tmp_path: Path, nproc: int, jobs: list[dict[str, Any]], *,
             script: str = "train_gpt.py", timeout: float = 120.0
             ) -> dict[str, list[dict[str, Any]]]:
    """Run ``script``'s jobs on ``nproc`` ranks: {job name: [rank 0's result, ...]}."""
    results = launch(script, nproc, [str(tmp_path), json.dumps(jobs)], timeout=timeout)
    collected: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        per_rank = []
        for r in job.get("ranks", range(nproc)):  # a job may kill some ranks on purpose
            path = tmp_path / f"{job['name']}_rank{r}.pt"
            if not path.exists():
                logs = "\n".join(f"--- rank {x.rank} (exit {x.returncode}) ---\n{x.output[-3000:]}"
                                 for x in results)
                raise AssertionError(f"rank {r} wrote no result for job {job['name']}\n{logs}")
            per_rank.append(torch.load(path, weights_only=False))
        collected[job["name"]] = per_rank
    return collected


Job = Callable[[dict[str, Any]], dict[str, Any]]


def serve_jobs(kinds: dict[str, Job]) -> NoReturn:
    """The rank side of :func:`run_jobs`, a ``dist_scripts/*`` script's main: ``argv`` is
    ``OUT_DIR JOBS_JSON``; each job's result, ``kinds[job["kind"]](job)`` -- or the
    ``VarunaFxError`` it raised, as ``{"error": class name, "message": ...}`` -- is saved to
    ``OUT_DIR/<name>_rank<r>.pt``. Then the process exits without interpreter teardown (about a
    second per rank with torch loaded; the results are saved)."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    for job in json.loads(sys.argv[2]):
        try:
            result = kinds[job["kind"]](job)
        except VarunaFxError as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        torch.save(result, out / f"{job['name']}_rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)
