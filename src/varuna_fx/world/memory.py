"""How much memory this process can still allocate on a device, and where that number comes from.

A one-process pipeline of a ``vf.deferred_init`` model allocates the whole model when it is first
used (``init/allocation.py``); it asks here first, so a model that cannot fit is refused with
the numbers instead of swapping the machine to a halt or being killed by the kernel. Host
memory: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping),
lowered to what this process's cgroup still allows (``memory.max - memory.current``, v2; the
v1 limit and usage otherwise). A CUDA device: the free bytes ``torch.cuda.mem_get_info`` reports.
None where nothing says (another OS, no such files): then nothing is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

_MEMINFO = Path("/proc/meminfo")
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes this process can still allocate on ``device``, where the number comes from),
    or None when nothing says."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device} (torch.cuda.mem_get_info)"
    if device.type != "cpu":
        return None
    found = _meminfo_available()
    limit = _cgroup_room()
    if limit is not None and (found is None or limit[0] < found[0]):
        return limit
    return found


def _meminfo_available() -> tuple[int, str] | None:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> tuple[int, str] | None:
    """What this process's memory cgroup still allows, or None without a limit."""
    for limit_file, usage_file in ((_CGROUP_V2 / "memory.max", _CGROUP_V2 / "memory.current"),
                                   (_CGROUP_V1 / "memory.limit_in_bytes",
                                    _CGROUP_V1 / "memory.usage_in_bytes")):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None  # no limit (v1 writes a huge number for none)
        return max(0, int(limit_text) - usage), f"the memory limit of this process's cgroup " \
            f"({limit_file})"
    return None
