"""Shared by the fusion tests: zoo compiles cached for the session (one compile serves every pass's checks on
that export), and a MindIR read-back of primitive arguments that resolves integer constants too.

`primitive_args` is fusion_utils.mindir_primitive_inputs plus integer/bool constants: that helper compares
against `AttributeProto.INT`, which mind_ir's AttributeProto does not define (its integer kinds are INT8 ...
UINT64), so it raises on primitives with int arguments (LayerNorm's axes, Swiglu's dim, GeluExt's approximate
enum). Fold into fusion_utils once it handles integers.
"""

from __future__ import annotations

import onnx

import graphconv
from graphconv import census

_COMPILED: dict[tuple, tuple] = {}


def zoo_compile(export_cache, tmp_path_factory, model: str, opset: int, exporter: str):
    """(report, mindir path, fused onnx model) of compiling the zoo export (default target ascend), once per
    session for each (model, opset, exporter)."""
    key = (model, opset, exporter)
    if key not in _COMPILED:
        d = tmp_path_factory.mktemp(f"compiled-{model}-{opset}-{exporter}")
        out = d / "m.mindir"
        report = graphconv.compile(export_cache(model, opset, exporter), out, save_fused=d / "fused.onnx")
        _COMPILED[key] = (report, out, onnx.load(d / "fused.onnx"))
    return _COMPILED[key]


def primitive_args(path, primitive: str) -> list[list]:
    """For each call of `primitive`: its inputs, constants as Python values, parameters (read through their
    Load) as their names (the ONNX initializer names), other inputs as node names."""
    model = census.read_mindir(path)
    a_type = census.mind_ir_pb2().AttributeProto
    ints = {a_type.INT8, a_type.INT16, a_type.INT32, a_type.INT64, a_type.UINT8, a_type.UINT16,
            a_type.UINT32, a_type.UINT64}
    consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    loads = {n.output[0]: n.input[0].partition(":")[2] for n in model.graph.node if n.op_type.startswith("REF::Load:")}
    calls = []
    for n in model.graph.node:
        if not n.op_type.startswith(f"REF::{primitive}:"):
            continue
        args = []
        for i in n.input:
            c = consts.get(i)
            if c is None or not c.attribute:
                args.append(loads.get(i, i))
                continue
            a = c.attribute[0]
            if a.type == a_type.FLOAT:
                args.append(a.f)
            elif a.type == a_type.DOUBLE:
                args.append(a.d)
            elif a.type in ints:
                args.append(a.i)
            elif a.type == a_type.BOOL:
                args.append(bool(a.i))
            elif a.type == a_type.STRING:
                args.append(a.s.decode())
            else:
                args.append(a)
        calls.append(args)
    return calls


def assert_verified(report, max_abs: float = 1e-4) -> None:
    """The cpu twin of the ascend MindIR matched the oracle on every output at both reference shapes."""
    assert report.status == "verified", report.error
    assert report.validation["checked"].startswith("cpu twin of ")
    for case in report.validation["cases"]:
        for o in case["outputs"]:
            assert o["max_abs"] <= max_abs, (case["name"], o)
