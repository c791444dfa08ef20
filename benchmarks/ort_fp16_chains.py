#!/usr/bin/env python3
"""ort_fp16_chains: does onnxruntime on this CPU round each fp16 op's result, or only a chain's end?

A Mul -> MatMul graph in fp16 (x * g, then @ w), run by onnxruntime's CPU provider at two optimization levels,
against numpy computing it two ways: each op's result rounded to fp16 ("each op"), and the chain in fp32 rounded
once at its end ("chain"). On a CPU without fp16 kernels for these ops (x86, AVX2), onnxruntime casts them to
fp32 and removes the casts between them: its output equals "chain" everywhere. Why it matters: the compile's
fp16 yardstick is the graph rounded at every op, not onnxruntime's run (docs/design.md, Comparison rule).

Run: .venv/bin/python benchmarks/ort_fp16_chains.py
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float16)
    g = rng.standard_normal(256).astype(np.float16)
    w = (rng.standard_normal((256, 128)) * 0.1).astype(np.float16)
    nodes = [helper.make_node("Mul", ["x", "g"], ["m"]), helper.make_node("MatMul", ["m", "w"], ["y"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None)
                                               for n in ("x", "g", "w")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    f32 = np.float32
    each = ((x.astype(f32) * g.astype(f32)).astype(np.float16).astype(f32) @ w.astype(f32)).astype(np.float16)
    chain = ((x.astype(f32) * g.astype(f32)) @ w.astype(f32)).astype(np.float16)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        y = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run(None, {"x": x, "g": g, "w": w})[0]
        print(f"{level.name:<16} onnxruntime {ort.__version__}: differs from 'each op rounded' in "
              f"{int((y != each).sum()):>5} of {y.size}, from 'chain in fp32, rounded once' in "
              f"{int((y != chain).sum()):>5}")


if __name__ == "__main__":
    main()
