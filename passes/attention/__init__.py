"""The stages of fuse-attention (passes/fuse_attention.py), each a small rule set over graphconv::SDPA:

  scores.py       Softmax/MatMul spellings (and opset 23's Attention) -> SDPA(q, k, v, mask, bias)
  head_repeat.py  SDPA(q, repeat(k), repeat(v)) -> SDPA(q, k, v): the kv heads un-repeated (GQA)
  mask.py         the mask proven 0 / large negative, bool masks made additive
  flash.py        SDPA -> mindspore::FlashAttentionScore, where the primitive can take it
  sdpa.py         the intermediate op itself: its semantics, its builder, and its expansion back to ONNX
                  for an SDPA no stage took all the way (refused: the graph computes as before)
"""
