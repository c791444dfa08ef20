"""MindIR primitive census, read from the protobuf (never executed).

A MindIR is a `mind_ir.ModelProto`; primitive calls are nodes whose op_type is "REF::<Primitive>:<uid>",
and sub-graphs (lazy_inline blocks, control flow) live in `functions`. Counts are weighted by calls: the
primitives of a function graph called N times count N times (docs/design.md, contracts).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections import Counter
from pathlib import Path

from graphconv.errors import InputError

_PRIM = re.compile(r"^REF::([A-Za-z_][\w]*?)(?::\d+)?$")


@functools.cache
def mind_ir_pb2():
    """Load mindspore/train/mind_ir_pb2.py by path: importing `mindspore` itself costs seconds and
    switches protobuf to its pure-Python implementation."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("reading a MindIR needs the mindspore package")
    path = Path(next(iter(spec.submodule_search_locations))) / "train" / "mind_ir_pb2.py"
    mod_spec = importlib.util.spec_from_file_location("graphconv._mind_ir_pb2", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def read_mindir(path: Path):
    pb2 = mind_ir_pb2()
    model = pb2.ModelProto()
    try:
        model.ParseFromString(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 - DecodeError and friends
        raise InputError(f"{path}: not a MindIR file ({type(e).__name__})") from None
    if not model.HasField("graph"):
        raise InputError(f"{path}: not a MindIR file (no graph)")
    return model


def _graph_counts(graph, graph_names: set[str]) -> tuple[Counter, Counter]:
    """Primitive counts of one graph, and how often it calls each function graph."""
    prims, calls = Counter(), Counter()
    for node in graph.node:
        m = _PRIM.match(node.op_type)
        if m:
            prims[m.group(1)] += 1
        for name in list(node.input) + [node.op_type]:
            base = name.split(":")[-1] if name.startswith("REF::") else name
            if base in graph_names:
                calls[base] += 1
    return prims, calls


def executed_graphs(model) -> list[tuple[object, int]]:
    """Every graph a run of the MindIR executes, with how many times: the main graph once, a function graph
    (a lazy_inline layer) as often as its callers call it (call-weighted; a recursive call counts once)."""
    graphs = {g.name: g for g in model.functions}
    names = set(graphs)
    times: Counter = Counter()

    def visit(graph, k: int, stack=()) -> None:
        times[graph.name] += k
        _, calls = _graph_counts(graph, names)
        for callee, n in calls.items():
            if callee in stack or callee == graph.name:
                continue  # recursion (loops): the body once
            visit(graphs[callee], k * n, stack + (graph.name,))

    visit(model.graph, 1)
    order = [model.graph] + [g for g in model.functions if g.name in times]
    return [(g, times[g.name]) for g in order]


def primitive_census(path: Path) -> dict[str, int]:
    total: Counter = Counter()
    for graph, k in executed_graphs(read_mindir(path)):
        prims, _ = _graph_counts(graph, set())
        for prim, c in prims.items():
            total[prim] += c * k
    return dict(sorted(total.items()))
