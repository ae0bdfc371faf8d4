"""The documentation a newcomer reads stands alone and stays complete: every public name is in
docs/API.md, nothing points outside the repository, and the README's test command is CI's."""

from __future__ import annotations

import re
from pathlib import Path

import varuna_fx as vf
from varuna_fx.pipeline import Pipeline

ROOT = Path(__file__).parent.parent
API = (ROOT / "docs" / "API.md").read_text()
README = (ROOT / "README.md").read_text()
INTERNAL = {"assemble"}  # Pipeline.assemble: the output assembler, used by the runtimes


def test_every_public_name_is_in_the_api_reference() -> None:
    for name in vf.__all__:
        assert re.search(rf"\bvf\.{name}\b", API), f"vf.{name} is not in docs/API.md"
    for name in dir(Pipeline):
        if not name.startswith("_") and name not in INTERNAL:
            assert f"pipe.{name}" in API, f"pipe.{name} is not in docs/API.md"


def test_docs_never_send_readers_outside_the_repository() -> None:
    texts = {path: path.read_text() for path in [ROOT / "README.md", ROOT / "ARCHITECTURE.md",
                                                 *(ROOT / "docs").glob("*.md"),
                                                 ROOT / "src" / "varuna_fx" / "__init__.py"]}
    for path, text in texts.items():
        assert "shared/" not in text and "../" not in text, path
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        if not link.startswith("http") and link != "docs/checkpoints.md":  # helper ckpt adds it
            assert (ROOT / link).exists(), link


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert f"&& {ci[-1]}\n```" in README  # the pytest line, after the same installs
    for install in ("pip install --quiet torch==2.13.0", 'pip install --quiet -e ".[dev]"'):
        assert any(install in line for line in ci)
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]" && ' + ci[-1] in README


def test_architecture_is_a_map_of_every_module_in_one_line_rows() -> None:
    """ARCHITECTURE.md's layer diagram names every module of the package, and its rows stay one
    line each (the detail lives in the module docstrings)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    entries: list[str] = []
    for line in block.splitlines():
        if line.strip():
            if line.startswith(" ") and entries:
                entries[-1] += " " + line.strip()
            else:
                entries.append(line)
    package = ROOT / "src" / "varuna_fx"
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" and path.parent != package:
            continue
        folder = "" if path.parent == package else f"{path.parent.name}/"
        name = path.stem
        assert any((folder in entry or not folder) and re.search(rf"\b{name}\b", entry)
                   for entry in entries), f"{folder}{name} is not in ARCHITECTURE.md's layers"
    long = [line[:60] for line in text.splitlines() if len(line) > 240]
    assert not long, f"ARCHITECTURE.md rows over 240 characters: {long}"
