"""EmbedLayerNormalization (com.microsoft) -> Gather, Add and the decomposed LayerNorm of a BERT / GPT-2
embedding (fuse-layernorm makes mindspore::LayerNorm of the norm).

Inputs input_ids (B, S) int32, segment_ids?, word_embedding, position_embedding, segment_embedding?, gamma,
beta, mask? (B, S) int32, position_ids? (B, S) or (1, S); attribute epsilon=1e-12; outputs output,
mask_index?, embedding_sum?:
    e = word[input_ids] + position[position_ids, or 0..S-1] (+ segment[segment_ids] when both are given);
    output = LayerNorm(e) over the last axis with gamma and beta (two-pass mean and variance);
    embedding_sum = e; mask_index (B,) int32 = the number of entries of each mask row equal to 1, or zeros
    without a mask. (mask_index counts ones wherever they are: the Attention reading it takes them as the
    first mask_index positions, onnxruntime's right-padding assumption, which the decomposition keeps.)
Read from onnxruntime's contrib schema and CPU kernel (contrib_ops/cpu/bert/embed_layer_norm.cc).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from graphconv.frontend.contrib import spell
from graphconv.frontend.contrib.layer_norm import layer_norm
from graphconv.frontend.contrib.norm import back_to, to_float
from graphconv.frontend.contrib.registry import MICROSOFT, decomposes
from graphconv.frontend.contrib.rewrite import Rewrite


@decomposes("EmbedLayerNormalization", domain=MICROSOFT)
def embed_layer_normalization(rw: Rewrite) -> None:
    ids, word = rw.input(0), rw.input(2)
    dtype = rw.dtype(word)
    e = rw.op("Gather", word, ids, axis=0)
    if rw.has(8):
        positions = rw.input(8)
    else:  # 0..S-1, broadcast over the batch
        positions = spell.positions(rw, spell.dim(rw, ids, 1))
    e = rw.op("Add", e, rw.op("Gather", rw.input(3), positions, axis=0))
    if rw.has(1) and rw.has(4):
        e = rw.op("Add", e, rw.op("Gather", rw.input(4), rw.input(1), axis=0))
    y32, _, _ = layer_norm(rw, to_float(rw, e, dtype), rw.input(5), rw.input(6), rw.attr("epsilon", 1e-12), [-1])
    back_to(rw, y32, dtype, rw.output(0))
    rw.identity(e, rw.output(2))
    if not rw.output(1):
        return
    if rw.has(7):
        ones = rw.op("Cast", rw.op("Equal", rw.input(7), rw.const(np.int32(1))), to=onnx.TensorProto.INT32)
        rw.identity(spell.reduce_sum(rw, ones, [1], keepdims=0), rw.output(1))
    else:
        batch = spell.unsqueeze(rw, spell.dim(rw, ids, 0), [0])
        rw.op("ConstantOfShape", batch, outputs=[rw.output(1)],
              value=numpy_helper.from_array(np.zeros(1, np.int32)))
