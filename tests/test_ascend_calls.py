"""The ascend network's attention calls, run: the emitted ascend source executed on MindSpore CPU with each
Ascend-only attention primitive replaced by a stand-in that computes its documented semantics (mindspore 2.10
docstrings: BNSD, kv heads repeated, (Q·Kᵀ + real_shift)·scale, a discard mask where 1 drops a key) and records
what it was given. So the arguments the device would see are checked at run time, at real shapes: the mask's
shape against the documented list, and no query row left with every key discarded (left padding makes such
rows in a prompt; the kernels leave them undefined, FusedInferAttentionScore's row-invalid correction is not
available at query length 1, and an undefined row reaches the valid ones through the next layer's P·V). The
network's logits then equal onnxruntime's at the valid positions, within fp16's tolerance (q/k/v are cast to
fp16 for the primitive)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphconv

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf_export import llama_with_past  # noqa: E402,F401  (a fixture)

STAND_IN = r'''
import json, sys
import numpy as np
import mindspore as ms
from mindspore import ops

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
seen = []


def _attend(q, k, v, discard, scale, kv_heads, real_shift=None):
    q, k, v = (x.astype(ms.float32) for x in (q, k, v))
    k, v = (ops.repeat_interleave(x, q.shape[1] // kv_heads, 1) for x in (k, v))
    scores = ops.matmul(q, k.swapaxes(-1, -2))
    if real_shift is not None:
        scores = scores + real_shift.astype(ms.float32)
    scores = scores * scale
    if discard is not None:
        drop = ops.broadcast_to(discard.astype(ms.bool_), scores.shape)
        seen[-1]["rows_all_discarded"] = int(ops.all(drop, -1).astype(ms.int32).sum())
        scores = ops.masked_fill(scores, drop, float("-inf"))
    return ops.matmul(ops.softmax(scores, -1), v)


def fused_infer_attention_score(query, key, value, *, atten_mask=None, num_heads=1, scale=1.0,
                                num_key_value_heads=0, **_):
    seen.append({"op": "FusedInferAttentionScore", "q": list(query.shape), "k": list(key.shape),
                 "mask": None if atten_mask is None else list(atten_mask.shape)})
    out = _attend(query, key, value, atten_mask, scale, num_key_value_heads or num_heads)
    return out.astype(query.dtype), None


def flash_attention_score(query, key, value, head_num, real_shift=None, attn_mask=None, scalar_value=1.0, **_):
    seen.append({"op": "FlashAttentionScore", "q": list(query.shape), "k": list(key.shape),
                 "mask": None if attn_mask is None else list(attn_mask.shape)})
    return _attend(query, key, value, attn_mask, scalar_value, key.shape[1], real_shift).astype(query.dtype)


ops.fused_infer_attention_score = fused_infer_attention_score
ops.flash_attention_score = flash_attention_score
src, feeds, out = sys.argv[1:4]
sys.path.insert(0, src)
import network

net = network.Network()
ms.load_param_into_net(net, ms.load_checkpoint(f"{src}/network.ckpt"))
with np.load(feeds) as z:
    outputs = net(*[ms.Tensor(z[name]) for name in json.loads(z["__order__"].item())])
outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
np.savez(out, *[o.asnumpy() for o in outputs])
print(json.dumps(seen))
'''


def _documented_mask_shapes(op: str, b: int, n1: int, s1: int, s2: int) -> list[list[int]]:
    """The attention mask shapes the 2.10 docstrings list (FusedInferAttentionScore: Q_S > 1 and Q_S = 1;
    FlashAttentionScore: (B, N1, S1, S2), (B, 1, S1, S2), (S1, S2))."""
    if op == "FlashAttentionScore":
        return [[b, n1, s1, s2], [b, 1, s1, s2], [s1, s2]]
    if s1 == 1:
        return [[b, s2], [b, 1, s2], [b, 1, 1, s2]]
    return [[s1, s2], [b, s1, s2], [1, s1, s2], [b, 1, s1, s2], [1, 1, s1, s2]]


def _run_ascend_source(path, feeds: dict, tmp_path) -> tuple[list[dict], list[np.ndarray]]:
    src = tmp_path / "src"
    # attention alone fused: the other fused primitives (RmsNorm, RotaryPositionEmbedding, ...) have no CPU kernel
    report = graphconv.compile(path, tmp_path / "m.mindir", emit_source=src, passes="fuse-attention")
    assert report.status == "verified", report.error
    script, feed_file, out_file = tmp_path / "stand_in.py", tmp_path / "feeds.npz", tmp_path / "out.npz"
    script.write_text(STAND_IN)
    order = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    np.savez(feed_file, __order__=json.dumps(order), **feeds)
    proc = subprocess.run([sys.executable, str(script), str(src), str(feed_file), str(out_file)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out_file) as z:
        outputs = [z[f"arr_{k}"] for k in range(len(z.files))]
    return json.loads(proc.stdout.strip().splitlines()[-1]), outputs


@pytest.mark.parametrize("graph", ["decode", "prefill"])
def test_left_padded_prompt_through_the_ascend_calls(graph, llama_with_past, tmp_path):  # noqa: F811 - the fixture
    """A prompt of two rows, the second left-padded by 3 (its first 3 query rows discard every key), through
    the decode graph at an empty cache (FusedInferAttentionScore) and the prefill (FlashAttentionScore)."""
    _, out, _ = llama_with_past
    path = out / f"{graph}.onnx"
    rng = np.random.default_rng(0)
    mask = np.array([[1] * 6, [0, 0, 0, 1, 1, 1]], np.int64)
    feeds = {"input_ids": rng.integers(3, 128, (2, 6)), "attention_mask": mask,
             "position_ids": np.clip(np.cumsum(mask, -1) - 1, 0, None)}
    inputs = {i.name: i for i in onnx.load(str(path), load_external_data=False).graph.input}
    for name in inputs:
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((2, 2, 0, 16), np.float32)
    feeds = {k: v for k, v in feeds.items() if k in inputs}
    seen, got = _run_ascend_source(path, feeds, tmp_path)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(seen) == 2 and {c["op"] for c in seen} == {"FusedInferAttentionScore" if graph == "decode"
                                                          else "FlashAttentionScore"}
    for call in seen:
        (b, n1, s1, _), s2 = call["q"], call["k"][2]
        assert call["mask"] in _documented_mask_shapes(call["op"], b, n1, s1, s2), call
        assert call["rows_all_discarded"] == 0, call
    valid = mask.astype(bool)
    logits, want_logits = got[0][valid], want[0][valid]
    assert np.isfinite(got[0]).all()
    np.testing.assert_allclose(logits, want_logits, atol=1e-2, rtol=1e-2)
