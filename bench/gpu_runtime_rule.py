"""Varuna's run-time rule on NCCL: step time with the rule on and off, and eager equality.

Run on a machine with at least ``--stages`` GPUs (NCCL refuses two ranks on one GPU)::

    python bench/gpu_runtime_rule.py                      # P=2, m=8, 2 rounds of each
    python bench/gpu_runtime_rule.py --late-ms 2          # + a 2 ms GPU sleep before every
                                                          #   backward of the last stage

Each round launches ``--stages`` ranks (one process per GPU, NCCL) twice, with
``$VARUNA_FX_OPPORTUNISTIC_FORWARD`` off and on, alternating, on a GPT with a heavy head. Every
rank first trains ``--check-steps`` steps next to an eager copy of the model on its own GPU (TF32
off) and compares the loss and its held parameters, then times ``--steps`` steps (the first
``--warmup`` dropped). The table gives the median step time per setting, on / off, how many
forwards ran ahead per step, and the largest difference from eager. A launch that does not
finish within ``--deadline`` seconds is reported as a hang (every wait has ``--timeout``).
Exit status 1 if any check fails or any launch hangs.

First, a two-rank probe of the one ordering question the CPU tests cannot answer: the executor
posts receives a few actions ahead, so on one pair of ranks a receive can be issued before a
send, in both directions at once (rank 0: irecv gradient, isend activation; rank 1: irecv
activation, isend gradient). torch runs a pair's NCCL sends and receives on one stream, in
issue order; if that deadlocks, the pipeline itself hangs on NCCL with or without the rule.
The probe runs once with both directions on one group (as the runtime does today) and once
with each direction on a group of its own (one NCCL stream per direction: a possible fix). ``--cpu`` runs the same on gloo with CPU
ranks (a smoke test of the script: gloo cannot poll a receive, so only stage 0, whose inputs are
local, runs forwards ahead there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from common import free_port, rank_env  # noqa: E402

ENV = "VARUNA_FX_OPPORTUNISTIC_FORWARD"


def rank_main(args: argparse.Namespace) -> None:
    import copy

    import torch

    import varuna_fx as vf
    from varuna_fx.examples import GPT, GPTConfig, lm_loss

    torch.backends.cuda.matmul.allow_tf32 = False  # equality with eager, not TF32 noise
    torch.backends.cudnn.allow_tf32 = False
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    if not args.cpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=16384, block_size=128, n_layer=args.layers, n_head=8,
                       n_embd=512)
    model = GPT(config)
    batch = args.micro_batches * args.micro_batch_size
    steps = args.check_steps + args.steps
    tokens = torch.randint(0, config.vocab_size, (steps, batch, config.block_size + 1))
    eager = copy.deepcopy(model).to(device)
    pipe = vf.compile(model, example_inputs=(tokens[0, :, :-1],), loss_fn=lm_loss,
                      stages=args.stages, micro_batch_size=args.micro_batch_size,
                      schedule=args.schedule, recompute=args.recompute, timeout=args.timeout)
    executor = pipe.runtime.executor
    if args.late_ms > 0 and pipe.stage_index == args.stages - 1:
        backward = executor.worker.backward
        khz = 0 if args.cpu else torch.cuda.get_device_properties(device).clock_rate

        def late_backward(*a: Any, **k: Any) -> Any:
            if args.cpu:
                time.sleep(args.late_ms * 1e-3)
            else:  # on the GPU's stream: the gradient leaves this stage later
                torch.cuda._sleep(int(args.late_ms * khz))
            return backward(*a, **k)

        executor.worker.backward = late_backward
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=1e-3)
    loss_diff = 0.0
    for step in range(args.check_steps):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        pipe.zero_grad()
        loss = float(pipe.step(x, target=y))
        pipe.optimizer_step(opt)
        eager_opt.zero_grad()
        reference = lm_loss(eager(x.to(device)), y.to(device))
        reference.backward()
        eager_opt.step()
        loss_diff = max(loss_diff, abs(loss - float(reference)))
    held = dict(eager.named_parameters(remove_duplicate=False))
    param_diff = max(float((p.detach() - held[n].detach()).abs().max())
                     for n, p in pipe.named_parameters())
    times, jumped = [], []
    for step in range(args.check_steps, steps):
        sync()
        start = time.perf_counter()
        pipe.zero_grad()
        pipe.step(tokens[step, :, :-1], target=tokens[step, :, 1:])
        pipe.optimizer_step(opt)
        sync()
        times.append(time.perf_counter() - start)
        jumped.append(len(executor.cursor.jumped))
    result = {"rank": rank, "stage": pipe.stage_index, "times": times[args.warmup:],
              "jumped": jumped, "loss_diff": loss_diff, "param_diff": param_diff,
              "reorder": executor.reorder, "schedule": str(pipe.plan.schedule)}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    pipe.close()


def probe_main(args: argparse.Namespace) -> None:
    """Receive posted before send on one pair, both directions (see the module docstring)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if not args.cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl")
    # --probe-groups 2: each direction on its own group (own NCCL communicator and stream),
    # the fix this probe would argue for if one group hangs
    groups = [dist.new_group([0, 1]) for _ in range(args.probe_groups)]
    peer = 1 - rank
    size = 4 * 2**20  # 16 MiB of float32: more than NCCL's default buffers hold
    inbox = torch.empty(size, device=device)
    # rank 0 receives "gradients" and sends "activations"; rank 1 the other way round
    recv_group = groups[0 if rank == 0 else -1]
    send_group = groups[-1 if rank == 0 else 0]
    recv = dist.irecv(inbox, src=peer, group=recv_group)
    send = dist.isend(torch.full((size,), float(rank), device=device), dst=peer,
                      group=send_group)
    for work in (recv, send):
        work.wait(timeout=timedelta(seconds=20))
    ok = bool((inbox == peer).all())
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"ok": ok}))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, setting: str, out: Path,
           ranks: int | None = None, mode: str = "--rank",
           deadline: float | None = None, extra: list[str] | None = None
           ) -> list[dict] | str:
    port = free_port()
    procs = []
    ranks = ranks or args.stages
    for r in range(ranks):
        env = rank_env(r, ranks, port, **{ENV: setting})
        if args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, __file__, mode, "--out", str(out), *sys.argv[1:], *(extra or [])]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    limit = deadline or args.deadline
    deadline = time.monotonic() + limit
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return f"hang: no result within {limit:.0f} s"
    results = []
    for r in range(ranks):
        path = out / f"rank{r}.json"
        if not path.exists():
            return "failed:\n" + "\n".join(log[-2000:] for log in logs)
        results.append(json.loads(path.read_text()))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--schedule", default="varuna")
    parser.add_argument("--recompute", type=lambda s: s.lower() in ("1", "true", "on"),
                        default=True)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--late-ms", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=240.0)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU: a smoke test")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-groups", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank or args.probe:
        (rank_main if args.rank else probe_main)(args)
        return
    import torch

    if not args.cpu and torch.cuda.device_count() < args.stages:
        print(f"needs {args.stages} GPUs (NCCL runs one rank per GPU); "
              f"this machine has {torch.cuda.device_count()}")
        sys.exit(2)
    failed = False
    for groups in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            probe = launch(args, "off", Path(tmp), ranks=2, mode="--probe", deadline=60.0,
                           extra=["--probe-groups", str(groups)])
        bad = isinstance(probe, str) or not all(r["ok"] for r in probe)
        failed |= bad and groups == 1  # the runtime uses one group per pair today
        print(f"receive posted before send on one pair, both directions, {groups} group(s): "
              + (probe if isinstance(probe, str) else "WRONG DATA" if bad else "ok"))
    per_setting: dict[str, list[list[dict]]] = {"off": [], "on": []}
    for k in range(args.rounds):
        for setting in ("off", "on") if k % 2 == 0 else ("on", "off"):
            with tempfile.TemporaryDirectory() as tmp:
                got = launch(args, setting, Path(tmp))
            if isinstance(got, str):
                print(f"round {k} rule {setting}: {got}")
                failed = True
                continue
            per_setting[setting].append(got)
    print(f"P={args.stages} m={args.micro_batches} b={args.micro_batch_size} "
          f"{args.schedule} recompute={args.recompute} late={args.late_ms} ms, "
          f"{'gloo (CPU smoke test)' if args.cpu else 'NCCL'}")
    medians = {}
    for setting, runs in per_setting.items():
        if not runs:
            continue
        step = statistics.median(t for run in runs for t in run[0]["times"])
        medians[setting] = step
        jumped = [j for run in runs for r in run for j in r["jumped"]]
        loss = max(r["loss_diff"] for run in runs for r in run)
        param = max(r["param_diff"] for run in runs for r in run)
        ok = loss < 1e-3 and param < 1e-4 and \
            all(r["reorder"] == (setting == "on") for run in runs for r in run)
        failed |= not ok
        print(f"  rule {setting:3s}: step {step * 1e3:8.2f} ms   forwards ahead per step "
              f"{statistics.mean(jumped):5.2f}   max |loss - eager| {loss:.2e}   "
              f"max |param - eager| {param:.2e}   {'ok' if ok else 'MISMATCH'}")
    if len(medians) == 2:
        print(f"  on / off: {medians['on'] / medians['off']:.3f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    from results import recorded

    with recorded("gpu_runtime_rule.py"):
        main()
