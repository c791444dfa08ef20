"""The default ONNX domain, which a model may spell "" or "ai.onnx": one definition of that test for the
frontend, the passes, opmap and the tools (the bottom layer, so every layer may import it)."""

from __future__ import annotations

import onnx

from graphconv.errors import InputError

DEFAULT_DOMAINS = ("", "ai.onnx")
# graphconv's own ops (graphconv::KVCacheUpdate, AllReduce, AllGather, SDPA: opmap/graphconv_ops.py) and
# the version of that domain a model imports.
GRAPHCONV_DOMAIN = "graphconv"
GRAPHCONV_DOMAIN_VERSION = 1


def is_default_domain(domain: str) -> bool:
    return domain in DEFAULT_DOMAINS


def canonical_domain(domain: str) -> str:
    """"" for the default domain however it is spelled; any other domain unchanged."""
    return "" if domain == "ai.onnx" else domain


def domain_name(domain: str) -> str:
    """"ai.onnx" for the default domain spelled "": how reports and inspect key a model's opset imports."""
    return domain or "ai.onnx"


def op_key(node) -> str:
    """`Op` for the default domain, `domain::Op` otherwise (how keep sets, reports and inspect name ops).
    `node`: anything with .domain and .op_type (an onnx.NodeProto, an onnx_ir Node)."""
    return f"{node.domain}::{node.op_type}" if not is_default_domain(node.domain) else node.op_type


def find_default_opset(model: onnx.ModelProto) -> int | None:
    """The version the model imports of the default domain; None when it imports none."""
    return next((i.version for i in model.opset_import if is_default_domain(i.domain)), None)


def default_opset(model: onnx.ModelProto) -> int:
    """The version the model imports of the default domain; an InputError when it imports none."""
    opset = find_default_opset(model)
    if opset is None:
        raise InputError("the model imports no opset of the default ONNX domain")
    return opset
