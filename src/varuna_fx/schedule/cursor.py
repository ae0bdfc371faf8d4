"""One rank's walk through its action list under Varuna's run-time rule (the pure part).

:class:`Cursor` says which action runs next when forwards may jump ahead of a backward whose
gradient is late (``runtime/opportunistic.py`` explains the rule and why it is safe). It lives
here, below the runtime, because the NCCL-order checker (``nccl_check.py``) walks the very same
cursor the executor does: what is checked is what runs.
"""

from __future__ import annotations

from varuna_fx.schedule.actions import Action, Kind
from varuna_fx.schedule.structure import peak_stash


def release_kind(split: bool) -> Kind:
    """The action that frees a micro-batch's stash: ``B``, or ``W`` with split backward."""
    return Kind.W if split else Kind.B


# most micro-batches a stage's list holds at once: the simulator's own count
stash_peak = peak_stash


class Cursor:
    """One rank's position in its static action list, with forwards allowed to jump ahead.

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
