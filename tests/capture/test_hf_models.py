"""Hugging Face architectures beyond the registry against eager on the whole batch, and losses
that are means over the labels a micro-batch keeps (-100 padding; ``runtime/loss_weights.py``)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from support.hf_zoo import ZOO, decoder_config, tf
from support.label_models import B, TokenLM, V, kept_labels_batch, token_ids
from tiers import tiered
from varuna_fx.capture.buffers import MicroBatchStateWarning

# (model, stages, schedule, recompute): each model under one configuration, all of them
# covering P 1..3, every schedule family and recompute on and off
SWEEP = [
    ("qwen2", 2, "varuna", True), ("mistral", 3, "1f1b", False), ("gemma", 2, "gpipe", False),
    ("phi", 3, "varuna-zb", True), ("gpt_neox", 2, "1f1b", True), ("opt", 3, "varuna", False),
    ("falcon", 2, "varuna-zb", False), ("bloom", 3, "gpipe", True), ("gptj", 1, "varuna", False),
    ("distilbert", 3, "varuna", True), ("albert", 3, "1f1b", True),
    ("deberta_v2", 2, "varuna", False), ("t5", 3, "varuna", True), ("bart", 2, "1f1b-zb", False),
    ("vit", 3, "gpipe", False), ("convnext", 2, "varuna", True),
    ("bert_regression", 2, "1f1b", False), ("llama_single_label", 3, "varuna-zb", True),
]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_like_eager(model: nn.Module, inputs: dict[str, torch.Tensor], **compile_kw: object
                      ) -> vf.Pipeline:
    """Step and eval-mode forward of a pipeline of ``model`` equal eager's on the whole batch."""
    eager = copy.deepcopy(model)
    want_loss = eager(**inputs).loss
    want_loss.backward()
    want = _grads(eager)
    with warnings.catch_warnings():  # computed per sample: nothing to warn about (issue 30)
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe = vf.compile(model, example_inputs=inputs, micro_batch_size=2, **compile_kw)
    torch.testing.assert_close(pipe.step(**inputs), want_loss.detach(), rtol=1e-5, atol=1e-6)
    names = set()
    for name, p in pipe.named_parameters():
        names.add(name)
        if name in want:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert p.grad is None or not p.grad.any(), name
    assert set(want) <= names
    pipe.eval()
    eager.eval()
    with torch.no_grad():
        out, expected = pipe(**inputs), eager(**inputs)
    assert type(out) is type(expected)
    torch.testing.assert_close(out.to_tuple(), expected.to_tuple(), rtol=1e-5, atol=1e-5)
    return pipe


@pytest.mark.parametrize("name,stages,schedule,recompute", tiered(
    SWEEP, [("distilbert", 3, "varuna", True)], lambda c: f"{c[0]}-P{c[1]}-{c[2]}-{'rc' if c[3] else 'norc'}"))
def test_hf_model_matches_eager(name: str, stages: int, schedule: str, recompute: bool) -> None:
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    _check_like_eager(model, inputs, stages=stages, schedule=schedule, recompute=recompute)


# -- losses that are means over the labels a micro-batch keeps ------------------------------


@pytest.mark.parametrize("how,tracer", tiered(
    [("function", "fx"), ("module", "fx"), ("function", "export")], [("function", "fx")]))
