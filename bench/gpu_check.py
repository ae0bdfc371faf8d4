"""GPU check: the one-process pipeline on one device against eager PyTorch (issue 28, item 5).

Run: ``python bench/gpu_check.py [--out DIR_OR_FILE] [--size full|small] [--device auto|cuda|cpu]``
(``--out`` defaults to ``$OUT`` when set: the JSON goes to ``<dir>/gpu_check.json``). On a CUDA
machine it runs, for a GPT of 12 blocks x 1024 (vocabulary 50304, sequence 1024, batch 8: about
200M parameters) and a small GPT (4 x 256), in fp32 (TF32 off) and bf16 (autocast), P = 4 stages
of the one-process runtime on that one device, micro-batches of 2:

1. **Equality with eager** on the whole batch: the loss, and every parameter's gradient as a
   relative error in norm, ``|g_pipe - g_eager| / |g_eager|`` (the largest over parameters), with
   tolerances per dtype (fp32: 1e-5 on the loss, 1e-4 on gradients; bf16: 1e-2 and 5e-2, autocast
   rounds every matmul to 8 mantissa bits and a micro-batch's GEMMs are other kernels than the
   whole batch's). Beside it, the same errors of eager run on the same micro-batches (the same
   mean) against eager on the whole batch: the reference noise of that dtype on that device; a
   case passes within its tolerance or within twice that noise. The JSON also holds the
   pipeline's errors against eager on those micro-batches (the same GEMM shapes).
2. **Memory per stage**: each stage's peak as if it ran on a device of its own, measured with
   the CUDA caching allocator's counters (``torch.cuda.memory_allocated`` /
   ``max_memory_allocated``) around every action the runtime runs for that stage, against the
   plan's memory column (``plan.stage_costs[s].memory``). A stage holds its parameters and
   their gradients and AdamW's two moments (counted from the tensors; a tied weight on every
   stage using it, as a distributed run holds a copy each), plus what its actions allocate and
   have not freed (its stash), plus, within an action, that action's transient peak. A value
   sent from stage s to s + 1 counts on s until s + 1 takes it (then on s + 1), and a gradient
   sent back likewise; where the sender also keeps the value (its autograd graph), it is
   counted once, on the receiver: the error is the boundary tensors (MBs per micro-batch).
3. **Step time** against eager: the median of ``--steps`` steps after ``--warmup`` ones, each
   timed between ``torch.cuda.synchronize()`` calls; eager is forward + backward on the whole
   batch, the pipeline ``pipe.step`` (P stages taking turns on the one device).

It prints a table and writes everything as JSON. On CPU (no CUDA, or ``--device cpu``) it runs
the same code on the CPU at the small size and says so: the equality and timing checks run; the
memory column is not measured (CPU tensors have no allocator counters). It finishes in a few
minutes on an H200 (no download: the models are built from configs). Exit status 1 when an
equality check fails. The numbers of a run go to bench/RESULTS.md ("GPU check").
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import varuna_fx as vf  # noqa: E402
from varuna_fx.examples import GPT, GPTConfig, lm_loss  # noqa: E402

STAGES, MICRO_BATCH = 4, 2
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 5e-2)}  # (loss, gradients): relative
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSize:
    name: str
    config: GPTConfig
    batch: int


SIZES = {
    "full": [ModelSize("gpt-12x1024", GPTConfig(vocab_size=50304, block_size=1024, n_layer=12,
                                                  n_head=16, n_embd=1024), 8),
             ModelSize("gpt-4x256", GPTConfig(vocab_size=8192, block_size=256, n_layer=4,
                                              n_head=4, n_embd=256), 8)],
    "small": [ModelSize("gpt-4x128", GPTConfig(vocab_size=1000, block_size=64, n_layer=4,
                                               n_head=4, n_embd=128), 8),
              ModelSize("gpt-2x64", GPTConfig(vocab_size=256, block_size=32, n_layer=2,
                                              n_head=2, n_embd=64), 4)],
    "tiny": [ModelSize("gpt-2x64", GPTConfig(vocab_size=256, block_size=32, n_layer=2,
                                             n_head=2, n_embd=64), 4)],  # (the test's)
}


@dataclass
class Result:
    model: str
    precision: str
    recompute: bool | str
    device: str
    stages: int = 0
    micro_batch_size: int = 0
    schedule: str = ""
    loss_eager: float = float("nan")
    loss_pipeline: float = float("nan")
    loss_error: float = float("nan")  # relative
    grad_error: float = float("nan")  # largest relative error in norm over parameters
    worst_parameter: str = ""
    noise_loss: float = float("nan")  # eager on the micro-batches against eager whole
    noise_grad: float = float("nan")
    micro_loss_error: float = float("nan")  # the pipeline against eager on the micro-batches
    micro_grad_error: float = float("nan")
    equal: bool = False
    memory_measured: list[float] | None = None  # bytes per stage (CUDA only)
    memory_planned: list[float] = field(default_factory=list)
    memory_one_device: float | None = None  # the step's peak with every stage on this device
    step_eager: float = float("nan")  # seconds, median
    step_pipeline: float = float("nan")
    predicted_step_on_p_devices: float | None = None  # the plan's (P devices, for reference)
    error: str | None = None


# -- the device ---------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    dtype = AUTOCAST[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None \
        else contextlib.nullcontext()


# -- equality ---------------------------------------------------------------------------------

def eager_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str,
                chunks: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """Eager loss and gradients on the whole batch, or as the mean over ``chunks`` equal
    micro-batches (the same quantity, computed in pieces)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        with autocast(x.device, precision):
            loss = lm_loss(model(xs), ys) / chunks
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def compare(loss: float, grads: dict[str, torch.Tensor], ref_loss: float,
            ref: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(relative loss error, largest relative gradient error in norm, its parameter)."""
    worst, name = 0.0, ""
    for n, g in ref.items():
        other = grads.get(n)
        if other is None:
            return abs(loss - ref_loss) / abs(ref_loss), float("inf"), n
        err = float((other.float() - g.float()).norm() / g.float().norm().clamp_min(1e-30))
        if err > worst:
            worst, name = err, n
    return abs(loss - ref_loss) / abs(ref_loss), worst, name


# -- memory per stage -----------------------------------------------------------------------------

class Allocator:
    """The caching allocator's counters on CUDA; zeros on CPU, where the same code runs but
    measures nothing (CPU tensors have no such counters)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0


class StageMemory:
    """Each stage's peak as if it ran on a device of its own (see the module docstring): the
    one-process runtime's per-stage actions (and the loss, which the last stage computes) are
    wrapped to count the allocator's bytes. What the runtime allocates between two actions
    (a sent value cast to its planned dtype, gradients summed for a sender) belongs to the
    stage of the action before; a value or gradient received moves from its sender to the
    receiver. A value sent to several stages counts once, on the first receiver."""

    def __init__(self, pipe: vf.Pipeline, optimizer: torch.optim.Optimizer,
                 allocator: Allocator) -> None:
        self.pipe = pipe
        self.alloc = allocator
        self.workers = pipe.runtime.workers  # the one-process runtime's, one per stage
        self.held = [self._held(s, optimizer) for s in range(len(self.workers))]
        self.live = [0.0] * len(self.workers)  # bytes its actions allocated, not yet freed
        self.peak = list(self.held)
        self.device_peak = 0  # all stages together on this one device, for reference
        self.last: int | None = None  # the stage of the last action
        self.mark = 0  # bytes allocated when it ended
        self._undo: list[Callable[[], None]] = []

    def _held(self, s: int, optimizer: torch.optim.Optimizer) -> float:
        """Parameters and buffers the stage reads, their gradients (kept allocated: the step
        accumulates into them in place) and AdamW's state of its parameters."""
        module = self.pipe.stages[s].module
        total = sum(t.numel() * t.element_size() for t in module.parameters())
        total += sum(t.numel() * t.element_size() for t in module.buffers())
        total += sum(p.grad.numel() * p.grad.element_size() for p in module.parameters()
                     if p.grad is not None)
        for p in module.parameters():
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return float(total)

    def _measured(self, s: int, run: Callable[[], Any]) -> Any:
        now = self.alloc.allocated()
        if self.last is not None:  # between two actions: the previous one's sends and sums
            self.live[self.last] += now - self.mark
        self.alloc.reset_peak()
        result = run()
        self.device_peak = max(self.device_peak, self.alloc.peak())
        self.peak[s] = max(self.peak[s], self.held[s] + self.live[s] + self.alloc.peak() - now)
        self.mark = self.alloc.allocated()
        self.live[s] += self.mark - now
        self.last = s
        return result

    def _move(self, nbytes: float, src: int | None, dst: int) -> None:
        if src is not None and src != dst:
            self.live[src] -= nbytes
            self.live[dst] += nbytes

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        runtime = self.pipe.runtime
        last = len(self.workers) - 1
        for s, worker in enumerate(self.workers):
            senders = {t.name: t.src for t in worker.spec.recvs}
            receivers = {t.name: t.dst for t in worker.spec.sends}
            for name in ("forward", "recompute_mb", "backward", "weight_grads"):
                self._wrap(s, worker, name, senders if name == "forward" else
                           receivers if name == "backward" else {})
        run_actions = runtime.run_actions

        def counted_actions(micro: Any, loss_of: Callable[..., Any]) -> Any:
            return run_actions(micro, lambda *a: self._measured(last, lambda: loss_of(*a)))

        runtime.run_actions = counted_actions
        try:
            yield
        finally:
            del runtime.run_actions
            for undo in self._undo:
                undo()
            self._undo.clear()

    def _wrap(self, s: int, worker: Any, name: str, peers: dict[str, int]) -> None:
        original = getattr(worker, name)
        position = {"forward": 2, "backward": 1}.get(name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            arriving = args[position] if position is not None and len(args) > position else {}
            for key, value in (arriving or {}).items():  # received: now this stage's
                if torch.is_tensor(value):
                    self._move(value.numel() * value.element_size(), peers.get(key), s)
            return self._measured(s, lambda: original(*args, **kwargs))

        setattr(worker, name, counted)
        self._undo.append(lambda: delattr(worker, name))


# -- one case -------------------------------------------------------------------------------------

def median_step(run: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(size: ModelSize, precision: str, recompute: bool | str, device: torch.device,
          args: argparse.Namespace) -> Result:
    result = Result(size.name, precision, recompute, str(device))
    torch.manual_seed(0)
    cfg = size.config
    model = GPT(cfg).to(device)
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, cfg.vocab_size, (size.batch, cfg.block_size + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    cluster = vf.Cluster.local() if device.type == "cuda" else vf.Cluster(gpus=1, device="cpu")
    pipe = vf.compile(model, cluster, example_inputs=(x,), loss_fn=lm_loss, stages=STAGES,
                      micro_batch_size=MICRO_BATCH, precision=precision, recompute=recompute)
    plan = pipe.plan
    result.stages, result.micro_batch_size = plan.stages, plan.micro_batch_size
    result.schedule = plan.schedule.name
    result.memory_planned = [s.memory for s in plan.stage_costs]
    result.predicted_step_on_p_devices = plan.predicted_step_time

    # 1. equality: one step from the same weights
    ref_loss, ref = eager_grads(eager, x, y, precision)
    chunked_loss, chunked = eager_grads(eager, x, y, precision, plan.num_micro_batches)
    result.noise_loss, result.noise_grad, _ = compare(chunked_loss, chunked, ref_loss, ref)
    pipe.zero_grad()
    loss = float(pipe.step(x, target=y))
    grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
    result.loss_eager, result.loss_pipeline = ref_loss, loss
    result.loss_error, result.grad_error, result.worst_parameter = compare(loss, grads,
                                                                           ref_loss, ref)
    result.micro_loss_error, result.micro_grad_error, _ = compare(loss, grads, chunked_loss,
                                                                  chunked)
    # within the dtype's tolerance, or within twice eager's own error from computing the same
    # mean in micro-batches (other GEMM shapes, other kernels: a property of the device)
    loss_tol, grad_tol = TOLERANCES[precision]
    result.equal = result.loss_error <= max(loss_tol, 2 * result.noise_loss) and \
        result.grad_error <= max(grad_tol, 2 * result.noise_grad)
    del grads, ref, chunked

    # 2. memory per stage: a step after the optimizer made its state, counted per stage
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    optimizer.step()
    # the gradients stay allocated (zeroed in place), so each stage's count holds its own
    # copy of a tied weight's gradient, as a stage on its own device would
    pipe.zero_grad(set_to_none=False)
    counter = StageMemory(pipe, optimizer, Allocator(device))
    with counter.counting():  # (on CPU the same code runs, counting nothing)
        pipe.step(x, target=y)
    if device.type == "cuda":
        result.memory_measured = counter.peak
        result.memory_one_device = float(counter.device_peak)
    del optimizer

    # 3. step time against eager (forward + backward of the same batch)
    def eager_step() -> None:
        eager.zero_grad(set_to_none=True)
        with autocast(device, precision):
            loss = lm_loss(eager(x), y)
        loss.backward()

    def pipe_step() -> None:
        pipe.zero_grad()
        pipe.step(x, target=y)

    result.step_eager = median_step(eager_step, device, args.warmup, args.steps)
    result.step_pipeline = median_step(pipe_step, device, args.warmup, args.steps)
    pipe.close()
    return result


# -- the report -------------------------------------------------------------------------------

def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def table(results: list[Result], on_cuda: bool) -> Table:
    t = Table(title=f"one-process pipeline (P={STAGES}, micro-batch {MICRO_BATCH}) against eager"
                    f" on {results[0].device if results else '?'}")
    for column in ("model", "dtype", "recompute", "schedule", "loss err", "grad err",
                   "noise (eager, mb)", "equal", "memory GiB measured/planned per stage",
                   "step eager", "step pipe", "pipe/eager"):
        t.add_column(column, justify="right")
    for r in results:
        if r.error:
            t.add_row(r.model, r.precision, str(r.recompute), "-", "error", r.error[:60],
                      *["-"] * 6)
            continue
        memory = "not measured on CPU" if not on_cuda or r.memory_measured is None else " ".join(
            f"{gib(m)}/{gib(p)}" for m, p in zip(r.memory_measured, r.memory_planned))
        t.add_row(r.model, r.precision, str(r.recompute), r.schedule, f"{r.loss_error:.1e}",
                  f"{r.grad_error:.1e}", f"{r.noise_loss:.1e} / {r.noise_grad:.1e}",
                  "yes" if r.equal else "NO", memory, f"{r.step_eager * 1e3:.1f} ms",
                  f"{r.step_pipeline * 1e3:.1f} ms",
                  f"{r.step_pipeline / r.step_eager:.2f}")
    t.caption = ("loss err, grad err: relative to eager on the whole batch (grad: the largest "
                 "over parameters, in norm); tolerances fp32 1e-5 / 1e-4, bf16 1e-2 / 5e-2. "
                 "noise: eager on the same micro-batches against eager whole. memory: each "
                 "stage's peak as on its own device (allocator counters) / the plan's column. "
                 "step: median after warm-up, synchronised")
    return t


def cpu_name() -> str:
    """The CPU's model name (``platform.processor()`` would run ``uname``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def out_path(given: str | None) -> Path | None:
    target = given or os.environ.get("OUT")
    if not target:
        return None
    path = Path(target)
    return path / "gpu_check.json" if path.is_dir() or not path.suffix else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file or folder (default: $OUT)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--size", default=None, choices=list(SIZES),
                        help="model sizes (default: full on CUDA, small on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not on_cuda:
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda \
        else torch.device("cpu")
    console = Console(width=200)
    if on_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: equality, not TF32
        torch.backends.cudnn.allow_tf32 = False
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_name()
        console.print("[yellow]no CUDA: running the same checks on the CPU at the small size "
                      "(memory per stage is not measured on CPU)[/yellow]")
    size = args.size or ("full" if on_cuda else "small")
    cases = [(m, precision, recompute) for m in SIZES[size] for precision in ("fp32", "bf16")
             for recompute in ("auto", True)]
    results = []
    started = time.perf_counter()
    for m, precision, recompute in cases:
        console.print(f"{m.name} {precision} recompute={recompute} ...")
        try:
            results.append(check(m, precision, recompute, device, args))
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, not fatal
            results.append(Result(m.name, precision, recompute, str(device),
                                  error=f"{type(exc).__name__}: {exc}"))
            traceback.print_exc()
        if on_cuda:
            torch.cuda.empty_cache()
    console.print(table(results, on_cuda))
    report = {"device": str(device), "device_name": name, "torch": torch.__version__,
              "cuda": torch.version.cuda if on_cuda else None, "size": size,
              "tolerances": TOLERANCES, "seconds": time.perf_counter() - started,
              "memory_measured": on_cuda, "results": [asdict(r) for r in results]}
    path = out_path(args.out)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))
        console.print(f"wrote {path}")
    ok = all(r.error is None and r.equal for r in results)
    console.print("all equal to eager within the tolerances" if ok
                  else "[red]some checks failed[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    from results import recorded

    with recorded("gpu_check.py"):
        code = main()
    raise SystemExit(code)
