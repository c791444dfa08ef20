"""Helpers for fusion tests: apply one pass to a hand-built graph, prove the fused graph equals the original.

A fusion test must show (1) the pass fired the expected number of times and (2) the fused graph, run by
onnxruntime with the fused ops' function bodies, is numerically equal to the unfused graph at the reference
shapes (two per symbolic dim).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import TensorProto

import opmap.fused
import passes
from graphconv.verify import census, compare, reference


def fuse(model: onnx.ModelProto, pass_name: str) -> tuple[int, onnx.ModelProto]:
    """Run one pass; return how often it fired and the fused model with function bodies attached."""
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    m = ir.from_proto(model)
    count = passes.PassManager(pass_name).run(m)[pass_name]
    fused = opmap.fused.attach_functions(ir.to_proto(m))
    return count, onnx.shape_inference.infer_shapes(fused, data_prop=True)


# The norm/activation families' passes in pipeline order (no rotary or attention): real exports through them.
FAMILY_PIPELINE = "canonicalize,tie-weights,fuse-rmsnorm,fuse-layernorm,fuse-gelu,fuse-silu,fuse-swiglu"


def fused_equals_unfused(path, spec: str = FAMILY_PIPELINE, tol: float = 1e-5):
    """The export run through `spec` (`fuse` for a pipeline), then onnxruntime on the fused graph with
    its function bodies against the export: returns the pass counts."""
    original = onnx.load(path)
    m = ir.from_proto(onnx.shape_inference.infer_shapes(original, data_prop=True))
    counts = passes.PassManager(spec).run(m)
    fused = onnx.shape_inference.infer_shapes(opmap.fused.attach_functions(ir.to_proto(m)), data_prop=True)
    assert_same_numerics(original, fused, tol, tol)
    return counts


def assert_same_numerics(original: onnx.ModelProto, fused: onnx.ModelProto, atol: float = 1e-5,
                         rtol: float = 1e-5) -> None:
    """onnxruntime on the fused graph equals onnxruntime on the original, at both reference shapes."""
    cases = reference.make_cases(original)
    for case, exp, got in zip(cases, reference.Oracle(original).run(cases), reference.Oracle(fused).run(cases)):
        for name, ref in exp.items():
            c = compare.compare(got[name], ref, atol, rtol, case.valid_positions(ref))
            assert c.ok, (name, case.shape_text(), c)


def assert_fuses_to_one(original: onnx.ModelProto, pass_name: str, op_type: str, dtype: int | None = None
                        ) -> onnx.ModelProto:
    """`pass_name` fires once on `original` and the fused graph is that one `op_type` node, with the original's
    numerics (tolerance 1e-2 when `dtype` is fp16, else 1e-5). Returns the fused model."""
    count, fused = fuse(original, pass_name)
    assert count == 1
    assert [n.op_type for n in fused.graph.node] == [op_type]
    tol = 1e-2 if dtype == TensorProto.FLOAT16 else 1e-5
    assert_same_numerics(original, fused, tol, tol)
    return fused


def run_refused(model: onnx.ModelProto, pass_name: str, data_prop: bool = True
                ) -> tuple[passes.PassManager, ir.Model]:
    """`pass_name` run on `model` (shapes inferred) fuses nothing; returns its manager (skipped reasons,
    coverage) and the model it ran on."""
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model, data_prop=data_prop))
    pm = passes.PassManager(pass_name)
    assert pm.run(m)[pass_name] == 0
    return pm, m


def spelling_id(spelling: dict, empty: str = "") -> str:
    """A parametrize id: the spelling's key=value pairs joined by '-' (`empty` for no pairs)."""
    return "-".join(f"{k}={v}" for k, v in spelling.items()) or empty


def fused_nodes(model: onnx.ModelProto, op_type: str | None = None) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == opmap.fused.DOMAIN and (op_type is None or n.op_type == op_type)]


def mindir_primitive_inputs(path, primitive: str) -> list[list]:
    """For each call of `primitive` in a MindIR, call-weighted like the census (a lazy_inline layer graph
    called N times gives N calls): its inputs, constants resolved to their values (float, int, string,
    bool or the AttributeProto), Parameters (read through their Load, in the main graph or passed into a
    layer graph) as their names, other inputs as node names. Read from the protobuf, never executed."""
    model = census.read_mindir(path)
    graphs = {g.name: g for g in model.functions}
    # (a function graph reads constants the main graph defines)
    consts = {n.output[0]: n for g in [model.graph, *model.functions] for n in g.node if n.op_type == "Constant"}
    params = {p.name: p.name.partition(":")[2] for p in model.graph.parameter}
    calls: list[list] = []

    def value(name: str, env: dict):
        if name in env:
            return env[name]
        c = consts.get(name)
        if c is not None and c.attribute:
            return _attribute_value(c.attribute[0])
        return params.get(name, name)

    def walk(graph, env: dict, stack: tuple) -> None:
        loads = {}
        for n in graph.node:
            if n.op_type.startswith("REF::Load:"):
                loads[n.output[0]] = value(n.input[0], env)
        local = {**env, **loads}
        for n in graph.node:
            if n.op_type.startswith(f"REF::{primitive}:"):
                calls.append([value(i, local) for i in n.input])
                continue
            callee = n.op_type.partition("REF::")[2] if n.op_type.startswith("REF::") else ""
            if callee in graphs and callee not in stack:
                g = graphs[callee]
                inner = {inp.name: value(arg, local) for inp, arg in zip(g.input, n.input)}
                walk(g, inner, stack + (graph.name,))

    walk(model.graph, {}, ())
    return calls


_INTS = {"UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "UINT32", "UINT64"}


def _attribute_value(a):
    """A MindIR constant's Python value (its AttributeProto has per-dtype types, INT64 but no INT)."""
    kind = census.mind_ir_pb2().AttributeProto.AttributeType.Name(a.type)
    if kind in _INTS:
        return a.i
    if kind == "BOOL":
        return bool(a.i)
    if kind in ("FLOAT", "FLOAT16", "BFLOAT16"):
        return a.f
    if kind == "DOUBLE":
        return a.d
    if kind == "STRING":
        return a.s.decode()
    if kind == "NONE":
        return None
    return a

