"""Varuna's run-time rule (``runtime/opportunistic.py``): a stage whose next backward's gradient
has not arrived runs its next forward first.

Fast tests: the cursor alone; every stage of a schedule played together under random
interleavings with messages (no deadlock, send order = posting order, stash within the static
peak, send-release proofs sound); the real executor loop with a fake inbox and an arrival
predicate. Slow tests: 2 and 3 gloo ranks training the tiny tied GPT with every gradient
"late", equal to eager PyTorch.
"""

from __future__ import annotations

import random
import types
from collections import defaultdict

import pytest
import torch

from support.dist import run_jobs
from support.training import eager_training
from varuna_fx.errors import DistributedError
from varuna_fx.ir.nodes import Affine, StageSpec, TensorInfo, Transfer, b
from varuna_fx.runtime import executor as executor_module
from varuna_fx.runtime.acks import release_keys
from varuna_fx.runtime.executor import StageExecutor
from varuna_fx.runtime.opportunistic import ENV, rule_enabled
from varuna_fx.schedule import Action, Kind, Schedule, build_schedule, peak_stash_counts
from varuna_fx.schedule.cursor import Cursor, stash_peak
from varuna_fx.schedule.placement import Placement

CASES = [(name, P, m, rc) for name in ("varuna", "1f1b", "gpipe", "varuna-zb", "1f1b-zb")
         for P, m in ((2, 8), (3, 6), (4, 8)) for rc in (True, False)]


def _specs(P: int) -> list[StageSpec]:
    """Stage s sends 'h<s>' to s+1; stage 0 also sends 'skip' to the last stage, and, for
    P > 3, 'mid' to stage 2 without a gradient coming back."""
    info = TensorInfo((b, 4), torch.float32)
    transfers = [Transfer(f"h{s}", s, s + 1, info, Affine(), True) for s in range(P - 1)]
    if P > 2:
        transfers.append(Transfer("skip", 0, P - 1, info, Affine(), True))
    if P > 3:
        transfers.append(Transfer("mid", 0, 2, info, Affine(), False))
    return [StageSpec(s, [], [t for t in transfers if t.dst == s],
                      [t for t in transfers if t.src == s], [], [], []) for s in range(P)]


def _jump_whenever_allowed(acts: list[Action], split: bool) -> Cursor:
    """The cursor of one stage whose gradients are always late and inputs always here."""
    cursor = Cursor(acts, split)
    while (k := cursor.head()) is not None:
        f = cursor.ahead()
        cursor.done(k if f is None else f)
    return cursor


# -- the cursor ------------------------------------------------------------------------------


def test_the_next_forward_jumps_and_nothing_else() -> None:
    # 1F1B-like stage 0 of P=2 with recompute, peak 3 held only at the start
    acts = [Action.parse(a) for a in
            "0F0 0F1 0F2 0R0 0B0 0R1 0B1 0F3 0R2 0B2 0F4 0R3 0B3 0R4 0B4".split()]
    cursor = Cursor(acts, split=False)
    assert cursor.peak == 3
    for k in range(3):
        assert cursor.ahead() is None  # the head is a forward: nothing to jump over
        cursor.done(k)
    assert cursor.ahead() is None, "3 held = the peak: no forward may run ahead"
    cursor.done(3)  # 0R0
    cursor.done(4)  # 0B0: 2 held
    assert cursor.head() == 5 and cursor.ahead() == 7, "at 0R1 the next forward is 0F3"
    cursor.done(7)
    assert cursor.jumped == [Action(0, Kind.F, 3)]
    assert cursor.ahead() is None, "back at the peak"
    cursor.done(5)
    cursor.done(6)  # 0B1: 2 held
    assert cursor.head() == 8 and cursor.ahead() == 10, "0F4, never a forward after it"
    with pytest.raises(AssertionError, match="ran out of its list order"):
        cursor.done(9)  # 0B2 before 0R2
    with pytest.raises(AssertionError, match="before an earlier forward"):
        Cursor(acts, split=False).done(1)


