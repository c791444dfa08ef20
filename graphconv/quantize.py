"""`graphconv compile --quantize`: a float model quantized by onnxruntime's own tools before it is compiled.

The schemes (`Scheme.parse`, checked once by CompileOptions.validate):
- w4a16[:GROUP], w8a16[:GROUP]: weight-only, round to nearest, symmetric, by onnxruntime's MatMulNBitsQuantizer
  (DefaultWeightOnlyQuantConfig, bits 4 or 8): each linear (a MatMul by a constant [K, N] weight) becomes a
  com.microsoft::MatMulNBits, which the load writes as mindspore::WeightQuantBatchMatmul
  (graphconv/frontend/contrib/quant.py). w4a16 groups 128 values along K by default; w8a16 is per output
  channel unless a GROUP is given (one block over K, which the load lays as group 0).
- w8a8 with --calibration FILE.npz: static activation quantization by onnxruntime's quantize_static (QDQ,
  per-channel symmetric int8 weights, uint8 activations calibrated by MinMax on the npz's inputs), the linears
  only: a MatMul of two activations (attention's scores and values) is excluded, and MatMul outputs stay
  float. passes/fuse_qdq_matmul.py writes each QDQ linear as QuantV2 + QuantBatchMatmul.

The group a linear gets (`block_for`): WeightQuantBatchMatmul takes groups that divide K and are at most K - 1
(opmap/fused/weight_quant_batch_matmul.py), so a GROUP that does not fit a linear's K is halved until it does
(down to 32; a 64-wide linear at group 128 gets 32), and the report lists every group used. An 8-bit linear
that no group fits is per channel; a 4-bit one keeps the GROUP and the load says why it is dequantized in the
network (the report's `quantized_linears`).

The quantizer runs in a child process (graphconv/runtime/quantize_task.py) in the compile's private
workspace, where the quantized model is written (never beside the user's file); the compile then runs on it,
so the oracle is onnxruntime on the quantized model and verification proves the compile. Its error against
the float model (`error_vs_float`, both run by onnxruntime on the compile's reference inputs) is the report's
`quantization` section. A model whose weights are in external data files is quantized too: the quantizers
hold every weight in memory (the float model's bytes, once), and the quantized model is written with its
weights in a file beside it in the workspace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np
import onnx

from graphconv.errors import InputError

SCHEMES = ("w4a16", "w8a16", "w8a8")
DEFAULT_GROUP = {"w4a16": 128, "w8a16": None, "w8a8": None}
SMALLEST_GROUP = 32  # WeightQuantBatchMatmul's smallest group (a multiple of 32)


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str  # w4a16 | w8a16 | w8a8
    group: int | None  # values per group along K; None: per output channel

    @property
    def bits(self) -> int:
        return 4 if self.name == "w4a16" else 8

    @property
    def weight_only(self) -> bool:
        return self.name != "w8a8"

    @classmethod
    def parse(cls, text: str) -> "Scheme":
        """`w8a16`, `w4a16:64`, `w8a8`; InputError (one line) for anything else."""
        name, sep, group = text.partition(":")
        if name not in SCHEMES:
            raise InputError(f"--quantize {text!r}: unknown scheme (choose from w4a16[:GROUP], w8a16[:GROUP], "
                             "w8a8 with --calibration)")
        if not sep:
            return cls(name, DEFAULT_GROUP[name])
        if name == "w8a8":
            raise InputError(f"--quantize {text!r}: w8a8 takes no GROUP (its weights are per output channel)")
        try:
            size = int(group)
        except ValueError:
            size = 0
        if size < 16 or size & (size - 1):
            raise InputError(f"--quantize {text!r}: GROUP must be a power of 2, at least 16")
        return cls(name, size)

    def text(self) -> str:
        return self.name + (f":{self.group}" if self.group and self.weight_only else "")


def check_options(quantize: str | None, calibration: Path | None) -> None:
    """What --quantize and --calibration need of each other (CompileOptions.validate)."""
    if quantize is None:
        if calibration is not None:
            raise InputError("--calibration needs --quantize w8a8")
        return
    scheme = Scheme.parse(quantize)
    if scheme.name == "w8a8" and calibration is None:
        raise InputError("--quantize w8a8 needs --calibration FILE.npz (graph inputs by name, as --inputs takes)")
    if scheme.name != "w8a8" and calibration is not None:
        raise InputError(f"--calibration applies to --quantize w8a8 only ({scheme.name} quantizes weights alone)")


def block_for(k: int, scheme: Scheme) -> int:
    """The MatMulNBits block size of a linear of K inputs: the scheme's group if it fits K (divides it, at most
    K - 1), else halved down to 32 until it does; per channel (8 bits: one block over K, the next power of 2
    at least 16) where no group is asked or none fits."""
    whole = max(16, 1 << (k - 1).bit_length())
    if scheme.group is None:
        return whole
    g = scheme.group
    while g > SMALLEST_GROUP and (k % g or g >= k):
        g //= 2
    if k % g == 0 and g < k:
        return g
    return whole if scheme.bits == 8 else scheme.group


def linear_nodes(model: onnx.ModelProto) -> dict[str, int]:
    """The linears of the main graph, MatMul name -> K: a MatMul by a constant 2-D initializer (the others, a
    product of two activations, are not quantized). Every node must have a name (`name_nodes`)."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    return {n.name: dims[n.input[1]][0] for n in model.graph.node
            if n.op_type == "MatMul" and not n.domain and len(n.input) == 2 and len(dims.get(n.input[1], [])) == 2}


