"""bench/bench_planner_truth.py's pure parts (issue 41 item 3): where a step went, from its
timeline, against the plan's cost terms; the rank correlation; the report and its blocks.
Nothing launched, no root."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import planner_truth_parts as parts  # noqa: E402

# one rank's step of 100 ms: F/B 40 ms, a send 1 ms, a wait 20 ms, the tail 30 ms; 9 ms outside
TIMELINE = [(0, "F", 0, 0.000, 0.010), (0, "send", 0, 0.010, 0.011), (0, "F", 1, 0.011, 0.021),
            (0, "wait", 1, 0.021, 0.041), (0, "B", 1, 0.041, 0.051), (0, "W", 1, 0.051, 0.056),
            (0, "B", 0, 0.056, 0.061), (-1, "sync", -1, 0.061, 0.091)]
TERMS = {"compute": 0.030, "action overhead": 0.002, "messages": 0.004, "all-reduce": 0.025,
         "bubble": 0.010}


def test_a_step_is_split_by_its_timeline() -> None:
    got = parts.decompose(0.100, TIMELINE)
    assert got["compute"] == pytest.approx(0.040)
    assert got["comm"] == pytest.approx(0.021)
    assert got["sync"] == pytest.approx(0.030)
    assert got["outside"] == pytest.approx(0.009) and got["wall"] == 0.100
    assert parts.decompose(0.010, [])["outside"] == 0.010  # no timeline: all outside
    assert parts.decompose(0.050, TIMELINE)["outside"] == 0.0  # never negative


def test_the_plans_terms_in_the_same_parts() -> None:
    want = parts.predicted_parts(TERMS)
    assert want == pytest.approx({"compute": 0.032, "sync": 0.025, "comm": 0.014,
                                  "outside": 0.0})
    # a term the cost model may add later counts outside the actions; pairs work as a dict
    assert parts.predicted_parts([*TERMS.items(), ("per step", 0.003)])["outside"] == 0.003


def test_the_slowest_rank_and_the_median_step() -> None:
    a, b = parts.decompose(0.1, TIMELINE), parts.decompose(0.1, TIMELINE[:3])
    assert parts.slowest_rank([b, a]) is a
    steps = [{"wall": w} for w in (0.3, 0.1, 0.2)]
    assert parts.median_step(steps) == {"wall": 0.2}
    assert parts.furthest_off(a, parts.predicted_parts(TERMS)) == "outside"  # 9 ms vs 8


def test_spearman() -> None:
    assert parts.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert parts.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert parts.spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties: average ranks
    assert parts.spearman([1.0], [2.0]) != parts.spearman([1.0], [2.0])  # nan for one row


def _row(p: int, predicted: float, measured: float) -> dict:
    ranks = [{**parts.decompose(measured, TIMELINE), "rank": r} for r in range(p)]
    return {"P": p, "D": 1, "b": 4, "m": 2, "schedule": "varuna", "predicted": predicted,
            "measured": measured, "normal": measured, "terms": TERMS, "ranks": ranks}


def test_the_report_shows_errors_and_where_the_step_went() -> None:
    rows = [_row(1, 0.09, 0.10), _row(2, 0.12, 0.10)]
    text = parts.report({"_links": None, "gpt": {"rows": rows, "pick": rows[0]}}, "a setting")
    assert "**gpt** (a setting)" in text and "| 1 | 1 | 4 x 2 | varuna (best) | 90.0 |" in text
    assert "median |error| 15.0%, max 20.0%" in text
    assert "| 40.0 / 32.0 | 30.0 / 25.0 | 21.0 / 14.0 | 9.0 / 0.0 | outside |" in text
    assert "compute +8.0 ms, sync +5.0 ms, messages+waits +7.0 ms, outside +9.0 ms" in text
    assert "_links" not in text
    assert "not measured" in parts.links_line(None)
    line = parts.links_line({"latency": 4e-4, "bandwidth": 12.5e6, "allreduce_latency": 7e-3,
                             "allreduce_bandwidth": 15e6, "link_bandwidths": [12.5e6, 12e6]})
    assert "bandwidth 100 Mbit/s (per link r -> r + 1: 100, 96)" in line


def test_each_mode_writes_its_own_block() -> None:
    import bench_planner_truth as truth
    import results

    def name(**kw: object) -> str:
        return truth.block_name(argparse.Namespace(**{"nodes": 0, "nproc": 2, "link": "",
                                                      **kw}))

    assert name() == "bench_planner_truth.py"
    assert name(nproc=4) == "bench_planner_truth.py nproc4"
    assert name(nodes=4, link="100mbit") == "bench_planner_truth.py nodes4-100mbit"
    held = results.block_names(results.RESULTS.read_text())
    assert {name(), name(nproc=4), name(nodes=4, link="100mbit")} <= set(held)


def test_nodes_need_root_and_say_so(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import bench_planner_truth as truth

    monkeypatch.setattr(truth.os, "geteuid", lambda: 1000)
    assert "run it as root" in (truth.nodes_unavailable() or "")
    args = argparse.Namespace(nodes=4, link="100mbit")
    truth.launch(args)  # a clear skip, nothing launched, nothing written
    assert "--nodes: skipped: --nodes creates network namespaces" in capsys.readouterr().err
