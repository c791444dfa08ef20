"""graphconv's version, and the versions of the tools a report records."""

from __future__ import annotations

import importlib.metadata

__version__ = "0.1.0"


def tool_versions() -> dict[str, str]:
    """The installed version of each tool a compile depends on, or "not installed"."""
    out = {}
    for dist in ("onnx", "onnxruntime", "onnxsim", "onnx-ir", "onnxscript", "mindspore", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
