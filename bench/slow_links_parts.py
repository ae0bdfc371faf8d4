"""The pure parts of bench_slow_links.py: corpus windows, ``--setting`` flags, the wire-bytes
formula, step-time and time-to-loss statistics, and reading a run's JSONL back.

No torch.distributed, no namespaces: tests/bench/test_slow_links_parts.py imports this file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import statistics
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- the corpus: the Python standard library's sources, read as bytes --------------------------


def stdlib_sources(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's ``*.py`` files, concatenated in the
    order of their sorted relative paths: the same bytes on every rank and every system (the
    interpreter is the same), no download. Its sha256 goes into every run's record."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "site-packages" in path.parts or "test" in path.relative_to(root).parts[:1]:
            continue  # installed packages differ between machines; test/ holds odd encodings on purpose
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def window_starts(corpus_len: int, seq_len: int) -> int:
    """How many non-overlapping windows of ``seq_len + 1`` bytes (input and shifted target)
    the corpus holds."""
    return (corpus_len - 1) // seq_len


def batch_windows(step: int, batch: int, windows: int, seed: int) -> list[int]:
    """The window indices of global batch ``step``: consecutive slices of a seeded permutation
    of all windows (a new permutation each epoch), the same for every system and rank."""
    out: list[int] = []
    first = step * batch
    while len(out) < batch:
        epoch, at = divmod(first + len(out), windows)
        out += _order(windows, seed, epoch)[at:at + batch - len(out)]
    return out


@functools.lru_cache(maxsize=2)
def _order(windows: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(windows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


# -- --setting flags: keyword arguments for vf.compile ------------------------------------------


def parse_value(text: str, namespace: Any = None) -> Any:
    """A flag value as Python: ints, floats, true/false, none, ``Name:arg:key=value`` for a
    class of ``namespace`` (``powersgd:4`` -> ``vf.PowerSGD(4)``, matched case-insensitively),
    else the string itself (``int8``, ``1f1b``)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if ":" in text:
        name, *parts = text.split(":")
        if namespace is None:
            raise ValueError(f"{text!r}: a class call needs the library to look {name!r} up in")
        factory = lookup(namespace, name)
        args = [parse_value(p, namespace) for p in parts if "=" not in p]
        kwargs = {k: parse_value(v, namespace) for k, _, v in
                  (p.partition("=") for p in parts if "=" in p)}
        return factory(*args, **kwargs)
    return text


def lookup(namespace: Any, name: str) -> Callable[..., Any]:
    for attr in dir(namespace):
        if attr.lower() == name.lower() and callable(getattr(namespace, attr)):
            return getattr(namespace, attr)
    raise ValueError(f"{name!r}: {getattr(namespace, '__name__', namespace)} has no such class "
                     "(this version may not have it yet)")


def parse_setting(text: str, namespace: Any = None) -> dict[str, Any]:
    """``"compression=int8,replica_sync=powersgd:4"`` -> keyword arguments for vf.compile
    (``""`` or ``"defaults"``: none)."""
    if text.strip() in ("", "defaults"):
        return {}
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"setting {item!r}: write key=value, e.g. compression=int8")
        if key in out:
            raise ValueError(f"setting {text!r} names {key!r} twice")
        out[key] = parse_value(value.strip(), namespace)
    return out


def label(setting: str) -> str:
    """A file-name-safe label for a setting string."""
    if setting.strip() in ("", "defaults"):
        return "defaults"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in setting.replace("=", "-"))


# -- bytes on the wire: the formula -------------------------------------------------------------


@dataclass(frozen=True)
class Wire:
    """Payload bytes per step, summed over all ranks' sends (no headers)."""

    pipeline: float   # boundary activations forward + their gradients backward
    sync: float       # gradient (or parameter) agreement between replicas

    @property
    def total(self) -> float:
        return self.pipeline + self.sync


def element_bytes(compression: str) -> float | None:
    """Bytes per boundary element sent under ``compression`` (int8 adds a per-row scale:
    see :func:`boundary_payload`); None when the setting decides per boundary (``auto``)."""
    return {"off": 4.0, "fp32": 4.0, "bf16": 2.0, "int8": 1.0}.get(compression)


def boundary_payload(shape: Sequence[int], compression: str = "off") -> float | None:
    """Bytes of one fp32 boundary tensor of ``shape`` sent under ``compression``: int8 sends
    one byte per element plus a 4-byte scale per row (the last dimension is a row)."""
    per = element_bytes(compression)
    if per is None:
        return None
    elements = math.prod(shape)
    rows = elements // shape[-1] if shape else 1
    return elements * per + (4 * rows if compression == "int8" else 0)


