"""vf.deferred_init / vf.materialize: models built on meta with their initialisers recorded,
materialised per stage with values that depend only on (seed, canonical FQN)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

# imported before any deferred_init block, as a model file would (issue 30)
from torch.nn.init import dirac_ as imported_dirac_
from torch.nn.init import orthogonal_ as imported_orthogonal_
from torch.nn.init import trunc_normal_ as imported_trunc_normal_

import varuna_fx as vf
from support.deferred import CFG, SEED, batch, deferred_gpt
from support.dist import launch_ok
from support.real_zoo import ZOO
from tiers import tiered
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.init.materialize import materialize_tensors


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent state under canonical names (the tied LM head is the embedding)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_materialize_allocates_every_tensor_ties_stay_one_and_buffers_equal_a_normal_build():
    model = deferred_gpt()
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert vf.materialize(model) is model
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.wte.weight
    normal = GPT(CFG).double()
    for (name, b), (_, want) in zip(model.named_buffers(), normal.named_buffers()):
        torch.testing.assert_close(b, want, rtol=0, atol=0, msg=name)
    # GPT-2's init: N(0, 0.02) weights, zero biases, unit LayerNorm weights
    assert abs(float(model.h[0].fc.weight.detach().std()) - 0.02) < 0.002
    assert not model.h[0].fc.bias.any() and bool((model.h[0].ln1.weight == 1).all())


def test_values_depend_on_seed_and_name_only():
    a, b = vf.materialize(deferred_gpt()), vf.materialize(deferred_gpt())
    for k, v in _state(a).items():
        torch.testing.assert_close(v, _state(b)[k], rtol=0, atol=0)
    other = vf.materialize(deferred_gpt(seed=SEED + 1))
    assert not torch.equal(other.h[0].fc.weight, a.h[0].fc.weight)
    # same-shaped tensors get different streams
    assert not torch.equal(a.h[0].fc.weight, a.h[1].fc.weight)
    # materialising a part gives the part's values whatever else is made
    part = deferred_gpt()
    made = materialize_tensors(part, ["h.2.fc.weight", "h.0.attn.qkv.bias"], torch.device("cpu"))
    assert set(made) == {"h.2.fc.weight", "h.0.attn.qkv.bias"} and part.h[1].fc.weight.is_meta
    torch.testing.assert_close(part.h[2].fc.weight, a.h[2].fc.weight, rtol=0, atol=0)
    vf.materialize(part)  # and the rest later gives the rest's
    for k, v in _state(part).items():
        torch.testing.assert_close(v, _state(a)[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("stages", tiered([1, 2, 3, 4], [1, 3]))
def test_every_stage_count_materialises_the_same_values_and_trains_like_eager(stages: int):
    x, y = batch()
    eager = vf.materialize(deferred_gpt())
    want = _state(eager)
    loss = lm_loss(eager(x), y)
    loss.backward()
    model = deferred_gpt()
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=stages,
                      micro_batch_size=2)
    got = pipe.state_dict()
    assert set(got) == set(want)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    torch.testing.assert_close(pipe.step(x, target=y), loss.detach())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, _grads(eager)[n], msg=n)
    assert model.lm_head.weight is model.wte.weight  # the user's model is materialised too


def test_sgd_steps_match_eager_on_the_materialised_model():
    x, y = batch()
    eager = vf.materialize(deferred_gpt())
    pipe = vf.compile(deferred_gpt(), example_inputs=(x,), loss_fn=lm_loss, stages=3)
    opts = [torch.optim.SGD(m, lr=0.1) for m in (eager.parameters(), pipe.parameters())]
    for _ in range(2):
        for o in opts:
            o.zero_grad()
        want = lm_loss(eager(x), y)
        want.backward()
        torch.testing.assert_close(pipe.step(x, target=y), want.detach())
        for o in opts:
            o.step()
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p, dict(eager.named_parameters())[n], msg=n)


class Zoo(nn.Module):
    """Buffers computed in __init__, views written in place, copies between tensors, small
    Python data, and torch.nn.init functions that do nothing on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=1)
        inv = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.int64).float() / 4))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("pos", torch.arange(6).expand((1, -1)))
        self.register_buffer("table", torch.tensor([1.5, 2.5]))
        self.register_buffer("small", torch.from_numpy(np.arange(3.0)).to(torch.float32))
        self.orth = nn.Linear(4, 4)
        nn.init.orthogonal_(self.orth.weight)
        self.trunc = nn.Parameter(torch.empty(3, 4))
        nn.init.trunc_normal_(self.trunc, std=0.5, a=-1.0, b=1.0)
        self.copy = nn.Linear(4, 4)
        self.copy.weight.data.copy_(self.orth.weight.data * 2)
        self.randn = nn.Parameter(torch.randn(5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.inv_freq.repeat(2) + self.table.sum()
        return self.copy(self.orth(h)).sum(-1) + self.trunc.sum() + self.randn.sum()


def test_recorded_initialisers_replay_exactly():
    with vf.deferred_init(seed=1):
        model = Zoo()
    vf.materialize(model)
    assert not model.emb.weight[1].any() and model.emb.weight[0].any()
    torch.testing.assert_close(model.inv_freq, torch.tensor([1.0, 0.01]))
    assert model.pos.tolist() == [list(range(6))]
    assert model.table.tolist() == [1.5, 2.5] and model.small.tolist() == [0.0, 1.0, 2.0]
    w = model.orth.weight
    torch.testing.assert_close(w @ w.T, torch.eye(4), atol=1e-5, rtol=0)
    assert float(model.trunc.detach().abs().max()) <= 1.0 and model.trunc.detach().std() > 0.1
    torch.testing.assert_close(model.copy.weight, 2 * w)
    assert model.randn.std() > 0
    ids = torch.randint(0, 10, (4, 3))
    pipe = vf.compile(Zoo_deferred(), example_inputs=(ids,), stages=2, micro_batch_size=4,
                      loss_fn=lambda out, _: out.sum())
    assert float(pipe.step(ids)) == pytest.approx(float(model(ids).sum().detach()), rel=1e-5)


class Imported(nn.Module):
    """Initialisers called through names imported before the block (issue 30), or through
    ``nn.init`` (``via_module``): the same calls, so the same values."""

    def __init__(self, via_module: bool = False, check: bool = False) -> None:
        super().__init__()
        init = nn.init if via_module else _imported
        self.lin = nn.Linear(6, 6)
        init.orthogonal_(self.lin.weight, gain=1.0)
        self.trunc = nn.Parameter(torch.empty(40))
        init.trunc_normal_(self.trunc, std=1.0, a=-0.5, b=0.5)
        self.conv = nn.Conv1d(3, 3, 3)
        init.dirac_(self.conv.weight)
        if check and self.lin.weight.abs().max() > 0.1:  # reads values: refused
            pass


class _imported:  # noqa: N801 - stands for the names imported at the top of this file
    orthogonal_ = staticmethod(imported_orthogonal_)
    trunc_normal_ = staticmethod(imported_trunc_normal_)
    dirac_ = staticmethod(imported_dirac_)


def test_an_initialiser_imported_before_the_block_is_recorded() -> None:
    with vf.deferred_init(seed=3):
        model = Imported()
    with vf.deferred_init(seed=3):
        reference = Imported(via_module=True)
    vf.materialize(model), vf.materialize(reference)
    w = model.lin.weight.detach()
    torch.testing.assert_close(w @ w.T, torch.eye(6), atol=1e-5, rtol=0)
    assert float(model.trunc.detach().abs().max()) <= 0.5 and model.trunc.detach().std() > 0.1
    assert model.conv.weight[:, :, 1].equal(torch.eye(3)) and not model.conv.weight[:, :, 0].any()
    for name, value in _state(reference).items():
        torch.testing.assert_close(_state(model)[name], value, rtol=0, atol=0, msg=name)
    assert torch.Tensor.is_meta is torch._C.TensorBase.is_meta  # restored after the block


def test_reading_values_while_building_names_the_line() -> None:
    with pytest.raises(vf.InputError, match=r"test_deferred_init\.py:\d+ \(if check and "
                       r"self\.lin\.weight\.abs\(\)\.max\(\) > 0\.1.*reads the values of a tensor "
                       r"while the model is built under vf\.deferred_init"):
        with vf.deferred_init(seed=0):
            Imported(check=True)
    with vf.deferred_init(seed=0):  # the block was left cleanly: another one works
        model = Imported()
    with pytest.raises(vf.InputError, match=r"tolist of a \(6, 6\) tensor"):
        with vf.deferred_init(seed=0):
            nn.Linear(6, 6).weight.tolist()
    assert vf.materialize(model).lin.weight.abs().sum() > 0


def Zoo_deferred() -> Zoo:  # noqa: N802 - a builder, named after what it builds
    with vf.deferred_init(seed=1):
        return Zoo()


def test_a_meta_model_without_deferred_init_only_plans_and_says_so():
    x, y = batch()
    with torch.device("meta"):
        model = GPT(CFG)
    with pytest.raises(vf.UninitializedError, match="not built under vf.deferred_init"):
        vf.materialize(model)
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2)
    with pytest.raises(vf.VarunaFxError, match="only plans.*vf.deferred_init"):
        pipe.step(x, target=y)


class Garbage(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        if how == "empty":
            self.left = nn.Parameter(torch.empty(3))
        elif how == "big":
            self.register_buffer("big", torch.zeros(600, 600))
            self.big.copy_(torch.from_numpy(np.ones((600, 600), dtype=np.float32)))
        elif how == "outside":
            self.late = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("how,name,words", [
    ("empty", "left", "torch.empty.*garbage"),
    ("big", "big", "too big to carry"),
    ("outside", "late", "not built under vf.deferred_init"),
])
def test_what_cannot_be_replayed_is_refused_naming_the_tensor(how: str, name: str, words: str):
    with vf.deferred_init(seed=0):
        model = Garbage(how)
    if how == "outside":  # a meta tensor made after the block
        model.late = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(vf.UninitializedError, match=f"{name}.*{words}"):
        vf.materialize(model)
    with vf.deferred_init(seed=0):
        model = Garbage(how)
    if how == "outside":
        model.late = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(vf.VarunaFxError, match=name):
        vf.compile(model, example_inputs=(torch.ones(2, 2),), loss_fn=lambda o, _: o.sum())


def test_deferred_init_refuses_bad_seeds_and_nesting():
    with pytest.raises(vf.VarunaFxError, match="integer seed"):
        with vf.deferred_init(seed="0"):  # type: ignore[arg-type]
            pass
    with pytest.raises(vf.VarunaFxError, match="do not nest"):
        with vf.deferred_init(seed=0), vf.deferred_init(seed=1):
            pass
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the block left nothing behind


def test_under_skip_init_a_step_before_a_load_raises_and_a_load_fills(tmp_path: Path):
    x, y = batch()
    source = vf.compile(deferred_gpt(), example_inputs=(x,), loss_fn=lm_loss, stages=2)
    source.save_checkpoint(str(tmp_path / "ck"))
    with vf.deferred_init(seed=SEED), vf.skip_init():
        model = GPT(CFG).double()
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3)
    with pytest.raises(vf.UninitializedError, match="never loaded"):
        pipe.step(x, target=y)
    pipe.load_checkpoint(str(tmp_path / "ck"))
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(v, source.state_dict()[k], rtol=0, atol=0)
    pipe.step(x, target=y)
    # the causal masks (not in checkpoints) were still computed
    assert bool((model.h[0].attn.mask[0, 0] == torch.tril(torch.ones(16, 16))).all())


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_billion_parameter_model_builds_in_little_memory():
    before = _rss_kib()
    with vf.deferred_init(seed=0):
        model = GPT(GPTConfig(n_layer=20, n_embd=2048, n_head=16, vocab_size=50304,
                              block_size=1024))
    grown = (_rss_kib() - before) / 1024
    params = sum(p.numel() for p in model.parameters())
    assert params > 1.0e9, params
    assert grown < 300, f"{grown:.0f} MB of RSS growth for {params / 1e9:.2f}B parameters"


# -- Hugging Face ------------------------------------------------------------------------------

tf = pytest.importorskip("transformers")


def _hf(name: str) -> nn.Module:
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                vocab_size=96, max_position_embeddings=32, use_cache=False, pad_token_id=0)
    config = {"llama": lambda: tf.LlamaConfig(**base),
              "qwen2": lambda: tf.Qwen2Config(**base, num_key_value_heads=1),
              "gpt_neox": lambda: tf.GPTNeoXConfig(**base),
              "opt": lambda: tf.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
                                          num_attention_heads=2, vocab_size=96, use_cache=False,
                                          max_position_embeddings=32, word_embed_proj_dim=32,
                                          pad_token_id=0, dropout=0.0, attention_dropout=0.0),
              }[name]()
    return tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.slow  # an HF import and torch.export: ~5-15 s each
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox", "opt"])
def test_hugging_face_from_config_same_buffers_initializer_range_and_training(name: str):
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    normal = _hf(name)
    with vf.deferred_init(seed=0):
        model = _hf(name)
    with vf.deferred_init(seed=0):  # the same build again (a copy.deepcopy is not recorded)
        reference = vf.materialize(_hf(name))
    for (bn, b), (_, want) in zip(reference.named_buffers(), normal.named_buffers()):
        torch.testing.assert_close(b, want, rtol=0, atol=0, msg=bn)
    std = getattr(normal.config, "initializer_range", None) or normal.config.init_std
    for pn, p in reference.named_parameters():
        if p.dim() == 2 and p.numel() > 500:  # N(0, initializer_range), as HF's _init_weights
            assert abs(float(p.detach().std()) - std) < 0.25 * std, (pn, float(p.detach().std()))
    ids = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(1))
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                      micro_batch_size=2)
    torch.testing.assert_close(pipe.step(input_ids=ids, labels=ids), want.detach(),
                               rtol=1e-5, atol=1e-6)
    grads = _grads(reference)
    for pn, p in pipe.named_parameters():
        if pn in grads:
            torch.testing.assert_close(p.grad, grads[pn], rtol=1e-4, atol=1e-6, msg=pn)


