"""Issue 31, measured: varuna_fx (defaults and ``--setting`` s) against torch.distributed.pipelining
and DeepSpeed's PipelineModule, training the same GPT on real bytes over shaped links.

Each configuration is a launch of its own: ``--nodes`` network-namespace "machines" on one bridge
(``tests/support/netns.py``'s ``nodes``), every node's egress and ingress limited by ``tc tbf`` to the ``--links``
rate (``unshaped``: no limit), rank i inside node i, gloo bound to its interface. Every system
trains the same model (``slow_links_systems``: the benchmarks' GPT with an untied 16k head, as
a flat layer list; the same initial weights; bytes use 256 of the head's 16k outputs, the
head stays as heavy as in bench_network.py) with AdamW on the same global batches: windows of
``--seq-len`` bytes of the Python standard library's sources (``slow_links_parts``), a seeded
order; for ``--steps`` steps. Systems (``--systems``):

- ``varuna_fx``: ``vf.compile(model, stages=P, data_parallel=D, micro_batch_size=B/D/m)`` and
  nothing else (the "defaults", i.e. exact), then once per ``--setting``: keyword arguments
  passed through to vf.compile (``--setting compression=int8,replica_sync=powersgd:4``;
  ``name:arg:key=value`` calls ``vf.<Name>``, matched case-insensitively, so ``powersgd:4`` is
  ``vf.PowerSGD(4)`` and ``diloco:every=50`` is ``vf.DiLoCo(every=50)``; ``none`` is None, so
  ``stages=none,data_parallel=none,micro_batch_size=none`` lets the planner choose);
- ``pipelining-1f1b`` / ``pipelining-gpipe``: torch.distributed.pipelining's Schedule1F1B /
  ScheduleGPipe, the blocks split evenly (a flat gradient all-reduce per stage when D > 1);
- ``deepspeed``: DeepSpeed's PipelineModule (its 1F1B TrainSchedule, ``partition_method``
  "parameters", its default), a torch AdamW object, gloo, CPU, ``gradient_clipping`` 0 (its
  default clips the gradient norm at 1.0; the others do not clip). Every system's losses equal
  eager's on this model (checked to 6 digits over the first steps).

Per run, a JSONL (``--out``/<group>/<label>.jsonl; a header line, then step, loss, wall time
since the common start) and, per group (nodes, P x D, link), a table: step time (median of the
steps after ``--warmup``, spread (p90 - p10) / median), final loss (mean of the last tenth of the
steps), wall time to reach the exact run's final loss (``--reference``: varuna_fx's defaults
unless told), bytes on the wire per step (counted: the nodes' interface counters
from /proc/net/dev, every frame's headers included; and from the formula in
``slow_links_parts``: 2 x m x D x cut bytes for the pipeline plus the replicas' all-reduce),
peak RSS per rank; a chart of loss against wall time (``bench/figures/slow_links*.png``).
``--write`` puts the tables into bench/RESULTS.md.

Issue 31's figures, one command each (root, iproute2; run alone on a quiet machine; each
``--write`` rewrites the RESULTS.md block from every run in ``--out``, so they add up). Minutes
are estimates for the 2-core machine from the smoke run's bytes and CPU seconds: a launch costs
~30 s to start; the 4-node exact run is bound by its bytes (ZeRO-1 on gloo: ~125 MB per node per
step, >= 10.5 s at 100 Mbit/s), and 4 ranks share the 2 cores (>= 3 s a step unshaped).

    # (1) P=2 on 2 nodes at 100 Mbit/s and 1 Gbit/s, against pipelining and DeepSpeed, defaults
    #     and settings (~1 s a step: 14 launches x 200 steps, ~60 min)
    python bench/bench_slow_links.py --nodes 2 --stages 2 --links 100mbit,1gbit --steps 200 \
        --systems varuna_fx,pipelining-1f1b,pipelining-gpipe,deepspeed \
        --setting compression=bf16 --setting compression=int8 --setting compression=auto --write
    # (2) P=2 x D=2 on 4 nodes at 100 Mbit/s: time to the exact run's final loss (exact ~12 s
    #     a step; peers and shard_optimizer=false ~8 s; compressed settings ~1-3 s: ~90 min)
    python bench/bench_slow_links.py --nodes 4 --stages 2 --links 100mbit --steps 100 \
        --systems varuna_fx,pipelining-1f1b,deepspeed --setting shard_optimizer=false \
        --setting replica_sync=bf16 --setting replica_sync=powersgd:rank=4 \
        --setting replica_sync=diloco:every=25 \
        --setting compression=int8,replica_sync=powersgd:rank=4 \
        --setting compression=auto,replica_sync=auto --write
    # (3) the same jobs unshaped, for "within 1.2x of unshaped" (~3-4 s a step, ~45 min)
    python bench/bench_slow_links.py --nodes 4 --stages 2 --links unshaped --steps 100 \
        --systems varuna_fx --setting shard_optimizer=false --setting replica_sync=bf16 \
        --setting replica_sync=powersgd:rank=4 --setting replica_sync=diloco:every=25 \
        --setting compression=int8,replica_sync=powersgd:rank=4 \
        --setting compression=auto,replica_sync=auto --write
    # (4) unshaped 2 nodes: compression="auto" against "off" (~0.7 s a step, ~6 min)
    python bench/bench_slow_links.py --nodes 2 --stages 2 --links unshaped --steps 150 \
        --systems varuna_fx --setting compression=auto --write
    # a smoke run: --smoke (6 steps unless --steps; runs and RESULTS block kept apart)

Only the settings this version of vf.compile accepts run (an unknown keyword fails that launch
with compile's TypeError; ``--keep-going`` carries on with the next).

DeepSpeed's first start JIT-builds a C++ op (deepspeed_shm_comm, ~3 min, cached in
~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/). The driver builds it once before
launching ranks. A build killed midway leaves that folder's ``lock`` file behind and every later
start waits on it forever: if the build step times out and no compiler runs
(``ps aux | grep -E 'ninja|c\\+\\+'``), delete the ``lock`` file and run again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from slow_links_parts import label, read_run, write_run  # noqa: E402

PORT = 29641
SYSTEMS = ("varuna_fx", "pipelining-1f1b", "pipelining-gpipe", "deepspeed")


# -- one rank -----------------------------------------------------------------------------------

def worker(job: dict) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from slow_links_parts import batch_windows, digest, stdlib_sources, window_starts
    from slow_links_systems import build

    from varuna_fx.examples import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if job["pin"]:  # each rank on a core of its own where there are enough, every system alike
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    corpus = stdlib_sources(job["corpus_bytes"])
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    T, B = job["seq_len"], job["batch"]
    windows = window_starts(len(tokens), T)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([tokens[i * T:i * T + T + 1]
                            for i in batch_windows(k, B, windows, job["seed"])])
        return rows[:, :-1], rows[:, 1:]

    cfg = GPTConfig(vocab_size=job["vocab"], block_size=T, n_layer=job["layers"],
                    n_head=job["heads"], n_embd=job["width"])
    x0, y0 = batch(0)
    trainer = build(job, cfg, x0)
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    import common  # noqa: F401  (puts tests/ on sys.path: the one netns harness)

    from support.netns import interface_bytes

    def counters() -> tuple[int, int]:
        return interface_bytes(Path("/proc/net/dev").read_text(), iface)

    batches = [batch(k) for k in range(job["steps"])]  # built before the clock starts
    losses: list[float | None] = []
    ends: list[float] = []
    dist.barrier()
    before, cpu0, start = counters(), time.process_time(), time.perf_counter()
    for x, y in batches:
        losses.append(trainer.step(x, y))
        ends.append(time.perf_counter())
    cpu = time.process_time() - cpu0
    dist.barrier()
    after = counters()
    mine = dict(rank=rank, stage=trainer.stage, replica=trainer.replica, start=start, ends=ends,
                losses=losses, rx=after[0] - before[0], tx=after[1] - before[1], cpu_s=cpu,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                note=trainer.note, formula=trainer.formula, formula_note=trainer.formula_note,
                extra=trainer.extra)
    everyone: list[Any] = [None] * world
    dist.gather_object(mine, everyone if rank == 0 else None, dst=0)
    if rank == 0:
        record(job, everyone, digest(corpus), int(x0.sum()))
    dist.barrier()
    dist.destroy_process_group()


def record(job: dict, ranks: list[dict], corpus_digest: str, first_batch_sum: int) -> None:
    """The run's JSONL: a header, then per step the mean loss over the ranks that report one
    and the wall time since the common start (the last rank's end of that step)."""
    import torch
    from slow_links_parts import spread, step_times

    start = min(r["start"] for r in ranks)
    times = step_times([r["ends"] for r in ranks], start)
    rows, t = [], 0.0
    for k, dt in enumerate(times):
        t += dt
        got = [r["losses"][k] for r in ranks if r["losses"][k] is not None]
        rows.append(dict(step=k, loss=sum(got) / len(got), t=t, step_s=dt))
    timed = times[job["warmup"]:] or times
    median, rel = spread(timed)
    versions = {"torch": torch.__version__}
    if job["system"] == "deepspeed":
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    formulas = {r["formula"] for r in ranks}
    head = dict(job, label=label(job["setting"]) if job["system"] == "varuna_fx" else
                job["system"], corpus_sha256=corpus_digest, first_batch_sum=first_batch_sum,
                step_median_s=median, step_spread=rel,
                wire_counted=sum(r["tx"] for r in ranks) / len(times),
                wire_counted_rx=sum(r["rx"] for r in ranks) / len(times),
                wire_formula=formulas.pop() if len(formulas) == 1 else None,
                formula_note=ranks[0]["formula_note"],
                peak_rss=[r["peak_rss"] for r in ranks], cpu_s=[r["cpu_s"] for r in ranks],
                notes=sorted({r["note"] for r in ranks}),
                layout=[(r["rank"], r["stage"], r["replica"]) for r in ranks],
                extra=ranks[0]["extra"], load=os.getloadavg()[0], versions=versions,
                when=datetime.datetime.now().isoformat(timespec="seconds"))
    write_run(Path(job["path"]), head, rows)


# -- the driver ---------------------------------------------------------------------------------

def ds_extension_lock() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions" /
        f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / "deepspeed_shm_comm" / "lock"


def prebuild_deepspeed(timeout: float) -> None:
    """Build (or load) DeepSpeed's shared-memory op once, here, before any rank starts: two ranks
    would otherwise race for the build, and a stale lock would hang them silently."""
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    print("DeepSpeed: building/loading its C++ op (first time ~3 min) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout,
                       capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"DeepSpeed's op build did not finish in {timeout:.0f} s. If no compiler runs "
            f"(ps aux | grep -E 'ninja|c\\+\\+'), a killed build left {ds_extension_lock()}: "
            "delete it and run again.") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"DeepSpeed's op build failed:\n{exc.stderr[-3000:]}") from None


