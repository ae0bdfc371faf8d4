"""Replica sync other than the exact all-reduce: bf16 and PowerSGD, through torch's own hooks.

``replica_sync="bf16"`` and ``vf.PowerSGD(...)`` (``costs/wire.py``) reduce a stage's gradients
over its D replicas with torch's DDP communication hooks themselves:
``default_hooks.bf16_compress_hook`` and ``powerSGD_hook.powerSGD_hook`` with its
``PowerSGDState`` (low rank with error feedback, warm-started factors, ``start_iter`` exact
steps first). Those hooks take a DDP ``GradBucket``; :class:`HookBucket` is that face over one of
our ~25 MB buckets (``buffer()``: the flat gradients, ``gradients()``: per-parameter views of
it, ``index()``, ``is_last()``: all the hooks read), so the algorithm is torch's, bit for bit,
on the buckets the exact all-reduce uses (``comm._buckets``). A hook returns a future; the
step's tail waits on it (:class:`HookReduce`), the process group's timeout bounding every
collective inside it, and copies the averaged buffer back into the gradients.

ZeRO-1 (``zero.py``) reduces the gradients as without it, so under it the hooks reduce them
alike and its step takes its shards' slices; the parameters' all-gather after the step stays
exact (half an all-reduce's bytes: ``costs/wire.py`` prices it). DiLoCo needs no per-step
reduction (``diloco.py``).

Weights the model ties (one tensor under several names: GPT's embedding and head) are reduced
exactly under every setting (:class:`HookedReduction`): at P > 1 their copies on several stages
are summed in one exact all-reduce over holders and replicas, so keeping them exact at P = 1
too makes every layout compute the same thing.

What a resumed run needs of PowerSGD (:class:`PowerSGDSync`): each replica's error feedback and
the warm-started ``Q`` factors (the same on every replica), per parameter FQN, and the step
count; checkpoints hold them per FQN (``checkpoint/sync_state.py``), so they reshard like the
model: a bucket's state is cut into its parameters' pieces and put back together for whatever
buckets the loading layout makes.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from ...costs.wire import PowerSGD, ReplicaSync
from .. import comm
from ..comm import _buckets, launch, peer_error
from ..traffic import SENT


@dataclass
class Piece:
    """One tensor's place in a bucket's flat buffer, by name."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class HookBucket:
    """The ``dist.GradBucket`` face torch's communication hooks read, over a flat buffer."""

    def __init__(self, flat: torch.Tensor, pieces: Sequence[Piece], index: int,
                 last: bool) -> None:
        self._flat, self._index, self._last = flat, index, last
        self._views = [flat[p.offset:p.offset + p.numel].view(p.shape) for p in pieces]

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


Hook = Callable[[HookBucket], Any]  # a bucket -> torch.futures.Future[Tensor]


class HookReduce:
    """One step's hook reductions: (bucket, hook, where the result goes), run one bucket after
    another on the replica-sync worker thread, waited for by :meth:`finish`.

    Why one at a time, off the main thread: torch's PowerSGD hook issues its ``Q`` all-reduce
    from a future's callback, so with two buckets in flight each replica issues the buckets'
    ``Q`` all-reduces in whichever order its callbacks ran. Gloo pairs collectives by the order
    they were issued, so a replica then reduces one bucket's ``Q`` against another's ("Received
    data size doesn't match expected size", or silently wrong sums where the sizes agree).
    One worker running every reduction's collectives in the order the step submitted them
    keeps that order the same on every replica; the main thread goes on with the step's tail
    meanwhile. Every collective inside is bounded by the process group's timeout."""

    def __init__(self, who: str, what: str, timeout: float) -> None:
        self.who, self.what, self.timeout = who, what, timeout
        self.pending: list[tuple[Hook, HookBucket, Callable[[torch.Tensor], None]]] = []
        self.job: concurrent.futures.Future[None] | None = None
        self.collectives = 0  # at most, in the submitted job: bounds its wait

    def launch(self, hook: Hook, bucket: HookBucket,
               done: Callable[[torch.Tensor], None]) -> None:
        self.pending.append((hook, bucket, done))

    def start(self, first: Callable[[], None] | None = None) -> None:
        """Submit this step's buckets (after ``first``, another collective of the same group
        that must keep its place in the order) to the worker."""
        jobs, self.pending = list(self.pending), []

        def run() -> None:
            if first is not None:
                first()
            for hook, bucket, done in jobs:
                future = launch(lambda hook=hook, bucket=bucket: hook(bucket), self.who,
                                self.what)
                done(future.wait())

        self.collectives = 2 + 3 * len(jobs)  # first, and three per PowerSGD bucket
        self.job = _worker().submit(run)

    def finish(self) -> None:
        """Wait for the worker to have run every bucket (each collective inside bounded by
        the process group's timeout, so the whole by that many timeouts)."""
        if self.job is None:
            return
        job, self.job = self.job, None
        limit = self.timeout * self.collectives
        try:
            job.result(timeout=limit)
        except concurrent.futures.TimeoutError as exc:
            raise peer_error(exc, limit, self.who, self.what) from exc
        except RuntimeError as exc:  # (a PeerTimeoutError from launch() passes as it is)
            raise peer_error(exc, self.timeout, self.who, self.what) from exc


