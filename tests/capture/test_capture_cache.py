"""Captured graphs on disk (capture/capture_cache.py, graph_json.py, model_key.py): a graph read
back is the graph captured (code, output structure, the model's own tensors) and runs as eager;
a compile that finds one skips tracing and gives the same pipeline; anything the graph depends
on changes the key; a stale, edited or hostile entry is ignored and never runs code.
(tests/conftest.py gives every test its own empty cache directory.)"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import varuna_fx as vf
from support.hf_zoo import ZOO
from support.registry import CASES
from varuna_fx.capture import capture_cache, graph_json, model_key
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.trace import capture
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.passes import frontend
from varuna_fx.world.disk_cache import sealed, unsealed
from varuna_fx.world.files import cache_dir

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
TOKENS = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_GRAPH_CACHE", raising=False)


def gpt(**changes: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CONFIG.__dict__, **changes}))


def compile_fresh(model: nn.Module) -> vf.Pipeline:
    """As a new process would compile: the in-memory captures forgotten."""
    frontend._CAPTURES.clear()
    return vf.compile(model, example_inputs=(TOKENS[:, :-1],), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)


def round_trip(model: nn.Module, inputs: object, tracer: str = "auto") -> tuple:
    bound = bind_inputs(model, inputs)
    fresh = capture(model, bound, tracer)
    data = json.loads(json.dumps(graph_json.encode_captured(fresh, model)))  # as on disk
    return fresh, graph_json.decode_captured(data, model, bound)


def entries() -> list[Path]:
    return sorted(cache_dir("captures").glob("*.json"))


def key(model: nn.Module, inputs: object = (TOKENS[:, :-1],), tracer: str = "auto") -> str | None:
    return model_key.capture_key(model, bind_inputs(model, inputs), tracer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_graph_read_back_is_the_graph_captured(name: str) -> None:
    case = CASES[name]
    fresh, read = round_trip(case.model, case.inputs, case.tracer)
    assert read.gm.code == fresh.gm.code and read.out_spec == fresh.out_spec
    assert read.tracer == fresh.tracer and read.input_names == fresh.input_names
    # the model's own parameters and buffers, not copies
    own = {id(t) for t in [*case.model.parameters(), *case.model.buffers()]}
    assert {id(t) for t in read.gm.parameters()} <= own
    args = case.inputs if isinstance(case.inputs, tuple) else tuple(case.inputs.values())
    torch.manual_seed(0)
    want = fresh.gm(*[a for a in args if isinstance(a, torch.Tensor)])
    torch.manual_seed(0)
    got = read.gm(*[a for a in args if isinstance(a, torch.Tensor)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow  # 18 torch.export captures
@pytest.mark.parametrize("name", sorted(ZOO))
def test_hugging_face_graphs_read_back_as_captured(name: str) -> None:
    model, inputs = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh, read = round_trip(model, inputs)
    assert read.gm.code == fresh.gm.code and read.out_spec == fresh.out_spec


def test_a_compile_that_finds_the_graph_skips_tracing_and_equals_a_fresh_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = capture_cache.stats.copy()
    first = compile_fresh(gpt())
    assert capture_cache.stats["write"] == before["write"] + 1 and len(entries()) == 1
    traced = []
    monkeypatch.setattr(frontend, "capture", lambda *a: traced.append(a))  # must not run
    model = gpt()
    second = compile_fresh(model)
    assert not traced and capture_cache.stats["hit"] == before["hit"] + 1
    assert [s.code for s in second.stages] == [s.code for s in first.stages]
    assert repr(second.plan) == repr(first.plan)
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]
    torch.testing.assert_close(second.step(x, target=y), first.step(x, target=y), rtol=0, atol=0)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    # the second pipeline trains the second model's own parameters
    assert {id(p) for _, p in second.named_parameters()} <= {id(p) for p in model.parameters()}


def test_a_second_compile_in_the_process_reuses_the_graph_without_tracing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = gpt()
    first = vf.compile(model, example_inputs=(TOKENS[:, :-1],), loss_fn=lm_loss, stages=2)
    monkeypatch.setattr(frontend, "capture", lambda *a: pytest.fail("traced again"))
    again = vf.compile(model, example_inputs=(TOKENS[:, :-1],), loss_fn=lm_loss, stages=1)
    assert again.captured is first.captured
    model.h[0].fc.weight = nn.Parameter(torch.zeros_like(model.h[0].fc.weight))  # another parameter object
    monkeypatch.setattr(frontend, "capture", capture)
    other = vf.compile(model, example_inputs=(TOKENS[:, :-1],), loss_fn=lm_loss, stages=1)
    assert other.captured is not first.captured


_FLAG = True


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.scale
        return y.relu() if _FLAG else y.tanh()


def test_what_the_graph_depends_on_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    x = (torch.randn(2, 4),)
    base = key(Flagged(), x)
    assert base is not None and key(Flagged(), x) == base  # other weights: the same key
    changed = Flagged()
    changed.scale = 3.0  # a plain attribute forward reads
    assert key(changed, x) != base
    monkeypatch.setattr(sys.modules[__name__], "_FLAG", False)  # a global forward reads
    assert key(Flagged(), x) != base
    monkeypatch.undo()
    monkeypatch.setattr(Flagged, "forward", lambda self, x: self.fc(x))  # other code
    assert key(Flagged(), x) != base
    monkeypatch.undo()
    assert key(Flagged(), (torch.randn(2, 5),)) != base  # other example shapes
    assert key(Flagged(), x, tracer="export") != base
    wider = Flagged()
    wider.fc = nn.Linear(4, 4, bias=False)  # other parameters
    assert key(wider, x) != base
    evaluating = Flagged().eval()
    assert key(evaluating, x) != base
    tied = GPT(CONFIG)
    untied = GPT(CONFIG)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert key(tied) != key(untied)
    assert key(gpt(n_head=4)) != key(gpt())  # a config value (the head count) in the code
    hooked = Flagged()
    hooked.fc.register_forward_hook(lambda *a: None)
    assert key(hooked, x) is None  # a hook's effect is not in the key: captured each time


@pytest.mark.slow  # two processes
def test_keys_are_the_same_in_another_process(tmp_path: Path) -> None:
    """The same program gives the same keys in another process (another string-hash salt, other
    addresses). Both run in fresh processes: a key covers every global the code reads, and
    Hugging Face keeps a registry of every model class a process has built, so this process,
    which built others before, has other keys for its models (another miss, never a wrong
    hit)."""
    import subprocess

    script = ("import sys; sys.path[:0] = sys.argv[1:3]\n"
              "from support.registry import registry\n"
              "from varuna_fx.capture.inputs import bind_inputs\n"
              "from varuna_fx.capture.model_key import capture_key\n"
              "print([capture_key(c.model, bind_inputs(c.model, c.inputs), c.tracer) "
              "for c in registry()])")
    tests = Path(__file__).parents[1]
    outputs = []
    for seed in ("7", "8"):
        run = subprocess.run([sys.executable, "-c", script, str(tests), str(tests / "support")],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": seed})
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.strip())
    assert "None" not in outputs[0] and outputs[0] == outputs[1]


def test_an_edited_source_file_makes_the_entry_stale(tmp_path: Path) -> None:
    path = tmp_path / "edited_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x).relu()
    """))
    spec = importlib.util.spec_from_file_location("edited_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["edited_model"] = module
    try:
        spec.loader.exec_module(module)
        x = torch.randn(4, 4)
        frontend._CAPTURES.clear()
        vf.compile(module.Model(), example_inputs=(x,), stages=1)
        before = capture_cache.stats.copy()
        frontend._CAPTURES.clear()
        vf.compile(module.Model(), example_inputs=(x,), stages=1)
        assert capture_cache.stats["hit"] == before["hit"] + 1
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
        frontend._CAPTURES.clear()
        vf.compile(module.Model(), example_inputs=(x,), stages=1)
        assert capture_cache.stats["stale"] == before["stale"] + 1
    finally:
        del sys.modules["edited_model"]


def _entry() -> tuple[Path, dict]:
    compile_fresh(gpt())
    (path,) = entries()
    return path, unsealed(path.read_text())


def _rewrite(path: Path, entry: dict, change: object) -> None:
    entry = copy.deepcopy(entry)
    change(entry["captured"]["graph"])
    path.write_text(sealed(entry))


def test_a_bad_entry_is_ignored_and_rewritten() -> None:
    path, entry = _entry()
    fresh = [s.code for s in compile_fresh(gpt()).stages]

    def call_function(graph: dict) -> dict:
        return next(n for n in graph["nodes"] if n["op"] == "call_function"
                    and "module" in n["target"])

    def other_shape(graph: dict) -> None:
        attr = next(a for a in graph["attrs"].values() if a["kind"] == "model" and "tensor" in a)
        attr["tensor"][0] = [s + 1 for s in attr["tensor"][0]]

    def hostile(graph: dict) -> None:  # a function reading it would run
        call_function(graph)["target"] = {"module": "os", "qualname": "system"}

    def not_imported(graph: dict) -> None:
        call_function(graph)["target"] = {"module": "torch.never_imported_module",
                                          "qualname": "f"}

    def dunder(graph: dict) -> None:
        call_function(graph)["target"] = {"module": "builtins", "qualname": "__import__"}

    def evaluating(graph: dict) -> None:  # found by name, but not a tensor function
        call_function(graph)["target"] = {"module": "builtins", "qualname": "eval"}

    def loading(graph: dict) -> None:  # torch's, but it unpickles a file
        call_function(graph)["target"] = {"module": "torch", "qualname": "load"}

    def dunder_method(graph: dict) -> None:  # a way to a module's globals
        node = next(n for n in graph["nodes"] if n["op"] == "call_method")
        node["target"] = "__reduce_ex__"

    for change in (other_shape, hostile, not_imported, dunder, evaluating, loading,
                   dunder_method):
        _rewrite(path, entry, change)
        ignored = capture_cache.stats["ignored"]
        assert [s.code for s in compile_fresh(gpt()).stages] == fresh
        assert capture_cache.stats["ignored"] == ignored + 1, change.__name__
        assert unsealed(path.read_text())["captured"] == entry["captured"]  # rewritten
    for text in ("not json", sealed({"format": 1}), json.dumps({"sha256": "0" * 64,
                                                                   "entry": entry})):
        path.write_text(text)
        ignored = capture_cache.stats["ignored"]
        assert [s.code for s in compile_fresh(gpt()).stages] == fresh
        assert capture_cache.stats["ignored"] == ignored + 1


def test_reading_never_imports_or_reaches_outside_the_allowed_modules() -> None:
    for module, name in (("os", "system"), ("subprocess", "run"), ("builtins", "__import__"),
                         ("torch", "__builtins__"), ("not_a_module_at_all", "f")):
        with pytest.raises(ValueError):
            graph_json._function(module, name)
    assert "not_a_module_at_all" not in sys.modules
    # what a graph read back may run: the tensor API only
    from varuna_fx.capture.runnable import check_runnable as runnable
    assert runnable("call_function", torch.nn.functional.linear, ()) == ""
    assert runnable("call_function", getattr, (None, "shape")) == ""
    assert runnable("call_method", "view", ()) == ""
    assert runnable("call_function", getattr, (None, "__globals__"))
    assert runnable("call_function", eval, ("1",)) and runnable("call_function", torch.load, ())
    assert runnable("call_method", "__reduce_ex__", ()) and runnable("call_method", "system", ())


def users_own(x: torch.Tensor) -> torch.Tensor:  # not torch's: named, it could be anything
    return x * 2


torch.fx.wrap("users_own")


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return users_own(self.fc(x)).sum()


def test_graphs_that_cannot_be_written_are_captured_each_time() -> None:
    before = capture_cache.stats.copy()
    frontend._CAPTURES.clear()
    vf.compile(Wrapped(), example_inputs=(torch.randn(2, 3),), stages=1, tracer="fx")
    assert capture_cache.stats["unwritable"] == before["unwritable"] + 1 and not entries()


def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_FX_GRAPH_CACHE", "0")
    compile_fresh(gpt())
    assert not cache_dir("captures").exists()
