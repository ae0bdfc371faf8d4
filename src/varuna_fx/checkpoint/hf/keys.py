"""Which checkpoint key fills which tensor of the model, as transformers decides it.

A traced, unmodified Hugging Face model keeps its module FQNs, and those are its checkpoint's
keys: nothing is converted. What transformers does beyond equal names, done here the same way
(with no import of transformers: the model's own class attributes say it):

* **The base-model prefix** (``base_model_prefix``, e.g. ``transformer`` for GPT-2): a
  checkpoint saved from the base model alone (``GPT2Model``: ``h.0...``, no ``transformer.``)
  loads into the model with a head by prefixing every key; its head, absent from such a file,
  is missing unless tied to the embedding. A checkpoint with the head loads into the base model
  by stripping the prefix; the head's keys are then dropped with a warning, as transformers
  drops them.
* **Tied weights** are one tensor under several names: any of them in the checkpoint fills it
  (the canonical name first), read once. Where the file holds several of them with different
  values the model cannot be both (transformers warns and unties them): the canonical name's
  values are kept, with a warning naming both (``pretrained.py``). Saving writes one name per tied group, the one
  transformers keeps (not a key of ``_tied_weights_keys``: GPT-2's ``lm_head.weight`` is dropped).
* **Keys transformers ignores**: ``_keys_to_ignore_on_load_unexpected`` (old GPT-2 files'
  ``attn.bias`` masks), keys naming a non-persistent buffer the model computes itself (rotary
  ``inv_freq``), and ``_keys_to_ignore_on_load_missing`` for the model's side.

* **transformers 5's renames** (GPT-NeoX's ``embed_out`` is ``lm_head``): ``hf_renames.py``.

Not handled: transformers' converters that reshape tensors (MoE experts fused into one tensor):
such checkpoints are refused, naming the keys that differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...runtime.model_state import StateLayout
from .renames import renames
from .safetensors_files import Entry

# safetensors dtype names by kind; a float tensor loads into any float tensor (copy_ casts)
_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FN", "F8_E5M2FNUZ",
          "F8_E4M3FNUZ", "E8M0"}
_INT = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}
# config.json entries that differ between saves of one architecture
_CONFIG_NOISE = {"architectures", "dtype", "torch_dtype", "transformers_version",
                 "_name_or_path", "use_cache", "auto_map"}


@dataclass
class KeyMatch:
    source: dict[str, str] = field(default_factory=dict)  # canonical FQN -> checkpoint key
    missing: list[str] = field(default_factory=list)  # canonical FQNs, model order
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys, file order
    mismatched: list[str] = field(default_factory=list)  # "name: checkpoint ..., model ..."
    dropped: list[str] = field(default_factory=list)  # a head's keys a base model leaves out
    # canonical FQN -> the other keys of the checkpoint that name it too (a tied weight saved
    # under several of its names): not read, but compared with the one read (pretrained.py)
    also: dict[str, list[str]] = field(default_factory=dict)


def match_keys(model: nn.Module, layout: StateLayout, entries: dict[str, Entry]) -> KeyMatch:
    """Pair the model's state (``layout``: canonical names, aliases, shapes, dtypes) with the
    checkpoint's keys; what is missing, unexpected or of another shape is listed, not raised."""
    found = KeyMatch()
    load, _ = renames(model)
    renamed, found.dropped = _apply_prefix(model, layout, {k: load(k) for k in entries})
    ignored = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    computed = _computed_buffers(model, layout)
    by_canonical: dict[str, list[str]] = {}
    for key, name in renamed.items():
        canonical = layout.aliases.get(name)
        if canonical is not None:
            by_canonical.setdefault(canonical, []).append(key)
        elif name not in computed and not any(p.search(name) for p in ignored):
            found.unexpected.append(key)
    optional = _patterns(model, "_keys_to_ignore_on_load_missing")
    aliases = _aliases(layout)
    for name in layout.names:
        keys = by_canonical.get(name)
        if not keys:
            if not any(p.search(a) for p in optional for a in aliases[name]):
                found.missing.append(name)
            continue
        # the canonical name's own key if the checkpoint has it, else the first alias's
        key = next((k for k in keys if renamed[k] == name), keys[0])
        found.source[name] = key
        if len(keys) > 1:
            found.also[name] = [k for k in keys if k != key]
        entry = entries[key]
        shape, dtype = layout.shapes[name], layout.dtypes[name]
        if tuple(entry.shape) != tuple(shape) or not _same_kind(entry.dtype, dtype):
            found.mismatched.append(f"{name}: {list(entry.shape)} {entry.dtype} in the "
                                    f"checkpoint, {list(shape)} {_short(dtype)} in the model")
    return found


