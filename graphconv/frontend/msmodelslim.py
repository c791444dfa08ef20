"""msModelSlim checkpoints (Huawei's quantizer for vllm-ascend and MindIE), read exactly, kept quantized.

msModelSlim writes `quant_model_description.json` beside `quant_model_weight_{type}.safetensors` (possibly
sharded). The description holds `model_quant_type` ("W8A8", "W8A16", "W4A16", ...), `version`, `group_size`,
`kv_cache_type` and `fa_quant_type`, and, for every other key, a tensor name -> its QuantType ("W8A8",
"FLOAT", ...). Its convention: q = round(x / scale + offset) with torch.round (half to even), dq = (q - offset)
* scale, the offsets zero points stored as float32. Tensors of a linear P, read here:

- W8A16: `P.weight` int8 [N, K]; `P.weight_scale` fp32 [N, 1] (per channel) or [N, K / g] (per group);
  `P.weight_offset` the same shape (a zero point, non-zero where asymmetric). W = (q - offset) * scale: a
  QuantizedLinear of 8 bits (q_u = q + 128, zp_u = offset + 128), so MatMulNBits, WeightQuantBatchMatmul int8.
- W4A16 (the writer that packs): `P.weight` int8 holding two int4 (two's complement) a byte, the lower index
  in the low nibble (`w0 & 0xF | w1 << 4`), in one of two layouts, told apart by the rows: [N, K / 2] packed
  along K (byte j of row n holds W[n, 2j], W[n, 2j + 1]; the per-channel writer), or [N / 2, K] packed along
  N and stored transposed (the per-group writer transposes W to [K, N], packs pairs of columns to [K, N / 2]
  and stores that transposed: byte [j, k] holds W[2j, k] low and W[2j + 1, k] high). Scales and offsets
  [N, 1] or [N, K / g], as W8A16. A QuantizedLinear of 4 bits (q_u = q + 8, zp_u = offset + 8).
- W8A8 (static): `P.weight` int8 [N, K]; `P.input_scale` [1]; `P.input_offset` [1]; `P.quant_bias` int32
  [N] = round(bias / deq_scale) - sum_k Wq[n, k] * input_offset; `P.deq_scale` [N] = input_scale *
  weight_scale, fp32 for a bf16 model, int64 holding the fp32 bit pattern in its low 32 bits for an fp16 model;
  `P.weight_scale` and `P.weight_offset` [N, 1] optional (the weights symmetric: an offset that is not 0 is
  refused). y[n] = deq_scale[n] * (sum_k Wq[n, k] * xq[k] + quant_bias[n]), xq = clamp(round(x /
  input_scale + input_offset), -128, 127): a StaticLinear (graphconv/frontend/quantized_activations.py) with
  c = quant_bias + input_offset * sum_k Wq, kept as QDQ that the compile runs on QuantV2 + QuantBatchMatmul.
  Where the checkpoint also stores `P.bias` (the architecture has one), that bias reads as deq_scale * c and
  quant_bias is not added twice.
- FLOAT: a plain weight.

Refused in one line naming the type: dynamic activations (W8A8_DYNAMIC, W4A8_DYNAMIC), MX and FP formats,
sparse ones (W8A8S, W8A8SC, W16A16S), a quantized KV cache or attention (kv_cache_type, fa_quant_type: C8,
FAQuant), and any type not named above.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from graphconv.errors import InputError, UnsupportedError
from graphconv.frontend.quantized_activations import QuantizedCheckpoint, StaticLinear
from graphconv.frontend.quantized_linears import QuantizedLinear

READ = ("W8A16", "W4A16", "W8A8", "FLOAT")
_PARTS = ("weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias", "deq_scale")
_META = ("model_quant_type", "version", "group_size", "kv_cache_type", "fa_quant_type", "kv_quant_type",
         "reduce_quant_type", "metadata")
_FLOATS = ("F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """An msModelSlim checkpoint: the description's model type and each tensor's QuantType."""

    where: Path
    model_type: str
    types: dict  # tensor name -> QuantType

    def note(self, linears: dict, static: dict) -> str:
        kinds = sorted({self.types[k] for k in (*linears, *static)})
        return (f"msModelSlim checkpoint ({self.model_type}; {', '.join(kinds) or 'no quantized linears'}): "
                f"{len(linears)} weight-only linears read exactly, W = (q - offset) * scale in fp32; {len(static)} "
                "static W8A8 linears kept as QDQ, y = deq_scale * (Wq . xq + quant_bias)")

    def view(self, checkpoint) -> QuantizedCheckpoint:
        """The checkpoint with each quantized weight read as its float value, its integers kept."""
        entries = checkpoint.entries
        linears: dict[str, QuantizedLinear] = {}
        static: dict[str, StaticLinear] = {}
        consumed: set[str] = set()
        for key, kind in self.types.items():
            if kind == "FLOAT" or not key.endswith(".weight"):
                continue
            module = key.removesuffix(".weight")
            if key not in entries:
                raise InputError(f"{self.where}: {key} ({kind}) is absent from the weights")
            if kind == "W8A8":
                static[key] = _w8a8(checkpoint, module, f"{module}.bias" in entries)
            else:
                linears[key] = _weight_only(checkpoint, module, 8 if kind == "W8A16" else 4)
            consumed |= {f"{module}.{p}" for p in _PARTS} & set(entries)
        return QuantizedCheckpoint(checkpoint, linears, static, consumed - {*linears, *static},
                                   self.note(linears, static))


def scheme(path: Path) -> Scheme:
    """The description file's scheme, or one line naming what is not read."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not an msModelSlim description ({e})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: not an msModelSlim description (not an object)")
    model_type = str(raw.get("model_quant_type", ""))

    def refuse(what: str):
        raise UnsupportedError(f"{path}: msModelSlim checkpoint with {what}: graphconv does not read this yet (it "
                               f"reads {', '.join(READ[:3])} and FLOAT)")

    if path.name.endswith("_w8a8sc.json"):
        refuse("W8A8SC (sparse, compressed) weights")
    for key in ("kv_cache_type", "fa_quant_type", "kv_quant_type"):
        value = raw.get(key)
        if value not in (None, "", "FLOAT", False):
            refuse(f"{key} {value!r} (a quantized KV cache or attention)")
    if model_type and model_type not in READ:
        refuse(f"model_quant_type {model_type!r}")
    types = {k: v for k, v in raw.items() if k not in _META}
    bad = next(((k, v) for k, v in types.items() if v not in READ), None)
    if bad is not None:
        if not isinstance(bad[1], str):
            raise InputError(f"{path}: {bad[0]}: {bad[1]!r} is not a QuantType")
        refuse(f"{bad[0]}: {bad[1]!r}")
    return Scheme(path, model_type or "W8A8", types)


