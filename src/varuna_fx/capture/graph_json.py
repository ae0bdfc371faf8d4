"""A captured graph as JSON and back, so a restarted process need not capture again.

What is written: every node's op, name, target, arguments, source lines (``stack_trace``, which
the graph's code shows) and module path (``nn_module_stack``), and fx's mark of an autowrapped call
(``is_wrapped``), and the two annotations capture itself makes (``NodeInfo.mutates``, ``NodeInfo.rebinds``); the output's structure (torch's own
JSON form of the pytree spec); the tensor constants the tracer made (their values, as bytes);
the subgraphs of higher-order operators, the same way. Parameters, buffers and called modules are
not written: ``get_attr``/``call_module`` name them by path, and the graph read back binds the
model's own objects, checked to exist with the shape and dtype written.

Reading runs no code: JSON only (``safe_json``: bounded in depth); a called function is named by
module and qualified name and looked up in a module already imported (``sys.modules``, never an
import) among torch's, Python's ``operator``/``math``/``builtins`` and varuna_fx's, and must be
that same object again; an operator is looked up in torch's registry. Nor can the graph read
back act when it runs: what it may call and read is ``runnable``'s allow-list (side-effect-free
tensor operations: never ``operator.call``, ``Tensor.numpy``, a file, a hook or a custom op),
and every string that reaches generated code is checked there too (node and method names are
identifiers, attribute paths dotted names, module paths, type names and stack traces hold no
line break). What cannot be written that way (a user's ``fx.wrap``-ed function, a module that
is not the model's, an argument of another type) makes the graph unwritable
(:class:`Unwritable`), and it is captured afresh each time.

Anything that does not fit when read (a missing node, a parameter of another shape, a function
that is not the one named) raises ``ValueError``; the cache then ignores the entry.
"""

from __future__ import annotations

import base64
import inspect
import sys
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.graph_module import _assign_attr, _copy_attr

from ..ir.nodes import info as node_info
from ..world import safe_json
from . import runnable
from .captured import Captured
from .inputs import BoundInputs

# where a called function may come from: already imported, never imported by reading
_FUNCTION_MODULES = ("torch", "operator", "_operator", "math", "builtins", "varuna_fx")


class Unwritable(Exception):  # noqa: N818 - a reason, not a failure: the caller captures afresh
    """This graph cannot be written so that reading it back runs no code."""


# -- writing -------------------------------------------------------------------------------------


def encode_captured(captured: Captured, model: nn.Module) -> dict[str, Any]:
    """``captured`` as JSON-able data; :class:`Unwritable` when it cannot be."""
    try:
        out_spec = pytree.treespec_dumps(captured.out_spec)
    except Exception as exc:  # noqa: BLE001 - a type without a serialised name, and the like
        raise Unwritable(f"output structure: {exc}") from None
    return {
        "tracer": captured.tracer,
        "class_name": type(captured.gm).__name__,
        "input_names": list(captured.input_names),
        "out_spec": out_spec,
        "graph": _encode_graph(captured.gm, model, top=True),
        "training": captured.gm.training,
    }


