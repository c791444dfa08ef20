"""mindspore::WeightQuantBatchMatmul(x, weight, antiquant_scale, antiquant_offset; antiquant_group_size) -> y,
MindSpore's `WeightQuantBatchMatmul` (ops.auto_generate) with int4 weights (docs/fused_ops.md).

y = x @ W, W[k, j] = (q[j, k] + antiquant_offset[k // g, j]) * antiquant_scale[k // g, j], g = antiquant_group_size.

weight is the int8 container of the qint4x2 tensor [N, K/2] (transpose_weight=True: the weight stored [N, K]):
byte (j, i) holds q[j, 2i] in its low nibble and q[j, 2i + 1] in its high one, each a two's-complement int4
(-8..7). antiquant_scale and antiquant_offset are (K/g, N) in x's dtype: MindSpore 2.10's per-group layout
(ceil(k/g), n), not transposed by transpose_weight. Ascend's offset is ADDED to the weight, so it is MINUS
the zero point: from MatMulNBits' unsigned q_u with zero point zp, q = q_u - 8 (the byte XOR 0x88) and
offset = 8 - zp give (q + offset) * s = (q_u - zp) * s exactly (graphconv/frontend/contrib/quant.py).

Reference body (what onnxruntime runs and the cpu twin inlines): the bytes cast to int32 (sign-extended);
lo_u = Mod(b, 16) (fmod 0: the divisor's sign, 0..15), hi = (b - lo_u) / 16 (exact, -8..7: an arithmetic
shift), lo = Mod(lo_u + 8, 16) - 8 (the low nibble sign-extended); interleaved [lo, hi] per byte into [N, K];
then in fp32: (q + offset) * scale per group, transposed to [K, N], x @ W, cast back to x's dtype. Integer
ops only up to the int32 -> fp32 Cast (every value exact), and no int8 MatMul: MindSpore's CPU has none
(its int8 MatMul returns int8). Integers rather than DequantizeLinear on an INT4 initializer: INT4 needs
opset 21 (models here are at 17/18) and graphconv binds no 4-bit tensor on CPU.

The ascend lowering: WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=g)
(x, weight as a qint4x2 Parameter, scale, offset). The primitive takes x, scale and offset in fp16/bf16 only
(scale/offset dtype = x's): an fp32 model's x is cast to fp16 around it and the result back, as
FlashAttentionScore's lowering does, and its constant scale and offset are stored in fp16 (converted once at
compile time); the ascend-precision body rounds those through fp16.
UNCONFIRMED without a device: the nibble order (element 2j in the low nibble, read from MindSpore's qint4x2
docs) and the offset's sign (y = x @ ((w + offset) * scale), MindSpore 2.10's docstring).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opmap.fused.record import (Constraint, FusedOp, attr_constant, define, from_fp32, int64_constant,
                                rounded_to_fp32)
from opmap.registry import register

_DOCSTRING = "mindspore 2.10 WeightQuantBatchMatmul docstring"
CONSTRAINTS = (
    Constraint("antiquant_group_size a multiple of 32 in [32, K-1]", _DOCSTRING, ("K", "G"),
               lambda K, G: G % 32 == 0 and 32 <= G <= K - 1),
    Constraint("K at most 65535", _DOCSTRING, ("K",), lambda K: 1 <= K <= 65535),
    Constraint("N at most 65535", _DOCSTRING, ("N",), lambda N: 1 <= N <= 65535),
    Constraint("K even (two int4 per qint4x2 byte)", "mindspore 2.10 qint4x2", ("K",), lambda K: K % 2 == 0),
)


def _int32(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int32), name))


def _unpack_nodes() -> list[onnx.NodeProto]:
    """weight int8 [N, K/2] -> q float32 [N, K], the two's-complement nibbles, the low one first."""
    return [
        helper.make_node("Cast", ["weight"], ["b"], to=TensorProto.INT32),
        _int32("c16", 16), _int32("c8", 8),
        helper.make_node("Mod", ["b", "c16"], ["lo_u"]),               # 0..15
        helper.make_node("Sub", ["b", "lo_u"], ["b_hi"]),
        helper.make_node("Div", ["b_hi", "c16"], ["hi"]),              # exact: -8..7
        helper.make_node("Add", ["lo_u", "c8"], ["lo_8"]),
        helper.make_node("Mod", ["lo_8", "c16"], ["lo_m"]),
        helper.make_node("Sub", ["lo_m", "c8"], ["lo"]),               # -8..7
        int64_constant("last", [-1]),
        helper.make_node("Unsqueeze", ["lo", "last"], ["lo1"]),
        helper.make_node("Unsqueeze", ["hi", "last"], ["hi1"]),
        helper.make_node("Concat", ["lo1", "hi1"], ["pairs"], axis=-1),  # [N, K/2, 2]
        int64_constant("rows", [0, -1]),
        helper.make_node("Reshape", ["pairs", "rows"], ["q_int"]),      # [N, K]
        helper.make_node("Cast", ["q_int"], ["q"], to=TensorProto.FLOAT),
    ]


