"""Nothing a cache entry names can act (issue 42 item 2). Each probe plants an entry a compile
would find and checks that it is ignored (a fresh capture) and never acted on:

* an edited entry re-sealed with a plain SHA-256 (the old seal anyone could recompute), or
  sealed by another user's key: entries are bound to their writer (``world/disk_cache.py``);
* even sealed with this user's key (a key that leaked): a graph reaching ``Tensor.numpy``,
  ``getattr(..., "tofile")`` and ``operator.call`` to write a file; a line break in a module
  path, a stack trace, a keyword, a method name or an annotation, which would become a line of
  ``pipe.stages[s].code`` (``capture/runnable.py``);
* the key file: created mode 0600 where ``$VARUNA_FX_CACHE_KEY`` says (tests never touch the
  real ~/.config), replaced when others could read it, refused inside the cache folder.
"""

from __future__ import annotations

import copy
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.capture import capture_cache, runnable
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.model_key import capture_key
from varuna_fx.capture.trace import capture
from varuna_fx.passes import frontend
from varuna_fx.world import disk_cache
from varuna_fx.world.files import cache_dir


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


X = torch.randn(2, 4)


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_GRAPH_CACHE", raising=False)


def compile_graph(model: nn.Module) -> Any:
    bound = bind_inputs(model, (X,))
    key = capture_key(model, bound, "fx")
    got = capture_cache.load(key, model, bound)
    if got is None:
        got = capture(model, bound, "fx")
        capture_cache.store(key, got, model)
    return got


def planted(change: Callable[[dict[str, Any]], None], seal: Callable[[dict], str] | None = None
            ) -> Path:
    """The entry of Small, changed by ``change`` and sealed (by default with this user's
    key: the strongest attacker, one who has it)."""
    torch.manual_seed(0)
    compile_graph(Small())
    (path,) = cache_dir("captures").glob("*.json")
    entry = copy.deepcopy(disk_cache.unsealed(path.read_text()))
    change(entry["captured"]["graph"])
    path.write_text((seal or disk_cache.sealed)(entry))
    return path


def must_be_ignored(path: Path) -> None:
    ignored = capture_cache.stats["ignored"]
    with pytest.warns(disk_cache.CacheWarning, match="ignoring the capture cache file"):
        got = compile_graph(Small())
    assert capture_cache.stats["ignored"] == ignored + 1
    got.gm(X)  # the graph a compile runs is the fresh one
    assert "numpy" not in got.gm.code and "import" not in got.gm.code


def _node(graph: dict, op: str) -> dict:
    return next(n for n in graph["nodes"] if n["op"] == op)


def _write_a_file(target: Path) -> Callable[[dict], None]:
    def change(graph: dict) -> None:
        out = graph["nodes"].pop()  # the output node stays last
        graph["nodes"] += [
            {"op": "call_method", "name": "as_array", "target": "numpy",
             "args": {"tuple": [{"node": "x"}]}, "kwargs": {"dict": []}},
            {"op": "call_function", "name": "tofile", "target": {"module": "builtins",
                                                                 "qualname": "getattr"},
             "args": {"tuple": [{"node": "as_array"}, "tofile"]}, "kwargs": {"dict": []}},
            {"op": "call_function", "name": "wrote",
             "target": {"module": "_operator", "qualname": "call"},
             "args": {"tuple": [{"node": "tofile"}, str(target)]}, "kwargs": {"dict": []}},
            out]
    return change


def test_a_graph_that_writes_a_file_is_never_run(tmp_path: Path) -> None:
    target = tmp_path / "written"
    must_be_ignored(planted(_write_a_file(target)))
    assert not target.exists()


def test_a_plain_digest_or_another_users_key_does_not_seal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def plain(entry: dict) -> str:  # the old seal: a SHA-256 anyone can recompute
        import hashlib
        body = json.dumps(entry, sort_keys=True)
        return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "entry": entry})

    must_be_ignored(planted(lambda g: None, seal=plain))

    def another_user(entry: dict) -> str:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VARUNA_FX_CACHE_KEY", str(tmp_path / "theirs" / "cache.key"))
            return disk_cache.sealed(entry)

    must_be_ignored(planted(lambda g: None, seal=another_user))


def _set(op: str, field: str, value: Any) -> Callable[[dict], None]:
    def change(graph: dict) -> None:
        _node(graph, op)[field] = value
    return change


