"""The compile targets (graphconv/compiler/targets.py): what each lowers, how it is exported and verified."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

import graphconv
from graphconv.compiler import targets
from graphconv.errors import InputError


def _two_graphs():
    return onnx.ModelProto(), onnx.ModelProto()


def test_ascend_lowers_the_fused_graph_with_lazy_layers_and_a_cpu_twin():
    fused, cpu_form = _two_graphs()
    t = targets.get("ascend")
    assert t.network_graph(fused, cpu_form) is fused and t.lazy_inline
    assert t.needs_twin(cpu_form, fused) and not t.needs_twin(fused, fused)  # no fused op: the MindIR runs
    assert t.measures_primitive_precision("fp32") and not t.measures_primitive_precision("fp16")
    t.check("bf16")  # emulated on the twin


def test_cpu_lowers_the_cpu_form_and_is_verified_on_its_mindir():
    fused, cpu_form = _two_graphs()
    t = targets.get("cpu")
    assert t.network_graph(fused, cpu_form) is cpu_form and not t.lazy_inline
    assert not t.needs_twin(cpu_form, fused) and not t.measures_primitive_precision("fp32")
    t.check("fp16")
    with pytest.raises(InputError, match="--precision bf16 needs --target ascend"):
        t.check("bf16")


def test_an_unknown_target_is_one_line_naming_the_choices(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
                              opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError, match=r"unknown target 'npu' \(choose from ascend, cpu\)"):
        graphconv.compile(path, tmp_path / "m.mindir", target="npu")
    assert not (tmp_path / "m.mindir").exists()
