"""GPTQ and AWQ checkpoints, written here as their tools lay them out, through export, compile and generate.

Each checkpoint is a tiny Llama saved in bf16 (as releases are), each `*_proj.weight` replaced by the format's
tensors: round-to-nearest min-max quantization per group (GPTQ's and AWQ's own quantizer formulas, without
their error correction, which changes which integers but not the layout), packed in plain numpy as the
formats document it, with the real tensor names and config.json's quantization_config as GPTQModel, AutoGPTQ
and AutoAWQ write it. The yardstick is a float32 LlamaForCausalLM whose weights are the format's formula
applied here to the integers before packing (W[n, k] = scale[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])), the
fp16 scales upcast to fp32; never graphconv's reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from models.hf import INITIALIZER_RANGE  # noqa: E402
from test_compressed_tensors import LINEARS, _generated, _graphconv, _hf_greedy, _mindir_params  # noqa: E402
from test_generate import NEW, PROMPTS, _match  # noqa: E402

GROUP = 64
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i of word j holds column 8 j + AWQ_ORDER[i]
SIZES = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 256 * 3)  # K * N summed over the 14 linears


# --- the formats, written out --------------------------------------------------------------------------------

def _quantize(w: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool, awq: bool = False):
    """w fp32 [K, N] (in, out) -> (q [K, N], fp16 scales [G, N], zeros [G, N]) by round-to-nearest min-max per
    group of the rows g_idx names: GPTQ's Quantizer (sym: zero 2^(bits-1)) or AWQ's pseudo_quantize_tensor."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = np.zeros((groups, w.shape[1]), np.float16)
    zeros = np.zeros((groups, w.shape[1]), np.int64)
    q = np.zeros(w.shape, np.int64)
    for gi in range(groups):
        rows = w[g_idx == gi]
        lo, hi = (rows.min(0), rows.max(0)) if awq else (np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0))
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / maxq).astype(np.float32)
        zero = np.full(scale.shape, (maxq + 1) // 2) if sym else np.clip(np.round(-lo / scale), 0, maxq)
        scales[gi], zeros[gi] = scale.astype(np.float16), zero
        q[g_idx == gi] = np.clip(np.round(rows / scale) + zero, 0, maxq)
    return q, scales, zeros


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] of `bits`-bit values -> int32 [R * bits / 32, C], packed along R as GPTQ packs: for bits dividing
    32, row 32 / bits * r + i at bit bits * i of word r; 3 bits as AutoGPTQ's pack loop runs them across
    three words (10 values, one split 2 + 1, 10, one split 1 + 2, 10)."""
    v = values.astype(np.uint64)
    out = []
    if 32 % bits == 0:
        per = 32 // bits
        for r in range(v.shape[0] // per):
            out.append(sum(v[per * r + i] << np.uint64(bits * i) for i in range(per)))
    else:
        assert bits == 3
        i = 0
        while i < v.shape[0]:
            w0 = sum(v[i + j] << np.uint64(3 * j) for j in range(10)) | (v[i + 10] << np.uint64(30))
            w1 = (v[i + 10] >> np.uint64(2)) | sum(v[i + 11 + j] << np.uint64(3 * j + 1) for j in range(10)) \
                | (v[i + 21] << np.uint64(31))
            w2 = (v[i + 21] >> np.uint64(1)) | sum(v[i + 22 + j] << np.uint64(3 * j + 2) for j in range(10))
            out += [w0, w1, w2]
            i += 32
    return (np.stack(out) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def _pack_awq(values: np.ndarray) -> np.ndarray:
    """[R, C] 4-bit -> int32 [R, C / 8] packed along C in AutoAWQ's order."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    word = np.zeros(v.shape[:2], np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        word |= v[..., col] << np.uint32(4 * i)
    return word.view(np.int32)


