"""The rank side of ``varuna-fx train``: ``python -m varuna_fx.train.worker PAYLOAD``.

``varuna-fx train`` runs :func:`run_training` in its own process (``nproc = 1``) or starts this
module under torchrun on every rank, with the resolved configuration as JSON (``PAYLOAD``), so
every rank trains on exactly the configuration the command checked. The loop
(``trainer.py``'s :class:`Trainer`, its parts typed fields) is the preemption-safe one of
docs/checkpoints.md, with the pipeline owning what it can; this module is the rank's process
around it (resume or join, config.toml, summary.json, the exit status, Ctrl-C):

- the model built deferred (each rank allocates its stage), initialised, or left for the load
  when resuming or starting from pretrained weights (``train_model.py``);
- ``pipe.optimizer`` (AdamW; ZeRO-1 when D > 1), gradient clipping with
  ``pipe.clip_grad_norm_``, warmup + cosine (or linear, constant) as a ``LambdaLR``;
- ``pipe.data_loader`` over the data (``train_data.py``): the global sample order is a
  function of (seed, epoch), so the run continues on the same samples on any layout;
- ``vf.Monitor``: the live line, ``metrics.jsonl``, TensorBoard, the charts;
- checkpoints in ``OUT/checkpoints/stepNNNNNNNN`` every ``checkpoint_every`` steps, at the end,
  at ``stop_at`` and when preempted (SIGTERM / SIGUSR1 on any rank: every rank saves the same
  step); the newest is resumed by the same command, on any number of processes.

Rank 0 also writes ``OUT/config.toml`` (the configuration of the latest launch) and
``OUT/summary.json`` (where this launch stopped, and why), which the command reads.

In place (``in_place = true``: ``launch/in_place.py``) the same loop survives morphs:
``pipe.step`` morphs first when a machine left or joins (or re-runs the step on the new layout
when a process vanished), so the step counter, the scheduler (the same object drives the same
optimizer object, re-pointed by the morph) and the loader carry on untouched; the monitor
follows the pipeline (``monitor/monitor.py``) and checkpoints after a morph are the new
layout's. What a process joining the running job needs is tracked (``pipe.track``: the
scheduler, the loader, and :class:`Progress`, the step counter), so it skips the checkpoint and
starts at the survivors' step; a process that leaves exits inside ``pipe.step`` once its state
has moved. The summary lists the morphs. Every process offers its configuration's fingerprint
(``TrainConfig.fingerprint``): a joiner whose configuration differs is refused
(``world/admission.py``). A launch that starts the job again after state was lost with its only
holders says so (``train_resume.Restart``), and in-place jobs take an early first checkpoint
(``first_checkpoint``) so that such a restart does not go back to step 0.

A resume (``train_resume.py``) takes the newest checkpoint that loads and this launch's
optimizer hyperparameters over the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ..api import compile as vf_compile
from ..checkpoint.directory import latest_checkpoint
from ..errors import VarunaFxError
from ..pipeline import Pipeline
from ..world.membership import in_place, job_restarted, membership
from ..world.where import launched_distributed
from .config import TrainConfig, to_toml
from .data import open_data
from .model import build_model, next_token_loss, own_loss
from .resume import Restart, restart_of, resume
from .trainer import (
    SAMPLES,
    Progress,
    Trainer,
    build_monitor,
    held_out,
    lr_factor,
    prune,
    save_checkpoint,
    this_rank,
)

__all__ = ["CHECKPOINTS", "SAMPLES", "SUMMARY", "Progress", "Run", "Trainer", "decode",
           "encode", "lr_factor", "main", "prune", "rank_errors", "report_error", "run_training",
           "save_on_ctrl_c"]

CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"
ERRORS = "errors"  # OUT/errors/rankN.txt: a rank's error, for the command (report_error)
EXAMPLE_BATCH = 8  # the example batch compile traces with (at most the global batch)


class Run:
    """One launch of a training run on this rank."""

    def __init__(self, cfg: TrainConfig, launched_at: float | None,
                 source: dict[str, str] | None = None) -> None:
        self.cfg, self.launched_at = cfg, launched_at
        self.out = Path(cfg.out)
        self.folder = self.out / CHECKPOINTS
        self.source = source or {}
        self.restart: Restart | None = None  # this launch restarts an in-place job
        self.best_val_loss: float | None = None  # the lowest validation loss (eval_every)

    @property
    def rank(self) -> int:
        """This process's rank now (in place, a morph may change it; before compile, in place,
        it is not known yet: 0)."""
        return this_rank()

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"varuna-fx train: {text}", flush=True)

    def build(self) -> tuple[Pipeline, Any, Any, Any, Progress]:
        """The trainer's parts (pipe, optimizer, scheduler, loader, progress)."""
        t = self.build_trainer()
        return t.pipe, t.optimizer, t.scheduler, t.loader, t.progress

    def build_trainer(self) -> Trainer:
        """The model compiled, the trainer's parts built; resumed from the newest checkpoint
        that loads, or joined to the running in-place job, or initialised from pretrained
        weights."""
        cfg = self.cfg
        if in_place():  # a running job refuses a joiner whose configuration differs
            membership().offer(cfg.fingerprint())
        start = latest_checkpoint(self.folder) if self.folder.is_dir() else None
        data = open_data(cfg)
        made = build_model(cfg, data.vocab_size, data.largest_token,
                           initialise=start is None and not cfg.init_from,
                           tokenizer_vocab=data.tokenizer_vocab)
        train_set, held, held_text = held_out(cfg, data.dataset, made.vocab_size, open_data)
        example = torch.zeros(min(cfg.global_batch_size, EXAMPLE_BATCH), cfg.seq_len,
                              dtype=torch.long)
        fed = made.targets_in_forward  # forward(idx, targets): fed the next tokens
        pipe = vf_compile(made.model, example_inputs=(example, example) if fed else (example,),
                          loss_fn=own_loss if fed else next_token_loss,
                          **cfg.compile_options())
        trainer = Trainer.build(cfg, pipe, train_set, held, targets_in_forward=fed)
        plan = pipe.plan
        sharded = pipe.replicas > 1 and cfg.shard_optimizer is not False
        self.say(f"model: {made.description}")
        self.say(f"data: {data.description}")
        if held is not None:
            self.say(f"validation every {cfg.eval_every} steps on "
                     f"{len(trainer.validation)} batch(es) of {held_text}")
        # the batch in the keys' words: micro_batch_size x grad_accum_steps x data_parallel
        self.say(f"plan: P={plan.stages} x D={plan.data_parallel}, {plan.batch_equation}, "
                 f"schedule {plan.schedule.name}, optimizer state "
                 f"{'sharded (ZeRO-1)' if sharded else 'not sharded'}")
        if pipe.joined:  # the running job's state came with the join: newer than a checkpoint
            print(f"varuna-fx train: rank {self.rank} joined the running job at step "
                  f"{trainer.progress.step}", flush=True)
            return trainer
        resumed = None
        if start is not None:  # the newest that loads, the launch's hyperparameters on top
            saved: dict[str, Any] = {}
            resumed = resume(pipe, trainer.optimizer, trainer.scheduler, trainer.loader,
                             self.folder, self.out, self.say, saved)
            trainer.progress.step = 0 if resumed is None else resumed[0]
            trainer.progress.best_val_loss = saved.get("best_val_loss")
        elif cfg.init_from:
            pipe.load_pretrained(cfg.init_from)
            self.say(f"initialised from {cfg.init_from}")
        if in_place() and job_restarted():  # said loudly (the monitor's first line, the
            self.restart = restart_of(resumed, self.out)  # last one, summary.json)
        return trainer

    def save(self, pipe: Pipeline, opt: Any, sched: Any, loader: Any, step: int) -> str:
        return save_checkpoint(self.folder, pipe, opt, sched, loader, step,
                               self.cfg.keep_checkpoints)

    def write(self, name: str, text: str, mode: str = "w") -> None:
        if self.rank == 0:
            with open(self.out / name, mode) as f:
                f.write(text)

    def train(self) -> int:
        """Train to ``stop_at`` or the end; returns 128 + the signal when one stopped it
        (143, or 130 for Ctrl-C), else 0."""
        cfg = self.cfg
        trainer = self.build_trainer()
        pipe, progress = trainer.pipe, trainer.progress
        pipe.install_preemption_handlers()  # (torchrun's ranks have them already)
        save_on_ctrl_c()
        stop = cfg.stop_at or cfg.steps
        if self.rank == 0 and not pipe.joined:
            self.out.mkdir(parents=True, exist_ok=True)
            self.write("config.toml", to_toml(cfg, self.source))
        if progress.step >= stop:
            self.say(f"nothing to train: {self.out} holds step {progress.step} and the run "
                     f"stops at {stop} (raise --steps, or give another --out)")
            if cfg.export and progress.step == cfg.steps:  # relaunched to export the result
                self.export(pipe)
            pipe.close()
            return 0
        first = progress.step
        trainer.monitor = build_monitor(pipe, cfg, first)
        if self.restart is not None:  # before the steps it trains again
            trainer.monitor.event(self.restart.as_dict(), self.restart.text())
        # (an error, or this process leaving an in-place job -- SystemExit from pipe.step once
        # its state moved -- closes the monitor's files without a collective)
        with trainer.monitor:
            trainer.fit(stop)
        preempted = pipe.preempted
        step = progress.step
        if cfg.export and step == cfg.steps:
            self.export(pipe)
        morphs = [m.as_dict() for m in pipe.morphs]
        pipe.close()
        self.best_val_loss = progress.best_val_loss
        self.finish(first, step, trainer.loss, trainer.saved, preempted, trainer.last_step_at,
                    morphs)
        if not preempted:
            return 0
        return 128 + (signal.SIGINT if _INTERRUPTED else signal.SIGTERM)

    def export(self, pipe: Pipeline) -> None:
        pipe.save_pretrained(self.cfg.export)
        self.say(f"exported the model to {self.cfg.export} (Hugging Face safetensors)")

    def finish(self, first: int, step: int, loss: Any, saved: str | None, preempted: bool,
               last_step_at: float, morphs: list[dict[str, Any]]) -> None:
        if self.rank != 0:
            return
        summary = {"first_step": first, "last_step": step, "steps": self.cfg.steps,
                   "final_loss": float(loss) if loss is not None else None,
                   "preempted": preempted, "checkpoint": saved, "morphs": morphs,
                   "restarted": self.restart.as_dict() if self.restart else None,
                   "best_val_loss": self.best_val_loss,
                   "seconds_from_command_to_last_step":
                       last_step_at - self.launched_at if self.launched_at else None}
        self.write(SUMMARY, json.dumps(summary, indent=1) + "\n")
        when = summary["seconds_from_command_to_last_step"]
        timing = f" ({when:.1f} s from the command to the last step)" if when else ""
        self.say(f"steps {first + 1}-{step} of {self.cfg.steps} done{timing}, final loss "
                 f"{summary['final_loss']:.4f}; charts and metrics.jsonl in {self.out}")
        if self.best_val_loss is not None:
            kept = f" (its checkpoint in {self.out / 'best'})" if self.cfg.keep_best else ""
            self.say(f"best validation loss {self.best_val_loss:.4f}{kept}")
        if self.restart is not None:  # (the steps above count from where it restarted)
            self.say(self.restart.text())
        if morphs:
            self.say(f"{len(morphs)} in-place morph(s): " + "; ".join(
                f"{m['reason']} {m['old_layout']} -> {m['new_layout']} in "
                f"{sum(v for k, v in m['phases'].items() if k != 'first_step'):.1f} s"
                for m in morphs))
        if preempted:
            self.say(f"preempted: saved {saved}; the same command resumes from it (on any "
                     "--nproc)")
        elif step < self.cfg.steps:
            self.say(f"stopped at step {step} (stop_at): saved {saved}; the same command "
                     "without stop_at resumes")


