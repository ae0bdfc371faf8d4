"""Non-strict torch.export into the canonical graph (see ``trace.py``).

``BatchNorm(momentum=None)`` compiles with fx only: torch.export cannot trace its
``float(num_batches_tracked)``.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..errors import CaptureError, InputError, env_int
from ..world.where import comm_device, launched_distributed
from .autograd_functions import functions_kept
from .captured import Captured
from .failures import (
    defined_at,
    describe_failure,
    meta_constant_refusal,
    plain_meta_tensors,
)
from .function_inlining import inlining_differs
from .inputs import BoundInputs
from .mutations import keep_mutations, place_write_backs
from .untraced import (
    attribute_assignments_recorded,
    check_root_pre_hooks,
    mark_rebinds,
    rebinding_recorded,
    recomputed_by_hooks,
    tensor_hooks_recorded,
)


def capture_export(model: nn.Module, bound: BoundInputs, alone: bool = True) -> Captured:
    signature = inspect.signature(model.forward)
    kwargs = {**_at_least_two(_unaliased(bound.tensors)), **bound.constants}
    # dim 0 of every tensor input is the one batch dimension: export it symbolically, so the
    # graph runs at any micro-batch size instead of being specialised to the example's.
    batch = torch.export.Dim("batch", min=1)
    dynamic = {name: ({0: batch} if name in bound.tensors else None) for name in kwargs}
    check_root_pre_hooks(model, alone)
    try:
        with weights_faked_on(stage_device(bound)), rebinding_recorded(model) as rebound, tensor_hooks_recorded() as hooked, \
                attribute_assignments_recorded() as assigned, functions_kept() as functions:
            program = torch.export.export(
                model, args=(), kwargs=kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as exc:
        meta = plain_meta_tensors(model)
        if meta and "meta" in str(exc):  # one of them met the inputs' device: name it
            raise InputError(meta_constant_refusal("a meta tensor", next(iter(meta.values())))
                             ) from None
        raise CaptureError(describe_failure("torch.export", exc, model, alone)) from None
    for applied in {f.cls: f for f in functions}.values():  # each Function once
        why = inlining_differs(applied)
        if why is not None:
            raise CaptureError(
                f"{type(model).__name__}.forward applies the custom torch.autograd.Function "
                f"{applied}: torch.export traces its forward and drops its backward, and {why}, "
                "so the pipeline's gradients would silently differ from eager's (zero for a "
                "straight-through estimator). Use tracer='fx'" + (" or 'auto'" if alone else "")
                + ", which keeps it as one call with its own backward (make the rest of "
                "forward traceable by torch.fx), or write its backward as differentiable "
                "torch code")
    if hooked:
        raise CaptureError(
            f"{type(model).__name__}.forward registers a gradient hook on a tensor ({hooked[0]}):"
            " torch.export does not record it, so the pipeline would silently skip it (and "
            "torch.fx cannot trace it). Register hooks on parameters outside forward "
            "(parameter.register_hook), or write the gradient change as a "
            "torch.autograd.Function")
    excused = recomputed_by_hooks(model)
    assigned = [a for a in assigned if a not in excused]
    if assigned:
        raise CaptureError(
            f"{type(model).__name__}.forward stores a tensor on the model ({assigned[0]} = ...)"
            f"{defined_at(model)}: torch.export does not keep attributes set in forward, so "
            "after a pipeline step it would silently be missing or stale. Register it as a "
            "buffer (register_buffer) and update it in place, or return it")
    gm = program.module()
    mark_rebinds(model, gm, rebound, alone)
    info = gm.graph._codegen.pytree_info
    leaves = pytree.tree_leaves(((), kwargs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat_names = _leaf_names(kwargs)
    for node, leaf, name in zip(placeholders, leaves, flat_names):
        if isinstance(leaf, torch.Tensor):
            node.target = name
            node._rename(name)
        elif node.users:
            raise CaptureError(f"constant input {name}={leaf!r} is used as a tensor")
        else:
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # torch.export's runtime input guards: not part of the model
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
        # and its checks that a `.to(...)`'s input has the dtype seen at export: under
        # precision="bf16"/"fp16" autocast makes it another, and they raised a bare
        # "Tensor dtype mismatch" on the first step (eager autocast runs the same code)
        elif node.op == "call_function" and node.target is _ASSERT_METADATA and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph._codegen = fx.graph.CodeGen()
    place_write_backs(gm)
    keep_mutations(gm)
    _name_after_modules(gm)
    # A fresh GraphModule: the unlifted one carries pre-hooks that check the pytree input spec.
    gm = fx.GraphModule(gm, gm.graph, type(model).__name__)
    return Captured(gm, list(bound.tensors), info.out_spec, "export", signature, bound.constants)


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def stage_device(bound: BoundInputs) -> torch.device | None:
    """The device a ``vf.deferred_init`` model's stages will run on, which its capture fakes
    its weights on: the example inputs' (a one-process pipeline allocates there), but in a
    launched job on GPUs the rank's GPU (``world/where.init_process_group`` picks NCCL and
    ``LOCAL_RANK``'s device), whatever device the example inputs are on."""
    device = next((t.device for t in bound.tensors.values()), None)
    if device is None or device.type != "cpu":
        return device
    if dist.is_available() and dist.is_initialized():
        return comm_device()
    if launched_distributed() and torch.cuda.is_available():
        return torch.device("cuda", env_int("LOCAL_RANK", 0))
    return device


