"""Issue 40 items 1 and 2: random only where something is drawn, layouts as the graph saw them.

``F.scaled_dot_product_attention`` carries torch's ``nondeterministic_seeded`` tag even at
``dropout_p=0``; it was keyed per sample (run once per row, the rows joined with ``torch.cat``),
which changed its output's layout, and torch.export had dropped the ``.contiguous()`` of
nanoGPT's ``y.transpose(1, 2).contiguous().view(B, T, C)``: ``pipe.step`` crashed at
micro-batches > 1 ("view size is not compatible with input tensor's size and stride"). Now an
op that draws nothing is no random op; one that draws applies its keyed mask to the whole
micro-batch at once; and stage graphs' shape views hold for any layout of their inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import varuna_fx as vf
from tiers import tiered
from varuna_fx.ir.keyed_calls import keyed_dropout, keyed_sdpa
from varuna_fx.ir.rng import RandomKey, draws, rng_context
from varuna_fx.passes.assign_stages import compute_nodes, trainable_names
from varuna_fx.passes.layout_robust import robust_views
from varuna_fx.passes.split_stages import split_stages

BATCH = 6  # micro-batches of 1, 2, 3 and the whole batch


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written here: flash attention through SDPA, then the heads joined
    with ``transpose(1, 2).contiguous().view(B, T, C)``."""

    def __init__(self, n_embd: int = 16, n_head: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class TwoBlocks(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = CausalSelfAttention(dropout=dropout), CausalSelfAttention(dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x + self.a(x)).sum(-1)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 5, 16, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 5, generator=g, dtype=torch.float64))


CASES = [(tracer, p, stages, micro) for tracer in ("export", "fx") for p in (0.0, 0.2)
         for stages in (1, 2) for micro in (1, 2, 3, BATCH)]
FAST = [("export", 0.0, 2, 2), ("fx", 0.2, 2, 3)]


@pytest.mark.parametrize("tracer,p,stages,micro", tiered(CASES, FAST))
def test_nanogpt_attention_equals_eager_at_every_micro_batch(tracer: str, p: float,
                                                              stages: int, micro: int) -> None:
    """Loss and every gradient equal eager's on the whole batch (inside ``vf.per_sample_rng``:
    the same keyed dropout masks) at micro-batches 1, 2, 3 and the whole batch, P 1 and 2."""
    torch.manual_seed(0)
    model = TwoBlocks(p).double()
    x, y = _data()
    torch.manual_seed(5)
    with vf.per_sample_rng(BATCH):
        want = mse(model(x), y)
    want.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    # recompute on two stages: stage 0 replays its forward from the stash, draws included
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=mse, stages=stages,
                      micro_batch_size=micro, tracer=tracer, recompute=stages > 1)
    pipe.zero_grad()
    torch.manual_seed(5)
    torch.testing.assert_close(torch.as_tensor(pipe.step(x, target=y)), want.detach())
    for n, q in pipe.named_parameters():
        torch.testing.assert_close(q.grad, grads[n], msg=n)
    code = "".join(s.code for s in pipe.stages)
    assert "random_begin" not in code  # no mode entered: attention keyed in one call, or none
    assert ("keyed_sdpa" in code) == (p > 0)


def test_ops_that_draw_nothing_are_no_random_ops() -> None:
    """SDPA at dropout_p=0, dropouts at p=0 or outside training, rrelu in eval: no markers, no
    keyed call, a stage without random state."""

    class Quiet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.off = CausalSelfAttention(), nn.Dropout(0.0)
            self.eval_drop = nn.Dropout(0.5).eval()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.eval_drop(self.off(self.attn(x)))
            h = F.dropout(h, 0.0, True) + F.dropout(h, 0.5, False)
            return F.rrelu(h, training=False).sum(-1)

    x, y = _data()
    pipe = vf.compile(Quiet().double(), example_inputs=(x,), loss_fn=mse, micro_batch_size=2)
    assert not any(s.random for s in pipe.stages)
    code = pipe.stages[0].code
    assert "random_begin" not in code and "keyed_" not in code, code


def test_draws_reads_the_arguments_that_say_nothing_is_drawn() -> None:
    q = torch.randn(2, 2, 3, 4)
    aten = torch.ops.aten
    assert not draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q),
                     {"dropout_p": 0.0})
    assert draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.1), {})
    assert not draws(aten.native_dropout.default, (q, 0.0, True), {})
    assert not draws(aten.native_dropout.default, (q, 0.5, False), {})
    assert draws(aten.native_dropout.default, (q, 0.5, None), {})
    assert not draws(aten.rrelu_with_noise.default, (q, q), {})  # training defaults to False
    assert draws(aten.bernoulli_.float, (q, 0.5), {})
    assert not draws(aten.add.Tensor, (q, q), {})


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_keyed_attention_and_dropout_apply_one_batched_call() -> None:
    """Each row's numbers are drawn from its own seed; the attention's products, softmax and
    the mask's multiplication run once for the whole micro-batch, never once per sample."""
    q = torch.randn(4, 2, 5, 8)
    with rng_context(RandomKey(7, 0, 4), 0), _Count() as count:
        keyed_sdpa(0, (True,), q, q, q, is_causal=True, dropout_p=0.3)
        keyed_dropout(1, (True,), q, 0.3, True)
    assert count.calls["bernoulli_"] == 8  # 4 rows x 2 ops: the draws
    assert count.calls["bmm"] == 2  # q @ k^T and p @ v, batched
    assert count.calls["_safe_softmax"] == 1
    assert count.calls["mul"] == 4  # q and k scaled, the attention mask, the dropout mask
    assert "cat" not in count.calls


