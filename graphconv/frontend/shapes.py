"""onnxruntime's symbolic shape inference, as the loader (contrib-op decompositions), the reference-input dims
(graphconv/verify/dims.py) and refine-shapes (passes/shapes.py) use it: its own infer_shapes saves a partial
model into the current directory whenever an op defeats it, so its loop is run here instead."""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys

import onnx


def symbolic_inference(model: onnx.ModelProto, auto_merge: bool, guess_output_rank: bool = False):
    """onnxruntime's SymbolicShapeInference run over `model` (its infer_shapes loop, minus the failure path
    that writes a file into the cwd: an op it cannot infer leaves its outputs, and what follows, unknown);
    None when it cannot start. Read its `known_vi_` and `suggested_merge_`."""
    try:
        ssi = _ssi_module().SymbolicShapeInference(int_max=2**31 - 1, auto_merge=auto_merge,
                                                   guess_output_rank=guess_output_rank, verbose=0)
        ssi._preprocess(model)
    except Exception:  # noqa: BLE001 - only an aid: callers do without
        return None
    log = _ssi_module().logger
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        while ssi.run_:
            ssi._infer_impl()
    except Exception:  # noqa: BLE001 - keep what was inferred before the op it could not handle
        pass
    finally:
        log.setLevel(level)
    return ssi


@functools.cache
def _ssi_module():
    """onnxruntime's symbolic_shape_infer module, loaded from its file. Importing it as
    onnxruntime.tools.symbolic_shape_infer runs onnxruntime/tools/__init__.py first, which imports torch
    whenever torch is installed (for a helper unrelated to shapes): 2.5 s of every compile on this machine.
    The module itself needs only onnx, numpy, sympy and packaging."""
    loaded = sys.modules.get("onnxruntime.tools.symbolic_shape_infer")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("onnxruntime")
    path = next(iter(spec.submodule_search_locations)) + "/tools/symbolic_shape_infer.py"
    module_spec = importlib.util.spec_from_file_location("_graphconv_ort_symbolic_shape_infer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
