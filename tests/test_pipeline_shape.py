"""The pipeline reads as its stages (graphconv/pipeline.py and its back half, graphconv/verification.py): the
attributes of the objects that run the stages are set once, in __init__, and stages hand each other typed
results (graphconv/stage_results.py), never state left on those objects; no stage takes a scheduling
argument (graphconv/runtime/scheduling.py decides when work runs)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from graphconv import pipeline, verification

STAGE_CLASSES = [(pipeline, "Compiler"), (verification, "Verification")]


def _class(module, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(Path(module.__file__).read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == name)


def _self_assignments(fn: ast.FunctionDef) -> list[str]:
    """`self.X = ...`, `self.X += ...`, `self.X: T = ...` and `with ... as self.X` in a method."""
    found = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else \
            [i.optional_vars for i in node.items if i.optional_vars is not None] if isinstance(node, ast.With) else []
        for t in targets:  # (the report's sections, self.report.X = ..., are the report's own)
            for sub in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    found.append(f"{fn.name}: self.{sub.attr}")
    return found


@pytest.mark.parametrize("module,name", STAGE_CLASSES)
def test_only_init_sets_the_attributes(module, name):
    methods = [f for f in _class(module, name).body if isinstance(f, ast.FunctionDef)]
    assert any(f.name == "__init__" and _self_assignments(f) for f in methods)  # (the walk sees assignments)
    written = [a for f in methods if f.name != "__init__" for a in _self_assignments(f)]
    assert not written, f"stages leave state on {name}: " + ", ".join(written)


@pytest.mark.parametrize("module,name", STAGE_CLASSES)
def test_no_stage_takes_a_scheduling_argument(module, name):
    scheduling_words = ("beside", "cancel", "warm", "overlap", "nice", "ahead", "schedule", "priority", "thread")
    for method, fn in inspect.getmembers(getattr(module, name), inspect.isfunction):
        params = list(inspect.signature(fn).parameters)
        assert not [p for p in params if any(w in p for w in scheduling_words)], f"{name}.{method}{params}"


def test_the_check_can_fail():
    tree = ast.parse("class C:\n    def stage(self):\n        self.left = 1\n        with open(f) as self.f: pass\n"
                     "        self.a, b = 1, 2\n        self.report.status = 'ok'\n")
    fn = tree.body[0].body[0]
    assert _self_assignments(fn) == ["stage: self.left", "stage: self.f", "stage: self.a"]
