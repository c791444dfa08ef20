"""The opmap registry: ONNX (domain, op_type, since_version) -> a lowering handler.

A handler receives a `graphconv.compiler.node_context.NodeContext` and returns, per output, the program Value it
built (`n.call("ops.sigmoid", n.x(0))`: graphconv/compiler/program_ir.py) or a numpy array for an output known at
compile time; a tuple of them for several outputs. For a model at opset N, the handler with the largest
since_version <= N is used, like an ONNX schema lookup; register a new version only where the op's
signature or semantics changed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from graphconv.onnx_domains import canonical_domain

DEFAULT_DOMAIN = ""


@dataclasses.dataclass(frozen=True)
class Handler:
    domain: str
    op_type: str
    since_version: int
    fn: Callable


_HANDLERS: dict[tuple[str, str], list[Handler]] = {}


def register(*op_types: str, since: int = 1, domain: str = DEFAULT_DOMAIN):
    """Decorator: `@register("Add", "Sub", since=14)`."""

    def deco(fn):
        for op_type in op_types:
            key = (canonical_domain(domain), op_type)
            versions = [h for h in _HANDLERS.get(key, []) if h.since_version != since]
            versions.append(Handler(canonical_domain(domain), op_type, since, fn))
            _HANDLERS[key] = sorted(versions, key=lambda h: h.since_version)
        return fn

    return deco


def lookup(domain: str, op_type: str, opset: int) -> Handler | None:
    best = None
    for h in _HANDLERS.get((canonical_domain(domain), op_type), []):
        if h.since_version <= opset:
            best = h
    return best


def supported_ops(domain: str = DEFAULT_DOMAIN) -> list[str]:
    return sorted(op for (d, op) in _HANDLERS if d == canonical_domain(domain))


def all_handlers() -> list[Handler]:
    return [h for hs in _HANDLERS.values() for h in hs]
