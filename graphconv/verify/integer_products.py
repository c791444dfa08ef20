"""The oracle's integer products, computed exactly whatever the CPU.

onnxruntime runs MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv and com.microsoft's
MatMulIntegerToFloat / DynamicQuantizeMatMul on MLAS's quantized GEMM (the convolutions after an im2col, or
MLAS's own quantized convolution kernels). On x86 without VNNI (AVX2; AVX-512 without VNNI) its u8s8 kernel
multiplies with VPMADDUBSW, which adds each pair of adjacent u8 x s8 products into a saturating int16: a pair
beyond 32767 (255 * 127 + 255 * 127) is clamped, and the result is not the op's (onnxruntime's quantization
documentation; MLAS's MlasPlatformU8S8Overflow). s8s8 goes through it too (A shifted to u8). Which kernel runs
depends on the CPU, so the oracle cannot take these results as they come; MindSpore computes the products
exactly.

`rewrite` returns a copy of a model in which each such node is a decomposition that onnxruntime computes with
kernels that do not saturate; every other node is left as it is:

- the product: both operands Cast to int32 minus their zero points, then an int32 MatMul (onnxruntime's
  int32 MatMul accumulates in int32, as the ops define). onnxruntime has no integer (nor float64) Conv, so a
  convolution's patches are gathered first by a float32 Conv whose kernels are one-hot (each output is one
  input value, times 1: exact), then multiplied with the flattened kernel as an int32 MatMul, per group;
- what follows the product, as onnxruntime's kernels compute it: QLinearMatMul / QLinearConv multiply the
  int32 sum (plus QLinearConv's int32 bias), converted to float32, by the float32 multiplier
  a_scale * b_scale / y_scale, round half to even, add the zero point and saturate (a QuantizeLinear with scale
  1); MatMulIntegerToFloat gives float(sum) * (a_scale * b_scale) + bias; DynamicQuantizeMatMul quantizes A
  as DynamicQuantizeLinear does first.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx

from graphconv.onnx_domains import canonical_domain, find_default_opset, is_default_domain

MICROSOFT = "com.microsoft"
INT32, FLOAT = onnx.TensorProto.INT32, onnx.TensorProto.FLOAT
# (domain, op type) of the nodes rewritten; '' is the default domain.
OPS = (("", "MatMulInteger"), ("", "ConvInteger"), ("", "QLinearMatMul"), ("", "QLinearConv"),
       (MICROSOFT, "MatMulIntegerToFloat"), (MICROSOFT, "DynamicQuantizeMatMul"))
NOTE = "computed exactly in int32 by the oracle (onnxruntime's u8s8 kernel can saturate on x86 without VNNI)"


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return (canonical_domain(node.domain), node.op_type)


def label(key: tuple[str, str]) -> str:
    return f"{key[0]}::{key[1]}" if key[0] else key[1]


def found(model: onnx.ModelProto) -> dict[str, int]:
    """The main graph's nodes `rewrite` replaces, counted per op."""
    counts = collections.Counter(label(_key(n)) for n in model.graph.node if _key(n) in OPS)
    return dict(counts)


def note(counts: dict[str, int]) -> str:
    """What the oracle did, for the report: `MatMulInteger (2 nodes) computed exactly in int32 by the oracle (...)`."""
    ops = ", ".join(f"{op} ({n} node{'s' if n != 1 else ''})" for op, n in sorted(counts.items()))
    return f"{ops} {NOTE}"


def rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` whose main-graph integer-product nodes (OPS) are exact decompositions, and the count
    replaced per op; `model` itself when it has none. A node whose form is not known well enough to rewrite (a
    convolution whose kernel shape is not static; DynamicQuantizeMatMul below opset 11) is left as it is and
    not counted."""
    if not found(model):
        return model, {}
    from graphconv.frontend.contrib.rewrite import Rewrite, static_shapes

    shapes = _Shapes(model, static_shapes)
    opset = find_default_opset(model) or 1
    taken = {x for n in model.graph.node for x in (*n.input, *n.output, n.name)}
    taken |= {t.name for t in model.graph.initializer} | {v.name for v in model.graph.input}
    counts: collections.Counter[str] = collections.Counter()
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        make = _REWRITES.get(_key(node))
        rw = Rewrite(node, shapes, opset, taken) if make else None
        if rw is None or make(rw) is False:
            nodes.append(node)
            continue
        nodes.extend(rw.finish())
        counts[label(_key(node))] += 1
    if not counts:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, dict(counts)


class _Shapes(dict):
    """value -> (dims, elem type): declared ones first (initializers, inputs, value_info), onnxruntime's symbolic
    shape inference (`infer`) asked only when a value is not declared."""

    def __init__(self, model: onnx.ModelProto, infer):
        super().__init__()
        self._model, self._infer = model, infer
        for t in model.graph.initializer:
            self[t.name] = (list(t.dims), t.data_type)
        for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type") and tt.HasField("shape") and vi.name not in self:
                self[vi.name] = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                  for d in tt.shape.dim], tt.elem_type)
        for n in model.graph.node:  # its scale and zero point are scalars (float32, uint8)
            if n.op_type == "DynamicQuantizeLinear" and is_default_domain(n.domain):
                for o, t in zip(n.output[1:3], (FLOAT, onnx.TensorProto.UINT8)):
                    self.setdefault(o, ([], t))

    def get(self, name, default=None):
        if name not in self and self._infer is not None:
            for k, v in self._infer(self._model).items():
                self.setdefault(k, v)
            self._infer = None
        return super().get(name, default)


# --- the products --------------------------------------------------------------------------------------

def _centered(rw, value: str, zp: str, per_row: bool = False, rank: int | None = None) -> str:
    """int32 `value` minus its zero point `zp` (when given). per_row: a 1-D zero point of A, one per row
    (MatMulInteger's [M]), is reshaped to [M, 1]; rank: a 1-D per-output-channel zero point of a kernel of
    that rank is reshaped to [M, 1, ...]. B's per-column zero point [N] broadcasts as it is."""
    x = rw.op("Cast", value, to=INT32)
    if not zp:
        return x
    shape = rw.shape(zp) if per_row or rank is not None else None
    if shape is not None and len(shape) == 1 and (rank is not None or shape[0] != 1):
        zp = rw.op("Reshape", zp, rw.const([-1] + [1] * ((rank or 2) - 1), np.int64))
    return rw.op("Sub", x, rw.op("Cast", zp, to=INT32))


def _matmul(rw, a: str, b: str, a_zp: str, b_zp: str, a_per_row: bool = True) -> str:
    """The int32 product of MatMulInteger's operands: A per tensor or per row, B per tensor or per column."""
    return rw.op("MatMul", _centered(rw, a, a_zp, per_row=a_per_row), _centered(rw, b, b_zp))


def _conv(rw, x: str, w: str, x_zp: str, w_zp: str) -> str | None:
    """The int32 sum of a quantized convolution ([N, M, *out]), or None when the kernel's shape is not static.
    Patches [N, C * K, *out] come from a float32 Conv with one-hot kernels (group C: each input channel gives K
    = prod(kernel) channels, one per kernel position, with the node's strides, pads, dilations and auto_pad);
    they are values of at most 9 bits, so exact. Then per group g: W[g] [M/G, C/G * K] @ patches[g] in int32."""
    shape = rw.shape(w)
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    m, cg, *kernel = shape
    group = rw.attr("group", 1)
    if m % group:
        return None
    k = math.prod(kernel)
    c = cg * group
    xf = rw.op("Cast", x, to=FLOAT)
    if x_zp:
        xf = rw.op("Sub", xf, rw.op("Cast", x_zp, to=FLOAT))
    one_hot = np.tile(np.eye(k, dtype=np.float32).reshape(k, 1, *kernel), (c, 1) + (1,) * len(kernel))
    attrs = {a: rw.attr(a) for a in ("strides", "pads", "dilations", "auto_pad") if rw.attr(a) is not None}
    patches = rw.op("Conv", xf, rw.const(one_hot), group=c, kernel_shape=list(kernel), **attrs)
    columns = rw.op("Reshape", rw.op("Cast", patches, to=INT32), rw.const([0, group, cg * k, -1], np.int64))
    weights = rw.op("Reshape", _centered(rw, w, w_zp, rank=len(shape)), rw.const([group, m // group, cg * k], np.int64))
    y = rw.op("MatMul", weights, columns)  # [N, G, M/G, L]
    rank = len(shape)
    keep = rw.const([1, 0] + [1] * (rank - 2), np.int64)
    out_shape = rw.op("Add", rw.op("Mul", rw.op("Shape", patches), keep), rw.const([0, m] + [0] * (rank - 2), np.int64))
    return rw.op("Reshape", y, out_shape)


def _requantized(rw, acc: str, a_scale: str, b_scale: str, y_scale: str, y_zp: str) -> None:
    """round(float32(acc) * (a_scale * b_scale / y_scale)) + y_zp, saturated to y_zp's type, into the node's
    output (MLAS's requantization: the multiplier and the product in float32, rounded half to even)."""
    multiplier = rw.op("Div", rw.op("Mul", a_scale, b_scale), y_scale)  # in the scales' type
    if rw.dtype(rw.input(1)) not in (None, FLOAT):
        multiplier = rw.op("Cast", multiplier, to=FLOAT)
    y = rw.op("Mul", rw.op("Cast", acc, to=FLOAT), multiplier)
    zp = rw.op("Reshape", y_zp, rw.const(np.zeros(0, np.int64)))  # per tensor: a scalar, as the scale 1
    rw.op("QuantizeLinear", y, rw.const(np.float32(1.0)), zp, outputs=[rw.output(0)])


# --- the ops -------------------------------------------------------------------------------------------

def matmul_integer(rw) -> None:
    rw.identity(_matmul(rw, rw.input(0), rw.input(1), rw.input(2), rw.input(3)), rw.output(0))


def conv_integer(rw) -> bool | None:
    acc = _conv(rw, rw.input(0), rw.input(1), rw.input(2), rw.input(3))
    if acc is None:
        return False
    rw.identity(acc, rw.output(0))
    return None


def qlinear_matmul(rw) -> None:
    acc = _matmul(rw, rw.input(0), rw.input(3), rw.input(2), rw.input(5))
    _requantized(rw, acc, rw.input(1), rw.input(4), rw.input(6), rw.input(7))


def qlinear_conv(rw) -> bool | None:
    acc = _conv(rw, rw.input(0), rw.input(3), rw.input(2), rw.input(5))
    if acc is None:
        return False
    rank = len(rw.shape(rw.input(3)))
    per_channel = rw.const([-1] + [1] * (rank - 2), np.int64)
    if rw.has(8):
        acc = rw.op("Add", acc, rw.op("Reshape", rw.input(8), per_channel))
    w_scale = rw.input(4)
    if rw.shape(w_scale) is not None and len(rw.shape(w_scale)) == 1:
        w_scale = rw.op("Reshape", w_scale, per_channel)
    _requantized(rw, acc, rw.input(1), w_scale, rw.input(6), rw.input(7))
    return None


def _scaled(rw, acc: str, scale: str, bias: str) -> None:
    out_type = rw.dtype(rw.input(2)) or FLOAT
    y = rw.op("Mul", rw.op("Cast", acc, to=out_type), scale)
    rw.identity(rw.op("Add", y, bias) if bias else y, rw.output(0))


def matmul_integer_to_float(rw) -> None:
    """Y = float(A x B) * (a_scale * b_scale) + bias (A, B minus their zero points)."""
    acc = _matmul(rw, rw.input(0), rw.input(1), rw.input(4), rw.input(5))
    _scaled(rw, acc, rw.op("Mul", rw.input(2), rw.input(3)), rw.input(6))


def dynamic_quantize_matmul(rw) -> bool | None:
    """A quantized per tensor to uint8 as DynamicQuantizeLinear does, then MatMulIntegerToFloat with B."""
    if rw.opset < 11:  # (DynamicQuantizeLinear is opset 11)
        return False
    a_q, a_scale, a_zp = rw.op("DynamicQuantizeLinear", rw.input(0), outputs=3)
    acc = _matmul(rw, a_q, rw.input(1), a_zp, rw.input(3), a_per_row=False)  # (a scalar zero point)
    _scaled(rw, acc, rw.op("Mul", a_scale, rw.input(2)), rw.input(4))
    return None


_REWRITES = {("", "MatMulInteger"): matmul_integer, ("", "ConvInteger"): conv_integer,
             ("", "QLinearMatMul"): qlinear_matmul, ("", "QLinearConv"): qlinear_conv,
             (MICROSOFT, "MatMulIntegerToFloat"): matmul_integer_to_float,
             (MICROSOFT, "DynamicQuantizeMatMul"): dynamic_quantize_matmul}
