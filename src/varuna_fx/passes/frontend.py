"""The front end of ``vf.compile``: capture and the annotation passes (1-6), cached per model.

These six are the head of the one pass list (``codegen/pass_list.PASS_LIST``, which names every
pass in order, configure included); they are defined here, beside their cache, because the
planner's ``analyze`` runs them too and sits below the rest of the list. They run over a
:class:`FrontState`, which the list's ``CompileState`` extends.

Re-compiling the same model (another P, schedule or micro-batch size, as one does while
exploring in a notebook) reuses its annotated graph; the planner's ``analyze`` shares it. Later
passes never write into this graph: ``vf.compile`` annotates a copy (``ir.copy_graph_module``),
so pipelines compiled from one cached graph do not change each other.

It sits in passes/, below the planner, because the planner's ``analyze`` shares the cache.

The cache (``_CAPTURES``) is keyed by the fresh capture's code, the called modules' settings,
parameter and buffer identities, tensor constants and modes, so a hit equals a fresh compile;
capture itself runs on every compile, passes 2-6 once per captured graph, and passes 7-9 on
``ir.copy_graph_module(captured.gm)`` (nodes carrying copies of their annotations), so
compiling the same model at P=4 leaves an earlier P=2 pipeline's graphs untouched. The profiler
hands ``split_stages`` a chunk map instead of rewriting stage annotations. With the on-disk
``shape_cache`` a restarted job skips both fake-tensor runs; passes 3-5 always run (they are
cheap; the figures: bench/RESULTS.md, "Figures the code cites").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..capture import capture_cache
from ..capture.captured import Captured
from ..capture.failures import meta_constant_refusal, plain_meta_tensors
from ..capture.inputs import BoundInputs
from ..capture.model_key import capture_key
from ..capture.trace import capture
from ..errors import InputError
from .annotate_backward import annotate_backward
from .annotate_shapes import annotate_shapes
from .manager import GraphState, Pass, run_passes
from .mark_replicable import mark_replicable
from .sample_mixing import mark_sample_mixing
from .specialize_sizes import specialize_sizes


@dataclass(kw_only=True)
class FrontState(GraphState):
    """What the front passes read (the model, its bound inputs, the tracer asked for, canonical
    parameter names) and what capture fills."""

    model: nn.Module
    bound: BoundInputs
    tracer: str  # "auto", "fx" or "export" (the captured graph says which ran)
    canonical: dict[str, str]  # every parameter/buffer FQN -> its canonical (tied: one) name
    captured: Captured | None = None  # capture: the graph and its input/output structure
    # the key of the capture taken before tracing (capture/model_key.py); None: not cacheable
    capture_key: str | None = None


def _capture(state: FrontState) -> None:
    """Capture, or read the graph a capture of the same key left on disk."""
    key = state.capture_key
    loaded = capture_cache.load(key, state.model, state.bound) if key is not None else None
    if loaded is None:
        loaded = capture(state.model, state.bound, state.tracer)
        if key is not None:
            capture_cache.store(key, loaded, state.model)
    state.captured = loaded
    state.gm = loaded.gm


FRONT_PASSES: tuple[Pass[FrontState], ...] = (
    Pass("capture", "one flat GraphModule over tensor inputs; original FQNs and parameter "
         "objects; output = flat tuple + out_spec", _capture,
         check=lambda s: refuse_meta_constants(s.model, s.captured)),
    Pass("annotate_shapes", "every node has shapes, dtypes, bytes and FLOPs affine in the "
         "micro-batch size b", lambda s: annotate_shapes(s.gm, s.bound)),
    Pass("specialize_sizes", "size()/.shape of activations are constants or arithmetic on the "
         "batch size: ints never pin two operations to one stage",
         lambda s: specialize_sizes(s.gm)),
    Pass("annotate_backward", "backward FLOPs and the parameters each node reads, under canonical "
         "names", lambda s: annotate_backward(s.gm, s.canonical)),
    Pass("mark_replicable", "cheap input/constant-derived nodes are copied into every stage "
         "that needs them, never sent", lambda s: mark_replicable(s.gm)),
    Pass("mark_sample_mixing", "nodes whose result micro-batching changes (statistics over the "
         "batch, batch x batch products) say why", lambda s: mark_sample_mixing(s.gm, s.model, s.bound)),
)

# The model is captured afresh on every compile and the cache key is what that capture produced
# (the graph's code, with attributes such as ``self.alpha`` baked in as constants; the type and
# settings of every module it calls; the identity of every parameter and buffer; tensor
# constants; modes), so a hit is exactly what a fresh compile would annotate. It skips the
# fake-tensor runs and cost passes (most of a compile: bench/RESULTS.md, "Capture cache").
_CAPTURES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Captured]] = \
    weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module, captured: Captured, bound: BoundInputs) -> tuple:
    gm = captured.gm
    tensors = tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in bound.tensors.items())
    state = tuple((n, id(t), tuple(t.shape), t.dtype) for n, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)])
    owned = {id(t) for t in [*model.parameters(), *model.buffers()]}
    constants = tuple((n, t.dtype, tuple(t.shape), _content(t))
                      for n, t in [*gm.named_parameters(), *gm.named_buffers()]
                      if id(t) not in owned)
    called = tuple((str(n.target), _module_settings(gm.get_submodule(str(n.target))))
                   for n in gm.graph.nodes if n.op == "call_module")
    modes = tuple(m.training for m in model.modules())
    return (captured.tracer, gm.code, tensors, tuple(sorted(bound.constants.items(), key=str)),
            state, constants, called, modes)


def _content(t: torch.Tensor) -> int:
    return hash(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def refuse_meta_constants(model: nn.Module, captured: Captured) -> None:
    """A tensor constant of the graph on meta has no values. Capture of a ``vf.deferred_init``
    model traces on fake tensors of the inputs' device (``trace_export.weights_faked_on``),
    so what forward makes from Python values (nanoGPT's ``x[:, [-1], :]`` index, an
    ``arange``, a mask) is captured with its values and travels with the stage that reads it.
    What remains meta is a tensor the model holds as a plain attribute, made from its
    uninitialised weights while it was built (``self.scale = w.detach().norm()``): refused,
    naming it, with a change that works under deferred init (Falcon's loss came out NaN
    when such a constant was run)."""
    owned = {id(t) for t in [*model.parameters(), *model.buffers()]}
    gm = captured.gm
    empty = [(n, t) for n, t in [*gm.named_parameters(), *gm.named_buffers()]
             if t.is_meta and id(t) not in owned]
    if empty:
        name, t = empty[0]
        what = f"{name}, shape {tuple(t.shape)}; {len(empty)} in all"
        raise InputError(meta_constant_refusal(what, plain_meta_tensors(model).get(id(t))))


def _module_settings(module: nn.Module) -> tuple:
    """A called module's type and plain settings (``p`` of Dropout, ``eps`` of LayerNorm...)."""
    plain = (bool, int, float, str, type(None), tuple)
    return (type(module), tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                                       if isinstance(v, plain))))