@pytest.mark.parametrize("change", [
    _set("call_module", "module_stack", [["fc", "fc\nimport os", "torch.nn.Linear"]]),
    _set("call_module", "module_stack", [["fc", "fc", "Linear\nimport os"]]),
    _set("call_module", "stack_trace", '  File "m.py", line 1, in forward\nimport os\n'),
    _set("call_method", "target", "relu\nimport os"),
    _set("call_method", "target", "numpy"),
    _set("call_method", "kwargs", {"dict": [["a\nimport os", 1]]}),
    _set("placeholder", "type", {"text": "torch.Tensor\nimport os"}),
    _set("call_module", "rebinds", "fc\nimport os"),
    _set("call_module", "target", "fc.__class__"),
], ids=["module path", "module type", "stack trace", "method name", "numpy method", "keyword",
        "annotation", "rebound name", "dunder path"])
def test_text_that_would_reach_generated_code_is_checked(change: Callable) -> None:
    must_be_ignored(planted(change))


def test_a_module_path_with_a_line_break_never_reaches_the_stage_code() -> None:
    path = planted(_set("call_module", "module_stack",
                        [["fc", "fc\nimport os  # planted", "torch.nn.Linear"]]))
    frontend._CAPTURES.clear()
    with pytest.warns(disk_cache.CacheWarning):
        pipe = vf.compile(Small(), example_inputs=(X,), stages=1, tracer="fx")
    assert "planted" not in pipe.stages[0].code and path.exists()


def test_what_a_graph_may_call_is_side_effect_free_tensor_code() -> None:
    import operator

    check = runnable.check_runnable
    for ok in [("call_function", torch.add, ()), ("call_function", operator.getitem, ()),
               ("call_function", getattr, (None, "shape")), ("call_method", "view", ()),
               ("call_function", torch.ops.aten.add.Tensor, ())]:
        assert check(*ok) == "", ok
    for bad in [("call_function", operator.call, ()),
                ("call_function", torch.Tensor.numpy, ()), ("call_method", "numpy", ()),
                ("call_function", getattr, (None, "tofile")),
                ("call_function", getattr, (None, "view")),  # a method, never its value
                ("call_function", getattr, (None, "grad_fn")),
                ("call_function", torch.from_file, ()), ("call_function", torch.from_numpy, ()),
                ("call_function", torch.ops.aten.from_file.default, ()),
                ("call_method", "register_hook", ()), ("call_method", "backward", ()),
                ("call_method", "share_memory_", ()), ("call_method", "untyped_storage", ())]:
        assert check(*bad), bad


def test_the_key_file_is_private_and_outside_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "config" / "cache.key"
    monkeypatch.setenv("VARUNA_FX_CACHE_KEY", str(key_file))
    monkeypatch.setattr(disk_cache, "_KEYS", {})
    key = disk_cache.seal_key()
    assert key and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert disk_cache.seal_key() == key  # read once per process

    os.chmod(key_file, 0o644)  # others could have read it: a new one
    monkeypatch.setattr(disk_cache, "_KEYS", {})
    with pytest.warns(disk_cache.CacheWarning, match="readable by you alone"):
        again = disk_cache.seal_key()
    assert again and again != key and stat.S_IMODE(key_file.stat().st_mode) == 0o600

    key_file.unlink()
    key_file.symlink_to(tmp_path / "elsewhere")  # a link someone placed: replaced, not followed
    monkeypatch.setattr(disk_cache, "_KEYS", {})
    with pytest.warns(disk_cache.CacheWarning):
        assert disk_cache.seal_key()
    assert not key_file.is_symlink() and not (tmp_path / "elsewhere").exists()

    inside = Path(os.environ["VARUNA_FX_CACHE_DIR"]) / "cache.key"
    monkeypatch.setenv("VARUNA_FX_CACHE_KEY", str(inside))
    monkeypatch.setattr(disk_cache, "_KEYS", {})
    with pytest.warns(disk_cache.CacheWarning, match="inside the cache folder"):
        assert disk_cache.seal_key() is None
    model = Small()  # no key: nothing on disk, and a compile still works
    compile_graph(model)
    assert not cache_dir("captures").exists() and not inside.exists()


def test_the_default_key_is_under_the_users_config(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("VARUNA_FX_CACHE_KEY")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert disk_cache.key_path() == tmp_path / "varuna_fx" / "cache.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert disk_cache.key_path() == Path.home() / ".config" / "varuna_fx" / "cache.key"
