"""Varuna's run-time rule: while a backward's gradient has not arrived, run the next forward.

The static order (``Schedule.per_stage``) was generated from estimated times; at run time a
gradient can be late. Varuna (Athlur et al., EuroSys'22) then runs the stage's next forward
instead of idling. :class:`Cursor` walks one stage's list and says when the executor may do so.
The executor asks only when the head of the list is a backward ``B(i)`` or a recompute ``R(i)``
(which exists only to feed ``B(i)``), ``B(i)``'s gradient has not arrived, and the next forward
``F(j)`` still to run (the paper's choice; never a later one) already has its inputs.

Why this is safe (the tests in ``tests/test_opportunistic.py`` check each point):

* **No deadlock.** A forward runs ahead only when every value it takes has already arrived
  (stage 0's inputs are local), so taking them does not wait, and nothing in the opportunistic
  path waits for a peer. Afterwards the stage returns to its list exactly where it was.
* **Memory as planned.** A forward runs ahead only while the stage holds fewer micro-batches
  than the static order's peak for this stage (from ``F(i)`` to ``B(i)``, or to ``W(i)`` with
  split backward), the count the memory model and the partition were priced with.
* **Messages in the order the receiver posts them.** Forwards keep their order (only the next
  one may jump) and every other action keeps its order, so what this stage sends to one peer
  keeps its order: a stage sends activations only to later stages and gradients only to earlier
  ones, skip connections included (each goes straight to its consumer), and tied weights are
  summed by an all-reduce after the step, not by these messages. Receives are still posted in
  the static consumption order.
* **Send buffers.** A send is released when a later message from the same peer proves it was
  consumed (``acks.py``). Forwards only move earlier, so "the peer's backward after it consumed
  my activation" still comes after. A gradient was proved by the upstream peer's next forward,
  which may now run before the backward that consumes the gradient; ``acks.release_keys(...,
  reorder=True)`` proves it instead by the first forward the peer cannot have run before that
  backward under the stash cap above (or waits for it at the end of the step).
* **Numbers.** Dropout is seeded per (step, node, micro-batch) and a recompute replays from its
  own micro-batch's stash, so running a forward earlier changes no value.

Where the check means something: NCCL's ``Work.is_completed()`` turns true once a receive has
landed; gloo's never does for a receive, so ``$VARUNA_FX_OPPORTUNISTIC_FORWARD`` ("auto", the
default) turns the rule on for NCCL only; "on" / "off" force it (tests, benchmarks).

It stays unverified on NCCL (no NCCL run has been made; the tests inject the arrival
predicate on CPU). Under the stash cap the rule cannot move 1F1B's or GPipe's forwards (they
hold their peak before every backward that has a forward after it); some Varuna and
split-backward orders peak early and leave room (unit costs, varuna, P=2, m=8, recompute:
stage 0 may run F5-F7 early).
"""

from __future__ import annotations

import os

from ..errors import DistributedError
from ..schedule import Action, Kind, peak_stash

ENV = "VARUNA_FX_OPPORTUNISTIC_FORWARD"
_ON, _OFF, _AUTO = ("1", "on", "true", "yes"), ("0", "off", "false", "no"), ("", "auto")


def rule_enabled(backend: str) -> bool:
    """Whether this rank runs forwards ahead: ``$VARUNA_FX_OPPORTUNISTIC_FORWARD`` or, by
    default ("auto"), only on NCCL, the one backend whose receives can be polled."""
    text = os.environ.get(ENV, "auto").strip().lower()
    if text in _AUTO:
        return backend.lower() == "nccl"
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise DistributedError(
        f"environment variable {ENV}={text!r} is not one of auto, on, off: unset it (auto: on "
        "with NCCL, whose receives can be polled) or set on / off on every rank"
    )


def release_kind(split: bool) -> Kind:
    """The action that frees a micro-batch's stash: ``B``, or ``W`` with split backward."""
    return Kind.W if split else Kind.B


# most micro-batches a stage's list holds at once: the simulator's own count
stash_peak = peak_stash


class Cursor:
    """One stage's position in its static action list, with forwards allowed to jump ahead.

    :meth:`head` is the next action of the list not yet run; :meth:`ahead` the index of the
    forward that may run before it now (or None); :meth:`done` records a run action. Forwards
    run in list order whether or not they jump, and so does everything else."""

    def __init__(self, actions: list[Action], split: bool) -> None:
        self.actions = actions
        self.release = release_kind(split)
        self.peak = stash_peak(actions, split)
        self._done = [False] * len(actions)
        self._head = 0
        self._forwards = [k for k, a in enumerate(actions) if a.kind is Kind.F]
        self._next_f = 0  # position in _forwards of the next forward to run
        self.live = 0  # micro-batches held: forwards run minus releases run
        self.max_live = 0
        self.jumped: list[Action] = []  # forwards run before their place, in the order run

    def head(self) -> int | None:
        while self._head < len(self.actions) and self._done[self._head]:
            self._head += 1
        return self._head if self._head < len(self.actions) else None

    def ahead(self) -> int | None:
        """The next forward, if the rule allows running it before the head: the head is a
        backward or recompute, that forward comes later in the list, and holding one more
        micro-batch stays within the static order's peak. (Whether its inputs and the head's
        gradient have arrived is the caller's question: this class knows no messages.)"""
        k = self.head()
        if k is None or self.actions[k].kind not in (Kind.B, Kind.R):
            return None
        if self._next_f >= len(self._forwards) or self.live >= self.peak:
            return None
        f = self._forwards[self._next_f]
        return f if f > k else None

    def done(self, k: int) -> None:
        act = self.actions[k]
        assert not self._done[k], f"{act} ran twice"
        if act.kind is Kind.F:
            # forwards in list order, so activations leave in the order receivers post them
            assert k == self._forwards[self._next_f], f"{act} ran before an earlier forward"
            self._next_f += 1
            self.live += 1
            self.max_live = max(self.max_live, self.live)
            assert self.live <= self.peak, f"{act} holds more micro-batches than planned"
            if k != self.head():
                self.jumped.append(act)
        else:
            assert k == self.head(), f"{act} ran out of its list order"
            if act.kind is self.release:
                self.live -= 1
        self._done[k] = True
