"""GPTQ and AWQ checkpoints (`quant_method: "gptq"` and `"awq"`, as GPTQModel, AutoGPTQ and AutoAWQ write them),
read exactly, their linears kept quantized (graphconv/frontend/quantized_linears.py).

Both store each Linear weight W [N, K] (out, in) transposed, as int32 words, with fp16 scales per group of g
input rows (group_size; -1 is one group of all K):

- GPTQ: `qweight` int32 [K * bits / 32, N], packed along K: the bits of column n, rows k = 0, 1, ... follow one
  another from the lowest bit of word 0 up (element k = (32 / bits) * r + i at bit bits * i of row r when
  bits divides 32; 3 bits run on across the words, 32 values in 3). `qzeros` int32 [K / g, N * bits / 32]
  packed the same way along N, `scales` [K / g, N], `g_idx` int32 [K] (each row's group), an optional `bias`.
  W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]). The v1 format (`checkpoint_format`/`format`
  "gptq", AutoGPTQ's) stores each zero point minus one, so z = stored + 1 (symmetric 4-bit stores 7 for 8);
  gptq_v2 (GPTQModel's own) stores z. A v1 zero stored as 2^bits - 1 (the zero point 0, written as -1) is
  refused: it does not fit, and the kernels disagree on its value.
- AWQ GEMM (`version` "gemm"): `qweight` int32 [K, N / 8] packed along N, eight columns a word in the order
  [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word j holds column 8 j + that order's i-th), `qzeros` int32 [K / g,
  N / 8] packed the same way, `scales` [K / g, N]: W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g, n].
  zero_point false: the zero point is 8 (qzeros absent, or all 8). The GEMV layouts are refused.

The readers transpose to QuantizedLinear's [N, K] (q, and [N, K / g] scales and zero points) and upcast the
scales exactly to fp32: the export computes in fp32, and W there is one rounding of an exact integer times the
fp16 scale. Zero points that are all 2^(bits - 1) are left out (MatMulNBits' default). Linears without a
qweight (`modules_to_not_convert`, `modules_in_block_to_quantize`, lm_head) read as stored.

Activation order (GPTQ desc_act, a g_idx that is not k // g): the groups are not contiguous runs of K, which
MatMulNBits cannot express; such a linear is still read exactly (its scales and zero points spread to each
row, a group of 1) and kept in float, the export's notes saying so. Refusing would lose most GPTQ releases
(desc_act true is common), and the weight in float is the format's value; quantized it would need the
activations permuted before each MatMulNBits, which is not built yet. 3-bit GPTQ is read the same way and kept
in float (MatMulNBits takes 2, 4 and 8 bits).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from graphconv.errors import InputError, UnsupportedError
from graphconv.frontend.compressed_tensors import unpack
from graphconv.frontend.quantized_linears import checkpoint_entry, QuantizedLinear, WeightOnlyCheckpoint

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SCALE_DTYPES = ("F16", "BF16", "F32")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8 j + c sits at nibble AWQ_REVERSE_ORDER[c] of word j
_ACT_ORDER = "activation order (g_idx is not k // group: MatMulNBits takes contiguous groups)"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A GPTQ or AWQ checkpoint's quantization, as far as the reader needs it."""

    method: str  # gptq | awq
    bits: int
    group: int  # -1: one group of all K
    v1: bool  # GPTQ v1: zero points stored minus one
    desc_act: bool
    zero_point: bool  # AWQ: asymmetric

    def note(self, linears: dict[str, QuantizedLinear]) -> str:
        what = (f"GPTQ ({'gptq v1' if self.v1 else 'gptq_v2'}, desc_act {self.desc_act})" if self.method == "gptq"
                else f"AWQ (gemm, zero_point {self.zero_point})")
        kept = [lin.kept for lin in linears.values() if lin.kept]
        return (f"{what} checkpoint, int{self.bits} group {self.group}: {len(linears)} weight-only quantized linears "
                "read exactly, W = (q - zero point) * scale in fp32"
                + (f"; {len(kept)} kept in float, their groups spread per row ({'; '.join(sorted(set(kept)))})"
                   if kept else ""))

    def view(self, checkpoint) -> WeightOnlyCheckpoint:
        """The checkpoint with each quantized weight read as its dequantized value, its integers kept."""
        entries = checkpoint.entries
        linears: dict[str, QuantizedLinear] = {}
        consumed: set[str] = set()
        for key in entries:
            module, _, suffix = key.rpartition(".")
            if suffix == "qweight":
                read = _gptq if self.method == "gptq" else _awq
                linears[f"{module}.weight"] = read(checkpoint, module, self)
                consumed |= {f"{module}.{p}" for p in _PARTS} & set(entries)
        stray = next((k for k in entries if k.rpartition(".")[2] in _PARTS and k not in consumed), None)
        if stray is not None:
            raise UnsupportedError(f"{stray} has no qweight beside it: graphconv reads {self.method.upper()} "
                                   "quantized linears only (not AWQ's scaled activations)")
        return WeightOnlyCheckpoint(checkpoint, linears, consumed, self.note(linears))


