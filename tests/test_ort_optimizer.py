"""Real outputs of onnxruntime's transformers optimizer (onnxruntime.transformers.optimizer.optimize_model,
CPU, default opt_level) compile to fused MindIR and verify: its contrib ops are decomposed on load
(graphconv/frontend/contrib) into the spellings graphconv's fusions take.

Inputs: tiny transformers models exported by TorchScript (torch.onnx.export(dynamo=False), opset 17), and a
GPT-2 written the way transformers <= 3 wrote it (GPT2Attention with the uint8 `bias` buffer and
torch.where, Conv1D via addmm): the optimizer's GPT-2 attention fusion (fusion_gpt_attention_no_past.py)
matches that graph only; transformers 5's GPT2LMHeadModel keeps its eager Softmax attention (the
optimizer fuses only SkipLayerNormalization and FastGelu there). BERT needs attn_implementation="eager":
with transformers' default sdpa the optimizer fuses no Attention and no EmbedLayerNormalization.
LayerNorm weights and all biases are randomized: with the default init (ones, zeros) onnxsim folds the
affine away, and the optimizer's weight dedup hides which LayerNorm reads which weights.

Expected fusions from the architecture, per layer: 1 attention, 2 LayerNorms, 1 GELU, plus the embedding's
LayerNorm (BERT, old GPT-2) or the final ln_f (GPT-2): 2L + 1 LayerNorms.
"""

from __future__ import annotations

import collections
import math
import subprocess
import sys

import onnx
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
import graphconv  # noqa: E402

HIDDEN, HEADS, LAYERS, VOCAB = 32, 2, 2, 100  # head size 16: FlashAttentionScore's multiple of 16
MS = "com.microsoft"


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.4 - 0.2)
            elif "LayerNorm" in name or "ln_" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return module.eval()


class _Outputs(torch.nn.Module):
    """A transformers model called with keyword inputs, returning the named outputs as a tuple."""

    def __init__(self, model, inputs, outputs):
        super().__init__()
        self.model, self.inputs, self.outputs = model, inputs, outputs

    def forward(self, *args):
        out = self.model(**dict(zip(self.inputs, args)), use_cache=False, return_dict=True)
        return tuple(out[k] for k in self.outputs)


def _export(module, inputs: dict, outputs: list[str], path):
    torch.onnx.export(module, tuple(inputs.values()), str(path), input_names=list(inputs), output_names=outputs,
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in inputs}, opset_version=17, dynamo=False)
    return path


# The optimizer runs in a child: onnxruntime.transformers puts its own directory on sys.path and imports
# its modules by bare names (fusion_utils, ...), which collide with the test helpers' names.
_OPTIMIZE = """
import sys
from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.optimizer import optimize_model
src, out, model_type, variant, heads, hidden = sys.argv[1:]
options = FusionOptions(model_type)
if variant == "multi_head_attention":
    options.use_multi_head_attention = True
elif variant == "raw_mask":
    options.use_raw_attention_mask(True)
    options.enable_embed_layer_norm = False
optimize_model(src, model_type=model_type, num_heads=int(heads), hidden_size=int(hidden),
               optimization_options=options).save_model_to_file(out)
"""


def _optimize(src, model_type: str, variant: str = "default"):
    """onnxruntime.transformers.optimizer.optimize_model(src, model_type, num_heads, hidden_size), CPU,
    default opt_level; `variant` sets FusionOptions (multi_head_attention, raw_mask)."""
    out = src.with_name(src.stem + "_ort_optimized.onnx")
    subprocess.run([sys.executable, "-c", _OPTIMIZE, str(src), str(out), model_type, variant, str(HEADS),
                    str(HIDDEN)], check=True, capture_output=True)
    return out


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node if n.domain == MS)


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def bert_export(path, attn: str = "eager"):
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=64, attn_implementation=attn)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    model = _Outputs(_randomize(tf.BertModel(cfg)), names, ["last_hidden_state", "pooler_output"])
    inputs = {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.long),
              "token_type_ids": torch.zeros(2, 8, dtype=torch.long)}
    return _export(model, inputs, ["last_hidden_state", "pooler_output"], path)


def gpt2_export(path):
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                        attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    model = _Outputs(_randomize(tf.GPT2LMHeadModel(cfg)), names, ["logits"])
    return _export(model, {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.long)}, ["logits"], path)


# --- GPT-2 as transformers <= 3 wrote it (modeling_gpt2.py of that era, reduced to inference) ----------------

class _Conv1D(torch.nn.Module):
    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*size_out)


class _OldAttention(torch.nn.Module):
    def __init__(self, nx: int, n_ctx: int, n_head: int):
        super().__init__()
        self.n_head, self.split_size = n_head, nx
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.uint8)).view(1, 1, n_ctx, n_ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.c_attn, self.c_proj = _Conv1D(3 * nx, nx), _Conv1D(nx, nx)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k) / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd: ns, :ns]
        w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))
        return torch.matmul(torch.nn.Softmax(dim=-1)(w), v)

    def _split_heads(self, x, k: bool = False):
        x = x.view(*(x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)))
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        a = self._attn(self._split_heads(q), self._split_heads(k, k=True), self._split_heads(v)).permute(0, 2, 1, 3)
        a = a.contiguous()
        return self.c_proj(a.view(*(a.size()[:-2] + (a.size(-2) * a.size(-1),))))


class _OldBlock(torch.nn.Module):
    def __init__(self, nx: int, n_ctx: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(nx), torch.nn.LayerNorm(nx)
        self.attn = _OldAttention(nx, n_ctx, n_head)
        self.c_fc, self.c_proj = _Conv1D(4 * nx, nx), _Conv1D(nx, 4 * nx)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.c_fc(self.ln_2(x))
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * torch.pow(h, 3))))  # gelu_new
        return x + self.c_proj(h)


