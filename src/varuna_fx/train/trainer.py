"""The training loop of ``varuna-fx train`` as a :class:`Trainer`: its parts are typed fields.

torchtitan's pattern: each part is built from its own section of the configuration
(``[optimizer]``: :func:`build_optimizer` and :func:`build_scheduler`; ``[data]``:
:func:`build_loader`; ``[monitor]``: :func:`build_monitor`), the trainer holds them, and
:meth:`Trainer.fit` is the loop a user would write by hand::

    for step in range(first, stop):
        x, y = next(batches)
        pipe.zero_grad()
        loss = pipe.step(x, target=y)
        pipe.clip_grad_norm_(grad_clip)
        pipe.optimizer_step(optimizer)
        scheduler.step()
        monitor.log(loss, lr=..., grad_norm=...)
        # every checkpoint_every steps, at stop and when preempted: save

What a launch does around it -- resuming, joining an in-place job, the summary file, the exit
status, Ctrl-C -- is the rank process's (``worker.py``) and the command's (``launch/train.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Subset

from ..checkpoint.directory import MARKER
from ..data.loader import GlobalBatchLoader
from ..errors import InputError
from ..monitor.monitor import Monitor
from ..pipeline import Pipeline
from ..world.where import launched_distributed, rank
from .config import AUTO, TrainConfig

SAMPLES = "samples.jsonl"
BEST = "best"  # keep_best's folder under out


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """The LR multiplier of step s (0-based; ``LambdaLR``): a linear warmup to 1, then down
    to ``min_lr_ratio`` at the last step (cosine or linear) or constant."""
    warmup, steps, floor = cfg.warmup, cfg.steps, cfg.min_lr_ratio

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" \
            else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_optimizer(pipe: Pipeline, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (sharded over the replicas when compile shards):
    weight decay on weights of two or more dimensions only, as nanoGPT and Megatron do. In
    place both groups are kept, even empty: a morph files each parameter under its group's
    index, which must mean the same group on every rank."""
    decay = [p for _, p in pipe.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in pipe.named_parameters() if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": rest, "weight_decay": 0.0})
              if g["params"] or cfg.in_place]
    return pipe.optimizer(torch.optim.AdamW, groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                          eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """Warmup, then cosine, linear or constant (``lr_factor``)."""
    return LambdaLR(optimizer, lr_factor(cfg))


def build_loader(pipe: Pipeline, dataset: Any, cfg: TrainConfig) -> GlobalBatchLoader:
    """This replica's share of each global batch, in the order of (seed, epoch)."""
    return pipe.data_loader(dataset, shuffle=cfg.shuffle, seed=cfg.seed,
                            num_workers=cfg.num_workers)


def build_monitor(pipe: Pipeline, cfg: TrainConfig, start_step: int) -> Monitor:
    """The live line, metrics.jsonl, TensorBoard, W&B and the charts, under ``out``."""
    return Monitor(pipe, Path(cfg.out), total_steps=cfg.steps, start_step=start_step,
                   print_every=cfg.print_every, live=_auto(cfg.live),
                   tensorboard=_auto(cfg.tensorboard), wandb=cfg.wandb, charts=cfg.charts,
                   peak_flops=None if cfg.peak_flops == AUTO else cfg.peak_flops)


def _auto(value: Any) -> bool | None:
    return None if value == AUTO else value


def prune(folder: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (rank 0, after a save)."""
    done = sorted(p for p in folder.glob("step*") if (p / MARKER).is_file())
    for old in done[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(folder: Path, pipe: Pipeline, optimizer: torch.optim.Optimizer,
                    scheduler: LambdaLR, loader: GlobalBatchLoader, step: int,
                    keep: int, best_val_loss: float | None = None) -> str:
    """``folder/stepNNNNNNNN`` with everything a resume needs; the oldest beyond ``keep``
    removed."""
    path = str(folder / f"step{step:08d}")
    extra: dict[str, Any] = {"step": step}
    if best_val_loss is not None:  # (a resume carries on keeping the best)
        extra["best_val_loss"] = best_val_loss
    pipe.save_checkpoint(path, optimizer, data=loader, scheduler=scheduler, extra=extra)
    if this_rank() == 0:
        prune(folder, keep)
    return path


def this_rank() -> int:
    """This process's rank now (in place, a morph may change it; before compile, in place,
    it is not known yet: 0)."""
    return rank() if launched_distributed() else 0


class Progress:
    """The steps done (and the best validation loss so far), as an object ``pipe.track``
    hands to a process joining an in-place job (with the scheduler's and the loader's states:
    it continues the count, not step 0)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.best_val_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "best_val_loss": self.best_val_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        best = state.get("best_val_loss")
        self.best_val_loss = None if best is None else float(best)


def held_out(cfg: TrainConfig, dataset: Any, vocab_size: int | None,
             open_file: Callable[[TrainConfig], Any]) -> tuple[Any, Any, str]:
    """(the samples trained on, the held-out ones or None, what they are). ``eval_fraction``
    takes the last samples of ``data`` (one sample between them is dropped, so no token is
    in both); ``eval_data`` is a file of its own, opened as data is (``open_file``)."""
    need = cfg.global_batch_size
    if cfg.eval_fraction:
        n = len(dataset)
        k = int(n * cfg.eval_fraction)
        if k < need or n - k - 1 < need:
            raise InputError(f"eval_fraction = {cfg.eval_fraction} of {cfg.data}'s {n} samples "
                             f"leaves {k} held out and {max(0, n - k - 1)} to train on; each "
                             f"needs a global batch ({need}): change eval_fraction, or give "
                             "more data")
        return (Subset(dataset, range(n - k - 1)), Subset(dataset, range(n - k, n)),
                f"the last {k:,} samples of the data (not trained on)")
    if cfg.eval_data:
        held = open_file(dataclasses.replace(cfg, data=cfg.eval_data))
        if vocab_size is not None and held.largest_token >= vocab_size:
            raise InputError(f"eval_data {cfg.eval_data} holds token id {held.largest_token}, "
                             f"but the model's vocabulary has {vocab_size} entries: give "
                             "held-out data tokenized as data is")
        if len(held.dataset) < need:
            raise InputError(f"eval_data {cfg.eval_data} holds {len(held.dataset)} samples of "
                             f"{cfg.seq_len}, less than one global batch ({need})")
        return dataset, held.dataset, held.description
    return dataset, None, ""


def validation_batches(cfg: TrainConfig, held: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``eval_batches`` global batches of the held-out samples, in order: the
    same ones at every validation, whole on every rank (``pipe.evaluate``)."""
    count = min(cfg.eval_batches, len(held) // cfg.global_batch_size)
    batches = []
    for b in range(count):
        samples = [held[i] for i in range(b * cfg.global_batch_size,
                                          (b + 1) * cfg.global_batch_size)]
        batches.append((torch.stack([x for x, _ in samples]),
                        torch.stack([y for _, y in samples])))
    return batches


@dataclass
class Trainer:
    """One rank's training: the pipeline and the parts the loop drives."""

    cfg: TrainConfig
    pipe: Pipeline
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: GlobalBatchLoader
    progress: Progress
    monitor: Monitor | None = None  # built when the loop starts (it knows the first step)
    validation: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    targets_in_forward: bool = False  # the model takes the next tokens (nanoGPT): step(x, y)
    # what the loop ends with (the summary reads them)
    loss: Any = None
    saved: str | None = None
    last_step_at: float = 0.0

    @classmethod
    def build(cls, cfg: TrainConfig, pipe: Pipeline, dataset: Any, held: Any = None, *,
              targets_in_forward: bool = False) -> Trainer:
        """Every part from its section. Tracked (in place; nothing otherwise) in this order
        on every process: a joining one receives their states in it."""
        optimizer = build_optimizer(pipe, cfg)
        scheduler = pipe.track(build_scheduler(optimizer, cfg))
        loader = build_loader(pipe, dataset, cfg)
        progress = pipe.track(Progress())
        validation = validation_batches(cfg, held) if held is not None else []
        return cls(cfg, pipe, optimizer, scheduler, loader, progress, validation=validation,
                   targets_in_forward=targets_in_forward)

    @property
    def folder(self) -> Path:
        return Path(self.cfg.out) / "checkpoints"

    def save(self, step: int) -> str:
        self.saved = save_checkpoint(self.folder, self.pipe, self.optimizer, self.scheduler,
                                     self.loader, step, self.cfg.keep_checkpoints,
                                     self.progress.best_val_loss)
        return self.saved

    def validate(self, step: int) -> float | None:
        """The validation loss now (every rank: a collective); with ``keep_best``, a new
        lowest one saves its checkpoint under ``best/`` (the previous best removed). None
        when validation went off: after an in-place morph a rank holding only its stage cannot
        cut the eval-mode stages of a model whose eval graph differs (every rank alike)."""
        try:
            loss = self.pipe.evaluate([((x, y), None) for x, y in self.validation]
                                      if self.targets_in_forward else self.validation)
        except InputError as exc:
            if not self.pipe.morphs:
                raise
            self.validation = []
            if this_rank() == 0:
                print(f"varuna-fx train: validation is off from step {step} on: after the "
                      f"morph {exc}", flush=True)
            return None
        best = self.progress.best_val_loss
        if best is None or loss < best:  # the same float on every rank: they agree
            self.progress.best_val_loss = loss
            if self.cfg.keep_best:
                folder = Path(self.cfg.out) / BEST
                path = save_checkpoint(folder, self.pipe, self.optimizer, self.scheduler,
                                       self.loader, step, 0, loss)
                if this_rank() == 0:  # the previous best goes (a later step, after a resume
                    for old in folder.glob("step*"):  # from an earlier checkpoint, too)
                        if str(old) != path:
                            shutil.rmtree(old, ignore_errors=True)
                    (folder / "best.json").write_text(json.dumps(
                        {"step": step, "val_loss": loss, "checkpoint": path}) + "\n")
        return loss

    def fit(self, stop: int) -> None:
        """The steps up to ``stop`` (or a preemption: saved after its step)."""
        cfg, pipe, monitor = self.cfg, self.pipe, self.monitor
        assert monitor is not None, "build_monitor first (the loop logs every step)"
        batches = self.loader.forever()
        self.last_step_at = time.time()
        while self.progress.step < stop:
            x, y = next(batches)
            pipe.zero_grad()
            # (in place: a morph may run first)
            self.loss = pipe.step(x, y) if self.targets_in_forward else pipe.step(x, target=y)
            scalars = {"lr": self.scheduler.get_last_lr()[0]}
            if cfg.grad_clip:
                scalars["grad_norm"] = float(pipe.clip_grad_norm_(cfg.grad_clip))
            pipe.optimizer_step(self.optimizer)
            self.scheduler.step()
            self.progress.step += 1
            step = self.progress.step
            if self.validation and (step % cfg.eval_every == 0 or step == cfg.steps):
                val_loss = self.validate(step)
                if val_loss is not None:
                    scalars["val_loss"] = val_loss
            self.last_step_at = time.time()
            monitor.log(self.loss, **scalars)
            if cfg.log_samples and this_rank() == 0:
                with open(Path(cfg.out) / SAMPLES, "a") as f:
                    f.write(json.dumps({"step": step,
                                        "ids": self.loader.last_global_batch()}) + "\n")
            if pipe.preempted or step == stop or step == cfg.first_checkpoint_step or \
                    (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                self.save(step)
            if pipe.preempted:
                break
