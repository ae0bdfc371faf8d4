"""Time estimates from FLOPs and bytes, used until measured profiles replace them.

A node's time is a roofline: the larger of its FLOPs over the device's throughput and the bytes
it reads and writes over the device's memory bandwidth (elementwise ops are memory-bound).
Backward FLOPs come from ``annotate_backward``; recomputation adds one more forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ..ir.nodes import NodeInfo


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops: float  # sustained FLOP/s for the model's dtype
    memory_bandwidth: float  # bytes/s


# Sustained (not peak) figures: roughly half of the datasheet dense numbers.
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", 5e10, 2e10),
    "v100": DeviceSpec("v100", 60e12, 0.8e12),
    "a100": DeviceSpec("a100", 150e12, 1.5e12),
    "h100": DeviceSpec("h100", 400e12, 2.5e12),
    "h200": DeviceSpec("h200", 400e12, 3.5e12),
    "cuda": DeviceSpec("cuda", 60e12, 0.8e12),  # a generic, V100-class GPU
}


def device_spec(name: str, flops: float | None = None) -> DeviceSpec:
    """The spec of a device type ("a100", "cpu", ...; unknown names: a generic GPU), with its
    throughput replaced by ``flops`` when the user states it."""
    spec = DEVICES.get(name.lower(), DEVICES["cuda"])
    if flops is not None:
        spec = replace(spec, name=name.lower(), flops=float(flops))
    return spec


class NodeTimes(Protocol):
    """Measured per-node costs that replace the roofline estimates (see ``varuna_fx.planner``).

    ``nodes`` are the partition's compute nodes in order; both methods return one value per node.
    """

    def step_times(self, nodes: Sequence[Any], batch: int, recompute: bool) -> np.ndarray:
        """Seconds of forward + backward (+ the recompute forward) of one micro-batch."""
        ...

    def activation_bytes(self, nodes: Sequence[Any], batch: int) -> np.ndarray:
        """Bytes one micro-batch leaves for the backward at each node."""
        ...


def forward_time(meta: NodeInfo, batch: int, device: DeviceSpec) -> float:
    flops = meta.fwd_flops(batch)
    moved = meta.in_bytes(batch) + meta.out_bytes(batch) if flops > 0 else 0.0
    return max(flops / device.flops, moved / device.memory_bandwidth)


def backward_time(meta: NodeInfo, batch: int, device: DeviceSpec) -> float:
    flops = meta.bwd_flops(batch)
    moved = 2 * (meta.in_bytes(batch) + meta.out_bytes(batch)) if flops > 0 else 0.0
    return max(flops / device.flops, moved / device.memory_bandwidth)


def step_time(meta: NodeInfo, batch: int, device: DeviceSpec, recompute: bool) -> float:
    """Forward + backward (+ the recompute forward) of one micro-batch through the node."""
    fwd = forward_time(meta, batch, device)
    return fwd * (2 if recompute else 1) + backward_time(meta, batch, device)