# -- several processes -------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("ranks,stages", [(2, 2), (4, 2)])
def test_each_rank_materialises_only_its_stage_with_the_one_process_values(
        tmp_path: Path, ranks: int, stages: int):
    x, y = batch()
    eager = vf.materialize(deferred_gpt())
    want = _state(eager)
    loss = lm_loss(eager(x), y)
    loss.backward()
    launch_ok("deferred_rank.py", ranks, [str(tmp_path), str(stages)], timeout=300)
    seen: set[str] = set()
    metas = []
    for r in range(ranks):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert set(out["real"]) <= set(out["held"])  # nothing another stage holds was made
        metas.append(out["meta"])
        for k, v in out["state"].items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
        seen |= set(out["state"])
        assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)  # reduced as float32
        for n, g in out["grads"].items():
            torch.testing.assert_close(g, _grads(eager)[n], msg=n)
    assert seen == set(want)
    assert any(metas)  # (a stage may hold every tensor: a partition can leave a tied head alone)
    # the zoo (tests/support/real_zoo.py) on the same ranks: each model equals its eager run
    for name in (list(ZOO) if ranks == 2 else ["nanogpt-masked"]):
        entry = ZOO[name]
        with vf.deferred_init(seed=SEED):
            zoo = vf.materialize(entry.build())
        out = zoo(*entry.inputs)
        zoo_loss = entry.loss_fn(out, entry.target) if entry.loss_fn else out
        zoo_loss.backward()
        zoo_grads = {n: p.grad for n, p in zoo.named_parameters()}
        held = set()
        for r in range(ranks):
            out = torch.load(tmp_path / f"zoo-{name}-{r}.pt", weights_only=False)
            assert out["loss"] == pytest.approx(float(zoo_loss), rel=1e-5), name
            for n, g in out["grads"].items():
                torch.testing.assert_close(g, zoo_grads[n], msg=f"{name}: {n}")
            held |= set(out["grads"])
        assert held == set(zoo_grads), name