_INTERRUPTED: list[int] = []  # Ctrl-C seen (the exit status says so: 130, not 143)


def save_on_ctrl_c() -> None:
    """Ctrl-C (SIGINT: the terminal sends it to the command and every rank) stops as SIGTERM
    does -- every rank saves after the step -- instead of a KeyboardInterrupt that loses the
    steps since the last checkpoint; a second Ctrl-C interrupts at once."""
    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _INTERRUPTED.append(signum)
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption handler takes it from here

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, first)


def run_training(cfg: TrainConfig, launched_at: float | None = None,
                 source: dict[str, str] | None = None) -> int:
    """Train as configured on this process (every rank calls it); the exit status."""
    return Run(cfg, launched_at, source).train()


def decode(payload: str) -> tuple[TrainConfig, float | None, dict[str, str]]:
    """The command's JSON payload (config, launch time, sources) back into objects."""
    data = json.loads(payload)
    return TrainConfig(**data["config"]), data.get("launched_at"), data.get("source", {})


def encode(cfg: TrainConfig, launched_at: float, source: dict[str, str]) -> str:
    return json.dumps({"config": dataclasses.asdict(cfg), "launched_at": launched_at,
                       "source": source})


def report_error(cfg: TrainConfig, exc: VarunaFxError) -> None:
    """One error, printed once: rank 0 prints it; every rank files it as
    ``OUT/errors/rankN.txt``, where the command finds (and prints) an error of a rank on its
    machine that rank 0 did not have -- not the same line once per rank."""
    me = this_rank()
    text = str(exc)
    if me == 0:
        print(f"varuna-fx train: error: {text}", file=sys.stderr, flush=True)
    try:
        folder = Path(cfg.out) / ERRORS
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{me}.txt").write_text(text)
    except OSError:  # no folder to file it in: say it here
        if me != 0:
            print(f"varuna-fx train: error (rank {me}): {text}", file=sys.stderr, flush=True)


