"""Build and execute the notebooks from their percent-format sources (nbformat, nbclient,
ipykernel; the dev extras install them).

    python notebooks/make_notebooks.py            # every notebooks/NN_*.py
    python notebooks/make_notebooks.py 03 04      # only those numbers

Each ``NN_name.py`` is jupytext's "percent" format: ``# %%`` starts a code cell and
``# %% [markdown]`` a markdown cell whose lines are ``# ``-prefixed. The executed
``NN_name.ipynb`` (outputs and charts kept) is written next to it and committed;
tests/test_notebooks.py checks that it matches its source and re-runs it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent
_MARKER = re.compile(r"^# %%(?P<rest>.*)$")


def sources() -> list[Path]:
    return sorted(HERE.glob("[0-9][0-9]_*.py"))


def parse(text: str) -> list[tuple[str, str]]:
    """(kind, source) per cell of a percent-format script; text before the first marker is
    dropped (a module docstring, say)."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        match = _MARKER.match(line)
        if match:
            kind = "markdown" if "[markdown]" in match.group("rest") else "code"
            cells.append((kind, []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [re.sub(r"^# ?", "", line) for line in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def build(source: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else
                nbformat.v4.new_code_cell(src) for kind, src in parse(source.read_text())]
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    path = source.with_suffix(".ipynb")
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    wanted = sys.argv[1:]
    for src in sources():
        if not wanted or src.name[:2] in wanted:
            print("wrote", build(src), flush=True)
