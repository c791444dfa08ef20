"""A contrib-op decomposition: onnxruntime's com.microsoft::GatedAdd (plain mode) -> standard ONNX Mul, Add.

onnxruntime's schema: output = X + round_to_T(Y * gate), gate of shape (..., 1) broadcast over the last axis,
the product rounded to T before the add "matching separate ONNX Mul and Add operators". With the optional
gate_weight input (the projected mode) onnxruntime's CPU kernel returns NOT_IMPLEMENTED, so that form is
refused: no oracle could check it.

Load it with `graphconv compile model.onnx --plugin gated_add`. docs/extending.md walks through it;
tests/test_extending_examples.py compiles a model with it against onnxruntime.
"""

from graphconv.frontend.contrib.registry import MICROSOFT, decomposes


@decomposes("GatedAdd", domain=MICROSOFT)
def gated_add(rw):
    """`rw` is the Rewrite of one GatedAdd node: read its inputs and attributes, write standard nodes."""
    if rw.has(3):
        rw.fail("gate_weight (the projected mode: onnxruntime implements it on CUDA only)")
    product = rw.op("Mul", rw.input(1), rw.input(2))
    rw.op("Add", rw.input(0), product, outputs=[rw.output(0)])  # the node's output keeps its name
