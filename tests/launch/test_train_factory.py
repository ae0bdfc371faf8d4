"""``--model module:factory``: the factory is offered the run's seq_len and vocabulary, and a
nanoGPT-style model (forward(idx, targets=None) -> (logits, loss), last-position logits
without targets) is fed its targets and trained on its own loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from varuna_fx.train.checks import resolve
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.model import build_model, factory_arguments
from varuna_fx.train.worker import Run


def test_the_factory_gets_the_keyword_arguments_its_signature_accepts() -> None:
    def sized(seq_len: int, vocab_size: int = 3) -> None: ...
    def plain() -> None: ...
    def anything(**kw: Any) -> None: ...
    offered = {"seq_len": 32, "vocab_size": 256}
    assert factory_arguments(sized, **offered) == offered
    assert factory_arguments(plain, **offered) == {}
    assert factory_arguments(anything, seq_len=32, vocab_size=None) == {"seq_len": 32}
    made = build_model(TrainConfig(model="support.real_zoo:train_nanogpt", seq_len=8), 256,
                       255, initialise=True)
    assert made.model.config.block_size == 8 and made.vocab_size == 256
    assert made.targets_in_forward
    # vocab_size goes to a factory too (it is refused only with a Hugging Face config)
    cfg, _ = resolve(["--model", "support.real_zoo:train_nanogpt", "--vocab-size", "300"])
    assert build_model(cfg, 256, 255, initialise=True).model.config.vocab_size == 300


def test_a_nanogpt_model_trains_and_validates_on_its_own_loss(tmp_path: Path,
                                                               handlers: None) -> None:
    cfg = TrainConfig(model="support.real_zoo:train_nanogpt", seq_len=8, corpus_bytes=4096,
                      steps=2, warmup_steps=1, global_batch_size=8, nproc=1, stages=2,
                      eval_every=2, eval_fraction=0.25, eval_batches=1,
                      out=str(tmp_path / "run"), live=False, tensorboard=False, charts=False)
    assert Run(cfg, None).train() == 0  # was: ValueError (batch size 8 vs 64) in the loss
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "val_loss" in r] == [2]