def saved_names(model: nn.Module, layout: StateLayout) -> dict[str, str]:
    """canonical FQN -> the key it is saved under: for a tied group, the name transformers
    keeps (not one of ``_tied_weights_keys``), the canonical one where both would do."""
    tied = _patterns(model, "_tied_weights_keys")
    _, save = renames(model)
    chosen = {}
    for name, group in _aliases(layout).items():
        kept = [a for a in group if not any(p.search(a) for p in tied)]
        chosen[name] = save(name if name in kept or not kept else kept[0])
    return chosen


def config_differences(model: nn.Module, saved: Any) -> tuple[str | None, list[str]]:
    """The checkpoint's config.json (``saved``, parsed) against the model's ``.config``: its
    model_type when it differs (None if equal or unknown), and the settings both name whose
    values differ, ``"n_layer: 2 in config.json, 3 in the model"``."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not isinstance(saved, dict) or not callable(to_dict):
        return None, []
    mine = to_dict()
    kind = None
    if saved.get("model_type") not in (None, mine.get("model_type")):
        kind = f"{saved['model_type']!r} in config.json, {mine.get('model_type')!r} in the model"
    differ = [f"{k}: {saved[k]!r} in config.json, {mine[k]!r} in the model"
              for k in saved if k in mine and k not in _CONFIG_NOISE and saved[k] != mine[k]
              and not isinstance(mine[k], dict)]
    return kind, differ


# -- helpers ---------------------------------------------------------------------------------


def _apply_prefix(model: nn.Module, layout: StateLayout,
                  names: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """checkpoint key -> the model name it stands for (``names``: after renames), after
    transformers' prefix rule; and the keys a base model drops (a head's)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return names, []
    dotted = prefix + "."
    model_has = any(n.startswith(dotted) for n in layout.aliases)
    file_has = any(n.startswith(dotted) for n in names.values())
    if model_has and not file_has:  # the base model's checkpoint into the model with a head
        return {k: dotted + n for k, n in names.items()}, []
    if file_has and not model_has:  # a checkpoint with a head into the base model
        return ({k: n.removeprefix(dotted) for k, n in names.items() if n.startswith(dotted)},
                [k for k, n in names.items() if not n.startswith(dotted)])
    return names, []


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    """A transformers class attribute of key patterns (a list, a set, or v5's dict whose keys
    are the patterns), compiled; none on other models."""
    value = getattr(model, attribute, None)
    if isinstance(value, dict):
        value = list(value)
    if not isinstance(value, list | tuple | set | frozenset):
        return []
    found = []
    for p in value:
        if isinstance(p, str):
            try:
                found.append(re.compile(p))
            except re.error:
                found.append(re.compile(re.escape(p)))
    return found


def _aliases(layout: StateLayout) -> dict[str, list[str]]:
    """canonical FQN -> every name of it (the canonical one first)."""
    groups: dict[str, list[str]] = {n: [n] for n in layout.names}
    for alias, canonical in layout.aliases.items():
        if alias != canonical and canonical in groups:
            groups[canonical].append(alias)
    return groups


def _computed_buffers(model: nn.Module, layout: StateLayout) -> set[str]:
    """Buffers that are not state (``persistent=False``): the model computes them; old files
    that hold them (rotary ``inv_freq``) are read by transformers without them too."""
    return {n for n, _ in model.named_buffers(remove_duplicate=False)
            if n not in layout.aliases}


def _same_kind(saved: str, dtype: torch.dtype) -> bool:
    if dtype.is_floating_point:
        return saved in _FLOAT
    if dtype == torch.bool:
        return saved == "BOOL"
    if dtype.is_complex:
        return saved.startswith("C")
    return saved in _INT


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