def _make_body(round_to: int | None):
    """The body; with round_to (a TensorProto dtype) x, scale, offset and y are rounded through it."""

    def body(opset: int) -> list[onnx.NodeProto]:
        nodes: list[onnx.NodeProto] = []

        nodes += rounded_to_fp32("x", "x32", round_to)
        nodes += rounded_to_fp32("antiquant_scale", "s32", round_to)
        nodes += rounded_to_fp32("antiquant_offset", "o32", round_to)
        nodes += _unpack_nodes()
        nodes += [
            attr_constant("g", "value_int", "antiquant_group_size"),
            int64_constant("one", [1]),
            helper.make_node("Reshape", ["g", "one"], ["g1"]),
            helper.make_node("Concat", ["rows", "g1"], ["grouped"], axis=0),  # [0, -1, g]
            helper.make_node("Reshape", ["q", "grouped"], ["qg"]),           # [N, K/g, g]
            helper.make_node("Transpose", ["s32"], ["s_t"], perm=[1, 0]),    # (K/g, N) -> (N, K/g)
            helper.make_node("Transpose", ["o32"], ["o_t"], perm=[1, 0]),
            helper.make_node("Unsqueeze", ["s_t", "last"], ["s_g"]),         # [N, K/g, 1]
            helper.make_node("Unsqueeze", ["o_t", "last"], ["o_g"]),
            helper.make_node("Add", ["qg", "o_g"], ["shifted"]),
            helper.make_node("Mul", ["shifted", "s_g"], ["wg"]),
            helper.make_node("Reshape", ["wg", "rows"], ["w_nk"]),           # [N, K]
            helper.make_node("Transpose", ["w_nk"], ["w_kn"], perm=[1, 0]),  # [K, N]
            helper.make_node("MatMul", ["x32", "w_kn"], ["y32" if round_to is None else "y32_full"]),
        ]
        if round_to is not None:
            nodes += rounded_to_fp32("y32_full", "y32", round_to)
        nodes.append(from_fp32(opset, "y32", "x", "y"))
        return nodes

    return body


WEIGHT_QUANT_BATCH_MATMUL = define(FusedOp(
    name="WeightQuantBatchMatmul", inputs=("x", "weight", "antiquant_scale", "antiquant_offset"), outputs=("y",),
    attributes=("antiquant_group_size",), body=_make_body(None), primitive="WeightQuantBatchMatmul", doc=__doc__,
    ascend_body=_make_body(TensorProto.FLOAT16), producer="fuse-quant-matmul", family="quant_matmul",
    as_is_inputs=(1,), ascend_compute="fp16",
    likely_causes="the nibble order (element 2j in the low nibble), the offset's sign (+offset = -zero point), "
                  "the scale layout (K/g, N), fp16 rounding of x and the scales",
    constraints=CONSTRAINTS))


@register("WeightQuantBatchMatmul", since=1, domain="mindspore")
def lower_weight_quant_batch_matmul(n):
    import onnx_ir as ir

    if not n.qint4x2(1):
        n.fail("the weight is not an initializer read only by WeightQuantBatchMatmul (it must be a qint4x2 Parameter)")
    model_dt = n.dtype(0)
    compute = model_dt if model_dt in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else ir.DataType.FLOAT16
    cdt = n.ms_dtype(compute)

    def fed(i: int, hint: str):
        """Input i in the compute dtype: a constant scale/offset converted once here (numpy's round to nearest
        even, as a Cast rounds), anything else cast in the network."""
        if n.dtype(i) == compute:
            return n.x(i)
        held = n.const(i) if i else None
        if held is not None and compute == ir.DataType.FLOAT16:
            return n.const_tensor(held.astype(np.float16), hint)
        return n.call("ops.cast", n.x(i), cdt)

    x, scale, offset = fed(0, "x"), fed(2, "antiquant_scale"), fed(3, "antiquant_offset")
    prim = n.call("ops.auto_generate.WeightQuantBatchMatmul", transpose_x=False, transpose_weight=True,
                  antiquant_group_size=int(n.attr("antiquant_group_size")))
    y = n.call(prim, x, n.x(1), scale, offset)
    return y if model_dt == compute else n.call("ops.cast", y, n.ms_dtype(model_dt))
