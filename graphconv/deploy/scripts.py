"""The text of the scripts the bundle ships: templates read from graphconv/deploy/templates/ with their
@@NAME@@ placeholders filled, and compare_outputs.py assembled from graphconv.verify.compare's own source, so the
bundle compares a device run by exactly the rule the compile verified with (and still needs numpy only).
"""

from __future__ import annotations

import ast
import functools
import importlib.resources
import inspect
import re

from graphconv.verify import compare
from graphconv.deploy.options import TOLERANCE_KEY
from graphconv.errors import InternalError

# What compare_outputs.py takes from graphconv.verify.compare: the tolerance table, the rule and its helpers.
RULE = ("DEFAULT_TOLERANCE", "SUSPICIOUS_FACTOR", "EDGE_OF_RANGE", "EDGE_ROUNDING", "default_tolerance", "Comparison",
        "_cosine", "compare")
# The modules graphconv.verify.compare may import: the ones compare_outputs.head.py.tmpl imports (numpy only).
RULE_IMPORTS = {"__future__", "dataclasses", "numpy"}


@functools.cache
def template(name: str) -> str:
    """A template file of graphconv/deploy/templates/ (shipped as package data)."""
    return (importlib.resources.files("graphconv.deploy") / "templates" / name).read_text(encoding="utf-8")


def fill(text: str, **values: str) -> str:
    """The template text with every @@KEY@@ replaced; an unfilled placeholder is a graphconv bug."""
    for k, v in values.items():
        text = text.replace(f"@@{k}@@", v)
    leftover = re.findall(r"@@\w+@@", text)
    if leftover:
        raise InternalError(f"bundle template placeholders left: {leftover}")
    return text


def _defined(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def rule_source() -> str:
    """The RULE definitions of graphconv.verify.compare, verbatim (with the comment lines above each), in its order.
    Refuses (InternalError) when compare imports a module the script does not, or when a RULE definition
    uses another of compare's module-level names: the script must stand alone."""
    source = inspect.getsource(compare)
    lines = source.splitlines()
    tree = ast.parse(source)
    pieces: list[str] = []
    taken: list[ast.stmt] = []
    prev_end, prev_taken = 0, False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            extra = sorted(n for n in names if n.split(".")[0] not in RULE_IMPORTS)
            if extra:
                raise InternalError(f"{compare.__name__} imports {extra}: compare_outputs.py imports "
                                    f"{sorted(RULE_IMPORTS)} only")
        name = _defined(node)
        if name not in RULE:
            prev_end, prev_taken = node.end_lineno, False
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while start > prev_end and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        gap = "\n" * (start - prev_end + 1) if prev_taken else "\n\n\n"  # keep compare's spacing between neighbours
        pieces.append((gap if pieces else "") + "\n".join(lines[start:node.end_lineno]))
        taken.append(node)
        prev_end, prev_taken = node.end_lineno, True
    missing = [n for n in RULE if n not in {_defined(t) for t in taken}]
    if missing:
        raise InternalError(f"{compare.__name__} no longer defines {missing} (compare_outputs.py needs them)")
    module_names = {_defined(n) for n in tree.body} - {None}
    used = {n.id for t in taken for n in ast.walk(t) if isinstance(n, ast.Name)}
    outside = sorted((used & module_names) - set(RULE))
    if outside:
        raise InternalError(f"the comparison rule uses {outside} of {compare.__name__}: add them to RULE")
    return "".join(pieces) + "\n"


def compare_script() -> str:
    """compare_outputs.py: the head template, graphconv.verify.compare's rule, and the command line."""
    head = fill(template("compare_outputs.head.py.tmpl"), SOURCE=compare.__name__.replace(".", "/") + ".py")
    main = fill(template("compare_outputs.main.py.tmpl"), PRECISION_DTYPE=repr(TOLERANCE_KEY))
    return head + "\n\n" + rule_source() + "\n\n" + main
