"""Measured times between and beyond the profiled micro-batch sizes (no timing loops)."""

from __future__ import annotations

import numpy as np
import pytest

from varuna_fx.ir.nodes import Affine
from varuna_fx.planner.cost_table import MeasuredTimes, NodeArrays, interpolate, monotone
from varuna_fx.planner.profile import ChunkProfile, Profile

SIZES = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])


def test_interpolate_hits_samples_and_is_linear_between() -> None:
    values = np.array([[1.0, 1.5, 2.0, 3.0, 5.0, 9.0]])
    for s, v in zip(SIZES, values[0]):
        assert interpolate(SIZES, values, s)[0] == pytest.approx(v)
    assert interpolate(SIZES, values, 24.0)[0] == pytest.approx(7.0)  # halfway 16 -> 32
    assert interpolate(SIZES, values, 64.0)[0] == pytest.approx(18.0)  # in proportion to 32's
    assert interpolate(SIZES[:1], values[:, :1], 3.0)[0] == pytest.approx(3.0)  # origin line


def test_beyond_the_largest_size_noise_is_not_amplified() -> None:
    """Four times the largest measured size: 10% of noise on the last sample stays 10%; along
    the last segment (the difference of two noisy samples, times the distance) it was 50%."""
    true = np.array([[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]])  # per-sample cost constant: 4.0 at 128
    noisy = true.copy()
    noisy[0, 4] *= 1.1  # 16 measured 10% slow
    at_128 = interpolate(SIZES, noisy, 128.0)[0]
    assert at_128 == pytest.approx(128.0)
    segment = noisy[0, 5] + (noisy[0, 5] - noisy[0, 4]) / 16 * 96
    assert abs(segment / 128.0 - 1) > 0.05  # what the old extrapolation gave


def test_monotone_pools_violators() -> None:
    assert monotone(np.array([1.0, 3.0, 2.0, 4.0])).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert monotone(np.array([5.0, 1.0, 1.0])).tolist() == pytest.approx([7 / 3] * 3)
    assert monotone(np.array([[1.0, 2.0], [2.0, 1.0]])).tolist() == [[1.0, 2.0], [1.5, 1.5]]


def chunk(name: str, backward: list[float]) -> ChunkProfile:
    samples = {int(b): (0.5 * t, 0.5 * t, t, 100.0 * b) for b, t in zip(SIZES, backward)}
    line = np.polyfit(SIZES, backward, 1)  # one line over all sizes: what was used before
    fit = Affine(float(line[1]), float(line[0]))
    half = Affine(fit.const / 2, fit.per_sample / 2)
    return ChunkProfile([name], half, half, fit, Affine(0.0, 100.0), samples=samples)


def measured(profile: Profile) -> MeasuredTimes:
    """The profile's MeasuredTimes for a two-node graph (one node per chunk)."""
    k = len(profile.chunks)

    def estimate(b: float) -> NodeArrays:
        return NodeArrays(*(np.ones(k) for _ in range(4)))

    times = MeasuredTimes(["a", "b"], np.arange(k), *(np.zeros((k, 2)) for _ in range(4)),
                          estimate=estimate)
    sizes = sorted(profile.sizes)
    times.sizes = np.array(sizes, float)
    times.samples = monotone(np.array([[c.samples[b][:3] for b in sizes]
                                       for c in profile.chunks]).transpose(0, 2, 1)
                             ).transpose(0, 2, 1)
    return times


def test_planner_times_follow_the_curve_not_one_line() -> None:
    # a matmul-like chunk: small batches cost nearly the same (memory bound), big ones scale
    curved = [2.0, 2.1, 2.3, 3.0, 5.0, 9.0]
    profile = Profile("k", "g", "cpu", "cpu", "float32", 1, [int(s) for s in SIZES],
                      [chunk("a", curved), chunk("b", [1.0, 2.0, 4.0, 8.0, 16.0, 32.0])])
    times = profile.times(0, 32)
    assert times[2] == pytest.approx(9.0)
    assert profile.times(0, 12)[2] == pytest.approx(4.0)
    # a straight line through the small sizes (the profiler's sizes used to stop at 8)
    # misses the big one
    slope, const = np.polyfit(SIZES[:4], curved[:4], 1)
    assert abs((const + slope * 32) / 9.0 - 1) > 0.25
    arrays = measured(profile).arrays(32)
    assert arrays.backward.tolist() == pytest.approx([9.0, 32.0])
    assert arrays.forward.tolist() == pytest.approx([4.5, 16.0])


def test_noisy_sample_is_pooled_not_followed() -> None:
    noisy = [1.0, 2.0, 6.0, 4.0, 8.0, 16.0]  # b=4 disturbed upward
    profile = Profile("k", "g", "cpu", "cpu", "float32", 1, [int(s) for s in SIZES],
                      [chunk("a", noisy)])
    assert profile.times(0, 4)[2] == pytest.approx(5.0)
    assert profile.times(0, 8)[2] == pytest.approx(5.0)


@pytest.mark.parametrize("batch,largest,expected", [(6, 8, [1, 2, 6]), (12, 8, [1, 2]),
                                                     (2, 8, [1, 2])])
def test_the_profile_measures_the_batch_itself_up_to_the_largest_size(
        batch: int, largest: int, expected: list[int]) -> None:
    """The planner may run the whole batch as one micro-batch: measured, not extrapolated,
    up to ``largest`` (beyond it the cost of profiling outgrows what it saves)."""
    import torch

    from varuna_fx.examples import GPT, GPTConfig
    from varuna_fx.planner import analyze
    from varuna_fx.planner.measure import ProfileSettings, measure

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=4, vocab_size=32))
    graph = analyze(model, (torch.randint(0, 32, (batch, 4)),))
    settings = ProfileSettings(sizes=(1, 2), largest=largest, repeats=1, warmup=0, max_chunks=2)
    assert measure(graph.gm, graph.bound, "k", settings).sizes == expected
