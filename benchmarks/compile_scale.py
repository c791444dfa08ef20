#!/usr/bin/env python3
"""compile_scale: how graphconv's compile time and memory scale with a billion-parameter model.

What it does, in one run:

1. Builds a Llama-shaped decoder ONNX model (opset 18, input `input_ids` int64 [batch, seq], output `logits`
   float32 [batch, seq, vocab]) with onnx.helper only, spelled the way PyTorch's dynamo exporter spells it
   (decomposed RMSNorm, rotate_half RoPE, repeat_kv GQA, causal mask through Trilu/Where, SiLU as
   x * Sigmoid(x)), with a value_info (symbolic "batch"/"seq" shapes) for every intermediate value as
   dynamo writes, and each node's module stack as dynamo's `namespace` metadata (--scopes none: without it),
   so graphconv's fusion passes and layer grouping see what they see in real exports. The random weights
   (seeded; fp32, or fp16 with --dtype fp16, the graph then computing in fp16 as transformers' fp16 exports do;
   N(0, 0.02) matrices, o_proj/down_proj N(0, 0.02 / sqrt(2 * layers)) unless --init plain; norm gammas
   1 + N(0, 0.02) like a trained checkpoint, or ones with --gamma ones)
   are generated one tensor at a time and appended to `<workdir>/model/model.onnx.data`; the graph's
   initializers are external references to that file. Linear weights are stored pre-transposed
   ([in, out]) under state_dict-like names (lm_head.weight is [hidden, vocab]).
2. Measures, each in a fresh subprocess (wall time, and peak RSS two ways: the summed RSS of the child's
   process tree polled every 0.1 s, and ru_maxrss from wait4, i.e. the largest single process), each one's
   output deleted before the next, in this order (`measure_all`: the three the ratio compares first, before
   the two that take 5-13 GB of memory, whose release slows what follows on this VM):
   (a) the floor of any converter: read every weight byte once and write it once (64 MiB chunks, the pages
       dropped from the page cache as it goes, the output flushed to disk);
   (o) onnxruntime running the model on a compile's reference inputs one layer at a time
       (graphconv.verify.piecewise), what any verified conversion must at least run;
   (c) graphconv end to end: `python -m graphconv compile model.onnx -o ... --report ... -q` with its
       defaults (target ascend, onnxsim and verification on), and the peak RSS of each of its stages.
   The weight files are read once, untimed, between (a) and (o): (o) and (c) start with the weights in the
   page cache as far as it holds them.
   (a') MindSpore's own floor, where the weights fit in memory: build an nn.Cell holding Parameters of the
       same shapes and mindspore.export it as MINDIR (CPU, GRAPH_MODE);
   (b) onnxsim alone, where it fits: onnx.load + onnxsim.simplify(check_n=0), what users run before converting.
3. Prints a summary table and the ratios; deletes the workdir unless --keep.
4. With --from-transformers (needs torch, transformers and onnxscript), also exports a real model of the same
   shape and runs (a), (b), (c) on it, printing a second table: a transformers LlamaForCausalLM built from a
   LlamaConfig with the size's numbers and otherwise default settings (attention implementation left at its
   default, sdpa; use_cache off; tie_word_embeddings False; fp32, random init seeded with --seed, norm weights
   1 + N(0, 0.02) unless --gamma ones), exported by `torch.onnx.export(..., dynamo=True, opset_version=18,
   external_data=True)` with input `input_ids` (batch and seq dynamic) and output `logits`, in its own
   subprocess whose wall time and peak RSS are reported as "export" (killed past EXPORT_RSS_LIMIT or 90% of the
   memory available when it starts, whichever is lower). Its floor (a) is built from the export's own
   floating-point initializers (names, shapes, bytes read from the ONNX: external data in place, the few
   small inline ones copied to a side file); the weight bytes of its ratios are those initializers' bytes.

Targets (printed as PASS/MISS), issue 17's: wall(c) <= 2 x (wall(a) + wall(o)), and peak RSS(c) <= 4 GiB + the
largest layer's weights. Before it builds anything it checks for 2.2 x the weight bytes of free disk (the
model and one MindIR; graphconv writes its merged gate/up weights nowhere: they are made from their parts).

Run (from the repository root):

    .venv/bin/python benchmarks/compile_scale.py [--size small|default|7b] [--dtype fp32|fp16]
                                                 [--init scaled|plain] [--scopes dynamo|none] [--atol A --rtol R]
                                                 [--workdir DIR] [--keep] [--json] [--from-transformers]
    .venv/bin/python benchmarks/compile_scale.py --selfcheck   # tiny models: onnxruntime vs numpy

`--size small` (~100M parameters, ~0.4 GB of weights) takes about a minute; `--size default` (~1.1B
parameters, TinyLlama-1.1B's shape, 4.4 GB of fp32 weights) about 3 minutes; `--size 7b` (Llama-2-7B's
shape, 27 GB in fp32, 13.5 GB in fp16) about 10 minutes. `--atol/--rtol` are passed to graphconv compile.
`--size small --from-transformers` takes about 4 minutes on 2 cores (the export alone ~50 s).
Progress goes to stderr, the results to stdout. No torch anywhere, except in --from-transformers' export child.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA_FILE = "model.onnx.data"
ALIGN = 4096  # offsets of the weights in the data file (page aligned, as onnx's own writer does for big ones)
CHUNK = 64 * 2**20
WALL_TARGET = 2.0  # wall(c) / (wall(a) + wall(o)): the read-and-write floor plus onnxruntime layer by layer
RSS_BASE = 4 * 2**30  # peak RSS(c) <= RSS_BASE + the largest layer's weights
DISK_FACTOR = 2.2  # free disk needed: the model and one MindIR (x weights), and a margin
# (a') and (b) hold the weights in memory: run where this x the weights fits in 80 % of the available memory
MS_FLOOR_FACTOR, ONNXSIM_FACTOR = 1.5, 3.1  # (measured on the 1.1B: 1.25 and 3.1, plus a margin)
# --init scaled: these matrices are drawn with std 0.02 / sqrt(2 * layers), GPT-2's and Megatron-LM's init for
# the projections that add into the residual stream; it keeps that stream O(1) through 32 random layers (with
# 0.02 everywhere, --init plain, it grows with depth, and an fp16 model's values reach magnitudes where fp16's
# rounding alone exceeds the comparison rule's atol of 1e-2)
RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}  # --dtype: the weights' and the graph's
EXPORT_RSS_LIMIT = 20 * 2**30  # --from-transformers: the export child is killed past this (or 90% of available)
EXPORT_BATCH, EXPORT_SEQ = 2, 8  # the example input_ids of the export (both dims dynamic)


# ----------------------------------------------------------------------------------------------------------
# model configuration


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    eps: float = 1e-5
    theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weights(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, init) of every weight in file order; init is "normal" or "ones"."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h), "normal")]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,), "ones"),
                    (p + "self_attn.q_proj.weight", (h, h), "normal"),
                    (p + "self_attn.k_proj.weight", (h, kv), "normal"),
                    (p + "self_attn.v_proj.weight", (h, kv), "normal"),
                    (p + "self_attn.o_proj.weight", (h, h), "normal"),
                    (p + "post_attention_layernorm.weight", (h,), "ones"),
                    (p + "mlp.gate_proj.weight", (h, self.intermediate), "normal"),
                    (p + "mlp.up_proj.weight", (h, self.intermediate), "normal"),
                    (p + "mlp.down_proj.weight", (self.intermediate, h), "normal")]
        out += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (h, self.vocab), "normal")]
        return out

    def n_params(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.weights())

    def validate(self) -> None:
        if self.hidden % self.heads or self.head_dim % 2 or self.heads % self.kv_heads:
            raise SystemExit(f"compile_scale: inconsistent shape {self}: hidden must be a multiple of heads, "
                             "head_dim even, heads a multiple of kv_heads")


SIZES = {
    # TinyLlama-1.1B's shape: 1.10e9 parameters, 4.4 GB of fp32 weights.
    "default": Config(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4, vocab=32000),
    # 0.0995e9 parameters, 0.40 GB.
    "small": Config(hidden=768, layers=8, intermediate=2048, heads=12, kv_heads=4, vocab=32000),
    # Llama-2-7B's shape: 6.74e9 parameters, 27.0 GB in fp32, 13.5 GB in fp16.
    "7b": Config(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
}
# --selfcheck: a tiny shape with kv repeat 2 and one with kv repeat 3 (catches a swapped
# [kv_heads, n_rep] in the repeat_kv Expand, which kv_heads == n_rep would hide).
SELFCHECK = [Config(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=128),
             Config(hidden=96, layers=2, intermediate=160, heads=6, kv_heads=2, vocab=128)]


def log(msg: str) -> None:
    print(f"[compile_scale] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# building the ONNX model


class WeightWriter:
    """Appends one generated weight at a time to the data file; hands back external-reference TensorProtos."""

    def __init__(self, path: Path, seed: int, gamma: str = "ones", dtype: str = "fp32", residual_std: float = 0.02):
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.residual_std = residual_std  # std of the projections into the residual stream (o_proj, down_proj)
        self.dtype = DTYPES[dtype]  # numpy dtype written (values drawn in fp32, then rounded)
        self.rng = np.random.default_rng(seed)
        self.gamma = gamma  # "ones", or "random": 1 + N(0, 0.02)
        self.offset = 0
        self.manifest: list[dict] = []  # name, shape, offset, length

    def add(self, name: str, shape: tuple[int, ...], init: str):
        import onnx

        if init == "ones" and self.gamma == "ones":
            arr = np.ones(shape, np.float32)
        elif init == "ones":
            arr = self.rng.standard_normal(shape, dtype=np.float32)
            arr *= np.float32(0.02)
            arr += np.float32(1.0)
        else:
            arr = self.rng.standard_normal(shape, dtype=np.float32)
            arr *= np.float32(self.residual_std if name.endswith(RESIDUAL_PROJECTIONS) else 0.02)
        arr = arr.astype(self.dtype, copy=False)
        pad = -self.offset % ALIGN
        if pad:
            self.file.write(b"\0" * pad)
            self.offset += pad
        self.file.write(memoryview(arr).cast("B"))
        t = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), dims=shape,
                             data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", DATA_FILE), ("offset", str(self.offset)), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.manifest.append({"name": name, "shape": list(shape), "offset": self.offset, "length": arr.nbytes,
                              "dtype": arr.dtype.name})
        self.offset += arr.nbytes
        return t

    def close(self) -> None:
        self.file.close()


class GraphBuilder:
    """Nodes with unique output and node names, small constants stored inline, and a value_info entry
    (elem type and shape, symbolic dims "batch"/"seq") for every node output, as the dynamo exporter writes:
    without them shape inference cannot tell that Range(0, seq) has `seq` elements. Each node made while
    `scope` is set (the module stack, ": LlamaForCausalLM/model: LlamaModel/model.layers.0: LlamaDecoderLayer")
    carries it as dynamo's `namespace` metadata, which graphconv reads to find the layers (layers.record_scopes)."""

    def __init__(self, float_elem: int = 1):
        self.float_elem = float_elem  # the model's float type (TensorProto FLOAT or FLOAT16)
        self.nodes: list = []
        self.initializers: list = []
        self.value_info: list = []
        self._used: dict[str, int] = {}
        self.scope = ""

    def _fresh(self, hint: str) -> str:
        n = self._used.get(hint, 0)
        self._used[hint] = n + 1
        return hint if n == 0 else f"{hint}_{n}"

    def op(self, op_type: str, inputs: list[str], hint: str, shape: list, elem: int | None = None, output: str = "",
           **attrs) -> str:
        """Appends a node; `shape` and `elem` (TensorProto type, default the model's float type) describe its
        output; `output` names a graph output (no value_info then)."""
        from onnx import helper

        elem = self.float_elem if elem is None else elem
        out = output or self._fresh(hint)
        node = helper.make_node(op_type, inputs, [out], name=f"node_{out}", **attrs)
        if self.scope:
            helper.set_metadata_props(node, {"namespace": f"{self.scope}/{out}: aten.{op_type.lower()}"})
        self.nodes.append(node)
        if not output:
            self.value_info.append(helper.make_tensor_value_info(out, elem, shape))
        return out

    def const(self, hint: str, value) -> str:
        from onnx import numpy_helper

        name = self._fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def f32(value: float) -> np.ndarray:
    return np.array(value, np.float32)


