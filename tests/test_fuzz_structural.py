"""Structure-aware fuzzing through the whole `graphconv compile` (issue 18), and the regression tests of the
defect classes it found.

Mutants (tests/structural_mutations.py): the shipped tiny Llama, a tiny BERT encoder and the zoo CNN, each with
one to three semantic changes (attributes, initializer dims/values/dtypes, input dims/dtypes, opset, wiring,
metadata), compiled with the real command line (`graphconv compile M.onnx -o OUT.mindir --target cpu -q`).
The contract per mutant: exit 0 with the MindIR written, or exit 1 with one line naming the problem and
nothing written; never exit 3, a traceback, a hang or a partial output; exit 2 (a valid mutant whose network
differs) is a bug unless shown to be onnxruntime's or MindSpore's.

    pytest tests/test_fuzz_structural.py                                  # the CI slice (seeds 0..23)
    GRAPHCONV_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_structural.py -k slice   # thousands
    GRAPHCONV_FUZZ_SEED=123 pytest tests/test_fuzz_structural.py -k replay       # one mutant, by its seed
    GRAPHCONV_FUZZ_HYPOTHESIS=200 pytest tests/test_fuzz_structural.py -k hypothesis  # hypothesis-driven
    python tests/structural_mutations.py replay 123 --keep /tmp/m123      # the same, keeping the mutant file
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import structural_mutations as sm

SLICE_START = int(os.environ.get("GRAPHCONV_FUZZ_SEED_START", "0"))
SLICE_COUNT = int(os.environ.get("GRAPHCONV_FUZZ_EXAMPLES", "24"))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The three base models; BERT and the CNN exported once per session (or taken from
    GRAPHCONV_FUZZ_CACHE)."""
    if not os.environ.get("GRAPHCONV_FUZZ_CACHE"):
        os.environ["GRAPHCONV_FUZZ_CACHE"] = str(tmp_path_factory.mktemp("fuzz-bases"))
    return {name: sm.base_path(name) for name in sm.BASES}


@pytest.fixture(scope="module")
def runner(bases):
    r = sm.Runner(timeout=float(os.environ.get("GRAPHCONV_FUZZ_TIMEOUT", "300")))
    yield r
    r.close()


def _assert_contract(mutant: sm.Mutant, outcome: sm.Outcome, bad: list[str]) -> None:
    assert not bad, (f"seed {mutant.seed}: {outcome.label} in {outcome.seconds:.1f}s: {'; '.join(bad)}\n"
                     f"mutant: {mutant.describe()}\n"
                     f"replay: GRAPHCONV_FUZZ_SEED={mutant.seed} pytest tests/test_fuzz_structural.py -k replay "
                     f"(or python tests/structural_mutations.py replay {mutant.seed} --keep DIR)")


@pytest.mark.parametrize("seed", range(SLICE_START, SLICE_START + SLICE_COUNT), ids=lambda s: f"seed{s}")
def test_fuzz_slice(runner, tmp_path, seed):
    """The seeded CI slice: every mutant keeps the contract."""
    mutant = sm.from_seed(seed)
    outcome, bad = sm.run_mutant(runner, mutant, tmp_path)
    _assert_contract(mutant, outcome, bad)


@pytest.mark.skipif(not os.environ.get("GRAPHCONV_FUZZ_SEED"), reason="set GRAPHCONV_FUZZ_SEED=N to replay a mutant")
def test_replay(runner, tmp_path):
    seed = int(os.environ["GRAPHCONV_FUZZ_SEED"])
    mutant = sm.from_seed(seed)
    outcome, bad = sm.run_mutant(runner, mutant, tmp_path)
    print(mutant.describe(), outcome.label, outcome.stderr)
    _assert_contract(mutant, outcome, bad)


@pytest.mark.skipif(not os.environ.get("GRAPHCONV_FUZZ_HYPOTHESIS"),
                    reason="set GRAPHCONV_FUZZ_HYPOTHESIS=N for N hypothesis-driven mutants")
