"""SwiGLU (opset 28; its gate, Swish, is in opmap/elementwise.py): Y = Swish_alpha(A) * B =
A * Sigmoid(alpha * A) * B, A and B of one shape (no broadcast).

The ONNX reference computes in the input dtype (the sigmoid cast to it before the products); so does this.
"""

from __future__ import annotations

from opmap.registry import register


@register("SwiGLU", since=28)
def swiglu(n):
    a, b = n.x(0), n.x(1)
    sa, sb = n.shape(0), n.shape(1)
    if sa is not None and sb is not None and len(sa) != len(sb):
        n.fail(f"A {sa} and B {sb} differ in rank (SwiGLU does not broadcast)")
    alpha = float(n.attr("alpha", 1.0))
    gate = n.call("ops.sigmoid", a if alpha == 1.0 else n.binop("*", a, alpha))
    return n.binop("*", n.binop("*", a, gate), b)
