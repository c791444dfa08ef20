"""Quantized checkpoint folders as they ship: fine-grained FP8 read exactly, every other format and every
unreadable tensor dtype refused in one line, before anything is written.

The FP8 checkpoint is written in the layout Qwen3's and DeepSeek-V3's FP8 releases use: each Linear weight in
float8_e4m3fn with an fp32 `weight_scale_inv` per block, config.json's quantization_config `quant_method: "fp8"`
with `weight_block_size`. transformers loads the same folder on a CPU (through accelerate) by dequantizing it,
and that model is the yardstick: its greedy tokens and its logits.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (transformers loads an FP8 checkpoint through it)

from models.hf import INITIALIZER_RANGE  # noqa: E402
from test_generate import NEW, PROMPTS, _hf_generate, _ids_arg, _match  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 64


def _graphconv(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", *args], capture_output=True, text=True, cwd=cwd)


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale fp32 per block) as an FP8 release stores a bf16 weight: amax / 448 per block."""
    rows, cols = w.shape
    grid = ((rows + block - 1) // block, (cols + block - 1) // block)
    scale = torch.empty(grid)
    q = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile / scale[i, j]
    return q.to(torch.float8_e4m3fn), scale


def _save_fp8(folder: Path, block: int = BLOCK) -> Path:
    """A tiny Qwen3 saved as bf16 (as its release is), then its Linear weights written in FP8 blocks."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                            initializer_range=INITIALIZER_RANGE, bos_token_id=1, eos_token_id=2)
    tf.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tensors = {}
    for key, w in load_file(folder / "model.safetensors").items():
        if key.endswith("_proj.weight"):
            tensors[key], tensors[key + "_scale_inv"] = _fp8_blocks(w, block)
        else:
            tensors[key] = w
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


@pytest.fixture(scope="module")
def fp8_gen(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    src = _save_fp8(base / "ckpt")
    export = _graphconv("export", str(src), "-o", str(base / "exp"), "--task", "text-generation-with-past", "-q")
    assert export.returncode == 0, export.stderr
    compiled = _graphconv("compile", str(base / "exp"), "-o", str(base / "gen"), "--target", "cpu", "-q")
    assert compiled.returncode == 0, compiled.stderr
    return src, base / "exp", base / "gen"


def test_fp8_dequantization_is_transformers(fp8_gen):
    """The exported weights are transformers' own dequantization of the checkpoint, bit for bit."""
    import onnx
    from onnx import numpy_helper

    src, exp, _ = fp8_gen
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    graph = onnx.load(str(exp / "decode.onnx"))
    stored = [numpy_helper.to_array(t) for t in graph.graph.initializer]
    linears = [(n, p.detach().numpy()) for n, p in model.named_parameters() if n.endswith("_proj.weight")]
    assert len(linears) == 14
    for name, theirs in linears:  # (the export stores a Linear's weight transposed, [in, out])
        assert sum(a.shape == theirs.T.shape and np.array_equal(a, theirs.T) for a in stored) == 1, name
    meta = json.loads((exp / "generation.json").read_text())
    assert any("fine-grained FP8" in n and "64x64" in n for n in meta["notes"]), meta["notes"]


def test_fp8_generates_as_transformers(fp8_gen):
    """A left-padded batch of three prompts: greedy tokens equal transformers', every step's logits within
    1e-4 of transformers', and the tokens varied (the model is not repeating one id)."""
    import graphconv

    src, _, gen = fp8_gen
    proc = _graphconv("generate", str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", str(NEW),
                      "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)["sequences"]
    want, ties, hf_logits = _hf_generate(src, PROMPTS, NEW, eos=2, pad=2)
    _match(got, want, ties)
    assert len({t for row in want for t in row}) >= 8, want
    api = graphconv.generate(gen, PROMPTS, NEW, check=True)
    worst = max(float(np.abs(step[r] - hf_logits[k][r]).max()) for k, step in enumerate(api.step_logits)
                for r in range(len(PROMPTS)) if k < len(want[r]) and (ties[r] is None or k < ties[r]))
    assert worst <= 1e-4, worst


def test_fp8_edge_blocks_follow_the_formula(tmp_path):
    """A weight the block size does not divide (DeepSeek-V3's 576 x 7168 with 128 blocks): each scale covers
    its block, the last blocks cut to the weight; checked against the formula applied here in numpy."""
    from graphconv.frontend import quantized_checkpoint as qc
    from graphconv.frontend import weightless_export as wl
    from safetensors.torch import save_file

    w = torch.randn(80, 100) * 0.1
    q, scale = _fp8_blocks(w, 32)  # scale grid 3 x 4
    save_file({"p.weight": q, "p.weight_scale_inv": scale, "n.weight": torch.ones(5)}, tmp_path / "m.safetensors")
    ckpt = qc.Fp8Checkpoint(wl.Checkpoint([tmp_path / "m.safetensors"]), qc.Fp8Blocks((32, 32), "dynamic"))
    assert sorted(ckpt.entries) == ["n.weight", "p.weight"] and ckpt.entries["p.weight"][1] == "F32"
    qf, s = q.float().numpy(), scale.numpy()
    want = np.array([[qf[i, j] * s[i // 32, j // 32] for j in range(100)] for i in range(80)], dtype=np.float32)
    assert np.array_equal(ckpt.tensor("p.weight").numpy(), want)
    assert np.array_equal(ckpt.tensor("n.weight").numpy(), np.ones(5, np.float32))


# --- hostile folders: one line, exit 1, nothing written -----------------------------------------------------------

def _tiny_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _refused(src: Path, tmp_path: Path, says: str) -> None:
    out = tmp_path / "out"
    proc = _graphconv("export", str(src), "-o", str(out), "--task", "text-generation")
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and says in line, line
    assert not out.exists() and not any(p.name.startswith(".graphconv") for p in tmp_path.iterdir())


@pytest.mark.parametrize("config, says", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "GPTQ checkpoint with format 'marlin': graphconv does not read this yet"),  # (gptq and gptq_v2 are read)
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ checkpoint with version 'gemv'"),  # (gemm is read)
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "config_groups is not a non-empty object"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' (bitsandbytes"),
    ({"load_in_8bit": True}, "quant_method 'bitsandbytes' (bitsandbytes"),
    ({"quant_method": "gguf"}, "quant_method 'gguf' (GGUF)"),
    ({"quant_method": "hqq"}, "quant_method 'hqq' (HQQ)"),
    ({"quant_method": "no-such-format"}, "'no-such-format' is a format graphconv does not know"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size [0, 128]"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ("not an object", "quantization_config is not an object"),
])
def test_a_format_not_read_is_one_line(tmp_path, config, says):
    src = _tiny_folder(tmp_path / "ckpt")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = config
    (src / "config.json").write_text(json.dumps(raw))
    _refused(src, tmp_path, says)


def test_msmodelslim_output_is_one_line(tmp_path):
    src = _tiny_folder(tmp_path / "ckpt")
    (src / "quant_model_description.json").write_text(json.dumps({"model_quant_type": "W8A8_DYNAMIC"}))
    _refused(src, tmp_path, "W8A8_DYNAMIC")  # (msModelSlim's W8A16, W4A16 and W8A8: tests/test_msmodelslim.py)


def _retype(path: Path, key: str, dtype: str, nbytes_per: float) -> None:
    """Rewrite one tensor's dtype in a .safetensors header, its bytes cut to what the new dtype takes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = bytearray(data[8 + n:])
    entry = header[key]
    begin, end = entry["data_offsets"]
    size = int(np.prod(entry["shape"]) * nbytes_per)
    entry["dtype"] = dtype
    blob = bytearray()
    offset = 0
    for k, e in sorted(((k, e) for k, e in header.items() if k != "__metadata__"), key=lambda x: x[1]["data_offsets"]):
        b, en = e["data_offsets"]
        chunk = body[b:en] if k != key else body[begin:begin + size]
        e["data_offsets"] = [offset, offset + len(chunk)]
        blob += chunk
        offset += len(chunk)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(blob))


@pytest.mark.parametrize("dtype, per, says", [
    ("F4", 0.5, "is stored as F4, which graphconv does not read"),
    ("F6_E2M3", 0.75, "is stored as F6_E2M3, which graphconv does not read"),
    ("F8_E4M3", 1, None),  # a plain float8 weight (no scale) reads as its values, as transformers reads it
])
def test_each_safetensors_dtype_is_read_or_refused(tmp_path, dtype, per, says):
    src = _tiny_folder(tmp_path / "ckpt")
    _retype(src / "model.safetensors", "model.layers.0.mlp.up_proj.weight", dtype, per)
    if says is not None:
        _refused(src, tmp_path, says)
        return
    proc = _graphconv("export", str(src), "-o", str(tmp_path / "out"), "--task", "text-generation", "-q")
    assert proc.returncode == 0, proc.stderr
