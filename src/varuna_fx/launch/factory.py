"""``--model package.module:function`` on the command line: import and return the factory."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def load_factory(spec: str) -> Any:
    """'package.module:function' -> function() (returns model, example inputs[, ...])."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--model {spec!r}: write module:function, e.g. mypkg.models:make_gpt")
    sys.path.insert(0, ".")
    return getattr(importlib.import_module(module_name), attr)
