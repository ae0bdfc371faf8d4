"""The error catalogue: every error a user can cause, as input -> exception class and the key
words of its message (issue 9). Each row is what a new user would try; each must end in a
``VarunaFxError`` subclass that names what is wrong and what to change -- never a raw
traceback, a hang or a silent default. (Errors that need several processes are pinned by
tests/launch/test_timeouts_and_loopback.py and the distributed tests.)"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import varuna_fx as vf
from support.autograd_models import Quantised
from support.registry import CASES
from varuna_fx.data.documents import read_documents
from varuna_fx.monitor.report import report
from varuna_fx.world.switches import read as read_switch

MLP = CASES["mlp"]
X, Y = MLP.inputs[0], MLP.target


def compile_mlp(cluster: vf.Cluster | None = None, inputs: Any = MLP.inputs,
                **kw: Any) -> vf.Pipeline:
    kw.setdefault("loss_fn", MLP.loss_fn)
    return vf.compile(MLP.model, cluster or vf.Cluster(gpus=1, device="cpu"),
                      example_inputs=inputs, **kw)


class _WeightDerived(nn.Module):
    """A plain tensor attribute made from the weights while the model is built: under
    deferred_init it is meta, and its values depend on weights not yet initialised."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = self.lin.weight.detach().norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _deferred_meta_constant(tracer: str) -> vf.Pipeline:
    with vf.deferred_init(seed=0):
        model = _WeightDerived()
    return vf.compile(model, example_inputs=(torch.randn(2, 8),), stages=1, tracer=tracer)


def compile_module(model: nn.Module, inputs: Any, **kw: Any) -> vf.Pipeline:
    return vf.compile(model, vf.Cluster(gpus=1, device="cpu"), example_inputs=inputs, **kw)


class BatchBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 2:  # the batch size: a pipeline's micro-batches differ
            return self.lin(x).sum()
        return self.lin(x).mean()


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # control flow on a tensor value
            return h
        return -h


class Returns(nn.Module):
    """forward returns ``value`` whatever the input (None, an int, ...)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.lin, self.value = nn.Linear(4, 4), value

    def forward(self, x: torch.Tensor) -> Any:
        self.lin(x)
        return self.value


class VarKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.lin(kwargs["x"])


class OwnLoss(nn.Module):
    """Computes its loss itself from a forward parameter named like step's ``target=``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), target)


def tiny_mixtral() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Mixtral with transformers' eager experts (a loop over the experts that were hit)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=2, num_experts_per_tok=1,
                           max_position_embeddings=32, use_cache=False,
                           experts_implementation="eager")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    return MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def step_after(make: Callable[[vf.Pipeline], Any], **kw: Any) -> Callable[[Any], Any]:
    def run(_: Any) -> Any:
        pipe = compile_mlp(stages=2, **kw)
        return make(pipe)
    return run


def env(name: str, value: str, then: Callable[[], Any]) -> Callable[[Any], Any]:
    def run(monkeypatch: pytest.MonkeyPatch) -> Any:
        monkeypatch.setenv(name, value)
        return then()
    return run


def closed(pipe: vf.Pipeline) -> Any:
    pipe.close()
    return pipe.step(X, target=Y)


def meta_model_step(_: Any) -> Any:
    model = MLP.model.__class__().to("meta")
    pipe = vf.compile(model, vf.Cluster(gpus=1, device="cpu"),
                      example_inputs=(torch.empty(8, 32, device="meta"),),
                      loss_fn=MLP.loss_fn, stages=2)
    return pipe.step(X, target=Y)


def skipped_init_step(_: Any) -> Any:
    with vf.skip_init():  # resuming... but the load was forgotten
        model = MLP.model.__class__()
    pipe = vf.compile(model, vf.Cluster(gpus=1, device="cpu"), example_inputs=MLP.inputs,
                      loss_fn=MLP.loss_fn, stages=2)
    return pipe.step(X, target=Y)


def other_graph_profile(_: Any) -> Any:
    from varuna_fx.planner import Profile

    profile = Profile(key="k", graph="another", device="cpu", device_name="cpu",
                      dtype="float32", threads=1, sizes=[1], chunks=[])
    return compile_mlp(stages=1, profile=profile)


def world_mismatch(_: Any) -> Any:
    from varuna_fx.schedule.placement import check_world_size

    return check_world_size(3, 2, 1)


def small(memory: str, **kw: Any) -> Callable[[Any], Any]:
    return lambda _: compile_mlp(vf.Cluster(gpus=2, device="cpu", gpu_memory=memory), **kw)


