"""Compiled stages that never stall a step: the compile runs in a background thread.

Under ``compile_stages="on"`` (``compile_wait=False``, the default) every stage of a new
pipeline -- at start-up, after a restart or resume, after a morph: each makes new stages --
runs **eagerly** while its compiled version builds in a background thread, and switches to
it at a **step boundary** (``StepLoop.step`` calls :meth:`BackgroundStage.at_step_boundary`
first), so the first step never waits for a compile and every micro-batch of one step runs
the same version. ``compile_wait=True`` compiles in the foreground on the first call instead
(``compiled_stage.CompiledStage``: torch.compile).

Why not ``torch.compile`` in a thread: PT2 is not thread safe (pytorch/pytorch#105943,
#118260), and worse for a thread beside a training loop, dynamo restores torch's and
Python's global random state when a compile ends (``convert_frame.preserve_global_state``):
every number the main thread drew during the tens of seconds of a compile would be drawn
again; it also patches module-level state while it traces. So the background path does not
use dynamo: varuna_fx owns the stage's fx graph already, and compiles it directly with
AOTAutograd and inductor (``compile_fx``), one compile at a time:

1. in the calling thread, at the stage's first call (cheap, no tracing): the stage module is
   copied as a *shell* (every submodule copied, its parameter, buffer and submodule dicts its
   own, the tensors shared), and a flat graph is made that takes every parameter, buffer and
   argument as an input and calls the shell through ``torch.func.functional_call``. Nothing
   the compile does can reach the stage's own module (tracing rebinds the shell's tensors);
2. in the background thread: inductor compiles that graph on fake tensors (a copy of the
   first micro-batch's metadata: no data is read, nothing runs), forward and backward (the
   backward not left lazy), for each grad mode the worker calls the stage in (a recomputing
   stage runs its forward under ``no_grad``), under the worker's autocast;
3. at a step boundary the compiled functions are adopted; each call passes the stage's
   parameters and buffers *as they are then* (so an in-place optimizer step, a buffer swap
   of the recompute, a checkpoint load are seen) and checks the call's tensors against what
   was compiled (shape, stride, dtype, device, requires_grad; grad mode): a call that differs
   runs eagerly, with a warning once.

No side effects: the compile runs nothing on real tensors, so parameters' ``.grad`` and
buffers (BatchNorm statistics) are untouched. Random state: AOTAutograd and inductor, like
dynamo, save torch's global generator before a compile and restore it after, which from a
thread rewinds the training loop's draws; :func:`_guard_random_state` skips that save and
restore in the compiling thread only (the compile draws nothing). The slow test checks a
loop drawing its batches from the global generator while its stages compile, step for step
against eager stages.

Every wait has a limit: a compile that has not finished ``$VARUNA_FX_COMPILE_TIMEOUT``
seconds after it began leaves the stage eager with a :class:`CompiledStageWarning`, as does a
compile that fails (naming the error). One thread compiles for the whole process, one stage
after another (inductor's compile is not safe to run twice at once); it is a daemon, so a
compile that hangs never holds the process at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import operator
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..codegen.stage_module import Stage
from ..world import switches
from .compiled_stage import CompiledStageWarning, use_cache_dir
from .keyed_inputs import DropoutSite, draw_noise, dropout_sites, record_call, with_noise_inputs
from .split_compile import aot_split

# what a compiled variant is called with (flat: parameters, buffers, arguments) and returns
Compiled = Callable[..., Sequence[torch.Tensor]]


def _shell(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s tree whose parameter, buffer and submodule dicts are its own (the
    tensors are the same objects): ``functional_call`` rebinds the shell's, never the
    original's, while the main thread runs the original."""
    if id(module) in memo:  # a submodule reached twice (shared) stays one
        return memo[id(module)]
    shell = copy.copy(module)
    memo[id(module)] = shell
    shell.__dict__["_parameters"] = dict(module._parameters)
    shell.__dict__["_buffers"] = dict(module._buffers)
    shell.__dict__["_modules"] = {k: None if m is None else _shell(m, memo)
                                  for k, m in module._modules.items()}
    return shell


class _ShellCall:
    """The call the flat graph makes: the shell run on the flat tensors given."""

    __name__ = "stage_call"  # fx names the node after its target

    def __init__(self, shell: nn.Module, names: list[str], keys: list[str]) -> None:
        self.shell, self.names, self.keys = shell, names, keys

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k = len(self.names)
        out = torch.func.functional_call(self.shell, dict(zip(self.names, flat[:k])),
                                         tuple(flat[k:]))
        return tuple(out[key] for key in self.keys)


