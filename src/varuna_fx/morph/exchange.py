"""One morph's exchange: every process's descriptor through the store, then the moves.

Each process of the transfer group (the new members and those leaving) writes what it holds and
needs (``state.Descriptor``) under the generation's key and reads everyone's; all compute the
same plan (``runtime/transfer.plan_moves``) and send and receive their pieces over the transfer
group. What this process already held and needs again is handed back with what arrived (the
weights it keeps are in place already and are left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..world.membership import Generation, Membership
from .records import MorphRecord
from .state import Descriptor, Info, Sources, expand_needs, merged_info
from .transfer import Channel, Item, MovePlan, plan_moves, run_moves


@dataclass
class Exchanged:
    plan: MovePlan
    got: Sources  # what arrived and what this process keeps, per item
    info: dict[Item, Info]
    # a vanished process held the only copy of its ZeRO-1 shard (its optimizer state is lost)
    lost_shard: bool


def exchange(m: Membership, gen: Generation, desc: Descriptor, sources: Sources,
             rec: MorphRecord) -> Exchanged:
    me = gen.transfer.index(m.member)
    m.put(gen.number, f"desc/{me}", desc.to_bytes())
    every = [desc if r == me else Descriptor.from_bytes(
        m.get(gen.number, f"desc/{r}", f"process {r}'s state description"))
        for r in range(len(gen.transfer))]
    needs = [expand_needs(d, every) for d in every]
    plan = plan_moves([d.holds for d in every], needs)
    info = merged_info(every)
    group = m.transfer_group(gen)
    channel = Channel(group, m.timeout, f"process {me} of generation {gen.number}")
    got = run_moves(plan, me, sources, {i: v.dtype for i, v in info.items()}, channel)
    itemsize = {i: v.dtype.itemsize for i, v in info.items()}
    rec.bytes_moved = plan.bytes_moved(itemsize)
    rec.bytes_received = sum(mv.count * itemsize[mv.item] for mv in plan.moves if mv.dst == me)
    for item, start, count in plan.kept.get(me, []):
        if item[1] == "":  # a weight this process keeps is in place already
            continue
        for first, flat in sources.get(item, []):
            if first <= start and start + count <= first + flat.numel():
                got.setdefault(item, []).append(
                    (start, flat[start - first:start - first + count]))
                break
    del group, channel  # the transfer group's sockets close with it
    rec.phase("transfer")
    return Exchanged(plan, got, info, bool(gen.lost) and any(d.sharded for d in every))
