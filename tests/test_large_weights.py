"""Weights over 1 GiB: MindSpore splits them into <name>_variables/; the result loads from the asked path."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphconv


@pytest.mark.slow
def test_split_weights_land_next_to_the_requested_mindir(tmp_path):
    rows = (1100 * 2**20) // (1024 * 4)  # 1.1 GiB of fp32
    table = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"])]
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1024])],
                          [numpy_helper.from_array(table, "table")])
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), model_dir / "big.onnx",
              save_as_external_data=True, location="big.onnx.data")
    del table
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    report = graphconv.compile(model_dir / "big.onnx", out_dir / "big.mindir", target="cpu", simplify=False)
    assert report.status == "verified"
    assert sorted(p.name for p in out_dir.iterdir()) == ["big.mindir", "big_variables"]
    assert report.artifacts["variables"] == str(out_dir / "big_variables")
