"""Varuna's run-time rule: while a backward's gradient has not arrived, run the next forward.

The static order (``Schedule.per_stage``) was generated from estimated times; at run time a
gradient can be late. Varuna (Athlur et al., EuroSys'22) then runs the stage's next forward
instead of idling. ``schedule/cursor.py``'s :class:`Cursor` walks one stage's list and says when the executor may do so.
The executor asks only when the head of the list is a backward ``B(i)`` or a recompute ``R(i)``
(which exists only to feed ``B(i)``), ``B(i)``'s gradient has not arrived, and the next forward
``F(j)`` still to run (the paper's choice; never a later one) already has its inputs.

Why this is safe (the tests in ``tests/runtime/test_opportunistic.py`` check each point):

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

from ..world.switches import read

ENV = "VARUNA_FX_OPPORTUNISTIC_FORWARD"


def rule_enabled(backend: str) -> bool:
    """Whether this rank runs forwards ahead: ``$VARUNA_FX_OPPORTUNISTIC_FORWARD`` or, by
    default ("auto"), only on NCCL, the one backend whose receives can be polled."""
    setting = read(ENV)  # (refused there when it is not auto, on or off)
    return backend.lower() == "nccl" if setting == "auto" else setting == "on"
