"""Shared by the fusion tests: zoo compiles cached for the session (one compile serves every pass's checks on
that export); `primitive_args` is fusion_utils.mindir_primitive_inputs."""

from __future__ import annotations

import onnx

import graphconv
from fusion_utils import mindir_primitive_inputs

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
    """fusion_utils.mindir_primitive_inputs (one reader of MindIR primitive arguments)."""
    return mindir_primitive_inputs(path, primitive)


def assert_verified(report, max_abs: float = 1e-4) -> None:
    """The cpu twin of the ascend MindIR matched the oracle on every output at both reference shapes."""
    assert report.status == "verified", report.error
    assert report.validation["checked"].startswith("cpu twin of ")
    for case in report.validation["cases"]:
        for o in case["outputs"]:
            assert o["max_abs"] <= max_abs, (case["name"], o)