def _gptq_tensors(w: np.ndarray, bits: int, group: int, sym: bool, v1: bool, act_order: bool, seed: int):
    """One linear's GPTQ tensors and its reference weight [N, K] (the formula on the integers)."""
    k, n = w.shape
    g = k if group == -1 else group
    g_idx = np.arange(k) // g
    if act_order:  # (desc_act: rows quantized in a permuted order, group i is the permutation's i-th run of g)
        perm = np.random.default_rng(seed).permutation(k)
        g_idx = np.empty(k, np.int64)
        g_idx[perm] = np.arange(k) // g
    q, scales, zeros = _quantize(w, bits, g_idx, sym)
    stored = (zeros - 1) & ((1 << bits) - 1) if v1 else zeros
    tensors = {"qweight": _pack_rows(q, bits), "qzeros": _pack_rows(stored.T, bits).T.copy(),
               "scales": scales, "g_idx": g_idx.astype(np.int32)}
    ref = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)
    return tensors, ref.T


def _awq_tensors(w: np.ndarray, group: int, sym: bool = False):
    k, n = w.shape
    g_idx = np.arange(k) // group
    q, scales, zeros = _quantize(w, 4, g_idx, sym, awq=not sym)
    tensors = {"qweight": _pack_awq(q), "qzeros": _pack_awq(zeros), "scales": scales}
    ref = (q - zeros[g_idx]).astype(np.float32) * scales.astype(np.float32)[g_idx]
    return tensors, ref.T


def _config() -> tf.LlamaConfig:
    return tf.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          initializer_range=INITIALIZER_RANGE, bos_token_id=1, eos_token_id=2)


def _gptq_config(bits: int, group: int, sym: bool, v1: bool, act_order: bool) -> dict:
    if v1:  # (as AutoGPTQ writes it)
        return {"bits": bits, "group_size": group, "damp_percent": 0.01, "desc_act": act_order, "static_groups": False,
                "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
                "quant_method": "gptq", "checkpoint_format": "gptq"}
    return {"bits": bits, "group_size": group, "desc_act": act_order, "sym": sym, "lm_head": False,  # GPTQModel
            "damp_percent": 0.05, "true_sequential": True, "static_groups": False, "pack_dtype": "int32",
            "quant_method": "gptq", "format": "gptq_v2", "meta": {"quantizer": ["gptqmodel:4.0.0"]}}


AWQ_CONFIG = {"bits": 4, "group_size": GROUP, "modules_to_not_convert": None, "quant_method": "awq",
              "version": "gemm", "zero_point": True}


