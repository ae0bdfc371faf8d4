"""MFU: the plan's FLOPs per step over the devices' peak.

The FLOPs are the plan's (``StageCost.flops``: forward + backward of one micro-batch, from the
graph's shapes; recomputation not counted, as MFU does not count it) times the micro-batches
of the step over every replica. The peak is a datasheet's dense figure per device: bf16/fp16
tensor cores under ``precision="bf16"``/``"fp16"``, TF32 (FP32 on a V100) otherwise. A device
not listed -- every CPU -- gets twice the roofline's sustained figure (``costs/roofline.py``,
which takes sustained as about half of peak): ``Peak.assumed``, and the monitor labels its MFU
an estimate against that assumed peak, naming it (a CPU has no datasheet figure of this kind:
its peak depends on the cores, threads and vector units the process gets).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..costs.roofline import DEVICES
from .watched import Watched

# dense datasheet peaks, FLOP/s: (bf16/fp16 tensor cores, fp32 via TF32 (FP32 on V100))
DATASHEET: dict[str, tuple[float, float]] = {
    "v100": (125e12, 15.7e12),
    "a100": (312e12, 156e12),
    "h100": (989e12, 495e12),
    "h200": (989e12, 495e12),
}


@dataclass(frozen=True)
class Peak:
    flops: float  # per device
    devices: int
    what: str  # how the figure was arrived at, for the monitor's header
    assumed: bool = False  # no datasheet or given figure: MFU is an estimate against it

    def mfu(self, model_flops: float, seconds: float) -> float | None:
        if seconds <= 0 or self.flops <= 0:
            return None
        return model_flops / (seconds * self.flops * self.devices)


def peak_of(pipe: Watched, given: float | None = None) -> Peak:
    """The peak FLOP/s of the devices ``pipe`` runs on (``given``: the user's figure)."""
    devices = 1 if pipe.replicas == 1 and len(pipe.local_stages) == len(pipe.stages) \
        else pipe.plan.placement.world_size if pipe.plan.placement is not None \
        else pipe.plan.stages * pipe.plan.data_parallel
    if given is not None:
        return Peak(float(given), devices, f"{given:.3g} FLOP/s per device (given)")
    device = next((p.device for p in pipe.parameters()), torch.device("cpu"))
    low = _low_precision(pipe)
    kind = "bf16/fp16" if low else "fp32/TF32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in DATASHEET.items():
            if key in name.lower():
                flops = half if low else single
                return Peak(flops, devices, f"{flops / 1e12:.0f} TFLOP/s per {name} "
                            f"({kind} dense datasheet peak)")
        flops = 2 * DEVICES["cuda"].flops
        return Peak(flops, devices, f"{flops / 1e12:.0f} TFLOP/s per {name} (assumed: not in "
                    "the datasheet table; pass peak_flops=)", assumed=True)
    flops = 2 * DEVICES["cpu"].flops
    return Peak(flops, devices, f"{flops / 1e9:.0f} GFLOP/s per CPU process (assumed, twice "
                "the roofline's sustained CPU figure; pass peak_flops= for this machine's)",
                assumed=True)


def flops_text(flops: float) -> str:
    """``100 GFLOP/s``, ``989 TFLOP/s``: a peak as the line and the charts name it."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP/s"


def step_flops(plan: Any, samples: int) -> float:
    """The model FLOPs (forward + backward) of a step over ``samples`` samples."""
    per_micro_batch = sum(s.flops for s in plan.stage_costs)
    return per_micro_batch * samples / plan.micro_batch_size


def _low_precision(pipe: Watched) -> bool:
    if pipe.runtime.autocast is not contextlib.nullcontext:
        return True
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in pipe.parameters())
