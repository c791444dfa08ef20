"""Resize (opsets 11 and 18; opset 19 only adds a coordinate mode), as separable per-axis interpolation.

ONNX's Resize is separable: each resized axis maps output index y to a source coordinate x (by
coordinate_transformation_mode) and mixes a few neighbours of x with coefficients that depend only on the
fraction of x (nearest / linear / cubic, optionally antialiased). With static input and output sizes these
coefficients are compile-time constants, so the lowering builds one (out x in) matrix per axis, exactly as
the ONNX reference computes it (edge neighbours clamped, exclude_outside renormalised), and emits:
- nearest: a gather of the chosen source index (exact for every dtype, inf and NaN included);
- linear / cubic: a matmul with the matrix along that axis (in fp32 for fp16 inputs);
- tf_crop_and_resize: positions whose source lies outside the input take extrapolation_value.
Output sizes follow the reference: floor(scale * size), or `sizes` with keep_aspect_ratio_policy. With scales,
align_corners and tf_crop_and_resize divide by the fractional output length scale * size, as the ONNX reference
and the node tests do (onnxruntime divides by the integer length; they differ where scale * size is fractional).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register


def _nearest(mode: str):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        pick_right = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                      "floor": False, "ceil": True}[mode]
        return np.array([0.0, 1.0]) if pick_right else np.array([1.0, 0.0])
    return coeffs


def _linear(antialias: bool):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1 - ratio, ratio])
        scale = min(scale, 1.0)
        start = int(np.floor(-1 / scale) + 1)
        args = (np.arange(start, 2 - start) - ratio) * scale
        c = np.clip(1 - np.abs(args), 0, 1)
        return c / c.sum()
    return coeffs


def _cubic(a: float, antialias: bool):
    def kernel(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        if x < 2:
            return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        return 0.0

    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([kernel(ratio + 1), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)])
        scale = min(scale, 1.0)
        start = int(np.floor(-2 / scale) + 1)
        c = np.array([kernel(scale * (i - ratio)) for i in range(start, 2 - start)])
        return c / c.sum()
    return coeffs


def _source_coords(ctm: str, out_int: int, in_w: int, scale: float, roi) -> np.ndarray:
    y = np.arange(out_int, dtype=np.float64)
    out_w = scale * in_w
    if ctm == "align_corners":
        return np.zeros(out_int) if out_w == 1 else y * (in_w - 1) / (out_w - 1)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "tf_crop_and_resize":
        x = np.full(out_int, (roi[1] - roi[0]) * (in_w - 1) / 2) if out_w == 1 else \
            y * (roi[1] - roi[0]) * (in_w - 1) / (out_w - 1)
        return x + roi[0] * (in_w - 1)
    if ctm == "pytorch_half_pixel":
        return np.full(out_int, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = in_w / 2 * (1 - out_int / out_w)
        return offset + (y + 0.5) / scale - 0.5
    raise ValueError(ctm)


def axis_matrix(in_w: int, out_int: int, scale: float, coeffs, ctm: str, roi=None,
                exclude_outside: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """(out x in) interpolation matrix of one axis and, for tf_crop_and_resize, the extrapolated rows."""
    x = _source_coords(ctm, out_int, in_w, scale, roi)
    extrapolated = ((x < 0) | (x > in_w - 1)) if ctm == "tf_crop_and_resize" else None
    xi = np.floor(x).astype(np.int64)
    ratios = np.where(x == xi, 1.0, x - xi)
    c = np.stack([np.asarray(coeffs(float(r), scale), np.float64) for r in ratios]) if out_int else np.zeros((0, 2))
    n = c.shape[1]
    pad = int(np.ceil(n / 2))
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    idx = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        c = np.where((idx < 0) | (idx >= in_w), 0.0, c)
        s = c.sum(axis=1, keepdims=True)
        c = c / np.where(s == 0, 1.0, s)
    w = np.zeros((out_int, in_w))
    np.add.at(w, (np.repeat(np.arange(out_int), n), np.clip(idx, 0, in_w - 1).reshape(-1)), c.reshape(-1))
    return w, extrapolated


def whole_repeats(mode: str, ctm: str, nearest_mode: str, scale: float) -> int | None:
    """s where a Resize along an axis by `scale` is each element repeated s times (output y reads input
    floor(y / s)) at every axis length, else None. With a whole scale s, output y = k*s + j (0 <= j < s) has the
    source coordinate k + j/s (asymmetric), which floor takes to k, and round_prefer_floor too while j/s <= 1/2
    (s <= 2); or k + (j - (s-1)/2)/s (half_pixel, pytorch_half_pixel), strictly within half a step of k, so
    either rounding gives k and no neighbour is ever clamped; or, align_corners at s = 2 over a length L,
    k + (L-1-k)/(2L-1) for j = 1 and k - k/(2L-1) for j = 0, both nearer k than half a step."""
    if mode != "nearest" or not float(scale).is_integer() or scale < 1:
        return None
    s = int(scale)
    if ctm == "asymmetric" and (nearest_mode == "floor" or (nearest_mode == "round_prefer_floor" and s <= 2)):
        return s
    rounds = nearest_mode in ("round_prefer_floor", "round_prefer_ceil")
    if rounds and (ctm in ("half_pixel", "pytorch_half_pixel") or (ctm == "align_corners" and s <= 2)):
        return s
    return None


def _resize(n, roi_i: int | None, scales_i: int, sizes_i: int | None):
    x = n.x(0)
    shape = n.shape(0)
    if shape is None:
        n.fail("the input rank must be known")
    rank = len(shape)
    mode = text(n.attr("mode", "nearest"))
    ctm = text(n.attr("coordinate_transformation_mode", "half_pixel"))
    antialias = bool(n.attr("antialias", 0))
    policy = text(n.attr("keep_aspect_ratio_policy", "stretch"))
    axes = [n.axis(a, rank) for a in (n.attr("axes") or range(rank))]

    def const_or_none(i):
        if i is None or not n.has(i):
            return None
        c = n.const(i)
        if c is None:
            n.fail(f"input {i} ({['X', 'roi', 'scales', 'sizes'][i]}) must be a constant")
        return None if c.size == 0 else c

    roi, scales, sizes = const_or_none(roi_i), const_or_none(scales_i), const_or_none(sizes_i)
    if scales is None and sizes is None:
        n.fail("neither scales nor sizes is given")
    if not all(isinstance(d, int) for d in shape):
        return _repeated(n, x, axes, scales, sizes, mode, ctm, text(n.attr("nearest_mode", "round_prefer_floor")))
    full_scales = [1.0] * rank
    out = list(shape)
    if sizes is not None:
        full_sizes = list(shape)
        for a, s in zip(axes, sizes.tolist()):
            full_sizes[a] = int(s)
        full_scales = [full_sizes[i] / shape[i] for i in range(rank)]
        out = full_sizes
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            s = pick(full_scales[a] for a in axes)
            full_scales = [s if i in axes else 1.0 for i in range(rank)]
            out = [int(s * shape[i] + 0.5) if i in axes else shape[i] for i in range(rank)]
    else:
        for a, s in zip(axes, scales.tolist()):
            full_scales[a] = s
        out = (np.asarray([np.float32(s) for s in full_scales]) * np.array(shape)).astype(int).tolist()
    full_roi = None
    if roi is not None:
        r = roi.astype(np.float64).tolist()
        full_roi = [0.0] * rank + [1.0] * rank
        for k, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = r[k], r[len(axes) + k]
    if ctm == "tf_crop_and_resize" and full_roi is None:
        n.fail("tf_crop_and_resize needs roi")
    if mode == "nearest":
        coeffs = _nearest(text(n.attr("nearest_mode", "round_prefer_floor")))
    elif mode == "linear":
        coeffs = _linear(antialias)
    elif mode == "cubic":
        coeffs = _cubic(float(n.attr("cubic_coeff_a", -0.75)), antialias)
    else:
        n.fail(f"mode {mode!r} is not supported")
    exclude = bool(n.attr("exclude_outside", 0))
    extrapolation = float(n.attr("extrapolation_value", 0.0))
    dt = n.dtype(0)
    floating = dt in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
    if mode != "nearest" and not floating:
        n.fail(f"{mode} Resize of {dt.name} is not supported")
    work_dt = {ir.DataType.DOUBLE: np.float64}.get(dt, np.float32)
    low = mode != "nearest" and dt in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if low:
        x = n.call("ops.cast", x, n.ms_dtype(ir.DataType.FLOAT))
    mask = None
    for a in range(rank):
        roi_a = None if full_roi is None else (full_roi[a], full_roi[rank + a])
        identity = math.isclose(full_scales[a], 1.0) and out[a] == shape[a] and \
            (roi_a is None or (math.isclose(roi_a[0], 0.0) and math.isclose(roi_a[1], 1.0)))
        if identity:
            continue
        w, extra = axis_matrix(shape[a], out[a], float(full_scales[a]), coeffs, ctm, roi_a, exclude)
        if mode == "nearest":
            index = n.const_tensor(w.argmax(axis=1).astype(np.int64) if out[a] else np.zeros(0, np.int64), "index")
            x = n.call("ops.gather", x, index, a)
        else:
            wt = n.const_tensor(w.T.astype(work_dt), "weights")
            x = n.call("ops.swapaxes", n.call("ops.matmul", n.call("ops.swapaxes", x, a, -1), wt), a, -1)
        if extra is not None and extra.any():
            m = extra.reshape((-1,) + (1,) * (rank - a - 1))
            mask = m if mask is None else (mask | m)
    if mask is not None:
        fill = n.const_tensor(np.array(extrapolation, work_dt if low else dt.numpy()), "extrapolation")
        x = n.call("ops.where", n.const_tensor(mask, "outside"), fill, x)
    if low:
        x = n.call("ops.cast", x, n.ms_dtype(dt))
    return x


def _repeated(n, x, axes, scales, sizes, mode: str, ctm: str, nearest_mode: str):
    """Resize of an input whose shape is not static: the matrices above need each axis's length, so only what
    is the same at every length is taken, nearest upsampling by whole scales (whole_repeats): each element
    repeated along its axis, `ops.repeat_interleave` (the upsampling of YOLO and PaddleOCR detectors)."""
    why = ("the input shape must be static (with a dynamic one, only nearest upsampling by whole scales that "
           f"repeats each element is taken; here: mode {mode}, {ctm}, nearest_mode {nearest_mode}, ")
    if scales is None:
        n.fail(why + "sizes instead of scales)")
    repeats = [whole_repeats(mode, ctm, nearest_mode, float(s)) for s in scales.tolist()]
    if None in repeats:
        n.fail(why + f"scales {[float(s) for s in scales.tolist()]})")
    for a, r in zip(axes, repeats):
        if r > 1:
            x = n.call("ops.repeat_interleave", x, r, a)
    return x


@register("Resize", since=11)
def resize11(n):
    return _resize(n, 1, 2, 3)


@register("Resize", since=18)
def resize18(n):
    """Opset 18 adds antialias, axes and keep_aspect_ratio_policy; 19 adds half_pixel_symmetric."""
    return _resize(n, 1, 2, 3)
