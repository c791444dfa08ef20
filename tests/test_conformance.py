"""The CI slice of ONNX conformance (the full run is `graphconv conformance`, about 8 minutes on 2 shared cores,
docs/conformance.md).

A fixed, representative set of onnx node tests (one to three per op family: elementwise, reductions, shapes,
NN, losses, resampling, attention, recurrent, spectral, control flow, quantization, the opset 24-28 ops, plus a
few function expansions and opset-upgraded models) must keep passing through graphconv.tools.backend; the
applicability rules and the document renderer are checked on their own.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import helper as oh

from graphconv.tools import conformance

SLICE = """
test_abs test_acos test_add test_affine_grid_2d test_affine_grid_2d_expanded test_and2d
test_argmax_default_axis_example test_argmax_negative_axis_keepdims_example test_argmin_default_axis_example
test_asin test_atan test_attention_23_boolmask_fullymasked_row_nan_robustness test_attention_4d_causal
test_attention_4d_with_qk_matmul_softmax test_attention_3d_gqa_with_past_and_present test_attention_4d_fp16
test_averagepool_1d_default test_averagepool_2d_precomputed_strides test_averagepool_3d_dilations_small
test_batchnorm_epsilon test_batchnorm_example_training_mode test_bitwise_and_i32_2d test_bitwise_not_2d
test_bitwise_xor_i32_2d test_blackmanwindow test_ceil test_center_crop_pad_crop
test_center_crop_pad_crop_and_pad_expanded test_clip test_clip_default_min test_col2im test_concat_1d_axis_0
test_concat_3d_axis_0 test_basic_conv_with_padding test_conv_with_strides_padding test_convinteger_with_padding
test_convtranspose test_convtranspose_group_2 test_convtranspose_kernel_shape test_cos
test_cumsum_1d_int32_exclusive test_dft test_dft_irfft test_det_2d test_div test_dropout_default
test_dynamicquantizelinear test_dynamicquantizelinear_expanded test_elu test_equal test_erf test_exp
test_expand_dim_changed test_eyelike_populate_off_main_diagonal test_floor test_gru_batchwise test_gather_0
test_gather_elements_0 test_gathernd_example_float32 test_gathernd_example_int32_batch_dim1 test_gelu_default_1
test_gemm_all_attributes test_gemm_default_scalar_bias test_globalaveragepool test_globalmaxpool test_greater
test_greater_equal test_gridsample test_gridsample_bicubic test_gridsample_volumetric_nearest_align_corners_0
test_group_normalization_epsilon test_hammingwindow test_hannwindow test_hardsigmoid test_hardswish
test_hardmax_axis_0 test_if test_instancenorm_epsilon test_isinf test_isnan test_lrn test_lstm_batchwise
test_lstm_with_peepholes test_layer_normalization_2d_axis0 test_layer_normalization_3d_axis_negative_3_epsilon
test_layer_normalization_default_axis test_layer_normalization_2d_axis0_expanded test_leakyrelu test_less
test_less_equal test_log test_logsoftmax_axis_0 test_logsoftmax_default_axis test_loop11 test_l1normalization_axis_0
test_lppool_1d_default test_lppool_2d_same_upper test_matmul_1d_1d test_matmul_2d test_matmulinteger
test_max_example test_maxpool_1d_default test_maxpool_2d_same_lower test_maxpool_2d_uint8
test_maxpool_with_argmax_2d_precomputed_pads test_maxunpool_export_with_output_shape test_mean_example test_mvn
test_min_example test_mish test_mul test_neg test_nllloss_NC test_nllloss_NCd1d2_reduction_sum
test_nllloss_NCd1d2d3d4d5_none_no_weight test_nonzero_example test_not_2d test_or2d test_prelu_broadcast test_pow
test_pow_types_float32_int64 test_qlinearconv test_qlinearmatmul_2D_int8_float16 test_rms_normalization_2d_axis0
test_rms_normalization_default_axis test_rnn_seq_length test_simple_rnn_bidirectional test_reciprocal
test_reduce_l1_default_axes_keepdims_example test_reduce_l2_empty_set test_reduce_max_bool_inputs
test_reduce_max_empty_set test_reduce_mean_default_axes_keepdims_example test_reduce_min_bool_inputs
test_reduce_prod_default_axes_keepdims_example test_reduce_sum_default_axes_keepdims_example
test_reduce_sum_empty_set test_reduce_sum_square_default_axes_keepdims_example test_hardmax_example test_relu
test_resize_downsample_scales_cubic test_resize_downsample_scales_linear_align_corners
test_resize_tf_crop_and_resize_extrapolation_value test_resize_upsample_sizes_nearest_round_prefer_ceil_asymmetric
test_resize_downsample_sizes_linear_antialias test_rotary_embedding test_rotary_embedding_expanded test_round
test_stft test_scan9_multi_state test_scatter_with_axis test_scatter_elements_with_axis
test_scatter_elements_with_reduction_max test_scatternd test_scatternd_multiply test_selu test_shrink_hard
test_sigmoid test_sign test_sin test_slice test_softmax_axis_0 test_softmax_default_axis
test_softmax_axis_0_expanded test_sce_NCd1_mean_weight_negative_ii test_sce_mean_no_weight_ii_4d
test_sce_sum_log_prob test_sce_mean_expanded test_softplus test_softsign test_split_1d_uneven_split_opset18
test_split_variable_parts_1d_opset13 test_sqrt test_sub test_sum_example test_tanh test_thresholdedrelu test_tile
test_tril test_triu test_tril_zero test_upsample_nearest test_where_example test_xor2d
test_attention_4d_gqa_causal_nonpad_decode test_attention_local_window_with_past test_attention_3d_local_window
test_tensorscatter_circular test_swiglu_alpha test_swish_expanded test_linear_attention_gated_delta_gqa
test_causal_conv_with_state_with_bias_and_past_state test_squeeze_negative_axes
""".split()


@pytest.fixture(scope="module")
def suite() -> dict[str, conformance.NodeCase]:
    return {c.name: c for c in conformance.collect()}


def test_slice_is_fixed_and_applicable(suite):
    assert len(SLICE) == len(set(SLICE)) >= 150
    missing = [n for n in SLICE if n not in suite]
    assert not missing, f"not in this onnx's node tests: {missing}"
    excluded = {n: suite[n].exclusion for n in SLICE if not suite[n].applicable}
    assert not excluded


def test_slice_passes(suite):
    outcomes = conformance.run([suite[n] for n in SLICE])
    bad = [f"{o.name}: {o.status}: {o.reason}" for o in outcomes if o.status != "passed"]
    assert not bad, "\n".join(bad)


# --- the applicability rule ---------------------------------------------------------------------------------


def _one_node(op, inputs, outputs, opset=17, domain="", **attrs):
    graph = oh.make_graph([oh.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=domain,
                                        **attrs)], "g", inputs, outputs)
    imports = [oh.make_opsetid("", opset)] + ([oh.make_opsetid(domain, 1)] if domain else [])
    return oh.make_model(graph, opset_imports=imports)


def _t(name, elem, shape=(2,)):
    return oh.make_tensor_value_info(name, elem, list(shape))


F, F16, D, BF16, S, I64 = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                           onnx.TensorProto.BFLOAT16, onnx.TensorProto.STRING, onnx.TensorProto.INT64)


def _dropout(ratio, training):
    """A training-mode Dropout node test: ratio and training_mode are graph inputs, their values test data."""
    inputs = [_t("x", F), oh.make_tensor_value_info("r", F, []), oh.make_tensor_value_info("t", onnx.TensorProto.BOOL,
                                                                                             [])]
    model = _one_node("Dropout", inputs, [_t("y", F)], opset=22)
    return model, [np.ones(2, np.float32), np.float32(ratio), np.bool_(training)]


@pytest.mark.parametrize("model,op,expected", [
    (_one_node("Relu", [_t("x", F)], [_t("y", F)]), "Relu", None),
    (_one_node("Relu", [_t("x", F16)], [_t("y", F16)], opset=23), "Relu", None),
    (_one_node("Relu", [_t("x", F)], [_t("y", F)], opset=28), "Relu", None),  # every opset onnx defines
    (_one_node("Relu", [_t("x", D)], [_t("y", D)]), "Relu", "dtype-wide: double"),
    (_one_node("Relu", [_t("x", BF16)], [_t("y", BF16)]), "Relu", "dtype-bfloat16"),
    (_one_node("Cast", [_t("x", F)], [_t("y", onnx.TensorProto.FLOAT8E4M3FN)], to=onnx.TensorProto.FLOAT8E4M3FN),
     "Cast", "dtype-none: float8e4m3fn"),
    (_one_node("Equal", [_t("x", S), _t("z", S)], [_t("y", onnx.TensorProto.BOOL)]), "Equal", "string"),
    (_one_node("RandomNormalLike", [_t("x", F)], [_t("y", F)]), "RandomNormalLike", "random: RandomNormalLike"),
    (_one_node("Binarizer", [_t("x", F)], [_t("y", F)], domain="ai.onnx.ml"), "Binarizer", "domain: ai.onnx.ml"),
    (_one_node("Momentum", [_t("x", F)], [_t("y", F)], domain="ai.onnx.preview.training"), "Momentum", "training"),
    (oh.make_model(oh.make_graph([oh.make_node("SequenceEmpty", [], ["s"])], "g", [],
                                 [oh.make_tensor_sequence_value_info("s", F, None)]),
                   opset_imports=[oh.make_opsetid("", 17)]), "SequenceEmpty", "non-tensor: sequence value"),
    (_one_node("Cast", [_t("x", F)], [_t("y", I64)], to=I64), "Cast", None),
])
def test_exclusion_rule(model, op, expected):
    got = conformance.exclusion(model, op)
    assert (got is None) if expected is None else (got is not None and got.startswith(expected)), got


@pytest.mark.parametrize("ratio,training,expected", [(0.5, True, "random"), (0.0, True, None), (0.5, False, None)])
def test_dropout_is_random_only_in_training_mode_with_a_ratio(ratio, training, expected):
    model, inputs = _dropout(ratio, training)
    got = conformance.exclusion(model, "Dropout", inputs)
    assert (got is None) if expected is None else got.startswith(expected), got


def test_every_exclusion_cites_a_rule(suite):
    """Each not-applicable case of the suite names one of conformance.RULES, and every rule is used (a rule no
    case needs is dead text in the document)."""
    cited = {conformance.rule_of(c.exclusion) for c in suite.values() if not c.applicable}
    assert cited <= set(conformance.RULES), cited - set(conformance.RULES)
    for c in suite.values():
        if not c.applicable:
            assert re.match(r"^[a-z0-9-]+: \S", c.exclusion), (c.name, c.exclusion)
    assert cited == set(conformance.RULES), set(conformance.RULES) - cited


def test_classification_of_the_suite(suite):
    """Every applicable case satisfies the rules, checked independently of exclusion(); every other one has a
    reason; with the pinned onnx the counts are those of the rules."""
    allowed = {F, F16, onnx.TensorProto.INT8, onnx.TensorProto.INT32, I64, onnx.TensorProto.UINT8,
               onnx.TensorProto.BOOL}
    for c in suite.values():
        if not c.applicable:
            assert c.exclusion
            continue
        assert {i.domain for i in c.model.opset_import} <= {"", "ai.onnx"}, c.name
        assert c.opset is not None and c.opset <= onnx.defs.onnx_opset_version(), c.name
        assert not re.match(r"Random|Bernoulli|Multinomial", c.op), c.name
        for vi in list(c.model.graph.input) + list(c.model.graph.output):
            assert vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in allowed, (c.name, vi.name)
    if onnx.__version__ == "1.23.2":
        assert len(suite) == 1884
        assert sum(c.applicable for c in suite.values()) == 1459
        assert sum(c.applicable for c in suite.values() if (c.opset or 0) > 23) == 282


def test_expanded_cases_count_under_their_op(suite):
    assert suite["test_softmax_axis_0_expanded"].op == "Softmax"
    assert suite["test_sce_mean_expanded"].op == "SoftmaxCrossEntropyLoss"


# --- the document --------------------------------------------------------------------------------------------


def test_render_gives_every_non_pass_a_reason():
    outcomes = [
        conformance.Outcome("test_a", "Abs", 13, True, None, "passed"),
        conformance.Outcome("test_b", "Abs", 13, True, None, "failed", "output 0: 1 of 4 elements exceed"),
        conformance.Outcome("test_c", "Foo", 13, True, None, "unsupported", "no lowering for Foo (opset 13)"),
        conformance.Outcome("test_d", "Abs", 25, False, "dtype-wide: double ('x')", "unsupported", "dtype double"),
    ]
    summary = conformance.summarize(outcomes)
    assert summary["applicable"]["cases"] == 3 and summary["applicable"]["passed"] == 1
    assert summary["applicable"]["percent"] == 33.3
    assert [f["op"] for f in summary["top_failures"]] == ["Abs", "Foo"]
    doc = conformance.render(summary, outcomes, 60.0)
    rows = [ln for ln in doc.splitlines() if ln.startswith("| test_")]
    assert [r.split(" | ")[0] for r in rows] == ["| test_b", "| test_c", "| test_d"]
    for o in outcomes[1:]:
        assert o.reason.replace("|", "\\|") in doc
    assert "| dtype-wide | 1 |" in doc and "| random | 0 |" in doc  # the rules table counts by rule


def test_committed_document_is_generated():
    text = conformance.DOCS.read_text()
    assert text.startswith("# ONNX conformance of graphconv.tools.backend")
    assert "Generated by `graphconv conformance`" in text
    m = re.search(r"\*\*applicable\*\* \| \*\*(\d+)\*\* \| \*\*(\d+) \(([\d.]+)%\)\*\*", text)
    assert m, "totals row missing"
    applicable, passed, percent = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert percent >= 90.0 and passed <= applicable


def test_cli_filter_json_leaves_the_document_alone():
    from click.testing import CliRunner

    from graphconv.cli import cli

    before = conformance.DOCS.read_text()
    result = CliRunner().invoke(cli, ["conformance", "--filter", "^test_(abs|sinh)$", "--json", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["summary"]["total"] == {"passed": 2, "failed": 0, "unsupported": 0, "cases": 2}
    assert sorted(c["name"] for c in data["cases"]) == ["test_abs", "test_sinh"]
    assert conformance.DOCS.read_text() == before


def test_check_uses_the_case_tolerance(suite):
    case = suite["test_abs"]
    (_, (expected,)) = case.data_sets[0]
    expected = np.asarray(expected)
    assert conformance.check(case, [[expected]]) == ""
    off = expected + np.float32(1e-3) * (np.abs(expected) + 1)
    assert "exceed atol=1e-07 + rtol=0.001" in conformance.check(case, [[off]])
    assert "dtype float64" in conformance.check(case, [[expected.astype(np.float64)]])
