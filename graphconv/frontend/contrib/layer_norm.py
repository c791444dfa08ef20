"""LayerNorm contrib ops -> the decomposed LayerNorm a PyTorch export below opset 17 writes (fuse-layernorm
makes mindspore::LayerNorm of it).

SkipLayerNormalization (com.microsoft; inputs input, skip, gamma, beta?, bias?; attribute epsilon=1e-12;
outputs output, mean, inv_std_var, input_skip_bias_sum):
    s = input + skip (+ bias), skip (B, S, H), (1, S, H) or (S, H) broadcast;
    output = (s - mean(s)) / sqrt(var(s) + epsilon) * gamma (+ beta) over the last axis, population variance;
    input_skip_bias_sum = s. fp16 inputs compute in float32 and round once at the end.
    onnxruntime's CPU kernel never writes `mean` and `inv_std_var`: a model reading them is refused.
LayerNormalization (default domain below opset 17, where onnxruntime registers it before onnx did; inputs X,
Scale, B?; attributes axis=-1, epsilon=1e-5, stash_type=1; outputs Y, Mean, InvStdDev): the same over axes
axis..rank-1, statistics in float32 (stash_type 1); Mean and InvStdDev keep the normalised axes as 1.
Read from onnxruntime's contrib schemas and CPU kernels (contrib_ops/cpu/skip_layer_norm.cc,
core/providers/cpu/nn/layer_norm_impl.cc). The kernels take the variance as E[s^2] - E[s]^2 in one pass; the
decomposition takes E[(s - E[s])^2] (the spelling exporters write), equal up to float rounding.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.frontend.contrib.norm import back_to, normalized_axes, reduce_mean, to_float
from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite


def layer_norm(rw: Rewrite, x32: str, gamma: str, beta: str, eps: float, axes: list[int]) -> tuple[str, str, str]:
    """(y32, mean, std) of float32 `x32`: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add, the
    spelling fuse-layernorm matches. `beta` may be '' (no bias)."""
    mean = reduce_mean(rw, x32, axes)
    d = rw.op("Sub", x32, mean)
    var = reduce_mean(rw, rw.op("Pow", d, rw.const(np.float32(2.0))), axes)
    std = rw.op("Sqrt", rw.op("Add", var, rw.const(np.float32(eps))))
    y = rw.op("Mul", rw.op("Div", d, std), to_float(rw, gamma, rw.dtype(gamma)))
    if beta:
        y = rw.op("Add", y, to_float(rw, beta, rw.dtype(beta)))
    return y, mean, std


@decomposes("SkipLayerNormalization", domain=MICROSOFT)
def skip_layer_normalization(rw: Rewrite) -> None:
    if rw.output(1) or rw.output(2):
        rw.fail("its mean / inv_std_var outputs are read, which onnxruntime's CPU kernel never writes")
    x, dtype = rw.input(0), rw.dtype(rw.input(0))
    s32 = rw.op("Add", to_float(rw, x, dtype), to_float(rw, rw.input(1), rw.dtype(rw.input(1))))
    if rw.has(4):
        s32 = rw.op("Add", s32, to_float(rw, rw.input(4), rw.dtype(rw.input(4))))
    y32, _, _ = layer_norm(rw, s32, rw.input(2), rw.input(3), rw.attr("epsilon", 1e-12), [-1])
    back_to(rw, y32, dtype, rw.output(0))
    if rw.output(3):
        back_to(rw, s32, dtype, rw.output(3))


@decomposes("LayerNormalization", domain="")
def layer_normalization(rw: Rewrite) -> None:
    """onnxruntime's LayerNormalization below opset 17 (at 17 and later it is onnx's own and stays)."""
    if rw.attr("stash_type", 1) != 1:
        rw.fail(f"stash_type {rw.attr('stash_type')}: only 1 (float32 statistics) is decomposed")
    x, dtype = rw.input(0), rw.dtype(rw.input(0))
    if dtype == onnx.TensorProto.DOUBLE:
        rw.fail("float64 input (the decomposition computes in float32)")
    axes = normalized_axes(rw, x, rw.attr("axis", -1))
    y32, mean, std = layer_norm(rw, to_float(rw, x, dtype), rw.input(1), rw.input(2), rw.attr("epsilon", 1e-5), axes)
    back_to(rw, y32, dtype, rw.output(0))
    rw.identity(mean, rw.output(1))
    if rw.output(2):
        rw.op("Reciprocal", std, outputs=[rw.output(2)])
