"""A token model with an HF-style loss (a mean over the labels kept), shared by
capture/test_hf_models.py and the two-rank script (dist_scripts/kept_labels.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

V, B, S = 96, 4, 8


def token_ids(seed: int, length: int = S) -> torch.Tensor:
    return torch.randint(3, V, (B, length), generator=torch.Generator().manual_seed(seed))


class TokenLM(nn.Module):
    """A model with its own code (torch.fx traces it) and an HF-style loss: the mean over the
    labels that are not ignore_index, by ``F.cross_entropy`` or a loss module."""

    def __init__(self, how: str = "function", aux: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, V)
        self.how, self.aux = how, aux
        self.loss = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.mix(self.embed(input_ids)))
        logits = self.head(h)
        if self.how == "module":
            loss = self.loss(logits.flatten(0, 1), labels.flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).float()
        if self.aux:  # another term: no weighting of micro-batch means gives eager's loss
            loss = loss + self.aux * h.pow(2).mean()
        return {"loss": loss, "logits": logits}


def kept_labels_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels keeping 2 of 16 in the first micro-batch of 2, 16 in the other."""
    ids = token_ids(1)
    labels = ids.clone()
    labels[:2, 1:] = -100
    return ids, labels
