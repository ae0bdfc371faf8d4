"""vf.deferred_init: peak RSS per rank under 4 ranks, and materialise time vs an eager build.

    python bench/bench_deferred.py materialise --layers 12 --embd 768
    python bench/bench_deferred.py ranks --nproc 4 --layers 24 --embd 1024 [--eager] [--adamw]

``ranks`` starts ``--nproc`` local gloo ranks (the environment torchrun gives) that each build
the GPT (under ``vf.deferred_init``, or eagerly with ``--eager``: today's path, every rank
builds everything and releases the rest), compile it with P = nproc, take one step with SGD
(or AdamW) and report their peak RSS (``ru_maxrss``) after the build, the compile and the step,
with the bytes of their stage's weights, gradients and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, Block, GPTConfig, _init_weights, lm_loss
from varuna_fx.init.materialize import materialize_tensors


def _cfg(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64),
                     vocab_size=args.vocab, block_size=args.block)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def materialise(args: argparse.Namespace) -> None:
    cfg = _cfg(args)
    times: dict[str, list[float]] = {"eager build (torch.empty + its initialisers)": [],
                                     "deferred build (record on meta)": [],
                                     "vf.materialize (allocate + replay)": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        model = GPT(cfg)
        times["eager build (torch.empty + its initialisers)"].append(time.perf_counter() - t)
        del model
        t = time.perf_counter()
        with vf.deferred_init(seed=0):
            model = GPT(cfg)
        times["deferred build (record on meta)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        vf.materialize(model)
        times["vf.materialize (allocate + replay)"].append(time.perf_counter() - t)
        del model
    # one stage of four: its blocks eagerly (torch.empty + the same initialisers) against
    # materialising just those tensors of a deferred model
    blocks = [f"h.{i}." for i in range(max(1, cfg.n_layer // 4))]
    eager_stage, deferred_stage = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        stage = nn.ModuleList([Block(cfg) for _ in blocks])
        stage.apply(_init_weights)
        eager_stage.append(time.perf_counter() - t)
        del stage
        with vf.deferred_init(seed=0):
            model = GPT(cfg)
        names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]
                 if n.startswith(tuple(blocks))]
        t = time.perf_counter()
        materialize_tensors(model, names, torch.device("cpu"))
        deferred_stage.append(time.perf_counter() - t)
        del model
    times[f"one stage ({len(blocks)} blocks) eagerly"] = eager_stage
    times[f"one stage ({len(blocks)} blocks) materialised"] = deferred_stage
    for k, v in times.items():
        print(f"{k:48s} median {sorted(v)[len(v) // 2]:.3f} s  (runs: "
              + ", ".join(f"{x:.3f}" for x in v) + ")")


def rank(args: argparse.Namespace) -> None:
    cfg = _cfg(args)
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, float] = {"base": _peak_mb()}
    torch.manual_seed(0)
    if args.eager:
        model = GPT(cfg)
    else:
        with vf.deferred_init(seed=0):
            model = GPT(cfg)
    out["build"] = _peak_mb()
    tokens = torch.randint(0, cfg.vocab_size, (world, cfg.block_size + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=world,
                      micro_batch_size=1, schedule="1f1b")
    out["compile"] = _peak_mb()
    opt = (torch.optim.AdamW if args.adamw else torch.optim.SGD)(pipe.parameters(), lr=1e-4)
    pipe.step(x, target=y)
    opt.step()
    out["step"] = _peak_mb()
    held = sum(p.numel() * p.element_size() for p in pipe.parameters())
    out["weights_mb"] = held / 2**20
    out["state_mb"] = held * (4 if args.adamw else 2) / 2**20  # weights, grads (+ 2 moments)
    out["stage"] = pipe.stage_index
    print("RESULT " + json.dumps(out), flush=True)
    pipe.close()


def ranks(args: argparse.Namespace) -> None:
    from common import free_port, rank_env

    port = free_port()
    cmd = [sys.executable, __file__, "rank", *sys.argv[2:]]
    procs = []
    for r in range(args.nproc):
        env = rank_env(r, args.nproc, port)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for r, p in enumerate(procs):
        text, _ = p.communicate(timeout=3600)
        line = [x for x in text.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"rank {r} failed:\n{text[-3000:]}")
            continue
        o = json.loads(line[0][7:])
        need = o["base"] + o["state_mb"]
        print(f"rank {r} stage {o['stage']}: peak RSS base {o['base']:.0f} MB, build "
              f"{o['build']:.0f}, compile {o['compile']:.0f}, step {o['step']:.0f} MB; stage "
              f"weights {o['weights_mb']:.0f} MB, weights+grads+optimizer {o['state_mb']:.0f} MB;"
              f" step peak / (base + that) = {o['step'] / need:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["materialise", "ranks", "rank"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--adamw", action="store_true")
    args = parser.parse_args()
    {"materialise": materialise, "ranks": ranks, "rank": rank}[args.mode](args)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_deferred.py", part=sys.argv[1] if len(sys.argv) > 1 else None):
        main()