@contextlib.contextmanager
def weights_faked_on(device: torch.device | None) -> Iterator[None]:
    """While torch.export runs, the fake tensors it makes of meta parameters and buffers
    (a ``vf.deferred_init`` model) claim ``device``, the inputs' and the stages'. Traced on
    meta, a model that mixes its outputs with an input (its own loss from ``targets``) failed
    ("Tensor on device meta is not on the expected device cpu"), a constant it made from
    Python values (``x[:, [-1]]``'s index) was made on meta, without values, and code that
    branches on the device (``if x.device.type == "cpu"``) took the meta branch, which then
    ran on the real device. Nothing is allocated: a fake tensor holds no data."""
    if device is None or device.type == "meta":
        yield
        return
    import torch.export._trace as export_trace  # torch.export's own step that fakes them

    original = getattr(export_trace, "_fakify_params_buffers", None)
    if original is None:  # another torch: traced on meta, as before
        yield
        return

    def fakify(fake_mode: Any, module: nn.Module) -> dict[str, torch.Tensor]:
        fakes = original(fake_mode, module)
        for fake in {id(f): f for f in fakes.values()}.values():
            if fake.device.type == "meta":
                fake.fake_device = device
        return fakes

    export_trace._fakify_params_buffers = fakify
    try:
        yield
    finally:
        export_trace._fakify_params_buffers = original


def _unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The example inputs, each with its own storage. torch.export reads inputs that share
    memory (``labels=input_ids``, the Hugging Face causal-LM idiom) through one placeholder:
    the graph then embedded ``labels``, and every step with other labels was silently wrong."""
    seen: set[Any] = set()
    out = {}
    for name, t in tensors.items():
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _at_least_two(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The example inputs with a batch of at least two samples (a batch of 1 repeated).

    torch.export specialises every dimension whose example size is 1 to the constant 1 (its
    0/1 specialisation), so an example batch of 1 (the natural first try for a big model)
    failed as "Constraints violated (batch)" and was reported as forward's code fixing the
    batch size. Captured from two copies of the sample, the graph is symbolic in the batch
    (down to 1: ``Dim(min=1)``) and identical to the one a batch of 2 gives; only the capture
    sees the copy (the shape pass, the planner and the pipeline use the example as given)."""
    if not tensors or next(iter(tensors.values())).shape[0] != 1:
        return tensors
    return {name: t.repeat(2, *([1] * (t.dim() - 1))) for name, t in tensors.items()}


def _leaf_names(kwargs: dict[str, Any]) -> list[str]:
    names = []
    for key, value in kwargs.items():
        names.extend([key] * max(1, len(pytree.tree_leaves(value))))
    return names


_SELF_PREFIX = re.compile(r"^L__self___?")


def _name_after_modules(gm: fx.GraphModule) -> None:
    """aten nodes are called ``linear_17``; prefix the module they came from: ``h_3_mlp_linear``."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L__self__.", "")
        if not path:
            continue
        try:
            gm.get_submodule(path)
        except AttributeError:  # export's own bookkeeping frames, not a model module
            continue
        parts = [p for p in re.split(r"[.\[\]'\"]+", path) if p]
        prefix = "_".join(parts).lower()
        base = re.sub(r"_\d+$", "", node.name)
        node._rename(f"{prefix}_{base}")
