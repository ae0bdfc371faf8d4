"""The front end of ``vf.compile``: capture and the annotation passes, cached per model.

Re-compiling the same model (another P, schedule or micro-batch size, as one does while
exploring in a notebook) reuses its annotated graph; the planner's ``analyze`` shares it. Later
passes never write into this graph: ``vf.compile`` annotates a copy (``ir.copy_graph_module``),
so pipelines compiled from one cached graph do not change each other.

Moved here from api.py (the cache and ``_captured_and_annotated``) because the planner, which
sits below api, needs it; api re-exports the names.
"""

from __future__ import annotations

import weakref
from pathlib import Path

from torch import nn

from .capture import BoundInputs, Captured, capture
from .passes.annotate_costs import annotate_costs
from .passes.annotate_shapes import annotate_shapes
from .passes.manager import CompileState, Pass, run_passes
from .passes.mark_replicable import mark_replicable
from .passes.specialize_sizes import specialize_sizes


def _capture(state: CompileState) -> None:
    state["captured"] = captured = capture(state.model, state["bound"], state["tracer"])
    state.gm = captured.gm


FRONT_PASSES: tuple[Pass, ...] = (
    Pass("capture", "one flat GraphModule over tensor inputs; original FQNs and parameter "
         "objects; output = flat tuple + out_spec", _capture),
    Pass("annotate_shapes", "every node has shapes, dtypes, bytes and FLOPs affine in the "
         "micro-batch size b", lambda s: annotate_shapes(s.gm, s["bound"])),
    Pass("specialize_sizes", "size()/.shape of activations are constants or arithmetic on the "
         "batch size: ints never pin two operations to one stage",
         lambda s: specialize_sizes(s.gm)),
    Pass("annotate_costs", "backward FLOPs and the parameters each node reads, under canonical "
         "names", lambda s: annotate_costs(s.gm, s["canonical"])),
    Pass("mark_replicable", "cheap input/constant-derived nodes are copied into every stage "
         "that needs them, never sent", lambda s: mark_replicable(s.gm)),
)

_CAPTURES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Captured]] = \
    weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module, bound: BoundInputs, tracer: str) -> tuple:
    tensors = tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in bound.tensors.items())
    state = tuple((n, id(t), tuple(t.shape), t.dtype) for n, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)])
    modes = tuple(m.training for m in model.modules())
    return (tracer, tensors, tuple(sorted(bound.constants.items(), key=str)), state, modes)


def captured_and_annotated(model: nn.Module, bound: BoundInputs, tracer: str,
                            canonical: dict[str, str], dump: Path | None = None) -> Captured:
    """The front passes' result, from the cache when the model is unchanged. With ``dump``
    the passes run afresh (so each one's graph can be written) and the result is cached."""
    key = _fingerprint(model, bound, tracer)
    cached = _CAPTURES.get(model)
    if dump is None and cached is not None and cached[0] == key:
        return cached[1]
    state = CompileState(model, values={"bound": bound, "tracer": tracer,
                                        "canonical": canonical})
    run_passes(FRONT_PASSES, state, dump=dump)
    captured: Captured = state["captured"]
    _CAPTURES[model] = (key, captured)
    return captured
