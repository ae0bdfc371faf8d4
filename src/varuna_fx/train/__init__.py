"""The trainer behind ``varuna-fx train``: its configuration (``config``), data (``data``), model
(``model``, ``factory``), resume rules (``resume``) and the loop each rank runs (``worker``). The
command's process plumbing (launching, the summary file, exit status, Ctrl-C relay) is
``launch/train.py``."""
