"""Emit stage helpers: lower a model and write what the export child needs into a directory.

`prepare()` is shared by the compile pipeline and by graphconv.runtime.runner (batches of small models, used by
the op tests and the ONNX backend), so both export exactly the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import numpy as np
import onnx
import onnx_ir as ir

from graphconv.frontend import param_names, weights
from graphconv.compiler import codegen, lowering, node_context
from graphconv.verify import reference

# Weights above this size go to an external data file (the child maps them lazily).
_EXTERNAL_THRESHOLD = 1024
# A network whose weights come from files (the model's external data: how large models arrive) and exceed
# this many bytes is exported streamed (graphconv/runtime/mindir_stream.py: its weights are never all in memory).
# Smaller ones keep mindspore.export, which below its own 1 GiB (TOTAL_SAVE) writes one .mindir holding the
# weights; above it both write the same split layout (<name>_graph.mindir + <name>_variables/data_0).
STREAM_MIN_BYTES = 1 << 30


class Placeholder(TypedDict):
    """One graph input as the export child declares it (network.placeholders)."""

    name: str
    shape: list[int | None]  # None: a symbolic dim
    ms_dtype: str  # the MindSpore dtype's name ("float32")


class _Prepared(TypedDict):
    """The keys of an export task that prepare() writes."""

    source: str  # the network's generated module (<name>.py)
    class_name: str  # its Cell class
    weights_onnx: str  # the weights prepare() wrote, keyed by Parameter name
    external_weights: dict[str, list]  # Parameter -> the model's own external data (WeightRef.as_list)
    folded_npz: str | None  # the constants the lowering folded, or None
    param_names: list[str]  # every Parameter, in the network's order
    inputs: list[Placeholder]
    param_layouts: dict[str, bool]  # Parameter -> whether its weight is stored transposed
    param_shapes: dict[str, list]  # Parameter -> [shape, dtype name]
    streamed: bool  # export through graphconv/runtime/mindir_stream.py, the weights never all in memory


class ExportTask(_Prepared, total=False):
    """What the export child (graphconv/runtime/export_tasks.py) needs to build and export one network:
    written by prepare() here, completed by its caller with the keys below, read in graphconv/runtime.
    JSON-able: it crosses the process boundary."""

    file_base: str  # where the MindIR goes, without ".mindir"
    checkpoint: str | None  # a checkpoint to write beside it, or None
    progress_file: str  # where the child reports the bytes it wrote (graphconv/runtime/child.py)


def placeholders(model: onnx.ModelProto) -> list[Placeholder]:
    """The graph inputs as MindSpore placeholders: None for every symbolic dim."""
    return [{"name": s.name, "shape": [d if isinstance(d, int) else None for d in s.shape],
             "ms_dtype": node_context.MS_DTYPES[ir.DataType(s.elem_type)].split(".")[1]}
            for s in reference.input_specs(model)]


def prepare(model: onnx.ModelProto, directory: Path, name: str = "network",
            names: param_names.WeightNames | None = None, scopes=None,
            lazy_inline: bool = True) -> tuple[lowering.LoweredNetwork, ExportTask]:
    """Lower `model`, write <name>.py, its weights and folded constants; return the network and the
    export task (the caller adds file_base and checkpoint). With `names` (recorded on the loaded model,
    graphconv.frontend.param_names), Parameters carry the model's own names and <name>.names.json maps each to its
    source initializer and transform; without, they keep the ONNX initializer names."""
    ir_model = weights.to_ir(model)
    origins = {}
    if names is not None:
        origins = names.assign(list(ir_model.graph.initializers),
                               param_names.made_records(dict(ir_model.graph.metadata_props)))
    net, folded = lowering.lower(ir_model, param_names={n: o.name for n, o in origins.items() if o.name != n},
                              scopes=scopes, lazy_inline=lazy_inline)
    source = directory / f"{name}.py"
    source.write_text(net.source)
    if names is not None:
        param_names.write_mapping(directory / f"{name}.names.json", net.params, origins)
    # Weights already in files (the model's external data, weights a pass made) are read from there by the
    # export child; only the rest is written here. Both are keyed by Parameter name.
    by_onnx = {p.onnx_name: p.name for p in net.params}
    external = {by_onnx[n]: ref.as_list() for n, ref in weights.external_refs(model).items() if n in by_onnx}
    for n, p in by_onnx.items():
        if p in external:
            ir_model.graph.initializers.pop(n)
    weights_file = directory / f"{name}.weights.onnx"
    # Saved from the IR copy: onnx.save(..., save_as_external_data=True) would rewrite `model` in place
    # to point at this temporary file. The IR's tensors are `model`'s TensorProtos, and a rename writes
    # through to them: the names are set back once the file is written.
    renames = {n: p for n, p in by_onnx.items() if n != p and n in ir_model.graph.initializers}
    _rename_initializers(ir_model.graph, renames)
    try:
        ir.save(ir_model, weights_file, external_data=f"{name}.weights.onnx.data",
                size_threshold_bytes=_EXTERNAL_THRESHOLD)
    finally:
        _rename_initializers(ir_model.graph, {p: n for n, p in renames.items()})
    folded_npz = None
    if folded:
        folded_npz = directory / f"{name}.folded.npz"
        np.savez(folded_npz, **folded)
    param_bytes = net.param_bytes
    task: ExportTask = {
        "source": str(source), "class_name": net.class_name, "weights_onnx": str(weights_file),
        "external_weights": external,
        "folded_npz": str(folded_npz) if folded_npz else None,
        "param_names": [p.name for p in net.params], "inputs": placeholders(model),
        "param_layouts": {p.name: p.transposed for p in net.params},
        "param_shapes": {p.name: [list(p.shape), p.dtype] for p in net.params},
        # graphconv/runtime/export_tasks._export_streamed (a checkpoint asked for is copied from the MindIR's weights)
        "streamed": bool(external) and param_bytes > STREAM_MIN_BYTES,
    }
    return net, task


def _rename_initializers(graph: ir.Graph, renames: dict[str, str]) -> None:
    """Rename initializers (the weights file is keyed by Parameter name); through temporary names, so that
    a swap of two names cannot collide half-way. The tensors' names follow (serialization sets them too)."""
    values = {n: graph.initializers[n] for n in renames}
    for k, v in enumerate(values.values()):
        v.name = f"__graphconv_renaming_{k}"
    for n, v in values.items():
        v.name = renames[n]
        if v.const_value is not None:
            v.const_value.name = v.name


def write_blocks(net: lowering.LoweredNetwork, directory: Path, stem: str) -> dict:
    """The network's blocks (graphconv/compiler/partition.py) as a module `<stem>_blocks.py` of Cell classes
    (codegen.render_blocks), and the plan the block-by-block run follows (Partition.plan)."""
    from opmap import helpers

    module = directory / f"{stem}_blocks.py"
    module.write_text(codegen.render_blocks(net.program, net.partition, helpers))
    return net.partition.plan(str(module))


def without_lazy_inline(net: lowering.LoweredNetwork, task: ExportTask, directory: Path) -> ExportTask:
    """The export task of the same network with its layer classes written without lazy_inline (MindSpore's CPU
    refuses some lazy_inline layer graphs): its source rendered again beside the first."""
    from opmap import helpers

    source = directory / f"{Path(task['source']).stem}_inlined.py"
    source.write_text(codegen.render(net.program, helpers, lazy_inline=False))
    return {**task, "source": str(source)}
