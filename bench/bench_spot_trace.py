"""A spot-preemption trace replayed against an in-place training job on network-namespace
machines, killing real processes: goodput, each morph's phases, work lost, and whether every
step's loss equals an uninterrupted run's.

Run (root; ``ip`` and ``tc``):
``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_spot_trace.py --trace bench/traces/spot_10min.json --scale 30``
(``--model gpt100m`` for the ~100M GPT; ``--scale 1`` replays the trace in real time: an hour
for ``spot_10min``, half an hour for ``harsh_2min``; ``--write``: the table into RESULTS.md).

Machines: one namespace per worker machine and one for the membership store (``--nproc 0``:
it runs no worker and is never preempted, as the machine that must stay), on one bridge
(``tests/support/netns.py``'s ``nodes``). Each worker machine runs
``varuna-fx run --elastic --in-place --nproc 1``; its worker trains the GPT (float64 for the
small one, so layouts agree with an uninterrupted one-process run to rounding) with
``pipe.optimizer`` (AdamW, optimizer state not sharded by default so that a replica survives an
abrupt kill: ``--shard``), a tracked scheduler, ``pipe.data_loader``, global batch 12, and a
checkpoint every ``--checkpoint-every`` steps (the restart path's, for state nobody alive
holds). The trace's events (``bench/traces/*.json``: times in seconds of the real trace) are
replayed at ``t / scale`` after the first step:

* ``notice``: SIGTERM to the machine's launcher (the workers hand over at the next step and
  exit); after ``warning_s / scale`` whatever still runs there is SIGKILLed (the machine goes);
* ``kill``: SIGKILL to every process of the machine (no warning);
* ``join``: the machine's launcher starts again (its worker joins the running job).

At the end every launcher gets SIGTERM (all leaving: the workers save and exit). Reported:

* goodput: samples trained (each global batch once) in the trace's time, against a failure-free
  run of the same job on all machines for the same time (``--no-baseline``: against the steady
  step time instead). On a machine whose cores the namespaces share, fewer machines do not
  mean less capacity: there read the downtime line;
* the morphs' downtime: each morph's stall (its phases), its first step's excess over the
  steady step, and every step lost, summed; as a share of the uncompressed trace (the morphs
  cost the same seconds there, spread over ``scale`` times the time);
* every morph's phases (``pipe.morphs``), steps lost (re-run after an abrupt kill, redone after
  a restart from the checkpoint), and the largest relative difference of any step's loss from
  an uninterrupted one-process run of the same steps.

Time compression keeps the morphs' own seconds real, so a compressed replay overstates their
share of the time by the scale factor; the downtime line is the uncompressed trace's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GLOBAL_BATCH = 12


# -- the worker: the in-place training loop ----------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch

    import varuna_fx as vf
    from varuna_fx.examples import GPT, GPTConfig, lm_loss

    big = args.model == "gpt100m"
    cfg = GPTConfig(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768) if big \
        else GPTConfig(vocab_size=96, block_size=12, n_layer=4, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg) if big else GPT(cfg).double()
    data = vf.TokenDataset(torch.randint(0, cfg.vocab_size, (20000 * cfg.block_size,)),
                           seq_len=cfg.block_size)
    pipe = vf.compile(model, example_inputs=(data[0][0][None],), loss_fn=lm_loss,
                      global_batch_size=GLOBAL_BATCH, shard_optimizer=args.shard,
                      stages=args.stages)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-3)
    sched = pipe.track(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s)))
    loader = pipe.data_loader(data, seed=0)
    if args.reference:
        steps = args.reference
    else:
        steps = 1 << 30
        ckpt = Path(args.dir) / "ckpt"
        start = vf.latest_checkpoint(ckpt)
        if start is not None and not pipe.joined:  # a restart: state lost with its holders
            pipe.load_checkpoint(start, optimizer=opt, data=loader, scheduler=sched)
    out = Path(args.dir)
    seen = 0
    for x, y in loader.forever():
        step = loader.epoch * len(loader) + loader.position // loader.global_batch_size
        if step > steps:
            break
        loss = pipe.step(x, target=y)
        opt.step()
        sched.step()
        pipe.zero_grad()
        if pipe.stage_index == 0 and pipe.replica_index == 0:
            with open(out / "log", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss), "t": time.time(),
                                    "world": pipe.plan.stages * pipe.plan.data_parallel,
                                    "layout": f"P={pipe.plan.stages} D={pipe.plan.data_parallel}"})
                        + "\n")
            morphs = pipe.morphs
            with open(out / "morphs.jsonl", "a") as f:
                for r in morphs[seen:]:
                    f.write(json.dumps(r.as_dict()) + "\n")
            seen = len(morphs)
        if not args.reference and (pipe.preempted or step % args.checkpoint_every == 0):
            pipe.save_checkpoint(str(Path(args.dir) / "ckpt" / f"step{step:08d}"),
                                 optimizer=opt, data=loader, scheduler=sched)
        if pipe.preempted:
            break
    pipe.close()
    sys.stdout.flush()
    os._exit(0)


# -- the driver --------------------------------------------------------------------------------

class Cluster:
    """The namespaces, one launcher per machine, and the trace's actions on them."""

    def __init__(self, net: object, args: argparse.Namespace, out: Path, port: int) -> None:
        self.net, self.args, self.out, self.port = net, args, out, port
        self.launchers: dict[int, subprocess.Popen] = {}
        self.workers = len(net.namespaces) - 1  # type: ignore[attr-defined]

    def launch(self, node: int) -> None:
        """Start node's launcher (node -1: the store's machine)."""
        net = self.net
        i = node + 1
        argv = [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--elastic", "--in-place",
                # every worker machine to start the job; any number of them to continue it
                "--nproc", "0" if node < 0 else "1", "--nnodes",
                f"{self.workers}:{self.workers}",
                "--rdzv-endpoint", f"{net.addresses[0]}:{self.port}",  # type: ignore[attr-defined]
                "--local-addr", net.addresses[i], "--rdzv-id", "trace",  # type: ignore[attr-defined]
                "--max-restarts", "3"]
        if node < 0:
            argv.append("--store-host")
        argv += [str(Path(__file__).resolve()), "--worker", "--dir", str(self.out),
                 "--model", self.args.model, *(["--stages", str(self.args.stages)]
                                               if self.args.stages else []),
                 "--checkpoint-every",
                 str(self.args.checkpoint_every), *(["--shard"] if self.args.shard else [])]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
                   CUDA_VISIBLE_DEVICES="", VARUNA_FX_TIMEOUT="300",
                   VARUNA_FX_CACHE_DIR=str(self.out / "cache"))
        log = (self.out / f"node{node}.out").open("a")
        self.launchers[node] = subprocess.Popen(
            net.command(i, argv), env=env, stdout=log,  # type: ignore[attr-defined]
            stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self, node: int) -> list[int]:
        ns = self.net.namespaces[node + 1]  # type: ignore[attr-defined]
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self, node: int) -> None:
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p = self.launchers.get(node)
        if p is not None:
            p.wait(timeout=30)

    def notice(self, node: int) -> None:
        p = self.launchers.get(node)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)

    def stop_all(self, timeout: float) -> None:
        for node in range(self.workers):
            self.notice(node)
        deadline = time.time() + timeout
        for node in range(self.workers):
            p = self.launchers.get(node)
            if p is not None:
                try:
                    p.wait(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    self.kill(node)
        self.kill(-1)


def replay(trace: dict, args: argparse.Namespace, out: Path, events: bool) -> dict:
    sys.path.insert(0, str(HERE))
    from common import free_port

    from support.netns import nodes

    n = args.nodes or trace["nodes"]
    port = free_port()
    with nodes(n + 1, args.rate) as net:
        cluster = Cluster(net, args, out, port)
        cluster.launch(-1)
        for node in range(n):
            cluster.launch(node)
        log = out / "log"
        deadline = time.time() + 600
        while not log.exists():
            if time.time() > deadline:
                raise SystemExit(f"no step within 600 s; see {out}/node*.out")
            time.sleep(0.1)
        t0 = time.time()
        todo = sorted((e for e in trace["events"] if e["node"] < n), key=lambda e: e["t"]) \
            if events else []
        pending_kills: list[tuple[float, int]] = []
        end = t0 + trace["duration_s"] / args.scale
        happened = []
        while time.time() < end:
            now = time.time()
            while todo and t0 + todo[0]["t"] / args.scale <= now:
                e = todo.pop(0)
                if e["kind"] == "notice":
                    cluster.notice(e["node"])
                    pending_kills.append((now + e.get("warning_s", 30) / args.scale, e["node"]))
                elif e["kind"] == "kill":
                    cluster.kill(e["node"])
                else:
                    cluster.launch(e["node"])
                happened.append({**e, "at": now - t0})
            for when, node in list(pending_kills):
                if when <= now:
                    cluster.kill(node)  # the machine goes at the end of its warning
                    pending_kills.remove((when, node))
            time.sleep(0.05)
        cluster.stop_all(timeout=120)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    morphs_file = out / "morphs.jsonl"
    morphs = [json.loads(line) for line in morphs_file.read_text().splitlines()] \
        if morphs_file.exists() else []
    return {"t0": t0, "end": end, "steps": rows, "morphs": morphs, "events": happened, "n": n}


def reference_losses(args: argparse.Namespace, steps: int, out: Path) -> dict[int, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               CUDA_VISIBLE_DEVICES="")
    env.pop("VARUNA_FX_STORE", None)
    subprocess.run([sys.executable, __file__, "--worker", "--dir", str(out), "--model",
                    args.model, "--reference", str(steps),
                    *(["--stages", str(args.stages)] if args.stages else []),
                    *(["--shard"] if args.shard else [])], env=env, check=True, timeout=7200)
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "log").read_text().splitlines())}


