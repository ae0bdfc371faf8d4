"""vf.skip_init: a model built without initialisation trains only once its tensors are loaded.

(The exact resume of such a model is in checkpoint/test_save_load.py and, on ranks, in
checkpoint/test_save_load_on_ranks.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
TOKENS = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
INIT_NAMES = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
              "trunc_normal_", "orthogonal_")


def compile_gpt(model: nn.Module) -> vf.Pipeline:
    return vf.compile(model, example_inputs=(TOKENS[:, :-1],), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)


def step(pipe: vf.Pipeline) -> torch.Tensor:
    return pipe.step(TOKENS[:, :-1], target=TOKENS[:, 1:])


def test_forgetting_to_load_raises_naming_the_tensors() -> None:
    with vf.skip_init():
        model = GPT(CONFIG)
    pipe = compile_gpt(model)
    with pytest.raises(vf.UninitializedError, match=r"never loaded: wte\.weight, wpe\.weight.*"
                       r"pipe\.load_checkpoint"):
        step(pipe)
    with pytest.raises(vf.UninitializedError, match="skip_init"):
        pipe(TOKENS[:, :-1])  # evaluation too
    # a state dict loaded through the pipeline fills them: it trains as the eager model does
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    pipe.load_state_dict(reference.state_dict())
    loss = step(pipe)
    torch.testing.assert_close(loss, lm_loss(reference(TOKENS[:, :-1]), TOKENS[:, 1:]))


def test_a_partial_load_still_raises_for_the_rest() -> None:
    with vf.skip_init():
        model = GPT(CONFIG)
    pipe = compile_gpt(model)
    state = GPT(CONFIG).state_dict()
    pipe.load_state_dict({k: v for k, v in state.items() if not k.startswith("h.1.")},
                         strict=False)
    with pytest.raises(vf.UninitializedError, match=r"h\.1\.") as caught:
        step(pipe)
    assert "wte.weight" not in str(caught.value)


class Odd(nn.Module):
    """Tensors initialised around the module's own parameters: a plain tensor wrapped into a
    Parameter after init, and a buffer no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(nn.init.normal_(torch.empty(4, 4)))  # another tensor object
        self.register_buffer("rot", nn.init.uniform_(torch.empty(4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.w) * self.rot).sum()


def test_wrapped_tensors_and_unsaved_buffers_are_caught() -> None:
    with vf.skip_init():
        model = Odd()
    pipe = vf.compile(model, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(vf.UninitializedError, match=r"2 parameter.*: w, rot"):
        pipe.step(torch.randn(2, 4))
    pipe.load_state_dict({"w": torch.randn(4, 4)})  # the non-persistent buffer stays unset
    with pytest.raises(vf.UninitializedError, match=r"1 parameter.*: rot\. .*persistent=False"):
        pipe.step(torch.randn(2, 4))


def test_disabled_is_a_no_op() -> None:
    originals = {n: getattr(nn.init, n) for n in INIT_NAMES}
    with vf.skip_init(enabled=False):
        assert all(getattr(nn.init, n) is f for n, f in originals.items())
        torch.manual_seed(3)
        model = GPT(CONFIG)
    torch.manual_seed(3)
    for (name, a), b in zip(model.state_dict().items(), GPT(CONFIG).state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    step(compile_gpt(model))  # nothing marked


def test_init_functions_are_restored_even_after_an_error() -> None:
    originals = {n: getattr(nn.init, n) for n in INIT_NAMES}
    with pytest.raises(RuntimeError, match="while building"):
        with vf.skip_init():
            assert all(getattr(nn.init, n) is not f for n, f in originals.items())
            with vf.skip_init():  # nested: still skipping after the inner one ends
                pass
            t = torch.zeros(3)
            assert nn.init.uniform_(t, 1, 2) is t and bool((t == 0).all())
            assert bool((nn.init.ones_(t) == 1).all())  # deterministic fills still run
            raise RuntimeError("while building")
    assert all(getattr(nn.init, n) is f for n, f in originals.items())
    assert bool((nn.init.uniform_(torch.zeros(3), 1, 2) >= 1).all())


def test_other_threads_still_initialise() -> None:
    inside, done = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []

    def other() -> None:
        inside.wait()
        seen.append(nn.init.uniform_(torch.zeros(3), 1, 2))  # while the main thread skips
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with vf.skip_init():
        inside.set()
        assert done.wait(30)
        skipped = nn.init.uniform_(torch.zeros(3), 1, 2)
    thread.join()
    assert bool((seen[0] >= 1).all()) and bool((skipped == 0).all())
