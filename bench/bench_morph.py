"""Morph time: preemption signal -> first step finished on the new layout, and useful work.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_morph.py``
(``--small`` for a smoke test; ``--old-ranks 2 --new-ranks 1`` is the default shrink).

A ~100M-parameter GPT (12 layers x 768, 16k vocabulary, tied head; AdamW) trains on
``--old-ranks`` gloo processes (the planner picks the layout). After two steps the driver sends
SIGUSR1 (Varuna's signal) to rank 0; ``pipe.preempted`` turns true on every rank after the step
in flight, every rank saves its shard (``pipe.save_checkpoint``) and exits. The driver then
starts ``--new-ranks`` processes, which compile for their world (another layout), load the
checkpoint and take one step. Timestamps from both sides split the morph into:

  drain     signal -> the step in flight finished (the flag rides on its all-reduce)
  save      pipe.save_checkpoint (model + AdamW state, every rank its shard)
  exit      save done -> the old processes gone (process-group teardown)
  restart   new processes spawned -> Python, torch and varuna_fx imported, model built
            (under ``vf.skip_init``: the checkpoint overwrites every weight)
  compile   vf.compile: capture + plan + codegen for the new world (the shape pass's fake
            runs come from the graph cache the old processes' compile wrote, in the run's
            temporary directory)
  load      pipe.load_checkpoint (re-sharded to the new layout)
  step      the first training step (forward, backward, optimizer) on the new layout

Plain processes stand in for torchrun's workers here; an elastic agent adds its re-rendezvous
(about 1 s with ``varuna-fx run --elastic``'s settings) before "restart". The useful-work
fraction at one preemption per 10 minutes (and per hour) then comes from
``varuna_fx.launch.morphing`` with the measured morph and save times, for Varuna's periodic
checkpoints (best interval) and for save-on-signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.time()  # as early as possible: "restart" starts at process spawn (driver's clock)


def config(small: bool):  # noqa: ANN201 - imported lazily so worker start-up is timed
    from varuna_fx.examples import GPTConfig

    if small:
        return GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
    return GPTConfig(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768)


class Stamps(dict):
    """Wall-clock stamps, and this process's CPU time at each (``cpu``): on a loaded machine
    the CPU seconds tell what a phase would take on a quiet one."""

    def __init__(self) -> None:
        super().__init__(spawned=T0)
        self.cpu = {"spawned": 0.0}

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        self.cpu[key] = time.process_time()


def worker(args: argparse.Namespace) -> None:
    stamps = Stamps()
    import torch

    import varuna_fx as vf
    from varuna_fx.examples import GPT, lm_loss
    from varuna_fx.passes import shape_cache
    stamps["imported"] = time.time()
    cfg = config(args.small)
    torch.manual_seed(0)
    # the new layout always resumes: the checkpoint overwrites every weight (README's loop);
    # --deferred: built as README's loop builds a big model, under vf.deferred_init too (each
    # rank then materialises only its stage)
    deferred = vf.deferred_init(seed=0) if args.deferred else contextlib.nullcontext()
    with deferred, vf.skip_init(enabled=args.phase == "new"):
        model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1),
                           generator=torch.Generator().manual_seed(1))
    params = sum(p.numel() for p in model.parameters())  # before a rank drops what it does not hold
    stamps["model_built"] = time.time()
    pipe = vf.compile(model, example_inputs=(tokens[:, :-1],), loss_fn=lm_loss,
                      global_batch_size=args.batch)
    stamps["compiled"] = time.time()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    share = args.batch // pipe.plan.data_parallel
    mine = tokens[pipe.replica_index * share:(pipe.replica_index + 1) * share]
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.dir)
    info = {"layout": f"P={pipe.plan.stages} D={pipe.plan.data_parallel} "
                      f"m={pipe.plan.num_micro_batches}",
            "params": params}

    def train_step() -> float:
        pipe.zero_grad()
        loss = pipe.step(mine[:, :-1], target=mine[:, 1:])
        opt.step()
        return float(loss)

    if args.phase == "new":
        start = vf.latest_checkpoint(out / "ckpt")
        assert start is not None, "no checkpoint to resume from"
        extra = pipe.load_checkpoint(start, optimizer=opt)
        stamps["loaded"] = time.time()
        t = time.time()
        train_step()
        stamps["first_step"] = time.time()
        info["step_s"] = stamps["first_step"] - t
        info["resumed_step"] = extra["step"]
        info["graph_cache"] = dict(shape_cache.stats)  # a hit: the old phase warmed it
    else:
        if args.phase == "old":
            pipe.install_preemption_handlers()  # also in one process (torchrun installs them)
        step, step_times, step_cpu = 0, [], []
        while True:
            t, c = time.time(), time.process_time()
            train_step()
            step_times.append(time.time() - t)
            step_cpu.append(time.process_time() - c)
            step += 1
            if step == 2 and rank == 0:
                (out / "ready").write_text("1")  # the driver signals us now
            if pipe.preempted:
                stamps["drained"] = time.time()
                pipe.save_checkpoint(str(out / "ckpt" / f"step{step:08d}"), optimizer=opt,
                                     extra={"step": step})
                stamps["saved"] = time.time()
                break
            if step > 50:
                raise SystemExit("no preemption signal arrived")
        info["step_s"] = min(step_times[1:] or step_times)
        info["step_cpu_s"] = min(step_cpu[1:] or step_cpu)
    pipe.close()
    stamps["closed"] = time.time()
    (out / f"{args.phase}{rank}.json").write_text(
        json.dumps({"stamps": stamps, "cpu": stamps.cpu, **info}))
    # The checkpoint is complete and the process group closed: nothing is left to tear down.
    # Interpreter teardown with torch loaded takes 4-12 s on a loaded 2-core machine (plain
    # torch.distributed alike), time an agent would wait before restarting; skip it.
    sys.stdout.flush()
    os._exit(0)


def launch(phase: str, ranks: int, args: argparse.Namespace) -> list[subprocess.Popen]:
    from common import free_port, rank_env  # the driver's only: workers start as timed

    port = free_port()
    procs = []
    for r in range(ranks):
        # the run's own graph cache (not ~/.cache), warmed by the old phase's compile as the
        # job's previous incarnation would have
        own = dict(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   CUDA_VISIBLE_DEVICES="", VARUNA_FX_CACHE_DIR=str(Path(args.dir) / "cache"))
        if ranks > 1:
            env = rank_env(r, ranks, port, **own)
        else:
            env = dict(os.environ, **own)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(k, None)
        argv = [sys.executable, __file__, "--worker", "--phase", phase, "--dir", args.dir,
                "--batch", str(args.batch), *(["--small"] if args.small else []),
                *(["--deferred"] if args.deferred else [])]
        procs.append(subprocess.Popen(argv, env=env))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    for p in procs:
        rc = p.wait(timeout=max(1.0, deadline - time.time()))
        if rc != 0:
            raise SystemExit(f"a worker failed with exit code {rc}")


def measure(args: argparse.Namespace) -> dict:
    out = Path(args.dir)
    old = launch("old", args.old_ranks, args)
    while not (out / "ready").exists():
        if any(p.poll() not in (None, 0) for p in old):
            raise SystemExit("the old layout failed before its second step")
        time.sleep(0.01)
    t_signal = time.time()
    old[0].send_signal(signal.SIGUSR1)
    wait_all(old, 600)
    t_exit = time.time()
    new = launch("new", args.new_ranks, args)
    wait_all(new, 600)
    o = json.loads((out / "old0.json").read_text())
    n = json.loads((out / "new0.json").read_text())
    so, sn, cn = o["stamps"], n["stamps"], n["cpu"]
    phases = {
        "drain": so["drained"] - t_signal,
        "save": so["saved"] - so["drained"],
        "exit": t_exit - so["saved"],
        "restart": sn["model_built"] - sn["spawned"],
        "compile": sn["compiled"] - sn["model_built"],
        "load": sn["loaded"] - sn["compiled"],
        "step": sn["first_step"] - sn["loaded"],
    }
    return {"params": o["params"], "old_layout": o["layout"], "new_layout": n["layout"],
            "old_step_s": o["step_s"], "new_step_s": n["step_s"], "phases": phases,
            "morph_s": sn["first_step"] - t_signal,
            "graph_cache": n["graph_cache"],
            "launch_gap_s": sn["spawned"] - t_exit,
            "imports_s": sn["imported"] - sn["spawned"],
            "close_s": so["closed"] - so["saved"],
            "old_step_cpu_s": o["step_cpu_s"],
            "save_cpu_s": o["cpu"]["saved"] - o["cpu"]["drained"],
            "new_cpu_s": {"restart": cn["model_built"], "compile": cn["compiled"] -
                          cn["model_built"], "load": cn["loaded"] - cn["compiled"],
                          "step": cn["first_step"] - cn["loaded"]}}


def useful_work(morph_s: float, save_s: float) -> list[dict]:
    from varuna_fx.launch.morphing import (
        expected_fraction_on_signal,
        expected_fraction_periodic,
        preemption_trace,
        simulate_preemptions,
        young_daly_interval,
    )

    rows = []
    for mean in (600.0, 3600.0):
        grid = sorted({*(30.0 * k for k in range(1, 121)), young_daly_interval(mean, save_s)})
        best = max(grid, key=lambda t: expected_fraction_periodic(mean, t, save_s, morph_s))
        horizon = mean * 1000
        trace = preemption_trace(mean, horizon, seed=0)
        periodic = simulate_preemptions(trace, horizon, interval_s=best, save_s=save_s, morph_s=morph_s)
        on_signal = simulate_preemptions(trace, horizon, interval_s=None, save_s=save_s, morph_s=morph_s,
                             policy="on_signal")
        rows.append({"mean_interval_s": mean, "best_interval_s": best,
                     "periodic_sim": periodic.fraction,
                     "periodic_expected": expected_fraction_periodic(mean, best, save_s,
                                                                     morph_s),
                     "on_signal_sim": on_signal.fraction,
                     "on_signal_expected": expected_fraction_on_signal(mean, None, save_s,
                                                                       morph_s)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="old", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--small", action="store_true", help="a tiny GPT: smoke test")
    ap.add_argument("--deferred", action="store_true",
                    help="build under vf.deferred_init as well (README's loop for big models)")
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences of 64)")
    ap.add_argument("--old-ranks", type=int, default=2)
    ap.add_argument("--new-ranks", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_morph_") as d:
        args.dir = d
        (Path(d) / "ckpt").mkdir()
        res = measure(args)
    res["useful_work"] = useful_work(res["morph_s"], res["phases"]["save"])
    # CPU seconds of every phase (half a step to drain, on average): what the morph would take
    # if this process had its core to itself, not counting disk and network waits
    res["morph_cpu_s"] = res["old_step_cpu_s"] / 2 + res["save_cpu_s"] + \
        sum(res["new_cpu_s"].values())
    res["useful_work_cpu"] = useful_work(res["morph_cpu_s"], res["save_cpu_s"])
    res["load_average"] = {"start": load_start, "end": os.getloadavg(), "cpus": os.cpu_count()}
    print("load average (1, 5, 15 min) at start " + " ".join(f"{x:.2f}" for x in load_start)
          + ", at the end " + " ".join(f"{x:.2f}" for x in res["load_average"]["end"])
          + f" ({os.cpu_count()} CPUs)")
    print(f"GPT {res['params'] / 1e6:.1f}M parameters, AdamW; {res['old_layout']} on "
          f"{args.old_ranks} ranks -> {res['new_layout']} on {args.new_ranks} "
          f"(step {res['old_step_s']:.2f} s -> {res['new_step_s']:.2f} s)")
    for k, v in res["phases"].items():
        print(f"  {k:8s} {v:6.2f} s")
    print(f"  morph    {res['morph_s']:6.2f} s  (signal -> first step on the new layout; "
          f"target <= 10 s; imports {res['imports_s']:.2f} s of restart, pipe.close "
          f"{res['close_s']:.2f} s of exit)")
    print(f"  the new process built the model under "
          f"{'vf.deferred_init + ' if args.deferred else ''}vf.skip_init; its compile's graph cache: "
          f"{res['graph_cache']}")
    cpu = res["new_cpu_s"]
    print("  CPU seconds of the new process: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                          cpu.items())
          + f"; save {res['save_cpu_s']:.2f} (wall minus CPU = waiting for the machine/disk)")
    print(f"  CPU-time morph (half a step's drain + save + new process): "
          f"{res['morph_cpu_s']:.2f} s -- the wall time on an unloaded core, without disk waits")
    for label, rows in (("measured", res["useful_work"]), ("CPU-time", res["useful_work_cpu"])):
        print(f"useful work with the {label} morph and save times:")
        for r in rows:
            print(f"  one preemption per {r['mean_interval_s'] / 60:.0f} min: periodic "
                  f"checkpoints every {r['best_interval_s']:.0f} s (best) {r['periodic_sim']:.1%}"
                  f" (closed form {r['periodic_expected']:.1%}); save on signal "
                  f"{r['on_signal_sim']:.1%} ({r['on_signal_expected']:.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_morph.py"):
        main()
