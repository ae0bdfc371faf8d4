"""What the passes write into ``node.meta["varuna"]`` and what the stages exchange.

Every cost is a function of the micro-batch size ``b``. Per-node costs are affine in ``b``
(``const + per_sample * b``): :class:`Affine` keeps the two numbers for fast numeric use and
gives the sympy expression on demand, so a planner can ask the cost of any micro-batch size
without re-tracing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

b = sympy.Symbol("b", positive=True, integer=True)  # the micro-batch size


@dataclass(frozen=True)
class Affine:
    """``const + per_sample * b`` -- exact for anything whose size is linear in the batch."""

    const: float = 0.0
    per_sample: float = 0.0

    @classmethod
    def fit(cls, b1: int, v1: float, b2: int, v2: float) -> Affine:
        slope = (v2 - v1) / (b2 - b1)
        return cls(v1 - slope * b1, slope)

    def __call__(self, batch: float) -> float:
        return self.const + self.per_sample * batch

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.const + other.const, self.per_sample + other.per_sample)

    def scale(self, factor: float) -> Affine:
        return Affine(self.const * factor, self.per_sample * factor)

    @property
    def expr(self) -> sympy.Expr:
        return sympy.nsimplify(self.const) + sympy.nsimplify(self.per_sample) * b


ZERO = Affine()


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[sympy.Expr, ...]  # symbolic in b
    dtype: torch.dtype

    def numel(self, batch: int) -> int:
        n = 1
        for dim in self.shape:
            n *= int(dim.subs(b, batch)) if isinstance(dim, sympy.Expr) else int(dim)
        return n

    def concrete_shape(self, batch: int) -> tuple[int, ...]:
        return tuple(int(d.subs(b, batch)) if isinstance(d, sympy.Expr) else int(d)
                     for d in self.shape)

    def __str__(self) -> str:
        return f"{dtype_abbr(self.dtype)}[{', '.join(str(d) for d in self.shape)}]"


def dtype_abbr(dtype: torch.dtype) -> str:
    return {
        torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
        torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8",
    }.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class NodeInfo:
    """Everything the passes know about one node."""

    # annotate_shapes
    outputs: list[TensorInfo] = field(default_factory=list)  # tensor leaves of the value
    is_tensor: bool = True  # the value is one tensor (what may cross a stage boundary)
    out_bytes: Affine = ZERO  # bytes of the value produced
    in_bytes: Affine = ZERO  # bytes of the tensors read (for a memory-bound time estimate)
    matmul_flops: Affine = ZERO  # counted by torch's FlopCounterMode (matmul, conv, attention)
    elementwise_flops: Affine = ZERO  # one per output element for everything else
    random: bool = False  # dropout & co: the RNG state must be replayed on recompute
    # per random op the node runs (inactive ones too): whether it draws per sample (ir/rng.py)
    random_draws: tuple[bool, ...] = ()
    # a draw whose values change with the layout (its batch is not dim 0): its shape, or ""
    random_layout: str = ""
    mutates: bool = False  # writes into an input or module state (capture/mutations.py)
    # capture: the buffer this write stores the tensor forward rebinds it to (`self.ema = ...`)
    rebinds: str = ""
    # mark_sample_mixing: why micro-batching changes this node's result ("" if it does not)
    mixes_samples: str = ""
    # annotate_backward
    fwd_flops: Affine = ZERO
    bwd_flops: Affine = ZERO
    params: dict[str, int] = field(default_factory=dict)  # canonical FQN -> bytes, read here

    @property
    def param_bytes(self) -> int:
        return sum(self.params.values())
    # partition
    replicable: bool = False  # cheap and input/constant-derived: copied into each stage using it
    stage: int | None = None  # the stage that computes it (None for replicable nodes)
    source: str = ""  # "file:line" of the model code, when known
    module_path: str = ""  # FQN of the innermost module the node came from

    @property
    def flops(self) -> Affine:
        return self.fwd_flops + self.bwd_flops


def copy_info(meta: NodeInfo) -> NodeInfo:
    """An independent copy: a pass writing into a copied node's annotations (its stage, ...)
    must not change the node it was copied from, which another pipeline may hold."""
    return replace(meta, outputs=list(meta.outputs), params=dict(meta.params))


def copied_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``node.meta`` for a copy of the node: its own NodeInfo (fx's node_copy shares it)."""
    out = dict(meta)
    if isinstance(out.get("varuna"), NodeInfo):
        out["varuna"] = copy_info(out["varuna"])
    return out


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over the same modules and parameters whose nodes carry copies of the
    annotations: the passes of one compile annotate it without touching the cached graph
    that other pipelines hold."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # export's graphs bind inputs with pytree codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = copied_meta(node.meta)
    # its Python is made only if something reads or runs it (_LazyGraphModule): a compile's
    # later passes read the graph (on the 70B Llama the code of 13k nodes cost ~0.4 s)
    copy = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


def info(node: Any) -> NodeInfo:
    """The node's annotations, created on first use."""
    meta = node.meta.get("varuna")
    if meta is None:
        meta = node.meta["varuna"] = NodeInfo()
    return meta


@dataclass(frozen=True)
class Transfer:
    """A value computed on stage ``src`` and used on stage ``dst``."""

    name: str  # the producing node's name; also the placeholder name on ``dst``
    src: int
    dst: int
    tensor: TensorInfo
    nbytes: Affine
    requires_grad: bool  # a gradient flows back from dst to src (static: from the graph)


@dataclass
class StageSpec:
    """The interface of one stage: what it reads, receives, sends and returns."""

    index: int
    inputs: list[str]  # model inputs it reads (every stage has the batch)
    recvs: list[Transfer]
    sends: list[Transfer]
    outputs: list[int]  # indices of the model's output leaves it returns (last stage)
    nodes: list[str]  # names of the captured-graph nodes it computes
    parameter_names: list[str]  # canonical FQNs of the parameters it holds
    buffer_names: list[str] = field(default_factory=list)  # ... and of its buffers

    @property
    def send_names(self) -> list[str]:
        return sorted({t.name for t in self.sends}, key=[t.name for t in self.sends].index)
