"""A minimal data loader with what an in-place morph needs (``varuna_fx.morph.batch
.MorphableData``): a global sample order, this replica's share of each global batch, a position
in global units, and the share of the last global batch for any replica and D.

Stands in for ``pipe.data_loader`` in the in-place tests until that loader (issue 28) carries the
same methods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class GlobalBatches:
    """``tokens[i]`` is sample i: yields ``(x, y) = (t[:, :-1], t[:, 1:])`` of this replica's
    share of global batch after global batch, in index order (epochs repeat)."""

    def __init__(self, tokens: torch.Tensor, global_batch: int, replica: int = 0,
                 replicas: int = 1) -> None:
        self.tokens, self.global_batch = tokens, global_batch
        self.replica, self.replicas = replica, replicas
        self.position = 0  # global batches handed out
        self.last_batch: Any = None

    def _indices(self, batch: int) -> torch.Tensor:
        n = self.tokens.shape[0] // self.global_batch
        k = batch % n
        return torch.arange(k * self.global_batch, (k + 1) * self.global_batch)

    def _share(self, batch: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
        share = self.global_batch // replicas
        rows = self.tokens[self._indices(batch)[replica * share:(replica + 1) * share]]
        return rows[:, :-1], rows[:, 1:]

    def __iter__(self) -> Iterator[Any]:
        while True:
            self.last_batch = self._share(self.position, self.replica, self.replicas)
            self.position += 1
            yield self.last_batch

    # -- MorphableData -------------------------------------------------------------------------

    def last_share(self, replica: int, replicas: int) -> Any:
        return self._share(self.position - 1, replica, replicas)

    def reshard(self, replica: int, replicas: int) -> None:
        self.replica, self.replicas = replica, replicas

    def state_at_last(self) -> dict[str, Any]:
        return {"position": max(self.position - 1, 0)}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
