"""A run's ``metrics.jsonl`` read back whole: the step records as they stand (a step logged
again supersedes what was logged from it on) and the event lines (morphs, resumes, restarts,
evaluations), for the charts and ``varuna-fx report``.

Reading is tolerant, because the file may belong to a running job or to one that was killed:
lines are JSON data (no code runs), a line that does not parse -- the last one half written --
or is not an object with an integer ``step`` is skipped. Supersession: when a resumed run
(``start_step=k``) logs step k+1 again, the records of steps k+1 and later from before are the
ones it trained again, so they are dropped; a ``"restart"`` event (an in-place job started
again from its ``step``) drops those after its step at once.

Marks for the charts (:func:`marks`): where a run resumed (and whether on another layout), an
in-place morph changed the layout, or a job restarted.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..world import safe_json

RESUME_EVENT = "resume"  # a run resumed from a checkpoint (the monitor's start_step)
RESTART_EVENT = "restart"  # an in-place job started again (the train command's, issue 42)
MORPH_EVENT = "morph"  # morph_events.EVENT


@dataclass
class History:
    records: list[dict[str, Any]] = field(default_factory=list)  # by step, each step once
    events: list[dict[str, Any]] = field(default_factory=list)  # in the file's order
    skipped: int = 0  # lines that were not JSON objects with an integer step (a cut last line)
    # the layout the run was on last: a record's ``layout`` (each launch's first), a morph's
    # ``new_layout`` or a resume's ``layout``, whichever came last in the file
    layout: str | None = None


def read_history(path: Path, before_step: int | None = None) -> History:
    """``path`` (a ``metrics.jsonl``) as records and events; ``before_step``: only lines of
    steps below it (what a run resuming at ``before_step`` keeps)."""
    history = History()
    if not path.is_file():
        return history
    kept: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            item = _parse(line, path, number)
            if item is None:
                history.skipped += line.strip() != ""
                continue
            step = item["step"]
            if before_step is not None and step >= before_step:
                continue
            if "event" in item:
                history.events.append(item)
                if item["event"] == RESTART_EVENT:  # what was logged after its step is redone
                    kept = {s: r for s, r in kept.items() if s <= step}
                layout = item.get("new_layout") or item.get("layout")
                if isinstance(layout, str):
                    history.layout = layout
                continue
            if step in kept:  # logged again: a resumed run trained it (and what follows) again
                kept = {s: r for s, r in kept.items() if s < step}
            kept[step] = item
            if isinstance(item.get("layout"), str):
                history.layout = item["layout"]
    history.records = [kept[s] for s in sorted(kept)]
    return history


def _parse(line: str, path: Path, number: int) -> dict[str, Any] | None:
    try:
        item = safe_json.loads(line)
    except safe_json.JsonTooDeep as exc:  # not a line the monitor wrote: say so, go on
        warnings.warn(f"varuna_fx: skipping line {number} of {path}: {exc}", stacklevel=3)
        return None
    except ValueError:  # a torn last line (the run was killed mid-write): skipped quietly
        return None
    if not isinstance(item, dict) or isinstance(item.get("step"), bool) or \
            not isinstance(item.get("step"), int):
        return None
    if "event" in item and not isinstance(item["event"], str):
        return None
    return item


def core_layout(layout: str | None) -> str | None:
    """``"P=2 D=1 b=2 m=2"`` of ``"P=2 D=1 b=2 m=2 (2 ranks)"``: layouts compared without the
    process count, which P x D already says (and a one-process pipeline words differently)."""
    return layout.split(" (")[0] if isinstance(layout, str) else None


@dataclass(frozen=True)
class Mark:
    """A vertical line on the training chart, before the step ``step``."""

    step: int
    kind: str  # resume | morph | restart
    label: str


def marks(events: list[dict[str, Any]]) -> list[Mark]:
    """The chart's marks: resumes (on another layout: said), morphs, restarts; several at one
    step (a restart is also a resume) make one mark."""
    found: dict[int, Mark] = {}
    for event in events:
        kind, step = event.get("event"), event["step"]
        if kind == RESUME_EVENT:
            old, new = core_layout(event.get("previous_layout")), core_layout(event.get("layout"))
            label = f"resumed on another layout, {old} -> {new}" \
                if old and new and old != new else "resumed"
        elif kind == MORPH_EVENT:
            label = (f"morph ({event.get('reason', '?')}): {core_layout(event.get('old_layout'))}"
                     f" -> {core_layout(event.get('new_layout'))}")
        elif kind == RESTART_EVENT:
            label = "restarted"
        else:
            continue
        earlier = found.get(step)
        if earlier is not None:  # one line, both labels (the morph's or restart's first)
            kind, label = earlier.kind, f"{earlier.label}; {label}" \
                if label not in earlier.label else earlier.label
        found[step] = Mark(step, str(kind), label)
    return [found[s] for s in sorted(found)]


def val_points(history_records: list[dict[str, Any]],
               events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, validation loss): a record's ``val_loss`` (``monitor.log(loss, val_loss=...)``)
    or an event line's (``{"event": "eval", "step": s, "val_loss": ...}``)."""
    points = {}
    for item in [*history_records, *events]:
        value = item.get("val_loss")
        if isinstance(value, int | float) and not isinstance(value, bool):
            points[item["step"]] = float(value)
    return sorted(points.items())


def assumed_peak(records: list[dict[str, Any]] | Any) -> float | None:
    """The assumed peak FLOP/s per device the records' MFU is against (``mfu_assumed_peak``),
    or None when MFU was against a datasheet's or the user's (or the field is not a number)."""
    for r in records:
        value = r.get("mfu_assumed_peak")
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None
