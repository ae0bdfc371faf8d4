"""Crafted pickles that run code when loaded, for the tests that checkpoints never do."""

from __future__ import annotations

import builtins
import operator
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata


class RunsCode:
    """Unpickling this calls builtins.exec, which writes ``flag``."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple:
        return builtins.exec, (f"open({str(self.flag)!r}, 'w').write('ran')",)


class Stealthy:
    """Runs the code, then unpickles to the genuine metadata: a plain load succeeds."""

    def __init__(self, flag: Path, genuine: Metadata) -> None:
        self.flag, self.genuine = flag, genuine

    def __reduce__(self) -> tuple:
        return operator.getitem, ((RunsCode(self.flag), self.genuine), 1)
