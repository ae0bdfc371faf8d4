"""The machine's own overheads, measured where the job runs and cached: what FLOP counts and a
profile's chunk times leave out.

:class:`MachineCosts` holds, for this device, thread count and core set (measured in about a
quarter of a second by :func:`machine_costs`, cached as JSON under
``$VARUNA_FX_CACHE_DIR/machine``):

* ``op_launch``: seconds to dispatch one operation (a one-element add: CPU dispatch; on a GPU
  the kernel launch);
* ``action``: the fixed cost of one stage action (a forward, recompute or backward of one
  micro-batch) beyond its operations: leaves made, the graph module called with autograd, the
  backward engine started (an autograd round trip through a one-operation graph, less its two
  operations). The planner adds it to every action of every stage, so many small
  micro-batches cost what they cost;
* the matrix-multiply rate as a function of the operation's size: ``gemm_flops`` /
  ``gemm_seconds`` (and ``gemm_backward_seconds``) of a linear layer 512 -> 512 recorded for
  autograd, from one row to 1024, forward and backward, so a micro-batch of 1
  runs its matmuls far below the large ones' rate (log-log interpolation between them,
  ``compute_seconds``);
* ``memory_bandwidth``: bytes/s of a large copy;
* ``half_speedup``: how much faster a bf16 matmul runs than fp32 (precision is priced: a
  bf16 model's compute is divided by it; CPUs without bf16 units measure below 1);
* ``cores``: the cores this process may run on (``os.sched_getaffinity``), so ranks sharing
  them are priced (``contention``).

Without a profile, :class:`CalibratedTimes` prices each node from these numbers instead of the
datasheet roofline (``cost_table.CostTable.estimate``); with one, the profile carries its own
``MachineCosts`` (measured with it) and the planner adds ``action`` per action and the
contention of the run's ranks per node over the profile's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import VarunaFxError
from ..world import safe_json, switches
from ..world.files import cache_dir, write_atomically
from ..world.where import in_process_group
from . import learned
from .cluster import Cluster, local_device_type
from .cost_table import CoreSharing, CostTable, NodeArrays, PerNodeTimes
from .steady import round_significant

FORMAT = 2  # 2: the backward of each linear layer timed too
MACHINE_ENV = "VARUNA_FX_MACHINE"  # a JSON file of MachineCosts to plan with instead of measuring
# (rows, inner, columns) of the timed matmuls: from one row (a micro-batch of one through a
# small linear layer) to a square matrix large enough to run near the machine's peak
GEMM_SHAPES = ((1, 512, 512), (4, 512, 512), (16, 512, 512), (64, 512, 512),
               (256, 512, 512), (1024, 512, 512))


@dataclass(frozen=True)
class MachineCosts:
    device: str
    threads: int
    cores: int
    op_launch: float  # seconds per forward operation (recorded for autograd)
    backward_launch: float  # seconds per backward operation (a forward op makes about two)
    action: float
    memory_bandwidth: float
    gemm_flops: tuple[float, ...]
    gemm_seconds: tuple[float, ...]
    half_speedup: float = 1.0
    # seconds of each measured linear layer's backward (its input's and weight's gradients,
    # about twice the forward's FLOPs; slower per FLOP: the weight gradient's inner dimension
    # is the micro-batch); empty: priced at the forward's rate
    gemm_backward_seconds: tuple[float, ...] = ()
    # a stated machine only (never measured here: compiled_speed.py measures it per model):
    # eager over compiled time of any model's stages, and the compile's seconds, so plans with
    # compile_stages priced alike on every host (None: no factor stated)
    compiled_speedup: float | None = None
    compile_seconds: float = 0.0

    def __post_init__(self) -> None:  # (read back from JSON: lists)
        for name in ("gemm_flops", "gemm_seconds", "gemm_backward_seconds"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    @property
    def peak_flops(self) -> float:
        """The best measured rate (FLOP/s), launch excluded."""
        return max(f / max(s - self.op_launch, 1e-12)
                   for f, s in zip(self.gemm_flops, self.gemm_seconds))

    def compute_seconds(self, flops: np.ndarray, backward: bool = False) -> np.ndarray:
        """Seconds of operations of ``flops`` each, launch excluded: the rate at that size
        interpolated in log-log between the measured matmuls, below the smallest at the
        smallest's rate, above the largest at the best rate. ``backward``: ``flops`` of a
        backward (about twice its forward's), at the measured backwards' rate."""
        f = np.asarray(flops, dtype=float)
        sizes = np.log(np.asarray(self.gemm_flops))
        if backward and self.gemm_backward_seconds:
            f = f / 2  # the forward's size: what the backward's rate was measured by
            rates = np.array([2 * fl / max(s - 2 * self.backward_launch, 1e-12) for fl, s in
                              zip(self.gemm_flops, self.gemm_backward_seconds)])
            rates = np.maximum.accumulate(rates)
            rate = np.exp(np.interp(np.log(np.maximum(f, 1.0)), sizes, np.log(rates)))
            return np.where(f > 0, 2 * f / rate, 0.0)
        rates = np.array([fl / max(s - self.op_launch, 1e-12)
                          for fl, s in zip(self.gemm_flops, self.gemm_seconds)])
        rates = np.maximum.accumulate(rates)  # a bigger matmul never runs slower per FLOP
        rate = np.exp(np.interp(np.log(np.maximum(f, 1.0)), sizes, np.log(rates)))
        return np.where(f > 0, f / rate, 0.0)

    def contention(self, ranks_per_node: int) -> float:
        """How much slower compute runs with ``ranks_per_node`` ranks of ``threads`` threads
        each sharing this process's cores: 1 while each has its own."""
        return max(1.0, ranks_per_node * self.threads / max(self.cores, 1))

    def precision_speedup(self, dtype: str) -> float:
        return self.half_speedup if dtype in ("bfloat16", "float16", "bf16", "fp16") else 1.0


@dataclass
class CalibratedTimes(PerNodeTimes):
    """Per-node costs from a graph's FLOPs and bytes priced with this machine's numbers: an
    operation costs ``op_launch`` plus the larger of its FLOPs at the rate of its size and
    its bytes over the memory bandwidth; a backward twice the forward's operations, each
    of about the forward's size; everything times the contention of the ranks sharing the
    cores, over the precision's speedup. Implements what ``cost_table.MeasuredTimes`` does
    for the planner and the partition pass (``arrays``, ``step_times``,
    ``activation_bytes``, ``reseed``, ``action``). Make one with :meth:`of`."""

    names: list[str]
    machine: MachineCosts
    contention: float = 1.0
    speedup: float = 1.0
    reseed: float = 0.0
    step: float = 0.0  # seconds outside the step's actions (learned.py)
    learn_key: str | None = None
    sharing: CoreSharing | None = None  # ranks sharing the cores (cost_table.CoreSharing)
    # (the table it prices: not a setting of its own, and it holds this object)
    table: CostTable | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, table: CostTable, machine: MachineCosts, contention: float = 1.0,
           speedup: float = 1.0) -> CalibratedTimes:
        made = cls(list(table.names), machine, contention, speedup,
                   sharing=CoreSharing(machine.threads, machine.cores, contention))
        made.table = table
        return made

    @property
    def action(self) -> float:
        return self.machine.action * self.contention

    def arrays(self, b: int) -> NodeArrays:
        t, m = self.table, self.machine
        assert t is not None
        ff, bf = t.fwd_flops[0] + t.fwd_flops[1] * b, t.bwd_flops[0] + t.bwd_flops[1] * b
        moved = t.moved[0] + t.moved[1] * b
        launch = m.op_launch
        fwd = launch + np.maximum(m.compute_seconds(ff), np.where(ff > 0, moved, 0.0)
                                  / m.memory_bandwidth)
        bwd = np.where(bf > 0, 2 * m.backward_launch + np.maximum(
            m.compute_seconds(bf, backward=True), 2 * moved / m.memory_bandwidth), 0.0)
        scale = self.contention / max(self.speedup, 1e-9)
        fwd, bwd = fwd * scale, bwd * scale
        return NodeArrays(fwd, fwd, bwd, t.activations[0] + t.activations[1] * b)