def _encode_graph(gm: fx.GraphModule, model: nn.Module | None, top: bool) -> dict[str, Any]:
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        raise Unwritable("a graph with its own code generator")
    nodes, attrs = [], {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            attrs[str(node.target)] = _encode_attr(gm, model, node, top)
        why = runnable.check_runnable(node.op, node.target, node.args)
        if why:
            raise Unwritable(f"node {node.name} {why}")
        entry: dict[str, Any] = {
            "op": node.op, "name": node.name, "target": _encode_target(node),
            "args": _encode_arg(node.args), "kwargs": _encode_arg(node.kwargs)}
        if node.type is not None:  # an annotation of forward's parameter (torch.Tensor)
            entry["type"] = _encode_type(node)
        if node.stack_trace:
            entry["stack_trace"] = node.stack_trace
        stack = node.meta.get("nn_module_stack")
        if stack:
            entry["module_stack"] = [[str(k), str(v[0]), _type_name(v[1])]
                                     for k, v in stack.items()]
        if node.meta.get("is_wrapped"):  # fx's autowrapped call (math.sqrt): the code says so
            entry["is_wrapped"] = True
        annotations = node.meta.get("varuna")
        if annotations is not None and annotations.mutates:
            entry["mutates"] = True
        if annotations is not None and annotations.rebinds:
            entry["rebinds"] = annotations.rebinds
        try:  # what reading would refuse is not written (it would be refused at every load)
            _check_text(entry)
        except ValueError as exc:
            raise Unwritable(f"node {node.name}: {exc}") from None
        nodes.append(entry)
    return {"nodes": nodes, "attrs": attrs}


def _check_text(entry: dict[str, Any]) -> None:
    """The checks reading makes of a node's text (``runnable``), made before writing it."""
    runnable.identifier(entry["name"], "node name")
    if "text" in entry.get("type", {}):
        runnable.annotation(entry["type"]["text"])
    if entry.get("stack_trace"):
        runnable.stack_trace(entry["stack_trace"])
    for key, path, kind in entry.get("module_stack", ()):
        runnable.module_path(key)
        runnable.module_path(path)
        runnable.type_name(kind)
    if entry.get("rebinds"):
        runnable.dotted(entry["rebinds"], "rebound attribute")
    for key, _ in entry["kwargs"]["dict"]:
        runnable.identifier(key, "keyword")


def _encode_type(node: fx.Node) -> dict[str, str]:
    t = node.type
    if isinstance(t, str):  # an annotation under `from __future__ import annotations`
        return {"text": t}
    if isinstance(t, type) and t.__module__.split(".")[0] in _FUNCTION_MODULES:
        try:
            if _function(t.__module__, t.__qualname__) is t:
                return {"module": t.__module__, "qualname": t.__qualname__}
        except ValueError:
            pass
    raise Unwritable(f"node {node.name} is annotated {t!r}, not a class of torch's or Python's")


def _type_name(value: Any) -> str:
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else str(value)


def _encode_attr(gm: fx.GraphModule, model: nn.Module | None, node: fx.Node,
                 top: bool) -> dict[str, Any]:
    target = str(node.target)
    value = _walk(gm, target)
    if top and model is not None and value is _walk(model, target) and value is not None:
        if isinstance(value, torch.Tensor):
            return {"kind": "model", "tensor": _tensor_form(value)}
        if node.op == "call_module" and isinstance(value, nn.Module):
            return {"kind": "model", "module": _type_name(type(value))}
    if node.op == "get_attr" and type(value) is torch.Tensor:
        if value.is_meta or value.requires_grad or value.layout != torch.strided:
            raise Unwritable(f"constant {target}: meta, requiring grad or not strided")
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return {"kind": "constant", "tensor": _tensor_form(value),
                "bytes": base64.b64encode(data.numpy().tobytes()).decode()}
    if node.op == "get_attr" and isinstance(value, fx.GraphModule):
        return {"kind": "graph", "class_name": type(value).__name__,
                "graph": _encode_graph(value, None, top=False)}
    raise Unwritable(f"{node.op} {target}: a {type(value).__name__} the model does not hold")


def _tensor_form(t: torch.Tensor) -> list[Any]:
    return [list(t.shape), str(t.dtype).removeprefix("torch."), bool(t.requires_grad),
            isinstance(t, nn.Parameter)]


def _encode_target(node: fx.Node) -> Any:
    target = node.target
    if node.op != "call_function":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return {"op": target._schema.name, "overload": target._overloadname}
    if isinstance(target, torch._ops.HigherOrderOperator):
        return {"hop": target.name()}
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] not in _FUNCTION_MODULES:
        raise Unwritable(f"node {node.name} calls {target!r}, which is not torch's or Python's")
    # by its plain name in its module (torch.cat's qualified name is a class's method)
    for name in (getattr(target, "__name__", ""), getattr(target, "__qualname__", "")):
        try:
            if name and _function(module, name) is target:
                return {"module": module, "qualname": name}
        except ValueError:
            continue
    raise Unwritable(f"node {node.name} calls {target!r}, not found again by its name")


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
           if isinstance(d, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.memory_format)}


