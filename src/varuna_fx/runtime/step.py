"""The one step loop, shared by the one-process and the distributed runtime.

``StepLoop.step`` is the whole of ``pipe.step`` after the inputs are bound: split the batch into
micro-batches, draw the step's dropout seed, run this process's share of the schedule (every
stage in one process; one stage per rank), then ``finish``: the loss and flags every rank must
agree on. A runtime supplies the four hooks of :class:`Runtime`; the loop owns everything else,
so the two runtimes cannot drift apart (they once drew dropout seeds differently).

Hooking a flag into the step's world all-reduce (e.g. "a rank was preempted"): pass it in
``flags`` -- the distributed runtime packs every flag into the same all-reduce as the loss and
the fp16 overflow, and returns them ORed over all ranks. A flag may be a function, read when the
step's work is done: a preemption signal that arrives during a step then rides that step's
all-reduce instead of the next one's (a whole step sooner).

Each micro-batch's loss is scaled by 1/m (so gradients equal eager ``loss.backward()`` on the
whole batch), or weighted by its kept labels (``loss_weights.py``). The step's dropout seed is
drawn on every replica and replica 0's draw is kept, so a one-replica torchrun run and the
one-process run use the same masks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..capture.captured import Captured
from ..codegen.modes import Modes
from ..codegen.stage_module import Stage
from ..ir.rng import RandomKey, next_step_seed
from ..passes.sample_mixing import warn_sample_mixing
from ..planner.plan import Plan
from .batching import micro_batch_loss, split_batch, split_target
from .loss_fn_mixing import loss_fn_findings
from .loss_weights import MeanLoss, warn_uneven_ignored_targets
from .precision import LossScaler
from .sync.grad_sync import GradSync
from .worker import StageWorker

# (micro-batch, the last stage's outputs for it) -> the scaled loss to back-propagate
LossOf = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]


class Runtime(Protocol):
    """What a pipeline, and the layers that hold one (checkpoints, the monitor, the morph, the
    optimizer's sharding), read of a runtime: one declaration, no probing. ``StepLoop`` gives
    the one-process defaults and implements ``step`` on top of the ``prepare`` /
    ``run_actions`` / ``finish`` hooks; both runtimes set the rest in their ``__init__``."""

    plan: Plan
    stages: list[Stage]
    scaler: LossScaler  # fp16's loss scale; a scale of 1 otherwise
    stage_index: int  # the stage this process runs (0 in one process)
    replica_index: int
    local_stages: list[int]  # stages whose parameters live in this process
    rank: int  # this process's rank in the job (0 in one process)
    device: torch.device | None  # where the stages run (None: where their tensors are)
    timeout: float | None  # seconds a wait on a peer may take (None: one process, no peers)
    autocast: Callable[[], Any]  # the precision's autocast context (nullcontext for fp32)
    loss_fn: Any  # compile's loss_fn (None: the model returns its loss)
    mean_loss: MeanLoss | None  # how micro-batches of a mean-over-labels loss are weighed
    # the replicas' gradient synchronisation (None: one process, nothing to synchronise)
    grad_sync: GradSync | None
    flags: tuple[bool, ...]  # the last step's flags, ORed over every rank
    flag_counts: tuple[int, ...]  # the last step's flags, summed over every rank
    # an in-place job's step-closing sum through its membership store (world/closing.py)
    closer: Callable[[list[float]], list[float]] | None
    # the stages of other train/eval modes made at compile (None: the compiled graph serves)
    other_modes: dict[Modes, tuple[Captured, list[Stage]] | None]
    timeline: list[tuple[int, str, int, float, float]] | None  # the step's actions, if recorded

    def step(self, inputs: dict[str, torch.Tensor], target: Any = None,
             flags: Sequence[bool | Callable[[], bool]] = ()) -> torch.Tensor: ...

    def forward(self, inputs: dict[str, torch.Tensor], stages: list[Stage] | None = None,
                assemble: Any = None) -> Any: ...

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor: ...

    def close(self) -> None: ...


class StepLoop:
    """Base of both runtimes: the step loop. Subclasses set the attributes below in their
    ``__init__`` and implement ``prepare``, ``run_actions`` and ``finish``."""

    plan: Plan
    stages: list[Stage]
    scaler: LossScaler
    autocast: Callable[[], Any]
    assemble: Callable[[dict[str, Any]], Any]  # last stage's outputs -> the model's output
    loss_fn: Any
    device: torch.device | None = None  # where targets go (None: leave them where they are)
    stage_index: int = 0
    replica_index: int = 0
    local_stages: list[int]
    workers: list[StageWorker]  # this process's stages, as the step runs them
    # one process: rank 0, no peers to wait on, nothing to synchronise or close through a store
    rank: int = 0
    timeout: float | None = None
    grad_sync: GradSync | None = None
    flag_counts: tuple[int, ...] = ()
    closer: Callable[[list[float]], list[float]] | None = None
    other_modes: dict[Modes, tuple[Captured, list[Stage]] | None]
    # the model's loss when it is a mean over the targets each micro-batch keeps (labels not
    # ignore_index), or the output a loss_fn may pick that is one: micro-batches are weighted
    # by their counts (runtime/loss_weights.py)
    mean_loss: MeanLoss | None = None
    _warned_ignored = False  # a loss_fn's targets with uneven -100 counts: warned once
    _judged_loss_fn = False  # whether the loss_fn was checked for mixing samples (first step)

    @property
    def random(self) -> bool:
        """Whether any stage draws random numbers (every process knows every stage, so all
        draw the step seed alike and the global generators stay in step)."""
        return any(s.random for s in self.stages)

    flags: tuple[bool, ...] = ()  # the last step's ``flags``, ORed over every rank
    # set to a list to record (stage, what, micro-batch, start, end) of the step's actions
    # (``step_stats.py``: ``pipe.last_step.timeline``)
    timeline: list[tuple[int, str, int, float, float]] | None = None

    def step(self, inputs: dict[str, torch.Tensor], target: Any = None,
             flags: Sequence[bool | Callable[[], bool]] = ()) -> torch.Tensor:
        b = self.plan.micro_batch_size
        for worker in self.workers:  # a stage compiled in the background switches here
            worker.at_step_boundary()
        inputs = self.prepare(inputs)
        micro = split_batch(inputs, b)
        m = len(micro)
        targets = split_target(target, b, m)
        # every rank has the whole batch, so every rank weighs (and refuses) alike
        weights = self.mean_loss.weights(micro) if self.mean_loss is not None else None
        if self.loss_fn is not None and target is not None and not self._warned_ignored:
            self._warned_ignored = warn_uneven_ignored_targets(targets)
        # one draw for every replica: a sample's numbers are keyed by its index in the global
        # batch (ir/rng.py), so D, P, b and the schedule never change them
        self.set_seed(RandomKey(next_step_seed() if self.random else 0,
                                self.replica_index * b * m, b))
        losses: dict[int, torch.Tensor] = {}

        def loss_of(i: int, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            target_i = targets[i]
            if self.device is not None and isinstance(target_i, torch.Tensor):
                target_i = target_i.to(self.device)
            output = self.assemble(outputs)
            if self.loss_fn is not None and not self._judged_loss_fn:
                self._judged_loss_fn = True
                warn_sample_mixing("loss_fn", loss_fn_findings(self.loss_fn, output, target_i, b),
                                   m, stacklevel=6)
            mean = self.mean_loss
            losses[i], scaled = micro_batch_loss(
                output, self.loss_fn, target_i, m, self.autocast, self.scaler.scale,
                None if weights is None else weights[i],
                None if mean is None else lambda loss: mean.weighs(loss, outputs))
            return scaled

        self.run_actions(micro, loss_of)
        now = [bool(f()) if callable(f) else bool(f) for f in flags]  # read as late as possible
        loss, self.flags = self.finish([losses[i] for i in sorted(losses)], now)
        return loss

    # -- hooks ---------------------------------------------------------------------------------

    def prepare(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check the batch and move it where the stages run."""
        return inputs

    def set_seed(self, key: RandomKey) -> None:
        raise NotImplementedError

    def run_actions(self, micro: list[dict[str, torch.Tensor]], loss_of: LossOf) -> None:
        """This process's actions of the schedule, and the gradient reductions they start."""
        raise NotImplementedError

    def finish(self, losses: list[torch.Tensor], flags: Sequence[bool]
               ) -> tuple[torch.Tensor, tuple[bool, ...]]:
        """The mean loss (every rank the same), the fp16 overflow into ``scaler.found_inf``,
        and ``flags`` ORed over every rank."""
        raise NotImplementedError
