"""One-process runtime: all P stages in this process, under the compiled schedule.

Actions run in ``execution_order(schedule)``: a global order that respects every stage's list
and every data dependency; Python dicts stand in for the network. The numbers are the same as
a distributed run's, which makes this the runtime for notebooks, exploration and tests.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..codegen import Stage
from ..schedule import Kind, build_schedule, execution_order, validate
from . import preemption
from .batching import micro_batch_loss, split_batch, split_target
from .precision import LossScaler, autocast_factory
from .worker import StageWorker


class LocalRuntime:
    def __init__(self, stages: list[Stage], *, assemble: Any, loss_fn: Any,
                 schedule: str, recompute: bool, micro_batch_size: int,
                 offload_stash: bool = False, precision: str = "fp32") -> None:
        self.stages = stages
        self.assemble = assemble  # last stage's outputs dict -> the model's output structure
        self.loss_fn = loss_fn
        self.schedule_name = schedule
        self.recompute = recompute
        self.micro_batch_size = micro_batch_size
        self.autocast = autocast_factory(precision, "cuda" if _on_cuda(stages) else "cpu")
        self.scaler = LossScaler(enabled=precision == "fp16")
        last = len(stages) - 1
        self.workers = [StageWorker(s, recompute=recompute, is_last=s.index == last,
                                    offload_stash=offload_stash, autocast=self.autocast)
                        for s in stages]
        self._orders: dict[int, list] = {}
        self.preempted = False
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # one rank under torchrun (an elastic job shrunk to one machine): its agent stops
            # workers with SIGTERM on a membership change, which must save, not kill
            preemption.install_handlers()

    def order(self, num_micro_batches: int) -> list:
        if num_micro_batches not in self._orders:
            sched = build_schedule(self.schedule_name, len(self.stages), num_micro_batches,
                                   self.recompute)
            validate(sched)
            self._orders[num_micro_batches] = execution_order(sched)
        return self._orders[num_micro_batches]

    def step(self, inputs: dict[str, torch.Tensor], target: Any = None) -> torch.Tensor:
        micro = split_batch(inputs, self.micro_batch_size)
        m = len(micro)
        targets = split_target(target, self.micro_batch_size, m)
        seed = int(torch.randint(0, 2**62, ())) if any(w.random for w in self.workers) else 0
        for w in self.workers:
            w.seed = seed
        # values in flight: (dst stage, mb) -> {name: tensor}; gradients: (src, mb) -> {name}
        inbox: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        grad_box: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        losses: list[torch.Tensor] = [torch.zeros(())] * m
        last = len(self.stages) - 1
        for action in self.order(m):
            s, i = action.stage, action.mb
            worker = self.workers[s]
            if action.kind is Kind.F:
                outputs = worker.forward(i, micro[i], inbox.pop((s, i), {}))
                for t in worker.spec.sends:  # in the planned dtype, as the network carries it
                    inbox[(t.dst, i)][t.name] = outputs[t.name].to(t.tensor.dtype)
            elif action.kind is Kind.R:
                worker.recompute_mb(i)
            else:
                loss = None
                if s == last:
                    output = self.assemble(worker.outputs_of(i))
                    losses[i], loss = micro_batch_loss(output, self.loss_fn, targets[i], m,
                                                       self.autocast, self.scaler.scale)
                grads = worker.backward(i, grad_box.pop((s, i), {}), loss)
                for t in worker.spec.recvs:
                    if t.requires_grad:
                        box = grad_box[(t.src, i)]
                        box[t.name] = box[t.name] + grads[t.name] if t.name in box \
                            else grads[t.name]
        if self.scaler.enabled:
            self.scaler.unscale_(_unique_params(self.stages))
        self.preempted = preemption.requested()  # handlers: pipe.install_preemption_handlers()
        return torch.stack(losses).mean()

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        # one process holds each parameter once (tied ones are one object): torch's own
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm, norm_type)

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The whole batch as one micro-batch, stage after stage (autograd as the caller's)."""
        values: dict[str, torch.Tensor] = {}
        outputs: dict[str, Any] = {}
        with self.autocast():
            for stage in self.stages:
                outputs = stage({**inputs, **values})
                values.update(outputs)
        return self.assemble(outputs)


def _on_cuda(stages: list[Stage]) -> bool:
    return any(p.is_cuda for s in stages for p in s.module.parameters())


def _unique_params(stages: list[Stage]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for s in stages:
        for p in s.module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
