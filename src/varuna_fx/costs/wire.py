"""What crosses slow links, and what it costs: compile's ``compression=`` and ``replica_sync=``.

Two settings choose what a link carries (docs/API.md, "Slow links"):

* ``compression``: the pipeline's boundary tensors (activations forward, their gradients
  backward). ``"off"`` (exact), ``"bf16"`` (a cast: 2 bytes an element), ``"int8"`` (1 byte an
  element plus a float32 scale per row, the last dimension being a row), or ``"auto"`` (the
  planner compresses a boundary only where it crosses a slow link and its simulation says the
  bytes saved outweigh the (de)quantisation: ``planner/links.py``).
* ``replica_sync``: how a stage's data-parallel replicas agree. ``"exact"`` (the fp32 all-reduce),
  ``"bf16"`` (torch's bf16 compression hook), :class:`PowerSGD` (torch's ``powerSGD_hook``: low
  rank with error feedback), :class:`DiLoCo` (local steps, then an outer Nesterov step on the
  averaged parameter change) or ``"auto"`` (per stage, from the link its replicas share; never
  DiLoCo, which changes what an optimizer step means and is only taken when asked for).

The numbers here are the planner's: bytes on the wire and the seconds of the work compression
adds, from a device's memory bandwidth and FLOP rate (a roofline, like every estimate before a
profile). The runtime's codecs are ``runtime/compress.py`` and ``runtime/sync/replica_sync.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import VarunaFxError
from .roofline import DeviceSpec

COMPRESSIONS = ("off", "bf16", "int8", "auto")
MODES = ("off", "bf16", "int8")  # what one boundary is sent as (the plan's per-boundary choice)
SYNC_NAMES = ("exact", "bf16", "auto")
# Bytes sent per fp32 byte. int8 adds a float32 scale per row: exact in the plan table (from the
# boundary's shapes), assumed rows of ROW elements where the planner prices bytes alone.
ROW = 128
WIRE_RATIO = {"off": 1.0, "bf16": 0.5, "int8": 0.25 + 1.0 / ROW}
# Memory traffic of encoding and decoding, in fp32 bytes of the tensor, and the kernels each
# takes (each costs OP_SECONDS of launch overhead): bf16 is a cast each way; int8 reads the
# rows for their maxima, divides, rounds, clamps and casts, and multiplies back.
_TRAFFIC = {"off": 0.0, "bf16": 3.0, "int8": 11.0}
_KERNELS = {"off": 0, "bf16": 2, "int8": 8}
OP_SECONDS = {"cpu": 10e-6, "gpu": 5e-6}
# "auto" takes a lossier setting only when it beats the less lossy one by this share of the time
# it prices (int8 over bf16, PowerSGD over bf16 over exact): a tie keeps the numbers closer.
LOSSIER_MARGIN = 0.05


@dataclass(frozen=True)
class PowerSGD:
    """Replica sync by torch's PowerSGD (``powerSGD_hook``): each weight matrix's gradient sent
    as two rank-``rank`` factors, the compression error fed back into the next step;
    ``start_iter`` steps of exact all-reduce first (torch's ``start_powerSGD_iter``, at least
    2); a matrix is compressed only where that sends ``min_compression_rate`` times fewer
    elements (torch's rule), vectors and small matrices go whole."""

    rank: int = 4
    start_iter: int = 2
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise VarunaFxError(f"vf.PowerSGD(rank={self.rank!r}): give a positive integer "
                                "rank, e.g. vf.PowerSGD(rank=4)")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) \
                or self.start_iter < 2:
            raise VarunaFxError(
                f"vf.PowerSGD(start_iter={self.start_iter!r}): PowerSGD starts after at least 2 "
                "exact steps (torch's start_powerSGD_iter with error feedback); pass 2 or more")
        if not (isinstance(self.min_compression_rate, (int, float))
                and math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 1):
            raise VarunaFxError(f"vf.PowerSGD(min_compression_rate={self.min_compression_rate!r})"
                                ": give a number >= 1 (torch's default is 2)")

    @property
    def name(self) -> str:
        return f"powersgd(rank={self.rank})"

    def compressed(self, shape: Sequence[int]) -> bool:
        """Whether torch's hook sends this gradient as low-rank factors (its
        ``_should_compress``: the matrix ``shape[0] x rest`` at rank min(r, n, m) sends at
        least ``min_compression_rate`` times fewer elements)."""
        if len(shape) < 2:
            return False
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, self.rank)
        return n * m >= self.min_compression_rate * (n + m) * r

    def elements(self, shape: Sequence[int]) -> int:
        """Elements one replica all-reduces for a gradient of ``shape``."""
        if not self.compressed(shape):
            return math.prod(shape)
        n, m = shape[0], math.prod(shape[1:])
        return (n + m) * min(n, m, self.rank)


