"""Executors: one process (``local``) and torch.distributed (``distributed``)."""
