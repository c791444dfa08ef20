"""ONNX op -> MindSpore lowering handlers, one module per op family, keyed by (domain, op_type, since_version)."""

from opmap.registry import lookup, register, supported_ops  # noqa: F401

# Importing the family modules registers their handlers.
from opmap import elementwise, fused, linalg, nn, reduce, shape  # noqa: F401,E402
from opmap import attention  # noqa: F401,E402
from opmap import attention_general, control, loss, quant, resize, rnn, rotary, sampling, spectral  # noqa: F401,E402
