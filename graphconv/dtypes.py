"""The dtype tables graphconv shares: which element types are floats, and how a precision name ("fp32",
"fp16", "bf16") maps to numpy's dtype names and back from ONNX's element types. One definition here keeps the
frontend, the passes, opmap, the compiler, the oracle and the MindSpore children agreeing.

The element types are ONNX's TensorProto numbers, which onnx_ir's DataType members equal (an IntEnum), so the
sets answer `in` for either. They are spelled as numbers, not imported from onnx, because the MindSpore
children import this module and never import onnx (tests/test_small_facts.py checks the numbers)."""

from __future__ import annotations

# ONNX element types (onnx.TensorProto.DataType).
FLOAT = 1
FLOAT16 = 10
DOUBLE = 11
BFLOAT16 = 16

# The 16-bit floats: what a precision check rounds to and the exact values upcast from.
LOW_PRECISION = frozenset({FLOAT16, BFLOAT16})
# Every float element type graphconv computes in.
FLOATS = frozenset({FLOAT, DOUBLE}) | LOW_PRECISION
# The float element types MindSpore's fused primitives take (no float64).
FUSED_FLOATS = frozenset({FLOAT, FLOAT16, BFLOAT16})

# numpy's names of the float dtypes (bfloat16 through ml_dtypes): how the weight streamer tells a float cast.
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")

# A precision name as numpy names its dtype: the key of the default tolerances and a store dtype's name.
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# An ONNX float element type as a precision name (a generation graph's cache dtype, say).
PRECISION_OF_TYPE = {FLOAT: "fp32", FLOAT16: "fp16", BFLOAT16: "bf16"}
