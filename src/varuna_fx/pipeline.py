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
from .runtime.batching import check_sample_shapes
from .runtime.distributed import make_distributed_runtime
from .runtime.local import LocalRuntime
from .runtime.outputs import OutputAssembler
from .runtime.precision import check_precision, optimizer_step
from .runtime.setup import held_names, held_tensors
from .runtime.shard import shard_batch
from .runtime.step import Runtime
from .where import launched_distributed


def make_pipeline(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                  canonical: dict[str, str], *, loss_fn: Any, offload_stash: bool,
                  precision: str = "fp32", timeout: float | None = None) -> Pipeline:
    """The distributed runtime under torchrun (world size > 1), else the one-process one."""
    check_precision(precision)
    assemble = OutputAssembler(captured)
    runtime: Runtime
    if launched_distributed():
        runtime = make_distributed_runtime(
            model, captured, stages, plan, canonical, assemble=assemble, loss_fn=loss_fn,
            offload_stash=offload_stash, precision=precision, timeout=timeout)
    else:
        runtime = LocalRuntime(stages, plan, assemble=assemble, loss_fn=loss_fn,
                               offload_stash=offload_stash, precision=precision)
    return Pipeline(model, captured, stages, plan, canonical, runtime, assemble)


class Pipeline:
    def __init__(self, model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                 canonical: dict[str, str], runtime: Runtime,
                 assemble: OutputAssembler | None = None) -> None:
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
        return self.runtime.step(self._bind(inputs, kw_inputs), target)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas that run: ``plan.data_parallel`` in a distributed job; 1 in
        one process, which steps on the whole batch it is given."""
        return 1 if isinstance(self.runtime, LocalRuntime) else self.plan.data_parallel

    def shard(self, batch: Any, replica: int | None = None, replicas: int | None = None) -> Any:
        """This replica's contiguous share of a global batch, with the batch's structure.

        Every rank passes the same global batch (a tensor, or tuples/lists/dicts of them, dim 0
        the batch); replica r of D keeps samples ``[r*N/D, (r+1)*N/D)``. In one process
        (``replicas`` 1) that is the whole batch. Without this, D replicas given the same batch
        train on the same samples D times, and nothing warns. ``replica``/``replicas`` override
        ``self.replica_index``/``self.replicas`` (e.g. to shard for another replica).
        """
        return shard_batch(batch, self.replica_index if replica is None else replica,
                           self.replicas if replicas is None else replicas)

    def __call__(self, *inputs: Any, **kw_inputs: Any) -> Any:
        return self.runtime.forward(self._bind(inputs, kw_inputs))

    # -- parameters ----------------------------------------------------------------------------

    def _held_names(self) -> list[str]:
        return held_names(self.canonical, self.stages, self.local_stages)

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
        """Parameters and buffers held here, keyed by the original (canonical) FQNs."""
        persistent = set(self.model.state_dict().keys())
        state = {n: p for n, p in self.named_parameters()}
        state.update({n: b for n, b in self.named_buffers() if n in persistent})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        mine = self.state_dict()
        missing = [k for k in mine if k not in state]
        if strict and missing:
            raise InputError(f"state dict lacks {len(missing)} entries, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, tensor in mine.items():
                if name in state:
                    tensor.copy_(state[name])

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan})"
