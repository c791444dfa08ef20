"""A compiled MindIR loads like MindSpore's own exports (issue 13 item 4).

`nn.GraphCell(mindspore.load(path))(*inputs)` runs at two different shapes in a row on one GraphCell with no
`set_inputs`, matching onnxruntime by the comparison rule, and no emitted graph (cpu or ascend) holds `raise`
or other residue of Python checks. What broke it (mindspore 2.10):

- `ops.split(x, sizes, axis)` checks `sum(sizes) == x.shape[axis]` in Python; where the dim is unknown at
  compile time graph mode compiles the check into Switch/raise nodes. A loaded graph is re-inferred at every
  new input shape and `raise` has no shape inference: "primitive name: raise". On fp16 the Reshape after such a
  split fails on CPU besides (GPT-2 after onnxsim at --precision fp16: "For 'Reshape', the size of 'input_x':
  {3840} is not equal to the size of the first output: {1920}").
- A shape *tensor* given to an op that takes a shape (ops.reshape, ops.zeros, ...) becomes a tuple of unknown
  length, which that re-inference cannot follow: the nodes after it keep the first call's shapes and the
  second shape fails in a Reshape (or silently returns the first shape's size).

The MindIR runs in a fresh MindSpore child (graphconv.runtime.worker's run_mindir with "plain": true).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv
from graphconv.compiler import export_task
from graphconv.verify import compare, reference
from graphconv.verify.census import primitive_census
from graphconv.runtime.child import run_task
from graphconv.errors import UnsupportedError

# Primitives that Python checks and fallbacks compile into: an `if ...: raise` (raise, and JoinedStr for its
# f-string message), Python executed at run time (PyExecute/PyInterpret).
RESIDUE = ("raise", "JoinedStr", "PyExecute", "PyInterpret")
# Control flow: legitimate only where the ONNX graph has If/Loop/Scan (none of the zoo's models).
CONTROL = ("Switch", "SwitchLayer", "Partial")
RNG = np.random.default_rng(0)


def residue(mindir: Path, control_flow: bool = False) -> dict[str, int]:
    census = primitive_census(mindir)
    banned = RESIDUE if control_flow else RESIDUE + CONTROL
    return {k: v for k, v in census.items() if k in banned}


def plain_graphcell_run(mindir: Path, model: onnx.ModelProto, cases, workdir: Path) -> list[list[np.ndarray]]:
    """Outputs of `nn.GraphCell(mindspore.load(mindir))` called at every case in a row, no set_inputs."""
    workdir.mkdir(parents=True, exist_ok=True)
    placeholders = export_task.placeholders(model)
    files, outs = [], []
    for k, case in enumerate(cases):
        np.savez(workdir / f"case{k}.npz", **case.inputs)
        files.append(str(workdir / f"case{k}.npz"))
        outs.append(str(workdir / f"case{k}.out.npz"))
    run_task("run_mindir", {"mindir": str(mindir), "cases": files, "outputs": outs, "plain": True,
                            "input_names": [s["name"] for s in placeholders], "inputs": placeholders},
             workdir, "plain GraphCell run")
    result = []
    for path in outs:
        with np.load(path) as z:
            result.append([z[f"out{i}"] for i in range(len(z.files))])
    return result


def check_plain_load(onnx_path: Path, mindir: Path, workdir: Path, tolerance: str = "float32") -> list[dict]:
    """Runs the MindIR plainly at the reference cases (two shapes) and compares with onnxruntime; returns the
    comparisons, asserting each holds."""
    model = onnx.load(onnx_path)
    cases = reference.make_cases(model)
    assert {tuple(v.shape) for v in cases[0].inputs.values()} != {tuple(v.shape) for v in cases[1].inputs.values()}
    expected = reference.Oracle(onnx_path).run(cases)
    got = plain_graphcell_run(mindir, model, cases, workdir)
    atol, rtol = compare.default_tolerance(tolerance)
    results = []
    for case, exp, outs in zip(cases, expected, got):
        for (name, ref), out in zip(exp.items(), outs):
            c = compare.compare(out, ref, atol, rtol, case.valid_positions(ref))
            assert c.ok, f"{name} at {case.shape_text()}: {c.reason}"
            results.append({"case": case.shape_text(), "output": name, "max_abs": c.max_abs})
    return results


# --- hand-built graphs: the two spellings that broke a plain GraphCell ------------------------------------------


def _value(name, dims, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, dims)


def gemm_split_model(hidden: int = 64, heads: int = 4) -> onnx.ModelProto:
    """GPT-2's fused q/k/v projection as onnxsim leaves it: Reshape to 2-D, Gemm, Reshape back by a shape built
    from Shape(x), then Split into q, k, v and a Reshape of each to heads."""
    d = hidden // heads
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"),
        helper.make_node("Gemm", ["x2", "w", "b"], ["qkv2"], name="c_attn"),
        helper.make_node("Shape", ["x"], ["xs"], name="shape_x"),
        helper.make_node("Slice", ["xs", "zero", "two"], ["lead"], name="lead"),
        helper.make_node("Concat", ["lead", "width"], ["qkv_shape"], name="qkv_shape", axis=0),
        helper.make_node("Reshape", ["qkv2", "qkv_shape"], ["qkv"], name="unflatten"),
        helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], name="split", axis=2),
        helper.make_node("Concat", ["lead", "head_shape"], ["heads_shape"], name="heads_shape", axis=0),
    ]
    for part in ("q", "k", "v"):
        nodes.append(helper.make_node("Reshape", [part, "heads_shape"], [f"{part}4"], name=f"view_{part}"))
    nodes += [helper.make_node("Mul", ["q4", "k4"], ["qk"], name="qk"),
              helper.make_node("Add", ["qk", "v4"], ["y"], name="out")]
    inits = [
        numpy_helper.from_array(np.array([-1, hidden], np.int64), "flat"),
        numpy_helper.from_array((RNG.standard_normal((hidden, 3 * hidden)) * 0.2).astype(np.float32), "w"),
        numpy_helper.from_array((RNG.standard_normal(3 * hidden) * 0.1).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array([3 * hidden], np.int64), "width"),
        numpy_helper.from_array(np.array([hidden] * 3, np.int64), "sizes"),
        numpy_helper.from_array(np.array([heads, d], np.int64), "head_shape"),
    ]
    g = helper.make_graph(nodes, "gemm_split", [_value("x", ["batch", "seq", hidden])],
                          [_value("y", ["batch", "seq", heads, d])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def foreign_shape_model(hidden: int = 64, heads: int = 4) -> onnx.ModelProto:
    """Shapes taken from another input, as dynamo's Llama views q/k/v by the attention mask's dims: heads split
    and merged by Reshapes to Concat(Shape(ids), ...), then a projection added to x and scaled (the ops whose
    shapes a plain GraphCell kept from the first call); and an Expand to such a shape."""
    d = hidden // heads
    nodes = [
        helper.make_node("Shape", ["ids"], ["ids_shape"], name="shape_ids"),
        helper.make_node("Concat", ["ids_shape", "head_shape"], ["heads_target"], name="heads_target", axis=0),
        helper.make_node("Concat", ["ids_shape", "width"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "heads_target"], ["xh"], name="view"),
        helper.make_node("Transpose", ["xh"], ["xt"], name="to_heads", perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["xt", "half"], ["xs"], name="scale_heads"),
        helper.make_node("Transpose", ["xs"], ["back"], name="from_heads", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["back", "target"], ["merged"], name="merge"),
        helper.make_node("MatMul", ["merged", "w"], ["proj"], name="o_proj"),
        helper.make_node("Add", ["x", "proj"], ["s"], name="residual"),
        helper.make_node("Mul", ["s", "two"], ["y"], name="scale"),
        helper.make_node("Expand", ["bias", "target"], ["bias_b"], name="expand"),
        helper.make_node("Add", ["x", "bias_b"], ["xb"], name="add_bias"),
        helper.make_node("Mul", ["xb", "two"], ["z"], name="scale_bias"),
    ]
    inits = [numpy_helper.from_array(np.array([heads, d], np.int64), "head_shape"),
             numpy_helper.from_array(np.array([hidden], np.int64), "width"),
             numpy_helper.from_array((RNG.standard_normal((hidden, hidden)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.standard_normal(hidden).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    g = helper.make_graph(nodes, "foreign_shape",
                          [_value("x", ["batch", "seq", hidden]), _value("ids", ["batch", "seq"], TensorProto.INT64)],
                          [_value("y", ["batch", "seq", hidden]), _value("z", ["batch", "seq", hidden])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def test_gemm_split_at_fp16_verifies(tmp_path):
    """The GPT-2 fp16 defect: before the fix, MindSpore CPU failed the Reshape after the split."""
    src = tmp_path / "gemm_split.onnx"
    onnx.save(gemm_split_model(), src)
    report = graphconv.compile(src, tmp_path / "m16.mindir", target="cpu", precision="fp16", simplify=False)
    assert report.status == "verified"
    assert not residue(tmp_path / "m16.mindir")


def test_zoo_gpt2_at_fp16_after_onnxsim(export_cache, tmp_path):
    """Issue 13's report: the zoo's GPT-2 (dynamo 18) at --precision fp16 failed inside MindSpore after
    onnxsim (its c_attn as Reshape/Gemm/Reshape, then Split) while --no-simplify verified."""
    onnx_path = export_cache("gpt2")
    out = tmp_path / "gpt2_fp16.mindir"
    report = graphconv.compile(onnx_path, out, target="cpu", precision="fp16")
    assert report.status == "verified"
    assert report.validation["atol"] == compare.default_tolerance("float16")[0]
    assert not residue(out), residue(out)
    check_plain_load(onnx_path, out, tmp_path / "plain", tolerance="float16")


@pytest.mark.parametrize("build", [gemm_split_model, foreign_shape_model])
def test_hand_built_plain_graphcell_two_shapes(build, tmp_path):
    src = tmp_path / "model.onnx"
    onnx.save(build(), src)
    for target in ("cpu", "ascend"):
        out = tmp_path / f"{target}.mindir"
        graphconv.compile(src, out, target=target, simplify=False, verify=target == "cpu")
        assert not residue(out), (target, residue(out))
    check_plain_load(src, tmp_path / "cpu.mindir", tmp_path / "plain")


def test_split_emits_no_ops_split():
    """The lowering slices each part itself (ops.split's Python check is what left the raise); the Reshapes
    by a shape tensor get a fixed-length tuple (onnx_dims). Asserted on the program IR."""
    import onnx_ir as ir

    from graphconv.compiler import lowering

    model = onnx.shape_inference.infer_shapes(gemm_split_model(), data_prop=True)
    net, _ = lowering.lower(ir.from_proto(model))
    assert net.program.calls("ops.split") == []
    slices = [n for n in net.program.body.walk() if n.kind == "getitem" and isinstance(n.args[1], tuple)
              and isinstance(n.args[1][-1], slice)]
    assert len(slices) == 3  # one per part
    assert "onnx_dims" in net.program.helpers  # (onnx_reshape, the Reshapes here, calls it)


# --- the zoo -----------------------------------------------------------------------------------------------------

# The default slice (each ~15-40 s on the 2-core dev machine, export included); the rest with --runslow.
SLICE = ["llama", "gpt2", "hf/llama", "hf/gpt2", "hf/gpt_neox"]


def _zoo() -> list[str]:
    from models import ZOO
    from models.architectures import ARCHITECTURES

    return list(ZOO) + [f"hf/{a}" for a in ARCHITECTURES]


def _needs_transformers(name: str) -> bool:
    return name.startswith(("hf/", "hf-"))


@pytest.mark.parametrize("name", [n if n in SLICE else pytest.param(n, marks=pytest.mark.slow) for n in _zoo()])
def test_zoo_cpu_mindir_runs_plainly_at_two_shapes(name, export_cache, tmp_path):
    if _needs_transformers(name):
        pytest.importorskip("transformers")
    onnx_path = export_cache(name)
    cpu = tmp_path / "cpu.mindir"
    try:
        report = graphconv.compile(onnx_path, cpu, target="cpu")
    except UnsupportedError as e:
        pytest.skip(f"graphconv does not compile {name}: {e}")
    assert report.status == "verified"
    assert not residue(cpu), residue(cpu)
    check_plain_load(onnx_path, cpu, tmp_path / "plain")
    ascend = tmp_path / "ascend.mindir"
    graphconv.compile(onnx_path, ascend, target="ascend", verify=False)
    assert not residue(ascend), residue(ascend)
