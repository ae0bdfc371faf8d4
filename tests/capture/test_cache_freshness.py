"""A cache returns only what a fresh compile would (issue 42 item 1): whatever global a forward
reads (a dict, a list, a nested container, a SimpleNamespace or dataclass config, a function
alias, an alias of a torch function, a tensor, an object whose attributes change, parsed
command-line flags, ``sys.argv``, a module used as a namespace), changing it between two
compiles gives the second one the graph of the changed value, never the cached one; what the
key cannot describe is captured each time. (tests/conftest.py: an empty cache per test.)"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from varuna_fx.capture import capture_cache
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.model_key import capture_key
from varuna_fx.capture.trace import capture


@dataclasses.dataclass
class Conf:
    scale: float = 2.0


class Holder:
    def __init__(self) -> None:
        self.scale = 2.0


class Slotted:  # no fields to read, a repr that shows only its address
    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale = 2.0


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


CFG: Any = None  # each case sets it to its global, then changes it
NAMESPACE = types.ModuleType("user_config")  # `import user_config` as a namespace of settings


class Reads(nn.Module):
    """Reads the global through the function ``READ`` (set per case) names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.fc(x))


def _apply(h: torch.Tensor) -> torch.Tensor:
    return READ(h)


READ: Callable[[torch.Tensor], torch.Tensor] = double


def _set_namespace(value: float) -> None:
    NAMESPACE.scale = value


# (name, the global's first value, its changed value, how forward uses it)
CASES: dict[str, tuple[Any, Any, Callable[[torch.Tensor], torch.Tensor]]] = {
    "dict": ({"scale": 2.0}, {"scale": 3.0}, lambda h: h * CFG["scale"]),
    "list": ([1.0, 2.0], [1.0, 3.0], lambda h: h * CFG[1]),
    "nested": ({"a": [{"b": (2.0,)}]}, {"a": [{"b": (3.0,)}]}, lambda h: h * CFG["a"][0]["b"][0]),
    "namespace": (types.SimpleNamespace(scale=2.0), types.SimpleNamespace(scale=3.0),
                  lambda h: h * CFG.scale),
    "dataclass": (Conf(2.0), Conf(3.0), lambda h: h * CFG.scale),
    "function alias": (double, triple, lambda h: CFG(h)),
    "torch function alias": (torch.relu, torch.sigmoid, lambda h: CFG(h)),
    "tensor": (torch.ones(4), torch.full((4,), 2.0), lambda h: h + CFG),
    "parsed flags": (argparse.Namespace(act="relu"), argparse.Namespace(act="tanh"),
                     lambda h: h.relu() if CFG.act == "relu" else h.tanh()),
}


def compile_graph(model: nn.Module, x: torch.Tensor) -> tuple[Any, str | None]:
    """What vf.compile's front end does: the cache on a key, else capture and store."""
    bound = bind_inputs(model, (x,))
    key = capture_key(model, bound, "fx")
    got = capture_cache.load(key, model, bound) if key is not None else None
    if got is None:
        got = capture(model, bound, "fx")
        if key is not None:
            capture_cache.store(key, got, model)
    return got, key


def check_fresh(monkeypatch: pytest.MonkeyPatch, read: Callable[[torch.Tensor], torch.Tensor],
                change: Callable[[], None]) -> tuple[str | None, str | None]:
    monkeypatch.setattr(sys.modules[__name__], "READ", read)
    torch.manual_seed(0)
    model, x = Reads(), torch.randn(2, 4)
    first, key = compile_graph(model, x)
    torch.testing.assert_close(first.gm(x)[0], model(x))
    change()
    second, again = compile_graph(model, x)
    # the cached graph, if one was served, must compute what the changed model computes
    torch.testing.assert_close(second.gm(x)[0], model(x))
    return key, again


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_cache_returns_only_what_a_fresh_compile_would(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first, changed, read = CASES[kind]
    monkeypatch.setattr(sys.modules[__name__], "CFG", first)
    key, again = check_fresh(monkeypatch, read, lambda: monkeypatch.setattr(
        sys.modules[__name__], "CFG", changed))
    assert key is not None and again is not None and again != key


def test_an_object_whose_attributes_change(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = Holder()
    monkeypatch.setattr(sys.modules[__name__], "CFG", holder)
    key, again = check_fresh(monkeypatch, lambda h: h * CFG.scale,
                             lambda: setattr(holder, "scale", 3.0))
    assert key is not None and again != key


def test_a_tensor_changed_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    bias = torch.ones(4)
    monkeypatch.setattr(sys.modules[__name__], "CFG", bias)
    key, again = check_fresh(monkeypatch, lambda h: h + CFG, lambda: bias.mul_(3))
    assert key is not None and again != key


def test_a_restart_with_other_command_line_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "--double"])
    key, again = check_fresh(monkeypatch, lambda h: h * 2 if "--double" in sys.argv else h,
                             lambda: monkeypatch.setattr(sys, "argv", ["train.py"]))
    assert key is not None and again != key


def test_a_module_used_as_a_namespace_of_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_namespace(2.0)
    monkeypatch.setattr(sys.modules[__name__], "CFG", NAMESPACE)
    key, again = check_fresh(monkeypatch, lambda h: h * CFG.scale,
                             lambda: _set_namespace(3.0))
    assert key is not None and again != key


def test_what_the_key_cannot_describe_is_captured_each_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slotted = Slotted()
    monkeypatch.setattr(sys.modules[__name__], "CFG", slotted)
    writes = capture_cache.stats["write"]
    key, again = check_fresh(monkeypatch, lambda h: h * CFG.scale,
                             lambda: setattr(slotted, "scale", 3.0))
    assert key is None and again is None and capture_cache.stats["write"] == writes
    # so is a torch generator (its state is not a value the key can hold)
    monkeypatch.setattr(sys.modules[__name__], "CFG", torch.Generator().manual_seed(0))
    monkeypatch.setattr(sys.modules[__name__], "READ",
                        lambda h: h + torch.rand(h.shape[-1], generator=CFG))
    model = Reads()
    assert capture_key(model, bind_inputs(model, (torch.randn(2, 4),)), "fx") is None


def test_an_unchanged_global_still_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "CFG", {"scale": 2.0})
    hits = capture_cache.stats["hit"]
    key, again = check_fresh(monkeypatch, lambda h: h * CFG["scale"], lambda: None)
    assert key is not None and again == key and capture_cache.stats["hit"] == hits + 1
