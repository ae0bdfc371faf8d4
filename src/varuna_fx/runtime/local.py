"""One-process runtime: all P stages in this process, under the compiled schedule.

Actions run in ``execution_order(schedule)``: a global order that respects every stage's list
and every data dependency; Python dicts stand in for the network. The numbers are the same as
a distributed run's, which makes this the runtime for notebooks, exploration and tests.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..codegen import Stage
from ..schedule import Kind, build_schedule, execution_order, validate
from .batching import extract_loss, split_batch, split_target
from .worker import StageWorker


class LocalRuntime:
    def __init__(self, stages: list[Stage], *, assemble: Any, loss_fn: Any,
                 schedule: str, recompute: bool, micro_batch_size: int,
                 offload_stash: bool = False) -> None:
        self.stages = stages
        self.assemble = assemble  # last stage's outputs dict -> the model's output structure
        self.loss_fn = loss_fn
        self.schedule_name = schedule
        self.recompute = recompute
        self.micro_batch_size = micro_batch_size
        last = len(stages) - 1
        self.workers = [StageWorker(s, recompute=recompute, is_last=s.index == last,
                                    offload_stash=offload_stash) for s in stages]
        self._orders: dict[int, list] = {}

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
                for t in worker.spec.sends:
                    inbox[(t.dst, i)][t.name] = outputs[t.name]
            elif action.kind is Kind.R:
                worker.recompute_mb(i)
            else:
                loss = None
                if s == last:
                    output = self.assemble(worker.outputs_of(i))
                    raw = extract_loss(output, self.loss_fn, targets[i])
                    losses[i] = raw.detach()
                    loss = raw / m
                grads = worker.backward(i, grad_box.pop((s, i), {}), loss)
                for t in worker.spec.recvs:
                    if t.requires_grad:
                        box = grad_box[(t.src, i)]
                        box[t.name] = box[t.name] + grads[t.name] if t.name in box \
                            else grads[t.name]
        return torch.stack(losses).mean()

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The whole batch as one micro-batch, stage after stage (autograd as the caller's)."""
        values: dict[str, torch.Tensor] = {}
        outputs: dict[str, Any] = {}
        for stage in self.stages:
            outputs = stage({**inputs, **values})
            values.update(outputs)
        return self.assemble(outputs)
