"""Per-stage costs that schedule generators order by: F, R, B (and W) times and link times.

Varuna's order and the split-backward placement are decided by an event simulation, so they
depend on what the actions cost. The planner passes its estimated or measured costs; without
any, :meth:`ScheduleCosts.unit` stands in (F = R = 1, B = 2 with W half of it, free links),
which is how schedules are drawn in papers and how the golden files are generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from varuna_fx.errors import ScheduleError


def _floats(values: Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if len(values) != n:
        raise ScheduleError(f"{what} needs {n} values (one per stage/link), got {len(values)}")
    out = tuple(float(v) for v in values)
    if any(v < 0 for v in out):
        raise ScheduleError(f"{what} must be >= 0 seconds, got {out}")
    return out


@dataclass(frozen=True)
class ScheduleCosts:
    """Seconds per micro-batch, per stage: ``forward``, ``recompute`` (default: the forward),
    ``backward`` (the whole backward), ``weight_grad`` (the part of it that computes the weight
    gradients, used by split-backward schedules; default half), and ``links[s]``: seconds one
    activation or gradient takes across link s (stage s to s+1), latency included."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute: tuple[float, ...] | None = None
    weight_grad: tuple[float, ...] | None = None
    links: tuple[float, ...] | None = None

    @classmethod
    def unit(cls, num_stages: int) -> ScheduleCosts:
        return cls((1.0,) * num_stages, (2.0,) * num_stages)

    @classmethod
    def of(cls, forward: Sequence[float], backward: Sequence[float],
           recompute: Sequence[float] | None = None,
           weight_grad: Sequence[float] | None = None,
           links: Sequence[float] | None = None) -> ScheduleCosts:
        """Checked construction from any sequences (one value per stage, ``P - 1`` links)."""
        p = len(forward)
        return cls(
            _floats(forward, p, "forward"),
            _floats(backward, p, "backward"),
            None if recompute is None else _floats(recompute, p, "recompute"),
            None if weight_grad is None else _floats(weight_grad, p, "weight_grad"),
            None if links is None else _floats(links, max(p - 1, 0), "links"),
        )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def f(self, s: int) -> float:
        return self.forward[s]

    def r(self, s: int) -> float:
        return self.forward[s] if self.recompute is None else self.recompute[s]

    def w(self, s: int) -> float:
        """The weight-gradient part of stage ``s``'s backward."""
        return self.backward[s] / 2 if self.weight_grad is None else \
            min(self.weight_grad[s], self.backward[s])

    def b(self, s: int, split: bool = False) -> float:
        """The backward of stage ``s``; with ``split``, only its input-gradient part."""
        return self.backward[s] - self.w(s) if split else self.backward[s]

    def link(self, s: int) -> float:
        """Transfer time across link ``s`` (stage s to s+1)."""
        return 0.0 if self.links is None else self.links[s]

    def input_grad_only(self) -> ScheduleCosts:
        """These costs with each backward cut to its input-gradient part (no ``W``)."""
        p = self.num_stages
        return ScheduleCosts(self.forward, tuple(self.b(s, split=True) for s in range(p)),
                             tuple(self.r(s) for s in range(p)), (0.0,) * p, self.links)

    def check(self, num_stages: int) -> None:
        if self.num_stages != num_stages:
            raise ScheduleError(
                f"schedule costs describe {self.num_stages} stages but the schedule has "
                f"{num_stages}"
            )


def per_stage(values: Sequence[float], n: int, what: str) -> list[float]:
    """``values`` as floats, refused unless there are ``n`` (one per stage or link)."""
    if len(values) != n:
        raise ScheduleError(f"{what} needs {n} values (one per stage/link), got {len(values)}")
    return [float(v) for v in values]


def stage_seconds(p: int, split_backward: bool, forward: Sequence[float],
                  backward: Sequence[float], recompute: Sequence[float] | None,
                  weight_grad: Sequence[float] | None
                  ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-stage F, R, B and W seconds of a ``p``-stage schedule: R defaults to F; with a split
    backward, B is the backward less its weight part (default half), else W is 0."""
    fwd = per_stage(forward, p, "forward")
    rec = fwd if recompute is None else per_stage(recompute, p, "recompute")
    bwd = per_stage(backward, p, "backward")
    wgt = [0.0] * p
    if split_backward:
        wgt = [b / 2 for b in bwd] if weight_grad is None else \
            per_stage(weight_grad, p, "weight_grad")
        bwd = [b - w for b, w in zip(bwd, wgt)]
    return fwd, rec, bwd, wgt


def simulator_arguments(costs: ScheduleCosts, num_stages: int) -> dict[str, object]:
    """The simulators' keyword arguments for ``costs`` (link times in seconds: one byte per
    link at one byte per second)."""
    p = num_stages
    costs.check(p)
    links = [costs.link(s) for s in range(p - 1)]
    return dict(forward=costs.forward, backward=costs.backward,
                recompute=[costs.r(s) for s in range(p)],
                send_bytes=links if any(links) else None, bandwidth=1.0,
                weight_grad=[costs.w(s) for s in range(p)])
