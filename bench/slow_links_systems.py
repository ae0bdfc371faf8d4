"""The model and the three systems of bench_slow_links.py, on one rank each.

The model is the benchmarks' GPT with a heavy (untied, large-vocabulary) head, written as a flat
list of layers -- embedding, blocks, head -- because DeepSpeed's PipelineModule takes a flat
``LayerSpec`` list: ``gpt_layers`` builds the ``nn.Sequential`` that varuna_fx and
torch.distributed.pipelining get, ``gpt_specs`` the same layers as LayerSpecs, and every system
loads the same initial weights (seed 0) by layer index. A step is forward + backward of one
global batch and an AdamW step, no gradient clipping, fp32, everywhere.

Rank layout for pipelining and DeepSpeed: rank = stage * D + replica (DeepSpeed's own
``PipeDataParallelTopology``); varuna_fx places ranks itself (``pipe.stage_index``,
``pipe.replica_index``). Every rank is a node of its own, so all layouts see the same links.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from slow_links_parts import boundary_payload, parse_setting, pipeline_bytes, sync_bytes
from torch import nn

from varuna_fx.examples import Block, GPTConfig, lm_loss


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _init(module: nn.Module) -> None:
    """GPT-2's initialisation (varuna_fx.examples.GPT's): N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> nn.Sequential:
    """Embed, ``n_layer`` Blocks, Head: layer i of the Sequential is LayerSpec i of DeepSpeed."""
    torch.manual_seed(seed)
    model = nn.Sequential(Embed(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg))
    model.apply(_init)
    return model


def gpt_specs(cfg: GPTConfig) -> list[Any]:
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(Embed, cfg), *(LayerSpec(Block, cfg) for _ in range(cfg.n_layer)),
            LayerSpec(Head, cfg)]