def _encode_arg(a: Any) -> Any:
    if a is None or type(a) in (bool, int, str):
        return a
    if type(a) is float:
        return {"float": repr(a)}  # inf and nan are not JSON
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if type(a) in (list, fx.immutable_collections.immutable_list):
        return [_encode_arg(x) for x in a]
    if type(a) is tuple:
        return {"tuple": [_encode_arg(x) for x in a]}
    if type(a) in (dict, fx.immutable_collections.immutable_dict) and \
            all(type(k) is str for k in a):
        return {"dict": [[k, _encode_arg(v)] for k, v in a.items()]}
    if type(a) is slice:
        return {"slice": [_encode_arg(a.start), _encode_arg(a.stop), _encode_arg(a.step)]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if a is Ellipsis:
        return {"ellipsis": True}
    raise Unwritable(f"an argument of type {type(a).__name__}")


# -- reading -------------------------------------------------------------------------------------


def decode_captured(data: dict[str, Any], model: nn.Module, bound: BoundInputs) -> Captured:
    """The :class:`Captured` ``data`` describes, bound to ``model``'s parameters, buffers and
    modules; ``ValueError`` when anything does not fit."""
    if list(data["input_names"]) != list(bound.tensors):
        raise ValueError("other inputs")
    if data["tracer"] not in ("fx", "export"):
        raise ValueError(f"unknown tracer {data['tracer']!r}")
    gm = _decode_graph(data["graph"], model, runnable.identifier(data["class_name"], "class"))
    gm.train(bool(data["training"]))  # as the root it was made from was (its modules keep theirs)
    safe_json.loads(str(data["out_spec"]))  # torch's own reader recurses without a bound
    out_spec = pytree.treespec_loads(str(data["out_spec"]))
    return Captured(gm, list(bound.tensors), out_spec, str(data["tracer"]),
                    inspect.signature(model.forward), bound.constants)


def _decode_graph(data: dict[str, Any], model: nn.Module | None, class_name: str
                  ) -> fx.GraphModule:
    values: dict[str, Any] = {}
    for target, attr in dict(data["attrs"]).items():
        values[target] = _decode_attr(model, runnable.dotted(target, "attribute path"), attr)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for entry in data["nodes"]:
        op = str(entry["op"])
        if op not in ("placeholder", "get_attr", "call_function", "call_method", "call_module",
                      "output"):
            raise ValueError(f"unknown op {op!r}")
        name = runnable.identifier(entry["name"], "node name")
        target = _decode_target(op, entry["target"])
        args = _decode_arg(entry["args"], env)
        kwargs = _decode_arg(entry["kwargs"], env)
        if not isinstance(kwargs, dict):
            raise ValueError(f"node {name}'s keyword arguments are not a dict")
        for key in kwargs:  # they appear in the code as `f(x, key = ...)`
            runnable.identifier(key, "keyword")
        why = runnable.check_runnable(op, target, args)
        if why:
            raise ValueError(f"node {entry['name']} {why}")
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"node {entry['name']} could not keep its name")
        env[node.name] = node
        if entry.get("type") is not None and "text" in entry["type"]:
            node.type = runnable.annotation(entry["type"]["text"])
        elif entry.get("type") is not None:
            node.type = _function(str(entry["type"]["module"]), str(entry["type"]["qualname"]))
            if not isinstance(node.type, type):
                raise ValueError(f"node {node.name}'s annotation is not a class")
        if entry.get("stack_trace"):
            node.stack_trace = runnable.stack_trace(entry["stack_trace"])
        if entry.get("module_stack"):
            node.meta["nn_module_stack"] = {
                runnable.module_path(k): (runnable.module_path(p), runnable.type_name(t))
                for k, p, t in entry["module_stack"]}
        if entry.get("is_wrapped"):
            node.meta["is_wrapped"] = True
        if entry.get("mutates"):
            node_info(node).mutates = True
        if entry.get("rebinds"):
            node_info(node).rebinds = runnable.dotted(entry["rebinds"], "rebound attribute")
    # Attributes installed in node order, the model's as fx copies them from a module root (a
    # dict root would order them by depth, and the shape cache's key sees the order)
    gm = fx.GraphModule({}, fx.Graph(), class_name)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            if target not in values:
                raise ValueError(f"node {node.name} names {target}, which was not written")
            if data["attrs"][target]["kind"] == "model":
                _copy_attr(model, gm, target)
            else:
                _assign_attr(values[target], gm, target)
    gm.graph = graph
    return gm


