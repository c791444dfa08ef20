"""The typed results a compile's stages hand each other (graphconv/pipeline.py, graphconv/verification.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from graphconv.errors import InternalError
from graphconv.frontend import param_names
from graphconv.frontend.load import LoadedModel
from graphconv.compiler import layers, lowering


@dataclasses.dataclass(frozen=True)
class Loaded:
    model: LoadedModel
    scopes: layers.Scopes  # where the exporter says each node came from (onnxsim drops it)
    names: param_names.WeightNames  # the weights' PyTorch names (onnxsim folds what tells them)
    layer_streamed: bool  # verify block by block, against the oracle run layer by layer


@dataclasses.dataclass(frozen=True)
class Validated:
    model: onnx.ModelProto  # what is compiled: the simplified model, or the original where onnxsim changed it
    expected: list[dict] | None  # the oracle's outputs per case; None: the oracle runs layer by layer, later
    oracle_model: onnx.ModelProto  # what the oracle runs (the model as given)
    ort_refused: str | None = None  # why onnxruntime could not run the model (onnx.reference did)
    cases: list | None = None  # the reference cases, where the validation replaced the generated ones


@dataclasses.dataclass(frozen=True)
class Lowered:
    net: lowering.LoweredNetwork
    task: dict  # what the export child needs (graphconv/compiler/export_task.py)


@dataclasses.dataclass(frozen=True)
class Emitted:
    files: list[Path]
    run: dict | None  # the verification run's result, when the child ran one

    @property
    def mindir(self) -> Path:
        found = next((f for f in self.files if f.suffix == ".mindir"), None)
        if found is None:
            raise InternalError("mindspore.export wrote no .mindir file")
        return found


@dataclasses.dataclass(frozen=True)
class OracleValues:
    expected: list[dict]  # the model's outputs per case
    kept: list[dict]  # the values the blocks pass on, by ONNX name, per case
    variant: list[dict] | None = None  # the ascend-precision variant's outputs, run with it
    exact: object = None  # a low-precision model's exact values (graphconv/verify/exact.Values)
