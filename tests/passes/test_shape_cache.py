"""The on-disk cache of annotate_shapes' observations (passes/shape_cache.py): a process that
compiles the same model again skips the fake-tensor runs and gets the same plan; anything the
annotations depend on changes the key; a bad file is ignored; VARUNA_FX_GRAPH_CACHE=0 is off.
(tests/conftest.py gives every test its own empty cache directory.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

import varuna_fx as vf
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.trace import capture
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.ir.nodes import info
from varuna_fx.passes import frontend, shape_cache
from varuna_fx.world.files import cache_dir

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
TOKENS = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_GRAPH_CACHE", raising=False)  # whatever the caller's shell has


def gpt(**changes: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CONFIG.__dict__, **changes}))


def compile_fresh(model: nn.Module, inputs: torch.Tensor = TOKENS[:, :-1]) -> vf.Pipeline:
    """A compile as a new process would do it: the in-memory capture cache forgotten."""
    frontend._CAPTURES.clear()
    return vf.compile(model, example_inputs=(inputs,), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)


def annotations(pipe: vf.Pipeline) -> list[tuple[str, dict]]:
    return [(n.name, {k: str(v) for k, v in asdict(info(n)).items()})
            for n in pipe.captured.gm.graph.nodes]


def key_of(model: nn.Module, inputs: torch.Tensor = TOKENS[:, :-1]) -> str | None:
    bound = bind_inputs(model, (inputs,))
    return shape_cache.graph_key(capture(model, bound).gm, bound)


def entries() -> list[Path]:
    return sorted(cache_dir("graphs").glob("*.json"))


def test_a_hit_gives_the_annotations_a_fresh_compile_gives() -> None:
    before = shape_cache.stats.copy()
    first = compile_fresh(gpt())
    assert shape_cache.stats["write"] == before["write"] + 1 and len(entries()) == 1
    second = compile_fresh(gpt())
    assert shape_cache.stats["hit"] == before["hit"] + 1
    assert annotations(second) == annotations(first)
    assert any(info(n).random for n in second.captured.gm.graph.nodes)  # dropout seen
    assert [s.code for s in second.stages] == [s.code for s in first.stages]


def test_what_the_annotations_depend_on_changes_the_key() -> None:
    base = key_of(gpt())
    assert base is not None and key_of(gpt()) == base
    torch.manual_seed(5)
    assert key_of(GPT(CONFIG)) == base  # other weights: the same shapes
    assert key_of(gpt(dropout=0.0)) != base  # Dropout(p=0) draws nothing: not random
    assert key_of(gpt(n_embd=24)) != base  # a Linear's size
    assert key_of(gpt(), TOKENS[:3, :-1]) != base  # an input shape
    assert key_of(gpt(), TOKENS[:, :-2]) != base
    assert key_of(gpt().double()) != base
    assert key_of(gpt().eval()) != base  # Dropout's mode
    frozen = gpt()
    frozen.ln_f.weight.requires_grad_(False)
    assert key_of(frozen) != base
    # and a changed model compiled after the original gets its own annotations
    compile_fresh(gpt())
    changed = compile_fresh(gpt(dropout=0.0))
    assert not any(info(n).random for n in changed.captured.gm.graph.nodes)


@fx.wrap
def user_scale(x: torch.Tensor) -> torch.Tensor:  # a leaf function fx does not look into
    return x * 2


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return user_scale(self.lin(x)).sum()


class Layer(nn.Module):
    """A built-in layer fx keeps as one call_module node."""

    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum()


def test_graphs_the_key_cannot_describe_are_not_cached() -> None:
    x = torch.randn(2, 4)
    assert key_of(Wrapped(), x) is None  # its body is not in the graph's code
    hooked = Wrapped()
    hooked.lin.register_forward_hook(lambda m, i, o: o)
    assert key_of(hooked, x) is None
    h = torch.randn(2, 3, 4)
    assert key_of(Layer(activation=user_scale), h) is None  # a built-in leaf calling user code
    assert None is not key_of(Layer(activation="gelu"), h) != key_of(Layer(), h)
    vf.compile(Wrapped(), example_inputs=(x,))
    assert entries() == []


def sealed_text(entry: dict) -> str:
    from varuna_fx.world.disk_cache import sealed
    return sealed(entry)


def test_a_bad_entry_is_ignored_and_rewritten() -> None:
    fresh = annotations(compile_fresh(gpt()))
    (path,) = entries()
    sealed = json.loads(path.read_text())
    good = sealed["entry"]
    wrong = json.loads(json.dumps(good))
    wrong["observed"][3][0]["dtypes"] = ["torch.notadtype"]  # the right key, a wrong value
    # a plausible edit that keeps the old digest: dropout's `random` flag turned off (with
    # recompute, forward and recompute would then draw different masks)
    edited = json.loads(json.dumps(good))
    flags = [o[0] for o in edited["observed"] if isinstance(o, list) and o and "random" in o[0]]
    flags[0]["random"] = not flags[0]["random"]
    for content in ["not json", "{}", json.dumps({"format": 1, "key": path.stem,
                                                  "nodes": [], "observed": []}),
                    json.dumps({"hmac": sealed["hmac"], "entry": edited}),
                    json.dumps({"sha256": "0" * 64, "entry": good}), sealed_text(wrong)]:
        path.write_text(content)
        ignored = shape_cache.stats["ignored"]
        assert annotations(compile_fresh(gpt())) == fresh
        assert shape_cache.stats["ignored"] == ignored + 1
        rewritten = json.loads(path.read_text())["entry"]
        assert rewritten["observed"][3][0]["dtypes"] != ["torch.notadtype"]
        assert rewritten == good


def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_FX_GRAPH_CACHE", "0")
    compile_fresh(gpt())
    assert not cache_dir("graphs").exists()


def test_the_newest_entries_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shape_cache.CACHE, "max_entries", 2)  # the service keeps the newest
    for when, key in enumerate(["a", "b", "c"], start=1):  # c is written last, now
        shape_cache.store(key, [], [])
        os.utime(cache_dir("graphs") / f"{key}.json", (when * 1e8, when * 1e8))
    assert [p.stem for p in entries()] == ["b", "c"]  # the oldest went when c was written


RESTART = """
import json, sys
import torch
import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.capture import capture_cache
from varuna_fx.passes import shape_cache
cfg = GPTConfig(**json.loads(sys.argv[1]))
torch.manual_seed(0)
with vf.skip_init(enabled=sys.argv[3] == "resume"):
    model = GPT(cfg)
tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1),
                       generator=torch.Generator().manual_seed(1))
pipe = vf.compile(model, example_inputs=(tokens[:, :-1],), loss_fn=lm_loss,
                  stages=int(sys.argv[2]), micro_batch_size=2)
if sys.argv[3] == "resume":
    pipe.load_checkpoint(sys.argv[4])
else:
    pipe.save_checkpoint(sys.argv[4])
loss = float(pipe.step(tokens[:, :-1], target=tokens[:, 1:]))
print(json.dumps({"stats": dict(shape_cache.stats), "captures": dict(capture_cache.stats),
                  "dynamo": "torch._dynamo" in sys.modules,
                  "plan": repr(pipe.plan), "code": [s.code for s in pipe.stages],
                  "loss": loss}))
"""


@pytest.mark.slow  # three fresh processes
def test_a_restarted_process_hits_and_never_imports_dynamo(tmp_path: Path) -> None:
    """The morph: compile + save; a new process compiles the same model (the same layout,
    then another), loads and steps without a fake-tensor run or torch._dynamo."""
    def run(stages: int, mode: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", RESTART, json.dumps(CONFIG.__dict__), str(stages), mode,
             str(tmp_path / "ckpt")],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")},
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run(2, "save")
    assert first["stats"] == {"miss": 1, "write": 1} and first["dynamo"]
    assert first["captures"] == {"miss": 1, "write": 1}
    again = run(2, "resume")
    assert again["stats"] == {"hit": 1} and not again["dynamo"]
    assert again["captures"] == {"hit": 1}  # nor traced (capture/capture_cache.py)
    assert (again["plan"], again["code"], again["loss"]) == \
        (first["plan"], first["code"], first["loss"])
    other = run(3, "resume")  # another layout: the key has none of it
    assert other["stats"] == {"hit": 1} and not other["dynamo"]
    assert other["captures"] == {"hit": 1}
    torch.testing.assert_close(other["loss"], first["loss"], rtol=1e-6, atol=1e-6)
