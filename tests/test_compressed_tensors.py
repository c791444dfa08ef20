"""compressed-tensors checkpoints as llm-compressor ships them, through export, compile and generate.

Each checkpoint is written by compressed-tensors itself: a tiny Llama saved in bf16 (as releases are), its
quantization config applied with the package's `apply_quantization_config`, round-to-nearest min-max scales
from its `calculate_qparams` (what llm-compressor's default observer computes), then its `ModelCompressor`
packs the weights and writes the config. The yardstick is the package's own decompression
(`PackedQuantizationCompressor.decompress`) of the same tensors, with the scales upcast to fp32 as transformers
does when it loads such a folder in fp32 (the symmetric folder is checked to load through transformers to the
same weights); never graphconv's reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from models.hf import INITIALIZER_RANGE  # noqa: E402
from test_generate import NEW, PROMPTS, TIE, _ids_arg, _match  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = 64
LINEARS = 14  # 7 per layer (q, k, v, o, gate, up, down), 2 layers; lm_head stays bf16 (the presets' ignore)


def _graphconv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", *args], capture_output=True, text=True, cwd=ROOT)


def _save_compressed(folder: Path, bits: int, symmetric: bool) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            initializer_range=INITIALIZER_RANGE, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data.reshape(module.weight.shape[0], -1, GROUP)
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


def _reference(folder: Path):
    """A float32 LlamaForCausalLM holding compressed-tensors' own decompression of the folder's weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    group = raw.pop("quantization_config")["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    stored = load_file(folder / "model.safetensors")
    state = {k: v.float() for k, v in stored.items() if not k.rsplit(".", 1)[1].startswith("weight_")}
    for key in [k for k in stored if k.endswith(".weight_packed")]:
        module = key.removesuffix(".weight_packed")
        local = {k[len(module) + 1:]: v for k, v in stored.items() if k.startswith(module + ".weight_")}
        local["weight_scale"] = local["weight_scale"].float()  # (as transformers loads it in fp32)
        state[module + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in raw.items() if k in tf.LlamaConfig().to_dict()}))
    model.load_state_dict(state, strict=True)
    return model.float().eval()


@pytest.fixture(scope="module", params=[(4, True), (4, False), (8, True)], ids=["w4a16", "w4a16-asym", "w8a16"])
def compressed(request, tmp_path_factory):
    bits, symmetric = request.param
    base = tmp_path_factory.mktemp(f"ct{bits}{'s' if symmetric else 'a'}")
    src = _save_compressed(base / "ckpt", bits, symmetric)
    export = _graphconv("export", str(src), "-o", str(base / "exp"), "-q")
    assert export.returncode == 0, export.stderr
    return bits, symmetric, src, base


def test_the_export_keeps_the_integers_as_matmul_nbits(compressed):
    """Every quantized linear is a MatMulNBits carrying the checkpoint's integers (no float copy of it), and
    onnxruntime on the written graph equals the package's decompressed model at a shape not exported."""
    import onnx
    import onnxruntime as ort

    bits, symmetric, src, base = compressed
    graph = onnx.load(str(base / "exp" / "prefill.onnx"))
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == LINEARS
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {bits}
    assert all(len(n.input) == (3 if symmetric else 4) for n in nbits)
    floats = [t for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
              and min(t.dims) >= GROUP]  # (the scales are [N, K / 64])
    assert sorted(tuple(t.dims) for t in floats) == [(128, 128), (128, 128)]  # embed_tokens and lm_head only
    packed = sum(np.prod(t.dims) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.UINT8
                 and t.name.endswith("_B"))
    assert packed == 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 256 * 3) * bits // 8
    ids = np.array([[5, 9, 17, 33, 65, 100, 3, 77, 12, 8, 1]], np.int64)
    mask = np.ones_like(ids)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(ids.shape[1])[None]}
    got = ort.InferenceSession(str(base / "exp" / "prefill.onnx")).run(["logits"], feeds)[0]
    with torch.no_grad():
        want = _reference(src)(input_ids=torch.from_numpy(ids)).logits.numpy()
    diff = np.abs(got - want)
    cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert diff.max() <= 1e-4 and cosine > 0.99999, (diff.max(), diff.mean(), cosine)


