"""varuna_fx: compile an unmodified PyTorch model into a balanced, recomputing pipeline.

Public names only; docs/API.md in the repository is the reference.
"""

from .api import compile
from .checkpoint.directory import latest_checkpoint
from .costs.wire import DiLoCo, PowerSGD
from .data.tokens import TokenDataset
from .errors import (
    AllocationError,
    CaptureError,
    CheckpointError,
    DistributedError,
    InputError,
    OptimizerError,
    PartitionError,
    PeerTimeoutError,
    PlanError,
    PretrainedError,
    ScheduleError,
    UninitializedError,
    VarunaFxError,
)
from .init.materialize import materialize
from .init.record import deferred_init
from .init.skip import skip_init
from .ir.rng import per_sample_rng
from .monitor.monitor import Monitor
from .pipeline import Pipeline
from .planner.cluster import Cluster
from .planner.plan import Plan, StageCost

__all__ = [
    "AllocationError",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "DiLoCo",
    "DistributedError",
    "InputError",
    "Monitor",
    "OptimizerError",
    "PartitionError",
    "PeerTimeoutError",
    "Pipeline",
    "Plan",
    "PowerSGD",
    "PlanError",
    "PretrainedError",
    "ScheduleError",
    "StageCost",
    "TokenDataset",
    "UninitializedError",
    "VarunaFxError",
    "compile",
    "deferred_init",
    "latest_checkpoint",
    "materialize",
    "per_sample_rng",
    "skip_init",
]
__version__ = "0.1.0"
