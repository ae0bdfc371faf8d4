"""Plan: the complete, frozen result of planning, printable as a table.

Everything downstream reads it and nothing rebuilds any part of it: the runtimes run
``plan.schedule`` (the very Schedule object the planner simulated), the fingerprint ranks agree
on is made from it, and each stage's recompute flag comes from ``plan.recompute``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.table import Table

from ..costs.memory import format_bytes
from ..costs.wire import ReplicaSync, departs, sync_name
from ..schedule import Schedule
from ..schedule.placement import Placement
from .cluster import Cluster


@dataclass(frozen=True)
class StageCost:
    index: int
    nodes: int  # operations computed on the stage
    parameters: int  # parameter elements held
    parameter_bytes: int
    flops: float  # forward + backward FLOPs per micro-batch
    activation_bytes: float  # activations one micro-batch produces on the stage
    boundary_bytes: float  # bytes the stage sends per micro-batch
    time: float  # estimated seconds per micro-batch (forward + backward (+ recompute) + send)
    memory: float  # estimated bytes on the device
    forward_time: float = 0.0  # estimated seconds of one micro-batch's forward
    backward_time: float = 0.0
    optimizer_bytes: float = 0.0  # optimizer state on each of its ranks (1/D when sharded)


@dataclass(frozen=True)
class Boundary:
    """One pipeline boundary (stage ``index`` to ``index + 1``) as the plan sends it."""

    index: int
    nbytes: float  # what stage ``index`` sends per micro-batch (its activations; their
    # gradients come back the same size)
    wire_bytes: float  # that, as the wire carries it under ``compression``
    link: str  # "same rank" | "within a node" | "between nodes" (a slow link)
    bandwidth: float  # bytes/s the plan priced it at (inf: never sent)
    compression: str = "off"  # "off" | "bf16" | "int8"


@dataclass(frozen=True)
class Alternative:
    """One configuration the planner weighed, with its simulated step."""

    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    step_time: float  # seconds: simulated pipeline + data-parallel all-reduce
    bubble_fraction: float  # idle share of the pipeline part
    allreduce_time: float  # seconds of gradient all-reduce after the pipeline
    stage_memory: tuple[float, ...]  # bytes per stage
    chosen: bool = False
    schedule: str = ""  # the schedule this row was simulated with (schedule="auto" varies it)
    shard_optimizer: bool = False  # its memory has the optimizer state split over D (ZeRO-1)

    @property
    def max_memory(self) -> float:
        return max(self.stage_memory, default=0.0)

    @property
    def samples(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.data_parallel

    @property
    def throughput(self) -> float:
        """Samples per second over all replicas."""
        return self.samples / self.step_time if self.step_time > 0 else float("inf")


@dataclass(frozen=True)
class Plan:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: Schedule  # the schedule that was simulated and that the runtimes run
    recompute: tuple[bool, ...]  # per stage: whether it recomputes its forward
    stage_costs: tuple[StageCost, ...]
    bounds: tuple[int, ...] = ()  # P + 1 positions among the compute nodes (assign_stages)
    placement: Placement | None = None  # which rank runs which (stage, replica)
    tied_parameters: dict[str, list[int]] = field(default_factory=dict)
    predicted_step_time: float | None = None
    tracer: str = "fx"
    model_name: str = "model"
    alternatives: tuple[Alternative, ...] = ()  # best first
    # whether optimizer state is sharded over the D replicas (ZeRO-1) in the memory priced
    shard_optimizer: bool = False
    # compile's shard_optimizer (True | False | "auto"): what a launched run does with the
    # optimizer (``optimizer_note``)
    shard_optimizer_setting: bool | str = "auto"
    # what slow links carry (docs/API.md, "Slow links"): per boundary how it travels (the
    # runtimes read it: runtime/compress.py), per stage how its replicas agree
    # (runtime/sync/replica_sync.py); empty: all "off" / "exact"
    compression: tuple[str, ...] = ()
    replica_sync: tuple[ReplicaSync, ...] = ()
    boundaries: tuple[Boundary, ...] = ()  # the table's rows per boundary
    # whether shard_optimizer="auto" shards an optimizer made by pipe.optimizer over D > 1
    # replicas: not where its all-gather would add half an all-reduce over a slow link and
    # memory does not need it, nor under DiLoCo (each replica keeps its own optimizer state)
    shards_by_default: bool = True
    # what the predicted step is made of, by the cost model's terms (configure.cost_terms:
    # compute, action overhead, messages, all-reduce, bubble), each stage's busy seconds per
    # micro-batch, and the profile's relative spread (None: planned without one)
    cost_terms: tuple[tuple[str, float], ...] = ()
    stage_busy: tuple[float, ...] = ()
    predicted_spread: float | None = None
    # whether the prediction is this machine's (a profile, or the machine's own costs:
    # planner/machine.py), so a measured step may be held against it (drift.py)
    priced_here: bool = False
    # where this plan's step overhead outside its actions is learned from its first steps
    # (planner/learned.py; None: nothing is learned)
    learn_key: str | None = None
    # whether the stages run through torch.compile / inductor (compile's compile_stages,
    # resolved: ``resolve_compile_stages``) and why
    compile_stages: bool = False
    compile_note: str = ""
    compile_setting: str = "auto"  # compile's compile_stages, as given
    # the compiled stages' speed-up the plan was priced with (planner/compiled_speed.py;
    # None: priced as eager stages)
    compile_speedup: float | None = None

    def compiles_on(self, device_type: str) -> bool:
        """Whether stages run compiled on a device of ``device_type`` ("cpu", "cuda"): as
        the plan says, but "auto" only on CUDA (a plan for a CUDA cluster stepped on CPU, as
        tests and notebooks do, runs eager stages), or on a CPU where "auto" decided it from
        this machine's measured speed (``compile_speedup``)."""
        return self.compile_stages and (
            self.compile_setting == "on" or device_type == "cuda"
            or (device_type == "cpu" and self.compile_speedup is not None))

    def sync_of(self, stage: int) -> ReplicaSync:
        """Stage ``stage``'s replica sync ("exact" where the plan names none)."""
        return self.replica_sync[stage] if stage < len(self.replica_sync) else "exact"

    @property
    def departs_from_eager(self) -> bool:
        """Whether a setting of the plan departs from eager numerics by design (a compressed
        boundary, a replica sync other than exact)."""
        return departs(self.compression, self.replica_sync)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.data_parallel

    @property
    def batch_equation(self) -> str:
        """How the global batch is made, in the words of compile's options: micro-batch
        (micro_batch_size) x micro-batches (grad_accum_steps) x replicas (data_parallel)."""
        m, d = self.num_micro_batches, self.data_parallel
        return (f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size}"
                f" x {m} micro-batch{'es' if m != 1 else ''} x {d} replica{'s' if d != 1 else ''}")

    @property
    def stages_per_rank(self) -> int:
        """v: the stages each rank runs (1 but with a virtual schedule)."""
        return self.placement.stages_per_rank if self.placement is not None else 1

    @property
    def balance(self) -> float:
        """max / mean stage time: 1.0 is perfect balance."""
        times = [s.time for s in self.stage_costs]
        return max(times) / (sum(times) / len(times)) if times and sum(times) else 1.0

    def table(self) -> Table:
        spread = f" ± {self.predicted_spread:.0%}" if self.predicted_spread else ""
        step = (f", predicted step {self.predicted_step_time * 1e3:.2f} ms{spread}"
                if self.predicted_step_time is not None else "")
        table = Table(title=(
            f"{self.model_name}: P={self.stages}"
            f"{f' ({self.stages_per_rank} per rank)' if self.stages_per_rank > 1 else ''}"
            f" x D={self.data_parallel}, {self.batch_equation}, schedule {self.schedule.name}"
            f"{_recompute_note(self.recompute)}{step}"
            f"{', optimizer state sharded over D (ZeRO-1)' if self.shard_optimizer else ''}"
            f"{', stages compiled (inductor)' if self.compile_stages else ''}"
        ))
        replicas = self.data_parallel > 1  # then each stage's replica sync has a column
        for name in ("stage", "nodes", "parameters", "FLOPs/mb", "activations/mb",
                     "boundary/mb", "time/mb", "optimizer", "recompute", "memory",
                     *(("sync",) if replicas else ())):
            table.add_column(name, justify="right", overflow="fold")
        for s in self.stage_costs:
            rc = self.recompute[s.index] if s.index < len(self.recompute) else False
            table.add_row(str(s.index), str(s.nodes), _count(s.parameters), _count(s.flops),
                          format_bytes(s.activation_bytes), format_bytes(s.boundary_bytes),
                          f"{s.time * 1e3:.3f} ms", format_bytes(s.optimizer_bytes),
                          "yes" if rc else "no", format_bytes(s.memory),
                          *((sync_name(self.sync_of(s.index)),) if replicas else ()))
        tied = ", ".join(f"{k} (stages {v})" for k, v in self.tied_parameters.items())
        note = optimizer_note(self.shard_optimizer_setting, self.data_parallel,
                              self.shard_optimizer, self.shards_by_default)
        table.caption = f"balance max/mean {self.balance:.3f}" + (f"; tied: {tied}" if tied else "") \
            + (f"\n{note}" if note else "") + (f"\n{DEPARTS}" if self.departs_from_eager else "") \
            + ("\nsync: how the stage's replicas agree (replica_sync)" if replicas else "") \
            + (f"\n{self.compile_note}" if self.compile_note else "")
        return table

    def boundaries_table(self) -> Table | None:
        """Per boundary: bytes per micro-batch, the link it crosses, the compression."""
        if not self.boundaries:
            return None
        table = Table(title="pipeline boundaries")
        for name in ("boundary", "bytes/mb", "link", "bandwidth", "compression", "sent/mb"):
            table.add_column(name, justify="right", overflow="fold")
        for b in self.boundaries:
            table.add_row(f"{b.index} -> {b.index + 1}", format_bytes(b.nbytes), b.link,
                          _rate(b.bandwidth), b.compression, format_bytes(b.wire_bytes))
        table.caption = ("bytes/mb: activations per micro-batch forward (their gradients come "
                         "back the same size); sent/mb: on the wire under the compression")
        return table

    def alternatives_table(self) -> Table | None:
        if not self.alternatives:
            return None
        return alternatives_table(self.alternatives, "configurations weighed by the planner")

    def __rich__(self) -> Group:
        tables = [self.table()]
        links = self.boundaries_table()
        if links is not None:
            tables.append(links)
        other = self.alternatives_table()
        if other is not None:
            tables.append(other)
        return Group(*tables)

    def explain(self) -> str:
        """What decided the pick, in words: the configuration, its predicted step and what
        the cost model says it is made of, and why it won against the runner-up
        (``explain_pick``); where the stages were priced compiled, with which speed-up."""
        text = explain_pick(self.alternatives, self.cost_terms, self.predicted_step_time,
                            self.predicted_spread)
        return text + (f"\n{self.compile_note}" if self.compile_speedup is not None else "")

    def __str__(self) -> str:
        # As wide as the widest table (at least 120 columns, for the captions): a string has
        # no terminal to fit, and a narrower width would cut cells ("powersg…"). A console
        # narrower than the table (print(plan) through rich on a terminal) wraps cells instead
        # (overflow="fold"), never cuts them.
        width = max(120, Console(width=_WIDE).measure(self).maximum)
        buffer = io.StringIO()
        # force_jupyter=False: inside a notebook rich would display the table instead of
        # writing it to the buffer, and str(plan) would come back empty
        Console(file=buffer, width=width, force_terminal=False, force_jupyter=False,
                color_system=None).print(self)
        return buffer.getvalue().rstrip() + "\n"


