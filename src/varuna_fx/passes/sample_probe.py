"""Sample mixing measured: the graph run on a few real samples at once and on each one alone.

``sample_mixing.py`` judges operations by kind (a mean, a batch x batch product, positions),
which misses whatever its lists do not name: ``cumsum``, ``sort`` or ``flip`` over the batch,
``layer_norm(h.t())``, ``h.reshape(-1).softmax(0)``, ``h[torch.randperm(b)]``... This pass asks
the graph itself. It runs the captured graph node by node, in lockstep, on the example's first
``PROBE_SAMPLES`` samples together and on each of them alone (a micro-batch of one), with the
random ops keyed per sample as the stages key them (``ir/rng.node_draws``), and compares every
node's value: where a node's output has the batch in one dimension (``annotate_shapes``), the
whole run's slice of sample ``i`` along it (``c`` rows per sample, sample-major, or sample-minor
after a transpose and flatten) must equal sample ``i``'s own run; elsewhere the values must be
equal. A node that differs while each of its inputs agreed (or does not depend on the batch's
data: ``torch.arange(b)``, ``torch.randperm(b)``) is where samples mix: its value for one sample
depends on others', or lands in another sample's place. Values agree within a tolerance of the
dtype (kernels may sum in another order at another batch size); shapes that depend on the data
(a mixture of experts' routed tokens) are not judged, their consumers are.

Statistics over the batch that end in a reduction (no batch dimension left) stay the rules':
whether a mean reaches the loss linearly is not a question of values. The probe runs only on a
model with real, initialised weights (not meta: ``vf.deferred_init``, planning only; not left
unset by ``vf.skip_init``) whose probe costs at most ``BUDGET_SECONDS`` by a rough rate, and
restores every buffer and the global RNG state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..capture.buffers import buffers_kept
from ..capture.inputs import BoundInputs
from ..init.skip import any_marked, unloaded
from ..ir.nodes import b, info
from ..ir.rng import forked_rng, node_draws

PROBE_SAMPLES = 3  # the whole run's samples (a permutation of 3 is the identity 1 in 6 times)
BUDGET_SECONDS = 1.0
_RATE = {"cpu": 2e10, "cuda": 2e12}  # FLOP/s assumed for the budget (pessimistic)
_SEED = 0x5A3F  # the probe's random ops: any fixed key

REASON = ("makes one sample's values from other samples' (or moves them to another sample's "
          "place)")

# a node's value against the samples' own: equal slice by slice; the same rows in another
# order (a mixture of experts sorts tokens by expert, then scatters them back); different; or
# not judged (a shape the data decides, a batch x batch value)
MATCH, PERMUTED, MISMATCH, UNKNOWN = "match", "permuted", "mismatch", "unknown"


def probe_sample_mixing(gm: fx.GraphModule, bound: BoundInputs,
                        found: set[str]) -> list[fx.Node]:
    """The nodes where samples start to mix (``found``: names the rules flagged already).

    A floating-point node whose value differs from the samples' own while none of its
    floating-point inputs did is one (integers and booleans are bookkeeping: positions, counts
    and masks that steer rows, judged by the values they steer); so is the first node of a
    chain of reordered values that reaches the graph's output still reordered."""
    samples = min(bound.batch_size, PROBE_SAMPLES)
    state = [*gm.parameters(), *gm.buffers()]
    if samples < 2 or any(t.is_meta or _is_fake(t) for t in [*state, *bound.tensors.values()]):
        return []
    named = [*gm.named_parameters(), *gm.named_buffers()]
    if any_marked() and unloaded(named):  # vf.skip_init: no values yet, only garbage
        return []
    device = next((t.device.type for t in state), "cpu")
    flops = sum(float(info(n).matmul_flops(1) + info(n).elementwise_flops(1))
                for n in gm.graph.nodes)
    if 2 * samples * flops > BUDGET_SECONDS * _RATE.get(device, _RATE["cpu"]):
        return []
    whole = {k: t[:samples] for k, t in bound.tensors.items()}
    runs = [_Run(gm, whole, 0, samples)] + \
        [_Run(gm, {k: t[i:i + 1] for k, t in whole.items()}, i, 1) for i in range(samples)]
    last_use = _last_uses(gm)
    status: dict[fx.Node, str] = {}
    data: dict[fx.Node, bool] = {}  # a tensor computed from the batch's values
    floats: dict[fx.Node, bool] = {}  # ... of floating point (others: bookkeeping)
    tainted: dict[fx.Node, bool] = {}  # at or after a finding
    reordered_from: dict[fx.Node, fx.Node] = {}  # a PERMUTED node -> where the reordering began
    mixing: list[fx.Node] = []
    with torch.no_grad(), buffers_kept(gm), forked_rng():
        for node in gm.graph.nodes:
            if node.op == "output":
                for out in node.all_input_nodes:  # reordered values the step returns
                    origin = reordered_from.get(out)
                    if origin is not None and not tainted[out] and origin not in mixing:
                        mixing.append(origin)
                break
            try:
                for run in runs:
                    run.step(node)
            except Exception:  # noqa: BLE001 - a graph that does not run per sample: not judged
                return mixing
            value = runs[0].env[node]
            inputs = node.all_input_nodes
            # (a size read from the batch, x.size(0), is no value of it: arange(b) is not data)
            # (nor is what torch.empty_like(h) holds)
            data[node] = _is_tensor(value) and not _uninitialised(node) and (
                node.op == "placeholder" and node.target in bound.tensors or
                any(data.get(i, False) for i in inputs))
            floats[node] = data[node] and _is_float(value)
            status[node] = _compare(node, value, [r.env[node] for r in runs[1:]])
            tainted[node] = node.name in found or any(tainted.get(i, False) for i in inputs)
            float_inputs = [i for i in inputs if floats.get(i, False)]
            if status[node] == PERMUTED and floats[node]:
                reordered_from[node] = next((reordered_from[i] for i in float_inputs
                                             if i in reordered_from), node)
            if status[node] == MISMATCH and floats[node] and _has_batch_dim(node) and \
                    not tainted[node] and all(status[i] != MISMATCH for i in float_inputs):
                # a reordering that met unreordered values here began the mixing
                origin = next((reordered_from[i] for i in float_inputs
                               if i in reordered_from), node)
                if origin not in mixing:
                    mixing.append(origin)
                tainted[node] = True
            for dead in last_use.get(node, ()):
                for run in runs:
                    run.env.pop(dead, None)
    return sorted(mixing, key=list(gm.graph.nodes).index)


