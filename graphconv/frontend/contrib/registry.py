"""The table of contrib-op decompositions: (domain, op type) -> fn(rw: Rewrite) (graphconv/frontend/contrib/__init__.py
explains them). Its own module so that the family modules and the package can both import it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from graphconv.frontend.contrib.rewrite import Rewrite

MICROSOFT = "com.microsoft"
DECOMPOSITIONS: dict[tuple[str, str], Callable[["Rewrite"], None]] = {}


def decomposes(*op_types: str, domain: str = MICROSOFT):
    """Decorator: `@decomposes("SkipSimplifiedLayerNormalization")` registers fn(rw: Rewrite)."""

    def deco(fn):
        for op in op_types:
            DECOMPOSITIONS[(domain, op)] = fn
        return fn

    return deco


# The fused-op table, which opmap.fused (a higher layer) registers here when it is imported (graphconv.pipeline
# imports it before any load): "records", name -> FusedOp, for the fused ops a decomposition writes directly
# (MatMulNBits as mindspore::WeightQuantBatchMatmul, whose limits it checks with the record's `broken`), and
# "attach", the function giving a model those ops' bodies. Without it they are decomposed into standard ops.
FUSED_TABLE: dict[str, object] = {}
