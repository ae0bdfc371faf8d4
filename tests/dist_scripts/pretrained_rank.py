"""One rank of a pretrained-weights test: load a Hugging Face checkpoint, train a step, export.

Usage: ``pretrained_rank.py OUT_DIR HF_DIR P [V]`` (V stages per rank, schedule
interleaved-1f1b; D = world size x V / P, ZeRO-1 when D > 1). The GPT-2 of
``support/pretrained.py`` is built under ``vf.deferred_init`` and ``vf.skip_init``; a step before
the load must raise. Then ``pipe.load_pretrained(HF_DIR)`` with ``safe_open`` counting the bytes
copied out per key, one SGD step on the whole batch (each replica its share), and
``pipe.save_pretrained(OUT_DIR/export)``. Writes ``OUT_DIR/rank<r>.pt``: the bytes read per key,
the state this rank holds after the load and after the step, and where it runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
import varuna_fx.checkpoint.hf.safetensors_files as files  # noqa: E402
from support.pretrained import IDS, count_reads, gpt2_config, tf  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
OUT, HF = Path(sys.argv[1]), sys.argv[2]
P = int(sys.argv[3])
V = int(sys.argv[4]) if len(sys.argv) > 4 else 1
D = WORLD * V // P

with vf.deferred_init(seed=3), vf.skip_init():
    model = tf.GPT2LMHeadModel(gpt2_config())
extra = {"stages_per_rank": V, "schedule": "interleaved-1f1b"} if V > 1 else {}
pipe = vf.compile(model, example_inputs={"input_ids": IDS, "labels": IDS}, stages=P,
                  data_parallel=D, global_batch_size=4, micro_batch_size=2,
                  shard_optimizer=D > 1, **extra)
try:
    pipe.step(input_ids=IDS, labels=IDS)
    before = "stepped"
except vf.UninitializedError as exc:
    before = str(exc)
reads: dict[str, int] = {}
files.safe_open = count_reads(reads)
report = pipe.load_pretrained(HF)
loaded = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
opt = pipe.optimizer(torch.optim.SGD, lr=0.5)
pipe.zero_grad()
ids = pipe.shard(IDS)
pipe.step(input_ids=ids, labels=ids)
pipe.optimizer_step(opt)
pipe.save_pretrained(str(OUT / "export"))
torch.save({"before": before, "reads": reads, "bytes_read": report.bytes_read,
            "loaded": loaded, "after": {k: v.detach().clone() for k, v in
                                        pipe.state_dict().items()},
            "stages": list(pipe.local_stages), "replica": pipe.replica_index},
           OUT / f"rank{RANK}.pt")
pipe.close()
