"""Reference inputs that respect the relations between symbolic dims (graphconv/verify/dims.py): written as
expressions (`past + seq`), or implied by the graph (a mask added to scores over the cached keys); and the
user's --inputs checked against the declared dtypes, dims and relations before anything runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import graphconv
from graphconv.errors import InputError, UnsupportedError
from graphconv.verify import dims, reference

VOCAB, H = 16, 8


def _step_graph(mask_dim: str) -> onnx.ModelProto:
    """A decode step as an exporter writes it: ids [batch, seq] embed to q/k, the cached keys [batch, past, H]
    grow by k (Concat), the scores over past + seq keys get the mask [batch, mask_dim] added."""
    rng = np.random.default_rng(0)
    m = helper.make_node
    nodes = [m("Gather", ["emb", "input_ids"], ["h"]),
             m("MatMul", ["h", "wq"], ["q"]), m("MatMul", ["h", "wk"], ["k"]),
             m("Concat", ["past_key", "k"], ["present_key"], axis=1),
             m("Transpose", ["present_key"], ["kt"], perm=[0, 2, 1]),
             m("MatMul", ["q", "kt"], ["scores"]),
             m("Unsqueeze", ["attention_mask", "ax1"], ["m3"]), m("Cast", ["m3"], ["mf"], to=T.FLOAT),
             m("Sub", ["one", "mf"], ["inv"]), m("Mul", ["inv", "big"], ["bias"]),
             m("Add", ["scores", "bias"], ["masked"]), m("Softmax", ["masked"], ["p"], axis=-1),
             m("MatMul", ["p", "present_key"], ["out"])]
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, H)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), "wq"),
             numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), "wk"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "big")]
    g = helper.make_graph(nodes, "step", [helper.make_tensor_value_info("input_ids", T.INT64, ["batch", "seq"]),
                                          helper.make_tensor_value_info("attention_mask", T.INT64, ["batch", mask_dim]),
                                          helper.make_tensor_value_info("past_key", T.FLOAT, ["batch", "past", H])],
                          [helper.make_tensor_value_info("out", T.FLOAT, ["batch", "seq", H]),
                           helper.make_tensor_value_info("present_key", T.FLOAT, ["batch", None, H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _shapes(case):
    return {k: v.shape for k, v in case.inputs.items()}


@pytest.mark.parametrize("mask_dim", ["past + seq", "total"])  # written / implied by the graph
def test_generated_cases_give_the_mask_past_plus_seq(mask_dim):
    model = _step_graph(mask_dim)
    names = ["batch", "seq", mask_dim, "past"]
    assert ast_text(dims.relations(names, model)) == {mask_dim: "past + seq"}
    if mask_dim == "total":  # implied: only the graph says so
        assert dims.relations(names) == {}
    cases = reference.make_cases(model)
    for case in cases:
        s = _shapes(case)
        assert s["attention_mask"][1] == s["past_key"][1] + s["input_ids"][1]
    assert {_shapes(c)["past_key"][1] for c in cases} == {9, 6}  # two different past lengths
    out = reference.Oracle(model).run(cases)
    assert out[1]["present_key"].shape[1] == _shapes(cases[1])["attention_mask"][1]


def ast_text(derived):
    import ast

    return {k: ast.unparse(v) for k, v in derived.items()}


def test_compile_verifies_a_step_graph_without_inputs(tmp_path):
    path = tmp_path / "step.onnx"
    onnx.save(_step_graph("total"), path)
    report = graphconv.compile(path, tmp_path / "step.mindir", target="cpu")
    assert report.status == "verified" and len(report.validation["cases"]) == 2


def test_a_dynamo_decode_step_with_an_unrelated_mask_symbol_compiles(tmp_path):
    """torch.export cannot write past + seq for the mask (only `dim + int`): it names the mask's length with
    a symbol of its own (`s53`); the graph implies the relation."""
    torch = pytest.importorskip("torch")

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.q, self.k = torch.nn.Embedding(VOCAB, H), torch.nn.Linear(H, H), torch.nn.Linear(H, H)

        def forward(self, input_ids, attention_mask, past_key):
            h = self.emb(input_ids)
            keys = torch.cat([past_key, self.k(h)], dim=1)
            scores = self.q(h) @ keys.transpose(1, 2) + (1.0 - attention_mask[:, None, :].float()) * -1e4
            return scores.softmax(-1) @ keys, keys

    b, s, p = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
    path = tmp_path / "step.onnx"
    torch.onnx.export(Step().eval(), (torch.randint(0, VOCAB, (2, 3)), torch.ones(2, 7, dtype=torch.int64),
                                      torch.randn(2, 4, H)), path, dynamo=True, opset_version=18,
                      input_names=["input_ids", "attention_mask", "past_key"], output_names=["out", "present_key"],
                      dynamic_shapes={"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: torch.export.Dim.DYNAMIC},
                                      "past_key": {0: b, 1: p}})
    mask_dim = onnx.load(path).graph.input[1].type.tensor_type.shape.dim[1].dim_param
    assert mask_dim not in ("past + seq", "seq + past")  # a symbol of its own
    report = graphconv.compile(path, tmp_path / "step.mindir", target="cpu")
    assert report.status == "verified"


def test_a_dim_derived_from_others_cannot_be_set():
    with pytest.raises(InputError, match=r"--dim total: that dim is past \+ seq; give sizes for past, seq"):
        reference.make_cases(_step_graph("total"), dim_overrides={"total": (4, 5)})


def _save(tmp_path, **arrays):
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("change, message", [
    (dict(input_ids=np.zeros((2, 3), np.float32)),
     r"input_ids is float32, the model declares int64 \['batch', 'seq'\]"),
    (dict(attention_mask=np.ones((2, 8), np.int64)),
     r"attention_mask dim 1 is 8, but dim 'total' must be past \+ seq = 7 \(past = 4, seq = 3\)"),
    (dict(past_key=np.zeros((3, 4, H), np.float32)), r"dim 'batch' differs between inputs: input_ids dim 0 is 2"),
    (dict(input_ids=np.full((2, 3), VOCAB, np.int64)),
     r"input_ids holds ids 16\.\.16, but the table it indexes has 16"),
])
def test_user_inputs_are_checked_before_anything_runs(tmp_path, change, message):
    good = dict(input_ids=np.zeros((2, 3), np.int64), attention_mask=np.ones((2, 7), np.int64),
                past_key=np.zeros((2, 4, H), np.float32))
    model_path = tmp_path / "step.onnx"
    onnx.save(_step_graph("total"), model_path)
    assert graphconv.compile(model_path, tmp_path / "ok.mindir", target="cpu",
                             inputs=(_save(tmp_path, **good),)).status == "verified"
    with pytest.raises(InputError, match=message):
        graphconv.compile(model_path, tmp_path / "m.mindir", target="cpu",
                          inputs=(_save(tmp_path, **{**good, **change}),))
    assert not (tmp_path / "m.mindir").exists()


def _related(tmp_path, extra: int):
    """b is reshaped to the shape of a (`extra` 0) or of a with `extra` more elements: the graph runs only when
    len_b == len_a + extra, which neither the dim names nor the shape inference say."""
    m = helper.make_node
    nodes = [m("Concat", ["a", "pad"], ["a2"], axis=0), m("Shape", ["a2"], ["sa"]), m("Reshape", ["b", "sa"], ["b2"]),
             m("Add", ["a2", "b2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", T.FLOAT, ["len_a"]),
                                       helper.make_tensor_value_info("b", T.FLOAT, ["len_b"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["len_y"])],
                          [numpy_helper.from_array(np.zeros(extra, np.float32), "pad")])
    path = tmp_path / f"g{extra}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_a_relation_nothing_states_gets_a_hint_naming_the_dims(tmp_path, capfd):
    """len_b must be len_a + 1: the sizes chosen (5 and 9), then at multiples of 32, 64 and 256, all fail; the
    refusal names every size tried and how to choose them."""
    path = _related(tmp_path, 1)
    with pytest.raises(UnsupportedError, match=r"the generated inputs had len_a = 5, len_b = 9; then len_a = 32, "
                                               r"len_b = 32; then len_a = 64, len_b = 64; then len_a = 256, "
                                               r"len_b = 256: .* --dim NAME=A,B"):
        graphconv.compile(path, tmp_path / "g.mindir", target="cpu")
    assert "E:onnxruntime" not in capfd.readouterr().err  # its own log stays quiet (unless --debug)
    report = graphconv.compile(path, tmp_path / "g.mindir", target="cpu", dims={"len_a": (4, 6), "len_b": (5, 7)})
    assert report.status == "verified"


def test_equal_dims_run_at_multiples_of_32(tmp_path):
    """len_b must equal len_a: at 5 and 9 onnxruntime refuses, at multiples of 32 (both 32, then both 64) the
    graph runs; the report says which sizes ran."""
    report = graphconv.compile(_related(tmp_path, 0), tmp_path / "g.mindir", target="cpu")
    assert report.status == "verified"
    assert [tuple(c["inputs"].values()) for c in report.validation["cases"]] == [([32], [32]), ([64], [64])]
    assert any("they ran at multiples of 32: len_a = 32, len_b = 32 and len_a = 64, len_b = 64" in w
               for w in report.warnings)


@pytest.mark.parametrize("stride", [32, 64])
def test_an_input_that_takes_a_stride_runs_at_its_multiples(tmp_path, stride):
    """A model that folds its width into rows of `stride` (as a detector downsamples by 32, or an OCR model's
    width by 4 x 16): the usual sizes fail in onnxruntime; multiples of 32, then of 64, are tried, and the first
    that runs verifies the compile. The batch keeps its sizes."""
    m = helper.make_node
    g = helper.make_graph([m("Reshape", ["x", "rows"], ["r"]), m("ReduceSum", ["r", "ax"], ["y"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, ["batch", "width"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["batch", "n"])],
                          [numpy_helper.from_array(np.array([0, -1, stride], np.int64), "rows"),
                           numpy_helper.from_array(np.array([2], np.int64), "ax")])
    path = tmp_path / "fold.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    report = graphconv.compile(path, tmp_path / "fold.mindir", target="cpu")
    assert report.status == "verified"
    assert [tuple(c["inputs"]["x"]) for c in report.validation["cases"]] == [(3, stride), (5, 2 * stride)]
    assert any(f"they ran at multiples of {stride}: batch = 3, width = {stride}" in w for w in report.warnings)
    # (onnx.reference failed too at the first sizes; the outputs compared are onnxruntime's, and the report says so)
    assert report.validation["oracle"] == "onnxruntime"
    assert not any("onnx.reference" in w for w in report.warnings), report.warnings


def test_a_dim_declared_negative_is_read_as_dynamic(tmp_path):
    """paddle2onnx and old exporters declare "any size" as dim_value -1: the reference-input generator failed on
    it (numpy: negative dimensions are not allowed, exit 3). It is read as an unnamed dynamic dim, as onnxruntime
    reads it, with a warning, and verifies at two sizes of it."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [-1, 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [-1, 4])])
    path = tmp_path / "neg.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    report = graphconv.compile(path, tmp_path / "neg.mindir")
    assert report.status == "verified"
    assert "'x' declares a negative dim at axis 0: read as a dynamic dim" in report.warnings
    sizes = {tuple(case["inputs"]["x"]) for case in report.validation["cases"]}
    assert len(sizes) == 2 and all(s[1] == 4 for s in sizes)


