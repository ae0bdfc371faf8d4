"""The documentation a newcomer reads stands alone, stays complete and runs: every public name
is in docs/API.md, nothing points outside the repository, the README's test command is CI's,
every Python block of README.md and docs/ runs as written (unless fenced ```python no-run) and
every command line they show parses."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
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


# -- the docs' code runs as written -------------------------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a fence's info string: the language, then tags. Python blocks run unless tagged "no-run"
# (signatures, files or jobs of several processes the page does not have); "slow" ones (a real
# training run) only in the slow tier. Other languages never run, but every `varuna-fx ...`
# command in them must parse.
LANGUAGES = {"python", "bash", "", "text", "toml", "json"}
TAGS = {"no-run", "slow"}
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    tags: frozenset[str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, *tags = match.group(1).split() or [""]
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, language, frozenset(tags), match.group(2)))
    return found


def test_every_code_block_is_of_a_known_kind() -> None:
    """A misspelt tag (``no_run``) would make a block run, or a language nothing checks."""
    for page in PAGES:
        for block in code_blocks(page):
            assert block.language in LANGUAGES, f"{block.where}: language {block.language!r}"
            assert block.tags <= TAGS, f"{block.where}: unknown tags {set(block.tags - TAGS)}"
            assert not block.tags or block.language == "python", block.where


def scripts_own_parts(tmp: Path) -> dict[str, Any]:
    """What the docs leave to the reader's script (docs/API.md lists them), small: a 2-block
    GPT with the demo's vocabulary and sequence length, dropout on (so the per-sample masks'
    claims are not trivially true), batches of 8, global batches of 64 and a dataset of two."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, dropout=0.1)

    def build_model() -> GPT:
        return GPT(config)

    def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab_size, (64, config.block_size + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    tokens, targets = (t[:8] for t in global_batch(-1))
    stream = torch.randint(0, config.vocab_size, (2 * 64 * config.block_size + 1,),
                           generator=torch.Generator().manual_seed(1))
    return {
        "dataset": vf.TokenDataset(stream, seq_len=config.block_size), "epochs": 1,
        "build_model": build_model, "model": build_model(), "tokens": tokens,
        "targets": targets, "example_inputs": (tokens,), "loss_fn": lm_loss,
        "global_batch": global_batch, "global_batches": [global_batch(s) for s in range(2)],
        "ckpt_dir": str(tmp / "checkpoints"), "total_steps": 2, "steps": 2, "every": 1,
    }


def run_page(page: Path, tmp: Path, slow: bool) -> int:
    """Run the page's Python blocks in order in one namespace (as a reader pasting them into
    one session would), given the script's own parts; the "slow" ones only if ``slow``.
    Returns how many ran."""
    namespace = scripts_own_parts(tmp)
    ran = 0
    for block in code_blocks(page):
        if block.language != "python" or "no-run" in block.tags or \
                ("slow" in block.tags and not slow):
            continue
        try:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102
        except Exception as exc:  # noqa: BLE001 - any failure is the block's
            pytest.fail(f"{block.where}: the block raised {type(exc).__name__}: {exc}\n"
                        f"{block.code}\n(a block that is not meant to run is fenced "
                        "```python no-run)", pytrace=False)
        ran += 1
    return ran


# pages whose blocks compile and train enough to pass the fast tier's CPU limit (API.md: a
# compile, a monitored run and its charts, 3-5 s of CPU): the full suite runs them
HEAVY_PAGES = {"API.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in HEAVY_PAGES
                                  else p for p in PAGES], ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run_in_order(page: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Until issue 28 the docs' preemption loop called ``pipe.step(*batch_for(step, pipe))``,
    which passes the target positionally."""
    monkeypatch.chdir(tmp_path)  # what the blocks write (charts, checkpoints) lands here
    ran = run_page(page, tmp_path, slow=False)
    assert ran or not any(b.language == "python" for b in code_blocks(page))


SLOW_PAGES = [p for p in PAGES if any("slow" in b.tags for b in code_blocks(p))]


@pytest.mark.slow  # a training run of a few hundred steps
@pytest.mark.parametrize("page", SLOW_PAGES, ids=lambda p: p.name)
def test_a_page_with_slow_blocks_runs_whole(page: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runnable = [b for b in code_blocks(page) if b.language == "python" and "no-run" not in b.tags]
    assert run_page(page, tmp_path, slow=True) == len(runnable)


def cli_commands(text: str) -> list[str]:
    """Every ``varuna-fx ...`` command a page shows: in code blocks (continued lines joined,
    comments dropped) and in inline code."""
    commands = []
    for match in FENCE.finditer(text):
        joined = match.group(2).replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            at = line.find("varuna-fx ")
            if at >= 0 and not line.startswith("pip "):
                commands.append(line[at:])
    commands += re.findall(r"`(varuna-fx [^`]+)`", FENCE.sub("", text))
    return commands


def test_every_command_line_the_docs_show_parses() -> None:
    """Optional parts (``[--json]``) count as given; ``...`` (more of the same) is dropped. A
    renamed or removed option fails here instead of in a reader's shell."""
    from varuna_fx.launch.cli import _subcommand, build_parser, split_at_script
    from varuna_fx.train.config import split_argv

    parser = build_parser()
    checked = 0
    for page in PAGES:
        for command in cli_commands(page.read_text()):
            words = [w for w in shlex.split(command.replace("[", " ").replace("]", " "))
                     if w not in ("...", "|")][1:]
            if len(words) < 2 or words[0] == "COMMAND" or "--help" in words:
                continue  # a command named in prose, or its help
            if words[0] == "train":  # its own flags: every key of its config (train/config.py)
                if "--key" not in words:  # (the synopsis)
                    split_argv([w for w in words[1:] if w != "--print-config"])
                    checked += 1
                continue
            argv, _ = split_at_script(words, _subcommand(parser, "run"))
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{page.name}: `{command}` does not parse", pytrace=False)
            checked += 1
    assert checked >= 10
