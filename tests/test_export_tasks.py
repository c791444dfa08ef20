"""`graphconv export CKPT` without --task takes the task its config implies (`--task auto`); optimum's task names
that graphconv does not export yet are refused in one line that names them. Expected tasks come from the
architectures: transformers' own auto classes say which head a config's architecture is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tf = pytest.importorskip("transformers")
pytest.importorskip("torch")

from graphconv.frontend import hf_export, tasks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _config(cls, archs, **kw):
    config = cls(**kw)
    config.architectures = archs
    return config


@pytest.mark.parametrize("config, task", [
    (_config(tf.LlamaConfig, ["LlamaForCausalLM"], **SMALL), "text-generation-with-past"),
    (_config(tf.Qwen3NextConfig, ["Qwen3NextForCausalLM"], **SMALL), "text-generation"),  # linear attention
    (_config(tf.T5Config, ["T5ForConditionalGeneration"]), "text2text-generation-with-past"),
    (_config(tf.BartConfig, ["BartForConditionalGeneration"]), "text2text-generation-with-past"),
    (_config(tf.WhisperConfig, ["WhisperForConditionalGeneration"]), "automatic-speech-recognition"),
    (_config(tf.ViTConfig, ["ViTForImageClassification"]), "image-classification"),
    (_config(tf.Wav2Vec2Config, ["Wav2Vec2ForSequenceClassification"]), "audio-classification"),
    (_config(tf.Qwen2_5_VLConfig, ["Qwen2_5_VLForConditionalGeneration"]), "image-text-to-text"),
    (_config(tf.BertConfig, ["BertModel"]), "feature-extraction"),
    (_config(tf.BertConfig, ["BertForMaskedLM"]), "feature-extraction"),  # a masked LM: no causal head
])
def test_the_config_implies_the_task(config, task):
    assert tasks.infer(config, hf_export._with_past_refusal).name == task


def _export(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphconv", "export", *args], capture_output=True, text=True,
                          cwd=cwd, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_auto_exports_a_causal_lm_with_its_cache_and_says_so(tmp_path):
    import torch

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, num_key_value_heads=1, **SMALL)).save_pretrained(tmp_path / "ck")
    proc = _export("ck", "-o", "out", cwd=tmp_path)  # (relative paths, from another working directory)
    assert proc.returncode == 0, proc.stderr
    assert "generation.json (llama, text-generation-with-past)" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").glob("*.onnx")) == ["decode.onnx", "prefill.onnx"]


@pytest.mark.parametrize("kind, flags, says", [
    ("t5", (), "task text2text-generation-with-past (an encoder-decoder's text generation) is not exported"),
    ("t5", ("--task", "text2text-generation"), "task text2text-generation (an encoder-decoder's"),
    ("vit", (), "task image-classification (image classification) is not exported"),
    ("vit", ("--task", "feature-extraction"), "takes pixel_values"),
])
def test_a_task_not_exported_yet_is_one_line(tmp_path, kind, flags, says):
    import torch

    torch.manual_seed(0)
    if kind == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                                          vocab_size=64))
    else:
        model = tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=8, **SMALL))
    model.save_pretrained(tmp_path / "ck")
    proc = _export(str(tmp_path / "ck"), "-o", str(tmp_path / "out"), *flags, cwd=tmp_path)
    line = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in line and says in line, proc.stderr
    assert not (tmp_path / "out").exists()
