"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, as llm-compressor writes them), read
exactly, their weight-only linears kept quantized (graphconv/frontend/quantized_linears.py).

config.json's quantization_config has `config_groups`, each with the modules it `targets` (a class name such
as "Linear", a module name, or "re:" and a regular expression), its `weights` arguments (num_bits, type,
symmetric, strategy, group_size, actorder) and `input_activations`; `ignore` lists modules left in float;
`format` says how the tensors are stored (per group, or once for all). Formats read here:

- pack-quantized: `weight_packed` int32 [N, ceil(K * bits / 32)], the values q + 2^(bits - 1) packed densely
  along K, element i at bit i * bits (lowest first); `weight_scale` [N, K / g] (group), [N, 1] (channel) or
  [1] (tensor); `weight_shape` [2] = (N, K); `weight_zero_point` only when asymmetric, packed the same way but
  along N: int32 [ceil(N * bits / 32), K / g].
- int-quantized and naive-quantized: `weight` int8 [N, K] holding q, the same scale and zero point (int8, not
  packed).

The value is W = (q - zp) * scale (compressed-tensors' `_dequantize`), so the unsigned q_u = q + 2^(bits - 1)
and zp_u = zp + 2^(bits - 1) give the same W; compressed-tensors computes it in the scale's dtype (bf16 for a
bf16 release), which rounds it, and transformers loading the folder in fp32 computes it in fp32 (the scale
upcast first), exactly as here.

Static W8A8 (`input_activations` int8, `dynamic: false`, strategy tensor; weights int8 symmetric per channel
or tensor; int-quantized): `weight` int8 [N, K], `weight_scale` [N, 1] or [1], `input_scale` [1] and an
optional `input_zero_point` [1] int8. compressed-tensors fake-quantizes the input as xq = clamp(round(x /
input_scale + zp)) (torch.round) and computes ((xq - zp) * input_scale) @ (q * weight_scale)^T: a StaticLinear
(graphconv/frontend/quantized_activations.py) with deq = input_scale * weight_scale and c = 0, kept as QDQ.

Refused in one line, naming what: dynamic (per-token) activations (no dynamic route yet), activations other
than static int8 per tensor, float formats (FP8, NVFP4, MXFP4 in this layout),
activation order (`actorder` with `weight_g_idx`), sparsity, transforms (rotations) and a quantized KV cache.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from graphconv.errors import InputError, UnsupportedError
from graphconv.frontend.quantized_activations import QuantizedCheckpoint, StaticLinear
from graphconv.frontend.quantized_linears import checkpoint_entry, QuantizedLinear

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_WHERE = "the compressed-tensors checkpoint"  # (where an absent tensor is said to be missing from)
_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_INPUT = ("input_scale", "input_zero_point")


@dataclasses.dataclass(frozen=True)
class WeightArgs:
    """One config group's weight quantization, as far as the reader needs it."""

    bits: int
    symmetric: bool
    strategy: str  # group | channel | tensor
    group: int | None


@dataclasses.dataclass(frozen=True)
class Group:
    """A config group: the modules it targets, its weights' arguments and its storage format."""

    targets: tuple[str, ...]
    weights: WeightArgs
    format: str
    static: bool = False  # its inputs quantized statically (W8A8): quantized_activations.StaticLinear

    def takes(self, module: str) -> bool:
        return any(_matches(t, module) for t in self.targets)


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A compressed-tensors checkpoint's weight-only quantization."""

    groups: tuple[Group, ...]
    ignore: tuple[str, ...]

    def note(self, linears: int) -> str:
        parts = sorted({f"{g.format} int{g.weights.bits} {g.weights.strategy}"
                        f"{f' {g.weights.group}' if g.weights.group else ''}"
                        f"{'' if g.weights.symmetric else ' asymmetric'}" for g in self.groups})
        return (f"compressed-tensors checkpoint ({'; '.join(parts)}): {linears} weight-only quantized linears read "
                "exactly, W = (q - zero point) * scale in fp32")

    def view(self, checkpoint) -> QuantizedCheckpoint:
        """The checkpoint with each quantized weight read as its dequantized value, its integers kept."""
        linears: dict[str, QuantizedLinear] = {}
        static: dict = {}
        consumed: set[str] = set()
        for key in checkpoint.entries:
            module, _, suffix = key.rpartition(".")
            if suffix not in ("weight_packed", "weight_scale") or f"{module}.weight" in {*linears, *static}:
                continue
            group = next((g for g in self.groups if g.takes(module)), None)
            if group is None:
                raise InputError(f"{key}: no config group of quantization_config targets {module}")
            lin = _linear(checkpoint, module, group)
            if group.static:
                static[lin.key] = _static(checkpoint, module, lin)
            else:
                linears[lin.key] = lin
            consumed |= {f"{module}.{s}" for s in (*_SUFFIXES, *_INPUT, "weight")} & set(checkpoint.entries)
        consumed -= {*linears, *static}
        note = self.note(len(linears)) + (f"; {len(static)} static W8A8 linears kept as QDQ" if static else "")
        return QuantizedCheckpoint(checkpoint, linears, static, consumed, note)


