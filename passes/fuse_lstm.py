"""fuse-lstm: an ONNX LSTM over a dynamic sequence -> mindspore::DynamicRNN (opmap/fused/dynamic_rnn.py).

An LSTM whose sequence length is static is unrolled by opmap/rnn.py on both targets. Over a dynamic sequence
(an OCR recognizer over an image's width, a voice detector over audio frames) it cannot be unrolled: on CPU it
runs MindSpore's LSTM primitive, which has no Ascend kernel, and on Ascend MindSpore's own nn.LSTM runs
DynamicRNN. This pass makes that node, whose reference body is the LSTM itself.

Fused when: layout 0 (onnxruntime implements no other), float32 X, the default activations (sigmoid, tanh,
tanh), no clip, no input_forget, no peepholes, no sequence_lens (DynamicRNN takes none), W, R and B constants.

Coverage family "recurrent" (passes/coverage.py): every LSTM node over a dynamic sequence length; one left
unfused says which condition it breaks.
"""

from __future__ import annotations

import onnx_ir as ir

from graphconv.onnx_domains import is_default_domain
from opmap.rnn import DEFAULT_ACTIVATIONS
from passes import coverage, match
from passes.manager import PassResult, register_pass


def _dynamic_sequence(node: ir.Node) -> bool:
    x = node.inputs[0]
    if x is None or x.shape is None or x.shape.rank() != 3:
        return False
    seq = x.shape[1] if node.attributes.get_int("layout", 0) else x.shape[0]
    return not isinstance(seq, int)


def lstm_candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if is_default_domain(n.domain) and n.op_type == "LSTM" and _dynamic_sequence(n)]


def refusal(node: ir.Node) -> str | None:
    """Why this LSTM does not become a DynamicRNN, or None when it does."""
    ins = list(node.inputs) + [None] * (8 - len(node.inputs))
    dirs = 2 if node.attributes.get_string("direction", "forward") == "bidirectional" else 1
    acts = list(node.attributes.get_strings("activations", []))
    if node.attributes.get_int("layout", 0):
        return "layout 1 (batch first): DynamicRNN takes the sequence first"
    if ins[0].dtype != ir.DataType.FLOAT:
        return f"{ins[0].dtype} input: fused for float32 (DynamicRNN computes in float16 from it)"
    if acts and acts != DEFAULT_ACTIVATIONS["LSTM"] * dirs:
        return f"activations {acts}: DynamicRNN computes sigmoid, tanh, tanh"
    if node.attributes.get_float("clip") is not None or node.attributes.get_int("input_forget", 0):
        return "clip or input_forget: DynamicRNN's cell_clip and forget_bias are not ONNX's"
    if ins[4] is not None or ins[7] is not None:
        return "sequence_lens or peepholes: DynamicRNN takes neither (graphconv passes it no seq_length)"
    if any(v is not None and match.const_value(v) is None for v in ins[1:4]):
        return "W, R or B computed at run time: DynamicRNN's weights are laid out at compile time"
    return None


def _defaults(node: ir.Node, ins: list, hidden: int, dirs: int) -> list[ir.Node]:
    """ONNX's defaults of the optional B, initial_h and initial_c made explicit (zeros; the states at the run's
    batch), so that the fused op always has them: its ascend-precision body rounds each to float16."""
    import numpy as np

    made = []
    if ins[3] is None:
        zero_b = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.zeros((dirs, 8 * hidden),
                                                                                          np.float32)))],
                         name=f"{node.name}_B")
        made.append(zero_b)
        ins[3] = zero_b.outputs[0]
    if ins[5] is None or ins[6] is None:
        x_shape = ir.Node("", "Shape", [ins[0]], name=f"{node.name}_x_shape")  # (no start/end before opset 15)
        one = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array([1], np.int64)))],
                      name=f"{node.name}_one")
        batch = ir.Node("", "Gather", [x_shape.outputs[0], one.outputs[0]], [ir.AttrInt64("axis", 0)],
                        name=f"{node.name}_batch")
        dirs_c = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array([dirs], np.int64)))],
                         name=f"{node.name}_dirs")
        hid_c = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array([hidden], np.int64)))],
                        name=f"{node.name}_hidden")
        shape = ir.Node("", "Concat", [dirs_c.outputs[0], batch.outputs[0], hid_c.outputs[0]],
                        [ir.AttrInt64("axis", 0)], name=f"{node.name}_state_shape")
        zeros = ir.Node("", "ConstantOfShape", [shape.outputs[0]],
                        [ir.AttrTensor("value", ir.tensor(np.zeros(1, np.float32)))], name=f"{node.name}_zeros")
        made += [x_shape, one, batch, dirs_c, hid_c, shape, zeros]
        ins[5] = ins[5] if ins[5] is not None else zeros.outputs[0]
        ins[6] = ins[6] if ins[6] is not None else zeros.outputs[0]
    return made


def apply(model: ir.Model) -> PassResult:
    graph = model.graph
    count, reasons, node_reasons = 0, [], {}
    for node in lstm_candidates(graph):
        why = refusal(node)
        if why is not None:
            reasons.append(f"{node.name or 'LSTM'}: {why}")
            if node.name:
                node_reasons[node.name] = why
            continue
        ins = list(node.inputs) + [None] * (8 - len(node.inputs))
        hidden = node.attributes.get_int("hidden_size")
        direction = node.attributes.get_string("direction", "forward")
        made = _defaults(node, ins, hidden, 2 if direction == "bidirectional" else 1)
        attrs = [ir.AttrInt64("hidden_size", hidden), ir.AttrString("direction", direction)]
        fused = ir.Node("mindspore", "DynamicRNN", [*ins[:4], ins[5], ins[6]], attrs, num_outputs=3,
                        name=node.name)
        for new, old in zip(fused.outputs, node.outputs):
            new.name, new.shape, new.type = old.name, old.shape, old.type
        olds = list(node.outputs)
        ir.convenience.replace_nodes_and_values(graph, node, [node], [*made, fused], olds,
                                                list(fused.outputs)[:len(olds)])
        count += 1
    if count:
        model.opset_imports.setdefault("mindspore", 1)
    return PassResult(count, sorted(reasons), node_reasons)


coverage.register_family(coverage.Family("recurrent", ("fuse-lstm",), lstm_candidates, refusal))
register_pass("fuse-lstm", "LSTM over a dynamic sequence -> mindspore::DynamicRNN")(apply)