def name_nodes(model: onnx.ModelProto) -> None:
    """Name the unnamed nodes (the quantizers select nodes by name), deterministically."""
    taken = {n.name for n in model.graph.node}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)


@dataclasses.dataclass
class Quantized:
    path: Path  # the quantized model, in the workspace
    info: dict  # the report's `quantization` section (error_vs_float added once the cases are known)


def quantize(model_path: Path, scheme: Scheme, calibration: Path | None, out: Path, workdir: Path) -> Quantized:
    """The model at `model_path` quantized into `out` (a file of the workspace `workdir`) by onnxruntime's
    tools, in a child process; the section the report gets. InputError for a model or a calibration file
    that cannot be quantized."""
    from graphconv.runtime import child

    proto = onnx.load(str(model_path), load_external_data=False)
    name_nodes(proto)
    linears = linear_nodes(proto)
    if not linears:
        raise InputError(f"--quantize {scheme.text()}: {model_path} has no MatMul by a constant weight to quantize")
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    task = {"input": str(Path(model_path).absolute()), "output": str(out), "scheme": scheme.name, "bits": scheme.bits,
            "external": external}
    info = {"scheme": scheme.text(), "bits": scheme.bits, "linears": len(linears)}
    if scheme.weight_only:
        blocks = {name: block_for(k, scheme) for name, k in linears.items()}
        task["blocks"] = blocks
        info.update(tool="onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer "
                         "(DefaultWeightOnlyQuantConfig: round to nearest, symmetric)",
                    group=scheme.group, groups=_groups(blocks, linears, scheme))
    else:
        task["calibration"] = str(_calibration(calibration, proto, Path(workdir) / "calibration.npz"))
        task["exclude"] = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in linears]
        info.update(tool="onnxruntime.quantization.quantize_static (QDQ, MinMax calibration, uint8 activations, "
                         "per-channel symmetric int8 weights)", calibration=str(calibration),
                    excluded_matmuls=len(task["exclude"]))
    started = time.perf_counter()
    try:
        child.run_task("quantize", task, workdir, "onnxruntime's quantizer")
    except child.ChildError as e:
        raise InputError(f"--quantize {scheme.text()}: onnxruntime's quantizer failed: {e.error}") from None
    info["seconds"] = round(time.perf_counter() - started, 3)
    info["external_data"] = external
    info["quantized_onnx_sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    return Quantized(out, info)


def _groups(blocks: dict[str, int], linears: dict[str, int], scheme: Scheme) -> dict[str, int]:
    """Linears per group used ("per channel" for one block over K)."""
    counts: dict[str, int] = {}
    for name, block in blocks.items():
        key = "per channel" if scheme.bits == 8 and block >= linears[name] else str(block)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _calibration(path: Path, model: onnx.ModelProto, out: Path) -> Path:
    """The calibration inputs checked as --inputs are (names, ranks, dtypes, dims) and written for the child."""
    from graphconv.verify import reference

    try:
        (case,) = reference.load_npz_cases([Path(path)], model)
    except InputError as e:
        raise InputError(str(e).replace("--inputs", "--calibration", 1)) from None
    np.savez(out, **case.inputs)
    return out


def error_vs_float(float_model: Path, quantized: Path, cases) -> dict:
    """Per output: the quantized model's max abs, mean abs and cosine against the float model's, both run by
    onnxruntime on the compile's reference inputs (the worst case of each)."""
    from graphconv.verify.reference import Oracle

    want = Oracle(_with_weights_in_place(Path(float_model))).run(cases, fallback=False)
    got = Oracle(_with_weights_in_place(Path(quantized))).run(cases, fallback=False)
    out: dict[str, dict] = {}
    for exp, act in zip(want, got):
        for name, ref in exp.items():
            a, b = np.asarray(act[name], np.float64).ravel(), np.asarray(ref, np.float64).ravel()
            diff = np.abs(a - b)
            denom = np.linalg.norm(a) * np.linalg.norm(b)
            cosine = float(a @ b / denom) if denom else float(np.array_equal(a, b))
            row = out.setdefault(name, {"max_abs": 0.0, "mean_abs": 0.0, "cosine": 1.0})
            row["max_abs"] = max(row["max_abs"], float(diff.max()) if diff.size else 0.0)
            row["mean_abs"] = max(row["mean_abs"], float(diff.mean()) if diff.size else 0.0)
            row["cosine"] = min(row["cosine"], cosine)
    return out


def _with_weights_in_place(path: Path) -> onnx.ModelProto:
    """The model with its small external tensors read in and the others referenced where they are (the oracle
    feeds them from their files: graphconv.frontend.weights)."""
    from graphconv.frontend import weights

    proto = onnx.load(str(path), load_external_data=False)
    weights.take_over_external(proto, path.parent)
    return proto
