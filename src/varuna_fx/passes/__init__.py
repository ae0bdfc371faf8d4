"""Compiler passes, one per file, each a function over an ``fx.GraphModule`` (or, for the
partitioner, a pure function over cost arrays). ``varuna_fx.api.compile`` runs them in order."""