def save_quantized(folder: Path, kind: str, bits: int = 4, group: int = GROUP, sym: bool = True, v1: bool = True,
                   act_order: bool = False):
    """A tiny Llama saved in bf16, its linears replaced by `kind`'s ("gptq" | "awq") tensors; returns the folder
    and the float32 reference model."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tf.LlamaForCausalLM(_config()).to(torch.bfloat16).save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    state = {key: value.float() for key, value in stored.items()}
    for i, key in enumerate(sorted(k for k in list(stored) if k.endswith("_proj.weight"))):
        module = key.removesuffix(".weight")
        w = stored.pop(key).float().numpy().T  # [K, N]
        if kind == "gptq":
            tensors, ref = _gptq_tensors(w, bits, group, sym, v1, act_order, seed=i)
        else:
            tensors, ref = _awq_tensors(w, group)
        stored |= {f"{module}.{name}": torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}
        state[key] = torch.from_numpy(np.ascontiguousarray(ref))
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = AWQ_CONFIG if kind == "awq" else _gptq_config(bits, group, sym, v1, act_order)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    reference = tf.LlamaForCausalLM(_config())
    reference.load_state_dict(state, strict=True)
    return folder, reference.float().eval()


# --- end to end ----------------------------------------------------------------------------------------------

CASES = {
    "gptq-v1-sym4": dict(kind="gptq", bits=4, sym=True, v1=True),
    "awq-gemm": dict(kind="awq"),
    "gptq-v2-asym4": dict(kind="gptq", bits=4, sym=False, v1=False),
    "gptq-v1-sym8-channel": dict(kind="gptq", bits=8, group=-1, sym=True, v1=True),
    "gptq-act-order": dict(kind="gptq", bits=4, sym=True, v1=True, act_order=True),
    "gptq-v2-asym3": dict(kind="gptq", bits=3, sym=False, v1=False),
}
FAST = ("gptq-v1-sym4", "awq-gemm")
FULL_IN_CI = ("gptq-v1-sym4",)  # generation too; the other fast case is exported and compiled for ascend


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    if request.param not in FAST and not request.config.getoption("--runslow"):
        pytest.skip("slow: run with --runslow")
    case = CASES[request.param]
    base = tmp_path_factory.mktemp(request.param)
    src, reference = save_quantized(base / "ckpt", **case)
    export = _graphconv("export", str(src), "-o", str(base / "exp"), "-q")
    assert export.returncode == 0, export.stderr
    return request.param, case, src, reference, base


def test_the_export_keeps_the_integers_as_matmul_nbits(exported):
    """Each linear MatMulNBits can carry is one with the checkpoint's integers (no float copy of it); activation
    order and 3 bits stay in float, noted; onnxruntime equals the reference at a shape not exported."""
    import onnx
    import onnxruntime as ort

    name, case, src, reference, base = exported
    graph = onnx.load(str(base / "exp" / "prefill.onnx"))
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    in_float = case.get("act_order") or case.get("bits") == 3
    assert len(nbits) == (0 if in_float else LINEARS)
    notes = json.loads((base / "exp" / "generation.json").read_text())["notes"]
    says = ("activation order" if case.get("act_order") else "3-bit") if in_float else "14 MatMulNBits"
    assert any(says in line for line in notes), notes
    if not in_float:
        bits = case.get("bits", 4)
        assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {bits}
        asym = case["kind"] == "awq" or not case.get("sym", True)
        assert all(len(n.input) == (4 if asym else 3) for n in nbits)
        packed = sum(np.prod(t.dims) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.UINT8
                     and t.name.endswith("_B"))
        assert packed == SIZES * bits // 8
    ids = np.array([[5, 9, 17, 33, 65, 100, 3, 77, 12, 8, 1]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    got = ort.InferenceSession(str(base / "exp" / "prefill.onnx")).run(["logits"], feeds)[0]
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    diff = np.abs(got - want)
    cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    print(f"{name}: max abs {diff.max():.3g}, cosine {cosine:.9f}")
    assert diff.max() <= 1e-4 and cosine > 0.99999, (diff.max(), diff.mean(), cosine)


def test_generates_as_the_reference(exported, request):
    """A left-padded batch of three prompts on the cpu compile: greedy tokens equal the reference's, every step's
    logits within 1e-4, and the tokens varied."""
    import graphconv

    name, _, src, reference, base = exported
    if name not in FULL_IN_CI and not request.config.getoption("--runslow"):
        pytest.skip("slow: run with --runslow (its export and ascend compile run in every run)")
    gen = base / "gen"
    compiled = _graphconv("compile", str(base / "exp"), "-o", str(gen), "--target", "cpu", "-q")
    assert compiled.returncode == 0, compiled.stderr
    want, ties, logits = _hf_greedy(reference, PROMPTS, NEW)
    print(name, _match(_generated(gen, src), want, ties))
    assert len({t for row in want for t in row}) >= 8, want
    api = graphconv.generate(gen, PROMPTS, NEW, check=True)
    worst = max(float(np.abs(step[r] - logits[k][r]).max()) for k, step in enumerate(api.step_logits)
                for r in range(len(PROMPTS)) if k < len(want[r]) and (ties[r] is None or k < ties[r]))
    print(f"{name}: worst step logits {worst:.3g}")
    assert worst <= 1e-4, worst


def test_the_ascend_compile_runs_int4_weights_on_weight_quant_batch_matmul(exported):
    """The 4-bit folders kept quantized: 12 WeightQuantBatchMatmul in the ascend MindIR (gate/up merged per
    layer), no float copy of a quantized weight, QINT4X2 bytes exactly K * N / 2 summed."""
    name, case, _, _, base = exported
    if case.get("bits", 4) != 4 or case.get("act_order"):
        pytest.skip("not 4-bit MatMulNBits")
    out = base / "gen-ascend"
    compiled = _graphconv("compile", str(base / "exp"), "-o", str(out), "--target", "ascend", "-q")
    assert compiled.returncode == 0, compiled.stderr
    primitives = json.loads(_graphconv("inspect", str(out / "decode.mindir"), "--json").stdout)["primitives"]
    assert primitives["WeightQuantBatchMatmul"] == 12, primitives
    assert not {"MatMulExt", "MatMul", "BatchMatMul", "RightShift", "FloorDiv"} & set(primitives), primitives
    params = _mindir_params(out / "decode.mindir")
    assert sum(b for dtype, _, b in params.values() if dtype == "QINT4X2") == SIZES // 2
    floats = [dims for dtype, dims, _ in params.values() if dtype in ("FLOAT", "FLOAT16", "BFLOAT16")
              and len(dims) == 2 and min(dims) >= 64]
    assert sorted(floats) == [[128, 128], [128, 128]], floats  # embed_tokens and lm_head


# --- the reader against the packing, without an export ---------------------------------------------------------

class _Stored:
    """A checkpoint (the Checkpoint interface: entries, tensor) over numpy arrays."""

    DTYPES = {np.dtype(np.int32): "I32", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.entries = {k: (None, self.DTYPES[v.dtype], tuple(v.shape)) for k, v in arrays.items()}

    def tensor(self, key):
        return torch.from_numpy(np.ascontiguousarray(self.arrays[key]))


def _one(kind: str, config: dict, tensors: dict, module: str = "m"):
    from graphconv.frontend import gptq_awq

    scheme = gptq_awq.scheme(Path("config.json"), config, kind)
    return scheme.view(_Stored({f"{module}.{k}": v for k, v in tensors.items()}))


@pytest.mark.parametrize("bits, sym, v1, group, act_order", [
    (2, False, False, 32, False), (3, True, True, 32, False), (4, True, True, 32, False),
    (4, False, False, -1, False), (8, False, True, 16, False), (4, True, False, 32, True), (3, False, True, 16, True),
])
def test_gptq_reads_every_layout_exactly(bits, sym, v1, group, act_order):
    """The reader's weight equals the formula on the integers for each width (3 bits across words), both zero
    point conventions, per-column groups and activation order; MatMulNBits' refusal names why it stays float."""
    w = np.random.default_rng(bits).standard_normal((128, 64)).astype(np.float32)
    tensors, ref = _gptq_tensors(w, bits, group, sym, v1, act_order, seed=bits)
    view = _one("gptq", _gptq_config(bits, group, sym, v1, act_order), tensors)
    lin = view.linears["m.weight"]
    assert torch.equal(view.tensor("m.weight"), torch.from_numpy(np.ascontiguousarray(ref)))
    assert set(view.entries) == {"m.weight"}
    assert lin.zero_points == (not sym)
    why = lin.refusal()
    if act_order:
        assert "activation order" in why, why
    elif bits == 3:
        assert why.startswith("3-bit"), why
    else:
        assert why is None, why


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_reads_its_interleaved_columns(zero_point):
    """zero_point false: no qzeros, every zero point 8 (left out of MatMulNBits)."""
    w = np.random.default_rng(4).standard_normal((128, 64)).astype(np.float32)
    tensors, ref = _awq_tensors(w, 32, sym=not zero_point)
    if not zero_point:
        del tensors["qzeros"]
    view = _one("awq", AWQ_CONFIG | {"group_size": 32, "zero_point": zero_point}, tensors)
    assert torch.equal(view.tensor("m.weight"), torch.from_numpy(np.ascontiguousarray(ref)))
    assert view.linears["m.weight"].refusal() is None
    assert view.linears["m.weight"].zero_points == zero_point