def test_weight_gradient_actions_never_move_and_free_the_stash() -> None:
    acts = [Action.parse(a) for a in "1F0 1F1 1B0 1W0 1F2 1B1 1W1 1B2 1W2".split()]
    assert stash_peak(acts, split=True) == 2
    cursor = Cursor(acts, split=True)
    cursor.done(0)
    cursor.done(1)
    cursor.done(2)  # 1B0: the split backward keeps the stash until 1W0
    assert cursor.head() == 3 and cursor.ahead() is None, "the head is a W"
    cursor.done(3)
    assert cursor.ahead() is None, "the head 1F2 is a forward"


@pytest.mark.parametrize("name,P,m,rc", CASES)
def test_always_late_gradients_keep_orders_and_the_stash_peak(name: str, P: int, m: int,
                                                              rc: bool) -> None:
    sched = build_schedule(name, P, m, recompute=rc)
    for acts, peak in zip(sched.per_stage, peak_stash_counts(sched)):
        cursor = _jump_whenever_allowed(acts, sched.split_backward)
        assert cursor.peak == peak and cursor.max_live <= peak


def test_one_f_one_b_never_has_room_and_varuna_often_does() -> None:
    """Under the stash cap the rule cannot move 1F1B's forwards (it holds its peak before every
    backward that has a forward after it); Varuna's orders peak early and leave room."""
    for P, m in ((2, 8), (3, 6), (4, 8)):
        for rc in (True, False):
            sched = build_schedule("1f1b", P, m, recompute=rc)
            assert all(not _jump_whenever_allowed(a, False).jumped for a in sched.per_stage)
    varuna = build_schedule("varuna", 2, 8, recompute=True)
    assert [str(a) for a in _jump_whenever_allowed(varuna.per_stage[0], False).jumped] == \
        ["0F5", "0F6", "0F7"]


# -- every stage together, with messages -----------------------------------------------------


def _posting_order(me: int, acts: list[Action], spec: StageSpec) -> list[tuple]:
    """The receives stage ``me`` posts, in order (as its lowered program's RECV ops)."""
    order = []
    for a in acts:
        if a.kind is Kind.F:
            order += [("activation", t.name, t.src, me, a.mb) for t in spec.recvs]
        elif a.kind is Kind.B:
            order += [("gradient", t.name, t.dst, me, a.mb) for t in spec.sends
                      if t.requires_grad]
    return order


def _play(sched: Schedule, specs: list[StageSpec], seed: int, *, reorder_proofs: bool,
          late: str) -> list[str]:
    """Run every stage's list with the rule on, one action at a time in a random interleaving;
    a message is here once its sender ran the action sending it. ``late``: "always" (every
    gradient counts as not arrived) or "truth". Returns the violated send-release proofs."""
    rng = random.Random(seed)
    P, split = sched.num_stages, sched.split_backward
    cursors = [Cursor(acts, split) for acts in sched.per_stage]
    here: set[tuple] = set()
    consumed: set[tuple] = set()
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    proved_by: dict[tuple, list[tuple]] = defaultdict(list)  # proof -> the sends it releases
    for me in range(P):
        proofs = release_keys(me, sched.per_stage, specs, reorder=reorder_proofs, split=split)
        for (kind, name, peer, mb), proof in proofs.items():
            if proof is not None:
                pk, pname, ppeer, pmb = proof
                proved_by[(pk, pname, ppeer, me, pmb)].append((kind, name, me, peer, mb))

    def needs(s: int, a: Action) -> list[tuple]:
        if a.kind is Kind.F:
            return [("activation", t.name, t.src, s, a.mb) for t in specs[s].recvs]
        if a.kind is Kind.B:
            return [("gradient", t.name, t.dst, s, a.mb) for t in specs[s].sends
                    if t.requires_grad]
        return []

    def makes(s: int, a: Action) -> list[tuple]:
        if a.kind is Kind.F:
            return [("activation", t.name, s, t.dst, a.mb) for t in specs[s].sends]
        if a.kind is Kind.B:
            return [("gradient", t.name, s, t.src, a.mb) for t in specs[s].recvs
                    if t.requires_grad]
        return []

    def choice(s: int) -> int | None:
        cursor = cursors[s]
        k = cursor.head()
        if k is None:
            return None
        f = cursor.ahead()
        if f is not None:
            head = sched.per_stage[s][k]
            grad_late = late == "always" or not all(
                n in here for n in needs(s, Action(s, Kind.B, head.mb)))
            if grad_late and all(n in here for n in needs(s, sched.per_stage[s][f])):
                return f  # the rule never waits: its inputs are here
        return k if all(n in here for n in needs(s, sched.per_stage[s][k])) else None

    violations = []
    while any(c.head() is not None for c in cursors):
        ready = [(s, k) for s in range(P) if (k := choice(s)) is not None]
        assert ready, "deadlock: " + ", ".join(
            f"stage {s} at {sched.per_stage[s][c.head()]}" for s, c in enumerate(cursors)
            if c.head() is not None)
        s, k = rng.choice(ready)
        action = sched.per_stage[s][k]
        consumed.update(needs(s, action))
        for msg in makes(s, action):
            for released in proved_by.get(msg, []):  # the receiver frees these on taking msg
                if released not in consumed:
                    violations.append(f"{msg} released {released} before it was consumed")
            sent[(msg[2], msg[3])].append(msg)
            here.add(msg)
        cursors[s].done(k)
    for me in range(P):  # per ordered pair: sent in the order the receiver posts
        posted = _posting_order(me, sched.per_stage[me], specs[me])
        for src in range(P):
            assert sent[(src, me)] == [x for x in posted if x[2] == src]
    for cursor in cursors:
        assert cursor.max_live <= cursor.peak
    return violations


