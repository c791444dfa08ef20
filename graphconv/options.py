"""A compile's options: the `graphconv compile` flags, built once by the CLI (or by `graphconv.compile(**options)`)
and checked against each other once, by `CompileOptions.validate()`.

The compile of one model and the compile of a generation folder receive the same object. The folder's build
derives each graph's options from it with `dataclasses.replace`. Checks that need the model or the filesystem
live with the stage that has them: `Compiler.check_output` for a model, the generation build's `check` for a
folder, and the deploy bundle's own check of its inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from graphconv.errors import InputError

# Above this many bytes of weights the compile verifies layer by layer (CompileOptions.layer_streamed
# overrides). The whole-network check holds every weight at once, which past a few GiB is the compile's peak
# memory: the cpu twin's Parameters, or mindspore.load's copy of about twice the weights for the cpu target.
THRESHOLD_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """The flags only a generation folder takes: how its KV cache is held and whether cpu MindIRs are written."""

    stateful_cache: bool | None = None  # True: held in place or an error; False: passed in and out; None: where it can
    max_batch: int = 8  # the held cache's rows: prompts per generate call
    max_seq_len: int | None = None  # its positions; None takes the model's max_position_embeddings, capped
    cpu_twin: bool | None = None  # write the cpu MindIRs beside the ascend ones; None: where this host can run them

    def given(self) -> list[str]:
        """The flags set away from their defaults, as the CLI spells them."""
        default = GenerationOptions()
        flags = {"stateful_cache": "--[no-]stateful-cache", "max_batch": "--max-batch",
                 "max_seq_len": "--max-seq-len", "cpu_twin": "--[no-]cpu-twin"}
        return [flag for name, flag in flags.items() if getattr(self, name) != getattr(default, name)]


@dataclasses.dataclass(frozen=True)
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
    passes: str | None = None  # the textual pipeline, e.g. "fuse-rmsnorm"; None runs the default pipeline
    disable_passes: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    verify_each: bool = False
    save_fused: Path | None = None
    bundle: Path | None = None  # the deploy bundle's directory (graphconv.deploy)
    soc: str = "Ascend910B"
    cann: str | None = None  # None takes the newest version graphconv.deploy knows
    shape_ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # dim -> (min, max)
    precision: str = "fp32"  # fp32 | fp16 | bf16 (passes.precision)
    keep_fp32: str | None = None  # the op types computed in fp32; None keeps passes.precision.KEEP_FP32
    # Verify block by block against onnxruntime run layer by layer. None decides by size (THRESHOLD_BYTES);
    # True and False force it either way.
    layer_streamed: bool | None = None
    # (max batch, max seq): a with-past graph's KV cache held in place, as Parameters of that capacity that each
    # call writes (passes/stateful_cache.py). None compiles the graph as given. The generation build sets it.
    cache_capacity: tuple[int, int] | None = None
    tp: int | None = None  # tensor parallelism over this many ranks: -o names a new directory
    # --quantize w4a16[:GROUP] | w8a16[:GROUP] | w8a8 (graphconv/quantize.py): the float model quantized by
    # onnxruntime's tools in the workspace, then compiled; --calibration: w8a8's inputs (.npz by input name)
    quantize: str | None = None
    calibration: Path | None = None
    save_quantized: Path | None = None  # also write the quantized ONNX model here (the generation build sets it)
    generation: GenerationOptions = GenerationOptions()

    def validate(self) -> None:
        """Raise InputError for options that contradict each other or take no valid value. This is the one
        place such checks live; nothing here reads the model or the filesystem."""
        from graphconv import quantize
        from graphconv.compiler import targets
        from passes import precision

        if self.precision not in precision.PRECISIONS:
            raise InputError(f"unknown precision {self.precision!r} (choose from {', '.join(precision.PRECISIONS)})")
        targets.get(self.target).check(self.precision)
        if self.keep_fp32 is not None and self.precision == "fp32":
            raise InputError("--keep-fp32 needs --precision fp16 or bf16")
        try:
            precision.check_keep(precision.parse_keep(self.keep_fp32))
        except precision.PrecisionError as e:
            raise InputError(str(e)) from e
        for flag, value in (("--atol", self.atol), ("--rtol", self.rtol)):
            if value is not None and not value >= 0:
                raise InputError(f"{flag} {value}: must be a number >= 0")
        for name, (lo, hi) in self.shape_ranges.items():
            if not 1 <= lo <= hi:
                raise InputError(f"--shape-range {name}={lo}..{hi}: expected 1 <= MIN <= MAX")
        self._validate_generation()
        quantize.check_options(self.quantize, self.calibration)
        if self.quantize is not None and self.tp is not None:
            raise InputError("--quantize is not supported with --tp yet")
        if self.tp is not None:
            self._validate_tp()

    def _validate_generation(self) -> None:
        gen = self.generation
        if not isinstance(gen.max_batch, int) or gen.max_batch < 1:
            raise InputError(f"--max-batch {gen.max_batch}: must be an integer >= 1")
        if gen.max_seq_len is not None and (not isinstance(gen.max_seq_len, int) or gen.max_seq_len < 2):
            raise InputError(f"--max-seq-len {gen.max_seq_len}: must be an integer >= 2")

    def _validate_tp(self) -> None:
        """What --tp takes in this version."""
        if not isinstance(self.tp, int) or self.tp < 2:
            raise InputError(f"--tp {self.tp}: give at least 2 ranks")
        if self.output is None:
            raise InputError("--tp needs -o OUT_DIR (a new directory)")
        for flag, value in (("--emit-source", self.emit_source), ("--layer-streamed", self.layer_streamed),
                            ("--verify-each", self.verify_each)):
            if value:
                raise InputError(f"{flag} is not supported with --tp yet")
        if self.precision != "fp32":
            raise InputError("--tp is fp32 only in this version")
        if self.generation.stateful_cache is False:
            raise InputError("--tp: a generation folder compiles with its KV cache held in place only (not with "
                             "--no-stateful-cache)")
        if self.generation.cpu_twin is False:
            raise InputError("--tp: the cpu MindIRs are what generate and the cached-step check run here "
                             "(not with --no-cpu-twin)")


def parse_dims(values: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """`--dim NAME=A,B` values as {name: (a, b)}."""
    dims = {}
    for v in values:
        name, _, sizes = v.partition("=")
        try:
            a, b = (int(s) for s in sizes.split(","))
            if a <= 0 or b <= 0:
                raise ValueError
        except ValueError:
            raise InputError(f"--dim {v!r}: expected NAME=SIZE1,SIZE2 with two positive sizes") from None
        dims[name] = (a, b)
    return dims


def parse_shape_ranges(text: str | None) -> dict[str, tuple[int, int]]:
    """`--shape-range DIM=MIN..MAX,...` as {dim: (min, max)}; validate() checks the bounds."""
    ranges = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, span = item.partition("=")
        lo, sep, hi = span.partition("..")
        try:
            if not sep:
                raise ValueError
            ranges[name.strip()] = (int(lo), int(hi))
        except ValueError:
            raise InputError(f"--shape-range {item!r}: expected DIM=MIN..MAX with 1 <= MIN <= MAX") from None
    return ranges