def captured_and_annotated(model: nn.Module, bound: BoundInputs, tracer: str,
                           canonical: dict[str, str], dump: Path | None = None) -> Captured:
    """The front passes' result, from the cache when a fresh capture equals the cached one.
    With ``dump`` the passes run afresh (so each one's graph can be written) and the result is
    cached."""
    state = FrontState(model=model, bound=bound, tracer=tracer, canonical=canonical)
    run_front_end(state, dump)
    assert state.captured is not None
    return state.captured


def run_front_end(state: FrontState, dump: Path | None = None) -> None:
    """Fill ``state.captured`` and ``state.gm`` (the cached graph: a compile copies it before
    changing it) with the front passes' result, from the cache when a fresh capture equals the
    cached one (``captured_and_annotated``)."""
    model, bound = state.model, state.bound
    if capture_cache.enabled():
        state.capture_key = capture_key(model, bound, state.tracer)
    if state.capture_key is not None:
        _front_end_by_key(state, state.capture_key, dump)
        return
    if dump is not None:
        run_passes(FRONT_PASSES, state, dump=dump)
        assert state.captured is not None
        _CAPTURES[model] = (_fingerprint(model, state.captured, bound), state.captured)
        return
    run_passes(FRONT_PASSES[:1], state)  # capture: cheap, and what the key is made of
    assert state.captured is not None
    key = _fingerprint(model, state.captured, bound)
    cached = _CAPTURES.get(model)
    if cached is not None and cached[0] == key:
        state.captured = cached[1]
        state.gm = cached[1].gm
        return
    run_passes(FRONT_PASSES[1:], state)
    _CAPTURES[model] = (key, state.captured)


def _front_end_by_key(state: FrontState, key: str, dump: Path | None) -> None:
    """The front end of a model whose capture has a key taken before tracing: a hit in this
    process skips capture and the annotation passes, one on disk skips capture."""
    model = state.model
    # the captured graph holds these very parameter and buffer objects
    full = (key, tuple(id(t) for t in [*model.parameters(), *model.buffers()]))
    cached = _CAPTURES.get(model)
    if dump is None and cached is not None and cached[0] == full:
        state.captured = cached[1]
        state.gm = cached[1].gm
        return
    run_passes(FRONT_PASSES, state, dump=dump)
    assert state.captured is not None
    _CAPTURES[model] = (full, state.captured)
