"""How ``varuna-fx train`` resumes a run folder: which checkpoint, and whose hyperparameters.

* **Which checkpoint.** The newest complete one first; when it cannot be loaded (a damaged or
  truncated file: the load raises ``CheckpointError``, on every rank alike, since ranks agree
  on a load's failure) the next older one, and so on. Resuming from an older one is said on
  the console, naming the newest and why it failed; the steps after it are trained again.
  When none loads, the error names every checkpoint tried with its reason -- damage and a
  configuration that is not the run's read differently there, so the advice fits both. A
  failed load's partial overwrite is cleared by the next load that succeeds (the pipeline
  refuses to step until then: checkpoint/failures.py).
* **Whose hyperparameters.** The checkpoint restores the optimizer's param groups (lr, betas,
  eps, weight decay) and the scheduler's base rates, but the launch's configuration is the
  run's from now on (flags win, as config.toml records): the fresh optimizer's values are
  put back after the load, the current rate recomputed from the schedule at the resumed step,
  and each change said on the console. The schedule's shape (warmup, steps, floor) was never
  saved: it is the configuration's already.
* **An in-place job started again** (state lost with its only holders before a morph could
  move it: ``morph/controller.py``'s restart) resumes like any launch, but says so loudly, on
  the console, in ``summary.json`` (``restarted``) and as a ``"restart"`` event line of
  ``metrics.jsonl``, which names the steps trained again (readers drop the records it
  supersedes: ``monitor/history.read_history``). :class:`Restart` is that note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.directory import checkpoints_newest_first
from ..errors import CheckpointError
from ..monitor.history import RESTART_EVENT
from ..monitor.sinks import METRICS, read_jsonl
from ..pipeline import Pipeline

# the param-group keys the configuration sets (lr goes through the scheduler's base rates)
_GROUP_KEYS = ("betas", "eps", "weight_decay")


def resume(pipe: Pipeline, opt: Any, sched: Any, loader: Any, folder: Path, out: Path,
           say: Callable[[str], None], extra: dict[str, Any] | None = None
           ) -> tuple[int, str] | None:
    """Load the newest checkpoint under ``folder`` that loads; (its step, its path), or None
    when there is none. The launch's hyperparameters are put back on ``opt`` and ``sched``
    after it. ``extra`` (a dict) receives what the checkpoint saved beside the step."""
    candidates = checkpoints_newest_first(folder) if folder.is_dir() else []
    if not candidates:
        return None
    fresh = _hyperparameters(opt, sched)
    failed: list[tuple[str, str]] = []
    for path in candidates:
        try:
            saved = pipe.load_checkpoint(path, opt, data=loader, scheduler=sched)
            step = int(saved["step"])
        except CheckpointError as exc:
            failed.append((path, str(exc)))
            continue
        for newer, why in failed:
            say(f"{newer} cannot be resumed ({_without(newer, why)}); it is skipped, and the "
                f"steps after {path} are trained again")
        say(f"resumed from {path} (step {step})")
        if extra is not None:
            extra.update(saved)
        changes = take_launch_hyperparameters(opt, sched, fresh)
        if changes:
            say(f"resumed with {', '.join(changes)} (this launch's flags win over the "
                "checkpoint's; config.toml records them)")
        return step, path
    tried = "; ".join(f"{path}: {_without(path, why)}" for path, why in failed)
    count = f"none of the {len(failed)} checkpoints" if len(failed) > 1 else "its checkpoint"
    raise CheckpointError(
        f"{out} holds a run, but {count} can be resumed ({tried}). If the files are damaged, "
        f"move them away (the run starts again from the newest that loads, or from step 0); if "
        f"this configuration is not the run's, the folder cannot resume it: give another --out, "
        f"or the configuration the run was saved with ({out / 'config.toml'} holds its last "
        "launch's)")


@dataclass(frozen=True)
class Restart:
    """An in-place job started again (state lost with its only holders): where it continues
    and what was trained before that is trained again."""

    step: int  # the step it continues from (0: no checkpoint had been saved)
    checkpoint: str | None
    logged: int  # the last step metrics.jsonl held before (0: none)

    def as_dict(self) -> dict[str, Any]:
        again = [self.step + 1, self.logged] if self.logged > self.step else None
        return {"event": RESTART_EVENT, "step": self.step, "checkpoint": self.checkpoint,
                "trained_again": again, "reason": "in-place state lost with its only holders"}

    def text(self) -> str:
        where = (f"from {self.checkpoint} (step {self.step})" if self.checkpoint else
                 "from step 0: no checkpoint had been saved yet")
        again = (f"; steps {self.step + 1}-{self.logged}, logged before, are trained again "
                 f"(metrics.jsonl marks them with a \"{RESTART_EVENT}\" event)"
                 if self.logged > self.step else "")
        return (f"RESTARTED: the in-place job lost state with its only holders (every copy of "
                f"a stage, or a ZeRO-1 shard, went with the processes lost) and continues "
                f"{where}{again}")


def restart_of(resumed: tuple[int, str] | None, out: Path) -> Restart:
    """The restart this launch is, given what it resumed (None: nothing) and the run's
    metrics so far."""
    step, checkpoint = resumed if resumed is not None else (0, None)
    logged = [r["step"] for r in read_jsonl(out / METRICS)]
    return Restart(step, checkpoint, max(logged, default=0))


def _hyperparameters(opt: Any, sched: Any) -> dict[str, Any]:
    """What the fresh optimizer and scheduler hold: the launch's configuration."""
    return {"base_lrs": list(sched.base_lrs),
            "groups": [{k: g[k] for k in _GROUP_KEYS if k in g} for g in opt.param_groups]}


