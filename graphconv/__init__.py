"""graphconv: compile PyTorch-born ONNX models into verified MindSpore MindIR for Ascend."""

from graphconv.errors import GraphconvError, InputError, InternalError, UnsupportedError, VerificationError  # noqa: F401
from graphconv.version import __version__  # noqa: F401


def __getattr__(name: str):
    """`graphconv.compile` (the pipeline) and `graphconv.generate` are imported on first use: importing graphconv.errors or any other
    small module must not pull in the whole pipeline (and the passes and opmap behind it)."""
    if name == "compile":
        from graphconv.pipeline import compile

        return compile
    if name in ("generate", "GenerationResult"):
        import graphconv.generate as module  # (the submodule; the attribute is then set to the function)

        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphconv' has no attribute {name!r}")