def test_transformers_loads_the_symmetric_folder_as_the_reference(compressed):
    """The yardstick is transformers' own load where it can load the folder (symmetric; its load of the
    asymmetric zero points fails in transformers 5.25 with compressed-tensors 0.20.1: a shape mismatch).
    transformers keeps the weights packed and decompresses them at the first forward: its logits equal the
    reference's."""
    bits, symmetric, src, _ = compressed
    if not symmetric:
        pytest.skip("transformers cannot load asymmetric pack-quantized zero points here")
    theirs = tf.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 17, 33, 65, 100, 3, 77]])
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=ids).logits, _reference(src)(input_ids=ids).logits)


def _generated(gen: Path, src: Path):
    proc = _graphconv("generate", str(gen), "--input-ids", _ids_arg(PROMPTS), "--max-new-tokens", str(NEW), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["sequences"]


def _hf_greedy(model, prompts, new: int, eos: int = 2, pad: int = 2):
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), pad, dtype=torch.int64)
    mask = torch.zeros((len(prompts), length), dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = torch.tensor(p)
        mask[r, length - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                             pad_token_id=pad, return_dict_in_generate=True, output_scores=True, output_logits=True)
    rows, ties = [], []
    for r in range(len(prompts)):
        row = out.sequences[r, length:].tolist()
        stop = next((k for k, t in enumerate(row) if t == eos), None)
        rows.append(row if stop is None else row[:stop + 1])
        gaps = [float(torch.topk(out.scores[k][r], 2).values.diff().abs()) for k in range(len(rows[-1]))]
        ties.append(next((k for k, g in enumerate(gaps) if g < TIE), None))
    return rows, ties, [x.numpy() for x in out.logits]


def test_generates_as_the_decompressed_model(compressed, request):
    """A left-padded batch of three prompts on the cpu compile: greedy tokens equal the package's
    decompressed model's, every step's logits within 1e-4, and the tokens varied. The 4-bit symmetric folder
    in every run, the others with --runslow."""
    import graphconv

    bits, symmetric, src, base = compressed
    if (bits, symmetric) != (4, True) and not request.config.getoption("--runslow"):
        pytest.skip("slow: run with --runslow")
    gen = base / "gen"
    compiled = _graphconv("compile", str(base / "exp"), "-o", str(gen), "--target", "cpu", "-q")
    assert compiled.returncode == 0, compiled.stderr
    want, ties, logits = _hf_greedy(_reference(src), PROMPTS, NEW)
    _match(_generated(gen, src), want, ties)
    assert len({t for row in want for t in row}) >= 8, want
    api = graphconv.generate(gen, PROMPTS, NEW, check=True)
    worst = max(float(np.abs(step[r] - logits[k][r]).max()) for k, step in enumerate(api.step_logits)
                for r in range(len(PROMPTS)) if k < len(want[r]) and (ties[r] is None or k < ties[r]))
    assert worst <= 1e-4, worst


def _mindir_params(mindir: Path) -> dict[str, tuple[str, list, int]]:
    from mindspore.train import mind_ir_pb2

    proto = mind_ir_pb2.ModelProto()
    proto.ParseFromString(mindir.read_bytes())
    name = mind_ir_pb2.TensorProto.DataType.Name
    return {p.name: (name(p.data_type), list(p.dims), len(p.raw_data)) for p in proto.graph.parameter}


def test_the_ascend_compile_runs_the_weights_on_weight_quant_batch_matmul(compressed):
    """The ascend MindIR: 12 WeightQuantBatchMatmul (14 linears, gate/up merged per layer as fuse-swiglu does),
    no float copy of a quantized weight, and its integer weights (QINT4X2 for 4 bits, INT8 for 8) exactly the
    checkpoint's weight_packed bytes: K * N * bits / 8 summed."""
    from safetensors import safe_open

    bits, _, src, base = compressed
    out = base / "gen-ascend"
    compiled = _graphconv("compile", str(base / "exp"), "-o", str(out), "--target", "ascend")
    assert compiled.returncode == 0, compiled.stderr
    inspect = _graphconv("inspect", str(out / "decode.mindir"), "--json")
    primitives = json.loads(inspect.stdout)["primitives"]
    assert primitives["WeightQuantBatchMatmul"] == 12, primitives
    assert not {"MatMulExt", "MatMul", "BatchMatMul", "RightShift", "FloorDiv"} & set(primitives), primitives
    params = _mindir_params(out / "decode.mindir")
    kind = {4: "QINT4X2", 8: "INT8"}[bits]
    integer = sum(b for dtype, _, b in params.values() if dtype == kind)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        packed = sum(f.get_tensor(k).numel() * 4 for k in f.keys() if k.endswith("weight_packed"))
    assert integer == packed == 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 256 * 3) * bits // 8
    floats = [dims for dtype, dims, _ in params.values() if dtype in ("FLOAT", "FLOAT16", "BFLOAT16")
              and len(dims) == 2 and min(dims) >= 64]
    assert sorted(floats) == [[128, 128], [128, 128]], floats  # embed_tokens and lm_head
    quantized = json.loads((out / "report.json").read_text())["graphs"]["decode"]["quantized_linears"]
    assert quantized["linears"] == quantized["on_low_bit_primitives"] == LINEARS and not quantized["fell_back"]
    assert quantized["primitives"] == {"WeightQuantBatchMatmul": 12}
    per = bits / 8
    assert quantized["integer_weight_bytes"] == packed and quantized["bytes_per_parameter"] == per
    assert f"{LINEARS}/{LINEARS} quantized linears on low-bit primitives, {per:g} weight bytes" in compiled.stdout


