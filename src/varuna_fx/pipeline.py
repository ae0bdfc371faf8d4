"""Pipeline: what ``vf.compile`` returns -- the stages, the plan and a runtime to drive them.

Layer: above the runtimes. :func:`make_pipeline` picks the runtime for where this process runs
(``where.py``): all stages here, or this rank's stage of a distributed job.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .capture import Captured, bind_inputs
from .codegen import Stage
from .errors import InputError
from .ir import info
from .plan import Plan
from .runtime import preemption
from .runtime.batching import check_sample_shapes
from .runtime.checkpoint import checkpointer, wait_for_saves
from .runtime.distributed import make_distributed_runtime
from .runtime.local import LocalRuntime
from .runtime.model_state import StateLayout, check_state_dict
from .runtime.outputs import OutputAssembler
from .runtime.precision import check_precision, optimizer_step
from .runtime.setup import held_tensors
from .runtime.step import Runtime
from .where import launched_distributed


def make_pipeline(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                  canonical: dict[str, str], *, loss_fn: Any, offload_stash: bool,
                  precision: str = "fp32", timeout: float | None = None) -> Pipeline:
    """The distributed runtime under torchrun (world size > 1), else the one-process one."""
    check_precision(precision)
    assemble = OutputAssembler(captured)
    # the model's whole state, before a distributed rank empties what it does not hold
    layout = StateLayout.of(model, canonical, stages)
    runtime: Runtime
    if launched_distributed():
        runtime = make_distributed_runtime(
            model, captured, stages, plan, canonical, assemble=assemble, loss_fn=loss_fn,
            offload_stash=offload_stash, precision=precision, timeout=timeout, layout=layout)
    else:
        runtime = LocalRuntime(stages, plan, assemble=assemble, loss_fn=loss_fn,
                               offload_stash=offload_stash, precision=precision)
    return Pipeline(model, captured, stages, plan, canonical, runtime, assemble, layout)


class Pipeline:
    def __init__(self, model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                 canonical: dict[str, str], runtime: Runtime,
                 assemble: OutputAssembler | None = None,
                 state_layout: StateLayout | None = None) -> None:
        self.model = model
        self.captured = captured
        self.stages = stages
        self.plan = plan
        self.canonical = canonical
        self.runtime = runtime
        self.stage_index = runtime.stage_index
        self.replica_index = runtime.replica_index
        # stages whose parameters live in this process (all of them in one process)
        self.local_stages = runtime.local_stages
        # every parameter and persistent buffer with its full shape, and which ones no stage
        # reads (stage 0 holds those)
        self.state_layout = state_layout or StateLayout.of(model, canonical, stages)
        self._input_infos = {str(n.target): info(n).outputs[0] for n in captured.gm.graph.nodes
                             if n.op == "placeholder" and info(n).outputs}
        self._assemble = assemble or OutputAssembler(captured)

    # -- running -------------------------------------------------------------------------------

    def _bind(self, inputs: tuple, kw_inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        bound = bind_inputs(self.model, inputs, kw_inputs, what="step inputs",
                            signature=self.captured.signature)
        expected = self.captured.input_names
        if list(bound.tensors) != expected:
            raise InputError(
                f"inputs {list(bound.tensors)} differ from the compiled ones {expected}: pass the "
                "same arguments as example_inputs"
            )
        check_sample_shapes(bound.tensors, self._input_infos)
        if bound.constants != self.captured.constants:
            raise InputError(
                f"constant arguments {bound.constants} differ from the compiled ones "
                f"{self.captured.constants}; compile again to change them"
            )
        return bound.tensors

    def assemble(self, outputs: dict[str, Any]) -> Any:
        """The last stage's result dict -> the model's output structure."""
        return self._assemble(outputs)

    def step(self, *inputs: Any, target: Any = None, **kw_inputs: Any) -> torch.Tensor:
        """Forward and backward of one batch under the schedule; returns the mean loss."""
        # this process's preemption signal rides on the step's world all-reduce
        return self.runtime.step(self._bind(inputs, kw_inputs), target,
                                 flags=(preemption.requested(),))

    def __call__(self, *inputs: Any, **kw_inputs: Any) -> Any:
        return self.runtime.forward(self._bind(inputs, kw_inputs))

    # -- parameters ----------------------------------------------------------------------------

    def _held_names(self) -> list[str]:
        """Canonical names this process holds: its stages' tensors, plus on stage 0 the ones
        forward never reads (so they are saved and kept, not lost)."""
        return self.state_layout.held_names(self.canonical, self.stages, self.local_stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from held_tensors(self.model, self._held_names())[0].items()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from held_tensors(self.model, self._held_names())[1].items()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model (every stage, tied parameters counted once) to
        ``max_norm`` and return the total norm -- ``torch.nn.utils.clip_grad_norm_`` on the
        eager model, on every rank."""
        return self.runtime.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    # -- mixed precision (see runtime/precision.py) ---------------------------------------------

    @property
    def found_inf(self) -> bool:
        """fp16: whether the last ``step`` overflowed on any stage of any replica (then
        :meth:`optimizer_step` skips the update everywhere). Always False otherwise."""
        return self.runtime.scaler.found_inf

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 for fp32 and bf16)."""
        return self.runtime.scaler.scale

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last step overflowed (fp16), then update the loss
        scale. Returns whether it stepped. Works for every precision, so scripts can always
        call it instead of ``optimizer.step()``."""
        return optimizer_step(self.runtime.scaler, optimizer)

    def close(self) -> None:
        """Release what the runtime holds (process groups); the pipeline is unusable after."""
        wait_for_saves(self)  # an async checkpoint still being written completes first
        self.runtime.close()

    def train(self, mode: bool = True) -> Pipeline:
        self.model.train(mode)
        for s in self.stages:
            s.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer held here, keyed by the original (canonical)
        FQNs: in one process the whole model (tied weights once, tensors forward never reads
        included); in a distributed run the tensors this rank holds."""
        persistent = set(self.state_layout.names)
        state = {n: p for n, p in self.named_parameters()}
        state.update({n: b for n, b in self.named_buffers() if n in persistent})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` into the tensors held here. Keys may be any FQN of the model (a tied
        weight under either name); the shapes must match. ``strict``: every held tensor must
        be given, and keys the model does not have are refused."""
        mine = self.state_dict()
        for name, value in check_state_dict(state, self.state_layout, list(mine), strict).items():
            with torch.no_grad():
                mine[name].copy_(value)

    # -- checkpoints (runtime/checkpoint.py) and preemption (runtime/preemption.py) ----------

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None, *,
                        async_save: bool = False) -> Any:
        """Write a checkpoint directory (torch.distributed.checkpoint; every rank its shard).
        ``async_save=True`` returns once the state is copied to host memory and writes in the
        background: the returned handle's ``.result()`` waits until the checkpoint is
        complete. See docs/checkpoints.md."""
        return checkpointer(self).save(str(path), optimizer, extra, async_save=async_save)

    def load_checkpoint(self, path: str,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Load a checkpoint saved under any layout; returns the ``extra`` dict it was saved
        with."""
        return checkpointer(self).load(str(path), optimizer)

    @property
    def preempted(self) -> bool:
        """True on every rank after the step during which any rank got SIGTERM or SIGUSR1."""
        flags = getattr(self.runtime, "flags", ())
        return bool(flags and flags[0])

    def install_preemption_handlers(self) -> None:
        """Catch SIGTERM and SIGUSR1 in this process (done automatically under torchrun)."""
        preemption.install_handlers()

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan})"
