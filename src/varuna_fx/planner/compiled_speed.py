"""Compiled stages, priced: how much faster torch.compile / inductor runs the model here, and
whether ``compile_stages="auto"`` compiles (issue 43 item 5).

**What is measured.** Compiling every candidate stage graph would cost a compile per candidate
(tens of seconds each on a CPU), so the profiler compiles the *whole model's* graph once (the
profiler's own chunk builder with one chunk: what a one-stage plan runs) and times its forward
(with autograd) and backward, eager against compiled, at :data:`SIZES` micro-batch sizes
(capped by the example batch), interleaved, medians of repeats, on the profiler's clock (CPU
time with one torch thread). The result, :class:`CompiledSpeed`, is a speed-up per size for the
forward and one for the backward, and the compile's own seconds (the first compiled calls less
an eager one, in wall seconds, every measured size included: ``dynamic=False`` compiles each
size). Every stage is priced with these factors (:class:`CompiledTimes`: each node's forward
and recompute time over the forward factor, its backward, input-gradient and weight passes over
the backward factor, at the micro-batch size interpolated between the measured ones;
activation bytes as eager's). What this leaves out, knowingly: fusion lost at a stage's
boundary and the compiled call's fixed cost paid per stage rather than once (small beside a
stage's compute on the models benched: bench/bench_compiled_stages.py prints the prediction
against the measured compiled step).

**When it is measured** (:func:`should_measure`). Only where the user asked the profiler to
measure (``profile=True``), on the cluster's kind of device being this machine's, and the
stages will compile anyway ("on", or "auto" on CUDA) or "auto" on a CPU has a run length to
weigh the compile against (compile's ``planned_steps``: the train command always passes its
``steps``; a plain ``vf.compile(profile=True)`` is not slowed by a compile it cannot weigh): one compile of the whole model per machine, torch version and graph, cached by
the cache service (``world/disk_cache.py``, kind ``compiled``; inductor's own artefacts stay
under ``$VARUNA_FX_CACHE_DIR/inductor``, so a measurement again is cheap too). Without
``profile=True`` a factor cached earlier is used, else none: nothing compiles at plan time
unless asked. A stated machine (``$VARUNA_FX_MACHINE``, the test suite's) that states
``compiled_speedup`` (and ``compile_seconds``) gives that factor for every model and is never
measured: plans are the same on every host, and no test runs inductor to plan.

**"auto" (``decide``).** On CUDA: compiled (as before; priced with a factor where one was
measured). Elsewhere (a CPU): compiled only where a factor is known and both hold:

* its speed-up (eager / compiled forward + backward, at the largest measured size) is at least
  :data:`THRESHOLD` (1.05x: below it, timing noise and the boundary losses above can eat it);
* the plan's steps pay for the compile: ``planned_steps x samples per step x eager seconds
  per sample x (1 - 1/speed-up) >= compile seconds``. "The plan's steps" is compile's
  ``planned_steps`` (the train command passes its ``steps``), else :data:`DEFAULT_STEPS`
  (1000: vf.compile does not know how long it will be stepped). Samples per step are each
  replica's batch (the example batch, or the global batch over the replicas given); the eager
  seconds per sample are the planner's own eager price of the whole model. Ranks compile their
  stages in parallel as they compute them in parallel, so the comparison holds for any P.

The plan says which and why (``plan.compile_note``, with the measured factor).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx

from ..capture.buffers import buffers_kept
from ..capture.inputs import BoundInputs
from ..passes.assign_stages import compute_nodes
from ..world import switches
from ..world.disk_cache import DiskCache
from ..world.where import (
    in_process_group,
    init_process_group,
    launched_distributed,
    resolve_timeout,
)
from .cluster import Cluster, local_device_type
from .cost_table import CoreSharing, NodeArrays, PerNodeTimes
from .machine import MACHINE_ENV, _cores, machine_costs
from .measure import (  # the profiler's own pieces: the graph as one chunk, its inputs
    ProfileSettings,
    _build_chunks,
    _chunk_args,
    _device_of,
    _graph_outputs,
    _inputs,
    _leaves,
    _sync,
)
from .plan import resolve_compile_stages
from .profile import graph_hash

SIZES = (2, 8)  # micro-batch sizes measured (each a compile: static shapes)
REPEATS = 5
THRESHOLD = 1.05  # "auto" compiles on a CPU only from this measured speed-up up
DEFAULT_STEPS = 1000  # the steps "auto" assumes a plan runs when compile is not told
FORMAT = 1
CACHE: DiskCache[CompiledSpeed] = DiskCache("compiled", FORMAT, 64, family="compiled",
                                            memory=True)


@dataclass(frozen=True)
class CompiledSpeed:
    """Eager over compiled time of the whole model, per measured micro-batch size: the
    forward (with autograd) and the backward; and the compile's seconds."""

    sizes: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    step: tuple[float, ...]  # forward + backward together
    compile_seconds: float
    source: str = "measured"  # "measured", "cached" or "stated" (a stated machine's)

    def at(self, b: float) -> tuple[float, float]:
        """(forward, backward) speed-up at micro-batch size ``b``: linear between the
        measured sizes, the nearest one's outside them."""
        sizes = np.asarray(self.sizes, dtype=float)
        return (float(np.interp(b, sizes, self.forward)),
                float(np.interp(b, sizes, self.backward)))

    @property
    def speedup(self) -> float:
        """The step's speed-up at the largest measured size (what "auto" weighs)."""
        return self.step[-1]

    def describe(self) -> str:
        where = {"measured": "measured now", "cached": "measured before, from the cache",
                 "stated": f"stated by ${MACHINE_ENV}"}.get(self.source, self.source)
        sizes = ", ".join(str(b) for b in self.sizes)
        return (f"{self.speedup:.2f}x (forward {self.forward[-1]:.2f}x, backward "
                f"{self.backward[-1]:.2f}x, whole model at micro-batch {sizes}; {where}; "
                f"compile {self.compile_seconds:.1f} s)")


