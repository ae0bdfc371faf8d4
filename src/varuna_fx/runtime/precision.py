"""Mixed precision: autocast around stage compute, and dynamic loss scaling for fp16.

* ``fp32`` (default): nothing happens.
* ``bf16``: every stage forward, recompute and the loss run under
  ``torch.autocast(device_type, dtype=torch.bfloat16)``; parameters and gradients stay fp32.
* ``fp16``: the same with ``torch.float16``, plus dynamic loss scaling as in
  ``torch.amp.GradScaler``: the loss is multiplied by ``scale`` before the backward, and at the
  end of ``pipe.step`` gradients are divided by it again (exact: the scale is a power of two) and
  checked for inf/nan on every stage. ``pipe.found_inf`` then says whether any stage of any
  replica overflowed, and ``pipe.optimizer_step(optimizer)`` steps unless it did, then updates
  the scale (halved after an overflow, doubled after ``growth_interval`` clean steps). Because the
  unscale happens inside ``step``, ``pipe.clip_grad_norm_`` sees true gradients. Zero the
  gradients before every fp16 step: the unscale assumes ``.grad`` holds this step's only.

Boundary values keep the dtype the plan recorded (traced in fp32): a stage casts what it sends,
so a peer's receive buffer always matches, and the gradient coming back is cast to the dtype of
the value it seeds.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import VarunaFxError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise VarunaFxError(
            f"precision={precision!r} is unknown; choose one of {sorted(PRECISIONS)}"
        )


def autocast_factory(precision: str, device_type: str) -> Callable[[], Any]:
    """A zero-argument function returning the context to run stage compute in. fp16 on a
    CPU warns the first time it is used (a step runs, not a plan that never runs): CPUs
    have no fast fp16 matrix kernels, so autocast to fp16 runs tens of times slower than
    fp32 there (a 256x512 @ 512x512 matmul: 4.5 ms fp32, 1.4 ms bf16, 188 ms fp16 on one
    core), where bf16 is fast."""
    check_precision(precision)
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext
    if dtype is torch.float16 and device_type == "cpu":
        warned = False

        def fp16_on_cpu() -> Any:
            nonlocal warned
            if not warned:
                warned = True
                warnings.warn(
                    "precision='fp16' runs on the CPU here, where fp16 matrix products have no "
                    "fast kernels: a step is many times slower than in fp32 (about 15-40x in "
                    "our measurements). Use precision='bf16' on a CPU (fast, no loss scaling "
                    "needed) or 'fp32'; fp16 is for GPUs", stacklevel=2)
            return torch.autocast(device_type, dtype=dtype)

        return fp16_on_cpu
    return lambda: torch.autocast(device_type, dtype=dtype)


class LossScaler:
    """Dynamic loss scale (fp16). Disabled, it is a scale of 1 that never finds an overflow."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.found_inf = False
        self._clean_steps = 0

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; sets and returns :attr:`found_inf` for this
        process's gradients (a distributed runtime ORs it over every rank afterwards)."""
        if not self.enabled:
            self.found_inf = False
            return False
        grads = [p.grad for p in params if p.grad is not None]
        local = False
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            norms = torch.stack(torch._foreach_norm(grads))
            local = not bool(torch.isfinite(norms).all())
        self.found_inf = local
        return self.found_inf

    def state_dict(self) -> dict[str, float | int]:
        """What carries the loss scale on (a checkpoint, a process joining in place): the
        scale and the clean steps counted towards its next growth."""
        return {"scale": float(self.scale), "clean_steps": int(self._clean_steps)}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s). A disabled scaler (fp32, bf16)
        keeps its scale of 1."""
        if self.enabled:
            self.scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])

    def update(self) -> None:
        """After the optimizer step (or its skip): back off on overflow, grow when stable."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._clean_steps = 0


def optimizer_step(scaler: LossScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Step unless the last ``pipe.step`` overflowed; update the scale. True when it stepped."""
    stepped = not scaler.found_inf
    if stepped:
        optimizer.step()
    scaler.update()
    return stepped
