"""The pure parts of in-place morphing, in one process: who sends what to whom, what a new
ZeRO-1 shard will hold, the records in the store, the options a new world plans with, and the
data loader's share of a step on another layout, and the refusal of an optimizer a morph could
not move, and of a replica sync whose state a morph would not carry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.data.loader import GlobalBatchLoader
from varuna_fx.errors import OptimizerError
from varuna_fx.morph.batch import MorphableData, rebuilt, sample_tensors
from varuna_fx.morph.state import INPUT, Descriptor, Info, expand_needs, input_holdings
from varuna_fx.morph.transfer import Move, plan_moves
from varuna_fx.options import CompileOptions, fit_to_world
from varuna_fx.runtime.sync.zero import build_layout, guard_direct_optimizers, shard_ranges
from varuna_fx.world.membership import Generation

W = ("w", "")


def test_what_a_rank_holds_stays_and_the_rest_comes_from_its_holders() -> None:
    # rank 0 keeps its weight; rank 2 (new) needs it and gets it from a holder; the replicas
    # 0 and 1 take turns as sources for different destinations
    holds = [{W: [(0, 10)]}, {W: [(0, 10)]}, {}, {}]
    needs = [{W: [(0, 10)]}, {}, {W: [(0, 10)]}, {W: [(0, 10)]}]
    plan = plan_moves(holds, needs)
    assert plan.kept[0] == [(W, 0, 10)] and not plan.missing
    assert plan.moves == [Move(0, 2, W, 0, 10), Move(1, 3, W, 0, 10)]
    assert plan.bytes_moved({W: 4}) == 80


def test_chunks_are_joined_from_several_holders_and_what_nobody_holds_is_missing() -> None:
    key = ("w", "o:exp_avg")
    holds = [{key: [(0, 6)]}, {key: [(6, 4)]}, {}]  # two ZeRO-1 shards of one parameter
    plan = plan_moves(holds, [{key: [(0, 10)]}, {}, {key: [(4, 8)]}])
    assert plan.kept[0] == [(key, 0, 6)]
    assert sorted(plan.moves, key=lambda m: (m.dst, m.start)) == [
        Move(1, 0, key, 6, 4), Move(0, 2, key, 4, 2), Move(1, 2, key, 6, 4)]
    assert plan.missing == [(2, key, 10, 2)]


def test_a_new_shard_holds_what_build_layout_cuts() -> None:
    params = [nn.Parameter(torch.randn(n)) for n in (5, 7, 3)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    for replica in range(3):
        predicted = shard_ranges(groups, names, set(names.values()), replica, 3)
        layout = build_layout(groups, names, set(names.values()), replica, 3)
        built: dict[str, list[tuple[int, int]]] = {}
        for b in layout.buckets:
            for pc in b.pieces:
                lo, hi = max(b.lo, pc.offset), min(b.lo + b.shard_size, pc.offset + pc.numel)
                if lo < hi:
                    built.setdefault(pc.name, []).append((lo - pc.offset, hi - lo))
        assert predicted == built


def test_records_and_descriptors_read_back_as_written() -> None:
    gen = Generation(3, ("a", "b"), ("a", "b", "c"), admitted=4, reason="notice", left=("c",),
                     cluster=vf.Cluster(gpus=2, device="cpu").to_dict(), global_batch_size=8,
                     running=True)
    assert Generation.from_json(gen.to_json()) == gen
    assert vf.Cluster.from_dict(gen.cluster) == vf.Cluster(gpus=2, device="cpu")
    desc = Descriptor(holds={W: [(0, 4)]}, info={W: Info(torch.float64, (2, 2), True)},
                      needs_model={"w": 4}, needs_optimizer={"w": [(0, 2)]}, sharded=True)
    back = Descriptor.from_bytes(desc.to_bytes())
    assert (back.holds, back.info, back.needs_model, back.needs_optimizer, back.sharded) == \
        (desc.holds, desc.info, desc.needs_model, desc.needs_optimizer, True)


def test_optimizer_needs_widen_to_every_entry_the_holders_have() -> None:
    holder = Descriptor(info={("w", "o:exp_avg"): Info(torch.float32, (10,), True),
                              ("w", "o:step"): Info(torch.float32, (), False)})
    joiner = Descriptor(needs_model={"w": 10}, needs_optimizer={"w": [(5, 5)]})
    assert expand_needs(joiner, [holder, joiner]) == {
        ("w", ""): [(0, 10)], ("w", "o:exp_avg"): [(5, 5)], ("w", "o:step"): [(0, 1)]}


def test_stages_and_replicas_given_for_one_world_are_dropped_where_they_no_longer_fit() -> None:
    o = CompileOptions(stages=2, data_parallel=2)
    assert (fit_to_world(o, 4, 2, {}).stages, fit_to_world(o, 4, 2, {}).data_parallel) == (2, 2)
    shrunk = fit_to_world(o, 2, 2, {"global_batch_size": 8})
    assert (shrunk.stages, shrunk.data_parallel, shrunk.global_batch_size) == (2, None, 8)
    alone = fit_to_world(o, 1, 2, {})
    assert (alone.stages, alone.data_parallel) == (None, None)


def test_a_step_is_recut_from_the_rows_of_the_old_replicas() -> None:
    batch = torch.arange(24).view(8, 3)
    desc, sources = Descriptor(), {}
    halves = [(batch[:4],), (batch[4:],)]
    for replica, args in enumerate(halves):  # each old replica holds its rows
        input_holdings([args[0]], replica, 2, desc, sources)
    _, _, found, rows = sample_tensors(((batch[:4],), {}, None))
    assert found == [0] and rows == 4
    pieces = {(INPUT, "0"): [(0, batch[:4].reshape(-1)), (12, batch[4:].reshape(-1))]}
    (whole,), _, _ = rebuilt(((batch[:4],), {}, None), pieces, {"0": [(0, 24)]})
    assert torch.equal(whole, batch)


def test_the_loader_cuts_any_share_of_its_last_batch_and_moves_on_resharded() -> None:
    data = torch.arange(64).view(16, 4)
    loader = GlobalBatchLoader(data, global_batch_size=8, replica=1, replicas=2, shuffle=False)
    assert isinstance(loader, MorphableData)
    it = iter(loader)
    first = next(it)
    assert torch.equal(first, data[4:8]) and loader.last_batch is first
    assert torch.equal(loader.last_share(0, 1), data[0:8])  # the whole global batch
    assert loader.state_at_last()["samples"] == 0  # a joiner would run this batch first
    loader.reshard(0, 1)
    assert torch.equal(next(it), data[8:16])  # the next global batch, all of it


def test_an_optimizer_made_around_the_pipeline_is_refused_in_an_in_place_job() -> None:
    params = [nn.Parameter(torch.ones(2))]
    guard_direct_optimizers(
        params, "this job morphs in place (--in-place)",
        "a morph moves pipe.optimizer's state and parameters only, so this one would keep "
        "stepping the old layout's", ", or run without --in-place (the restart path)")
    opt = torch.optim.SGD(params, lr=0.1)
    params[0].grad = torch.ones(2)
    with pytest.raises(OptimizerError, match=r"in place.*pipe.optimizer\(torch.optim.SGD"):
        opt.step()


@pytest.mark.parametrize("sync", ["auto", vf.PowerSGD(rank=2), vf.DiLoCo(every=4)],
                         ids=["auto", "powersgd", "diloco"])
def test_an_in_place_job_refuses_a_replica_sync_that_keeps_state(sync: object) -> None:
    # compile in an in-place job and every re-plan go through fit_to_world
    with pytest.raises(vf.PlanError, match=r"replica_sync=.*in-place.*'exact' or 'bf16'"):
        fit_to_world(CompileOptions(replica_sync=sync), 4, 2, {})
    for fine in ("exact", "bf16"):
        assert fit_to_world(CompileOptions(replica_sync=fine), 4, 2, {}).replica_sync == fine


def test_the_shared_launch_starts_the_in_place_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """``varuna-fx run --elastic --in-place`` goes through launch/torchrun.py as every launch
    does; with in_place it starts varuna_fx's own launcher (not torchrun) with the script's
    arguments untouched, and returns its exit status."""
    from varuna_fx.launch import in_place as launcher
    from varuna_fx.launch.cli import main
    from varuna_fx.launch.torchrun import Ranks, start_ranks

    started: list[launcher.InPlaceLaunch] = []
    monkeypatch.setattr(launcher.InPlaceLaunch, "run", lambda self: started.append(self) or 143)
    assert main(["run", "--elastic", "--in-place", "--nproc", "2", "--nnodes", "1:3",
                 "--rdzv-endpoint", "127.0.0.1:29999",
                 "train.py", "--lr", "1"]) == 143
    (got,) = started
    assert (got.argv, got.nproc, got.nnodes) == (["train.py", "--lr", "1"], 2, "1:3")
    assert start_ranks(Ranks(nproc=1, elastic=True, in_place=True), "pkg.worker", ["x"],
                       module=True) == 143
    assert started[1].argv == ["-m", "pkg.worker", "x"]
    with pytest.raises(vf.InputError, match="goes with elastic"):
        Ranks(nproc=1, in_place=True)
    with pytest.raises(vf.InputError, match="no torchrun flags"):
        Ranks(nproc=1, elastic=True, in_place=True, flags=("--nnodes=2",))
    with pytest.raises(SystemExit, match="--in-place goes with --elastic"):
        main(["run", "--in-place", "--nproc", "1", "train.py"])
