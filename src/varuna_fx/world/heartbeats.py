"""Which members of a generation stopped beating: the one rule the membership's agreement
after a failure (``Membership.recover``) and a step's closing sum (``closing.py``) share. A
member is gone once its heartbeat counter (``beat/<member>`` in the store) has not moved for
the window. Base layer: the standard library only."""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopped:
    """Tracks ``members``' heartbeats from now on; :meth:`gone` reads them again."""

    def __init__(self, beats: Callable[[list[str]], dict[str, int]], members: list[str],
                 window: float) -> None:
        self.beats, self.members, self.window = beats, members, window
        self.last = beats(members)
        self.moved = dict.fromkeys(members, time.monotonic())

    def gone(self) -> set[str]:
        """The members whose heartbeat has not moved for the window."""
        now, beats = time.monotonic(), self.beats(self.members)
        for m in self.members:
            if beats[m] != self.last[m]:
                self.last[m], self.moved[m] = beats[m], now
        return {m for m in self.members if now - self.moved[m] > self.window}