@dataclass
class Row:
    name: str
    run: Callable[[Any], Any]  # gets pytest's monkeypatch
    error: type[vf.VarunaFxError]
    words: tuple[str, ...]
    absent: tuple[str, ...] = ()  # advice that would not help here


def row(name: str, run: Callable[[Any], Any], error: type[vf.VarunaFxError],
        *words: str, absent: tuple[str, ...] = ()) -> Row:
    return Row(name, run, error, words, absent)


E, Cap, Inp, Part, Plan, Dist = (vf.VarunaFxError, vf.CaptureError, vf.InputError,
                                 vf.PartitionError, vf.PlanError, vf.DistributedError)

CATALOGUE = [
    # -- compile's arguments --------------------------------------------------------------
    row("not a module", lambda _: vf.compile(lambda x: x, example_inputs=(X,)), E,
        "torch.nn.Module"),
    row("no example inputs", lambda _: vf.compile(MLP.model, stages=1), E,
        "example_inputs is required"),
    row("unknown schedule", lambda _: compile_mlp(stages=1, schedule="zigzag"), E,
        "schedule='zigzag'", "1f1b"),
    row("unknown tracer", lambda _: compile_mlp(stages=1, tracer="jit"), E, "tracer='jit'",
        "export"),
    row("inputs passed where the cluster goes", lambda _: vf.compile(MLP.model, (X,)), E,
        "cluster=<tuple> is not a vf.Cluster", "example_inputs="),
    row("cluster=4", lambda _: vf.compile(MLP.model, 4, example_inputs=(X,)), E,
        "cluster=4", "vf.Cluster"),
    row("loss_fn not callable", lambda _: compile_mlp(stages=2, loss_fn="mse"), E,
        "loss_fn='mse'", "not callable"),
    row("schedule as a list", lambda _: compile_mlp(stages=1, schedule=["varuna"]), E,
        "schedule=['varuna']", "string"),
    row("precision as a list", lambda _: compile_mlp(stages=1, precision=["fp32"]), E,
        "precision=['fp32']", "string"),
    row("unknown precision", lambda _: compile_mlp(stages=1, precision="fp8"), E,
        "precision='fp8'", "bf16"),
    row("unknown compile_stages", lambda _: compile_mlp(stages=1, compile_stages="max"), E,
        "compile_stages='max'", "'on'", "'auto'"),
    row("compile_wait not a bool", lambda _: compile_mlp(stages=1, compile_wait="yes"), E,
        "compile_wait='yes'", "True", "False"),
    row("planned_steps not a count", lambda _: compile_mlp(stages=1, planned_steps=0), E,
        "planned_steps=0", "positive number of optimizer steps"),
    # -- what slow links carry (issue 31) -------------------------------------------------
    row("unknown compression", lambda _: compile_mlp(stages=2, compression="int4"), E,
        "compression='int4'", "'bf16'", "'int8'"),
    row("replica_sync by a class's name", lambda _: compile_mlp(
        stages=2, replica_sync="powersgd"), E, "replica_sync='powersgd'", "vf.PowerSGD(rank=4)"),
    row("PowerSGD(rank=0)", lambda _: vf.PowerSGD(rank=0), E, "rank=0", "positive integer"),
    row("PowerSGD(start_iter=1)", lambda _: vf.PowerSGD(start_iter=1), E, "at least 2"),
    row("DiLoCo(every=0)", lambda _: vf.DiLoCo(every=0), E, "every=0", "local"),
    row("DiLoCo(outer_momentum=1)", lambda _: vf.DiLoCo(outer_momentum=1.0), E, "[0, 1)"),
    row("compression with one stage", lambda _: compile_mlp(stages=1, compression="int8"), Plan,
        "one stage (P=1)", "stages=2"),
    row("DiLoCo with one replica", lambda _: compile_mlp(stages=2, replica_sync=vf.DiLoCo()),
        Plan, "one replica (D=1)", "data_parallel=2"),
    row("DiLoCo with ZeRO-1", lambda _: compile_mlp(
        vf.Cluster(gpus=2, device="cpu"), stages=1, data_parallel=2, shard_optimizer=True,
        replica_sync=vf.DiLoCo()), Plan, "cannot be sharded", "shard_optimizer='auto'"),
    row("PowerSGD rank too large", lambda _: compile_mlp(
        vf.Cluster(gpus=2, device="cpu"), stages=1, data_parallel=2,
        replica_sync=vf.PowerSGD(rank=9)), Plan, "compress none", "choose rank <= 8"),
    row("dualpipev on 3 stages per rank", lambda _: compile_mlp(
        stages=6, stages_per_rank=3, schedule="dualpipev"), E, "exactly 2 stages",
        "stages_per_rank=2"),
    row("stages=0", lambda _: compile_mlp(stages=0), E, "stages=0", "positive number"),
    row("stages=-2", lambda _: compile_mlp(stages=-2), E, "stages=-2", "positive number"),
    row("stages=True", lambda _: compile_mlp(stages=True), E, "stages=True", "positive number"),
    row("stages=1.5", lambda _: compile_mlp(stages=1.5), E, "stages=1.5", "positive number"),
    row("more stages than operations", lambda _: compile_mlp(stages=50), Part, "stages=50",
        "operations of the model", "at most 13"),
    row("stages=10**6", lambda _: compile_mlp(stages=10**6), Part, "operations of the model"),
    row("micro_batch_size=0", lambda _: compile_mlp(stages=2, micro_batch_size=0), E,
        "micro_batch_size=0", "positive number"),
    row("micro_batch_size=True", lambda _: compile_mlp(stages=2, micro_batch_size=True), E,
        "micro_batch_size=True"),
    row("micro_batch_size=2.0", lambda _: compile_mlp(stages=2, micro_batch_size=2.0), E,
        "micro_batch_size=2.0"),
    row("data_parallel=0", lambda _: compile_mlp(stages=2, data_parallel=0), E,
        "data_parallel=0", "positive number"),
    row("global_batch_size=0", lambda _: compile_mlp(stages=2, global_batch_size=0), E,
        "global_batch_size=0"),
    row("global batch smaller than the example", lambda _: compile_mlp(
        stages=2, global_batch_size=7), Inp, "8 samples", "global_batch_size=7"),
    row("micro-batch not dividing the batch", lambda _: compile_mlp(
        stages=2, micro_batch_size=3), Plan, "micro_batch_size=3", "batch of 8"),
    # -- grad_accum_steps: global batch = micro-batch x micro-batches x replicas (issue 44) --
    row("grad_accum_steps=0", lambda _: compile_mlp(stages=2, grad_accum_steps=0), E,
        "grad_accum_steps=0", "positive number"),
    row("grad_accum_steps not dividing the global batch", lambda _: compile_mlp(
        stages=2, global_batch_size=16, grad_accum_steps=3), E, "does not divide",
        "global_batch_size=16"),
    row("grad_accum_steps x micro_batch_size x data_parallel not the global batch",
        lambda _: compile_mlp(stages=2, global_batch_size=16, micro_batch_size=2,
                              grad_accum_steps=2, data_parallel=1), E, "global batch of 4",
        "global_batch_size=16"),
    row("grad_accum_steps not dividing the example batch", lambda _: compile_mlp(
        stages=2, grad_accum_steps=3), Plan, "grad_accum_steps=3", "batch of 8"),
    row("micro_batch_size x grad_accum_steps not the example batch", lambda _: compile_mlp(
        stages=2, micro_batch_size=2, grad_accum_steps=2), Plan,
        "micro_batch_size=2 x grad_accum_steps=2", "per-replica batch of 8"),
    row("recompute='yes'", lambda _: compile_mlp(stages=2, recompute="yes"), E,
        "recompute='yes'", "True"),
    row("offload_stash='no'", lambda _: compile_mlp(stages=2, offload_stash="no"), E,
        "offload_stash='no'"),
    row("timeout=-1", lambda _: compile_mlp(stages=1, timeout=-1), E, "timeout=-1",
        "positive, finite"),
    row("timeout=nan", lambda _: compile_mlp(stages=1, timeout=math.nan), E, "timeout=nan"),
    row("timeout=inf", lambda _: compile_mlp(stages=1, timeout=math.inf), E, "timeout=inf"),
    row("timeout='10'", lambda _: compile_mlp(stages=1, timeout="10"), E, "timeout='10'",
        "number of seconds"),
    row("VARUNA_FX_MACHINE names no machine's costs",
        env("VARUNA_FX_MACHINE", "/no/such/machine.json",
            lambda: vf.compile(MLP.model, example_inputs=MLP.inputs, loss_fn=MLP.loss_fn)),
        E, "$VARUNA_FX_MACHINE", "unset it to measure"),
    row("VARUNA_FX_TIMEOUT=nan", env("VARUNA_FX_TIMEOUT", "nan", lambda: compile_mlp(stages=1)),
        E, "VARUNA_FX_TIMEOUT=nan", "positive, finite"),
    row("VARUNA_FX_TIMEOUT=inf", env("VARUNA_FX_TIMEOUT", "inf", lambda: compile_mlp(stages=1)),
        E, "VARUNA_FX_TIMEOUT=inf"),
    row("VARUNA_FX_TIMEOUT=soon", env("VARUNA_FX_TIMEOUT", "soon",
                                      lambda: compile_mlp(stages=1)),
        E, "VARUNA_FX_TIMEOUT='soon'", "not a number of seconds"),
    row("VARUNA_FX_TIMEOUT=-5", env("VARUNA_FX_TIMEOUT", "-5", lambda: compile_mlp(stages=1)),
        E, "VARUNA_FX_TIMEOUT=-5"),
    # every switch reads through world/switches.py: one refusal per kind
    row("VARUNA_FX_HEARTBEAT_WINDOW=soon", env("VARUNA_FX_HEARTBEAT_WINDOW", "soon",
                                               lambda: read_switch("VARUNA_FX_HEARTBEAT_WINDOW")),
        E, "VARUNA_FX_HEARTBEAT_WINDOW='soon'", "number of seconds"),
    row("VARUNA_FX_PREPLAN_SECONDS=0", env("VARUNA_FX_PREPLAN_SECONDS", "0",
                                           lambda: read_switch("VARUNA_FX_PREPLAN_SECONDS")),
        E, "VARUNA_FX_PREPLAN_SECONDS=0", "positive, finite"),
    row("VARUNA_FX_MIN_WORLD=two", env("VARUNA_FX_MIN_WORLD", "two",
                                       lambda: read_switch("VARUNA_FX_MIN_WORLD")),
        Dist, "VARUNA_FX_MIN_WORLD='two'", "integer"),
    row("WORLD_SIZE=two", env("WORLD_SIZE", "two", lambda: compile_mlp(stages=1)), Dist,
        "WORLD_SIZE='two'", "torchrun"),
    row("WORLD_SIZE=two, local cluster", env("WORLD_SIZE", "two", vf.Cluster.local), Dist,
        "WORLD_SIZE='two'"),
    row("profile='yes'", lambda _: compile_mlp(stages=1, profile="yes"), E, "profile='yes'",
        "True (measure this device)"),  # the advice names the values that work
    row("profile of another graph", other_graph_profile, E, "different graph", "profile=True"),
    # -- example inputs -------------------------------------------------------------------
    row("inputs not a tuple or dict", lambda _: compile_mlp(stages=1, inputs="text"), Inp,
        "tuple of positional arguments or a dict"),
    row("too many inputs", lambda _: compile_mlp(stages=1, inputs=(X, X)), Inp, "do not match"),
    row("unknown keyword", lambda _: compile_mlp(stages=1, inputs={"y": X}), Inp,
        "do not match"),
    row("no inputs", lambda _: compile_mlp(stages=1, inputs=()), Inp, "do not match"),
    row("a list input", lambda _: compile_mlp(stages=1, inputs=([1, 2, 3],)), Inp,
        "inputs must be tensors"),
    row("a 0-d input", lambda _: compile_mlp(stages=1, inputs=(torch.tensor(3.0),)), Inp,
        "0-d tensors"),
    row("empty batch", lambda _: compile_mlp(stages=1, inputs=(torch.randn(0, 32),)), Inp,
        "empty", "at least one sample"),
    row("batch dims disagree", lambda _: vf.compile(
        CASES["kwargs_dict"].model, example_inputs={"features": torch.randn(8, 5, 16),
                                                    "mask": torch.ones(6, 5)}, stages=2),
        Inp, "features: 8, mask: 6"),
    row("meta example, real model", lambda _: compile_mlp(
        stages=1, inputs=(torch.empty(8, 32, device="meta"),)), Inp, "meta", "cpu"),
    row("forward(**kwargs)", lambda _: compile_module(VarKwargs(), {"x": torch.randn(2, 4)}),
        Inp, "*args/**kwargs"),
    row("forward's target and a loss_fn", lambda _: compile_module(
        OwnLoss(), (torch.randn(8, 8), torch.randint(0, 4, (8,))), loss_fn=MLP.loss_fn), E,
        "parameter named 'target'", "loss_fn=None"),
    # -- capture --------------------------------------------------------------------------
    row("data-dependent control flow", lambda _: compile_module(
        DataDependent(), (torch.randn(2, 4),), stages=1, tracer="fx"), Cap,
        "if h.sum() > 0", "test_error_catalogue.py", "torch.where"),
    row("untraceable by both tracers", lambda _: compile_module(
        DataDependent(), (torch.randn(2, 4),), stages=1), Cap, "fx:", "export:",
        "if h.sum() > 0", absent=("try tracer=",)),  # auto already tried both
    row("forward returns None", lambda _: compile_module(Returns(None), (torch.randn(2, 4),)),
        Cap, "returned None", "no tensor", "test_error_catalogue.py"),
    row("forward returns an int", lambda _: compile_module(Returns(0), (torch.randn(2, 4),)),
        Cap, "returned 0", "return the loss"),
    row("Mixtral eager experts", lambda _: compile_module(*tiny_mixtral(), stages=1), Cap,
        "modeling_mixtral.py:", "for expert_idx in expert_hit", "data-dependent",
        absent=("capture/trace.py", "try tracer=")),
    # -- the cluster ----------------------------------------------------------------------
    row("gpus=0", lambda _: vf.Cluster(gpus=0), E, "gpus=0", "positive integer"),
    row("gpus=True", lambda _: vf.Cluster(gpus=True), E, "gpus=True"),
    row("gpus_per_node=0", lambda _: vf.Cluster(gpus=2, gpus_per_node=0), E,
        "gpus_per_node=0"),
    row("device='tpu'", lambda _: vf.Cluster(gpus=1, device="tpu"), E, "device='tpu'", "cpu"),
    row("unknown device_type", lambda _: vf.Cluster(gpus=1, device_type="z80"), E,
        "device_type='z80'", "flops="),
    row("unreadable memory", lambda _: vf.Cluster(gpus=1, gpu_memory="lots"), E,
        "memory size 'lots'", "16GiB"),
    row("negative memory", lambda _: vf.Cluster(gpus=1, gpu_memory=-5), E,
        "gpu_memory=-5", "positive"),
    row("NaN memory", lambda _: vf.Cluster(gpus=1, gpu_memory=math.nan), E, "memory size nan"),
    row("zero bandwidth", lambda _: vf.Cluster(gpus=2, inter_node_bandwidth=0), E,
        "inter_node_bandwidth=0", "positive"),
    row("unreadable bandwidth", lambda _: vf.Cluster(gpus=2, intra_node_bandwidth="fast"), E,
        "bandwidth 'fast'", "GB/s"),
    row("negative flops", lambda _: vf.Cluster(gpus=1, flops=-1.0), E, "flops=-1.0",
        "positive"),
    row("NaN flops", lambda _: vf.Cluster(gpus=1, flops=math.nan), E, "flops=nan"),
    row("negative latency", lambda _: vf.Cluster(gpus=1, latency=-1e-6), E, "latency=",
        "zero or a positive"),
    # -- planning -------------------------------------------------------------------------
    row("nothing fits, recompute on", small("4KiB"), Plan, "no configuration", "per device",
        absent=("recompute=True",)),
    row("nothing fits, recompute off", small("4KiB", recompute=False), Plan,
        "no configuration", "recompute=True"),
    row("stage does not fit", lambda _: compile_mlp(
        vf.Cluster(gpus=1, device="cpu", gpu_memory="4KiB"), stages=2), Part,
        "no partition into 2 stages fits", absent=("recomputation",)),
    row("no P x D for the devices", lambda _: compile_mlp(
        vf.Cluster(gpus=2, device="cpu"), data_parallel=3), Plan, "P x D must fit"),
    row("world size not P x D", world_mismatch, Dist, "3 ranks", "P x D = 2 x 1",
        "--nproc 2"),
    # -- stepping -------------------------------------------------------------------------
    row("batch not divisible by micro-batch", step_after(
        lambda p: p.step(torch.randn(6, 32), target=torch.randint(0, 4, (6,))),
        micro_batch_size=4), Inp, "batch size 6", "micro-batch size 4"),
    row("no loss", step_after(lambda p: p.step(X), loss_fn=None), Inp, "loss_fn"),
    row("loss not a scalar", step_after(lambda p: p.step(X, target=Y),
                                        loss_fn=lambda o, t: o), Inp, "0-d tensor"),
    row("target batch differs", step_after(lambda p: p.step(X, target=Y[:4])), Inp,
        "target has batch size 4"),
    row("other feature size", step_after(lambda p: p.step(torch.randn(8, 16), target=Y)), Inp,
        "compiled for (batch, 32)", "only the batch size"),
    row("other dtype", step_after(lambda p: p.step(X.double(), target=Y)), Inp,
        "torch.float64", "torch.float32"),
    row("other inputs than compiled", step_after(lambda p: p.step(x=X, target=Y, extra=1)),
        Inp, "do not match"),
    row("target passed positionally", step_after(lambda p: p.step(X, Y)), Inp,
        "2 positional arguments", "takes 1", "target=y"),
    row("step after close", step_after(closed), E, "closed", "compile again"),
    row("batch other than global_batch_size", step_after(
        lambda p: p.step(X[:4], target=Y[:4]), global_batch_size=8), Inp,
        "batch of 4", "global_batch_size=8", "pass 8 samples"),
    row("meta model, real step", meta_model_step, Inp, "meta device", "real parameters"),
    row("built under skip_init, never loaded", skipped_init_step, vf.UninitializedError,
        "never loaded", "pipe.load_checkpoint", "without skip_init"),
    # -- optimizers (sharded state: the distributed refusals are in tests/test_zero.py) ------
    row("pipe.optimizer of a non-optimizer", step_after(
        lambda p: p.optimizer(torch.nn.Linear)), vf.OptimizerError, "torch.optim.Optimizer"),
    row("pipe.optimizer over a foreign tensor", step_after(
        lambda p: p.optimizer(torch.optim.SGD, [torch.zeros(2, requires_grad=True)], lr=1.0)),
        vf.OptimizerError, "not one of this rank's parameters", "pipe.named_parameters()"),
    row("shard_optimizer not a choice", lambda _: compile_mlp(shard_optimizer="always"), E,
        "shard_optimizer='always'", "'auto'"),
    # -- vf.deferred_init (tests/test_deferred_init.py has the rest) -------------------------
    row("materialize a meta model", lambda _: vf.materialize(MLP.model.__class__().to("meta")),
        vf.UninitializedError, "not built under vf.deferred_init", "deferred_init(seed"),
    row("deferred tensor nothing initialised", lambda _: vf.materialize(_deferred_empty()),
        vf.UninitializedError, "left", "torch.empty", "vf.skip_init"),
    row("deferred_init nested", lambda _: _nested_deferred(), Inp, "do not nest"),
    row("fx: a Python condition on the batch size", lambda _: compile_module(
        BatchBranch(), (torch.randn(4, 4),), stages=1, tracer="fx"), Cap, "x.size(0) > 2",
        "depends on the batch size", "decides on the batch size"),
    row("custom autograd.Function under torch.export", lambda _: vf.compile(
        Quantised(), example_inputs=(torch.randn(8, 4),), stages=2, tracer="export"), Cap,
        "RoundSTE", "drops its backward", "tracer='fx'"),
    *[row(f"deferred model whose forward reads a constant made from its weights ({t})",
          lambda _, t=t: _deferred_meta_constant(t), Inp, "self.scale", "meta",
          "register_buffer('scale'", absent=("without vf.deferred_init",))
      for t in ("fx", "export")],
    row("deferred model bigger than this process", lambda mp: _too_big_to_allocate(mp),
        vf.AllocationError, "would allocate", "bytes)", "can allocate 1.0 KiB",
        "Nothing was allocated", "distributed"),
    # -- data, stateful checkpoints, watching (tests/data/, tests/monitor/ have the rest) -------
    row("data_loader over fewer samples than a global batch",
        step_after(lambda p: p.data_loader(list(range(3)))), Inp, "fewer than one global batch"),
    row("data_loader given batch_size", step_after(
        lambda p: p.data_loader(list(range(64)), batch_size=4)), Inp, "decides batch_size"),
    row("TokenDataset seq_len too long", lambda _: vf.TokenDataset(torch.arange(10), 64), Inp,
        "too long", "seq_len + 1"),
    row("TokenDataset over a negative token id",
        lambda _: vf.TokenDataset(torch.tensor([3, 1, -1, 2, 5]), 2), Inp,
        "negative token id -1 at position 2", "start at 0"),
    row("save a scheduler without state_dict", step_after(lambda p: p.save_checkpoint(
        os.path.join(tempfile.gettempdir(), "varuna_fx_never_written"), scheduler=object())),
        vf.CheckpointError, "lacks state_dict() and load_state_dict()"),
    row("Monitor.log before any step", step_after(
        lambda p: vf.Monitor(p, tempfile.mkdtemp(), live=False).log(1.0)), Inp,
        "no pipe.step since the last log"),
    row("Monitor wandb= neither a bool nor a dict", lambda _: vf.Monitor(
        None, tempfile.mkdtemp(), wandb="offline"), Inp, "wandb='offline'", "{'project'"),
    row("Monitor wandb=True without wandb installed", lambda mp: _without_wandb(mp), Inp,
        "pip install 'varuna_fx[wandb]'"),
    row("varuna-fx report of a folder that is not there", lambda _: report(
        os.path.join(tempfile.mkdtemp(), "runs", "train")), Inp, "is not a folder",
        "the train command's --out"),
    row("varuna-fx report of a folder without metrics.jsonl", lambda _: report(
        tempfile.mkdtemp()), Inp, "holds no metrics.jsonl", "Monitor's out_dir"),
    # -- pretrained weights (tests/checkpoint/test_pretrained.py has the rest) -----------------
    row("load_pretrained of pickled weights", lambda _: compile_mlp(stages=1).load_pretrained(
        _weights_dir({"pytorch_model.bin": b"x"})), vf.PretrainedError,
        "neither model.safetensors nor", "pickled weights can run code"),
    row("load_pretrained of a damaged file", lambda _: compile_mlp(stages=1).load_pretrained(
        _weights_dir({"model.safetensors": b"\x10" * 64})), vf.PretrainedError,
        "not a readable safetensors file"),
    row("load_pretrained of another model", lambda _: compile_mlp(stages=1).load_pretrained(
        _weights_dir({"model.safetensors": {"layers.0.weight": torch.zeros(3, 3)}})),
        vf.PretrainedError, "layers.0.weight: [3, 3] F32 in the checkpoint, [32, 32]",
        "missing: layers.0.bias"),
    row("load_pretrained into a meta pipeline", lambda _: compile_module(
        MLP.model.__class__().to("meta"), MLP.inputs, loss_fn=MLP.loss_fn,
        stages=1).load_pretrained(_weights_dir({})), vf.PretrainedError, "meta device",
        "vf.deferred_init"),
    row("load_pretrained with a deeply nested config.json", lambda _: compile_mlp(
        stages=1).load_pretrained(_weights_dir({"model.safetensors": {
            "layers.0.weight": torch.zeros(3, 3)}, "config.json": _DEEP_JSON})),
        vf.PretrainedError, "config.json cannot be read as JSON", "nested deeper"),
    row("load_checkpoint of a deeply nested marker", lambda _: compile_mlp(
        stages=1).load_checkpoint(_weights_dir({"varuna_fx_checkpoint.json": _DEEP_JSON})),
        vf.CheckpointError, "varuna_fx_checkpoint.json is unreadable", "nested deeper"),
    row("save_pretrained onto a file", lambda _: compile_mlp(stages=1).save_pretrained(
        os.path.join(_weights_dir({"weights": b""}), "weights")), vf.PretrainedError,
        "is a file", "pass a directory"),
    row("deferred_init reading values", lambda _: _deferred_reads_values(), Inp,
        "test_error_catalogue.py", "reads the values of a tensor", "vf.deferred_init"),
    # -- issue 30 -------------------------------------------------------------------------
    row("random draw with the batch last", lambda _: compile_module(
        DrawsTransposed(), (torch.randn(8, 4),), loss_fn=lambda o, _: o.sum(),
        micro_batch_size=2), Inp, "shape (4, b)", "test_error_catalogue.py",
        "Draw with the batch first"),
    row("tensor default of the batch's rows", lambda _: compile_module(
        BatchDefault(), (torch.randn(16, 4),), stages=1), Cap, "parameter 'y'",
        "dim 0 is the batch size (16)", "register_buffer"),
    # -- varuna-fx train (tests/launch/test_train_config.py has every refusal) -----------------
    row("train: an unknown key", lambda _: _train_config(["--learning-rate", "1e-3"]), Inp,
        "unknown key 'learning_rate'", "did you mean", "lr"),
    row("train: a value of the wrong type", lambda _: _train_config(["--steps", "1e3"]), Inp,
        "steps takes an integer", "'1e3'"),
    row("train: a learning rate of nan", lambda _: _train_config(["--lr", "nan"]), Inp,
        "lr must be a finite number, got nan"),
    row("train: --out onto a file", lambda _: _train_config(["--out", _a_file()]), Inp,
        "is a file", "the run's folder, a directory"),
    row("train: --export onto a file", lambda _: _train_config(["--export", _a_file()]), Inp,
        "is a file", "exported to, a directory"),
    row("train: grad_accum_steps x micro_batch_size x data_parallel not the global batch",
        lambda _: _train_config(["--grad-accum-steps", "2", "--micro-batch-size", "4",
                                 "--data-parallel", "1"]), Inp, "is a global batch of 8",
        "global_batch_size = 16"),
    # -- documents and tokenizers (issue 44 item 2; tests/data/test_text_data.py has the rest)
    row("train: .jsonl data without a tokenizer", lambda _: _train_config(
        ["--data", _jsonl([{"text": "a b"}])]), Inp, "--tokenizer DIR"),
    row("train: a tokenizer folder that is not there", lambda _: _train_config(
        ["--data", _jsonl([{"text": "a b"}]), "--tokenizer", "/nonexistent/tokenizer"]), Inp,
        "is not a folder", "tokenizer.json"),
    row("an empty document", lambda _: _documents([{"text": "a b"}, {"text": ""}]), Inp,
        "line 2", "empty"),
    row("a document without the text key", lambda _: _documents([{"body": "a b"}]), Inp,
        "no 'text' field", "--text-key"),
    row("data that does not exist", lambda _: list(read_documents("/nonexistent/docs.jsonl")),
        Inp, "does not exist"),
    row("data_loader of a stream with workers", step_after(
        lambda p: p.data_loader(_Stream(), num_workers=2)), Inp, "takes no num_workers"),
    row("train: --eval-every without held-out data",
        lambda _: _train_config(["--eval-every", "50"]), Inp, "needs held-out data",
        "eval_data", "eval_fraction"),
    row("train: held-out data without --eval-every",
        lambda _: _train_config(["--eval-fraction", "0.05"]), Inp, "eval_every = 0",
        "--eval-every N"),
    row("train: --keep-best without validation", lambda _: _train_config(["--keep-best"]),
        Inp, "keep_best keeps", "--eval-every N"),
    row("train: --eval-data and --eval-fraction both", lambda _: _train_config(
        ["--eval-every", "5", "--eval-fraction", "0.1", "--eval-data", _a_file()]), Inp,
        "both name the held-out data", "give one"),
    row("train: --eval-data not a file", lambda _: _train_config(
        ["--eval-every", "5", "--eval-data", "no/such/file.bin"]), Inp, "is not a file"),
]


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(64))


