"""The child side of `--quantize` (graphconv/quantize.py): onnxruntime's quantizers on the float model, the
result written into the compile's workspace. In a child because onnxruntime.quantization imports
onnxruntime.transformers' modules under top-level names (fusion_utils, ...) that other code may shadow, and
because it holds the whole model in memory, which the compile does not need to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from graphconv.quantize import name_nodes


def quantize(task: dict) -> dict:
    src, dst = Path(task["input"]), Path(task["output"])
    if task["scheme"] == "w8a8":
        _static(task, src, dst)
    else:
        _weight_only(task, src, dst)
    return {"output": str(dst)}


def _save(model: onnx.ModelProto, dst: Path, external: bool) -> None:
    if external:  # (a model past 2 GB cannot be one protobuf: its weights go to a file beside it)
        onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{dst.name}.data", size_threshold=1024)
    else:
        onnx.save(model, str(dst))


def _weight_only(task: dict, src: Path, dst: Path) -> None:
    """MatMulNBitsQuantizer once per block size, each run taking the linears of that block (the others
    excluded), round to nearest and symmetric."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(src))
    name_nodes(model)
    blocks: dict[str, int] = task["blocks"]
    for block in sorted(set(blocks.values())):
        others = [n.name for n in model.graph.node if n.op_type == "MatMul" and blocks.get(n.name) != block]
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, bits=task["bits"])
        quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=others, algo_config=config)
        quantizer.process()
        model = quantizer.model.model
    _save(model, dst, task["external"])


def _static(task: dict, src: Path, dst: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    with np.load(task["calibration"]) as data:
        inputs = {k: data[k] for k in data.files}

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([inputs])

        def get_next(self):
            return next(self.items, None)

    model = onnx.load(str(src))
    name_nodes(model)
    quantize_static(model, str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                    nodes_to_exclude=task["exclude"], use_external_data_format=task["external"],
                    extra_options={"WeightSymmetric": True, "OpTypesToExcludeOutputQuantization": ["MatMul"]})