def _uninitialised(node: fx.Node) -> bool:
    target = node.target
    name = target._overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) \
        else str(getattr(target, "__name__", target))
    return name.startswith(("empty", "new_empty"))


def _is_tensor(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))


def _is_float(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)
               for t in pytree.tree_leaves(value))


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or isinstance(t, torch._subclasses.FakeTensor)


class _Run(fx.Interpreter):
    """One of the lockstep runs: ``batch`` samples from global sample ``first``."""

    def __init__(self, gm: fx.GraphModule, inputs: dict[str, torch.Tensor], first: int,
                 batch: int) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.inputs, self.first, self.batch = inputs, first, batch
        self.next_op = 0  # the number of the next random op (as the stages count them)

    def step(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self.env[node] = self.inputs.get(str(node.target))
            return
        draws = info(node).random_draws
        if draws:
            with node_draws(_SEED, self.first, self.batch, self.next_op, draws):
                self.env[node] = self.run_node(node)
            self.next_op += len(draws)
        else:
            self.env[node] = self.run_node(node)


def _last_uses(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """node -> the values whose last reader it is (freed after it runs)."""
    last: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        for i in node.all_input_nodes:
            last[i] = node
    out: dict[fx.Node, list[fx.Node]] = {}
    for value, reader in last.items():
        out.setdefault(reader, []).append(value)
    return out


def _has_batch_dim(node: fx.Node) -> bool:
    return any(_batch_dims(t.shape) for t in info(node).outputs)


def _batch_dims(shape: tuple[Any, ...]) -> list[int]:
    return [d for d, size in enumerate(shape) if getattr(size, "has", None) and size.has(b)]


def _compare(node: fx.Node, whole: Any, singles: list[Any]) -> str:
    """Whether the whole run's value of ``node`` is each single run's, sample by sample."""
    leaves = [t for t in pytree.tree_leaves(whole) if isinstance(t, torch.Tensor)]
    per_sample = [[t for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)]
                  for s in singles]
    outputs = info(node).outputs
    if any(len(p) != len(leaves) for p in per_sample) or len(outputs) != len(leaves):
        return UNKNOWN
    found = [_compare_leaf(w, [p[k] for p in per_sample], _batch_dims(outputs[k].shape))
             for k, w in enumerate(leaves)]
    return next((s for s in (MISMATCH, PERMUTED, UNKNOWN) if s in found), MATCH)


def _compare_leaf(w: torch.Tensor, singles: list[torch.Tensor], dims: list[int]) -> str:
    if not dims:
        if any(s.shape != w.shape for s in singles):
            return UNKNOWN  # a shape the data decides
        return MATCH if all(_close(w, s) for s in singles) else MISMATCH
    if len(dims) > 1:
        return UNKNOWN  # a batch x batch value: the rules' (a product of samples)
    d, n = dims[0], len(singles)
    c = singles[0].shape[d] if singles[0].dim() > d else -1
    if any(s.dim() != w.dim() or s.shape[d] != c for s in singles) or w.shape[d] != n * c or \
            any(tuple(s.shape[:d]) + tuple(s.shape[d + 1:]) !=
                tuple(w.shape[:d]) + tuple(w.shape[d + 1:]) for s in singles):
        return UNKNOWN
    layouts: list[Callable[[int], torch.Tensor]] = [
        lambda i: w.narrow(d, i * c, c),  # sample-major: the batch outermost
        lambda i: w.index_select(d, torch.arange(i, n * c, n, device=w.device)),  # innermost
    ]
    for layout in layouts:
        if all(_close(layout(i), s) for i, s in enumerate(singles)):
            return MATCH
    return PERMUTED if _same_rows(w, torch.cat(singles, d), d) else MISMATCH


def _same_rows(w: torch.Tensor, s: torch.Tensor, d: int) -> bool:
    """Whether ``w`` holds ``s``'s slices along ``d`` in some order: each slice projected on
    one fixed random direction, the sorted projections equal."""
    if w.shape != s.shape or w.dtype != s.dtype or w.numel() == 0:
        return False
    rows_w = w.movedim(d, 0).reshape(w.shape[d], -1).to(torch.float64)
    rows_s = s.movedim(d, 0).reshape(s.shape[d], -1).to(torch.float64)
    g = torch.Generator(device=w.device).manual_seed(_SEED)
    direction = torch.rand(rows_w.shape[1], generator=g, dtype=torch.float64,
                           device=w.device) + 0.5
    pw, ps = (rows_w @ direction).sort().values, (rows_s @ direction).sort().values
    rtol = 2e-2 if w.element_size() <= 2 else 1e-3
    scale = float((rows_s.abs().nan_to_num(0.0, 0.0, 0.0) @ direction).max())
    return bool(torch.allclose(pw, ps, rtol=0.0, atol=rtol * max(scale, 1e-6),
                               equal_nan=True))


def _close(a: torch.Tensor, b_: torch.Tensor) -> bool:
    if a.shape != b_.shape:
        return False
    if a.dtype != b_.dtype:
        return False
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return bool(torch.equal(a, b_))
    rtol = 2e-2 if a.element_size() <= 2 else 1e-3
    finite = b_.abs().nan_to_num(0.0, 0.0, 0.0)
    scale = float(finite.max()) if b_.numel() else 0.0
    return bool(torch.allclose(a, b_, rtol=rtol, atol=rtol * max(scale, 1e-6), equal_nan=True))
