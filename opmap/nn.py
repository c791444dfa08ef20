"""Neural-network ops: Conv, pooling, BatchNormalization, LayerNormalization.

Padding is always applied explicitly with ops.pad and the MindSpore op runs with pad_mode='valid', so
asymmetric ONNX pads need no special case.
"""

from __future__ import annotations


from opmap.registry import register


def _spatial_attrs(n, spatial: int):
    kernel = n.attr("kernel_shape")
    strides = n.attr("strides") or [1] * spatial
    dilations = n.attr("dilations") or [1] * spatial
    pads = n.attr("pads") or [0] * (2 * spatial)
    auto_pad = n.attr("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        src = n.shape(0)
        dims = src[2:] if src else [None] * spatial
        if kernel is None:
            kernel = n.shape(1)[2:]
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
    w_shape = n.shape(1)
    if w_shape is None or not all(isinstance(d, int) for d in w_shape):
        n.fail("the weight shape must be static")
    spatial = len(w_shape) - 2
    if spatial not in (1, 2, 3):
        n.fail(f"{spatial}-D convolution is not supported")
    _, strides, dilations, pads = _spatial_attrs(n, spatial)
    x, w = n.x(0), n.x(1)
    if any(pads):
        x = f"ops.pad({x}, {_ms_padding(pads, spatial)!r})"
    if spatial == 1:  # as 2-D with a height of 1
        x, w = f"ops.expand_dims({x}, 2)", f"ops.expand_dims({w}, 2)"
        w_shape = [w_shape[0], w_shape[1], 1, w_shape[2]]
        strides, dilations = [1] + strides, [1] + dilations
    prim = "ops.Conv3D" if spatial == 3 else "ops.Conv2D"
    y = (f"{prim}({w_shape[0]}, {tuple(w_shape[2:])!r}, stride={tuple(strides)!r}, "
         f"dilation={tuple(dilations)!r}, group={n.attr('group', 1)})({x}, {w})")
    if spatial == 1:
        y = f"ops.squeeze({y}, (2,))"
    if n.has(2):
        b = n.const(2)
        bias = (n.const_tensor(b.reshape((-1,) + (1,) * spatial), "bias") if b is not None
                else f"ops.reshape({n.x(2)}, {(-1,) + (1,) * spatial!r})")
        y = f"{y} + {bias}"
    return y


@register("MaxPool", since=12)
def max_pool(n):
    rank = n.require_rank(0)
    spatial = rank - 2
    if spatial != 2:
        n.fail("only 2-D MaxPool is supported")
    if n.n_outputs > 1 and n.node.outputs[1].name:
        n.fail("the Indices output is not supported")
    kernel, strides, dilations, pads = _spatial_attrs(n, spatial)
    x = n.x(0)
    ceil_mode = bool(n.attr("ceil_mode", 0))
    if all(d == 1 for d in dilations):
        # MaxPool3D takes asymmetric pads and applies ONNX's ceil_mode rule to them (a window may not start in
        # the end padding); explicit padding would let such windows through.
        pad_list = (0, 0, pads[0], pads[2], pads[1], pads[3])
        y = (f"ops.MaxPool3D((1, {kernel[0]}, {kernel[1]}), (1, {strides[0]}, {strides[1]}), 'PAD', {pad_list!r}, "
             f"{ceil_mode})(ops.expand_dims({x}, 2))")
        return f"ops.squeeze({y}, (2,))"
    # Dilated windows: MaxPoolWithArgmaxV2 pads symmetrically, at most half the kernel; pad explicitly otherwise.
    padding = tuple(pads[:spatial])
    if pads[:spatial] != pads[spatial:] or any(2 * p > k for p, k in zip(padding, kernel)):
        if ceil_mode:
            n.fail("ceil_mode=1 with these pads on a dilated MaxPool is not supported")
        x = f"ops.pad({x}, {_ms_padding(pads, spatial)!r}, 'constant', float('-inf'))"
        padding = 0
    return (f"ops.max_pool2d({x}, {tuple(kernel)!r}, {tuple(strides)!r}, {padding!r}, {tuple(dilations)!r}, "
            f"ceil_mode={ceil_mode})")


@register("AveragePool", since=11)
def average_pool(n):
    rank = n.require_rank(0)
    spatial = rank - 2
    if spatial != 2:
        n.fail("only 2-D AveragePool is supported")
    kernel, strides, dilations, pads = _spatial_attrs(n, spatial)
    if any(d != 1 for d in dilations):
        n.fail("dilated AveragePool is not supported")
    # ops.avg_pool2d (AvgPool3D) takes (top, bottom, left, right): asymmetric pads need no special case.
    padding = (pads[0], pads[2], pads[1], pads[3])
    return (f"ops.avg_pool2d({n.x(0)}, {tuple(kernel)!r}, {tuple(strides)!r}, {padding!r}, "
            f"ceil_mode={bool(n.attr('ceil_mode', 0))}, count_include_pad={bool(n.attr('count_include_pad', 0))})")


@register("GlobalAveragePool", "GlobalMaxPool", since=1)
def global_pool(n):
    rank = n.require_rank(0)
    axes = tuple(range(2, rank))
    if n.node.op_type == "GlobalAveragePool":
        return f"ops.mean({n.x(0)}, {axes!r}, keep_dims=True)"
    return f"ops.amax({n.x(0)}, {axes!r}, keepdims=True)"


def _channel_param(n, i: int, spatial: int, hint: str) -> str:
    """A per-channel (C,) input reshaped to (C, 1, ..., 1) so it broadcasts over (N, C, spatial...)."""
    c = n.const(i)
    if c is not None:
        return n.const_tensor(c.reshape((-1,) + (1,) * spatial), hint)
    return f"ops.reshape({n.x(i)}, {(-1,) + (1,) * spatial!r})"


@register("BatchNormalization", since=15)
def batch_norm(n):
    if n.attr("training_mode", 0):
        n.fail("training_mode=1 is not supported (inference only)")
    rank = n.require_rank(0)
    spatial = rank - 2
    eps = float(n.attr("epsilon", 1e-5))
    scale, bias, mean, var = (_channel_param(n, i, spatial, h) for i, h in
                              ((1, "bn_scale"), (2, "bn_bias"), (3, "bn_mean"), (4, "bn_var")))
    return f"({n.x(0)} - {mean}) * ({scale} / ops.sqrt({var} + {eps!r})) + {bias}"


@register("LayerNormalization", since=17)
def layer_norm(n):
    rank = n.require_rank(0)
    axis = n.axis(n.attr("axis", -1), rank)
    eps = float(n.attr("epsilon", 1e-5))
    if n.n_outputs > 1 and any(v.name for v in n.node.outputs[1:]):
        n.fail("the Mean/InvStdDev outputs are not supported")
    axes = tuple(range(axis, rank))
    x = n.x(0)
    low_precision = n.dtype(0) is not None and n.dtype(0).name in ("FLOAT16", "BFLOAT16")
    if low_precision:  # stash_type=1: statistics in fp32
        x = n.tmp(f"ops.cast({x}, ms.float32)", "x32")
    mean = n.tmp(f"ops.mean({x}, {axes!r}, keep_dims=True)", "mean")
    centered = n.tmp(f"{x} - {mean}", "centered")
    var = n.tmp(f"ops.mean({centered} * {centered}, {axes!r}, keep_dims=True)", "var")
    y = f"{centered} * ops.rsqrt({var} + {eps!r})"
    if low_precision:
        y = f"ops.cast({y}, {n.ms_dtype(n.dtype(0))})"
    y = f"{y} * {n.x(1)}"
    if n.has(2):
        y = f"{y} + {n.x(2)}"
    return y


@register("RMSNormalization", since=23)
def rms_normalization(n):
    """Opset 23: y = x / sqrt(mean(x^2 over axes[axis:]) + eps) * scale, statistics in fp32 (stash_type=1)."""
    rank = n.require_rank(0)
    axes = tuple(range(n.axis(n.attr("axis", -1), rank), rank))
    eps = float(n.attr("epsilon", 1e-5))
    x = n.x(0)
    low_precision = n.dtype(0) is not None and n.dtype(0).name in ("FLOAT16", "BFLOAT16")
    if low_precision:
        x = n.tmp(f"ops.cast({x}, ms.float32)", "x32")
    ms_ = n.tmp(f"ops.mean({x} * {x}, {axes!r}, keep_dims=True)", "meansq")
    y = f"{x} * ops.rsqrt({ms_} + {eps!r})"
    if low_precision:
        y = f"ops.cast({y}, {n.ms_dtype(n.dtype(0))})"
    return f"{y} * {n.x(1)}"

