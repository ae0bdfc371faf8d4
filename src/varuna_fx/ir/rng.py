"""Random numbers keyed per sample: (step seed, random op, sample index in the global batch).

A step's random ops are the aten ops tagged ``nondeterministic_seeded`` that draw: dropout &
co, but not a call that draws nothing (:func:`draws`: an attention or dropout with p = 0, a
dropout or rrelu outside training), which runs batched and unmarked like any op. They are
numbered in the order the model's forward runs them: ``k`` = how many random ops ran before
this one in the whole forward (the captured graph's order; ``annotate_shapes`` counts them per
node). Each draw is then keyed, not taken from a running generator:

* **per sample** when the op's leading dimension is the batch: the op's first tensor argument
  (or, for a factory such as ``torch.rand(size)``, ``size[0]``) has the batch as dimension 0.
  Row ``j`` is drawn by the op itself on row ``j`` alone, from the default generator of the op's
  device seeded with ``mix(seed, k, g)``, where ``g`` is the row's index in the *global* batch
  (data-parallel replica ``r`` starts at ``r x`` its batch). So the micro-batch size, the stage
  count P, the replicas D and the schedule never change a value, and a recompute replays it.
* **shared** otherwise (a random tensor without a batch dimension, rare): one draw keyed by
  ``mix(seed, k)``, so every micro-batch and replica of the step sees the same values, as the
  one eager forward on the whole batch does.

A row's numbers are drawn in the logical order of its elements (the op runs on contiguous
rows), so a tensor's layout never changes its mask. Drawing is row by row (one generator seed
per row); applying is batched: dropout's mask (``bernoulli_`` rows of one noise tensor,
:func:`keyed_noise`) multiplies the whole micro-batch at once, and an attention with dropout
(whose fused kernels cannot be keyed) runs torch's math path on the whole micro-batch with such
a mask (``ir/attention_math.py``; a torch-function mode, :class:`_KeyedAttention`, catches
``F.scaled_dot_product_attention`` inside a random node). Other random ops (``randn_like``,
factories, ``rrelu``) run once per row, their results joined.

An op's ``generator=`` argument is replaced by the keyed default generator. Stage code calls a
plain dropout (``nn.Dropout``, ``F.dropout``, ``aten.dropout``) and an attention with dropout
through ``ir/keyed_calls.py``, which draws the very numbers the modes would without entering
them (a Python mode costs its entry per node call and a Python call on every op it sees:
bench/RESULTS.md, "Keyed dropout without the dispatch mode"). Stage code marks its other random
nodes with ``random_begin(k, per_sample)`` / ``random_end()`` (``split_stages``);
``per_sample`` says, per random op of the node, whether compile saw its leading dimension scale
with the batch. They do something only inside ``rng_context`` (a worker's forward or
recompute); a stage module called by hand draws from the global generators like any module.

The eager reference is :func:`per_sample_rng`: the user's own model, run on the whole batch
inside it, draws exactly the pipeline's numbers (its rule for "the leading dimension is the
batch" is ``== batch_size``). The global RNG state is restored on exit in both cases; the step
seed is one draw from the global generator (``next_step_seed``), as each ``pipe.step`` makes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import VarunaFxError
from .attention_math import math_sdpa

_MASK = 2**64 - 1
_SHARED = -1  # the "sample index" of a draw without a batch dimension
_context = threading.local()


def next_step_seed() -> int:
    """One draw from the global generator: the seed of one step's random ops."""
    return int(torch.randint(0, 2**62, ()))


