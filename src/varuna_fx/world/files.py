"""Small files written whole or not at all (the on-disk caches)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(directory: Path, name: str, text: str) -> None:
    """Write ``directory/name`` so a reader sees the old file or the whole new one: the text
    goes to a name no other writer uses (ranks, threads, machines sharing a home directory),
    then is renamed over ``name``. Creates ``directory``; raises ``OSError`` when it cannot."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
