"""The monitor's optional Weights & Biases sink (``pip install 'varuna_fx[wandb]'``): the same
interface as ``sinks.py``'s (``write`` a step's record, ``write_event`` a morph, ``close``).

Offline unless told otherwise: a training job should not reach the network because a package
is installed, and a job on a machine without a W&B login would stop at its prompt. So the run
is offline (files under ``<out_dir>/wandb``, uploaded later with ``wandb sync``) unless the
environment's ``WANDB_MODE`` or the ``mode`` the user gives says another.

One ``wandb.log`` per step with all its numbers (lists -- the per-rank totals -- and strings
are left out; ``step`` is W&B's step), handed to W&B's own service process: measured at about
1.5 ms of the loop's time per step on a busy 2-core machine (wandb 0.31, offline). Keeping
records to log later would not make that cheaper (W&B takes one step per call), so they go as
they come and a live dashboard stays live. W&B is told to be quiet and to leave the console
alone (``Settings(quiet=True, console="off")``: its capture of stdout would wrap the monitor's
own line) unless the user passes ``settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import InputError
from .morph_events import EVENT as MORPH_EVENT
from .morph_events import tensorboard_scalars
from .sinks import NOT_SCALARS

DEFAULT_PROJECT = "varuna-fx"


class WandbSink:
    def __init__(self, wandb: Any, directory: Path, settings: dict[str, Any],
                 config: dict[str, Any]) -> None:
        kwargs: dict[str, Any] = {"project": DEFAULT_PROJECT, "dir": str(directory)}
        if "mode" not in settings and not os.environ.get("WANDB_MODE"):
            kwargs["mode"] = "offline"
        if "settings" not in settings:
            kwargs["settings"] = wandb.Settings(quiet=True, console="off")
        kwargs.update(settings)
        kwargs["config"] = {**config, **dict(settings.get("config") or {})}
        try:
            self.run = wandb.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - W&B's own errors: login, a bad setting, ...
            raise InputError(
                f"Monitor(wandb=...): wandb.init({_shown(kwargs)}) failed: {exc}. Set "
                "WANDB_MODE=offline (no network, no login) or log in with `wandb login`, "
                "and check the settings passed") from exc

    def write(self, record: dict[str, Any]) -> None:
        numbers = {key: value for key, value in record.items()
                   if key not in NOT_SCALARS and isinstance(value, int | float)
                   and not isinstance(value, bool)}
        self.run.log(numbers, step=record["step"])

    def write_event(self, event: dict[str, Any]) -> None:
        """An in-place morph: its seconds, phases and bytes under ``morph/`` at its step (other
        events are the JSONL file's alone)."""
        if event.get("event") == MORPH_EVENT:
            self.write(tensorboard_scalars(event))

    def close(self) -> None:
        self.run.finish()


def _shown(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in ("config", "settings"))


def check_wandb_setting(value: Any) -> None:
    """``Monitor(wandb=...)``: False (none), True (W&B's defaults, project ``varuna-fx``) or a
    dict of ``wandb.init`` keyword arguments (``project``, ``name``, ``mode``, ``tags``, ``id``,
    ``resume``, ``config``, ...)."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InputError(f"Monitor: wandb={value!r}: pass True, False or a dict of wandb.init "
                         "keyword arguments, e.g. wandb={'project': 'mine', 'mode': 'offline'}")
    if value.get("config") is not None and not isinstance(value["config"], dict):
        raise InputError(f"Monitor: wandb['config']={value['config']!r} must be a dict")


def wandb_sink(directory: Path, setting: bool | dict[str, Any],
               config: dict[str, Any]) -> WandbSink | None:
    """The sink ``setting`` asks for (``check_wandb_setting``'s), or None for False."""
    if setting is False:
        return None
    try:
        import wandb
    except ImportError as exc:
        raise InputError("Monitor: wandb= asks for Weights & Biases, but it is not installed: "
                         "pip install 'varuna_fx[wandb]' (or leave wandb=False)") from exc
    return WandbSink(wandb, directory, {} if setting is True else dict(setting), config)
