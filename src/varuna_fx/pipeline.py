"""Pipeline: what ``vf.compile`` returns -- the stages, the plan and a runtime to drive them.

Layer: above the runtimes. ``api.make_pipeline`` picks the runtime for where this process runs
(``world/where.py``): all stages here, or this rank's stage of a distributed job, and hands it
here. The pipeline, like the runtime, takes compile's running options whole
(``runtime/options.RunOptions``) in its constructor.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .capture.captured import Captured
from .capture.inputs import BoundInputs, bind_inputs
from .capture.model_edits import ModelEdits, traced_modules
from .checkpoint.failures import FailedLoad
from .checkpoint.hf.pretrained import PretrainedLoad, load_pretrained, save_pretrained
from .checkpoint.save_load import Checkpointer
from .codegen.modes import Modes, evaluation_stages, module_modes
from .codegen.stage_module import Stage
from .data.loader import GlobalBatchLoader, loader_for
from .data.stream import StreamLoader, stream_loader
from .errors import InputError, VarunaFxError
from .init.allocation import DeferredAllocation
from .init.skip import any_marked, loaded, raise_unloaded, unloaded
from .ir.nodes import info
from .morph.controller import InPlace
from .morph.records import MorphRecord
from .passes.manager import dump_dir
from .planner.drift import DriftCheck
from .planner.learned import StepLearner
from .planner.plan import Plan
from .runtime import preemption
from .runtime.batching import check_sample_shapes, extract_loss
from .runtime.local import LocalRuntime
from .runtime.model_state import StateLayout, check_state_dict
from .runtime.options import RunOptions
from .runtime.outputs import OutputAssembler
from .runtime.precision import optimizer_step
from .runtime.setup import held_tensors
from .runtime.shard import shard_batch
from .runtime.step import Runtime
from .runtime.step_stats import StepMeter, StepStats
from .runtime.sync.zero_repoint import build_optimizer


class Pipeline:
    _in_place: InPlace | None = None  # an in-place job's morphing (morph/controller.py)
    # checkpoints (checkpoint/): the checkpointer, made at the first save or load (its process
    # group, the save in flight); while set, the refusal a load that failed partway left
    _checkpointer: Checkpointer | None = None
    _failed_load: FailedLoad | None = None
    _closed = False  # pipe.close() released the process groups
    # what the last step measured (runtime/step_stats.py); None before the first step
    last_step: StepStats | None = None
    _meter: StepMeter | None = None
    _drift: DriftCheck | None = None
    _learner: StepLearner | None = None
    _began = 0.0  # perf_counter at the start of the step being run

    def __init__(self, model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                 canonical: dict[str, str], runtime: Runtime, options: RunOptions,
                 assemble: OutputAssembler | None = None,
                 state_layout: StateLayout | None = None,
                 allocation: DeferredAllocation | None = None,
                 in_place: InPlace | None = None) -> None:
        """``in_place``: an in-place job's morphing (``morph/controller.py``), which holds
        this pipeline from here on."""
        self.model = model
        self.captured = captured
        self.canonical = canonical
        # a one-process pipeline of a vf.deferred_init model: its tensors, allocated at first
        # use (None: allocated, or nothing to allocate)
        self._allocation = allocation
        # every parameter and persistent buffer with its full shape, and which ones no stage
        # reads (stage 0 holds those)
        self.state_layout = state_layout or StateLayout.of(model, canonical, stages)
        self._input_infos = {str(n.target): info(n).outputs[0] for n in captured.gm.graph.nodes
                             if n.op == "placeholder" and info(n).outputs}
        self._assemble = assemble or OutputAssembler(captured)
        # The graph serves the modules' modes at compile; other modes get their own capture
        # (codegen/modes.py): None where it equals the compiled graph, else its evaluation stages
        # (a distributed runtime made eval mode's at compile, while it held every parameter).
        self.compiled_modes = module_modes(model)
        self.other_modes: dict[Modes, tuple[Captured, list[Stage]] | None] = {}
        self._set_layout(stages, plan, runtime, options)
        self._in_place = in_place
        if in_place is not None:
            in_place.attach(self)

    def _set_layout(self, stages: list[Stage], plan: Plan, runtime: Runtime,
                    options: RunOptions) -> None:
        """Run ``plan``'s ``stages`` with ``runtime`` as ``options`` say: everything that
        depends on the layout, set here only (the constructor, and an in-place morph that
        re-planned, ``morph/controller.py``)."""
        self.stages, self.plan, self.runtime = stages, plan, runtime
        self._options = options  # how it runs: compile's running options
        # the samples each replica must pass to step when compile was given global_batch_size
        # (global / D); None: any batch the micro-batch size divides
        self._replica_batch = options.replica_batch(plan.data_parallel)
        self.stage_index = runtime.stage_index
        self.replica_index = runtime.replica_index
        # stages whose parameters live in this process (all of them in one process)
        self.local_stages = runtime.local_stages
        # what the stages hold, so a step after the model was edited asks for a new compile
        self._edits = ModelEdits(self.model, [stages[s].module for s in self.local_stages],
                                 traced_modules(self.captured.gm))
        # other modes' stages were cut for the old stages ("the compiled graph serves" holds);
        # the runtime brings those it made for these
        self.other_modes = {**{k: v for k, v in self.other_modes.items() if v is None},
                            **runtime.other_modes}
        # the checkpointer's group and the step meter were the old runtime's; the checks of
        # the first steps were the old plan's
        self._checkpointer, self._meter = None, None
        self._drift, self._learner = None, None

    def _finish_saves(self) -> None:
        """Wait for an asynchronous save in flight and forget the checkpointer, whose group
        is the old world's (an in-place morph; a save that failed with that world is gone)."""
        if self._checkpointer is not None:
            try:
                self._checkpointer.wait()
            except Exception:  # noqa: BLE001 - a save that failed with the old world is gone
                pass
            self._checkpointer = None

    def _drop_runtime(self) -> Runtime:
        """The runtime, which this pipeline no longer holds: an in-place morph destroys its
        groups next, and their sockets close only when nothing references them."""
        runtime = self.runtime
        self.runtime = None  # until the morph sets the new layout's (``_set_layout``)
        return runtime

    # -- running -------------------------------------------------------------------------------

    def _bind(self, inputs: tuple, kw_inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        bound = bind_inputs(self.model, inputs, kw_inputs, what="step inputs",
                            signature=self.captured.signature)
        expected = self.captured.input_names
        if list(bound.tensors) != expected:
            raise InputError(
                f"inputs {list(bound.tensors)} differ from the compiled ones {expected}: pass the "
                "same arguments as example_inputs"
            )
        check_sample_shapes(bound.tensors, self._input_infos)
        if bound.constants != self.captured.constants:
            raise InputError(
                f"constant arguments {bound.constants} differ from the compiled ones "
                f"{self.captured.constants}; compile again to change them"
            )
        return bound.tensors

    def assemble(self, outputs: dict[str, Any]) -> Any:
        """The last stage's result dict -> the model's output structure."""
        return self._assemble(outputs)

    def step(self, *inputs: Any, target: Any = None, **kw_inputs: Any) -> torch.Tensor:
        """Forward and backward of one batch under the schedule; returns the mean loss."""
        self._began = time.perf_counter()
        self._check_runnable()
        if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            block = "torch.inference_mode()" if torch.is_inference_mode_enabled() \
                else "torch.no_grad()"
            raise InputError(
                f"pipe.step was called under {block}: a step runs forward and backward, which "
                "needs gradients. Call pipe.step outside that block, or pipe(...) for a "
                "forward-only evaluation")
        if self._in_place is not None:  # a morph may run first, or the step run again
            return self._in_place.step((inputs, kw_inputs, target))
        return self._step(inputs, kw_inputs, target, (preemption.requested,))

    def _step(self, inputs: tuple, kw_inputs: dict[str, Any], target: Any,
              flags: tuple) -> torch.Tensor:
        if target is not None and "target" in self.captured.signature.parameters:
            # forward's own `target` (compile refused it alongside a loss_fn): feed the model
            kw_inputs, target = {**kw_inputs, "target": target}, None
        self._check_target_by_keyword(inputs, target)
        tensors = self._bind(inputs, kw_inputs)
        if self._mode_graph(tensors) is not None:
            raise InputError(
                f"{type(self.model).__name__} is in another train/eval mode than when it was "
                "compiled, and its graph differs in this mode: call pipe.train() (or put the "
                "modules back in their modes at compile) before step, or compile the model "
                "again in the mode to train in"
            )
        batch = next(iter(tensors.values())).shape[0]
        if self._replica_batch is not None and batch != self._replica_batch:
            raise InputError(
                f"step got a batch of {batch} samples, but the pipeline was compiled for "
                f"global_batch_size={self._replica_batch * self.plan.data_parallel} over "
                f"{self.plan.data_parallel} replica(s): pass {self._replica_batch} samples per "
                "replica, or compile again with the global batch you train with"
            )
        meter = self._meter = self._meter or StepMeter(self.runtime, self.replicas)
        meter.start()
        # this process's preemption signal rides on the step's world all-reduce, read when the
        # step's work is done (a signal during this step stops after this step, not the next)
        loss = self.runtime.step(tensors, target, flags=flags)
        self.last_step = meter.finish(tensors)
        # after the first steps: the measured step against the plan, said once per job, by
        # rank 0 (drift.py)
        as_planned = not isinstance(self.runtime, LocalRuntime) or self.plan.stages == 1
        self._drift = self._drift or DriftCheck(self.plan, as_planned,
                                                speaks=self.runtime.rank == 0)
        off = self._drift.observe(self.last_step.seconds, self.last_step._raw)
        if off is not None:
            warnings.warn(off, stacklevel=3)  # (step -> _step -> here)
        # and what a step spends outside its actions, kept by rank 0 for later plans
        # (learned.py): from the step's start, its checks included
        self._learner = self._learner or StepLearner(self.plan.learn_key,
                                                     as_planned and self.runtime.rank == 0)
        self._learner.observe(time.perf_counter() - self._began, self.last_step._raw)
        return loss

    @property
    def replicas(self) -> int:
        """Data-parallel replicas that run: ``plan.data_parallel`` in a distributed job; 1 in
        one process, which steps on the whole batch it is given."""
        return 1 if isinstance(self.runtime, LocalRuntime) else self.plan.data_parallel

    def shard(self, batch: Any, replica: int | None = None, replicas: int | None = None) -> Any:
        """This replica's contiguous share of a global batch, with the batch's structure.

        Every rank passes the same global batch (a tensor, or tuples/lists/dicts of them, dim 0
        the batch); replica r of D keeps samples ``[r*N/D, (r+1)*N/D)``. In one process
        (``replicas`` 1) that is the whole batch. Without this, D replicas given the same batch
        train on the same samples D times, and nothing warns. ``replica``/``replicas`` override
        ``self.replica_index``/``self.replicas`` (e.g. to shard for another replica).
        """
        return shard_batch(batch, self.replica_index if replica is None else replica,
                           self.replicas if replicas is None else replicas)

    def data_loader(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                    num_workers: int = 0, collate_fn: Any = None,
                    **dataloader_kwargs: Any) -> GlobalBatchLoader | StreamLoader:
        """This replica's share of one global batch per step, over a map-style ``dataset``,
        in an order that depends on (seed, epoch) only; its position is saved with
        ``save_checkpoint(..., data=loader)`` and restored on any layout (data/loader.py). An
        iterable dataset (a stream) gives a ``StreamLoader`` (data/stream.py): the stream's own
        order, a position in samples consumed, resumed on any layout.
        Other keyword arguments go to ``torch.utils.data.DataLoader`` (pin_memory, ...)."""
        plan = self.plan
        replica_batch = self._replica_batch or plan.micro_batch_size * plan.num_micro_batches
        if isinstance(dataset, torch.utils.data.IterableDataset):
            # a stream: its own order, every replica reading it and keeping its share
            # (data/stream.py); shuffle= and seed= do not apply
            return stream_loader(dataset, replica_batch=replica_batch, replicas=self.replicas,
                                 replica=self.replica_index, in_place=self._in_place is not None,
                                 num_workers=num_workers, collate_fn=collate_fn,
                                 **dataloader_kwargs)
        return self.track(loader_for(dataset, replica_batch=replica_batch,
                                     replicas=self.replicas, replica=self.replica_index,
                                     shuffle=shuffle, seed=seed, num_workers=num_workers,
                                     collate_fn=collate_fn, **dataloader_kwargs))

    def __call__(self, *inputs: Any, **kw_inputs: Any) -> Any:
        self._check_runnable()
        tensors = self._bind(inputs, kw_inputs)
        other = self._mode_graph(tensors)
        if other is None:
            return self.runtime.forward(tensors)
        captured, stages = other
        return self.runtime.forward(tensors, stages=stages, assemble=OutputAssembler(captured))

    def evaluate(self, batches: Iterable[Any]) -> float:
        """The mean loss over ``batches`` in eval mode, forward only (no gradients, no
        micro-batching: each batch runs whole): what eager ``model.eval()`` and
        ``torch.no_grad()`` give over the same batches, averaged per batch. Each batch is
        ``(inputs, target)`` (inputs a tensor or a tuple of positional inputs; the target
        goes to compile's ``loss_fn``, or is None for a model that returns its loss). Every
        rank passes the same batches (the whole batch, not a replica's shard) and gets the
        same loss. The modules' train/eval modes are put back afterwards."""
        modes = [(m, m.training) for m in (self.model, *(s.module for s in self.stages))
                 for m in m.modules()]
        self.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for inputs, target in batches:
                    output = self(*(inputs if isinstance(inputs, tuple) else (inputs,)))
                    total += float(extract_loss(output, self.runtime.loss_fn, target))
                    count += 1
        finally:
            for module, training in modes:
                module.training = training
        if not count:
            raise InputError("pipe.evaluate got no batches: give it (inputs, target) pairs")
        return total / count

    def _mode_graph(self, tensors: dict[str, torch.Tensor]) -> tuple[Captured, list[Stage]] | None:
        """None when the compiled stages are the model in its current modes."""
        modes = module_modes(self.model)
        if modes == self.compiled_modes:
            return None
        if modes not in self.other_modes and len(self.local_stages) < len(self.stages):
            raise InputError(
                "the model's modules are in train/eval modes other than at compile and "
                "pipe.eval(): a distributed rank holds only its stage and cannot capture the "
                "model again; use pipe.train() or pipe.eval(), or compile in these modes"
            )
        if modes not in self.other_modes:  # every parameter is here
            bound = BoundInputs(dict(tensors), dict(self.captured.constants))
            dump = dump_dir(self._options.dump)
            try:
                self.other_modes[modes] = evaluation_stages(
                    self.model, bound, self.captured, self.stages, self.canonical,
                    len(self.stages), dump)
            except VarunaFxError:  # no cut fits the compiled stages: one stage will do
                self.other_modes[modes] = evaluation_stages(
                    self.model, bound, self.captured, [], self.canonical, 1, dump)
        return self.other_modes[modes]

    def _allocated(self) -> None:
        """A deferred model's tensors, allocated and initialised the first time they are needed
        (or refused with the numbers when this process cannot hold them)."""
        if self._allocation is not None:
            self._allocation.allocate()
            self._edits.allocated(self._allocation.device)
            self._allocation = None

    def _check_runnable(self) -> None:
        if self._closed:
            raise VarunaFxError("the pipeline was closed (pipe.close() released its process "
                                "groups): call vf.compile again to run the model")
        self._allocated()
        self._edits.check()  # (before the meta check: an edit can leave a stage on meta)
        if any(t.is_meta for s in self.local_stages for t in self.stages[s].module.parameters()):
            raise InputError(
                "the model's parameters are on the meta device: a pipeline compiled from a meta "
                "model only plans. Build it under `with vf.deferred_init(seed=0):` instead of "
                "on the meta device (vf.compile then allocates and initialises each stage's "
                "tensors where it runs), or with real parameters, and call vf.compile again"
            )
        self._check_loaded()

    def _check_loaded(self) -> None:
        """Refuse to run on tensors ``vf.skip_init`` left uninitialised (init/skip.py).
        Each rank checks what it holds, before any communication: a forgotten load raises on
        every rank; a rank alone in holding such a tensor (a non-persistent buffer) raises
        alone, and its launcher (torchrun) stops the others."""
        if not any_marked():  # every step asks: nothing to gather in the usual case
            return
        mine = unloaded([*self.named_parameters(), *self.named_buffers()])
        if mine:
            where = "" if isinstance(self.runtime, LocalRuntime) else \
                f" on rank {dist.get_rank()}"
            if self._failed_load is not None:  # checkpoint/failures.py
                self._failed_load.refuse(mine, where)
            raise_unloaded(mine, where)

    # -- parameters ----------------------------------------------------------------------------

    def _held_names(self) -> list[str]:
        """Canonical names this process holds: its stages' tensors, plus on stage 0 the ones
        forward never reads (so they are saved and kept, not lost)."""
        return self.state_layout.held_names(self.canonical, self.stages, self.local_stages)

    # (not generators: a deferred model is allocated, or refused, when they are called)
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self._allocated()
        return iter(held_tensors(self.model, self._held_names())[0].items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._allocated()
        return iter(held_tensors(self.model, self._held_names())[1].items())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model (every stage, tied parameters counted once) to
        ``max_norm`` and return the total norm -- ``torch.nn.utils.clip_grad_norm_`` on the
        eager model, on every rank."""
        return self.runtime.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    # -- mixed precision (see runtime/precision.py) ---------------------------------------------

    def _check_target_by_keyword(self, inputs: tuple, target: Any) -> None:
        """``pipe.step(x, y)`` with a loss_fn: ``y`` is surely the target, which step takes by
        keyword only (a positional one could not be told from an input the model forgot); say
        so instead of only that forward takes fewer arguments."""
        if target is not None or self.runtime.loss_fn is None:
            return
        params = self.captured.signature.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            return
        room = sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                              inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)
        if len(inputs) == room + 1:
            raise InputError(
                f"pipe.step got {len(inputs)} positional arguments, but "
                f"{type(self.model).__name__}.forward takes {room}: the last one looks like "
                "the loss_fn's target, which step takes by keyword: x, y = batch; "
                "pipe.step(x, target=y)")

    @property
    def found_inf(self) -> bool:
        """fp16: whether the last ``step`` overflowed on any stage of any replica (then
        :meth:`optimizer_step` skips the update everywhere). Always False otherwise."""
        return self.runtime.scaler.found_inf

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 for fp32 and bf16)."""
        return self.runtime.scaler.scale

    def optimizer(self, cls: type, params: Any = None, **defaults: Any) -> torch.optim.Optimizer:
        """``cls(params, **defaults)`` over this rank's parameters (``params``: parameters or
        param groups from :meth:`named_parameters`; None: all), or, when the optimizer state is
        sharded over the D replicas (``shard_optimizer``; runtime/sync/zero.py), over this rank's
        shard of them: an instance of ``cls`` whose state_dict holds this rank's shard only,
        and whose step also gathers the updated parameters."""
        optimizer = build_optimizer(self.runtime, dict(self.named_parameters()), cls, params,
                                    defaults, self._options.shard_optimizer)
        if self._in_place is not None:
            self._in_place.optimizer_made(optimizer)
        return optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last step overflowed (fp16), then update the loss
        scale. Returns whether it stepped. Works for every precision, so scripts can always
        call it instead of ``optimizer.step()``."""
        return optimizer_step(self.runtime.scaler, optimizer)

    def close(self) -> None:
        """Release what the runtime holds (process groups); the pipeline is unusable after."""
        if self._checkpointer is not None:  # an async save still being written completes first
            self._checkpointer.close()
            self._checkpointer = None
        if self.runtime is not None:
            self.runtime.close()
        if self._in_place is not None:
            self._in_place.membership.finished()
            self._in_place.membership.stop()
        self._closed = True

    def train(self, mode: bool = True) -> Pipeline:
        self.model.train(mode)
        for s in self.stages:
            s.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer held here, keyed by the original (canonical)
        FQNs: in one process the whole model (tied weights once, tensors forward never reads
        included); in a distributed run the tensors this rank holds."""
        persistent = set(self.state_layout.names)
        state = {n: p for n, p in self.named_parameters()}
        state.update({n: b for n, b in self.named_buffers() if n in persistent})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` into the tensors held here. Keys may be any FQN of the model (a tied
        weight under either name); the shapes must match. ``strict``: every held tensor must
        be given, and keys the model does not have are refused."""
        mine = self.state_dict()
        for name, value in check_state_dict(state, self.state_layout, list(mine), strict).items():
            with torch.no_grad():
                mine[name].copy_(value)
            loaded([mine[name]])  # what vf.skip_init left uninitialised is now set

    # -- in-place morphing (morph/controller.py; docs/API.md, "Morphing in place") ----------

    @property
    def morphs(self) -> list[MorphRecord]:
        """Each in-place morph this process took part in: when, old and new layout, seconds
        per phase, bytes moved (``morph/records.py``). [] outside an in-place job."""
        return list(self._in_place.records) if self._in_place is not None else []

    @property
    def joined(self) -> bool:
        """This process joined a running in-place job and took its state from the others (so
        its script must not load a checkpoint into it)."""
        return self._in_place is not None and self._in_place.carried is not None

    def track(self, obj: Any) -> Any:
        """Register an object with ``state_dict``/``load_state_dict`` (an LR scheduler; a data
        loader is registered by ``data_loader``) for in-place morphing: a process that joins
        gets rank 0's state of it, and a loader continues with the new replica's share.
        Returns ``obj``; does nothing outside an in-place job."""
        if self._in_place is not None:
            self._in_place.track(obj)
        return obj

    def _note_checkpoint(self, path: str) -> None:
        """The latest checkpoint saved or loaded: what a morph restarts from if state is lost."""
        if self._in_place is not None:
            self._in_place.checkpoint = path

    # -- checkpoints (checkpoint/save_load.py) and preemption (runtime/preemption.py) ----------

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None, *,
                        async_save: bool = False, data: Any = None, scheduler: Any = None,
                        stateful: dict[str, Any] | None = None) -> Any:
        """Write a checkpoint directory (torch.distributed.checkpoint; every rank its shard).
        ``async_save=True`` returns once the state is copied to host memory and writes in the
        background: the returned handle's ``.result()`` waits until the checkpoint is
        complete. ``data`` (a ``data_loader``), ``scheduler`` and ``stateful`` (names ->
        objects with state_dict/load_state_dict) are saved too (checkpoint/stateful.py).
        See docs/checkpoints.md."""
        try:
            handle = self._checkpoints().save(
                str(path), optimizer, extra, async_save=async_save,
                states={"data": data, "scheduler": scheduler, "stateful": stateful})
        except VarunaFxError as exc:  # in place, a peer lost meanwhile: the next step recovers
            if self._in_place is None or not self._in_place.save_failed(exc):
                raise
            warnings.warn(f"{path} was not saved: a process vanished; the next step recovers "
                          "in place", stacklevel=2)
            return None
        self._note_checkpoint(str(path))
        return handle

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, *,
                        data: Any = None, scheduler: Any = None,
                        stateful: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load a checkpoint saved under any layout (and the states of ``data``,
        ``scheduler`` and ``stateful``, as saved); returns the ``extra`` dict it was saved
        with."""
        if self.joined:
            raise VarunaFxError(
                "this process joined a running in-place job: its state came from the others and "
                "is newer than any checkpoint; loading one would rewind this process alone. Skip "
                "the load when pipe.joined is True")
        outcome = self._checkpoints().load(
            str(path), optimizer, states={"data": data, "scheduler": scheduler,
                                          "stateful": stateful})
        if isinstance(outcome, FailedLoad):  # partly overwritten: refuse to run until a load
            self._failed_load = outcome      # succeeds
            raise outcome.error
        self._failed_load = None
        self._note_checkpoint(str(path))
        return outcome

    def _checkpoints(self) -> Checkpointer:
        self._allocated()  # (saves and loads read and fill the tensors)
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self)
        return self._checkpointer

    def load_pretrained(self, path: str, *, strict: bool = True) -> PretrainedLoad:
        """Load a Hugging Face safetensors checkpoint (a directory, or one file) into the
        tensors held here, reading only those; see checkpoint/hf/pretrained.py."""
        outcome = load_pretrained(self, self._checkpoints(), path, strict=strict)
        if isinstance(outcome, FailedLoad):  # partly overwritten: refuse to run until a load
            self._failed_load = outcome      # succeeds
            raise outcome.error
        self._failed_load = None
        return outcome

    def save_pretrained(self, directory: str) -> None:
        """Write the weights in Hugging Face's layout (sharded safetensors, index, config),
        every rank its own stages'; ``from_pretrained(directory)`` opens it."""
        save_pretrained(self, self._checkpoints(), directory)

    @property
    def preempted(self) -> bool:
        """True on every rank after the step during which any rank got SIGTERM or SIGUSR1 (in
        an in-place job: every process got one; else the others morph in place)."""
        if self._in_place is not None:
            return self._in_place.all_leaving
        flags = self.runtime.flags
        return bool(flags and flags[0])

    def install_preemption_handlers(self) -> None:
        """Catch SIGTERM and SIGUSR1 in this process (done automatically under torchrun)."""
        preemption.install_handlers()

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan})"
