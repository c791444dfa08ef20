"""Reading node attributes in handlers: a STRING attribute's value arrives as bytes (onnx_ir), which every
comparison with a mode name needs as str."""

from __future__ import annotations


def text(value):
    """`value` decoded when it is bytes; anything else (a str default, None) unchanged."""
    return value.decode() if isinstance(value, bytes) else value
