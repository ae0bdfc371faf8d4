"""Floors: lower bounds of a candidate's step, from the cheapest to the tightest: from the model's
totals (every candidate at once), from its partition, from the link queue and from Little's law
over the stash counts. Each is a function of a pricer (``pricing.Pricer``) and a candidate; what
they share across candidates (the totals at a micro-batch size, one round trip's hops) is kept
in the pricer's memo. The search (``search.py``) orders its heap by them; each is proved in its
docstring, and ``tests/planner/test_fast_paths.py`` and ``test_link_queue.py`` check them
against simulated steps.

("Floor" here always means a lower bound of time; "bounds" in the planner are cut positions.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..schedule import ScheduleSpec
from .candidates import Candidate
from .pricing import Pricer


def totals_at(pricer: Pricer, b: int, split: bool = False) -> tuple[float, ...]:
    """(all busy time, busy without recompute, largest unit without recompute, one
    micro-batch's forward + backward, gradient bytes, of the largest unit, the chain
    around the last unit, its busy time) at micro-batch size b. ``split``: for a
    split-backward schedule, whose chains need only the input-gradient part of each
    backward (not known per unit: the chains count forwards only)."""
    memo = pricer.memo.totals
    if (b, split) not in memo:
        u = pricer.balancer(b).units
        plain = u.recompute + u.backward
        chain = np.minimum(u.forward, u.recompute) + (0.0 if split else u.backward)
        # the last stage holds at least the last unit, and all other units' forward and
        # backward of one micro-batch chain around it
        last = float(chain.sum() - chain[-1]), float(plain[-1])
        memo[b, split] = (pricer.balancer(b).total, float(plain.sum()),
                          float(plain.max(initial=0.0)), float(chain.sum()),
                          float(u.grads.sum()), float(u.grads.max(initial=0.0)), *last)
    return memo[b, split]


def hops(pricer: Pricer, b: int, stages: int, replicas: int) -> float:
    """One micro-batch crosses every link forward and back, with at least the smallest
    value any cut sends."""
    if stages == 1:
        return 0.0
    key = (b, stages, replicas)
    memo = pricer.memo.hops
    if key not in memo:
        net = pricer.links(stages, replicas)
        memo[key] = 2 * ((stages - 1) * net.latency
                         + least_cut(pricer, b) * net.inverse_bandwidth)
    return memo[key]


def slowest(pricer: Pricer, stages: int, replicas: int) -> float:
    """Seconds per byte on the slowest pipeline link (0 with one stage)."""
    net = pricer.links(stages, replicas)
    return 1.0 / min(net.bandwidths) if net.bandwidths else 0.0


def least_cut(pricer: Pricer, b: int) -> float:
    """The fewest bytes any cut sends at micro-batch size b."""
    cut = pricer.balancer(b).units.cut[1:-1]
    return float(cut.min()) if len(cut) else 0.0


def split_schedule(pricer: Pricer, c: Candidate) -> ScheduleSpec | None:
    """The split-backward schedule ``c``'s floors must hold for, if any: its own, or
    before a schedule="auto" search branches it, any it weighs."""
    kinds = [pricer.kind(c.schedule)] if c.schedule else pricer.schedules
    return next((k for k in kinds if k.split_backward), None)


def chain_backward(pricer: Pricer, c: Candidate) -> np.ndarray:
    """Each stage's backward as far as the stage upstream waits for it: all of it, or in
    a split-backward schedule only the input-gradient part (``W`` can run later)."""
    plan = c.plan
    assert plan is not None
    split = split_schedule(pricer, c)
    if split is None:
        return np.asarray(plan.backward, dtype=float)
    backward, weight = pricer.backward_costs(plan, split)
    return np.asarray(backward, dtype=float) - np.asarray(weight, dtype=float)


# -- the three keys ----------------------------------------------------------------------------

def from_totals(pricer: Pricer, c: Candidate) -> float:
    """Level 0's key, from the model's totals (any partition of ``c``)."""
    busy, plain, largest, chain, grads, unit_grads, around, last = \
        totals_at(pricer, c.micro_batch_size, split_schedule(pricer, c) is not None)
    p, m = c.stages, c.num_micro_batches
    # the last stage does not recompute: some stage is busy >= (busy - its R) / P
    bottleneck = plain if p == 1 else max(largest, busy / (p + 1))
    hop = hops(pricer, c.micro_batch_size, p, c.data_parallel)
    pipeline = max(m * bottleneck, link_queue(pricer, c),
                   around + hop + m * last if p > 1 else 0.0)
    stage_grads = max(grads / p, unit_grads)
    return pipeline + pricer.links(p, c.data_parallel).allreduce(stage_grads, c.data_parallel)


def all_from_totals(pricer: Pricer, pool: Sequence[Candidate]) -> list[float]:
    """``from_totals`` of every candidate at once: the search starts with 10^4-10^5
    of them, and one at a time this was a sixth of the search. The same operations on the
    same float64 values in the same order (numpy's arithmetic is IEEE's, as Python's), so
    the same bits; only what depends on (P, D) or on b alone is computed per value."""
    if not pool:
        return []
    p = np.array([c.stages for c in pool])
    d = np.array([c.data_parallel for c in pool])
    m = np.array([c.num_micro_batches for c in pool])
    # per micro-batch size: the totals and the smallest cut (hops), gathered by index
    sizes = sorted({c.micro_batch_size for c in pool})
    at = {b: k for k, b in enumerate(sizes)}
    size = np.array([at[c.micro_batch_size] for c in pool])
    split = [split_schedule(pricer, c) is not None for c in pool]
    rows = [totals_at(pricer, b, True) + totals_at(pricer, b, False) for b in sizes]
    totals = np.array(rows)[size]  # [candidate, 16]: the split totals, then the plain
    picked = np.where(np.array(split)[:, None], totals[:, :8], totals[:, 8:])
    busy, plain, largest, chain, grads, unit_grads, around, last = picked.T
    least = np.array([least_cut(pricer, b) for b in sizes])[size]
    # per (P, D): the links
    pairs = sorted({(c.stages, c.data_parallel) for c in pool})
    where = {pair: k for k, pair in enumerate(pairs)}
    pair = np.array([where[c.stages, c.data_parallel] for c in pool])
    nets = [pricer.links(*one) for one in pairs]
    latency, inverse, ar_bw, ar_lat = (np.array(values)[pair] for values in zip(
        *((n.latency, n.inverse_bandwidth, n.allreduce_bandwidth, n.allreduce_latency)
          for n in nets)))
    slow = np.array([slowest(pricer, *one) for one in pairs])[pair]
    bottleneck = np.where(p == 1, plain, np.maximum(largest, busy / (p + 1)))
    hop = np.where(p == 1, 0.0, 2 * ((p - 1) * latency + least * inverse))
    with np.errstate(invalid="ignore"):  # (0 * inf where it is not used)
        queue = np.where((p > 1) & (m > 1), (m - 1) * (least * slow), 0.0)
    pipeline = np.maximum(np.maximum(m * bottleneck, chain + hop + queue),
                          np.where(p > 1, around + hop + m * last, 0.0))
    stage_grads = np.maximum(grads / p, unit_grads)
    ring = 2 * (d - 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # (where no all-reduce runs)
        allreduce = np.where((d <= 1) | (stage_grads <= 0), 0.0,
                             ring / d * stage_grads / ar_bw + ring * ar_lat)
    return (pipeline + allreduce).tolist()


def from_stages(pricer: Pricer, c: Candidate, final: bool = False) -> float:
    """Level 1's key, from ``c``'s partition. ``final``: the partition is taken to be the one
    that will be simulated even where an order might make ``Pricer.finish`` re-partition it
    (see ``Planner.search``: only for rows that are listed, not for the exact ones)."""
    plan = c.plan
    assert plan is not None
    net = pricer.links(c.stages, c.data_parallel)
    busy = plan.compute(pricer.recompute)
    hop = np.asarray([net.latency + nb / bw for nb, bw in zip(plan.send_bytes,
                                                              net.bandwidths)])
    m = c.num_micro_batches
    fill = np.concatenate([[0.0], np.cumsum(plan.sim_forward(pricer.recompute)[:-1] + hop)])
    back = chain_backward(pricer, c)
    drain = np.concatenate([[0.0], np.cumsum(back[:-1] + hop)])
    # stage s starts after the forwards upstream, and after its last backward the
    # gradient runs back upstream; a split backward's W (busy - back) may overlap that
    later = np.maximum(m * busy, m * (busy - (plan.backward - back)) + drain) \
        if split_schedule(pricer, c) else m * busy + drain
    pipeline = max(float(np.max(fill + later)), link_queue(pricer, c),
                   plan_queue(pricer, c, hop, back, final))
    return pipeline + pricer.allreduce(c)


def plan_queue(pricer: Pricer, c: Candidate, hop: np.ndarray, back: np.ndarray,
               final: bool = False) -> float:
    """``link_queue`` with this partition's own bytes on each link, where the partition
    is the one that will be simulated (``final``, or ``is_final``: it fits holding the
    most micro-batches any order can hold, so no order makes ``Pricer.finish`` re-partition
    it); the same proof, each term now this partition's own. (The
    balancer prices every cut at the intra-node bandwidth, so a partition may send a
    large activation over a slow link: 72 MiB at 1 Gbit/s is 0.6 s per message, and
    those candidates' orders were most of a memory-tight search on a slow link.) 0
    where it may be re-partitioned. Kept a hair (1e-12 relative) below the sum, so that
    summation order never lifts it above the simulated step."""
    plan = c.plan
    assert plan is not None
    p, m = c.stages, c.num_micro_batches
    if p == 1 or m == 1 or not (final or is_final(pricer, c)):
        return 0.0
    net = pricer.links(p, c.data_parallel)
    wire = max(nb / bw for nb, bw in zip(plan.send_bytes, net.bandwidths))
    trip = float(plan.sim_forward(pricer.recompute).sum() + back.sum() + 2 * hop.sum())
    return (trip + (m - 1) * wire) * (1 - 1e-12)


def is_final(pricer: Pricer, c: Candidate) -> bool:
    """Whether ``c``'s partition fits holding the most micro-batches any order of its
    schedule can hold (``most_held``), so that no order makes ``Pricer.finish`` re-partition
    it (a stage's peak grows with its stash count where its bytes are nonnegative)."""
    plan = c.plan
    assert plan is not None
    if np.any(plan.input_bytes < 0) or np.any(plan.activations < 0):
        return False
    most = plan.memory(most_held(pricer, c), pricer.recompute)
    return bool(np.all(most <= pricer.memory_cap))


def most_held(pricer: Pricer, c: Candidate) -> list[int]:
    """Per stage, the most micro-batches an order of ``c``'s schedule can hold at once:
    m (no more exist), except on the last stage of Varuna's order, which holds one: its
    B is ready as its F ends and B goes before F (a split backward holds a micro-batch
    until its W, which may wait); a cost-free order's own counts where the pricer has made
    it already (not made for this: most candidates never need it). Before a
    schedule="auto" search branches ``c``: the most of any."""
    p, m = c.stages, c.num_micro_batches
    kinds = [pricer.kind(c.schedule)] if c.schedule else pricer.schedules
    made = pricer.memo.schedules
    most = [1] * p
    for kind in kinds:
        if p > 1 and not kind.cost_aware and (kind.name, p, m) in made:
            counts = made[kind.name, p, m][1]
        elif p > 1 and kind.varuna_stash:
            counts = [m] * (p - 1) + [1]
        else:
            counts = [m] * p
        most = [max(a, b) for a, b in zip(most, counts)]
    return most


def link_queue(pricer: Pricer, c: Candidate) -> float:
    """One micro-batch's round trip through every stage and link, and the other m - 1
    queued on the slowest link: a lower bound of the pipeline part of any partition of
    ``c`` (the search may re-partition a candidate for memory after bounding it, so this
    must not depend on which cuts the partition picked).

    Why: a link carries one message at a time each way (``simulate``: the next waits
    until the previous one's bytes have crossed, ``bytes / bandwidth``; the latency
    overlaps), so on link s the m forward messages take at least ``m * wire_s`` from
    the first one's start to the last one's arrival. The first starts at the earliest
    when one micro-batch's forwards up to stage s and the links between are done; the
    last one's micro-batch then still runs its forwards after stage s, every backward
    (the part the stage upstream waits for) and crosses every link back. So a step
    lasts at least one round trip plus ``(m - 1) * wire_s`` (the backward direction
    gives the same sum). The round trip is at least ``chain + hops`` of
    ``totals_at`` and ``hops``; ``wire_s`` is at least the fewest bytes any cut
    sends over the slowest link's bandwidth. Slow links make this the binding floor of
    deep pipelines with many micro-batches, for which orders of 10^5 tasks were
    otherwise made (bench/RESULTS.md, "Figures the code cites")."""
    b, p, m = c.micro_batch_size, c.stages, c.num_micro_batches
    chain = totals_at(pricer, b, split_schedule(pricer, c) is not None)[3]
    trip = hops(pricer, b, p, c.data_parallel)
    queue = (m - 1) * (least_cut(pricer, b) * slowest(pricer, p, c.data_parallel)) \
        if p > 1 and m > 1 else 0.0
    return chain + trip + queue


def from_stash(pricer: Pricer, c: Candidate, counts: list[int]) -> float:
    """Little's law: stage s holds at most counts[s] micro-batches, each for at least the
    round trip from its forward to its backward, so a step lasts >= m * trip / count."""
    plan = c.plan
    assert plan is not None
    net = pricer.links(c.stages, c.data_parallel)
    hop = [net.latency + nb / bw for nb, bw in zip(plan.send_bytes, net.bandwidths)]
    work = plan.sim_forward(pricer.recompute) + chain_backward(pricer, c)
    trip = np.cumsum((work + 2 * np.asarray([*hop, 0.0]))[::-1])[::-1]
    pipeline = float(np.max(c.num_micro_batches * trip / np.maximum(counts, 1)))
    return pipeline + pricer.allreduce(c)