def launch(args: argparse.Namespace, job: dict, link: str, port: int) -> None:
    """One configuration: ``--nodes`` namespaces, one rank in each, until all exit."""
    from common import rank_env  # (common puts tests/ on sys.path)

    from support.netns import nodes

    rate = None if link == "unshaped" else link
    n = args.nodes
    extra = {"TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d's "hostname cannot be retrieved" per socket
             "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
             **({"VARUNA_FX_CACHE_DIR": args.cache} if args.cache else {})}
    with nodes(n, rate) as cluster:
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(n):
                env = rank_env(rank, n, port, addr=cluster.addresses[0], local=False,
                               GLOO_SOCKET_IFNAME=cluster.interfaces[rank], **extra)
                argv = cluster.command(rank, [sys.executable, __file__, "--worker",
                                              json.dumps(job)])
                procs.append(subprocess.Popen(argv, env=env))
            deadline = time.time() + args.timeout
            # a rank that fails leaves its peers waiting in a collective until gloo's timeout:
            # stop them all as soon as one fails
            while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
                if time.time() > deadline:
                    print(f"{job['path']}: timed out after {args.timeout:.0f} s", flush=True)
                    break
                time.sleep(0.5)
        finally:
            for p in procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {job['system']} {job['setting']!r} on {link}")


