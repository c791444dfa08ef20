"""Detection: NonMaxSuppression (opset 11) and RoiAlign (opsets 10 and 16), as the ONNX reference computes them.

Per batch and class, boxes scoring above score_threshold are visited by descending score (ties: lower index
first); a box is selected unless its IoU with an already selected box exceeds iou_threshold, until
max_output_boxes_per_class are selected. With the box count static, the greedy loop is unrolled over the
sorted positions, vectorised over batches and classes; the output (selected, 3) = [batch, class, box] rows in
that order has a data-dependent length (a masked select). IoU follows the reference's corner handling
(center_point_box=0: [y1, x1, y2, x2] in any corner order; 1: [x_center, y_center, width, height]); an empty
intersection or a non-positive area never suppresses.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register


def _corners(n, boxes, center: bool) -> tuple:
    """(x_min, x_max, y_min, y_max) of (B, N, 4) boxes, each (B, N)."""
    if center:
        xc, yc, w, h = (n.getitem(boxes, (Ellipsis, k)) for k in range(4))
        half_w, half_h = n.binop("/", w, 2), n.binop("/", h, 2)
        return (n.binop("-", xc, half_w), n.binop("+", xc, half_w), n.binop("-", yc, half_h),
                n.binop("+", yc, half_h))
    y1, x1, y2, x2 = (n.getitem(boxes, (Ellipsis, k)) for k in range(4))
    return (n.call("ops.minimum", x1, x2), n.call("ops.maximum", x1, x2), n.call("ops.minimum", y1, y2),
            n.call("ops.maximum", y1, y2))


@register("NonMaxSuppression", since=11)
def non_max_suppression(n):
    bs, ss = n.shape(0), n.shape(1)
    if bs is None or ss is None or not all(isinstance(d, int) for d in bs + ss):
        n.fail("NonMaxSuppression needs static boxes and scores shapes (the selection loop is unrolled)")
    batches, boxes_n, classes = bs[0], bs[1], ss[1]
    limit = n.ints(2) if n.has(2) else [0]
    if n.has(2) and limit is None:
        n.fail("max_output_boxes_per_class must be a constant")
    limit = max(int(limit[0]), 0) if limit else 0
    iou_t = float(n.const(3).reshape(-1)[0]) if n.has(3) and n.const(3) is not None and n.const(3).size else 0.0
    if n.has(3) and n.const(3) is None:
        n.fail("iou_threshold must be a constant")
    score_t = None
    if n.has(4):
        c = n.const(4)
        if c is None:
            n.fail("score_threshold must be a constant")
        score_t = float(c.reshape(-1)[0]) if c.size else None
    boxes, scores = n.x(0), n.x(1)
    i32, i64 = n.ms_dtype(ir.DataType.INT32), n.ms_dtype(ir.DataType.INT64)
    x0, x1, y0, y1 = _corners(n, boxes, bool(n.attr("center_point_box", 0)))

    def pair(v):  # (B, N) -> (B, N, 1) and (B, 1, N)
        return n.call("ops.expand_dims", v, 2), n.call("ops.expand_dims", v, 1)

    (ax0, bx0), (ax1, bx1), (ay0, by0), (ay1, by1) = pair(x0), pair(x1), pair(y0), pair(y1)
    iw = n.binop("-", n.call("ops.minimum", ax1, bx1), n.call("ops.maximum", ax0, bx0))
    ih = n.binop("-", n.call("ops.minimum", ay1, by1), n.call("ops.maximum", ay0, by0))
    inter = n.binop("*", iw, ih)
    area = n.binop("*", n.binop("-", x1, x0), n.binop("-", y1, y0))
    area_i, area_j = pair(area)
    union = n.binop("-", n.binop("+", area_i, area_j), inter)
    areas_ok = n.call("ops.logical_and", n.binop(">", area_i, 0), n.binop(">", area_j, 0))
    union_ok = n.binop(">", union, 0)
    ok = n.call("ops.logical_and",
                n.call("ops.logical_and", n.call("ops.logical_and", n.binop(">", iw, 0), n.binop(">", ih, 0)),
                       n.binop(">", inter, 0)),
                n.call("ops.logical_and", areas_ok, union_ok))
    safe_union = n.call("ops.where", union_ok, union, n.call("ops.ones_like", union))
    suppress = n.call("ops.logical_and", ok, n.binop(">", n.binop("/", inter, safe_union), iou_t))  # (B, N, N)
    # Rank of each box within its class: higher score first, ties by lower index.
    si, sj = n.call("ops.expand_dims", scores, 3), n.call("ops.expand_dims", scores, 2)
    lower = n.const_tensor(np.tril(np.ones((boxes_n, boxes_n), bool), -1), "lower_index")
    # [b, c, i, j]: j goes before i
    before = n.call("ops.logical_or", n.binop(">", sj, si), n.call("ops.logical_and", n.binop("==", sj, si), lower))
    rank = n.call("ops.sum", n.call("ops.cast", before, i32), 3)  # (B, C, N)
    positions = n.const_tensor(np.arange(boxes_n, dtype=np.int32), "positions")
    # order[b, c, k] = the box of rank k
    is_rank = n.call("ops.equal", n.call("ops.expand_dims", rank, 2), n.call("ops.reshape", positions, (1, 1, -1, 1)))
    order = n.call("ops.cast", n.call("ops.argmax", n.call("ops.cast", is_rank, i32), 3), i64)
    valid = n.binop(">", scores, score_t) if score_t is not None else n.binop(">", n.call("ops.ones_like", scores), 0)
    eye = n.const_tensor(np.eye(boxes_n, dtype=bool), "one_hot")
    selected = n.call("ops.zeros_like", valid)  # (B, C, N), by box index
    count = n.call("ops.zeros", (batches, classes), i32)
    picks = []
    suppress_bc = n.call("ops.broadcast_to", n.call("ops.expand_dims", suppress, 1),
                         (batches, classes, boxes_n, boxes_n))
    for k in range(boxes_n):
        box = n.getitem(order, (slice(None), slice(None), slice(k, k + 1)))  # (B, C, 1)
        box_rows = n.call("ops.broadcast_to", n.call("ops.expand_dims", box, 3), (batches, classes, 1, boxes_n))
        row = n.call("ops.squeeze", n.call("ops.gather_elements", suppress_bc, 2, box_rows), 2)
        hit = n.call(n.call("ops.ReduceAny"), n.call("ops.logical_and", selected, row), 2)
        is_valid = n.call("ops.squeeze", n.call("ops.gather_elements", valid, 2, box), 2)
        pick = n.call("ops.logical_and", n.call("ops.logical_and", is_valid, n.call("ops.logical_not", hit)),
                      n.binop("<", count, limit))
        picks.append(pick)
        onehot = n.call("ops.gather", eye, n.call("ops.squeeze", box, 2), 0)  # (B, C, N)
        selected = n.call("ops.logical_or", selected,
                          n.call("ops.logical_and", onehot, n.call("ops.expand_dims", pick, 2)))
        count = n.binop("+", count, n.call("ops.cast", pick, i32))
    chosen = n.call("ops.reshape", n.call("ops.stack", tuple(picks), 2), (-1,))  # (B*C*N,) sorted order
    b_idx = n.const_tensor(np.repeat(np.arange(batches, dtype=np.int64), classes * boxes_n), "batch_index")
    c_idx = n.const_tensor(np.tile(np.repeat(np.arange(classes, dtype=np.int64), boxes_n), batches), "class_index")
    rows = (n.call("ops.masked_select", b_idx, chosen), n.call("ops.masked_select", c_idx, chosen),
            n.call("ops.masked_select", n.call("ops.reshape", order, (-1,)), chosen))
    return n.call("ops.stack", rows, 1)


def _roi_align(n, default_ctm: str):
    """Bilinear samples on a static grid per bin (sampling_ratio > 0), averaged or maxed (max of the four weighted
    corners, as the reference); samples outside [-1, size] contribute 0, coordinates below 0 clamp to 0 and at
    the last row / column stay there."""
    xs, rs = n.shape(0), n.shape(1)
    if xs is None or rs is None or not all(isinstance(d, int) for d in xs[1:] + rs):
        n.fail("RoiAlign needs static input (but the batch) and rois shapes")
    ratio = int(n.attr("sampling_ratio", 0))
    if ratio <= 0:
        n.fail("sampling_ratio=0 (a data-dependent sampling grid) is not supported")
    _, channels, height, width = xs
    rois = rs[0]
    ph_n, pw_n = int(n.attr("output_height", 1)), int(n.attr("output_width", 1))
    scale = float(n.attr("spatial_scale", 1.0))
    ctm = text(n.attr("coordinate_transformation_mode", default_ctm))
    mode = text(n.attr("mode", "avg"))
    offset = 0.5 if ctm == "half_pixel" else 0.0
    r = n.x(1)

    def coord(k):  # column k of the rois, scaled and offset: (R, 1)
        return n.binop("-", n.binop("*", n.getitem(r, (slice(None), slice(k, k + 1))), scale), offset)

    start_w, start_h = coord(0), coord(1)
    end_w, end_h = coord(2), coord(3)
    roi_w, roi_h = n.binop("-", end_w, start_w), n.binop("-", end_h, start_h)
    if ctm != "half_pixel":  # malformed ROIs forced to 1x1
        roi_w, roi_h = n.call("ops.maximum", roi_w, 1.0), n.call("ops.maximum", roi_h, 1.0)
    bin_w = n.binop("/", roi_w, pw_n)
    bin_h = n.binop("/", roi_h, ph_n)
    # Sample positions in units of bins, in [ph][pw][iy][ix] order: (S,) constants.
    ph, pw, iy, ix = np.meshgrid(np.arange(ph_n), np.arange(pw_n), np.arange(ratio), np.arange(ratio), indexing="ij")
    fy = n.const_tensor((ph + (iy + 0.5) / ratio).reshape(1, -1).astype(np.float32), "grid_y")
    fx = n.const_tensor((pw + (ix + 0.5) / ratio).reshape(1, -1).astype(np.float32), "grid_x")
    y = n.binop("+", start_h, n.binop("*", fy, bin_h))  # (R, S)
    x = n.binop("+", start_w, n.binop("*", fx, bin_w))
    outside = n.call("ops.logical_or",
                     n.call("ops.logical_or", n.binop("<", y, -1.0), n.binop(">", y, float(height))),
                     n.call("ops.logical_or", n.binop("<", x, -1.0), n.binop(">", x, float(width))))
    inside = n.call("ops.cast", n.call("ops.logical_not", outside), n.ms_dtype(ir.DataType.FLOAT))
    corners = {}
    for v, size, hint in ((y, height, "y"), (x, width, "x")):
        v = n.call("ops.maximum", v, 0.0)
        low = n.call("ops.floor", v)
        at_end = n.binop(">=", low, size - 1)
        low = n.call("ops.where", at_end, n.call("ops.full_like", low, size - 1), low)
        high = n.call("ops.where", at_end, low, n.binop("+", low, 1))
        frac = n.call("ops.where", at_end, n.call("ops.zeros_like", v), n.binop("-", v, low))
        corners[hint] = (low, high, frac)
    (y0, y1, ly), (x0, x1, lx) = corners["y"], corners["x"]
    weights = [n.binop("*", n.binop("-", 1, ly), n.binop("-", 1, lx)), n.binop("*", n.binop("-", 1, ly), lx),
               n.binop("*", ly, n.binop("-", 1, lx)), n.binop("*", ly, lx)]
    positions = [(y0, x0), (y0, x1), (y1, x0), (y1, x1)]
    feat = n.call("ops.flatten", n.call("ops.gather", n.x(0), n.call("ops.cast", n.x(2), n.ms_dtype(ir.DataType.INT64)),
                                        0), start_dim=2)
    samples = ph_n * pw_n * ratio * ratio
    terms = []
    for w, (py, px) in zip(weights, positions):
        idx = n.call("ops.cast", n.binop("+", n.binop("*", py, width), px), n.ms_dtype(ir.DataType.INT64))
        idx = n.call("ops.broadcast_to", n.call("ops.expand_dims", idx, 1), (rois, channels, samples))
        wt = n.call("ops.expand_dims", n.binop("*", w, inside), 1)
        terms.append(n.binop("*", n.call("ops.gather_elements", feat, 2, idx), wt))
    bins = (rois, channels, ph_n, pw_n, ratio * ratio)
    if mode == "avg":
        total = terms[0]
        for t in terms[1:]:
            total = n.binop("+", total, t)
        v = n.call("ops.mean", n.call("ops.reshape", total, bins), 4)
    elif mode == "max":
        best = terms[0]
        for t in terms[1:]:
            best = n.call("ops.maximum", best, t)
        v = n.call("ops.amax", n.call("ops.reshape", best, bins), 4)
    else:
        n.fail(f"mode {mode!r} is not supported")
    return n.call("ops.cast", v, n.ms_dtype(n.dtype(0)))


@register("RoiAlign", since=10)
def roi_align10(n):
    """Opset 10: no coordinate_transformation_mode (output_half_pixel: no half-pixel offset)."""
    return _roi_align(n, "output_half_pixel")


@register("RoiAlign", since=16)
def roi_align16(n):
    """Opset 16 adds coordinate_transformation_mode, default half_pixel; 22 only types."""
    return _roi_align(n, "half_pixel")
