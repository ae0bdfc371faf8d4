"""The seams between layers stay typed (issue 39): a lower layer names what it reads of a
pipeline, runtime or re-plan as a protocol instead of taking ``Any`` and probing it with
``getattr``, and no object writes another's private attributes. Parsed with ast."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "src" / "varuna_fx"
HIGHER = {"pipe", "runtime", "replan"}  # parameters that stand for a higher layer's object
# private attributes of torch's own objects that torch offers no other way to set
# torch's own hooks that have no public form (each written where torch offers nothing else, and
# guarded for a torch without it): fx's codegen, pipelining's split marker, and the step of
# torch.export that fakes parameters (capture/trace_export.weights_faked_on)
TORCH_PRIVATE = {"_codegen", "_pipe_split", "_fakify_params_buffers"}


def _trees() -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text()))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_higher_layer_object_is_typed_any() -> None:
    found = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.arg in HIGHER and node.annotation is not None \
                    and ast.unparse(node.annotation) == "Any":
                found.append(f"{name}:{node.lineno}: {node.arg}: Any")
    assert not found, "name what is read as a protocol:\n" + "\n".join(found)


def test_no_runtime_is_probed_with_getattr() -> None:
    found = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args and \
                    "runtime" in ast.unparse(node.args[0]):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "declare it on runtime/step.Runtime:\n" + "\n".join(found)


def test_no_object_writes_another_objects_private_attributes() -> None:
    found = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if isinstance(t, ast.Attribute) and t.attr.startswith("_") and \
                        not t.attr.startswith("__") and t.attr not in TORCH_PRIVATE and \
                        not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    found.append(f"{name}:{t.lineno}: {ast.unparse(t)}")
    assert not found, "give the owner a method instead:\n" + "\n".join(found)


def test_the_morph_has_no_face_mixin() -> None:
    assert not (PACKAGE / "morph" / "face.py").exists()
    tree = ast.parse((PACKAGE / "pipeline.py").read_text())
    (pipeline,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline"]
    assert not pipeline.bases  # everything depending on the layout: Pipeline._set_layout