def planning_times(table: CostTable, cluster: Cluster, profile: Any = None,
                   dtype: str = "float32", agree: bool = True, graph: str = "") -> None:
    """Set ``table.measured`` to what the planner prices ``cluster`` with: ``profile``'s
    times where it applies (scaled for the ranks sharing the cores, plus the action cost);
    else, on this machine's own kind of device with no stated throughput (``Cluster.local``),
    this machine's calibrated costs (``CalibratedTimes``; with ``agree``, rank 0's in a
    launched job, a collective every rank must reach: compile's configure step); else
    nothing (the device spec's roofline). Either measured kind also carries the step's
    overhead outside its actions, learned for ``graph`` (its ``graph_hash``) on this world
    or estimated (``learned.py``; rank 0's with ``agree``)."""
    sharing = ranks_sharing(cluster.kind, cluster.gpus_per_node)
    if profile is not None and profile.applies_to(cluster):
        table.measured = profile.measured_times(table, sharing)
        network = profile.network or cluster.network
        threads = profile.threads
    else:
        if cluster.flops is not None or cluster.device_type is None or \
                cluster.kind != _device() or cluster.kind != "cpu":
            return
        costs = agreed_machine_costs() if agree else machine_costs()
        table.measured = CalibratedTimes.of(table, costs, costs.contention(sharing),
                                            costs.precision_speedup(dtype))
        network, threads = cluster.network, costs.threads
    key = learned.learn_key(graph, cluster.gpus, cluster.gpus_per_node, cluster.kind,
                            threads, dtype) if graph and learns() else None
    found = _agreed(learned.recall(key)) if agree else learned.recall(key)
    table.measured.learn_key = key
    table.measured.step = found if found is not None else \
        learned.estimated_step_overhead(cluster.gpus, network)


