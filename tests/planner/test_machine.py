"""The machine's overheads in the cost model (issue 41, item 1): planner/machine.py.

* a fixed cost per stage action: many small micro-batches cost what they cost;
* the FLOP rate as a function of the operation's size: a micro-batch of one runs its matmuls
  below the large ones' rate, so the prediction moves with the micro-batch size;
* ranks sharing cores are priced (contention), relative to how the profile was measured;
* precision: a bf16 model's compute at the measured bf16 speedup;
* the cached costs and the profile carrying them are checked when read back.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.ir.nodes import Affine
from varuna_fx.planner import machine
from varuna_fx.planner.cost_table import CostTable
from varuna_fx.planner.machine import CalibratedTimes, MachineCosts
from varuna_fx.planner.profile import ChunkProfile, Profile

FAKE = MachineCosts(device="cpu", threads=1, cores=2, op_launch=5e-6, backward_launch=5e-6,
                    action=1e-3, memory_bandwidth=1e10,
                    # 1 GFLOP/s at a kFLOP, 10 at a MFLOP, 50 at a GFLOP (launch excluded)
                    gemm_flops=(1e3, 1e6, 1e9),
                    gemm_seconds=(5e-6 + 1e-6, 5e-6 + 1e-4, 5e-6 + 2e-2), half_speedup=2.0)


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch) -> MachineCosts:
    monkeypatch.delenv(machine.MACHINE_ENV)  # (the suite's stated machine: conftest.py)
    monkeypatch.setattr(machine, "_MEASURED", {machine._key(): dataclasses.replace(
        FAKE, cores=machine._cores(), threads=torch.get_num_threads())})
    return machine.machine_costs()


@pytest.fixture(scope="module")
def graph() -> vf.planner.Analyzed:
    torch.manual_seed(0)
    return vf.planner.analyze(Regression(), (torch.randn(16, 32), torch.randn(16, 32)))


def _predicted(graph: vf.planner.Analyzed, micro_batch_size: int) -> float:
    """compile's prediction on this machine (``Cluster.local()``: this device, no stated
    throughput)."""
    cluster = vf.Cluster(gpus=1, device="cpu", device_type="cpu")
    return vf.planner.plan_for(graph, cluster, stages=1,
                               micro_batch_size=micro_batch_size).best.step_time


def test_the_rate_grows_with_the_operation_size() -> None:
    seconds = FAKE.compute_seconds(np.array([1e3, 1e6, 1e9, 1e10, 0.0]))
    rates = [f / s for f, s in zip([1e3, 1e6, 1e9, 1e10], seconds[:4])]
    assert rates == pytest.approx([1e9, 1e10, 5e10, 5e10], rel=1e-6)
    assert seconds[4] == 0.0
    assert FAKE.contention(1) == FAKE.contention(2) == 1.0 and FAKE.contention(4) == 2.0
    assert FAKE.precision_speedup("bfloat16") == 2.0 and FAKE.precision_speedup("float32") == 1


def test_every_action_pays_the_fixed_cost(graph: vf.planner.Analyzed,
                                          fake_machine: MachineCosts) -> None:
    """16 micro-batches of one: 16 forwards and 16 backwards, each 1 ms more than the one
    micro-batch of 16 (before: the same prediction for both, within the roofline's noise)."""
    one, sixteen = _predicted(graph, 16), _predicted(graph, 1)
    assert sixteen - one == pytest.approx(30 * fake_machine.action, rel=0.1)


def test_small_micro_batches_run_below_the_rate(graph: vf.planner.Analyzed,
                                                fake_machine: MachineCosts) -> None:
    table = CostTable.build(graph.gm)
    times = CalibratedTimes.of(table, fake_machine)
    per_sample = [float(times.arrays(b).forward.sum()) / b for b in (1, 16)]
    assert per_sample[0] > 3 * per_sample[1]
    shared = CalibratedTimes.of(table, fake_machine, contention=2.0, speedup=2.0)
    assert shared.arrays(4).forward == pytest.approx(times.arrays(4).forward)
    assert shared.action == 2 * fake_machine.action


def test_contention_is_priced_relative_to_the_profile(graph: vf.planner.Analyzed) -> None:
    table = CostTable.build(graph.gm)
    chunk = ChunkProfile(list(table.names), Affine(0.0, 1e-3), Affine(0.0, 1e-3),
                         Affine(0.0, 2e-3), Affine(0.0, 1e3),
                         samples={1: (1e-3, 1e-3, 2e-3, 1e3), 16: (16e-3, 16e-3, 32e-3, 16e3)})
    profile = Profile("k", "g", "cpu", "cpu", "float32", 1, [1, 16], [chunk],
                      machine=FAKE, ranks=1)
    alone = profile.measured_times(table, 1).arrays(8).forward.sum()
    four = profile.measured_times(table, 4)  # 4 ranks on 2 cores, measured by one
    assert four.arrays(8).forward.sum() == pytest.approx(2 * alone)
    assert four.action == pytest.approx(2 * FAKE.action)
    measured_by_four = dataclasses.replace(profile, ranks=4)
    assert measured_by_four.measured_times(table, 4).arrays(8).forward.sum() == \
        pytest.approx(alone)
    # in CPU time the four that measured together saw no contention: the run's is priced
    cpu_by_four = dataclasses.replace(profile, ranks=4, cpu_clock=True)
    assert cpu_by_four.measured_times(table, 4).arrays(8).forward.sum() == \
        pytest.approx(2 * alone)
    again = Profile.from_json(cpu_by_four.to_json())
    assert again.machine == FAKE and again.ranks == 4 and again.cpu_clock


def test_cached_costs_are_checked_when_read(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = json.dumps(dataclasses.asdict(FAKE))
    assert machine.from_json(good) == FAKE
    for bad in ({"op_launch": float("nan")}, {"memory_bandwidth": -1.0},
                {"gemm_seconds": []}, {"action": True}):
        with pytest.raises((ValueError, TypeError)):
            machine.from_json(json.dumps({**dataclasses.asdict(FAKE), **bad}))
    # a bad file in the cache is measured again, not used
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(machine.MACHINE_ENV)  # (the suite's stated machine: conftest.py)
    monkeypatch.setattr(machine, "_MEASURED", {})
    monkeypatch.setattr(machine, "measure_machine", lambda: FAKE)
    path = tmp_path / "machine" / f"{machine._key()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**dataclasses.asdict(FAKE), "op_launch": -5.0}))
    assert machine.machine_costs() == FAKE


def test_gpus_on_paper_run_small_micro_batches_far_below_peak() -> None:
    """docs/gpu_costs.md: a bf16 8192 x 8192 layer at 1 row is bound by reading its weight."""
    for kind, peak in (("a100", 312e12), ("h100", 989e12), ("h200", 989e12)):
        costs = machine.paper_costs(kind)
        rates = [f / (s - costs.op_launch) for f, s in zip(costs.gemm_flops, costs.gemm_seconds)]
        assert rates[0] < 0.02 * peak and rates[-1] == pytest.approx(0.75 * peak)
        assert rates == sorted(rates)
    assert machine.paper_costs("h200").gemm_seconds[0] < machine.paper_costs("h100").gemm_seconds[0]
