"""Distributed runtime: this process runs one stage of one data-parallel replica (or, with
virtual stages, the ``v`` stages ``plan.placement`` gives its rank).

``make_distributed_runtime`` joins the job (process group, same plan on every rank, groups) and
keeps only this stage's parameters; the runtime's step is the shared loop (``step.py``), whose
hooks here run the stage's action list (``executor.py``), reduce gradients (``grad_sync.py``)
and make the one world all-reduce of the step (loss, fp16 overflow, the caller's flags).

The job: gloo on CPU, NCCL on GPU. Ranks all-gather a hash of the plan (``setup.py``), so ranks
that planned differently are named instead of deadlocking, then require world = P x D. Ranks are
numbered replica-major (``rank = replica * P + stage``, ``schedule/placement.py``), so a
replica's stages are consecutive ranks on one node and only the gradient all-reduce crosses
nodes. Each rank keeps only the tensors its stage module uses and empties the rest in place;
replica 0's weights are broadcast at start, as DDP does. Point-to-point messages travel on a
two-rank group per direction of each communicating stage pair (``setup.build_groups``: on NCCL
one communicator and stream per direction). After the last backward, tied parameters are summed
and the rest averaged (``grad_sync.py``); one world all-reduce then carries the mean loss, the
fp16 overflow flag and the step loop's flags, so every rank returns the same loss and skips the
same steps. Every wait has a deadline (``timeout=`` / ``$VARUNA_FX_TIMEOUT``, 300 s), and the
one-process runtime shares the stage worker, the casting of boundary values to their planned
dtype, autocast and loss scaling, so both give the same numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capture.captured import Captured
from ..capture.inputs import BoundInputs
from ..codegen.modes import Modes, evaluation_stages, modes_set, module_modes
from ..codegen.stage_module import Stage
from ..costs.wire import DiLoCo
from ..errors import DistributedError, InputError, PeerTimeoutError
from ..init.materialize import is_deferred, materialize_tensors, meta_without_record
from ..ir.nodes import info
from ..ir.rng import RandomKey
from ..passes.manager import dump_dir
from ..planner.plan import Plan
from ..schedule import OpKind, RankOp, validate
from ..schedule.placement import Placement, check_world_size
from ..world.membership import in_place
from ..world.where import comm_device, init_process_group
from . import preemption
from .batching import check_batch_shapes
from .comm import launch, peer_error, wait
from .executor import StageExecutor
from .loss_weights import MeanLoss, find_mean_loss
from .model_state import StateLayout, unread_tensors
from .opportunistic import ENV as RULE_ENV
from .opportunistic import rule_enabled
from .options import RunOptions
from .precision import LossScaler, autocast_factory
from .setup import (
    Groups,
    broadcast_initial,
    build_groups,
    held_tensors,
    message_links,
    plan_fingerprint,
    release_unheld,
    tied_sets,
    verify_same_plan,
)
from .step import LossOf, StepLoop
from .sync.diloco import DiLoCoSync
from .sync.grad_sync import GradSync
from .sync.replica_sync import SyncHook
from .worker import StageWorker


class DistributedRuntime(StepLoop):
    def __init__(self, stages: list[Stage], plan: Plan, placement: Placement, rank: int,
                 groups: Groups, grad_sync: GradSync, options: RunOptions, *,
                 assemble: Callable[[dict], Any], device: torch.device,
                 input_shapes: dict[str, Any], reorder: bool = False,
                 tied_holders: Sequence[tuple[int, ...]] = (),
                 mean_loss: MeanLoss | None = None, scaler: LossScaler | None = None,
                 other_modes: dict[Modes, tuple[Captured, list[Stage]] | None] | None = None
                 ) -> None:
        """``mean_loss``: how micro-batches of the model's mean-over-labels loss are weighed;
        ``scaler``: the loss scale to carry on with (an in-place morph's; None: a fresh one);
        ``other_modes``: other train/eval modes' stages made at compile (codegen/modes.py)."""
        self.stages, self.plan, self.placement, self.rank = stages, plan, placement, rank
        self.stage, self.replica = placement.coords(rank)
        self.stage_index, self.replica_index = self.stage, self.replica
        self.local_stages = placement.stages_of(rank)
        self.groups, self.grad_sync = groups, grad_sync
        self.assemble, self.loss_fn = assemble, options.loss_fn
        self.timeout, self.device, self.input_shapes = options.seconds, device, input_shapes
        self.who = f"{stage_label(self.local_stages)} (rank {rank})"
        last = plan.stages - 1
        self.is_last = last in self.local_stages
        self.autocast = autocast_factory(options.precision, device.type)
        self.scaler = scaler or LossScaler(enabled=options.precision == "fp16")
        self.mean_loss = mean_loss
        self.workers = [StageWorker(stages[s], recompute=plan.recompute[s], is_last=s == last,
                                    offload_stash=options.offload_stash, autocast=self.autocast,
                                    compiled=plan.compiles_on(device.type),
                                    split_backward=plan.schedule.split_backward,
                                    compile_wait=options.compile_wait)
                        for s in self.local_stages]
        self.worker = self.workers[0]
        self.executor = StageExecutor(self.workers, stages, placement, self.replica,
                                      plan.micro_batch_size, device, self.timeout, self.who,
                                      links=groups.links)
        self.executor.compression = plan.compression  # before its first message is made
        validate(plan.schedule)
        self.executor.split = plan.schedule.split_backward
        self.executor.reorder = reorder  # Varuna's run-time rule (opportunistic.py)
        self.executor.tied = list(tied_holders)
        self.per_stage = plan.schedule.per_stage
        # virtual stages: each rank's order of its stages' actions (None: per_stage)
        self.rank_lists = plan.schedule.rank_lists
        # the program every rank runs, proved against NCCL's rules before any message (the
        # one check of the NCCL path possible without GPUs; cheap: milliseconds at P=8, m=16)
        self.executor.program(self.per_stage, self.rank_lists)
        self._other: tuple[list[Stage], StageExecutor] | None = None  # another mode's stages
        # eval mode's stages, made at compile while this rank held every parameter (codegen/modes.py)
        self.other_modes = dict(other_modes or {})

    flag_counts: tuple[int, ...] = ()  # the last step's flags, summed over every rank
    # an in-place job's step-closing sum through its membership store (values -> sums over
    # every rank), in place of the world all-reduce: see ``world/closing.py``
    closer: Callable[[list[float]], list[float]] | None = None

    # A wait that timed out or lost its peer leaves the process group unusable: every later
    # step would fail at once with a message about timeouts. It says so instead.
    broken: PeerTimeoutError | None = None

    def step(self, inputs: dict[str, torch.Tensor], target: Any = None,
             flags: Sequence[bool | Callable[[], bool]] = ()) -> torch.Tensor:
        if self.broken is not None:
            raise DistributedError(
                f"{self.who} cannot step: an earlier step failed talking to its peers "
                f"({self.broken}), which leaves the process group unusable. Restart the job "
                "(under 'varuna-fx run --elastic' the agents restart the workers) and resume "
                "from the last checkpoint")
        try:
            return super().step(inputs, target, flags)
        except PeerTimeoutError as exc:
            self.broken = exc
            raise

    # -- step-loop hooks -----------------------------------------------------------------------

    def prepare(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self.plan
        m = plan.num_micro_batches
        # before any communication: every rank has the same batch, so every rank raises
        check_batch_shapes(inputs, self.input_shapes, plan.micro_batch_size * m,
                           f" per step ({m} micro-batches of {plan.micro_batch_size})")
        return {k: v.to(self.device) for k, v in inputs.items()}

    def set_seed(self, key: RandomKey) -> None:
        for worker in self.workers:
            worker.key = key

    def run_actions(self, micro: list[dict[str, torch.Tensor]], loss_of: LossOf) -> None:
        """The lowered program, its tail included: right after this stage's last backward the
        tied sums and the data-parallel average start, then the sends and those reductions are
        waited for; the loss all-reduce that closes the tail is :meth:`finish`'s."""
        self.grad_sync.before_step()
        pending: list[Any] = []
        tied = iter(range(len(self.grad_sync.tied)))
        closed = False

        def tail(op: RankOp) -> None:
            nonlocal pending, closed
            if op.kind is OpKind.ALLREDUCE and op.group.startswith("tied:"):
                pending.append(self.grad_sync.start_tied(next(tied)))
            elif op.kind is OpKind.ALLREDUCE and op.group.startswith("dp:"):
                pending += self.grad_sync.start_data_parallel()
            elif op.kind is OpKind.WAIT_SENDS:
                self.executor.outbox.drain()
            elif op.kind is OpKind.WAIT_REDUCE and not closed:
                for reduction in pending:
                    reduction.finish()
                pending = []
            else:  # ALLREDUCE(world) and its wait: finish() makes them, after the step's work
                closed = True

        self.executor.timeline = self.timeline
        self.executor.run(self.per_stage, micro, loss_of if self.is_last else None, tail,
                          self.rank_lists)
        assert next(tied, None) is None and closed, "the tail covers every reduction"

    def finish(self, losses: list[torch.Tensor], flags: Sequence[bool]
               ) -> tuple[torch.Tensor, tuple[bool, ...]]:
        """One world all-reduce: the replicas' mean loss (from each last stage), the fp16
        overflow flag (from every stage) and the caller's flags, so every rank returns and
        decides the same."""
        local_inf = False
        if self.scaler.enabled:
            local_inf = self.scaler.unscale_(self.grad_sync.reduced())
        loss = torch.stack(losses).mean() / self.plan.data_parallel if losses else \
            torch.zeros(())
        # Every rank must all-reduce the same dtype (gloo aborts on a mix): float64 on all,
        # whatever the model's dtype; the ranks holding a last stage also say whether the loss
        # is float64, so that ranks without one return it in its own dtype, not rounded.
        wide = bool(losses) and torch.promote_types(loss.dtype, torch.float32) == torch.float64
        packed = torch.tensor([float(loss), float(local_inf), float(wide),
                               *(float(f) for f in flags)],
                              dtype=torch.float64, device=comm_device())
        if self.closer is not None:
            total = torch.tensor(self.closer(packed.tolist()), dtype=torch.float64)
        else:
            work = launch(lambda: dist.all_reduce(packed, async_op=True), self.who, "the loss")
            wait(work, self.timeout, self.who, "the loss all-reduce over all "
                 f"{dist.get_world_size()} ranks")
            total = packed.cpu()
        # how many ranks raised each flag (an in-place job counts the processes leaving)
        self.flag_counts = tuple(round(float(x)) for x in total[3:])
        self.scaler.found_inf = bool(total[1] > 0)
        loss_dtype = torch.float64 if total[2] > 0 else torch.float32
        return total[0].to(loss_dtype), tuple(bool(x > 0) for x in total[3:])

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        del params  # the runtime knows the held parameters and which tied copies count
        return self.grad_sync.clip_grad_norm_(max_norm, norm_type)

    # -- evaluation ----------------------------------------------------------------------------

    def forward(self, inputs: dict[str, torch.Tensor], stages: list[Stage] | None = None,
                assemble: Any = None) -> Any:
        """The whole batch as one micro-batch (no autograd); every rank returns the output.
        ``stages``/``assemble``: another mode's graph (``codegen/modes.py``)."""
        batch = next(iter(inputs.values())).shape[0]
        check_batch_shapes(inputs, self.input_shapes, batch)
        moved = {k: v.to(self.device) for k, v in inputs.items()}
        executor = self.executor if stages is None else self._executor_for(stages)
        outputs = executor.evaluate(moved, batch, self.autocast)
        result = [(assemble or self.assemble)(outputs) if self.is_last else None]
        if self.groups.pipeline is not None:
            src = self.placement.rank(self.plan.stages - 1, self.replica)
            try:
                dist.broadcast_object_list(result, src=src, group=self.groups.pipeline)
            except RuntimeError as exc:
                raise peer_error(exc, self.timeout, self.who, "the output from the last "
                                 "stage") from exc
        return result[0]

    def _executor_for(self, stages: list[Stage]) -> StageExecutor:
        if self._other is None or self._other[0] is not stages:
            last = self.plan.stages - 1
            workers = [StageWorker(stages[s], recompute=False, is_last=s == last,
                                   autocast=self.autocast) for s in self.local_stages]
            self._other = (stages, StageExecutor(workers, stages, self.placement, self.replica,
                                                 self.plan.micro_batch_size, self.device,
                                                 self.timeout, self.who,
                                                 links=self.groups.links))
        return self._other[1]

    def close(self) -> None:
        """Release the process groups (lets one process build several pipelines in turn)."""
        self.executor.outbox.close()
        for group in self.groups.created:
            dist.destroy_process_group(group)
        self.groups.created.clear()


def make_distributed_runtime(model: nn.Module, captured: Captured, stages: list[Stage],
                             plan: Plan, canonical: dict[str, str], options: RunOptions, *,
                             assemble: Callable[[dict], Any],
                             layout: StateLayout | None = None,
                             joining: bool = False) -> DistributedRuntime:
    """Join the job and build this rank's runtime (collective: every rank calls it), run as
    ``options`` say. ``layout``: the model's state, recorded before this rank empties what it
    does not hold. ``joining``: this process joins an in-place job that is running
    (``world/membership.py``): its values come from the members (``morph/``), not from
    replica 0."""
    layout = layout or StateLayout.of(model, canonical, stages)
    seconds = options.seconds
    refuse_plain_meta(model)  # every rank has the same model: all raise, before any wait
    # eval mode's graph, cut now (a rank keeps only its stage's parameters), and before the
    # first collective, so peers never wait on it
    eval_mode = _eval_mode_stages(model, captured, stages, canonical, plan,
                                  dump_dir(options.dump))
    init_process_group(seconds)
    reorder = agree_on_plan(plan, stages, options)
    local = (plan.placement or Placement(plan.stages, plan.data_parallel)).stages_of(
        dist.get_rank())
    eval_roots = [] if eval_mode[1] is None else \
        [eval_mode[1][0].gm, *(s.module for s in eval_mode[1][1])]
    hold_only(model, stages, local, rank_device(), layout, canonical,
              [captured.gm, *eval_roots])
    # (a graph cut from the captured one: made after the allocation retargeted it to the
    # rank's device)
    mean_loss = find_mean_loss(captured.gm, captured.out_spec, captured.input_names,
                               options.loss_fn)
    runtime = build_runtime(model, captured, stages, plan, canonical, options,
                            assemble=assemble, layout=layout, reorder=reorder,
                            eval_stages=eval_mode[1][1] if eval_mode[1] is not None else None,
                            mean_loss=mean_loss, other_modes={eval_mode[0]: eval_mode[1]})
    preemption.install_handlers()  # under torchrun: SIGTERM/SIGUSR1 -> pipe.preempted
    if not joining:
        held, buffers = held_tensors(model, layout.held_names(canonical, stages, local))
        broadcast_initial({**held, **buffers}, runtime.groups, runtime.placement,
                          runtime.stage, seconds, runtime.who)
    return runtime


def rank_device() -> torch.device:
    return comm_device() if torch.cuda.is_available() else torch.device("cpu")


def agree_on_plan(plan: Plan, stages: list[Stage], options: RunOptions) -> bool:
    """Every rank checks that all planned alike and that the world fits the plan
    (collective); returns whether Varuna's run-time rule runs."""
    # on NCCL (receives can be polled) unless the environment says; every rank must agree,
    # since it changes which message proves a send delivered (acks.py) (not with virtual
    # stages: the rule's stash bound and send proofs are one stage's)
    reorder = rule_enabled(dist.get_backend()) and plan.stages_per_rank == 1
    runtime_text = f" opportunistic forwards ${RULE_ENV}={'on' if reorder else 'off'}"
    fingerprint = plan_fingerprint(plan, stages, options.precision, runtime_text)
    verify_same_plan(plan, fingerprint, options.seconds, runtime_text)
    check_world_size(dist.get_world_size(), plan.stages, plan.data_parallel,
                     plan.stages_per_rank)
    return reorder


def build_runtime(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                  canonical: dict[str, str], options: RunOptions, *,
                  assemble: Callable[[dict], Any], layout: StateLayout, reorder: bool,
                  eval_stages: list[Stage] | None = None, mean_loss: MeanLoss | None = None,
                  scaler: LossScaler | None = None,
                  other_modes: dict[Modes, tuple[Captured, list[Stage]] | None] | None = None
                  ) -> DistributedRuntime:
    """This rank's runtime in the formed process group, once every rank agreed on the plan
    (:func:`agree_on_plan`) and holds its stages' tensors (:func:`hold_only`; the gradient
    sync keeps those tensor objects). Collective: every rank makes the same groups. An
    in-place morph builds its new runtime with this too (``morph/``), handing on the old
    one's ``mean_loss`` and loss ``scaler``."""
    seconds, rank = options.seconds, dist.get_rank()
    placement = plan.placement or Placement(plan.stages, plan.data_parallel)
    stage, replica = placement.coords(rank)
    local = placement.stages_of(rank)
    tied = tied_sets(plan, model, canonical)
    links = message_links(stages, eval_stages)
    groups = build_groups(placement, tied, local, replica, seconds, links)
    held, _ = held_tensors(model, layout.held_names(canonical, stages, local))
    who = f"{stage_label(local)} (rank {rank})"
    trained = {n: p for n, p in held.items() if n not in layout.unread}  # unread: no gradient
    aliases = Counter(canonical.values())  # a weight the model ties: one tensor, several names
    sync = GradSync(trained, groups, plan.tied_parameters, local, plan.data_parallel, seconds, who,
                    model_tied={n for n, k in aliases.items() if k > 1})
    setting = plan.sync_of(local[0])  # (a rank's stages share their replicas' link)
    if plan.data_parallel > 1 and groups.data_parallel is not None and setting != "exact":
        if isinstance(setting, DiLoCo):
            sync.diloco = DiLoCoSync(setting, sync.held, groups.data_parallel,
                                     plan.data_parallel, seconds, who)
        else:
            sync.hook = SyncHook(setting, groups.data_parallel, plan.data_parallel)
    shapes = {str(n.target): info(n).outputs[0] for n in captured.gm.graph.nodes
              if n.op == "placeholder" and info(n).outputs}
    return DistributedRuntime(
        stages, plan, placement, rank, groups, sync, options, assemble=assemble,
        device=rank_device(), input_shapes=shapes, reorder=reorder,
        # (a tied set all on one rank, D = 1, has no group: autograd sums its copies there)
        tied_holders=[h for h in tied if len(placement.holder_ranks(list(h))) > 1],
        mean_loss=mean_loss, scaler=scaler, other_modes=other_modes)


def hold_only(model: nn.Module, stages: list[Stage], local: list[int], device: torch.device,
              layout: StateLayout, canonical: dict[str, str], roots: list[nn.Module]) -> None:
    """Allocate (``vf.deferred_init``: and initialise) the ``local`` stages' tensors and empty
    every other tensor of the model. ``roots``: modules besides the stages that share the
    model's tensors (the captured graph). In an in-place job buffers are kept (they are
    small, and a stage this rank takes over later needs the ones no checkpoint holds)."""
    if is_deferred(model):  # vf.deferred_init: allocate and initialise only this rank's stages
        materialize_tensors(model, layout.held_names(canonical, stages, local), device,
                            roots=[*roots, *(s.module for s in stages)])
    # stage 0 also keeps what forward never reads, so no rank loses those weights
    keep = unread_tensors(model, layout) if 0 in local else []
    release_unheld(model, [stages[s] for s in local], device, keep=keep,
                   keep_buffers=in_place())


def refuse_plain_meta(model: nn.Module) -> None:
    """A rank runs its stage on real tensors: a model put on the meta device without
    ``vf.deferred_init`` has nothing to run (one process only plans with it)."""
    names = meta_without_record(model)
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise InputError(
            f"{len(names)} parameter(s)/buffer(s) are on the meta device ({shown}) with nothing "
            "saying what they hold: under torchrun every rank needs its stage's real tensors. "
            "Build the model under `with vf.deferred_init(seed=0):` (each rank then allocates "
            "and initialises only its stage), or with real tensors")


def stage_label(local: list[int]) -> str:
    """How errors name this rank's work: "stage 2", or "stages 0, 3" (virtual stages)."""
    return f"stage {local[0]}" if len(local) == 1 else \
        "stages " + ", ".join(str(s) for s in local)


def _eval_mode_stages(model: nn.Module, captured: Captured, stages: list[Stage],
                      canonical: dict[str, str], plan: Plan,
                      dump: Path | None) -> tuple[Modes, Any]:
    """(the modes of ``model.eval()``, its stages or None when the compiled graph serves)."""
    compiled = module_modes(model)
    with modes_set(model, False):
        modes = module_modes(model)
        if modes == compiled:
            return modes, None
        shapes = {str(n.target): info(n).outputs[0] for n in captured.gm.graph.nodes
                  if n.op == "placeholder" and info(n).outputs}
        example = {name: torch.zeros(t.concrete_shape(plan.micro_batch_size), dtype=t.dtype)
                   for name, t in shapes.items()}
        bound = BoundInputs(example, dict(captured.constants))
        return modes, evaluation_stages(model, bound, captured, stages, canonical, plan.stages,
                                        dump)