_WORKER: concurrent.futures.ThreadPoolExecutor | None = None


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one replica-sync thread (one, so reductions of several stages on one
    rank also keep the order they were submitted in)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="varuna-fx-replica-sync")
    return _WORKER


def named_buckets(named: Sequence[tuple[str, torch.Tensor]],
                  bucket_bytes: int | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """``named`` in the exact all-reduce's buckets (``comm._buckets``: consecutive tensors of
    one dtype and device, ``comm.BUCKET_BYTES``: ~25 MB, read at the call so a test can make a
    small model's gradients several buckets), names kept."""
    by_id = {id(t): n for n, t in named}
    size = comm.BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    return [[(by_id[id(t)], t) for t in bucket]
            for bucket in _buckets([t for _, t in named], size)]


class SyncHook:
    """A stage's replica sync by one of torch's hooks over its replica group: ``bf16`` or
    PowerSGD (its state kept here, with what checkpoints save of it)."""

    def __init__(self, setting: ReplicaSync, group: Any, replicas: int) -> None:
        self.setting, self.group, self.replicas = setting, group, replicas
        self.state: psgd.PowerSGDState | None = None
        self.steps = 0  # steps reduced so far (PowerSGD's ``iter``, the same on every rank)
        # per bucket index: its pieces and its flat length, for the state's per-FQN form
        self.layout: dict[int, tuple[list[Piece], int]] = {}
        if isinstance(setting, PowerSGD):
            self.state = psgd.PowerSGDState(
                group, matrix_approximation_rank=setting.rank,
                start_powerSGD_iter=setting.start_iter,
                min_compression_rate=setting.min_compression_rate,
                use_error_feedback=True, warm_start=True, random_seed=0,
                compression_stats_logging_frequency=10**9)

    @property
    def name(self) -> str:
        return "bf16" if self.state is None else "PowerSGD"

    def hook(self, bucket: HookBucket) -> Any:
        if self.state is None:
            SENT.all_reduce(bucket.buffer().to(torch.bfloat16), self.group)
            return default_hooks.bf16_compress_hook(self.group, bucket)  # type: ignore[arg-type]
        SENT.all_reduce(bucket.buffer()[:self._sent(bucket)], self.group)
        return psgd.powerSGD_hook(self.state, bucket)  # type: ignore[arg-type]

    def _sent(self, bucket: HookBucket) -> int:
        """Elements this bucket's PowerSGD all-reduces (for the byte count only)."""
        assert self.state is not None
        if self.state.iter < self.state.start_powerSGD_iter:
            return bucket.buffer().numel()
        setting = self.setting
        assert isinstance(setting, PowerSGD)
        return min(bucket.buffer().numel(),
                   sum(setting.elements(tuple(g.shape)) for g in bucket.gradients()))

    def start(self, buckets: Sequence[tuple[torch.Tensor, list[Piece],
                                            Callable[[torch.Tensor], None]]],
              reduce: HookReduce, first: Callable[[], None] | None = None) -> None:
        """Launch the hook on every (flat, pieces, done) bucket of this step (after
        ``first``: see :meth:`HookReduce.start`)."""
        if self.state is not None:
            self.state.iter = self.steps  # every rank counts steps alike (checkpoints)
        self.steps += 1
        for i, (flat, pieces, done) in enumerate(buckets):
            self.layout[i] = (list(pieces), flat.numel())
            reduce.launch(self.hook, HookBucket(flat, pieces, i, i == len(buckets) - 1), done)
        reduce.start(first)

    # -- what checkpoints keep (checkpoint/sync_state.py) --------------------------------------

    def errors(self) -> dict[str, torch.Tensor]:
        """This replica's PowerSGD error feedback per FQN."""
        if self.state is None:
            return {}
        out = {}
        for i, flat in self.state.error_dict.items():
            for p in self.layout.get(i, ([], 0))[0]:
                out[p.name] = flat[p.offset:p.offset + p.numel].view(p.shape)
        return out

    def factors(self) -> dict[str, torch.Tensor]:
        """The warm-started Q factor of every compressed gradient, per FQN (the same on
        every replica)."""
        if self.state is None:
            return {}
        out = {}
        for i, q_flat in self.state.q_memory_dict.items():
            for piece, (start, length, m, r) in _factor_slots(self.layout.get(i, ([], 0))[0],
                                                              self.state):
                out[piece.name] = q_flat[start:start + length].view(m, r)
        return out

    def restore(self, steps: int, errors: dict[str, torch.Tensor],
                factors: dict[str, torch.Tensor],
                buckets: Sequence[tuple[list[Piece], int]]) -> None:
        """Put saved state back for this layout's ``buckets``: a bucket takes its pieces'
        errors (zeros where none was saved) and, where every compressed piece's Q was
        saved, its warm start (else PowerSGD draws fresh factors, alike on every replica)."""
        self.steps = steps
        if self.state is None:
            return
        state = self.state
        state.iter = steps
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        for i, (pieces, length) in enumerate(buckets):
            self.layout[i] = (list(pieces), length)
            if any(p.name in errors for p in pieces):
                first = next(iter(errors.values()))
                flat = torch.zeros(length, dtype=first.dtype, device=first.device)
                for p in pieces:
                    if p.name in errors:
                        flat[p.offset:p.offset + p.numel].copy_(errors[p.name].reshape(-1))
                state.error_dict[i] = flat
            slots = _factor_slots(pieces, state)
            if slots and all(p.name in factors for p, _ in slots):
                size = sum(length for _, (_, length, _, _) in slots)
                sample = factors[slots[0][0].name]
                q_flat = torch.empty(size, dtype=sample.dtype, device=sample.device)
                for p, (start, length, _, _) in slots:
                    q_flat[start:start + length].copy_(factors[p.name].reshape(-1))
                state.q_memory_dict[i] = q_flat
                p_size = sum(n * r for n, r in _p_sizes(pieces, state))
                state.p_memory_dict[i] = torch.empty(p_size, dtype=sample.dtype,
                                                     device=sample.device)


def _compressed(pieces: Sequence[Piece], state: psgd.PowerSGDState) -> list[Piece]:
    out = []
    for p in pieces:
        n, m = p.shape[0] if p.shape else 1, math.prod(p.shape[1:]) if p.shape else 1
        r = min(n, m, state.matrix_approximation_rank)
        if psgd._should_compress(n, m, r, state.min_compression_rate)[0]:
            out.append(p)
    return out


def _p_sizes(pieces: Sequence[Piece], state: psgd.PowerSGDState) -> list[tuple[int, int]]:
    return [(p.shape[0], min(p.shape[0], math.prod(p.shape[1:]),
                             state.matrix_approximation_rank))
            for p in _compressed(pieces, state)]


def _factor_slots(pieces: Sequence[Piece], state: psgd.PowerSGDState
                  ) -> list[tuple[Piece, tuple[int, int, int, int]]]:
    """Where each compressed piece's Q sits in the bucket's ``q_memory`` flat: the hook lays
    them out grouped by shape, shapes in first-seen order (``powerSGD_hook``'s
    ``shape_to_tensors``, unbatched), each ``m x r``."""
    groups: dict[tuple[int, int], list[Piece]] = {}
    for p in _compressed(pieces, state):
        groups.setdefault((p.shape[0], math.prod(p.shape[1:])), []).append(p)
    slots, at = [], 0
    for (n, m), members in groups.items():
        r = min(n, m, state.matrix_approximation_rank)
        for p in members:
            slots.append((p, (at, m * r, m, r)))
            at += m * r
    return slots


def _plain_buckets(plain: Sequence[tuple[str, torch.Tensor]], exact: set[str]
                   ) -> list[list[tuple[str, torch.Tensor]]]:
    return named_buckets([(n, p) for n, p in plain if n not in exact])


def hook_layout(plain: Sequence[tuple[str, torch.Tensor]],
                exact: set[str]) -> list[tuple[list[Piece], int]]:
    """The buckets the hook reduces, as (pieces by FQN at their offsets, flat length): the
    parameters it reduces in the exact all-reduce's buckets (the model's tied weights left
    out). Checkpoints reshard the hook's state over this."""
    out = []
    for bucket in _plain_buckets(plain, exact):
        pieces, at = [], 0
        for name, p in bucket:
            pieces.append(Piece(name, at, tuple(p.shape)))
            at += p.numel()
        out.append((pieces, at))
    return out


class HookedReduction:
    """One step's reduction of a stage's gradients (``.grad``, in place) under a hook (bf16,
    PowerSGD); the model's tied weights by the exact all-reduce."""

    def __init__(self, hook: SyncHook, plain: Sequence[tuple[str, torch.Tensor]],
                 exact: set[str], timeout: float, who: str, what: str) -> None:
        from ..comm import AllReduce  # (the exact all-reduce, as grad_sync's)

        self.reduce = HookReduce(who, what, timeout)
        exact_grads = [_grad(p) for n, p in plain if n in exact]
        self.exact: AllReduce | None = None

        def tied() -> None:  # on the worker, first: the group's collectives keep one order
            self.exact = AllReduce(exact_grads, hook.group, divide=hook.replicas,
                                   timeout=timeout, who=who, what=what)
        buckets = []
        for (pieces, _), bucket in zip(hook_layout(plain, exact), _plain_buckets(plain, exact)):
            grads = [_grad(p) for _, p in bucket]

            def done(result: torch.Tensor, grads: list[torch.Tensor] = grads) -> None:
                at = 0
                for g in grads:
                    g.copy_(result[at:at + g.numel()].view_as(g))
                    at += g.numel()

            buckets.append((torch.cat([g.reshape(-1) for g in grads]), pieces, done))
        hook.start(buckets, self.reduce, tied if exact_grads else None)

    def finish(self) -> None:
        self.reduce.finish()
        if self.exact is not None:
            self.exact.finish()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient (zeros where it has none: every replica reduces alike)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
