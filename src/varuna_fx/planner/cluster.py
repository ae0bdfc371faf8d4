"""Cluster: the machines a plan is made for (which need not be the machines we run on)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..costs.roofline import DEVICES, DeviceSpec, device_spec
from ..errors import VarunaFxError
from ..world import where
from ..world.membership import in_place, membership
from ..world.network import NetworkProfile
from .steady import steady as steady_links

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_FLOP_UNITS = {"flop": 1, "kflop": 10**3, "mflop": 10**6, "gflop": 10**9, "tflop": 10**12,
               "pflop": 10**15, "flops": 1, "tflops": 10**12, "gflops": 10**9, "pflops": 10**15}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """"16GiB" / "32GB" / "512MiB" / 1024 -> bytes."""
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise VarunaFxError(f"cannot read memory size {value!r}: give a finite number of "
                                "bytes or e.g. '16GiB'")
        return int(value)
    match = _QUANTITY.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise VarunaFxError(
            f"cannot read memory size {value!r}: write a number of bytes or e.g. '16GiB', '32GB', "
            "'512MiB'"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _rate(text: str) -> tuple[float, str] | None:
    """'25 Gbit/s' -> (25.0, 'gbit'); None when it does not read as a number and a unit."""
    text = text.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    match = _QUANTITY.match(text)
    return (float(match.group(1)), match.group(2).lower()) if match else None


def parse_bandwidth(value: int | float | str) -> float:
    """"100GB/s" / "25Gbit/s" / 1e9 -> bytes per second."""
    if isinstance(value, (int, float)):
        return float(value)
    rate = _rate(value)
    if rate is not None and rate[1] in _BIT_UNITS:
        return rate[0] * _BIT_UNITS[rate[1]] / 8
    if rate is not None and rate[1] in _BYTE_UNITS:
        return rate[0] * _BYTE_UNITS[rate[1]]
    raise VarunaFxError(
        f"cannot read bandwidth {value!r}: write bytes/s or e.g. '100GB/s', '25Gbit/s'"
    )


def parse_flops(value: int | float | str) -> float:
    """"150TFLOP/s" / "150 TFLOPS" / 1.5e14 -> FLOP per second."""
    if isinstance(value, (int, float)):
        return float(value)
    rate = _rate(value)
    if rate is None or rate[1] not in _FLOP_UNITS:
        raise VarunaFxError(
            f"cannot read throughput {value!r}: write FLOP/s or e.g. '150TFLOP/s', '60 TFLOPS'"
        )
    return rate[0] * _FLOP_UNITS[rate[1]]


def parse_seconds(value: int | float | str) -> float:
    """"5us" / "0.1ms" / 2e-6 -> seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    match = _QUANTITY.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in units:
        raise VarunaFxError(f"cannot read latency {value!r}: write seconds or e.g. '5us', '0.1ms'")
    return float(match.group(1)) * units[unit]


