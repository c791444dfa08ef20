"""The size budget of the product (graphconv/, passes/, opmap/): no function or method over 80 lines (from
its def line to its last, docstring and nested functions included, decorators not) or over 8 parameters
(positional-only, positional, keyword-only, *args and **kwargs; `self` and `cls` not counted), unless
tests/size_budget_allowlist.txt names it: `path::qualname lines=N params=M`, one a line, sorted. The list
may only shrink: a listed function may not grow past its recorded lines or params, and an entry whose
function is gone or now within budget fails the test until it is deleted.

models/ (zoo factories and examples that build PyTorch modules for the tests) and benchmarks/ (one-off
measurement scripts) are not the product and stay out, as tests/ does.

The allowlist was seeded once from the tree (`python tests/test_size_budget.py --seed`); re-seeding is not
the way to make room for a new long function: split it instead."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("graphconv", "passes", "opmap")
ALLOWLIST = Path(__file__).resolve().parent / "size_budget_allowlist.txt"
MAX_LINES = 80
MAX_PARAMS = 8


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    if in_class and names and names[0] in ("self", "cls"):
        count -= 1
    return count


def measure() -> dict[str, tuple[int, int]]:
    """`path::qualname` -> (lines, params) of every function and method of the product."""
    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, path: str, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                key = f"{path}::{name}"
                while key in found:  # (a redefinition, e.g. a property's setter: counted on its own)
                    key += "'"
                found[key] = (child.end_lineno - child.lineno + 1, _params(child, in_class))
                visit(child, path, f"{name}.<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.", True)
            else:
                visit(child, path, prefix, in_class)

    for pkg in PACKAGES:
        for file in sorted((ROOT / pkg).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            visit(ast.parse(file.read_text(), rel), rel, "", False)
    return found


def over_budget(measured: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    measured = measure() if measured is None else measured
    return {k: v for k, v in measured.items() if v[0] > MAX_LINES or v[1] > MAX_PARAMS}


def _line(key: str, lines: int, params: int) -> str:
    return f"{key} lines={lines} params={params}"


def read_allowlist() -> dict[str, tuple[int, int]]:
    entries = {}
    for raw in ALLOWLIST.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            key, lines, params = raw.rsplit(" ", 2)
            entries[key] = (int(lines.removeprefix("lines=")), int(params.removeprefix("params=")))
    return entries


def test_no_function_over_budget_outside_the_allowlist():
    measured = measure()
    allowed, now = read_allowlist(), over_budget(measured)
    problems = []
    for key, (lines, params) in sorted(now.items()):
        if key not in allowed:
            problems.append(f"over budget (max {MAX_LINES} lines, {MAX_PARAMS} params), not allowlisted: "
                            f"{_line(key, lines, params)}")
        elif lines > allowed[key][0] or params > allowed[key][1]:
            problems.append(f"grown past its allowlist entry {_line(key, *allowed[key])}: now lines={lines} "
                            f"params={params}")
    for key in sorted(set(allowed) - set(now)):
        why = "gone" if key not in measured else "now within budget"
        problems.append(f"stale allowlist entry ({why}; delete its line): {_line(key, *allowed[key])}")
    assert not problems, "\n".join(problems)


def test_allowlist_is_sorted():
    keys = list(read_allowlist())
    assert keys == sorted(keys), "tests/size_budget_allowlist.txt must be sorted"


def seed() -> int:
    now = over_budget()
    header = "# Functions over the size budget (tests/test_size_budget.py): it may only shrink.\n"
    ALLOWLIST.write_text(header + "".join(_line(k, *now[k]) + "\n" for k in sorted(now)))
    return len(now)


if __name__ == "__main__":
    if sys.argv[1:] != ["--seed"]:
        sys.exit("usage: python tests/test_size_budget.py --seed  (the one-time seeding of the allowlist)")
    print(f"{seed()} entries written to {ALLOWLIST.relative_to(ROOT)}")
