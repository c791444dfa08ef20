"""Quantization: QuantizeLinear / DequantizeLinear (opsets 13, 19, 21; int8 / uint8 / int16 / uint16 / int32;
per tensor, per axis and blocked; 4-bit types are not: graphconv binds no 4-bit tensors), DynamicQuantizeLinear,
MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv, as the ONNX reference computes them.

Integer products are computed exactly in floating point (float64 for matmuls; float32 for convolutions, whose
CPU kernels have no float64: exact while a sum of products stays below 2^24), then cast to int32. Rounding is
half to even (ops.round), saturation to the output type's range.
"""

from __future__ import annotations

import onnx_ir as ir

from opmap.nn import conv_expr
from opmap.registry import register

_INT_RANGE = {ir.DataType.INT8: (-128, 127), ir.DataType.UINT8: (0, 255), ir.DataType.INT16: (-32768, 32767),
              ir.DataType.UINT16: (0, 65535), ir.DataType.INT32: (-2**31, 2**31 - 1)}


def _range(n, dt) -> tuple[int, int]:
    if dt not in _INT_RANGE:
        n.fail(f"quantized type {ir.DataType(dt).name} is not supported")
    return _INT_RANGE[dt]


def _f32(n):
    return n.ms_dtype(ir.DataType.FLOAT)


def _f64(n):
    return n.ms_dtype(ir.DataType.DOUBLE)


def _per_axis(n, i: int, rank: int):
    """Input i (a scale or zero point): as is when 0-d or 1 element, shaped to broadcast along `axis` when 1-D,
    and for blocked quantization (opset 21 block_size; same rank as x, ceil(dim / block_size) along `axis`)
    each value repeated over its block, the last block cut to x's dim."""
    shape = n.shape(i)
    x = n.x(i)
    block = n.attr("block_size", 0)
    if block:
        if shape is None or len(shape) != rank:
            n.fail(f"blocked quantization needs the scale and zero point of x's rank {rank}")
        axis = n.axis(n.attr("axis", 1), rank)
        dims = n.shape(0)
        if dims is None or not isinstance(dims[axis], int):
            n.fail("blocked quantization needs a static dim of x along the quantization axis")
        full = n.call("ops.repeat_interleave", x, block, axis)
        return full if shape[axis] * block == dims[axis] else n.call("ops.narrow", full, axis, 0, dims[axis])
    if shape is None or len(shape) == 0 or shape == [1]:
        return x
    if len(shape) == 1:
        axis = n.axis(n.attr("axis", 1), rank)
        return n.call("ops.reshape", x, (-1,) + (1,) * (rank - axis - 1))
    n.fail(f"a scale of shape {shape} without block_size")


def _quantize(n):
    rank = n.require_rank(0)
    out = n.out_dtype(0)
    if out is None or out == ir.DataType.UNDEFINED:
        out = n.dtype(2) if n.has(2) else ir.DataType(n.attr("output_dtype", 0) or ir.DataType.UINT8)
    lo, hi = _range(n, out)
    scale = _per_axis(n, 1, rank)
    y = n.call("ops.round", n.binop("/", n.call("ops.cast", n.x(0), _f32(n)), n.call("ops.cast", scale, _f32(n))))
    if n.has(2):
        y = n.binop("+", y, n.call("ops.cast", _per_axis(n, 2, rank), _f32(n)))
    return n.call("ops.cast", n.call("ops.clamp", y, float(lo), float(hi)), n.ms_dtype(out))


def _dequantize(n):
    rank = n.require_rank(0)
    scale = _per_axis(n, 1, rank)
    out = n.out_dtype(0) or n.dtype(1)
    x = n.call("ops.cast", n.x(0), _f32(n))
    if n.has(2):
        x = n.binop("-", x, n.call("ops.cast", _per_axis(n, 2, rank), _f32(n)))
    return n.call("ops.cast", n.binop("*", x, n.call("ops.cast", scale, _f32(n))), n.ms_dtype(out))


@register("QuantizeLinear", since=13)
def quantize13(n):
    return _quantize(n)


@register("QuantizeLinear", since=19)
def quantize19(n):
    """Opset 19 adds float8 outputs (refused: no MindSpore type) and saturate."""
    return _quantize(n)


@register("QuantizeLinear", since=21)
def quantize21(n):
    """Opset 21 adds block_size and output_dtype."""
    return _quantize(n)


@register("DequantizeLinear", since=13)
def dequantize13(n):
    return _dequantize(n)


@register("DequantizeLinear", since=19)
def dequantize19(n):
    return _dequantize(n)


@register("DequantizeLinear", since=21)
def dequantize21(n):
    return _dequantize(n)