def _name(row: Alternative) -> str:
    schedule = f", {row.schedule}" if row.schedule and row.stages > 1 else ""
    return (f"P={row.stages} x D={row.data_parallel}, {row.num_micro_batches} micro-batch(es) "
            f"of {row.micro_batch_size}{schedule}")


def explain_pick(rows: Sequence[Alternative], terms: Sequence[tuple[str, float]] = (),
                 predicted: float | None = None, spread: float | None = None) -> str:
    """The pick among ``rows`` (the chosen one marked), in words: what its predicted step is
    made of (``terms``: the cost model's, largest first), and what decided it -- the
    fastest time per sample by how much over the runner-up and in which term
    (all-reduce or the pipeline part), or a near-tie given to the simpler configuration
    (``steady.TIE_TOLERANCE``), or nothing weighed (the caller fixed it)."""
    chosen = next((r for r in rows if r.chosen), rows[0] if rows else None)
    lines = []
    if chosen is not None:
        step = predicted if predicted is not None else chosen.step_time
        sure = f" ± {spread:.0%} (the profile's spread)" if spread else ""
        lines.append(f"picked {_name(chosen)}: predicted step {_seconds(step)}{sure}")
    if terms:
        total = sum(v for _, v in terms) or 1.0
        parts = ", ".join(f"{name} {_seconds(v)} ({v / total:.0%})"
                          for name, v in sorted(terms, key=lambda t: -t[1]) if v > 0)
        lines.append(f"its step, by the cost model's terms: {parts}")
    others = [r for r in rows if r is not chosen]
    if chosen is None or not others:
        lines.append("decided by: nothing to weigh (one configuration: the given stages, "
                     "replicas and micro-batch size, or the only one that fits)")
        return "\n".join(lines)

    def per_sample(r: Alternative) -> float:
        return r.step_time / max(r.samples, 1)

    fastest = min(rows, key=per_sample)
    if per_sample(fastest) < per_sample(chosen):
        lines.append(f"decided by: the tie rule: {_name(fastest)} is predicted "
                     f"{1 - per_sample(fastest) / per_sample(chosen):.1%} faster per sample, "
                     "within the tolerance the measurements cannot tell apart; the simpler "
                     "configuration (fewest devices, then stages, then the largest "
                     "micro-batch, then the schedule listed first) is picked")
        return "\n".join(lines)
    runner = min(others, key=per_sample)
    gap = per_sample(runner) / per_sample(chosen) - 1
    scale = chosen.samples / max(runner.samples, 1)  # the runner-up's step per our samples
    d_sync = runner.allreduce_time * scale - chosen.allreduce_time
    d_pipe = (runner.step_time - runner.allreduce_time) * scale - \
        (chosen.step_time - chosen.allreduce_time)
    why = "the all-reduce" if abs(d_sync) > abs(d_pipe) else \
        "the pipeline part (compute, messages and bubble)"
    lines.append(f"decided by: the fastest predicted time per sample of {len(rows)} weighed; "
                 f"the runner-up {_name(runner)} is {gap:+.1%}, mostly in {why} "
                 f"({_seconds(d_sync if why == 'the all-reduce' else d_pipe)} more)")
    return "\n".join(lines)


