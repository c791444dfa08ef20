"""FusedMatMul (com.microsoft) -> Transpose, MatMul, Mul: the spelling of `alpha * a.transpose(..) @ b`.

Y = alpha * (op(A) @ op(B)), numpy matmul broadcasting. For an operand of rank r >= 2, op moves axes:
  transBatch=0: batch axes 0..r-3 stay, the matrix is (r-2, r-1);
  transBatch=1: axis 0 moves behind the batch axes 1..r-2, the matrix is (0, r-1);
  trans=1 then swaps the matrix's two axes. A 1-D operand is never transposed. transBatchA/B need both
  inputs of one rank >= 3 (the CPU kernel's MatMulComputeHelper refuses anything else: so is it here).
Read from onnxruntime's FusedMatMul schema and its shape inference (FusedMatMulShapeInference in
core/graph/contrib_ops/contrib_defs.cc), which the CPU kernel's MatMulComputeHelper follows.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite


def operand_perm(rank: int, trans: bool, trans_batch: bool) -> list[int]:
    """The axes of op(X) for an operand of `rank` (identity for rank < 2)."""
    if rank < 2:
        return list(range(rank))
    batch = list(range(1, rank - 1)) if trans_batch else list(range(rank - 2))
    row, col = (0 if trans_batch else rank - 2), rank - 1
    return batch + ([col, row] if trans else [row, col])


def _operand(rw: Rewrite, i: int, trans: bool, trans_batch: bool) -> str:
    x = rw.input(i)
    if not (trans or trans_batch):
        return x
    shape = rw.shape(x)
    if shape is None:
        rw.fail(f"input {i} is transposed, and shape inference did not give its rank")
    perm = operand_perm(len(shape), trans, trans_batch)
    return x if perm == list(range(len(shape))) else rw.op("Transpose", x, perm=perm)


@decomposes("FusedMatMul", domain=MICROSOFT)
def fused_matmul(rw: Rewrite) -> None:
    if rw.attr("transBatchA", 0) or rw.attr("transBatchB", 0):
        ranks = [len(rw.shape(rw.input(i)) or []) for i in (0, 1)]
        if ranks[0] != ranks[1] or ranks[0] < 3:
            rw.fail(f"transBatchA/B with input ranks {ranks}: onnxruntime's kernel takes them only for two "
                    "inputs of one rank >= 3")
    a = _operand(rw, 0, bool(rw.attr("transA", 0)), bool(rw.attr("transBatchA", 0)))
    b = _operand(rw, 1, bool(rw.attr("transB", 0)), bool(rw.attr("transBatchB", 0)))
    alpha = float(rw.attr("alpha", 1.0))
    if alpha == 1.0:
        rw.op("MatMul", a, b, outputs=[rw.output(0)])
        return
    dtype = rw.dtype(rw.input(0))
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype) if dtype is not None else np.float32
    rw.op("Mul", rw.op("MatMul", a, b), rw.const(np.asarray(alpha, np_dtype)), outputs=[rw.output(0)])