@register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(n):
    """uint8: scale = (max(0, max x) - min(0, min x)) / 255 (1/255 for a constant 0 input), zero point =
    round(clamp(-min / scale, 0, 255)), y = clamp(round(x / scale) + zero point, 0, 255); fp32 throughout."""
    x = n.x(0)
    u8 = n.ms_dtype(ir.DataType.UINT8)
    hi = n.call("ops.maximum", n.call("ops.amax", x), 0.0)
    lo = n.call("ops.minimum", n.call("ops.amin", x), 0.0)
    scale = n.binop("/", n.call("ops.where", n.binop("==", hi, lo), n.call("ops.ones_like", hi), n.binop("-", hi, lo)),
                    255.0)
    zp = n.call("ops.round", n.call("ops.clamp", n.binop("-", 0.0, n.binop("/", lo, scale)), 0.0, 255.0))
    shifted = n.binop("+", n.call("ops.round", n.binop("/", x, scale)), zp)
    y = n.call("ops.cast", n.call("ops.clamp", shifted, 0.0, 255.0), u8)
    return y, scale, n.call("ops.cast", zp, u8)


def _centered(n, i: int, zp: int | None, work, zp_shape_axis: int | None = None):
    """Input i in the work float type (a dtype Ref), minus its zero point (input zp) when given."""
    x = n.call("ops.cast", n.x(i), work)
    if zp is not None and n.has(zp):
        z = n.x(zp)
        zs = n.shape(zp)
        if zp_shape_axis is not None and zs is not None and len(zs) == 1 and zs[0] != 1:
            rank = n.require_rank(i)
            z = n.call("ops.reshape", z, (-1,) + (1,) * (rank - zp_shape_axis - 1))
        x = n.binop("-", x, n.call("ops.cast", z, work))
    return x


@register("MatMulInteger", since=10)
def matmul_integer(n):
    a = _centered(n, 0, 2, _f64(n))
    b_zp = n.shape(3) if n.has(3) else None
    if b_zp and len(b_zp) == 1 and b_zp[0] != 1:  # per-column zero point of B
        b = n.binop("-", n.call("ops.cast", n.x(1), _f64(n)), n.call("ops.cast", n.x(3), _f64(n)))
    else:
        b = _centered(n, 1, 3, _f64(n))
    return n.call("ops.cast", n.call("ops.round", n.call("ops.matmul", a, b)), n.ms_dtype(ir.DataType.INT32))


@register("ConvInteger", since=10)
def conv_integer(n):
    x = _centered(n, 0, 2, _f32(n))
    w = _centered(n, 1, 3, _f32(n), zp_shape_axis=0)
    return n.call("ops.cast", n.call("ops.round", conv_expr(n, x, w)), n.ms_dtype(ir.DataType.INT32))


def _requantize(n, acc, scale, zp_i: int, out_dt):
    lo, hi = _range(n, out_dt)
    y = n.binop("*", acc, n.call("ops.cast", scale, _f64(n)))
    if n.has(zp_i):
        y = n.binop("+", y, n.call("ops.cast", n.x(zp_i), _f64(n)))
    return n.call("ops.cast", n.call("ops.clamp", n.call("ops.round", y), float(lo), float(hi)), n.ms_dtype(out_dt))


@register("QLinearMatMul", since=10)
def qlinear_matmul(n):
    """Opset 10 (21 adds float16 / bfloat16 scales): the scale product a_scale * b_scale / y_scale is computed in
    the scales' type, the rest in float64."""
    a = _centered(n, 0, 2, _f64(n))
    b = _centered(n, 3, 5, _f64(n))
    acc = n.call("ops.matmul", a, b)
    scale = n.binop("/", n.binop("*", n.x(1), n.x(4)), n.x(6))
    out = n.dtype(7) if n.has(7) else n.dtype(0)
    return _requantize(n, acc, scale, 7, out)


@register("QLinearMatMul", since=21)
def qlinear_matmul21(n):
    return qlinear_matmul(n)


@register("QLinearConv", since=10)
def qlinear_conv(n):
    x = _centered(n, 0, 2, _f32(n))
    w = _centered(n, 3, 5, _f32(n), zp_shape_axis=0)
    acc = n.call("ops.cast", n.call("ops.round", conv_expr(n, x, w, w_index=3)), _f64(n))
    if n.has(8):
        rank = n.require_rank(0)
        acc = n.binop("+", acc, n.call("ops.cast", n.call("ops.reshape", n.x(8), (-1,) + (1,) * (rank - 2)), _f64(n)))
    rank = n.require_rank(0)
    w_scale = n.shape(4)
    ws = n.x(4)
    if w_scale and len(w_scale) == 1 and w_scale[0] != 1:
        ws = n.call("ops.reshape", ws, (-1,) + (1,) * (rank - 2))
    scale = n.binop("/", n.binop("*", n.x(1), ws), n.x(6))
    out = n.dtype(7) if n.has(7) else n.dtype(0)
    return _requantize(n, acc, scale, 7, out)