def flat_graph(module: nn.Module, names: list[str], nargs: int, keys: list[str]
               ) -> fx.GraphModule:
    """A graph taking ``module``'s ``names`` (parameters, then buffers) and its ``nargs``
    arguments as inputs, returning its outputs ``keys`` in that order."""
    if isinstance(module, _LazyGraphModule):
        module.real_recompile()  # its Python made here, not in the compiling thread
    call = _ShellCall(_shell(module, {}), names, keys)
    graph = fx.Graph()
    inputs = [graph.placeholder(f"in_{i}") for i in range(len(names) + nargs)]
    node = graph.call_function(call, tuple(inputs))
    graph.output(tuple(graph.call_function(operator.getitem, (node, i))
                       for i in range(len(keys))))
    return fx.GraphModule(nn.Module(), graph)


def compile_flat(gm: fx.GraphModule, examples: dict[bool, list[torch.Tensor]],
                 params: list[bool], split: bool, autocast: Callable[[], Any],
                 live: Callable[[], list[nn.Parameter | None]]) -> dict[bool, Compiled]:
    """The compile the background thread runs (tests replace it): inductor on ``gm`` for each
    grad mode of ``examples``, on fakes of its inputs there. ``params``: per input, whether it
    is a parameter (a split backward leaves their gradients to ``W``); ``live()``: per input,
    the parameter it is at the call (where a split backward's weight half accumulates)."""
    from torch._functorch import config as functorch_config  # compile-time imports
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    _guard_random_state()  # here: its imports (a second or two) not in a step
    result: dict[bool, Compiled] = {}
    cuda = next((t.device for t in examples[True if True in examples else False]
                 if t.is_cuda), None)
    if cuda is not None:  # the current device is per thread: the stage's, not device 0
        torch.cuda.set_device(cuda)
    for grad, inputs in examples.items():
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in inputs]
        # the backward compiled now, not at the first backward (that would stall a step)
        with functorch_config.patch(force_non_lazy_backward_lowering=True), \
                torch.set_grad_enabled(grad), autocast():
            if split and grad:
                result[grad] = aot_split(gm, fakes, params, live)
            else:
                result[grad] = compile_fx(gm, fakes)
    return result


class _Job:
    """One stage's compile, queued for the compiling thread. It holds its stage weakly: the
    stages of a pipeline that morphed or closed are dropped, and their queued compiles with
    them."""

    def __init__(self, run: Callable[[], dict[bool, Compiled]], owner: Any) -> None:
        self.run = run
        self.owner = weakref.ref(owner)
        self.future: Future[dict[bool, Compiled]] = Future()
        self.submitted = time.monotonic()  # its time limit counts from here (queued too)
        self.began: float | None = None  # when the thread took it up
        self.seconds: float | None = None  # how long the compile took


class _Compiler:
    """The process's one compiling thread, started at its first job."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    IDLE = 60.0  # seconds the thread waits for another job before it ends

    def submit(self, job: _Job) -> None:
        with self.lock:  # one with _loop's ending: a job is never left without a thread
            self.jobs.put(job)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="varuna-fx-compile",
                                               daemon=True)
                self.thread.start()
                if not self.registered:
                    self.registered = True
                    atexit.register(self.at_exit)

    registered = False  # at_exit registered

    def _loop(self) -> None:
        if NICE:
            try:  # Linux: a thread's own niceness (the compile workers it starts inherit it)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except (AttributeError, OSError):
                pass
        while True:
            try:
                job = self.jobs.get(timeout=self.IDLE)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty():
                        self.thread = None
                        return
                continue
            self.current = job
            # abandoned before it began (its stage gave up on it, or is gone)
            if job.owner() is None:
                job.future.cancel()
            if not job.future.set_running_or_notify_cancel():
                continue
            job.began = time.monotonic()
            try:
                result = job.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the stage, which warns
                job.seconds = time.monotonic() - job.began
                job.future.set_exception(exc)
            else:
                job.seconds = time.monotonic() - job.began
                job.future.set_result(result)
            self.current = None

    current: _Job | None = None  # the job the thread is on

    def at_exit(self) -> None:
        """At interpreter exit: drop the queued compiles and let the running one end (up to
        its time limit): a daemon thread stopped inside inductor's C++ aborts the process."""
        while True:
            try:
                self.jobs.get_nowait().future.cancel()
            except queue.Empty:
                break
        job = self.current
        if job is not None and job.began is not None:
            left = switches.read("VARUNA_FX_COMPILE_TIMEOUT") - (time.monotonic() - job.began)
            try:
                job.future.exception(timeout=max(left, 0.0))
            except (TimeoutError, CancelledError):
                pass