def scheme(where: Path, config: dict, method: str) -> Scheme:
    """The scheme of a GPTQ or AWQ quantization_config, or one line naming what is not read."""
    def refuse(what: str):
        raise UnsupportedError(f"{where}: {method.upper()} checkpoint with {what}: graphconv does not read this yet "
                               f"({'GPTQ gptq and gptq_v2, 2, 3, 4 and 8 bits' if method == 'gptq' else 'AWQ gemm'})")

    bits, group = config.get("bits"), config.get("group_size", 128)
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise InputError(f"{where}: quantization_config.bits {bits!r} is not an integer")
    if not isinstance(group, int) or isinstance(group, bool) or not (group > 0 or group == -1):
        raise InputError(f"{where}: quantization_config.group_size {group!r}: expected a positive integer or -1")
    if method == "awq":
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if config.get("backend") == "llm-awq":
            version = "llm-awq"
        if version != "gemm":
            refuse(f"version {version!r}")
        if bits != 4:
            refuse(f"{bits}-bit weights")
        return Scheme("awq", 4, group, False, False, config.get("zero_point", True) is not False)
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        refuse(f"format {fmt!r}")
    if bits not in (2, 3, 4, 8):
        refuse(f"{bits}-bit weights")
    if config.get("pack_dtype", "int32") != "int32":
        refuse(f"pack_dtype {config.get('pack_dtype')!r}")
    return Scheme("gptq", bits, group, fmt == "gptq", bool(config.get("desc_act")), True)


