"""mindspore::WeightQuantBatchMatmul(x, weight, antiquant_scale, antiquant_offset; antiquant_group_size,
weight_bits) -> y, MindSpore's `WeightQuantBatchMatmul` (ops.auto_generate) with int4 or int8 weights
(docs/fused_ops.md).

y = x @ W, W[k, j] = (q[j, k] + antiquant_offset[k // g, j]) * antiquant_scale[k // g, j], g = antiquant_group_size
(g = 0: per channel, W[k, j] = (q[j, k] + antiquant_offset[j]) * antiquant_scale[j]).

Two weight forms, told apart by the attribute weight_bits: MindSpore tells them apart by the weight's dtype
(qint4x2 or int8), but in the graph both are int8 containers, whose shapes alone do not say which one is
meant. transpose_weight=True in both: the weight is stored [N, K].
- weight_bits 4: the int8 container of the qint4x2 tensor [N, K/2]: byte (j, i) holds q[j, 2i] in its low nibble
  and q[j, 2i + 1] in its high one, each a two's-complement int4 (-8..7). K even.
- weight_bits 8: the int8 tensor [N, K] itself (A16W8), q = the byte.
antiquant_scale and antiquant_offset are in x's dtype, (K/g, N) per group (MindSpore 2.10's per-group layout
(ceil(k/g), n), not transposed by transpose_weight; g a multiple of 32 in [32, K-1]) or (N,) per channel with
g = 0 (the layout MindFormers' A8W4 dense linear gives its int8 [N, K] weight's (N,) scale, calling
WeightQuantBatchMatmul(False, True, group_size)). Ascend's offset is ADDED to the weight, so it is MINUS the
zero point: from an unsigned q_u with zero point zp, q = q_u - 2^(bits-1) (the byte XOR 0x88 for 4 bits, XOR
0x80 for 8) and offset = 2^(bits-1) - zp give (q + offset) * s = (q_u - zp) * s exactly; a signed q is kept,
offset -zp (graphconv/frontend/contrib/quant.py for MatMulNBits, graphconv/frontend/weight_only_qdq.py for
DequantizeLinear weights).

Reference body (what onnxruntime runs and the cpu twin inlines): the bytes cast to int32 (sign-extended);
with m = 2^weight_bits: lo_u = Mod(b, m) (fmod 0: the divisor's sign, 0..m-1), hi = (b - lo_u) / m (exact: an
arithmetic shift), lo = Mod(lo_u + m/2, m) - m/2 (lo_u sign-extended); the first 8 / weight_bits of [lo, hi]
per byte kept (both nibbles for 4 bits; lo = b for 8, hi then unused) into [N, K]; then in fp32:
(q + offset) * scale per group (the groups read from the scale's shape, (N,) being one group of K), transposed
to [K, N], x @ W, cast back to x's dtype. Integer ops only up to the int32 -> fp32 Cast (every value exact),
and no int8 MatMul: MindSpore's CPU has none (its int8 MatMul returns int8). Integers rather than
DequantizeLinear on an INT4 initializer: INT4 needs opset 21 (models here are at 17/18) and graphconv binds no
4-bit tensor on CPU.

The ascend lowering: WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=g)
(x, weight as a qint4x2 Parameter (weight_bits 4) or an int8 one (8), scale, offset). The primitive takes x,
scale and offset in fp16/bf16 only (scale/offset dtype = x's): an fp32 model's x is cast to fp16 around it and
the result back, as FlashAttentionScore's lowering does, and its constant scale and offset are stored in fp16
(converted once at compile time); the ascend-precision body rounds those through fp16.
UNCONFIRMED without a device: the nibble order (element 2j in the low nibble, read from MindSpore's qint4x2
docs), the offset's sign (y = x @ ((w + offset) * scale), MindSpore 2.10's docstring and CANN's
aclnnWeightQuantBatchMatmulV2), and the per-channel form's (N,) scale with group 0 for int8 (CANN documents
(N,), (1, N) and (1,); MindFormers passes (N,)); an fp16 offset of up to 255 in magnitude is exact in fp16.
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
    Constraint("antiquant_group_size 0 (per channel) or a multiple of 32 in [32, K-1]", _DOCSTRING, ("K", "G"),
               lambda K, G: G == 0 or (G % 32 == 0 and 32 <= G <= K - 1)),
    Constraint("K at most 65535", _DOCSTRING, ("K",), lambda K: 1 <= K <= 65535),
    Constraint("N at most 65535", _DOCSTRING, ("N",), lambda N: 1 <= N <= 65535),
    Constraint("K even for 4-bit weights (two int4 per qint4x2 byte)", "mindspore 2.10 qint4x2", ("K", "bits"),
               lambda K, bits: bits != 4 or K % 2 == 0),
    Constraint("weight_bits 4 (qint4x2) or 8 (int8)", "CANN aclnnWeightQuantBatchMatmulV2 weight dtypes (int4, int8)",
               ("bits",), lambda bits: bits in (4, 8)),
)


def _int32(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int32), name))


def _unpack_nodes() -> list[onnx.NodeProto]:
    """weight int8 [N, K * bits / 8] -> q float32 [N, K], bits = weight_bits: each byte's fields of `bits`
    bits, the low one first, two's complement. With m = 2^bits: lo_u = Mod(b, m) (fmod 0: 0..m-1), hi = (b -
    lo_u) / m (exact: an arithmetic shift), lo = Mod(lo_u + m/2, m) - m/2 (lo_u sign-extended); the first
    8 / bits of [lo, hi] are kept: both nibbles of a qint4x2 byte, the byte itself (lo = b) for int8."""
    return [
        helper.make_node("Cast", ["weight"], ["b"], to=TensorProto.INT32),
        attr_constant("bits", "value_int", "weight_bits"),
        _int32("powers_of_two", [1 << i for i in range(9)]),
        helper.make_node("Gather", ["powers_of_two", "bits"], ["m"]),   # 2^bits: 16 or 256
        _int32("c2", 2),
        helper.make_node("Div", ["m", "c2"], ["half"]),
        helper.make_node("Mod", ["b", "m"], ["lo_u"]),                 # 0..m-1
        helper.make_node("Sub", ["b", "lo_u"], ["b_hi"]),
        helper.make_node("Div", ["b_hi", "m"], ["hi"]),                # exact: -8..7 (int4), 0 or -1 (int8)
        helper.make_node("Add", ["lo_u", "half"], ["lo_h"]),
        helper.make_node("Mod", ["lo_h", "m"], ["lo_m"]),
        helper.make_node("Sub", ["lo_m", "half"], ["lo"]),             # -m/2..m/2-1
        int64_constant("last", [-1]),
        helper.make_node("Unsqueeze", ["lo", "last"], ["lo1"]),
        helper.make_node("Unsqueeze", ["hi", "last"], ["hi1"]),
        helper.make_node("Concat", ["lo1", "hi1"], ["pairs"], axis=-1),  # [N, W, 2]
        int64_constant("c8", 8),
        helper.make_node("Div", ["c8", "bits"], ["per_scalar"]),        # fields per byte: 2 or 1
        int64_constant("one", [1]),
        helper.make_node("Reshape", ["per_scalar", "one"], ["per"]),
        int64_constant("zero", [0]),
        helper.make_node("Slice", ["pairs", "zero", "per", "last"], ["fields"]),  # [N, W, 8 / bits]
        int64_constant("rows", [0, -1]),
        helper.make_node("Reshape", ["fields", "rows"], ["q_int"]),     # [N, K]
        helper.make_node("Cast", ["q_int"], ["q"], to=TensorProto.FLOAT),
    ]


def _make_body(round_to: int | None):
    """The body; with round_to (a TensorProto dtype) x, scale, offset and y are rounded through it. The groups
    are read from the scale's shape, not from antiquant_group_size: (K/g, N) per group, (N,) per channel (one
    group of K), so one body serves both."""

    def body(opset: int) -> list[onnx.NodeProto]:
        nodes: list[onnx.NodeProto] = []

        nodes += rounded_to_fp32("x", "x32", round_to)
        nodes += rounded_to_fp32("antiquant_scale", "s32", round_to)
        nodes += rounded_to_fp32("antiquant_offset", "o32", round_to)
        nodes += _unpack_nodes()
        nodes += [
            helper.make_node("Shape", ["weight"], ["w_shape"], start=0, end=1),  # [N]
            helper.make_node("Concat", ["last", "w_shape"], ["by_n"], axis=0),     # [-1, N]
            helper.make_node("Reshape", ["s32", "by_n"], ["s2"]),                  # (K/g, N) or (1, N)
            helper.make_node("Reshape", ["o32", "by_n"], ["o2"]),
            helper.make_node("Shape", ["s2"], ["groups"], start=0, end=1),
            helper.make_node("Concat", ["zero", "groups", "last"], ["grouped"], axis=0),  # [0, K/g, -1]
            helper.make_node("Reshape", ["q", "grouped"], ["qg"]),                 # [N, K/g, g]
            helper.make_node("Transpose", ["s2"], ["s_t"], perm=[1, 0]),           # (N, K/g)
            helper.make_node("Transpose", ["o2"], ["o_t"], perm=[1, 0]),
            helper.make_node("Unsqueeze", ["s_t", "last"], ["s_g"]),               # [N, K/g, 1]
            helper.make_node("Unsqueeze", ["o_t", "last"], ["o_g"]),
            helper.make_node("Add", ["qg", "o_g"], ["shifted"]),
            helper.make_node("Mul", ["shifted", "s_g"], ["wg"]),
            helper.make_node("Reshape", ["wg", "rows"], ["w_nk"]),                 # [N, K]
            helper.make_node("Transpose", ["w_nk"], ["w_kn"], perm=[1, 0]),        # [K, N]
            helper.make_node("MatMul", ["x32", "w_kn"], ["y32" if round_to is None else "y32_full"]),
        ]
        if round_to is not None:
            nodes += rounded_to_fp32("y32_full", "y32", round_to)
        nodes.append(from_fp32(opset, "y32", "x", "y"))
        return nodes

    return body


WEIGHT_QUANT_BATCH_MATMUL = define(FusedOp(
    name="WeightQuantBatchMatmul", inputs=("x", "weight", "antiquant_scale", "antiquant_offset"), outputs=("y",),
    attributes=("antiquant_group_size", "weight_bits"), body=_make_body(None), primitive="WeightQuantBatchMatmul",
    doc=__doc__,
    ascend_body=_make_body(TensorProto.FLOAT16), producer="fuse-quant-matmul", family="quant_matmul",
    as_is_inputs=(1,), ascend_compute="fp16",
    likely_causes="the nibble order (element 2j in the low nibble), the offset's sign (+offset = -zero point), "
                  "the scale layout ((K/g, N), or (N,) per channel), fp16 rounding of x and the scales",
    constraints=CONSTRAINTS))


@register("WeightQuantBatchMatmul", since=1, domain="mindspore")
def lower_weight_quant_batch_matmul(n):
    import onnx_ir as ir

    bits = int(n.attr("weight_bits", 4))
    if bits not in (4, 8):
        n.fail(f"weight_bits={bits} (4: a qint4x2 weight, 8: an int8 one)")
    if bits == 4 and not n.qint4x2(1):
        n.fail("the weight is not an initializer read only by WeightQuantBatchMatmul (it must be a qint4x2 Parameter)")
    if bits == 8 and (n.dtype(1) != ir.DataType.INT8 or n.const(1) is None):
        n.fail("the 8-bit weight is not an int8 initializer (it must be an int8 Parameter)")
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
