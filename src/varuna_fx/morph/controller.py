"""In-place morphs: the survivors of a membership change keep running, in this process.

A pipeline compiled in an in-place job (``varuna-fx run --elastic --in-place``;
``world/membership.py``) gets an :class:`InPlace`. Three ways a morph begins:

* **A spot notice** (SIGTERM with some seconds' warning) on some process rides on the step's
  world all-reduce (a count, beside the loss); so does rank 0's check that a process waits to
  join. At the start of the next ``pipe.step`` (:meth:`InPlace.begin_step`) every process agrees
  on the next generation over the old group (who leaves, who joins), then the morph below runs,
  the leavers taking part until their state has moved, then exiting (``SystemExit(0)``). Nothing
  is lost: the user's checkpoint after the previous step, if any, ran on the old world.
* **A process vanishes** (SIGKILL, a machine gone): some receive or collective of the step in
  flight fails at once (the kernel closes a dead process's sockets). That process destroys its
  groups and drops every reference to them, which closes its sockets too, so the peers blocked
  on it fail in turn (gloo cannot abort a blocked wait, and a timed-out wait would close the pair
  anyway). The survivors meet in the store (:meth:`Membership.recover`), run the morph, and run
  the step again on the new layout, from the same RNG state and the same global batch: at most
  that step is lost. If some state has no live holder (every replica of a stage vanished, or a
  ZeRO-1 shard with its only owner), in-place cannot continue: every survivor exits with
  ``RESTART_EXIT`` and the launcher starts them again, to resume from the latest checkpoint on
  the new layout as the restart path does.
* **This process joins** a running job (:meth:`InPlace.join`, from ``vf.compile``): it plans as
  the survivors do, receives its stage's state, and keeps the rest (``carried.py``) for the
  optimizer, schedulers and loader its script makes next.

The morph itself: destroy the old group and form the new generation's (``regroup``); re-plan
for the new world on this process's captured, annotated graph (``replan``: configure and the back
passes only); every rank agrees on the plan, makes its groups and allocates the tensors it now
holds (``runtime``); every process writes what it holds and needs to the store and the moves are
sent point to point, only what changed owner (``transfer``, ``morph/transfer.py``); the same
optimizer object is pointed at the new parameters and loads what arrived, loaders continue with
the new share, tensors no longer held are released (``adopt``). ``pipe.morphs`` records each.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.contents import rng_state, set_rng_state
from ..checkpoint.optimizer_state import restore_optimizer
from ..codegen.stage_module import Stage
from ..errors import DistributedError, PeerTimeoutError
from ..init.materialize import is_deferred, materialize_tensors
from ..planner.cluster import Cluster
from ..runtime import preemption
from ..runtime.distributed import agree_on_plan, build_runtime, release_unheld
from ..runtime.model_state import unread_tensors
from ..runtime.setup import held_tensors
from ..runtime.sync.zero import guard_direct_optimizers, made_by_pipeline
from ..runtime.sync.zero_repoint import repoint_optimizer
from ..world.closing import store_closer
from ..world.membership import Generation, Membership, backend_name
from . import batch
from .carried import Carried, recipe
from .exchange import exchange
from .morphable import Morphable, Replanner
from .preplan import Preplanner
from .records import MorphRecord, layout_text
from .state import (
    OPT,
    Descriptor,
    Sources,
    copy_model,
    joiner_ranges,
    model_holdings,
    optimizer_entries_from,
    optimizer_holdings,
    optimizer_ranges,
)
from .transfer import MovePlan

RESTART_EXIT = 75  # exit status asking the in-place launcher to start this worker again


class InPlace:
    """The in-place morphing of one pipeline (``Pipeline._in_place``)."""

    def __init__(self, membership: Membership, replan: Replanner) -> None:
        self.membership, self.replan, self.cluster = membership, replan, replan.cluster
        self.pipe: Morphable  # the pipeline it morphs (``attach``, from its constructor)
        self.global_batch_size: int | None = replan.options.global_batch_size
        self.records: list[MorphRecord] = []
        self.tracked: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.carried: Carried | None = None  # a joiner's, until its script used it
        self.checkpoint: str | None = None  # the latest checkpoint saved or loaded
        self.pending = False  # a notice or a join rode on the last step: morph at the next
        self.all_leaving = False  # every process got a notice: the restart path (save, exit)
        self._rng: dict[str, Any] | None = None  # at the start of the step in flight
        self._had_grads = False  # the step in flight started with gradients (accumulating)
        self._lost_shard = False
        self.broken = False  # a checkpoint save lost a peer: the next step recovers first
        self._first_step: MorphRecord | None = None  # waiting for its first step's time
        self._step_started = 0.0
        # the likely next worlds' searches, run after the first step of each layout
        self.preplanner, self._preplan_due = Preplanner(replan), True

    def attach(self, pipe: Morphable) -> None:
        """``Pipeline.__init__``'s: the pipeline this morphs, held from now on."""
        self.pipe = pipe

    def start(self, joining: bool) -> None:
        """``make_pipeline``'s, once the pipeline is made: optimizers made around it are
        refused; a process joining a running job takes its state from the members."""
        guard_direct_optimizers(
            self.pipe.parameters(), "this job morphs in place (--in-place)",
            "a morph moves pipe.optimizer's state and parameters only, so this one would keep "
            "stepping the old layout's", ", or run without --in-place (the restart path)")
        if joining:
            self.join()

    # -- every step ----------------------------------------------------------------------------

    def step(self, args: batch.Args) -> torch.Tensor:
        """``pipe.step`` in an in-place job: a morph first if the last step asked for one;
        if a peer vanishes mid-step, survive it and run the step again on the new layout."""
        pipe = self.pipe
        args = self.begin_step(args)
        while True:
            failure: PeerTimeoutError | None = None
            if pipe.runtime.closer is None:  # a generation's first step
                pipe.runtime.closer = store_closer(self.membership, dist.get_rank())
            try:
                loss = pipe._step(*args, self.flags())
                break
            except PeerTimeoutError as exc:
                failure = exc
            args = self.recover(failure, args)
            del failure
        self.end_step()
        return loss

    def flags(self) -> tuple[Any, ...]:
        """What rides on the step's world all-reduce: this process's notice, and (rank 0) a
        process waiting to join. Both are summed (``runtime.flag_counts``)."""
        def joins() -> bool:
            return dist.get_rank() == 0 and self.membership.joins_waiting()
        return (preemption.requested, joins)

    def begin_step(self, args: batch.Args) -> batch.Args:
        """Before a step: the morph a notice or a join asked for, then this step's snapshot."""
        if self.broken:  # a process vanished during a checkpoint save: recover first
            args = self.recover(None, args, in_flight=False)
        if self.pending:
            args = self._boundary(args)
        self._had_grads = _has_grads(self.pipe)
        self._rng = rng_state()
        self._step_started = time.perf_counter()
        return args

    def end_step(self) -> None:
        pipe = self.pipe
        counts = pipe.runtime.flag_counts
        leaving, joins = int(counts[0]), int(counts[1])
        world = dist.get_world_size()
        self.all_leaving = leaving >= world
        self.pending = not self.all_leaving and (leaving > 0 or joins > 0)
        if self._first_step is not None:
            self._first_step.phase("first_step")
            self._first_step = None
        if self._preplan_due and not self.pending and not self.all_leaving:
            self._preplan_due = False
            self.preplanner.start(self.cluster, self._global_batch())

    # -- a notice or a join, at a step boundary ------------------------------------------------

    def _boundary(self, args: batch.Args) -> batch.Args:
        pipe = self.pipe
        old = self.membership.generation
        assert old is not None
        rec = MorphRecord(old.number + 1, "notice", time.time(), layout_text(pipe.plan, len(
            old.members)), "")
        leaving = preemption.requested()
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, (leaving, preemption.received_at(), _has_grads(pipe)))
        if any(s[2] for s in said):  # gradients being accumulated: morph at a later step
            return args
        self.pending = False
        text = [""]
        if dist.get_rank() == 0:
            text[0] = self.membership.after_boundary(
                [s[0] for s in said], self.cluster.to_dict(), self._global_batch()).to_json()
        dist.broadcast_object_list(text, src=0)
        gen = Generation.from_json(text[0])
        times = [s[1] for s in said if s[0] and s[1] is not None]
        rec.signal_at = min(times) if times else None
        rec.reason, rec.joined, rec.left = gen.reason, gen.joined, gen.left
        rec.phase("agree")
        return self._morph(gen, args, rec, leaving=leaving)

    # -- a process vanished --------------------------------------------------------------------

    def recover(self, exc: BaseException | None, args: batch.Args,
                in_flight: bool = True) -> batch.Args:
        """After the step in flight failed talking to a peer (``in_flight``; else the last
        step's checkpoint save did): agree with the other survivors on the next generation,
        morph, and return the step's arguments for the new layout (the caller runs the step)."""
        pipe = self.pipe
        old = self.membership.generation
        assert old is not None
        rec = MorphRecord(old.number + 1, "lost", time.time(),
                          layout_text(pipe.plan, len(old.members)), "")
        self.broken = False
        if in_flight and self._rng is not None:  # the failed attempt drew its step seed
            set_rng_state(self._rng)
        if exc is not None:
            _forget(exc)
        if self._had_grads if in_flight else _has_grads(pipe):
            raise DistributedError(
                "a process vanished during a step that accumulates onto earlier steps' "
                "gradients: those gradients cannot be moved to the new layout, so the job "
                "cannot continue in place (zero the gradients before each pipe.step to make "
                "every step recoverable)") from None
        for p in pipe.parameters():  # the failed attempt's partial gradients
            p.grad = None
        snapshot = self._snapshot(args)  # before the groups go: views of this state
        if pipe.runtime is not None:
            self._teardown(failed=True)
        gen = self.membership.recover(self.cluster.to_dict(), self._global_batch())
        rec.lost, rec.joined = gen.lost, gen.joined
        rec.phase("agree")
        return self._morph(gen, args, rec, leaving=False, snapshot=snapshot)

    def save_failed(self, exc: BaseException) -> bool:
        """A checkpoint save raised: when a peer vanished meanwhile (its connection closed or
        reset, a wait timed out), close this process's groups at once (so peers blocked in the
        save fail too) and recover at the next step; True then (the save is abandoned)."""
        text = " ".join(str(e) for e in _chain(exc)).lower()
        if not any(w in text for w in ("closed", "reset", "timed out", "timeout", "broken")):
            return False
        _forget(exc)
        self._teardown(failed=True)
        self.broken = True
        return True

    # -- the morph -----------------------------------------------------------------------------

    def _morph(self, gen: Generation, args: batch.Args, rec: MorphRecord, *,
               leaving: bool, snapshot: tuple[Descriptor, Sources] | None = None
               ) -> batch.Args:
        pipe = self.pipe
        self.preplanner.stop()  # (the morph's CPU now; a finished pre-plan is on disk)
        old_replicas, old_local = pipe.plan.data_parallel, list(pipe.local_stages)
        desc, sources = snapshot or self._snapshot(args)
        if snapshot is None:
            self._teardown()
        desc.signal_at = rec.signal_at
        self.membership.form(gen, backend_name())
        rec.phase("regroup")
        if leaving:  # hand over what this process holds, then go
            self._exchange(gen, desc, sources, rec)
            self._leave(gen)
        if dist.get_rank() == 0 and gen.joined:
            self.membership.put(gen.number, "recipe", recipe(
                self._scaler, self.optimizer, self._group_of(), pipe._options.shard_optimizer,
                self.tracked, self.checkpoint).numpy().tobytes())
        self._rebuild(gen, rec)
        self._allocate_opt(desc)
        batch.input_needs(args, old_replicas, pipe.replica_index, pipe.plan.data_parallel, desc)
        plan, got = self._exchange(gen, desc, sources, rec)
        missing = [m for m in plan.missing if m[1][0] != batch.INPUT]
        if missing or self._lost_shard:
            self._restart(gen, missing)
        self._adopt(plan, got, sources, desc)
        lost_rows = any(m[1][0] == batch.INPUT and m[0] == self._me(gen) for m in plan.missing)
        if lost_rows:
            args = batch.from_loader(args, self._loaders(), pipe.replica_index,
                                     pipe.plan.data_parallel)
        elif desc.needs_input:
            args = batch.rebuilt(args, got, desc.needs_input)
        for loader in self._loaders():
            loader.reshard(pipe.replica_index, pipe.plan.data_parallel)
        keep = unread_tensors(pipe.model, pipe.state_layout) if 0 in pipe.local_stages else []
        release_unheld(pipe.model, [pipe.stages[s] for s in pipe.local_stages],
                       pipe.runtime.device, keep=keep, keep_buffers=True)
        del old_local
        rec.new_layout = layout_text(pipe.plan, len(gen.members))
        rec.phase("adopt")
        self.records.append(rec)
        self._first_step, self._preplan_due = rec, True
        return args

    def _snapshot(self, args: batch.Args) -> tuple[Descriptor, Sources]:
        """What this process holds: views of its tensors, read before anything changes."""
        pipe = self.pipe
        desc, sources = Descriptor(), {}
        model_holdings(pipe.state_dict(), desc, sources)
        if self.optimizer is not None:
            names = {id(p): n for n, p in pipe.named_parameters()}
            optimizer_holdings(self.optimizer, names, pipe.state_layout.shapes, desc, sources)
        batch.input_state(args, pipe.replica_index, pipe.plan.data_parallel, desc, sources)
        return desc, sources

    def _teardown(self, failed: bool = False) -> None:
        """Destroy every group of the old generation and drop every reference to them, so their
        sockets close now (``failed``: at once, cycles collected too, and every connection of
        the old generation shut down first, ``Membership.sever``: a peer blocked on this process
        then fails at once even if something still holds the old groups)."""
        pipe = self.pipe
        if failed:
            self.membership.sever()
        pipe._finish_saves()
        made = made_by_pipeline(self.optimizer)
        if made is not None:
            made.zero, made.grad_sync = None, None
        # what outlives the runtime: the loss scale, and how the model's loss is weighed
        runtime = pipe._drop_runtime()
        self._scaler, self._mean_loss = runtime.scaler, runtime.mean_loss
        self._device = runtime.device
        del runtime
        if dist.is_initialized():
            dist.destroy_process_group()
        if failed:
            gc.collect()

    def _rebuild(self, gen: Generation, rec: MorphRecord) -> None:
        """Re-plan for the new world and build this rank's runtime in the new group."""
        pipe = self.pipe
        cluster = Cluster.from_dict(gen.cluster) if gen.cluster else self.cluster
        gbs = gen.global_batch_size or self._global_batch()
        stages, plan, _ = self.replan(cluster, gbs)
        rec.phase("replan")
        options = dataclasses.replace(pipe._options, global_batch_size=gbs)
        reorder = agree_on_plan(plan, stages, options)
        local = plan.placement.stages_of(dist.get_rank())
        self._allocate(stages, local)
        runtime = build_runtime(pipe.model, pipe.captured, stages, plan, pipe.canonical,
                                options, assemble=pipe._assemble, layout=pipe.state_layout,
                                reorder=reorder, mean_loss=self._mean_loss, scaler=self._scaler)
        pipe._set_layout(stages, plan, runtime, options)
        self.cluster = cluster
        rec.phase("runtime")

    def _allocate(self, stages: list[Stage], local: list[int]) -> None:
        """Storage for the tensors this rank holds from now on (their values move in next)."""
        pipe = self.pipe
        names = pipe.state_layout.held_names(pipe.canonical, stages, local)
        params, buffers = held_tensors(pipe.model, names)
        meta = [n for n, t in [*params.items(), *buffers.items()] if t.is_meta]
        if meta and is_deferred(pipe.model):
            materialize_tensors(pipe.model, meta, self._device,
                                roots=[pipe.captured.gm, *(s.module for s in stages)])
        with torch.no_grad():
            for name, t in params.items():
                shape = pipe.state_layout.shapes.get(name)
                if shape is not None and tuple(t.shape) != shape:
                    t.data = torch.empty(shape, dtype=t.dtype, device=self._device)

    def _allocate_opt(self, desc: Descriptor) -> None:
        """Point the optimizer at the new parameters and say which optimizer state this rank
        needs (its new shard's elements, or all of each parameter's)."""
        pipe = self.pipe
        named = dict(pipe.named_parameters())
        desc.needs_model = {n: t.numel() for n, t in pipe.state_dict().items()}
        if self.optimizer is None:
            return
        repoint_optimizer(self.optimizer, pipe.runtime, named)
        desc.needs_optimizer = optimizer_ranges(self.optimizer, named)

    def _me(self, gen: Generation) -> int:
        return gen.transfer.index(self.membership.member)

    def _exchange(self, gen: Generation, desc: Descriptor, sources: Sources,
                  rec: MorphRecord) -> tuple[MovePlan, Sources]:
        done = exchange(self.membership, gen, desc, sources, rec)
        self._info, self._lost_shard = done.info, done.lost_shard
        return done.plan, done.got

    def _adopt(self, plan: MovePlan, got: Sources, sources: Sources,
               desc: Descriptor) -> None:
        """Values into the tensors held now; the optimizer's state loaded."""
        pipe = self.pipe
        copy_model(pipe.state_dict(), got)
        if self.optimizer is not None:
            names = {id(p): n for n, p in pipe.named_parameters()}
            made = made_by_pipeline(self.optimizer)
            assert made is not None
            fqns = [n for n in names.values() if n in made.group_of]
            entries = optimizer_entries_from(
                got, self._info, made.group_of,
                [{k: v for k, v in g.items() if k != "params"}
                 for g in self.optimizer.param_groups], fqns)
            restore_optimizer(self.optimizer, names, entries)

    def _leave(self, gen: Generation) -> None:
        self.membership.stop()
        print(f"varuna_fx: {self.membership.member} left the job after handing over its "
              f"state (generation {gen.number}: {len(gen.members)} processes continue)",
              file=sys.stderr, flush=True)
        raise SystemExit(0)

    def _restart(self, gen: Generation, missing: list[Any]) -> None:
        """State nobody alive holds: the restart path (every survivor exits the same way)."""
        if missing:
            (dst, item, start, count), *rest = missing
            what = "its weights" if item[1] == "" else \
                f"its optimizer state {item[1][len(OPT):]!r}"
            lost = f"{item[0]} ({what}, elements {start}-{start + count}; {len(rest)} more)"
        else:
            lost = "the ZeRO-1 optimizer shards of the processes that vanished"
        print(f"varuna_fx: no live process holds {lost}: a whole stage or a ZeRO-1 shard "
              "vanished with its only holder. Exiting to resume from the latest checkpoint on "
              f"the new layout ({len(gen.members)} processes)", file=sys.stderr, flush=True)
        self.membership.mark_restart(gen, back=gen.members)
        self.membership.stop()
        sys.stdout.flush()
        os._exit(RESTART_EXIT)

    # -- this process joins a running job ------------------------------------------------------

    def join(self) -> None:
        """In ``vf.compile`` of a process a running generation admitted: receive its state."""
        pipe = self.pipe
        gen = self.membership.generation
        assert gen is not None
        rec = MorphRecord(gen.number, "joined", time.time(), "-",
                          layout_text(pipe.plan, len(gen.members)), joined=gen.joined,
                          left=gen.left)
        rec.phase("replan")  # compile made the plan; this is only the record's start
        carried = Carried.decode(torch.frombuffer(bytearray(self.membership.get(
            gen.number, "recipe", "the survivors' recipe")), dtype=torch.uint8))
        carried.restore_process_state(pipe.runtime.scaler)
        desc = Descriptor(needs_model={n: t.numel() for n, t in pipe.state_dict().items()})
        if carried.optimizer is not None:
            desc.needs_optimizer = joiner_ranges(pipe, carried)
        plan, got = self._exchange(gen, desc, {}, rec)
        missing = [m for m in plan.missing if m[0] == self._me(gen)]
        if missing:
            raise DistributedError(f"joining generation {gen.number}: no member holds "
                                   f"{missing[0][1]}")
        copy_model(pipe.state_dict(), got)
        if carried.optimizer is not None:
            fqns = [n for n, _ in pipe.named_parameters() if n in carried.optimizer["group_of"]]
            carried.entries = optimizer_entries_from(
                got, self._info, carried.optimizer["group_of"], carried.optimizer["hypers"],
                fqns)
        self.carried, self.checkpoint = carried, carried.checkpoint
        rec.phase("adopt")
        self.records.append(rec)
        self._first_step = rec

    # -- what the pipeline registers -----------------------------------------------------------

    def optimizer_made(self, optimizer: torch.optim.Optimizer) -> None:
        """``pipe.optimizer`` made ``optimizer``: the one a morph moves. On a joiner it loads
        the state carried in; else every process learns every parameter's group."""
        pipe = self.pipe
        self.optimizer = optimizer
        made = made_by_pipeline(optimizer)
        assert made is not None
        if self.carried is not None and self.carried.optimizer is not None:
            self.carried.apply_optimizer(optimizer, made, pipe.runtime,
                                         dict(pipe.named_parameters()))
            return
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, made.group_of)
        for part in every:
            made.group_of.update(part)

    def track(self, obj: Any) -> None:
        self.tracked.append(obj)
        if self.carried is not None:
            self.carried.apply_tracked(obj, self.optimizer)

    def _loaders(self) -> list[Any]:
        return [t for t in self.tracked if isinstance(t, batch.MorphableData)]

    def _group_of(self) -> dict[str, int]:
        made = made_by_pipeline(self.optimizer)
        return dict(made.group_of) if made is not None else {}

    def _global_batch(self) -> int:
        pipe = self.pipe
        if self.global_batch_size is None:
            self.global_batch_size = pipe.plan.micro_batch_size * \
                pipe.plan.num_micro_batches * pipe.plan.data_parallel
        return self.global_batch_size


def _has_grads(pipe: Morphable) -> bool:
    return any(p.grad is not None for p in pipe.parameters())


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while exc is not None and exc not in found:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return found


def _forget(exc: BaseException) -> None:
    """Drop the locals of every frame the failure unwound (they hold the old groups' work and
    tensors): the groups' sockets close only when nothing references them."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]

