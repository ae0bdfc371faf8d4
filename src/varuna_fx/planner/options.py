"""The planning part of ``vf.compile``'s options: what the planner reads, as one frozen object.

:class:`PlanOptions` is taken whole by the planner's entry points (``configure.py:
choose_configuration``, ``analyze.py: Analyzed.plan`` behind ``plan_for``) and by ``varuna-fx
plan``; ``vf.compile`` makes it from its keywords (``options.py: CompileOptions`` is this part
and the running part, ``runtime/options.py``). Making one checks every field, each error saying
which option is wrong and what to pass instead. ``bool`` is refused where a count is expected:
``True`` is an ``int`` in Python, and ``stages=True`` meaning one stage is never what the user
meant.

A new planning option is one field here (with its check) and one keyword of ``vf.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..costs.wire import ReplicaSync, check_compression, check_replica_sync
from ..errors import VarunaFxError
from ..schedule import DEFAULT_SCHEDULE, ScheduleChoice, resolve_schedule
from ..world.where import resolve_timeout
from .cluster import Cluster


@dataclass(frozen=True)
class PlanOptions:
    """What the planner chooses with (docs/API.md has each option's meaning)."""

    cluster: Cluster | None = None  # None: Cluster.local()
    global_batch_size: int | None = None
    stages: int | None = None
    stages_per_rank: int | None = 1  # None: the schedule's default (the planner checks it)
    data_parallel: int | None = None
    micro_batch_size: int | None = None
    # micro-batches per replica per optimizer step (m): the gradients of m micro-batches are
    # accumulated before the step, so global batch = micro_batch_size x m x data_parallel
    grad_accum_steps: int | None = None
    schedule: str = DEFAULT_SCHEDULE
    recompute: bool | str = "auto"
    shard_optimizer: bool | str = "auto"  # ZeRO-1 over each stage's D replicas
    profile: Any = False  # False | True | a varuna_fx.planner.Profile (resolve_profile checks)
    timeout: float | None = None  # None: $VARUNA_FX_TIMEOUT or the default, when waited on
    # what slow links carry (costs/wire.py): the plan resolves both per boundary / per stage,
    # and the runtimes read the plan
    compression: str = "off"
    replica_sync: ReplicaSync = "exact"
    # whether each stage's forward and backward run through torch.compile / inductor
    # ("auto": where a step pays for the compile; the plan resolves it: plan.compile_stages)
    compile_stages: str = "auto"
    # the optimizer steps the run will take, which "auto" weighs the compile against
    # (planner/compiled_speed.py: decide); None: compiled_speed.DEFAULT_STEPS
    planned_steps: int | None = None

    def __post_init__(self) -> None:
        if self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise VarunaFxError(
                f"cluster={short(self.cluster)} is not a vf.Cluster: the second positional "
                "argument of vf.compile is the cluster; pass the inputs as example_inputs=(...)"
            )
        check_name("schedule", self.schedule, "varuna")
        check_count("stages", self.stages, "pipeline stages")
        check_count("data_parallel", self.data_parallel, "data-parallel replicas")
        check_count("micro_batch_size", self.micro_batch_size, "samples per micro-batch")
        check_count("global_batch_size", self.global_batch_size, "samples per optimizer step")
        check_count("grad_accum_steps", self.grad_accum_steps,
                    "micro-batches accumulated per optimizer step")
        check_batch_equation(self.global_batch_size, self.micro_batch_size,
                             self.grad_accum_steps, self.data_parallel)
        check_flag("recompute", self.recompute, (True, False, "auto"))
        check_flag("shard_optimizer", self.shard_optimizer, (True, False, "auto"))
        resolve_timeout(self.timeout)  # the keyword or $VARUNA_FX_TIMEOUT: wrong values fail here
        check_compression(self.compression)
        check_replica_sync(self.replica_sync)
        check_compile_stages(self.compile_stages)
        check_count("planned_steps", self.planned_steps, "optimizer steps the run will take")
        _ = self.schedule_choice  # the name resolved once, now: an unknown one is refused

    @cached_property
    def schedule_choice(self) -> ScheduleChoice:
        """``schedule`` resolved into its registry entry (or "auto"): what the planner reads,
        so that nothing after the options decodes the name."""
        return resolve_schedule(self.schedule)


def check_batch_equation(global_batch_size: int | None, micro_batch_size: int | None,
                         grad_accum_steps: int | None, data_parallel: int | None) -> None:
    """global batch = micro-batch x micro-batches (grad_accum_steps) x replicas: the values
    given must be able to meet it (the planner chooses the rest)."""
    if grad_accum_steps is None or global_batch_size is None:
        return
    given = {"micro_batch_size": micro_batch_size, "grad_accum_steps": grad_accum_steps,
             "data_parallel": data_parallel}
    product = 1
    for value in given.values():
        product *= value or 1
    shown = " x ".join(f"{k}={v}" for k, v in given.items() if v is not None)
    if None not in given.values() and product != global_batch_size:
        raise VarunaFxError(
            f"{shown} makes a global batch of {product}, not global_batch_size="
            f"{global_batch_size} (global batch = micro-batch x micro-batches x replicas): "
            "change one of them, or leave micro_batch_size or data_parallel to the planner")
    if global_batch_size % product:
        raise VarunaFxError(
            f"{shown} does not divide global_batch_size={global_batch_size} (global batch = "
            "micro-batch x micro-batches (grad_accum_steps) x replicas): choose values whose "
            f"product divides {global_batch_size}")


COMPILE_STAGES = ("off", "on", "auto")


def check_compile_stages(value: Any) -> None:
    """``compile_stages`` is one of :data:`COMPILE_STAGES` (a bool is refused: which of "on"
    and "auto" True would mean is not clear)."""
    if not isinstance(value, str) or value not in COMPILE_STAGES:
        raise VarunaFxError(
            f"compile_stages={short(value)} is unknown: pass 'on' (every stage's forward and "
            "backward through torch.compile / inductor), 'off' (eager stages) or 'auto' (on "
            "for CUDA clusters, off on CPU)")


def check_name(name: str, value: Any, example: str) -> None:
    """A choice given by name must be a string (the value is checked against the choices
    after the other options)."""
    if not isinstance(value, str):
        raise VarunaFxError(f"{name}={short(value)}: give its name as a string, e.g. "
                            f"{name}={example!r}")


def check_count(name: str, value: Any, what: str) -> None:
    """``value`` is None (the planner chooses) or a positive int."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VarunaFxError(f"{name}={value!r}: give a positive number of {what}, or None to let "
                            "the planner choose")


def check_flag(name: str, value: Any, allowed: tuple[Any, ...] = (True, False)) -> None:
    if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
        raise VarunaFxError(f"{name}={value!r}: use one of {list(allowed)}")


def short(value: Any) -> str:
    """``repr(value)``, or its type where that is long (a model passed by mistake)."""
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"