def test_fuzz_hypothesis(runner):
    """Hypothesis drives the same generator (and shrinks a failing mutant's choices)."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=int(os.environ.get("GRAPHCONV_FUZZ_HYPOTHESIS", "0")), deadline=None, database=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(sm.mutants())
    def check(mutant):
        with tempfile.TemporaryDirectory() as tmp:
            outcome, bad = sm.run_mutant(runner, mutant, Path(tmp))
        _assert_contract(mutant, outcome, bad)

    check()


def test_generator_is_deterministic_and_varied(bases):
    """A seed names one mutant (the replay key); the slice covers every base and most mutation kinds."""
    a, b = sm.from_seed(7), sm.from_seed(7)
    assert a.mutations == b.mutations and a.model.SerializeToString() == b.model.SerializeToString()
    drawn = [sm.from_seed(s) for s in range(200)]
    assert {m.base for m in drawn} == set(sm.BASES)
    assert {k for m in drawn for k in m.kinds} >= set(sm.KINDS) - {"value_dtype"} | {"input_dtype"}


# --- regressions: one per defect class the fuzzer found, each built from its mutant ------------------
def _compile(runner, model: onnx.ModelProto, tmp_path: Path) -> sm.Outcome:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return runner.compile(path, tmp_path)


def _refused(outcome: sm.Outcome, phrase: str) -> str:
    """Exit 1, one line, naming the problem, nothing written."""
    assert not sm.violations(outcome) and outcome.code == 1, (outcome.label, outcome.stderr)
    line = outcome.stderr.strip()
    assert phrase in line, line
    return line


def test_zero_sized_input_dims_verify_or_are_refused_naming_the_input(runner, bases, tmp_path):
    """Seed 149 (tiny Llama, attention_mask batch fixed to 0): IndexError in the mask padding; the CNN with batch
    0 ran in onnxruntime, then MindSpore refused it (PadV3: "output size must be greater than 0"), exit 3.
    Zero-sized inputs are not refused up front (onnx's empty-set reductions verify: test_conformance), but
    MindSpore refusing such a network is the input's fault: exit 1 naming the input."""
    m = sm.base_model("tiny_llama")
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 0
    outcome = _compile(runner, m, tmp_path)
    assert outcome.code in (0, 1) and not sm.violations(outcome), (outcome.label, outcome.stderr)
    cnn = sm.base_model("cnn")
    cnn.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 0
    line = _refused(_compile(runner, cnn, tmp_path / "cnn"), "has a dim of size 0 (axis 0)")
    assert "graph input 'image'" in line and "MindSpore" in line


def test_huge_input_dim_is_refused_before_allocation(runner, bases, tmp_path):
    """Seeds 199, 222 (and the issue's 10^9): MemoryError allocating the reference inputs (80 GiB, 24 TiB), or
    the OOM killer. Refused with the size it would need, before anything allocates it (the fork server caps the
    address space at 6 GiB, so an allocation would have shown as a MemoryError)."""
    m = sm.base_model("tiny_llama")
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 10**9
    line = _refused(_compile(runner, m, tmp_path), "would need 22.4 GiB")
    assert "input_ids [3, 1000000000] int64" in line


def test_huge_intermediate_is_refused_before_allocation(bases):
    """Fixed dims that keep the reference inputs under their bound but make a computed tensor huge: the CNN at
    5000 x 5000 pixels takes 858 MiB of input (batch 3) and its first convolution makes 16 channels of that,
    4.5 GiB. Refused from the inferred shapes, before onnxruntime allocates anything."""
    from graphconv.errors import UnsupportedError
    from graphconv.frontend.load import infer_shapes
    from graphconv.verify import reference

    m = sm.base_model("cnn")
    dims = m.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value, dims[3].dim_value = 5000, 5000
    del m.graph.value_info[:]
    m = infer_shapes(m, Path("m.onnx"))
    with pytest.raises(UnsupportedError, match=r"would be \[3, 16, 5000, 5000\] float32, 4\.5 GiB"):
        reference.make_cases(m)


def test_gather_axis_out_of_range_is_the_oracles_one_line(runner, bases, tmp_path):
    """The issue's Gather axis out of range: IndexError in the reference-input bounds (exit 3). Now onnxruntime's
    refusal of the model, without the hint about related dims (the inputs are not the problem)."""
    m = sm.base_model("bert")
    gather = next(n for n in m.graph.node if n.op_type == "Gather")
    next(a for a in gather.attribute if a.name == "axis").i = 5
    line = _refused(_compile(runner, m, tmp_path), "axis must be in [-r, r-1]")
    assert "--dim" not in line


def test_value_info_contradicting_the_graph_is_dropped(runner, bases, tmp_path):
    """Seed 73 (BERT, value_info of add_269 declared [0]): lenient shape inference kept the declared rank 1,
    refine-shapes then indexed past it (IndexError, exit 3). A value_info is a hint (onnxruntime overrides it;
    onnxruntime-genai's builder writes contradicting ones for its Constants): strict inference finds the
    contradiction, the hint is dropped with a note, and the model verifies. A graph output's declared shape
    that contradicts the graph is the model's interface: refused, naming the node."""
    m = sm.base_model("bert")
    vi = next(v for v in m.graph.value_info if v.name == "add_269")
    vi.type.tensor_type.shape.Clear()
    vi.type.tensor_type.shape.dim.add().dim_value = 0
    outcome = _compile(runner, m, tmp_path / "hint")
    assert outcome.code == 0 and not sm.violations(outcome), (outcome.label, outcome.stderr)
    from graphconv.frontend.load import infer_shapes

    notes = []
    infer_shapes(m, Path("m.onnx"), notes)
    assert len(notes) == 1 and "'add_269' contradicts the graph" in notes[0]
    assert "differ in rank: (3) vs (1)" in notes[0]
    out = sm.base_model("bert")
    out.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 7  # rank 4 for a rank-3 output
    _refused(_compile(runner, out, tmp_path / "output"), "a declared type contradicts the graph")


def test_value_info_contradicting_an_initializer_is_dropped():
    """transformers' exporter with ort_fusions declares its `unfused_attention_*_scale` initializer, dims [1], as a
    scalar: strict inference failed without naming a node ("differ in rank: (1) vs (0)"), and the compile with it.
    The initializer is the value: the hint goes, with a note."""
    from graphconv.frontend.load import infer_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    g = helper.make_graph([helper.make_node("Mul", ["x", "scale"], ["y"])], "g", [x], [y],
                          [numpy_helper.from_array(np.array([0.5], np.float32), "scale")],
                          value_info=[helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    notes = []
    inferred = infer_shapes(m, Path("m.onnx"), notes)
    assert notes == ["value_info of initializer 'scale' contradicts its dims [1]: ignored"]
    assert [d.dim_param for d in inferred.graph.output[0].type.tensor_type.shape.dim][0] == "n"


def test_declared_dtype_contradiction_names_the_dtypes(runner, bases, tmp_path):
    """An input declared bfloat16 where the graph's value_info says int64 (the issue's bf16 input on the
    Llama): one line naming both dtypes."""
    m = sm.base_model("tiny_llama")
    m.graph.input[1].type.tensor_type.elem_type = TensorProto.BFLOAT16
    line = _refused(_compile(runner, m, tmp_path), "a declared type contradicts the graph")
    assert "(BFLOAT16) vs (INT64)" in line


def _cast_model(dtype: int, rest: list | None = None, opset: int = 18) -> onnx.ModelProto:
    nodes = ([helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT)]
             + (rest or [helper.make_node("Relu", ["c"], ["y"])]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_bfloat16_input_and_output_reach_mindspore_and_back(runner, tmp_path):
    """The issue's bf16 input: the cpu run got the case as numpy.void (np.savez writes ml_dtypes' bfloat16 as
    2-byte void), "initializing tensor by numpy array failed" (exit 3); a bf16 output came back as void too
    ("setting an array element with a sequence", exit 3). Both verify now."""
    outcome = _compile(runner, _cast_model(TensorProto.BFLOAT16), tmp_path / "in")
    assert outcome.code == 0 and not sm.violations(outcome), (outcome.label, outcome.stderr)
    to_bf16 = [helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Cast", ["r"], ["y"], to=TensorProto.BFLOAT16)]
    model = _cast_model(TensorProto.FLOAT, to_bf16)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    outcome = _compile(runner, model, tmp_path / "out")
    assert outcome.code == 0 and not sm.violations(outcome), (outcome.label, outcome.stderr)


def test_bfloat16_compute_on_cpu_is_refused_with_the_reason(runner, bases, tmp_path):
    """A bf16 attention mask flowing into ops MindSpore's CPU has no bf16 kernels for (ExpandDims): an
    unsupported model on this target (exit 1), not an internal error."""
    m = sm.base_model("bert")
    del m.graph.value_info[:]
    m.graph.input[1].type.tensor_type.elem_type = TensorProto.BFLOAT16
    _refused(_compile(runner, m, tmp_path), "the model computes in bfloat16")


def test_nan_epsilon_is_refused(runner, bases, tmp_path):
    """The issue's LayerNormalization epsilon NaN. MindSpore 2.10's graph compiler folds `x + NaN` and `x * NaN`
    (a constant that is all NaN) into x, so the network returned finite values where onnxruntime gives NaN (exit
    2): refused in the lowering, naming the node."""
    m = sm.base_model("bert")
    ln = next(n for n in m.graph.node if n.op_type == "LayerNormalization")
    next(a for a in ln.attribute if a.name == "epsilon").f = math.nan
    line = _refused(_compile(runner, m, tmp_path), "with a constant that is all NaN")
    assert f"node {ln.name!r} (LayerNormalization)" in line


def test_layernorm_axis_out_of_range_is_refused(runner, bases, tmp_path):
    """Seed 2081 (BERT, a LayerNormalization axis of 2**31): onnxruntime ran it, and fuse-layernorm took
    2**31 % 3 == 2 for the last axis, so the network normalised what onnxruntime did not (exit 2). The fusion
    now refuses it (passes.match.last_axis) and the lowering names it."""
    m = sm.base_model("bert")
    ln = next(n for n in m.graph.node if n.op_type == "LayerNormalization")
    next(a for a in ln.attribute if a.name == "axis").i = 2**31
    line = _refused(_compile(runner, m, tmp_path), "axis 2147483648 is out of range for rank 3")
    assert f"node {ln.name!r} (LayerNormalization)" in line


def test_conv_attribute_lengths_are_checked(runner, bases, tmp_path):
    """Seed 240 (CNN, dilations [1] on a 2-D Conv): onnxruntime ran it, mindspore.export refused the network
    ("attr 'dilation' must be ... a tuple of two or four positive int numbers"), exit 3."""
    m = sm.base_model("cnn")
    conv = [n for n in m.graph.node if n.op_type == "Conv"][1]
    dil = next(a for a in conv.attribute if a.name == "dilations")
    del dil.ints[:]
    dil.ints.append(1)
    _refused(_compile(runner, m, tmp_path), "dilations [1] must be 2 integers >= 1")


def test_library_warnings_stay_off_stderr(runner, bases, tmp_path):
    """Seed 147 (CNN, a bias of 3e38 and two swapped edges): numpy's "RuntimeWarning: overflow encountered in
    reduce" was printed before the one error line."""
    m = sm.base_model("cnn")
    for t in m.graph.initializer:
        if t.name == "features.3.weight_bias":
            t.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(t).shape, 3e38, np.float32), t.name))
    nodes = {n.name: n for n in m.graph.node}
    a, b = nodes["node_Reshape_49"], nodes["node_linear"]
    a.input[0], b.input[1] = b.input[1], a.input[0]
    outcome = _compile(runner, m, tmp_path)
    assert outcome.code == 1 and not sm.violations(outcome), outcome.stderr


def test_op_newer_than_the_opset_is_named_as_such(bases, tmp_path):
    """Seeds 89, 137, 355 (tiny Llama at opset 11): "1 onnxruntime contrib op(s) graphconv does not lower:
    LessOrEqual": onnxruntime registers every standard op, so an op of opset 12 in an opset-11 model looked like a
    contrib op. It is named as an op the model's opset does not have."""
    from graphconv.errors import UnsupportedError
    from graphconv.frontend.load import load

    m = sm.base_model("tiny_llama")
    next(i for i in m.opset_import if i.domain in ("", "ai.onnx")).version = 11
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    with pytest.raises(UnsupportedError, match=r"^op LessOrEqual does not exist at opset 11 \(onnx defines it from "
                                               r"opset 12\); 1 such op\(s\): LessOrEqual$"):
        load(path)


def test_overflow_on_both_sides_is_told_apart_from_a_difference():
    """A comparison that fails only where both runtimes are inf/NaN (of different kinds: an overflowing sum is
    +inf or NaN depending on its order) is `overflow`, which the compile reports as unverifiable (exit 1);
    a finite value where the reference is NaN is a real difference (exit 2)."""
    from graphconv.verify.compare import compare

    both = compare(np.array([np.inf, np.nan, 1.0], np.float32), np.array([np.nan, -np.inf, 1.0], np.float32))
    assert not both.ok and both.overflow
    one = compare(np.array([0.0, np.nan], np.float32), np.array([np.nan, np.nan], np.float32))
    assert not one.ok and not one.overflow
    off = compare(np.array([np.inf, 2.0], np.float32), np.array([np.nan, 1.0], np.float32))
    assert not off.ok and not off.overflow  # a finite element off too: not only overflow


def test_rounding_at_the_end_of_float32s_range_is_told_apart_from_a_difference(runner, bases, tmp_path):
    """Seed 1534 (BERT, its last LayerNormalization weight set to 3e38): the normalised values' float32
    rounding (~1e-7) times 3e38 made onnxruntime and MindSpore differ by 1.9e32 near zero, 5.7e-7 of the
    output's magnitude (exit 2). Failures within 1e-6 of a tensor at 1e30 or more are rounding at the end of
    the range (`overflow`): the compile says it cannot verify (exit 1). A larger difference there, or one at
    an ordinary magnitude, is still a difference."""
    from graphconv.verify.compare import compare

    edge = compare(np.array([3e38, 1e32], np.float32), np.array([3e38, 0.0], np.float32))
    assert not edge.ok and edge.overflow
    wrong = compare(np.array([3e38, 1e37], np.float32), np.array([3e38, 0.0], np.float32))
    assert not wrong.ok and not wrong.overflow
    ordinary = compare(np.array([3e10, 1e4], np.float32), np.array([3e10, 0.0], np.float32))
    assert not ordinary.ok and not ordinary.overflow
    m = sm.base_model("bert")
    ln = [n for n in m.graph.node if n.op_type == "LayerNormalization"][-1]
    gamma = next(t for t in m.graph.initializer if t.name == ln.input[1])
    gamma.CopyFrom(onnx.numpy_helper.from_array(np.full(onnx.numpy_helper.to_array(gamma).shape, 3e38, np.float32),
                                                gamma.name))
    _refused(_compile(runner, m, tmp_path), "cannot verify: the model overflows on the reference inputs")


def test_invalid_reshape_target_is_refused(runner, bases, tmp_path):
    """Seed 1688 (CNN, the flattening Reshape's target [-2147483648, 32]) and seed 1575 (tiny Llama, a -5 in a
    computed target): onnxruntime refused the model, onnx.reference (the fallback oracle, numpy's reshape) took
    the -5 for a -1, and MindSpore then refused the network: exit 3. A constant target is refused in the lowering;
    where MindSpore refuses a network of a model onnxruntime refused too, that is the model's fault (exit 1)."""
    m = sm.base_model("cnn")
    t = next(t for t in m.graph.initializer if t.name == "val_37")
    t.CopyFrom(numpy_helper.from_array(np.array([-2**31, 32], np.int64), t.name))
    _refused(_compile(runner, m, tmp_path / "const"), "shape [-2147483648, 32]: one -1 at most")
    m = sm.base_model("tiny_llama")
    t = next(t for t in m.graph.initializer if t.name == "val_212")
    t.CopyFrom(numpy_helper.from_array(np.array([-5], np.int64), t.name))
    line = _refused(_compile(runner, m, tmp_path / "computed"), "can't be less than -1")
    assert "onnxruntime could not run the model" in line
