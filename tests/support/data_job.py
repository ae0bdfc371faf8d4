"""The training job of the data-position tests: a tiny GPT over token windows that carry
their sample ids (4 global batches of 12 per epoch: D = 1, 2, 3, 4 divide it), AdamW and a
scheduler.
Used in one process (tests/data/test_data_on_ranks.py) and on ranks
(tests/dist_scripts/data_jobs.py)."""

from __future__ import annotations

from typing import Any

import torch

import varuna_fx as vf
from varuna_fx.data.loader import GlobalBatchLoader
from varuna_fx.examples import GPT, GPTConfig, lm_loss

GLOBAL, SEQ = 12, 8
CONFIG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
TOKENS = torch.randint(0, 64, (50 * SEQ + 1,), generator=torch.Generator().manual_seed(0))


class WithIds(torch.utils.data.Dataset):
    """TokenDataset windows, each with its index: (input, target, id)."""

    def __init__(self) -> None:
        self.windows = vf.TokenDataset(TOKENS, SEQ)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.windows[i], i)


def build(stages: int, replicas: int) -> tuple[vf.Pipeline, Any, Any, Any]:
    torch.manual_seed(0)
    pipe = vf.compile(GPT(CONFIG), vf.Cluster(gpus=stages * replicas, device="cpu"),
                      (torch.zeros(2, SEQ, dtype=torch.long),), loss_fn=lm_loss,
                      global_batch_size=GLOBAL, stages=stages, data_parallel=replicas,
                      micro_batch_size=2, schedule="1f1b")
    loader = pipe.data_loader(WithIds(), seed=11)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    return pipe, loader, opt, sched


def train(pipe: vf.Pipeline, loader: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """One step on the loader's next batch: this rank's sample ids, the loss, the rate."""
    x, y, ids = next(iter(loader))
    pipe.zero_grad()
    loss = pipe.step(x, target=y)
    opt.step()
    sched.step()
    return {"ids": ids.tolist(), "loss": float(loss), "lr": sched.get_last_lr()[0]}


def expected_global_batches(steps: int) -> list[list[int]]:
    """What every layout must step on: the loader's order, computed without a pipeline."""
    loader = GlobalBatchLoader(WithIds(), global_batch_size=GLOBAL, seed=11)
    return [ids.tolist() for _, (_, _, ids) in zip(range(steps), loader.forever())]
