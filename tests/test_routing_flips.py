"""The ascend-precision check's routing explanation: outputs beyond fp16 tolerance that come from a router
choosing other experts after fp16 rounding upstream (a near-tie: sarvam_moe and minicpm5_moe in the ledger)
are a warning, proven by re-running the variant with the fp32 choices imposed; any other excess stays an error.

The variant here adds 1e-3 to one score column before the TopK, as fp16 inputs to attention move a router's
scores; rows whose two best scores are closer than that flip. The output adds 10 where expert 2 is chosen, so a
flip moves it far beyond fp16 tolerance."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper as oh, numpy_helper

from fusion_utils import fuse
from graphconv.errors import VerificationError
from graphconv.verify import precision_checks, reference


def _router(shift: float, scale: float = 1.0, softmax: bool = False) -> onnx.ModelProto:
    nodes = [oh.make_node("Add", ["x", "shift"], ["logits" if softmax else "scores"]),
             *([oh.make_node("Softmax", ["logits"], ["scores"], axis=-1)] if softmax else []),
             oh.make_node("TopK", ["scores", "k"], ["v", "i"], name="router_topk"),
             oh.make_node("Equal", ["i", "two"], ["is2"]),
             oh.make_node("Cast", ["is2"], ["fi"], to=TP.FLOAT),
             oh.make_node("Mul", ["fi", "ten"], ["ti"]),
             oh.make_node("Add", ["ti", "v"], ["y0"]),
             oh.make_node("Mul", ["y0", "scale"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0, 0, shift, 0], np.float32), "shift"),
             numpy_helper.from_array(np.array([2], np.int64), "k"),
             numpy_helper.from_array(np.array(10.0, np.float32), "ten"),
             numpy_helper.from_array(np.array(2, np.int64), "two"),
             numpy_helper.from_array(np.array(scale, np.float32), "scale")]
    g = oh.make_graph(nodes, "router", [oh.make_tensor_value_info("x", TP.FLOAT, ["n", 4])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["n", 2])], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 18)])


def _cases():
    rng = np.random.default_rng(0)
    out = []
    for n in (6, 9):
        x = rng.uniform(0, 1, (n, 4)).astype(np.float32)
        x[:2, 1] = x[:2].max(1) + 0.5  # column 1 first, then a near-tie for second place between 2 and 3 ...
        x[:2, 0], x[:2, 3] = 0.1, 0.4
        x[:2, 2] = 0.4 - 5e-4  # ... which the variant's +1e-3 on column 2 flips
        out.append(reference.ReferenceCase(f"n{n}", {"x": x}))
    return out


def _check(variant_model, fused=None):
    fused = fused or _router(0.0)
    cases = _cases()
    expected = reference.Oracle(fused).run(cases)
    variant = precision_checks.AscendVariant(variant_model, {"FlashAttentionScore"}, {"fuse-attention"}, fused)
    return precision_checks.check_ascend_variant(variant, cases, expected, reference.Oracle(variant_model).run(cases))


def test_a_flipped_near_tie_is_a_warning_with_the_imposed_proof():
    section, warning = _check(_router(1e-3))
    assert section["status"] == "routing flips"
    flips = section["routing"]
    assert flips["rows_flipped"] == 4 and flips["rows"] == 15  # 2 rows in each case, of 6 + 9
    assert flips["max_margin"] == pytest.approx(5e-4, rel=1e-3)
    assert flips["imposed_max_abs"] == pytest.approx(1e-3, rel=1e-3)  # what the shift leaves: within fp16's
    assert "top-k choice of 4 of 15 rows" in warning and "near-tie of the router" in warning


def test_an_excess_the_routing_does_not_explain_stays_an_error():
    with pytest.raises(VerificationError, match="fp16 casts exceed fp16 tolerance"):
        _check(_router(1e-3, scale=5.0))  # the flips, and every output 5x: imposing the choice leaves the 5x


def test_without_a_flip_the_excess_is_an_error():
    with pytest.raises(VerificationError, match="fp16 casts exceed fp16 tolerance"):
        _check(_router(0.0, scale=5.0))


def test_a_fused_router_flipped_is_imposed_through_its_softmax():
    """The router fused to MoeGatingTopKSoftmax (JetMoE's in the ledger): its choice is imposed with its
    values recomputed as the softmax's at the imposed experts."""
    count, fused = fuse(_router(0.0, softmax=True), "fuse-moe")
    assert count == 1 and not [n for n in fused.graph.node if n.op_type == "TopK"]
    variant = onnx.ModelProto()
    variant.CopyFrom(fused)
    (shift,) = [t for t in variant.graph.initializer if t.name == "shift"]
    shift.CopyFrom(numpy_helper.from_array(np.array([0, 0, 1e-3, 0], np.float32), "shift"))
    section, warning = _check(variant, fused)
    assert section["status"] == "routing flips" and section["routing"]["rows_flipped"] == 4, section
    assert section["routing"]["imposed_max_abs"] < 1e-2