def build_graph(cfg: Config, writer: WeightWriter):
    """The Llama decoder graph; weights come from `writer` in file order. In fp16 it is spelled as
    transformers' fp16 Llama exports: RMSNorm and softmax computed in fp32 between Casts, RoPE tables made in
    fp32 and cast (LlamaRMSNorm, eager_attention_forward, LlamaRotaryEmbedding)."""
    from onnx import TensorProto, helper

    INT64, BOOL, FP32 = TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT
    FT = helper.np_dtype_to_tensor_dtype(writer.dtype)  # the model's float type
    ft = writer.dtype
    low = FT != FP32
    B, S = "batch", "seq"
    g = GraphBuilder(FT)
    weights: list = []

    def weight(name: str, shape, init: str = "normal") -> str:
        weights.append(writer.add(name, tuple(shape), init))
        return name

    h, hd, half, inter = cfg.hidden, cfg.head_dim, cfg.head_dim // 2, cfg.intermediate
    n_heads, n_kv, n_rep = cfg.heads, cfg.kv_heads, cfg.heads // cfg.kv_heads

    # shared constants (dynamo exports one initializer per distinct value and reuses it)
    axis_last, ax1 = g.const("axes_last", i64(-1)), g.const("ax1", i64(1))
    ax2, ax01 = g.const("ax2", i64(2)), g.const("ax01", i64(0, 1))
    two, eps = g.const("two", f32(2.0)), g.const("eps", f32(cfg.eps))  # (RMSNorm runs in fp32)
    scale = g.const("scale", np.array(1.0 / math.sqrt(hd), ft))
    c_heads, c_kv, c_rep = g.const("n_heads", i64(n_heads)), g.const("n_kv", i64(n_kv)), g.const("n_rep", i64(n_rep))
    c_hd, c_hidden = g.const("head_dim", i64(hd)), g.const("hidden", i64(h))
    c_zero, c_half, c_one = g.const("s0", i64(0)), g.const("s_half", i64(half)), g.const("s1", i64(1))
    c_max = g.const("s_max", i64(2**63 - 1))

    top = ": LlamaForCausalLM/model: LlamaModel"
    g.scope = top
    # batch and seq at run time, read once from input_ids
    batch = g.op("Shape", ["input_ids"], "batch_1d", [1], INT64, start=0, end=1)
    seq = g.op("Shape", ["input_ids"], "seq_1d", [1], INT64, start=1, end=2)
    seq_scalar = g.op("Squeeze", [seq], "seq", [], INT64)

    # run-time shapes for the reshapes and the kv repeat
    q_shape = g.op("Concat", [batch, seq, c_heads, c_hd], "shape_q", [4], INT64, axis=0)
    kv_shape = g.op("Concat", [batch, seq, c_kv, c_hd], "shape_kv", [4], INT64, axis=0)
    expand_shape = g.op("Concat", [batch, c_kv, c_rep, seq, c_hd], "shape_kv_expand", [5], INT64, axis=0)
    rep_shape = g.op("Concat", [batch, c_heads, seq, c_hd], "shape_kv_repeated", [4], INT64, axis=0)
    out_shape = g.op("Concat", [batch, seq, c_hidden], "shape_attn_out", [3], INT64, axis=0)

    # RoPE tables, once: positions (Range) x inv_freq, cat(freqs, freqs), cos / sin as [1, 1, seq, head_dim]
    inv_freq = 1.0 / (cfg.theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    c_inv = g.const("inv_freq", inv_freq.astype(np.float32).reshape(1, half))
    start, step = g.const("range_start", np.array(0, np.int64)), g.const("range_step", np.array(1, np.int64))
    pos = g.op("Range", [start, seq_scalar, step], "arange", [S], INT64)
    pos = g.op("Cast", [pos], "arange_float", [S], FP32, to=FP32)
    pos = g.op("Unsqueeze", [pos, ax1], "positions", [S, 1], FP32)
    freqs = g.op("Mul", [pos, c_inv], "freqs", [S, half], FP32)
    emb = g.op("Concat", [freqs, freqs], "rope_emb", [S, hd], FP32, axis=-1)
    cos, sin = g.op("Cos", [emb], "cos_2d", [S, hd], FP32), g.op("Sin", [emb], "sin_2d", [S, hd], FP32)
    if low:
        cos, sin = g.op("Cast", [cos], "cos_low", [S, hd], to=FT), g.op("Cast", [sin], "sin_low", [S, hd], to=FT)
    cos = g.op("Unsqueeze", [cos, ax01], "cos", [1, 1, S, hd])
    sin = g.op("Unsqueeze", [sin, ax01], "sin", [1, 1, S, hd])

    # causal mask, once: Where(Trilu(ones[seq, seq], k=1) as bool, float32 min, 0) as [1, 1, seq, seq]
    mask_shape = g.op("Concat", [seq, seq], "shape_mask", [2], INT64, axis=0)
    ones = g.op("ConstantOfShape", [mask_shape], "mask_ones", [S, S],
                value=helper.make_tensor("one", FT, [1], [1.0]))
    upper = g.op("Trilu", [ones, c_one], "mask_upper", [S, S], upper=1)
    upper = g.op("Cast", [upper], "mask_bool", [S, S], BOOL, to=BOOL)
    fill, zero = g.const("mask_fill", np.array(np.finfo(ft).min, ft)), g.const("zero", np.array(0.0, ft))
    mask = g.op("Where", [upper, fill, zero], "mask_2d", [S, S])
    mask = g.op("Unsqueeze", [mask, ax01], "mask", [1, 1, S, S])

    def rmsnorm(x: str, gamma: str, tag: str) -> str:
        if low:
            x = g.op("Cast", [x], f"{tag}_fp32", [B, S, h], FP32, to=FP32)
        sq = g.op("Pow", [x, two], f"{tag}_pow", [B, S, h], FP32)
        var = g.op("ReduceMean", [sq, axis_last], f"{tag}_mean", [B, S, 1], FP32, keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, eps], f"{tag}_add_eps", [B, S, 1], FP32)], f"{tag}_sqrt", [B, S, 1], FP32)
        normed = g.op("Mul", [x, g.op("Reciprocal", [std], f"{tag}_rsqrt", [B, S, 1], FP32)], f"{tag}_normed",
                      [B, S, h], FP32)
        if low:
            normed = g.op("Cast", [normed], f"{tag}_normed_low", [B, S, h], to=FT)
        return g.op("Mul", [weight(gamma, (h,), "ones"), normed], f"{tag}_out", [B, S, h])

    def linear(x: str, name: str, n_in: int, n_out: int, tag: str) -> str:
        return g.op("MatMul", [x, weight(name, (n_in, n_out))], tag, [B, S, n_out])

    def heads_bnsd(x: str, shape: str, n: int, tag: str) -> str:
        x = g.op("Reshape", [x, shape], f"{tag}_bsnd", [B, S, n, hd], allowzero=1)
        return g.op("Transpose", [x], f"{tag}_bnsd", [B, n, S, hd], perm=[0, 2, 1, 3])

    def rope(x: str, n: int, tag: str) -> str:
        x1 = g.op("Slice", [x, c_zero, c_half, axis_last, c_one], f"{tag}_x1", [B, n, S, half])
        x2 = g.op("Slice", [x, c_half, c_max, axis_last, c_one], f"{tag}_x2", [B, n, S, half])
        neg = g.op("Neg", [x2], f"{tag}_neg_x2", [B, n, S, half])
        rotated = g.op("Concat", [neg, x1], f"{tag}_rotate_half", [B, n, S, hd], axis=-1)
        with_cos = g.op("Mul", [x, cos], f"{tag}_cos", [B, n, S, hd])
        with_sin = g.op("Mul", [rotated, sin], f"{tag}_sin", [B, n, S, hd])
        return g.op("Add", [with_cos, with_sin], f"{tag}_rope", [B, n, S, hd])

    def repeat_kv(x: str, tag: str) -> str:
        x = g.op("Unsqueeze", [x, ax2], f"{tag}_unsqueeze", [B, n_kv, 1, S, hd])
        x = g.op("Expand", [x, expand_shape], f"{tag}_expand", [B, n_kv, n_rep, S, hd])
        return g.op("Reshape", [x, rep_shape], f"{tag}_repeated", [B, n_heads, S, hd], allowzero=1)

    def attention(x: str, p: str, t: str) -> str:
        hs = rmsnorm(x, p + "input_layernorm.weight", f"{t}_input_norm")
        q = heads_bnsd(linear(hs, p + "self_attn.q_proj.weight", h, h, f"{t}_q_proj"), q_shape, n_heads, f"{t}_q")
        k = heads_bnsd(linear(hs, p + "self_attn.k_proj.weight", h, n_kv * hd, f"{t}_k_proj"), kv_shape, n_kv, f"{t}_k")
        v = heads_bnsd(linear(hs, p + "self_attn.v_proj.weight", h, n_kv * hd, f"{t}_v_proj"), kv_shape, n_kv, f"{t}_v")
        q, k = rope(q, n_heads, f"{t}_q"), rope(k, n_kv, f"{t}_k")
        k, v = repeat_kv(k, f"{t}_k"), repeat_kv(v, f"{t}_v")
        kt = g.op("Transpose", [k], f"{t}_k_t", [B, n_heads, hd, S], perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [q, kt], f"{t}_qk", [B, n_heads, S, S])
        scores = g.op("Mul", [scores, scale], f"{t}_scores", [B, n_heads, S, S])
        scores = g.op("Add", [scores, mask], f"{t}_masked", [B, n_heads, S, S])
        if low:
            scores = g.op("Cast", [scores], f"{t}_scores_fp32", [B, n_heads, S, S], FP32, to=FP32)
        probs = g.op("Softmax", [scores], f"{t}_probs", [B, n_heads, S, S], FP32 if low else FT, axis=-1)
        if low:
            probs = g.op("Cast", [probs], f"{t}_probs_low", [B, n_heads, S, S], to=FT)
        attn = g.op("MatMul", [probs, v], f"{t}_pv", [B, n_heads, S, hd])
        attn = g.op("Transpose", [attn], f"{t}_attn_bsnd", [B, S, n_heads, hd], perm=[0, 2, 1, 3])
        attn = g.op("Reshape", [attn, out_shape], f"{t}_attn", [B, S, h], allowzero=1)
        out = linear(attn, p + "self_attn.o_proj.weight", h, h, f"{t}_o_proj")
        return g.op("Add", [x, out], f"{t}_residual_attn", [B, S, h])

    def mlp(x: str, p: str, t: str) -> str:
        hs = rmsnorm(x, p + "post_attention_layernorm.weight", f"{t}_post_norm")
        gate = linear(hs, p + "mlp.gate_proj.weight", h, inter, f"{t}_gate_proj")
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{t}_sigmoid", [B, S, inter])], f"{t}_silu", [B, S, inter])
        up = linear(hs, p + "mlp.up_proj.weight", h, inter, f"{t}_up_proj")
        act = g.op("Mul", [silu, up], f"{t}_swiglu", [B, S, inter])
        down = linear(act, p + "mlp.down_proj.weight", inter, h, f"{t}_down_proj")
        return g.op("Add", [x, down], f"{t}_residual_mlp", [B, S, h])

    embed = weight("model.embed_tokens.weight", (cfg.vocab, h))
    g.scope = f"{top}/model.embed_tokens: Embedding"
    x = g.op("Gather", [embed, "input_ids"], "embedding", [B, S, h], axis=0)
    for i in range(cfg.layers):
        g.scope = f"{top}/model.layers.{i}: LlamaDecoderLayer"
        x = attention(x, f"model.layers.{i}.", f"l{i}")
        x = mlp(x, f"model.layers.{i}.", f"l{i}")
    g.scope = f"{top}/model.norm: LlamaRMSNorm"
    x = rmsnorm(x, "model.norm.weight", "final_norm")
    g.scope = ": LlamaForCausalLM/lm_head: Linear"
    g.op("MatMul", [x, weight("lm_head.weight", (h, cfg.vocab))], "lm_head", [B, S, cfg.vocab], output="logits")

    assert [w.name for w in weights] == [n for n, _, _ in cfg.weights()], "weights out of file order"
    return helper.make_graph(
        g.nodes, "llama_decoder",
        [helper.make_tensor_value_info("input_ids", INT64, [B, S])],
        [helper.make_tensor_value_info("logits", FT, [B, S, cfg.vocab])],
        initializer=weights + g.initializers, value_info=g.value_info)


