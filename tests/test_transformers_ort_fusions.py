"""transformers' own exporter with onnxruntime fusions: `OnnxExporter` + `OnnxConfig(ort_fusions="cpu")`, the
option its docs give for onnxruntime. It writes com.microsoft GroupQueryAttention with position_ids and an
attention_bias (its mask), SkipSimplifiedLayerNormalization with outputs nothing reads, and in a multi-token
decode graph RotaryEmbedding; graphconv decomposes them on load (graphconv/frontend/contrib/) and re-fuses them.
A tiny LlamaForCausalLM (default settings but its sizes; save_pretrained then from_pretrained, as users do),
exported plainly and for generation, compiled through the CLI: the fused census is the one the module tree
implies, and the generation folder generates transformers' greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("transformers.exporters")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 17, 33, 70], [70, 33, 17, 9, 5], [5, 9, 17]]  # two lengths: run as two groups
NEW = 12
FUSED_ATTENTION = ("FlashAttentionScore", "FusedInferAttentionScore")


ARCHS = {"llama": "Llama", "qwen2": "Qwen2"}  # Qwen2: q/k/v biases, GroupQueryAttention's separate q, k, v


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a tiny checkpoint folder (2 layers, 4 heads over 2 kv heads), saved on first use."""
    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(f"ortf-{arch}") / "ckpt"
            config = getattr(tf, f"{ARCHS[arch]}Config")(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
            getattr(tf, f"{ARCHS[arch]}ForCausalLM")(config).save_pretrained(folder)
            made[arch] = folder
        return made[arch]

    return get


def _load(checkpoint: Path):
    return tf.AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def _sample():
    return {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])}


def expected_census(model) -> dict[str, int]:
    """What the architecture asks to fuse, from the PyTorch module tree: each *RMSNorm module, each attention
    module (its q and k rotated: two RoPE applications, the whole head as Llama's config has no partial rotary),
    each MLP with a gate and a SiLU activation (SwiGLU)."""
    modules = list(model.modules())
    attention = sum(type(m).__name__.endswith("Attention") for m in modules)
    assert getattr(model.config, "partial_rotary_factor", 1.0) in (None, 1.0)
    return {"RmsNorm": sum(type(m).__name__.endswith("RMSNorm") for m in modules),
            "attention": attention, "RotaryPositionEmbedding": 2 * attention,
            "Swiglu": sum(hasattr(m, "gate_proj") and type(getattr(m, "act_fn", None)).__name__ == "SiLUActivation"
                          for m in modules)}


def _census(report: dict) -> dict[str, int]:
    census = report["census"]
    return {"RmsNorm": census.get("RmsNorm", 0), "attention": sum(census.get(k, 0) for k in FUSED_ATTENTION),
            "RotaryPositionEmbedding": census.get("RotaryPositionEmbedding", 0), "Swiglu": census.get("Swiglu", 0)}


def _contrib_inputs(path: Path) -> dict[str, set[int]]:
    """Per contrib op type in the graph, the input positions some node of that type fills."""
    found: dict[str, set[int]] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        if n.domain == "com.microsoft" or n.op_type == "SimplifiedLayerNormalization":
            found.setdefault(n.op_type, set()).update(i for i, x in enumerate(n.input) if x)
    return found


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", *args], capture_output=True, text=True, cwd=ROOT)


def _hf_tokens(checkpoint: Path, prompts, new: int) -> list[list[int]]:
    """transformers' greedy generate, each prompt alone (no padding), exactly `new` tokens."""
    model = _load(checkpoint)
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_the_plain_export_compiles_fused_and_verifies(checkpoints, tmp_path, arch):
    """One graph (logits and the new cache): GroupQueryAttention reads position_ids (input 9) and its mask as
    attention_bias (input 10). The old code refused it: "its position_ids input is not decomposed"."""
    from transformers.exporters import OnnxConfig, OnnxExporter

    model = _load(checkpoints(arch))
    OnnxExporter().export(model, _sample(), OnnxConfig(dynamic=True, ort_fusions="cpu")).save_pretrained(tmp_path / "x")
    path = tmp_path / "x" / "model.onnx"
    ops = _contrib_inputs(path)
    assert {9, 10} <= ops["GroupQueryAttention"] and "SkipSimplifiedLayerNormalization" in ops
    proc = _cli("compile", str(path), "-o", str(tmp_path / "m.mindir"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "verified"
    want = expected_census(model)
    assert want == {"RmsNorm": 5, "attention": 2, "RotaryPositionEmbedding": 4, "Swiglu": 2}  # 2 layers
    assert _census(report) == want
    assert all(not c["refused"] for c in report["coverage"].values()), report["coverage"]
    load = next(s for s in report["stages"] if s["name"] == "load")
    decomposed = load["detail"]["onnxruntime_contrib_ops_decomposed"]
    assert decomposed == {"com.microsoft::GroupQueryAttention": 2, "com.microsoft::SkipSimplifiedLayerNormalization": 4,
                          "SimplifiedLayerNormalization": 1}
    worst = max(o["max_abs"] for c in report["validation"]["cases"] for o in c["outputs"])
    assert worst <= 1e-4, worst


@pytest.mark.slow
@pytest.mark.parametrize("arch, multi_token_decode", [("llama", False), ("llama", True), ("qwen2", False)])
def test_the_generation_folder_generates_transformers_tokens(checkpoints, tmp_path, arch, multi_token_decode):
    """export_for_generation: prefill.onnx and decode.onnx both with GroupQueryAttention (a multi-token decode
    graph: RotaryEmbedding and plain attention instead). `graphconv compile FOLDER -o GEN` verifies each graph
    with the census above (attention over the cache: FusedInferAttentionScore) and `graphconv generate GEN`
    gives transformers' greedy tokens. Prompts of one length run together: onnxruntime's GroupQueryAttention
    rotates every row of a first prompt at position_ids[0, 0] + s, so a left-padded row would be rotated
    elsewhere than in transformers."""
    from transformers.exporters import OnnxConfig, OnnxExporter

    checkpoint = checkpoints(arch)
    model = _load(checkpoint)
    folder = tmp_path / "exported"
    OnnxExporter().export_for_generation(model, _sample(), OnnxConfig(dynamic=True, ort_fusions="cpu"),
                                         multi_token_decode=multi_token_decode).save_pretrained(folder)
    assert {9, 10} <= _contrib_inputs(folder / "prefill.onnx")["GroupQueryAttention"]
    gen = tmp_path / "gen"
    proc = _cli("compile", str(folder), "-o", str(gen))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((gen / "report.json").read_text())
    assert report["status"] == "verified"
    want = expected_census(model)
    used = {report["steps"]["prefill"], report["steps"]["decode"]}
    assert used == ({"decode"} if multi_token_decode else {"prefill", "decode"})
    for g in used:
        graph = report["graphs"][g]
        assert _census(graph) == want, g
        worst = max(o["max_abs"] for c in graph["validation"]["cases"] for o in c["outputs"])
        assert worst <= 1e-4, (g, worst)
    if not multi_token_decode:
        assert report["graphs"]["decode"]["census"].get("FusedInferAttentionScore") == want["attention"]
    assert json.loads((gen / "generation.json").read_text())["prompt_padding"] == "none"
    ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    proc = _cli("generate", str(gen), "--input-ids", ids, "--max-new-tokens", str(NEW), "--check", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert all(s["argmax_match"] and s["max_abs"] <= 1e-4 for s in result["steps"])
    assert result["sequences"] == _hf_tokens(checkpoint, PROMPTS, NEW)