def rank_errors(out: str, since: float) -> dict[int, str]:
    """The errors the ranks filed (``report_error``) since ``since``, by rank (each cut at
    2,000 characters: it is printed, never run)."""
    found: dict[int, str] = {}
    for path in (Path(out) / ERRORS).glob("rank*.txt"):
        number = path.stem[len("rank"):]
        try:
            if number.isdigit() and path.stat().st_mtime >= since:
                found[int(number)] = path.read_text(errors="replace")[:2000]
        except OSError:
            continue
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m varuna_fx.train.worker PAYLOAD (started by "
              "`varuna-fx train`)", file=sys.stderr)
        return 2
    cfg, launched_at, source = decode(argv[0])
    try:
        code = run_training(cfg, launched_at, source)
    except VarunaFxError as exc:
        if in_place() and membership().job_finished():
            # started again (the in-place launcher restarts a process that vanished) to join
            # a job that has finished meanwhile: nothing to do, and no failure to restart for
            print(f"varuna-fx train: {membership().member} found the job finished before it "
                  "could join; nothing to do", file=sys.stderr, flush=True)
            return 0
        report_error(cfg, exc)
        return 1
    # preempted or done, the checkpoint is complete: a rank that exits 0 tells torchrun's agent
    # it finished (the command reads summary.json to say whether it was preempted)
    return 0 if launched_distributed() else code


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip torch's slow interpreter teardown (the agent waits on it)
