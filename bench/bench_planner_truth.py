"""The planner measured against itself (issue 41, item 3): predicted vs measured step time of
every configuration of a world, and the pick against the best measured.

Run: ``python bench/bench_planner_truth.py`` (``--models gpt,llama,mlp``, ``--nproc N``,
``--nodes N --link RATE``, ``--steps``, ``--global-batch-size``, ``--sizes``, ``--schedules``,
``--quick``, ``--write``). Per model, on every rank:

1. ``vf.compile`` with its defaults (``profile=True``, nothing else but the global batch):
   the pick, its prediction, and its measured step;
2. every (P, D) with P x D = N, every micro-batch size of ``--sizes`` dividing the replica
   batch and, for P > 1, every schedule of ``--schedules``: compiled with those values (the
   same cached profile and kept links), then timed: two warm-up steps, then the median of
   ``--steps`` steps, a barrier before each.

Where the ranks run:

* ``--nproc N`` (default 2): ``torch.distributed.run --standalone --nproc-per-node N`` on
  loopback (gloo, one thread per process). With more ranks than cores (``--nproc 4`` on this
  2-core machine) they share the cores, and the planner prices that (``LOCAL_WORLD_SIZE``
  ranks per node: ``planner/machine.py``'s contention).
* ``--nodes N --link RATE`` (root, iproute2): rank i inside network namespace i of
  ``tests/support/netns.py``'s ``nodes(N, RATE)`` (one bridge, every node's link limited to
  RATE each way by tc tbf; ``unshaped``: no limit), gloo bound to its veth
  (``GLOO_SOCKET_IFNAME``), the rendezvous on node 0's namespace address: every byte between
  ranks crosses a shaped link, and nothing leaves the namespaces made here. The planner's
  links are what its probe measured there (``world/network.py``, kept by
  ``planner/steady.py``; the report prints them). The namespaces share this machine's cores:
  by default the ranks say so (``LOCAL_WORLD_SIZE`` N, the planner prices the contention);
  ``--own-cores`` plans as if each node had its own (a real cluster's ``LOCAL_WORLD_SIZE`` 1).

Models: the GPT of ``varuna_fx.examples`` (its loss inside the graph, so the profiler times
it), a small Hugging Face Llama (``labels`` in, the loss out) and a uniform MLP with an MSE loss.

Reported per model: each row's predicted, measured and error (predicted / measured - 1); the
median and largest |error|; Spearman's rank correlation of predicted against measured; the
pick's measured step against the best measured row; and where each row's step went
(``planner_truth_parts.py``): compute, sync, messages + waits and outside the actions on the
slowest rank, from ``pipe.last_step.timeline``, against the plan's ``cost_terms``. Targets
(issue 41): median <= 10%, max <= 25%, the pick within 5% of the best, the 4-node shaped run
within 10%. The machine may be shared: wall times move by tens of percent between runs
(bench/RESULTS.md, "Machine noise"), so the figures say what this run saw.

The full sweeps (one block of bench/RESULTS.md each with ``--write``; minutes measured on the
quiet 2-core machine, see RESULTS.md):

    python bench/bench_planner_truth.py --write                    # 2 processes
    python bench/bench_planner_truth.py --nproc 4 --write          # 4 processes on 2 cores
    python bench/bench_planner_truth.py --nodes 4 --link 100mbit --write   # root
    python bench/bench_planner_truth.py --nproc 4 --quick          # a smoke run (~1 min)
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
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from common import free_port, rank_env, write_block  # noqa: E402
from planner_truth_parts import decompose, links_line, median_step, report  # noqa: E402

ALL_MODELS = "gpt,llama,mlp"
SIZES = "1,2,4,8,16"
SCHEDULES = "varuna,1f1b"
# a smoke run: one model, one micro-batch size, both schedules (so P = 4 runs each), 3 steps
QUICK = {"models": "gpt", "sizes": "4", "schedules": SCHEDULES, "steps": 3}
FULL = {"models": ALL_MODELS, "sizes": SIZES, "schedules": SCHEDULES, "steps": 5}
# 4 ranks on 2 cores: each compile and step costs about twice as much, and P = 4 adds rows
# (every size at 4 ranks is 21 configurations a model, ~10 minutes): 12 a model, ~5 minutes
FULL_4 = {**FULL, "sizes": "1,4,16"}
# on shaped links every step carries the all-reduce over them: the GPT alone, fewer sizes
NODES = {"models": "gpt", "sizes": "2,8", "schedules": SCHEDULES, "steps": 5}


# -- models ------------------------------------------------------------------------------------

def make_case(name: str, batch: int) -> tuple[Any, dict[str, Any]]:
    """(model, its inputs as keywords) of ``batch`` samples; the model returns its loss."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "gpt":
        from varuna_fx.examples import GPT, GPTConfig, lm_loss

        class LanguageModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gpt = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=64,
                                         vocab_size=1000))

            def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                return lm_loss(self.gpt(idx), targets)

        tokens = torch.randint(0, 1000, (batch, 65), generator=gen)
        return LanguageModel(), {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
    if name == "llama":
        import transformers as tf

        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=1000, max_position_embeddings=64,
            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))
        ids = torch.randint(0, 1000, (batch, 64), generator=gen)
        return model, {"input_ids": ids, "labels": ids}
    if name == "mlp":
        class Regression(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.Sequential(*(m for _ in range(8)
                                              for m in (nn.Linear(512, 512), nn.ReLU())))

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return nn.functional.mse_loss(self.layers(x), y)

        return Regression(), {"x": torch.randn(batch, 512, generator=gen),
                              "y": torch.randn(batch, 512, generator=gen)}
    raise SystemExit(f"unknown model {name!r}: gpt, llama or mlp")


# -- one rank ----------------------------------------------------------------------------------

def slowdown(seconds: float = 0.01) -> float:
    """How much slower than its CPU time a fixed busy loop runs right now on this rank: wall
    over CPU time of ``seconds`` of CPU work (1.0 on an idle core; the other agents sharing
    this machine make it 2-4)."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - start_cpu < seconds:
        x += 1
    return (time.perf_counter() - start_wall) / max(time.process_time() - start_cpu, 1e-9)


def own_contention() -> float:
    """The slowdown this job's own ranks cause each other when all spin at once: the ranks of
    this machine (``LOCAL_WORLD_SIZE``, or every rank of a job of namespace nodes, which share
    the cores too: ``VF_TRUTH_SHARING``) over its cores, at least 1."""
    sharing = int(os.environ.get("VF_TRUTH_SHARING") or os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1.0, sharing / max(len(os.sched_getaffinity(0)), 1))


def timed(pipe: Any, inputs: dict[str, Any], steps: int
          ) -> tuple[float, float, dict[str, float]]:
    """(median wall seconds of a step, the median of each step's wall time over the machine's
    slowdown measured just before it beyond what this job's own ranks cause: the step on an
    unshared machine, roughly; this rank's median step split by its timeline)."""
    import torch.distributed as dist

    times, normal, parts = [], [], []
    own = own_contention()
    for i in range(steps + 2):
        dist.barrier()
        load = slowdown()
        dist.barrier()
        start = time.perf_counter()
        pipe.step(**inputs)
        if i >= 2:
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            normal.append(elapsed / max(1.0, load / own))
            parts.append(decompose(elapsed, pipe.last_step.timeline))
    return statistics.median(times), statistics.median(normal), dict(median_step(parts))


def run_one(name: str, global_batch: int, steps: int, **given: Any) -> dict[str, Any]:
    """Compile (example inputs: the global batch, so every configuration plans from one
    profile) and time this rank's replica batch; rank 0 gets every rank's decomposition."""
    import torch.distributed as dist

    import varuna_fx as vf

    model, example = make_case(name, global_batch)
    began = time.perf_counter()
    pipe = vf.compile(model, example_inputs=example, global_batch_size=global_batch,
                      profile=True, **given)
    compile_s = time.perf_counter() - began
    plan = pipe.plan
    _, inputs = make_case(name, global_batch // plan.data_parallel)
    measured, normal, mine = timed(pipe, inputs, steps)
    mine["rank"] = dist.get_rank()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, ranks if dist.get_rank() == 0 else None, dst=0)
    pipe.runtime.close()
    return {"P": plan.stages, "D": plan.data_parallel, "b": plan.micro_batch_size,
            "m": plan.num_micro_batches, "schedule": plan.schedule.name,
            "predicted": plan.predicted_step_time, "measured": measured, "normal": normal,
            "terms": dict(plan.cost_terms), "stage_busy": list(plan.stage_busy),
            "ranks": ranks if dist.get_rank() == 0 else [], "compile_s": compile_s}


def kept_links() -> dict[str, Any] | None:
    """The links the planner plans with: the newest kept by its probe (``planner/steady.py``,
    ``$VARUNA_FX_CACHE_DIR/links``), as JSON numbers; None if none."""
    from varuna_fx.world.files import cache_dir

    found = sorted(cache_dir("links").glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    got = json.loads(found[-1].read_text())
    return got if isinstance(got, dict) else None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from varuna_fx.world.where import init_process_group

    torch.set_num_threads(1)
    # the pipeline's own check of its prediction (planner/drift.py) says what this table shows
    warnings.filterwarnings("ignore", message="the step took")
    init_process_group(600.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for name in args.models.split(","):
        # compile's defaults first (it measures the profile and the links the others reuse)
        pick = run_one(name, args.global_batch_size, args.steps)
        if rank == 0 and "_links" not in out:
            out["_links"] = kept_links()
        rows = []
        for p in (x for x in range(1, world + 1) if world % x == 0):
            d = world // p
            replica = args.global_batch_size // d
            schedules = args.schedules.split(",") if p > 1 else ["varuna"]
            for b in (int(s) for s in args.sizes.split(",")):
                if replica % b:
                    continue
                for schedule in schedules:
                    rows.append(run_one(name, args.global_batch_size, args.steps,
                                        stages=p, data_parallel=d, micro_batch_size=b,
                                        schedule=schedule))
        out[name] = {"rows": rows, "pick": pick}
        if rank == 0:
            print(f"{name}: {len(rows)} configurations timed", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def one_process(args: argparse.Namespace) -> str:
    """P = D = 1 in this process, timed in CPU time (what other jobs on the machine barely
    move): the compute, per-operation and per-action terms without links or the load. Per
    model and micro-batch size: the prediction with compile's defaults (this machine's costs,
    planner/machine.py) and with a profile, against the median CPU time of ``--steps``."""
    import torch

    import varuna_fx as vf

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="the step took")
    gb = args.global_batch_size
    lines = [f"One process, P = D = 1, global batch {gb}, CPU time per step (median of "
             f"{args.steps} after 2 warm-up steps):\n",
             "| model | b x m | predicted (defaults) ms | predicted (profile) ms | measured CPU ms "
             "| error (defaults) | error (profile) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    errors: dict[str, list[float]] = {"defaults": [], "profile": []}
    for name in args.models.split(","):
        for b in (int(x) for x in args.sizes.split(",")):
            if gb % b:
                continue
            predicted = {}
            measured = 0.0
            for kind in ("defaults", "profile"):
                model, inputs = make_case(name, gb)
                pipe = vf.compile(model, example_inputs=inputs, global_batch_size=gb,
                                  stages=1, micro_batch_size=b, profile=kind == "profile")
                predicted[kind] = pipe.plan.predicted_step_time
                times = []
                for i in range(args.steps + 2):
                    start = time.process_time()
                    pipe.step(**inputs)
                    if i >= 2:
                        times.append(time.process_time() - start)
                if kind == "defaults":
                    measured = statistics.median(times)
            e = {k: predicted[k] / measured - 1 for k in predicted}
            for k, v in e.items():
                errors[k].append(abs(v))
            lines.append(f"| {name} | {b} x {gb // b} | {predicted['defaults'] * 1e3:.1f} "
                         f"| {predicted['profile'] * 1e3:.1f} | {measured * 1e3:.1f} "
                         f"| {e['defaults']:+.1%} | {e['profile']:+.1%} |")
    lines.append("")
    for k, v in errors.items():
        lines.append(f"- {k}: median |error| {statistics.median(v):.1%}, max {max(v):.1%} "
                     f"over {len(v)} configurations")
    return "\n".join(lines)


def worker_argv(args: argparse.Namespace, out: str) -> list[str]:
    return [os.path.abspath(__file__), "--worker", "--out", out, "--models", args.models,
            "--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size),
            "--sizes", args.sizes, "--schedules", args.schedules]


def launch_local(args: argparse.Namespace, out: str, env: dict[str, str]) -> None:
    """``--nproc`` ranks on loopback under torchrun."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(args.nproc), *worker_argv(args, out)],
                   env=env, check=True, timeout=args.timeout)


def launch_nodes(args: argparse.Namespace, out: str, env: dict[str, str]) -> None:
    """``--nodes`` ranks, rank i inside namespace node i (bench_slow_links.py's pattern): the
    rendezvous on node 0's address, gloo on each node's veth; as soon as one rank fails the
    others are stopped (they would wait in a collective until gloo's timeout)."""
    from support.netns import nodes  # (common put tests/ on sys.path)

    n = args.nodes
    rate = None if args.link == "unshaped" else args.link
    extra = {"TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d's "hostname cannot be retrieved" per socket
             "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
             "VF_TRUTH_SHARING": str(n)}
    port = free_port()
    with nodes(n, rate) as net:
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(n):
                renv = rank_env(rank, n, port, addr=net.addresses[0], local=False,
                                GLOO_SOCKET_IFNAME=net.interfaces[rank], **extra)
                renv["VARUNA_FX_CACHE_DIR"] = env["VARUNA_FX_CACHE_DIR"]
                if not args.own_cores:  # the namespaces share this machine's cores: say so
                    renv["LOCAL_WORLD_SIZE"] = str(n)
                argv = net.command(rank, [sys.executable, *worker_argv(args, out)])
                procs.append(subprocess.Popen(argv, env=renv))
            deadline = time.time() + args.timeout
            while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
                if time.time() > deadline:
                    raise SystemExit(f"the sweep timed out after {args.timeout:.0f} s")
                time.sleep(0.5)
        finally:
            for p in procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed on {n} nodes at {args.link}")


def nodes_unavailable() -> str | None:
    """Why the namespace nodes cannot run here (not root, no iproute2 or tbf), or None."""
    from support.netns import netns_available

    if os.geteuid() != 0:
        return "--nodes creates network namespaces: run it as root"
    ok, why = netns_available(shaping=True)
    return None if ok else why


def block_name(args: argparse.Namespace) -> str:
    """The RESULTS.md block of this mode: the 2-process sweep keeps the script's own."""
    if args.nodes:
        return f"bench_planner_truth.py nodes{args.nodes}-{args.link}"
    return "bench_planner_truth.py" if args.nproc == 2 else \
        f"bench_planner_truth.py nproc{args.nproc}"


def setting_text(args: argparse.Namespace) -> str:
    if args.nodes:
        cores = "sharing the machine's cores, priced" if not args.own_cores else \
            "planned as if each had its own cores"
        return (f"global batch {args.global_batch_size}, {args.nodes} namespace nodes, links "
                f"{args.link} each way, 1 gloo rank per node ({cores}), 1 thread each")
    return (f"global batch {args.global_batch_size}, {args.nproc} gloo processes on loopback, "
            f"1 thread each, {os.cpu_count()} cores")


def launch(args: argparse.Namespace) -> None:
    if args.nodes:
        why = nodes_unavailable()
        if why is not None:
            print(f"bench_planner_truth.py --nodes: skipped: {why}", file=sys.stderr)
            return
    # a fresh cache (profile, machine costs, kept links), deleted at the end, unless given; on
    # namespace nodes always, so no loopback run's kept links are planned with
    given = os.environ.get("VARUNA_FX_CACHE_DIR") if not args.nodes else None
    with tempfile.TemporaryDirectory(prefix="varuna_fx_truth_") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "VARUNA_FX_CACHE_DIR": given or os.path.join(tmp, "cache")}
        out = os.path.join(tmp, "rows.json")
        start = time.time()
        (launch_nodes if args.nodes else launch_local)(args, out, env)
        data = json.loads(Path(out).read_text())
        load = os.getloadavg()[0]
        text = links_line(data.get("_links")) + "\n\n" + report(data, setting_text(args))
        if args.one_process:
            os.environ["VARUNA_FX_CACHE_DIR"] = env["VARUNA_FX_CACHE_DIR"]
            text += "\n\n" + one_process(args)
    head = (f"Command: `{' '.join(['python', 'bench/bench_planner_truth.py', *sys.argv[1:]])}`"
            f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{time.time() - start:.0f} s, load average {load:.1f} at the end).\n\n")
    print(head + text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.write:
        write_block(block_name(args), head + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help=f"default {ALL_MODELS} (--nodes: {NODES['models']})")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on loopback (2, 4)")
    parser.add_argument("--nodes", type=int, default=0,
                        help="ranks in as many shaped network-namespace nodes (root)")
    parser.add_argument("--link", default="100mbit",
                        help="--nodes: every node's link each way (100mbit, 1gbit, unshaped)")
    parser.add_argument("--own-cores", action="store_true",
                        help="--nodes: plan as if each node had cores of its own")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--sizes", help=f"micro-batch sizes (default {SIZES}; --nproc 4 "
                        f"and more: {FULL_4['sizes']}; --nodes: {NODES['sizes']})")
    parser.add_argument("--schedules", help=f"for P > 1 (default {SCHEDULES})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK} unless given; not --write")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--one-process", action="store_true",
                        help="also time P = D = 1 in this process, in CPU time")
    parser.add_argument("--json", default="", help="also write the rows (decompositions too)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick and args.write:
        raise SystemExit("--quick is a smoke run: its tables are not written to RESULTS.md")
    defaults = QUICK if args.quick else NODES if args.nodes else \
        FULL if args.nproc < 4 else FULL_4
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nodes and args.nodes < 2:
        raise SystemExit("--nodes needs at least 2 nodes")
    launch(args)


if __name__ == "__main__":
    main()
