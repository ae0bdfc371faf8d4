"""The one link-timing rule: how long an activation or gradient takes between two stages.

Each direction of a link (stage s -> s+1 forward, s+1 -> s backward) carries one message at a
time. A message ready to go at ``ready`` leaves when the previous one has left the wire
(``free``), occupies that direction for its wire time (bytes / bandwidth) and arrives its
latency plus wire time after leaving. So on a slow link back-to-back forwards queue, while a
message crossing as the other direction is busy does not. Messages of one direction cross in
the order their receiver takes them.

The simulator (``simulate``), the step timer (``simulate_step``) and both generators that time
what they place (Varuna's order, ``varuna._generate``, and the split-backward placement,
``split._fill``) all call :func:`cross`, so a schedule's simulated step is the same number
wherever it is computed.
"""

from __future__ import annotations

from collections.abc import Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.schedule_costs import per_stage


def cross(free: list[float], direction: int, ready: float, busy: float, delay: float) -> float:
    """When a message ready at ``ready`` arrives over one link ``direction``; ``free[direction]``
    (when it is next free) moves on by the ``busy`` seconds the message occupies it, and it
    arrives ``delay`` (latency + wire time) after leaving."""
    leave = free[direction]
    if ready > leave:
        leave = ready
    free[direction] = leave + busy
    return leave + delay


def link_seconds(p: int, send_bytes: Sequence[float] | None,
                 bandwidth: float | Sequence[float]) -> list[float]:
    """Wire time per link of a ``p``-stage pipeline (the same both ways: gradients are as big
    as activations); ``bandwidth``: bytes/s, one value or one per link."""
    sizes = per_stage(send_bytes, p - 1, "send_bytes") if send_bytes is not None \
        else [0.0] * (p - 1)
    if isinstance(bandwidth, (int, float)):
        bws = [float(bandwidth)] * (p - 1)
    else:
        bws = per_stage(bandwidth, p - 1, "bandwidth")
    if any(bw <= 0 for bw in bws):
        raise ScheduleError(f"bandwidth must be > 0 bytes/s, got {bws}")
    return [size / bw if size else 0.0 for size, bw in zip(sizes, bws)]
