"""mindspore::QuantV2(x, scale, zero_point) -> int8 and mindspore::QuantBatchMatmul(x1, x2, scale, bias; dtype) -> y:
static W8A8, MindSpore's `QuantV2` and `QuantBatchMatmul` (ops.auto_generate, aclnn AscendQuantV2 and
QuantMatmulV4), made by passes/fuse_qdq_matmul.py from QuantizeLinear -> DequantizeLinear -> MatMul by a
DequantizeLinear'd int8 weight (docs/fused_ops.md).

QuantV2: y = saturate_int8(round_half_even(x / scale) + zero_point), scale a float scalar (the QDQ graph's
activation scale s_x), zero_point an int8 scalar: exactly ONNX's QuantizeLinear, which the reference body is.
A uint8 activation is shifted to int8 on the way: clamp(round(x/s) + zp, 0, 255) - 128 = clamp(round(x/s) +
(zp - 128), -128, 127), exact, so the pass gives zero_point zp - 128.
QuantBatchMatmul: y = dtype((x1 @ x2^T + bias) * scale), x1 int8 [..., K], x2 int8 [N, K] (the weight stored
transposed), bias int32 [N], scale float32 [N] (the dequantization scale s_x * s_w per output column), dtype
the model's float type. With zero_point z the pass folds the activation's offset into the bias:
sum_k (q_k - z) w_kn = sum_k q_k w_kn - z * sum_k w_kn, so bias = -z * sum_k Wq[n, k], exact in int32.

Reference bodies (what onnxruntime runs and the cpu twin inlines): QuantV2 is QuantizeLinear on x cast to
fp32; QuantBatchMatmul casts both int8 operands to int32 and multiplies in int32 (exact: |sum| <= K * 2^14,
the pass refuses K >= 2^17), adds the bias in int32, then casts to fp32 and multiplies by the scale. No int8
MatMul: MindSpore's CPU int8 MatMul returns int8; its int32 MatMul is exact.

The ascend lowerings: QuantV2()(x, 1/scale, zero_point) in x's own dtype (the docstring takes fp16, fp32 and
bf16), scale and offset [K] (the docstring: the last axis of x), computed once at compile time (1/scale in
fp32, then rounded to x's dtype); the kernel computes round(x * scale + offset), so it multiplies by the
reciprocal where ONNX divides. QuantBatchMatmul(transpose_x1=False,
transpose_x2=True, dtype=fp16|bf16)(x1 as 2-D [M, K], x2 an int8 Parameter, scale, None, bias, None), the
result reshaped back (MindFormers' A8W8 linear flattens x1 the same way). Its scale: for fp16 output an int64
holding the fp32 bits (MindSpore's tests' trans_fp32_to_u64), of which the hardware reads the top 19 bits
(sign, exponent, 10 mantissa bits: `bits & 0xFFFFE000`, aclnnTransQuantParamV2); for bf16 output the float32
scale itself (MindFormers' A8W8LinearMethod).
The ascend-precision bodies: QuantV2 multiplies x by 1/scale rounded to x's dtype; QuantBatchMatmul models the
fp16 output (an fp32 or fp16 model): the scale truncated to its top 19 bits, y rounded through fp16.
UNCONFIRMED without a device: the kernel's tie rule (ONNX rounds half to even; the body does too, AscendQuantV2's
"ROUND" is not documented further), whether it computes x * scale in fp32 or in x's dtype, the 19-bit
truncation, and the offset's dtype (the docstring says x's; MindFormers passes an int8 offset).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opmap.fused.record import FusedOp, define, from_fp32, rounded_to_fp32
from opmap.registry import register

FP16_MAX = 65504.0
TRUNCATED_SCALE_MASK = 0xFFFFE000  # the 19 bits of a deq scale QuantBatchMatmul's fp16 path reads


def _f32(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.float32), name))


def _quant_v2_body(opset: int) -> list[onnx.NodeProto]:
    return [helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["scale"], ["s32"], to=TensorProto.FLOAT),
            helper.make_node("QuantizeLinear", ["x32", "s32", "zero_point"], ["y"])]


def _quant_v2_ascend_body(opset: int) -> list[onnx.NodeProto]:
    """round(x * dtype(1/scale) + zero_point), saturated to int8: the kernel's arithmetic as read from its
    docstring, 1/scale rounded to x's dtype, multiplied in fp32 (UNCONFIRMED)."""
    return [helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["scale"], ["s32"], to=TensorProto.FLOAT),
            helper.make_node("Reciprocal", ["s32"], ["inv32"]),
            from_fp32(opset, "inv32", "x", "inv_x"),
            helper.make_node("Cast", ["inv_x"], ["inv"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["zero_point"], ["offset"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x32", "inv"], ["scaled"]),
            helper.make_node("Add", ["scaled", "offset"], ["shifted"]),
            helper.make_node("Round", ["shifted"], ["rounded"]),
            _f32("lo", -128.0), _f32("hi", 127.0),
            helper.make_node("Clip", ["rounded", "lo", "hi"], ["clamped"]),
            helper.make_node("Cast", ["clamped"], ["y"], to=TensorProto.INT8)]


def _cast_to_dtype(src: str, dst: str) -> onnx.NodeProto:
    """Cast `src` to the node's attribute `dtype` (an attribute reference: the output's float type)."""
    node = helper.make_node("Cast", [src], [dst])
    node.attribute.append(helper.make_attribute_ref("to", onnx.AttributeProto.INT, ref_attr_name="dtype"))
    return node


def _accumulate() -> list[onnx.NodeProto]:
    """x1 @ x2^T + bias in int32, cast to fp32 as `acc32`."""
    return [helper.make_node("Cast", ["x1"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["x2"], ["w_nk"], to=TensorProto.INT32),
            helper.make_node("Transpose", ["w_nk"], ["w_kn"], perm=[1, 0]),
            helper.make_node("MatMul", ["a", "w_kn"], ["acc"]),
            helper.make_node("Add", ["acc", "bias"], ["acc_b"]),
            helper.make_node("Cast", ["acc_b"], ["acc32"], to=TensorProto.FLOAT)]


def _quant_batch_matmul_body(opset: int) -> list[onnx.NodeProto]:
    return [*_accumulate(), helper.make_node("Mul", ["acc32", "scale"], ["y32"]), _cast_to_dtype("y32", "y")]


def truncated_scale_nodes(src: str, dst: str) -> list[onnx.NodeProto]:
    """A positive normal fp32 `src` with its mantissa cut to 10 bits (toward zero), as `dst`: e = floor(log2 s)
    (from Log, corrected by one either way against an exact power of two), ulp = 2^(e - 10), dst = floor(s /
    ulp) * ulp; every step but the Log is exact. Onnxruntime only runs it (the ascend-precision body)."""
    return [_f32("two", 2.0), _f32("one", 1.0), _f32("ten", 10.0), _f32("ln2", float(np.log(2.0))),
            helper.make_node("Log", [src], ["ln_s"]),
            helper.make_node("Div", ["ln_s", "ln2"], ["log2_s"]),
            helper.make_node("Floor", ["log2_s"], ["e0"]),
            helper.make_node("Pow", ["two", "e0"], ["p0"]),
            helper.make_node("Greater", ["p0", src], ["too_high"]),
            helper.make_node("Cast", ["too_high"], ["down"], to=TensorProto.FLOAT),
            helper.make_node("Sub", ["e0", "down"], ["e1"]),
            helper.make_node("Add", ["e1", "one"], ["e1_next"]),
            helper.make_node("Pow", ["two", "e1_next"], ["p1"]),
            helper.make_node("LessOrEqual", ["p1", src], ["too_low"]),
            helper.make_node("Cast", ["too_low"], ["up"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["e1", "up"], ["e"]),
            helper.make_node("Sub", ["e", "ten"], ["e_ulp"]),
            helper.make_node("Pow", ["two", "e_ulp"], ["ulp"]),
            helper.make_node("Div", [src, "ulp"], ["units"]),
            helper.make_node("Floor", ["units"], ["whole"]),
            helper.make_node("Mul", ["whole", "ulp"], [dst])]


def _quant_batch_matmul_ascend_body(opset: int) -> list[onnx.NodeProto]:
    """The fp16 path: the scale read as its top 19 bits, y rounded through fp16."""
    return [*_accumulate(), *truncated_scale_nodes("scale", "scale19"),
            helper.make_node("Mul", ["acc32", "scale19"], ["y32_full"]),
            *rounded_to_fp32("y32_full", "y32", TensorProto.FLOAT16), _cast_to_dtype("y32", "y")]


_DOC_QUANT = __doc__.split("QuantBatchMatmul: ")[0]

QUANT_V2 = define(FusedOp(
    name="QuantV2", inputs=("x", "scale", "zero_point"), outputs=("y",), attributes=(), body=_quant_v2_body,
    primitive="QuantV2", doc=_DOC_QUANT, ascend_body=_quant_v2_ascend_body, producer="fuse-qdq-matmul",
    family="qdq_matmul", as_is_inputs=(1, 2),
    likely_causes="the kernel multiplies by 1/scale where QuantizeLinear divides (a value near a rounding "
                  "boundary moves by one quantum), 1/scale rounded to x's dtype; the tie rule"))

QUANT_BATCH_MATMUL = define(FusedOp(
    name="QuantBatchMatmul", inputs=("x1", "x2", "scale", "bias"), outputs=("y",), attributes=("dtype",),
    body=_quant_batch_matmul_body, primitive="QuantBatchMatmul", doc=__doc__,
    ascend_body=_quant_batch_matmul_ascend_body, producer="fuse-qdq-matmul", family="qdq_matmul",
    as_is_inputs=(0, 1, 2, 3), ascend_compute="fp16",
    likely_causes="the 19-bit truncation of the fp16 path's int64 scale, fp16 rounding of y, the bias folding "
                  "the activation's zero point (-zp * sum_k W[n, k]), the weight stored [N, K]"))


@register("QuantV2", since=1, domain="mindspore")
def lower_quant_v2(n):
    """QuantV2 in x's own dtype (its docstring takes fp16, fp32 and bf16): no rounding of x before the scale."""
    import onnx_ir as ir

    dtype = n.dtype(0)
    scale, zero_point, shape = n.const(1), n.const(2), n.shape(0)
    if scale is None or zero_point is None or scale.size != 1 or zero_point.size != 1:
        n.fail("the scale and zero point must be constant scalars (QuantV2's scale is computed at compile time)")
    if not shape or not isinstance(shape[-1], int):
        n.fail("the last dim of x must be static (QuantV2's scale and offset have its size)")
    k = shape[-1]
    inverse = np.float32(1.0) / scale.astype(np.float32).reshape(())
    if dtype == ir.DataType.FLOAT16 and not abs(float(inverse)) <= FP16_MAX:
        n.fail(f"1/scale = {float(inverse):.6g} overflows fp16 (QuantV2's scale is in x's dtype)")

    def in_x_dtype(value: float, hint: str):
        """[K] of `value` in x's dtype: converted here for fp32/fp16 (numpy rounds to nearest even, as a Cast
        does), cast in the network for bf16 (numpy has no bf16)."""
        full = np.full((k,), value, np.float32)
        if dtype == ir.DataType.FLOAT16:
            return n.const_tensor(full.astype(np.float16), hint)
        if dtype == ir.DataType.FLOAT:
            return n.const_tensor(full, hint)
        return n.call("ops.cast", n.const_tensor(full, hint), n.ms_dtype(dtype))

    scale_k = in_x_dtype(float(inverse), "quant_scale")
    offset_k = in_x_dtype(float(zero_point.reshape(())), "quant_offset")
    return n.call(n.call("ops.auto_generate.QuantV2"), n.x(0), scale_k, offset_k)


def scale_as_int64(scale: np.ndarray) -> np.ndarray:
    """The fp16 path's scale: each fp32 value's bit pattern in an int64 (MindSpore's trans_fp32_to_u64)."""
    return np.ascontiguousarray(scale, np.float32).view(np.uint32).astype(np.int64)


@register("QuantBatchMatmul", since=1, domain="mindspore")
def lower_quant_batch_matmul(n):
    import onnx_ir as ir

    out_dt = ir.DataType(int(n.attr("dtype")))
    compute = out_dt if out_dt in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else ir.DataType.FLOAT16
    scale, w_shape, x_shape = n.const(2), n.shape(1), n.shape(0)
    if scale is None:
        n.fail("the scale must be a constant (its fp16 form is encoded at compile time)")
    if not x_shape or not w_shape or len(w_shape) != 2:
        n.fail("x1's rank must be known and x2 must be 2-D [N, K]")
    big = compute == ir.DataType.FLOAT16
    scale_t = n.const_tensor(scale_as_int64(scale), "deq_scale") if big else n.x(2)
    x1 = n.x(0)
    if len(x_shape) != 2:
        x1 = n.call("ops.reshape", x1, (-1, int(w_shape[1])))
    prim = n.call("ops.auto_generate.QuantBatchMatmul", transpose_x1=False, transpose_x2=True,
                  dtype=n.ms_dtype(compute))
    y = n.call(prim, x1, n.x(1), scale_t, None, n.x(3), None)
    if len(x_shape) != 2:
        dims = n.call("ops.dyn_shape", n.x(0))
        target = n.call("ops.concat", n.tuple(n.getitem(dims, slice(0, -1)),
                                              n.const_tensor(np.array([w_shape[0]], np.int64), "n_out")))
        y = n.call("ops.reshape", y, n.call(n.helper("onnx_dims"), target))
    return y if out_dt == compute else n.call("ops.cast", y, n.ms_dtype(out_dt))