def build_model(cfg: Config, model_dir: Path, seed: int, gamma: str = "ones",
                dtype: str = "fp32", init: str = "scaled", scopes: bool = True) -> tuple[Path, list[dict]]:
    """Writes model_dir/model.onnx and model_dir/model.onnx.data; returns the .onnx path and the weight
    manifest (name, shape, offset, length in the data file). scopes=False: no node carries dynamo's module
    stack (an exporter that writes none: graphconv then finds the layers by their weights alone)."""
    import onnx
    from onnx import helper

    model_dir.mkdir(parents=True, exist_ok=True)
    writer = WeightWriter(model_dir / DATA_FILE, seed, gamma, dtype,
                          0.02 / math.sqrt(2 * cfg.layers) if init == "scaled" else 0.02)
    try:
        graph = build_graph(cfg, writer)
        if not scopes:
            for node in graph.node:
                del node.metadata_props[:]
    finally:
        writer.close()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10,
                              producer_name="graphconv-benchmarks-compile_scale")
    path = model_dir / "model.onnx"
    onnx.save(model, str(path))  # initializers are already external references: only the graph is written
    onnx.checker.check_model(str(path))
    return path, writer.manifest


# ----------------------------------------------------------------------------------------------------------
# --selfcheck: the graph against a plain numpy Llama forward, with onnxruntime at two shapes