@dataclass
class Trainer:
    """One rank's training step and what the report says about it."""

    step: Callable[[torch.Tensor, torch.Tensor], float | None]  # global batch -> loss or None
    note: str                                                   # layout, split, settings
    stage: int
    replica: int
    formula: float | None = None     # payload bytes per step, all ranks (None: unknown)
    formula_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def shard(t: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    n = t.shape[0] // replicas
    return t[replica * n:(replica + 1) * n]


def stage_shapes(modules: list[nn.Module]) -> list[list[list[int]]]:
    return [[list(p.shape) for p in m.parameters()] for m in modules]


def even_cuts(n_layer: int, stages: int) -> list[int]:
    """Sequential indices where stages start: the blocks split evenly (the embedding with the
    first stage, the head with the last), as a user splitting "at the middle block" would."""
    return [0, *(1 + round(s * n_layer / stages) for s in range(1, stages)), n_layer + 2]


def formula_for(cfg: GPTConfig, job: dict, compression: str, sync: str, sharded: bool,
                stage_modules: list[nn.Module]) -> tuple[float | None, str]:
    mb = job["batch"] // job["replicas"] // job["micro_batches"]
    P, D, m = job["stages"], job["replicas"], job["micro_batches"]
    cut = boundary_payload([mb, cfg.block_size, cfg.n_embd], compression)
    sync_b = sync_bytes(stage_shapes(stage_modules), D, sync, sharded)
    if cut is None or sync_b is None:
        return None, f"compression={compression}, sync={sync}: decided by the plan"
    pipe_b = pipeline_bytes([cut] * (P - 1), m, D)
    return pipe_b + sync_b, (f"pipeline {pipe_b / 2**20:.2f} MiB (2 x m={m} x D={D} x "
                             f"{P - 1} cut(s) of {cut / 2**10:.0f} KiB) + sync "
                             f"{sync_b / 2**20:.2f} MiB ({sync}{', ZeRO-1 on gloo' if sharded else ''})")


# -- varuna_fx ----------------------------------------------------------------------------------


def sync_label(setting: Any) -> str:
    """A replica sync as the byte formula names it: "exact", "bf16", "powersgd:R",
    "diloco:H" (``slow_links_parts.sync_bytes``)."""
    if isinstance(setting, str):
        return setting
    if hasattr(setting, "rank"):
        return f"powersgd:{setting.rank}"
    return f"diloco:{getattr(setting, 'every', '')}"


def varuna(job: dict, cfg: GPTConfig, example: torch.Tensor) -> Trainer:
    import varuna_fx as vf

    settings = parse_setting(job["setting"], vf)
    options: dict[str, Any] = dict(stages=job["stages"], data_parallel=job["replicas"],
                                   micro_batch_size=job["batch"] // job["replicas"]
                                   // job["micro_batches"])
    options.update(settings)
    model = gpt_layers(cfg, job["seed"])
    pipe = vf.compile(model, example_inputs=(example,), loss_fn=lm_loss,
                      global_batch_size=job["batch"], **options)
    opt = pipe.optimizer(torch.optim.AdamW, lr=job["lr"])
    plan = pipe.plan

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        xs, ys = pipe.shard((x, y))
        pipe.zero_grad()
        loss = pipe.step(xs, target=ys)
        pipe.optimizer_step(opt)
        return float(loss)

    schedule = getattr(plan.schedule, "name", plan.schedule)
    recompute = plan.recompute if isinstance(plan.recompute, bool) else \
        "".join("R" if r else "-" for r in plan.recompute)
    from varuna_fx.runtime.sync.zero import layout_of

    sharded = layout_of(opt) is not None  # ZeRO-1 as it runs
    # what the plan resolved ("auto" included): per boundary the bytes it sends as its
    # compression has them (the plan's own per-boundary rows, int8's scales counted), per
    # stage its replica sync
    boundaries = getattr(plan, "boundaries", ())
    compression = ",".join(b.compression for b in boundaries) or \
        str(settings.get("compression", "off"))
    syncs = [sync_label(s) for s in getattr(plan, "replica_sync", ())] or \
        [sync_label(settings.get("replica_sync", "exact"))] * plan.stages
    sync_name = syncs[0] if len(set(syncs)) == 1 else "/".join(syncs)
    per = boundary_payload([1, 1], compression) if not boundaries else 4.0
    formula = note = None
    if per is not None and plan.stages == job["stages"] and plan.data_parallel == job["replicas"]:
        scaled = [b.wire_bytes for b in boundaries] if boundaries else \
            [s.boundary_bytes * per / 4 for s in plan.stage_costs[:-1]]
        pipe_b = pipeline_bytes(scaled, plan.num_micro_batches, plan.data_parallel)
        if dist.is_initialized():  # each rank holds its own stage's parameters
            mine = [list(p.shape) for _, p in pipe.named_parameters()]
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (pipe.stage_index, pipe.replica_index, mine))
            per_stage = [s for (_, rep, s) in sorted(gathered, key=lambda g: g[:2]) if rep == 0]
        else:  # one process holds every stage
            per_stage = stage_shapes([s.module for s in pipe.stages])
        parts = [sync_bytes([shapes], plan.data_parallel, name, sharded)
                 for shapes, name in zip(per_stage, syncs)]
        sync_b = None if None in parts else sum(p for p in parts if p is not None)
        if sync_b is not None:
            formula = pipe_b + sync_b
            note = (f"pipeline {pipe_b / 2**20:.2f} MiB (2 x m={plan.num_micro_batches} x "
                    f"D={plan.data_parallel} x cuts {[round(c / 2**10) for c in scaled]} KiB) "
                    f"+ sync {sync_b / 2**20:.2f} MiB ({sync_name}"
                    f"{', ZeRO-1 all-gather' if sharded else ''})")
    settings_note = f" compression={compression} sync={sync_name}" \
        if any(c != "off" for c in compression.split(",")) or sync_name != "exact" else ""
    return Trainer(step, f"P={plan.stages} D={plan.data_parallel} b={plan.micro_batch_size} "
                         f"m={plan.num_micro_batches} {schedule} recompute={recompute}"
                         f"{' ZeRO-1' if sharded else ''}{settings_note}",
                   pipe.stage_index, pipe.replica_index, formula,
                   note or "the formula does not know this setting",
                   extra={"predicted_step_s": plan.predicted_step_time})


# -- torch.distributed.pipelining -----------------------------------------------------------------


def pipelining(job: dict, cfg: GPTConfig, kind: str) -> Trainer:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    P, D, m = job["stages"], job["replicas"], job["micro_batches"]
    rank = dist.get_rank()
    stage_index, replica = divmod(rank, D)
    # every rank creates every group, in the same order (new_group's contract)
    pp = [dist.new_group([s * D + r for s in range(P)]) for r in range(D)]
    dp = [dist.new_group([s * D + r for r in range(D)]) for s in range(P)]
    model = gpt_layers(cfg, job["seed"])
    cuts = even_cuts(cfg.n_layer, P)
    parts = [model[a:b] for a, b in zip(cuts, cuts[1:])]
    submod = parts[stage_index]
    stage = PipelineStage(submod, stage_index, P, torch.device("cpu"), group=pp[replica])
    cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=m, loss_fn=lm_loss)
    params = list(submod.parameters())
    opt = torch.optim.AdamW(params, lr=job["lr"])

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        xs, ys = shard(x, replica, D), shard(y, replica, D)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if stage_index == 0 and P > 1:
            sched.step(xs)
        elif stage_index == P - 1:
            sched.step(*((xs,) if P == 1 else ()), target=ys, losses=losses)
        else:
            sched.step()
        if D > 1:  # what DDP does once per step: one flat all-reduce of the stage's gradients
            grads = [p.grad for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=dp[stage_index])
            flat /= D
            for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(r)
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    formula, note = formula_for(cfg, job, "off", "exact", False, parts)
    names = [type(layer).__name__ for layer in model]
    return Trainer(step, f"P={P} D={D} m={m} Schedule{'1F1B' if kind == '1f1b' else 'GPipe'}, "
                         f"stage {stage_index}: layers {cuts[stage_index]}-"
                         f"{cuts[stage_index + 1] - 1} ({names[cuts[stage_index]]}..)"
                         f"{', grads all-reduced flat' if D > 1 else ''}",
                   stage_index, replica, formula, note)


