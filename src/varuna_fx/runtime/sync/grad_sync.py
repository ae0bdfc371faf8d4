"""After the last backward: tied-weight sums, the data-parallel average, the global grad norm.

* **Tied parameters** (held by several stages) are summed over every holder stage of every
  replica and divided by D in one all-reduce, so all copies stay bit-identical. Gradient
  accumulation across steps works: before a step, only the lowest holder keeps the
  (already synchronised) accumulated gradient; the others start from zero, so the sum counts it
  once.
* **Everything else** this stage holds is averaged over the D replicas, flattened into ~25 MB
  buckets with one asynchronous all-reduce each, launched right after the stage's last backward.
* **Gradient clipping** needs the norm of the whole model: each stage adds its squares (a tied
  parameter only on its lowest holder), one all-reduce over the replica's P stages sums them
  (the replicas already agree), and every stage scales by the same factor.
* **Sharded optimizer state** (``zero.py``, set by ``pipe.optimizer``) changes none of this:
  every ``.grad`` is averaged as without it (what the user's loop reads and edits), and the
  optimizer's step copies its shards' slices of them.
* **Replica sync** (``plan.replica_sync``, docs/API.md "Slow links"): ``bf16`` and PowerSGD
  average the same buckets through torch's hooks instead (``replica_sync.py``); DiLoCo
  averages nothing per step (``diloco.py``: each replica's optimizer steps on its own
  gradients). Weights the model ties keep the exact all-reduce under every setting.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..comm import AllReduce, wait
from ..setup import Groups
from .diloco import DiLoCoSync
from .replica_sync import HookedReduction, Piece, SyncHook, hook_layout
from .zero import ZeroSync


class GradSync:
    def __init__(self, held: dict[str, nn.Parameter], groups: Groups,
                 tied_holders: dict[str, list[int]], stage: int | list[int], replicas: int,
                 timeout: float, who: str, model_tied: set[str] | None = None) -> None:
        # ``stage``: this rank's stage, or all it runs (virtual stages: copies of a tied
        # parameter on two of them are one tensor here, summed by autograd)
        local = {stage} if isinstance(stage, int) else set(stage)
        self.groups, self.replicas, self.timeout, self.who = groups, replicas, timeout, who
        self.held = {n: p for n, p in held.items() if p.requires_grad}
        tied_here = {n for names, _ in groups.tied for n in names}
        self.plain = [p for n, p in self.held.items() if n not in tied_here]
        self.plain_named = [(n, p) for n, p in self.held.items() if n not in tied_here]
        self.tied = [([self.held[n] for n in names if n in self.held], g)
                     for names, g in groups.tied]
        # tied copies whose accumulated gradient another (lower) holder stage keeps
        self.not_lowest = [self.held[n] for n in tied_here
                           if n in self.held and min(tied_holders[n]) not in local]
        # what this stage contributes to the global norm: tied parameters once, at the lowest
        self.norm_params = [p for n, p in self.held.items()
                            if n not in tied_holders or min(tied_holders[n]) in local]
        # the newest pipe.optimizer's sharding (an older sharded optimizer refuses to step)
        self.zero: ZeroSync | None = None
        # the plan's replica sync for this rank's stage(s), where not exact: a hook of torch's
        # (bf16, PowerSGD) or DiLoCo's outer loop (the runtime sets them: distributed.py)
        self.hook: SyncHook | None = None
        self.diloco: DiLoCoSync | None = None
        # weights the model ties (several names, one tensor): reduced exactly every step
        # under every replica sync, so every layout computes the same (replica_sync.py)
        self.model_tied = set(model_tied or ())

    def reduced(self) -> list[nn.Parameter]:
        """Whose ``.grad`` holds the averaged gradient after a step (what fp16 unscales)."""
        return list(self.held.values())

    def before_step(self) -> None:
        for p in self.not_lowest:
            if p.grad is not None:
                p.grad.zero_()

    def start(self) -> list[AllReduce]:
        """Launch every reduction of this stage's gradients (asynchronous): the tied sums in
        order, then the data-parallel average (the lowered program's tail, one op each)."""
        pending = [self.start_tied(k) for k in range(len(self.tied))]
        return pending + self.start_data_parallel()

    def start_tied(self, k: int) -> AllReduce:
        """Launch the sum of this rank's ``k``-th tied set (``ALLREDUCE(tied:...)``)."""
        params, group = self.tied[k]
        return AllReduce(_grads(params), group, divide=self.replicas, timeout=self.timeout,
                         who=self.who, what=f"the tied-parameter gradient sum {_ranks(group)}")

    def start_data_parallel(self) -> list[AllReduce | HookedReduction]:
        """Launch the data-parallel average (``ALLREDUCE(dp:<stage>)``), if there is one: the
        exact all-reduce, the plan's hook (bf16, PowerSGD), or under DiLoCo only the model's
        tied weights' (each replica keeps its own gradients of the rest)."""
        pending: list[AllReduce | HookedReduction] = []
        group = self.groups.data_parallel
        if group is None:
            return pending
        if self.hook is not None:
            pending.append(HookedReduction(
                self.hook, self.plain_named, self.model_tied, self.timeout, self.who,
                f"the data-parallel {self.hook.name} reduction {_ranks(group)}"))
            return pending
        exact = self.plain if self.diloco is None else \
            [p for n, p in self.plain_named if n in self.model_tied]
        if exact:
            pending.append(AllReduce(_grads(exact), group,
                                     divide=self.replicas, timeout=self.timeout, who=self.who,
                                     what="the data-parallel gradient all-reduce "
                                     f"{_ranks(group)}"))
        return pending

    def hook_buckets(self) -> list[tuple[list[Piece], int]]:
        """The buckets the hook reduces (``replica_sync.hook_layout``): what checkpoints
        reshard its state over."""
        return hook_layout(self.plain_named, self.model_tied)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, on every rank."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        group = self.groups.pipeline
        device = grads[0].device if grads else torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # float64 on every rank: the all-reduce needs one dtype whatever each stage's
        # parameters are (a float64 model, or float32 next to float64 stages)
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
        result_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) \
            else torch.float32
        if math.isinf(norm_type):
            local = torch.stack(norms).max() if norms else torch.zeros(())
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros(())
            op = dist.ReduceOp.SUM
        total = local.to(device, torch.float64).reshape(1)
        if group is not None:
            work = dist.all_reduce(total, op=op, group=group, async_op=True)
            wait(work, self.timeout, self.who,
                 f"the gradient-norm sum {_ranks(group)}")
        total = total[0] if math.isinf(norm_type) else total[0].pow(1.0 / norm_type)
        total = total.to(result_dtype)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        every = [p.grad for p in self.reduced() if p.grad is not None]
        if every:
            torch._foreach_mul_(every, coef.to(every[0].device))
        return total


def _ranks(group: object) -> str:
    return f"with ranks {dist.get_process_group_ranks(group)}"


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients to reduce; a parameter without one contributes zeros (every member of a
    group must reduce the same tensors)."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out
