"""Random numbers keyed per sample: (step seed, random op, sample index in the global batch).

A step's random ops (dropout & co: every aten op tagged ``nondeterministic_seeded``) are
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

An op's ``generator=`` argument is replaced by the keyed default generator. Stage code calls a
plain dropout (``nn.Dropout``, ``F.dropout``, ``aten.dropout``) through :func:`keyed_dropout`,
which draws the very numbers the dispatch mode would (the same kernels on the same rows, from
the same seeds) without entering it: a Python dispatch mode costs ~100 us per node call and
microseconds on every op it sees, most of keyed dropout's former cost. Stage code marks its
other random nodes with ``random_begin(k, per_sample)`` / ``random_end()`` (``split_stages``);
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
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import VarunaFxError

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
    return torch.Tag.nondeterministic_seeded in func.tags


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
        if not key.active or not is_random_op(func):
            return func(*args, **kwargs)
        k = key.next_op
        key.next_op += 1
        lead = leading_dim(func, args, kwargs)
        if key.per_sample is None:  # eager: by shape
            per_sample = lead == key.batch
        else:
            if k >= key.node_end:
                raise VarunaFxError(
                    f"a random node ran more random ops ({func}) than when it was compiled "
                    f"({len(key.per_sample)}); its randomness must not depend on the data: "
                    "make the number of random calls fixed, or compile again")
            per_sample = key.per_sample[k - key.node_end + len(key.per_sample)] \
                and lead == key.batch
        if "generator" in kwargs:
            kwargs = {**kwargs, "generator": None}
        if not per_sample:
            _seed_device(args, kwargs, mix(key.seed, k, _SHARED))
            return func(*args, **kwargs)
        return _per_row(func, args, kwargs, key.batch,
                        row_seeds(key.seed, k, key.first_sample, key.batch))


def _device(args: tuple, kwargs: dict) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device(kwargs.get("device") or "cpu")


def _seed_device(args: tuple, kwargs: dict, value: int) -> None:
    device = _device(args, kwargs)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)
    else:
        # not torch.manual_seed: it also seeds every lazy device backend, a cost per call
        # (bench/RESULTS.md, "Figures the code cites")
        torch.default_generator.manual_seed(value)


def _row(value: Any, batch: int, j: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[j:j + 1]
    return value


@functools.lru_cache(maxsize=256)
def _returns_written(func: Any) -> bool:
    """Whether the op returns the argument it writes (``bernoulli_``: its rows are written in
    place); ``rrelu_with_noise`` writes its noise argument but returns a new tensor."""
    return any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)


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
        rows.append(func(*row_args, **row_kwargs))
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


@contextmanager
def rng_context(step: RandomKey, mb: int) -> Iterator[None]:
    """A worker's forward or recompute of micro-batch ``mb``: random nodes draw keyed; the
    global RNG state is restored."""
    b = step.micro_batch_size
    key = _Key(step.seed, step.first_sample + mb * b, b)
    # the mode is entered only around random nodes (random_begin/random_end): a Python
    # dispatch mode costs microseconds on every op it sees
    with _forked():
        _context.key = key
        _context.mode = _KeyedDraws(key)
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
    with _forked(), _KeyedDraws(key):
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
    with _KeyedDraws(key):
        yield


# -- dropout without the dispatch mode ---------------------------------------------------------

# where eager's dropout runs one fused kernel (aten's is_fused_kernel_acceptable)
_FUSED_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def plain_dropout(root: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether ``node`` is one dropout call :func:`keyed_dropout` can run directly."""
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))) is torch.nn.Dropout
    return node.op == "call_function" and direct_dropout(node.target) is not None


def direct_dropout(target: Any) -> Any:
    """The keyed function to call instead of the dropout function ``target`` (or None)."""
    if target is torch.nn.functional.dropout:
        return keyed_functional_dropout
    if target is torch.dropout or target is torch.ops.aten.dropout.default:
        return keyed_aten_dropout
    return None


@torch.fx.wrap
def keyed_module_dropout(first_op: int, per_sample: tuple[bool, ...], module: torch.nn.Module,
                         x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Dropout``, keyed: its settings as they are now."""
    return keyed_dropout(first_op, per_sample, x, module.p, module.training, module.inplace)


@torch.fx.wrap
def keyed_functional_dropout(first_op: int, per_sample: tuple[bool, ...], input: torch.Tensor,
                             p: float = 0.5, training: bool = True,
                             inplace: bool = False) -> torch.Tensor:
    """``F.dropout(input, p, training, inplace)``, keyed."""
    return keyed_dropout(first_op, per_sample, input, p, training, inplace)


@torch.fx.wrap
def keyed_aten_dropout(first_op: int, per_sample: tuple[bool, ...], input: torch.Tensor,
                       p: float, train: bool) -> torch.Tensor:
    """``torch.dropout(input, p, train)`` (``aten.dropout``, what torch.export records), keyed."""
    return keyed_dropout(first_op, per_sample, input, p, train)


def keyed_dropout(first_op: int, per_sample: tuple[bool, ...], x: torch.Tensor, p: float,
                  training: bool, inplace: bool = False) -> torch.Tensor:
    """Eager's dropout (aten's ``_dropout_impl``, or its fused kernel where eager uses it),
    each row's mask drawn as the dispatch mode draws it: op ``first_op``, per sample when
    compile said so and ``x``'s dim 0 is the micro-batch. Outside a worker (no key), or where
    eager draws nothing (p of 0 or 1, eval, an empty tensor): plain ``F.dropout``."""
    key = getattr(_context, "key", None)
    if key is None or not training or p == 0 or p == 1 or x.numel() == 0:
        return torch.nn.functional.dropout(x, p, training, inplace)
    per_row = bool(per_sample and per_sample[0] and x.dim() and x.shape[0] == key.batch)
    seeds = row_seeds(key.seed, first_op, key.first_sample, key.batch) if per_row else \
        [mix(key.seed, first_op, _SHARED)]
    generator = _generator(x.device)
    if not inplace and x.device.type in _FUSED_DEVICES:  # one fused kernel per row
        parts = []
        for value, row in zip(seeds, x.split(1) if per_row else (x,)):
            generator.manual_seed(value)
            parts.append(torch.ops.aten.native_dropout.default(row, p, True)[0])
        return torch.cat(parts) if per_row else parts[0]
    noise = torch.empty_like(x)
    for value, row in zip(seeds, noise.split(1) if per_row else (noise,)):
        generator.manual_seed(value)
        row.bernoulli_(1 - p)
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


def _generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (what ``_seed_device`` seeds)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


@torch.fx.wrap
def random_begin(first_op: int, per_sample: tuple[bool, ...]) -> None:
    """Before a random node: its ops are numbered from ``first_op``; ``per_sample[i]`` says
    whether op ``i`` draws per sample (its leading dimension is the batch)."""
    key = getattr(_context, "key", None)
    if key is None:
        return
    key.next_op = first_op
    key.per_sample = per_sample
    key.node_end = first_op + len(per_sample)
    key.active = True
    _context.mode.__enter__()


@torch.fx.wrap
def random_end() -> None:
    """After a random node: ops draw from the (forked) global generator again."""
    key = getattr(_context, "key", None)
    if key is not None and key.active:
        key.active = False
        _context.mode.__exit__(None, None, None)