def scheme(where: Path, config: dict) -> Scheme:
    """The scheme of a compressed-tensors quantization_config, or one line naming what is not read."""
    def refuse(what: str):
        raise UnsupportedError(f"{where}: compressed-tensors checkpoint with {what}: graphconv does not read this "
                               "yet (it reads weight-only int quantization, pack-quantized or int-quantized)")

    for key, what in (("sparsity_config", "a sparsity config"), ("transform_config", "transforms (rotations)"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if config.get(key):
            refuse(what)
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InputError(f"{where}: quantization_config.config_groups is not a non-empty object")
    top = config.get("format")
    parsed = []
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise InputError(f"{where}: quantization_config.config_groups.{name} has no weights arguments")
        if group.get("output_activations"):
            refuse(f"quantized outputs (config group {name!r})")
        fmt = group.get("format") or top
        if fmt not in _FORMATS:
            refuse(f"format {fmt!r}")
        weights = _weights(where, name, group["weights"], refuse)
        static = _static_activations(name, group.get("input_activations"), weights, fmt, refuse)
        parsed.append(Group(_targets(where, name, group), weights, fmt, static))
    ignore = config.get("ignore") or []
    return Scheme(tuple(parsed), tuple(ignore) if isinstance(ignore, list) else ())


def _static_activations(name: str, args, weights: WeightArgs, fmt: str, refuse) -> bool:
    """Whether the group quantizes its inputs statically (W8A8), refusing every other activation scheme."""
    if not args:
        return False
    if not isinstance(args, dict) or args.get("dynamic", False) is not False:
        refuse(f"dynamic activations (config group {name!r}: W8A8 per token, no dynamic route yet)")
    what = (f"{args.get('type', 'int')} {args.get('num_bits')}-bit activations, strategy {args.get('strategy')!r}"
            f" (config group {name!r}: static int 8-bit per tensor taken)")
    if args.get("type", "int") != "int" or args.get("num_bits") != 8 or args.get("strategy", "tensor") != "tensor":
        refuse(what)
    if weights.bits != 8 or not weights.symmetric or weights.strategy not in ("channel", "tensor") \
            or fmt == "pack-quantized":
        refuse(f"static activations over {weights.bits}-bit {weights.strategy} weights, format {fmt!r} (config "
               f"group {name!r}: symmetric int8 per channel or tensor, int-quantized, taken)")
    return True


def _targets(where: Path, name: str, group: dict) -> tuple[str, ...]:
    targets = group.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise InputError(f"{where}: quantization_config.config_groups.{name}.targets is not a list of names")
    return tuple(targets)


def _weights(where: Path, name: str, args: dict, refuse) -> WeightArgs:
    bits, kind = args.get("num_bits"), args.get("type", "int")
    if kind != "int":
        refuse(f"{kind} weights (config group {name!r})")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise InputError(f"{where}: config group {name!r}: num_bits {bits!r} is not an integer in 1..8")
    if args.get("actorder") not in (None, False, "static", "weight"):
        refuse(f"activation order {args.get('actorder')!r} (config group {name!r})")
    if args.get("dynamic"):
        refuse(f"dynamic weight quantization (config group {name!r})")
    strategy = args.get("strategy", "tensor")
    if strategy not in ("group", "channel", "tensor"):
        refuse(f"strategy {strategy!r} (config group {name!r})")
    group = args.get("group_size")
    if strategy == "group" and (not isinstance(group, int) or isinstance(group, bool) or group <= 0):
        raise InputError(f"{where}: config group {name!r}: strategy group with group_size {group!r}")
    return WeightArgs(bits, args.get("symmetric", True) is not False, strategy, group if strategy == "group" else None)


def _linear(checkpoint, module: str, group: Group) -> QuantizedLinear:
    """One linear's tensors checked against the format, as a QuantizedLinear that reads them when asked."""
    entries = checkpoint.entries
    args = group.weights
    if f"{module}.weight_g_idx" in entries:
        raise UnsupportedError(f"{module}.weight_g_idx: compressed-tensors activation order (g_idx): graphconv does "
                               "not read it yet")
    scale_shape = checkpoint_entry(entries, f"{module}.weight_scale", _WHERE)[2]
    if group.format == "pack-quantized":
        n, k = (int(v) for v in checkpoint.tensor(f"{module}.weight_shape").tolist())
        _expect(entries, f"{module}.weight_packed", "I32", (n, -(-k * args.bits // 32)))
    else:
        n, k = checkpoint_entry(entries, f"{module}.weight", _WHERE)[2]
        _expect(entries, f"{module}.weight", "I8", (n, k))
    g = {"group": args.group, "channel": k, "tensor": k}[args.strategy]
    blocks = -(-k // g)
    if tuple(scale_shape) not in ((n, blocks), *(((1,), (1, 1)) if args.strategy == "tensor" else ())):
        raise InputError(f"{module}.weight_scale has the shape {list(scale_shape)}: {args.strategy} quantization of "
                         f"[{n}, {k}] takes {[n, blocks]}")
    zp_key = f"{module}.weight_zero_point"
    if not args.symmetric and zp_key not in entries:
        raise InputError(f"{zp_key} is absent, and the config group's weights are asymmetric")
    if k % g:
        raise UnsupportedError(f"{module}: K={k} is not a multiple of the group {g}: graphconv does not read a "
                               "padded last group yet")

    def read():
        return _read(checkpoint, module, group, n, k, g)

    return QuantizedLinear(f"{module}.weight", n, k, args.bits, g, not args.symmetric, read)


def _read(checkpoint, module: str, group: Group, n: int, k: int, g: int):
    """(q_u uint8 [N, K], scale fp32 [N, K/g], zp_u uint8 [N, K/g] or None)."""
    import torch

    bits, offset = group.weights.bits, 1 << (group.weights.bits - 1)
    if group.format == "pack-quantized":
        q = unpack(checkpoint.tensor(f"{module}.weight_packed").numpy(), bits, k)
    else:
        q = (checkpoint.tensor(f"{module}.weight").numpy().astype(np.int16) + offset).astype(np.uint8)
    scale = checkpoint.tensor(f"{module}.weight_scale").to(torch.float32).numpy()
    scale = np.broadcast_to(scale.reshape(-1, 1) if scale.size == 1 else scale, (n, k // g)).astype(np.float32)
    zp = None
    zp_key = f"{module}.weight_zero_point"
    if not group.weights.symmetric:
        stored = checkpoint.tensor(zp_key).numpy()
        if group.format == "pack-quantized" and stored.dtype == np.int32:
            zp = unpack(np.ascontiguousarray(stored.T), bits, n).T
        else:
            zp = (stored.astype(np.int16) + offset).astype(np.uint8)
        zp = np.broadcast_to(zp.reshape(-1, 1) if zp.size == 1 else zp, (n, k // g)).astype(np.uint8)
    return q, scale, zp


def _static(checkpoint, module: str, lin: QuantizedLinear) -> StaticLinear:
    """A static W8A8 linear: its int8 weight (lin's q_u - 128), deq = input_scale * weight_scale, c = 0."""
    import torch

    entries = checkpoint.entries
    for part in _INPUT:
        key = f"{module}.{part}"
        if (key in entries or part == "input_scale") and int(np.prod(checkpoint_entry(entries, key, _WHERE)[2])) != 1:
            raise InputError(f"{key} has the shape {list(entries[key][2])}: static per-tensor activations take [1]")
    s_x = float(checkpoint.tensor(f"{module}.input_scale").to(torch.float32).reshape(-1)[0])
    if not (np.isfinite(s_x) and s_x > 0):
        raise InputError(f"{module}.input_scale is {s_x}: a positive scale taken")
    zp_key = f"{module}.input_zero_point"
    zp = float(checkpoint.tensor(zp_key).to(torch.float32).reshape(-1)[0]) if zp_key in entries else 0.0
    if zp != round(zp) or not -128 <= zp <= 127:
        raise InputError(f"{zp_key} is {zp}: an int8 zero point taken")

    def read():
        q, scale, _ = lin.read()
        deq = (np.float32(s_x) * scale.reshape(-1)).astype(np.float32)
        return (q.astype(np.int16) - 128).astype(np.int8), np.broadcast_to(deq, (lin.n,)).copy(), None

    return StaticLinear(lin.key, lin.n, lin.k, s_x, int(zp), read)


def unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [rows, W] packed densely (element i at bit i * bits, lowest first) -> uint8 [rows, count]."""
    rows = words.shape[0]
    data = np.ascontiguousarray(words).astype("<i4").view(np.uint8).reshape(rows, -1)
    if bits == 8:
        return data[:, :count].copy()
    if bits == 4:
        return np.stack([data & 0xF, data >> 4], axis=-1).reshape(rows, -1)[:, :count]
    stream = np.unpackbits(data, axis=1, bitorder="little")[:, : count * bits].reshape(rows, count, bits)
    return (stream.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(-1).astype(np.uint8)




def _expect(entries: dict, key: str, dtype: str, shape: tuple) -> None:
    _path, stored, stored_shape = checkpoint_entry(entries, key, _WHERE)
    if stored != dtype or tuple(stored_shape) != tuple(shape):
        raise InputError(f"{key} is {stored} {list(stored_shape)}: the format stores {dtype} {list(shape)}")