def speed_from_json(entry: dict[str, Any], source: str = "cached") -> CompiledSpeed:
    """A ``CompiledSpeed`` from its fields, refused (ValueError) unless every number is finite
    and positive and there is one factor of each kind per size."""
    sizes = tuple(entry["sizes"])
    rows = tuple(tuple(entry[k]) for k in ("forward", "backward", "step"))
    seconds = entry["compile_seconds"]
    numbers = [x for row in rows for x in row] + [seconds]
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes) \
            or list(sizes) != sorted(set(sizes)) or any(len(r) != len(sizes) for r in rows) \
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                       and math.isfinite(x) and x >= 0 for x in numbers) \
            or min(x for row in rows for x in row) <= 0:
        raise ValueError("not a compiled speed: sizes, factors and seconds must be finite, "
                         "positive and one per size")
    return CompiledSpeed(sizes, *(tuple(float(x) for x in r) for r in rows), float(seconds),
                         source)


# -- pricing -----------------------------------------------------------------------------------


@dataclass
class CompiledTimes(PerNodeTimes):
    """The planner's eager per-node costs (a profile's ``MeasuredTimes``, the machine's
    ``CalibratedTimes``, or with neither the device's roofline ``estimate``) as compiled stages
    run them: times over the measured speed-ups (forward and recompute by the forward's, the
    backward and its split passes by the backward's), bytes as they are. The fixed cost of an
    action stays eager's (the compiled call's is inside the measured factor)."""

    names: list[str]
    eager: PerNodeTimes | None
    speed: CompiledSpeed
    estimate: Any = field(default=None, repr=False)  # b -> NodeArrays, where eager is None

    @property
    def action(self) -> float:
        return float(getattr(self.eager, "action", 0.0))

    @property
    def reseed(self) -> float:
        return float(getattr(self.eager, "reseed", 0.0))

    @property
    def variation(self) -> float:
        return float(getattr(self.eager, "variation", 0.0))

    @property
    def step(self) -> float:
        """Seconds a step spends outside its actions (learned.py): not compiled code."""
        return float(getattr(self.eager, "step", 0.0))

    @property
    def learn_key(self) -> str | None:
        return getattr(self.eager, "learn_key", None)

    @property
    def sharing(self) -> CoreSharing | None:
        """How the ranks share the cores (``cost_table.CoreSharing``): the eager costs'."""
        return getattr(self.eager, "sharing", None)

    @property
    def priced_here(self) -> bool:
        """Whether the eager costs are this machine's (not a datasheet's roofline)."""
        return self.eager is not None

    def arrays(self, b: int) -> NodeArrays:
        a = self.eager.arrays(b) if self.eager is not None else self.estimate(b)
        f, w = self.speed.at(b)
        return NodeArrays(a.forward / f, a.recompute / f, a.backward / w, a.activations,
                          None if a.input_grad is None else a.input_grad / w,
                          None if a.weight_grad is None else a.weight_grad / w)


