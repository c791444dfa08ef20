"""Shared fixtures. Heavy cases are marked `slow` and run only with --runslow (the full matrix)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("GRAPHCONV_RUNSLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory):
    """Exported zoo models, one file per (model, opset, exporter), shared by every test of the session."""
    from graphconv.frontend.export import zoo_export
    from models import load_factory

    root = tmp_path_factory.mktemp("exports")
    done: dict[tuple, Path] = {}

    def get(name: str, opset: int = 18, exporter: str = "dynamo") -> Path:
        key = (name, opset, exporter)
        if key not in done:
            d = root / f"{name.replace('/', '_')}-{opset}-{exporter}"  # hf/llama and hf-llama differ
            d.mkdir()
            path = d / "model.onnx"
            zoo_export(load_factory(name), path, opset=opset, exporter=exporter)
            done[key] = path
        return done[key]

    return get
