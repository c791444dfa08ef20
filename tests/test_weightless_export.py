"""The checkpoint export that never holds the model's weights (graphconv/frontend/weightless_export.py):
traced with FakeTensor parameters, initializers read from the safetensors files when written.

Expected values come from transformers' own model loaded in fp32 from the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from test_hf_export import _export, _llama, _positions, _save  # noqa: E402

from graphconv.frontend import hf_export, weightless_export  # noqa: E402


def _logits(src: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=torch.from_numpy(_positions(mask)), use_cache=False).logits.numpy()


def _ort(path: Path, feed: dict) -> list:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feed.items() if k in names})


def test_bf16_checkpoint_keeps_bf16_weights_and_computes_in_fp32(tmp_path):
    """--dtype auto on a bf16 checkpoint: every float weight of the prefill is stored bf16 (half the bytes of
    fp32) and read through a Cast; the logits equal transformers' fp32 model of the same folder at a shape
    that is neither of the export's."""
    torch.manual_seed(0)
    src = _save(_llama().to(torch.bfloat16), tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = _export(src, out, "text-generation-with-past", "--dtype", "auto")
    assert proc.returncode == 0, proc.stderr
    gen = json.loads((out / "generation.json").read_text())
    assert gen["dtype"] == "bf16" and any("stored as bf16 with a Cast" in n for n in gen["notes"])
    model = onnx.load(str(out / "prefill.onnx"))
    weights = [t for t in model.graph.initializer if len(t.dims) == 2]
    # 2 layers x 7 matrices + embedding + lm_head
    assert len(weights) == 16 and {t.data_type for t in weights} == {onnx.TensorProto.BFLOAT16}
    casts = [n for n in model.graph.node if n.op_type == "Cast"
             and n.input[0] in {t.name for t in model.graph.initializer}]
    assert len(casts) >= 16
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 128, (3, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    got = _ort(out / "prefill.onnx", {"input_ids": ids, "attention_mask": mask, "position_ids": _positions(mask)})[0]
    ref = _logits(src, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 0.1


def test_a_model_too_large_to_check_whole_is_checked_on_its_first_layers(tmp_path, monkeypatch):
    """When the fp32 model does not fit twice in the memory share, the check runs on the architecture cut to
    2 layers with the checkpoint's weights; the whole model is never loaded (the only model transformers loads
    has 2 layers), and the written 3-layer graph, with its weights in external data, is still exact."""
    torch.manual_seed(0)
    src = _save(_llama(num_hidden_layers=3), tmp_path / "ckpt")
    monkeypatch.setattr(hf_export, "CHECK_MEMORY_SHARE", 0.0)
    monkeypatch.setattr(hf_export, "EXTERNAL_DATA_BYTES", 0)
    loaded = []
    load = hf_export._load_model

    def counting(folder, cls, config, task, notes):
        loaded.append(config.num_hidden_layers)
        return load(folder, cls, config, task, notes)

    monkeypatch.setattr(hf_export, "_load_model", counting)
    result = hf_export.export_checkpoint(src, tmp_path / "out", "text-generation")
    assert loaded == [2]
    checks = result.generation["graphs"]["model"]["checks"]
    assert len(checks) == 2 and all(c["ok"] and c["layers"] == "first 2 of 3" for c in checks)
    assert any("truncated to its first 2 of 3 layers" in n for n in result.generation["notes"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["generation.json", "model.onnx",
                                                                    "model.onnx.data"]
    ids = np.arange(30, dtype=np.int64).reshape(3, 10) % 128
    mask = np.ones_like(ids)
    got = _ort(tmp_path / "out" / "model.onnx", {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_allclose(got, _logits(src, ids, mask), atol=1e-4, rtol=0)


def test_a_parameter_the_checkpoint_does_not_hold_as_is_is_named(tmp_path):
    """plan() refuses a checkpoint whose tensor has another shape or name than the parameter (transformers
    would convert it at load): the export then loads the model instead, and the note names the parameter."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _llama()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"][:32].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    checkpoint = weightless_export.Checkpoint([tmp_path / "model.safetensors"])
    fake, _mode = weightless_export.fake_model(tf.LlamaForCausalLM, model.config, torch.float32)
    with pytest.raises(weightless_export.NotPlain, match=r"model.norm.weight stored as \[32\], the model's is \[64\]"):
        weightless_export.plan(fake, checkpoint)
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(weightless_export.NotPlain, match="model.norm.weight absent"):
        weightless_export.plan(fake, weightless_export.Checkpoint([tmp_path / "model.safetensors"]))
    keys = weightless_export.plan(fake, weightless_export.Checkpoint([_full(tmp_path, model)]))
    assert keys["lm_head.weight"] == "lm_head.weight" and len(keys) == 21


def _full(tmp_path: Path, model) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_bf16_weights_behind_casts_compile_to_dense_products(tmp_path):
    """The --dtype auto graph's weight Casts: each weight MatMul lowers to ops.dense on the weight stored
    [out, in] (graphconv.compiler.lowering.dense_weights; MindSpore CPU's matmul of a 3-D input by a 2-D weight
    copies the weight), 2 layers x 6 matrices (q, k, v, o, the merged gate/up of fuse-swiglu, down) + the LM
    head = 13 Dense, and the network verifies against onnxruntime."""
    from click.testing import CliRunner

    from graphconv.cli import cli
    from graphconv.verify import census

    torch.manual_seed(0)
    # (weights past graphconv.compiler.constant_fold.FOLD_MAX_ELEMENTS, so no Cast of one is folded)
    src = _save(_llama(tie_word_embeddings=False, hidden_size=256, intermediate_size=512, vocab_size=512)
                .to(torch.bfloat16), tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = _export(src, out, "text-generation", "--dtype", "auto")
    assert proc.returncode == 0, proc.stderr
    mindir, report = tmp_path / "m.mindir", tmp_path / "m.json"
    result = CliRunner().invoke(cli, ["compile", str(out / "model.onnx"), "-o", str(mindir), "--target", "cpu",
                                      "--report", str(report), "-q"])
    assert result.exit_code == 0, result.output
    done = json.loads(report.read_text())
    assert done["status"] == "verified"
    assert census.primitive_census(mindir).get("Dense") == 13 and done["fusions"]["fuse-swiglu"] == 2


def test_bf16_lm_head_cast_is_computed_in_the_epilogue_layer_streamed(tmp_path):
    """Layer-streamed, the LM head's weight Cast (outside every layer, read only after them) is computed in the
    epilogue (graphconv.compiler.layers._sink_into_epilogue): in the prologue it crossed the blocks stored [out, in]
    for ops.dense, and the block check compared it with the ONNX value's [in, out] (the 1.1B's exit 2). The norm
    weights are made distinct, as a trained checkpoint's are (a random init's all-ones norms are one
    deduplicated initializer that both layers read, and the layers do not group)."""
    from click.testing import CliRunner

    from graphconv.cli import cli

    torch.manual_seed(0)
    model = _llama(tie_word_embeddings=False, hidden_size=256, intermediate_size=512, vocab_size=512)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    src = _save(model.to(torch.bfloat16), tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = _export(src, out, "text-generation", "--dtype", "auto")
    assert proc.returncode == 0, proc.stderr
    report = tmp_path / "m.json"
    result = CliRunner().invoke(cli, ["compile", str(out / "model.onnx"), "-o", str(tmp_path / "m.mindir"),
                                      "--target", "cpu", "--layer-streamed", "--report", str(report), "-q",
                                      # (the residual stream compared at each boundary: one of 3,328 values
                                      # differed by 3.4e-4 from onnxruntime's fp32 sums, past 1e-4)
                                      "--atol", "1e-3", "--rtol", "1e-3"])
    assert result.exit_code == 0, result.output
    done = json.loads(report.read_text())
    assert done["status"] == "verified" and done["validation"]["mode"] == "layer-streamed"
    blocks = [b["block"] for b in done["validation"]["layer_streamed"]["blocks"]]
    assert blocks == ["prologue", "layers[0]", "layers[1]", "epilogue"], blocks