def _jsonl(records: list[Any]) -> str:
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _documents(records: list[Any]) -> list[str]:
    return list(read_documents(_jsonl(records)))


_DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # a crafted file: json.loads would recurse out


def _weights_dir(contents: dict[str, Any]) -> str:
    """A fresh directory holding ``contents``: bytes as they are, dicts of tensors as
    safetensors files."""
    directory = tempfile.mkdtemp()
    for name, value in contents.items():
        if isinstance(value, dict):
            save_file(value, os.path.join(directory, name), metadata={"format": "pt"})
        else:
            with open(os.path.join(directory, name), "wb") as f:
                f.write(value)
    return directory



class DrawsTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn(4, x.shape[0]).T


class BatchDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.zeros(16, 4)) -> torch.Tensor:  # noqa: B008
        return (self.lin(x) + y).sum()


def _deferred_reads_values() -> None:
    with vf.deferred_init(seed=0):
        lin = nn.Linear(4, 4)
        if lin.weight.abs().max() > 0.1:
            pass


def _a_file() -> str:
    fd, path = tempfile.mkstemp()
    os.close(fd)
    return path


def _train_config(argv: list[str]) -> Any:
    from varuna_fx.train.checks import resolve

    return resolve(argv)


def _deferred_empty() -> torch.nn.Module:
    with vf.deferred_init(seed=0):
        model = torch.nn.Module()
        model.left = torch.nn.Parameter(torch.empty(3))
    return model


