"""assign_stages: turn the annotated graph into cost arrays, partition, record each node's stage.

The partitioner (``partition.py``) sees only arrays; this pass is the bridge. Positions are the
non-replicable compute nodes in graph (topological) order. A value produced at position ``p``
and last used at ``q`` (the output node counts as position N, on the last stage) crosses every
cut between them; a value that is not a single tensor (a tuple, an int computed from an
activation) may not cross, so those cuts are forbidden. Nor may a buffer written in place cross
before its next in-place write (``self.ema.mul_(0.9).add_(v)``): the receiving stage would
write a copy it received, never the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx
from torch import nn

from ..capture.buffers import written_buffers
from ..capture.mutations import after_write, view_write_chain
from ..costs.memory import WEIGHT_COPIES, SharedWeight, held_copies
from ..costs.roofline import DeviceSpec, NodeTimes, step_time
from ..ir.nodes import info
from .partition import Partition, PartitionProblem, partition


@dataclass(frozen=True)
class CostSetting:
    micro_batch_size: int
    device: DeviceSpec
    bandwidth: float  # bytes/s between neighbouring stages
    memory_cap: float  # bytes per device
    # micro-batches each stage stashes at once: one count for all, or the schedule's per stage
    stash_counts: int | tuple[int, ...]
    recompute: bool | str  # True | False | "auto": per stage, only where it must (partition)
    # Measured costs (a planner profile) replacing the FLOP-based estimates when given.
    node_times: NodeTimes | None = None
    # replicas the optimizer state is split over (ZeRO-1): 1 = unsharded
    optimizer_shards: int = 1
    # per boundary (P - 1), the bandwidth each stage's send is priced at, where the links
    # differ (a slow link between nodes; planner/slow_links.py); None: ``bandwidth``
    bandwidths: tuple[float, ...] | None = None


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output") and not info(n).replicable]


def params_read(node: fx.Node) -> dict[str, int]:
    """Parameters/buffers a node reads itself or through replicable inputs (get_attr, views)."""
    found: dict[str, int] = {}
    todo = [node]
    while todo:
        current = todo.pop()
        meta = info(current)
        found.update(meta.params)
        todo.extend(i for i in current.all_input_nodes if info(i).replicable)
    return found


def canonical_parameters(gm: fx.GraphModule) -> dict[str, nn.Parameter]:
    """``gm``'s parameters under every name the annotations (``NodeInfo.params``) use.

    fx keeps a tied weight under each of its model names; torch.export keeps it once, under
    whichever name it met (``lm_head.weight`` of HF GPT-2), while the annotations use the
    canonical (first) one (``transformer.wte.weight``): a get_attr node says which it is."""
    found = dict(gm.named_parameters(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in found:
            for name in info(node).params:
                found.setdefault(name, found[str(node.target)])
    return found


def trainable_names(gm: fx.GraphModule) -> set[str]:
    """Parameters with gradients: they carry WEIGHT_COPIES; buffers and frozen weights one.
    Canonical names included, so a tied weight torch.export keeps under its other name is
    still trainable (else it was priced as a buffer: no gradient, no optimizer state, no
    all-reduce)."""
    return {name for name, p in canonical_parameters(gm).items() if p.requires_grad}


def partition_problem(gm: fx.GraphModule, setting: CostSetting) -> PartitionProblem:
    nodes = compute_nodes(gm)
    n = len(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    b = setting.micro_batch_size
    def times(recompute: bool) -> np.ndarray:
        if setting.node_times is not None:
            return np.asarray(setting.node_times.step_times(nodes, b, recompute), float)
        return np.array([step_time(info(x), b, setting.device, recompute) for x in nodes])

    compute = times(bool(setting.recompute))
    # the last stage never recomputes: its forward is followed directly by its backward
    last_compute = times(False) if setting.recompute else None
    weights = np.zeros(n)
    grads = np.zeros(n)  # what data parallelism all-reduces
    seen: set[str] = set()
    trainable = trainable_names(gm)
    copies = held_copies(setting.optimizer_shards)
    reads = [params_read(node) for node in nodes]  # (walked once: ~10^5 nodes at 70B)
    for i, read in enumerate(reads):  # a weight counts where it is first read
        for name, nbytes in read.items():
            if name not in seen:
                seen.add(name)
                weights[i] += (copies if name in trainable else 1) * nbytes
                grads[i] += nbytes if name in trainable else 0
    # the largest single activation of a stage: its gradient is the backward's workspace
    workspace = np.array([
        info(x).out_bytes(b) if (info(x).fwd_flops(b) > 0) else 0.0 for x in nodes
    ])
    if setting.node_times is not None:
        activations = np.asarray(setting.node_times.activation_bytes(nodes, b), float)
    else:
        activations = workspace.copy()  # estimated: every computed output is kept
    crossing = np.zeros(n + 2)
    forbidden = np.zeros(n + 2)
    for node in nodes:
        p = position[node]
        last = max((position.get(u, n) if u.op != "output" else n) for u in node.users) \
            if node.users else p
        if last <= p:
            continue
        # crosses cuts p+1 .. last
        if info(node).is_tensor:
            crossing[p + 1] += info(node).out_bytes(b)
            crossing[last + 1] -= info(node).out_bytes(b)
        else:
            forbidden[p + 1] += 1
            forbidden[last + 1] -= 1
        if written_buffers(node):
            rewrites = [position[u] for u in node.users if u in position and info(u).mutates
                        and u.args and u.args[0] is node]
            if rewrites:
                forbidden[p + 1] += 1
                forbidden[max(rewrites) + 1] -= 1
    for node in nodes:  # a write into a view, with the views and the reads after it
        chain = view_write_chain(node) if info(node).mutates else []
        if len(chain) > 2 and chain[-1].op != "get_attr":
            held = [*chain[:-1], *(u for u in node.users if u.target is after_write)]
            at = [position[x] for x in held if x in position]
            forbidden[min(at) + 1] += 1
            forbidden[max(at) + 1] -= 1
    spans = written_buffer_spans(nodes, position, reads)
    for first, last in spans.values():
        forbidden[first + 1] += 1
        forbidden[last + 1] -= 1
    cut = np.cumsum(crossing)[: n + 1]
    cut[np.cumsum(forbidden)[: n + 1] > 0] = np.inf
    cut[0] = cut[n] = 0.0
    return PartitionProblem(
        compute=compute, weight_bytes=weights, activation_bytes=activations, cut_bytes=cut,
        bandwidth=setting.bandwidth, bandwidths=setting.bandwidths,
        memory_cap=setting.memory_cap,
        stash_counts=setting.stash_counts, recompute=setting.recompute,
        last_stage_compute=last_compute, workspace_bytes=workspace,
        shared=shared_weights(nodes, trainable, copies, reads), written_spans=spans,
        grad_bytes=grads,
    )


def written_buffer_spans(nodes: list[fx.Node], position: dict[fx.Node, int],
                         reads: list[dict[str, int]] | None = None
                         ) -> dict[str, tuple[int, int]]:
    """(first, last) position of the nodes reading or writing each buffer the graph writes.
    Every stage reading a buffer holds its own copy on its rank, so a buffer written on one
    stage and read on another would be read stale from the next step on: one stage does all."""
    written = {b for node in nodes for b in written_buffers(node)}
    spans: dict[str, tuple[int, int]] = {}
    if not written:
        return spans
    reads = reads or [params_read(node) for node in nodes]
    for node, read in zip(nodes, reads):
        for name in [*written_buffers(node), *(b for b in read if b in written)]:
            p = position[node]
            first, last = spans.get(name, (p, p))
            spans[name] = (min(first, p), max(last, p))
    return spans


def shared_weights(nodes: list[fx.Node], trainable: set[str],
                   copies: float = WEIGHT_COPIES,
                   reads: list[dict[str, int]] | None = None) -> tuple[SharedWeight, ...]:
    """Weights read by several compute nodes (tied embeddings): each stage reading one holds a
    copy, which the first-read accounting of ``weight_bytes`` does not see."""
    readers: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for i, read in enumerate(reads or [params_read(node) for node in nodes]):
        for name, nbytes in read.items():
            readers.setdefault(name, []).append(i)
            sizes[name] = nbytes
    return tuple(
        SharedWeight(float((copies if name in trainable else 1) * sizes[name]),
                     float(sizes[name]) if name in trainable else 0.0, np.array(sorted(set(at))))
        for name, at in readers.items() if len(set(at)) > 1)


def assign_stages(gm: fx.GraphModule, num_stages: int, setting: CostSetting) -> Partition:
    result = partition(partition_problem(gm, setting), num_stages)
    record_stages(gm, result)
    return result


def record_stages(gm: fx.GraphModule, result: Partition) -> None:
    """Write each compute node's stage into its annotations."""
    for i, node in enumerate(compute_nodes(gm)):
        info(node).stage = result.stage_of(i)
