"""The text of the scripts the bundle ships: templates read from graphconv/deploy/templates/ (package data)
with their @@NAME@@ placeholders filled.
"""

from __future__ import annotations

import functools
import importlib.resources
import re

from graphconv.errors import InternalError


@functools.cache
def template(name: str) -> str:
    """A template file of graphconv/deploy/templates/ (shipped as package data)."""
    return (importlib.resources.files("graphconv.deploy") / "templates" / name).read_text(encoding="utf-8")


def fill(text: str, **values: str) -> str:
    """The template text with every @@KEY@@ replaced; an unfilled placeholder is a graphconv bug."""
    for k, v in values.items():
        text = text.replace(f"@@{k}@@", v)
    leftover = re.findall(r"@@\w+@@", text)
    if leftover:
        raise InternalError(f"bundle template placeholders left: {leftover}")
    return text


def compare_script() -> str:
    """compare_outputs.py: numpy-only, graphconv's comparison rule."""
    return template("compare_outputs.py.tmpl")
