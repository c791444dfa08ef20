"""Neural-network ops: Conv, pooling, BatchNormalization, LayerNormalization.

Padding is always applied explicitly with ops.pad and the MindSpore op runs with pad_mode='valid', so
asymmetric ONNX pads need no special case.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register

_F32, _I64 = ir.DataType.FLOAT, ir.DataType.INT64


def _spatial_attrs(n, spatial: int, w_index: int = 1):
    kernel = n.ints_attr("kernel_shape", spatial, 1)
    strides = n.ints_attr("strides", spatial, 1, 1)
    dilations = n.ints_attr("dilations", spatial, 1, 1)
    pads = n.ints_attr("pads", 2 * spatial, 0, 0)
    auto_pad = text(n.attr("auto_pad", "NOTSET"))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        src = n.shape(0)
        dims = src[2:] if src else [None] * spatial
        if kernel is None:
            kernel = n.shape(w_index)[2:]
        pads_b, pads_e = [], []
        for d, k, s, dl in zip(dims, kernel, strides, dilations):
            if isinstance(d, int):
                total = max((-(-d // s) - 1) * s + (k - 1) * dl + 1 - d, 0)
            elif s == 1:
                total = (k - 1) * dl  # at stride 1 the input size cancels out: dynamic dims are fine
            else:
                n.fail(f"auto_pad={auto_pad} with a stride > 1 needs static spatial dims")
            small, big = total // 2, total - total // 2
            pads_b.append(small if auto_pad == "SAME_UPPER" else big)
            pads_e.append(big if auto_pad == "SAME_UPPER" else small)
        pads = pads_b + pads_e
    elif auto_pad == "VALID":
        pads = [0] * (2 * spatial)
    return kernel, list(strides), list(dilations), list(pads)


def _ms_padding(pads: list[int], spatial: int) -> tuple:
    """ONNX [b1..bn, e1..en] -> ops.pad order (last axis first)."""
    out = []
    for a in reversed(range(spatial)):
        out += [pads[a], pads[a + spatial]]
    return tuple(out)


@register("Conv", since=11)
def conv(n):
    """The Conv2D/Conv3D primitives directly: ops.conv2d's Python argument checks turn into run-time
    `raise` nodes when the channel dim is dynamic, and a MindIR holding them cannot be loaded."""
    y = conv_expr(n, n.x(0), n.x(1))
    spatial = len(n.shape(1)) - 2
    if n.has(2):
        b = n.const(2)
        bias = (n.const_tensor(b.reshape((-1,) + (1,) * spatial), "bias") if b is not None
                else n.call("ops.reshape", n.x(2), (-1,) + (1,) * spatial))
        y = n.binop("+", y, bias)
    return y


def conv_expr(n, x, w, w_index: int = 1):
    """The convolution of x by w (Values; the shape of input w_index, the node's attributes), without bias."""
    w_shape = n.shape(w_index)
    if w_shape is None or not all(isinstance(d, int) for d in w_shape):
        n.fail("the weight shape must be static")
    spatial = len(w_shape) - 2
    if spatial not in (1, 2, 3):
        n.fail(f"{spatial}-D convolution is not supported")
    _, strides, dilations, pads = _spatial_attrs(n, spatial, w_index)
    if any(pads):
        x = n.call("ops.pad", x, _ms_padding(pads, spatial))
    if spatial == 1:  # as 2-D with a height of 1
        x, w = n.call("ops.expand_dims", x, 2), n.call("ops.expand_dims", w, 2)
        w_shape = [w_shape[0], w_shape[1], 1, w_shape[2]]
        strides, dilations = [1] + strides, [1] + dilations
    prim = n.call("ops.Conv3D" if spatial == 3 else "ops.Conv2D", w_shape[0], tuple(w_shape[2:]),
                  stride=tuple(strides), dilation=tuple(dilations), group=n.attr("group", 1))
    y = n.call(prim, x, w)
    if spatial == 1:
        y = n.call("ops.squeeze", y, (2,))
    return y


@register("MaxPool", since=12)
def max_pool(n):
    rank = n.require_rank(0)
    spatial = rank - 2
    indices = n.n_outputs > 1 and bool(n.node.outputs[1].name)
    floating = n.dtype(0) is not None and n.dtype(0).name in ("FLOAT", "FLOAT16", "DOUBLE")
    if spatial != 2 or indices or not floating:
        return _window_pool(n, "max")
    kernel, strides, dilations, pads = _spatial_attrs(n, spatial)
    x = n.x(0)
    ceil_mode = bool(n.attr("ceil_mode", 0))
    if any(pads[a] + pads[a + spatial] > kernel[a] for a in range(spatial)):
        return _window_pool(n, "max")  # the primitives refuse pads larger than the window
    if all(d == 1 for d in dilations):
        # MaxPool3D takes asymmetric pads and applies ONNX's ceil_mode rule to them (a window may not start in
        # the end padding); explicit padding would let such windows through.
        pad_list = (0, 0, pads[0], pads[2], pads[1], pads[3])
        prim = n.call("ops.MaxPool3D", (1, kernel[0], kernel[1]), (1, strides[0], strides[1]), "PAD", pad_list,
                      ceil_mode)
        y = n.call(prim, n.call("ops.expand_dims", x, 2))
        return n.call("ops.squeeze", y, (2,))
    # Dilated windows: MaxPoolWithArgmaxV2 pads symmetrically, at most half the kernel; pad explicitly otherwise.
    padding = tuple(pads[:spatial])
    if pads[:spatial] != pads[spatial:] or any(2 * p > k for p, k in zip(padding, kernel)):
        if ceil_mode:
            return _window_pool(n, "max")
        x = n.call("ops.pad", x, _ms_padding(pads, spatial), "constant", float("-inf"))
        padding = 0
    return n.call("ops.max_pool2d", x, tuple(kernel), tuple(strides), padding, tuple(dilations), ceil_mode=ceil_mode)


@register("AveragePool", since=11)
def average_pool(n):
    rank = n.require_rank(0)
    spatial = rank - 2
    if spatial != 2:
        return _window_pool(n, "avg")
    kernel, strides, dilations, pads = _spatial_attrs(n, spatial)
    if any(d != 1 for d in dilations) or any(pads[a] + pads[a + spatial] > kernel[a] for a in range(spatial)):
        return _window_pool(n, "avg")
    # ops.avg_pool2d (AvgPool3D) takes (top, bottom, left, right): asymmetric pads need no special case.
    padding = (pads[0], pads[2], pads[1], pads[3])
    return n.call("ops.avg_pool2d", n.x(0), tuple(kernel), tuple(strides), padding,
                  ceil_mode=bool(n.attr("ceil_mode", 0)), count_include_pad=bool(n.attr("count_include_pad", 0)))


def _pool_geometry(n, spatial: int, dims: list[int]):
    """Output sizes and begin/end pads of a pooling window, as the ONNX reference defines them."""
    kernel = n.ints_attr("kernel_shape", spatial, 1)
    if kernel is None:
        n.fail("kernel_shape is required")
    strides = n.ints_attr("strides", spatial, 1, 1)
    dilations = n.ints_attr("dilations", spatial, 1, 1)
    auto_pad = text(n.attr("auto_pad", "NOTSET"))
    k_eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-d // s) for d, s in zip(dims, strides)]
        total = [max((o - 1) * s + k - d, 0) for o, s, k, d in zip(out, strides, k_eff, dims)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        return kernel, strides, dilations, out, begin, [t - b for t, b in zip(total, begin)]
    if auto_pad == "VALID":
        out = [-(-(d - k + 1) // s) for d, k, s in zip(dims, k_eff, strides)]
        return kernel, strides, dilations, out, [0] * spatial, [0] * spatial
    pads = n.ints_attr("pads", 2 * spatial, 0, 0)
    begin, end = pads[:spatial], pads[spatial:]
    out = []
    for d, b, e, k, s in zip(dims, begin, end, k_eff, strides):
        size = (d + b + e - k) / s + 1
        if n.attr("ceil_mode", 0):
            o = int(np.ceil(size))
            if (o - 1) * s >= d + b:  # no window may start in the end padding
                o -= 1
        else:
            o = int(np.floor(size))
        out.append(o)
    return kernel, strides, dilations, out, begin, end


def _window_pool(n, kind: str, p: int = 2):
    """Max / average / Lp pooling for any rank, dtype, pads, dilations and ceil_mode, from static shapes: one strided
    slice of the padded input per kernel offset, combined elementwise. Window o of an axis covers input
    positions o*stride - pad_begin + j*dilation; max ignores positions outside the input, average divides by the
    positions inside the input (or inside input + pads with count_include_pad), both compile-time counts.
    MaxPool's Indices output is the flat (row-major, or column-major over the spatial dims with storage_order=1)
    index of the first maximum."""
    xs = n.shape(0)
    if xs is None or not all(isinstance(d, int) for d in xs[2:]):
        n.fail("pooling needs static spatial dims")
    spatial = len(xs) - 2
    dims = xs[2:]
    kernel, strides, dilations, out, begin, end = _pool_geometry(n, spatial, dims)
    np_dt = n.dtype(0).numpy()
    need_end = [(o - 1) * s + (k - 1) * dl + 1 - d - b
                for o, s, k, dl, d, b in zip(out, strides, kernel, dilations, dims, begin)]
    x = n.x(0)
    if kind == "lp":
        x = n.call("ops.pow", n.call("ops.abs", x), float(p)) if p != 1 else n.call("ops.abs", x)
    fill = 0
    if kind == "max":
        fill = float("-inf") if np.dtype(np_dt).kind == "f" else int(np.iinfo(np_dt).min)
    if any(e < 0 for e in need_end):  # windows never reach the end: crop (ops.pad with a negative amount and a
        # fill value is unreliable on CPU)
        crop = tuple(slice(None, d + e) if e < 0 else slice(None) for d, e in zip(dims, need_end))
        x = n.getitem(x, (slice(None), slice(None)) + crop)
        need_end = [max(e, 0) for e in need_end]
    if any(begin) or any(need_end):
        x = n.call("ops.pad", x, _ms_padding(begin + need_end, spatial), "constant", fill)
    combos = list(np.ndindex(*kernel))
    acc = best_idx = None
    indices = kind == "max" and n.n_outputs > 1 and bool(n.node.outputs[1].name)
    col_major = bool(n.attr("storage_order", 0))
    for combo in combos:
        index = tuple(slice(j * dl, j * dl + (o - 1) * s + 1, s) for j, dl, o, s in zip(combo, dilations, out, strides))
        window = n.getitem(x, (slice(None), slice(None)) + index)
        if kind == "max":
            if acc is None:
                acc = window
            else:
                better = n.binop(">", window, acc) if indices else None
                acc = n.call("ops.maximum", acc, window)
            if indices:
                pos = [np.arange(o) * s - b + j * dl for o, s, b, j, dl in zip(out, strides, begin, combo, dilations)]
                grid = np.meshgrid(*pos, indexing="ij")
                if col_major:
                    strides_flat = [int(np.prod(dims[:a])) for a in range(spatial)]
                else:
                    strides_flat = [int(np.prod(dims[a + 1:])) for a in range(spatial)]
                flat = sum(g.astype(np.int64) * st for g, st in zip(grid, strides_flat))
                flat_t = n.const_tensor(flat.astype(np.int64)[None, None], "flat")
                best_idx = flat_t if best_idx is None else n.call("ops.where", better, flat_t, best_idx)
        else:
            acc = window if acc is None else n.binop("+", acc, window)
    if kind == "max":
        if indices:
            if not all(isinstance(d, int) for d in xs[:2]):
                n.fail("the Indices output needs static N and C")
            base = (np.arange(xs[0] * xs[1], dtype=np.int64) * int(np.prod(dims))).reshape(xs[0], xs[1], *[1] * spatial)
            return acc, n.binop("+", n.call("ops.broadcast_to", best_idx, tuple(xs[:2]) + tuple(out)),
                                n.const_tensor(base, "base"))
        return acc
    if kind == "lp":
        return n.call("ops.pow", acc, 1.0 / p) if p != 1 else acc
    include = bool(n.attr("count_include_pad", 0))
    counts = np.ones(out)
    for a in range(spatial):
        pos = np.arange(out[a])[:, None] * strides[a] - begin[a] + np.arange(kernel[a])[None, :] * dilations[a]
        lo, hi = (-begin[a], dims[a] + end[a]) if include else (0, dims[a])
        c = ((pos >= lo) & (pos < hi)).sum(axis=1)
        counts = counts * c.reshape([-1] + [1] * (spatial - a - 1))
    return n.binop("/", acc, n.const_tensor(counts.astype(np_dt), "count"))


@register("LpPool", since=11)
def lp_pool(n):
    """Opset 11+ (18 adds ceil_mode, 22 only types): (sum |x|^p over the window)^(1/p), pads contributing 0."""
    return _window_pool(n, "lp", int(n.attr("p", 2)))


@register("LpPool", since=18)
def lp_pool18(n):
    return _window_pool(n, "lp", int(n.attr("p", 2)))


@register("GlobalAveragePool", "GlobalMaxPool", since=1)
def global_pool(n):
    rank = n.require_rank(0)
    axes = tuple(range(2, rank))
    if n.node.op_type == "GlobalAveragePool":
        return n.call("ops.mean", n.x(0), axes, keep_dims=True)
    return n.call("ops.amax", n.x(0), axes, keepdims=True)


def _channel_param(n, i: int, spatial: int, hint: str):
    """A per-channel (C,) input reshaped to (C, 1, ..., 1) so it broadcasts over (N, C, spatial...)."""
    c = n.const(i)
    if c is not None:
        return n.const_tensor(c.reshape((-1,) + (1,) * spatial), hint)
    return n.call("ops.reshape", n.x(i), (-1,) + (1,) * spatial)


def _mean_square(n, x, axes):
    """ops.mean(x * x, axes, keep_dims=True)."""
    return n.call("ops.mean", n.binop("*", x, x), axes, keep_dims=True)


@register("BatchNormalization", since=9)
def batch_norm(n):
    """BatchNormalization-9 to -15: the same inference formula. Training mode is the `training_mode` attribute
    from opset 14; before it, the presence of the running-statistics outputs (BatchNormalization-9)."""
    rank = n.require_rank(0)
    spatial = rank - 2
    eps = float(n.attr("epsilon", 1e-5))
    training = n.attr("training_mode", 0) if n.opset >= 14 else n.n_outputs > 1
    if training:
        return _batch_norm_training(n, rank, eps)
    scale, bias, mean, var = (_channel_param(n, i, spatial, h) for i, h in
                              ((1, "bn_scale"), (2, "bn_bias"), (3, "bn_mean"), (4, "bn_var")))
    inv = n.binop("/", scale, n.call("ops.sqrt", n.binop("+", var, eps)))
    return n.binop("+", n.binop("*", n.binop("-", n.x(0), mean), inv), bias)


def _batch_norm_training(n, rank: int, eps: float):
    """training_mode=1: normalise with the batch statistics (population variance); the optional outputs are the
    updated running mean and variance, input * momentum + batch statistic * (1 - momentum)."""
    spatial = rank - 2
    axes = (0,) + tuple(range(2, rank))
    x = n.x(0)
    mean = n.call("ops.mean", x, axes, keep_dims=True)
    centered = n.binop("-", x, mean)
    var = _mean_square(n, centered, axes)
    scale, bias = _channel_param(n, 1, spatial, "bn_scale"), _channel_param(n, 2, spatial, "bn_bias")
    y = n.binop("+", n.binop("*", n.binop("/", centered, n.call("ops.sqrt", n.binop("+", var, eps))), scale), bias)
    if n.n_outputs == 1:
        return y
    m = float(n.attr("momentum", 0.9))
    flat_mean, flat_var = n.call("ops.reshape", mean, (-1,)), n.call("ops.reshape", var, (-1,))
    return (y, n.binop("+", n.binop("*", n.x(3), m), n.binop("*", flat_mean, 1 - m)),
            n.binop("+", n.binop("*", n.x(4), m), n.binop("*", flat_var, 1 - m)))


@register("InstanceNormalization", since=6)
def instance_norm(n):
    rank = n.require_rank(0)
    axes = tuple(range(2, rank))
    x = n.x(0)
    mean = n.call("ops.mean", x, axes, keep_dims=True)
    centered = n.binop("-", x, mean)
    var = _mean_square(n, centered, axes)
    eps = float(n.attr("epsilon", 1e-5))
    scaled = n.binop("*", _channel_param(n, 1, rank - 2, "in_scale"), centered)
    normed = n.binop("/", scaled, n.call("ops.sqrt", n.binop("+", var, eps)))
    return n.binop("+", normed, _channel_param(n, 2, rank - 2, "in_bias"))


@register("GroupNormalization", since=21)
def group_norm(n):
    """Opset 21: statistics per group of C/num_groups channels, scale and bias per channel (stash in fp32)."""
    xs = n.shape(0)
    if xs is None or not isinstance(xs[1], int):
        n.fail("the channel dim must be static")
    groups = int(n.attr("num_groups"))
    rank = len(xs)
    x = n.x(0)
    dt = n.dtype(0)
    low = dt is not None and dt.name in ("FLOAT16", "BFLOAT16")
    if low:
        x = n.call("ops.cast", x, n.ms_dtype(_F32))
    head = n.const_tensor(np.array([groups, -1], np.int64), "groups")
    batch = n.getitem(n.call("ops.dyn_shape", x), slice(None, 1))
    dims = n.helper("onnx_dims")
    grouped = n.call("ops.reshape", x, n.call(dims, n.call("ops.concat", (batch, head))))
    mean = n.call("ops.mean", grouped, 2, keep_dims=True)
    centered = n.binop("-", grouped, mean)
    var = _mean_square(n, centered, 2)
    eps = float(n.attr("epsilon", 1e-5))
    normed = n.binop("/", centered, n.call("ops.sqrt", n.binop("+", var, eps)))
    y = n.call("ops.reshape", normed, n.call(dims, n.call("ops.dyn_shape", n.x(0))))
    if low:
        y = n.call("ops.cast", y, n.ms_dtype(dt))
    return n.binop("+", n.binop("*", _channel_param(n, 1, rank - 2, "gn_scale"), y),
                   _channel_param(n, 2, rank - 2, "gn_bias"))


@register("LRN", since=13)
def lrn(n):
    """Square sums over a window of channels [c - floor((size-1)/2), c + ceil((size-1)/2)], as a padded sum of
    channel slices."""
    xs = n.shape(0)
    if xs is None or not isinstance(xs[1], int):
        n.fail("the channel dim must be static")
    size = int(n.attr("size"))
    alpha, beta, bias = float(n.attr("alpha", 1e-4)), float(n.attr("beta", 0.75)), float(n.attr("bias", 1.0))
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    x = n.x(0)
    sq = n.binop("*", x, x)
    spatial = len(xs) - 2
    padded = n.call("ops.pad", sq, (0, 0) * spatial + (before, after))
    c = xs[1]
    total = None
    for k in range(size):
        part = n.getitem(padded, (slice(None), slice(k, k + c)))
        total = part if total is None else n.binop("+", total, part)
    return n.binop("/", x, n.call("ops.pow", n.binop("+", bias, n.binop("*", alpha / size, total)), beta))


@register("MeanVarianceNormalization", since=13)
def mean_variance_normalization(n):
    """(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over `axes` (default 0, 2, 3), as the ONNX function body."""
    rank = n.require_rank(0)
    axes = tuple(sorted(n.axis(a, rank) for a in (n.attr("axes") or [0, 2, 3])))
    x = n.x(0)
    mean = n.call("ops.mean", x, axes, keep_dims=True)
    mean_sq = _mean_square(n, x, axes)
    std = n.call("ops.sqrt", n.binop("-", mean_sq, n.binop("*", mean, mean)))
    return n.binop("/", n.binop("-", x, mean), n.binop("+", std, 1e-9))


@register("LpNormalization", since=1)
def lp_normalization(n):
    """x / (sum |x|^p)^(1/p) along axis (p 1 or 2); 0 where the norm is 0."""
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    p = int(n.attr("p", 2))
    x = n.x(0)
    if p == 1:
        norm = n.call("ops.sum", n.call("ops.abs", x), (axis,), keepdim=True)
    elif p == 2:
        norm = n.call("ops.sqrt", n.call("ops.sum", n.binop("*", x, x), (axis,), keepdim=True))
    else:
        n.fail(f"p={p} is not supported (1 or 2)")
    return n.call("ops.where", n.binop("==", norm, 0), n.call("ops.zeros_like", x), n.binop("/", x, norm))


@register("LayerNormalization", since=17)
def layer_norm(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    eps = float(n.attr("epsilon", 1e-5))
    stats = n.n_outputs > 1 and any(v.name for v in n.node.outputs[1:])
    axes = tuple(range(axis, rank))
    x = n.x(0)
    low_precision = n.dtype(0) is not None and n.dtype(0).name in ("FLOAT16", "BFLOAT16")
    if low_precision:  # stash_type=1: statistics in fp32
        x = n.call("ops.cast", x, n.ms_dtype(_F32))
    mean = n.call("ops.mean", x, axes, keep_dims=True)
    centered = n.binop("-", x, mean)
    var = _mean_square(n, centered, axes)
    inv_std = n.call("ops.rsqrt", n.binop("+", var, eps))
    y = n.binop("*", centered, inv_std)
    if low_precision:
        y = n.call("ops.cast", y, n.ms_dtype(n.dtype(0)))
    y = n.binop("*", y, n.x(1))
    if n.has(2):
        y = n.binop("+", y, n.x(2))
    # Mean and InvStdDev (optional outputs): the statistics, reduced axes kept as 1, in the stash type (fp32).
    return (y, mean, inv_std) if stats else y


@register("RMSNormalization", since=23)
def rms_normalization(n):
    """Opset 23: y = x / sqrt(mean(x^2 over axes[axis:]) + eps) * scale, statistics in fp32 (stash_type=1)."""
    rank = n.require_rank(0)
    axes = tuple(range(n.axis(n.attr("axis", -1), rank), rank))
    eps = float(n.attr("epsilon", 1e-5))
    x = n.x(0)
    low_precision = n.dtype(0) is not None and n.dtype(0).name in ("FLOAT16", "BFLOAT16")
    if low_precision:
        x = n.call("ops.cast", x, n.ms_dtype(_F32))
    ms_ = _mean_square(n, x, axes)
    y = n.binop("*", x, n.call("ops.rsqrt", n.binop("+", ms_, eps)))
    if low_precision:
        y = n.call("ops.cast", y, n.ms_dtype(n.dtype(0)))
    return n.binop("*", y, n.x(1))


@register("ConvTranspose", since=11)
def conv_transpose(n):
    """As a stride-1 convolution: the input gets stride-1 zeros between elements and k_eff-1-pad on each side
    (negative: cropped; output_padding at the end), the kernel is transposed per group and flipped. pads
    follow the spec: from output_shape or auto_pad (total padding split begin/end) when given, else `pads`."""
    xs, ws = n.shape(0), n.shape(1)
    if xs is None or ws is None or not all(isinstance(d, int) for d in ws):
        n.fail("a known input rank and a static weight shape are needed")
    spatial = len(ws) - 2
    if spatial not in (1, 2, 3):
        n.fail(f"{spatial}-D transposed convolution is not supported")
    group = n.attr("group", 1)
    kernel = list(ws[2:])
    strides = n.ints_attr("strides", spatial, 1, 1)
    dilations = n.ints_attr("dilations", spatial, 1, 1)
    out_pad = n.ints_attr("output_padding", spatial, 0, 0)
    auto_pad = text(n.attr("auto_pad", "NOTSET"))
    k_eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    in_dims = xs[2:]
    out_shape = n.attr("output_shape")
    if out_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out_shape = [d * s for d, s in zip(in_dims, strides)]
    if out_shape is not None:
        if not all(isinstance(d, int) for d in in_dims):
            n.fail("output_shape or a SAME auto_pad needs static spatial input dims")
        out_shape = list(out_shape)[-spatial:]
        total = [s * (d - 1) + op + k - o for s, d, op, k, o in zip(strides, in_dims, out_pad, k_eff, out_shape)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        pads = begin + [t - b for t, b in zip(total, begin)]
    else:
        pads = n.ints_attr("pads", 2 * spatial, 0, 0)
    x, w = n.x(0), n.x(1)
    cin, cout_g = ws[0], ws[1]
    cout = cout_g * group
    # Kernel (Cin, Cout/g, k..) -> (Cout, Cin/g, k..), flipped in every spatial dim.
    w = n.call("ops.reshape", w, (group, cin // group, cout_g) + tuple(kernel))
    w = n.call("ops.transpose", w, (0, 2, 1) + tuple(range(3, 3 + spatial)))
    w = n.call("ops.reshape", w, (cout, cin // group) + tuple(kernel))
    w = n.call("ops.flip", w, tuple(range(2, 2 + spatial)))
    for a, s in enumerate(strides):  # s-1 zeros after each element, the last s-1 dropped: (d-1)*s+1
        if s == 1 or in_dims[a] == 0:
            continue
        ax = 2 + a  # (no size is named, so the spatial dims may be dynamic)
        grown = n.call("ops.expand_dims", x, ax + 1)
        after = len(xs) - 1 - ax  # axes after the new one
        x = n.call("ops.pad", grown, (0, 0) * (after) + (0, s - 1))
        x = n.call("ops.flatten", x, start_dim=ax, end_dim=ax + 1)
        x = n.getitem(x, tuple([slice(None)] * ax) + (slice(None, -(s - 1)),))
    pad_b = [k - 1 - p for k, p in zip(k_eff, pads[:spatial])]
    pad_e = [k - 1 - p + op for k, p, op in zip(k_eff, pads[spatial:], out_pad)]
    if any(pad_b) or any(pad_e):
        x = n.call("ops.pad", x, _ms_padding(pad_b + pad_e, spatial))
    kshape = kernel
    if spatial == 1:
        x, w = n.call("ops.expand_dims", x, 2), n.call("ops.expand_dims", w, 2)
        kshape, dilations = [1] + kernel, [1] + list(dilations)
    prim = n.call("ops.Conv3D" if spatial == 3 else "ops.Conv2D", cout, tuple(kshape), dilation=tuple(dilations),
                  group=group)
    y = n.call(prim, x, w)
    if spatial == 1:
        y = n.call("ops.squeeze", y, (2,))
    if n.has(2):
        y = n.binop("+", y, _channel_param(n, 2, spatial, "bias"))
    return y


@register("MaxUnpool", since=11)
def max_unpool(n):
    """Scatter X into zeros at the flat indices I (MaxPool's Indices: over the whole tensor) of the inferred shape,
    (in - 1) * stride + kernel - pads per spatial dim; with output_shape, zero-padded at the end to it."""
    xs = n.shape(0)
    if xs is None or not all(isinstance(d, int) for d in xs):
        n.fail("MaxUnpool needs a static input shape")
    spatial = len(xs) - 2
    kernel = n.ints_attr("kernel_shape", spatial, 1)
    if kernel is None:
        n.fail("kernel_shape is required")
    strides = n.ints_attr("strides", spatial, 1, 1)
    pads = n.ints_attr("pads", 2 * spatial, 0, 0)
    inferred = xs[:2] + [(d - 1) * s + k - pads[a] - pads[a + spatial]
                         for a, (d, s, k) in enumerate(zip(xs[2:], strides, kernel))]
    total = int(np.prod(inferred))
    zeros = n.const_tensor(np.zeros(total, n.dtype(0).numpy()), "zeros")
    idx = n.call("ops.reshape", n.call("ops.cast", n.x(1), n.ms_dtype(_I64)), (-1, 1))
    flat = n.call("ops.tensor_scatter_update", zeros, idx, n.call("ops.reshape", n.x(0), (-1,)))
    y = n.call("ops.reshape", flat, tuple(inferred))
    if n.has(2):  # as the reference: the inferred-shape result, zero-padded at the end to output_shape
        out = n.require_ints(2, "MaxUnpool output_shape")
        extra = [o - i for o, i in zip(out, inferred)]
        if any(e < 0 for e in extra):
            n.fail("output_shape smaller than the inferred shape is not supported")
        if any(extra):
            order = []
            for e in reversed(extra):
                order += [0, e]
            y = n.call("ops.pad", y, tuple(order))
    return y


@register("Col2Im", since=18)
def col2im(n):
    """Sum each column block back into the image: input (N, C * prod(block), L) -> (N, C, *image_shape), with
    constant scatter-add indices (positions falling in the padding go to a discarded extra slot)."""
    xs = n.shape(0)
    image = n.require_ints(1, "Col2Im image_shape")
    block = n.require_ints(2, "Col2Im block_shape")
    if xs is None or not all(isinstance(d, int) for d in xs[1:]):
        n.fail("Col2Im needs static input dims (but the batch)")
    r = len(image)
    dil = n.ints_attr("dilations", r, 1, 1)
    strides = n.ints_attr("strides", r, 1, 1)
    pads = n.ints_attr("pads", 2 * r, 0, 0)
    k = int(np.prod(block))
    channels = xs[1] // k
    counts = [(image[a] + pads[a] + pads[a + r] - dil[a] * (block[a] - 1) - 1) // strides[a] + 1 for a in range(r)]
    if xs[1] % k or xs[2] != int(np.prod(counts)):
        n.fail(f"input {xs[1:]} does not match {k} block elements and {int(np.prod(counts))} blocks")
    # For each kernel offset (row within the channel) and block (column): the pixel it lands on.
    offs = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1).reshape(-1, r)
    blocks = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"), -1).reshape(-1, r)
    pos = blocks[None, :, :] * np.array(strides) - np.array(pads[:r]) + offs[:, None, :] * np.array(dil)
    inside = np.all((pos >= 0) & (pos < np.array(image)), axis=-1)
    flat = np.ravel_multi_index(tuple(np.clip(pos, 0, np.array(image) - 1).transpose(2, 0, 1)), image)
    total = int(np.prod(image))
    flat = np.where(inside, flat, total).reshape(1, 1, -1).astype(np.int64)
    index = n.const_tensor(np.broadcast_to(flat, (1, channels, flat.shape[-1])).copy(), "col_index")
    x = n.call("ops.reshape", n.x(0), (-1, channels, k * xs[2]))
    batch = n.getitem(n.call("ops.dyn_shape", n.x(0)), 0)
    zeros = n.call("ops.zeros", (batch, channels, total + 1), n.ms_dtype(n.dtype(0)))
    index = n.call("ops.broadcast_to", index, (batch, channels, k * xs[2]))
    summed = n.call("ops.tensor_scatter_elements", zeros, index, x, 2, "add")
    return n.call("ops.reshape", n.getitem(summed, (slice(None), slice(None), slice(None, total))),
                  (-1, channels) + tuple(image))


@register("DeformConv", since=19)
def deform_conv(n):
    """2-D deformable convolution, as the ONNX reference: each kernel tap samples the input bilinearly (zero
    outside the image) at its regular position plus the learned offset (per offset group), times the mask; the
    samples (N, C * kH * kW, oH * oW) then meet the weights in one grouped matmul."""
    xs, ws, os_ = n.shape(0), n.shape(1), n.shape(2)
    if any(s is None or not all(isinstance(d, int) for d in s) for s in (xs, ws, os_)) or len(xs) != 4:
        n.fail("DeformConv needs static 2-D input, weight and offset shapes")
    batch, channels, height, width = xs
    out_c, _, kh, kw = ws
    oh, ow = os_[2:]
    group, og = int(n.attr("group", 1)), int(n.attr("offset_group", 1))
    sh, sw = n.ints_attr("strides", 2, 1, 1)
    dh, dw = n.ints_attr("dilations", 2, 1, 1)
    pads = n.ints_attr("pads", 4, 0, 0)
    k, p = kh * kw, oh * ow
    base_h = (np.arange(oh)[None, :, None] * sh - pads[0] + np.arange(kh)[:, None, None] * dh)  # (kh, oh, 1)
    base_w = (np.arange(ow)[None, None, :] * sw - pads[1] + np.arange(kw)[:, None, None] * dw)  # (kw, 1, ow)
    base_h = np.broadcast_to(base_h[:, None], (kh, kw, oh, ow)).reshape(1, 1, k, p).astype(np.float32)
    base_w = np.broadcast_to(base_w[None], (kh, kw, oh, ow)).reshape(1, 1, k, p).astype(np.float32)
    off = n.call("ops.reshape", n.x(2), (batch, og, k, 2, p))
    py = n.binop("+", n.const_tensor(base_h, "base_h"), n.getitem(off, (slice(None), slice(None), slice(None), 0)))
    # (N, G, K, P)
    px = n.binop("+", n.const_tensor(base_w, "base_w"), n.getitem(off, (slice(None), slice(None), slice(None), 1)))
    y0, x0 = n.call("ops.floor", py), n.call("ops.floor", px)
    ly, lx = n.binop("-", py, y0), n.binop("-", px, x0)
    mask = n.call("ops.reshape", n.x(4), (batch, og, k, p)) if n.has(4) else None
    feat = n.call("ops.reshape", n.x(0), (batch, og, channels // og, height * width))
    not_ly, not_lx = n.binop("-", 1, ly), n.binop("-", 1, lx)
    f32 = n.ms_dtype(_F32)
    ys, xs_ = (y0, n.binop("+", y0, 1)), (x0, n.binop("+", x0, 1))
    terms = []
    for dy, dx, (wy, wx) in ((0, 0, (not_ly, not_lx)), (0, 1, (not_ly, lx)), (1, 0, (ly, not_lx)), (1, 1, (ly, lx))):
        yy, xx = ys[dy], xs_[dx]
        inside_y = n.call("ops.logical_and", n.binop(">=", yy, 0), n.binop("<", yy, height))
        inside_x = n.call("ops.logical_and", n.binop(">=", xx, 0), n.binop("<", xx, width))
        valid = n.call("ops.cast", n.call("ops.logical_and", inside_y, inside_x), f32)
        flat = n.binop("+", n.binop("*", n.call("ops.clamp", yy, 0, height - 1), width),
                       n.call("ops.clamp", xx, 0, width - 1))
        idx = n.call("ops.cast", flat, n.ms_dtype(_I64))
        idx = n.call("ops.broadcast_to", n.call("ops.reshape", idx, (batch, og, 1, k * p)),
                     (batch, og, channels // og, k * p))
        wt = n.binop("*", n.binop("*", wy, wx), valid)
        if mask is not None:
            wt = n.binop("*", wt, mask)
        terms.append(n.binop("*", n.call("ops.gather_elements", feat, 3, idx),
                             n.call("ops.reshape", wt, (batch, og, 1, k * p))))
    total = terms[0]
    for t in terms[1:]:
        total = n.binop("+", total, t)
    cols = n.call("ops.reshape", total, (batch, group, channels // group * k, p))
    weights = n.call("ops.reshape", n.x(1), (1, group, out_c // group, channels // group * k))
    y = n.call("ops.reshape", n.call("ops.matmul", weights, cols), (batch, out_c, oh, ow))
    if n.has(3):
        y = n.binop("+", y, _channel_param(n, 3, 2, "bias"))
    return y


@register("GlobalLpPool", since=2)
def global_lp_pool(n):
    """(sum over the spatial dims of |x|^p)^(1/p), kept as size-1 dims."""
    axes = tuple(range(2, n.require_rank(0)))
    p = int(n.attr("p", 2))
    x = n.call("ops.abs", n.x(0))
    if p == 1:
        return n.call("ops.sum", x, axes, keepdim=True)
    if p == 2:
        return n.call("ops.sqrt", n.call("ops.sum", n.binop("*", x, x), axes, keepdim=True))
    return n.call("ops.pow", n.call("ops.sum", n.call("ops.pow", x, float(p)), axes, keepdim=True), 1.0 / p)
