"""What each slow link carries, chosen and priced: ``compression=`` per pipeline boundary and
``replica_sync=`` per stage (the settings and their formulas: ``costs/wire.py``).

A boundary or a stage's replica group is *slow* when it joins two nodes (``network.Links``:
``slow``, ``allreduce_slow``; nodes from ``Cluster.gpus_per_node``, under a launcher its
``LOCAL_WORLD_SIZE``). Given settings apply where they can: an explicit compression to every
boundary between two ranks, an explicit sync to every stage. ``"auto"`` chooses:

* compression, per slow boundary: the mode whose link time plus (de)quantisation is smallest
  (:func:`boundary_modes`), a lossier one only when it saves ``LOSSIER_MARGIN`` more; then the
  simulator has the last word (``Pricer.simulated`` keeps the compressed step only where it is
  faster than the exact one: a link hidden behind compute is not worth an approximation);
* replica sync, per stage whose replicas span nodes: the fastest of exact, bf16 and
  ``PowerSGD(rank=4)`` by the same rule (:func:`stage_syncs`); a stage whose replicas share a
  node stays exact, and DiLoCo is never chosen for the user.

Seconds of a stage's sync (:func:`sync_seconds`): the ring all-reduce of what the setting sends
(``SyncPrice.ratio`` of the gradient bytes; ZeRO-1's all-gather adds half), the extra all-reduce rounds'
latency, and the compute it adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..costs.roofline import DeviceSpec
from ..costs.wire import (
    LOSSIER_MARGIN,
    WIRE_RATIO,
    DiLoCo,
    PowerSGD,
    ReplicaSync,
    codec_seconds,
    powersgd_max_rank,
    sync_price,
    wire_bytes,
)
from ..errors import PlanError
from .candidates import Candidate
from .network import Links
from .options import PlanOptions

AUTO_POWERSGD = PowerSGD(rank=4)


def boundary_modes(setting: str, net: Links, send_bytes: Sequence[float],
                   spec: DeviceSpec) -> tuple[str, ...]:
    """Per boundary, how it travels: ``setting`` on every boundary between two ranks (a
    boundary inside one rank, infinite bandwidth, is never sent), or for ``"auto"`` the
    cheapest mode on each slow one."""
    modes = []
    for k, nbytes in enumerate(send_bytes):
        bw = net.bandwidths[k] if k < len(net.bandwidths) else float("inf")
        if setting == "off" or not np.isfinite(bw):
            modes.append("off")
        elif setting != "auto":
            modes.append(setting)
        elif not net.is_slow(k):
            modes.append("off")
        else:
            modes.append(_least(
                [(m, wire_bytes(float(nbytes), m) / bw + codec_seconds(float(nbytes), m, spec))
                 for m in ("off", "bf16", "int8")]))
    return tuple(modes)


def _least(options: list[tuple[ReplicaSync | str, float]]) -> ReplicaSync | str:
    """The first option (least lossy) unless a later one is faster by the margin."""
    best, best_time = options[0]
    for option, seconds in options[1:]:
        if seconds < best_time * (1 - LOSSIER_MARGIN):
            best, best_time = option, seconds
    return best


def compressed(send_bytes: Sequence[float], modes: Sequence[str]) -> list[float]:
    """Bytes each boundary puts on the wire per micro-batch under ``modes``."""
    return [wire_bytes(float(b), m) for b, m in zip(send_bytes, modes)]


def codec_per_stage(send_bytes: Sequence[float], modes: Sequence[str],
                    spec: DeviceSpec) -> np.ndarray:
    """Seconds each stage spends (de)quantising per micro-batch and direction: half of each
    boundary's encode-and-decode on either side of it."""
    stages = len(send_bytes) + 1
    extra = np.zeros(stages)
    for k, (nbytes, mode) in enumerate(zip(send_bytes, modes)):
        half = 0.5 * codec_seconds(float(nbytes), mode, spec)
        extra[k] += half
        extra[k + 1] += half
    return extra


def sync_seconds(setting: ReplicaSync, grad_bytes: float, net: Links, replicas: int,
                 spec: DeviceSpec, shapes: Sequence[Sequence[int]] = (),
                 sharded: bool = False) -> float:
    """One stage's replica sync per step (averaged over steps: DiLoCo's every ``every``)."""
    if replicas <= 1 or grad_bytes <= 0:
        return 0.0
    price = sync_price(setting, shapes, sharded)
    ring_latency = 2 * (replicas - 1) * net.allreduce_latency
    return net.allreduce(grad_bytes * price.ratio, replicas) \
        + max(0.0, price.rounds - 1.0) * ring_latency + price.seconds(grad_bytes, spec)


