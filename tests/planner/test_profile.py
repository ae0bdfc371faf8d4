"""Issue 5: the profiler -- measured costs, their fits, the on-disk cache, and their use."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import varuna_fx as vf
import varuna_fx.planner.resolve as resolve
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.planner import Profile, analyze, plan_for
from varuna_fx.planner.measure import measure
from varuna_fx.world.files import cache_dir

pytestmark = pytest.mark.slow  # measures this device for real (timing loops)

VOCAB, T = 512, 64


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=T, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """One measured compile (one CPU thread: the profiler then times CPU time, which other
    processes on this machine cannot inflate), shared by the tests."""
    patch = pytest.MonkeyPatch()
    cache = str(tmp_path_factory.mktemp("cache"))
    patch.setenv("VARUNA_FX_CACHE_DIR", cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_model()
    tokens = torch.randint(0, VOCAB, (8, T))
    grads_before = [p.grad for p in model.parameters()]
    rng_before = torch.random.get_rng_state()
    counted = {"measurements": 0}  # profiles measured: the cache must spare the second

    def counting(*args: object, **kwargs: object) -> Profile:
        counted["measurements"] += 1
        return measure(*args, **kwargs)  # type: ignore[arg-type]

    patch.setattr(resolve, "measure", counting)
    # schedule pinned: the default ("auto") weighs split-backward schedules, whose profile
    # also times the split (another cache key than analyze(...).profile()'s below)
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2,
                      profile=True, schedule="varuna")
    yield {"model": model, "tokens": tokens, "pipe": pipe, "counted": counted, "cache": cache,
           "measured": counted["measurements"],
           "grads_before": grads_before, "rng_before": rng_before}
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(autouse=True)
def _own_graph_cache(monkeypatch: pytest.MonkeyPatch, env: dict[str, object]) -> None:
    """This module's tests share the fixture's profile cache (conftest gives every other test
    a fresh one): the second compile must find what the first measured."""
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(env["cache"]))


def cached_profile(env: dict[str, object]) -> Profile:
    return analyze(env["model"], (env["tokens"],)).profile()  # type: ignore[arg-type]


def test_second_compile_hits_the_cache(env: dict[str, object]) -> None:
    assert env["measured"] == 1  # the first compile measured
    counted: dict[str, int] = env["counted"]  # type: ignore[assignment]
    before = counted["measurements"]
    vf.compile(env["model"], example_inputs=(env["tokens"],), loss_fn=lm_loss, stages=2,
               profile=True, schedule="varuna")
    assert counted["measurements"] == before  # the second did not
    assert cached_profile(env).from_cache
    assert list(cache_dir("profiles").glob("*.json"))


def fit_errors(profile: Profile) -> list[tuple[float, str, int]]:
    """Relative error of the fitted time at every profiled size (pieces >= 0.5 ms)."""
    errors = []
    for chunk in profile.chunks:
        for b, measured in chunk.samples.items():
            for i, kind in enumerate(("forward", "recompute", "backward")):
                if measured[i] >= 5e-4:  # shorter ones are too short to time reliably
                    errors.append((abs(getattr(chunk, kind)(b) / measured[i] - 1), kind, b))
            assert chunk.memory(b) == pytest.approx(measured[3], rel=0.05)
    return errors


def test_fit_reproduces_the_measurements(env: dict[str, object]) -> None:
    # memory is deterministic and must fit within 5% (checked in fit_errors); times are wall
    # clock on a shared machine, so the test asks the fit to follow the typical sample closely
    # (median within 10%) and tolerates one disturbed sample (worst within 35%); how close
    # the timing fit is on a quiet machine is a benchmark (bench/bench_sim_accuracy.py)
    profile = cached_profile(env)
    assert profile.sizes == [1, 2, 4, 8] and len(profile.chunks) >= 2
    assert "b" in str(profile.chunks[0].backward.expr)  # the same sympy form as the FLOPs
    graph = analyze(env["model"], (env["tokens"],))  # type: ignore[arg-type]
    errors = sorted(fit_errors(profile))
    for _ in range(2):  # a busy machine can spoil one profile; measure again to tell
        if _typical_and_worst_fit(errors):
            break
        errors = sorted(fit_errors(measure(graph.gm, graph.bound, "retry")))
    assert _typical_and_worst_fit(errors), (errors[len(errors) // 2], errors[-1])


def _typical_and_worst_fit(errors: list[tuple[float, str, int]]) -> bool:
    return errors[len(errors) // 2][0] <= 0.10 and errors[-1][0] <= 0.35


def test_measured_costs_drive_the_partition(env: dict[str, object]) -> None:
    pipe = env["pipe"]
    profile = cached_profile(env)
    b = pipe.plan.micro_batch_size  # type: ignore[attr-defined]
    # the planner's times: the measurements, interpolated at b (Profile.times)
    times = [profile.times(k, b) for k in range(len(profile.chunks))]
    measured = sum(f + r + bwd for f, r, bwd in times)
    # the last stage never recomputes: at least the no-grad forward of every chunk drops out
    without_forward = sum(r + bwd for _, r, bwd in times)
    partitioned = sum(s.time for s in pipe.plan.stage_costs)  # type: ignore[attr-defined]
    sends = sum(s.boundary_bytes for s in pipe.plan.stage_costs) / 1.25e9  # type: ignore
    assert without_forward <= partitioned <= measured + sends + 1e-9


def test_profiling_leaves_the_model_alone(env: dict[str, object]) -> None:
    model = env["model"]
    assert [p.grad for p in model.parameters()] == env["grads_before"]  # type: ignore[attr-defined]
    assert torch.equal(torch.random.get_rng_state(), env["rng_before"])  # type: ignore[arg-type]


def test_profile_survives_json(env: dict[str, object]) -> None:
    profile = cached_profile(env)
    again = Profile.from_json(profile.to_json())
    assert dataclasses.replace(again, from_cache=True) == profile


def test_a_profile_of_another_graph_is_rejected(env: dict[str, object]) -> None:
    other = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    with pytest.raises(vf.VarunaFxError, match="different graph"):
        vf.compile(other, example_inputs=(torch.zeros(2, 8, dtype=torch.long),), stages=1,
                   profile=cached_profile(env))


def test_a_profile_from_another_device_type_is_not_used(env: dict[str, object]) -> None:
    profile = cached_profile(env)
    graph = analyze(env["model"], (env["tokens"],))  # type: ignore[arg-type]
    a100 = vf.Cluster(gpus=4, device_type="a100")
    estimated = plan_for(graph, a100, stages=2, micro_batch_size=2)
    assert plan_for(graph, a100, stages=2, micro_batch_size=2, profile=profile
                    ).best.step_time == estimated.best.step_time
    cpu = vf.Cluster(gpus=2, device="cpu")
    measured = plan_for(graph, cpu, stages=2, micro_batch_size=2, profile=profile)
    assert measured.best.step_time != plan_for(graph, cpu, stages=2,
                                               micro_batch_size=2).best.step_time
    with pytest.warns(UserWarning, match="FLOP estimates"):
        vf.compile(env["model"], a100, (env["tokens"],), stages=2, profile=profile)


def test_profiling_a_model_on_the_meta_device_says_what_to_do() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, n_embd=32, vocab_size=64, block_size=8))
    with pytest.raises(vf.VarunaFxError, match="meta device"):
        vf.compile(model, example_inputs=(torch.zeros(2, 8, dtype=torch.long),), stages=1,
                   profile=True)
