"""GELU-family contrib ops -> the GELU spellings of a PyTorch TorchScript export (fuse-gelu makes
mindspore::Gelu / GeluTanh / FastGelu of them).

  Gelu (com.microsoft)   exact: 0.5 x (1 + erf(x / sqrt 2))                  -> mindspore::Gelu
  BiasGelu               the exact GELU of A + B (B 1-D, broadcast)            -> mindspore::Gelu
  FastGelu               the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of X (+ bias):
                         onnxruntime's kernel writes it as tanh(x (0.7978845608 + 0.0356774081 x^2)), the
                         same function                                          -> mindspore::GeluTanh
                         (never MindSpore's FastGeLU, which is x sigmoid(1.702 x))
  QuickGelu              x sigmoid(alpha x), alpha=1.702 by default            -> mindspore::FastGelu only
                         when alpha is 1.702 (fuse-gelu checks), else it stays as written
  BiasSplitGelu          s = X + bias over the last axis D, left/right halves of s: left * Gelu(right),
                         exact erf GELU, in float32 (contrib_ops/cuda/diffusion/bias_split_gelu_impl.cu:
                         onnxruntime has no CPU kernel, so no oracle runs a model holding it)
Read from onnxruntime's contrib schemas (Gelu's function body, FastGelu's and QuickGelu's docs) and kernels
(contrib_ops/cpu/bert/bias_gelu.cc, fast_gelu.cc, contrib_ops/cpu/activations.h).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from graphconv.dtypes import FLOATS
from graphconv.frontend import weights
from graphconv.frontend.contrib import spell
from graphconv.frontend.contrib.norm import back_to, to_float
from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite


def _float_dtype(rw: Rewrite, x: str):
    """x's numpy dtype, which must be a float (float32 when unknown)."""
    dtype = rw.dtype(x)
    if dtype is None:
        return np.float32
    if dtype not in FLOATS:
        rw.fail(f"input dtype {onnx.TensorProto.DataType.Name(dtype)} (GELU takes floats)")
    return weights.np_dtype(dtype)


def _c(rw: Rewrite, value: float, dt) -> str:
    return rw.const(np.asarray(value, dt))


def gelu_erf(rw: Rewrite, x: str, dt, out: str | None = None) -> str:
    """x * (1 + erf(x / sqrt 2)) * 0.5, TorchScript's nn.GELU() spelling."""
    t = rw.op("Erf", rw.op("Div", x, _c(rw, math.sqrt(2.0), dt)))
    inner = rw.op("Mul", x, rw.op("Add", t, _c(rw, 1.0, dt)))
    return rw.op("Mul", inner, _c(rw, 0.5, dt), outputs=[out] if out else 1)


def gelu_tanh(rw: Rewrite, x: str, dt, out: str) -> None:
    """x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), TorchScript's spelling of GPT-2's gelu_new."""
    cube = rw.op("Pow", x, _c(rw, 3.0, dt))
    inner = rw.op("Add", x, rw.op("Mul", cube, _c(rw, 0.044715, dt)))
    t = rw.op("Tanh", rw.op("Mul", inner, _c(rw, math.sqrt(2.0 / math.pi), dt)))
    rw.op("Mul", rw.op("Mul", x, _c(rw, 0.5, dt)), rw.op("Add", t, _c(rw, 1.0, dt)), outputs=[out])


def _plus_bias(rw: Rewrite, x: str, i: int) -> str:
    return rw.op("Add", x, rw.input(i)) if rw.has(i) else x


@decomposes("Gelu", domain=MICROSOFT)
def gelu(rw: Rewrite) -> None:
    gelu_erf(rw, rw.input(0), _float_dtype(rw, rw.input(0)), rw.output(0))


@decomposes("BiasGelu", domain=MICROSOFT)
def bias_gelu(rw: Rewrite) -> None:
    gelu_erf(rw, _plus_bias(rw, rw.input(0), 1), _float_dtype(rw, rw.input(0)), rw.output(0))


@decomposes("FastGelu", domain=MICROSOFT)
def fast_gelu(rw: Rewrite) -> None:
    gelu_tanh(rw, _plus_bias(rw, rw.input(0), 1), _float_dtype(rw, rw.input(0)), rw.output(0))


@decomposes("QuickGelu", domain=MICROSOFT)
def quick_gelu(rw: Rewrite) -> None:
    x = rw.input(0)
    alpha = _c(rw, rw.attr("alpha", 1.702), _float_dtype(rw, x))
    rw.op("Mul", x, rw.op("Sigmoid", rw.op("Mul", x, alpha)), outputs=[rw.output(0)])


@decomposes("BiasSplitGelu", domain=MICROSOFT)
def bias_split_gelu(rw: Rewrite) -> None:
    x, dtype = rw.input(0), rw.dtype(rw.input(0))
    _float_dtype(rw, x)
    d = rw.static_dim(rw.input(1), 0)
    if d is None or d % 2:
        rw.fail(f"the bias length {d} is not a known even number (the halves' size)")
    s32 = rw.op("Add", to_float(rw, x, dtype), to_float(rw, rw.input(1), rw.dtype(rw.input(1))))
    left, right = spell.split(rw, s32, [d // 2, d // 2], axis=-1)
    back_to(rw, rw.op("Mul", left, gelu_erf(rw, right, np.float32)), dtype, rw.output(0))