def stage_syncs(setting: ReplicaSync, grads: Sequence[float], net: Links, replicas: int,
                spec: DeviceSpec, shapes: Sequence[Sequence[int]] = (),
                sharded: bool = False) -> tuple[ReplicaSync, ...]:
    """Per stage, its replica sync: ``setting``, or for ``"auto"`` the cheapest of exact,
    bf16 and PowerSGD on a stage whose replicas span nodes (exact where they share one)."""
    if setting != "auto":
        return tuple(setting for _ in grads)
    if replicas <= 1 or not net.allreduce_slow:
        return tuple("exact" for _ in grads)
    out: list[ReplicaSync] = []
    for g in grads:
        options: list[tuple[ReplicaSync | str, float]] = [
            (s, sync_seconds(s, float(g), net, replicas, spec, shapes,
                             sharded))
            for s in ("exact", "bf16", AUTO_POWERSGD)]
        out.append(_least(options))  # type: ignore[arg-type]
    return tuple(out)


def byte_ratio(syncs: Sequence[ReplicaSync], shapes: Sequence[Sequence[int]] = (),
               sharded: bool = False) -> float:
    """The largest share of gradient bytes any stage's sync sends (what the partition weighs
    each stage's all-reduce by)."""
    return max((sync_price(s, shapes, sharded).ratio for s in syncs),
               default=1.0)


def partition_bandwidths(net: Links, compression: str) -> list[float]:
    """Per boundary, the bandwidth the partition prices its cut at: the link's, widened by
    an explicit compression's byte ratio (``"auto"`` decides after the cut is made, so its
    cut goes where the exact bytes are fewest)."""
    ratio = WIRE_RATIO.get(compression, 1.0)
    return [bw / ratio if np.isfinite(bw) else bw for bw in net.bandwidths]


def check_settings(options: PlanOptions, chosen: Candidate,
                   shapes: Sequence[Sequence[int]]) -> None:
    """Refuse settings that cannot apply to the chosen layout, saying what to do instead."""
    p, d = chosen.stages, chosen.data_parallel
    compression, sync = options.compression, options.replica_sync
    if compression in ("bf16", "int8") and p == 1:
        raise PlanError(
            f"compression={compression!r} compresses the tensors between pipeline stages, but "
            "the plan has one stage (P=1): there is no boundary to compress. Pass stages=2 or "
            "more, or compression='off' ('auto' compresses only where it finds a slow boundary)")
    if isinstance(sync, DiLoCo):
        if d == 1:
            raise PlanError(
                f"replica_sync=vf.DiLoCo(every={sync.every}) averages the parameters of "
                "data-parallel replicas, but the plan has one replica (D=1): there is nothing "
                "to average. Pass data_parallel=2 or more (or launch more processes), or "
                "replica_sync='exact'")
        if options.shard_optimizer is True or chosen.shard:
            why = "shard_optimizer=True" if options.shard_optimizer is True else \
                "the plan needs ZeRO-1 (optimizer state sharded over D) to fit in memory"
            raise PlanError(
                f"replica_sync=vf.DiLoCo(...) steps each replica's own optimizer on its own "
                f"gradients, so its state cannot be sharded over the replicas, but {why}. "
                "Pass shard_optimizer='auto' or False (with devices that hold the optimizer "
                "state, or more stages), or another replica_sync")
    if isinstance(sync, PowerSGD):
        most = powersgd_max_rank(shapes, sync)
        if sync.rank > most:
            fix = f"choose rank <= {most}" if most else \
                "no weight matrix of this model is large enough for low rank to pay; use " \
                "replica_sync='bf16' or 'exact'"
            raise PlanError(
                f"replica_sync=vf.PowerSGD(rank={sync.rank}) would compress none of the "
                f"model's weight gradients: at that rank no matrix sends "
                f"{sync.min_compression_rate:g}x fewer elements as two factors (torch's "
                f"min_compression_rate), so every gradient would go whole: {fix}")


def shards_by_default(options: PlanOptions, net: Links, needed: bool) -> bool:
    """Whether ``shard_optimizer="auto"`` shards an optimizer made by ``pipe.optimizer``
    (``Plan.shards_by_default``): yes, unless memory does not need it and either the
    replicas talk over a slow link (between nodes), where ZeRO-1's all-gather of the
    parameters adds half an all-reduce's bytes to every step (1.5x in all), or DiLoCo keeps
    each replica's own optimizer state."""
    if needed:
        return True
    if isinstance(options.replica_sync, DiLoCo):
        return False
    return not net.allreduce_slow
