"""Moved to ``varuna_fx.rng`` (generated stage code calls ``seed_node``, so split_stages needs
it below the runtime); kept so existing imports keep working."""

from ..rng import rng_context, seed_node

__all__ = ["rng_context", "seed_node"]