def learns() -> bool:
    """Whether plans use what their first steps taught (``learned.py``): not on a stated
    machine (``$VARUNA_FX_MACHINE``: the same plans on every host, whatever ran before), nor
    with ``$VARUNA_FX_LEARN=off``."""
    return not switches.read(MACHINE_ENV) and switches.read(learned.LEARN_ENV) != "off"


def _agreed(value: float | None) -> float | None:
    """``value``, rank 0's in a process group (every rank must call it then)."""
    found = [value]
    if in_process_group():
        dist.broadcast_object_list(found, src=0)
    return found[0]


def paper_costs(kind: str, rows: Sequence[int] = (1, 8, 64, 512, 4096)) -> MachineCosts:
    """A datacenter GPU's terms on paper (docs/gpu_costs.md: the figures and their sources;
    nothing here was measured on one): ``kind`` "a100", "h100" or "h200". The matmul rate
    by size is the roofline of a bf16 ``rows x 8192 x 8192`` GEMM at the datasheet's dense
    peak (times ``GEMM_EFFICIENCY``) and HBM bandwidth (a small micro-batch is bound by
    reading the weights), plus the launch. Not priced by default (a ``Cluster`` of GPUs
    keeps its spec's roofline); for planning on paper and the table in docs/gpu_costs.md."""
    peak, bandwidth = PAPER[kind]
    k = n = 8192
    flops = tuple(2.0 * m * k * n for m in rows)
    seconds = tuple(GPU_LAUNCH + max(f / (peak * GEMM_EFFICIENCY),
                                     2.0 * (m * k + k * n + m * n) / bandwidth)
                    for f, m in zip(flops, rows))
    return MachineCosts(device=kind, threads=1, cores=1, op_launch=GPU_LAUNCH,
                        backward_launch=GPU_LAUNCH, action=GPU_ACTION,
                        memory_bandwidth=bandwidth, gemm_flops=flops, gemm_seconds=seconds,
                        half_speedup=1.0)