def read_weight(data_path: Path, entry: dict) -> np.ndarray:
    """One weight of the manifest, read from the data file in its stored dtype."""
    dtype = np.dtype(entry.get("dtype", "float32"))
    with open(data_path, "rb") as f:
        f.seek(entry["offset"])
        return np.fromfile(f, dtype, entry["length"] // dtype.itemsize).reshape(entry["shape"])


def load_weights(data_path: Path, manifest: list[dict]) -> dict[str, np.ndarray]:
    return {w["name"]: read_weight(data_path, w) for w in manifest}


def numpy_llama(cfg: Config, weight, ids: np.ndarray) -> np.ndarray:
    """Llama forward (transformers' LlamaForCausalLM, no cache, causal mask), in float64. `weight(name)` gives
    each weight (any float dtype; used in float64) when the forward reaches it, so that a 7B needs one layer's
    weights at a time."""
    def w_(name: str) -> np.ndarray:
        return np.asarray(weight(name), np.float64)

    b, s = ids.shape
    hd, half, n_rep = cfg.head_dim, cfg.head_dim // 2, cfg.heads // cfg.kv_heads
    inv_freq = 1.0 / (cfg.theta ** (np.arange(0, hd, 2) / hd))
    angles = np.arange(s)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((s, s), np.finfo(np.float32).min, np.float64), k=1)

    def rms(x, gamma):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * gamma

    def rotate_half(x):
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    def split(x, n):
        return x.reshape(b, s, n, hd).transpose(0, 2, 1, 3)

    x = w_("model.embed_tokens.weight")[ids]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        hs = rms(x, w_(p + "input_layernorm.weight"))
        q = split(hs @ w_(p + "self_attn.q_proj.weight"), cfg.heads)
        k = split(hs @ w_(p + "self_attn.k_proj.weight"), cfg.kv_heads)
        v = split(hs @ w_(p + "self_attn.v_proj.weight"), cfg.kv_heads)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_rep, axis=1), np.repeat(v, n_rep, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, cfg.hidden)
        x = x + attn @ w_(p + "self_attn.o_proj.weight")
        hs = rms(x, w_(p + "post_attention_layernorm.weight"))
        gate = hs @ w_(p + "mlp.gate_proj.weight")
        x = x + (gate / (1 + np.exp(-gate)) * (hs @ w_(p + "mlp.up_proj.weight"))) @ w_(p + "mlp.down_proj.weight")
    return rms(x, w_("model.norm.weight")) @ w_("lm_head.weight")


def all_values_as_outputs(path: Path, out_path: Path) -> dict[str, list]:
    """A copy of the model whose every value_info is also a graph output; returns name -> annotated dims."""
    import onnx

    model = onnx.load(str(path))  # tiny: weights loaded, the copy is self-contained
    annotated = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
                 for vi in model.graph.value_info}
    model.graph.output.extend(model.graph.value_info)
    onnx.save(model, str(out_path))
    return annotated


def selfcheck(seed: int) -> bool:
    """Tiny models: logits from onnxruntime against numpy_llama at two (batch, seq), and every value_info
    annotation against the shape onnxruntime computes."""
    import onnxruntime as ort

    ok = True
    with tempfile.TemporaryDirectory(prefix="compile_scale_selfcheck-") as tmp:
        for n, cfg in enumerate(SELFCHECK):
            gamma = ("ones", "random")[n % 2]  # random gammas: the gamma wiring is checked too
            path, manifest = build_model(cfg, Path(tmp) / f"tiny{n}", seed, gamma)
            weights = load_weights(path.parent / DATA_FILE, manifest)
            annotated = all_values_as_outputs(path, Path(tmp) / f"tiny{n}_all_outputs.onnx")
            sess = ort.InferenceSession(str(Path(tmp) / f"tiny{n}_all_outputs.onnx"),
                                        providers=["CPUExecutionProvider"])
            names = [o.name for o in sess.get_outputs()]
            rng = np.random.default_rng(seed + 1)
            for batch, seq in ((1, 7), (3, 13)):
                ids = rng.integers(0, cfg.vocab, (batch, seq), dtype=np.int64)
                values = dict(zip(names, sess.run(names, {"input_ids": ids})))
                got, want = values["logits"], numpy_llama(cfg, weights.__getitem__, ids)
                err = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
                good = got.shape == (batch, seq, cfg.vocab) and err <= 1e-5 * max(1.0, float(np.abs(want).max()))
                dims = {"batch": batch, "seq": seq}
                wrong = [f"{k} {list(values[k].shape)} != {v}" for k, v in annotated.items()
                         if list(values[k].shape) != [dims.get(d, d) for d in v]]
                ok &= good and not wrong
                print(f"selfcheck hidden {cfg.hidden} heads {cfg.heads}/{cfg.kv_heads} layers {cfg.layers} "
                      f"gamma {gamma} "
                      f"input [{batch}, {seq}]: logits {list(got.shape)}, max |ort - numpy| {err:.2e} "
                      f"(max |logit| {np.abs(want).max():.3f}), {len(annotated) - len(wrong)}/{len(annotated)} "
                      f"annotated shapes right {'ok' if good and not wrong else 'FAIL'}")
                for line in wrong[:10]:
                    print(f"  value_info wrong: {line}")
    print("selfcheck " + ("passed" if ok else "FAILED"))
    return ok


# ----------------------------------------------------------------------------------------------------------
# measuring a child process: wall time, peak RSS of its process tree, ru_maxrss


def tree_rss(proc) -> int:
    import psutil

    total = 0
    try:
        members = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], logs: Path, name: str, env: dict | None = None, rss_limit: int | None = None) -> dict:
    """Runs cmd with stdout/stderr to logs/<name>.out/.err; polls the summed RSS of its process tree every
    0.1 s; reaps it with wait4 for ru_maxrss (the largest single process of the tree). With `rss_limit`, a tree
    whose RSS goes past it is killed (result "rss_limit_exceeded": the limit)."""
    import psutil

    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{name}.out", logs / f"{name}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=REPO,
                                env={**os.environ, **(env or {})})
        ps = psutil.Process(proc.pid)
        peak, over, samples = 0, None, []
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                samples.append((time.time(), tree_rss(ps)))
                peak = max(peak, samples[-1][1])
                if rss_limit is not None and peak > rss_limit and over is None:
                    over = rss_limit
                    try:
                        members = ps.children(recursive=True) + [ps]
                    except psutil.Error:
                        members = [ps]
                    for member in members:
                        try:
                            member.kill()
                        except psutil.Error:
                            pass
                time.sleep(0.1)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = err_path.read_text(errors="replace").strip().splitlines()
    out = {"wall_s": wall, "peak_rss_tree_bytes": peak, "ru_maxrss_bytes": usage.ru_maxrss * 1024,
           "exit_code": proc.returncode, "stdout": out_path.read_text(errors="replace"),
           "stderr_tail": stderr[-1] if stderr else "", "samples": samples}
    if over is not None:
        out["rss_limit_exceeded"] = over
    return out


