"""Quantized models as onnxruntime's quantization tools write them, from small PyTorch models exported here:
quantize_dynamic (DynamicQuantizeLinear + MatMulInteger / ConvInteger), quantize_static in QDQ format
(per tensor and per channel), MatMulNBitsQuantizer (com.microsoft MatMulNBits, 4 bits, block 32, symmetric
and with zero points). Each compiles and verifies against onnxruntime, whose integer products the oracle
computes exactly (graphconv/verify/integer_products.py: onnxruntime's u8s8 kernel saturates on x86 without
VNNI, and quantize_dynamic's int8 weights with uint8 activations are such products). The QOperator format's
com.microsoft QLinearAdd / QGemm are refused with one line (not decomposed: onnxruntime's requantization rounding would
have to be mirrored bit for bit)."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
import torch

from graphconv.errors import UnsupportedError
from graphconv.frontend import contrib
from graphconv.frontend.contrib import quant
from graphconv.verify import reference
from tests.contrib_utils import compile_verified


def _import_ort_tool(module: str):
    """Import an onnxruntime tool module. onnxruntime.quantization reaches onnxruntime/transformers, which
    imports its own top-level `fusion_utils`, a name tests/fusion_utils.py takes on this path: its own folder
    goes first while it imports, and the tests' module is put back after."""
    import onnxruntime

    own = os.path.join(os.path.dirname(onnxruntime.__file__), "transformers")
    saved = sys.modules.pop("fusion_utils", None)
    sys.path.insert(0, own)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(own)
        sys.modules.pop("fusion_utils", None)
        if saved is not None:
            sys.modules["fusion_utils"] = saved


ortq = _import_ort_tool("onnxruntime.quantization")
nbits = _import_ort_tool("onnxruntime.quantization.matmul_nbits_quantizer")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def _export(tmp_path, kind: str):
    torch.manual_seed(0)
    m, x, dyn = ((MLP(), torch.randn(2, 5, 64), {"x": {0: "batch", 1: "seq"}}) if kind == "mlp"
                 else (CNN(), torch.randn(2, 3, 16, 16), {"x": {0: "batch"}}))
    path = tmp_path / f"{kind}.onnx"
    torch.onnx.export(m.eval(), (x,), path, input_names=["x"], output_names=["y"], dynamic_axes=dyn,
                      opset_version=17, dynamo=False)
    return path, x.shape


def _calibration(shape):
    class Reader(ortq.CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.data = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.data, None)

    return Reader()


def _ops(path) -> dict[str, int]:
    m = onnx.load(path)
    out: dict[str, int] = {}
    for n in m.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        out[key] = out.get(key, 0) + 1
    return out


EXACT = "computed exactly in int32 by the oracle (onnxruntime's u8s8 kernel can saturate on x86 without VNNI)"


@pytest.mark.parametrize("kind,products", [("mlp", "MatMulInteger (2 nodes)"),
                                           pytest.param("cnn", "ConvInteger (2 nodes), MatMulInteger (1 node)",
                                                        marks=pytest.mark.slow)])
def test_quantize_dynamic_compiles_and_verifies(tmp_path, kind, products):
    """uint8 activations times int8 weights: the oracle computes the products exactly and the report says so."""
    src, _ = _export(tmp_path, kind)
    dst = tmp_path / f"{kind}_dynamic.onnx"
    ortq.quantize_dynamic(src, dst)
    ops = _ops(dst)
    assert ops["DynamicQuantizeLinear"] >= 2 and ops["MatMulInteger"] >= 1
    weights = {t.name: t.data_type for t in onnx.load(dst).graph.initializer}
    assert {weights[n.input[1]] for n in onnx.load(dst).graph.node if n.op_type == "MatMulInteger"} == {
        onnx.TensorProto.INT8}
    report = compile_verified(onnx.load(dst), tmp_path, target="ascend")
    assert report.validation["oracle"] == "onnxruntime"
    assert report.validation["oracle_exact"] == f"{products} {EXACT}"
    assert f"    {products} {EXACT}" in report.summary().splitlines()


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_layer_by_layer_oracle_computes_the_integer_products_exactly(tmp_path, monkeypatch):
    """Layer-streamed verification: onnxruntime runs the model piece by piece (graphconv/verify/piecewise.py),
    each piece from the model with its integer products rewritten; no piece holds a MatMulInteger."""
    torch.manual_seed(0)
    torch.onnx.export(Stack().eval(), (torch.randn(2, 5, 64),), tmp_path / "stack.onnx", input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "seq"}}, opset_version=17, dynamo=False)
    ortq.quantize_dynamic(tmp_path / "stack.onnx", tmp_path / "stack_dynamic.onnx")
    handed = []
    session = reference.ort_session

    def spy(model):
        handed.append({n.op_type for n in onnx.load_from_string(model).graph.node})
        return session(model)

    monkeypatch.setattr(reference, "ort_session", spy)
    report = compile_verified(onnx.load(tmp_path / "stack_dynamic.onnx"), tmp_path, target="ascend",
                              layer_streamed=True)
    assert report.validation["oracle"] == "onnxruntime (layer by layer)"
    assert report.validation["oracle_exact"] == f"MatMulInteger (3 nodes) {EXACT}"
    blocks = [b["block"] for b in report.validation["layer_streamed"]["blocks"]]
    assert blocks[1:4] == ["layers.0", "layers.1", "layers.2"]
    # one piece per layer: the model computes nothing before its first layer or after its last
    assert len(handed) == 3 and not any("MatMulInteger" in ops for ops in handed)
    assert sum("MatMul" in ops for ops in handed) == 3  # one int32 MatMul in each layer's piece


