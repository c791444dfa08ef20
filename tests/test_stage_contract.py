"""The stages of a compile hand each other typed results, never attributes. An attribute of a stage object is
set once, in its __init__, so no stage can write a fact that a later stage reads from the object. (The report
is the one shared record: stages write their own sections of it, which is not an attribute of the stage.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The classes whose methods are a compile's stages.
STAGE_CLASSES = {
    "graphconv/pipeline.py": ("Compiler",),
    "graphconv/verification.py": ("Verification",),
    "graphconv/parallel/tensor_parallel.py": ("TensorParallel",),
}


def _writes_outside_init(source: str, classes: tuple[str, ...]) -> list[str]:
    """`Class.method: self.attr` for every assignment to an attribute of self outside __init__."""
    found = []
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef) or cls.name not in classes:
            continue
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name == "__init__":
                continue
            for node in ast.walk(method):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for target in targets:
                    for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            found.append(f"{cls.name}.{method.name}: self.{t.attr}")
    return found


def test_stage_objects_set_their_attributes_only_in_init():
    found = []
    for path, classes in STAGE_CLASSES.items():
        source = (ROOT / path).read_text()
        assert all(f"class {c}" in source for c in classes), f"{path} no longer defines {classes}"
        found += [f"{path}: {w}" for w in _writes_outside_init(source, classes)]
    assert not found, "stage attributes written outside __init__: " + "; ".join(found)


def test_the_check_can_fail():
    source = "class Compiler:\n    def __init__(self):\n        self.a = 1\n    def load(self):\n        self.b = 2\n" \
             "        self.a += 1\n        self.report.status = 'ok'\n"
    assert _writes_outside_init(source, ("Compiler",)) == ["Compiler.load: self.b", "Compiler.load: self.a"]