def _gptq_v1(**change):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    tensors, _ = _gptq_tensors(w, 4, 32, True, True, False, seed=0)
    for k, v in change.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v(tensors[k])
    return tensors


@pytest.mark.parametrize("change, says", [
    (dict(qzeros=None), "m.qzeros is absent"),
    (dict(scales=None), "m.scales is absent"),
    (dict(qweight=lambda t: t[:-1]), "m.qweight is I32 [7, 32] (K=56 4-bit rows), m.g_idx has 64 rows"),
    (dict(qweight=lambda t: t.astype(np.float32)), "m.qweight is F32 [8, 32]: the format stores I32"),
    (dict(scales=lambda t: t[:, :-1]), "m.scales is F16 [2, 31]: the format stores F16 [2, 32]"),
    (dict(scales=lambda t: t.astype(np.int32)), "m.scales is I32 [2, 32]"),
    (dict(qzeros=lambda t: t[:1]), "m.qzeros is I32 [1, 4]: the format stores I32 [2, 4]"),
    (dict(g_idx=lambda t: t + 1), "m.g_idx holds groups outside 0..1"),
    (dict(g_idx=lambda t: t[:-1]), "m.g_idx has 63 rows: they disagree on K"),
    (dict(g_idx=lambda t: t.astype(np.float32)), "m.g_idx is F32 [64]: the format stores I32 of rank 1"),
    (dict(qzeros=lambda t: t | -1), "m.qzeros stores 15 in a gptq (v1) checkpoint"),
])
def test_a_malformed_tensor_is_one_line(change, says):
    from graphconv.errors import InputError

    with pytest.raises(InputError) as e:
        _one("gptq", _gptq_config(4, 32, True, True, False), _gptq_v1(**change))
    assert says in str(e.value) and "\n" not in str(e.value), e.value


