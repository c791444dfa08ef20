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
