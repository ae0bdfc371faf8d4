"""``varuna-fx train``: the default run, and a preempted run resumed on other process counts.

    python bench/bench_train.py default [--write]   # the command with no arguments
    python bench/bench_train.py resume [--write] [--stop N] [--signal-at K]

``default`` runs ``varuna-fx train`` with no arguments in an empty folder (so ``runs/train``
is fresh) and reports the wall time from starting the command to the last step's record in
``metrics.jsonl`` (Python's start, imports, the corpus, compile and every step included), to
the exit (the charts included), the steps, the first and final loss, the plan, the machine's
load average before and after; it copies the charts to ``bench/figures/train_default_*.png``.

``resume``: the default configuration with ``log_samples`` (each step's global batch as
dataset indices) and periodic checkpoints off, the layout on 2 processes pinned (P=2, 1F1B:
see ``PINNED``). An uninterrupted run on 2 processes to step
``--stop`` (40); another on 2 processes sent SIGTERM once ``--signal-at`` (20) steps are logged
(it saves at the step it is in, s, and exits 143); its folder copied three times and resumed by
the same command on 2, 1 and 3 processes to ``--stop``. For each step after s: whether every
run's global batch is the uninterrupted run's, and each run's loss against it (exact on the
same layout: P and D as before; up to summation order on another).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import HERE, SRC, write_block

COMMAND = [sys.executable, "-m", "varuna_fx.launch.cli", "train"]


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def records(out: Path, name: str = "metrics.jsonl") -> dict[int, dict[str, Any]]:
    """Each step's last record (a resumed run appends to the stopped run's file)."""
    return {r["step"]: r for r in map(json.loads, (out / name).read_text().splitlines())}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def default(write: bool) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench_train_"))
    before = load()
    began = time.time()
    done = subprocess.run(COMMAND, cwd=folder, env=env(), capture_output=True, text=True)
    ended = time.time()
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    out = folder / "runs" / "train"
    metrics = records(out)
    last = metrics[max(metrics)]
    plan = next(line for line in done.stdout.splitlines() if "plan:" in line)
    for chart in ("training", "timeline"):
        shutil.copy(out / "charts" / f"{chart}.png", HERE / "figures" / f"train_default_{chart}.png")
    rows = [
        ("steps", f"{len(metrics)}"),
        ("wall, command to the last step", f"{last['time'] - began:.1f} s"),
        ("wall, command to exit (charts drawn)", f"{ended - began:.1f} s"),
        ("loss, first step -> last", f"{metrics[1]['loss']:.3f} -> {last['loss']:.3f}"),
        ("median step (pipe.step) / plan's prediction",
         f"{_median(r['step_seconds'] for r in metrics.values()) * 1e3:.0f} ms / "
         f"{last['predicted_step_seconds'] * 1e3:.0f} ms"),
        ("plan", plan.split("plan: ", 1)[1]),
        ("load average (1/5/15 min) before; after", f"{before}; {load()}"),
    ]
    text = "\n".join(["`python bench/bench_train.py default` (`varuna-fx train`, no arguments, "
                      f"in an empty folder), {time.strftime('%Y-%m-%d')}:", "",
                      "| what | measured |", "| --- | --- |",
                      *(f"| {a} | {b} |" for a, b in rows), "",
                      "Charts: `bench/figures/train_default_training.png`, "
                      "`bench/figures/train_default_timeline.png`."])
    print(text)
    if write:
        write_block("bench_train.py default", text)
    shutil.rmtree(folder, ignore_errors=True)


def _median(values: Any) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def train(out: Path, nproc: int, stop: int) -> str:
    """Run to ``stop`` on ``nproc`` processes (resuming what ``out`` holds); the plan line."""
    done = subprocess.run([*COMMAND, *FLAGS, *layout(nproc), "--out", str(out), "--nproc",
                           str(nproc), "--stop-at", str(stop)], env=env(), capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return next(line for line in done.stdout.splitlines() if "plan:" in line).split("plan: ")[1]


FLAGS = ["--log-samples", "--checkpoint-every", "0", "--charts", "false",
         "--tensorboard", "false"]
# on 2 processes a layout the default run gets, pinned: "auto" choices follow the timings the
# planner measures (the network probe), and another layout or order of the micro-batches sums
# the gradients in another order (the micro-batch size is the default's, 4)
PINNED = ["--stages", "2", "--schedule", "1f1b"]


def layout(nproc: int) -> list[str]:
    return PINNED if nproc == 2 else []


def terminated(out: Path, at: int) -> int:
    """Start a 2-process run, SIGTERM the command once ``at`` steps are logged; the step
    saved."""
    proc = subprocess.Popen([*COMMAND, *FLAGS, *PINNED, "--out", str(out), "--nproc", "2"],
                            env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    samples = out / "samples.jsonl"
    while not (samples.exists() and len(samples.read_text().splitlines()) >= at):
        if proc.poll() is not None:
            raise SystemExit(f"the run ended ({proc.returncode}) before step {at}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    if code != 143 or not summary["preempted"]:
        raise SystemExit(f"exit status {code}, summary {summary}")
    return summary["last_step"]


def resume(write: bool, stop: int, signal_at: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_train_resume_"))
    before = load()
    plans = {"uninterrupted": train(root / "whole", 2, stop)}
    s = terminated(root / "stopped", signal_at)
    runs = {}
    for nproc in (2, 1, 3):
        out = root / f"resumed{nproc}"
        shutil.copytree(root / "stopped", out)
        plans[f"resumed on {nproc}"] = train(out, nproc, stop)
        runs[nproc] = out
    whole, ids = records(root / "whole"), records(root / "whole", "samples.jsonl")
    lines = ["| step | same samples (2, 1, 3 processes) | loss uninterrupted | resumed on 2 "
             "(P, D as before) | on 1 | on 3 |", "| --- | --- | --- | --- | --- | --- |"]
    same_ids, exact, worst = True, True, {1: 0.0, 3: 0.0}
    for k in range(s + 1, stop + 1):
        got = {n: records(out)[k]["loss"] for n, out in runs.items()}
        match = [records(out, "samples.jsonl")[k]["ids"] == ids[k]["ids"]
                 for out in runs.values()]
        same_ids &= all(match)
        exact &= got[2] == whole[k]["loss"]
        for n in (1, 3):
            worst[n] = max(worst[n], abs(got[n] - whole[k]["loss"]))
        lines.append(f"| {k} | {'yes' if all(match) else 'NO'} | {whole[k]['loss']:.7f} | "
                     f"{'= (bit for bit)' if got[2] == whole[k]['loss'] else f'{got[2]:.7f}'} | "
                     f"{got[1]:.7f} | {got[3]:.7f} |")
    text = "\n".join([
        f"`python bench/bench_train.py resume --stop {stop} --signal-at {signal_at}`, "
        f"{time.strftime('%Y-%m-%d')}, load average {before} before: the default configuration, "
        f"SIGTERM to the command after {signal_at} logged steps; it saved step {s} and exited "
        f"143; resumed by the same command on 2, 1 and 3 processes to step {stop}.", "",
        f"Every step's global batch equals the uninterrupted run's: "
        f"{'yes' if same_ids else 'NO'}. Same layout, losses bit for bit: "
        f"{'yes' if exact else 'NO'}. Largest |loss difference|: {worst[1]:.2e} on 1 process, "
        f"{worst[3]:.2e} on 3.", "", *lines, "",
        *(f"- {name}: {plan}" for name, plan in plans.items())])
    print(text)
    if write:
        write_block("bench_train.py resume", text)
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["default", "resume"])
    parser.add_argument("--write", action="store_true", help="replace its block in RESULTS.md")
    parser.add_argument("--stop", type=int, default=40, help="resume: the last step")
    parser.add_argument("--signal-at", type=int, default=20,
                        help="resume: SIGTERM once this many steps are logged")
    args = parser.parse_args()
    if args.what == "default":
        default(args.write)
    else:
        resume(args.write, args.stop, args.signal_at)


if __name__ == "__main__":
    main()
