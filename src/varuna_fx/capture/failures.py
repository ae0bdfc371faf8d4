"""Why a tracer failed, said in terms of the user's code: the line, and what to change."""

from __future__ import annotations

import inspect
import linecache
import traceback

import torch
from torch import nn

# -- error messages ------------------------------------------------------------------------------

_LIBRARY_PATHS = (
    "/torch/", "/varuna_fx/", "/transformers/", "/contextlib.py", "/functools.py", "/sympy/",
)


# Never the model's code: the tracers, this package and generated code ("<string>", "<eval>").
_OUR_PATHS = ("/torch/", "/varuna_fx/", "/contextlib.py", "/functools.py", "/sympy/")


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not any(p in f.filename for p in _LIBRARY_PATHS)
            and not f.filename.startswith("<")]
    if not user:
        # A model defined inside a library (e.g. transformers) still has a best guess: the last
        # frame of that library, never a tracer's or varuna_fx's own line.
        user = [f for f in frames if not any(p in f.filename for p in _OUR_PATHS)
                and not f.filename.startswith("<")]
    return user[-1] if user else None


def defined_at(model: nn.Module, method: str = "forward") -> str:
    """' (forward at file:line)' for the model's forward (or another method), or '' when its
    source is unknown."""
    try:
        function = inspect.unwrap(getattr(type(model), method))
        path = inspect.getsourcefile(function)
        line = inspect.getsourcelines(function)[1]
    except (TypeError, OSError, AttributeError):
        return ""
    return f" ({type(model).__name__}.{method} at {path}:{line})"


def describe_failure(tracer: str, exc: BaseException, model: nn.Module,
                      alone: bool = True) -> str:
    """``alone``: the user chose this tracer (so the other one is worth suggesting)."""
    frame = _user_frame(exc)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(reason) > 300:
        reason = reason[:300] + "..."
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f" at {frame.filename}:{frame.lineno} in {frame.name}: `{line}`"
    else:  # the tracer failed before running any of the model's code: name its forward
        where = defined_at(model).replace(" (", " in ", 1).rstrip(")")
    shape_python = any(key in reason for key in (
        "cannot be interpreted as an integer", "Proxy object cannot be iterated",
        "'len' is not supported", "len() of a traced value"))
    data_dependent = not shape_python and any(key in f"{type(exc).__name__} {reason}" for key in (
        "control flow", "DataDependent", "data-dependent", "__bool__"))
    if "depends on the batch size (dim 0)" in reason:
        hint = (
            "forward's Python code decides on the batch size (dim 0), which a pipeline "
            "changes (it runs micro-batches of other sizes): make the decision depend on "
            "other dimensions or constants, or compute it with torch operations")
    elif shape_python and tracer == "torch.fx":
        hint = (
            "Python needs a plain value of a traced tensor or size here (range(), int(), "
            "len(), iterating), which torch.fx cannot give: it gives conditions, lengths and "
            "items of sizes the example's shapes fix, but keeps a size symbolic where torch "
            "functions may take it (so range(x.size(1)) gets none), and values that depend on "
            "data are unknown while tracing"
            + (": try tracer='export' or 'auto', which traces with concrete sizes"
               if alone else ""))
    elif "cache_utils." in reason and "not a known type" in reason:
        hint = (
            "the model returns its key/value cache (a Hugging Face model with use_cache=True, "
            "the default of its config), which is no tensor a pipeline could pass on: set "
            "model.config.use_cache = False before vf.compile (training needs no cache)"
        )
    elif "Constraints violated (batch)" in reason:
        hint = (
            "forward's code fixes the batch size (dim 0) to the example's, e.g. by computing "
            "with it in Python or numpy (a Hugging Face wav2vec2's SpecAugment masking, "
            "config.mask_time_prob > 0); a pipeline runs micro-batches of other sizes, so "
            "compute it with torch operations on the tensors, or turn that feature off"
        )
    elif data_dependent:
        hint = (
            "Python control flow (if/while/bool()) that depends on tensor values cannot be "
            "traced: rewrite it with torch.where or torch.cond, move it out of forward, or make "
            "it depend only on shapes or constants"
        )
    else:
        other = "'export'" if tracer == "torch.fx" else "'fx'"
        hint = f"this operation cannot be traced by {tracer}" + (
            f": try tracer={other} or 'auto'" if alone else "")
    return f"{tracer} failed{where} ({type(exc).__name__}: {reason}). {hint}"


def plain_meta_tensors(model: nn.Module) -> dict[int, str]:
    """id -> ``self.path`` of each meta tensor the model holds as a plain attribute (neither
    parameter nor buffer): made while the model was built under ``vf.deferred_init``
    (``self.scale = self.lin.weight.detach().norm()``), it is never materialised, so its
    values are never made."""
    found: dict[int, str] = {}
    for path, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta and \
                    key not in module._parameters and key not in module._buffers:
                found.setdefault(id(value), f"self.{path + '.' if path else ''}{key}")
    return found


def meta_constant_refusal(what: str, attribute: str | None) -> str:
    """Why a deferred model's constant with no values is refused, and the change that works
    under ``vf.deferred_init`` (``varuna-fx train`` always builds a model so)."""
    if attribute is not None:
        owner, _, key = attribute.rpartition(".")
        return (
            f"the model's forward reads {attribute} ({what}), a tensor that is neither a "
            "parameter nor a buffer, made while the model was built under vf.deferred_init: "
            "it is on the meta device and its values (made from the model's uninitialised "
            "tensors) are never made. Register it as a buffer in __init__ "
            f"({owner}.register_buffer('{key}', ..., persistent=False)), which "
            "vf.deferred_init initialises with the model, or compute it in forward")
    return (
        f"the model's forward makes a tensor constant ({what}) on the meta device under "
        "vf.deferred_init, so its values are unknown: its value depends on the model's "
        "uninitialised tensors, or the code names device='meta'. Make it in forward from the "
        "inputs' device (torch.tensor(..., device=x.device)), or register it as a buffer in "
        "__init__ (self.register_buffer(name, ..., persistent=False)), which vf.deferred_init "
        "initialises with the model")
