"""Issue 9: nothing waits past the user's timeout, and one-machine runs listen on loopback."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import varuna_fx as vf

SCRIPTS = Path(__file__).parents[1] / "dist_scripts"
SRC = str(Path(vf.__file__).resolve().parents[1])


def test_a_huge_stage_count_fails_before_any_schedule_is_built() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    for cluster in (vf.Cluster(gpus=1, device="cpu"), vf.Cluster(gpus=8, device="cpu")):
        start = time.monotonic()
        with pytest.raises(vf.PartitionError, match="more than the 3 operations"):
            vf.compile(model, cluster, example_inputs=(torch.randn(4, 4),), stages=10**6)
        assert time.monotonic() - start < 30  # it took minutes (a shared machine: generous)


def test_profile_joins_the_process_group_with_the_users_timeout(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from varuna_fx.planner import resolve

    class Joined(Exception):
        pass

    seen = []

    def join(timeout: float) -> None:
        seen.append(timeout)
        raise Joined

    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(resolve, "launched_distributed", lambda: True)
    monkeypatch.setattr(resolve, "init_process_group", join)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(Joined):
        vf.compile(model, vf.Cluster(gpus=1, device="cpu"), example_inputs=(torch.randn(4, 4),),
                   stages=1, profile=True, timeout=7.5)
    monkeypatch.setenv("VARUNA_FX_TIMEOUT", "12")
    with pytest.raises(Joined):
        vf.compile(model, vf.Cluster(gpus=1, device="cpu"), example_inputs=(torch.randn(4, 4),),
                   stages=1, profile=True)
    assert seen == [7.5, 12.0]


def _join_as(rank: int, port: int, timeout: float) -> subprocess.Popen:
    code = (
        "import time\n"
        "import varuna_fx as vf\n"
        "from varuna_fx.world.where import init_process_group\n"
        "start = time.monotonic()\n"
        "try:\n"
        f"    init_process_group({timeout})\n"
        "except vf.VarunaFxError as exc:\n"
        "    print(type(exc).__name__, round(time.monotonic() - start, 1), exc)\n"
    )
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": SRC}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_master_port_held_by_another_program_fails_within_the_timeout() -> None:
    """A program listening on the master port accepts the store client's connection and never
    answers: rank 1 used to wait minutes whatever the timeout; rank 0 cannot listen there."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(16)
    port = holder.getsockname()[1]
    try:
        ranks = [_join_as(rank, port, 3.0) for rank in (1, 0)]  # both at once: half the time
        (client, client_err), (server, server_err) = [r.communicate(timeout=120) for r in ranks]
    finally:
        holder.close()
    name, seconds, message = client.split(" ", 2)
    assert name == "PeerTimeoutError", client + client_err
    assert float(seconds) <= 3.0 + 2.0, client  # the timeout and a little
    assert f"127.0.0.1:{port}" in message and "MASTER_PORT" in message
    assert server.startswith("DistributedError"), server + server_err
    assert "another program holds that port" in server


def test_standalone_run_builds_a_loopback_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run

    from varuna_fx.launch.cli import cmd_run, main

    calls: list[argparse.Namespace] = []  # what torchrun's parser made of our argv
    seen: list[str | None] = []
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(torch.distributed.run, "run", lambda parsed: (
        calls.append(parsed), seen.append(os.environ.get("GLOO_SOCKET_IFNAME"))))
    main(["run", "--nproc", "2", "train.py", "--lr", "1"])
    (parsed,) = calls
    # the workers get the loopback interface; this process keeps its own environment (a later
    # launch from it, such as an elastic one in namespaces, must not inherit it)
    assert seen[0] is not None and seen[0].startswith("lo")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert not parsed.standalone  # it would name localhost:0, listening on every interface
    assert parsed.rdzv_endpoint == "127.0.0.1:0" and parsed.local_addr == "127.0.0.1"
    assert [parsed.training_script, *parsed.training_script_args] == ["train.py", "--lr", "1"]
    cmd_run(argparse.Namespace(nproc=2, torchrun_args=["--nnodes=2", "--rdzv-endpoint=h:1"],
                               script="train.py", script_args=[], elastic=False, nnodes=None,
                               rdzv_endpoint=None, local_addr=None))
    assert calls[1].rdzv_endpoint == "h:1" and calls[1].local_addr is None  # the user's


def test_store_servers_in_a_standalone_run_bind_loopback() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from varuna_fx.launch.standalone import loopback_stores

    with loopback_stores():
        store = dist.TCPStore("localhost", 0, 1, True, timeout=timedelta(seconds=5))
    assert store._listener.getsockname()[0] == "127.0.0.1"
    assert dist.TCPStore.__name__ == "TCPStore"  # restored
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.slow
@pytest.mark.distributed
def test_varuna_fx_run_listens_on_loopback_only(tmp_path: Path) -> None:
    out = tmp_path / "listening.txt"
    done = subprocess.run(
        [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--nproc", "2",
         str(SCRIPTS / "listen_probe.py"), str(out)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    master, *listening = out.read_text().splitlines()
    assert master == "127.0.0.1"
    assert len(listening) >= 2, listening  # the rendezvous store and the master store
    assert all(a.startswith("127.0.0.1:") for a in listening), listening
    for rank in range(2):  # gloo's pairs listened on the address the hostname resolves to
        workers = Path(f"{out}.worker{rank}").read_text().splitlines()
        assert workers and all(a.startswith("127.0.0.1:") for a in workers), workers


def test_one_machine_runs_put_the_workers_sockets_on_loopback() -> None:
    from varuna_fx.launch.standalone import loopback_interfaces
    env = loopback_interfaces({})
    assert set(env) == {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
    assert env["GLOO_SOCKET_IFNAME"].startswith("lo")
    assert loopback_interfaces({"GLOO_SOCKET_IFNAME": "eth1"}) == \
        {"NCCL_SOCKET_IFNAME": env["NCCL_SOCKET_IFNAME"]}  # the user's choice is kept


WAITS_FOR_SIGTERM = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1] + ".saved").write_text("ok"),
                                          sys.exit(0)))
Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_the_launcher_stops_it_cleanly(tmp_path: Path) -> None:
    """What a spot supervisor sends: the workers got it and saved, but the launcher ended in a
    SignalException traceback with exit code 1, which reads as a crash."""
    script, ready = tmp_path / "worker.py", tmp_path / "ready"
    script.write_text(WAITS_FOR_SIGTERM)
    agent = subprocess.Popen(
        [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--nproc", "1", str(script),
         str(ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC})
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.2)
    assert ready.exists(), agent.communicate(timeout=30)
    agent.send_signal(signal.SIGTERM)
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 128 + signal.SIGTERM, (agent.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert "varuna-fx run: stopped by SIGTERM" in err
    assert (tmp_path / "ready.saved").read_text() == "ok"  # the worker was told and saved
