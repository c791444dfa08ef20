"""Shared by the rotary and RMSNorm fusion tests: tiny transformers architectures (models/architectures.py)
exported with default settings by dynamo and compiled with the default pipeline, once per session for each
(architecture, opset, simplify), plus the checks both test files make on such a compile.

The architectures' factories build hidden 64, 2 layers, 4 heads (head_dim 16, 32 for Gemma), 2 kv heads, vocab
128, initializer_range 0.2, attn_implementation left at transformers' default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

import graphconv
from fusion_utils import assert_same_numerics, fused_nodes
from graphconv.verify import reference


@dataclasses.dataclass
class Compiled:
    report: object
    onnx_path: Path
    mindir: Path
    fused_path: Path

    @property
    def fused(self) -> onnx.ModelProto:
        return onnx.load(self.fused_path)


_DONE: dict[tuple, Compiled] = {}


def factory(name: str):
    from models import load_factory
    from models.architectures import ARCHITECTURES

    return load_factory(ARCHITECTURES[name].factory)


def expected_census(name: str) -> dict[str, int]:
    from models.architectures import ARCHITECTURES

    return ARCHITECTURES[name].census


def compile_arch(tmp_path_factory, name: str, opset: int = 18, simplify: bool = True,
                 disable: tuple[str, ...] = ()) -> Compiled:
    """`disable`: passes left out (e.g. fuse-attention where its fp16 q/k/v casts fail the model's own
    verification, which is not what a norm or rotary test is about)."""
    from graphconv.frontend.export import zoo_export

    key = (name, opset, simplify, disable)
    if key not in _DONE:
        exported = [c.onnx_path for k, c in _DONE.items() if k[:2] == key[:2]]
        d = tmp_path_factory.mktemp(f"{name}-{opset}-{'sim' if simplify else 'nosim'}")
        if exported:
            path = exported[0]
        else:
            path = d / f"{name}.onnx"
            zoo_export(factory(name), path, opset=opset, exporter="dynamo")
        out = d / "m.mindir"
        report = graphconv.compile(path, out, save_fused=d / "fused.onnx", simplify=simplify,
                                   disable_passes=disable)
        _DONE[key] = Compiled(report, path, out, d / "fused.onnx")
    return _DONE[key]


def modes(model: onnx.ModelProto) -> list[int]:
    return [helper.get_attribute_value(a) for n in fused_nodes(model, "RotaryPositionEmbedding")
            for a in n.attribute if a.name == "mode"]


def max_abs_fused_vs_unfused(c: Compiled) -> float:
    """onnxruntime on the saved fused graph (function bodies attached) against the original export, over both
    reference shapes, valid positions only."""
    original = onnx.load(c.onnx_path)
    cases = reference.make_cases(original)
    worst = 0.0
    for case, exp, got in zip(cases, reference.Oracle(original).run(cases), reference.Oracle(c.fused).run(cases)):
        for name, ref in exp.items():
            valid = case.valid_positions(ref)
            diff = np.abs(np.asarray(got[name], np.float64) - np.asarray(ref, np.float64))
            worst = max(worst, float(diff[valid].max() if valid is not None else diff.max()))
    return worst


def check_family(c: Compiled, family: str, n: int) -> None:
    """Every candidate of the coverage family fused: n candidates, n fused, none refused."""
    cov = c.report.coverage[family]
    assert (cov["candidates"], cov["fused"], cov["refused"]) == (n, n, {}), cov


def check_verified(c: Compiled, max_abs: float = 1e-4) -> None:
    """The cpu twin of the ascend MindIR matched onnxruntime at both reference shapes, and the saved fused graph
    equals the unfused export in onnxruntime."""
    report = c.report
    assert report.status == "verified" and report.validation["status"] == "verified", report.error
    for case in report.validation["cases"]:
        for o in case["outputs"]:
            assert o["max_abs"] <= max_abs, (case["name"], o)
    assert_same_numerics(onnx.load(c.onnx_path), c.fused, 1e-4, 1e-4)
