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

from opmap.registry import register


def _corners(n, boxes: str, center: bool) -> tuple[str, str, str, str]:
    """(x_min, x_max, y_min, y_max) of (B, N, 4) boxes, each (B, N)."""
    if center:
        xc, yc, w, h = (f"{boxes}[..., {k}]" for k in range(4))
        return (f"({xc} - {w} / 2)", f"({xc} + {w} / 2)", f"({yc} - {h} / 2)", f"({yc} + {h} / 2)")
    y1, x1, y2, x2 = (f"{boxes}[..., {k}]" for k in range(4))
    return (f"ops.minimum({x1}, {x2})", f"ops.maximum({x1}, {x2})", f"ops.minimum({y1}, {y2})",
            f"ops.maximum({y1}, {y2})")


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
    x0, x1, y0, y1 = (n.tmp(e, h) for e, h in zip(_corners(n, boxes, bool(n.attr("center_point_box", 0))),
                                                   ("x_min", "x_max", "y_min", "y_max")))

    def pair(v):  # (B, N) -> (B, N, 1) and (B, 1, N)
        return f"ops.expand_dims({v}, 2)", f"ops.expand_dims({v}, 1)"

    (ax0, bx0), (ax1, bx1), (ay0, by0), (ay1, by1) = pair(x0), pair(x1), pair(y0), pair(y1)
    iw = n.tmp(f"ops.minimum({ax1}, {bx1}) - ops.maximum({ax0}, {bx0})", "inter_w")
    ih = n.tmp(f"ops.minimum({ay1}, {by1}) - ops.maximum({ay0}, {by0})", "inter_h")
    inter = n.tmp(f"{iw} * {ih}", "inter")
    area = n.tmp(f"({x1} - {x0}) * ({y1} - {y0})", "area")
    union = n.tmp(f"ops.expand_dims({area}, 2) + ops.expand_dims({area}, 1) - {inter}", "union")
    areas_ok = f"ops.logical_and(ops.expand_dims({area}, 2) > 0, ops.expand_dims({area}, 1) > 0)"
    ok = (f"ops.logical_and(ops.logical_and(ops.logical_and({iw} > 0, {ih} > 0), {inter} > 0), "
          f"ops.logical_and({areas_ok}, {union} > 0))")
    safe_union = f"ops.where({union} > 0, {union}, ops.ones_like({union}))"
    suppress = n.tmp(f"ops.logical_and({ok}, {inter} / {safe_union} > {iou_t!r})", "suppress")  # (B, N, N)
    # Rank of each box within its class: higher score first, ties by lower index.
    si, sj = f"ops.expand_dims({scores}, 3)", f"ops.expand_dims({scores}, 2)"
    lower = n.const_tensor(np.tril(np.ones((boxes_n, boxes_n), bool), -1), "lower_index")
    before = f"ops.logical_or({sj} > {si}, ops.logical_and({sj} == {si}, {lower}))"  # [b, c, i, j]: j goes before i
    rank = n.tmp(f"ops.sum(ops.cast({before}, ms.int32), 3)", "rank")  # (B, C, N)
    positions = n.const_tensor(np.arange(boxes_n, dtype=np.int32), "positions")
    # order[b, c, k] = the box of rank k
    order = n.tmp(f"ops.cast(ops.argmax(ops.cast(ops.equal(ops.expand_dims({rank}, 2), "
                  f"ops.reshape({positions}, (1, 1, -1, 1))), ms.int32), 3), ms.int64)", "order")
    valid = n.tmp(f"{scores} > {score_t!r}" if score_t is not None else f"ops.ones_like({scores}) > 0", "candidate")
    eye = n.const_tensor(np.eye(boxes_n, dtype=bool), "one_hot")
    selected = n.tmp(f"ops.zeros_like({valid})", "selected")  # (B, C, N), by box index
    count = n.tmp(f"ops.zeros(({batches}, {classes}), ms.int32)", "count")
    picks = []
    suppress_bc = n.tmp(f"ops.broadcast_to(ops.expand_dims({suppress}, 1), "
                        f"({batches}, {classes}, {boxes_n}, {boxes_n}))", "suppress_bc")
    for k in range(boxes_n):
        box = f"{order}[:, :, {k}:{k + 1}]"  # (B, C, 1)
        row = f"ops.squeeze(ops.gather_elements({suppress_bc}, 2, ops.broadcast_to(ops.expand_dims({box}, 3), "\
              f"({batches}, {classes}, 1, {boxes_n}))), 2)"
        hit = f"ops.ReduceAny()(ops.logical_and({selected}, {row}), 2)"
        is_valid = f"ops.squeeze(ops.gather_elements({valid}, 2, {box}), 2)"
        pick = n.tmp(f"ops.logical_and(ops.logical_and({is_valid}, ops.logical_not({hit})), {count} < {limit})", "pick")
        picks.append(pick)
        onehot = f"ops.gather({eye}, ops.squeeze({box}, 2), 0)"  # (B, C, N)
        selected = n.tmp(f"ops.logical_or({selected}, ops.logical_and({onehot}, ops.expand_dims({pick}, 2)))",
                         "selected")
        count = n.tmp(f"{count} + ops.cast({pick}, ms.int32)", "count")
    chosen = n.tmp(f"ops.reshape(ops.stack(({', '.join(picks)},), 2), (-1,))", "chosen")  # (B*C*N,) sorted order
    b_idx = n.const_tensor(np.repeat(np.arange(batches, dtype=np.int64), classes * boxes_n), "batch_index")
    c_idx = n.const_tensor(np.tile(np.repeat(np.arange(classes, dtype=np.int64), boxes_n), batches), "class_index")
    rows = [f"ops.masked_select({b_idx}, {chosen})", f"ops.masked_select({c_idx}, {chosen})",
            f"ops.masked_select(ops.reshape({order}, (-1,)), {chosen})"]
    return f"ops.stack(({', '.join(rows)},), 1)"


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
    ctm = n.attr("coordinate_transformation_mode", default_ctm)
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    mode = n.attr("mode", "avg")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    offset = 0.5 if ctm == "half_pixel" else 0.0
    r = n.x(1)
    start_w, start_h = (n.tmp(f"{r}[:, {k}:{k + 1}] * {scale!r} - {offset!r}", h)
                        for k, h in ((0, "start_w"), (1, "start_h")))
    end_w, end_h = (f"({r}[:, {k}:{k + 1}] * {scale!r} - {offset!r})" for k in (2, 3))
    roi_w, roi_h = f"({end_w} - {start_w})", f"({end_h} - {start_h})"
    if ctm != "half_pixel":  # malformed ROIs forced to 1x1
        roi_w, roi_h = f"ops.maximum({roi_w}, 1.0)", f"ops.maximum({roi_h}, 1.0)"
    bin_w = n.tmp(f"{roi_w} / {pw_n}", "bin_w")
    bin_h = n.tmp(f"{roi_h} / {ph_n}", "bin_h")
    # Sample positions in units of bins, in [ph][pw][iy][ix] order: (S,) constants.
    ph, pw, iy, ix = np.meshgrid(np.arange(ph_n), np.arange(pw_n), np.arange(ratio), np.arange(ratio), indexing="ij")
    fy = n.const_tensor((ph + (iy + 0.5) / ratio).reshape(1, -1).astype(np.float32), "grid_y")
    fx = n.const_tensor((pw + (ix + 0.5) / ratio).reshape(1, -1).astype(np.float32), "grid_x")
    y = n.tmp(f"{start_h} + {fy} * {bin_h}", "y")  # (R, S)
    x = n.tmp(f"{start_w} + {fx} * {bin_w}", "x")
    inside = n.tmp(f"ops.cast(ops.logical_not(ops.logical_or(ops.logical_or({y} < -1.0, {y} > {float(height)!r}), "
                   f"ops.logical_or({x} < -1.0, {x} > {float(width)!r}))), ms.float32)", "inside")
    corners = {}
    for v, size, hint in ((y, height, "y"), (x, width, "x")):
        v = n.tmp(f"ops.maximum({v}, 0.0)", f"{hint}_clamped")
        low = n.tmp(f"ops.floor({v})", f"{hint}_low")
        at_end = n.tmp(f"{low} >= {size - 1}", f"{hint}_at_end")
        low = n.tmp(f"ops.where({at_end}, ops.full_like({low}, {size - 1}), {low})", f"{hint}_low")
        high = n.tmp(f"ops.where({at_end}, {low}, {low} + 1)", f"{hint}_high")
        frac = n.tmp(f"ops.where({at_end}, ops.zeros_like({v}), {v} - {low})", f"{hint}_frac")
        corners[hint] = (low, high, frac)
    (y0, y1, ly), (x0, x1, lx) = corners["y"], corners["x"]
    weights = [f"(1 - {ly}) * (1 - {lx})", f"(1 - {ly}) * {lx}", f"{ly} * (1 - {lx})", f"{ly} * {lx}"]
    positions = [(y0, x0), (y0, x1), (y1, x0), (y1, x1)]
    feat = n.tmp(f"ops.flatten(ops.gather({n.x(0)}, ops.cast({n.x(2)}, ms.int64), 0), start_dim=2)", "roi_features")
    samples = ph_n * pw_n * ratio * ratio
    terms = []
    for w, (py, px) in zip(weights, positions):
        idx = f"ops.cast({py} * {width} + {px}, ms.int64)"
        idx = f"ops.broadcast_to(ops.expand_dims({idx}, 1), ({rois}, {channels}, {samples}))"
        wt = f"ops.expand_dims(({w}) * {inside}, 1)"
        terms.append(n.tmp(f"ops.gather_elements({feat}, 2, {idx}) * {wt}", "corner"))
    if mode == "avg":
        v = f"ops.mean(ops.reshape({' + '.join(terms)}, ({rois}, {channels}, {ph_n}, {pw_n}, {ratio * ratio})), 4)"
    elif mode == "max":
        best = terms[0]
        for t in terms[1:]:
            best = f"ops.maximum({best}, {t})"
        v = f"ops.amax(ops.reshape({best}, ({rois}, {channels}, {ph_n}, {pw_n}, {ratio * ratio})), 4)"
    else:
        n.fail(f"mode {mode!r} is not supported")
    return f"ops.cast({v}, {n.ms_dtype(n.dtype(0))})"


@register("RoiAlign", since=10)
def roi_align10(n):
    """Opset 10: no coordinate_transformation_mode (output_half_pixel: no half-pixel offset)."""
    return _roi_align(n, "output_half_pixel")


@register("RoiAlign", since=16)
def roi_align16(n):
    """Opset 16 adds coordinate_transformation_mode, default half_pixel; 22 only types."""
    return _roi_align(n, "half_pixel")