def _entry(entries: dict, key: str, dtypes: tuple, rank: int | None = None) -> tuple:
    entry = entries.get(key)
    if entry is None:
        raise InputError(f"{key} is absent from the msModelSlim checkpoint")
    if entry[1] not in dtypes or (rank is not None and len(entry[2]) != rank):
        raise InputError(f"{key} is {entry[1]} {list(entry[2])}: msModelSlim stores "
                         f"{'/'.join(dtypes)}{f' of rank {rank}' if rank else ''}")
    return tuple(entry[2])


def _floats(checkpoint, key: str) -> np.ndarray:
    import torch

    return checkpoint.tensor(key).to(torch.float32).numpy()


def _integral(values: np.ndarray, key: str, lo: int, hi: int) -> np.ndarray:
    if not np.all(np.isfinite(values)) or np.any(values != np.round(values)) or values.min(initial=lo) < lo \
            or values.max(initial=hi) > hi:
        raise InputError(f"{key}: zero points that are not integers in {lo}..{hi}")
    return values.astype(np.int64)


def _weight_only(checkpoint, module: str, bits: int) -> QuantizedLinear:
    """A W8A16 or W4A16 linear as a QuantizedLinear."""
    entries = checkpoint.entries
    rows, cols = _entry(entries, f"{module}.weight", ("I8",), 2)
    n, blocks = _entry(entries, f"{module}.weight_scale", _FLOATS, 2)
    if bits == 8:
        layout, k = "plain", cols
        if rows != n:
            raise InputError(f"{module}.weight is I8 {[rows, cols]}, its weight_scale has {n} rows")
    elif rows == n:
        layout, k = "along K", 2 * cols
    elif 2 * rows == n:
        layout, k = "along N", cols
    else:
        raise InputError(f"{module}.weight is I8 {[rows, cols]}: W4A16 packs [N, K / 2] or [N / 2, K], and its "
                         f"weight_scale has N={n} rows")
    if k % blocks:
        raise InputError(f"{module}.weight_scale has {blocks} groups a row: they do not divide K={k}")
    offset_key = f"{module}.weight_offset"
    if offset_key in entries and _entry(entries, offset_key, _FLOATS, 2) != (n, blocks):
        raise InputError(f"{offset_key} has the shape {list(entries[offset_key][2])}: weight_scale's is "
                         f"{[n, blocks]}")
    half = 1 << (bits - 1)
    offsets = _integral(_floats(checkpoint, offset_key), offset_key, -half, half - 1) \
        if offset_key in entries else np.zeros((n, blocks), np.int64)
    symmetric = not np.any(offsets)

    def read():
        q = _unpack4(checkpoint.tensor(f"{module}.weight").numpy(), layout) if bits == 4 \
            else checkpoint.tensor(f"{module}.weight").numpy().astype(np.int16)
        scale = _floats(checkpoint, f"{module}.weight_scale").astype(np.float32)
        zp = None if symmetric else (offsets + half).astype(np.uint8)
        return (q + half).astype(np.uint8), scale, zp

    return QuantizedLinear(f"{module}.weight", n, k, bits, k // blocks, not symmetric, read)


def _unpack4(stored: np.ndarray, layout: str) -> np.ndarray:
    """int8 bytes of two int4 (low nibble first) -> int16 values in -8..7, [N, K]."""
    b = stored.view(np.uint8).astype(np.int16)
    low, high = b & 0xF, b >> 4
    low, high = low - ((low & 8) << 1), high - ((high & 8) << 1)
    if layout == "along K":  # [N, K / 2]: W[n, 2j], W[n, 2j + 1]
        return np.stack([low, high], axis=-1).reshape(b.shape[0], -1)
    return np.stack([low, high], axis=1).reshape(-1, b.shape[1])  # [N / 2, K]: W[2j, k], W[2j + 1, k]


def deq_scale_fp32(stored: np.ndarray) -> np.ndarray:
    """deq_scale as fp32: as stored (fp32, bf16) or, int64 (an fp16 model's), the fp32 in its low 32 bits."""
    if stored.dtype == np.int64:
        return (stored & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return stored.astype(np.float32)


def _w8a8(checkpoint, module: str, bias_stored: bool) -> StaticLinear:
    """A static W8A8 linear as a StaticLinear."""
    entries = checkpoint.entries
    n, k = _entry(entries, f"{module}.weight", ("I8",), 2)
    for part, dtypes in (("input_scale", _FLOATS), ("input_offset", _FLOATS)):
        if _entry(entries, f"{module}.{part}", dtypes) not in ((1,), (1, 1), ()):
            raise InputError(f"{module}.{part} has the shape {list(entries[f'{module}.{part}'][2])}: msModelSlim's "
                             "static W8A8 stores one per tensor ([1])")
    for part, dtypes in (("quant_bias", ("I32",)), ("deq_scale", ("F32", "I64", "BF16"))):
        shape = _entry(entries, f"{module}.{part}", dtypes)
        if int(np.prod(shape)) != n or len(shape) > 2:
            raise InputError(f"{module}.{part} has the shape {list(shape)}: one per output channel ({n}) taken")
    offset_key = f"{module}.weight_offset"
    if offset_key in entries and np.any(_floats(checkpoint, offset_key)):
        raise UnsupportedError(f"{offset_key}: asymmetric W8A8 weights (offsets not 0): QuantBatchMatmul has no "
                               "weight offset, and graphconv does not read them yet")
    s_x = float(_floats(checkpoint, f"{module}.input_scale").reshape(-1)[0])
    if not (np.isfinite(s_x) and s_x > 0):
        raise InputError(f"{module}.input_scale is {s_x}: a positive scale taken")
    z_x = int(_integral(_floats(checkpoint, f"{module}.input_offset").reshape(-1), f"{module}.input_offset",
                        -128, 127)[0])

    def read():
        wq = checkpoint.tensor(f"{module}.weight").numpy()
        deq = deq_scale_fp32(checkpoint.tensor(f"{module}.deq_scale").numpy().reshape(-1)
                             if entries[f"{module}.deq_scale"][1] != "BF16"
                             else _floats(checkpoint, f"{module}.deq_scale").reshape(-1))
        qb = checkpoint.tensor(f"{module}.quant_bias").numpy().reshape(-1).astype(np.int64)
        return wq, deq, qb + z_x * wq.astype(np.int64).sum(axis=1)

    return StaticLinear(f"{module}.weight", n, k, s_x, z_x, read, bias_stored)
