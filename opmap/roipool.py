"""MaxRoiPool (opset 1), as onnxruntime's kernel (Caffe's ROI pooling) computes it: each roi [batch, x1, y1,
x2, y2] scaled by spatial_scale and rounded half away from zero, split into pooled_shape bins from
floor(p * bin) to ceil((p + 1) * bin), clipped to the feature map; an empty bin gives 0.

Vectorised over rois and bins: a bin's window is a row range times a column range, so the max is taken over
the columns (masked, R x C x H x PW x W) and then over the rows of those column maxima."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register


def _round(n, v):
    """C's round(): half away from zero (ops.round rounds half to even)."""
    return n.binop("*", n.call("ops.sign", v), n.call("ops.floor", n.binop("+", n.call("ops.abs", v), 0.5)))


def _bins(n, start, end, pooled: int, size):
    """Per roi (R,) the [lo, hi) of each of `pooled` bins, (R, pooled), clipped to [0, size]."""
    extent = n.call("ops.maximum", n.binop("+", n.binop("-", end, start), 1.0), 1.0)
    step = n.call("ops.expand_dims", n.binop("/", extent, float(pooled)), 1)  # (R, 1)
    p = n.const_tensor(np.arange(pooled, dtype=np.float32).reshape(1, -1), "bins")
    first = n.call("ops.expand_dims", start, 1)
    lo = n.binop("+", n.call("ops.floor", n.binop("*", p, step)), first)
    hi = n.binop("+", n.call("ops.ceil", n.binop("*", n.binop("+", p, 1.0), step)), first)
    clip = lambda v: n.call("ops.minimum", n.call("ops.maximum", v, 0.0), size)  # noqa: E731
    return clip(lo), clip(hi)


def _mask(n, lo, hi, size):
    """(R, pooled, size): position i of the axis is in the bin."""
    f32 = n.ms_dtype(ir.DataType.FLOAT)
    i = n.call("ops.range", n.call("Tensor", 0.0, f32), size, n.call("Tensor", 1.0, f32))
    lo, hi = n.call("ops.expand_dims", lo, 2), n.call("ops.expand_dims", hi, 2)
    return n.call("ops.logical_and", n.binop(">=", i, lo), n.binop("<", i, hi))


@register("MaxRoiPool", since=1)
def max_roi_pool(n):
    if n.require_rank(0) != 4:
        n.fail("only 4-D (N, C, H, W) inputs are defined")
    ph, pw = (int(v) for v in n.attr("pooled_shape"))
    scale = float(n.attr("spatial_scale", 1.0))
    x, rois = n.x(0), n.x(1)
    f32 = n.ms_dtype(ir.DataType.FLOAT)
    if n.dtype(1) != ir.DataType.FLOAT:
        rois = n.call("ops.cast", rois, f32)
    col = [n.getitem(rois, (slice(None), k)) for k in range(5)]
    batch = n.call("ops.cast", col[0], n.ms_dtype(ir.DataType.INT64))
    x1, y1, x2, y2 = (_round(n, n.binop("*", c, scale)) for c in col[1:])
    dims = n.call("ops.cast", n.call("ops.dyn_shape", x), f32)
    height, width = n.getitem(dims, 2), n.getitem(dims, 3)
    h_lo, h_hi = _bins(n, y1, y2, ph, height)
    w_lo, w_hi = _bins(n, x1, x2, pw, width)
    feats = n.call("ops.gather", x, batch, 0)  # (R, C, H, W)
    low = n.const_tensor(np.array(-np.inf, (n.dtype(0) or ir.DataType.FLOAT).numpy()), "minus_inf")
    # columns: (R, C, H, 1, W) against (R, 1, 1, PW, W) -> (R, C, H, PW)
    w_mask = n.call("ops.expand_dims", n.call("ops.expand_dims", _mask(n, w_lo, w_hi, width), 1), 1)
    cols = n.call("ops.amax", n.call("ops.where", w_mask, n.call("ops.expand_dims", feats, 3), low), -1)
    # rows: (R, C, 1, PW, H) against (R, 1, PH, 1, H) -> (R, C, PH, PW)
    h_mask = n.call("ops.expand_dims", n.call("ops.expand_dims", _mask(n, h_lo, h_hi, height), 1), 3)
    rows = n.call("ops.expand_dims", n.call("ops.transpose", cols, (0, 1, 3, 2)), 2)
    y = n.call("ops.amax", n.call("ops.where", h_mask, rows, low), -1)
    empty = n.call("ops.logical_or", n.call("ops.expand_dims", n.binop("<=", h_hi, h_lo), 2),
                   n.call("ops.expand_dims", n.binop("<=", w_hi, w_lo), 1))  # (R, PH, PW)
    return n.call("ops.where", n.call("ops.expand_dims", empty, 1), n.call("ops.zeros_like", y), y)
