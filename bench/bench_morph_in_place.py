"""In-place morph time on the ~100M GPT: a notice, the survivors' re-plan and hand-over, and a
join back, each phase timed (wall and CPU), beside the restart path (``bench_morph.py``; both in
bench/RESULTS.md).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_morph_in_place.py``
(``--small``: a tiny GPT, a smoke test; ``--write``: the table into bench/RESULTS.md).

Two jobs of two gloo processes (the driver hosts the membership store, as the launcher of the
rendezvous machine does), each training the GPT of ``bench_morph.py`` (12 layers x 768, 16k
vocabulary, tied head, ~100M parameters; AdamW from ``pipe.optimizer``; a LambdaLR scheduler
with ``pipe.track``; ``pipe.data_loader`` over random tokens; global batch 4 x 64 tokens):

* ``stages=2``: P=2 x D=1 -> (SIGTERM to stage 1's process) -> P=1 -> (a process joins) -> P=2;
* ``stages=1``: P=1 x D=2 with ZeRO-1 -> (SIGTERM to replica 1) -> D=1 -> (a join) -> D=2.

For each morph the survivors' ``pipe.morphs`` records give the phases (agree, regroup, replan,
runtime, transfer, adopt) and the first step on the new layout; ``signal -> ready`` is the
leaver's signal time to the new layout's first step beginning (the rest of the step the signal
interrupted, which completes as useful work, then the morph), ``-> first step done`` adds that
step; ``stall`` is what the survivors waited (the morph's phases: no work is lost on a notice). For a join, the survivors'
stall is measured the same way and the joiner's own time from its spawn to its first step is
shown beside it (imports, model, capture happen before it is admitted, while the job runs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPAWNED = time.time()


def worker(args: argparse.Namespace) -> None:
    import torch

    import varuna_fx as vf
    from varuna_fx.examples import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64) \
        if args.small else GPTConfig(vocab_size=16384, block_size=64, n_layer=12, n_head=12,
                                     n_embd=768)
    torch.manual_seed(0)
    model = GPT(cfg)
    data = vf.TokenDataset(torch.randint(0, cfg.vocab_size, (4096 * cfg.block_size,)),
                           seq_len=cfg.block_size)
    pipe = vf.compile(model, example_inputs=(data[0][0][None],), loss_fn=lm_loss,
                      global_batch_size=args.batch, stages=args.stages)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-4)
    sched = pipe.track(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    loader = pipe.data_loader(data, seed=0)
    out, member = Path(args.dir), os.environ["VARUNA_FX_MEMBER"]
    steps = []
    for x, y in loader.forever():
        step = loader.epoch * len(loader) + loader.position // loader.global_batch_size
        if step > args.steps:
            break
        if step >= args.pause and pipe.plan.stages * pipe.plan.data_parallel < 2:
            while not (out / "go").exists():  # until the driver saw the joiner register
                time.sleep(0.05)
            time.sleep(0.3)  # (a tiny model's steps: slow enough that rank 0 sees it beat)
        t = time.time()
        pipe.step(x, target=y)
        opt.step()
        sched.step()
        pipe.zero_grad()
        steps.append({"step": step, "start": t, "end": time.time(),
                      "layout": f"P={pipe.plan.stages} D={pipe.plan.data_parallel}"})
        (out / f"progress.{member}").write_text(json.dumps(steps[-1]))
    (out / f"{member}.json").write_text(json.dumps({
        "spawned": SPAWNED, "steps": steps, "morphs": [r.as_dict() for r in pipe.morphs],
        "params": sum(p.numel() for p in model.parameters())}))
    pipe.close()
    sys.stdout.flush()
    os._exit(0)


def run_job(args: argparse.Namespace, stages: int, out: Path) -> dict:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from common import SRC, free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=600),
                           wait_for_workers=False)
    store = dist.PrefixStore("varuna_fx/bench/", server)
    procs: dict[str, subprocess.Popen] = {}

    def start(member: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=str(SRC), CUDA_VISIBLE_DEVICES="", VARUNA_FX_TIMEOUT="600",
                   VARUNA_FX_STORE=f"127.0.0.1:{port}", VARUNA_FX_JOB="bench",
                   VARUNA_FX_MEMBER=member, VARUNA_FX_MIN_WORLD="2", VARUNA_FX_MAX_WORLD="2",
                   VARUNA_FX_CACHE_DIR=str(out / "cache"))
        argv = [sys.executable, __file__, "--worker", "--dir", str(out), "--stages", str(stages),
                "--batch", str(args.batch), "--steps", str(args.steps), "--pause", "6",
                *(["--small"] if args.small else [])]
        procs[member] = subprocess.Popen(argv, env=env)

    def step_of(member: str) -> int:
        f = out / f"progress.{member}"
        return json.loads(f.read_text())["step"] if f.exists() else 0

    start("m0")
    start("m1")
    while step_of("m1") < 2:
        time.sleep(0.05)
    procs["m1"].send_signal(signal.SIGTERM)  # the spot notice, during step 3
    procs["m1"].wait(timeout=600)
    start("m2")  # the machine comes back
    while int(store.add("joins", 0)) < 3:
        time.sleep(0.05)
    (out / "go").write_text("1")
    for name, p in procs.items():
        if p.wait(timeout=1200) != 0:
            raise SystemExit(f"{name} exited {p.returncode}")
    survivor = json.loads((out / "m0.json").read_text())
    joiner = json.loads((out / "m2.json").read_text())
    return {"survivor": survivor, "joiner": joiner}


def rows_of(job: dict) -> list[dict]:
    s, j = job["survivor"], job["joiner"]
    notice, join = s["morphs"]
    step_s = min(x["end"] - x["start"] for x in s["steps"][:2])
    rows = []
    for kind, rec in (("notice", notice), ("join", join)):
        phases = {k: v for k, v in rec["phases"].items()}
        stall = sum(v for k, v in phases.items() if k != "first_step")
        row = {"kind": kind, "from": rec["old_layout"], "to": rec["new_layout"],
               "phases": phases, "cpu": rec["cpu"], "stall_s": stall,
               "bytes_moved": rec["bytes_moved"], "old_step_s": step_s}
        if kind == "notice":
            row["signal_to_first_step_s"] = rec["finished"] - rec["signal_at"]
            row["drain_s"] = rec["started"] - rec["signal_at"]
            row["signal_to_ready_s"] = row["drain_s"] + stall
        else:
            jrec = j["morphs"][0]
            row["joiner_spawn_to_first_step_s"] = jrec["finished"] - j["spawned"]
        rows.append(row)
    return rows


def loaded(load: float) -> str:
    """The caveat for a run that shared the machine: above one job per CPU at the start (the
    1-minute average also remembers what ran just before), the wall times are not the result."""
    return "**loaded: wall times are not the result**; " if load > (os.cpu_count() or 1) \
        else "nothing else running; "


def table(results: list[dict], params: int, load: tuple) -> str:
    lines = [f"GPT {params / 1e6:.0f}M parameters, AdamW, global batch 4 x 64 tokens; "
             f"load average at start {load[0]:.1f} on {os.cpu_count()} CPUs "
             f"({loaded(load[0])}the CPU columns are this process's CPU seconds)", "",
             "| morph | layouts | signal -> ready / -> first step done (s) | stall (s) | agree | "
             "regroup | replan | runtime | transfer | adopt | first step | CPU: replan / "
             "runtime / transfer / adopt | MB moved |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, c = r["phases"], r["cpu"]
        first = r.get("signal_to_first_step_s")
        head = f"{r['signal_to_ready_s']:.2f} / {first:.2f}" if first is not None else \
            f"(joiner: spawn -> step {r['joiner_spawn_to_first_step_s']:.1f})"
        lines.append(
            f"| {r['kind']} | {r['from']} -> {r['to']} | {head} | {r['stall_s']:.2f} | "
            + " | ".join(f"{p.get(k, 0):.2f}" for k in ("agree", "regroup", "replan",
                                                          "runtime", "transfer", "adopt",
                                                          "first_step"))
            + " | " + " / ".join(f"{c.get(k, 0):.2f}" for k in ("replan", "runtime",
                                                                 "transfer", "adopt"))
            + f" | {r['bytes_moved'] / 1e6:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=int, default=6, help=argparse.SUPPRESS)
    ap.add_argument("--small", action="store_true", help="a tiny GPT: smoke test")
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=12, help="steps of each job")
    ap.add_argument("--write", action="store_true", help="the table into bench/RESULTS.md")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()
    results, params = [], 0
    for stages in (2, 1):
        with tempfile.TemporaryDirectory(prefix="bench_morph_in_place_") as d:
            job = run_job(args, stages, Path(d))
        params = job["survivor"]["params"]
        results += rows_of(job)
    text = table(results, params, load)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        sys.path.insert(0, str(HERE))
        from common import write_block

        write_block("bench_morph_in_place.py", text)


if __name__ == "__main__":
    main()
