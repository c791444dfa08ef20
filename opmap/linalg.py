"""Matrix products: MatMul (numpy semantics, batch broadcasting) and Gemm."""

from __future__ import annotations

from opmap.registry import register


@register("MatMul", since=13)
def matmul(n):
    if n.is_dense_weight(1):
        # The weight is stored [out, in] (graphconv.compiler.lowering.dense_weights): x @ w == dense(x, w_stored).
        return n.call("ops.dense", n.x(0), n.x(1))
    return n.call("ops.matmul", n.x(0), n.x(1))


@register("Gemm", since=13)
def gemm(n):
    a, b = n.x(0), n.x(1)
    alpha, beta = float(n.attr("alpha", 1.0)), float(n.attr("beta", 1.0))
    if n.attr("transB", 0) and not n.attr("transA", 0) and alpha == 1.0 and beta in (0.0, 1.0) and \
            (not n.has(2) or n.rank(2) == 1):
        # Linear layout (weight stored out x in): one fused primitive, no run-time transpose.
        return n.call("ops.dense", a, b, n.x(2) if n.has(2) and beta else None)
    if n.attr("transA", 0):
        a = n.call("ops.transpose", a, (1, 0))
    if n.attr("transB", 0):
        b = n.call("ops.transpose", b, (1, 0))
    y = n.call("ops.matmul", a, b)
    if alpha != 1.0:
        y = n.binop("*", alpha, y)
    if n.has(2) and beta != 0.0:
        c = n.x(2) if beta == 1.0 else n.binop("*", beta, n.x(2))
        y = n.binop("+", y, c)
    return y


@register("Det", since=11)
def det(n):
    return n.call("ops.det", n.x(0))