def test_mean_over_kept_labels_is_weighted_by_each_micro_batch_count(how: str,
                                                                      tracer: str) -> None:
    # the pipeline averaged the micro-batches' means: 2 labels kept in one, 8 in the other,
    # and the step's loss and gradients were silently another number than eager's
    torch.manual_seed(0)
    ids = token_ids(1)
    ignore = -1 if how == "module" else -100
    model = TokenLM(how)
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                      micro_batch_size=2, tracer=tracer)
    # 2 labels kept in the first micro-batch and 16 in the second; then none in the first
    # (its mean is nan, eager's whole-batch loss is not); the weights are each step's own
    for kept in (1, 0, 1):
        labels = ids.clone()
        labels[:2, kept:] = ignore
        eager = copy.deepcopy(model)
        want_loss = eager(ids, labels)["loss"]
        want_loss.backward()
        pipe.zero_grad()
        loss = pipe.step(input_ids=ids, labels=labels)
        torch.testing.assert_close(loss, want_loss.detach())
        for name, p in eager.named_parameters():
            torch.testing.assert_close(dict(pipe.named_parameters())[name].grad, p.grad,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_mean_over_kept_labels_mixed_with_another_term_refuses_uneven_micro_batches() -> None:
    torch.manual_seed(0)
    ids = token_ids(1)
    model = TokenLM(aux=0.1)
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                      micro_batch_size=2)
    # equal counts: the plain mean over micro-batches is eager's
    eager = copy.deepcopy(model)
    torch.testing.assert_close(pipe.step(input_ids=ids, labels=ids),
                               eager(ids, ids)["loss"].detach())
    labels = ids.clone()
    labels[0, 3:] = -100
    with pytest.raises(vf.VarunaFxError, match=r"not ignore_index \(-100\).*different numbers "
                                               r"of them \(11, 16\)"):
        pipe.step(input_ids=ids, labels=labels)
    # one micro-batch holding the whole batch is exact whatever the counts
    whole = vf.compile(model, example_inputs={"input_ids": ids, "labels": labels}, stages=2,
                       micro_batch_size=4)
    torch.testing.assert_close(whole.step(input_ids=ids, labels=labels),
                               eager(ids, labels)["loss"].detach())


@pytest.mark.slow  # a bf16 compile of an HF model (torch.export)
def test_bf16_runs_a_torch_export_graph_like_eager_autocast() -> None:
    # torch.export records a dtype check before each `.to(...)` (fp32 at export): under
    # autocast the first step raised a bare "Tensor dtype mismatch! Expected: Float"
    torch.manual_seed(0)
    model, inputs = ZOO["qwen2"]()
    eager = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=inputs, stages=2, micro_batch_size=2,
                      precision="bf16")
    loss = pipe.step(**inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager(**inputs).loss
    want.backward()
    torch.testing.assert_close(torch.as_tensor(loss), want.detach().float(), rtol=2e-2, atol=2e-2)
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0.1, atol=2e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("share", ["same", "view"])
def test_example_inputs_sharing_memory_stay_two_inputs_under_export(share: str) -> None:
    # HF's causal-LM idiom `labels=input_ids`: torch.export read both through one placeholder,
    # so the graph embedded `labels`, and steps with other labels were silently wrong
    torch.manual_seed(0)
    ids, other = token_ids(1), token_ids(2)
    model = TokenLM()
    eager = copy.deepcopy(model)
    want = eager(ids, other)["loss"]
    want.backward()
    labels = ids if share == "same" else ids[:, :]
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": labels}, stages=2,
                      micro_batch_size=2, tracer="export")
    torch.testing.assert_close(pipe.step(input_ids=ids, labels=other), want.detach())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(pipe.named_parameters())[name].grad, p.grad)


@pytest.mark.slow  # two HF compiles (the eval graph is captured again)
def test_hidden_states_come_back_once_per_layer_after_compile() -> None:
    # a HF model installs its output-capturing hooks on its first call and marks itself; the
    # capture put the mark back but kept the hooks, so every later capture (the eval graph)
    # and the user's own eager calls collected each layer's hidden state twice
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**decoder_config(num_key_value_heads=1,
                                                          output_hidden_states=True)))
    ids = token_ids(1)
    inputs = {"input_ids": ids, "labels": ids}
    pristine = copy.deepcopy(model)
    pipe = _check_like_eager(model, inputs, stages=2)  # eval mode: captured again
    want = pristine(**inputs)
    assert len(want.hidden_states) == 3
    torch.testing.assert_close(model(**inputs).to_tuple(), want.to_tuple())  # eager after it
    pipe.train()
    with pytest.raises(vf.VarunaFxError, match=r"model\._output_capturing_hooks_installed was "
                                               r"replaced, added or deleted after vf\.compile"):
        pipe.step(**inputs)  # that eager call installed the hooks: a changed model