def child_result(m: dict) -> dict:
    """The JSON a child printed as its last stdout line ({} if none)."""
    for line in reversed(m["stdout"].strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# (a) -------------------------------------------------------------------------------------------------------


def child_floor(manifest_path: str, out_base: str) -> None:
    """Runs in the floor subprocess: read every byte, then Parameters from the file and mindspore.export.
    The manifest: {"data": file, "weights": [{name, shape, offset, length}, ...]}; a weight may name its own
    "file" and "dtype" (numpy name, default float32)."""
    spec = json.loads(Path(manifest_path).read_text())
    files = list(dict.fromkeys(w.get("file", spec.get("data")) for w in spec["weights"]))
    t0 = time.perf_counter()
    buf, total = bytearray(CHUNK), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    read_s = time.perf_counter() - t0

    import mindspore as ms
    from mindspore import nn, ops

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    t1 = time.perf_counter()
    params = []
    handles = {path: open(path, "rb") for path in files}  # noqa: SIM115 - closed in the finally below
    try:
        for w in spec["weights"]:
            f, dtype = handles[w.get("file", spec.get("data"))], np.dtype(w.get("dtype", "float32"))
            f.seek(w["offset"])
            arr = np.fromfile(f, dtype, w["length"] // dtype.itemsize).reshape(w["shape"])
            params.append(ms.Parameter(ms.Tensor(arr), name=w["name"]))
    finally:
        for f in handles.values():
            f.close()

    class Floor(nn.Cell):
        def __init__(self, ws):
            super().__init__()
            self.ws = ms.ParameterTuple(ws)

        def construct(self, x):
            for w in self.ws:
                x = x + ops.reshape(w, (-1,))[0]
            return x

    net = Floor(params)
    params_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    ms.export(net, ms.Tensor(np.zeros((1,), np.float32)), file_name=out_base, file_format="MINDIR")
    export_s = time.perf_counter() - t2
    print(json.dumps({"bytes_read": total, "read_s": read_s, "params_s": params_s, "export_s": export_s}))


def measure_all(work: Path, data_path: Path | None, manifest: list[dict], model_path: Path, keep: bool,
                what: str, compile_args: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each in a fresh subprocess, logged, each one's output deleted before the next: (a) the read-and-write
    floor, (o) onnxruntime running the model layer by layer, (c) graphconv compile, then (a') MindSpore's
    Cell + export floor and (b) onnxsim alone where they fit in memory.

    The three stages the ratio compares run first, back to back: (a') and (b) take 5.5 and 13 GB on the
    1.1B, and on this VM memory taken again after such a release is slow to come back (touching 13 GB right
    after (b) took 40.8 s; a compile right after it 26.6 s, against 17.8-20.0 s on its own). Before (o) the
    weight files are read once, untimed (`warm_page_cache`), so that (o) and (c) start with the weights in
    the page cache as far as it holds them, as (b)'s onnx.load left them when (b) ran before (o)."""
    weight_bytes = sum(w["length"] for w in manifest)
    available = _available_memory()
    out: dict[str, dict] = {}
    log(f"(a) floor{what}: read every weight byte once and write it once")
    out["a"] = measure_rw_floor(work, data_path, manifest)
    log(f"(a) {out['a']['wall_s']:.1f}s, peak RSS {mib(out['a']['peak_rss_tree_bytes'])}, exit {out['a']['exit_code']}")
    files = sorted({w.get("file") or str(data_path) for w in manifest if w.get("file") or data_path})
    warm_page_cache(files)
    log(f"(o) onnxruntime layer by layer{what}")
    cached = page_cached_bytes(files)
    out["o"] = measure_ort_layers(work, model_path)
    out["o"]["weights_in_page_cache_at_start"] = cached
    log(f"(o) {out['o']['wall_s']:.1f}s, peak RSS {mib(out['o']['peak_rss_tree_bytes'])}, exit {out['o']['exit_code']}")
    log(f"(c) graphconv compile{what}")
    cached = page_cached_bytes(files)
    out["c"] = measure_graphconv(work, model_path, compile_args)
    out["c"]["weights_in_page_cache_at_start"] = cached
    log(f"(c) {out['c']['wall_s']:.1f}s, peak RSS {mib(out['c']['peak_rss_tree_bytes'])}, exit {out['c']['exit_code']}")
    if not keep:
        shutil.rmtree(work / "out", ignore_errors=True)  # disk: one MindIR at a time
    if MS_FLOOR_FACTOR * weight_bytes <= 0.8 * available:
        log(f"(a') MindSpore's floor{what}: a Cell with the same Parameters, mindspore.export")
        out["a2"] = measure_floor(work, data_path, manifest, rss_limit=int(0.9 * available))
        log(f"(a') {out['a2']['wall_s']:.1f}s, peak RSS {mib(out['a2']['peak_rss_tree_bytes'])}, "
            f"exit {out['a2']['exit_code']}")
        if not keep:
            shutil.rmtree(work / "floor", ignore_errors=True)  # disk: one MindIR at a time
    else:
        out["a2"] = _skipped(f"needs ~{MS_FLOOR_FACTOR} x the weights = {mib(MS_FLOOR_FACTOR * weight_bytes)} "
                             "resident; "
                             f"{mib(available)} available")
    if ONNXSIM_FACTOR * weight_bytes <= 0.8 * available:
        log(f"(b) onnxsim alone{what}")
        out["b"] = measure_onnxsim(work, model_path, rss_limit=int(0.9 * available))
        log(f"(b) {out['b']['wall_s']:.1f}s, peak RSS {mib(out['b']['peak_rss_tree_bytes'])}, "
            f"exit {out['b']['exit_code']}")
    else:
        out["b"] = _skipped(f"needs ~{ONNXSIM_FACTOR} x the weights = {mib(ONNXSIM_FACTOR * weight_bytes)} resident; "
                            f"{mib(available)} available")
    return out


def warm_page_cache(paths: list[str]) -> None:
    """Read these files once (1 MiB at a time, nothing kept): as much of them as the page cache holds is in it
    afterwards. Untimed: (o) and (c) then start as they did when (b) ran before them (its onnx.load read every
    weight); (a) has dropped the pages it read."""
    buf = bytearray(2**20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def page_cached_bytes(paths: list[str]) -> int | None:
    """How many bytes of these files are in the page cache now (mincore over a read-only mapping of each;
    None where that cannot be asked): a weight read from the page cache costs no disk time."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
                if libc.mincore(address, size, vec) != 0:
                    return None
                total += min(size, sum(1 for v in vec if v & 1) * mmap.PAGESIZE)
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
    return total


def _skipped(why: str) -> dict:
    return {"skipped": why, "wall_s": None, "peak_rss_tree_bytes": None, "ru_maxrss_bytes": None, "exit_code": None}


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def child_rw(manifest_path: str, out_path: str) -> None:
    """Runs in the (a) subprocess: every weight byte read once and written once (64 MiB chunks, the output
    file flushed to disk at the end; each chunk's pages dropped from the page cache as it goes, so that the
    reads come from the disk as a converter's first read would)."""
    spec = json.loads(Path(manifest_path).read_text())
    files = list(dict.fromkeys(w.get("file", spec.get("data")) for w in spec["weights"]))
    t0 = time.perf_counter()
    buf, total = bytearray(CHUNK), 0
    with open(out_path, "wb", buffering=0) as out:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    out.write(memoryview(buf)[:n])
                    total += n
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.fsync(out.fileno())
    print(json.dumps({"bytes": total, "rw_s": time.perf_counter() - t0}))


def measure_rw_floor(work: Path, data_path: Path | None, manifest: list[dict]) -> dict:
    spec = work / "floor_manifest.json"
    spec.write_text(json.dumps({"data": str(data_path) if data_path else None, "weights": manifest}))
    target = work / "floor_copy.bin"
    m = measure([sys.executable, __file__, "--child", "rw", str(spec), str(target)], work / "logs", "rw")
    m.update(child_result(m))
    target.unlink(missing_ok=True)
    return m


def layer_boundaries(model) -> list[tuple[str, list[str]]]:
    """Where the layer-by-layer oracle cuts a model this generator built: after the embedding and after each
    layer's residual stream (build_graph names them), then the outputs."""
    made = {o for n in model.graph.node for o in n.output}
    layers = sorted(int(o[1:].split("_")[0]) for o in made if o.startswith("l") and o.endswith("_residual_mlp"))
    return [("prologue", ["embedding"])] + [(f"layer {k}", [f"l{k}_residual_mlp"]) for k in layers] + [("epilogue", [])]


def child_ort_layers(model_path: str) -> None:
    """Runs in the (o) subprocess: onnxruntime runs the model on the reference inputs a compile makes (two
    shapes), one layer at a time (graphconv.verify.piecewise: each layer's weights mapped only while it runs)."""
    sys.path.insert(0, str(REPO))
    from graphconv.frontend.load import load
    from graphconv.verify import piecewise, reference

    t0 = time.perf_counter()
    model = load(Path(model_path)).proto
    cases = reference.make_cases(model)
    pieces = piecewise.cut(model, layer_boundaries(model))
    t1 = time.perf_counter()
    _, _, rows = piecewise.run(model, pieces, cases)
    print(json.dumps({"load_s": t1 - t0, "run_s": time.perf_counter() - t1, "pieces": len(rows),
                      "largest_piece_bytes": max(r["weight_bytes"] for r in rows)}))


def measure_ort_layers(work: Path, model_path: Path) -> dict:
    m = measure([sys.executable, __file__, "--child", "ort_layers", str(model_path)], work / "logs", "ort_layers")
    m.update(child_result(m))
    return m


def measure_floor(work: Path, data_path: Path | None, manifest: list[dict], rss_limit: int | None = None) -> dict:
    spec = work / "floor_manifest.json"
    spec.write_text(json.dumps({"data": str(data_path) if data_path else None, "weights": manifest}))
    out = work / "floor"
    out.mkdir(exist_ok=True)
    m = measure([sys.executable, __file__, "--child", "floor", str(spec), str(out / "floor")],
                work / "logs", "floor", env={"GLOG_v": "3"},  # GLOG_v=3 as graphconv's export child
                rss_limit=rss_limit)
    m.update(child_result(m), output_bytes=dir_bytes(out))
    return m


# (b) -------------------------------------------------------------------------------------------------------


def child_onnxsim(model_path: str) -> None:
    sys.modules["torch"] = None  # onnxsim imports torch if it can; keep it out
    t0 = time.perf_counter()
    import onnx
    import onnxsim

    m = onnx.load(model_path)
    t1 = time.perf_counter()
    simplified, _ = onnxsim.simplify(m, check_n=0)
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "simplify_s": t2 - t1,
                      "nodes_before": len(m.graph.node), "nodes_after": len(simplified.graph.node)}))


def measure_onnxsim(work: Path, model_path: Path, rss_limit: int | None = None) -> dict:
    m = measure([sys.executable, __file__, "--child", "onnxsim", str(model_path)], work / "logs", "onnxsim",
                rss_limit=rss_limit)
    m.update(child_result(m))
    if m["exit_code"]:
        m["error"] = m["stderr_tail"] or f"exit code {m['exit_code']}"
    return m


# (c) -------------------------------------------------------------------------------------------------------


def measure_graphconv(work: Path, model_path: Path, extra: tuple[str, ...] = ()) -> dict:
    out = work / "out"
    out.mkdir(exist_ok=True)
    report_path = out / "report.json"
    cmd = [sys.executable, "-m", "graphconv", "compile", str(model_path), "-o", str(out / "model.mindir"),
           "--report", str(report_path), "-q", *extra]
    m = measure(cmd, work / "logs", "graphconv")
    m["command"] = " ".join(cmd)
    m["report"] = json.loads(report_path.read_text()) if report_path.exists() else None
    m["output_bytes"] = dir_bytes(out) - (report_path.stat().st_size if report_path.exists() else 0)
    if m["exit_code"]:
        m["error"] = (m["report"] or {}).get("error") or m["stderr_tail"]
    return m


# --from-transformers: the same shape as a transformers LlamaForCausalLM, exported by torch's dynamo exporter


def transformers_missing() -> list[str]:
    """The packages --from-transformers needs that are not installed (found without importing them)."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a broken install, or sys.modules[name] = None
            return True

    return [name for name in ("torch", "transformers", "onnxscript") if absent(name)]


def child_export(cfg_json: str, model_path: str, seed: str, gamma: str) -> None:
    """Runs in the export subprocess: LlamaForCausalLM from a LlamaConfig of the Config's numbers (defaults
    otherwise), random init, then torch.onnx.export(dynamo=True, opset 18, external data) to model_path."""
    import warnings

    t0 = time.perf_counter()
    import torch
    import transformers

    cfg = Config(**json.loads(cfg_json))
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        rms_norm_eps=cfg.eps, rope_parameters={"rope_type": "default", "rope_theta": cfg.theta},
        tie_word_embeddings=False, use_cache=False)
    import_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.manual_seed(int(seed))
    with torch.no_grad():  # no autograd state; the parameters are the only copy of the weights
        model = transformers.LlamaForCausalLM(config).eval()
        if gamma == "random":
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.weight.normal_(1.0, 0.02)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    build_s = time.perf_counter() - t1
    n_params = sum(p.numel() for p in model.parameters())
    input_ids = torch.randint(0, cfg.vocab, (EXPORT_BATCH, EXPORT_SEQ), generator=torch.Generator().manual_seed(1))
    t2 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (input_ids,), model_path, dynamo=True, opset_version=18,
                          dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}},
                          input_names=["input_ids"], output_names=["logits"], external_data=True)
    export_s = time.perf_counter() - t2
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "attn_implementation": model.config._attn_implementation, "dtypes": dtypes,
                      "torch_params": n_params, "import_s": import_s, "build_s": build_s, "export_s": export_s}))


def measure_export(work: Path, cfg: Config, seed: int, gamma: str) -> tuple[Path, dict]:
    import psutil

    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "model.onnx"
    limit = min(EXPORT_RSS_LIMIT, int(0.9 * psutil.virtual_memory().available))
    m = measure([sys.executable, __file__, "--child", "export", json.dumps(dataclasses.asdict(cfg)), str(path),
                 str(seed), gamma], work / "logs", "export", rss_limit=limit)
    m.update(child_result(m), rss_limit=limit, output_bytes=dir_bytes(model_dir))
    if m.get("rss_limit_exceeded"):
        m["error"] = (f"export killed: its process tree went past {mib(limit)} of RSS (the limit: "
                      f"min({mib(EXPORT_RSS_LIMIT)}, 90% of the memory available when it started))")
    elif m["exit_code"] < 0:
        m["error"] = (f"export killed by signal {-m['exit_code']} (out of memory?); "
                      f"peak RSS {mib(m['peak_rss_tree_bytes'])}")
    elif m["exit_code"] or not path.exists():
        m["error"] = m["stderr_tail"] or f"exit code {m['exit_code']}"
    return path, m


def export_manifest(model_path: Path, side_file: Path) -> tuple[list[dict], dict]:
    """The floor's weights from the export's own initializers: every floating-point one, external data read in
    place (file, offset, length from its external_data entries), inline ones copied to `side_file`. Returns the
    manifest and counts (params, bytes, the external / inline split, the non-float initializers left out)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    manifest: list[dict] = []
    counts = {"params": 0, "bytes": 0, "external": 0, "external_bytes": 0, "inline": 0, "inline_bytes": 0,
              "non_float": 0, "non_float_bytes": 0}
    with open(side_file, "wb") as side:
        offset = 0
        for t in model.graph.initializer:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
            shape = list(t.dims)
            n = math.prod(shape)
            if not np.issubdtype(dtype, np.floating):
                counts["non_float"] += 1
                counts["non_float_bytes"] += n * dtype.itemsize
                continue
            if t.data_location == onnx.TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in t.external_data}
                entry = {"file": str((model_path.parent / ext["location"]).resolve()),
                         "offset": int(ext.get("offset", 0)), "length": int(ext.get("length", n * dtype.itemsize))}
                counts["external"] += 1
                counts["external_bytes"] += entry["length"]
            else:
                arr = np.ascontiguousarray(numpy_helper.to_array(t), dtype)
                entry = {"file": str(side_file.resolve()), "offset": offset, "length": arr.nbytes}
                side.write(memoryview(arr).cast("B"))
                offset += arr.nbytes
                counts["inline"] += 1
                counts["inline_bytes"] += arr.nbytes
            manifest.append({"name": t.name, "shape": shape, "dtype": dtype.name, **entry})
            counts["params"] += n
            counts["bytes"] += entry["length"]
    return manifest, counts


def run_transformers(work: Path, cfg: Config, size: str, seed: int, gamma: str, keep: bool) -> dict | None:
    """Exports the transformers model into work/ and measures (a), (b), (c) on it; the summary, or None when
    the export failed (its error is printed)."""
    work.mkdir(parents=True, exist_ok=True)
    log(f"export: transformers LlamaForCausalLM of the same shape, torch.onnx.export(dynamo=True) to {work / 'model'}")
    model_path, e = measure_export(work, cfg, seed, gamma)
    log(f"export: {e['wall_s']:.1f}s, peak RSS {mib(e['peak_rss_tree_bytes'])}, exit {e['exit_code']}")
    if e.get("error"):
        print(f"compile_scale --size {size} --from-transformers: the export FAILED after {e['wall_s']:.1f}s "
              f"(peak RSS {mib(e['peak_rss_tree_bytes'])}): {e['error']}")
        return None
    manifest, counts = export_manifest(model_path, work / "floor_inline.bin")
    weight_bytes = counts["bytes"]

    m = measure_all(work, None, manifest, model_path, keep, " on the export")
    s = summarize(cfg, size, gamma, "fp32", weight_bytes, largest_layer_bytes(manifest), e.get("build_s", 0.0), m)
    s.update(source="transformers", params=counts["params"], initializers=counts,
             export={k: v for k, v in e.items() if k != "stdout"})
    return s


# ----------------------------------------------------------------------------------------------------------
# summary


def mib(n) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "-"


def largest_layer_bytes(manifest: list[dict]) -> int:
    """The weight bytes of the largest layer: the weights of one indexed module (`model.layers.3.`) summed,
    or a weight outside the layers (the embedding, the lm_head) alone, whichever is more."""
    import re

    per: dict[str, int] = {}
    for w in manifest:
        m = re.match(r"^(.*?\.\d+)\.", w["name"])
        key = m.group(1) if m else w["name"]
        per[key] = per.get(key, 0) + w["length"]
    return max(per.values())


def stage_peaks(c: dict) -> list[dict]:
    """graphconv's stages with the peak RSS of the whole process tree while each ran (the benchmark's samples
    mapped by the stages' start times in the report)."""
    rows = []
    for st in (c.get("report") or {}).get("stages", []):
        end = st.get("started", 0) + st["seconds"]
        peak = max([b for t, b in c.get("samples", []) if st.get("started", 0) <= t <= end + 0.1] or [0])
        rows.append({"name": st["name"], "seconds": st["seconds"], "peak_rss_tree_bytes": peak,
                     "detail": st.get("detail", {})})
    return rows


def _cached_text(m: dict, s: dict) -> str:
    cached = m.get("weights_in_page_cache_at_start")
    if cached is None:
        return ""
    return f"; at its start {mib(cached)} of the weights' {mib(s['weight_bytes'])} in the page cache"


def summarize(cfg: Config, size: str, gamma: str, dtype: str, weight_bytes: int, largest_layer: int,
              build_s: float, m: dict[str, dict]) -> dict:
    a, o, c = m["a"], m["o"], m["c"]
    rep = c.get("report") or {}
    cases = [{"name": case.get("name"), "max_abs": max((o["max_abs"] for o in case.get("outputs", [])), default=None),
              # an fp16 model: max_abs is the network's distance from the exact values; these the graph's
              # rounded at every op and onnxruntime's
              **{key: max((o["exact"][key] for o in case.get("outputs", []) if o.get("exact")), default=None)
                 for key in ("rounded_max_abs", "onnxruntime_max_abs")}}
             for case in (rep.get("validation") or {}).get("cases", [])]
    floor = (a["wall_s"] or 0) + (o["wall_s"] or 0)
    rss_bound = RSS_BASE + largest_layer
    ratios = {
        "c_over_floor_wall": c["wall_s"] / floor if floor else None,
        "c_peak_rss_over_bound": c["peak_rss_tree_bytes"] / rss_bound,
        "c_peak_rss_over_weights": c["peak_rss_tree_bytes"] / weight_bytes,
    }
    ok = c["exit_code"] == 0 and a["exit_code"] == 0 and o["exit_code"] == 0
    targets = {"wall": ok and ratios["c_over_floor_wall"] <= WALL_TARGET,
               "peak_rss": c["exit_code"] == 0 and c["peak_rss_tree_bytes"] <= rss_bound}
    strip = ("stdout", "report", "samples")
    return {
        "source": "synthetic", "size": size, "dtype": dtype, "gamma": gamma, "config": dataclasses.asdict(cfg),
        "params": cfg.n_params(), "weight_bytes": weight_bytes, "largest_layer_bytes": largest_layer,
        "rss_bound_bytes": rss_bound, "build_s": build_s,
        **{key: {k: v for k, v in m[short].items() if k not in strip}
           for key, short in (("floor", "a"), ("ms_floor", "a2"), ("onnxsim", "b"), ("ort_layers", "o"))},
        "graphconv": {**{k: v for k, v in c.items() if k not in strip},
                      "status": rep.get("status"), "stages": stage_peaks(c),
                      "validation_max_abs": cases, "validation_mode": (rep.get("validation") or {}).get("mode"),
                      "fusions": rep.get("fusions"), "skipped_fusions": rep.get("skipped_fusions"),
                      "report_peak_rss_bytes": rep.get("peak_rss_bytes"), "warnings": rep.get("warnings", []),
                      "ascend_precision": ((rep.get("validation") or {}).get("ascend_precision") or {}).get("status"),
                      "layers": next((st["detail"].get("layers") for st in rep.get("stages", [])
                                      if st["name"] == "lower" and st.get("detail")), None)},
        "ratios": ratios, "targets_met": targets,
    }


def print_summary(s: dict) -> None:
    cfg = s["config"]
    shape = (f"hidden {cfg['hidden']}, layers {cfg['layers']}, intermediate {cfg['intermediate']}, heads "
             f"{cfg['heads']}/{cfg['kv_heads']}, vocab {cfg['vocab']}, gammas {s['gamma']}")
    if s["source"] == "transformers":
        e, n = s["export"], s["initializers"]
        print(f"compile_scale --size {s['size']} --from-transformers: transformers {e['transformers']} "
              f"LlamaForCausalLM (attention {e['attn_implementation']}, {'/'.join(e['dtypes'])}), "
              f"torch {e['torch']} dynamo export, opset 18; "
              f"{shape}")
        print(f"  {s['params'] / 1e6:,.1f}M parameters in {n['external'] + n['inline']} float initializers, weights "
              f"{s['weight_bytes'] / 1e9:.2f} GB ({mib(s['weight_bytes'])}; {n['external']} external, "
              f"{n['inline']} inline = {n['inline_bytes']:,} bytes); {n['non_float']} non-float initializers "
              f"({n['non_float_bytes']:,} bytes) "
              f"not in the floor; torch parameters {e['torch_params'] / 1e6:,.1f}M")
        print(f"  export child: import {e['import_s']:.1f}s, model built in {e['build_s']:.1f}s, torch.onnx.export "
              f"{e['export_s']:.1f}s; ONNX + data {mib(e['output_bytes'])}")
    else:
        print(f"compile_scale --size {s['size']} --dtype {s['dtype']}: {s['params'] / 1e6:,.1f}M parameters, weights "
              f"{s['weight_bytes'] / 1e9:.2f} GB ({mib(s['weight_bytes'])}), "
              f"largest layer {mib(s['largest_layer_bytes'])}; "
              f"{shape}; built in {s['build_s']:.1f}s")
    print()
    print(f"{'measurement':<26}{'wall s':>9}{'peak RSS (tree)':>18}{'ru_maxrss':>13}{'x weights':>11}{'exit':>6}")
    rows = (("floor", "(a) read + write floor"), ("ms_floor", "(a') MindSpore Cell+export"),
            ("onnxsim", "(b) onnxsim"), ("ort_layers", "(o) onnxruntime by layer"), ("graphconv", "(c) graphconv"))
    if s["source"] == "transformers":
        rows = (("export", "export"),) + rows
    for key, label in rows:
        m = s[key]
        if m.get("skipped"):
            print(f"{label:<26}  skipped: {m['skipped']}")
            continue
        print(f"{label:<26}{m['wall_s']:>9.1f}{mib(m['peak_rss_tree_bytes']):>18}{mib(m['ru_maxrss_bytes']):>13}"
              f"{m['peak_rss_tree_bytes'] / s['weight_bytes']:>11.2f}{m['exit_code']:>6}")
    print()
    a, a2, b, o, c = s["floor"], s["ms_floor"], s["onnxsim"], s["ort_layers"], s["graphconv"]
    if a["exit_code"] == 0:
        print(f"(a) {a['bytes'] / 1e9:.2f} GB read and written in {a['rw_s']:.2f}s "
              f"({a['bytes'] / 1e9 / max(a['rw_s'], 1e-9):.2f} GB/s each way)")
    else:
        print(f"(a) FAILED: {a['stderr_tail']}")
    if a2.get("exit_code") == 0:
        print(f"(a') read {a2['read_s']:.2f}s, parameters {a2['params_s']:.2f}s, "
              f"mindspore.export {a2['export_s']:.2f}s, "
              f"MindIR {mib(a2['output_bytes'])}")
    elif not a2.get("skipped"):
        print(f"(a') FAILED: {a2.get('rss_limit_exceeded') and 'memory limit exceeded' or a2['stderr_tail']}")
    if b.get("exit_code") == 0:
        print(f"(b) onnx.load {b['load_s']:.2f}s, onnxsim.simplify {b['simplify_s']:.2f}s, "
              f"nodes {b['nodes_before']} -> {b['nodes_after']}")
    elif not b.get("skipped"):
        print(f"(b) FAILED: {b.get('error')}")
    if o["exit_code"] == 0:
        print(f"(o) load {o['load_s']:.2f}s, {o['pieces']} pieces run in {o['run_s']:.2f}s, "
              f"largest {mib(o['largest_piece_bytes'])}"
              f"{_cached_text(o, s)}")
    else:
        print(f"(o) FAILED: {o['stderr_tail']}")
    grouping = c.get("layers") or {}
    print(f"(c) status {c['status']} ({c['validation_mode']}), exit code {c['exit_code']}, layers in a Cell class: "
          f"{grouping.get('grouped', 0)} of {grouping.get('layers', 0)}"
          + (f" ({grouping['reason']})" if grouping.get("reason") else "")
          + (f", error: {c['error']}" if c.get("error") else "") + _cached_text(c, s))
    print(f"    {c.get('command', '')}")
    print("    stage              seconds   peak RSS (tree)")
    for st in c["stages"]:
        timing = {k: v for k, v in st.get("detail", {}).items() if "seconds" in k and not isinstance(v, (list, dict))}
        print(f"    {st['name']:<18}{st['seconds']:>8.2f}{mib(st['peak_rss_tree_bytes']):>18}"
              + ("   " + ", ".join(f"{k} {v}" for k, v in timing.items()) if timing else ""))
    print("    validation max_abs: " + (", ".join(f"{v['name']} {v['max_abs']:.3g}" for v in c["validation_max_abs"]
                                                  if v["max_abs"] is not None) or "-"))
    if any(v.get("rounded_max_abs") is not None for v in c["validation_max_abs"]):
        print("    distance from the exact values, graphconv / rounded at every op (onnxruntime): " + ", ".join(
            f"{v['name']} {v['max_abs']:.3g} / {v['rounded_max_abs']:.3g} = "
            f"{v['max_abs'] / v['rounded_max_abs']:.2f}x ({v['onnxruntime_max_abs']:.3g})"
            for v in c["validation_max_abs"] if v.get("rounded_max_abs")))
    print(f"    fusions: {json.dumps(c['fusions'])}")
    for name, reasons in (c.get("skipped_fusions") or {}).items():
        for r in reasons[:3]:
            print(f"    {name} skipped: {r}")
    print(f"    ascend precision: {c.get('ascend_precision')}; MindIR {mib(c['output_bytes'])}")
    for w in c.get("warnings") or []:
        print(f"    warning: {w[:300]}")
    print()
    r, t = s["ratios"], s["targets_met"]
    wall = f"{r['c_over_floor_wall']:6.2f}" if r["c_over_floor_wall"] is not None else "     -"
    print(f"wall(c) / (wall(a) + wall(o))   {wall}   target <= {WALL_TARGET}  {'PASS' if t['wall'] else 'MISS'}")
    print(f"peak RSS(c)                 {mib(c['peak_rss_tree_bytes']):>10}   target <= 4 GiB + largest layer = "
          f"{mib(s['rss_bound_bytes'])}  {'PASS' if t['peak_rss'] else 'MISS'}   "
          f"({r['c_peak_rss_over_weights']:.2f} x the weights)")


# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    for flag in ("hidden", "layers", "intermediate", "heads", "kv-heads", "vocab"):
        ap.add_argument(f"--{flag}", type=int, help=f"override the size's {flag}")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="the weights' and the graph's float type (fp16: spelled as transformers' fp16 exports)")
    ap.add_argument("--init", choices=("scaled", "plain"), default="scaled",
                    help="std of o_proj/down_proj: 0.02 / sqrt(2 * layers) (scaled, GPT-2's init) or 0.02 (plain)")
    ap.add_argument("--atol", type=float, help="passed to graphconv compile (default: the comparison rule's)")
    ap.add_argument("--rtol", type=float, help="passed to graphconv compile (default: the comparison rule's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gamma", choices=("ones", "random"), default="random",
                    help="norm gammas: random = 1 + N(0, 0.02) like a trained checkpoint (default), or ones "
                         "(onnxsim then drops the x * 1 and fuse-rmsnorm finds no gamma Mul)")
    ap.add_argument("--scopes", choices=("dynamo", "none"), default="dynamo",
                    help="dynamo (default): every node carries its module stack as dynamo's `namespace` metadata, "
                         "as a real export does (graphconv then emits the layers as one Cell class); none: no "
                         "node does (the layers stay inline, each its own statements)")
    ap.add_argument("--workdir", type=Path, help="empty or new directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (model, MindIRs, logs, report)")
    ap.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    ap.add_argument("--from-transformers", action="store_true",
                    help="also export a transformers LlamaForCausalLM of the same shape with torch's dynamo "
                         "exporter (in a subprocess, measured as 'export') and measure (a), (b), (c) on it: a "
                         "second table (needs torch, transformers, onnxscript)")
    ap.add_argument("--selfcheck", action="store_true", help="check the graph on tiny models (ORT vs numpy) and exit")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab")
                 if getattr(args, k) is not None}
    cfg = dataclasses.replace(SIZES[args.size], **overrides)
    cfg.validate()
    return cfg