def optimizer_note(setting: bool | str, data_parallel: int, priced_sharded: bool,
                   by_default: bool = True) -> str | None:
    """What a launched run with D = ``data_parallel`` replicas does with the optimizer state
    under compile's ``shard_optimizer=setting`` (``runtime/sync/zero.py``, ``pipeline.py``), and how
    the memory column counted it (``priced_sharded``); None for one replica (nothing to shard).
    ``by_default``: whether "auto" shards an optimizer made by pipe.optimizer where memory does
    not need it (``Plan.shards_by_default``)."""
    if data_parallel <= 1:
        return None
    d = f"D={data_parallel}"
    refused = "build it with pipe.optimizer(cls, ...) (a torch optimizer over " \
        "pipe.parameters() is refused)"
    if setting is True or (setting == "auto" and priced_sharded):
        why = "shard_optimizer=True" if setting is True else \
            "shard_optimizer='auto', and the plan needs it to fit"
        return (f"optimizer state: sharded over the {d} replicas (ZeRO-1; {why}): {refused}; "
                "memory counts 1/D of it per rank")
    if setting == "auto" and not by_default:
        return (f"optimizer state: not sharded (shard_optimizer='auto': the replicas' link is "
                f"slow and sharding would send more bytes over it, or DiLoCo keeps each "
                f"replica's own state; memory does not need it): each of the {d} replicas "
                "holds all of it")
    if setting == "auto":
        return (f"optimizer state: shard_optimizer='auto' shards an optimizer built with "
                f"pipe.optimizer over the {d} replicas (ZeRO-1, 1/D of its state per rank); "
                "one built over pipe.parameters() runs unsharded, as memory counts it")
    return (f"optimizer state: not sharded (shard_optimizer=False): each of the {d} replicas "
            "holds all of it")


