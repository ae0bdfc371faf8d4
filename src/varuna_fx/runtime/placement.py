"""Moved to ``varuna_fx.placement`` (the plan holds a Placement, and the plan sits below the
runtime); kept so existing imports keep working."""

from ..placement import Placement, check_world_size

__all__ = ["Placement", "check_world_size"]