@pytest.mark.parametrize("kind,per_channel", [("mlp", False), ("cnn", True),
                                              pytest.param("mlp", True, marks=pytest.mark.slow),
                                              pytest.param("cnn", False, marks=pytest.mark.slow)])
def test_quantize_static_qdq_compiles_and_verifies(tmp_path, kind, per_channel):
    src, shape = _export(tmp_path, kind)
    dst = tmp_path / f"{kind}_qdq.onnx"
    ortq.quantize_static(src, dst, _calibration(shape), quant_format=ortq.QuantFormat.QDQ, per_channel=per_channel)
    ops = _ops(dst)
    assert ops["QuantizeLinear"] >= 3 and ops["DequantizeLinear"] >= 6
    compile_verified(onnx.load(dst), tmp_path, target="ascend")


@pytest.mark.parametrize("symmetric", [pytest.param(True, marks=pytest.mark.slow), False])
def test_matmul_nbits_quantizer_output_compiles_and_verifies(tmp_path, symmetric):
    src, _ = _export(tmp_path, "mlp")
    q = nbits.MatMulNBitsQuantizer(onnx.load(src), block_size=32, is_symmetric=symmetric)
    q.process()
    m = q.model.model
    assert _ops_of(m) == {"com.microsoft::MatMulNBits": 2, "Add": 2, "Relu": 1}
    assert sum(len(n.input) > 3 and bool(n.input[3]) for n in m.graph.node) == (0 if symmetric else 2)
    report = compile_verified(m, tmp_path, target="ascend")
    load = next(s for s in report.stages if s.name == "load")
    assert load.detail["onnxruntime_contrib_ops_decomposed"] == {"com.microsoft::MatMulNBits": 2}
    assert len(load.detail["quantized_weights"]) == 2


def _ops_of(m: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in m.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        out[key] = out.get(key, 0) + 1
    return out


def test_qoperator_format_is_refused_in_one_line(tmp_path):
    src, shape = _export(tmp_path, "mlp")
    dst = tmp_path / "mlp_qop.onnx"
    ortq.quantize_static(src, dst, _calibration(shape), quant_format=ortq.QuantFormat.QOperator)
    with pytest.raises(UnsupportedError, match="com.microsoft::QLinearAdd") as e:
        contrib.decompose(onnx.load(dst))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_builder_int4_matmul_nbits_layer_decomposes_exactly(tmp_path):
    """onnxruntime-genai's model builder (int4, cpu) on a tiny random Llama: one MatMulNBits (accuracy_level 4)
    extracted with onnx.utils.Extractor. The decomposition equals onnxruntime at accuracy_level 0; level 4
    differs from it (int8 activations)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    import subprocess

    import onnxruntime as ort

    from graphconv.verify import compare

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "hf")
    from tokenizers import Tokenizer, models  # the builder saves the tokenizer too: a word-level one will do

    vocab = {f"t{i}": i for i in range(256)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1",
                                                     bos_token="t2")
    tokenizer.save_pretrained(tmp_path / "hf")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tmp_path / "hf"), "-o",
                    str(tmp_path / "int4"), "-p", "int4", "-e", "cpu", "-c", str(tmp_path / "cache")],
                   cwd=tmp_path, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    full = onnx.load(tmp_path / "int4" / "model.onnx")
    node = next(n for n in full.graph.node if n.op_type == "MatMulNBits" and "down_proj" in n.name)
    assert {a.name: a.i for a in node.attribute}["accuracy_level"] == 4
    sub = onnx.utils.Extractor(full).extract_model([node.input[0]], [node.output[0]])
    exact, levels = quant.at_accuracy_level_0(sub)
    assert levels == [4]
    decomposed, _ = contrib.decompose(sub)
    k = {a.name: a.i for a in node.attribute}["K"]
    x = np.random.default_rng(0).standard_normal((2, 7, k)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {node.input[0]: x})[0]

    y0 = run(exact)
    assert compare.compare(run(decomposed), y0, 1e-5, 1e-5).ok
    level4 = compare.compare(run(sub), y0)
    assert level4.max_abs > 0 and level4.cosine > 0.999