_WIDE = 10_000  # a width no table reaches: what str(plan) measures its tables at

DEPARTS = ("departs from eager numerics by design: compressed boundaries and/or a replica sync "
           "other than exact (docs/API.md, \"Slow links\")")


def resolve_compile_stages(setting: str, cluster: Cluster | None) -> tuple[bool, str]:
    """Whether a plan's stages run compiled under compile's ``compile_stages`` (checked
    already) on ``cluster`` (a ``Cluster``; None: this machine, a CPU unless CUDA is there),
    and the plan's note saying why, where no compiled speed is known. "auto" compiles on
    CUDA, where inductor's fused kernels repay a compile of seconds within a few steps; not on
    CPU, where the compile takes tens of seconds for 10-30% a step (bench/
    bench_compiled_stages.py): there ``compiled_speed.decide`` weighs a measured speed."""
    if setting == "on":
        return True, "stages: compiled with torch.compile / inductor (compile_stages='on')"
    if setting == "off":
        return False, ""
    device = cluster.device if cluster is not None else "cpu"
    if device == "cuda":
        return True, ("stages: compiled with torch.compile / inductor (compile_stages='auto' "
                      "on a CUDA cluster: fused kernels repay the compile within a few steps)")
    return False, ("stages: eager (compile_stages='auto' on CPU: inductor's compile takes tens "
                   "of seconds for ~10% per step; pass compile_stages='on' to compile)")


