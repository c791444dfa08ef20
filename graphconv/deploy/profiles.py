"""Dynamic-shape profiles for the Ascend tools: the model's symbolic dims with their --shape-range ranges and
reference sizes, the profile grid ATC --dynamic_dims and converter_lite take (the reference cases always
among them), and the --input_shape text of each mode.
"""

from __future__ import annotations

import dataclasses

from graphconv.errors import InputError

MAX_PROFILES = 100  # ATC --dynamic_dims: (1, 100]; Lite dynamic_dims: up to 100

@dataclasses.dataclass
class Dims:
    """The model's symbolic dims in order of first appearance, their user ranges and reference sizes."""

    names: list[str]
    ranges: dict[str, tuple[int, int]]
    ref_sizes: dict[str, list[int]]  # sizes the reference cases use, in case order
    ref_tuples: list[tuple[int, ...]]  # one per case, a size per name

    def fixed(self, name: str) -> int | None:
        r = self.ranges.get(name)
        return r[0] if r and r[0] == r[1] else None

    @property
    def dynamic(self) -> list[str]:
        return [n for n in self.names if self.fixed(n) is None]


def dim_key(input_name: str, axis: int, d) -> str | None:
    """The name of the dim at `axis` of an input; None for a static one."""
    if isinstance(d, int):
        return None
    return d if d else f"{input_name}:{axis}"  # unnamed dynamic dims: the name graphconv.verify.reference uses


def collect_dims(inputs: list[dict], cases: list, ranges: dict) -> Dims:
    names: list[str] = []
    for spec in inputs:
        for axis, d in enumerate(spec["shape"]):
            key = dim_key(spec["name"], axis, d)
            if key is not None and key not in names:
                names.append(key)
    unknown = sorted(set(ranges) - set(names))
    if unknown:
        raise InputError(f"--shape-range names {unknown} are not symbolic dims of the model "
                         f"(it has {names or 'none'})")
    ref_sizes: dict[str, list[int]] = {n: [] for n in names}
    ref_tuples = []
    for case in cases:
        sizes: dict[str, int] = {}
        for spec in inputs:
            arr = case.inputs.get(spec["name"])
            if arr is None:
                continue
            for axis, d in enumerate(spec["shape"]):
                key = dim_key(spec["name"], axis, d)
                if key is not None and axis < arr.ndim:
                    sizes.setdefault(key, int(arr.shape[axis]))
        for n in names:
            if n in sizes:
                ref_sizes[n].append(sizes[n])
        if all(n in sizes for n in names):
            ref_tuples.append(tuple(sizes[n] for n in names))
    return Dims(names, {k: (int(v[0]), int(v[1])) for k, v in ranges.items()}, ref_sizes, ref_tuples)


def _candidates(lo: int, hi: int) -> list[int]:
    vals = {lo, hi}
    p = 1
    while p <= hi:
        if p >= lo:
            vals.add(p)
        p *= 2
    return sorted(vals)


def profiles(dims: Dims, limit: int = MAX_PROFILES) -> tuple[list[tuple[int, ...]], list[str]]:
    """Dynamic-dimension profiles over dims.dynamic: a grid of powers of two inside each user range (ends
    included), thinned until it fits `limit`, plus the reference case sizes (so the bundle's reference inputs
    run on a profile-based model). Dims without a range contribute their reference sizes only. Returns the
    sorted profiles and notes for the README."""
    notes = []
    dyn = dims.dynamic
    if not dyn:
        return [], notes
    index = {n: i for i, n in enumerate(dims.names)}
    refs = []
    for t in dims.ref_tuples:
        sub = tuple(t[index[n]] for n in dyn)
        outside = [n for n, v in zip(dyn, sub) if n in dims.ranges and not dims.ranges[n][0] <= v <= dims.ranges[n][1]]
        if outside:
            notes.append(f"reference sizes {dict(zip(dyn, sub))} lie outside --shape-range for {', '.join(outside)}; "
                         "that case cannot run on the profile-based models")
        elif sub not in refs:
            refs.append(sub)
    axes = []
    for n in dyn:
        if n in dims.ranges:
            axes.append(_candidates(*dims.ranges[n]))
        else:
            axes.append(sorted(set(dims.ref_sizes.get(n, []))) or [1])
            notes.append(f"dim {n!r} has no --shape-range: its profiles use the reference sizes "
                         f"{axes[-1]} only")
    budget = max(limit - len(refs), 1)

    def size(ax):
        total = 1
        for a in ax:
            total *= len(a)
        return total

    while size(axes) > budget:
        k = max(range(len(axes)), key=lambda i: len(axes[i]))
        if len(axes[k]) <= 2:
            break
        axes[k] = axes[k][:1] + axes[k][1:-1][1::2] + axes[k][-1:]
    grid = [()]
    for a in axes:
        grid = [g + (v,) for g in grid for v in a]
    out = sorted(set(grid) | set(refs))
    if len(out) > limit:  # only when the reference tuples alone exceed it
        out = sorted(set(refs))[:limit]
    return out, notes


def atc_input_shape(inputs: list[dict], dims: Dims, mode: str) -> str:
    """--input_shape: mode "range" gives a~b for ranged dims and -1 for unranged ones; mode "profile" gives
    -1 for every dynamic dim (values come from --dynamic_dims)."""
    items = []
    for spec in inputs:
        out = []
        for axis, d in enumerate(spec["shape"]):
            key = dim_key(spec["name"], axis, d)
            if key is None:
                out.append(str(d))
            elif dims.fixed(key) is not None:
                out.append(str(dims.fixed(key)))
            elif mode == "range" and key in dims.ranges:
                lo, hi = dims.ranges[key]
                out.append(f"{lo}~{hi}")
            else:
                out.append("-1")
        items.append(f"{spec['name']}:{','.join(out)}")
    return ";".join(items)


def profile_values(inputs: list[dict], dims: Dims, profile: tuple[int, ...]) -> list[int]:
    """The values of one profile in the order of the -1 dims of the profile-mode --input_shape."""
    value = dict(zip(dims.dynamic, profile))
    out = []
    for spec in inputs:
        for axis, d in enumerate(spec["shape"]):
            key = dim_key(spec["name"], axis, d)
            if key is not None and dims.fixed(key) is None:
                out.append(value[key])
    return out

