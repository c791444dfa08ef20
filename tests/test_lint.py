"""The lint, run as part of the suite: `ruff check` with pyproject.toml's [tool.ruff] (pyflakes errors, lines
over 120 characters, broad excepts without a written reason, noqa comments that name no enabled rule or
suppress nothing). Alone: `.venv/bin/python -m ruff check` from the repository root (`--fix` mends the
unused imports and noqa codes it can)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("graphconv", "passes", "opmap", "models", "tests", "benchmarks", "docs/examples")


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in proc.stderr, "ruff is a test dependency: pip install -e '.[test]'"
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
