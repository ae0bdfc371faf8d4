"""The planner: measured profiles, cost tables, and the search for P, D and micro-batch size.

>>> from varuna_fx.planner import analyze, plan_for
>>> graph = analyze(model, (tokens,))                      # capture + annotate, no stages yet
>>> result = plan_for(graph, vf.Cluster(gpus=64, gpus_per_node=8), global_batch_size=512)
>>> result.best.stages, result.best.data_parallel, result.best.micro_batch_size
"""

from .analyze import Analyzed, analyze, plan_for
from .candidates import Candidate, SearchResult, Space
from .cost_table import CostTable, MeasuredTimes
from .measure import ProfileSettings
from .options import PlanOptions
from .profile import ChunkProfile, Profile
from .resolve import profile_here, resolve_profile
from .search import Planner

__all__ = [
    "Analyzed",
    "Candidate",
    "ChunkProfile",
    "CostTable",
    "MeasuredTimes",
    "PlanOptions",
    "Planner",
    "Profile",
    "ProfileSettings",
    "SearchResult",
    "Space",
    "analyze",
    "plan_for",
    "profile_here",
    "resolve_profile",
]