def command_line() -> str:
    """This driver's command, as the report shows it (without --write/--report)."""
    return "python bench/bench_slow_links.py " + " ".join(
        a for a in sys.argv[1:] if a not in ("--write", "--report", "--keep-going"))


def group_name(nodes: int, stages: int, replicas: int, link: str) -> str:
    return f"n{nodes}-P{stages}xD{replicas}-{link}"


def jobs_for(args: argparse.Namespace, link: str) -> list[dict]:
    replicas = args.nodes // args.stages
    group = Path(args.out) / group_name(args.nodes, args.stages, replicas, link)
    common = dict(nodes=args.nodes, link=link, stages=args.stages, replicas=replicas,
                  micro_batches=args.micro_batches, batch=args.batch, seq_len=args.seq_len,
                  vocab=args.vocab, layers=args.layers, heads=args.heads, width=args.width,
                  steps=args.steps, warmup=args.warmup, lr=args.lr, seed=args.seed,
                  corpus_bytes=args.corpus_bytes, timeout=args.timeout, pin=args.pin,
                  smoke=args.smoke, command=command_line(), reference=args.reference)
    out = []
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"--systems: unknown {system!r}; known: {', '.join(SYSTEMS)}")
        settings = list(dict.fromkeys(["defaults", args.reference, *args.setting])) \
            if system == "varuna_fx" else ["defaults"]
        for setting in settings:
            stem = f"varuna_fx.{label(setting)}" if system == "varuna_fx" else system
            out.append(dict(common, system=system, setting=setting,
                            path=str(group / f"{stem}.jsonl")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="namespace nodes = ranks (2, 4)")
    parser.add_argument("--stages", type=int, default=2, help="P; D is nodes / P")
    parser.add_argument("--links", default="100mbit", help="e.g. 100mbit,1gbit,unshaped")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--setting", action="append", default=[],
                        help="varuna_fx keyword arguments, e.g. compression=int8,"
                             "replica_sync=powersgd:4 (repeatable: one run each)")
    parser.add_argument("--reference", default="defaults",
                        help="the varuna_fx setting whose run is 'exact' in time-to-loss "
                             "(e.g. shard_optimizer=false: ZeRO-1 on gloo sends 1.5x)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of step time")
    parser.add_argument("--batch", type=int, default=16, help="global batch (samples)")
    parser.add_argument("--micro-batches", type=int, default=4, help="m per replica")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16000,
                        help="head size (bytes use 256 of it: a heavy head, as bench_network)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=8 << 20)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin rank i to core i mod cores")
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps, small: results in bench/figures/slow_links_smoke "
                             "and a RESULTS.md block of their own, marked as a smoke run")
    parser.add_argument("--out", default="", help="run folder (default bench/figures/slow_links)")
    parser.add_argument("--cache", default="", help="VARUNA_FX_CACHE_DIR of the runs "
                        "(profiles, with --setting profile=true)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--keep-going", action="store_true",
                        help="a failed launch is reported and the next one runs")
    parser.add_argument("--write", action="store_true", help="tables into bench/RESULTS.md")
    parser.add_argument("--report", action="store_true",
                        help="only redo tables and charts from the runs in --out")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.smoke and args.steps == parser.get_default("steps"):
        args.steps = 6
    args.out = args.out or str(HERE / "figures" / ("slow_links_smoke" if args.smoke
                                                   else "slow_links"))
    from slow_links_report import report

    links = args.links.split(",")
    if not args.report:
        if os.geteuid() != 0:
            raise SystemExit("bench_slow_links.py creates network namespaces: run it as root")
        if args.nodes % args.stages:
            raise SystemExit(f"--nodes {args.nodes} is not a multiple of --stages {args.stages}")
        jobs = [(link, job) for link in links for job in jobs_for(args, link)]
        if any(job["system"] == "deepspeed" for _, job in jobs):
            prebuild_deepspeed(timeout=900)
        started = time.time()
        for i, (link, job) in enumerate(jobs):
            print(f"[{time.time() - started:6.0f} s] {i + 1}/{len(jobs)} {link}: "
                  f"{job['system']} {job['setting']}", flush=True)
            try:
                launch(args, job, link, PORT + i % 20)
            except RuntimeError as exc:
                if not args.keep_going:
                    raise SystemExit(str(exc)) from None
                print(exc, flush=True)
    runs = [read_run(p) for p in sorted(Path(args.out).glob("*/*.jsonl"))]
    print(report(runs, Path(args.out), args.write, args.smoke))


if __name__ == "__main__":
    main()
