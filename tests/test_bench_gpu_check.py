"""bench/gpu_check.py (issue 28 item 5) runs on a machine without a GPU: the same checks on the
CPU, at the tiny size, saying so; its JSON holds every case, equal to eager."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_gpu_check_runs_on_the_cpu_and_writes_its_json(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check

    code = gpu_check.main(["--device", "cpu", "--size", "tiny", "--steps", "1", "--warmup", "0",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "running the same checks on the CPU" in out and "not measured on CPU" in out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and report["device"] == "cpu" and not report["memory_measured"]
    cases = {(r["precision"], str(r["recompute"])) for r in report["results"]}
    assert cases == {("fp32", "auto"), ("fp32", "True"), ("bf16", "auto"), ("bf16", "True")}
    for r in report["results"]:
        assert r["error"] is None and r["equal"], r
        assert r["stages"] == 4 and len(r["memory_planned"]) == 4
        assert r["step_eager"] > 0 and r["step_pipeline"] > 0
