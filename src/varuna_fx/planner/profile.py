"""Measured profiles: what they hold, where they are cached, and when they apply.

A :class:`Profile` holds, for contiguous chunks of the graph's compute nodes, the measured
forward, recompute (forward with autograd) and backward time and the activation memory, each
fitted as ``const + per_sample * b`` (:class:`varuna_fx.ir.nodes.Affine`, so ``.expr`` is sympy like
every other cost). ``measure.py`` makes them; the planner turns them into per-node costs with
:class:`varuna_fx.planner.cost_table.MeasuredTimes`.

Profiles are cached as JSON under ``$VARUNA_FX_CACHE_DIR/profiles`` (default ``~/.cache/varuna_fx/profiles``),
keyed by a hash of the graph (every node's op, target and output shapes), the parameters' dtype,
the device and the thread count, so compiling the same model again re-plans without measuring.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from ..costs.roofline import device_spec
from ..errors import PlanError
from ..ir.nodes import Affine, info
from ..world import safe_json
from ..world.files import cache_dir, write_atomically
from ..world.network import NetworkProfile
from .cluster import Cluster
from .cost_table import CostTable, MeasuredTimes, interpolate, monotone
from .machine import MachineCosts
from .machine import from_json as machine_from_json
from .steady import round_costs

FORMAT = 5  # bump when the JSON layout or the measuring method changes (3: memory counts
# the saved tensors' own bytes, see measure._memory; 4: the machine's costs and the ranks
# that measured at once; 5: which clock timed it)


@dataclass
class ChunkProfile:
    nodes: list[str]  # compute nodes of the chunk, in graph order
    forward: Affine  # seconds per micro-batch, without autograd
    recompute: Affine  # forward with autograd (also what a non-recomputing stage runs)
    backward: Affine
    memory: Affine  # bytes the forward leaves for the backward (GPU: peak over F + B)
    # per size: (forward, recompute, backward, memory), then, when the split backward was
    # timed, (input-gradient pass, weight pass)
    samples: dict[int, tuple[float, ...]] = field(default_factory=dict)


@dataclass
class Profile:
    key: str
    graph: str  # graph_hash of the profiled graph
    device: str  # device type as Cluster names it: "cpu", "h100", "cuda", ...
    device_name: str
    dtype: str
    threads: int
    sizes: list[int]
    chunks: list[ChunkProfile]
    # seconds the runtime spends re-seeding the RNG around each forward/recompute of a stage
    # with random ops (dropout replays exactly on recompute); added per action by the planner
    reseed: float = 0.0
    network: NetworkProfile | None = None
    # the machine's overheads measured with it (planner/machine.py: the fixed cost of an
    # action, the cores), and how many ranks of this node measured at once (they shared the
    # cores as the run's ranks will: contention is priced relative to it)
    machine: MachineCosts | None = None
    ranks: int = 1
    # the timings' relative spread: per chunk and size, the interquartile range of the
    # repeats over their median, the median of those (how sure the prediction is)
    spread: float = 0.0
    # whether the times are this process's CPU time (one torch thread on a CPU: immune to
    # other processes, so they hold no contention of the ranks that measured at once)
    cpu_clock: bool = False
    from_cache: bool = False

    def measured_times(self, table: CostTable, ranks_per_node: int = 1) -> MeasuredTimes:
        """Per-node costs for ``table``'s graph (which must be the profiled one), for a run
        with ``ranks_per_node`` ranks sharing this machine's cores (``machine.ranks_sharing``):
        the profile's times scaled by the run's contention over the profile's, and the
        machine's fixed cost per action."""
        position = {name: i for i, name in enumerate(table.names)}
        chunk_of = np.full(len(table.names), -1, dtype=np.int64)
        for k, chunk in enumerate(self.chunks):
            for name in chunk.nodes:
                if name not in position:
                    raise PlanError(f"the profile does not match this graph (no node {name!r}); "
                                    "profile this model again (profile=True)")
                chunk_of[position[name]] = k
        if (chunk_of < 0).any():
            missing = table.names[int(np.argmax(chunk_of < 0))]
            raise PlanError(f"the profile does not cover node {missing!r} of this graph; "
                            "profile this model again (profile=True)")
        spec = device_spec(self.device)

        def coef(attr: str) -> np.ndarray:  # at the stated resolution (steady.py)
            return round_costs(np.array([[getattr(c, attr).const, getattr(c, attr).per_sample]
                                         for c in self.chunks]))

        sizes = sorted(self.sizes)
        samples = None
        if all(set(sizes) <= set(c.samples) for c in self.chunks):
            # forward, recompute, backward; then the split backward's two passes if measured
            slots = [0, 1, 2]
            if all(len(c.samples[b]) >= 6 for c in self.chunks for b in sizes):
                slots += [4, 5]
            measured = round_costs(np.array([[[c.samples[b][i] for i in slots] for b in sizes]
                                             for c in self.chunks]))
            samples = monotone(measured.transpose(0, 2, 1)).transpose(0, 2, 1)
        scale, action = 1.0, 0.0
        if self.machine is not None:
            m = self.machine
            # wall times hold the contention of the ranks that measured together; CPU times
            # hold none (a rank waiting for a core spends no CPU time), so the run's is priced
            # whole: 4 ranks on 2 cores run each rank's compute 2x slower than it measured
            scale = m.contention(ranks_per_node) / \
                (1.0 if self.cpu_clock else m.contention(self.ranks))
            action = float(round_costs(np.array([m.action * m.contention(ranks_per_node)]))[0])
        return MeasuredTimes(list(table.names), chunk_of, coef("forward"), coef("recompute"),
                             coef("backward"), coef("memory"),
                             estimate=lambda b: table.estimate(b, spec),
                             reseed=float(round_costs(np.array([self.reseed]))[0]),
                             sizes=np.array(sizes, dtype=float), samples=samples,
                             action=action, scale=scale, variation=self.spread)

    def times(self, chunk: int, b: float) -> tuple[float, float, float]:
        """(forward, recompute, backward) seconds of one chunk at micro-batch size ``b`` as the
        planner uses them: the measurements, made monotone in ``b`` and interpolated."""
        sizes = sorted(self.sizes)
        c = self.chunks[chunk]
        values = monotone(np.array([[c.samples[s][i] for s in sizes] for i in range(3)]))
        return tuple(float(v) for v in interpolate(np.array(sizes, float), values, b))

    def applies_to(self, cluster: Cluster) -> bool:
        """Measured times transfer to devices of the same type (a generic "cuda" cluster
        accepts any GPU's profile)."""
        if cluster.flops is not None:
            return False  # the user stated the throughput to plan with
        if self.device == cluster.kind:
            return True
        return cluster.device_type is None and cluster.device == "cuda" and self.device != "cpu"

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("from_cache")
        data["format"] = FORMAT
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = safe_json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError("profile format changed")
        chunks = [ChunkProfile(
            nodes=c["nodes"],
            **{k: Affine(**c[k]) for k in ("forward", "recompute", "backward", "memory")},
            samples={int(b): tuple(v) for b, v in c["samples"].items()},
        ) for c in data.pop("chunks")]
        network = data.pop("network")
        machine = data.pop("machine", None)
        return cls(chunks=chunks, network=NetworkProfile(**network) if network else None,
                   machine=machine_from_json(json.dumps(machine)) if machine else None,
                   **data)


