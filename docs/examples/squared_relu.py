"""An opmap handler for an op graphconv does not know: com.example::SquaredRelu(x; scale) -> scale * relu(x)^2.

Load it with `graphconv compile model.onnx --plugin squared_relu` (the module must be importable): --plugin
imports the module before the model is loaded, so the handler is registered when the load stage asks whether
every op has one. docs/extending.md walks through it; tests/test_extending_examples.py compiles a model with it.
"""

from opmap.registry import register


@register("SquaredRelu", since=1, domain="com.example")
def squared_relu(n):
    """`n` is the NodeContext of one ONNX node. The handler returns the node's output as an emission Value
    (graphconv/compiler/program_ir.py), built through `n`; the code generator turns it into MindSpore source."""
    dtype = n.dtype(0)
    if dtype is not None and not dtype.is_floating_point():
        n.fail(f"SquaredRelu takes floats, not {dtype.name}")  # one line, exit code 1
    r = n.call("ops.relu", n.x(0))  # -> `r = ops.relu(x)` in the generated construct()
    y = n.binop("*", r, r)
    scale = float(n.attr("scale", 1.0))  # an attribute, with the op's default
    return y if scale == 1.0 else n.binop("*", y, scale)
