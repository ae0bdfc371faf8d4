"""The fast tier stays a one-process check, and a tiered sweep keeps every case."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest

from tiers import tiered


def test_a_fast_test_that_launches_a_process_is_told_to_mark_itself_slow() -> None:
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.slow"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_a_slow_test_may_launch_processes() -> None:
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                          text=True, check=True).stdout.strip() == "42"


def test_a_tiered_sweep_keeps_every_case_and_marks_all_but_the_fast_slice() -> None:
    params = tiered([(1, "a"), (2, "b"), (3, "c")], [(2, "b")], lambda c: f"{c[0]}{c[1]}")
    assert [p.values for p in params] == [(1, "a"), (2, "b"), (3, "c")]
    assert [p.id for p in params] == ["1a", "2b", "3c"]
    assert [[m.name for m in p.marks] for p in params] == [["slow"], [], ["slow"]]
    with pytest.raises(ValueError, match="not in the sweep"):  # a typo would hide a case
        tiered([1, 2], [3])
    with pytest.raises(ValueError, match="at least one fast case"):
        tiered([1, 2], lambda c: False)
