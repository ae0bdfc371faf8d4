"""Golden snapshot of generated stage code: codegen changes show up in review.

Regenerate with ``VARUNA_FX_UPDATE_GOLDEN=1 python -m pytest tests/codegen/test_codegen_golden.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf

GOLDEN = Path(__file__).parents[1] / "golden" / "stage_code"


class TinyResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block1 = nn.Linear(16, 16)
        self.block2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.embed(x))
        h = h + F.relu(self.block1(h))
        h = h + F.relu(self.block2(h))
        return self.head(h)


@pytest.mark.parametrize("stage", [0, 1])
def test_stage_code_matches_golden(stage: int) -> None:
    torch.manual_seed(0)
    # recompute pinned: the golden shows codegen, not the partition recompute="auto" picks
    pipe = vf.compile(TinyResidual(), example_inputs=(torch.randn(4, 8),), stages=2,
                      tracer="fx", recompute=True)
    path = GOLDEN / f"tiny_residual_P2_stage{stage}.py.txt"
    code = pipe.stages[stage].code
    if os.environ.get("VARUNA_FX_UPDATE_GOLDEN") == "1":
        path.write_text(code)
    assert code == path.read_text(), f"stage code changed; if intended, regenerate {path.name}"
