"""Small facts have one home: the first line of an error, the default-domain test, the dtype tables."""

from __future__ import annotations

import ast
from pathlib import Path

from graphconv.errors import first_line

ROOT = Path(__file__).resolve().parent.parent


def test_first_line_is_the_first_non_empty_line():
    assert first_line(ValueError("\n\n  bad shape  \nat node 3")) == "bad shape"
    assert first_line(RuntimeError("one line")) == "one line"


def test_first_line_of_an_empty_message_is_the_type_name():
    """An empty or blank message must not raise IndexError: the type name stands in."""
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(RuntimeError(" \n \n")) == "RuntimeError"


def test_first_line_cuts_at_the_limit_and_drops_colour_codes():
    assert first_line(ValueError("abcdef\nxyz"), 3) == "abc"
    assert first_line(ValueError("\x1b[31mred\x1b[0m failure")) == "red failure"


def _spelled_out_default_domain(tree) -> list[int]:
    """The lines of `tree` that spell the default-domain test out: a tuple, list or set of exactly "" and
    "ai.onnx", or a comparison with "ai.onnx"."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if len(node.elts) == 2 and values == {"", "ai.onnx"}:
                found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value == "ai.onnx" for o in operands):
                found.append(node.lineno)
    return sorted(set(found))


def test_the_default_domain_test_lives_in_onnx_domains_only():
    """graphconv/onnx_domains.py holds the test for the default domain: a copy spelled out elsewhere drifts
    (one spelling forgets "ai.onnx", and a model that spells its domain so stops matching)."""
    home = ROOT / "graphconv" / "onnx_domains.py"
    copies = []
    for pkg in ("graphconv", "passes", "opmap"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != home:
                copies += [f"{path.relative_to(ROOT)}:{n}" for n in
                           _spelled_out_default_domain(ast.parse(path.read_text()))]
    assert not copies, "use graphconv.onnx_domains instead of spelling the default domain out: " + ", ".join(copies)


def test_the_scan_finds_a_spelled_out_domain_test():
    source = 'a = d in ("", "ai.onnx")\nb = d not in {"ai.onnx", ""}\nc = d == "ai.onnx"\nok = d in ("", "x")\n'
    assert _spelled_out_default_domain(ast.parse(source)) == [1, 2, 3]


def test_the_dtype_numbers_are_onnx_and_onnx_ir_element_types():
    """graphconv.dtypes spells ONNX's element types as numbers (the MindSpore children never import onnx):
    they must be onnx's, and onnx_ir's DataType members must find themselves in its sets."""
    import onnx
    import onnx_ir as ir

    from graphconv import dtypes

    for name in ("FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16"):
        assert getattr(dtypes, name) == getattr(onnx.TensorProto, name)
        assert getattr(ir.DataType, name) in dtypes.FLOATS
    assert ir.DataType.DOUBLE not in dtypes.FUSED_FLOATS and dtypes.FUSED_FLOATS < dtypes.FLOATS
    assert {onnx.helper.tensor_dtype_to_np_dtype(t).name for t in dtypes.FLOATS} == set(dtypes.FLOAT_NAMES)
    for t, precision in dtypes.PRECISION_OF_TYPE.items():
        assert onnx.helper.tensor_dtype_to_np_dtype(t).name == dtypes.PRECISION_DTYPES[precision]


def test_each_graphconv_op_is_lowered_or_leaves_as_its_record_says():
    """The graphconv-op record is what the makers write and the lowerings read: an op the record lowers in
    opmap is registered there under the record's name and domain; an op with a body makes a function with
    the record's signature."""
    import opmap  # noqa: F401  (registers the handlers)
    from opmap import registry
    from opmap.graphconv_ops import DOMAIN, GRAPHCONV_OPS

    for op in GRAPHCONV_OPS.values():
        lowered = registry.lookup(DOMAIN, op.name, 1) is not None
        assert lowered == op.lowering.startswith("opmap/"), op.name
        if op.body is not None:
            params = {"rank": 0, "axis": 1, "sizes": [2, 2], "ndim": 2} if op.attributes == ("axis",) else {}
            f = op.function(18, **params)
            assert (f.domain, f.name, tuple(f.input), tuple(f.output), tuple(f.attribute)) == \
                (DOMAIN, op.name, op.inputs, op.outputs, op.attributes)


def test_prepare_writes_the_keys_the_export_task_declares(tmp_path):
    """The export task's TypedDict is its schema: prepare() writes exactly its required keys, and the caller
    adds only its optional ones."""
    import onnx
    from onnx import TensorProto, helper

    from graphconv.compiler.export_task import ExportTask, prepare

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    _, task = prepare(model, tmp_path)
    assert set(task) == ExportTask.__required_keys__
    assert ExportTask.__optional_keys__ == {"file_base", "checkpoint", "progress_file"}
    assert set(task["inputs"][0]) == {"name", "shape", "ms_dtype"}
