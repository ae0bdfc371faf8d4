"""What a joining process is handed besides tensors, and holds until its script makes the objects
it belongs to.

A process that joins a running job compiles (``vf.compile`` admits it and moves its stage's
weights in), and only then does its script make ``pipe.optimizer(...)``, schedulers and
``pipe.data_loader(...)``. The survivors' rank 0 writes a *recipe* into the membership store for
it: the torch RNG state the step seeds are drawn from, the fp16 loss scale, the optimizer's
param groups (which group each FQN belongs to, and each group's current hyperparameters: the
learning rate a scheduler has set), the state of every object registered with ``pipe.track``
in registration order (a data loader's positioned at the step the joiner runs first), and the
latest checkpoint. The joiner keeps it in a :class:`Carried` and applies each part when the
script makes the object: the same calls as on the survivors, the same numbers after.

Encoded as a checkpoint's plain data is (``torch.save``, read back with ``weights_only``), so
reading it never runs code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.contents import class_name, rng_state, set_rng_state
from ..checkpoint.optimizer_state import decode, encode, restore_optimizer
from ..errors import VarunaFxError
from ..runtime.precision import LossScaler
from ..runtime.step import Runtime
from ..runtime.sync.zero import Made
from ..runtime.sync.zero_repoint import repoint_optimizer


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def recipe(scaler: LossScaler, optimizer: torch.optim.Optimizer | None, group_of: dict[str, int],
           setting: Any, tracked: list[Any], checkpoint: str | None,
           rng: dict[str, Any] | None = None) -> torch.Tensor:
    """The survivors' rank 0: what a joiner needs, encoded (``rng``: the state to hand on,
    default this process's now)."""
    scale = scaler.state_dict()
    return encode({
        "rng": rng if rng is not None else rng_state(),
        "scaler": [scale["scale"], scale["clean_steps"]],
        "optimizer": None if optimizer is None else {
            "class": class_name(optimizer), "group_of": dict(group_of),
            "hypers": [_hyper(g) for g in optimizer.param_groups], "setting": setting},
        "tracked": [[type(t).__name__, state_of(t)] for t in tracked],
        "checkpoint": checkpoint,
    })


def state_of(obj: Any) -> Any:
    """A tracked object's state to hand a joiner: a data loader's positioned at the global batch
    it handed out last (the step a joiner runs first), anything else its ``state_dict()``."""
    at_last = getattr(obj, "state_at_last", None)
    return at_last() if callable(at_last) else obj.state_dict()


@dataclass
class Carried:
    """A joiner's recipe and the optimizer state it received, until its script uses them."""

    rng: dict[str, Any]
    scaler: tuple[float, int]
    optimizer: dict[str, Any] | None
    tracked: list[tuple[str, Any]]
    checkpoint: str | None
    entries: dict[str, torch.Tensor] = field(default_factory=dict)  # the optimizer's state
    applied: int = 0  # how many tracked objects got their state

    @classmethod
    def decode(cls, data: torch.Tensor) -> Carried:
        raw = decode(data)
        return cls(rng=raw["rng"], scaler=(raw["scaler"][0], raw["scaler"][1]),
                   optimizer=raw["optimizer"], tracked=[tuple(t) for t in raw["tracked"]],
                   checkpoint=raw["checkpoint"])

    def restore_process_state(self, scaler: LossScaler) -> None:
        set_rng_state(self.rng)
        scaler.load_state_dict({"scale": self.scaler[0], "clean_steps": self.scaler[1]})

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is None:
            raise VarunaFxError(
                "this process joined a running job whose script made no pipe.optimizer before "
                "its first morph, but this one makes one: every process must run the same script")
        if self.optimizer["class"] != class_name(optimizer):
            raise VarunaFxError(
                f"this process joined a running job that trains with {self.optimizer['class']}, "
                f"but its script made a {class_name(optimizer)}: run the same script everywhere")

    def apply_optimizer(self, optimizer: torch.optim.Optimizer, made: Made, runtime: Runtime,
                        named: dict[str, Any]) -> None:
        """The optimizer the joiner's script made: cut as the survivors cut theirs (model order
        within each param group, which is what the carried state was cut for), with the running
        job's hyperparameters and state."""
        assert self.optimizer is not None
        self.check_optimizer(optimizer)
        made.group_of = dict(self.optimizer["group_of"])
        repoint_optimizer(optimizer, runtime, named)
        for group, hyper in zip(optimizer.param_groups, self.optimizer["hypers"]):
            group.update(hyper)
        restore_optimizer(optimizer, {id(p): n for n, p in named.items()}, self.entries)
        self.entries = {}

    def apply_tracked(self, obj: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """The next registered object's state (objects are matched in registration order)."""
        if self.applied >= len(self.tracked):
            raise VarunaFxError(
                f"this process joined a running job whose processes registered "
                f"{len(self.tracked)} object(s) with pipe.track, but its script registers more "
                f"({type(obj).__name__}): every process must run the same script")
        kind, state = self.tracked[self.applied]
        if kind != type(obj).__name__:
            raise VarunaFxError(
                f"pipe.track object {self.applied} is a {kind} on the running processes but a "
                f"{type(obj).__name__} here: register the same objects in the same order")
        obj.load_state_dict(state)
        self.applied += 1
        if self.optimizer is not None and optimizer is not None:
            # a scheduler made after the optimizer set its own learning rate: the running
            # job's is the one to continue with
            for group, hyper in zip(optimizer.param_groups, self.optimizer["hypers"]):
                group.update(hyper)