def _rate(bandwidth: float) -> str:
    if bandwidth == float("inf"):
        return "-"
    bits = bandwidth * 8
    for scale, suffix in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits >= scale:
            return f"{bits / scale:.3g} {suffix}"
    return f"{bits:.3g} bit/s"


def _recompute_note(flags: tuple[bool, ...]) -> str:
    if not any(flags):
        return ""
    if all(flags[:-1]):
        return " + recompute"
    return f" + recompute on stages {', '.join(str(s) for s, f in enumerate(flags) if f)}"


def alternatives_table(rows: Sequence[Alternative], title: str) -> Table:
    table = Table(title=title)
    for name in ("", "P", "D", "b x m", "schedule", "step", "samples/s", "bubble",
                 "all-reduce", "memory"):
        table.add_column(name, justify="right", overflow="fold")
    for row in rows:
        table.add_row(
            "*" if row.chosen else "", str(row.stages), str(row.data_parallel),
            f"{row.micro_batch_size} x {row.num_micro_batches}",
            row.schedule if row.schedule and row.stages > 1 else "-",  # one stage: no schedule
            _seconds(row.step_time),
            _count(row.throughput), f"{row.bubble_fraction:.0%}", _seconds(row.allreduce_time),
            format_bytes(row.max_memory) + (" (ZeRO-1)" if row.shard_optimizer else ""),
        )
    table.caption = ("* chosen. b x m: micro-batch size x count per replica; step: simulated "
                     "pipeline + data-parallel all-reduce; memory: largest stage (ZeRO-1: "
                     "with the optimizer state sharded over D)")
    return table


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def _count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"

