"""ONNX op -> MindSpore lowering handlers, one module per op family, keyed by (domain, op_type, since_version)."""

from opmap.registry import lookup, register, supported_ops  # noqa: F401

# Importing the family modules registers their handlers.
from opmap import elementwise, fused, linalg, nn, reduce, shape  # noqa: F401
from opmap import attention  # noqa: F401
from opmap import attention_general, control, detection, loss, quant, resize, rnn  # noqa: F401
from opmap import rotary, sampling, spectral, text  # noqa: F401
from opmap import einsum, optional, rearrange, refusals, roipool, selection  # noqa: F401
from opmap import onehot, sorting  # noqa: F401
from opmap import collective, kv_cache, linear_attention, swiglu, tensor_scatter  # noqa: F401
