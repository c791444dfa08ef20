"""Optional values where they hold a tensor known to be there: an optional is then its tensor. An empty
optional has no MindSpore value; only the test for one folds to False at compile time."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphconv.onnx_domains import is_default_domain
from opmap.registry import register


def _holds_tensor(n, i: int) -> bool:
    """Input i is a tensor, or the optional that Optional(tensor) made."""
    v = n.node.inputs[i]
    if isinstance(v.type, ir.TensorType):
        return True
    p = v.producer()
    return p is not None and p.op_type == "Optional" and is_default_domain(p.domain) and \
        len(p.inputs) > 0 and p.inputs[0] is not None and p.inputs[0].name != ""


@register("Optional", since=15)
def optional(n):
    if not n.has(0):
        n.fail("an empty optional has no MindSpore value")
    if not isinstance(n.node.inputs[0].type, ir.TensorType):
        n.fail("an optional of a sequence is not supported (graphconv lowers tensors only)")
    return n.x(0)


@register("OptionalHasElement", since=18)
def optional_has_element(n):
    if not n.has(0):
        return np.array(False)
    if _holds_tensor(n, 0):
        return np.array(True)
    n.fail("whether this optional holds a value is only known at run time")


@register("OptionalGetElement", since=18)
def optional_get_element(n):
    if not _holds_tensor(n, 0):
        n.fail("the optional's element is not a tensor known to be present")
    return n.x(0)