@pytest.mark.parametrize("name,P,m,rc", CASES)
def test_all_stages_together_never_deadlock_and_keep_proofs(name: str, P: int, m: int,
                                                            rc: bool) -> None:
    sched, specs = build_schedule(name, P, m, recompute=rc), _specs(P)
    for seed in range(4):
        for late in ("always", "truth"):
            assert _play(sched, specs, seed, reorder_proofs=True, late=late) == []


def test_static_gradient_proofs_would_release_too_early() -> None:
    """Why ``release_keys(reorder=True)``: upstream may now send the forward that proved a
    gradient consumed before running the backward that consumes it."""
    sched = build_schedule("varuna", 2, 8, recompute=True)
    found = [v for seed in range(4)
             for v in _play(sched, _specs(2), seed, reorder_proofs=False, late="always")]
    assert found and all("'gradient'" in v.split("released")[1] for v in found)


# -- the executor loop, with a fake inbox ----------------------------------------------------


class _FakeInbox:
    def __init__(self, expected: list, device: torch.device, timeout: float, who: str) -> None:
        self._expected, self._next, self._posted = expected, 0, {}

    def post_until(self, index: int) -> None:
        while self._next < len(self._expected) and self._expected[self._next][0] < index:
            msg = self._expected[self._next][1]
            self._posted[msg.key] = msg
            self._next += 1

    def post(self, msg: object) -> None:  # the lowered program's RECV op
        self._posted[msg.key] = msg  # type: ignore[attr-defined]

    def posted(self, key: tuple) -> bool:
        return key in self._posted

    landed: set[int] | None = None  # without a predicate: micro-batches whose input landed

    def completed(self, key: tuple) -> bool:  # stands for Work.is_completed()
        assert self.landed is not None, "the test's predicate answers, not Work.is_completed()"
        return key[0] == "activation" and key[3] in self.landed

    def take(self, key: tuple) -> torch.Tensor:
        return torch.zeros(self._posted.pop(key).shape)

    @property
    def pending(self) -> int:
        return len(self._posted) + len(self._expected) - self._next