def mix(*words: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = _round(h, w)
    return h & (2**63 - 1)


def _round(h: int, w: int) -> int:
    h = (h ^ (w & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 29)


def row_seeds(seed: int, op: int, first_sample: int, rows: int) -> list[int]:
    """``[mix(seed, op, first_sample + j) for j < rows]``, the shared prefix mixed once."""
    h = _round(_round(0x9E3779B97F4A7C15, seed), op)
    return [_round(h, first_sample + j) & (2**63 - 1) for j in range(rows)]


def is_random_op(func: Any) -> bool:
    """Whether ``func`` may draw (torch's tag); :func:`draws` says whether a call does."""
    return torch.Tag.nondeterministic_seeded in func.tags


# arguments whose value makes a seeded op draw nothing: attention's and dropout's probability
# (0: nothing dropped), and a training flag (False: rrelu's fixed slope, dropout's identity)
_NO_DRAW = {"dropout_p": 0, "train": False, "training": False}


@functools.lru_cache(maxsize=256)
def _no_draw_arguments(func: Any) -> tuple[tuple[int, str, Any, Any], ...]:
    """(position, name, the value that means "no draw", the default) of ``func``'s arguments
    that say so; ``p`` only for ``native_dropout`` (``_fused_dropout``'s is the keep
    probability)."""
    found = []
    for k, arg in enumerate(func._schema.arguments):
        none = _NO_DRAW.get(arg.name)
        if arg.name == "p" and func._schema.name == "aten::native_dropout":
            none = 0
        if none is not None:
            found.append((k, arg.name, none, arg.default_value))
    return tuple(found)


def draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws random numbers: a seeded op, unless an argument says
    it draws nothing (an attention at dropout_p = 0 carries the tag but is deterministic)."""
    if not is_random_op(func):
        return False
    for at, name, none, default in _no_draw_arguments(func):
        value = args[at] if at < len(args) else kwargs.get(name, default)
        if value is not None and not isinstance(value, torch.Tensor) and value == none:
            return False
    return True


@functools.lru_cache(maxsize=256)
def _size_position(func: Any) -> int | None:
    """Where a factory's ``size`` argument is (``randint(low, high, size)``: 2), if it has one."""
    for k, arg in enumerate(func._schema.arguments):
        if arg.name == "size" and not arg.kwarg_only:
            return k
    return None


def _size(func: Any, args: tuple, kwargs: dict) -> Any:
    at = _size_position(func)
    if at is not None and at < len(args):
        return args[at]
    return kwargs.get("size")


def leading_dim(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Dimension 0 of what a random op draws for: its first tensor argument's, else a
    factory's ``size[0]`` (wherever its schema puts ``size``); None for a 0-d tensor or no
    size (``randperm(n)``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return int(a.shape[0]) if a.dim() else None
    size = _size(func, args, kwargs)
    if isinstance(size, (list, tuple)) and size and isinstance(size[0], int):
        return int(size[0])
    return None


@dataclass(frozen=True)
class RandomKey:
    """One step's key, as a replica sees it."""

    seed: int
    first_sample: int  # the global index of this replica's first sample
    micro_batch_size: int


@dataclass
class _Key:
    seed: int
    first_sample: int  # global index of row 0 of what runs now
    batch: int  # rows of what runs now (the micro-batch size, or the eager batch)
    next_op: int = 0  # k of the next random op
    per_sample: tuple[bool, ...] | None = None  # the current node's ops (None: by shape)
    node_end: int | None = None  # k after the current node's last op (pipeline only)
    active: bool = False  # inside a node (pipeline) or everywhere (eager)


def _claim(key: _Key, what: Any, lead: int | None) -> tuple[int, bool]:
    """The next random op's number and whether it draws per sample (by shape in eager, as
    compile saw it in a pipeline's node)."""
    k = key.next_op
    key.next_op += 1
    if key.per_sample is None:  # eager: by shape
        return k, lead == key.batch
    if k >= key.node_end:
        raise VarunaFxError(
            f"a random node ran more random ops ({what}) than when it was compiled "
            f"({len(key.per_sample)}); its randomness must not depend on the data: "
            "make the number of random calls fixed, or compile again")
    return k, key.per_sample[k - key.node_end + len(key.per_sample)] and lead == key.batch


def draw_seeds(key: _Key, k: int, per_sample: bool) -> list[int]:
    """The generator seeds of op ``k``'s draws: one per row, or the one shared draw."""
    if per_sample:
        return row_seeds(key.seed, k, key.first_sample, key.batch)
    return [mix(key.seed, k, _SHARED)]


class _KeyedDraws(TorchDispatchMode):
    """Replaces each random op by its keyed draws (see the module docstring)."""

    def __init__(self, key: _Key) -> None:
        super().__init__()
        self.key = key

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable by default, which
        # imports torch._dynamo (a second or more) on a restarted job's first random op
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        key = self.key
        if not key.active or not draws(func, args, kwargs):
            return func(*args, **kwargs)
        k, per_sample = _claim(key, func, leading_dim(func, args, kwargs))
        if "generator" in kwargs:
            kwargs = {**kwargs, "generator": None}
        seeds = draw_seeds(key, k, per_sample)
        if func is torch.ops.aten.native_dropout.default:  # eager's fused dropout (CUDA)
            noise = keyed_noise(args[0], float(args[1]), seeds)
            return args[0] * noise, noise != 0
        if not per_sample:
            _seed_device(args, kwargs, seeds[0])
            return _contiguous_call(func, args, kwargs)
        return _per_row(func, args, kwargs, key.batch, seeds)


class _KeyedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` with dropout, keyed: torch's math path on the whole
    batch with a keyed mask (a fused kernel's own mask cannot be keyed per sample), as the
    stage code's ``keyed_sdpa`` runs it. One random op, as compile counted it."""

    def __init__(self, key: _Key) -> None:
        super().__init__()
        self.key = key

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func not in _ATTENTION or not self.key.active:
            return func(*args, **kwargs)
        call = attention_arguments(*args, **kwargs)
        if call.dropout_p == 0:
            return func(*args, **kwargs)
        key = self.key
        k, per_sample = _claim(key, func, call.batch)
        seeds = draw_seeds(key, k, per_sample)
        key.active = False  # the math path's ops are no random ops of their own
        try:
            return call.run(seeds)
        finally:
            key.active = True


_ATTENTION = (torch.nn.functional.scaled_dot_product_attention,
              torch.ops.aten.scaled_dot_product_attention.default)


@dataclass
class AttentionCall:
    """The arguments of one ``scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    @property
    def batch(self) -> int | None:
        """Dimension 0 of what the mask is drawn for (the probabilities ``(..., L, S)``:
        the query's dimension 0, as the dispatch mode sees the math path's draw)."""
        return int(self.query.shape[0]) if self.query.dim() else None

    def run(self, seeds: list[int]) -> torch.Tensor:
        """The math path, its dropout mask drawn from ``seeds`` (one per row, or one)."""
        p = self.dropout_p
        return math_sdpa(self.query, self.key, self.value, self.attn_mask, self.is_causal,
                         self.scale, self.enable_gqa, lambda a: a * keyed_noise(a, p, seeds))


def attention_arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False) -> AttentionCall:
    """``F.scaled_dot_product_attention``'s signature (aten's takes the same names)."""
    return AttentionCall(query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale,
                         bool(enable_gqa))


def keyed_noise(x: torch.Tensor, p: float, seeds: list[int]) -> torch.Tensor:
    """Eager's dropout noise for ``x`` (aten's ``_dropout_impl``: ``bernoulli_(1 - p)``, then
    ``/ (1 - p)``), row ``j`` drawn from the generator seeded ``seeds[j]`` (one seed: the whole
    tensor at once). Contiguous whatever ``x``'s layout, so a mask never depends on it; the
    caller applies it to the whole batch in one multiplication."""
    noise = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    seed_generator, keep = _generator(x.device).manual_seed, 1 - p
    for value, row in zip(seeds, noise.unbind(0) if len(seeds) > 1 else (noise,)):
        seed_generator(value)
        row.bernoulli_(keep)
    return noise.div_(keep)


def _generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (what ``_seed_device`` seeds)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def _device(args: tuple, kwargs: dict) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device(kwargs.get("device") or "cpu")


def _seed_device(args: tuple, kwargs: dict, value: int) -> None:
    # not torch.manual_seed: it also seeds every lazy device backend, a cost per call
    # (bench/RESULTS.md, "Figures the code cites")
    _generator(_device(args, kwargs)).manual_seed(value)


def _row(value: Any, batch: int, j: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[j:j + 1]
    return value


@functools.lru_cache(maxsize=256)
def _returns_written(func: Any) -> bool:
    """Whether the op returns the argument it writes (``bernoulli_``: its rows are written in
    place); ``rrelu_with_noise`` writes its noise argument but returns a new tensor."""
    return any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)


@functools.lru_cache(maxsize=256)
def _written(func: Any) -> frozenset[str]:
    """The names of the arguments ``func`` writes into (``self`` of ``bernoulli_``)."""
    return frozenset(a.name for a in func._schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write)


def _contiguous_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on contiguous copies of its non-contiguous tensor arguments (random numbers
    are drawn in memory order: so they fill the elements in their logical order whatever the
    layout), a written argument's copy written back."""
    schema = func._schema.arguments
    names = [a.name for a in schema]
    back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def dense(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.is_contiguous():
            return value
        copy = value.contiguous()
        if name in _written(func):
            back.append((value, copy))
        return copy

    args = tuple(dense(names[i] if i < len(names) else "", a) for i, a in enumerate(args))
    kwargs = {n: dense(n, a) for n, a in kwargs.items()}
    out = func(*args, **kwargs)
    for original, copy in back:
        original.copy_(copy)
    if back and _returns_written(func):
        return back[0][0] if out is back[0][1] else out
    return out


def _per_row(func: Any, args: tuple, kwargs: dict, batch: int, seeds: list[int]) -> Any:
    """``func`` once per row ``j`` (tensor arguments cut to that row, a factory's size to 1
    row), each from the generator seeded ``seeds[j]``; results joined along dimension 0."""
    mutable = _returns_written(func)
    factory = not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
    at = _size_position(func)
    rows = []
    for j, value in enumerate(seeds):
        if factory:  # one row of the size (a per-sample factory has the batch as size[0])
            row_args, row_kwargs = args, kwargs
            if at is not None and at < len(args):
                row_args = (*args[:at], [1, *args[at][1:]], *args[at + 1:])
            else:
                row_kwargs = {**kwargs, "size": [1, *kwargs["size"][1:]]}
        else:
            row_args = tuple(_row(a, batch, j) for a in args)
            row_kwargs = {n: _row(a, batch, j) for n, a in kwargs.items()}
        _seed_device(row_args, row_kwargs, value)
        rows.append(_contiguous_call(func, row_args, row_kwargs))
    if mutable:  # written into the rows of its (aliased) argument: return what it returns
        return args[0]
    if len(rows) == 1:
        return rows[0]
    if isinstance(rows[0], torch.Tensor):
        return torch.cat(rows)
    return tuple(torch.cat([r[i] for r in rows]) for i in range(len(rows[0])))


def _forked() -> Any:
    cuda = torch.cuda.is_available()
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [])


def current_key() -> _Key | None:
    """The key of what a worker runs now (None outside ``rng_context``)."""
    return getattr(_context, "key", None)


@contextmanager
def rng_context(step: RandomKey, mb: int) -> Iterator[None]:
    """A worker's forward or recompute of micro-batch ``mb``: random nodes draw keyed; the
    global RNG state is restored."""
    b = step.micro_batch_size
    key = _Key(step.seed, step.first_sample + mb * b, b)
    # the modes are entered only around random nodes (random_begin/random_end): a Python
    # mode costs microseconds on every op it sees
    with _forked():
        _context.key = key
        _context.modes = (_KeyedDraws(key), _KeyedAttention(key))
        try:
            yield
        finally:
            if key.active:  # a node raised between begin and end
                random_end()
            _context.key = None


@contextmanager
def per_sample_rng(batch_size: int, *, seed: int | None = None,
                   first_sample: int = 0) -> Iterator[int]:
    """The eager reference of a pipeline's random ops: the model's forward on a batch of
    ``batch_size`` samples inside it draws what ``pipe.step`` draws on the same batch.

    ``seed`` None takes one draw from the global generator, as a step does, so
    ``torch.manual_seed(s); pipe.step(x, target=y)`` and ``torch.manual_seed(s)`` then this
    context around ``loss_fn(model(x), y)`` use the same numbers. ``first_sample``: the batch's
    first index in the global batch (data-parallel replica ``r`` of a batch of ``n`` per
    replica: ``r * n``). Yields the seed; the global RNG state is restored on exit (after the
    seed's draw). Run only the forward inside it (the k-th random op is keyed by ``k``).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise VarunaFxError(f"per_sample_rng: batch_size must be a positive int, got "
                            f"{batch_size!r} (the number of samples the forward runs on)")
    seed = next_step_seed() if seed is None else int(seed)
    key = _Key(seed, int(first_sample), batch_size, active=True)
    with _forked(), _KeyedDraws(key), _KeyedAttention(key):
        yield seed


def forked_rng() -> Any:
    """The global generators' state, restored on exit (as a step's random ops leave it)."""
    return _forked()


@contextmanager
def node_draws(seed: int, first_sample: int, batch: int, first_op: int,
               per_sample: tuple[bool, ...]) -> Iterator[None]:
    """One random node's ops drawn as a stage draws them for a micro-batch of ``batch`` rows
    starting at global sample ``first_sample`` (what ``random_begin``/``random_end`` do inside
    a worker; compile's sample-mixing probe runs nodes one by one with it)."""
    key = _Key(seed, first_sample, batch, next_op=first_op, per_sample=per_sample,
               node_end=first_op + len(per_sample), active=True)
    with _KeyedDraws(key), _KeyedAttention(key):
        yield


@torch.fx.wrap
def random_begin(first_op: int, per_sample: tuple[bool, ...]) -> None:
    """Before a random node: its ops are numbered from ``first_op``; ``per_sample[i]`` says
    whether op ``i`` draws per sample (its leading dimension is the batch)."""
    key = current_key()
    if key is None:
        return
    key.next_op = first_op
    key.per_sample = per_sample
    key.node_end = first_op + len(per_sample)
    key.active = True
    for mode in _context.modes:
        mode.__enter__()


@torch.fx.wrap
def random_end() -> None:
    """After a random node: ops draw from the (forked) global generator again."""
    key = current_key()
    if key is not None and key.active:
        key.active = False
        for mode in reversed(_context.modes):
            mode.__exit__(None, None, None)
