"""Grid sampling: GridSample (opsets 16 and 20) and AffineGrid (opset 20), as the ONNX reference computes them.

GridSample reads X (N, C, D1..Dr) at the normalised coordinates of Grid (N, O1..Or, r) (last dim ordered x, y,
z: the spatial dims reversed). Per spatial dim the coordinate is denormalised (align_corners), rounded half to
even for nearest, and moved inside the borders first (border: clamped to the input; reflection: reflected at
-0.5 / D-0.5, or 0 / D-1 with align_corners); then each neighbour (1 nearest, 2 linear, 4 cubic with Keys'
a=-0.75) is fetched with its own padding rule (zeros: 0 outside; border: clamped; reflection: reflected and
truncated). One gather per neighbour combination from the flattened spatial dims, weighted and summed.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from opmap.attrs import text
from opmap.registry import register

_CUBIC_A = -0.75


def _reflect(n, v, lo: float, hi: float):
    """v reflected at lo and hi until inside (where v is outside; elsewhere v)."""
    rng = hi - lo
    below = n.binop("<", v, lo)
    dx = n.call("ops.where", below, n.binop("-", lo, v), n.binop("-", v, hi))
    k = n.call("ops.floor", n.binop("/", dx, rng))
    rem = n.binop("-", dx, n.binop("*", k, rng))
    even = n.call("ops.equal", n.call("ops.fmod", k, 2.0), 0.0)
    inside = n.call("ops.where", below,
                    n.call("ops.where", even, n.binop("+", lo, rem), n.binop("-", hi, rem)),
                    n.call("ops.where", even, n.binop("-", hi, rem), n.binop("+", lo, rem)))
    outside = n.call("ops.logical_or", n.binop("<", v, lo), n.binop(">", v, hi))
    return n.call("ops.where", outside, inside, v)


def _cubic_coeffs(n, t) -> list:
    a = _CUBIC_A
    t = n.call("ops.abs", t)

    def outer(u):  # ((a u - 5a) u + 8a) u - 4a, for 1 < u < 2
        return n.binop("-", n.binop("*", n.binop("+", n.binop("*", n.binop("-", n.binop("*", a, u), 5 * a), u),
                                                 8 * a), u), 4 * a)

    def inner(u):  # ((a + 2) u - (a + 3)) u u + 1, for u <= 1
        return n.binop("+", n.binop("*", n.binop("*", n.binop("-", n.binop("*", a + 2, u), a + 3), u), u), 1)

    return [outer(n.binop("+", t, 1)), inner(t), inner(n.binop("-", 1, t)), outer(n.binop("-", 2, t))]


def _sum(n, op: str, items: list):
    """items[0] op items[1] op ... (left to right)."""
    acc = items[0]
    for item in items[1:]:
        acc = n.binop(op, acc, item)
    return acc


def _grid_sample(n, mode: str):
    xs, gs = n.shape(0), n.shape(1)
    if xs is None or gs is None or not all(isinstance(d, int) for d in xs[1:] + gs[1:]):
        n.fail("GridSample needs static shapes (but the batch)")
    padding = text(n.attr("padding_mode", "zeros"))
    align = bool(n.attr("align_corners", 0))
    dims = xs[2:]
    r = len(dims)
    if mode not in ("nearest", "linear", "cubic"):
        n.fail(f"mode {mode!r} is not supported")
    if padding not in ("zeros", "border", "reflection"):
        n.fail(f"padding_mode {padding!r} is not supported")
    x, grid = n.x(0), n.x(1)
    dt = n.ms_dtype(n.dtype(0))
    i64 = n.ms_dtype(ir.DataType.INT64)
    channels, out_dims = xs[1], gs[1:-1]
    per_dim = []  # [(index values, weight values)] per spatial dim
    for i, size in enumerate(dims):
        g = n.getitem(grid, (Ellipsis, r - 1 - i))
        g1 = n.binop("+", g, 1)
        if align:
            v = n.binop("*", n.binop("/", g1, 2.0), size - 1)
        else:
            v = n.binop("/", n.binop("-", n.binop("*", g1, size), 1), 2.0)
        if mode == "nearest":
            v = n.call("ops.round", v)
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if padding == "border":
            outside = n.call("ops.logical_or", n.binop("<", v, lo), n.binop(">", v, hi))
            v = n.call("ops.where", outside, n.call("ops.clamp", v, 0.0, size - 1.0), v)
        elif padding == "reflection":
            v = _reflect(n, v, lo, hi)
        if mode == "nearest":
            points, weights = [v], [None]
        else:
            base = n.call("ops.floor", v)
            frac = n.binop("-", v, base)
            if mode == "linear":
                points, weights = [base, n.binop("+", base, 1)], [n.binop("-", 1, frac), frac]
            else:
                points = [n.binop("-", base, 1), base, n.binop("+", base, 1), n.binop("+", base, 2)]
                weights = _cubic_coeffs(n, frac)
        entries = []
        for p, w in zip(points, weights):
            if padding == "zeros":
                ok = n.call("ops.cast", n.call("ops.logical_and", n.binop(">=", p, 0), n.binop("<", p, size)), dt)
                w = ok if w is None else n.binop("*", w, ok)
            elif padding == "reflection":
                p = _reflect(n, p, lo, hi)
            idx = n.call("ops.clamp", n.call("ops.cast", p, i64), 0, size - 1)
            entries.append((idx, w))
        per_dim.append(entries)
    strides = [int(np.prod(dims[i + 1:], dtype=np.int64)) for i in range(r)]
    flat = n.call("ops.flatten", x, start_dim=2)
    q = int(np.prod(out_dims, dtype=np.int64))
    terms = []
    for combo in itertools.product(*[range(len(e)) for e in per_dim]):
        lin = _sum(n, "+", [n.binop("*", per_dim[i][k][0], strides[i]) if strides[i] != 1 else per_dim[i][k][0]
                            for i, k in enumerate(combo)])
        index = n.call("ops.broadcast_to", n.call("ops.expand_dims", n.call("ops.reshape", lin, (-1, q)), 1),
                       (-1, channels, q))
        value = n.call("ops.gather_elements", flat, 2, index)
        ws = [per_dim[i][k][1] for i, k in enumerate(combo) if per_dim[i][k][1] is not None]
        if ws:
            value = n.binop("*", value, n.call("ops.expand_dims", n.call("ops.reshape", _sum(n, "*", ws), (-1, q)), 1))
        terms.append(value)
    return n.call("ops.reshape", _sum(n, "+", terms), (-1, channels) + tuple(out_dims))


@register("GridSample", since=16)
def grid_sample16(n):
    """Opset 16: 4-D only, modes bilinear / nearest / bicubic."""
    mode = text(n.attr("mode", "bilinear"))
    return _grid_sample(n, {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode))


@register("GridSample", since=20)
def grid_sample20(n):
    """Opset 20: N-D, modes linear / nearest / cubic."""
    return _grid_sample(n, text(n.attr("mode", "linear")))


@register("AffineGrid", since=20)
def affine_grid(n):
    """grid[n, d.., :] = theta[n] @ (x, y[, z], 1): the base coordinates are constants for a constant size."""
    size = n.require_ints(1, "AffineGrid size")
    spatial = size[2:]
    align = bool(n.attr("align_corners", 0))

    def axis(d):
        if align:
            return np.linspace(-1.0, 1.0, d) if d > 1 else np.zeros(1)
        return (np.arange(d) * 2.0 + 1.0) / d - 1.0

    grids = np.meshgrid(*[axis(d) for d in spatial], indexing="ij")  # spatial order (z,) y, x
    base = np.stack(list(reversed(grids)) + [np.ones(spatial)], axis=-1).reshape(-1, len(spatial) + 1)
    np_dt = n.dtype(0).numpy()
    base_t = n.const_tensor(base.astype(np_dt), "base")
    y = n.call("ops.matmul", base_t, n.call("ops.transpose", n.x(0), (0, 2, 1)))  # (N, P, r)
    return n.call("ops.reshape", y, (-1,) + tuple(spatial) + (len(spatial),))