def prepare_workdir(args: argparse.Namespace, weight_bytes: int) -> tuple[Path, bool]:
    """The workdir and whether this script created it; exits if it is not empty or the disk is too full
    (DISK_FACTOR x the weights; twice that for --from-transformers --keep, which keeps both models)."""
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        raise SystemExit(f"compile_scale: --workdir {args.workdir} is not empty")
    probe = args.workdir if args.workdir is not None else Path(tempfile.gettempdir())
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    # the model and one MindIR at a time (each stage's output is deleted before the next)
    factor = DISK_FACTOR * (2 if args.from_transformers and args.keep else 1)
    if free < factor * weight_bytes:
        raise SystemExit(f"compile_scale: {free / 1e9:.1f} GB free on {probe}, need {factor:.2f}x the weights = "
                         f"{factor * weight_bytes / 1e9:.1f} GB; free space or pass --workdir elsewhere")
    if args.workdir is None:
        return Path(tempfile.mkdtemp(prefix="compile_scale-")), True
    created = not args.workdir.exists()
    args.workdir.mkdir(parents=True, exist_ok=True)
    return args.workdir.resolve(), created


def cleanup(work: Path, created: bool) -> None:
    if created:
        shutil.rmtree(work, ignore_errors=True)
    else:
        for sub in ("model", "floor", "out", "logs", "floor_manifest.json", "transformers"):
            p = work / sub
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        {"floor": child_floor, "onnxsim": child_onnxsim, "export": child_export, "rw": child_rw,
         "ort_layers": child_ort_layers}[args.child[0]](*args.child[1:])
        return 0
    if args.selfcheck:
        return 0 if selfcheck(args.seed) else 1
    if args.from_transformers and (missing := transformers_missing()):
        print(f"compile_scale: --from-transformers needs torch, transformers and onnxscript; not installed: "
              f"{', '.join(missing)}", file=sys.stderr)
        return 1

    cfg = config_from(args)
    weight_bytes = DTYPES[args.dtype].itemsize * cfg.n_params()
    work, created = prepare_workdir(args, weight_bytes)
    try:
        log(f"workdir {work}; building {cfg.n_params() / 1e6:,.1f}M parameters ({weight_bytes / 1e9:.2f} GB)")
        t0 = time.perf_counter()
        model_path, manifest = build_model(cfg, work / "model", args.seed, args.gamma, args.dtype, args.init,
                                           args.scopes == "dynamo")
        build_s = time.perf_counter() - t0
        log(f"built {model_path} in {build_s:.1f}s")

        tolerance = tuple(a for flag in ("atol", "rtol") if getattr(args, flag) is not None
                          for a in (f"--{flag}", str(getattr(args, flag))))
        m = measure_all(work, model_path.parent / DATA_FILE, manifest, model_path, args.keep, "", tolerance)
        if not args.keep:  # disk: the model before the transformers one
            shutil.rmtree(work / "out", ignore_errors=True)
        summary = summarize(cfg, args.size, args.gamma, args.dtype, weight_bytes, largest_layer_bytes(manifest),
                            build_s, m)
        print_summary(summary)
        ok = m["a"]["exit_code"] == 0 and m["c"]["exit_code"] == 0
        if args.from_transformers:
            sys.stdout.flush()
            if not args.keep:  # disk: one model at a time
                cleanup(work, False)
            hf = run_transformers(work / "transformers", cfg, args.size, args.seed, args.gamma, args.keep)
            if hf is not None:
                print()
                print_summary(hf)
            ok = ok and hf is not None and hf["floor"]["exit_code"] == 0 and hf["graphconv"]["exit_code"] == 0
            if args.json:
                print(json.dumps({"synthetic": summary, "transformers": hf}, indent=2, default=str))
        elif args.json:
            print(json.dumps(summary, indent=2, default=str))
        if args.keep:
            log(f"kept {work}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            cleanup(work, created)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