@dataclass(frozen=True)
class Cluster:
    """Devices to plan for. Sizes accept numbers or strings such as "16GiB" and "10Gbit/s"."""

    gpus: int
    gpus_per_node: int = 1
    gpu_memory: int | str = "16GiB"
    intra_node_bandwidth: float | str = "100GB/s"
    inter_node_bandwidth: float | str = "10Gbit/s"
    device: str = "cuda"
    # What the planner needs to time a device it cannot measure: a known type ("a100", "v100",
    # "h100", "h200", "cpu"; None: a generic GPU, or "cpu" for device="cpu") and/or the sustained
    # throughput. A profile measured on the same device type beats both.
    device_type: str | None = None
    flops: float | str | None = None
    latency: float | str = 0.0  # seconds per message between devices (added to every transfer)
    # The links as measured (Cluster.local() in a launched job): when set, the planner and the
    # partitioner time every transfer with it instead of the stated bandwidths and latency.
    network: NetworkProfile | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise VarunaFxError(f"Cluster(gpus={self.gpus!r}): gpus must be a positive integer")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise VarunaFxError(
                f"Cluster(gpus_per_node={self.gpus_per_node!r}): must be a positive integer"
            )
        if self.device not in ("cuda", "cpu"):
            raise VarunaFxError(f"Cluster(device={self.device!r}): use 'cuda' or 'cpu'")
        if self.device_type is not None:
            object.__setattr__(self, "device_type", str(self.device_type).lower())
            if self.device_type not in DEVICES and self.flops is None:
                raise VarunaFxError(
                    f"Cluster(device_type={self.device_type!r}) is unknown: use one of "
                    f"{sorted(DEVICES)} or state its throughput, e.g. flops='100TFLOP/s'"
                )
        if self.flops is not None:
            object.__setattr__(self, "flops", parse_flops(self.flops))
        object.__setattr__(self, "latency", parse_seconds(self.latency))
        # Normalise units once so the planner only ever sees numbers.
        object.__setattr__(self, "gpu_memory", parse_bytes(self.gpu_memory))
        object.__setattr__(self, "intra_node_bandwidth", parse_bandwidth(self.intra_node_bandwidth))
        object.__setattr__(self, "inter_node_bandwidth", parse_bandwidth(self.inter_node_bandwidth))
        self._check_positive()

    def _check_positive(self) -> None:
        """Zero, negative or NaN sizes and rates would divide by zero or make every plan fit."""
        examples = {"gpu_memory": "'16GiB'", "intra_node_bandwidth": "'100GB/s'",
                    "inter_node_bandwidth": "'10Gbit/s'", "flops": "'150TFLOP/s'"}
        for name, example in examples.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise VarunaFxError(f"Cluster({name}={value!r}): must be positive and finite, "
                                    f"e.g. {example}")
        if not (math.isfinite(self.latency) and self.latency >= 0):  # type: ignore[arg-type]
            raise VarunaFxError(f"Cluster(latency={self.latency!r}): must be zero or a positive, "
                                "finite time, e.g. '5us'")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON) describing this cluster: an in-place morph hands it from the
        survivors to a joining process (``world/membership.py``), so both plan alike."""
        data = dataclasses.asdict(self)
        data["network"] = None if self.network is None else dataclasses.asdict(self.network)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        data = dict(data)
        if data.get("network") is not None:
            data["network"] = NetworkProfile(**data["network"])
        return cls(**data)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def kind(self) -> str:
        """The device type plans are timed for: device_type, else "cpu" or generic "cuda"."""
        return self.device_type or self.device

    @property
    def spec(self) -> DeviceSpec:
        """Throughput and memory bandwidth for FLOP-based time estimates."""
        return device_spec(self.kind, self.flops)  # type: ignore[arg-type]

    @classmethod
    def local(cls, measure_network: bool = True, timeout: float | None = None) -> Cluster:
        """The job we are running in: world size from torch.distributed or torchrun's env.

        Launched on several ranks (torchrun), it joins the process group and measures the links
        the job will use (:func:`varuna_fx.world.network.measure_network`: ping-pongs and an all-reduce,
        about a second, the same numbers on every rank), so plans price
        transfers by the real network instead of assuming fast links. Every rank must call it
        then. ``measure_network=False`` skips that and keeps the stated defaults. ``timeout``:
        seconds to wait for the other ranks (default 300; ``vf.compile`` passes its own, which
        the process group then keeps for its collectives)."""
        import torch

        if in_place():  # an in-place job: joining a running one plans for the survivors' world
            where.init_process_group(300.0 if timeout is None else timeout)
            gen = membership().generation
            if gen is not None and gen.running and gen.cluster is not None:
                return cls.from_dict(gen.cluster)
        measured = None
        if measure_network and where.launched_distributed():
            where.init_process_group(300.0 if timeout is None else timeout)
            measured = steady_links()  # probed up to 3 times, rounded, kept (steady.py)
        world = where.world_size()
        if torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory
            device = "cuda"
        else:
            memory = _host_memory()
            device = "cpu"
        return cls(
            gpus=world,
            gpus_per_node=where.local_world_size(),
            gpu_memory=memory,
            device=device,
            device_type=local_device_type(),
            network=measured,
        )


def local_device_type() -> str:
    """This machine's device type as the planner names it: "cpu", "h100", ..., or "cuda"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for kind in ("h200", "h100", "a100", "v100"):
        if kind in name:
            return kind
    return "cuda"


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30
