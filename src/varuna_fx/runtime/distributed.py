"""Distributed runtime: this process runs one stage of one data-parallel replica.

``make_distributed_pipeline`` joins the job (process group, same plan on every rank, groups),
keeps only this stage's parameters, and returns a :class:`Pipeline` whose ``step`` runs the
stage's action list (``executor.py``), then reduces gradients (``grad_sync.py``) and the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capture import Captured
from ..codegen import Stage
from ..ir import info
from ..pipeline import Pipeline
from ..plan import Plan
from ..schedule import build_schedule, validate
from . import preemption
from .batching import check_batch_shapes, micro_batch_loss, split_batch, split_target
from .comm import launch, peer_error, resolve_timeout, wait
from .executor import StageExecutor
from .grad_sync import GradSync
from .model_state import unread_tensors
from .placement import Placement, check_world_size
from .precision import LossScaler, autocast_factory
from .setup import (
    Groups,
    broadcast_initial,
    build_groups,
    init_process_group,
    plan_fingerprint,
    release_unheld,
    tied_sets,
    verify_same_plan,
)
from .worker import StageWorker


class DistributedRuntime:
    def __init__(self, stages: list[Stage], plan: Plan, placement: Placement, rank: int,
                 groups: Groups, grad_sync: GradSync, *, assemble: Any, loss_fn: Any,
                 precision: str, timeout: float, device: torch.device,
                 input_shapes: dict[str, Any], offload_stash: bool) -> None:
        self.plan, self.placement, self.rank = plan, placement, rank
        self.stage, self.replica = placement.coords(rank)
        self.groups, self.grad_sync = groups, grad_sync
        self.assemble, self.loss_fn = assemble, loss_fn
        self.timeout, self.device, self.input_shapes = timeout, device, input_shapes
        self.who = f"stage {self.stage} (rank {rank})"
        self.is_last = self.stage == plan.stages - 1
        self.autocast = autocast_factory(precision, device.type)
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.worker = StageWorker(stages[self.stage], recompute=plan.recompute,
                                  is_last=self.is_last, offload_stash=offload_stash,
                                  autocast=self.autocast)
        self.executor = StageExecutor(self.worker, stages, placement, self.replica,
                                      plan.micro_batch_size, device, timeout, self.who)
        sched = build_schedule(plan.schedule, plan.stages, plan.num_micro_batches,
                               plan.recompute)
        validate(sched)
        self.per_stage = sched.per_stage
        self.preempted = False  # a rank got SIGTERM/SIGUSR1 (set after a step, on every rank)

    # -- training ------------------------------------------------------------------------------

    def step(self, inputs: dict[str, torch.Tensor], target: Any = None) -> torch.Tensor:
        plan = self.plan
        m = plan.num_micro_batches
        # before any communication: every rank has the same batch, so every rank raises
        check_batch_shapes(inputs, self.input_shapes, plan.micro_batch_size * m,
                           f" per step ({m} micro-batches of {plan.micro_batch_size})")
        targets = split_target(target, plan.micro_batch_size, m)
        micro = split_batch({k: v.to(self.device) for k, v in inputs.items()},
                            plan.micro_batch_size)
        if self.worker.random:  # distinct dropout masks per replica, replayed on recompute
            self.worker.seed = hash((int(torch.randint(0, 2**62, ())), self.replica))
        losses: list[torch.Tensor] = []

        def loss_of(i: int, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            target_i = _to(targets[i], self.device)
            raw, seed = micro_batch_loss(self.assemble(outputs), self.loss_fn, target_i, m,
                                         self.autocast, self.scaler.scale)
            losses.append(raw)
            return seed

        self.grad_sync.before_step()
        self.executor.run(self.per_stage, micro, loss_of if self.is_last else None)
        pending = self.grad_sync.start()  # right after this stage's last backward
        self.executor.outbox.drain()
        for reduction in pending:
            reduction.finish()
        return self._finish_step(losses)

    def _finish_step(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """One world all-reduce: the replicas' mean loss (from each last stage), the fp16
        overflow flag and the preemption flag (from every stage), so every rank returns and
        decides the same."""
        local_inf = False
        if self.scaler.enabled:
            local_inf = self.scaler.unscale_(self.grad_sync.held.values())
        loss = torch.stack(losses).mean() / self.plan.data_parallel if losses else \
            torch.zeros(())
        # Every rank must all-reduce the same dtype (gloo aborts on a mix): float64 on all,
        # whatever the model's dtype (ranks without a loss would pack float32 otherwise).
        # The preemption flag rides along: every rank learns after the same step.
        packed = torch.tensor([float(loss), float(local_inf), float(preemption.requested())],
                              dtype=torch.float64, device=_comm_device())
        work = launch(lambda: dist.all_reduce(packed, async_op=True), self.who, "the loss")
        wait(work, self.timeout, self.who, "the loss all-reduce over all "
             f"{dist.get_world_size()} ranks")
        total = packed.cpu()
        self.scaler.found_inf = bool(total[1] > 0)
        self.preempted = self.preempted or bool(total[2] > 0)
        return total[0].to(torch.promote_types(loss.dtype, torch.float32))

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        del params  # the runtime knows the held parameters and which tied copies count
        return self.grad_sync.clip_grad_norm_(max_norm, norm_type)

    # -- evaluation ----------------------------------------------------------------------------

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The whole batch as one micro-batch (no autograd); every rank returns the output."""
        batch = next(iter(inputs.values())).shape[0]
        check_batch_shapes(inputs, self.input_shapes, batch)
        moved = {k: v.to(self.device) for k, v in inputs.items()}
        outputs = self.executor.evaluate(moved, batch, self.autocast)
        result = [self.assemble(outputs) if self.is_last else None]
        if self.groups.pipeline is not None:
            src = self.placement.rank(self.plan.stages - 1, self.replica)
            try:
                dist.broadcast_object_list(result, src=src, group=self.groups.pipeline)
            except RuntimeError as exc:
                raise peer_error(exc, self.timeout, self.who, "the output from the last "
                                 "stage") from exc
        return result[0]

    def close(self) -> None:
        """Release the process groups (lets one process build several pipelines in turn)."""
        self.executor.outbox.close()
        for group in self.groups.created:
            dist.destroy_process_group(group)
        self.groups.created.clear()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_distributed_pipeline(model: nn.Module, captured: Captured, stages: list[Stage],
                              plan: Plan, canonical: dict[str, str], *, loss_fn: Any,
                              offload_stash: bool, precision: str,
                              timeout: float | None) -> Pipeline:
    seconds = resolve_timeout(timeout)
    init_process_group(seconds)
    rank, world = dist.get_rank(), dist.get_world_size()
    verify_same_plan(plan, plan_fingerprint(plan, stages, precision), seconds)
    check_world_size(world, plan.stages, plan.data_parallel)
    placement = Placement(plan.stages, plan.data_parallel)
    stage, replica = placement.coords(rank)
    device = _comm_device() if torch.cuda.is_available() else torch.device("cpu")
    tied = tied_sets(plan, model, canonical)
    groups = build_groups(placement, tied, stage, replica, seconds)
    pipe = Pipeline(model, captured, stages, plan, canonical, runtime=None, stage_index=stage,
                    replica_index=replica, local_stages=[stage])
    # stage 0 also keeps what forward never reads, so no rank loses those weights
    keep = unread_tensors(model, pipe.state_layout) if stage == 0 else []
    release_unheld(model, stages[stage], device, keep=keep)
    preemption.install_handlers()  # under torchrun: SIGTERM/SIGUSR1 -> pipe.preempted
    unread = pipe.state_layout.unread
    held = {n: p for n, p in pipe.named_parameters() if n not in unread}  # those get no grad
    who = f"stage {stage} (rank {rank})"
    broadcast_initial({**held, **dict(pipe.named_buffers())}, groups, placement, stage,
                      seconds, who)
    sync = GradSync(held, groups, plan.tied_parameters, stage, plan.data_parallel, seconds, who)
    shapes = {str(n.target): info(n).outputs[0] for n in captured.gm.graph.nodes
              if n.op == "placeholder" and info(n).outputs}
    pipe.runtime = DistributedRuntime(
        stages, plan, placement, rank, groups, sync, assemble=pipe.assemble, loss_fn=loss_fn,
        precision=precision, timeout=seconds, device=device, input_shapes=shapes,
        offload_stash=offload_stash,
    )
    return pipe
