"""onnxruntime's symbolic shape inference, as the loader (contrib-op decompositions), the reference-input dims
(graphconv/verify/dims.py) and refine-shapes (passes/shapes.py) use it: its own infer_shapes saves a partial
model into the current directory whenever an op defeats it, so its loop is run here instead."""

from __future__ import annotations

import logging

import onnx


def symbolic_inference(model: onnx.ModelProto, auto_merge: bool, guess_output_rank: bool = False):
    """onnxruntime's SymbolicShapeInference run over `model` (its infer_shapes loop, minus the failure path
    that writes a file into the cwd: an op it cannot infer leaves its outputs, and what follows, unknown);
    None when it cannot start. Read its `known_vi_` and `suggested_merge_`."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        ssi = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=auto_merge, guess_output_rank=guess_output_rank, verbose=0)
        ssi._preprocess(model)
    except Exception:  # noqa: BLE001 - only an aid: callers do without
        return None
    log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
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