# --- what is not read: one line, exit 1, nothing written -----------------------------------------------------

def _with_config(src: Path, change) -> Path:
    raw = json.loads((src / "config.json").read_text())
    change(raw["quantization_config"])
    (src / "config.json").write_text(json.dumps(raw))
    return src


def _w8a8(q):
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                          "dynamic": True, "symmetric": True}


@pytest.mark.parametrize("change, says", [
    (_w8a8, "dynamic activations (config group 'group_0': W8A8 per token, no dynamic route yet)"),
    (lambda q: q["config_groups"]["group_0"].update(format="float-quantized"), "format 'float-quantized'"),
])
def test_what_is_not_read_is_one_line(tmp_path, change, says):
    src = _with_config(_save_compressed(tmp_path / "ckpt", 4, True), change)
    out = tmp_path / "out"
    proc = _graphconv("export", str(src), "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and says in line, line
    assert not out.exists() and not any(p.name.startswith(".graphconv") for p in tmp_path.iterdir())


@pytest.mark.parametrize("change, says", [
    (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "float weights"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "activation order 'group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(dynamic=True), "dynamic weight quantization"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "strategy 'block'"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "a quantized KV cache"),
    (lambda q: q.update(transform_config={"config_groups": {"u": {}}}), "transforms (rotations)"),
])
def test_each_scheme_not_read_is_refused_by_name(change, says):
    from graphconv.errors import UnsupportedError
    from graphconv.frontend import compressed_tensors

    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128}}}}
    change(config)
    with pytest.raises(UnsupportedError, match="graphconv does not read this yet") as e:
        compressed_tensors.scheme(Path("config.json"), config)
    assert says in str(e.value), e.value


@pytest.mark.parametrize("change, says", [
    (lambda q: q.update(config_groups={}), "config_groups is not a non-empty object"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=12), "num_bits 12"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=0), "group_size 0"),
    (lambda q: q["config_groups"]["group_0"].update(targets="Linear"), "targets is not a list of names"),
])
def test_a_malformed_config_is_an_input_error(change, says):
    from graphconv.errors import InputError
    from graphconv.frontend import compressed_tensors

    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128}}}}
    change(config)
    with pytest.raises(InputError, match=says):
        compressed_tensors.scheme(Path("config.json"), config)


def test_unpack_matches_the_package_for_every_width():
    """The dense int32 packing of every width 1..8 (3, 5, 6 and 7 bits straddle words) unpacks as the
    package's own unpack_from_int32 does."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from graphconv.frontend.compressed_tensors import unpack

    gen = torch.Generator().manual_seed(1)
    for bits in range(1, 9):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q = torch.randint(lo, hi + 1, (5, 72), generator=gen, dtype=torch.int8)
        packed = pack_to_int32(q, bits)
        want = unpack_from_int32(packed, bits, q.shape).numpy().astype(np.int16) + (1 << (bits - 1))
        assert np.array_equal(unpack(packed.numpy(), bits, 72), want), bits


def test_a_packed_weight_of_the_wrong_shape_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    src = _save_compressed(tmp_path / "ckpt", 4, True)
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight_packed"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    proc = _graphconv("export", str(src), "-o", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stderr
    assert "up_proj.weight_packed is I32 [256, 15]: the format stores I32 [256, 16]" in proc.stderr, proc.stderr
