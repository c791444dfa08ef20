"""Emit stage helpers: lower a model and write what the export child needs into a directory.

`prepare()` is shared by the compile pipeline and by graphconv.runner (batches of small models, used by
the op tests and the ONNX backend), so both export exactly the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from graphconv import lower, reference, weights

# Weights above this size go to an external data file (the child maps them lazily).
_EXTERNAL_THRESHOLD = 1024


def placeholders(model: onnx.ModelProto) -> list[dict]:
    """The graph inputs as MindSpore placeholders: None for every symbolic dim."""
    return [{"name": s.name, "shape": [d if isinstance(d, int) else None for d in s.shape],
             "ms_dtype": lower.MS_DTYPES[ir.DataType(s.elem_type)].split(".")[1]}
            for s in reference.input_specs(model)]


def prepare(model: onnx.ModelProto, directory: Path, name: str = "network",
            scopes=None, lazy_inline: bool = True) -> tuple[lower.LoweredNetwork, dict]:
    """Lower `model`, write <name>.py, its weights and folded constants; return the network and the
    export task (the caller adds file_base and checkpoint)."""
    ir_model = ir.from_proto(model)
    net, folded = lower.lower(ir_model, scopes=scopes, lazy_inline=lazy_inline)
    source = directory / f"{name}.py"
    source.write_text(net.source)
    # Weights already in files (the model's external data, weights a pass made) are read from there by the
    # export child; only the rest is written here.
    param_names = {p.onnx_name for p in net.params}
    external = {n: ref.as_list() for n, ref in weights.external_refs(model).items() if n in param_names}
    for n in external:
        ir_model.graph.initializers.pop(n)
    weights_file = directory / f"{name}.weights.onnx"
    # Saved from the IR copy: onnx.save(..., save_as_external_data=True) would rewrite `model` in place
    # to point at this temporary file.
    ir.save(ir_model, weights_file, external_data=f"{name}.weights.onnx.data",
            size_threshold_bytes=_EXTERNAL_THRESHOLD)
    folded_npz = None
    if folded:
        folded_npz = directory / f"{name}.folded.npz"
        np.savez(folded_npz, **folded)
    task = {
        "source": str(source), "class_name": net.class_name, "weights_onnx": str(weights_file),
        "external_weights": external,
        "folded_npz": str(folded_npz) if folded_npz else None,
        "param_names": [p.onnx_name for p in net.params], "inputs": placeholders(model),
    }
    return net, task