@pytest.mark.distributed
@pytest.mark.slow
def test_a_meta_model_under_torchrun_is_refused_not_a_raw_notimplementederror(tmp_path: Path):
    launch_ok("deferred_rank.py", 2, [str(tmp_path), "2", "meta"])
    for r in range(2):
        error = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["error"]
        assert error.startswith("InputError") and "vf.deferred_init" in error, error


@pytest.mark.parametrize("name", tiered(
    ["qwen2", "mistral", "gemma", "phi", "gpt_neox", "opt", "falcon", "bloom", "gptj",
     "distilbert", "albert", "deberta_v2", "t5", "bart", "vit", "convnext", "bert_regression",
     "llama_single_label"], ["gpt_neox"]))
def test_every_hf_zoo_family_materialises_like_its_normal_build(name: str):
    """tests/capture/test_hf_models.py's architectures: the same buffers, and every weight matrix with the
    spread of a normal build (HF's _init_weights ran and was recorded, not torch's defaults)."""
    from support.hf_zoo import ZOO

    torch.manual_seed(0)
    normal, _ = ZOO[name]()
    with vf.deferred_init(seed=0):
        model, _ = ZOO[name]()
    vf.materialize(model)
    buffers = dict(normal.named_buffers())
    assert dict(model.named_buffers()).keys() == buffers.keys()
    for bn, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[bn], rtol=0, atol=0, msg=bn)
    params = dict(normal.named_parameters())
    for pn, p in model.named_parameters():
        if p.dim() == 2 and p.numel() > 500:
            want = float(params[pn].detach().std())
            assert abs(float(p.detach().std()) - want) < 0.25 * want + 1e-3, (pn, want)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_resume_a_deferred_skip_init_model_from_a_one_process_checkpoint(
        tmp_path: Path):
    x, y = batch()
    source = vf.compile(deferred_gpt(), example_inputs=(x,), loss_fn=lm_loss, stages=1)
    source.save_checkpoint(str(tmp_path / "ck"))
    want = {k: v.clone() for k, v in source.state_dict().items()}
    loss = float(source.step(x, target=y))
    launch_ok("deferred_rank.py", 2, [str(tmp_path), "2", "resume", str(tmp_path / "ck")],
              timeout=300)
    seen: set[str] = set()
    for r in range(2):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert "never loaded" in out["before"], out["before"]
        assert out["loss"] == pytest.approx(loss, rel=1e-6)
        seen |= set(out["state"])
        for k, v in out["state"].items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    assert seen == set(want)
