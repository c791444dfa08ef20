"""RMS normalisation contrib ops -> the RMSNorm spelling of a PyTorch export (fuse-rmsnorm makes
mindspore::RmsNorm of it).

SimplifiedLayerNormalization (default domain, registered by onnxruntime; inputs X, scale; attributes axis=-1,
epsilon=1e-5, stash_type=1; outputs Y, inv_std_var):
    inv_std_var = 1 / sqrt(mean(x^2 over axes axis..rank-1) + epsilon), Y = x * inv_std_var * scale,
    computed in float32 (stash_type 1) whatever X's type, Y cast back to X's type.
SkipSimplifiedLayerNormalization (com.microsoft; inputs input, skip, gamma, bias?; attribute epsilon=1e-12;
outputs output, mean, inv_std_var, input_skip_bias_sum):
    s = input + skip (+ bias); output = the above of s over the last axis with gamma;
    input_skip_bias_sum = s (the residual stream the next layer adds to: it matters).
    The `mean` output is not computed by a simplified norm: a model reading it is refused.
Read from onnxruntime's contrib-op schemas and its CPU kernels (layer_norm_impl.cc and skip_layer_norm.cc,
`simplified` branch): sums and products in float32, one cast back at the end.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite

FLOAT = onnx.TensorProto.FLOAT


def to_float(rw: Rewrite, value: str, dtype: int | None) -> str:
    """`value` in float32 (a Cast only when it is not already)."""
    return value if dtype == FLOAT else rw.op("Cast", value, to=FLOAT)


def back_to(rw: Rewrite, value: str, dtype: int | None, out: str) -> None:
    """Write float32 `value` to output `out` in `dtype` (nothing when the model does not use `out`)."""
    if not out:
        return
    if dtype in (FLOAT, None):
        rw.identity(value, out)
    else:
        rw.op("Cast", value, outputs=[out], to=dtype)


def reduce_mean(rw: Rewrite, value: str, axes: list[int]) -> str:
    if rw.opset >= 18:
        return rw.op("ReduceMean", value, rw.const(axes, np.int64), keepdims=1)
    return rw.op("ReduceMean", value, axes=axes, keepdims=1)


def rms_norm(rw: Rewrite, x32: str, gamma: str, eps: float, axes: list[int]) -> tuple[str, str]:
    """(y32, inv_std_var) of float32 `x32`: the spelling fuse-rmsnorm matches."""
    mean_square = reduce_mean(rw, rw.op("Mul", x32, x32), axes)
    inv_std = rw.op("Reciprocal", rw.op("Sqrt", rw.op("Add", mean_square, rw.const(np.float32(eps)))))
    gamma32 = to_float(rw, gamma, rw.dtype(gamma))
    return rw.op("Mul", rw.op("Mul", x32, inv_std), gamma32), inv_std


def normalized_axes(rw: Rewrite, x: str, axis: int) -> list[int]:
    """The axes a norm over `axis`..last covers (-1 needs no rank)."""
    if axis == -1:
        return [-1]
    shape = rw.shape(x)
    if shape is None:
        rw.fail(f"axis {axis} needs the input's rank, which shape inference did not give")
    rank = len(shape)
    axis = axis + rank if axis < 0 else axis
    return list(range(axis, rank))


@decomposes("SimplifiedLayerNormalization", domain="")
def simplified_layer_normalization(rw: Rewrite) -> None:
    x, dtype = rw.input(0), rw.dtype(rw.input(0))
    if rw.attr("stash_type", 1) != 1:
        rw.fail(f"stash_type {rw.attr('stash_type')} (only 1, float32 statistics, is defined by onnxruntime's kernel)")
    y32, inv_std = rms_norm(rw, to_float(rw, x, dtype), rw.input(1), rw.attr("epsilon", 1e-5),
                            normalized_axes(rw, x, rw.attr("axis", -1)))
    back_to(rw, y32, dtype, rw.output(0))
    rw.identity(inv_std, rw.output(1))


@decomposes("SkipSimplifiedLayerNormalization", domain=MICROSOFT)
def skip_simplified_layer_normalization(rw: Rewrite) -> None:
    if rw.output(1):
        rw.fail("its `mean` output is read, which a simplified (RMS) norm does not compute")
    x, dtype = rw.input(0), rw.dtype(rw.input(0))
    s32 = rw.op("Add", to_float(rw, x, dtype), to_float(rw, rw.input(1), rw.dtype(rw.input(1))))
    if rw.has(3):
        s32 = rw.op("Add", s32, to_float(rw, rw.input(3), rw.dtype(rw.input(3))))
    y32, inv_std = rms_norm(rw, s32, rw.input(2), rw.attr("epsilon", 1e-12), [-1])
    back_to(rw, y32, dtype, rw.output(0))
    rw.identity(inv_std, rw.output(2))
    if rw.output(3):
        back_to(rw, s32, dtype, rw.output(3))
