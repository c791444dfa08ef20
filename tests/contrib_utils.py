"""Helpers for the onnxruntime contrib-op tests: a decomposition must compute what onnxruntime's kernel
computes (onnxruntime runs both the contrib graph and its decomposition), and the whole compile must verify."""

from __future__ import annotations

import onnx
from onnx import helper

import graphconv
from graphconv.frontend import contrib
from graphconv.verify import compare, reference

MS_OPSET = helper.make_opsetid("com.microsoft", 1)


def model(nodes, inputs, outputs, initializers=(), opset: int = 22) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "contrib", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), MS_OPSET], ir_version=10)


def decomposition_matches(m: onnx.ModelProto, atol: float = 1e-5, rtol: float = 1e-5,
                          cases=None) -> tuple[onnx.ModelProto, dict]:
    """Decompose `m`; onnxruntime on the decomposition equals onnxruntime on `m` at the reference shapes.
    Returns the decomposed model and the per-op counts."""
    decomposed, counts = contrib.decompose(m)
    assert not contrib.contrib_nodes(decomposed)
    onnx.checker.check_model(decomposed)
    cases = cases or reference.make_cases(m)
    for case, exp, got in zip(cases, reference.Oracle(m).run(cases), reference.Oracle(decomposed).run(cases)):
        for name, ref in exp.items():
            c = compare.compare(got[name], ref, atol, rtol, case.valid_positions(ref))
            assert c.ok, (name, case.shape_text(), c)
    return decomposed, counts


def compile_verified(m: onnx.ModelProto, tmp_path, **options):
    """Save and compile `m`; it must verify. Returns the report."""
    path = tmp_path / "contrib.onnx"
    onnx.save(m, path)
    report = graphconv.compile(path, tmp_path / "contrib.mindir", **options)
    assert report.status == "verified", report.error
    return report