def analyse(run: dict, ref: dict[int, float], trace: dict, args: argparse.Namespace,
            baseline: dict | None) -> dict:
    rows = [r for r in run["steps"] if r["t"] <= run["end"]]
    unique = {r["step"] for r in rows}
    redone = len(rows) - len(unique)  # logged twice: redone after a restart from a checkpoint
    span = run["end"] - run["t0"]
    gaps = [b["t"] - a["t"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    step_s = statistics.median(gaps) if gaps else float("nan")
    # the failure-free run's samples in the same time (or, without one, the steady step)
    if baseline is not None:
        goodput = len(unique) / baseline["steps"]
    else:
        goodput = len(unique) * step_s / span
    # one record per morph (rank 0's; a record of its own joining is skipped when the
    # survivors' is there)
    per_gen: dict[int, dict] = {}
    for m in run["morphs"]:
        if m["reason"] != "joined" or m["generation"] not in per_gen:
            per_gen[m["generation"]] = m
    morphs = [per_gen[g] for g in sorted(per_gen)]
    stalls = [sum(v for k, v in m["phases"].items() if k != "first_step") +
              max(0.0, m["phases"].get("first_step", 0.0) - step_s) for m in morphs]
    lost = sum(1 for m in morphs if m["reason"] == "lost")
    downtime = sum(stalls) + (lost + redone) * step_s
    diffs = [abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]) for r in rows
             if r["step"] in ref]
    return {"trace": trace["name"], "scale": args.scale, "nodes": run["n"], "span_s": span,
            "steps": len(unique), "redone": redone, "goodput": goodput,
            "baseline_steps": baseline["steps"] if baseline else None,
            "step_s": step_s, "morphs": morphs, "stalls": stalls, "lost_steps": lost + redone,
            "downtime_s": downtime,
            # the same events in the real trace: the morphs cost what they cost here
            "morph_share_uncompressed": downtime / trace["duration_s"],
            "events": run["events"],
            "max_loss_rel_diff": max(diffs) if diffs else None, "compared_steps": len(diffs)}


