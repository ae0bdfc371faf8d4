"""Elastic morphing: `varuna-fx run --elastic` on two "machines" (network namespaces).

A torchrun agent runs in each namespace; the nodes are joined by a veth pair. Killing every
process of one node shrinks the job to the other, which re-plans and resumes from the newest
checkpoint; starting the node again grows the job back. Every step's loss must equal an
uninterrupted one-process run of the same script (the layouts differ only in summation order).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from varuna_fx.errors import VarunaFxError
from varuna_fx.launch.elastic import elastic_launch, parse_nnodes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "elastic_train.py"
TOTAL, EVERY, PAUSE_AT = 9, 2, 5


@pytest.mark.slow  # runs `ip addr` to find the interface of local_addr
def test_elastic_launch_arguments() -> None:
    host = elastic_launch(nproc=2, nnodes="1:4", rdzv_endpoint="10.1.2.3:29500", rdzv_id="j",
                          local_addr="10.1.2.3", max_restarts=7)
    assert host.is_host is True
    assert "--nnodes=1:4" in host.argv and "--nproc-per-node=2" in host.argv
    assert "--rdzv-backend=c10d" in host.argv and "--rdzv-endpoint=10.1.2.3:29500" in host.argv
    assert "--local-addr=10.1.2.3" in host.argv and "--max-restarts=7" in host.argv
    conf = next(a for a in host.argv if a.startswith("--rdzv-conf="))
    assert "is_host=1" in conf and "last_call_timeout=1" in conf
    # growing back needs the per-round store address (see varuna_fx.launch.elastic)
    assert host.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    other = elastic_launch(nproc=1, nnodes="2", rdzv_endpoint="10.1.2.3", rdzv_id="j",
                           local_addr="10.1.2.4", max_restarts=1, rdzv_conf="join_timeout=5")
    assert other.is_host is False and "--rdzv-endpoint=10.1.2.3:29400" in other.argv
    assert "join_timeout=5" in next(a for a in other.argv if a.startswith("--rdzv-conf="))
    assert parse_nnodes("2:8") == (2, 8) and parse_nnodes("3") == (3, 3)
    for bad in ("0:2", "3:2", "a:b"):
        with pytest.raises(VarunaFxError, match="--nnodes"):
            parse_nnodes(bad)
    with pytest.raises(VarunaFxError, match="--rdzv-endpoint"):
        elastic_launch(nproc=1, nnodes="1:2", rdzv_endpoint=None, rdzv_id="j",
                       local_addr=None, max_restarts=1)


def _rows(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def _losses(log: Path) -> dict[int, float]:
    """The loss of every step, as last logged (a step redone after a restart counts once)."""
    return {int(r[0]): float(r[-1]) for r in _rows(log)}


@pytest.mark.slow
@pytest.mark.distributed
def test_shrink_and_grow_two_nodes(tmp_path: Path) -> None:
    from support import netns

    ok, why = netns.netns_available(shaping=False)
    if not ok:
        pytest.skip(why)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               VARUNA_FX_TIMEOUT="60", CUDA_VISIBLE_DEVICES="")
    # the uninterrupted run every layout must reproduce (one process, no checkpoints)
    ref_log = tmp_path / "ref.log"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "unused"), str(ref_log),
                    str(TOTAL), "0"], env=env, check=True, timeout=120)
    reference = _losses(ref_log)

    log, pause = tmp_path / "elastic.log", tmp_path / "pause"
    pause.write_text(str(PAUSE_AT))
    outputs: list[Path] = []

    def agent(net: netns.NetNS, i: int) -> subprocess.Popen:
        out = tmp_path / f"node{i}.{len(outputs)}.out"
        outputs.append(out)
        argv = [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--elastic", "--nproc", "1",
                "--nnodes", "1:2", "--rdzv-endpoint", f"{net.addr(0)}:29400",
                "--local-addr", net.addr(i), str(SCRIPT), str(tmp_path / "ckpt"), str(log),
                str(TOTAL), str(EVERY), "0.2", str(pause)]
        return net.popen(i, argv, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT)

    def wait_for(what: str, pred, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not pred(_rows(log)):
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {o.name}\n" + o.read_text()[-3000:] for o in outputs)
                pytest.fail(f"timed out waiting for {what}; log {_rows(log)}\n{tails}")
            time.sleep(0.1)

    with netns.NetNS(2) as net:
        first = agent(net, 0)
        agent(net, 1)
        wait_for("two steps on 2 ranks", lambda rows: len(rows) >= 2 and rows[-1][1] == "2")
        net.kill(1)  # node 1 vanishes: agent and worker, no chance to save
        wait_for("the survivor to train alone",
                 lambda rows: rows and rows[-1][1] == "1" and int(rows[-1][0]) >= PAUSE_AT)
        second = agent(net, 1)  # the node comes back
        wait_for("the job to grow back", lambda rows: rows[-1][1] == "2" and
                 int(rows[-1][0]) > PAUSE_AT)
        assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0

    rows = _rows(log)
    worlds = [r[1] for r in rows]
    shrink = worlds.index("1")
    grow = shrink + worlds[shrink:].index("2")
    assert "1" not in worlds[grow:], worlds
    for r in rows:  # every layout keeps the global batch: D x micro-batch size x count
        world, p, d, b, m = map(int, r[1:6])
        assert p * d == world and d * b * m == 8, r
    # the survivor resumed from the last periodic checkpoint before the kill (kill -9 saves
    # nothing), the grown job from the one the survivor saved on SIGTERM (no step lost)
    resumed = int(rows[shrink][0]) - 1
    assert resumed % EVERY == 0 and resumed <= int(rows[shrink - 1][0]), rows
    assert int(rows[grow][0]) == int(rows[grow - 1][0]) + 1
    got = _losses(log)
    assert sorted(got) == list(range(1, TOTAL + 1))
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                               torch.tensor([reference[s] for s in sorted(got)]),
                               rtol=1e-5, atol=1e-5)


def test_run_refuses_elastic_flags_without_elastic() -> None:
    from varuna_fx.launch.cli import main

    with pytest.raises(SystemExit, match="--elastic"):
        main(["run", "--nproc", "1", "--nnodes", "1:2", "train.py"])