def test_awq_scaled_activations_are_refused():
    from graphconv.errors import UnsupportedError

    w = np.random.default_rng(4).standard_normal((64, 32)).astype(np.float32)
    arrays = {f"m.{k}": v for k, v in _awq_tensors(w, 32)[0].items()}
    arrays["mlp.act.scales"] = np.ones(32, np.float16)
    from graphconv.frontend import gptq_awq

    with pytest.raises(UnsupportedError, match="mlp.act.scales has no qweight beside it"):
        gptq_awq.scheme(Path("config.json"), AWQ_CONFIG | {"group_size": 32}, "awq").view(_Stored(arrays))


@pytest.mark.parametrize("kind, change, says", [
    ("awq", {"version": "gemv"}, "AWQ checkpoint with version 'gemv'"),
    ("awq", {"version": "gemv_fast"}, "version 'gemv_fast'"),
    ("awq", {"version": None, "backend": "llm-awq"}, "version 'llm-awq'"),
    ("awq", {"bits": 8}, "8-bit weights"),
    ("gptq", {"bits": 5}, "GPTQ checkpoint with 5-bit weights"),
    ("gptq", {"checkpoint_format": "marlin"}, "format 'marlin'"),
    ("gptq", {"pack_dtype": "int16"}, "pack_dtype 'int16'"),
])
def test_each_layout_not_read_is_refused_by_name(kind, change, says):
    from graphconv.errors import UnsupportedError
    from graphconv.frontend import gptq_awq

    config = dict(AWQ_CONFIG if kind == "awq" else _gptq_config(4, 128, True, True, False)) | change
    with pytest.raises(UnsupportedError, match="graphconv does not read this yet") as e:
        gptq_awq.scheme(Path("config.json"), config, kind)
    assert says in str(e.value), e.value


@pytest.mark.parametrize("change, says", [
    ({"bits": "4"}, "quantization_config.bits '4' is not an integer"),
    ({"group_size": 0}, "group_size 0: expected a positive integer or -1"),
])
def test_a_malformed_config_is_an_input_error(change, says):
    from graphconv.errors import InputError
    from graphconv.frontend import gptq_awq

    with pytest.raises(InputError, match=says):
        gptq_awq.scheme(Path("config.json"), _gptq_config(4, 128, True, True, False) | change, "gptq")


def _no_scales(tensors):
    del tensors["model.layers.1.self_attn.o_proj.scales"]


def _short_qweight(tensors):  # (no g_idx to say K: the qweight gives K = 112, the model's is 128)
    module = "model.layers.1.mlp.gate_proj"
    tensors[f"{module}.qweight"] = tensors[f"{module}.qweight"][:-2].contiguous()
    del tensors[f"{module}.g_idx"]


@pytest.mark.parametrize("kind, change, says", [
    ("awq", _no_scales, "model.layers.1.self_attn.o_proj.scales is absent"),
    ("gptq", _short_qweight, "parameter model.layers.1.mlp.gate_proj.weight stored as [256, 112], the model's is "
                             "[256, 128] in the checkpoint: the quantized checkpoint does not fit LlamaForCausalLM"),
])
def test_the_cli_refuses_a_malformed_tensor_in_one_line(tmp_path, kind, change, says):
    from safetensors.torch import load_file, save_file

    src, _ = save_quantized(tmp_path / "ckpt", kind)
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = _graphconv("export", str(src), "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and says in line, line
    assert not out.exists() and not any(p.name.startswith(".graphconv") for p in tmp_path.iterdir())
