"""The one table of switches (``world/switches.py``): docs/API.md's table is it, no other module
reads a ``VARUNA_FX_*`` variable, every kind reads through the one parser, and the in-place
launcher's variables travel as one record."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import varuna_fx as vf
from varuna_fx.world.switches import SWITCHES, WorkerEnv, read

ROOT = Path(__file__).parent.parent.parent
PACKAGE = ROOT / "src" / "varuna_fx"


def test_the_api_reference_table_is_the_switch_table() -> None:
    text = (ROOT / "docs" / "API.md").read_text().split("## Environment variables", 1)[1]
    rows = re.findall(r"^\| `(VARUNA_FX_\w+)` \| (\w+) \| (.+?) \| (.+) \|$",
                      text.split("\n## ", 1)[0], re.MULTILINE)
    expected = [(s.name, s.kind, f"`{s.default}`" if s.default else "unset",
                 s.meaning + (" (*launcher*)" if s.launcher else ""))
                for s in SWITCHES.values()]
    assert rows == expected


def _env_reads(path: Path) -> list[str]:
    """``os.environ.get(...)``, ``os.environ[...]`` and ``os.getenv(...)`` of a VARUNA_FX_*
    name or of a ``*ENV`` constant, in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        if key is None:
            continue
        name = ast.unparse(key)
        if "VARUNA_FX_" in name or name.endswith("ENV"):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_table_reads_a_switch() -> None:
    reads = [r for path in sorted(PACKAGE.rglob("*.py")) if path.name != "switches.py"
             for r in _env_reads(path)]
    assert not reads, "read these through world/switches.read:\n" + "\n".join(reads)
    named = set(re.findall(r"VARUNA_FX_[A-Z_]+", "\n".join(
        p.read_text() for p in PACKAGE.rglob("*.py"))))
    assert named <= set(SWITCHES), f"undeclared switches: {sorted(named - set(SWITCHES))}"


def test_each_kind_reads_through_the_one_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert read("VARUNA_FX_TIMEOUT") == 300.0 and read("VARUNA_FX_DUMP") is None
    assert read("VARUNA_FX_JOB") == "varuna-fx" and read("VARUNA_FX_MAX_WORLD") == 1 << 30
    assert (read("VARUNA_FX_CACHE_MODE"), read("VARUNA_FX_PLAN_CACHE"),
            read("VARUNA_FX_GRAPH_CACHE"), read("VARUNA_FX_PREPLAN")) == ("disk",) * 3 + ("auto",)
    for value, mode in (("0", "off"), (" Memory ", "memory"), ("no", "off"), ("", "disk"),
                        ("anything", "disk")):
        monkeypatch.setenv("VARUNA_FX_PLAN_CACHE", value)
        assert read("VARUNA_FX_PLAN_CACHE") == mode, value
    monkeypatch.setenv("VARUNA_FX_GRAPH_CACHE", "OFF")
    assert read("VARUNA_FX_GRAPH_CACHE") == "off"
    monkeypatch.setenv("VARUNA_FX_PREPLAN", "yes")
    assert read("VARUNA_FX_PREPLAN") == "on"
    monkeypatch.setenv("VARUNA_FX_HEARTBEAT_WINDOW", "0.5")
    assert read("VARUNA_FX_HEARTBEAT_WINDOW") == 0.5
    monkeypatch.setenv("VARUNA_FX_OPPORTUNISTIC_FORWARD", "sometimes")
    with pytest.raises(vf.DistributedError, match="'sometimes' is not one of auto, on, off"):
        read("VARUNA_FX_OPPORTUNISTIC_FORWARD")


def test_the_launcher_record_travels_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert WorkerEnv.read() is None  # no store: no in-place job
    worker = WorkerEnv(store="10.0.0.1:29400", job="run7", member="node.12.0.0", min_world=2,
                       max_world=8)
    for key, value in worker.environ().items():
        monkeypatch.setenv(key, value)
    assert WorkerEnv.read() == worker
    monkeypatch.delenv("VARUNA_FX_MEMBER")
    assert WorkerEnv.read() == WorkerEnv(store="10.0.0.1:29400", job="run7", min_world=2,
                                         max_world=8)
