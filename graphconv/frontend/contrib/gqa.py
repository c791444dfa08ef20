"""com.microsoft GroupQueryAttention -> attention as a PyTorch export writes it (fuse-attention makes
mindspore::FlashAttentionScore of it, or FusedInferAttentionScore when the keys are a past cache Concat'ed with
the new ones; fuse-rope makes the do_rotary part mindspore::RotaryPositionEmbedding).

Semantics read from onnxruntime's schema (1.32) and its CPU kernel (contrib_ops/cpu/bert/
group_query_attention.cc, gqa_attention_base.h, group_query_attention_helper.h), per batch row b:
  query (B, S, N·H), or packed QKV (B, S, (N + 2·K)·H) when key/value are absent; key/value (B, S, K·H);
  past_key/past_value (B, K, P, H) (BNSH); seqlens_k[b] = T_b - 1 (T_b the row's total length);
  total_sequence_length the batch maximum of T_b.
  first prompt when S == total_sequence_length: the row's past length p_b = 0; else p_b = T_b - S.
  present (B, K, max(total_sequence_length, P), H): rows [0, p_b) of the past, the S new rows at [p_b, p_b + S),
  zeros after. Query row s sits at position p_b + s and attends the present rows q <= p_b + s (causal), and
  with local_window_size W > 0 only rows q > p_b + s - W (W keys, the row's own included: measured on 1.32;
  the older kernels' source keeps W + 1); query head n reads kv head n // (N / K).
  scores = scale · q·kᵀ (scale 0: 1/sqrt(H)); softcap c > 0: c·tanh(scores / c); softmax over the attended
  rows; smooth_softmax=1 / head_sink: one more logit (0, or head_sink[n]) in the softmax's denominator.
  do_rotary: q and the new k are rotated (rotary.py's semantics) at position p_b + s, cos/sin_cache
  (max_pos, R/2), rotary_interleaved the pair layout.
Written with the keys and values Concat(past, new) along the sequence axis (the spelling of a cache in every
decode-step export, which fuse-attention maps to FusedInferAttentionScore): key j of that concatenation sits at
position j (j < P) or p_b + j - P, and is attended when it is a valid past row (j < p_b) or a new one and the
causal (and window) condition holds: a Where(mask, scores, -inf) mask, so the attention computes exactly the
kernel's sum. present is that concatenation gathered into the kernel's layout (the identity when every row is
full, T_b = P + S, as for a generation loop without padding).
Right padding of a first prompt (T_b < S): onnxruntime's schema calls the padded rows s >= T_b unspecified; its
fp32 CPU kernel (1.32, measured) rotates them at position s and lets them attend the row's valid keys (those in
the window of position s; none: output 0), and so does the decomposition (the padded keys are in present,
rotated, as in the kernel). Its fp16 kernel gives other values there when a window is set.

position_ids (B, S) (transformers' exporter with OnnxConfig(ort_fusions=...) writes them): the positions q and the
new k are rotated at, position_ids[b, s], except for a first prompt, where the kernel reads position_ids[0, 0]
alone and rotates every row at position_ids[0, 0] + s (measured on 1.32; the schema says "uses only the first
element"). The causal mask, the window and the cache rows keep p_b + s.
attention_bias (B|1, N|1, S, total_sequence_length), the exporter's mask: added after the softcap, before the
causal mask; column = the key's absolute position (a GatherElements at kpos; bias[..., :L] when every row is full).
float32's lowest value counts as -inf: a row whose every key has it (a padded query row) gives 0, not
softmax's uniform row (measured; float16: NaN, as the kernel's).
float16 as the kernel does it where it matters: the softmax in float32 (a Cast island); q·kᵀ stays in float16
(the kernel's is float32: differences within fp16 tolerance, ~1e-3 measured).
Refused with the reason: opset < 13, quantized caches (k_scale/v_scale, quant types),
q/k_norm_weight, query_seqlens, the output_qk output or qk_output, causal=0, sliding_window_cache=1.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite
from graphconv.frontend.contrib.rotary import apply_rotary, ints, widen

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
INT64 = onnx.TensorProto.INT64
_REFUSED_INPUTS = {12: "k_scale", 13: "v_scale", 14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens"}


def _dim(rw: Rewrite, value: str, axis: int) -> str:
    """value.shape[axis] as a 1-element int64 tensor."""
    return rw.op("Slice", rw.op("Shape", value), ints(rw, axis), ints(rw, axis + 1))


def _range(rw: Rewrite, length: str) -> str:
    """0 .. length-1 for a 1-element int64 `length`."""
    return rw.op("Range", rw.const(np.int64(0)), rw.op("Squeeze", length, ints(rw, 0)), rw.const(np.int64(1)))


def _steps(rw: Rewrite, length: str) -> str:
    """0 .. length-1 as CumSum(ones(length)) - 1: shape inference then knows its size is `length` (Range's
    output gets a fresh symbol, and fuse-rope must prove cos/sin have the query's sequence length)."""
    ones = rw.op("ConstantOfShape", length, value=onnx.helper.make_tensor("one", INT64, [1], [1]))
    return rw.op("Sub", rw.op("CumSum", ones, rw.const(np.int64(0))), ints(rw, 1))


def _bnsh(rw: Rewrite, x: str, heads: int, head_size: int) -> str:
    return rw.op("Transpose", rw.op("Reshape", x, ints(rw, 0, 0, heads, head_size)), perm=[0, 2, 1, 3])


def _rotary_positions(rw: Rewrite, seq: str, total: str, qpos: str) -> str:
    """The positions q and the new k are rotated at, (B, S): p_b + s without position_ids; with them,
    position_ids[b, s], except for a first prompt (S == total_sequence_length), where the kernel reads only
    position_ids[0, 0] and rotates every row at position_ids[0, 0] + s (measured on onnxruntime 1.32, and its
    schema says so: "when processing the first prompt the kernel uses only the first element")."""
    if not rw.has(9):
        return qpos
    ids = rw.op("Cast", rw.input(9), to=INT64)
    first = rw.op("Slice", rw.op("Reshape", ids, ints(rw, -1)), ints(rw, 0), ints(rw, 1))  # (1,)
    from_first = rw.op("Add", rw.op("Unsqueeze", first, ints(rw, 1)), _steps(rw, seq))  # (1, S)
    positions = rw.op("Where", rw.op("Equal", seq, total), from_first, ids)
    # reshaped to the query's (B, S), read off its shape: shape inference then knows cos/sin have the query's batch
    # (an exporter's position_ids may reach here with a batch dim of its own symbol; fuse-rope must prove it)
    return rw.op("Reshape", positions, rw.op("Slice", rw.op("Shape", rw.input(0)), ints(rw, 0), ints(rw, 2)))


def _bias_at_key_positions(rw: Rewrite, query: str, kpos: str, length: str) -> str:
    """attention_bias (B|1, N|1, S, T), its last axis indexed by absolute key position, as (B, N|1, S, L) over
    the Concat(past, new) keys: column kpos[b, j] for key j (a gather, clipped for the keys the mask drops). When
    every row is full (T_b = P + S) kpos[b, j] = j and this is bias[..., :L]."""
    bias = rw.input(10)
    batch = _dim(rw, query, 0)
    bias = rw.op("Expand", bias, rw.op("Concat", batch, ints(rw, 1, 1, 1), axis=0))  # (B, N|1, S, T)
    columns = _dim(rw, bias, 3)
    col = rw.op("Max", rw.op("Min", kpos, rw.op("Sub", columns, ints(rw, 1))), ints(rw, 0))
    shape = rw.op("Concat", rw.op("Slice", rw.op("Shape", bias), ints(rw, 0), ints(rw, 3)), length, axis=0)
    index = rw.op("Expand", rw.op("Unsqueeze", col, ints(rw, 1, 2)), shape)
    return rw.op("GatherElements", bias, index, axis=3)


def _check(rw: Rewrite) -> None:
    if rw.opset < 13:
        rw.fail(f"the model's opset {rw.opset} < 13 (the decomposition writes Unsqueeze/Squeeze with axes inputs)")
    for i, name in _REFUSED_INPUTS.items():
        if rw.has(i):
            rw.fail(f"its {name} input is not decomposed")
    if rw.output(3):
        rw.fail("its output_qk output is read")
    if rw.attr("qk_output", 0):
        rw.fail(f"qk_output={rw.attr('qk_output')} is not decomposed")
    if rw.attr("causal", 1) != 1:
        rw.fail("causal=0 (bidirectional attention) is not decomposed")
    if rw.attr("sliding_window_cache", 0):
        rw.fail("sliding_window_cache=1 (a window-sized cache the kernel evicts from) is not decomposed")
    for q in ("k_quant_type", "v_quant_type"):
        if rw.attr(q, "NONE") != "NONE":
            rw.fail(f"{q}={rw.attr(q)} (a quantized KV cache) is not decomposed")
    if rw.has(3) != rw.has(4):
        rw.fail("past_key and past_value must be given together")
    if rw.has(1) != rw.has(2):
        rw.fail("key and value must be given together")


@decomposes("GroupQueryAttention", domain=MICROSOFT)
def group_query_attention(rw: Rewrite) -> None:
    _check(rw)
    query = rw.input(0)
    n, kvh = rw.attr("num_heads"), rw.attr("kv_num_heads")
    if not n or not kvh or n % kvh:
        rw.fail(f"num_heads {n} must be a multiple of kv_num_heads {kvh}")
    dtype = rw.dtype(query)
    if dtype not in (FLOAT, FLOAT16):
        rw.fail(f"query dtype {onnx.TensorProto.DataType.Name(dtype) if dtype else 'unknown'}: onnxruntime's CPU "
                "kernel takes float32 and float16")
    hidden = rw.static_dim(query, 2)
    packed = not rw.has(1)
    width = n + 2 * kvh if packed else n
    if hidden is None or hidden % width:
        rw.fail(f"query's last dim ({hidden}) must be static and a multiple of {width} heads")
    h = hidden // width
    np_dt = np.float32 if dtype == FLOAT else np.float16

    # q (B, N, S, H), k and v (B, K, S, H)
    if packed:
        x = rw.op("Reshape", query, ints(rw, 0, 0, width, h))
        parts = [rw.op("Slice", x, ints(rw, a), ints(rw, b), ints(rw, 2)) for a, b in
                 ((0, n), (n, n + kvh), (n + kvh, width))]
        q, k, v = (rw.op("Transpose", p, perm=[0, 2, 1, 3]) for p in parts)
    else:
        q, k, v = _bnsh(rw, query, n, h), _bnsh(rw, rw.input(1), kvh, h), _bnsh(rw, rw.input(2), kvh, h)

    # positions: p_b = 0 for a first prompt (S == total_sequence_length), else T_b - S; query row s at p_b + s
    seq = _dim(rw, query, 1)
    total = rw.op("Cast", rw.op("Reshape", rw.input(6), ints(rw, 1)), to=INT64)
    lens = rw.op("Add", rw.op("Cast", rw.input(5), to=INT64), ints(rw, 1))  # T_b, (B,)
    past_len = rw.op("Where", rw.op("Equal", seq, total), ints(rw, 0), rw.op("Sub", lens, seq))
    pb = rw.op("Unsqueeze", past_len, ints(rw, 1))  # (B, 1)
    qpos = rw.op("Add", pb, _steps(rw, seq))  # (B, S)

    if rw.attr("do_rotary", 0):
        cos_cache, sin_cache = rw.input(7), rw.input(8)
        rpos = _rotary_positions(rw, seq, total, qpos)
        half = rw.static_dim(cos_cache, 1)
        if not cos_cache or not sin_cache or half is None or 2 * half > h:
            rw.fail("do_rotary needs cos_cache/sin_cache of a static last dim <= head_size / 2")
        interleaved = bool(rw.attr("rotary_interleaved", 0))
        cos, sin = (rw.op("Unsqueeze", widen(rw, rw.op("Gather", c, rpos, axis=0), 2 * half, interleaved),
                          ints(rw, 1)) for c in (cos_cache, sin_cache))  # (B, 1, S, R)
        q = apply_rotary(rw, q, cos, sin, h, 2 * half, interleaved)
        k = apply_rotary(rw, k, cos, sin, h, 2 * half, interleaved)

    # keys/values: Concat(past, new); key j at position j (j < P) or p_b + j - P, valid when j < p_b or j >= P
    if rw.has(3):
        past = _dim(rw, rw.input(3), 2)
        keys = rw.op("Concat", rw.input(3), k, axis=2)
        values = rw.op("Concat", rw.input(4), v, axis=2)
    else:
        past, keys, values = ints(rw, 0), k, v
    length = rw.op("Add", past, seq)
    j = _range(rw, length)
    is_past = rw.op("Less", j, past)
    kpos = rw.op("Where", is_past, j, rw.op("Add", pb, rw.op("Sub", j, past)))  # (B, L)
    kvalid = rw.op("Or", rw.op("Less", j, pb), rw.op("Not", is_past))
    # a padded row of a first prompt (p_b + s >= T_b) attends like the row's last valid one (as the kernel does)
    last = rw.op("Min", qpos, rw.op("Sub", rw.op("Unsqueeze", lens, ints(rw, 1)), ints(rw, 1)))
    kpos4, q4 = rw.op("Unsqueeze", kpos, ints(rw, 1, 2)), rw.op("Unsqueeze", last, ints(rw, 1, 3))
    attend = rw.op("And", rw.op("Unsqueeze", kvalid, ints(rw, 1, 2)), rw.op("LessOrEqual", kpos4, q4))
    window = rw.attr("local_window_size", -1)
    if window > 0:  # the W positions up to the row's own (measured: onnxruntime 1.32 attends W keys, not W + 1)
        lowest = rw.op("Sub", rw.op("Unsqueeze", qpos, ints(rw, 1, 3)), ints(rw, window - 1))
        attend = rw.op("And", attend, rw.op("GreaterOrEqual", kpos4, lowest))

    # attention: GQA by repeating the kv heads (Unsqueeze, Expand, Reshape: transformers' repeat_kv)
    kr, vr = keys, values
    if n != kvh:
        kr, vr = (rw.op("Reshape", rw.op("Expand", rw.op("Unsqueeze", t, ints(rw, 2)), ints(rw, 1, 1, n // kvh, 1, 1)),
                        ints(rw, 0, n, -1, h)) for t in (keys, values))
    scale = rw.attr("scale", 0.0) or 1.0 / np.sqrt(np.float32(h))
    scores = rw.op("Mul", rw.op("MatMul", q, rw.op("Transpose", kr, perm=[0, 1, 3, 2])), rw.const(np_dt(scale)))
    softcap = rw.attr("softcap", 0.0)
    if softcap > 0:
        c = rw.const(np_dt(softcap))
        scores = rw.op("Mul", rw.op("Tanh", rw.op("Div", scores, c)), c)
    if rw.has(10):  # attention_bias, added after the softcap, read at each key's absolute position
        bias = _bias_at_key_positions(rw, query, kpos, length)
        inf = rw.const(np_dt(-np.inf))
        if dtype == FLOAT:  # float32's lowest is -inf to the kernel: a row whose every key has it gives 0 (measured)
            bias = rw.op("Where", rw.op("Equal", bias, rw.const(np.float32(np.finfo(np.float32).min))), inf, bias)
        masked = rw.op("Add", scores, rw.op("Where", attend, bias, inf))
    else:
        masked = rw.op("Where", attend, scores, rw.const(np_dt(-np.inf)))
    if dtype != FLOAT:  # the kernel's softmax is float32
        masked = rw.op("Cast", masked, to=FLOAT)
    sink = rw.input(11) if rw.has(11) else (rw.const(np.zeros(n, np_dt)) if rw.attr("smooth_softmax", 0) == 1 else "")
    if sink:  # one more logit per head in the denominator: Softmax over [scores, sink], the sink column dropped
        sink = rw.op("Reshape", sink, ints(rw, 1, n, 1, 1))
        if dtype != FLOAT:
            sink = rw.op("Cast", sink, to=FLOAT)
        col = rw.op("Expand", sink, rw.op("Concat", rw.op("Slice", rw.op("Shape", masked), ints(rw, 0), ints(rw, 3)),
                                          ints(rw, 1), axis=0))
        probs = rw.op("Softmax", rw.op("Concat", masked, col, axis=-1), axis=-1)
        probs = rw.op("Slice", probs, ints(rw, 0), rw.op("Add", past, seq), ints(rw, -1))
    else:
        probs = rw.op("Softmax", masked, axis=-1)
    if window > 0 or (rw.has(10) and dtype == FLOAT):  # a row with no key left gives 0 (the kernel's), not NaN
        # (float16 with a bias: NaN, as the kernel, measured)
        zero32 = rw.const(np.array(0, np.float32))  # (probs are float32 here)
        probs = rw.op("Where", rw.op("IsNaN", probs), zero32, probs)
    if dtype != FLOAT:
        probs = rw.op("Cast", probs, to=dtype)
    out = rw.op("Transpose", rw.op("MatMul", probs, vr), perm=[0, 2, 1, 3])
    rw.op("Reshape", out, ints(rw, 0, 0, n * h), outputs=[rw.output(0)])

    # present in the kernel's layout: row r is past row r (r < p_b), new row r - p_b (r < p_b + S), else 0
    if rw.output(1) or rw.output(2):
        rows = rw.op("Max", total, past)
        r = _range(rw, rows)
        src = rw.op("Where", rw.op("Less", r, pb), r, rw.op("Add", past, rw.op("Sub", r, pb)))  # (B, T)
        src = rw.op("Max", rw.op("Min", src, rw.op("Sub", length, ints(rw, 1))), ints(rw, 0))
        index = rw.op("Expand", rw.op("Unsqueeze", src, ints(rw, 1, 3)), ints(rw, 1, kvh, 1, h))
        kept = rw.op("Unsqueeze", rw.op("Less", r, rw.op("Add", pb, seq)), ints(rw, 1, 3))
        zero = rw.const(np_dt(0))
        for cache, out_name in ((keys, rw.output(1)), (values, rw.output(2))):
            if out_name:
                rw.op("Where", kept, rw.op("GatherElements", cache, index, axis=2), zero, outputs=[out_name])


def gqa_presents(model: onnx.ModelProto | None) -> dict[str, str]:
    """{past input: present output} of each com.microsoft GroupQueryAttention reading a graph-input cache in
    `model` (its inputs 3, 4 -> outputs 1, 2): the presents its decomposition gives, not as a Concat's output."""
    if model is None:
        return {}
    inputs = {vi.name for vi in model.graph.input}
    found = {}
    for node in model.graph.node:
        if (node.domain, node.op_type) == ("com.microsoft", "GroupQueryAttention"):
            found.update({node.input[i]: node.output[o] for i, o in ((3, 1), (4, 2))
                          if len(node.input) > i and node.input[i] in inputs and len(node.output) > o
                          and node.output[o]})
    return found
