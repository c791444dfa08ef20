"""graphconv: compile PyTorch-born ONNX models into verified MindSpore MindIR for Ascend."""

import os

# onnxruntime's usage telemetry off (its documented opt-out; set before onnxruntime is first imported): a compiler
# reports nothing about its users' models. A user's own setting wins.
os.environ.setdefault("ORT_TELEMETRY_DISABLED", "1")

from graphconv.errors import GraphconvError, InputError, InternalError, UnsupportedError, VerificationError  # noqa: F401
from graphconv.version import __version__  # noqa: F401


def __getattr__(name: str):
    """`graphconv.compile` (the pipeline) and `graphconv.generate` are imported on first use: importing
    graphconv.errors or any other small module must not pull in the whole pipeline (and the passes and opmap
    behind it)."""
    if name == "compile":
        from graphconv.pipeline import compile

        return compile
    if name in ("generate", "GenerationResult"):
        # (graphconv.generation.run, not graphconv.generate: a submodule of the function's name would replace
        # the function on the package once imported)
        from graphconv.generation import run

        return getattr(run, name)
    raise AttributeError(f"module 'graphconv' has no attribute {name!r}")
