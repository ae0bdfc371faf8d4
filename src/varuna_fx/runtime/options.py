"""The running part of ``vf.compile``'s options: what the pipeline and its runtimes read.

:class:`RunOptions` is taken whole by ``api.make_pipeline``, the ``Pipeline`` constructor
and both runtimes (``local.py``, ``distributed.py``), which read the fields they use; nothing
between them passes an option by name. ``vf.compile`` makes it from its keywords
(``options.py: CompileOptions`` is this part and the planning part, ``planner/options.py``).

A new running option is one field here (with its check) and one keyword of ``vf.compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import VarunaFxError
from ..planner.options import check_count, check_flag, check_name, short
from ..world.where import resolve_timeout
from .precision import check_precision


@dataclass(frozen=True)
class RunOptions:
    """How the compiled pipeline runs (docs/API.md has each option's meaning)."""

    loss_fn: Callable[..., Any] | None = None
    offload_stash: bool = False
    precision: str = "fp32"
    timeout: float | None = None  # None: $VARUNA_FX_TIMEOUT or the default, when waited on
    shard_optimizer: bool | str = "auto"  # ZeRO-1 over each stage's D replicas
    # given: each replica's step takes exactly global_batch_size / D samples
    global_batch_size: int | None = None
    # pass dumps (None: $VARUNA_FX_DUMP): a model run in another train/eval mode is compiled
    # again at run time (codegen/modes.py), and dumps there too
    dump: str | None = None
    # compile_stages on: True compiles each stage at its first call, the first step waiting
    # for it; False (the default) compiles in the background, the stage eager until a step
    # boundary after its compile (runtime/background_compile.py)
    compile_wait: bool = False

    def __post_init__(self) -> None:
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise VarunaFxError(f"loss_fn={short(self.loss_fn)} is not callable: pass a "
                                "function loss_fn(output, target) -> 0-d tensor, or None")
        check_name("precision", self.precision, "fp32")
        check_count("global_batch_size", self.global_batch_size, "samples per optimizer step")
        check_flag("offload_stash", self.offload_stash)
        check_flag("compile_wait", self.compile_wait)
        check_flag("shard_optimizer", self.shard_optimizer, (True, False, "auto"))
        resolve_timeout(self.timeout)  # the keyword or $VARUNA_FX_TIMEOUT: wrong values fail here
        check_precision(self.precision)  # before capture and planning, not after

    @property
    def seconds(self) -> float:
        """How long any wait on a peer may take: ``timeout``, else $VARUNA_FX_TIMEOUT, else
        the default."""
        return resolve_timeout(self.timeout)

    def replica_batch(self, data_parallel: int) -> int | None:
        """The samples each replica's step must take (None: any batch the micro-batch size
        divides)."""
        return None if self.global_batch_size is None else self.global_batch_size // data_parallel