def priced_here(times: Any) -> bool:
    """Whether per-node costs ``times`` (a table's ``measured``) are this machine's."""
    if isinstance(times, CompiledTimes):
        return times.priced_here
    return times is not None


# -- deciding ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileDecision:
    """Whether the plan's stages run compiled, the factor they are priced with (None: as
    eager stages) and the plan's note saying why."""

    compiled: bool
    speed: CompiledSpeed | None
    note: str

    @property
    def speedup(self) -> float | None:
        return self.speed.speedup if self.speed is not None else None


def applies_here(cluster: Cluster) -> bool:
    """A factor measured here prices a cluster of this machine's kind of device (as a
    profile does), where its throughput is not stated."""
    return cluster.flops is None and cluster.kind == local_device_type()


def decide(setting: str, cluster: Cluster, speed: CompiledSpeed | None,
           eager_per_sample: float, samples_per_step: int, planned_steps: int | None
           ) -> CompileDecision:
    """compile_stages ``setting`` resolved on ``cluster`` with the factor ``speed`` (the rule
    of the module docstring); ``eager_per_sample``: the planner's eager seconds of the whole
    model's forward and backward per sample."""
    compiled, note = resolve_compile_stages(setting, cluster)
    if setting == "off":
        return CompileDecision(False, None, note)
    if speed is None:
        if compiled and not applies_here(cluster):
            note += ("; priced as eager stages (the compiled speed is measured on the "
                     "cluster's own kind of device only)")
        elif compiled:
            note += ("; priced as eager stages: the compiled speed was not measured "
                     "(profile=True measures it: one compile of the whole model, cached)")
        elif setting == "auto":
            note = ("stages: eager (compile_stages='auto' on CPU: compiling pays only where the "
                    "profiler measured a gain; profile=True with planned_steps measures it, one "
                    "compile of the whole model, cached; the train command passes its steps)")
        return CompileDecision(compiled, None, note)
    priced = f"priced with the compiled stages' speed {speed.describe()}"
    if compiled:  # "on", or "auto" on CUDA
        return CompileDecision(True, speed, f"{note}; {priced}")
    steps = planned_steps or DEFAULT_STEPS
    told = f"planned_steps={planned_steps}" if planned_steps else \
        f"{DEFAULT_STEPS}, the default: compile's planned_steps sets it"
    s = speed.speedup
    saved = samples_per_step * eager_per_sample * max(1.0 - 1.0 / s, 0.0)  # per step
    pays_after = speed.compile_seconds / saved if saved > 0 else math.inf
    if s < THRESHOLD:
        return CompileDecision(False, None, (
            f"stages: eager (compile_stages='auto' on CPU: compiled stages' speed "
            f"{speed.describe()}, below the {THRESHOLD:.2f}x that pays for compiling)"))
    if pays_after > steps:
        return CompileDecision(False, None, (
            f"stages: eager (compile_stages='auto' on CPU: compiled stages' speed "
            f"{speed.describe()}; saving {saved * 1e3:.2f} ms a step, the compile pays after "
            f"{_steps(pays_after)} steps, more than the plan's {steps} ({told}))"))
    return CompileDecision(True, speed, (
        f"stages: compiled with torch.compile / inductor (compile_stages='auto' on CPU: "
        f"saving {saved * 1e3:.2f} ms a step, the compile pays after {_steps(pays_after)} of "
        f"the plan's {steps} steps ({told})); {priced}"))


