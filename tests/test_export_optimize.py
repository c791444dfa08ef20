"""graphconv/frontend/optimize.py: the exporter's optimizer with the tiny epsilons a model adds kept.

onnxscript's no-op rules take a constant within 1e-8 of 0 for 0: Helium's RMSNorm epsilon (1e-8) was removed
from its export, the norm stayed unfused ("no epsilon is added to mean(x²)"), and a zero row became NaN."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from graphconv.frontend import optimize


def _norm(eps: float) -> ir.Model:
    """x / sqrt(mean(x²) + eps), as dynamo writes an RMSNorm."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
             helper.make_node("Constant", [], ["eps"], value=helper.make_tensor("e", TensorProto.FLOAT, [], [eps])),
             helper.make_node("Add", ["var", "eps"], ["var_eps"]),
             helper.make_node("Sqrt", ["var_eps"], ["rms"]), helper.make_node("Div", ["x", "rms"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                          [onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    return ir.from_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def _adds(model: ir.Model) -> list[float]:
    return [float(n.inputs[1].const_value.numpy()) for n in model.graph if n.op_type == "Add"]


@pytest.mark.parametrize("eps", [1e-8, 1e-9, 1e-12])
def test_a_tiny_epsilon_survives_the_optimizer_that_removes_it(eps):
    bare = _norm(eps)
    import onnxscript.optimizer

    onnxscript.optimizer.optimize_ir(bare)
    assert _adds(bare) == []  # (onnxscript's own: the epsilon is taken for 0)
    kept = _norm(eps)
    optimize.optimize_ir(kept)
    assert _adds(kept) == [pytest.approx(eps, rel=1e-6)]
    assert all(not n.domain for n in kept.graph) and "graphconv.pinned" not in kept.opset_imports
    import onnxruntime as ort

    session = ort.InferenceSession(ir.to_proto(kept).SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.zeros((2, 8), np.float32)})
    assert not np.isnan(y).any()  # (without the epsilon: 0 / 0)


def test_a_real_zero_is_still_removed():
    model = _norm(0.0)
    optimize.optimize_ir(model)
    assert _adds(model) == []


def _helium(folder):
    tf = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = tf.HeliumConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert config.rms_norm_eps == 1e-8
    tf.HeliumForCausalLM(config).eval().save_pretrained(folder)
    return folder


def test_the_exports_check_feeds_the_pad_id_where_the_mask_pads(tmp_path, monkeypatch):
    """The export's check against PyTorch puts the pad id at the padded positions, as generate does: with the
    epsilon dropped (onnxscript's own optimizer, simulated), Helium's zero pad embedding makes NaN, which
    reaches the valid rows through attention (0 x NaN), and the check refuses the export; random ids hid it."""
    from click.testing import CliRunner

    from graphconv.cli import cli

    src = _helium(tmp_path / "ckpt")
    monkeypatch.setattr(optimize, "tiny_epsilon_nodes", lambda graph: [])
    result = CliRunner().invoke(cli, ["export", str(src), "-o", str(tmp_path / "exp"), "--task", "text-generation",
                                      "-q"])
    assert result.exit_code == 1, result.output
    said = f"{result.output} {result.exception}"
    assert "disagrees with PyTorch" in said and "inf/NaN" in said, said
    assert not (tmp_path / "exp").exists()


def test_helium_exported_keeps_its_epsilon_and_fuses_every_norm(tmp_path):
    """transformers' Helium (rms_norm_eps 1e-8), saved by save_pretrained and exported by `graphconv export`:
    every RMSNorm of the architecture (2 layers x 2 + the final one = 5) fuses, and the network verifies."""
    from click.testing import CliRunner

    import graphconv
    from graphconv.cli import cli

    src = _helium(tmp_path / "ckpt")
    result = CliRunner().invoke(cli, ["export", str(src), "-o", str(tmp_path / "exp"), "--task",
                                      "text-generation", "-q"])
    assert result.exit_code == 0, result.output
    report = graphconv.compile(tmp_path / "exp" / "model.onnx", tmp_path / "m.mindir")
    norm = report.coverage["norm"]
    assert (norm["candidates"], norm["fused"]) == (5, 5) and report.status == "verified"
