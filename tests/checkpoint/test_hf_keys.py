"""Which checkpoint key fills which tensor (checkpoint/hf/keys.py, hf_renames.py), on small
modules without compiling: transformers' base-model prefix both ways, tied names, keys it
ignores, buffers the model computes, the name a save keeps for a tied group, and
transformers 5's renames (GPT-NeoX's embed_out)."""

from __future__ import annotations

import torch
from torch import nn

from support.hf_zoo import ZOO
from varuna_fx.checkpoint.hf.keys import match_keys, saved_names
from varuna_fx.checkpoint.hf.renames import renames
from varuna_fx.checkpoint.hf.safetensors_files import Entry
from varuna_fx.runtime.model_state import StateLayout


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


class WithHead(nn.Module):
    """Shaped like a transformers ``...ForCausalLM``: the base under a prefix, a tied head."""

    base_model_prefix = "transformer"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # transformers 5's form
    _keys_to_ignore_on_load_unexpected = [r"attn\.bias"]

    def __init__(self) -> None:
        super().__init__()
        self.transformer = Base()
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def layout(model: nn.Module, *, canonical_head: bool = False) -> StateLayout:
    """The layout compile records (tied names share one canonical name)."""
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    if canonical_head:  # the head registered first: its name is the canonical one
        named.sort(key=lambda item: not item[0].startswith("lm_head"))
    for name, t in named:
        canonical[name] = first.setdefault(id(t), name)
    return StateLayout.of(model, canonical, [])


def entries(model: nn.Module, rename: dict[str, str] | None = None,
            drop: tuple[str, ...] = ()) -> dict[str, Entry]:
    state = {k: v for k, v in model.state_dict().items() if k not in drop}
    return {(rename or {}).get(k, k): Entry("f", tuple(v.shape), "F32")
            for k, v in state.items()}


def test_a_base_model_file_loads_into_the_model_with_a_head_and_the_reverse_drops_the_head():
    head = WithHead()
    base_file = entries(head.transformer)  # keys without "transformer."
    base_file["h.0.attn.bias"] = Entry("f", (1, 1, 4, 4), "F32")  # old GPT-2 files' masks
    base_file["inv_freq"] = Entry("f", (2,), "F32")  # a buffer the model computes
    found = match_keys(head, layout(head), base_file)
    assert found.missing == [] and found.unexpected == [] and found.mismatched == []
    assert found.source["transformer.wte.weight"] == "wte.weight"

    base = Base()
    base.base_model_prefix = "transformer"
    found = match_keys(base, layout(base), entries(head, drop=("lm_head.weight",)) | {
        "lm_head.weight": Entry("f", (10, 4), "F32")})
    assert found.missing == [] and found.unexpected == []
    assert found.dropped == ["lm_head.weight"]
    assert found.source["wte.weight"] == "transformer.wte.weight"


def test_a_tied_weight_is_filled_by_either_name_and_saved_under_the_kept_one():
    head = WithHead()
    only_head = entries(head, drop=("transformer.wte.weight",)) | {
        "lm_head.weight": Entry("f", (10, 4), "F32")}
    found = match_keys(head, layout(head), only_head)
    assert found.missing == [] and found.source["transformer.wte.weight"] == "lm_head.weight"
    both = entries(head) | {"lm_head.weight": Entry("f", (10, 4), "F32")}
    assert match_keys(head, layout(head), both).source["transformer.wte.weight"] == \
        "transformer.wte.weight"  # the canonical name's own key first
    # whichever name compile calls canonical, a save writes the one transformers keeps
    assert saved_names(head, layout(head, canonical_head=True)) == {
        "lm_head.weight": "transformer.wte.weight", "transformer.ln.weight":
        "transformer.ln.weight", "transformer.ln.bias": "transformer.ln.bias"}


def test_shapes_and_dtype_kinds_are_compared_and_named():
    head = WithHead()
    file = entries(head)
    file["transformer.ln.weight"] = Entry("f", (5,), "F32")
    file["transformer.ln.bias"] = Entry("f", (4,), "I64")
    file["transformer.wte.weight"] = Entry("f", (10, 4), "BF16")  # any float loads
    found = match_keys(head, layout(head), file)
    assert found.mismatched == [
        "transformer.ln.weight: [5] F32 in the checkpoint, [4] float32 in the model",
        "transformer.ln.bias: [4] I64 in the checkpoint, [4] float32 in the model"]


def test_transformers_5_renames_apply_both_ways():
    model, _ = ZOO["gpt_neox"]()
    load, save = renames(model)
    assert load("embed_out.weight") == "lm_head.weight"
    assert save("lm_head.weight") == "embed_out.weight"
    assert load("gpt_neox.layers.0.mlp.dense_h_to_4h.weight") == \
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    plain, _ = renames(WithHead())  # not a transformers class: keys as they are
    assert plain("embed_out.weight") == "embed_out.weight"