# -- DeepSpeed PipelineModule -------------------------------------------------------------------


def deepspeed_pipe(job: dict, cfg: GPTConfig) -> Trainer:
    import logging

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already there
    P, D, m = job["stages"], job["replicas"], job["micro_batches"]
    mb = job["batch"] // D // m
    method = job.get("ds_partition", "parameters")
    net = PipelineModule(layers=gpt_specs(cfg), num_stages=P, loss_fn=lm_loss,
                         partition_method=method)
    reference = gpt_layers(cfg, job["seed"]).state_dict()  # layer i <-> LayerSpec i
    mine = net.state_dict()
    net.load_state_dict({k: reference[k] for k in mine})
    opt = torch.optim.AdamW(net.parameters(), lr=job["lr"])  # its FusedAdam needs CUDA
    config = {"train_batch_size": job["batch"], "train_micro_batch_size_per_gpu": mb,
              "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "wall_clock_breakdown": False,
              # its default clips the gradient norm at 1.0: the other systems do not clip
              "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    replica = engine.grid.get_data_parallel_id()
    stage_index = engine.stage_id

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        xs, ys = shard(x, replica, D), shard(y, replica, D)
        chunks = iter(list(zip(xs.split(mb), ys.split(mb))))
        return float(engine.train_batch(data_iter=chunks))

    parts = [int(p) for p in net.parts]  # stage s holds layers parts[s]..parts[s+1]-1
    full = gpt_layers(cfg, job["seed"])
    modules = [full[a:b] for a, b in zip(parts, parts[1:])]
    formula, note = formula_for(cfg, job, "off", "exact", False, modules)
    return Trainer(step, f"P={P} D={D} m={m} PipelineModule 1F1B (TrainSchedule), "
                         f"partition_method={method}: stage starts {parts[:-1]}",
                   stage_index, replica, formula, note)


def build(job: dict, cfg: GPTConfig, example: torch.Tensor) -> Trainer:
    system = job["system"]
    if system == "varuna_fx":
        return varuna(job, cfg, example)
    if system in ("pipelining-1f1b", "pipelining-gpipe"):
        return pipelining(job, cfg, system.split("-")[1])
    if system == "deepspeed":
        return deepspeed_pipe(job, cfg)
    raise ValueError(f"unknown system {system!r}")
