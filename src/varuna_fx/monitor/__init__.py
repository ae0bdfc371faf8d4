"""Watching a run: ``vf.Monitor`` (``monitor.py``) with its sinks, live line, MFU and
charts."""
