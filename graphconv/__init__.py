"""graphconv: compile PyTorch-born ONNX models into verified MindSpore MindIR for Ascend."""

from graphconv.errors import GraphconvError, InputError, InternalError, UnsupportedError, VerificationError  # noqa: F401
from graphconv.pipeline import compile  # noqa: F401  (shadows the builtin inside this namespace only)
from graphconv.version import __version__  # noqa: F401
