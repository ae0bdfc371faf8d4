"""An in-place morph as the monitor reports it: one ``metrics.jsonl`` line (``"event":
"morph"``, beside the per-step records, which ``read_jsonl`` and the charts skip), TensorBoard
scalars under ``morph/``, and a line on the console.

Built from ``MorphRecord.as_dict()`` (``pipe.morphs``; duck-typed: this layer is below the
pipeline's), with the step that first ran on the new layout.
"""

from __future__ import annotations

from typing import Any

from ..costs.memory import format_bytes

EVENT = "morph"
_KEPT = ("generation", "reason", "old_layout", "new_layout", "phases", "cpu", "bytes_moved",
         "bytes_received", "joined", "left", "lost", "signal_at", "started", "finished")


def layout_text(plan: Any, world: int | None) -> str:
    """``"P=2 D=1 b=2 m=2 (2 ranks)"`` (``"(1 process)"`` for ``world`` None): a layout as the
    morphs' records word it (``morph/records.py``, a layer above), so the two compare."""
    text = (f"P={plan.stages} D={plan.data_parallel} b={plan.micro_batch_size} "
            f"m={plan.num_micro_batches}")
    return f"{text} ({'1 process' if world is None else f'{world} ranks'})"


def morph_event(record: dict[str, Any], step: int) -> dict[str, Any]:
    """The event line of one morph: what the record says, the step that first ran on the new
    layout, and the morph's seconds (its phases but the first step)."""
    phases = record.get("phases", {})
    seconds = sum(v for k, v in phases.items() if k != "first_step")
    event: dict[str, Any] = {"event": EVENT, "step": step, "seconds": seconds}
    event.update({k: record[k] for k in _KEPT if k in record})
    return event


def tensorboard_scalars(event: dict[str, Any]) -> dict[str, Any]:
    """The event as a record TensorBoard's sink writes: numbers under ``morph/``."""
    scalars = {"step": event["step"], "morph/seconds": event["seconds"],
               "morph/bytes_moved": event.get("bytes_moved", 0)}
    scalars.update({f"morph/{k}_seconds": v for k, v in event.get("phases", {}).items()})
    return scalars


def describe_morph(event: dict[str, Any]) -> str:
    """``morph before step 7 (notice: m1 left): P=2 D=1 ... -> P=1 D=1 ... in 1.20 s (agree
    0.10, ...), 1.2 MiB moved``."""
    who = [f"{', '.join(event.get(k) or ())} {k}" for k in ("left", "lost", "joined")
           if event.get(k)]
    why = event.get("reason", "?") + (f": {'; '.join(who)}" if who else "")
    phases = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in
                       event.get("phases", {}).items())
    return (f"in-place morph before step {event['step']} ({why}): {event.get('old_layout')} -> "
            f"{event.get('new_layout')} in {event['seconds']:.2f} s ({phases}), "
            f"{format_bytes(event.get('bytes_moved', 0))} moved")
