"""The compile of a generation folder from a test: keyword options as `graphconv compile`'s flags give them
(CompileOptions fields, and GenerationOptions' by their own names), validated as the CLI validates them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from graphconv.generation.build import compile_generation
from graphconv.options import CompileOptions, GenerationOptions

_GENERATION = {f.name for f in dataclasses.fields(GenerationOptions)}


def compile_folder(source, output, progress=None, **options) -> dict:
    """compile_generation of `source` into the new folder `output`; returns the report."""
    generation = GenerationOptions(**{k: v for k, v in options.items() if k in _GENERATION})
    opts = CompileOptions(output=Path(output), generation=generation,
                          **{k: v for k, v in options.items() if k not in _GENERATION})
    opts.validate()
    return compile_generation(source, opts, progress)
