"""The quantization formats a checkpoint folder names, and how their tensors are read.

A checkpoint says how it is quantized in config.json's `quantization_config` (its `quant_method`), or, for
msModelSlim's output, in a `quant_model_description*.json` beside it. graphconv reads a format only where it
can give the exact values the format defines; it refuses every other format in one line that names it, before
any model is built.

Fine-grained FP8 (`quant_method: "fp8"`, as DeepSeek-V3 and Qwen3's FP8 releases ship): each Linear weight is
float8_e4m3fn with an fp32 `weight_scale_inv` per block of the weight (128 x 128 in those releases). Despite its
name the scale is a multiplier: W = float32(q) * scale_inv[row // bm, col // bn], exactly as transformers
dequantizes it on a CPU. Atlas A2 and A3 compute no FP8, so the export carries these dequantized weights, in
the dtype `--dtype` stores (bf16 for a bf16 release). Activations stay in float: transformers computes them so
on a CPU, for `activation_scheme` "dynamic" and "static" alike.

MXFP4 (`quant_method: "mxfp4"`, gpt-oss's experts) is read through transformers, which dequantizes it at load.

compressed-tensors (`quant_method: "compressed-tensors"`): its weight-only int formats are read by
graphconv/frontend/compressed_tensors.py, and the export keeps those weights quantized.

GPTQ (`quant_method: "gptq"`, v1 and gptq_v2) and AWQ (`quant_method: "awq"`, the GEMM layout): read by
graphconv/frontend/gptq_awq.py, their weights kept quantized the same way.

msModelSlim (a `quant_model_description.json` beside `quant_model_weight_*.safetensors`): W8A16 and W4A16
read by graphconv/frontend/msmodelslim.py as weight-only linears, its static W8A8 as QDQ linears
(graphconv/frontend/quantized_activations.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from graphconv.errors import InputError, UnsupportedError

# quant_method -> what the format is, for the refusal of a format graphconv does not read.
_NOT_READ = {
    "bitsandbytes": "bitsandbytes (NF4/FP4 or LLM.int8: no Ascend kernel takes its codebook)",
    "gguf": "GGUF",
    "hqq": "HQQ",
    "quanto": "optimum-quanto",
    "eetq": "EETQ",
    "higgs": "HIGGS",
    "torchao": "torchao",
    "bitnet": "BitNet",
    "aqlm": "AQLM",
    "vptq": "VPTQ",
    "spqr": "SpQR",
    "fbgemm_fp8": "FBGEMM FP8",
    "auto-round": "AutoRound",
    "quark": "Quark",
    "fp_quant": "FP-Quant",
}
READ = ("fp8", "mxfp4", "compressed-tensors", "gptq", "awq")
MSMODELSLIM_DESCRIPTIONS = ("quant_model_description.json", "quant_model_description_w8a8sc.json",
                            "quantization_description.json")


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """Fine-grained FP8: the block shape the config declares and its activation scheme."""

    block: tuple[int, int] | None  # (rows, cols) per scale; None takes it from each scale's grid
    activation_scheme: str

    def note(self) -> str:
        block = "x".join(map(str, self.block)) if self.block else "per the scales' grid"
        return (f"fine-grained FP8 checkpoint (blocks {block}, activation_scheme {self.activation_scheme!r}): "
                "weights dequantized exactly (float32(q) * weight_scale_inv), as transformers does on a CPU; "
                "Atlas A2/A3 compute no FP8, so the export carries them in float; activations stay in float")

    def view(self, checkpoint) -> Fp8Checkpoint:
        """The checkpoint with each FP8 weight read as its dequantized value."""
        return Fp8Checkpoint(checkpoint, self)


def scheme(folder: Path, raw: dict):
    """The quantization a checkpoint folder needs read specially (Fp8Blocks, compressed_tensors.Scheme,
    gptq_awq.Scheme, msmodelslim.Scheme), or None (a float checkpoint, or MXFP4, which transformers
    dequantizes). Refuses, in one line, a format graphconv does not read."""
    for name in MSMODELSLIM_DESCRIPTIONS:
        if (folder / name).is_file():
            from graphconv.frontend import msmodelslim

            return msmodelslim.scheme(folder / name)
    config = raw.get("quantization_config")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    config = config if config is not None else text.get("quantization_config")
    if config is None:
        return None
    where = folder / "config.json"
    if not isinstance(config, dict):
        raise InputError(f"{where}: quantization_config is not an object")
    method = config.get("quant_method")
    if config.get("load_in_4bit") or config.get("load_in_8bit"):
        method = method or "bitsandbytes"
    if method == "compressed-tensors":
        from graphconv.frontend import compressed_tensors

        return compressed_tensors.scheme(where, config)
    if method in ("gptq", "awq"):
        from graphconv.frontend import gptq_awq

        return gptq_awq.scheme(where, config, method)
    if method in READ:
        return _fp8(where, config) if method == "fp8" else None
    if method in _NOT_READ:
        raise UnsupportedError(f"{where}: quant_method {method!r} ({_NOT_READ[method]}): graphconv does not read "
                               f"this quantization format yet (it reads quant_method {', '.join(READ)})")
    raise UnsupportedError(f"{where}: quantization_config.quant_method {method!r} is a format graphconv does not "
                           f"know (it reads {', '.join(READ)})")


def _fp8(where: Path, config: dict) -> Fp8Blocks:
    block = config.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2
                              or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputError(f"{where}: quantization_config.weight_block_size {block!r}: expected [rows, cols]")
    if config.get("scale_fmt") not in (None, "float"):
        raise UnsupportedError(f"{where}: FP8 with scale_fmt {config.get('scale_fmt')!r}: graphconv reads float "
                               "scales only")
    scheme_ = config.get("activation_scheme", "dynamic")
    if scheme_ not in ("dynamic", "static"):
        raise InputError(f"{where}: quantization_config.activation_scheme {scheme_!r}: expected dynamic or static")
    return Fp8Blocks(tuple(block) if block else None, scheme_)


class Fp8Checkpoint:
    """A fine-grained FP8 checkpoint seen as its dequantized weights: each FP8 weight with a `_scale_inv`
    beside it reads as float32(q) * scale, the scales and activation scales are not weights, and the other
    tensors read as stored. It offers the Checkpoint interface (`entries`, `tensor`)."""

    SCALE = "_scale_inv"

    def __init__(self, checkpoint, blocks: Fp8Blocks):
        self._checkpoint, self._blocks = checkpoint, blocks
        self.note = blocks.note()
        self.quantized: set[str] = set()
        self.entries = {}
        for key, (path, dtype, shape) in checkpoint.entries.items():
            if key.endswith(self.SCALE) or key.endswith("activation_scale"):
                continue
            scale = checkpoint.entries.get(key + self.SCALE)
            if scale is not None:
                self._check(key, dtype, shape, scale)
                self.quantized.add(key)
                dtype = "F32"
            self.entries[key] = (path, dtype, shape)

    def _check(self, key: str, dtype: str, shape: tuple, scale: tuple) -> None:
        if dtype not in ("F8_E4M3", "F8_E5M2"):
            raise InputError(f"{key} has a {self.SCALE} but is stored as {dtype}, not FP8")
        grid = scale[2]
        if len(shape) < 2 or len(grid) != len(shape) or tuple(grid[:-2]) != tuple(shape[:-2]):
            raise InputError(f"{key}{self.SCALE} has the shape {list(grid)}: not a block grid of {key}'s "
                             f"{list(shape)}")
        rows, cols = self._block(shape, grid)
        if (math.ceil(shape[-2] / rows), math.ceil(shape[-1] / cols)) != tuple(grid[-2:]):
            raise InputError(f"{key}{self.SCALE} has the shape {list(grid)}: {list(shape)} in blocks of "
                             f"{rows}x{cols} takes {[math.ceil(shape[-2] / rows), math.ceil(shape[-1] / cols)]}")

    def _block(self, shape, grid) -> tuple[int, int]:
        if self._blocks.block is not None:
            return self._blocks.block
        return math.ceil(shape[-2] / grid[-2]), math.ceil(shape[-1] / grid[-1])

    def tensor(self, key: str):
        import torch

        stored = self._checkpoint.tensor(key)
        if key not in self.quantized:
            return stored
        scale = self._checkpoint.tensor(key + self.SCALE).to(torch.float32)
        rows, cols = self._block(stored.shape, scale.shape)
        # Each scale repeated over its block, the last blocks cut to the weight (a shape the block size does
        # not divide, as DeepSeek-V3's 576 x 7168 ships).
        full = scale.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
        full = full[..., : stored.shape[-2], : stored.shape[-1]]
        return stored.to(torch.float32) * full
