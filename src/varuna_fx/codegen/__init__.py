from .stage_module import Stage, build_stage, run_code

__all__ = ["Stage", "build_stage", "run_code"]
