"""``varuna-fx train --eval-every N``: validation on held-out batches, ``val_loss`` in
metrics.jsonl, ``--keep-best``; the keys refused when they do not go together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from varuna_fx.checkpoint.directory import MARKER
from varuna_fx.errors import InputError
from varuna_fx.train.checks import resolve
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.data import open_data
from varuna_fx.train.trainer import held_out
from varuna_fx.train.worker import Run


def tiny(tmp_path: Path, **changes: Any) -> TrainConfig:
    return TrainConfig(**{"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 8,
                          "corpus_bytes": 4096, "steps": 4, "warmup_steps": 1,
                          "global_batch_size": 8, "nproc": 1,
                          "out": str(tmp_path / "run"), "live": False, "tensorboard": False,
                          "charts": False, **changes})



def test_validation_logs_val_loss_and_keeps_the_best(tmp_path: Path, handlers: None) -> None:
    cfg = tiny(tmp_path, eval_every=1, eval_fraction=0.25, eval_batches=2, keep_best=True,
               steps=2)
    assert Run(cfg, None).train() == 0
    out = Path(cfg.out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert set(losses) == {1, 2}
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["val_loss"] == min(losses.values())
    assert best["step"] == min(losses, key=losses.__getitem__)
    assert (Path(best["checkpoint"]) / MARKER).is_file()
    assert len(list((out / "best").glob("step*"))) == 1  # the previous best removed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_val_loss"] == best["val_loss"]


def test_held_out_file_with_tokens_beyond_the_models_vocabulary_is_refused(
        tmp_path: Path) -> None:
    import numpy as np

    tokens = tmp_path / "held.bin"
    np.arange(300, dtype=np.uint16).repeat(4).tofile(tokens)
    cfg = tiny(tmp_path, eval_every=2, eval_data=str(tokens))
    with pytest.raises(InputError, match="token id 299, but the model's vocabulary has 256"):
        held_out(cfg, open_data(cfg).dataset, 256, open_data)


def test_the_held_out_fraction_is_the_end_of_the_data_and_never_trained_on(
        tmp_path: Path) -> None:
    cfg = tiny(tmp_path, eval_every=2, eval_fraction=0.25)
    data = open_data(cfg)
    train, held, _ = held_out(cfg, data.dataset, 256, open_data)
    n = len(data.dataset)
    assert list(train.indices) == list(range(n - int(n * 0.25) - 1))
    assert list(held.indices) == list(range(n - int(n * 0.25), n))
    last_trained = data.dataset.stride * train.indices[-1] + cfg.seq_len  # its last token
    assert last_trained < data.dataset.stride * held.indices[0]


@pytest.mark.parametrize("flags, message", [
    (["--eval-every", "5"], "needs held-out data"),
    (["--eval-fraction", "0.1"], "eval_every = 0"),
    (["--keep-best"], "keep_best keeps"),
    (["--eval-every", "5", "--eval-fraction", "0.1", "--eval-data", __file__], "give one"),
    (["--eval-every", "5", "--eval-data", "no/such/file"], "is not a file"),
    (["--eval-fraction", "0.9"], r"in \[0.0, 0.5\]"),
])
def test_validation_keys_that_do_not_go_together_are_refused_before_training(
        flags: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        resolve(flags)


def test_validation_goes_off_saying_so_when_a_morph_left_no_eval_stages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from varuna_fx.train.trainer import Progress, Trainer

    def refuse(batches: Any) -> float:
        raise InputError("a distributed rank holds only its stage")

    pipe = SimpleNamespace(evaluate=refuse, morphs=[])
    trainer = Trainer(tiny(tmp_path), pipe, None, None, None, Progress(),  # type: ignore[arg-type]
                      validation=[(None, None)])
    with pytest.raises(InputError):  # no morph: the error is the user's
        trainer.validate(1)
    pipe.morphs = ["a morph"]
    assert trainer.validate(2) is None and trainer.validation == []
    assert "validation is off from step 2" in capsys.readouterr().out
