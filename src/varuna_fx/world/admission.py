"""Whether a process may join a running in-place job: it must run the job's model and
configuration.

A process joining a running job takes its state from the members (weights, optimizer state,
the step count, the data position) and plans as they do; one that runs another model, other
compile options or another training configuration would be admitted, then fail the morph on
every survivor, which then exit to resume from a checkpoint (that may not exist yet): one
wrong command could end the job. So every process offers a *fingerprint* before it registers
(``Membership.join`` writes it as ``print/<member>``), and the member that admits joiners
compares each registrant's with its own (``Membership._admit``): a registrant whose fingerprint
differs is never admitted, its refusal is written as ``refused/<member>`` (the registrant
raises, naming what differs, and its launcher does not start it again), and the job runs on.

A fingerprint is plain data, ``{name: text}``: ``model`` (a digest of the parameters', the
buffers' and the graph's structure), ``compile.<option>`` (compile's options that shape the
plan or the numbers), and what the script adds (``varuna-fx train``: ``train.<key>`` for every
key of its configuration that is not a per-machine setting). An empty fingerprint (a process
that offered none) is admitted as before.
"""

from __future__ import annotations

from typing import Any

from . import safe_json

PRINT_KEY = "print/{member}"
REFUSED_KEY = "refused/{member}"
_SHOWN = 60  # characters of a value shown in a refusal


def differences(job: dict[str, str], joiner: dict[str, str]) -> list[str]:
    """What differs between the job's fingerprint and a joiner's, one line per name (the
    joiner's value first), in name order; [] when either is empty (nothing offered)."""
    if not job or not joiner:
        return []
    lines = []
    for name in sorted(set(job) | set(joiner)):
        mine, theirs = joiner.get(name), job.get(name)
        if mine != theirs:
            lines.append(f"{name}: {_short(mine)} in the joining process, {_short(theirs)} in "
                         "the running job")
    return lines


def refusal(member: str, job: str, lines: list[str]) -> str:
    """The message a refused joiner raises."""
    shown = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
    return (f"{member} was refused by the running in-place job {job!r}: it runs another model "
            f"or configuration ({shown}). A process joins a running job only with the job's "
            "own script, model and configuration (the same command); the job keeps running "
            "without it")


def registrant_refusal(store: Any, job: str, fingerprint: dict[str, str],
                       member: str) -> str | None:
    """The refusal of registrant ``member`` by a process running ``fingerprint``, or None
    when it may join. Its fingerprint is read as JSON data (nothing in it runs); one that is
    not a flat object of strings is refused as unreadable."""
    key = PRINT_KEY.format(member=member)
    try:
        theirs = safe_json.loads(store.get(key)) if store.check([key]) else {}
    except ValueError:  # (safe_json: a deep one too)
        theirs = None
    if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
        theirs = {"fingerprint": "unreadable"}
    lines = differences(fingerprint, theirs)
    return refusal(member, job, lines) if lines else None


def plain(value: Any) -> str:
    """A value as fingerprint text, the same in every process: functions by their qualified
    name, objects whose repr holds an address by their type (never the address)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _short(value: str | None) -> str:
    if value is None:
        return "(not given)"
    return value if len(value) <= _SHOWN else value[:_SHOWN - 3] + "..."