def report(res: dict, args: argparse.Namespace) -> str:
    load = os.getloadavg()
    base = f"the failure-free run's {res['baseline_steps']} steps in the same time" \
        if res["baseline_steps"] is not None else "the steady step time (no failure-free run)"
    lines = [f"trace `{res['trace']}` at scale 1/{res['scale']:g} ({res['span_s']:.0f} s of "
             f"wall time), {res['nodes']} worker machines + the store's, model {args.model}; "
             f"load average {load[0]:.1f} on {os.cpu_count()} CPUs"
             + (" (**loaded: not the result**)" if load[0] > (os.cpu_count() or 1) else ""),
             "",
             f"* goodput {res['goodput']:.1%}: {res['steps']} steps against {base}",
             f"* the morphs' downtime {res['downtime_s']:.1f} s (stalls, first steps beyond the "
             f"steady {res['step_s']:.2f} s, lost steps): "
             f"{1 - res['morph_share_uncompressed']:.2%} of the uncompressed trace's "
             f"{res['span_s'] * res['scale']:.0f} s left to training",
             f"* steps lost: {res['lost_steps']} "
             f"({sum(1 for m in res['morphs'] if m['reason'] == 'lost')} re-run after an abrupt "
             f"kill, {res['redone']} redone from a checkpoint); events: "
             + ", ".join(f"{e['kind']} node {e['node']} at {e['at']:.0f} s"
                         for e in res["events"]),
             f"* every step's loss against an uninterrupted one-process run: largest relative "
             f"difference {res['max_loss_rel_diff']:.1e} over {res['compared_steps']} steps"
             if res["max_loss_rel_diff"] is not None else "* no loss compared",
             "", "| morph | layouts | downtime (s) | agree | regroup | replan | runtime | "
             "transfer | adopt | first step | MB moved |", "|---|---|---|---|---|---|---|---|"
             "---|---|---|"]
    for m, stall in zip(res["morphs"], res["stalls"]):
        p = m["phases"]
        lines.append(f"| {m['reason']} | {m['old_layout']} -> {m['new_layout']} | {stall:.2f} | "
                     + " | ".join(f"{p.get(k, 0):.2f}" for k in (
                         "agree", "regroup", "replan", "runtime", "transfer", "adopt",
                         "first_step"))
                     + f" | {m['bytes_moved'] / 1e6:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=str(HERE / "traces" / "spot_10min.json"))
    ap.add_argument("--scale", type=float, default=30.0,
                    help="replay the trace this many times faster (default %(default)s)")
    ap.add_argument("--nodes", type=int, default=None, help="worker machines (trace's)")
    ap.add_argument("--model", default="small", choices=["small", "gpt100m"])
    ap.add_argument("--rate", default=None, help="each machine's link, e.g. 1gbit (unshaped)")
    ap.add_argument("--shard", action="store_true", help="ZeRO-1 (a kill then restarts)")
    ap.add_argument("--stages", type=int, default=None,
                    help="compile's stages= (dropped where it does not fit a world); 1: data "
                         "parallel only, so every abrupt kill leaves a replica (default: the "
                         "planner's choice)")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the failure-free run (goodput from the steady step time)")
    ap.add_argument("--write", action="store_true", help="the table into bench/RESULTS.md")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="keep the runs' logs in this directory")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    trace = json.loads(Path(args.trace).read_text())
    with tempfile.TemporaryDirectory(prefix="bench_spot_") as d:
        if args.keep:
            d = args.keep
            Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "run").mkdir()
        run = replay(trace, args, Path(d) / "run", events=True)
        baseline = None
        if not args.no_baseline:
            (Path(d) / "base").mkdir()
            base = replay(trace, args, Path(d) / "base", events=False)
            baseline = {"steps": len({r["step"] for r in base["steps"]
                                      if r["t"] <= base["end"]})}
        (Path(d) / "ref").mkdir()
        last = max(r["step"] for r in run["steps"])
        ref = reference_losses(args, last, Path(d) / "ref")
    res = analyse(run, ref, trace, args, baseline)
    text = report(res, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if args.write:
        sys.path.insert(0, str(HERE))
        from common import write_block

        write_block(f"bench_spot_trace.py {res['trace']}", text)


if __name__ == "__main__":
    main()