# Datasheet figures (docs/gpu_costs.md): dense bf16 tensor-core FLOP/s (without sparsity) and
# HBM bytes/s of the SXM parts
PAPER: dict[str, tuple[float, float]] = {
    "a100": (312e12, 2.039e12),  # A100 80GB SXM
    "h100": (989e12, 3.35e12),  # H100 SXM
    "h200": (989e12, 4.8e12),  # H200 SXM: H100's compute, HBM3e
}
GEMM_EFFICIENCY = 0.75  # assumed share of the dense peak a large GEMM sustains (docs/gpu_costs.md)
GPU_LAUNCH = 5e-6  # seconds per kernel as PyTorch eager issues it (launch + dispatch)
GPU_ACTION = 50e-6  # seconds of fixed cost per stage action (graph call, autograd start)


def ranks_sharing(kind: str, ranks_per_node: int) -> int:
    """Ranks that share one machine's cores: all of a node's on a CPU cluster, none on GPUs
    (each rank computes on its own device)."""
    return max(1, ranks_per_node) if kind == "cpu" else 1


# -- measuring ---------------------------------------------------------------------------------


def _clock() -> Callable[[], float]:
    """CPU time with one torch thread (immune to other processes, as the profiler's clock),
    else wall time."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _median_time(fn: Callable[[], Any], inner: int, repeats: int = 5) -> float:
    clock = _clock()
    fn()  # warm
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - start) / inner)
    return statistics.median(samples)


class _OneOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x * 2.0}


def measure_machine() -> MachineCosts:
    """This process's machine, measured now (about a quarter of a second on a CPU)."""
    one = torch.zeros(1)
    # an operation as a model runs it: a one-row linear layer recorded for autograd, and the
    # backward of it (its input's and its weight's gradient: two operations)
    row, weight = torch.zeros(1, 4), torch.zeros(4, 4, requires_grad=True)
    with torch.enable_grad():
        launch = _median_time(lambda: torch.nn.functional.linear(row, weight), 200)
        grad = torch.ones(1, 4)

        def backward() -> None:
            torch.autograd.backward([torch.nn.functional.linear(row, weight)], [grad])

        backward_launch = max(_median_time(backward, 100) - launch, 0.0) / 2
    gm = fx.symbolic_trace(_OneOp())
    seed = torch.ones(1)

    def action() -> None:
        x = one.detach().requires_grad_(True)
        with torch.enable_grad():
            out = gm(x)
        torch.autograd.backward([out["y"]], [seed])

    round_trip = _median_time(action, 50)
    flops, seconds, backwards = [], [], []
    with torch.enable_grad():  # linear layers as a model runs them: recorded, then backward
        for rows, inner, cols in GEMM_SHAPES:
            a = torch.randn(rows, inner, requires_grad=True)
            w = torch.randn(cols, inner, requires_grad=True)
            bias = torch.randn(cols, requires_grad=True)
            seed = torch.ones(rows, cols)
            work = 2.0 * rows * inner * cols
            inner_reps = max(1, int(2e7 // work))
            forward = _median_time(lambda a=a, w=w, bias=bias: torch.nn.functional.linear(
                a, w, bias), inner_reps, 3)

            def both(a: torch.Tensor = a, w: torch.Tensor = w, bias: torch.Tensor = bias,
                     seed: torch.Tensor = seed) -> None:
                torch.autograd.backward([torch.nn.functional.linear(a, w, bias)], [seed])

            backwards.append(max(_median_time(both, inner_reps, 3) - forward, forward))
            seconds.append(forward)
            flops.append(work)
    big = torch.empty(2**23)  # 32 MiB: beyond the caches
    src = torch.randn(2**23)
    copy = _median_time(lambda: big.copy_(src), 3, 3)
    half = torch.randn(256, 256, dtype=torch.bfloat16)
    single = torch.randn(256, 256)
    speedup = _median_time(lambda: single @ single, 5, 3) / \
        max(_median_time(lambda: half @ half, 5, 3), 1e-12)
    action_cost = max(round_trip - 2 * launch - backward_launch, 0.0)
    return rounded_costs(MachineCosts(
        device=_device(), threads=torch.get_num_threads(), cores=_cores(),
        op_launch=launch, backward_launch=backward_launch, action=action_cost,
        memory_bandwidth=2 * big.numel() * 4 / max(copy, 1e-12),
        gemm_flops=tuple(flops), gemm_seconds=tuple(seconds), half_speedup=speedup,
        gemm_backward_seconds=tuple(backwards)))


def rounded_costs(costs: MachineCosts) -> MachineCosts:
    """Every measured number at the links' stated resolution (``steady.SIGNIFICANT``
    figures): a re-measurement that moves a little prices the same."""
    def r(x: float) -> float:
        return round_significant(x)

    return dataclasses.replace(
        costs, op_launch=r(costs.op_launch), backward_launch=r(costs.backward_launch),
        action=r(costs.action), memory_bandwidth=r(costs.memory_bandwidth),
        half_speedup=r(costs.half_speedup),
        gemm_seconds=tuple(r(x) for x in costs.gemm_seconds),
        gemm_backward_seconds=tuple(r(x) for x in costs.gemm_backward_seconds))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _device() -> str:
    return local_device_type()


def _key() -> str:
    text = json.dumps([FORMAT, _device(), torch.get_num_threads(), _cores(),
                       torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_MEASURED: dict[str, MachineCosts] = {}


def machine_costs() -> MachineCosts:
    """This machine's costs: from this process's memory, the cache on disk, or measured now
    (and cached). A cached file is used only when every number in it is finite and
    positive (and the key, device, threads and cores are this process's)."""
    stated = switches.read(MACHINE_ENV)
    key = _key() + (f"@{stated}" if stated else "")
    if key in _MEASURED:
        return _MEASURED[key]
    if stated:  # a stated machine: the same plans on every host (the test suite's)
        try:
            _MEASURED[key] = from_json(Path(stated).read_text())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise VarunaFxError(f"${MACHINE_ENV}={stated!r} is not a machine's costs ({exc}): "
                                "give a JSON file as planner/machine.py writes them, or unset "
                                "it to measure this machine") from exc
        return _MEASURED[key]
    path = cache_dir("machine") / f"{key}.json"
    found = None
    try:
        found = from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        found = None
    if found is None or found.device != _device() or found.threads != torch.get_num_threads() \
            or found.cores != _cores():
        found = measure_machine()
        try:
            write_atomically(path.parent, path.name, json.dumps(dataclasses.asdict(found)))
        except OSError as exc:
            warnings.warn(f"could not cache the machine's costs in {path.parent}: {exc}",
                          stacklevel=2)
    _MEASURED[key] = found
    return found


def agreed_machine_costs() -> MachineCosts:
    """``machine_costs()``, rank 0's in a process group (every rank must call it then): the
    ranks plan alike."""
    found: list[MachineCosts | None] = [machine_costs()]
    if in_process_group():
        dist.broadcast_object_list(found, src=0)
    assert found[0] is not None
    return found[0]


def from_json(text: str) -> MachineCosts:
    """A ``MachineCosts`` from its JSON, refused (ValueError) unless every number is finite
    and positive where it must be."""
    data = safe_json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not an object")
    costs = MachineCosts(**data)
    numbers = [costs.op_launch, costs.backward_launch, costs.action, costs.memory_bandwidth, costs.half_speedup,
               *costs.gemm_flops, *costs.gemm_seconds, *costs.gemm_backward_seconds,
               costs.compile_seconds,
               *(() if costs.compiled_speedup is None else (costs.compiled_speedup,))]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
               and x >= 0 for x in numbers) or not costs.gemm_flops or \
            len(costs.gemm_flops) != len(costs.gemm_seconds) or \
            len(costs.gemm_backward_seconds) not in (0, len(costs.gemm_flops)) or \
            min(costs.gemm_flops) <= 0 or min(costs.gemm_seconds) <= 0 or \
            costs.memory_bandwidth <= 0 or costs.half_speedup <= 0 or \
            costs.compiled_speedup == 0:
        raise ValueError("a number that is not finite and positive")
    return costs
