"""StageWorker: forward, recompute and backward of one stage for one micro-batch at a time.

Shared by the one-process and the distributed runtimes; they differ only in how values travel.

* **forward** runs the stage. With recomputation (and not on the last stage) it runs under
  ``no_grad`` and stashes only what went *in*: the received values and the model-input slices
  (optionally in host memory). Without it, it keeps the autograd graph until the backward.
* **recompute** replays the forward with autograd on, from the stash.
* **backward** back-propagates the gradients of the values the stage sent (summed over every
  consumer stage) and returns the gradients of the values it received. With ``split=True``
  (split-backward schedules) it computes only those input gradients, and **weight_grads**
  later accumulates the parameters' gradients (``split_backward.py``).

Random ops (dropout) draw keyed by (step seed, op, sample index in the global batch)
(``ir/rng.py``), so the replay reproduces the same masks, and recomputation, schedule, stage
count, replicas and micro-batch size do not change the numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..codegen.stage_module import Stage
from ..ir.rng import RandomKey, rng_context
from .background_compile import BackgroundStage
from .compiled_stage import CompiledStage
from .split_backward import Deferred, input_grads
from .split_compile import PENDING, CompiledWeights, take_pending

LossFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class _Stash:
    inputs: dict[str, torch.Tensor]  # model-input slices and received values (leaves)
    outputs: dict[str, torch.Tensor] | None = None  # with autograd graph, after F or R
    nbytes: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # mutated ones, as before F


def _leaf(value: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    leaf = value.detach()
    if requires_grad:
        leaf.requires_grad_(True)
    return leaf


class StageWorker:
    def __init__(self, stage: Stage, *, recompute: bool, is_last: bool,
                 offload_stash: bool = False,
                 autocast: Callable[[], Any] = contextlib.nullcontext,
                 compiled: bool = False, split_backward: bool = False,
                 compile_wait: bool = False) -> None:
        """``compiled``: run the stage compiled by inductor: eagerly while it compiles in the
        background, then compiled from a step boundary on (background_compile.py), or with
        ``compile_wait`` compiled by torch.compile at its first call (compiled_stage.py);
        ``split_backward``: the schedule splits backwards (then a compiled stage's backward
        is compiled in an input half and a weight half: split_compile.py)."""
        self.stage = stage
        self.compiled = compiled
        self.autocast = autocast  # mixed precision: the context stage compute runs in
        self.spec = stage.spec
        self.recompute = recompute and not is_last  # the last stage never recomputes
        # what forward and recompute call: the stage, or the stage compiled
        self.call: Callable[[dict[str, Any]], dict[str, Any]] = stage
        if compiled and compile_wait:
            self.call = CompiledStage(stage, split_backward)
        elif compiled:  # a recomputing stage's forward runs under no_grad, its recompute not
            self.call = BackgroundStage(stage, split_backward, autocast=autocast,
                                        grad_modes=(False, True) if self.recompute else (True,))
        self.is_last = is_last
        self.offload = offload_stash
        self.random = stage.random
        self.key = RandomKey(0, 0, 1)  # the step's (step.py)
        self.grad_recvs = [t for t in self.spec.recvs if t.requires_grad]
        self._stash: dict[int, _Stash] = {}
        # split: W still to run, bytes
        self._weights: dict[int, tuple[Deferred | CompiledWeights, int]] = {}
        self._devices: dict[int, dict[str, torch.device]] = {}  # of offloaded stashes
        self.stash_bytes = 0
        self.peak_stash_bytes = 0
        # Buffers the stage updates in place (BatchNorm statistics, a call counter): the
        # forward updates them once per micro-batch, as eager does; the recompute replays on
        # copies of their values before that forward, so it neither counts twice nor sees a
        # later micro-batch's state. None until the first forward has shown which they are.
        self._mutated: list[str] | None = None

    # -- helpers -------------------------------------------------------------------------------

    def _run(self, mb: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.random:
            with self.autocast():
                return self.call(inputs)
        with rng_context(self.key, mb), self.autocast():
            return self.call(inputs)

    def _track(self, delta: int) -> None:
        self.stash_bytes += delta
        self.peak_stash_bytes = max(self.peak_stash_bytes, self.stash_bytes)

    def reset_peak(self) -> None:
        self.peak_stash_bytes = self.stash_bytes

    def at_step_boundary(self) -> None:
        """Before a step: a stage compiling in the background switches to its compiled
        version here once it is ready, so every micro-batch of a step runs one version."""
        if isinstance(self.call, BackgroundStage):
            self.call.at_step_boundary()

    # -- actions -------------------------------------------------------------------------------

    def forward(self, mb: int, model_inputs: dict[str, torch.Tensor],
                received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Returns every value the stage produces for others (sends and output leaves)."""
        inputs = {name: model_inputs[name] for name in self.spec.inputs}
        needs = {t.name: t.requires_grad for t in self.spec.recvs}
        for name, value in received.items():
            inputs[name] = _leaf(value, needs[name] and torch.is_grad_enabled())
        if self.recompute:
            every = dict(self.stage.module.named_buffers())  # looked up: may be reassigned
            watched = every if self._mutated is None else {n: every[n] for n in self._mutated}
            before = {n: (b._version, b.clone()) for n, b in watched.items()}
            with torch.no_grad():
                outputs = self._run(mb, inputs)
            if self._mutated is None:
                # by value too: BatchNorm's kernel updates its statistics without a version bump
                self._mutated = [n for n, b in watched.items() if b._version != before[n][0]
                                 or not torch.equal(b, before[n][1])]
            saved = {n: before[n][1] for n in self._mutated}
            stashed = {k: (v.detach().to("cpu", non_blocking=True) if self.offload else v)
                       for k, v in inputs.items()}
            self._devices[mb] = {k: v.device for k, v in inputs.items()}
            nbytes = sum(v.numel() * v.element_size() for v in stashed.values())
            self._stash[mb] = _Stash(stashed, None, nbytes, saved)
        else:
            outputs = self._run(mb, inputs)
            nbytes = _graph_bytes(outputs, inputs)
            self._stash[mb] = _Stash(inputs, outputs, nbytes)
        self._track(nbytes)
        return outputs

    def recompute_mb(self, mb: int, device: torch.device | None = None) -> None:
        stash = self._stash[mb]
        inputs = {}
        needs = {t.name: t.requires_grad for t in self.spec.recvs}
        devices = self._devices.pop(mb, {})
        for name, value in stash.inputs.items():
            if self.offload:  # back from host memory to where the stage runs
                value = value.to(device or devices.get(name, value.device), non_blocking=True)
            inputs[name] = _leaf(value, needs.get(name, False))
        with torch.enable_grad(), _swapped(self.stage.module, stash.buffers):
            stash.inputs = inputs
            stash.outputs = self._run(mb, inputs)

    def backward(self, mb: int, grads: dict[str, torch.Tensor],
                 loss: torch.Tensor | None = None,
                 split: bool = False) -> dict[str, torch.Tensor]:
        """``grads``: summed gradients of the sent values; ``loss``: on the last stage, the
        micro-batch's scaled loss. Returns the gradients of the received values. ``split``:
        leave the weight gradients to :meth:`weight_grads`."""
        stash = self._stash.pop(mb)
        if stash.outputs is None:
            raise RuntimeError(f"stage {self.stage.index}: backward of micro-batch {mb} before "
                               "its recompute")
        tensors, seeds = [], []
        if loss is not None:
            tensors.append(loss)
            seeds.append(torch.ones_like(loss))
        for name, grad in grads.items():
            value = stash.outputs[name]
            if value.requires_grad:
                tensors.append(value)
                # under autocast the value may be bf16 while the gradient travelled as planned
                seeds.append(grad if grad.dtype == value.dtype else grad.to(value.dtype))
        if split and self.compiled:
            # the compiled backward computes the input gradients and queues its weight half
            # (split_compile.py), which W runs; a stage that runs eagerly (its compile failed,
            # or it draws keyed) gets every gradient here and an empty W
            mark = len(PENDING)
            if tensors:
                torch.autograd.backward(tensors, seeds)
            self._weights[mb] = (take_pending(mark), stash.nbytes)
        elif split:
            leaves = [stash.inputs[t.name] for t in self.grad_recvs]
            params = list(self.stage.module.parameters())
            self._weights[mb] = (input_grads(tensors, seeds, leaves, params), stash.nbytes)
        else:
            if tensors:
                torch.autograd.backward(tensors, seeds)
            self._track(-stash.nbytes)
        result = {}
        for t in self.grad_recvs:
            leaf = stash.inputs[t.name]
            result[t.name] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        return result

    def weight_grads(self, mb: int) -> None:
        """The weight-gradient part of micro-batch ``mb``'s split backward (into ``.grad``)."""
        deferred, nbytes = self._weights.pop(mb)
        deferred.run()
        self._track(-nbytes)

    def outputs_of(self, mb: int) -> dict[str, torch.Tensor]:
        stash = self._stash[mb]
        assert stash.outputs is not None
        return stash.outputs


@contextlib.contextmanager
def _swapped(module: nn.Module, buffers: dict[str, torch.Tensor]) -> Any:
    """Temporarily make ``buffers`` (by FQN) the module's buffers; the originals come back
    untouched, whatever the body did to the substitutes."""
    originals = {}
    for name, value in buffers.items():
        prefix, _, attr = name.rpartition(".")
        owner = module.get_submodule(prefix)
        originals[name] = (owner, attr, getattr(owner, attr))
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, original in originals.values():
            setattr(owner, attr, original)


def _graph_bytes(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> int:
    """Rough size of what a kept autograd graph holds: inputs plus outputs (a lower bound; the
    saved intermediates are not visible from here)."""
    total = sum(v.numel() * v.element_size() for v in inputs.values())
    return total + sum(v.numel() * v.element_size() for v in outputs.values()
                       if isinstance(v, torch.Tensor))
