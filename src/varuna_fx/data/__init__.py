"""Data for training: the global sample order, this replica's share of each global batch, a
position any layout resumes (``loader.py``, ``sampler.py``), and token windows
(``tokens.py``)."""

from .loader import GlobalBatchLoader
from .sampler import GlobalBatchSampler
from .tokens import TokenDataset

__all__ = ["GlobalBatchLoader", "GlobalBatchSampler", "TokenDataset"]
