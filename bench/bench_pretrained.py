"""pipe.load_pretrained / pipe.save_pretrained: peak RSS per rank and seconds (issue 29).

    python bench/bench_pretrained.py make --dir /tmp/gpt2-1g --layers 16 --embd 1024
    python bench/bench_pretrained.py run --dir /tmp/gpt2-1g --nproc 4

``make`` saves a Hugging Face GPT-2 built from a config (no download) with transformers'
``save_pretrained``: 16 layers at d = 1024 and GPT-2's vocabulary hold 254M parameters, a
~1.0 GB fp32 ``model.safetensors``.

``run`` measures, each in a fresh process: the RSS of ``import torch, varuna_fx`` (the base),
the same with transformers imported, and ``AutoModelForCausalLM.from_pretrained`` of the whole
model in one process (seconds and peak RSS). Then ``--nproc`` local gloo ranks (P = nproc)
each build the model under ``vf.deferred_init`` + ``vf.skip_init`` from its config.json,
compile it, ``pipe.load_pretrained(dir)`` (seconds between barriers; the RSS sampled every
5 ms during the load; ``ru_maxrss`` after it) and ``pipe.save_pretrained(dir/export)`` (seconds;
RSS growth sampled during the save). It prints per rank: the stage's share of the weights (its
bytes read), the peak RSS against the target 1.25 x base + share + 150 MB, and the times.
Timings on a loaded machine are noise; RSS is not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

MB = 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """The largest VmRSS seen while the ``with`` block runs (every 5 ms)."""

    def __enter__(self) -> Sampler:
        self.peak, self._stop = _rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def make(args: argparse.Namespace) -> None:
    import torch
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64),
                        vocab_size=args.vocab, n_positions=args.positions, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg)
    model.save_pretrained(args.dir)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir)
               if f.endswith(".safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.dir}: {params / 1e6:.0f}M parameters, {size / 1e9:.2f} GB of safetensors")


def base(_: argparse.Namespace) -> None:
    import torch  # noqa: F401

    import varuna_fx  # noqa: F401
    out = {"base": _peak_mb()}
    import transformers  # noqa: F401
    out["with_transformers"] = _peak_mb()
    print("RESULT " + json.dumps(out), flush=True)


def hf(args: argparse.Namespace) -> None:
    import transformers as tf

    before = _peak_mb()
    seconds = []
    for _ in range(2):  # the first also imports the model's modules
        t = time.perf_counter()
        model = tf.AutoModelForCausalLM.from_pretrained(args.dir)
        seconds.append(time.perf_counter() - t)
        if not seconds[1:]:
            peak = _peak_mb()
            # transformers may leave the weights as views of the file's map (not resident
            # until read): touch them, as training would
            touched = sum(float(p.detach().sum()) for p in model.parameters())
            del model
    print("RESULT " + json.dumps({"seconds": seconds, "peak": peak, "before": before,
                                  "touched_peak": _peak_mb(), "sum": touched}), flush=True)


def rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf

    import varuna_fx as vf

    tf.logging.set_verbosity_error()
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, float] = {"imports": _peak_mb()}
    cfg = tf.AutoConfig.from_pretrained(args.dir)
    with vf.deferred_init(seed=0), vf.skip_init():
        model = tf.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2 * world, args.seq))
    # micro-batches of 2: a distributed compile captures eval mode at the micro-batch size, and
    # torch.export refuses GPT-2 at a batch of 1
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=world,
                      micro_batch_size=2, schedule="1f1b")
    out["compile_peak"], out["before_load"] = _peak_mb(), _rss_mb()
    dist.barrier()
    t = time.perf_counter()
    with Sampler() as sampled:
        report = pipe.load_pretrained(args.dir)
    dist.barrier()
    out["load_s"] = time.perf_counter() - t
    out["load_sampled_peak"], out["peak"] = sampled.peak, _peak_mb()
    out["share_mb"] = report.bytes_read / MB
    out["held_mb"] = sum(t.numel() * t.element_size() for t in pipe.state_dict().values()) / MB
    dist.barrier()
    before = _rss_mb()
    t = time.perf_counter()
    with Sampler() as sampled:
        pipe.save_pretrained(os.path.join(args.dir, "export"))
    dist.barrier()
    out["save_s"] = time.perf_counter() - t
    out["save_growth"] = sampled.peak - before
    out["stage"] = pipe.stage_index
    print("RESULT " + json.dumps(out), flush=True)
    pipe.close()


def _results(cmd: list[str], env: dict[str, str] | None = None) -> list[dict[str, float]]:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = [json.loads(line[7:]) for line in done.stdout.splitlines()
             if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return found


def run(args: argparse.Namespace) -> None:
    me = [sys.executable, __file__]
    bases = [_results([*me, "base"])[0] for _ in range(args.repeats)]
    base_mb = min(b["base"] for b in bases)
    print(f"fresh `import torch, varuna_fx`: {base_mb:.0f} MB peak RSS "
          f"(+ transformers: {min(b['with_transformers'] for b in bases):.0f} MB)")
    loads = [_results([*me, "hf", "--dir", args.dir])[0] for _ in range(args.repeats)]
    print("AutoModelForCausalLM.from_pretrained, one process, first / second call: "
          + ", ".join(f"{r['seconds'][0]:.2f} / {r['seconds'][1]:.2f} s" for r in loads)
          + f"; peak RSS after the first {min(r['peak'] for r in loads):.0f} MB, with every "
          f"weight read {min(r['touched_peak'] for r in loads):.0f} MB")
    from common import free_port, rank_env

    port = free_port()
    procs = []
    for r in range(args.nproc):
        env = rank_env(r, args.nproc, port)
        procs.append(subprocess.Popen([*me, "rank", "--dir", args.dir, "--seq", str(args.seq)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    ranks = []
    for proc in procs:
        text, _ = proc.communicate()
        found = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            sys.exit(f"a rank failed:\n{text[-4000:]}")
        ranks.append(found[0])
    ranks.sort(key=lambda r: r["stage"])
    print(f"\nload_pretrained over {args.nproc} ranks (P = {args.nproc}): "
          f"{max(r['load_s'] for r in ranks):.2f} s; save_pretrained: "
          f"{max(r['save_s'] for r in ranks):.2f} s")
    print("| stage | share read | after imports | compile peak | peak after load | "
          "target 1.25 x base + share + 150 MB | peak / target | load: sampled RSS peak - "
          "before - share | save: RSS growth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ranks:
        target = 1.25 * base_mb + r["share_mb"] + 150
        print(f"| {r['stage']} | {r['share_mb']:.0f} MB | {r['imports']:.0f} MB | "
              f"{r['compile_peak']:.0f} MB | {r['peak']:.0f} MB | {target:.0f} MB | "
              f"{r['peak'] / target:.2f} | "
              f"{r['load_sampled_peak'] - r['before_load'] - r['share_mb']:.0f} MB | "
              f"{r['save_growth']:.0f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--positions", type=int, default=1024)
    sub.add_parser("base")
    p = sub.add_parser("hf")
    p.add_argument("--dir", required=True)
    for name in ("rank", "run"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--seq", type=int, default=64)
        p.add_argument("--nproc", type=int, default=4)
        p.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    {"make": make, "base": base, "hf": hf, "rank": rank, "run": run}[args.command](args)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_pretrained.py"):
        main()
