"""One rank's pipeline work: its lowered program, op by op, with real messages.

The program is ``schedule.lower`` of the schedule's action lists (``program``): this stage's
compute actions with explicit sends and receives, receives posted ``LOOKAHEAD`` compute actions
ahead (so activations and gradients land while the rank still computes), sends right after the
action that made the value (they never block the loop), and the step's tail. :func:`run` walks
it with ``schedule.walk``, the walk ``schedule/nccl_check.py`` proves deadlock-free under NCCL's
rules (and ``DistributedRuntime`` checks this very program at start): what is checked is what
runs. One send or receive op stands for every tensor of its link and micro-batch, put on the
wire in transfer order on both ends. A value used by several later stages is sent to each
directly (skip connections are not relayed), and the gradients coming back from several
consumers are summed here, on the producer.

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

from ..codegen import Stage
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
    Op,
    OpKind,
    RankProgram,
    Walk,
    lower,
)
from ..schedule.nccl_check import check_comms
from ..schedule.placement import Placement
from .acks import release_keys
from .comm import Inbox, Message, Outbox
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
    def __init__(self, worker: StageWorker, stages: list[Stage], placement: Placement,
                 replica: int, micro_batch_size: int, device: torch.device,
                 timeout: float, who: str, links: dict[tuple[int, int], Any] | None = None
                 ) -> None:
        self.worker = worker
        # (sending stage, receiving stage) -> its direction's process group (setup.build_groups);
        # a direction not listed uses the default group
        self.links = links or {}
        self.spec = worker.spec
        self.placement, self.replica = placement, replica
        self.micro_batch_size = micro_batch_size
        self.device, self.timeout, self.who = device, timeout, who
        every = [t for s in stages for t in s.spec.sends]  # identical on every rank
        self._tid = {(t.name, t.src, t.dst): k for k, t in enumerate(every)}
        order = self._tid.__getitem__
        # in transfer order on both ends of every link: the order messages go on the wire
        self._sends = sorted(self.spec.sends, key=lambda t: order((t.name, t.src, t.dst)))
        self._recvs = sorted(self.spec.recvs, key=lambda t: order((t.name, t.src, t.dst)))
        self._grad_in = [t for t in self._sends if t.requires_grad]
        self._grad_out = [t for t in self._recvs if t.requires_grad]
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
        self._proof_cache: dict[tuple, dict[tuple, tuple | None]] = {}
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
        peer = t.src if t.dst == self.spec.index else t.dst
        tag = (mb * len(self._tid) + self._tid[(t.name, t.src, t.dst)]) * 3 + kind
        direction = (t.dst, t.src) if kind == GRADIENT else (t.src, t.dst)  # sending stage first
        return Message(
            kind="gradient" if kind == GRADIENT else "activation", name=t.name,
            peer_stage=peer, peer_rank=self.placement.rank(peer, self.replica), mb=mb, tag=tag,
            shape=t.tensor.concrete_shape(batch or self.micro_batch_size), dtype=t.tensor.dtype,
            group=self.links.get(direction),
        )

    def program(self, per_stage: list[list[Action]]) -> RankProgram:
        """This rank's lowered program for ``per_stage``, proved deadlock-free under NCCL's
        rules (:func:`check_lowered`) the first time each order is seen; ``self.lowered`` keeps
        every rank's program of the last order."""
        key = (self._order_key(per_stage), self.reorder, self.split)
        if key not in self._programs:
            m = sum(a.kind is Kind.F for a in per_stage[self.spec.index])
            lowered = lower(per_stage, list(range(len(per_stage))), m, name="step",
                            split_backward=self.split, links=self.links_of_stages,
                            tied=self.tied, replicas=self.placement.replicas)
            check_lowered(lowered, self.reorder)
            self._programs[key] = (lowered, lowered.programs[self.spec.index])
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

    def _op_wire(self, op: Op) -> list[tuple[Transfer, Message]]:
        """The tensors one send or receive op stands for, in transfer order (the same order
        on both ends, so NCCL pairs them one by one)."""
        key = (op.kind, op.mb, op.peer)
        found = self._op_messages.get(key)
        if found is None:
            if op.kind is OpKind.RECV_F:
                ts, kind = [t for t in self._recvs if t.src == op.peer], ACTIVATION
            elif op.kind is OpKind.RECV_B:
                ts, kind = [t for t in self._grad_in if t.dst == op.peer], GRADIENT
            elif op.kind is OpKind.SEND_F:
                ts, kind = [t for t in self._sends if t.dst == op.peer], ACTIVATION
            else:
                ts, kind = [t for t in self._grad_out if t.src == op.peer], GRADIENT
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
        self.outbox.send(wire.contiguous(), msg, proof)
        if self.on_send is not None:
            self.on_send(msg)

    # -- a training step -----------------------------------------------------------------------

    def run(self, per_stage: list[list[Action]], micro: list[dict[str, torch.Tensor]],
            loss_of: LossOf | None, tail: Callable[[Op], None] | None = None) -> None:
        """Run this rank's lowered program for ``per_stage`` (every stage's list: they also
        tell when a send is delivered), op by op as :func:`schedule.walk` yields them, the one
        walk the NCCL-order checker proves; ``loss_of`` (last stage) gives the loss seed of a
        micro-batch; ``tail`` runs the step's closing ops (all-reduces, waits)."""
        program = self.program(per_stage)
        inbox = Inbox([], self.device, self.timeout, self.who)
        proofs = self._proofs(per_stage)
        worker = self.worker
        trace = self.trace
        opened: list[tuple[str, int, float, float]] = []  # the compute action being traced

        def take(key: tuple) -> torch.Tensor:
            if trace is not None:
                start, cpu = time.perf_counter(), time.process_time()
            value = inbox.take(key)
            self.outbox.release(key)
            if trace is not None:
                trace.append(("wait", key[3], start, time.perf_counter() - start,
                              time.process_time() - cpu))
            return value

        def landed(op: Op) -> bool:  # every tensor of a posted receive has arrived
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
                for t, msg in self._op_wire(op):
                    self._send(produced[t.name], msg, proofs[msg.key])
            elif op.kind in COMPUTE:
                if trace is not None:
                    opened.append((op.kind.name, i, time.perf_counter(), time.process_time()))
                if op.kind is OpKind.F:
                    received = {t.name: take(msg.key) for t, msg in self._recv_messages(i)}
                    produced = worker.forward(i, micro[i], received)
                elif op.kind is OpKind.R:
                    worker.recompute_mb(i, self.device)
                elif op.kind is OpKind.W:  # weight gradients: no messages
                    worker.weight_grads(i)
                else:
                    loss = loss_of(i, worker.outputs_of(i)) if loss_of is not None else None
                    grads: dict[str, torch.Tensor] = {}
                    for t in self._grad_in:  # one per consumer stage: summed on the producer
                        g = take(self.message(t, i, GRADIENT).key)
                        grads[t.name] = grads[t.name] + g if t.name in grads else g
                    produced = worker.backward(i, grads, loss, split=self.split)
            elif tail is not None:
                tail(op)
        if trace is not None:
            close()
        assert inbox.pending == 0, "every posted receive is consumed by the schedule"

    def _recv_messages(self, mb: int) -> list[tuple[Transfer, Message]]:
        return [(t, self.message(t, mb, ACTIVATION)) for t in self._recvs]

    def _landed(self, msg: Message, inbox: Inbox) -> bool:
        if not inbox.posted(msg.key):
            return False  # not even posted: it cannot have landed
        return inbox.completed(msg.key) if self.arrived is None else self.arrived(msg)

    def _proofs(self, per_stage: list[list[Action]]) -> dict[tuple, tuple | None]:
        key = (self._order_key(per_stage), self.reorder)  # (any order may run)
        if key not in self._proof_cache:
            self._proof_cache[key] = release_keys(self.spec.index, per_stage, self._specs,
                                                  reorder=self.reorder, split=self.split)
        return self._proof_cache[key]

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, inputs: dict[str, torch.Tensor], batch: int,
                 autocast: Callable[[], Any]) -> dict[str, Any]:
        """The whole batch as one micro-batch through this stage, without autograd."""
        expected = [(0, self.message(t, 0, EVALUATION, batch)) for t in self.spec.recvs]
        inbox = Inbox(expected, self.device, self.timeout, self.who)
        inbox.post_until(1)
        received = {t.name: inbox.take(("activation", t.name, t.src, 0)) for t in self.spec.recvs}
        with torch.no_grad(), autocast():
            outputs = self.worker.stage({**inputs, **received})
        for t in self.spec.sends:
            self._send(outputs[t.name], self.message(t, 0, EVALUATION, batch))
        self.outbox.drain()
        return outputs