def take_launch_hyperparameters(opt: Any, sched: Any, fresh: dict[str, Any]) -> list[str]:
    """Put the launch's values (``fresh``, taken before the load) back over the loaded ones;
    the changes, as ``"lr 0.003 -> 0.001"``."""
    changes: list[str] = []
    if list(sched.base_lrs) != fresh["base_lrs"]:
        changes.append(f"lr {_show(sched.base_lrs)} -> {_show(fresh['base_lrs'])}")
    for key in _GROUP_KEYS:
        loaded = [g.get(key) for g in opt.param_groups]
        wanted = [g.get(key) for g in fresh["groups"]]
        if loaded == wanted:
            continue
        if key == "betas":
            for i, name in enumerate(("beta1", "beta2")):
                was, now = [b[i] for b in loaded], [b[i] for b in wanted]
                if was != now:
                    changes.append(f"{name} {_show(was)} -> {_show(now)}")
        else:
            # only the groups that carry the key's configured value (the no-decay group
            # keeps weight_decay 0 whatever the flag)
            was = [v for v, w in zip(loaded, wanted, strict=True) if v != w]
            now = [w for v, w in zip(loaded, wanted, strict=True) if v != w]
            changes.append(f"{key} {_show(was)} -> {_show(now)}")
    bases = list(fresh["base_lrs"])
    rates = [base * factor(sched.last_epoch)
             for base, factor in zip(bases, sched.lr_lambdas, strict=True)]
    for group, values, base, rate in zip(opt.param_groups, fresh["groups"], bases,
                                         rates, strict=True):
        group.update(values)
        group["initial_lr"], group["lr"] = base, rate
    # through the scheduler's own state: get_last_lr() reports the new rates until its next step
    state = sched.state_dict()
    state.update(base_lrs=bases, _last_lr=rates)
    sched.load_state_dict(state)
    return changes


def _without(path: str, why: str) -> str:
    """A load's message without the path it starts with (said beside it already)."""
    return why[len(path) + 2:] if why.startswith(f"{path}: ") else why


def _show(values: list[Any]) -> str:
    """One value when every group has it (the usual case), else the list."""
    distinct = list(dict.fromkeys(values))
    return f"{distinct[0]:g}" if len(distinct) == 1 else "[" + ", ".join(
        f"{v:g}" for v in values) + "]"