def pipeline_bytes(boundaries: Sequence[float], micro_batches: int, replicas: int) -> float:
    """Every cut's tensor sent forward and its gradient backward, per micro-batch, in every
    replica: ``2 * m * D * sum(boundary bytes)``."""
    return 2.0 * micro_batches * replicas * sum(boundaries)


def allreduce_bytes(tensor_bytes: float, ranks: int) -> float:
    """All ranks' sends of a ring all-reduce of ``tensor_bytes``: each sends 2(n-1)/n of it
    (reduce-scatter, then all-gather)."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) * tensor_bytes


def allgather_bytes(tensor_bytes: float, ranks: int) -> float:
    """All ranks' sends of an all-gather of ``tensor_bytes`` from ``ranks`` equal shards:
    ZeRO-1's parameters after the step, half an all-reduce's bytes (docs/API.md)."""
    return (ranks - 1) * tensor_bytes if ranks > 1 else 0.0


def powersgd_elements(shape: Sequence[int], rank: int, min_rate: float = 2.0) -> int:
    """Elements torch's PowerSGD hook all-reduces for a gradient of ``shape``: two rank-r
    factors of the matrix ``shape[0] x rest`` where that sends ``min_rate`` times fewer
    (torch's ``_should_compress``), else the tensor whole."""
    total = math.prod(shape)
    if len(shape) < 2:
        return total
    n, m = shape[0], total // shape[0]
    r = min(n, m, rank)
    return (n + m) * r if n * m >= min_rate * (n + m) * r else total


def sync_bytes(stage_shapes: Sequence[Sequence[Sequence[int]]], replicas: int,
               sync: str = "exact", sharded: bool = False) -> float | None:
    """Replica agreement per step, all stages, from each stage's parameter shapes:
    ``exact`` all-reduces fp32 gradients; ``bf16`` half of that; ``powersgd:R`` all-reduces
    P (n x R) and Q (m x R) per matrix and vectors whole (after its first exact steps);
    ``diloco:H`` all-reduces fp32 parameter deltas once every H steps. ``sharded`` (ZeRO-1):
    the parameters' all-gather after the step too. None for a setting the formula does not
    know (``auto``: the plan decides)."""
    name, _, arg = sync.partition(":")
    total = 0.0
    for shapes in stage_shapes:
        full = sum(4.0 * math.prod(s) for s in shapes)
        if name == "exact":
            payload = full
        elif name == "bf16":
            payload = full / 2
        elif name == "powersgd":
            payload = sum(4.0 * powersgd_elements(s, int(arg or 4)) for s in shapes)
        elif name == "diloco":
            payload = full / int(arg or 50)
        else:
            return None
        total += allreduce_bytes(payload, replicas)
        if sharded and name != "diloco":
            total += allgather_bytes(full, replicas)
    return total


# -- statistics ---------------------------------------------------------------------------------


def step_times(ends: Sequence[Sequence[float]], start: float) -> list[float]:
    """Per step, the time between the last rank finishing the previous step and the last rank
    finishing this one (``ends[rank][step]``, one monotonic clock; ``start`` the common start)."""
    last = [max(column) for column in zip(*ends)]
    return [b - a for a, b in zip([start, *last], last)]


def spread(times: Sequence[float]) -> tuple[float, float]:
    """(median, (p90 - p10) / median) of step times."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    if len(ordered) < 3:
        return median, (ordered[-1] - ordered[0]) / median
    deciles = statistics.quantiles(ordered, n=10, method="inclusive")
    return median, (deciles[-1] - deciles[0]) / median


def smoothed(losses: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` losses at every step (fewer at the start)."""
    out, acc = [], 0.0
    for i, loss in enumerate(losses):
        acc += loss
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def final_loss(losses: Sequence[float], window: int) -> float:
    return smoothed(losses, window)[-1]


def time_to_loss(times: Sequence[float], losses: Sequence[float], target: float,
                 window: int) -> float | None:
    """Wall time at which the ``window``-step mean loss first reaches ``target``; None if never."""
    for t, loss in zip(times, smoothed(losses, window)):
        if loss <= target:
            return t
    return None


# -- runs on disk -------------------------------------------------------------------------------


def read_run(path: Path) -> dict[str, Any]:
    """A run's JSONL: the first line its header (system, setting, layout, link, bytes, RSS...),
    then one line per step (``step``, ``loss``, ``t``: seconds since the common start)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or "system" not in lines[0]:
        raise ValueError(f"{path}: not a bench_slow_links run (no header line)")
    head, steps = lines[0], lines[1:]
    return {**head, "steps": steps}


def write_run(path: Path, head: dict[str, Any], rows: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in (head, *rows)))
