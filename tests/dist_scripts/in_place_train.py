"""The in-place training loop, as every process of an in-place job runs it.

    in_place_train.py OUT TOTAL_STEPS [--stages P] [--shard true|false|auto]
                      [--notice STEP:MEMBER] [--kill STEP:MEMBER] [--pause STEP:FILE]

Builds the tiny GPT in float64 (every layout then equals eager tightly), compiles with the
global batch fixed, makes the optimizer with ``pipe.optimizer`` and a tracked LR scheduler and
data loader, and trains ``for x, y in loader: pipe.step(x, target=y); opt.step();
sched.step()``. ``--notice`` sends this process SIGTERM (a spot notice) before step STEP if its
member name is MEMBER (or ends with it, MEMBER starting with '.'); ``--kill`` SIGKILLs it there; ``--pause`` waits before step STEP until
FILE exists, then takes slow steps while alone (so a test can let a process join). Rank 0 appends ``step world P D loss`` to
OUT/log; at the end every process writes its parameters and its morph records to
OUT/<member>.pt. Outside an in-place job (no membership store) it is the uninterrupted
reference.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.training import ADAM_EPS, CONFIG, GLOBAL_BATCH  # noqa: E402
from varuna_fx.examples import GPT, lm_loss  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("total", type=int)
parser.add_argument("--stages", type=int, default=None)
parser.add_argument("--shard", default="auto")
parser.add_argument("--notice", default="")
parser.add_argument("--kill", default="")
parser.add_argument("--pause", default="")
args = parser.parse_args()
out = Path(args.out)
member = os.environ.get("VARUNA_FX_MEMBER", "solo")
shard = {"true": True, "false": False}.get(args.shard, "auto")


def at(spec: str) -> tuple[int, str]:
    step, _, who = spec.partition(":")
    return (int(step), who) if spec else (-1, "")


def me(who: str) -> bool:
    """``who`` names this process: its member name, or under the launcher (whose names are
    node.pid.local_rank.restarts) a tail of it such as ".1.0"."""
    return member == who or (who.startswith(".") and member.endswith(who))


torch.manual_seed(0)
model = GPT(CONFIG).double()
data = vf.TokenDataset(torch.randint(0, CONFIG.vocab_size, (64 * CONFIG.block_size + 1,)),
                       seq_len=CONFIG.block_size)
pipe = vf.compile(model, example_inputs=(data[0][0][None],), loss_fn=lm_loss,
                  global_batch_size=GLOBAL_BATCH, stages=args.stages, shard_optimizer=shard)
opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2, eps=ADAM_EPS)
sched = pipe.track(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
loader = pipe.data_loader(data, shuffle=True, seed=0)
refused = None
if pipe.joined:  # its state came from the others: loading a checkpoint would rewind it alone
    try:
        pipe.load_checkpoint(str(out / "no_such_checkpoint"), optimizer=opt)
    except vf.VarunaFxError as exc:
        refused = str(exc)
notice, kill, pause = at(args.notice), at(args.kill), at(args.pause)
for x, y in loader.forever():
    # the global batch this step trains on (1-based; a joining process continues the count)
    step = loader.epoch * len(loader) + loader.position // loader.global_batch_size
    if step > args.total:
        break
    if step == notice[0] and me(notice[1]):
        os.kill(os.getpid(), signal.SIGTERM)
    if step == kill[0] and me(kill[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    if 0 <= pause[0] <= step and pipe.plan.data_parallel * pipe.plan.stages < 2:
        while not Path(pause[1]).exists():  # until the test saw a process register
            time.sleep(0.05)
        time.sleep(0.3)  # then slow steps, so that rank 0 sees its heartbeat and admits it
    loss = pipe.step(x, target=y)
    opt.step()
    sched.step()
    pipe.zero_grad()
    if pipe.stage_index == 0 and pipe.replica_index == 0:
        world = pipe.plan.stages * pipe.plan.data_parallel
        with open(out / "log", "a") as f:
            f.write(f"{step} {world} {pipe.plan.stages} {pipe.plan.data_parallel} "
                    f"{float(loss):.17g}\n")
torch.save({"params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "morphs": [r.as_dict() for r in pipe.morphs], "lr": sched.get_last_lr(),
            "refused_load": refused},
           out / f"{member}.pt")
pipe.close()
sys.stdout.flush()
os._exit(0)