@dataclass(frozen=True)
class DiLoCo:
    """Replica sync by local steps (DiLoCo): each replica steps its own optimizer on its own
    gradients; every ``every`` optimizer steps the replicas average their parameters' change
    since the last outer step and an outer SGD with Nesterov momentum (``outer_lr``,
    ``outer_momentum``) applies it to the parameters they last agreed on."""

    every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise VarunaFxError(f"vf.DiLoCo(every={self.every!r}): give the number of local "
                                "optimizer steps between outer steps, e.g. vf.DiLoCo(every=50)")
        if not (isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr)
                and self.outer_lr > 0):
            raise VarunaFxError(f"vf.DiLoCo(outer_lr={self.outer_lr!r}): give a positive "
                                "learning rate (0.7 in the DiLoCo paper)")
        if not (isinstance(self.outer_momentum, (int, float))
                and 0 <= self.outer_momentum < 1):
            raise VarunaFxError(f"vf.DiLoCo(outer_momentum={self.outer_momentum!r}): give a "
                                "momentum in [0, 1) (0.9 in the DiLoCo paper)")

    @property
    def name(self) -> str:
        return f"diloco(every={self.every})"


ReplicaSync = str | PowerSGD | DiLoCo


def check_compression(value: Any) -> None:
    if not isinstance(value, str) or value not in COMPRESSIONS:
        raise VarunaFxError(f"compression={value!r} is unknown: choose one of "
                            f"{list(COMPRESSIONS)} ('off', the default, sends boundary tensors "
                            "exactly)")


def check_replica_sync(value: Any) -> None:
    if isinstance(value, (PowerSGD, DiLoCo)):
        return
    if isinstance(value, str) and value in SYNC_NAMES:
        return
    hint = " (PowerSGD and DiLoCo are objects: vf.PowerSGD(rank=4), vf.DiLoCo(every=50))" \
        if isinstance(value, str) and value.lower().startswith(("powersgd", "diloco")) else ""
    raise VarunaFxError(f"replica_sync={value!r} is unknown: choose 'exact' (the default), "
                        f"'bf16', vf.PowerSGD(rank=...), vf.DiLoCo(every=...) or 'auto'{hint}")


def sync_name(setting: ReplicaSync) -> str:
    """How tables name a replica sync."""
    return setting if isinstance(setting, str) else setting.name


def departs(compression: Sequence[str], sync: Iterable[ReplicaSync]) -> bool:
    """Whether a plan's choices depart from eager numerics (anything but off / exact)."""
    return any(c != "off" for c in compression) or any(s != "exact" for s in sync)


# -- the price of a boundary ---------------------------------------------------------------------


def wire_bytes(nbytes: float, mode: str, rows: float | None = None,
               element_size: int = 4) -> float:
    """Bytes sent for a boundary tensor of ``nbytes`` under ``mode``; ``rows`` (int8's scales):
    given, or assumed from :data:`ROW`."""
    if mode == "off" or nbytes <= 0:
        return nbytes
    elements = nbytes / element_size
    if mode == "bf16":
        return min(nbytes, 2.0 * elements)
    scale_rows = elements / ROW if rows is None else rows
    return min(nbytes, elements + 4.0 * scale_rows)