@pytest.mark.slow  # two failing traces of an HF model (use_cache=False: the sweep's qwen2)
def test_a_model_returning_its_kv_cache_is_refused_naming_use_cache() -> None:
    # a decoder built from its config has use_cache=True: the error named the cache class
    # only, cut off mid-sentence, and said nothing about what to change
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**decoder_config(num_key_value_heads=1),
                                                  "use_cache": True}))
    ids = token_ids(1)
    with pytest.raises(vf.CaptureError, match=r"model\.config\.use_cache = False"):
        vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                   micro_batch_size=2)


@pytest.mark.slow
@pytest.mark.distributed
def test_mean_over_kept_labels_on_two_ranks_matches_eager(tmp_path: Path) -> None:
    # the last stage's rank weights the micro-batches: every rank has the batch and counts
    from support.dist import launch_ok

    launch_ok("kept_labels.py", 2, [str(tmp_path)], timeout=300)
    torch.manual_seed(0)
    model, (ids, labels) = TokenLM(), kept_labels_batch()
    loss = model(ids, labels)["loss"]
    loss.backward()
    grads = dict(model.named_parameters())
    held = set()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(result["losses"], [loss.item()] * 2)
        for name, grad in result["grads"].items():
            held.add(name)
            torch.testing.assert_close(grad, grads[name].grad,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    assert held == set(grads)


@pytest.mark.slow  # a mixture of experts' compile
def test_router_load_balancing_loss_warns_with_micro_batches() -> None:
    # the auxiliary loss is a statistic over all tokens routed together: per micro-batch it
    # is another number, and the gradients differed from eager without a word
    from varuna_fx.capture.buffers import MicroBatchStateWarning

    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**decoder_config(
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True)))
    ids = token_ids(1)
    inputs = {"input_ids": ids, "labels": ids}
    with pytest.warns(MicroBatchStateWarning, match="router load-balancing loss.*2 micro-batch"):
        vf.compile(model, example_inputs=inputs, stages=2, micro_batch_size=2)


@pytest.mark.slow  # two failing traces of an HF model
def test_code_fixing_the_batch_size_is_refused_saying_why() -> None:
    # wav2vec2's SpecAugment draws its masks with numpy on the batch size: torch.export's
    # error was only "Constraints violated (batch)!"
    model = tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, num_labels=3,
        classifier_proj_size=8, layerdrop=0.0, mask_time_prob=0.05))
    inputs = {"input_values": torch.randn(B, 400), "labels": torch.randint(0, 3, (B,))}
    with pytest.raises(vf.CaptureError, match=r"fixes the batch size.*mask_time_prob"):
        vf.compile(model, example_inputs=inputs, stages=2, micro_batch_size=2)


def test_loss_fn_with_uneven_ignored_labels_warns_once() -> None:
    # a loss_fn runs outside the graph, so its mean over kept labels is not weighted: the
    # pipeline's mean over micro-batches silently differed from eager's
    from varuna_fx.capture.buffers import MicroBatchStateWarning

    torch.manual_seed(0)
    ids, labels = kept_labels_batch()
    model = TokenLM()

    def loss_fn(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())

    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                      micro_batch_size=2, loss_fn=loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe.step(input_ids=ids, labels=ids, target=ids)  # no -100: nothing to say
    with pytest.warns(MicroBatchStateWarning, match=r"different numbers of negative labels .* "
                                                    r"per micro-batch \(14, 0\)"):
        pipe.step(input_ids=ids, labels=ids, target=labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe.step(input_ids=ids, labels=ids, target=labels)  # once per pipeline
