"""Cluster: the machines a plan is made for (which need not be the machines we run on)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import VarunaFxError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """"16GiB" / "32GB" / "512MiB" / 1024 -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = _QUANTITY.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise VarunaFxError(
            f"cannot read memory size {value!r}: write a number of bytes or e.g. '16GiB', '32GB', "
            "'512MiB'"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def parse_bandwidth(value: int | float | str) -> float:
    """"100GB/s" / "25Gbit/s" / 1e9 -> bytes per second."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    match = _QUANTITY.match(text)
    unit = match.group(2).lower() if match else None
    if match is not None and unit in _BIT_UNITS:
        return float(match.group(1)) * _BIT_UNITS[unit] / 8
    if match is not None and unit in _BYTE_UNITS:
        return float(match.group(1)) * _BYTE_UNITS[unit]
    raise VarunaFxError(
        f"cannot read bandwidth {value!r}: write bytes/s or e.g. '100GB/s', '25Gbit/s'"
    )


@dataclass(frozen=True)
class Cluster:
    """Devices to plan for. Sizes accept numbers or strings such as "16GiB" and "10Gbit/s"."""

    gpus: int
    gpus_per_node: int = 1
    gpu_memory: int | str = "16GiB"
    intra_node_bandwidth: float | str = "100GB/s"
    inter_node_bandwidth: float | str = "10Gbit/s"
    device: str = "cuda"

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise VarunaFxError(f"Cluster(gpus={self.gpus!r}): gpus must be a positive integer")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise VarunaFxError(
                f"Cluster(gpus_per_node={self.gpus_per_node!r}): must be a positive integer"
            )
        if self.device not in ("cuda", "cpu"):
            raise VarunaFxError(f"Cluster(device={self.device!r}): use 'cuda' or 'cpu'")
        # Normalise units once so the planner only ever sees numbers.
        object.__setattr__(self, "gpu_memory", parse_bytes(self.gpu_memory))
        object.__setattr__(self, "intra_node_bandwidth", parse_bandwidth(self.intra_node_bandwidth))
        object.__setattr__(self, "inter_node_bandwidth", parse_bandwidth(self.inter_node_bandwidth))

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @classmethod
    def local(cls) -> Cluster:
        """The job we are running in: world size from torch.distributed or torchrun's env."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory
            device = "cuda"
        else:
            memory = _host_memory()
            device = "cpu"
        return cls(
            gpus=world,
            gpus_per_node=max(1, min(per_node, world)),
            gpu_memory=memory,
            device=device,
        )


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30
