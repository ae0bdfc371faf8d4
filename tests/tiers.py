"""The two test tiers.

``pytest -m "not slow"`` is the fast tier: a quick check (its time: README, "Run the tests")
that still runs every schedule, P in {1, 2, 3}, both tracers, a few random models, one small
Hugging Face model, the error catalogue and the codegen goldens. ``pytest`` runs everything (CI).

A sweep keeps one test function for both tiers: ``tiered`` marks every parametrization outside
its fast slice ``slow``, so the full run still covers every case.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

slow = pytest.mark.slow


def tiered(cases: Iterable[Any], fast: Callable[[Any], bool] | Iterable[Any],
           ids: Callable[[Any], str] | None = None) -> list[Any]:
    """``cases`` as pytest parameters, those not in ``fast`` (a predicate or a collection of
    cases) marked ``slow``. A tuple case is the argument list of a multi-name parametrize."""
    cases = list(cases)
    keep = fast if callable(fast) else set(fast).__contains__
    if not callable(fast):
        unknown = set(fast) - set(cases)
        if unknown:  # a typo would silently move a case to the slow tier
            raise ValueError(f"fast cases that are not in the sweep: {sorted(map(str, unknown))}")
    if not any(map(keep, cases)):
        raise ValueError("a tiered sweep needs at least one fast case")
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, id=ids(case) if ids else None,
                                   marks=() if keep(case) else slow))
    return params


def product(*axes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Every combination, in the order stacked ``parametrize`` decorators would give."""
    return list(itertools.product(*axes))
