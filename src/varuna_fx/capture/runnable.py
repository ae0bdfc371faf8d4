"""What a graph read back from disk may run, and what text of it may reach generated code.

A cached graph (``graph_json``) is data someone could have edited. Reading it runs no code, but
the graph it gives runs when the pipeline does, and its strings end up in the stages' source
(``pipe.stages[s].code``). Both are allow-lists, so that nothing an entry names can act:

* **calls**: side-effect-free tensor operations only. A function must be one of torch's
  tensor functions (its overridable and native functions), an arithmetic, comparison or
  indexing function of ``operator``, ``math``'s, a few pure builtins or capture's own
  write-back helpers, and not one of :data:`_ACTING` (anything that converts to numpy, reads
  or writes files, installs hooks, runs backward, shares memory, prints: ``Tensor.numpy``,
  ``torch.from_file``, ``operator.call``...). A method must be a public ``torch.Tensor``
  method, not one of those either. An operator must be ``aten``'s or ``prims``' (a user's
  custom op could do anything), a higher-order operator one of :data:`_HIGHER_ORDER`.
  ``getattr`` reads only the attributes of :func:`attributes` (a tensor's ``shape``,
  ``dtype``, ``T``...; a device's ``type``; the fields of torch's named results), never a
  method, so no chain of attribute reads reaches a callable or a module's globals.
* **text**: node names and method names are identifiers; attribute paths are dotted
  identifiers; module paths, type names, annotations and stack traces hold no line break
  or other unprintable character (a stack trace's lines are its ``File`` lines and indented
  code), so none of
  it can become a statement line of generated code.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import keyword
import math
import operator
import re
from typing import Any

import torch

from . import mutations

# converts to numpy, reads or writes files, hooks, backward, shares memory, prints, pickles
_ACTING = frozenset({
    "numpy", "from_numpy", "from_file", "tofile", "save", "load", "_print",
    "__dlpack__", "__dlpack_device__", "__reduce__", "__reduce_ex__", "__setstate__",
    "__getstate__", "__deepcopy__", "__get__", "backward", "grad", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "share_memory_", "is_shared",
    "storage", "untyped_storage", "_typed_storage", "storage_type", "module_load", "apply_",
    "map_", "map2_", "pin_memory", "_pin_memory", "record_stream", "set_", "data_ptr",
    "const_data_ptr", "as_subclass", "_make_subclass", "_make_wrapper_subclass",
    "_cufft_set_plan_cache_max_size", "call", "methodcaller", "attrgetter", "itemgetter",
})
# operator's functions a traced graph calls: arithmetic, comparison, indexing (never `call`)
_OPERATORS = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos", "abs",
    "invert", "inv", "lshift", "rshift", "and_", "or_", "xor", "not_", "truth", "eq", "ne",
    "lt", "le", "gt", "ge", "getitem", "setitem", "contains", "concat", "index", "is_",
    "is_not", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
    "iand", "ior", "ixor", "ilshift", "irshift")
_PURE_BUILTINS = ("getattr", "len", "int", "float", "bool", "abs", "min", "max", "round",
                  "pow", "divmod", "range", "slice", "tuple", "list", "isinstance")
_OPERATOR_NAMESPACES = ("aten", "prims")
_HIGHER_ORDER = frozenset({
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "cond", "while_loop", "map_impl",
    "scan", "associative_scan", "invoke_subgraph", "flex_attention"})


@functools.lru_cache(maxsize=1)
def allowed_functions() -> frozenset[int]:
    """The ids of the functions a graph read back may call."""
    functions = [f for fs in torch.overrides.get_overridable_functions().values() for f in fs]
    native = [n for n in dir(torch._C._VariableFunctions) if not n.startswith("__")]
    functions += [getattr(torch._C._VariableFunctions, n) for n in native]
    functions += [getattr(torch, n) for n in native if callable(getattr(torch, n, None))]
    functions = [f for f in functions if getattr(f, "__name__", "") not in _ACTING]
    functions += [getattr(operator, n) for n in _OPERATORS]
    functions += [f for f in vars(math).values() if callable(f)]
    functions += [getattr(builtins, n) for n in _PURE_BUILTINS]
    functions += [mutations.after_write, mutations.setitem_value]
    return frozenset(id(f) for f in functions)


@functools.lru_cache(maxsize=1)
def attributes() -> frozenset[str]:
    """The attributes ``getattr`` may read: values, never methods."""
    names = {n for n in dir(torch.Tensor) if not n.startswith("_")
             and not callable(inspect.getattr_static(torch.Tensor, n))}
    names -= {"grad_fn"}  # an autograd node: its hooks would be in reach
    names |= {"type", "index"}  # a device's
    names |= {"is_floating_point", "is_complex", "is_signed", "itemsize"}  # a dtype's
    for kind in vars(torch.return_types).values():  # torch.max(...).values and the like
        if isinstance(kind, type) and hasattr(kind, "n_fields"):
            names |= {n for n in dir(kind) if not n.startswith("_") and n not in
                      ("count", "index", "n_fields", "n_sequence_fields", "n_unnamed_fields")}
    return frozenset(names)


@functools.lru_cache(maxsize=1)
def _methods() -> frozenset[str]:
    return frozenset(n for n in dir(torch.Tensor) if not n.startswith("_") and n not in _ACTING
                     and callable(inspect.getattr_static(torch.Tensor, n)))


def check_runnable(op: str, target: Any, args: Any) -> str:
    """Why a node could run something other than side-effect-free tensor code ("" if not)."""
    if op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            namespace, _, name = target._schema.name.partition("::")
            if namespace not in _OPERATOR_NAMESPACES or name.split(".")[0] in _ACTING:
                return f"calls operator {target._schema.name}, not one of aten's tensor operators"
            return ""
        if isinstance(target, torch._ops.HigherOrderOperator):
            if target.name() not in _HIGHER_ORDER:
                return f"calls higher-order operator {target.name()!r}, not a known one"
            return ""
        if id(target) not in allowed_functions():
            return f"calls {getattr(target, '__name__', target)!r}, not a tensor function"
        if target is getattr and not (len(args) >= 2 and isinstance(args[1], str)
                                      and args[1] in attributes()):
            return "reads an attribute that is not a tensor's value"
    if op == "call_method" and str(target) not in _methods():
        return f"calls method {target!r}, not one of torch.Tensor's without side effects"
    return ""


# -- text that reaches generated code ------------------------------------------------------------

_DOTTED = re.compile(r"[A-Za-z_0-9]+(\.[A-Za-z_0-9]+)*")
_MODULE_PATH = re.compile(r"[\w.\[\]'\"@:-]*")  # no space, no line break
_TYPE_NAME = re.compile(r"[\w.<>]+")
_ANNOTATION = re.compile(r"[\w.\[\], |]+")
MAX_TEXT = 100_000


def identifier(text: Any, what: str) -> str:
    """``text`` when it is a Python identifier (not a keyword); ValueError otherwise."""
    if not isinstance(text, str) or not text.isidentifier() or keyword.iskeyword(text):
        raise ValueError(f"{what} {text!r} is not an identifier")
    return text


def dotted(text: Any, what: str) -> str:
    """``text`` when it is a dotted path of names (``h.0.attn``), none of them a dunder (a way
    to an object's class and globals); ValueError otherwise."""
    if not isinstance(text, str) or not _DOTTED.fullmatch(text) or "__" in text:
        raise ValueError(f"{what} {text!r} is not a dotted name")
    return text


def module_path(text: Any) -> str:
    if not isinstance(text, str) or not _MODULE_PATH.fullmatch(text):
        raise ValueError(f"module path {text!r} is not a path of names")
    return text


def type_name(text: Any) -> str:
    if not isinstance(text, str) or not _TYPE_NAME.fullmatch(text):
        raise ValueError(f"type name {text!r} is not a dotted name")
    return text


def annotation(text: Any) -> str:
    if not isinstance(text, str) or not _ANNOTATION.fullmatch(text):
        raise ValueError(f"annotation {text!r} is not a type expression")
    return text


def stack_trace(text: Any) -> str:
    """A traceback's text: printable lines, each a ``File "..."`` line or beginning with a
    space (the code), so no line of it can stand alone in generated code."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise ValueError("a stack trace that is not text")
    for line in text.split("\n"):
        if line and (not line.isprintable() or not line.startswith((" ", 'File "'))):
            raise ValueError(f"a stack trace line {line[:80]!r} that is not a traceback's")
    return text