COMPILER = _Compiler()
# the compiling thread's niceness (Linux): the training loop's steps keep the CPU. Measured
# on 2 shared cores (GPT 4 layers, P=2, cold cache): eager steps while compiling 56 ms at 0,
# 26 ms at 10 (24 ms without a compile), the switch 41 s -> 56 s after the first step
NICE = 10


def _guard_random_state() -> None:
    """AOTAutograd and inductor save torch's global random state before a compile and put it
    back after (``torch._dynamo.utils.preserve_rng_state``), as dynamo does: in a thread
    beside a training loop that rewinds every draw the loop made meanwhile (measured: the
    loop's batches repeated). Their compile draws nothing itself, so in the compiling thread
    the save and restore are skipped; elsewhere they are as they were. Installed once, on
    the names those modules call it by."""
    import torch._dynamo.utils as dynamo_utils
    import torch._functorch.aot_autograd as aot_autograd

    original = dynamo_utils.preserve_rng_state
    if getattr(original, "varuna_fx_guard", False):
        return

    @contextlib.contextmanager
    def preserve_rng_state() -> Iterator[None]:
        if threading.current_thread() is COMPILER.thread:
            yield
        else:
            with original():
                yield

    preserve_rng_state.varuna_fx_guard = True  # type: ignore[attr-defined]
    dynamo_utils.preserve_rng_state = preserve_rng_state  # type: ignore[assignment]
    if getattr(aot_autograd, "preserve_rng_state", None) is original:
        aot_autograd.preserve_rng_state = preserve_rng_state  # type: ignore[assignment]


