"""transformers' own key renames between a checkpoint and a model's module names (v5).

transformers 5 loads some checkpoints through a conversion mapping: renames of keys (GPT-NeoX's
``embed_out.`` is the module ``lm_head.``; old files' ``gamma``/``beta`` are ``weight``/``bias``)
and converters that reshape tensors (MoE experts fused into one tensor). Its
``save_pretrained`` writes the original names back. :func:`renames` asks transformers for the
model's mapping and keeps the pure renames, so a load reads those files and a save writes the
names transformers itself would write. Converters are not applied: a checkpoint that needs one
names its keys as unexpected (``hf_keys.py``), and a save writes the model's own names.

Only for models whose class comes from transformers (then transformers is importable); with
transformers 4, which has no such mapping, or if its internals change shape, keys are used as
they are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

Rename = Callable[[str], str]


def _same(key: str) -> str:
    return key


def renames(model: nn.Module) -> tuple[Rename, Rename]:
    """(checkpoint key -> model name, model name -> the key a save writes); identities when
    transformers has no renames for this model."""
    if not type(model).__module__.startswith("transformers.") or "transformers" not in \
            sys.modules:
        return _same, _same
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_renamings,
        )

        loading = get_model_conversion_mapping(model)
        load = [c for c in loading if isinstance(c, WeightRenaming)
                and not isinstance(c, WeightConverter)]
        # as transformers saves: no legacy renames, no prefix changes, the reverse in reverse
        saving = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                  if not isinstance(c, PrefixChange)]
        save = [c.reverse_transform() for c in saving[::-1]]
        save = [c for c in save if isinstance(c, WeightRenaming)
                and not isinstance(c, WeightConverter)]
    except Exception:  # noqa: BLE001 - transformers 4, or internals of another shape
        return _same, _same
    return _applying(apply_renamings, load), _applying(apply_renamings, save)


def _applying(apply: Any, transforms: list[Any]) -> Rename:
    if not transforms:
        return _same
    return lambda key: apply(key, transforms)