def _gptq(checkpoint, module: str, s: Scheme) -> QuantizedLinear:
    entries, bits = checkpoint.entries, s.bits
    rows, n = _shape(entries, f"{module}.qweight", "I32")
    if rows * 32 % bits:
        raise InputError(f"{module}.qweight is I32 {[rows, n]}: {rows} words do not hold whole {bits}-bit rows")
    k = rows * 32 // bits
    g_key = f"{module}.g_idx"
    if g_key in entries and _shape(entries, g_key, "I32", 1) != (k,):
        raise InputError(f"{module}.qweight is I32 {[rows, n]} (K={k} {bits}-bit rows), {g_key} has "
                         f"{checkpoint_entry(entries, g_key)[2][0]} rows: they disagree on K")
    g = k if s.group == -1 else s.group
    blocks = -(-k // g)
    _scales(entries, f"{module}.scales", (blocks, n))
    zeros_key = f"{module}.qzeros"
    if zeros_key not in entries:
        raise InputError(f"{zeros_key} is absent from the GPTQ checkpoint")
    _expect(entries, zeros_key, (blocks, n * bits // 32), whole=n * bits % 32 == 0)
    if g_key in entries:
        g_idx = checkpoint.tensor(g_key).numpy().astype(np.int64)
        if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= blocks:
            raise InputError(f"{g_key} holds groups outside 0..{blocks - 1}")
    elif s.desc_act:
        raise InputError(f"{g_key} is absent, and the GPTQ checkpoint has desc_act true")
    else:
        g_idx = np.arange(k) // g
    zeros = unpack(checkpoint.tensor(zeros_key).numpy(), bits, n).astype(np.int16) + (1 if s.v1 else 0)
    if s.v1 and zeros.max(initial=0) >= 1 << bits:
        raise UnsupportedError(f"{zeros_key} stores {(1 << bits) - 1} in a gptq (v1) checkpoint: the zero point 0 "
                               "written as -1, which readers of the format take differently; graphconv does not "
                               "read it (re-save it as gptq_v2)")

    def q() -> np.ndarray:
        return unpack(np.ascontiguousarray(checkpoint.tensor(f"{module}.qweight").numpy().T), bits, k)

    return _linear(checkpoint, module, (n, k, bits, g), g_idx, zeros.astype(np.uint8), q)


def _awq(checkpoint, module: str, s: Scheme) -> QuantizedLinear:
    entries = checkpoint.entries
    k, words = _shape(entries, f"{module}.qweight", "I32")
    n = words * 8
    g = k if s.group == -1 else s.group
    blocks = -(-k // g)
    _scales(entries, f"{module}.scales", (blocks, n))
    zeros_key = f"{module}.qzeros"
    order = (np.arange(n).reshape(-1, 8)[:, AWQ_REVERSE_ORDER]).reshape(-1)
    if zeros_key in entries:
        _expect(entries, zeros_key, (blocks, words))
        zeros = unpack(checkpoint.tensor(zeros_key).numpy(), 4, n)[:, order]
    elif s.zero_point:
        raise InputError(f"{zeros_key} is absent, and the AWQ checkpoint has zero_point true")
    else:
        zeros = np.full((blocks, n), 8, np.uint8)

    def q() -> np.ndarray:
        return np.ascontiguousarray(unpack(checkpoint.tensor(f"{module}.qweight").numpy(), 4, n)[:, order].T)

    return _linear(checkpoint, module, (n, k, 4, g), np.arange(k) // g, zeros, q)


def _linear(checkpoint, module: str, dims: tuple, g_idx: np.ndarray, zeros: np.ndarray, q) -> QuantizedLinear:
    """The QuantizedLinear of q [N, K] (read when asked) with scales and zeros [K / g, N] per g_idx: contiguous
    groups as they are, other groupings (activation order, a last group cut short) spread to a group of 1."""
    import torch

    n, k, bits, g = dims
    contiguous = k % g == 0 and np.array_equal(g_idx, np.arange(k) // g)
    zero_points = bool((zeros != 1 << (bits - 1)).any())

    def read():
        scales = checkpoint.tensor(f"{module}.scales").to(torch.float32).numpy()
        spread = (lambda a: a) if contiguous else (lambda a: a[g_idx])
        zp = np.ascontiguousarray(spread(zeros).T) if zero_points else None
        return q(), np.ascontiguousarray(spread(scales).T), zp

    why = None if contiguous else (_ACT_ORDER if k % g == 0 else f"K={k} is not a multiple of the group {g}")
    return QuantizedLinear(f"{module}.weight", n, k, bits, g if contiguous else 1, zero_points, read, why)




def _shape(entries: dict, key: str, dtype: str, rank: int = 2) -> tuple:
    _path, stored, shape = checkpoint_entry(entries, key)
    if stored != dtype or len(shape) != rank:
        raise InputError(f"{key} is {stored} {list(shape)}: the format stores {dtype} of rank {rank}")
    return tuple(shape)


def _expect(entries: dict, key: str, shape: tuple, whole: bool = True) -> None:
    """`key` is int32 of `shape`; `whole`: its values fill whole int32 words."""
    _path, stored, stored_shape = checkpoint_entry(entries, key)
    if not whole:
        raise InputError(f"{key} is {stored} {list(stored_shape)}: its packing does not fill whole int32 words")
    if stored != "I32" or tuple(stored_shape) != tuple(shape):
        raise InputError(f"{key} is {stored} {list(stored_shape)}: the format stores I32 {list(shape)}")


def _scales(entries: dict, key: str, shape: tuple) -> None:
    _path, stored, stored_shape = checkpoint_entry(entries, key)
    if stored not in _SCALE_DTYPES or tuple(stored_shape) != tuple(shape):
        raise InputError(f"{key} is {stored} {list(stored_shape)}: the format stores F16 {list(shape)}")