def test_sizes_too_small_for_the_models_downsampling_are_raised_to_a_stride(tmp_path):
    """A classifier pooling its image by 32, its height and width declared `?` (paddle2onnx writes such): at the
    generated sizes (5 x 9) the window is larger than the image. onnxruntime and ONNX's shape inference still give
    an output of 1 (their division truncates), MindSpore refuses an output of 0: an internal error before. A window
    larger than its input sends the sizes to multiples of 32, where the network verifies; the report says so."""
    m = helper.make_node
    g = helper.make_graph([m("MaxPool", ["x"], ["p"], kernel_shape=[32, 32], strides=[32, 32]),
                           m("Flatten", ["p"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 2, None, None])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, None])])
    path = tmp_path / "pool.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)]), path)
    report = graphconv.compile(path, tmp_path / "pool.mindir", target="cpu")
    assert report.status == "verified"
    assert [tuple(c["inputs"]["x"]) for c in report.validation["cases"]] == [(1, 2, 32, 32), (1, 2, 64, 64)]
    assert any("smaller than the window of" in w and "(window 32 over 5)" in w and "they ran at multiples of 32" in w
               for w in report.warnings)


def test_the_search_for_sizes_never_falls_back_to_the_reference_evaluator():
    """A retry at multiples of 32 or 64 takes onnxruntime's answer only: its fallback, onnx.reference, ran an OCR
    model's convolutions at 128 x 128 through im2col into 22 GiB (killed by the kernel). Erf in float64 has no
    onnxruntime kernel: the oracle's fallback computes it, the search's run refuses."""
    g = helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.DOUBLE, ["n"])],
                          [helper.make_tensor_value_info("y", T.DOUBLE, ["n"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    cases = reference.make_cases(model)
    oracle = reference.Oracle(model)
    with pytest.raises(UnsupportedError, match="onnxruntime could not run the model"):
        oracle.run(cases, fallback=False)
    assert oracle.fallback_reason is None
    from math import erf
    (out,) = [o["y"] for o in oracle.run(cases[:1])]
    assert oracle.name == "onnx.reference"
    np.testing.assert_allclose(out, [erf(v) for v in cases[0].inputs["x"]], rtol=1e-6)  # (its Erf: float32)


def test_a_window_no_stride_fills_is_one_line_naming_it(tmp_path):
    """An average pool of window and stride 600 behind a Reshape to a computed shape (onnx's inference cannot
    size the pool's input: the sizes come from onnxruntime's run of each case) is larger than its input at the
    generated sizes and at multiples of 32, 64 and 256, where onnxruntime still pools to 1 (its division truncates):
    exit 1 naming the window and the dim to give (the input's dim at the window's axis), before any lowering
    (MindSpore refuses the window)."""
    m = helper.make_node
    nodes = [m("Shape", ["x"], ["s"]), m("Greater", ["s", "zero"], ["pos"]),
             m("Compress", ["s", "pos"], ["si"], axis=0), m("Reshape", ["x", "si"], ["r"]),
             m("AveragePool", ["r"], ["y"], kernel_shape=[600], strides=[600])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, ["batch", 1, "width"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["batch", 1, "pooled"])],
                          [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    path = tmp_path / "pool.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    expected = (r"smaller than the window of AveragePool_4 \(window 600 over \d+\) at .*then batch = 3, width = 256: "
                r"--dim 'width=A,B' for the input dim the window runs along \(the sizes the model takes\)")
    with pytest.raises(UnsupportedError, match=expected) as e:
        graphconv.compile(path, tmp_path / "pool.mindir", target="cpu")
    assert "\n" not in str(e.value)


def test_an_integer_input_compared_with_a_constant_gets_that_constant():
    """silero-vad's `sr`: Equal(sr, 16000) chooses the 16 kHz branch; fed a random small integer, the run took
    the other branch, which the model is not made for. Both cases feed the constant; another integer input
    stays random."""
    m = helper.make_node
    g = helper.make_graph(
        [m("Equal", ["sr", "khz16"], ["is16"]), m("Cast", ["is16"], ["f"], to=T.FLOAT), m("Mul", ["x", "f"], ["y"]),
         m("Add", ["n", "n"], ["n2"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, ["batch", 4]), helper.make_tensor_value_info("sr", T.INT64, []),
         helper.make_tensor_value_info("n", T.INT64, [1])],
        [helper.make_tensor_value_info("y", T.FLOAT, ["batch", 4]), helper.make_tensor_value_info("n2", T.INT64, [1])],
        [numpy_helper.from_array(np.array(16000, np.int64), "khz16")])
    cases = reference.make_cases(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    assert [int(c.inputs["sr"]) for c in cases] == [16000, 16000]
    assert all(c.inputs["n"][0] < reference.DEFAULT_INT_HIGH for c in cases)


def test_the_selector_search_reads_no_weight(tmp_path):
    """Only one-element initializers are read to find the constants an input is compared with: a weight in an
    external file stays unread (a held KV cache's zeros are such a file, with an absolute path, which onnx
    refuses to read: compile-past failed with exit 3 before this)."""
    m = helper.make_node
    g = helper.make_graph([m("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["n", 4])],
                          [numpy_helper.from_array(np.ones((4, 4), np.float32), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = onnx.TensorProto.EXTERNAL
    w.external_data.add(key="location", value=str(tmp_path / "absent.bin"))  # absolute, and not there
    cases = reference.make_cases(model)
    assert [c.inputs["x"].shape for c in cases] == [(3, 4), (5, 4)]


def test_an_rnn_states_unnamed_batch_takes_the_batch_sizes():
    """silero-vad's inputs: audio [?, ?] and its LSTM state [2, ?, 128], the batch unnamed in both and nothing
    in the graph onnx's inference reads to relate them. The state's one dynamic dim, between static layers and
    hidden sizes, is the batch: both cases give it the audio's batch (before, it took an unrelated size and
    onnxruntime refused every case)."""
    m = helper.make_node
    g = helper.make_graph([m("ReduceSum", ["audio"], ["a"], keepdims=0), m("ReduceSum", ["state"], ["s"], keepdims=0),
                           m("Add", ["a", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("audio", T.FLOAT, [None, None]),
                           helper.make_tensor_value_info("state", T.FLOAT, [2, None, 128])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [])])
    cases = reference.make_cases(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [c.inputs["state"].shape[1] for c in cases] == [c.inputs["audio"].shape[0] for c in cases] \
        == list(reference.BATCH_SIZES)
    assert [c.inputs["audio"].shape[1] for c in cases] != list(reference.BATCH_SIZES)
