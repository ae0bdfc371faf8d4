"""bench/RESULTS.md as current tables (issue 39 item 7): every benchmark script has its own block
there and takes ``--write``, and writing a block changes nothing outside it. Fast tier: text only,
nothing launched."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import results  # noqa: E402

# scripts with a main that make no table: what they make instead
NO_TABLE = {"chart_defaults.py": "draws bench/figures/defaults.png from bench_defaults.py's JSON"}


def scripts() -> list[str]:
    """bench/'s runnable scripts (a ``__main__`` block), helpers without one left out."""
    return sorted(p.name for p in BENCH.glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text() and p.name not in NO_TABLE)


def test_every_bench_script_has_its_block_in_results() -> None:
    doc = results.RESULTS.read_text()
    names = results.block_names(doc)
    assert len(names) == len(set(names)), "a block appears twice in RESULTS.md"
    owners = {name.split(" ")[0] for name in names}
    missing = [s for s in scripts() if s not in owners]
    assert not missing, (f"no block in bench/RESULTS.md for {missing}: add the script's section "
                         f"with its two markers ({results.markers(missing[0])})")
    unknown = sorted(owners - set(scripts()))
    assert not unknown, f"RESULTS.md has blocks of scripts bench/ does not hold: {unknown}"


def test_every_bench_script_takes_write() -> None:
    without = [s for s in scripts()
               if "recorded(" not in (text := (BENCH / s).read_text()) and '"--write"' not in text]
    assert not without, f"{without}: run the main under results.recorded or parse --write"


DOC = """# title

## one

notes before
<!-- a.py: begin (replaced by --write) -->

old a

<!-- a.py: end -->
notes after a

<!-- b.py part: begin (replaced by --write) -->

old b

<!-- b.py part: end -->
tail
"""


def test_a_block_is_replaced_and_nothing_else() -> None:
    new = results.replace_block(DOC, "a.py", "| new | table |\n")
    assert new == DOC.replace("old a", "| new | table |")
    assert results.replace_block(new, "a.py", "old a") == DOC  # and back, byte for byte
    assert results.block_names(new) == ["a.py", "b.py part"]
    other = results.replace_block(DOC, "b.py part", "new b")
    assert other.split("<!-- b.py part: begin")[0] == DOC.split("<!-- b.py part: begin")[0]
    assert other.endswith("<!-- b.py part: end -->\ntail\n")


def test_a_new_block_is_appended_and_a_broken_one_refused() -> None:
    new = results.replace_block(DOC, "c.py", "c's table")
    assert new.startswith(DOC.rstrip("\n")) and new.endswith(
        "<!-- c.py: begin (replaced by --write) -->\n\nc's table\n\n<!-- c.py: end -->\n")
    broken = DOC.replace("<!-- a.py: end -->", "")
    with pytest.raises(ValueError, match="no '<!-- a.py: end -->'"):
        results.replace_block(broken, "a.py", "x")


def test_recorded_writes_what_the_run_printed_only_with_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--steps", "3"])
    with results.recorded("a.py", path=path):
        print("a run without --write")
    assert path.read_text() == DOC
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--steps", "3", "--write"])
    with results.recorded("a.py", path=path):
        assert sys.argv == ["bench_x.py", "--steps", "3"]  # the script's parser never sees it
        print("| step | 1.0 s |")
    text = path.read_text()
    assert "a run without --write" in capsys.readouterr().out
    assert re.search(r"Command: `python bench/a.py --steps 3 --write`\. \d{4}-\d\d-\d\d, \d+-core",
                     text)
    assert "```\n| step | 1.0 s |\n```" in text and "old a" not in text
    assert text.split("<!-- a.py: end -->")[1] == DOC.split("<!-- a.py: end -->")[1]
