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

from opmap.registry import register

_CUBIC_A = -0.75


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _reflect(n, v: str, lo: float, hi: float, hint: str) -> str:
    """v reflected at lo and hi until inside (where v is outside; elsewhere v)."""
    rng = hi - lo
    below = n.tmp(f"{v} < {lo!r}", f"{hint}_below")
    dx = n.tmp(f"ops.where({below}, {lo!r} - {v}, {v} - {hi!r})", f"{hint}_dx")
    k = n.tmp(f"ops.floor({dx} / {rng!r})", f"{hint}_k")
    rem = n.tmp(f"{dx} - {k} * {rng!r}", f"{hint}_rem")
    even = n.tmp(f"ops.equal(ops.fmod({k}, 2.0), 0.0)", f"{hint}_even")
    inside = f"ops.where({below}, ops.where({even}, {lo!r} + {rem}, {hi!r} - {rem}), " \
             f"ops.where({even}, {hi!r} - {rem}, {lo!r} + {rem}))"
    return n.tmp(f"ops.where(ops.logical_or({v} < {lo!r}, {v} > {hi!r}), {inside}, {v})", hint)


def _cubic_coeffs(n, t: str, hint: str) -> list[str]:
    a = _CUBIC_A
    t = n.tmp(f"ops.abs({t})", f"{hint}_t")
    return [n.tmp(e, f"{hint}_c{i}") for i, e in enumerate((
        f"(({a!r} * ({t} + 1) - {5 * a!r}) * ({t} + 1) + {8 * a!r}) * ({t} + 1) - {4 * a!r}",
        f"(({a + 2!r} * {t} - {a + 3!r}) * {t} * {t} + 1)",
        f"(({a + 2!r} * (1 - {t}) - {a + 3!r}) * (1 - {t}) * (1 - {t}) + 1)",
        f"(({a!r} * (2 - {t}) - {5 * a!r}) * (2 - {t}) + {8 * a!r}) * (2 - {t}) - {4 * a!r}"))]


def _grid_sample(n, mode: str):
    xs, gs = n.shape(0), n.shape(1)
    if xs is None or gs is None or not all(isinstance(d, int) for d in xs[1:] + gs[1:]):
        n.fail("GridSample needs static shapes (but the batch)")
    padding = _text(n.attr("padding_mode", "zeros"))
    align = bool(n.attr("align_corners", 0))
    dims = xs[2:]
    r = len(dims)
    if mode not in ("nearest", "linear", "cubic"):
        n.fail(f"mode {mode!r} is not supported")
    if padding not in ("zeros", "border", "reflection"):
        n.fail(f"padding_mode {padding!r} is not supported")
    x, grid = n.x(0), n.x(1)
    dt = n.ms_dtype(n.dtype(0))
    channels, out_dims = xs[1], gs[1:-1]
    per_dim = []  # [(index expressions, weight expressions)] per spatial dim
    for i, size in enumerate(dims):
        g = n.tmp(f"{grid}[..., {r - 1 - i}]", f"g{i}")
        v = f"({g} + 1) / 2.0 * {size - 1}" if align else f"(({g} + 1) * {size} - 1) / 2.0"
        v = n.tmp(f"ops.round({v})" if mode == "nearest" else v, f"v{i}")
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if padding == "border":
            outside = f"ops.logical_or({v} < {lo!r}, {v} > {hi!r})"
            v = n.tmp(f"ops.where({outside}, ops.clamp({v}, 0.0, {size - 1.0!r}), {v})", f"v{i}_in")
        elif padding == "reflection":
            v = _reflect(n, v, lo, hi, f"v{i}_in")
        if mode == "nearest":
            points, weights = [v], [None]
        else:
            base = n.tmp(f"ops.floor({v})", f"v{i}_floor")
            frac = n.tmp(f"{v} - {base}", f"v{i}_frac")
            if mode == "linear":
                points, weights = [base, f"({base} + 1)"], [n.tmp(f"1 - {frac}", f"w{i}_0"), frac]
            else:
                points = [f"({base} - 1)", base, f"({base} + 1)", f"({base} + 2)"]
                weights = _cubic_coeffs(n, frac, f"w{i}")
        entries = []
        for k, (p, w) in enumerate(zip(points, weights)):
            if padding == "zeros":
                ok = f"ops.cast(ops.logical_and({p} >= 0, {p} < {size}), {dt})"
                w = n.tmp(ok if w is None else f"{w} * {ok}", f"w{i}_{k}z")
            elif padding == "reflection":
                p = _reflect(n, p, lo, hi, f"p{i}_{k}")
            idx = n.tmp(f"ops.clamp(ops.cast({p}, ms.int64), 0, {size - 1})", f"i{i}_{k}")
            entries.append((idx, w))
        per_dim.append(entries)
    strides = [int(np.prod(dims[i + 1:], dtype=np.int64)) for i in range(r)]
    flat = n.tmp(f"ops.flatten({x}, start_dim=2)", "flat")
    q = int(np.prod(out_dims, dtype=np.int64))
    terms = []
    for combo in itertools.product(*[range(len(e)) for e in per_dim]):
        lin = " + ".join(f"{per_dim[i][k][0]} * {strides[i]}" if strides[i] != 1 else per_dim[i][k][0]
                         for i, k in enumerate(combo))
        index = n.tmp(f"ops.broadcast_to(ops.expand_dims(ops.reshape({lin}, (-1, {q})), 1), (-1, {channels}, {q}))",
                      "index")
        value = f"ops.gather_elements({flat}, 2, {index})"
        ws = [per_dim[i][k][1] for i, k in enumerate(combo) if per_dim[i][k][1] is not None]
        if ws:
            value = f"{value} * ops.expand_dims(ops.reshape({' * '.join(ws)}, (-1, {q})), 1)"
        terms.append(n.tmp(value, "term"))
    total = terms[0] if len(terms) == 1 else " + ".join(terms)
    return f"ops.reshape({total}, (-1, {channels}) + {tuple(out_dims)!r})"


@register("GridSample", since=16)
def grid_sample16(n):
    """Opset 16: 4-D only, modes bilinear / nearest / bicubic."""
    mode = _text(n.attr("mode", "bilinear"))
    return _grid_sample(n, {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode))


@register("GridSample", since=20)
def grid_sample20(n):
    """Opset 20: N-D, modes linear / nearest / cubic."""
    return _grid_sample(n, _text(n.attr("mode", "linear")))


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
    y = f"ops.matmul({base_t}, ops.transpose({n.x(0)}, (0, 2, 1)))"  # (N, P, r)
    return f"ops.reshape({y}, (-1,) + {tuple(spatial) + (len(spatial),)!r})"
