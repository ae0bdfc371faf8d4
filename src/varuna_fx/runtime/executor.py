"""One rank's pipeline work: its lowered program, op by op, with real messages.

The program is ``schedule.lower`` of the schedule's action lists (``program``): this rank's
compute actions (one stage's, or with virtual stages the rank's list interleaving its stages',
one worker per stage) with explicit sends and receives, receives posted ``LOOKAHEAD`` compute actions
ahead (so activations and gradients land while the rank still computes), sends right after the
action that made the value (they never block the loop), and the step's tail. :func:`run` walks
it with ``schedule.walk``, the walk ``schedule/nccl_check.py`` proves deadlock-free under NCCL's
rules (and ``DistributedRuntime`` checks this very program at start): what is checked is what
runs. One send or receive op stands for every tensor of its link and micro-batch, put on the
wire in transfer order on both ends. A value used by several later stages is sent to each
directly (skip connections are not relayed), and the gradients coming back from several
consumers are summed here, on the producer. A value passed between two stages of this rank is
handed over in memory (the lowering has no op for it).

Tags: ``(mb * T + transfer) * 3 + kind`` with ``T`` transfers in the plan and kind 0
(activation), 1 (gradient) or 2 (an evaluation forward), so gloo matches every message exactly;
NCCL, which matches by order only, gets the order the checker proved. A send is released when a later message
from the same peer proves it delivered (``acks.py``), the rest at the end of the step.

With ``reorder`` on (Varuna's run-time rule, ``opportunistic.py``; NCCL by default), a stage
whose next backward's gradient has not arrived runs its next forward first, if that forward's
inputs have arrived and the stage holds fewer micro-batches than its static peak; ``arrived``
(a predicate on a posted receive's :class:`Message`) replaces ``Work.is_completed()`` in tests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from ..codegen.stage_module import Stage
from ..errors import DistributedError
from ..ir.nodes import Transfer
from ..schedule import Action, Kind
from ..schedule.cursor import Cursor
from ..schedule.lowering import (
    COMPUTE,
    LOOKAHEAD,
    RECVS,
    SENDS,
    Link,
    Lowered,
    OpKind,
    RankOp,
    RankProgram,
    Walk,
    lower,
)
from ..schedule.nccl_check import check_comms
from ..schedule.placement import Placement
from .acks import release_keys
from .comm import Inbox, Message, Outbox
from .compress import encode, transfer_mode
from .worker import StageWorker

__all__ = ["LOOKAHEAD", "StageExecutor"]
ACTIVATION, GRADIENT, EVALUATION = 0, 1, 2

# (mb, scaled loss seed) for the last stage's backward of micro-batch mb
LossOf = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]


def check_lowered(lowered: Lowered, reorder: bool) -> None:
    """Prove a step's lowered program deadlock-free on the runtime's communicators: the static
    order and, where Varuna's rule is on, its reorderings (every gradient late; one random
    interleaving). Two replicas stand for D: every replica runs the same programs on groups of
    its own, joined only by the tied and data-parallel all-reduces. Milliseconds at P=8, m=16;
    about a second at P=16, m=64."""
    lowered = dataclasses.replace(lowered, replicas=min(lowered.replicas, 2))
    check_comms(lowered)
    if reorder:
        check_comms(lowered, reorder=True, late=True)
        check_comms(lowered, reorder=True, seed=0)


class StageExecutor:
    def __init__(self, worker: StageWorker | list[StageWorker], stages: list[Stage],
                 placement: Placement, replica: int, micro_batch_size: int,
                 device: torch.device, timeout: float, who: str,
                 links: dict[tuple[int, int], Any] | None = None) -> None:
        """``worker``: this rank's stage worker, or one per stage it runs (virtual stages)."""
        listed = worker if isinstance(worker, list) else [worker]
        self.workers = {w.spec.index: w for w in listed}
        self.worker = listed[0]
        self.local = frozenset(self.workers)  # the stages this rank runs
        # (sending stage, receiving stage) -> its direction's process group (setup.build_groups);
        # a direction not listed uses the default group
        self.links = links or {}
        # per stage boundary, how a training step's messages across it travel (compress.py)
        self.compression: tuple[str, ...] = ()
        self.spec = self.worker.spec
        self.placement, self.replica = placement, replica
        self.micro_batch_size = micro_batch_size
        self.device, self.timeout, self.who = device, timeout, who
        every = [t for s in stages for t in s.spec.sends]  # identical on every rank
        self._tid = {(t.name, t.src, t.dst): k for k, t in enumerate(every)}
        order = self._tid.__getitem__
        # per local stage, in transfer order on both ends of every link: the order messages go
        # on the wire; the gradients its backward takes (_grad_in) and gives back (_grad_out)
        self._sends = {s: sorted(w.spec.sends, key=lambda t: order((t.name, t.src, t.dst)))
                       for s, w in self.workers.items()}
        self._recvs = {s: sorted(w.spec.recvs, key=lambda t: order((t.name, t.src, t.dst)))
                       for s, w in self.workers.items()}
        self._grad_in = {s: [t for t in ts if t.requires_grad] for s, ts in self._sends.items()}
        self._grad_out = {s: [t for t in ts if t.requires_grad] for s, ts in self._recvs.items()}
        # which stage sends to which (and whether a gradient comes back): the lowering's links
        grads: dict[tuple[int, int], bool] = {}
        for t in every:
            grads[(t.src, t.dst)] = grads.get((t.src, t.dst), False) or t.requires_grad
        self.links_of_stages = [Link(a, b, g) for (a, b), g in sorted(grads.items())]
        self.tied: list[tuple[int, ...]] = []  # holder stages of each tied set (the tail)
        self._programs: dict[tuple, tuple[Lowered, RankProgram]] = {}
        self._order_keys: dict[int, tuple[list[list[Action]], int]] = {}
        self._orders: dict[tuple, int] = {}
        self._op_messages: dict[tuple, list[tuple[Transfer, Message]]] = {}
        self.lowered: Lowered | None = None
        self._messages: dict[tuple, Message] = {}
        self._specs = [s.spec for s in stages]
        self._proof_cache: dict[tuple, dict[int, dict[tuple, tuple | None]]] = {}
        self.outbox = Outbox(timeout, who)
        self.split = False  # split-backward schedule: B computes input gradients only
        # set to a list to record (what, micro-batch, start, wall seconds, CPU seconds) of
        # every action and every wait for a message (bench/bench_step_breakdown.py)
        self.trace: list[tuple[str, int, float, float, float]] | None = None
        self.reorder = False  # Varuna's run-time rule: run the next forward while a gradient is late
        # tests: whether a posted receive has landed (default: its Work.is_completed())
        self.arrived: Callable[[Message], bool] | None = None
        self.on_send: Callable[[Message], None] | None = None  # tests: after every send
        self.cursor: Cursor | None = None  # the last step's walk (jumped forwards, peak held)
        # (stage, what, micro-batch, start, end) of every action, send, wait and tail op of
        # a step, appended here when a list is set (runtime/timeline.py; pipe.last_step)
        self.timeline: list[tuple[int, str, int, float, float]] | None = None

    # -- messages ------------------------------------------------------------------------------

    def message(self, t: Transfer, mb: int, kind: int, batch: int | None = None) -> Message:
        """The message carrying transfer ``t`` for micro-batch ``mb`` (seen from this rank);
        cached, as every step sends the same ones (and shapes are sympy substitutions)."""
        if batch is not None:  # evaluation: any batch size, not worth keeping
            return self._make_message(t, mb, kind, batch)
        key = (t.name, t.src, t.dst, mb, kind)
        found = self._messages.get(key)
        if found is None:
            found = self._messages[key] = self._make_message(t, mb, kind, None)
        return found

    def _make_message(self, t: Transfer, mb: int, kind: int, batch: int | None) -> Message:
        mine, peer = (t.dst, t.src) if t.dst in self.local else (t.src, t.dst)
        tag = (mb * len(self._tid) + self._tid[(t.name, t.src, t.dst)]) * 3 + kind
        direction = (t.dst, t.src) if kind == GRADIENT else (t.src, t.dst)  # sending stage first
        mode = "off" if kind == EVALUATION else transfer_mode(self.compression, t.src, t.dst)
        return Message(
            kind="gradient" if kind == GRADIENT else "activation", name=t.name,
            peer_stage=peer, peer_rank=self.placement.rank(peer, self.replica), mb=mb, tag=tag,
            shape=t.tensor.concrete_shape(batch or self.micro_batch_size), dtype=t.tensor.dtype,
            group=self.links.get(direction), stage=mine, mode=mode,
        )

    def remote(self, t: Transfer) -> bool:
        """Whether ``t`` crosses to another rank (else both its stages run here)."""
        return not (t.src in self.local and t.dst in self.local)

    def program(self, per_stage: list[list[Action]],
                rank_lists: list[list[Action]] | None = None) -> RankProgram:
        """This rank's lowered program for ``per_stage`` (with virtual stages: for
        ``rank_lists``, each rank's order of its stages' actions), proved deadlock-free under
        NCCL's rules (:func:`check_lowered`) the first time each order is seen;
        ``self.lowered`` keeps every rank's program of the last order."""
        lists = per_stage if rank_lists is None else rank_lists
        key = (self._order_key(lists), self.reorder, self.split)
        if key not in self._programs:
            m = sum(a.kind is Kind.F for a in per_stage[self.spec.index])
            ranks = [self.placement.pipeline_rank(s) for s in range(len(per_stage))]
            lowered = lower(lists, ranks, m, name="step", split_backward=self.split,
                            links=self.links_of_stages, tied=self.tied,
                            replicas=self.placement.replicas)
            check_lowered(lowered, self.reorder)
            mine = lowered.programs[self.placement.pipeline_rank(self.spec.index)]
            self._programs[key] = (lowered, mine)
        self.lowered, program = self._programs[key]
        return program

    def _order_key(self, per_stage: list[list[Action]]) -> int:
        """A number for the order ``per_stage`` holds (equal orders, equal numbers), remembered
        by identity (schedules are never edited in place): hashing every action each step
        cost a millisecond at m=16."""
        found = self._order_keys.get(id(per_stage))
        if found is None or found[0] is not per_stage:
            content = tuple(tuple(acts) for acts in per_stage)
            number = self._orders.setdefault(content, len(self._orders))
            found = self._order_keys[id(per_stage)] = (per_stage, number)
        return found[1]

    def _op_wire(self, op: RankOp) -> list[tuple[Transfer, Message]]:
        """The tensors one send or receive op stands for, in transfer order (the same order
        on both ends, so NCCL pairs them one by one)."""
        key = (op.kind, op.stage, op.mb, op.peer)
        found = self._op_messages.get(key)
        if found is None:
            s = op.stage
            if op.kind is OpKind.RECV_F:
                ts, kind = [t for t in self._recvs[s] if t.src == op.peer], ACTIVATION
            elif op.kind is OpKind.RECV_B:
                ts, kind = [t for t in self._grad_in[s] if t.dst == op.peer], GRADIENT
            elif op.kind is OpKind.SEND_F:
                ts, kind = [t for t in self._sends[s] if t.dst == op.peer], ACTIVATION
            else:
                ts, kind = [t for t in self._grad_out[s] if t.src == op.peer], GRADIENT
            found = self._op_messages[key] = [(t, self.message(t, op.mb, kind)) for t in ts]
        return found

    def _send(self, value: torch.Tensor, msg: Message, proof: tuple | None = None) -> None:
        if tuple(value.shape) != msg.shape:
            raise DistributedError(
                f"{self.who} produced {msg.name!r} of shape {tuple(value.shape)} for micro-batch "
                f"{msg.mb} but the plan says {msg.shape}: the value's shape depends on the data, "
                "which a pipeline cannot carry; make it fixed or keep it within one stage"
            )
        wire = value.detach()
        if wire.dtype != msg.dtype:  # autocast: keep the planned dtype on the wire
            wire = wire.to(msg.dtype)
        self.outbox.send(encode(wire, msg.mode), msg, proof)
        if self.on_send is not None:
            self.on_send(msg)

    # -- a training step -----------------------------------------------------------------------

    def run(self, per_stage: list[list[Action]], micro: list[dict[str, torch.Tensor]],
            loss_of: LossOf | None, tail: Callable[[RankOp], None] | None = None,
            rank_lists: list[list[Action]] | None = None) -> None:
        """Run this rank's lowered program for ``per_stage`` (every stage's list: they also
        tell when a send is delivered), op by op as :func:`schedule.walk` yields them, the one
        walk the NCCL-order checker proves; ``loss_of`` (last stage) gives the loss seed of a
        micro-batch; ``tail`` runs the step's closing ops (all-reduces, waits); ``rank_lists``:
        with virtual stages, each rank's order (``Schedule.rank_lists``)."""
        program = self.program(per_stage, rank_lists)
        inbox = Inbox([], self.device, self.timeout, self.who)
        proofs = self._proofs(per_stage)
        near: dict[tuple, torch.Tensor] = {}  # values between two stages of this rank
        trace = self.trace
        opened: list[tuple[str, int, float, float]] = []  # the compute action being traced
        timeline, clock = self.timeline, time.perf_counter

        def take(key: tuple) -> torch.Tensor:
            if trace is not None:
                start, cpu = time.perf_counter(), time.process_time()
            began = clock()
            value = inbox.take(key)
            self.outbox.release(key)
            if timeline is not None:  # key: (kind, name, peer stage, mb, stage)
                timeline.append((key[4], "wait", key[3], began, clock()))
            if trace is not None:
                trace.append(("wait", key[3], start, time.perf_counter() - start,
                              time.process_time() - cpu))
            return value

        def landed(op: RankOp) -> bool:  # every tensor of a posted receive has arrived
            return all(self._landed(msg, inbox) for _, msg in self._op_wire(op))

        def close() -> None:  # a traced action lasts until its sends are out
            if opened:
                what, i, begin, begin_cpu = opened.pop()
                trace.append((what, i, begin, time.perf_counter() - begin,  # type: ignore[union-attr]
                              time.process_time() - begin_cpu))

        produced: dict[str, torch.Tensor] = {}  # what the last compute action made, to send
        walk = Walk(program, self.split, self.reorder, landed)
        self.cursor = walk.cursor
        for op in walk:
            if trace is not None and op.kind not in SENDS:
                close()
            i = op.mb
            if op.kind in RECVS:
                for _, msg in self._op_wire(op):
                    inbox.post(msg)
            elif op.kind in SENDS:
                began = clock()
                for t, msg in self._op_wire(op):
                    self._send(produced[t.name], msg, proofs[op.stage][msg.key[:4]])
                if timeline is not None:
                    timeline.append((op.stage, "send", i, began, clock()))
            elif op.kind in COMPUTE:
                if trace is not None:
                    opened.append((op.kind.name, i, time.perf_counter(), time.process_time()))
                s = op.stage
                worker = self.workers[s]
                began = clock()  # (F and B: after the waits for their inputs, "wait")
                if op.kind is OpKind.F:
                    received = {t.name: take(self.message(t, i, ACTIVATION).key)
                                if self.remote(t) else near.pop((ACTIVATION, t.name, t.dst, i))
                                for t in self._recvs[s]}
                    began = clock()
                    produced = worker.forward(i, micro[i], received)
                    for t in self._sends[s]:  # to a stage of this rank: in the wire's dtype
                        if not self.remote(t):
                            near[(ACTIVATION, t.name, t.dst, i)] = \
                                produced[t.name].detach().to(t.tensor.dtype)
                elif op.kind is OpKind.R:
                    worker.recompute_mb(i, self.device)
                elif op.kind is OpKind.W:  # weight gradients: no messages
                    worker.weight_grads(i)
                else:
                    grads: dict[str, torch.Tensor] = {}
                    for t in self._grad_in[s]:  # one per consumer stage: summed on the producer
                        g = take(self.message(t, i, GRADIENT).key) if self.remote(t) \
                            else near.pop((GRADIENT, t.name, t.dst, i))
                        grads[t.name] = grads[t.name] + g if t.name in grads else g
                    began = clock()
                    loss = loss_of(i, worker.outputs_of(i)) \
                        if loss_of is not None and worker.is_last else None
                    produced = worker.backward(i, grads, loss, split=self.split)
                    for t in self._grad_out[s]:
                        if not self.remote(t):
                            near[(GRADIENT, t.name, t.dst, i)] = produced[t.name]
                if timeline is not None:
                    timeline.append((s, op.kind.name, i, began, clock()))
            elif tail is not None:
                began = clock()
                tail(op)
                if timeline is not None:  # the step's tail: reductions and their waits
                    timeline.append((self.spec.index, "sync", -1, began, clock()))
        if trace is not None:
            close()
        assert inbox.pending == 0, "every posted receive is consumed by the schedule"
        assert not near, "every value passed within this rank is consumed"

    def _landed(self, msg: Message, inbox: Inbox) -> bool:
        if not inbox.posted(msg.key):
            return False  # not even posted: it cannot have landed
        return inbox.completed(msg.key) if self.arrived is None else self.arrived(msg)

    def _proofs(self, per_stage: list[list[Action]]) -> dict[int, dict[tuple, tuple | None]]:
        """Per local stage: each send's key (as ``acks.release_keys`` names it) -> the key of
        the received message that proves it delivered (``Message.key``: with the stage)."""
        key = (self._order_key(per_stage), self.reorder)  # (any order may run)
        if key not in self._proof_cache:
            self._proof_cache[key] = {
                s: {k: None if proof is None else (*proof, s)
                    for k, proof in release_keys(s, per_stage, self._specs,
                                                 reorder=self.reorder, split=self.split).items()}
                for s in self.local}
        return self._proof_cache[key]

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, inputs: dict[str, torch.Tensor], batch: int,
                 autocast: Callable[[], Any]) -> dict[str, Any]:
        """The whole batch as one micro-batch through this rank's stages (in stage order, a
        topological one), without autograd; returns the outputs of its highest stage."""
        order = sorted(self.workers)
        expected = [(k, self.message(t, 0, EVALUATION, batch)) for k, s in enumerate(order)
                    for t in self.workers[s].spec.recvs if self.remote(t)]
        inbox = Inbox(expected, self.device, self.timeout, self.who)
        near: dict[tuple, torch.Tensor] = {}
        outputs: dict[str, Any] = {}
        for k, s in enumerate(order):
            spec = self.workers[s].spec
            inbox.post_until(k + 1)
            received = {t.name: inbox.take(self.message(t, 0, EVALUATION, batch).key)
                        if self.remote(t) else near.pop((t.name, t.dst)) for t in spec.recvs}
            with torch.no_grad(), autocast():
                outputs = self.workers[s].stage({**inputs, **received})
            for t in spec.sends:
                if self.remote(t):
                    self._send(outputs[t.name], self.message(t, 0, EVALUATION, batch))
                else:
                    near[(t.name, t.dst)] = outputs[t.name].to(t.tensor.dtype)
        self.outbox.drain()
        return outputs
