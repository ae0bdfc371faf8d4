"""fx capture records each node's source lines itself: the user's frames only, and without
fx's ``record_stack_traces``, whose frame filter imports torch._dynamo, torch._inductor and
torch.export on first use (~2 s of a restarted job's compile)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from varuna_fx.capture.trace_fx import Tracer

SRC = str(Path(__file__).parents[2] / "src")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.seq(x)  # LINE: seq
        return self.out(hidden).sum(dim=0)  # LINE: out


def test_nodes_point_at_the_users_line_without_torch_frames() -> None:
    graph = Tracer().trace(Net())
    traces = {n.name: n.stack_trace for n in graph.nodes}
    assert not traces["x"] and not traces["output"]  # made outside forward
    for name, marker in (("seq_0", "seq"), ("seq_1", "seq"), ("out", "out"), ("sum_1", "out")):
        lines = traces[name].splitlines()
        assert lines[-2].strip().startswith(f'File "{__file__}"') and "in forward" in lines[-2]
        assert lines[-1].strip().endswith(f"# LINE: {marker}"), traces[name]
        assert "/torch/" not in traces[name] and "capture/trace.py" not in traces[name]


@pytest.mark.slow
def test_fx_capture_imports_no_compiler_stack() -> None:
    code = """
import sys
import torch
from varuna_fx.capture.trace_fx import Tracer
from varuna_fx.examples import GPT, GPTConfig
Tracer().trace(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)))
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "torch.export._trace")
             if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "PATH": ""},
                         timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
