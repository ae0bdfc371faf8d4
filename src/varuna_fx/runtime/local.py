"""One-process runtime: all P stages in this process, under the plan's schedule.

Actions run in ``execution_order(schedule)``: a global order that respects every stage's list
and every data dependency; Python dicts stand in for the network. The step loop is the shared
one (``step.py``), so the numbers are the same as a distributed run's, which makes this the
runtime for notebooks, exploration and tests. It runs as compile's running options say
(``options.RunOptions``, taken whole).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..codegen.stage_module import Stage
from ..ir.rng import RandomKey
from ..planner.plan import Plan
from ..schedule import Action, Kind, execution_order, validate, with_micro_batches
from . import preemption
from .compress import roundtrip, transfer_mode
from .loss_weights import MeanLoss
from .options import RunOptions
from .precision import LossScaler, autocast_factory
from .step import LossOf, StepLoop
from .worker import StageWorker


class LocalRuntime(StepLoop):
    def __init__(self, stages: list[Stage], plan: Plan, options: RunOptions, *,
                 assemble: Callable[[dict], Any], device: torch.device | None = None,
                 mean_loss: MeanLoss | None = None) -> None:
        """``device``: where the stages' tensors will be (a deferred model allocates them at
        first use); None: where they are. ``mean_loss``: how micro-batches of the model's
        mean-over-labels loss are weighed (``loss_weights.find_mean_loss``)."""
        self.stages = stages
        self.plan = plan
        self.assemble = assemble
        self.loss_fn = options.loss_fn
        self.local_stages = list(range(len(stages)))
        on_cuda = device.type == "cuda" if device is not None else _on_cuda(stages)
        self.autocast = autocast_factory(options.precision, "cuda" if on_cuda else "cpu")
        self.scaler = LossScaler(enabled=options.precision == "fp16")
        self.mean_loss = mean_loss
        # none made at compile: every parameter is here, so the pipeline cuts them when asked
        self.other_modes = {}
        last = len(stages) - 1
        self.workers = [StageWorker(s, recompute=plan.recompute[s.index],
                                    is_last=s.index == last, offload_stash=options.offload_stash,
                                    autocast=self.autocast,
                                    compiled=plan.compiles_on("cuda" if on_cuda else "cpu"),
                                    split_backward=plan.schedule.split_backward,
                                    compile_wait=options.compile_wait)
                        for s in stages]
        self._orders: dict[int, list[Action]] = {}
        # (src, dst) -> how a transfer between those stages would travel between their ranks
        # (compress.py): the distributed runtime's codec, applied here in memory
        self._modes: dict[tuple[int, int], str] = {}
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # one rank under torchrun (an elastic job shrunk to one machine): its agent stops
            # workers with SIGTERM on a membership change, which must save, not kill
            preemption.install_handlers()

    def order(self, num_micro_batches: int) -> list[Action]:
        if num_micro_batches not in self._orders:
            sched = with_micro_batches(self.plan.schedule, num_micro_batches)
            validate(sched)
            self._orders[num_micro_batches] = execution_order(sched)
        return self._orders[num_micro_batches]

    # -- step-loop hooks -----------------------------------------------------------------------

    def set_seed(self, key: RandomKey) -> None:
        for w in self.workers:
            w.key = key

    def run_actions(self, micro: list[dict[str, torch.Tensor]], loss_of: LossOf) -> None:
        # values in flight: (dst stage, mb) -> {name: tensor}; gradients: (src, mb) -> {name}
        inbox: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        grad_box: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        last = len(self.stages) - 1
        timeline, clock = self.timeline, time.perf_counter
        for action in self.order(len(micro)):
            s, i = action.stage, action.mb
            began = clock()
            worker = self.workers[s]
            if action.kind is Kind.F:
                outputs = worker.forward(i, micro[i], inbox.pop((s, i), {}))
                for t in worker.spec.sends:  # in the planned dtype, as the network carries it
                    inbox[(t.dst, i)][t.name] = roundtrip(outputs[t.name].to(t.tensor.dtype),
                                                          self.mode(t.src, t.dst))
            elif action.kind is Kind.R:
                worker.recompute_mb(i)
            elif action.kind is Kind.W:
                worker.weight_grads(i)
            else:
                loss = loss_of(i, worker.outputs_of(i)) if s == last else None
                grads = worker.backward(i, grad_box.pop((s, i), {}), loss,
                                        split=self.plan.schedule.split_backward)
                for t in worker.spec.recvs:
                    if t.requires_grad:
                        box = grad_box[(t.src, i)]
                        grad = roundtrip(grads[t.name], self.mode(t.src, t.dst))
                        box[t.name] = box[t.name] + grad if t.name in box else grad
            if timeline is not None:
                timeline.append((s, action.kind.value, i, began, clock()))

    def mode(self, src: int, dst: int) -> str:
        """How a transfer from stage ``src`` to ``dst`` travels: as the plan compresses the
        boundaries it crosses, when their ranks differ (``compress.py``)."""
        found = self._modes.get((src, dst))
        if found is None:
            placement = self.plan.placement
            same = placement is not None and \
                placement.pipeline_rank(src) == placement.pipeline_rank(dst)
            found = self._modes[(src, dst)] = "off" if same else \
                transfer_mode(self.plan.compression, src, dst)
        return found

    def finish(self, losses: list[torch.Tensor], flags: Sequence[bool]
               ) -> tuple[torch.Tensor, tuple[bool, ...]]:
        if self.scaler.enabled:
            self.scaler.unscale_(_unique_params(self.stages))
        return torch.stack(losses).mean(), tuple(bool(f) for f in flags)

    # -- the rest of the Runtime protocol ------------------------------------------------------

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        # one process holds each parameter once (tied ones are one object): torch's own
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm, norm_type)

    def forward(self, inputs: dict[str, torch.Tensor], stages: list[Stage] | None = None,
                assemble: Any = None) -> Any:
        """The whole batch as one micro-batch, stage after stage (autograd as the caller's);
        ``stages``/``assemble``: another mode's graph (``codegen/modes.py``)."""
        values: dict[str, torch.Tensor] = {}
        outputs: dict[str, Any] = {}
        with self.autocast():
            for stage in stages or self.stages:
                outputs = stage({**inputs, **values})
                values.update(outputs)
        return (assemble or self.assemble)(outputs)

    def close(self) -> None:
        """Nothing to release in one process."""


def _on_cuda(stages: list[Stage]) -> bool:
    return any(p.is_cuda for s in stages for p in s.module.parameters())


def _unique_params(stages: list[Stage]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for s in stages:
        for p in s.module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