def codec_seconds(nbytes: float, mode: str, spec: DeviceSpec) -> float:
    """Seconds of encoding and decoding ``nbytes`` (fp32) under ``mode`` on ``spec``'s device:
    its memory traffic at the device's bandwidth plus the kernels' launch overhead."""
    if mode == "off" or nbytes <= 0:
        return 0.0
    overhead = OP_SECONDS["cpu" if spec.name == "cpu" else "gpu"]
    return _TRAFFIC[mode] * nbytes / spec.memory_bandwidth + _KERNELS[mode] * overhead


# -- the price of a replica sync -----------------------------------------------------------------


def powersgd_ratio(shapes: Iterable[Sequence[int]], setting: PowerSGD) -> float:
    """Elements PowerSGD all-reduces over the elements of the gradients of ``shapes``."""
    total = sent = 0
    for shape in shapes:
        total += math.prod(shape)
        sent += setting.elements(shape)
    return sent / total if total else 1.0


def powersgd_max_rank(shapes: Iterable[Sequence[int]], setting: PowerSGD) -> int:
    """The largest rank at which PowerSGD still compresses one of ``shapes`` (0: none)."""
    best = 0
    for shape in shapes:
        if len(shape) < 2:
            continue
        n, m = shape[0], math.prod(shape[1:])
        # n m >= rate (n + m) r
        best = max(best, min(n, m, int(n * m // (setting.min_compression_rate * (n + m)))))
    return best


@dataclass(frozen=True)
class SyncPrice:
    """One stage's replica sync per step: fp32 gradient bytes -> (bytes each replica's ring
    all-reduce carries, seconds of the work it adds, all-reduces it waits on in turn)."""

    ratio: float  # all-reduced bytes per gradient byte, averaged over steps
    flops_per_byte: float = 0.0  # compute per gradient byte (PowerSGD's matmuls)
    traffic: float = 0.0  # memory traffic per gradient byte (casts, the outer step)
    rounds: float = 1.0  # all-reduces in sequence (latency terms), averaged over steps

    def seconds(self, grad_bytes: float, spec: DeviceSpec) -> float:
        """The work the sync adds besides the all-reduce itself."""
        return grad_bytes * (self.flops_per_byte / spec.flops
                             + self.traffic / spec.memory_bandwidth)


def sync_price(setting: ReplicaSync, powersgd_shapes: Sequence[Sequence[int]] = (),
               sharded: bool = False) -> SyncPrice:
    """The price of ``setting`` (resolved: not "auto"). ``powersgd_shapes``: the trainable
    weights' shapes (PowerSGD's ratio). ``sharded``: ZeRO-1, whose step all-gathers the
    parameters after the gradients' reduction, exact whatever the sync: (D-1)/D of them, half
    an all-reduce's bytes (on gloo the exact run then sends 1.5x the plain all-reduce's:
    bench/RESULTS.md, "Slow links")."""
    gather = 0.5 if sharded else 0.0
    if isinstance(setting, PowerSGD):
        ratio = powersgd_ratio(powersgd_shapes, setting)
        # P = M Q, Q = M^T P, M = P Q^T: three (n x m x r) matmuls, 2 FLOPs each, per fp32 byte
        # of M; the compression error copy and the factors' orthogonalisation are memory work
        return SyncPrice(ratio + gather, flops_per_byte=6.0 * setting.rank / 4.0, traffic=3.0,
                         rounds=3.0)
    if isinstance(setting, DiLoCo):
        # one fp32 all-reduce of the parameter change every `every` steps; the outer step
        # reads and writes the anchor, momentum and parameters then (never sharded)
        return SyncPrice(1.0 / setting.every, traffic=8.0 / setting.every,
                         rounds=1.0 / setting.every)
    if setting == "bf16":
        return SyncPrice(0.5 + gather, traffic=1.5)
    return SyncPrice(1.0 + gather)