class _FakeWorker:
    def __init__(self, spec: StageSpec) -> None:
        self.spec, self.calls = spec, []

    def forward(self, mb: int, inputs: dict, received: dict) -> dict:
        self.calls.append(f"F{mb}")
        return {t.name: torch.zeros(1, 4) for t in self.spec.sends}

    def recompute_mb(self, mb: int, device: torch.device) -> None:
        self.calls.append(f"R{mb}")

    def backward(self, mb: int, grads: dict, loss: object, split: bool) -> dict:
        self.calls.append(f"B{mb}")
        return {t.name: torch.zeros(1, 4) for t in self.spec.recvs}

    def weight_grads(self, mb: int) -> None:
        self.calls.append(f"W{mb}")

    def outputs_of(self, mb: int) -> dict:
        return {}


def _run_stage(sched: Schedule, stage: int, arrived_mbs: set[int],
               monkeypatch: pytest.MonkeyPatch, predicate: bool = True
               ) -> tuple[list[str], Cursor, list[str]]:
    """Run ``stage``'s list through the real executor loop; gradients never arrive and an
    activation has arrived when its micro-batch is in ``arrived_mbs`` (told by a predicate,
    or without one by the inbox's completion check, as on NCCL)."""
    specs = _specs(sched.num_stages)
    worker = _FakeWorker(specs[stage])
    stages = [types.SimpleNamespace(spec=s) for s in specs]
    ex = StageExecutor(worker, stages, Placement(sched.num_stages, 1), 0, 1,  # type: ignore[arg-type]
                       torch.device("cpu"), 1.0, f"stage {stage}")
    ex.split, ex.reorder = sched.split_backward, True
    asked: list[str] = []

    def arrived(msg: object) -> bool:
        asked.append(f"{msg.kind} {msg.mb}")  # type: ignore[attr-defined]
        return msg.kind == "activation" and msg.mb in arrived_mbs  # type: ignore[attr-defined]

    ex.arrived = arrived if predicate else None
    ex.outbox = types.SimpleNamespace(send=lambda *a: None, release=lambda key: None)
    monkeypatch.setattr(executor_module, "Inbox", _FakeInbox)
    monkeypatch.setattr(_FakeInbox, "landed", None if predicate else arrived_mbs)
    micro = [{} for _ in range(sched.num_micro_batches)]
    ex.run(sched.per_stage, micro, None)
    assert ex.cursor is not None
    return worker.calls, ex.cursor, asked


def test_executor_runs_the_next_forward_when_its_input_is_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sched = build_schedule("1f1b-zb", 3, 6, recompute=True)
    calls, cursor, asked = _run_stage(sched, 1, set(range(6)), monkeypatch)
    static = [f"{a.kind.value}{a.mb}" for a in sched.per_stage[1]]
    assert cursor.jumped, "gradients never arrive: some forward must run ahead"
    assert calls != static and sorted(calls) == sorted(static)
    forwards = [c for c in calls if c[0] == "F"]
    assert forwards == [f"F{i}" for i in range(6)], "forwards keep their order"
    assert [c for c in calls if c[0] != "F"] == [c for c in static if c[0] != "F"]
    assert any(q.startswith("gradient") for q in asked)
    assert cursor.max_live <= cursor.peak


def test_executor_never_runs_ahead_a_forward_whose_input_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sched = build_schedule("1f1b-zb", 3, 6, recompute=True)
    _, cursor, _ = _run_stage(sched, 1, set(range(6)), monkeypatch)
    missing = cursor.jumped[0].mb  # that forward's activation now never counts as arrived
    calls, cursor, _ = _run_stage(sched, 1, set(range(6)) - {missing}, monkeypatch)
    assert all(a.mb < missing for a in cursor.jumped), "nothing jumps at or over a missing input"
    assert [c for c in calls if c[0] == "F"] == [f"F{i}" for i in range(6)]
    static = [f"{a.kind.value}{a.mb}" for a in sched.per_stage[1]]
    before = static[:static.index(f"F{missing}")]
    assert set(before) <= set(calls[:calls.index(f"F{missing}")]), "it waits for its place"


