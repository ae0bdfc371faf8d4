"""The preemption-safe loop of docs/checkpoints.md, as `varuna-fx run --elastic` restarts it.

    elastic_train.py CKPT_DIR LOG TOTAL_STEPS EVERY [STEP_SLEEP [PAUSE_FILE]]

Every (re)start compiles for the world it finds with the same global batch, resumes from the
newest complete checkpoint and trains to TOTAL_STEPS, saving every EVERY steps (0: never) and
when preempted. Rank 0 appends "step world P D micro_batches loss" per step to LOG, so a test
can compare the loss of every step with an uninterrupted run (float32: layouts agree up to
summation order). While PAUSE_FILE holds a number N and this run has a single rank (a shrunken
two-machine job), training waits after step N until a preemption signal arrives -- so a
test can let a machine rejoin before a shrunken run finishes, without timing guesses.
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.training import ADAM_EPS, CONFIG, GLOBAL_BATCH  # noqa: E402
from varuna_fx.examples import GPT, lm_loss  # noqa: E402
from varuna_fx.runtime import preemption  # noqa: E402

ckpt_dir, log, total, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
step_sleep = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
pause_file = Path(sys.argv[6]) if len(sys.argv) > 6 else None


def batch_for(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size + 1), generator=g)


torch.manual_seed(0)
model = GPT(CONFIG)
example = batch_for(0)
pipe = vf.compile(model, example_inputs=(example[:, :-1],), loss_fn=lm_loss,
                  global_batch_size=GLOBAL_BATCH)
plan = pipe.plan
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=ADAM_EPS)
start = vf.latest_checkpoint(ckpt_dir) if every else None
step = pipe.load_checkpoint(start, optimizer=opt)["step"] if start else 0
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
share = GLOBAL_BATCH // plan.data_parallel
while step < total:
    if pause_file is not None and world == 1 and pause_file.exists() \
            and step >= int(pause_file.read_text()):
        while not preemption.requested():  # a slow step: the agent's SIGTERM ends it
            time.sleep(0.05)
    batch = batch_for(step)[pipe.replica_index * share:(pipe.replica_index + 1) * share]
    pipe.zero_grad()
    loss = pipe.step(batch[:, :-1], target=batch[:, 1:])
    opt.step()
    step += 1
    if rank == 0:
        with open(log, "a") as f:
            f.write(f"{step} {world} {plan.stages} {plan.data_parallel} "
                    f"{plan.micro_batch_size} {plan.num_micro_batches} {float(loss):.17g}\n")
    if every and (pipe.preempted or step % every == 0):
        pipe.save_checkpoint(f"{ckpt_dir}/step{step:08d}", optimizer=opt, extra={"step": step})
    if pipe.preempted:
        break
    time.sleep(step_sleep)  # lets a test act between steps on a fast machine
pipe.close()
sys.stdout.flush()
os._exit(0)  # checkpoint complete: skip torch's slow interpreter teardown (the agent waits)