def graph_hash(gm: fx.GraphModule) -> str:
    """Structure and shapes of the graph: equal for the same model and example shapes."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else \
            getattr(node.target, "__qualname__", repr(node.target))
        shapes = ";".join(str(t) for t in info(node).outputs)
        digest.update(f"{node.op}|{target}|{node.name}|{shapes}\n".encode())
    return digest.hexdigest()[:32]


def profile_key(gm: fx.GraphModule, device: str, dtype: str, threads: int,
                settings: dict[str, Any]) -> str:
    text = json.dumps([graph_hash(gm), device, dtype, threads, torch.__version__, FORMAT,
                       sorted(settings.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_cached(key: str, graph: str | None = None) -> Profile | None:
    """The cached profile for ``key``, or None (then the caller measures again).

    The cache is a directory anyone with write access may have put files in, or an older
    version of this code wrote: a file is used only when its stored key and graph hash are
    the ones asked for and every time and byte count in it is a finite, non-negative number;
    otherwise it is ignored with a warning."""
    path = cache_dir("profiles") / f"{key}.json"
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        profile = Profile.from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _ignored(path, f"it cannot be read ({exc})")
    problem = profile_problem(profile, key, graph)
    if problem:
        return _ignored(path, problem)
    profile.from_cache = True
    return profile


def profile_problem(profile: Profile, key: str, graph: str | None) -> str | None:
    """Why ``profile`` must not be used for ``key``/``graph``, or None."""
    if profile.key != key:
        return f"it holds the profile {profile.key!r}"
    if graph is not None and profile.graph != graph:
        return "it was measured for another graph"
    if isinstance(profile.ranks, bool) or not isinstance(profile.ranks, int) or \
            profile.ranks < 1:
        return "it has an invalid number of ranks"
    if not profile.chunks or not profile.sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in profile.sizes):
        return "it has no chunks or invalid batch sizes"
    fits = [fit for chunk in profile.chunks
            for fit in (chunk.forward, chunk.recompute, chunk.backward, chunk.memory)]
    numbers = [profile.reseed, profile.spread, *(v for fit in fits for v in (fit.const, fit.per_sample)),
               *(v for chunk in profile.chunks for sample in chunk.samples.values()
                 for v in sample)]
    bad = [v for v in numbers if isinstance(v, bool) or not isinstance(v, (int, float))
           or not math.isfinite(v)]
    if bad:
        return f"it holds a value that is not a finite number ({bad[0]!r})"
    # times and bytes are never negative, measured or fitted (a fit may dip a little below a
    # tiny measurement, not below zero by more than that)
    low = min([profile.reseed, *(v for chunk in profile.chunks
                                 for sample in chunk.samples.values() for v in sample)])
    for chunk in profile.chunks:
        kinds = (chunk.forward, chunk.recompute, chunk.backward, chunk.memory)
        for b in profile.sizes:
            sample = chunk.samples.get(b, (0.0,) * 4)
            for fit, measured in zip(kinds, sample):
                if fit(b) < -0.01 * abs(measured) - 1e-9:
                    low = min(low, fit(b))
    if low < 0:
        return f"it holds a negative time or memory ({low:g})"
    return None


def _ignored(path: Path, why: str) -> None:
    warnings.warn(f"ignoring the cached profile {path}: {why}; measuring again", stacklevel=3)
    return None


def save_cached(profile: Profile) -> None:
    directory = cache_dir("profiles")
    try:
        write_atomically(directory, f"{profile.key}.json", profile.to_json())
    except OSError as exc:
        warnings.warn(f"could not cache the profile in {directory}: {exc}", stacklevel=2)