def test_keyed_attention_rows_are_the_whole_batchs_rows() -> None:
    """A row's attention mask depends on its global sample index only: micro-batch 2 starting
    at sample 2 equals rows 2..3 of the batch of 4, and the eager reference draws the same."""
    torch.manual_seed(0)
    q = torch.randn(4, 2, 5, 8, dtype=torch.float64)
    with rng_context(RandomKey(7, 0, 4), 0):
        whole = keyed_sdpa(3, (True,), q, q, q, None, 0.4, True)
    with rng_context(RandomKey(7, 0, 2), 1):  # micro-batch 1 of size 2: samples 2 and 3
        half = keyed_sdpa(3, (True,), q[2:], q[2:], q[2:], None, 0.4, True)
    torch.testing.assert_close(half, whole[2:], rtol=0, atol=0)
    with vf.per_sample_rng(4, seed=7):  # op 0 in eager: the key of op 3 differs
        eager = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4, is_causal=True)
    with rng_context(RandomKey(7, 0, 4), 0):
        torch.testing.assert_close(keyed_sdpa(0, (True,), q, q, q, None, 0.4, True), eager)
    assert not torch.allclose(eager, whole)


def test_a_mask_does_not_depend_on_the_layout() -> None:
    """Dropout of a transposed tensor draws the mask of its contiguous copy (numbers fill the
    elements in their logical order), keyed in stage code and in the eager reference."""
    base = torch.ones(4, 6, 8, dtype=torch.float64)
    laid_out = base.transpose(1, 2)
    dense = laid_out.contiguous()
    with rng_context(RandomKey(3, 0, 4), 0):
        torch.testing.assert_close(keyed_dropout(0, (True,), laid_out, 0.5, True),
                                   keyed_dropout(0, (True,), dense, 0.5, True), rtol=0, atol=0)
    drop = nn.Dropout(0.5)
    with vf.per_sample_rng(4, seed=3):
        a = drop(laid_out)
    with vf.per_sample_rng(4, seed=3):
        b = drop(dense)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with vf.per_sample_rng(4, seed=3):  # and a per-row op that is no dropout
        c = torch.rand_like(laid_out)
    with vf.per_sample_rng(4, seed=3):
        d = torch.rand_like(dense)
    torch.testing.assert_close(c, d, rtol=0, atol=0)


