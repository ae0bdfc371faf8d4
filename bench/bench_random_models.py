"""Randomized equivalence against eager PyTorch: N random models x P x schedule x recompute.

Run: ``python bench/bench_random_models.py`` (2,000 cases; ``--cases``, ``--start`` to change;
``--all`` also generates the features in ``PENDING_FIXES``, whose bugs are being fixed;
``--only FEATURE`` generates only cases that use FEATURE; ``--quiet`` omits the programs).

Each case is ``tests/support/random_models.py``'s ``Case.generate(seed)``, checked by ``run_case``:
loss, every gradient and the eval output against eager, and with dropout active the pipeline
against its one-stage self. Every failing case prints its seed, its program and its error; the
table counts, per feature, the cases that used it and how many of them failed (a failing case
counts under every feature it uses).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support import random_models as rm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--all", action="store_true", help="also generate PENDING_FIXES features")
    ap.add_argument("--only", help="run only the seeds whose case uses this feature")
    ap.add_argument("--quiet", action="store_true", help="print failing seeds, not programs")
    args = ap.parse_args()
    enabled = frozenset(rm.FEATURES) if args.all else rm.ENABLED
    console = Console()

    used: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    failures: list[int] = []
    unexplained: list[int] = []  # failing cases that use no pending feature
    ran = 0
    t0 = time.perf_counter()
    seed = args.start
    while ran < args.cases:
        case = rm.Case.generate(seed, enabled)
        seed += 1
        if args.only and args.only not in case.features:
            continue
        ran += 1
        report = rm.check_case(case)
        features = case.features  # after P was lowered to what the model allows
        used.update(features)
        if report is not None:
            failures.append(case.seed)
            failed.update(features)
            if not features & set(rm.PENDING_FIXES):
                unexplained.append(case.seed)
            errors[case.error or "?"] += 1
            console.print(f"[red]FAIL[/red] seed {case.seed}", highlight=False)
            if not args.quiet:
                print(report, flush=True)
    elapsed = time.perf_counter() - t0

    table = Table(title=f"{ran} random cases (seeds {args.start}..{seed - 1}), "
                        f"{len(failures)} failed, {elapsed:.0f} s")
    for col in ("feature", "cases", "failed", "status"):
        table.add_column(col, justify="left" if col in ("feature", "status") else "right")
    for feature in rm.FEATURES:
        status = "pending fix" if feature in rm.PENDING_FIXES else ""
        if feature not in enabled:
            status = ("not checked (pending fix)" if feature in rm.OBSERVED else
                      "not generated (pending fix)")
        table.add_row(feature, str(used[feature]), str(failed[feature]), status)
    console.print(table)
    if errors:
        err = Table(title="failures by error")
        err.add_column("count", justify="right")
        err.add_column("error (first line, numbers elided)")
        for line, n in errors.most_common():
            err.add_row(str(n), line)
        console.print(err)
    print(f"failing seeds: {failures}")
    print(f"failing cases that use no pending feature: {len(unexplained)} {unexplained}")
    return 1 if failures else 0


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_random_models.py"):
        code = main()
    sys.exit(code)
