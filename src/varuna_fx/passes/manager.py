"""The pass list's machinery: named passes, a checker after every one, and dumps of each graph.

``vf.compile`` runs an ordered list of :class:`Pass` objects (``codegen/pass_list.PASS_LIST``).
:func:`run_passes` runs them over one mutable state (a :class:`GraphState`: the compile's
typed ``CompileState``, or the front end's ``FrontState``); after every pass it runs the generic
graph check plus the pass's own checker, and, when ``VARUNA_FX_DUMP=<dir>`` is set (or
``dump=`` is given), writes the graph the pass left as readable code, headed by its provenance
(every graph pass run so far and what each guarantees), the way lightning-thunder writes its
traces. The stage code header names the same list. A step that does not change the graph
(``configure``: ``graph=False``) is checked like the others but neither numbered nor dumped.

The generic check after every pass is ``check_graph`` (fx's lint, and no two nodes sharing a
``NodeInfo``); dumps are ``<dir>/NN_<pass>.py``, each stage's graph after the split.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import torch.fx as fx

from ..ir.nodes import info
from ..world.switches import read
from .check import check_graph
from .split_stages import StageGraph


@dataclass(kw_only=True)
class GraphState:
    """What every pass state holds for the checks and dumps between passes."""

    gm: fx.GraphModule | None = None  # the graph the passes annotate
    stage_graphs: list[StageGraph] | None = None  # split_stages: one graph per stage
    # CPU seconds of each pass run over this state, checks included (bench_plan_llama.py
    # shows them; CPU time, which a loaded machine moves less than wall time)
    seconds: dict[str, float] = field(default_factory=dict)


State = TypeVar("State", bound=GraphState, contravariant=True)


@dataclass(frozen=True)
class Pass(Generic[State]):
    name: str
    guarantees: str  # what holds afterwards (the dump header and ARCHITECTURE.md say it)
    run: Callable[[State], None]
    check: Callable[[State], None] | None = None  # invariants after this pass
    graph: bool = True  # False: a step that leaves the graph as it is (not numbered, no dump)

    def __str__(self) -> str:
        return self.name


def graph_passes(passes: Sequence[Pass]) -> list[str]:
    """The names of the passes that rewrite or annotate the graph, numbered as the dumps are."""
    return [p.name for p in passes if p.graph]


def substitute(passes: Sequence[Pass], **replace: Pass | None) -> tuple[Pass, ...]:
    """``passes`` with the pass of each given name replaced (None: left out)."""
    unknown = set(replace) - {p.name for p in passes}
    assert not unknown, f"no passes named {sorted(unknown)} in the list"
    kept = (replace.get(p.name, p) for p in passes)
    return tuple(p for p in kept if p is not None)


def dump_dir(dump: str | os.PathLike[str] | None = None) -> Path | None:
    """Where to write pass dumps: ``dump``, else ``$VARUNA_FX_DUMP``, else nowhere."""
    target = dump if dump is not None else read("VARUNA_FX_DUMP")
    return Path(target) if target is not None else None


def run_passes(passes: Sequence[Pass[State]], state: State, *, dump: Path | None = None,
               done: Sequence[Pass] = ()) -> None:
    """Run ``passes`` in order over ``state``, checking after each; ``done``: passes already
    applied to ``state.gm`` (the cached front end), for the provenance of the dumps."""
    history = [p for p in done if p.graph]
    with collector_paused():
        _run(passes, state, dump, history)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector does not run while passes run (``gc.disable``), and is
    turned back on after.

    A compile allocates millions of small objects (nodes, annotations, sympy expressions), and
    each full collection walked every object of the process, the model's and earlier graphs'
    included: on the 70B Llama that was 0.5-0.8 of the 2.1 CPU s of a warm re-plan and about
    1.5 s of a 7B's cold compile (bench/RESULTS.md, "Planning a 7B and a 70B Llama"); peak RSS
    was the same with it off (a compile's garbage is mostly freed by reference counts).
    (``gc.freeze`` would keep collecting what the passes make, but counting frozen objects to
    leave a user's freeze alone costs as much as a collection.) Nothing where the collector is
    off already."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _run(passes: Sequence[Pass[State]], state: State, dump: Path | None,
         history: list[Pass]) -> None:
    for p in passes:
        start = time.process_time()
        p.run(state)
        if state.gm is not None:
            check_graph(state.gm)
        if p.check is not None:
            p.check(state)
        state.seconds[p.name] = state.seconds.get(p.name, 0.0) + time.process_time() - start
        if p.graph:
            history.append(p)
            if dump is not None:
                write_dump(dump, history, state)


def write_dump(directory: Path, history: Sequence[Pass], state: GraphState) -> Path:
    """``<dir>/<NN>_<pass>.py``: provenance, then the graph (each stage's after split_stages)
    with one comment per node giving its annotations."""
    directory.mkdir(parents=True, exist_ok=True)
    last = history[-1]
    lines = [f"# varuna_fx pass dump: after {last.name} (pass {len(history)} of the list)",
             "# provenance -- passes applied, in order:"]
    lines += [f"#   {k + 1}. {p.name}: {p.guarantees}" for k, p in enumerate(history)]
    graphs: list[tuple[str, fx.Graph]] = []
    if state.stage_graphs is not None:
        graphs = [(f"stage {sg.spec.index}", sg.graph) for sg in state.stage_graphs]
    elif state.gm is not None:
        graphs = [("whole model", state.gm.graph)]
    for title, graph in graphs:
        lines += ["", f"# ---- {title} ----", describe_graph(graph)]
    path = directory / f"{len(history):02d}_{last.name}.py"
    path.write_text("\n".join(lines) + "\n")
    return path


def describe_graph(graph: fx.Graph) -> str:
    """The graph's Python source with a comment above each node: its annotations."""
    notes = {n.name: _note(n) for n in graph.nodes}
    out = []
    for line in graph.python_code(root_module="self").src.splitlines():
        name = line.strip().split(" ", 1)[0].split(":", 1)[0]
        note = notes.get(name)
        if note and " = " in line:
            out.append(f"    # {note}")
        out.append(line)
    return "\n".join(out).strip("\n")


def _note(node: fx.Node) -> str:
    meta = node.meta.get("varuna")
    if meta is None:
        return ""
    meta = info(node)
    parts = [str(t) for t in meta.outputs[:1]]
    if meta.fwd_flops.per_sample or meta.fwd_flops.const:
        parts.append(f"fwd {meta.fwd_flops.expr} FLOP")
    if meta.params:
        parts.append(f"reads {', '.join(meta.params)}")
    if meta.replicable:
        parts.append("replicable")
    if meta.stage is not None:
        parts.append(f"stage {meta.stage}")
    if meta.random:
        parts.append("random")
    return "  ".join(parts)
