"""``varuna-fx train --model module:factory`` over a zoo model (tests/support/real_zoo.py):
torchtitan-style Llama (its RoPE table a complex buffer from torch.polar, view_as_complex, GQA)
minGPT (its MLP called through a lambda), nanoGPT (its own loss from the targets the command
feeds it), a mixture of experts routed by torch.where(mask) and a state-space scan as a custom
autograd Function, each on two gloo ranks, two stages, 20 steps, under the deferred init the
command always uses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("factory", ["train_llama", "train_mingpt", "train_nanogpt",
                                     "train_moe", "train_ssm"])
def test_a_zoo_model_trains_twenty_steps_on_two_ranks(tmp_path: Path, factory: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "varuna_fx.launch.cli", "train",
         "--model", f"support.real_zoo:{factory}", "--seq-len", "16",
         "--global-batch-size", "8", "--corpus-bytes", "100000", "--steps", "20",
         "--checkpoint-every", "0", "--charts", "false", "--tensorboard", "false",
         "--nproc", "2", "--stages", "2", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert min(losses[-5:]) < losses[0]  # it learns the bytes