def _steps(n: float) -> str:
    return "never" if not math.isfinite(n) else f"{math.ceil(n - 1e-9)}"  # (float dust)


def eager_seconds_per_sample(arrays: Callable[[int], NodeArrays], b: int) -> float:
    """The whole model's eager forward (with autograd) and backward per sample at ``b``, as
    the planner prices them (``arrays``: its per-node costs at a micro-batch size)."""
    a = arrays(b)
    return float(np.sum(a.recompute) + np.sum(a.backward)) / max(b, 1)


# -- finding or measuring ----------------------------------------------------------------------


def should_measure(setting: str, cluster: Cluster, profile: Any,
                   planned_steps: int | None) -> bool:
    """Whether the profiler measures the compiled speed now (where none is stated or cached):
    ``profile=True``, and the stages compile anyway or "auto" has the run's length to weigh
    the compile against (module docstring)."""
    if profile is not True or setting == "off":
        return False
    return setting == "on" or cluster.device == "cuda" or planned_steps is not None


def stated_speed() -> CompiledSpeed | None:
    """The stated machine's factor (``$VARUNA_FX_MACHINE`` with ``compiled_speedup``), or
    None (no machine stated, or it states no factor)."""
    if not switches.read(MACHINE_ENV):
        return None
    costs = machine_costs()
    if costs.compiled_speedup is None:
        return None
    s = costs.compiled_speedup
    return CompiledSpeed((1,), (s,), (s,), (s,), costs.compile_seconds, "stated")


def speed_key(gm: fx.GraphModule) -> str:
    """The cache key: the graph (every node's op, target and shapes: the model's capture),
    its dtype and this machine (device, threads, cores); the cache service adds the torch and
    varuna_fx versions and source."""
    dtype = str(next((p.dtype for p in gm.parameters()), torch.float32))
    device = local_device_type()
    name = torch.cuda.get_device_name(0) if device != "cpu" else "cpu"
    return CACHE.key(repr((graph_hash(gm), dtype, device, name, torch.get_num_threads(),
                           _cores(), SIZES, REPEATS)))


def _decode(entry: dict[str, Any]) -> CompiledSpeed:
    return speed_from_json(entry["speed"], "cached")


def resolve_speed(gm: fx.GraphModule, bound: BoundInputs, setting: str, cluster: Cluster,
                  measure: bool, compile_fn: Callable[[torch.nn.Module], Any] | None,
                  timeout: float | None = None, agree: bool = True) -> CompiledSpeed | None:
    """The factor to price ``setting`` on ``cluster`` with: None under "off" or where it
    cannot apply; else the stated machine's, else the cache's, else (``measure``: the user
    asked the profiler to measure, and ``compile_fn`` compiles a module as the runtime
    does) measured now and cached. In a process group every rank measures if any must
    (the cores busy as in training) and rank 0's factor is used by all (``timeout``: the
    user's, for joining the other ranks; ``agree=False``: no collective, this process's own
    answer, for a caller that may run on one rank alone: ``analyze.plan_for``)."""
    if setting == "off" or not applies_here(cluster):
        return None
    stated = stated_speed()
    if stated is not None:
        return stated
    key = speed_key(gm)
    found = CACHE.load(key, _decode)
    need = found is None and measure and compile_fn is not None
    if agree and launched_distributed():  # join first: ranks deciding apart plan apart
        init_process_group(timeout=resolve_timeout(timeout))
    group = agree and in_process_group()
    if group:
        flag = torch.tensor([float(need)])
        dist.all_reduce(flag)
        if flag.item() > 0 and compile_fn is not None and measure:
            found = measure_speed(gm, bound, compile_fn)
        shared: list[CompiledSpeed | None] = [found]
        dist.broadcast_object_list(shared, src=0)
        found = shared[0]
    elif need:
        assert compile_fn is not None
        found = measure_speed(gm, bound, compile_fn)
    if found is not None and found.source == "measured" and \
            (not group or dist.get_rank() == 0):
        CACHE.store(key, dataclasses.replace(found, source="cached"),
                    {"speed": {k: v for k, v in asdict(found).items() if k != "source"}})
    return found