class Transposing(nn.Module):
    """A value whose traced layout is transposed (a ``(B, C, T)`` result of a transpose times a
    scalar): export drops ``.contiguous()`` in ``h.transpose(1, 2).contiguous().view(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # noqa: N806
        h = self.a(x).transpose(1, 2) * 2.0
        return self.b(h.transpose(1, 2).contiguous().view(B, T * C))


def test_a_received_activation_laid_out_otherwise_runs_every_cut() -> None:
    """Cut the captured graph after each node: the second stage, given what the first sends as
    a receive buffer holds it (contiguous), computes what the whole graph does."""
    torch.manual_seed(0)
    model = Transposing()
    x = torch.randn(4, 5, 8)
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lambda o, t: ((o - t) ** 2).mean(),
                      tracer="export")
    gm = pipe.captured.gm
    want = model(x)
    nodes = compute_nodes(gm)
    views = 0
    for cut in range(1, len(nodes)):
        chunk_of = {n: int(i >= cut) for i, n in enumerate(nodes)}
        first, second = (g.graph for g in split_stages(gm, 2, trainable_names(gm), chunk_of))
        views += sum(n.target is torch.ops.aten.reshape.default for n in second.nodes)
        sent = _run(gm, first, {"x": x})
        got = _run(gm, second, {"x": x, **{k: v.contiguous() for k, v in sent.items()}})
        torch.testing.assert_close(got["output_0"], want, msg=f"cut after {nodes[cut - 1]}")
    assert views  # the bare view export recorded became a reshape


def _run(root: torch.nn.Module, graph: fx.Graph, values: dict[str, torch.Tensor]) -> dict:
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    return fx.GraphModule(root, graph)(*(values[n] for n in names))


def test_views_that_alias_a_write_stay_views_and_dtype_views_stay() -> None:
    def written(x: torch.Tensor) -> torch.Tensor:
        y = x.view(-1)
        y.add_(1)
        return x

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1) + x.view(torch.int32).float()

    w, p = fx.symbolic_trace(written), fx.symbolic_trace(plain)
    assert robust_views(w.graph) == 0
    assert robust_views(p.graph) == 1
    assert [n.target for n in p.graph.nodes if n.op == "call_method"][:2] == ["reshape", "view"]


@pytest.mark.slow  # ~5 s each: an export capture of a 4-layer Llama
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hf_llama_attention_runs_batched_and_keyed_only_with_dropout(dropout: float) -> None:
    """A 4-layer Hugging Face Llama (SDPA) in training: no random op at attention_dropout 0
    (its stage code held a marker per layer), one keyed batched call per layer at 0.1; loss and
    gradients equal eager's (keyed the same way) at micro-batch 2 on 2 stages."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attn_implementation="sdpa", use_cache=False, attention_dropout=dropout)
    model = LlamaForCausalLM(cfg).double().train()
    ids = torch.randint(0, 64, (4, 12))

    def loss_fn(out: object, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # type: ignore[attr-defined]

    torch.manual_seed(3)
    with vf.per_sample_rng(4):
        want = loss_fn(model(ids), ids)
    want.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    pipe = vf.compile(model, example_inputs=(ids,), loss_fn=loss_fn, stages=2,
                      micro_batch_size=2)
    code = "".join(s.code for s in pipe.stages)
    assert "random_begin" not in code
    assert code.count("keyed_sdpa(") == (4 if dropout else 0)
    pipe.zero_grad()
    torch.manual_seed(3)
    torch.testing.assert_close(torch.as_tensor(pipe.step(ids, target=ids)), want.detach())
    for n, q in pipe.named_parameters():
        torch.testing.assert_close(q.grad, grads[n], msg=n)


def test_eager_fused_dropout_draws_what_stage_code_draws() -> None:
    """Where eager's dropout is one fused kernel (``aten.native_dropout``, CUDA), the eager
    reference's mode draws the keyed mask stage code's ``keyed_dropout`` draws, and the
    gradient is the same mask."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with vf.per_sample_rng(4, seed=3):
        fused, mask = torch.ops.aten.native_dropout.default(x, 0.3, True)
    with rng_context(RandomKey(3, 0, 4), 0):
        keyed = keyed_dropout(0, (True,), x, 0.3, True)
    torch.testing.assert_close(fused, keyed, rtol=0, atol=0)
    (g_fused,) = torch.autograd.grad(fused.sum(), x)
    (g_keyed,) = torch.autograd.grad(keyed.sum(), x)
    torch.testing.assert_close(g_fused, g_keyed)
    assert mask.dtype == torch.bool and not mask.all()


class HeldAttention(nn.Module):
    """``nn.MultiheadAttention`` with dropout: a module the graph calls (fx keeps torch.nn
    modules whole), whose SDPA inside is keyed by the random node's torch-function mode."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.out(h).sum(-1)


@pytest.mark.slow  # ~1 s: compile runs the sample probe through the attention
def test_an_attention_inside_a_called_module_is_keyed_batched_like_eager() -> None:
    torch.manual_seed(0)
    model = HeldAttention().double()
    x, y = _data()
    torch.manual_seed(5)
    with vf.per_sample_rng(BATCH):
        want = mse(model(x), y)
    want.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=mse, micro_batch_size=3, tracer="fx")
    assert "random_begin" in "".join(s.code for s in pipe.stages)
    pipe.zero_grad()
    torch.manual_seed(5)
    with _Count() as count:
        torch.testing.assert_close(torch.as_tensor(pipe.step(x, target=y)), want.detach())
    assert count.calls.get("_scaled_dot_product_flash_attention_for_cpu", 0) == 0
    assert count.calls["_safe_softmax"] == 2  # the math path once per micro-batch
    for n, q in pipe.named_parameters():
        torch.testing.assert_close(q.grad, grads[n], msg=n)


def test_masks_are_the_keyed_rows_bit_for_bit() -> None:
    """The scheme itself, pinned: row ``j`` of op ``k``'s mask is ``bernoulli_(1 - p)`` from the
    default generator seeded ``mix(seed, k, j)``, in the rows' logical order (as before the
    batched application: existing masks, and so checkpoints' continuations, are unchanged)."""
    from varuna_fx.ir.rng import mix

    x = torch.ones(3, 4, 5, dtype=torch.float64)
    with vf.per_sample_rng(3, seed=11):
        got = nn.Dropout(0.25)(x)
        second = F.dropout(x, 0.25, True)
    for k, drawn in enumerate((got, second)):
        for j in range(3):
            torch.default_generator.manual_seed(mix(11, k, j))
            want = torch.empty(4, 5, dtype=torch.float64).bernoulli_(0.75).div_(0.75)
            torch.testing.assert_close(drawn[j], want, rtol=0, atol=0)
