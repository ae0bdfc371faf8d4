"""varuna_fx: compile an unmodified PyTorch model into a balanced, recomputing pipeline.

Public names only; docs/API.md in the repository is the reference.
"""

from .api import compile
from .cluster import Cluster
from .errors import (
    CaptureError,
    DistributedError,
    InputError,
    PartitionError,
    PeerTimeoutError,
    PlanError,
    ScheduleError,
    VarunaFxError,
)
from .pipeline import Pipeline
from .plan import Plan, StageCost

__all__ = [
    "CaptureError",
    "Cluster",
    "DistributedError",
    "InputError",
    "PartitionError",
    "PeerTimeoutError",
    "Pipeline",
    "Plan",
    "PlanError",
    "ScheduleError",
    "StageCost",
    "VarunaFxError",
    "compile",
]
__version__ = "0.1.0"
