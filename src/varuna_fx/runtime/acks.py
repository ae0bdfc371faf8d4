"""When is a send known to be delivered? Proof by a later message from the same peer.

A gloo send completes only once the peer has posted the matching receive, and its progress
cannot be polled, so blocking on it mid-step could stall this rank behind a slow peer. But every
rank knows every stage's action list, and a peer *takes* what an action needs before that action
sends anything. So if the peer consumes our message X in its action ``a`` and later (at an action
``>= a``) sends us a message Y, then receiving Y proves X was delivered: waiting on X's send
then returns at once, and its tensor can be dropped. Activations are released by the gradients
that come back; gradients by the next activation from upstream. Sends with no such later
message (the last micro-batches) are waited for at the end of the step, when this rank has
nothing left to do, which cannot deadlock.

With Varuna's run-time rule (``opportunistic.py``) a stage may run its next forward before a
backward whose gradient is late. Forwards only move earlier, so an activation's proof (the
peer's first backward after consuming it) still holds. A gradient's proof (the upstream peer's
first forward after the backward consuming it) may not: that forward can now run first. With
``reorder=True`` the proof is instead the forward the peer cannot have started before that
backward: a stage never holds more than its static peak of micro-batches, so before its
backward ``B(i)`` it has run at most ``peak + (releases listed before B(i))`` forwards, and the
next one proves ``B(i)`` took the gradient. (The peer's rule must be on exactly when ours is:
the plan fingerprint includes it.)
"""

from __future__ import annotations

from ..ir.nodes import StageSpec
from ..schedule import Action, Kind
from ..schedule.cursor import release_kind, stash_peak

Key = tuple[str, str, int, int]  # (kind, value name, peer stage, micro-batch), as Message.key


def release_keys(me: int, per_stage: list[list[Action]], specs: list[StageSpec],
                 reorder: bool = False, split: bool = False) -> dict[Key, Key | None]:
    """For every message stage ``me`` sends in a step: the key of the received message that
    proves its delivery, or None (wait at the end of the step). ``reorder``: every stage may
    run forwards ahead of their place (``opportunistic.py``); ``split``: split backward, whose
    ``W`` frees a micro-batch's stash."""
    found: dict[Key, Key | None] = {}
    m = sum(a.kind is Kind.F for a in per_stage[me])
    for t in specs[me].sends:  # activations, consumed by the peer's forward
        back = [u.name for u in specs[t.dst].recvs if u.src == me and u.requires_grad]
        for i in range(m):
            j = _later(per_stage[t.dst], Action(t.dst, Kind.F, i), Kind.B) if back else None
            found[("activation", t.name, t.dst, i)] = \
                None if j is None else ("gradient", back[0], t.dst, j)
    for t in specs[me].recvs:  # gradients, consumed by the peer's backward
        if t.requires_grad:
            ahead = [u.name for u in specs[t.src].sends if u.dst == me]
            for i in range(m):
                consumer = Action(t.src, Kind.B, i)
                j = _bounded_forward(per_stage[t.src], consumer, split) if reorder else \
                    _later(per_stage[t.src], consumer, Kind.F)
                found[("gradient", t.name, t.src, i)] = \
                    None if j is None else ("activation", ahead[0], t.src, j)
    return found


def _bounded_forward(peer_actions: list[Action], consumer: Action, split: bool) -> int | None:
    """The micro-batch of the first forward the peer cannot run before ``consumer`` when its
    forwards may jump ahead but it never holds more than its static peak of micro-batches."""
    release = release_kind(split)
    start = peer_actions.index(consumer)
    released = sum(a.kind is release for a in peer_actions[:start])
    forwards = [a.mb for a in peer_actions if a.kind is Kind.F]
    n = stash_peak(peer_actions, split) + released  # forwards possibly run before consumer
    return forwards[n] if n < len(forwards) else None


def _later(peer_actions: list[Action], consumer: Action, kind: Kind) -> int | None:
    """The micro-batch of the first ``kind`` action the peer runs after ``consumer``."""
    start = peer_actions.index(consumer)
    return next((a.mb for a in peer_actions[start:] if a.kind is kind), None)
