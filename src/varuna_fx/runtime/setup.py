"""Joining a distributed run: the process group, one plan for all, groups, held parameters.

Every rank compiles the model itself; nothing but a fingerprint of the plan crosses the network
before training, so a rank that planned differently (another seed, batch or argument) is named
instead of deadlocking or exchanging tensors of the wrong size later.

Why a group per direction: the executor posts receives a few actions ahead, so on one pair of
ranks a receive is issued before a send while the peer does the same the other way (varuna,
P=2: stage 0 posts the gradient of micro-batch 0 before sending activation 2, stage 1 posts
activation 2 before sending that gradient). gloo matches such messages by tag; NCCL issues a
communicator's sends and receives on one stream in order, where this would deadlock. So every
direction of every communicating stage pair gets a two-rank group (``build_groups(links=...)``,
``Message.group``), each carrying its messages in the order both ends issue them. Tested on
gloo; no NCCL run has been made.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..codegen.stage_module import Stage
from ..errors import DistributedError
from ..planner.plan import Plan
from ..schedule.placement import Placement
from ..world.where import comm_device
from .comm import wait


def plan_summary(plan: Plan) -> str:
    sizes = [c.nodes for c in plan.stage_costs]
    return (f"P={plan.stages} D={plan.data_parallel} micro-batch {plan.micro_batch_size} x "
            f"{plan.num_micro_batches} schedule {plan.schedule.name} "
            f"recompute={list(plan.recompute)} "
            f"nodes per stage {sizes}")


def plan_fingerprint(plan: Plan, stages: list[Stage], precision: str, runtime: str = "") -> str:
    """Everything two ranks must agree on: layout, stage contents, boundaries, schedule, and
    ``runtime`` (run-time settings that change when sends are released, see ``acks.py``)."""
    parts = [plan_summary(plan) + runtime, precision]
    for s in stages:
        spec = s.spec
        parts.append(f"stage {spec.index}: {' '.join(spec.nodes)} | "
                     f"{' '.join(spec.parameter_names)} | inputs {spec.inputs}")
        for t in spec.sends:
            parts.append(f"  {t.name} {t.src}->{t.dst} {t.tensor} grad={t.requires_grad}")
    parts.append(str(plan.schedule))
    return "\n".join(parts)


def verify_same_plan(plan: Plan, fingerprint: str, timeout: float, runtime: str = "") -> None:
    """All-gather a hash of the plan; every rank raises if any two differ (``runtime``: what
    :func:`plan_fingerprint` was given, named in the error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    digest = int(hashlib.sha256(fingerprint.encode()).hexdigest()[:15], 16)
    mine = torch.tensor([digest], dtype=torch.int64, device=comm_device())
    every = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(every, mine, async_op=True)
    wait(work, timeout, f"rank {rank}", "every rank's plan fingerprint (all ranks must call "
         "vf.compile)")
    hashes = [int(t) for t in every]
    if len(set(hashes)) == 1:
        return
    summaries: list[Any] = [None] * world
    dist.all_gather_object(summaries, plan_summary(plan) + runtime)  # every rank is here
    groups: dict[int, list[int]] = {}
    for r, h in enumerate(hashes):
        groups.setdefault(h, []).append(r)
    described = "; ".join(f"ranks {ranks} planned {summaries[ranks[0]]}"
                          for ranks in groups.values())
    odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
    raise DistributedError(
        f"the ranks compiled different plans (ranks {odd} differ from rank 0): {described}. "
        "Every rank must call vf.compile with the same model (same seed), example inputs and "
        "arguments, and the same Cluster"
    )


@dataclass
class Groups:
    """Process groups of this rank (None where a group would hold this rank alone)."""

    pipeline: Any = None  # the P stages of my replica: loss and grad-norm reductions
    data_parallel: Any = None  # the D replicas of my stage: the gradient average
    tied: list[tuple[list[str], Any]] = field(default_factory=list)  # my tied sets
    # (sending stage, receiving stage) -> the group that carries that direction's messages
    # (keyed by stages, not ranks: with several stages per rank, two stage links between one
    # rank pair must not share a FIFO; schedule/nccl_check.py, layout "stage-direction")
    links: dict[tuple[int, int], Any] = field(default_factory=dict)
    created: list[Any] = field(default_factory=list)


def build_groups(placement: Placement, tied: dict[tuple[int, ...], list[str]],
                 stage: int | list[int], replica: int, timeout: float,
                 links: set[tuple[int, int]] | None = None) -> Groups:
    """``dist.new_group`` for every group of the job, on every rank in the same order (the
    call is collective), keeping the ones this rank belongs to.

    A tied set gets one group spanning its holder stages in *all* replicas: summing there and
    dividing by D equals summing across holders per replica and then averaging across
    replicas, in one collective instead of two.

    ``links``: the (sending stage, receiving stage) pairs that exchange point-to-point
    messages; each direction of each stage pair gets a two-rank group of its own per replica
    (schedule/nccl_check.py checks every schedule against exactly this layout). NCCL
    runs a pair's sends and receives on one stream per communicator, in the order they are
    issued, while the executor posts receives ahead of its sends: on one shared communicator
    stage 0's posted receive of gradient 0 would sit ahead of its send of activation 2, which
    stage 1 waits for before it sends gradient 0. One communicator (stream) per direction keeps
    the two directions independent; within a direction sends and receives are issued in the
    same order on both ends (executor.py).

    ``stage``: this rank's stage, or every stage it runs (virtual stages): then a stage pair
    within one rank needs no group, two stage pairs between the same two ranks still get a
    group each (``schedule/nccl_check.py``'s "stage-direction" layout), the data-parallel group
    is the rank's (one for all its stages), and a tied set whose holders all run on one rank
    needs no group when D = 1."""
    local = {stage} if isinstance(stage, int) else set(stage)
    groups = Groups()
    span = timedelta(seconds=timeout)

    def make(ranks: list[int]) -> Any:
        group = dist.new_group(ranks, timeout=span)
        groups.created.append(group)
        return group

    ranks, d = placement.ranks_per_replica, placement.replicas
    mine = placement.pipeline_rank(min(local))
    if ranks > 1:
        for r in range(d):
            g = make(placement.pipeline_ranks(r))
            if r == replica:
                groups.pipeline = g
    if d > 1:
        for position in range(ranks):  # the D ranks at one place of the pipeline
            g = make([r * ranks + position for r in range(d)])
            if position == mine:
                groups.data_parallel = g
    for holders in sorted(tied):
        holder_ranks = placement.holder_ranks(list(holders))
        if len(holder_ranks) == 1:
            continue  # every copy on this one rank: autograd sums them, nothing to reduce
        g = make(holder_ranks)
        if local & set(holders):
            groups.tied.append((tied[holders], g))
    for r in range(d):
        for src, dst in sorted(links or ()):
            a, b = placement.rank(src, r), placement.rank(dst, r)
            if a == b:
                continue  # two stages of one rank: the value stays in the process
            # one group per stage direction even when two share a rank pair (virtual
            # stages): a V-shape's activations 0 -> 1 and gradients 3 -> 2 both go from rank
            # 0 to rank 1, and rank 1 posts them in another order than rank 0 sends them
            g = make(sorted([a, b]))
            if r == replica and (src in local or dst in local):
                groups.links[(src, dst)] = g
    return groups


def message_links(*stage_lists: list[Stage] | None) -> set[tuple[int, int]]:
    """Every (sending stage, receiving stage) direction that carries a message in these
    stages: activations downstream and, where they need a gradient, gradients upstream."""
    found: set[tuple[int, int]] = set()
    for stages in stage_lists:
        for s in stages or ():
            for t in s.spec.sends:
                found.add((t.src, t.dst))
                if t.requires_grad:
                    found.add((t.dst, t.src))
    return found


def tied_sets(plan: Plan, model: nn.Module, canonical: dict[str, str]) -> dict[tuple, list[str]]:
    """Trainable parameters held by several stages, grouped by their holder stages."""
    trainable = {canonical[n] for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    sets: dict[tuple[int, ...], list[str]] = {}
    for name, holders in plan.tied_parameters.items():
        if name in trainable:
            sets.setdefault(tuple(sorted(holders)), []).append(name)
    return sets


def release_unheld(model: nn.Module, stage: Stage | list[Stage], device: torch.device,
                   keep: list[torch.Tensor] | None = None, keep_buffers: bool = False) -> None:
    """Keep (and move to ``device``) the tensors this rank's stage modules use; empty every
    other parameter and buffer of the model in place, so the memory is released while the
    module objects stay intact. Decided by identity with what the stage modules hold, which is
    exactly what their code can reach, plus ``keep`` (and every buffer: ``keep_buffers``)."""
    held = stage if isinstance(stage, list) else [stage]
    used = {id(t) for s in held for t in [*s.module.parameters(), *s.module.buffers()]}
    used |= {id(t) for t in keep or []}
    if keep_buffers:
        used |= {id(t) for t in model.buffers() if not t.is_meta}
    seen: set[int] = set()
    released = False
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in used:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)
        elif tensor.is_meta:  # another stage's tensor of a vf.deferred_init model: free
            released = True
        else:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
            released = True
            if isinstance(tensor, nn.Parameter):
                tensor.grad = None
    if released:
        guard_released(model, ", ".join(str(s.spec.index) for s in held))


def guard_released(model: nn.Module, stage: int | str) -> None:
    """The user's model object now holds empty tensors for every other stage: its
    ``state_dict()`` would save them as if they were the weights (``torch.save`` on rank 0 is
    the usual habit), and ``load_state_dict`` would fail deep inside torch. Both raise a
    clear error instead, pointing at the pipeline's own state and checkpoints."""
    advice = (
        f"this rank holds only stage {stage} of the model: vf.compile released the other "
        "stages' parameters and buffers of your model object in this distributed run, so "
        "{what} would see empty tensors. Use pipe.state_dict() / pipe.load_state_dict() for "
        "the tensors this rank holds (keyed by the original names), or pipe.save_checkpoint(path)"
        " / pipe.load_checkpoint(path) for the whole model (every rank writes its shard)"
    )

    def no_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise DistributedError(advice.format(what="model.state_dict()"))

    def no_load(*args: object, **kwargs: object) -> None:
        raise DistributedError(advice.format(what="model.load_state_dict()"))

    model.register_state_dict_pre_hook(no_state_dict)
    model.register_load_state_dict_pre_hook(no_load)


def broadcast_initial(named: dict[str, torch.Tensor], groups: Groups, placement: Placement,
                      stage: int, timeout: float, who: str) -> None:
    """Make the replicas start equal, as DDP does: replica 0 of each stage broadcasts its
    parameters and buffers; a tied set comes from its lowest holder rank (in replica 0: every
    replica holds the set, ranks are numbered replica-major)."""
    tied_names = {n for names, _ in groups.tied for n in names}
    works = []
    with torch.no_grad():
        for names, group in groups.tied:
            lowest = min(dist.get_process_group_ranks(group))
            for n in names:
                works.append(dist.broadcast(named[n], src=lowest, group=group, async_op=True))
        if groups.data_parallel is not None:
            for n, t in named.items():
                if n not in tied_names and t.numel():
                    works.append(dist.broadcast(t, src=placement.rank(stage, 0),
                                                group=groups.data_parallel, async_op=True))
    for w in works:
        wait(w, timeout, who, "the initial parameters from replica 0")


def held_names(canonical: dict[str, str], stages: list[Stage], local: list[int]) -> list[str]:
    """Canonical FQNs of the parameters and buffers the ``local`` stages hold, model order."""
    held = {n for s in local for n in [*stages[s].parameter_names, *stages[s].spec.buffer_names]}
    return [n for n in dict.fromkeys(canonical.values()) if n in held]


def held_tensors(model: nn.Module, names: list[str]
                 ) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """(parameters, buffers) of ``model`` among ``names`` (from :func:`held_names`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return ({n: params[n] for n in names if n in params},
            {n: buffers[n] for n in names if n in buffers})