def _signature(tensors: Sequence[Any]) -> tuple[Any, ...] | None:
    """What a compiled variant assumes of its inputs (None: a non-tensor input)."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return None
        out.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
    return tuple(out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class BackgroundStage:
    """``stage`` eager until its compiled version, built in the background, is adopted at a
    step boundary (module docstring). Called as a ``Stage``: named values in, out."""

    def __init__(self, stage: Stage, split: bool = False, grad_modes: Sequence[bool] = (True,),
                 autocast: Callable[[], Any] | None = None) -> None:
        """``grad_modes``: the grad modes the worker calls the stage in; ``split``: its
        backward in an input half and a weight half (split_compile.py)."""
        self.stage = stage
        self.split = split
        self.grad_modes = tuple(dict.fromkeys(grad_modes))
        self.autocast = autocast or contextlib.nullcontext
        self.failed: str | None = None  # why the stage stays eager, once it does
        self.compiled: dict[bool, Compiled] | None = None  # adopted variants, by grad mode
        self.compile_seconds: float | None = None  # the background compile's wall time
        self._job: _Job | None = None
        self._names: list[str] = []  # the parameters' and buffers' FQNs, inputs first
        self._keys: list[str] = []  # the outputs' names, in the compiled order
        # what each grad mode's compiled variant assumes of its inputs
        self._expected: dict[bool, tuple[Any, ...] | None] = {}
        # per input, the parameter at the latest call (where a split backward's weight half
        # accumulates): a box the compile's closure reads, so it holds no reference to self
        self._live: list[list[nn.Parameter | None]] = [[]]
        self._said: set[str] = set()
        # keyed dropouts: their masks drawn eagerly, inputs of the compiled graph
        sites = dropout_sites(stage) if stage.random else []
        self.sites: list[DropoutSite] = sites or []
        if sites is None:
            self.failed = ("its random ops other than dropout (an attention with dropout, "
                           "randn_like, ...) are not compiled: they read each micro-batch's "
                           "key from Python state")

    # -- the calls --------------------------------------------------------------------------------

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        if self.failed is not None:
            self._warn("eager", f"stage {self.stage.index} runs eagerly under "
                       f"compile_stages: {self.failed}")
            return self.stage(values)
        if self.compiled is None:
            if self._job is not None:
                return self.stage(values)
            # the first call: the keyed dropouts' input shapes recorded as it runs
            result = record_call(self.stage, self.sites, values) if self.sites else \
                self.stage(values)
            self._submit(values, result)
            return result
        return self._call_compiled(values)

    def _call_compiled(self, values: dict[str, Any]) -> dict[str, Any]:
        assert self.compiled is not None
        module = self.stage.module
        # looked up at each call: the optimizer, a checkpoint load or the recompute's buffer
        # swap may have changed what they are
        tensors = dict(module.named_parameters())
        tensors.update(module.named_buffers())
        flat = [tensors.get(n) for n in self._names] + [values[n] for n in self.stage.arg_names]
        if self.sites:
            noise = draw_noise(self.stage, self.sites)
            if noise is None:  # a dropout that draws nothing now (eval, p of 0): as eager
                return self.stage(values)
            flat += noise
        grad = torch.is_grad_enabled()
        fn = self.compiled.get(grad)
        if fn is None or len(tensors) != len(self._names) or \
                _signature(flat) != self._expected.get(grad):
            self._warn("differs", f"stage {self.stage.index}: a call differs from what was "
                       "compiled (grad mode, or a tensor's shape, stride, dtype, device or "
                       "requires_grad); such calls run eagerly")
            return self.stage(values)
        self._live[0] = [p if isinstance(p, nn.Parameter) else None for p in flat]
        try:
            out = fn(*flat)
        except Exception as exc:  # noqa: BLE001 - compiled failed: eager tells whose fault
            result = self.stage(values)  # the model's own error is raised from here
            self._fail(f"its compiled version failed ({_first_line(exc)})")
            return result
        return dict(zip(self._keys, out))

    # -- the background compile -------------------------------------------------------------------

    def _submit(self, values: dict[str, Any], result: dict[str, Any]) -> None:
        """Queue the compile, shaped by this (the first) call."""
        module = self.stage.module
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        self._names = [*params, *buffers]
        args = [values[n] for n in self.stage.arg_names]
        if _signature(args) is None or _signature(list(result.values())) is None:
            self._fail("an input or output is not a tensor")
            return
        # the arguments as each grad mode sees them: a received value needs a gradient under
        # autograd (a recomputing stage's forward runs under no_grad, its recompute not)
        needs = {t.name: t.requires_grad for t in self.stage.spec.recvs}
        noise = [torch.empty(s.shape or (), dtype=s.dtype, device=s.device) for s in self.sites]
        examples = {g: [*params.values(), *buffers.values(),
                        *[a.detach().requires_grad_(g and needs.get(n, False))
                          for n, a in zip(self.stage.arg_names, args)], *noise]
                    for g in self.grad_modes}
        self._expected = {g: _signature(e) for g, e in examples.items()}
        args += noise
        self._keys = list(result)
        try:
            module = with_noise_inputs(self.stage, self.sites) if self.sites else \
                self.stage.module
            gm = flat_graph(module, self._names, len(args), self._keys)
        except Exception as exc:  # noqa: BLE001 - the stage stays eager, said
            self._fail(f"its flat graph could not be made ({_first_line(exc)})")
            return
        marks = [True] * len(params) + [False] * (len(buffers) + len(args))
        use_cache_dir()
        split, autocast, box = self.split, self.autocast, self._live
        self._job = _Job(lambda: compile_flat(gm, examples, marks, split, autocast,
                                              lambda: box[0]), self)
        COMPILER.submit(self._job)

    def at_step_boundary(self) -> bool:
        """Adopt the compiled version if it is ready (never waits); give up on a compile past
        its time limit. Returns whether the stage runs compiled."""
        job = self._job
        if self.compiled is not None or job is None or self.failed is not None:
            return self.compiled is not None
        if job.future.done():
            self._job = None
            error = job.future.exception()
            if error is not None:
                self._fail(f"torch.compile / inductor could not compile it in the background "
                           f"({_first_line(error)})")
                return False
            self.compiled = job.future.result()
            self.compile_seconds = job.seconds
            return True
        limit = switches.read("VARUNA_FX_COMPILE_TIMEOUT")
        if time.monotonic() - job.submitted > limit:
            self._job = None
            job.future.cancel()
            self._fail(f"its background compile did not finish within {limit:g} s "
                       "($VARUNA_FX_COMPILE_TIMEOUT)")
        return False

    @property
    def pending(self) -> bool:
        """Whether a background compile is queued or running (or done, not yet adopted)."""
        return self._job is not None

    @property
    def ready(self) -> bool:
        """Whether the background compile has ended (the next step boundary adopts it)."""
        return self._job is not None and self._job.future.done()

    # -- warnings ---------------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        self.failed = why
        self.compiled = None
        self._said.add("eager")
        warnings.warn(f"stage {self.stage.index}: {why}; the stage runs eagerly from now on "
                      "(its numbers are eager's; compile_stages='off' silences this)",
                      CompiledStageWarning, stacklevel=3)

    def _warn(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(text, CompiledStageWarning, stacklevel=4)