def test_without_a_predicate_the_inbox_completion_check_decides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sched = build_schedule("1f1b-zb", 3, 6, recompute=True)
    told = _run_stage(sched, 1, set(range(6)), monkeypatch)
    polled = _run_stage(sched, 1, set(range(6)), monkeypatch, predicate=False)
    assert polled[0] == told[0] and polled[1].jumped == told[1].jumped
    nothing = _run_stage(sched, 1, set(), monkeypatch, predicate=False)
    assert not nothing[1].jumped, "no input landed: the static order"
    assert nothing[0] == [f"{a.kind.value}{a.mb}" for a in sched.per_stage[1]]


def test_inbox_polls_the_posted_receive_without_waiting() -> None:
    from varuna_fx.runtime.comm import Inbox

    class Work:
        def __init__(self, done: bool) -> None:
            self.done = done

        def is_completed(self) -> bool:
            return self.done

        def wait(self, timeout: object = None) -> None:
            raise AssertionError("polling must not wait")

    inbox = Inbox([], torch.device("cpu"), 1.0, "stage 1")
    inbox._posted[("activation", "h0", 0, 0)] = (Work(True), torch.zeros(1), None)
    inbox._posted[("activation", "h0", 0, 1)] = (Work(False), torch.zeros(1), None)
    assert inbox.posted(("activation", "h0", 0, 0)) and not inbox.posted(("gradient", "h0", 0, 0))
    assert inbox.completed(("activation", "h0", 0, 0))
    assert not inbox.completed(("activation", "h0", 0, 1))


def test_rule_is_on_for_nccl_by_default_and_forced_by_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert rule_enabled("nccl") and not rule_enabled("gloo")
    monkeypatch.setenv(ENV, "on")
    assert rule_enabled("gloo")
    monkeypatch.setenv(ENV, "off")
    assert not rule_enabled("nccl")
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(DistributedError, match=f"{ENV}='sometimes'.*auto, on, off"):
        rule_enabled("nccl")


# -- gloo ranks, every gradient late ---------------------------------------------------------

# Unit-cost orders (the planner's order depends on measured costs, which vary from run to run):
# room to run ahead on stage 0 (deterministic: its inputs are local) for P=2 varuna and
# varuna-zb, on stage 1 for P=3 varuna and varuna-zb, none in 1F1B.
_JOBS = {
    2: [{"name": "varuna_rc_m8", "schedule": "varuna", "recompute": True, "mb": 1},
        {"name": "varuna-zb_rc_m8", "schedule": "varuna-zb", "recompute": True, "mb": 1},
        {"name": "1f1b_m4", "schedule": "1f1b", "recompute": False, "mb": 2},
        {"name": "dropout_on", "schedule": "varuna", "recompute": True, "mb": 1, "dropout": 0.3},
        {"name": "dropout_off", "schedule": "varuna", "recompute": True, "mb": 1, "dropout": 0.3,
         "reorder": False},
        {"name": "disagree", "kind": "mismatch", "rule_env": {"0": "on", "1": "off"}}],
    3: [{"name": "varuna_rc_m8", "schedule": "varuna", "recompute": True, "mb": 1},
        {"name": "varuna-zb_m8", "schedule": "varuna-zb", "recompute": False, "mb": 1},
        {"name": "1f1b_rc_m4", "schedule": "1f1b", "recompute": True, "mb": 2}],
}


@pytest.fixture(scope="module")
def late_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    runs = {}
    for P, specs in _JOBS.items():
        jobs = [{"kind": "train", "P": P, "D": 1, "reorder": s.get("reorder", True),
                 "name": s["name"], "schedule": s["schedule"], "recompute": s["recompute"],
                 "micro_batch_size": {str(r): s["mb"] for r in range(P)},
                 "dropout": s.get("dropout", 0.0), "unit_order": True}
                if "kind" not in s else {**s, "P": P, "D": 1} for s in specs]
        runs[P] = run_jobs(tmp_path_factory.mktemp(f"late{P}"), P, jobs, timeout=300.0)
    return runs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("P,name", [(P, s["name"]) for P, specs in _JOBS.items() for s in specs
                                    if "dropout" not in s and "kind" not in s])
