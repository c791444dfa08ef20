"""Reading the JSON files graphconv reads from a user's folders (config.json, generation.json, export.json)."""

from __future__ import annotations

import json
from pathlib import Path

from graphconv.errors import InputError


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a one-line InputError naming the file."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object")
    return value
