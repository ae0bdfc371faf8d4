"""Stages as code: each stage's ``fx.Graph`` -> a readable Python module holding its parameters
(``stage_module``), its costs totalled for the plan's table (``stage_totals``), and the stages
of another train/eval mode (``modes``)."""