def test_late_gradients_match_eager(late_runs: dict, P: int, name: str) -> None:
    from support.training import check_against_eager  # the same comparison as every layout

    per_rank = late_runs[P][name]
    check_against_eager(per_rank, eager_training(), P, 1)
    sched = Schedule.parse(per_rank[0]["schedule"])
    for r in per_rank:
        for max_live, peak in r["held"]:
            assert max_live <= peak == peak_stash_counts(sched)[r["stage"]]
    # stage 0's inputs are local, so wherever its static order has room it must have jumped
    room = _jump_whenever_allowed(sched.per_stage[0], sched.split_backward).jumped
    stage0 = next(r for r in per_rank if r["stage"] == 0)
    assert all(steps == [str(a) for a in room] for steps in stage0["jumped"])
    if not name.startswith("1f1b"):
        assert any(steps for r in per_rank for steps in r["jumped"]), "nothing ran ahead"
    else:
        assert not any(steps for r in per_rank for steps in r["jumped"])


@pytest.mark.slow
@pytest.mark.distributed
def test_late_gradients_keep_dropout_masks(late_runs: dict) -> None:
    on, off = late_runs[2]["dropout_on"], late_runs[2]["dropout_off"]
    assert any(steps for r in on for steps in r["jumped"])
    assert not any(steps for r in off for steps in r["jumped"])
    for a, c in zip(sorted(on, key=lambda r: r["stage"]), sorted(off, key=lambda r: r["stage"])):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(c["losses"]))
        for n, value in a["params"].items():
            torch.testing.assert_close(value, c["params"][n])


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_disagreeing_on_the_rule_are_named(late_runs: dict) -> None:
    """The rule changes which message proves a send delivered, so ranks must agree on it."""
    for r in late_runs[2]["disagree"]:
        assert r["error"] == "DistributedError"
        assert f"{ENV}=on" in r["message"] and f"{ENV}=off" in r["message"]


def test_the_executor_issues_exactly_the_checked_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is checked is what runs: the real executor loop's posts, computes and sends, with
    forwards jumping, are the ops of ``schedule.walk`` over the lowered program the checker
    proves (the same predicate deciding what landed), tensor by tensor in transfer order."""
    from varuna_fx.schedule import OpKind, check_comms, walk

    sched = build_schedule("varuna-zb", 3, 6, recompute=True)
    issued: list[str] = []
    monkeypatch.setattr(_FakeInbox, "post", lambda self, msg: (
        issued.append(f"post {msg.kind} {msg.name} {msg.mb}"),
        self._posted.__setitem__(msg.key, msg)))
    real_run = StageExecutor.run

    def recording_run(self: StageExecutor, *args: object) -> None:
        self.outbox = types.SimpleNamespace(
            send=lambda t, msg, proof: issued.append(f"send {msg.kind} {msg.name} {msg.mb}"),
            release=lambda key: None)
        worker_forward = self.worker.forward
        self.worker.forward = lambda mb, *a: (issued.append(f"F{mb}"), worker_forward(mb, *a))[1]
        real_run(self, *args)
        recording.append(self)

    recording: list[StageExecutor] = []
    monkeypatch.setattr(StageExecutor, "run", recording_run)
    calls, cursor, _ = _run_stage(sched, 1, set(range(6)), monkeypatch)
    assert cursor.jumped, "the case exercises the rule"
    ex = recording[0]
    assert ex.lowered is not None
    check_comms(ex.lowered, reorder=True, late=True)
    program = ex.lowered.programs[1]
    expected: list[str] = []
    # stage 1 of _specs(3) takes h0 from stage 0 and sends h1 to stage 2
    names = {OpKind.RECV_F: ("activation", "h0"), OpKind.RECV_B: ("gradient", "h1"),
             OpKind.SEND_F: ("activation", "h1"), OpKind.SEND_B: ("gradient", "h0")}
    for op in walk(program, True, True, lambda op: op.kind is OpKind.RECV_F):
        if op.kind in names:
            kind, value = names[op.kind]
            verb = "post" if op.kind.name.startswith("RECV") else "send"
            expected.append(f"{verb} {kind} {value} {op.mb}")
        elif op.kind is OpKind.F:
            expected.append(f"F{op.mb}")
    assert issued == expected
