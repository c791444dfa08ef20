"""refine-shapes: static dims that onnxruntime's symbolic shape inference proves and onnx's does not.

TorchScript exports of transformers models reshape q/k/v with a -1 for the head count, which onnx's shape
inference leaves unknown; fuse-attention needs it static. Runs before the fusions (passes/shapes.py). Where
onnxruntime's inference gives up (BERT's position-id slice: "unsupported broadcast between Min(128, seq) and
seq"), the Reshape's -1 is solved from the shape arithmetic itself (refine_reshape_minus_one), following dims
through the ops that pass them on unchanged (BERT's first query after onnxsim: Reshape(MatMul(LayerNorm(x), Wq),
Concat(Shape(LayerNorm(x))[0], [1], -1, 16)) with no bias Add in between). A -1 that is provably one of the
input's symbolic dims gets that dim: Bloom's TorchScript flattening Reshape(q (B, N, S, D), Concat(Shape(x)[0]·N,
-1, D)) keeps q's S, which fuse-attention's flattened layout needs (onnx's inference names it anew).
"""

from __future__ import annotations

import onnx_ir as ir

from passes.manager import PassResult, register_pass
from passes.shapes import refine_reshape_minus_one, refine_static_dims


@register_pass("refine-shapes", "static dims proved by onnxruntime's symbolic shape inference (e.g. head counts "
                                "behind Reshape(x, [b, s, -1, d]))")
def refine_shapes(model: ir.Model) -> PassResult:
    return PassResult(refine_static_dims(model) + refine_reshape_minus_one(model))
