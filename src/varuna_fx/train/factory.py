"""``--model package.module:function`` on the command line: import and return the factory."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..errors import InputError


def load_factory(spec: str) -> Any:
    """'package.module:function' -> function() (returns model, example inputs[, ...]). A
    module that cannot be found or a name it lacks is an ``InputError`` saying which (the
    command prints it without a traceback); an error raised *inside* the module is its own."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--model {spec!r}: write module:function, e.g. mypkg.models:make_gpt")
    if "." not in sys.path and "" not in sys.path:
        sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the module was found; something it imports is missing
        raise InputError(f"--model {spec!r}: no module named {exc.name!r} (looked in the "
                         "current folder and the installed packages: run from the folder "
                         "that holds it, or add that folder to PYTHONPATH)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError(f"--model {spec!r}: module {module_name!r} has no function {attr!r}"
                         + ("" if factory is None else f" ({attr} is a "
                                                        f"{type(factory).__name__})"))
    return factory
