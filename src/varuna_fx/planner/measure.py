"""The profiler: time the graph's pieces on this device at several micro-batch sizes.

The compute nodes are grouped into contiguous chunks of similar estimated cost, cut only where
the partitioner may cut (so a chunk is what a stage could be made of), and each chunk becomes a
GraphModule exactly as a stage does (``split_stages``: received values are placeholders,
replicable nodes are recomputed inside). The chunks run in order on the real example inputs
(repeated when a size exceeds the example batch), so every chunk sees realistic values: valid
token ids, real masks. Per size and chunk: the forward without autograd, the forward with it
(a recompute) and the backward, after warm-up, as the median of repeats interleaved over the
chunks so slow drift hits all alike; then a least-squares ``const + per_sample * b`` fit.
Memory: the bytes autograd saves for the backward (CPU), or the allocator's peak over forward
and backward (GPU).

Sizes: 1, 2, 4 ... 32 (capped by the example batch) and the example batch itself up to 128 (the
planner may run it as one micro-batch). For a split-backward schedule ``compile`` hands the
profiler the runtime's own split (``runtime/split_backward.input_grads``; the planner sits below
the runtime) and each chunk's input-gradient and weight passes are timed too (together 14-17%
more than the fused backward on the bench GPT; ``tests/planner/test_profile_split.py``). Per-node costs
spread each chunk's time in proportion to the estimates. Activation memory counts each distinct
view autograd saves once (not the storages they view: whether a reshape is a view depends on
the batch size, which no affine fit follows).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from rich.progress import Progress

from ..capture.buffers import buffers_kept
from ..capture.inputs import BoundInputs
from ..ir.nodes import Affine
from ..passes.assign_stages import compute_nodes, trainable_names
from ..passes.split_stages import split_stages
from ..world.where import in_process_group, local_world_size
from .cluster import local_device_type
from .cost_table import CostTable
from .machine import machine_costs
from .profile import ChunkProfile, Profile, graph_hash


@dataclass(frozen=True)
class ProfileSettings:
    # micro-batch sizes, capped by the example batch (and the batch itself when it falls
    # between two, or lies above them up to ``largest``): the planner interpolates between
    # measured sizes, so they should cover the ones it may pick -- extrapolating small sizes'
    # per-sample cost to big micro-batches overstated an MLP's backward on a CPU, and
    # extrapolating from 32 to 128 was off either way (bench/RESULTS.md, "Figures the code
    # cites"; planner/cost_table.py: interpolate)
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    largest: int = 128
    repeats: int = 7
    warmup: int = 2
    min_piece: float = 1e-3  # seconds: smaller pieces are too noisy to time
    max_chunks: int = 48
    # "wall", or "cpu": this process's CPU time, immune to other processes competing for the
    # cores -- equal to wall time for single-threaded CPU work. "auto": cpu when torch runs
    # on one CPU thread, else wall.
    clock: str = "auto"
    # the runtime's split backward (``runtime.split_backward.input_grads``, passed in by the
    # compiler: the planner sits below the runtime): when given, every chunk's backward is
    # also timed split into its input-gradient pass (I) and its weight pass (W), as a
    # split-backward schedule runs it -- together they cost more than the fused backward
    split: Callable[..., Any] | None = field(default=None, compare=False)

    def key(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "largest": self.largest, "repeats": self.repeats,
                "warmup": self.warmup,
                "min_piece": self.min_piece, "max_chunks": self.max_chunks,
                **({"split": True} if self.split is not None else {})}

    def timer(self, device: torch.device) -> Callable[[], float]:
        cpu = self.clock == "cpu" or (self.clock == "auto" and device.type == "cpu"
                                      and torch.get_num_threads() == 1)
        return time.process_time if cpu else time.perf_counter


@dataclass
class _Chunk:
    module: fx.GraphModule
    nodes: list[str]
    inputs: list[str]  # model inputs it reads
    received: list[str]  # values from earlier chunks
    needs_grad: list[bool]  # per received value


def measure(gm: fx.GraphModule, bound: BoundInputs, key: str,
            settings: ProfileSettings = ProfileSettings()) -> Profile:
    device = _device_of(gm)
    sizes = sorted({min(s, bound.batch_size) for s in settings.sizes})
    if sizes[-1] < bound.batch_size <= settings.largest:  # the batch as one micro-batch
        sizes.append(bound.batch_size)
    table = CostTable.build(gm)
    saved_grads = {p: p.grad for p in gm.parameters()}
    devices = [device] if device.type == "cuda" else []
    try:
        # timing runs are not training: BatchNorm statistics stay as the user left them
        with torch.random.fork_rng(devices=devices), buffers_kept(gm):
            torch.manual_seed(0)
            bounds = _boundaries(gm, bound, table, sizes[0], device, settings)
            chunks = _build_chunks(gm, bounds)
            samples, spread = _time_all(chunks, bound, sizes, device, settings)
    finally:
        for p, g in saved_grads.items():
            p.grad = g
    profiles = []
    for k, chunk in enumerate(chunks):
        per_size = {b: samples[b][k] for b in sizes}
        fits = [_fit(sizes, [per_size[b][i] for b in sizes]) for i in range(4)]
        profiles.append(ChunkProfile(chunk.nodes, *fits, samples=per_size))
    return Profile(
        key=key, graph=graph_hash(gm), device=local_device_type(), device_name=_device_name(device),
        dtype=str(_dtype_of(gm)).replace("torch.", ""), threads=torch.get_num_threads(),
        sizes=sizes, chunks=profiles, reseed=_reseed_time(device, settings),
        machine=machine_costs(), ranks=_ranks_measuring(), spread=spread,
        cpu_clock=settings.timer(device) is time.process_time,
    )


def _ranks_measuring() -> int:
    """Ranks of this node profiling at once (``resolve.profile_here``: every rank of a
    launched job measures together), which shared the cores while they measured."""
    return local_world_size() if in_process_group() else 1


def _reseed_time(device: torch.device, settings: ProfileSettings) -> float:
    """What the runtime adds around every forward/recompute of a stage with random ops: fork
    the RNG state and seed it for the micro-batch (``torch.manual_seed`` also seeds every
    accelerator backend, which is not free)."""
    clock = settings.timer(device)
    devices = [device] if device.type == "cuda" else []
    times = []
    for i in range(25):
        start = clock()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(i)
        times.append(clock() - start)
    return statistics.median(times[5:])


def _fit(sizes: list[int], values: list[float]) -> Affine:
    """Least squares ``const + per_sample * b`` in relative terms (so the small sizes fit as
    well as the big ones); through the origin with one size."""
    if len(sizes) == 1:
        return Affine(0.0, values[0] / sizes[0])
    y = np.asarray(values, float)
    weight = 1.0 / np.maximum(np.abs(y), 1e-12)
    slope, const = np.polyfit(np.asarray(sizes, float), y, 1, w=weight)
    return Affine(float(const), float(slope))


def _device_of(gm: fx.GraphModule) -> torch.device:
    for t in [*gm.parameters(), *gm.buffers()]:
        return t.device
    return torch.device("cpu")


def _dtype_of(gm: fx.GraphModule) -> torch.dtype:
    return next((p.dtype for p in gm.parameters()), torch.float32)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(bound: BoundInputs, b: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The example batch cut or repeated to ``b`` samples."""
    out = {}
    for name, t in bound.tensors.items():
        reps = -(-b // t.shape[0])
        # a copy, not a slice: a slice would keep (and the memory count charge) all samples
        out[name] = t.repeat(reps, *([1] * (t.dim() - 1)))[:b].to(device).clone()
    return out


# -- chunks ------------------------------------------------------------------------------------


class _NodeTimer(fx.Interpreter):
    """Runs the graph, timing every compute node's forward (for choosing chunk boundaries)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device,
                 clock: Callable[[], float]) -> None:
        super().__init__(gm)
        self.device = device
        self.clock = clock
        self.times: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        _sync(self.device)
        start = self.clock()
        value = super().run_node(n)
        _sync(self.device)
        elapsed = self.clock() - start
        self.times[n] = min(elapsed, self.times.get(n, elapsed))
        return value


def _boundaries(gm: fx.GraphModule, bound: BoundInputs, table: CostTable, b: int,
                device: torch.device, settings: ProfileSettings) -> list[int]:
    """Node positions cutting the graph into chunks of similar *measured* forward time (FLOP
    estimates are too rough for small pieces), as many as keep each above ``min_piece``."""
    args = list(_inputs(bound, b, device).values())
    clock = settings.timer(device)
    timer = _NodeTimer(gm, device, clock)
    whole = math.inf
    with torch.no_grad():
        for _ in range(3):
            timer.run(*args)
            _sync(device)
            start = clock()
            gm(*args)
            _sync(device)
            whole = min(whole, clock() - start)
    cost = np.array([timer.times.get(n, 0.0) for n in compute_nodes(gm)])
    cost = np.maximum(cost - cost.min(initial=0.0), 0.0)  # the interpreter's own overhead
    count = int(max(1, min(settings.max_chunks, table.num_units, whole // settings.min_piece)))
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    at_units = prefix[table.units]
    targets = np.arange(1, count) * prefix[-1] / count
    picks = np.clip(np.searchsorted(at_units, targets), 1, len(table.units) - 2)
    inner = sorted({int(table.units[i]) for i in picks} - {0, len(cost)})
    return [0, *inner, len(cost)]


def _build_chunks(gm: fx.GraphModule, bounds: list[int]) -> list[_Chunk]:
    """One GraphModule per chunk, made by the stage splitter (chunks given as a map, so the
    shared annotated graph is not touched)."""
    nodes = compute_nodes(gm)
    chunk_of = {n: k for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])) for n in nodes[lo:hi]}
    graphs = split_stages(gm, len(bounds) - 1, trainable_names(gm), chunk_of)
    chunks = []
    for sg in graphs:
        recvs = {t.name: t.requires_grad for t in sg.spec.recvs}
        chunks.append(_Chunk(fx.GraphModule(gm, sg.graph), list(sg.spec.nodes),
                             list(sg.spec.inputs), list(recvs), list(recvs.values())))
    return chunks


# -- timing ------------------------------------------------------------------------------------


def _time_all(chunks: list[_Chunk], bound: BoundInputs, sizes: list[int], device: torch.device,
              settings: ProfileSettings
              ) -> tuple[dict[int, list[tuple[float, float, float, float]]], float]:
    """Per size, each chunk's median times and memory; and the timings' relative spread
    (``Profile.spread``)."""
    rounds = settings.warmup + settings.repeats
    quiet = not sys.stderr.isatty() or "PYTEST_CURRENT_TEST" in os.environ
    result: dict[int, list[tuple[float, float, float, float]]] = {}
    spreads: list[float] = []
    with Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("profiling", total=len(sizes) * rounds * len(chunks))
        for b in sizes:
            args = _chunk_args(chunks, _inputs(bound, b, device))
            memory = [_memory(c, a, device) for c, a in zip(chunks, args)]
            times: list[list[tuple[float, ...]]] = [[] for _ in chunks]
            for r in range(rounds):
                for k, chunk in enumerate(chunks):
                    timed = _time_once(chunk, args[k], device, settings.timer(device),
                                       settings.split)
                    if r >= settings.warmup:
                        times[k].append(timed)
                    progress.advance(task)
            # (forward, recompute, backward, memory[, input-gradient pass, weight pass])
            result[b] = [(*(statistics.median(t[i] for t in ts) for i in range(3)), mem,
                          *(statistics.median(t[i] for t in ts) for i in range(3, len(ts[0]))))
                         for ts, mem in zip(times, memory)]
            spreads += [_relative_iqr([sum(t[:3]) for t in ts]) for ts in times]
    return result, statistics.median(spreads) if spreads else 0.0


def _relative_iqr(values: list[float]) -> float:
    """The interquartile range of ``values`` over their median (0 for fewer than 4)."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    middle = statistics.median(values)
    return (q[2] - q[0]) / middle if middle > 0 else 0.0


def _chunk_args(chunks: list[_Chunk], inputs: dict[str, torch.Tensor]) -> list[list[Any]]:
    """Run the chunks in order once, collecting each one's arguments.

    A value crossing a chunk boundary is copied into a tensor of its own, as a stage receives
    it: a view would share its producer's storage (q, k, v slice one qkv tensor; at batch 1 a
    reshape is a view, at larger batches a copy), and the saved-tensor count would charge that
    whole storage at some batch sizes only, which no const + per_sample * b can fit."""
    values: dict[str, Any] = dict(inputs)
    args = []
    with torch.no_grad():
        for chunk in chunks:
            args.append([_own(values[n]) for n in (*chunk.inputs, *chunk.received)])
            values.update(chunk.module(*args[-1]))
    return args


def _own(value: Any) -> Any:
    return value.clone(memory_format=torch.contiguous_format) \
        if isinstance(value, torch.Tensor) else value


def _leaves(chunk: _Chunk, args: list[Any]) -> list[Any]:
    flags = [False] * len(chunk.inputs) + chunk.needs_grad
    return [a.detach().requires_grad_(True) if g and a.dtype.is_floating_point else a
            for a, g in zip(args, flags)]


def _graph_outputs(out: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in out.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _time_once(chunk: _Chunk, args: list[Any], device: torch.device,
               clock: Callable[[], float], split: Callable[..., Any] | None = None
               ) -> tuple[float, ...]:
    """(forward, recompute, backward) seconds of one micro-batch through the chunk; with
    ``split``, also its input-gradient and weight passes (a chunk without inputs that need a
    gradient runs its whole backward as the weight pass, as the runtime does)."""
    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        _sync(device)
        start = clock()
        value = fn()
        _sync(device)
        return value, clock() - start

    with torch.no_grad():
        _, forward = timed(lambda: chunk.module(*args))
    leaves = _leaves(chunk, args)
    with torch.enable_grad():
        out, recompute = timed(lambda: chunk.module(*leaves))
    tensors = _graph_outputs(out)
    seeds = [torch.ones_like(t) for t in tensors]
    backward = 0.0
    if tensors:
        _, backward = timed(lambda: torch.autograd.backward(tensors, seeds))
    if split is None:
        return forward, recompute, backward
    wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if not tensors or not wanted:
        return forward, recompute, backward, 0.0, backward
    leaves = _leaves(chunk, args)
    wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    with torch.enable_grad():
        tensors = _graph_outputs(chunk.module(*leaves))
    params = [p for p in chunk.module.parameters() if p.requires_grad]
    deferred, inputs = timed(lambda: split(tensors, seeds, wanted, params))
    _, weights = timed(deferred.run)
    return forward, recompute, backward, inputs, weights


def _memory(chunk: _Chunk, args: list[Any], device: torch.device) -> float:
    """Bytes the forward keeps for the backward (parameters excluded: counted as weights)."""
    leaves = _leaves(chunk, args)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.enable_grad():
            tensors = _graph_outputs(chunk.module(*leaves))
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        _sync(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    # Bytes of the saved tensors themselves (each distinct view once), not of the storages
    # they view: whether a reshape returns a view of a larger storage or a copy depends on the
    # batch size (at batch 1 most reshapes are views), so storage bytes are not affine in b and
    # the fit misses them by up to tens of percent on small chunks.
    weights = {p.untyped_storage().data_ptr() for p in chunk.module.parameters()}
    saved: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            view = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            saved[view] = t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk.module(*leaves)
    return float(sum(saved.values()))
