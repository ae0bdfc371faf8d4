"""bench/RESULTS.md as current tables: each benchmark owns one block of it and replaces only that.

A block is the text between two markers named after the script (and, for a script that makes
several tables, a part: ``bench_train.py resume``)::

    <!-- bench_NAME.py: begin (replaced by --write) -->
    ...the command, the date and machine, the table...
    <!-- bench_NAME.py: end -->

Every benchmark script takes ``--write``: without it a run only prints; with it the run's
tables replace the script's own block and nothing else in the file (a section's heading and the
notes around its markers stay). History is not kept in the current table: an earlier run lives
in git (``git log -p bench/RESULTS.md``) or, when a comparison is worth reading, in a dated
report under ``bench/reports/``.

Scripts that format their own tables call :func:`write_block`; the others wrap their main in
:func:`recorded`, which keeps what the run prints and writes it as the block, under a line with
the command, the date and the machine (:func:`stamp`).
"""

from __future__ import annotations

import datetime
import io
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name`` (``bench_x.py`` or ``bench_x.py part``)."""
    return f"<!-- {name}: begin (replaced by --write) -->", f"<!-- {name}: end -->"


def replace_block(doc: str, name: str, text: str) -> str:
    """``doc`` with block ``name``'s content replaced by ``text`` (appended at the end, markers
    and all, if the block is not there yet); every other byte of ``doc`` stays."""
    begin, end = markers(name)
    block = f"{begin}\n\n{text.strip()}\n\n{end}"
    if begin in doc:
        head, rest = doc.split(begin, 1)
        if end not in rest:
            raise ValueError(f"RESULTS.md: block {name!r} has a begin marker but no {end!r}; "
                             f"restore the end marker before writing")
        return head + block + rest.split(end, 1)[1]
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def block_names(doc: str) -> list[str]:
    """The names of the blocks in ``doc``, in order (those with both markers)."""
    names = []
    for line in doc.splitlines():
        line = line.strip()
        if line.startswith("<!-- ") and line.endswith(": begin (replaced by --write) -->"):
            name = line[len("<!-- "):-len(": begin (replaced by --write) -->")]
            if markers(name)[1] in doc:
                names.append(name)
    return names


def write_block(name: str, text: str, *, path: Path = RESULTS) -> None:
    """Replace block ``name`` of ``path`` (bench/RESULTS.md) with ``text``."""
    path.write_text(replace_block(path.read_text(), name, text))


def machine() -> str:
    """A one-line note on what ran: cores, processor, OS, Python and (if loaded) torch."""
    note = f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, " \
           f"Python {platform.python_version()}"
    torch = sys.modules.get("torch")
    if torch is not None:
        note += f", torch {torch.__version__}"
    return note


def stamp(command: str) -> str:
    """``Command: `...`. <UTC date>, <machine>.``: the line a block starts with."""
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"Command: `{command}`. {day}, {machine()}."


class _Tee(io.TextIOBase):
    """What is written goes to ``out`` and is kept."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextmanager
def recorded(script: str, part: str | None = None, *, path: Path = RESULTS) -> Iterator[None]:
    """Run the body (a script's main); with ``--write`` on the command line (taken off
    ``sys.argv`` first, so the script's own parser never sees it) what it printed becomes block
    ``script`` (or ``script part``) under :func:`stamp`'s line. Nothing is written if the body
    raises. Without ``--write`` this does nothing at all."""
    if "--write" not in sys.argv[1:]:
        yield
        return
    args = [a for a in sys.argv[1:] if a != "--write"]
    sys.argv[1:] = args
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = tee.out
    command = " ".join(["python", f"bench/{script}", *args, "--write"])
    printed = tee.kept.getvalue().strip("\n").rstrip()  # a centred title keeps its indent
    write_block(script if part is None else f"{script} {part}",
                f"{stamp(command)}\n\n```\n{printed}\n```", path=path)
