"""A compile's options (the `graphconv compile` flags; `graphconv.compile(**options)`), the tool versions the
report records, and the size past which a compile verifies layer by layer."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

# Above this many bytes of weights the compile verifies layer by layer (CompileOptions.layer_streamed
# overrides): the whole-network check holds every weight at once (the cpu twin's Parameters, or
# mindspore.load's ~2x for the cpu target), which past a few GiB is the compile's peak memory.
THRESHOLD_BYTES = 2 << 30


@dataclasses.dataclass
class CompileOptions:
    output: Path | None = None
    target: str = "ascend"
    simplify: bool = True
    verify: bool = True
    inputs: tuple[Path, ...] = ()
    dims: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    mask_inputs: tuple[str, ...] = ()
    atol: float | None = None
    rtol: float | None = None
    report_path: Path | None = None
    emit_source: Path | None = None
    passes: str | None = None  # textual pipeline, e.g. "fuse-rmsnorm"; None = the default pipeline
    disable_passes: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    verify_each: bool = False
    save_fused: Path | None = None
    bundle: Path | None = None  # deploy bundle directory (graphconv.deploy)
    soc: str = "Ascend910B"
    cann: str | None = None  # None: the newest version graphconv.deploy knows
    shape_ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # dim -> (min, max)
    precision: str = "fp32"  # fp32 | fp16 | bf16 (passes.precision)
    keep_fp32: str | None = None  # op types computed in fp32; None = passes.precision.KEEP_FP32
    # verify block by block (graphconv/runtime/blocks.py) against onnxruntime run layer by layer
    # (graphconv/verify/piecewise.py): None = when the model's weights exceed THRESHOLD_BYTES (2 GiB);
    # True / False force it either way
    layer_streamed: bool | None = None
    # (max batch, max seq): a with-past graph's KV cache held in place, as Parameters of that capacity written
    # by each call (passes/stateful_cache.py); None: the graph as given
    cache_capacity: tuple[int, int] | None = None
    # tensor parallelism over this many ranks (graphconv/parallel/tensor_parallel.py): -o names a new directory
    tp: int | None = None


def tool_versions() -> dict[str, str]:
    out = {}
    for dist in ("onnx", "onnxruntime", "onnxsim", "onnx-ir", "onnxscript", "mindspore", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
