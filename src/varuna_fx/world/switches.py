"""Every ``VARUNA_FX_*`` environment variable, declared once, read through one parser.

:data:`SWITCHES` is the table: each variable's kind, its default and what it means, in one line.
docs/API.md's "Environment variables" table is this one (``tests/world/test_switches.py`` holds
them equal), and no other module reads a ``VARUNA_FX_*`` variable itself: it calls
:func:`read`, which turns the text into a value by the switch's kind and refuses a value it
cannot read with a message naming the variable. The variables the in-place launcher hands its
workers are one record, :class:`WorkerEnv`, written by the launcher and read by the worker.

Bottom layer: imports nothing from the package but ``errors``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import DistributedError, VarunaFxError

# the words a yes/no switch takes (lower-cased, stripped)
ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """One environment variable: how its text is read and what it means."""

    name: str
    kind: str  # "seconds" | "count" | "path" | "text" | "choice": how read() parses it
    default: str  # as docs/API.md shows it ("" where unset means "not given")
    meaning: str  # one line
    # "choice": each accepted word (lower-cased) -> the value read() returns; unset or empty
    # reads as the default's value
    words: Mapping[str, str] = field(default_factory=dict)
    # "choice": the value of a word not in ``words`` (None: refused)
    otherwise: str | None = None
    error: type[VarunaFxError] = VarunaFxError  # what a value it cannot read raises
    fix: str = ""  # what the refusal says to do
    launcher: bool = False  # set by varuna-fx run for its workers, not by a user


def _words(on: str, off: str, **more: str) -> dict[str, str]:
    return {**more, **{w: on for w in ON}, **{w: off for w in OFF}}


# a cache switch: off, the process's memory only, or memory and disk (any other word)
_CACHE_WORDS = {**{w: "off" for w in OFF}, "memory": "memory"}

_TABLE = (
    Switch("VARUNA_FX_TIMEOUT", "seconds", "300",
           "seconds any wait on a peer may take (compile's timeout= wins)"),
    Switch("VARUNA_FX_COMPILE_TIMEOUT", "seconds", "1800",
           "seconds a stage's background compile (compile_stages='on') may take from when it "
           "is queued; past it the stage stays eager, with a warning"),
    Switch("VARUNA_FX_DUMP", "path", "",
           "folder every compiler pass's graph is written to (compile's dump= wins)"),
    Switch("VARUNA_FX_CACHE_DIR", "path", "", "the one folder of every on-disk cache "
           "(captures, graphs, profiles, plans, partitions); unset: ~/.cache/varuna_fx"),
    Switch("VARUNA_FX_CACHE", "path", "",
           "the profiles folder itself, read only while VARUNA_FX_CACHE_DIR is unset (older name)"),
    Switch("VARUNA_FX_CACHE_MODE", "choice", "1",
           "the one switch of compile's caches: 1: the process's memory and disk; memory: the "
           "process only; 0: off", words=_CACHE_WORDS, otherwise="disk"),
    Switch("VARUNA_FX_CACHE_KEY", "path", "", "the file of this user's key that seals cache "
           "entries (outside the cache folder); unset: $XDG_CONFIG_HOME/varuna_fx/cache.key"),
    Switch("VARUNA_FX_GRAPH_CACHE", "choice", "",
           "older switch of captured graphs and shape observations (wins where set): 1, memory, "
           "0", words=_CACHE_WORDS, otherwise="disk"),
    Switch("VARUNA_FX_PLAN_CACHE", "choice", "",
           "older switch of the planner's searches and partitions (wins where set): 1, memory, "
           "0", words=_CACHE_WORDS, otherwise="disk"),
    Switch("VARUNA_FX_MACHINE", "path", "", "a JSON file of this machine's costs to plan with "
           "instead of measuring them (planner/machine.py; the test suite states one)"),
    Switch("VARUNA_FX_LEARN", "choice", "on",
           "plans learn the step's overhead from their first steps (on), only use what was "
           "learned (use), or neither (off) (planner/learned.py)",
           words=_words("on", "off", use="use"), otherwise="on"),
    Switch("VARUNA_FX_PREPLAN", "choice", "auto",
           "in place, search the likely next worlds in a child after each layout's first step "
           "(auto: on GPU clusters; 1: on; 0: off)",
           words=_words("on", "off", auto="auto"), otherwise="auto"),
    Switch("VARUNA_FX_PREPLAN_SECONDS", "seconds", "600", "the pre-planning child's time limit"),
    Switch("VARUNA_FX_OPPORTUNISTIC_FORWARD", "choice", "auto",
           "Varuna's run-time rule: a forward whose input arrived runs while a gradient has not "
           "(auto: with NCCL; on; off)", words=_words("on", "off", auto="auto"),
           error=DistributedError,
           fix="unset it (auto: on with NCCL, whose receives can be polled) or set on / off on "
               "every rank"),
    Switch("VARUNA_FX_HEARTBEAT_WINDOW", "seconds", "3",
           "in place, seconds without a heartbeat before a member is gone"),
    Switch("VARUNA_FX_STORE", "text", "", "host:port of the in-place job's membership store",
           launcher=True),
    Switch("VARUNA_FX_JOB", "text", "varuna-fx", "the in-place job's name (--rdzv-id)",
           launcher=True),
    Switch("VARUNA_FX_MEMBER", "text", "", "this worker's name, unique in the job (unset: pid "
           "and the process id)", launcher=True),
    Switch("VARUNA_FX_MIN_WORLD", "count", "1", "the fewest processes the job runs with "
           "(--nnodes MIN x --nproc)", error=DistributedError, launcher=True),
    Switch("VARUNA_FX_MAX_WORLD", "count", str(1 << 30), "the most processes the job takes "
           "(--nnodes MAX x --nproc)", error=DistributedError, launcher=True),
)
SWITCHES: dict[str, Switch] = {s.name: s for s in _TABLE}


def check_seconds(name: str, value: object) -> float:
    """A positive, finite number of seconds (NaN would make every deadline pass or none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise VarunaFxError(f"{name}={value!r}: give a number of seconds, e.g. 60")
    if not math.isfinite(value) or value <= 0:
        raise VarunaFxError(f"{name}={value!r}: give a positive, finite number of seconds "
                            "(e.g. 60); to wait long, give a large number")
    return float(value)


def given(name: str) -> bool:
    """Whether the variable is set to something (an older switch wins only where given)."""
    return bool(os.environ.get(SWITCHES[name].name, "").strip())


def read(name: str) -> Any:
    """The variable's value by its switch's kind: "seconds" a positive float, "count" an
    int, "path" and "text" the text (None where unset or empty and the default is ""),
    "choice" the value its word stands for. Unset or empty reads as the default; a value that
    cannot be read raises the switch's error, naming it."""
    switch = SWITCHES[name]
    text = os.environ.get(name, "").strip()
    given = text if text else switch.default
    if switch.kind == "seconds":
        try:
            value = float(given)
        except ValueError:
            raise switch.error(f"{name}={text!r} is not a number of seconds; set it to e.g. "
                               "60") from None
        return check_seconds(name, value)
    if switch.kind == "count":
        try:
            return int(given)
        except ValueError:
            raise switch.error(f"{name}={text!r} is not an integer; set it to a number of "
                               "processes (varuna-fx run sets it)") from None
    if switch.kind in ("path", "text"):
        return given or None
    word = given.lower()
    value = switch.words.get(word, switch.otherwise) if word else switch.words.get(
        switch.default.lower(), switch.otherwise)
    if value is None:
        shown = ", ".join(dict.fromkeys(switch.words.values()))
        raise switch.error(f"environment variable {name}={text!r} is not one of {shown}: "
                           f"{switch.fix}")
    return value


@dataclass(frozen=True)
class WorkerEnv:
    """What the in-place launcher (``launch/in_place.py``) hands each worker in its
    environment, as one record: written with :meth:`environ`, read back with :meth:`read`."""

    store: str  # host:port of the membership store
    job: str = "varuna-fx"
    member: str | None = None  # None: the worker names itself pid<pid>
    min_world: int = 1
    max_world: int = 1 << 30

    def environ(self) -> dict[str, str]:
        env = {"VARUNA_FX_STORE": self.store, "VARUNA_FX_JOB": self.job,
               "VARUNA_FX_MIN_WORLD": str(self.min_world),
               "VARUNA_FX_MAX_WORLD": str(self.max_world)}
        if self.member is not None:
            env["VARUNA_FX_MEMBER"] = self.member
        return env

    @classmethod
    def read(cls) -> WorkerEnv | None:
        """This worker's record; None outside an in-place job (no store)."""
        store = read("VARUNA_FX_STORE")
        if store is None:
            return None
        return cls(store=store, job=read("VARUNA_FX_JOB"), member=read("VARUNA_FX_MEMBER"),
                   min_world=read("VARUNA_FX_MIN_WORLD"), max_world=read("VARUNA_FX_MAX_WORLD"))
