"""vf.compile of a vf.deferred_init model allocates nothing by itself (issue 30 item 11): a
one-process pipeline allocates its tensors when it first needs them, with the values
vf.materialize gives, and refuses with the numbers when this process cannot hold them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import varuna_fx as vf
import varuna_fx.init.allocation as allocation
from support.deferred import batch, deferred_gpt
from tiers import tiered
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _meta(model: torch.nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_compiling_a_big_deferred_model_allocates_nothing_and_too_little_memory_is_refused(
        monkeypatch: pytest.MonkeyPatch):
    with vf.deferred_init(seed=0):  # 0.71 B parameters: 2.8 GB of fp32 if allocated
        model = GPT(GPTConfig(n_layer=12, n_embd=2048, n_head=16, vocab_size=50304,
                              block_size=64))
    before = _rss_mib()
    pipe = vf.compile(model, example_inputs=(torch.zeros(2, 64, dtype=torch.long),),
                      loss_fn=lambda out, _: out.sum(), stages=2)
    grown = _rss_mib() - before
    assert grown < 300, f"compile grew RSS by {grown:.0f} MiB"
    assert _meta(model) and "def forward" in pipe.stages[0].code  # planned, code readable
    needed = 4 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(allocation, "available_memory",
                        lambda device: (1 << 30, "a test's limit"))
    with pytest.raises(vf.AllocationError, match=r"(?s)2\.\d\d GiB \([\d,]+ bytes\).*"
                       r"1\.00 GiB \(1,073,741,824 bytes\) \(a test's limit\).*2 ranks") as e:
        pipe.parameters()
    assert e.value.needed == needed and e.value.available == 1 << 30
    with pytest.raises(vf.AllocationError):  # refused again, not half-allocated
        pipe.step(torch.zeros(2, 64, dtype=torch.long))
    assert _meta(model)


def _optimizer(pipe: vf.Pipeline, _: Path) -> Any:
    return pipe.optimizer(torch.optim.SGD, lr=0.1)


def _load_checkpoint(pipe: vf.Pipeline, tmp: Path) -> Any:
    x, _ = batch()
    source = vf.compile(vf.materialize(deferred_gpt()), example_inputs=(x,), loss_fn=lm_loss,
                        stages=1)
    source.save_checkpoint(str(tmp / "ck"))
    return pipe.load_checkpoint(str(tmp / "ck"))


USES: dict[str, Callable[[vf.Pipeline, Path], Any]] = {
    "step": lambda pipe, _: pipe.step(batch()[0], target=batch()[1]),
    "forward": lambda pipe, _: pipe(batch()[0]),
    "parameters": lambda pipe, _: list(pipe.parameters()),
    "named_parameters": lambda pipe, _: dict(pipe.named_parameters()),
    "state_dict": lambda pipe, _: pipe.state_dict(),
    "optimizer": _optimizer,
    "load_checkpoint": _load_checkpoint,
}


@pytest.mark.parametrize("use", tiered(USES, ["step", "parameters"]))
def test_the_first_use_allocates_the_values_materialize_gives(use: str, tmp_path: Path):
    want = {k: v for k, v in vf.materialize(deferred_gpt()).state_dict().items()
            if k != "lm_head.weight"}
    model = deferred_gpt()
    pipe = vf.compile(model, example_inputs=(batch()[0],), loss_fn=lm_loss, stages=2)
    assert _meta(model)
    USES[use](pipe, tmp_path)
    assert not _meta(model) and model.lm_head.weight is model.wte.weight
    for stage in pipe.stages:  # the stages run the model's own (now real) tensors
        for name, p in stage.module.named_parameters():
            assert not p.is_meta, name
    got = pipe.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_two_pipelines_of_one_deferred_model_share_its_allocation():
    x, y = batch()
    eager = vf.materialize(deferred_gpt())
    loss = lm_loss(eager(x), y)
    loss.backward()
    model = deferred_gpt()
    first = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2)
    second = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3)
    torch.testing.assert_close(first.step(x, target=y), loss.detach())
    first.zero_grad()
    torch.testing.assert_close(second.step(x, target=y), loss.detach())
    assert dict(first.named_parameters()).keys() == dict(second.named_parameters()).keys()
    for (n, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert a is b, n  # one model, one set of tensors


def test_an_edit_before_the_first_use_is_still_refused():
    x, y = batch()
    model = deferred_gpt()
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2)
    fc = model.h[1].fc
    model.h[1].fc = torch.nn.Linear(fc.in_features, fc.out_features, dtype=torch.float64)
    with pytest.raises(vf.InputError, match="h.1.fc is not the submodule"):
        pipe.step(x, target=y)

