"""graphconv::SDPA, the intermediate op between fuse-attention's stages.

    SDPA(q, k, v[, mask][, bias]; scale, mask_kind, mask_proven, fill, safe_softmax, fp32_softmax) -> out

q (B, N1, S1, D), k and v (B, N2, S2, D), all BNSD; N2 divides N1 and query head n reads kv head
n // (N1 / N2) (N2 = N1: its own head; N2 = 1: MQA). out = P @ v in q's dtype, (B, N1, S1, D), with
P = Softmax(scale · q @ kᵀ + bias + M) over the last axis:
  bias          an optional additive term on the scaled scores (Bloom's ALiBi), broadcastable to (B, N1, S1, S2);
  M             mask_kind "none": 0; "additive": the mask input; "keep_bool": Where(mask, ·, fill), i.e. the
                scores where mask is True, fill elsewhere; "discard_bool": Where(mask, fill, ·). Once
                mask_proven = 1 the mask input is additive whatever mask_kind says (mask_kind then records
                what the graph had: FlashAttentionScore's attribute of that name) and its values are proven
                0 or <= mask.LARGE_NEGATIVE;
  safe_softmax  1: a row with every score -inf gives 0, not NaN (torch's SDPA export);
  fp32_softmax  1: for fp16/bf16 inputs the softmax computes in fp32 (the Cast island of torch's
                softmax(x, dtype=float32)).
The SDPA node carries the name of the node the attention was found at (its Softmax, or the Attention node):
the coverage candidate, so a refusal recorded at any stage is that candidate's reason. An SDPA that no stage
took to FlashAttentionScore is expanded back into standard ONNX by `expand_leftovers` (the Softmax keeps
that name: coverage sees the candidate alive, refused).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from opmap.graphconv_ops import DOMAIN, SDPA
from passes import match

OP = SDPA.name


@dataclasses.dataclass
class Sdpa:
    """What an SDPA node says (or a stage has found, before it builds one)."""

    q: ir.Value
    k: ir.Value
    v: ir.Value
    scale: float
    mask_kind: str = "none"
    mask: ir.Value | None = None
    fill: float = -math.inf
    bias: ir.Value | None = None
    mask_proven: bool = False
    safe_softmax: bool = False
    fp32_softmax: bool = False
    source: str = ""

    @classmethod
    def read(cls, node: ir.Node) -> "Sdpa":
        a = node.attributes
        inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
        present = [x if x is not None and x.name != "" else None for x in inputs]
        return cls(present[0], present[1], present[2], a["scale"].value, a["mask_kind"].value, present[3],
                   a["fill"].value, present[4], bool(a["mask_proven"].value), bool(a["safe_softmax"].value),
                   bool(a["fp32_softmax"].value), node.name or "")

    def build(self, op, like: ir.Value) -> ir.Value:
        """The SDPA node in a rewrite (`op` the rewriter's builder); `like` gives its dtype and shape."""
        out = op.SDPA(self.q, self.k, self.v, self.mask, self.bias, _domain=DOMAIN, scale=float(self.scale),
                      mask_kind=self.mask_kind, mask_proven=int(self.mask_proven), fill=float(self.fill),
                      safe_softmax=int(self.safe_softmax), fp32_softmax=int(self.fp32_softmax))
        out.producer().name = self.source
        out.dtype, out.shape = like.dtype, like.shape
        return out


class SdpaRule(pattern.RewriteRuleClassBase):
    """A stage's rule on an SDPA node (its output bound as `out`; the matched producers stay for DCE)."""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)

    def pattern(self, op, q, k, v):
        return op.SDPA(q, k, v, _allow_other_inputs=True, _domain=DOMAIN, _outputs=["out"])


def is_sdpa(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type == OP


def _const(tape: ir.tape.Tape, value: np.ndarray) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(value)})


def _repeat_heads(tape: ir.tape.Tape, x: ir.Value, rep: int, n1: int, d: int) -> ir.Value:
    """(B, N2, S, D) -> (B, N1, S, D), head n reading head n // rep."""
    five = tape.op("Unsqueeze", [x, _const(tape, np.array([2], np.int64))])
    grown = tape.op("Expand", [five, _const(tape, np.array([1, 1, rep, 1, 1], np.int64))])
    return tape.op("Reshape", [grown, _const(tape, np.array([0, n1, -1, d], np.int64))])


def _expand(node: ir.Node) -> tuple[list[ir.Node], ir.Value]:
    """Standard ONNX computing what the SDPA node computes (its definition above)."""
    s = Sdpa.read(node)
    tape = ir.tape.Tape()
    dtype = s.q.dtype
    k, v = s.k, s.v
    qd, kd = match.dims(s.q), match.dims(s.k)
    if qd is not None and kd is not None and isinstance(qd[1], int) and isinstance(kd[1], int) \
            and 1 < kd[1] < qd[1] and isinstance(kd[3], int):  # GQA (MatMul broadcasts only N2 = 1)
        k = _repeat_heads(tape, k, qd[1] // kd[1], qd[1], kd[3])
        v = _repeat_heads(tape, v, qd[1] // kd[1], qd[1], kd[3])
    scores = tape.op("MatMul", [s.q, tape.op("Transpose", [k], {"perm": [0, 1, 3, 2]})])
    scores = tape.op("Mul", [scores, _const(tape, np.array(s.scale, dtype.numpy()))])
    if s.bias is not None:
        scores = tape.op("Add", [scores, s.bias])
    if s.mask is not None:
        if s.mask_proven or s.mask_kind == "additive":
            scores = tape.op("Add", [scores, s.mask])
        else:
            fill = _const(tape, np.array(s.fill, dtype.numpy()))
            pair = [scores, fill] if s.mask_kind == "keep_bool" else [fill, scores]
            scores = tape.op("Where", [s.mask, *pair])
    island = s.fp32_softmax and dtype != ir.DataType.FLOAT
    if island:
        scores = tape.op("Cast", [scores], {"to": ir.DataType.FLOAT})
    probs = tape.op("Softmax", [scores], {"axis": -1}, name=s.source or None)
    if s.safe_softmax:
        zero = _const(tape, np.array(0.0, np.float32 if island else dtype.numpy()))
        probs = tape.op("Where", [tape.op("IsNaN", [probs]), zero, probs])
    if island:
        probs = tape.op("Cast", [probs], {"to": dtype})
    out = tape.op("MatMul", [probs, v])
    out.dtype, out.shape = node.outputs[0].dtype, node.outputs[0].shape
    return list(tape.nodes), out


def expand_leftovers(model: ir.Model) -> int:
    """Replace every SDPA node with its standard-ONNX expansion; returns how many there were."""
    graph = model.graph
    leftovers = [n for n in graph if is_sdpa(n)]
    for node in leftovers:
        nodes, out = _expand(node)
        graph.insert_before(node, nodes)
        old = node.outputs[0]
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        if out.is_graph_output():  # the graph output keeps its name
            name, old.name = old.name, None
            out.name = name
        graph.remove(node, safe=True)
    if not any(n.domain == DOMAIN for n in graph):
        model.opset_imports.pop(DOMAIN, None)
        graph.opset_imports.pop(DOMAIN, None)
    return len(leftovers)
