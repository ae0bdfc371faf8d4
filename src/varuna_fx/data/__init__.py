"""Data for training: the global sample order, this replica's share of each global batch, a
position any layout resumes (``loader.py``, ``sampler.py``), and token windows
(``tokens.py``)."""
