"""One rank's pipeline work: its action list, in order, with real messages.

The action list is ``Schedule.lists[rank]``: one stage's list, or with virtual stages the
rank's list interleaving its stages' actions (one worker per stage; a value passed between two
stages of this rank is handed over in memory, never sent). Before each action the receives of the next
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
        self.spec = self.worker.spec
        self.placement, self.replica = placement, replica
        self.micro_batch_size = micro_batch_size
        self.device, self.timeout, self.who = device, timeout, who
        every = [t for s in stages for t in s.spec.sends]  # identical on every rank
        self._tid = {(t.name, t.src, t.dst): k for k, t in enumerate(every)}
        # per local stage: the gradients its backward takes, and those it gives back
        self._grad_in = {s: [t for t in w.spec.sends if t.requires_grad]
                         for s, w in self.workers.items()}
        self._grad_out = {s: [t for t in w.spec.recvs if t.requires_grad]
                          for s, w in self.workers.items()}
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
        mine, peer = (t.dst, t.src) if t.dst in self.local else (t.src, t.dst)
        tag = (mb * len(self._tid) + self._tid[(t.name, t.src, t.dst)]) * 3 + kind
        direction = (t.dst, t.src) if kind == GRADIENT else (t.src, t.dst)  # stages
        return Message(
            kind="gradient" if kind == GRADIENT else "activation", name=t.name,
            peer_stage=peer, peer_rank=self.placement.rank(peer, self.replica), mb=mb, tag=tag,
            shape=t.tensor.concrete_shape(batch or self.micro_batch_size), dtype=t.tensor.dtype,
            group=self.links.get(direction), stage=mine,
        )

    def remote(self, t: Transfer) -> bool:
        """Whether ``t`` crosses to another rank (else both its stages run here)."""
        return not (t.src in self.local and t.dst in self.local)

    def expected(self, actions: list[Action]) -> list[tuple[int, Message]]:
        """(action index, message) for every receive of the list, in consumption order
        (cached per number of micro-batches: the list depends on nothing else)."""
        key = sum(a.kind is Kind.F for a in actions)
        if key not in self._expected:
            found = []
            for k, a in enumerate(actions):
                if a.kind is Kind.F:
                    found += [(k, self.message(t, a.mb, ACTIVATION))
                              for t in self.workers[a.stage].spec.recvs if self.remote(t)]
                elif a.kind is Kind.B:
                    found += [(k, self.message(t, a.mb, GRADIENT))
                              for t in self._grad_in[a.stage] if self.remote(t)]
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
            loss_of: LossOf | None, actions: list[Action] | None = None) -> None:
        """Run this rank's ``actions`` (default: its stage's list of ``per_stage``); every
        stage's list tells when a send is delivered. ``loss_of`` (the rank running the last
        stage) gives the loss seed of a micro-batch."""
        actions = per_stage[self.spec.index] if actions is None else actions
        inbox = Inbox(self.expected(actions), self.device, self.timeout, self.who)
        proofs = self._proofs(per_stage)
        near: dict[tuple, torch.Tensor] = {}  # values between two stages of this rank
        trace = self.trace

        def take(msg: Message) -> torch.Tensor:
            if trace is not None:
                start, cpu = time.perf_counter(), time.process_time()
            value = inbox.take(msg.key)
            self.outbox.release(msg.key)
            if trace is not None:
                trace.append(("wait", msg.mb, start, time.perf_counter() - start,
                              time.process_time() - cpu))
            return value

        def give(value: torch.Tensor, t: Transfer, mb: int, kind: int) -> None:
            if self.remote(t):
                msg = self.message(t, mb, kind)
                self._send(value, msg, proofs[msg.stage][msg.key[:4]])
            else:  # the wire's dtype, as the receiving stage would get it
                near[(kind, t.name, t.src, t.dst, mb)] = value.detach().to(t.tensor.dtype)

        def forward(s: int, i: int) -> None:
            worker = self.workers[s]
            received = {t.name: take(self.message(t, i, ACTIVATION)) if self.remote(t)
                        else near.pop((ACTIVATION, t.name, t.src, t.dst, i))
                        for t in worker.spec.recvs}
            outputs = worker.forward(i, micro[i], received)
            for t in worker.spec.sends:
                give(outputs[t.name], t, i, ACTIVATION)

        def backward(s: int, i: int) -> None:
            worker = self.workers[s]
            loss = loss_of(i, worker.outputs_of(i)) if loss_of is not None and \
                worker.is_last else None
            grads: dict[str, torch.Tensor] = {}
            for t in self._grad_in[s]:  # one per consumer stage: summed on the producer
                g = take(self.message(t, i, GRADIENT)) if self.remote(t) \
                    else near.pop((GRADIENT, t.name, t.src, t.dst, i))
                grads[t.name] = grads[t.name] + g if t.name in grads else g
            back = worker.backward(i, grads, loss, split=self.split)
            for t in self._grad_out[s]:
                give(back[t.name], t, i, GRADIENT)

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
            s, i = action.stage, action.mb
            if action.kind is Kind.F:
                forward(s, i)
            elif action.kind is Kind.R:
                self.workers[s].recompute_mb(i, self.device)
            elif action.kind is Kind.W:  # weight gradients: no messages
                self.workers[s].weight_grads(i)
            else:
                backward(s, i)
            cursor.done(k)
            if trace is not None:  # the whole action, its waits included (subtract them)
                trace.append((action.kind.name, i, begin, time.perf_counter() - begin,
                              time.process_time() - begin_cpu))
        assert inbox.pending == 0, "every posted receive is consumed by the schedule"
        assert not near, "every value passed within this rank is consumed"

    def _gradient_here(self, mb: int, inbox: Inbox) -> bool:
        """Every gradient the backward of ``mb`` takes has landed (True when it takes none:
        the last stage, or nothing it sends needs a gradient)."""
        return all(self._landed(self.message(t, mb, GRADIENT), inbox)
                   for t in self._grad_in[self.spec.index])

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

    def _proofs(self, per_stage: list[list[Action]]) -> dict[int, dict[tuple, tuple | None]]:
        """Per local stage: each send's key (as ``acks.release_keys`` names it) -> the key of
        the received message that proves it delivered (``Message.key``: with the stage)."""
        m = sum(a.kind is Kind.F for a in per_stage[self.spec.index])
        key = (m, self.reorder)
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
