"""`varuna-fx run --nproc 2 cli_smoke.py OUT_DIR`: compile and one step on every rank (torchrun's
environment); each rank writes one line to OUT_DIR/rank<r>.txt."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.training import make_model_and_data  # noqa: E402
from varuna_fx.examples import lm_loss  # noqa: E402

model, tokens = make_model_and_data()
batch = tokens[0]
pipe = vf.compile(model, example_inputs=(batch[:, :-1],), loss_fn=lm_loss, stages=2)
loss = pipe.step(batch[:, :-1], target=batch[:, 1:])
line = (f"rank {os.environ['RANK']} stage {pipe.stage_index} replica {pipe.replica_index} "
        f"loss {float(loss):.6f}")
Path(sys.argv[1], f"rank{os.environ['RANK']}.txt").write_text(line)
os._exit(0)