def _decode_attr(model: nn.Module | None, target: str, attr: dict[str, Any]) -> Any:
    kind = attr["kind"]
    if kind == "model":
        value = _walk(model, target) if model is not None else None
        if "module" in attr:
            if not isinstance(value, nn.Module) or _type_name(type(value)) != attr["module"]:
                raise ValueError(f"the model has no {attr['module']} at {target}")
            return value
        if not isinstance(value, torch.Tensor) or _tensor_form(value) != attr["tensor"]:
            raise ValueError(f"the model's {target} is not the tensor written")
        return value
    if kind == "constant":
        shape, dtype_name = attr["tensor"][0], attr["tensor"][1]
        dtype = _DTYPES.get(str(dtype_name))
        if dtype is None:
            raise ValueError(f"unknown dtype {dtype_name!r}")
        raw = bytearray(base64.b64decode(str(attr["bytes"])))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        t = flat.view(dtype).reshape([int(s) for s in shape])
        if _tensor_form(t) != attr["tensor"]:
            raise ValueError(f"constant {target} is not the tensor written")
        return t
    if kind == "graph":
        return _decode_graph(attr["graph"], None, str(attr["class_name"]))
    raise ValueError(f"unknown attribute kind {kind!r}")


def _decode_target(op: str, target: Any) -> Any:
    if op == "output":
        if target != "output":
            raise ValueError(f"an output named {target!r}")
        return target
    if op == "placeholder":  # forward's parameter: `def forward(self, <target>)`
        if not isinstance(target, str):
            raise ValueError("an input that is not a name")
        runnable.identifier(target.removeprefix("**").removeprefix("*"), "input")
        return target
    if op in ("get_attr", "call_module"):
        return runnable.dotted(target, "attribute path")
    if op == "call_method":
        return runnable.identifier(target, "method")
    if "op" in target:
        namespace, _, name = str(target["op"]).partition("::")
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
            found = getattr(packet, str(target["overload"]) or "default")
        except (AttributeError, RuntimeError):
            raise ValueError(f"no operator {target['op']}") from None
        if not isinstance(found, torch._ops.OpOverload):
            raise ValueError(f"{target['op']} is not an operator")
        return found
    if "hop" in target:
        found = getattr(torch.ops.higher_order, str(target["hop"]), None)
        if not isinstance(found, torch._ops.HigherOrderOperator):
            raise ValueError(f"no higher-order operator {target['hop']}")
        return found
    return _function(str(target["module"]), str(target["qualname"]))


def _function(module: str, qualname: str) -> Any:
    """A function by name, from a module already imported among :data:`_FUNCTION_MODULES`."""
    if module.split(".")[0] not in _FUNCTION_MODULES or module not in sys.modules:
        raise ValueError(f"{module} is not an imported module functions may come from")
    value: Any = sys.modules[module]
    for part in qualname.split("."):
        if part.startswith("__"):
            raise ValueError(f"{module}.{qualname} is not a plain name")
        # a module's own namespace (its __getattr__ could import); a class of one of those
        # modules by attribute (a staticmethod is then the function itself)
        if isinstance(value, type(sys)):
            value = vars(value).get(part)
        elif isinstance(value, type):
            value = getattr(value, part, None)
        else:
            value = None
        if value is None:
            raise ValueError(f"{module}.{qualname} not found")
    if not callable(value):
        raise ValueError(f"{module}.{qualname} is not callable")
    return value


def _decode_arg(a: Any, env: dict[str, fx.Node]) -> Any:
    if a is None or type(a) in (bool, int, str):
        return a
    if type(a) is list:
        return [_decode_arg(x, env) for x in a]
    if type(a) is not dict or len(a) != 1:
        raise ValueError(f"an argument of unknown form {a!r}")
    (kind, value), = a.items()
    if kind == "node":
        if value not in env:
            raise ValueError(f"node {value} used before it is made")
        return env[value]
    if kind == "float":
        return float(value)
    if kind == "tuple":
        return tuple(_decode_arg(x, env) for x in value)
    if kind == "dict":
        return {str(k): _decode_arg(v, env) for k, v in value}
    if kind == "slice":
        return slice(*(_decode_arg(x, env) for x in value))
    if kind == "ellipsis":
        return Ellipsis
    table = {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _FORMATS}.get(kind)
    if table is not None:
        if value not in table:
            raise ValueError(f"unknown {kind} {value!r}")
        return table[value]
    if kind == "device":
        return torch.device(str(value))
    raise ValueError(f"an argument of unknown kind {kind!r}")


def _walk(root: Any, path: str) -> Any:
    value = root
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