class OldGPT2(torch.nn.Module):
    def __init__(self, n_ctx: int = 64):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(n_ctx, HIDDEN)
        self.h = torch.nn.ModuleList([_OldBlock(HIDDEN, n_ctx, HEADS) for _ in range(LAYERS)])
        self.ln_f = torch.nn.LayerNorm(HIDDEN)

    def forward(self, input_ids):
        positions = torch.arange(0, input_ids.size(-1), dtype=torch.long).unsqueeze(0)
        h = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            h = block(h)
        return torch.matmul(self.ln_f(h), self.wte.weight.t())


def old_gpt2_export(path):
    torch.manual_seed(0)
    return _export(_randomize(OldGPT2()), {"input_ids": _ids()}, ["logits"], path)


# --- the tests --------------------------------------------------------------------------------------------

def _compile(path, tmp_path):
    report = graphconv.compile(path, tmp_path / (path.stem + ".mindir"), target="ascend")
    assert report.status == "verified", report.error
    return report


def _decomposed(report) -> dict:
    return next(s for s in report.stages if s.name == "load").detail["onnxruntime_contrib_ops_decomposed"]


def _max_abs(report) -> float:
    return max(o["max_abs"] for c in report.validation["cases"] for o in c["outputs"])


def _assert_fusions(report, attention: int, layernorm: int, gelu: int):
    got = {k: report.fusions.get(f"fuse-{k}") for k in ("attention", "layernorm", "gelu")}
    assert got == {"attention": attention, "layernorm": layernorm, "gelu": gelu}, report.coverage
    assert report.census.get("FlashAttentionScore") == attention


def test_bert_optimizer_output_compiles_fused_and_verifies(tmp_path):
    optimized = _optimize(bert_export(tmp_path / "bert.onnx"), "bert")
    assert _ops(optimized) == {"Attention": LAYERS, "SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS,
                               "EmbedLayerNormalization": 1}
    report = _compile(optimized, tmp_path)
    assert _decomposed(report) == {f"{MS}::Attention": 2, f"{MS}::SkipLayerNormalization": 4,
                                   f"{MS}::BiasGelu": 2, f"{MS}::EmbedLayerNormalization": 1}
    _assert_fusions(report, attention=LAYERS, layernorm=2 * LAYERS + 1, gelu=LAYERS)
    assert _max_abs(report) < 1e-4


def test_old_gpt2_optimizer_output_compiles_fused_and_verifies(tmp_path):
    optimized = _optimize(old_gpt2_export(tmp_path / "gpt2_old.onnx"), "gpt2")
    assert _ops(optimized) == {"Attention": LAYERS, "SkipLayerNormalization": 2 * LAYERS, "FastGelu": LAYERS,
                               "EmbedLayerNormalization": 1}
    attention = [n for n in onnx.load(str(optimized)).graph.node if n.op_type == "Attention"]
    assert all(onnx.helper.get_attribute_value(a) == 1 for n in attention for a in n.attribute
               if a.name == "unidirectional")
    report = _compile(optimized, tmp_path)
    _assert_fusions(report, attention=LAYERS, layernorm=2 * LAYERS + 1, gelu=LAYERS)
    assert _max_abs(report) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["multi_head_attention", "raw_mask"])
def test_bert_optimizer_variants_compile_fused_and_verify(tmp_path, variant):
    """MultiHeadAttention (use_multi_head_attention: separate Q/K/V MatMuls, bias and a 1-D mask_index in
    the op) and the 2-D raw attention mask without EmbedLayerNormalization."""
    expected = ({"MultiHeadAttention": LAYERS, "EmbedLayerNormalization": 1} if variant == "multi_head_attention"
                else {"Attention": LAYERS})
    optimized = _optimize(bert_export(tmp_path / "bert.onnx"), "bert", variant)
    assert _ops(optimized) == {**expected, "SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS}
    if variant == "raw_mask":
        attention = next(n for n in onnx.load(str(optimized)).graph.node if n.op_type == "Attention")
        assert attention.input[3]  # the (B, S) mask itself, cast to int32
    report = _compile(optimized, tmp_path)
    _assert_fusions(report, attention=LAYERS, layernorm=2 * LAYERS + 1, gelu=LAYERS)


@pytest.mark.slow
def test_transformers5_gpt2_optimizer_output_compiles_and_verifies(tmp_path):
    """transformers 5's GPT-2: the optimizer fuses its norms and GELUs, not its attention (its GPT-2
    patterns are transformers <= 4's); graphconv fuses the eager attention itself."""
    optimized = _optimize(gpt2_export(tmp_path / "gpt2.onnx"), "gpt2")
    assert _ops(optimized) == {"SkipLayerNormalization": 2 * LAYERS, "FastGelu": LAYERS}
    report = _compile(optimized, tmp_path)
    _assert_fusions(report, attention=LAYERS, layernorm=2 * LAYERS + 1, gelu=LAYERS)


@pytest.mark.slow
def test_bert_with_sdpa_gets_no_attention_fusion_from_the_optimizer(tmp_path):
    """Why the BERT tests export with attn_implementation="eager" (a fact about the optimizer)."""
    ops = _ops(_optimize(bert_export(tmp_path / "bert.onnx", attn="sdpa"), "bert"))
    assert "Attention" not in ops and "EmbedLayerNormalization" not in ops and ops["SkipLayerNormalization"] == 4
