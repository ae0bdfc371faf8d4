"""A process joining a running in-place job must run the job's model and configuration
(``world/admission.py``; issue 42, item 8): one that differs was admitted and the morph then
failed on every survivor, which exited to resume from a checkpoint that did not exist. Here,
on a store in this process: rank 0 refuses it (it raises, naming the differences; the job
never morphs for it and its launcher does not start it again), and admits one that matches."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn

from varuna_fx.errors import DistributedError
from varuna_fx.launch.in_place import InPlaceLaunch, Worker
from varuna_fx.morph.fingerprint import fingerprint
from varuna_fx.options import CompileOptions
from varuna_fx.train.config import TrainConfig
from varuna_fx.world.admission import REFUSED_KEY, differences, plain
from varuna_fx.world.membership import Generation, Membership

JOB = TrainConfig(elastic=True, in_place=True).fingerprint()


def test_differences_name_each_key_with_both_values() -> None:
    other = {**JOB, "train.lr": "0.001"}
    other.pop("train.seed")
    assert differences(JOB, other) == [
        "train.lr: 0.001 in the joining process, 0.003 in the running job",
        "train.seed: (not given) in the joining process, 0 in the running job"]
    assert differences(JOB, JOB) == [] and differences({}, other) == []  # nothing offered


def test_the_train_fingerprint_leaves_out_what_each_machine_sets_itself() -> None:
    assert TrainConfig(nproc=3, local_addr="10.0.0.2", live=False).fingerprint() == \
        TrainConfig().fingerprint()
    assert differences(TrainConfig().fingerprint(), TrainConfig(n_layer=2).fingerprint()) == \
        ["train.n_layer: 2 in the joining process, 4 in the running job"]


class Small(nn.Module):
    def __init__(self, width: int = 4, act: Any = torch.relu) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def test_the_compile_fingerprint_is_the_model_and_the_options_that_shape_the_run() -> None:
    def of(model: nn.Module, **options: Any) -> dict[str, str]:
        return fingerprint(model, fx.symbolic_trace(model), CompileOptions(loss_fn=loss,
                                                                           **options))

    base = of(Small())
    assert of(Small()) == base  # another process building the same model offers the same
    assert of(Small(), timeout=5.0, dump="/tmp/x") == base  # per-process options left out
    assert [line.split(":")[0] for line in differences(base, of(Small(8)))] == ["model"]
    assert [line.split(":")[0] for line in differences(base, of(Small(act=torch.tanh)))] \
        == ["model"]
    assert differences(base, of(Small(), schedule="gpipe"))[0].startswith(
        "compile.schedule: 'gpipe' in the joining process")
    assert base["compile.loss_fn"] == f"{__name__}.loss"
    assert plain(object()) == "object"  # never an address


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                           wait_for_workers=False)
    yield server
    del server


def member(store: Any, name: str, print_: dict[str, str]) -> Membership:
    m = Membership(address=f"127.0.0.1:{store.port}", job="t", member=name, timeout=10.0,
                   window=1.0)  # wide enough that a loaded machine's pauses are not a loss
    m.offer(print_)
    return m


def running_job(store: Any) -> Membership:
    """Rank 0 of a job running generation 0 alone."""
    rank0 = member(store, "m0", JOB)
    rank0.connect()
    rank0.store.set("join/1", "m0")
    rank0.store.add("joins", 1)
    rank0.generation = rank0._publish(Generation(0, ("m0",), ("m0",), admitted=1,
                                                 running=True))
    return rank0


def joining(joiner: Membership) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["gen"] = joiner.join()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_rank_0_refuses_a_joiner_of_another_configuration_and_admits_its_own(
        store: Any) -> None:
    rank0 = running_job(store)
    wrong = member(store, "m1", {**JOB, "train.lr": "0.001"})
    thread, out = joining(wrong)
    deadline = time.monotonic() + 8
    while thread.is_alive():
        assert not rank0.joins_waiting(), "a joiner of another configuration was admitted"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert isinstance(out.get("error"), DistributedError), out
    text = str(out["error"])
    assert "m1 was refused by the running in-place job 't'" in text
    assert "train.lr: 0.001 in the joining process, 0.003 in the running job" in text
    assert "the job keeps running without it" in text
    assert not rank0.joins_waiting()  # settled: never waited for again
    # the launcher that started it sees the refusal and does not start it again
    launch = InPlaceLaunch(nproc=1, nnodes="1", rdzv_endpoint=f"127.0.0.1:{store.port}",
                           rdzv_id="t", local_addr=None, max_restarts=3, argv=[])
    worker = Worker(0, None)  # type: ignore[arg-type]
    assert not launch._refused(worker)
    name = launch.environment(0, 0)["VARUNA_FX_MEMBER"]
    rank0.store.set(REFUSED_KEY.format(member=name), "refused")
    # a TCPStore set is not answered: read it back on the same connection, so the server has
    # applied it before the launcher's own connection asks (in a job the joiner reads this
    # very key before it exits, and the launcher asks only after that exit)
    assert rank0.store.get(REFUSED_KEY.format(member=name)) == b"refused"
    assert launch._refused(worker)
    # one of the job's own configuration is admitted at the next boundary
    right = member(store, "m2", dict(JOB))
    thread, out = joining(right)
    while not rank0.joins_waiting():
        assert time.monotonic() < deadline + 4
        time.sleep(0.05)
    gen = rank0.after_boundary([False], None, None)
    thread.join(timeout=5)
    assert gen.members == ("m0", "m2") and out["gen"].members == ("m0", "m2")
    for m in (rank0, wrong, right):
        m.stop()
