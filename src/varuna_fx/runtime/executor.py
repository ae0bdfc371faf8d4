"""One rank's pipeline work: its stage's action list, in order, with real messages.

The action list is ``Schedule.per_stage[stage]``. Before each action the receives of the next
few actions are posted (``LOOKAHEAD``), so activations and gradients land while the rank still
computes; sends go out as soon as a value exists and never block the loop. A value used by
several later stages is sent to each directly (skip connections are not relayed), and the
gradients coming back from several consumers are summed here, on the producer.

Tags: ``(mb * T + transfer) * 3 + kind`` with ``T`` transfers in the plan and kind 0
(activation), 1 (gradient) or 2 (an evaluation forward), so gloo matches every message exactly;
the posting order (micro-batch order for activations, the common backward order for gradients)
is also the sending order, which is what NCCL needs. A send is released when a later message
from the same peer proves it delivered (``acks.py``), the rest at the end of the step.

With ``reorder`` on (Varuna's run-time rule, ``opportunistic.py``; NCCL by default), a stage
whose next backward's gradient has not arrived runs its next forward first, if that forward's
inputs have arrived and the stage holds fewer micro-batches than its static peak; ``arrived``
(a predicate on a posted receive's :class:`Message`) replaces ``Work.is_completed()`` in tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..codegen import Stage
from ..errors import DistributedError
from ..ir.nodes import Transfer
from ..schedule import Action, Kind
from ..schedule.placement import Placement
from .acks import release_keys
from .comm import Inbox, Message, Outbox
from .opportunistic import Cursor
from .worker import StageWorker

LOOKAHEAD = 3  # actions whose receives are posted ahead of the current one
ACTIVATION, GRADIENT, EVALUATION = 0, 1, 2

# (mb, scaled loss seed) for the last stage's backward of micro-batch mb
LossOf = Callable[[int, dict[str, torch.Tensor]], torch.Tensor]


class StageExecutor:
    def __init__(self, worker: StageWorker, stages: list[Stage], placement: Placement,
                 replica: int, micro_batch_size: int, device: torch.device,
                 timeout: float, who: str, links: dict[tuple[int, int], Any] | None = None
                 ) -> None:
        self.worker = worker
        # (sending rank, receiving rank) -> its direction's process group (setup.build_groups);
        # a direction not listed uses the default group
        self.links = links or {}
        self.spec = worker.spec
        self.placement, self.replica = placement, replica
        self.micro_batch_size = micro_batch_size
        self.device, self.timeout, self.who = device, timeout, who
        every = [t for s in stages for t in s.spec.sends]  # identical on every rank
        self._tid = {(t.name, t.src, t.dst): k for k, t in enumerate(every)}
        self._grad_in = [t for t in self.spec.sends if t.requires_grad]
        self._grad_out = [t for t in self.spec.recvs if t.requires_grad]
        self._expected: dict[int, list[tuple[int, Message]]] = {}
        self._messages: dict[tuple, Message] = {}
        self._specs = [s.spec for s in stages]
        self._proof_cache: dict[tuple[int, bool], dict[tuple, tuple | None]] = {}
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
        sender, receiver = (t.dst, t.src) if kind == GRADIENT else (t.src, t.dst)
        direction = (self.placement.rank(sender, self.replica),
                     self.placement.rank(receiver, self.replica))
        return Message(
            kind="gradient" if kind == GRADIENT else "activation", name=t.name,
            peer_stage=peer, peer_rank=self.placement.rank(peer, self.replica), mb=mb, tag=tag,
            shape=t.tensor.concrete_shape(batch or self.micro_batch_size), dtype=t.tensor.dtype,
            group=self.links.get(direction),
        )

    def expected(self, actions: list[Action]) -> list[tuple[int, Message]]:
        """(action index, message) for every receive of the list, in consumption order
        (cached per number of micro-batches: the list depends on nothing else)."""
        key = sum(a.kind is Kind.F for a in actions)
        if key not in self._expected:
            found = []
            for k, a in enumerate(actions):
                if a.kind is Kind.F:
                    found += [(k, self.message(t, a.mb, ACTIVATION)) for t in self.spec.recvs]
                elif a.kind is Kind.B:
                    found += [(k, self.message(t, a.mb, GRADIENT)) for t in self._grad_in]
            self._expected[key] = found
        return self._expected[key]

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
            loss_of: LossOf | None) -> None:
        """Run this stage's list of ``per_stage`` (every stage's list: they tell when a send is
        delivered); ``loss_of`` (last stage) gives the loss seed of a micro-batch."""
        actions = per_stage[self.spec.index]
        inbox = Inbox(self.expected(actions), self.device, self.timeout, self.who)
        proofs = self._proofs(per_stage)
        worker, spec = self.worker, self.spec

        trace = self.trace

        def take(key: tuple) -> torch.Tensor:
            if trace is not None:
                start, cpu = time.perf_counter(), time.process_time()
            value = inbox.take(key)
            self.outbox.release(key)
            if trace is not None:
                trace.append(("wait", key[3], start, time.perf_counter() - start,
                              time.process_time() - cpu))
            return value

        def forward(i: int) -> None:
            received = {t.name: take(("activation", t.name, t.src, i)) for t in spec.recvs}
            outputs = worker.forward(i, micro[i], received)
            for t in spec.sends:
                msg = self.message(t, i, ACTIVATION)
                self._send(outputs[t.name], msg, proofs[msg.key])

        cursor = self.cursor = Cursor(actions, self.split)
        while (k := cursor.head()) is not None:
            inbox.post_until(k + 1 + LOOKAHEAD)
            if self.reorder:  # Varuna's rule; never waits, so it cannot deadlock
                f = cursor.ahead()
                if f is not None and not self._gradient_here(actions[k].mb, inbox) and \
                        self._inputs_here(actions[f].mb, f, inbox):
                    k = f
            action = actions[k]
            if trace is not None:
                begin, begin_cpu = time.perf_counter(), time.process_time()
            i = action.mb
            if action.kind is Kind.F:
                forward(i)
            elif action.kind is Kind.R:
                worker.recompute_mb(i, self.device)
            elif action.kind is Kind.W:  # weight gradients: no messages
                worker.weight_grads(i)
            else:
                loss = loss_of(i, worker.outputs_of(i)) if loss_of is not None else None
                grads: dict[str, torch.Tensor] = {}
                for t in self._grad_in:  # one per consumer stage: summed on the producer
                    g = take(("gradient", t.name, t.dst, i))
                    grads[t.name] = grads[t.name] + g if t.name in grads else g
                back = worker.backward(i, grads, loss, split=self.split)
                for t in self._grad_out:
                    msg = self.message(t, i, GRADIENT)
                    self._send(back[t.name], msg, proofs[msg.key])
            cursor.done(k)
            if trace is not None:  # the whole action, its waits included (subtract them)
                trace.append((action.kind.name, i, begin, time.perf_counter() - begin,
                              time.process_time() - begin_cpu))
        assert inbox.pending == 0, "every posted receive is consumed by the schedule"

    def _gradient_here(self, mb: int, inbox: Inbox) -> bool:
        """Every gradient the backward of ``mb`` takes has landed (True when it takes none:
        the last stage, or nothing it sends needs a gradient)."""
        return all(self._landed(self.message(t, mb, GRADIENT), inbox) for t in self._grad_in)

    def _inputs_here(self, mb: int, index: int, inbox: Inbox) -> bool:
        """Every activation the forward of ``mb`` (list position ``index``) takes has landed."""
        if not self.spec.recvs:
            return True  # stage 0: the inputs are local
        inbox.post_until(index + 1)  # in the static order, as the senders expect
        return all(self._landed(self.message(t, mb, ACTIVATION), inbox) for t in self.spec.recvs)

    def _landed(self, msg: Message, inbox: Inbox) -> bool:
        if not inbox.posted(msg.key):
            return False  # not even posted: it cannot have landed
        return inbox.completed(msg.key) if self.arrived is None else self.arrived(msg)

    def _proofs(self, per_stage: list[list[Action]]) -> dict[tuple, tuple | None]:
        m = sum(a.kind is Kind.F for a in per_stage[self.spec.index])
        key = (m, self.reorder)
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
