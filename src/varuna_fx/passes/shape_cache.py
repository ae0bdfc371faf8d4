"""An on-disk cache of what ``annotate_shapes`` observes, for a process that compiles again.

A job restarted after a preemption compiles the same model on the same example shapes; the two
fake-tensor runs of ``annotate_shapes`` are most of that compile, much of it importing
``torch._dynamo``, which ``FakeTensorMode`` needs (bench/RESULTS.md, "Figures the code cites"). The cache keeps the raw
observations of both runs per node (shapes, dtypes, bytes, FLOP counts, randomness), so the
annotations are still derived by ``annotate_shapes``' own code from them.

The key is a hash of everything the observations depend on, taken from the freshly captured
graph: its code (constants and attribute values baked in); for every called module its class,
``repr`` and plain settings (``p`` of Dropout, ``batch_first``, ``training``...); every
parameter, buffer and tensor constant's name, shape, dtype, device and ``requires_grad``; the
example inputs' names, shapes, dtypes and devices; torch's default dtype; the torch, Python and
varuna_fx versions and the source of ``annotate_shapes.py``, of ``ir/rng.py`` (which ops draw)
and of this file. Nothing about the layout (P, D, micro-batches) is in it: a job that re-plans for another world hits.

Graphs whose behaviour the key cannot see are not cached: a called module that is not a
``torch.nn`` built-in, has forward hooks (or global ones exist) or holds a function that is
not torch's (a user's ``activation=``), a called function that is not
torch's, Python's ``operator``/``math``/builtins (e.g. an ``fx.wrap``-ed user function), a
``get_attr`` of anything but a tensor (export's higher-order-op subgraphs).

Files: ``$VARUNA_FX_CACHE_DIR/graphs/<key>.json`` (default ``~/.cache/varuna_fx/graphs``),
JSON (loading never runs code), written to a temporary name and renamed, at most
:data:`MAX_ENTRIES` kept (the oldest go). An unreadable, corrupt or mismatching file is
ignored and rewritten, never an error. ``VARUNA_FX_GRAPH_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture.capture_cache import enabled
from ..capture.inputs import BoundInputs
from ..world.files import read_entry, write_entry

FORMAT = 3  # 2: sealed with a digest of the content (world/files.sealed); 3: draw shapes
MAX_ENTRIES = 64
# what happened in this process (tests and benchmarks read it): hit, miss, write, uncacheable,
# ignored (a file that could not be used)
stats: Counter[str] = Counter()

_FUNCTION_MODULES = ("torch", "_operator", "operator", "math", "builtins")
# what decides the observations: the fake runs, and which ops draw (ir/rng.draws)
_SOURCES = (Path(__file__).with_name("annotate_shapes.py"), Path(__file__),
            Path(__file__).parent.parent / "ir" / "rng.py")


def graph_key(gm: fx.GraphModule, bound: BoundInputs) -> str | None:
    """The cache key of ``gm`` on ``bound``'s inputs, or None when it must not be cached."""
    if not enabled() or _global_hooks():
        stats["uncacheable"] += 1
        return None
    called = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if not _builtin_module(module):
                stats["uncacheable"] += 1
                return None
            called.append((str(node.target), _qualname(type(module)), repr(module),
                           _settings(module)))
        elif node.op == "call_function" and not _torch_function(node.target):
            stats["uncacheable"] += 1
            return None
        elif node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if not isinstance(value, torch.Tensor):
                stats["uncacheable"] += 1
                return None
            called.append((str(node.target), _tensor(value)))
    state = [(n, _tensor(t)) for n, t in [*gm.named_parameters(remove_duplicate=False),
                                          *gm.named_buffers(remove_duplicate=False)]]
    inputs = [(n, _tensor(t)) for n, t in bound.tensors.items()]
    text = repr((FORMAT, gm.code, called, state, inputs, sorted(map(repr, bound.constants.items())),
                 str(torch.get_default_dtype()), torch.__version__, sys.version_info[:2],
                 _package_version(), [_source_hash(p) for p in _SOURCES]))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def load(key: str, names: list[str]) -> list[Any] | None:
    """The observations stored under ``key`` for a graph whose nodes are ``names``, or None."""
    try:
        entry = read_entry("graphs", key, FORMAT)
        if entry is None:
            stats["miss"] += 1
            return None
        if entry["nodes"] != names or len(entry["observed"]) != len(names):
            raise ValueError("another graph")
        stats["hit"] += 1
        return list(entry["observed"])
    except (ValueError, KeyError, TypeError):
        stats["ignored"] += 1
        stats["miss"] += 1
        return None


def store(key: str, names: list[str], observed: list[Any]) -> None:
    """Write an entry atomically (a reader sees the old file or the whole new one); keep the
    newest :data:`MAX_ENTRIES`. A cache that cannot be written is skipped silently: it only
    saves time."""
    if write_entry("graphs", key, FORMAT, {"nodes": names, "observed": observed}, MAX_ENTRIES):
        stats["write"] += 1


# -- what the key is made of ---------------------------------------------------------------------


def _builtin_module(module: nn.Module) -> bool:
    """A torch.nn module running torch's own code: its class, repr and settings describe it
    (a function it holds, such as a TransformerEncoderLayer's ``activation``, must be torch's:
    a user's function's body is in no key)."""
    cls = type(module)
    return (cls.__module__.startswith(("torch.nn.", "torch.ao.nn."))
            and "forward" not in vars(module)
            and not (module._forward_hooks or module._forward_pre_hooks)
            and all(_torch_function(v) for v in _functions(module).values()))


def _functions(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items()
            if callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type))}


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _torch_function(target: Any) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in _FUNCTION_MODULES


def _settings(module: nn.Module) -> list[tuple[str, str]]:
    plain = (bool, int, float, str, type(None), tuple)
    functions = [(k, f"{v.__module__}.{getattr(v, '__qualname__', '')}")
                 for k, v in _functions(module).items()]
    return sorted([*functions, *((k, repr(v)) for k, v in vars(module).items()
                                 if isinstance(v, plain))])


def _tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype), str(t.device), bool(t.requires_grad),
            isinstance(t, nn.Parameter))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _package_version() -> str:
    # read, not imported: the package root sits above this layer (and is loaded by now)
    return str(getattr(sys.modules.get("varuna_fx"), "__version__", ""))


_source_hashes: dict[Path, str] = {}


def _source_hash(path: Path) -> str:
    if path not in _source_hashes:
        try:
            _source_hashes[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:  # no source (a zipped install): the package version must do
            _source_hashes[path] = ""
    return _source_hashes[path]