def _too_big_to_allocate(monkeypatch: pytest.MonkeyPatch) -> None:
    import varuna_fx.init.allocation as allocation

    monkeypatch.setattr(allocation, "available_memory", lambda _: (1024, "a test's limit"))
    with vf.deferred_init(seed=0):
        model = MLP.model.__class__()
    compile_module(model, MLP.inputs, loss_fn=MLP.loss_fn, stages=1).parameters()


def _without_wandb(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(sys.modules, "wandb", None)  # (an import of it fails)
    return step_after(lambda p: vf.Monitor(p, tempfile.mkdtemp(), wandb=True,
                                           tensorboard=False))(None)


def _nested_deferred() -> None:
    with vf.deferred_init(seed=0), vf.deferred_init(seed=1):
        pass


def test_every_row_has_a_unique_name() -> None:
    names = [r.name for r in CATALOGUE]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("entry", CATALOGUE, ids=[r.name for r in CATALOGUE])
def test_error_catalogue(entry: Row, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(vf.VarunaFxError) as caught:
        entry.run(monkeypatch)
    assert isinstance(caught.value, entry.error), repr(caught.value)
    message = str(caught.value)
    for word in entry.words:
        assert word in message, f"{word!r} not in: {message}"
    for word in entry.absent:
        assert word not in message, f"{word!r} should not be in: {message}"


def test_a_forward_parameter_named_target_is_fed_by_steps_target_keyword() -> None:
    """Without a loss_fn, ``pipe.step(x, target=y)`` is the model's own ``target`` input."""
    torch.manual_seed(0)
    model = OwnLoss()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    pipe = compile_module(model, (x, y), stages=2)
    loss = pipe.step(x, target=y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = model(x, y)
    eager.backward()
    torch.testing.assert_close(torch.as_tensor(loss).detach(), eager.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