@dataclass
class _Timings:
    eager: list[tuple[float, float]] = field(default_factory=list)
    compiled: list[tuple[float, float]] = field(default_factory=list)


def measure_speed(gm: fx.GraphModule, bound: BoundInputs,
                  compile_fn: Callable[[torch.nn.Module], Any],
                  sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS) -> CompiledSpeed | None:
    """The whole model's graph eager and compiled (``compile_fn``), timed at ``sizes``
    (module docstring). None, with a warning, where the compiled model fails (the runtime
    would run such stages eagerly: they are priced as eager)."""
    device = _device_of(gm)
    clock = ProfileSettings().timer(device)
    wanted = sorted({min(s, bound.batch_size) for s in sizes})
    saved_grads = {p: p.grad for p in gm.parameters()}
    devices = [device] if device.type == "cuda" else []
    rows: list[tuple[float, float, float]] = []
    compile_seconds = 0.0
    try:
        with torch.random.fork_rng(devices=devices), buffers_kept(gm):
            torch.manual_seed(0)
            (chunk,) = _build_chunks(gm, [0, len(compute_nodes(gm))])
            compiled = compile_fn(chunk.module)

            def once(fn: Callable[..., Any], args: list[Any]) -> tuple[float, float]:
                leaves = _leaves(chunk, args)
                _sync(device)
                start = clock()
                with torch.enable_grad():
                    tensors = _graph_outputs(fn(*leaves))
                _sync(device)
                middle = clock()
                if tensors:
                    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
                _sync(device)
                return middle - start, clock() - middle

            for b in wanted:
                (args,) = _chunk_args([chunk], _inputs(bound, b, device))
                once(chunk.module, args)  # warm
                # the compile in wall seconds: inductor compiles in worker processes too,
                # which this process's CPU time does not see
                began = time.perf_counter()
                once(chunk.module, args)
                eager_wall = time.perf_counter() - began
                began = time.perf_counter()
                once(compiled, args)  # compiles (forward and backward) at b
                compile_seconds += max(time.perf_counter() - began - eager_wall, 0.0)
                timed = _Timings()
                for r in range(repeats + 1):  # interleaved, so drift hits both alike
                    pair = [(timed.eager, chunk.module), (timed.compiled, compiled)]
                    for out, fn in pair if r % 2 == 0 else pair[::-1]:
                        t = once(fn, args)
                        if r:  # the first round warms
                            out.append(t)
                e = [statistics.median(x[i] for x in timed.eager) for i in range(2)]
                c = [statistics.median(x[i] for x in timed.compiled) for i in range(2)]
                rows.append((e[0] / max(c[0], 1e-12), e[1] / max(c[1], 1e-12),
                             sum(e) / max(sum(c), 1e-12)))
    except Exception as exc:  # noqa: BLE001 - a model inductor cannot compile: priced eager
        warnings.warn(f"measuring the compiled model failed ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}); "
                      "its stages are priced as eager stages", stacklevel=3)
        return None
    finally:
        for p, g in saved_grads.items():
            p.grad = g
    forward, backward, step = (tuple(r[i] for r in rows) for i in range(3))
    return CompiledSpeed(tuple(wanted), forward, backward, step, compile_seconds, "measured")
