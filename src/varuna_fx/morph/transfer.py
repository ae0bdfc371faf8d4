"""Moving state between ranks when the layout changes: only what changed owner, point to point.

State is described per *item*: one tensor of the model (``(fqn, "")``) or one entry of a
parameter's optimizer state (``(fqn, "exp_avg")``, ``(fqn, "step")``, ...), each seen as its
flattened elements. A rank *holds* ranges of items (a whole weight; the chunk of an optimizer
state its ZeRO-1 shard covers) and *needs* ranges in the new layout. :func:`plan_moves` is a pure
function of everyone's holdings and needs (every rank computes the same plan): what a rank
already holds stays where it is; every other needed range comes from a rank that holds it, the
least loaded holder first (the replicas of a stage share the sending, so several send at once); a range nobody holds is
reported missing (the caller then falls back to the latest checkpoint). :func:`run_moves` then
sends, per peer and dtype, one flat buffer of the pieces in plan order, so both ends know every
piece's place without any metadata on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerTimeoutError

Item = tuple[str, str]  # (canonical fqn, "" for the tensor itself or an optimizer-state key)
Range = tuple[int, int]  # (first element, count) of the flattened item


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    item: Item
    start: int
    count: int


@dataclass
class MovePlan:
    moves: list[Move] = field(default_factory=list)
    kept: dict[int, list[tuple[Item, int, int]]] = field(default_factory=dict)  # dst's own data
    missing: list[tuple[int, Item, int, int]] = field(default_factory=list)

    def bytes_moved(self, itemsize: dict[Item, int]) -> int:
        return sum(m.count * itemsize[m.item] for m in self.moves)


def _subtract(want: list[Range], have: Iterable[Range]) -> tuple[list[Range], list[Range]]:
    """(parts of ``want`` covered by ``have``, parts not covered), both as ranges."""
    left = list(want)
    covered: list[Range] = []
    for h0, hn in have:
        h1 = h0 + hn
        nxt = []
        for w0, wn in left:
            w1 = w0 + wn
            lo, hi = max(w0, h0), min(w1, h1)
            if lo >= hi:
                nxt.append((w0, wn))
                continue
            covered.append((lo, hi - lo))
            if w0 < lo:
                nxt.append((w0, lo - w0))
            if hi < w1:
                nxt.append((hi, w1 - hi))
        left = nxt
    return covered, left


def plan_moves(holds: list[dict[Item, list[Range]]],
               needs: list[dict[Item, list[Range]]]) -> MovePlan:
    """Who sends what to whom. ``holds[r]`` / ``needs[r]``: rank r's ranges per item (ranks of
    the transfer group; a rank that leaves needs nothing, one that joins holds nothing)."""
    plan = MovePlan()
    world = len(holds)
    holders: dict[Item, list[int]] = {}
    load: dict[int, int] = {}  # elements each source sends so far
    for r, held in enumerate(holds):
        for item in held:
            holders.setdefault(item, []).append(r)
    for dst in range(world):
        kept = plan.kept.setdefault(dst, [])
        for item in sorted(needs[dst]):
            covered, left = _subtract(needs[dst][item], holds[dst].get(item, []))
            kept += [(item, s, n) for s, n in covered]
            # the other holders, least loaded first: replicas of a stage share the sending
            others = sorted((r for r in holders.get(item, []) if r != dst),
                            key=lambda r: (load.get(r, 0), (r - dst) % world))
            for src in others:
                if not left:
                    break
                got, left = _subtract(left, holds[src][item])
                plan.moves += [Move(src, dst, item, s, n) for s, n in sorted(got)]
                load[src] = load.get(src, 0) + sum(n for _, n in got)
            plan.missing += [(dst, item, s, n) for s, n in left]
    return plan


class Channel:
    """Point-to-point sends and receives over the default group (``group=None``: the new
    generation's) or over a gloo group made outside it (``world/membership.transfer_group``).
    ``device``: where its buffers live (the default group's device under NCCL, else the CPU)."""

    def __init__(self, group: Any, timeout: float, who: str) -> None:
        self.group, self.timeout, self.who = group, timeout, who
        nccl = group is None and dist.is_initialized() and dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        if self.group is None:
            return dist.isend(tensor, dst=dst, tag=tag)
        return self.group.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        if self.group is None:
            return dist.irecv(tensor, src=src, tag=tag)
        return self.group.recv([tensor], src, tag)

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise PeerTimeoutError(f"{self.who} lost a peer while moving state ({what}): "
                                   f"{str(exc).splitlines()[0]}") from exc


def run_moves(plan: MovePlan, me: int, sources: dict[Item, list[tuple[int, torch.Tensor]]],
              dtypes: dict[Item, torch.dtype], channel: Channel
              ) -> dict[Item, list[tuple[int, torch.Tensor]]]:
    """Send this rank's pieces and receive the ones it needs. ``sources[item]``: (first element,
    flat tensor) of what this rank holds. Returns what arrived: (first element, flat tensor)
    per item."""
    out: dict[tuple[int, torch.dtype], list[Move]] = {}
    inc: dict[tuple[int, torch.dtype], list[Move]] = {}
    for m in plan.moves:
        if m.src == me:
            out.setdefault((m.dst, dtypes[m.item]), []).append(m)
        if m.dst == me:
            inc.setdefault((m.src, dtypes[m.item]), []).append(m)
    # one tag per dtype, the same on every rank (from the whole plan, not this rank's moves)
    order = sorted({dtypes[m.item] for m in plan.moves}, key=str)
    works: list[tuple[Any, str]] = []
    for (dst, dtype), moves in sorted(out.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([_piece(sources[m.item], m.start, m.count).to(channel.device)
                          for m in moves])
        works.append((channel.send(flat, dst, order.index(dtype)), f"to rank {dst}"))
    received: dict[Item, list[tuple[int, torch.Tensor]]] = {}
    buffers = []
    for (src, dtype), moves in sorted(inc.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.empty(sum(m.count for m in moves), dtype=dtype, device=channel.device)
        works.append((channel.recv(flat, src, order.index(dtype)), f"from rank {src}"))
        buffers.append((flat, moves))
    for work, what in works:
        channel.wait(work, what)
    for flat, moves in buffers:
        offset = 0
        for m in moves:
            received.setdefault(m.item, []).append((m.start, flat[offset:offset + m.count]))
            offset += m.count
    return received


def _piece(held: list[tuple[int, torch.Tensor]], start: int, count: int) -> torch.Tensor:
    for first, flat in held:
        if first <= start and start + count <= first + flat.numel():
            return flat[start - first:start - first + count]
    raise AssertionError(f"no held range covers elements [{start}, {start + count})")


def assemble(pieces: list[tuple[int, torch.Tensor]], start: int, count: int,
             dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, start + count)`` from pieces that cover them."""
    if len(pieces) == 1 and pieces[0][0] == start and pieces[0][1].numel() == count:
        return pieces[0][1]
    out = torch.empty(count, dtype=dtype)
    for first, flat in pieces:
        lo, hi = max(first, start), min(first + flat.numel(), start + count)
        if lo < hi:
            out[lo - start:hi - start] = flat[lo - first:hi - first]
    return out
