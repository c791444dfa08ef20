"""Ranks onnx's shape inference leaves unknown, taken from onnxruntime's run of the model.

paddle2onnx and tf2onnx reshape to shapes the graph computes (Reshape(x, Concat(...))), and onnx's shape
inference then loses even the rank of what follows; the lowering needs ranks (a Transpose's permutation, a
reduction's axes). onnxruntime knows them once it runs: those values are made outputs of a copy of the model,
run on the reference cases, and each gets the rank it had, with symbolic dims (a size seen at two inputs says
nothing of a third); onnx's inference then runs again from there and derives what dims it can.
"""

from __future__ import annotations

import onnx
from onnx import helper

from graphconv.errors import UnsupportedError


def unknown_rank_values(model: onnx.ModelProto) -> list[str]:
    """Node outputs of the main graph whose rank no value_info, input, output or initializer gives."""
    graph = model.graph
    known = {v.name for v in [*graph.value_info, *graph.input, *graph.output]
             if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    known |= {t.name for t in graph.initializer}
    return [o for n in graph.node for o in n.output if o and o not in known]


def _runs(model: onnx.ModelProto, cases, names: list[str], oracle_factory) -> list[dict] | None:
    """Each case's outputs of a copy of `model` whose outputs include `names`; None where onnxruntime does not
    run it."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)  # (onnxruntime takes untyped outputs)
    try:
        return oracle_factory(probe).run(cases, fallback=False)
    except UnsupportedError:
        return None


def observed_shapes(model: onnx.ModelProto, case, names: list[str], oracle_factory) -> dict[str, tuple]:
    """The shapes the values `names` had in onnxruntime's run of `case` ({} where it does not run)."""
    (run,) = _runs(model, [case], names, oracle_factory) or [{}]
    return {n: tuple(run[n].shape) for n in names if n in run}


def complete(model: onnx.ModelProto, cases, oracle_factory) -> tuple[onnx.ModelProto, list[str]]:
    """`model` with a shape of the observed rank for each value whose rank was unknown (where every case ran
    with one rank), and the names given one. `oracle_factory(model)` -> an object with
    run(cases, fallback=False) (graphconv.verify.reference.Oracle). The model as it was where onnxruntime does
    not run it."""
    names = unknown_rank_values(model)
    if not names or not cases:
        return model, []
    runs = _runs(model, cases, names, oracle_factory)
    if runs is None:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    given = []
    for name in names:
        seen = [run[name] for run in runs if name in run]
        ranks = {a.ndim for a in seen}
        if len(seen) != len(runs) or len(ranks) != 1:
            continue
        value = seen[0]
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        out.graph.value_info.append(helper.make_tensor_value_info(
            name, elem, [f"{name}__observed_{axis}" for axis in range(value.ndim)]))
        given.append(name)
    return out, given
