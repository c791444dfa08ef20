"""Generation: compile a generation source into a generation folder (`graphconv compile SOURCE -o GEN_DIR`)
and generate with it (`graphconv generate GEN_DIR`).

    schema.py   generation.json, typed: its one writer and its reader
    sources.py  the sources compile takes (an export, a builder folder, transformers' exporter, one graph)
    cache.py    a KV cache held in place: whether it can be, its capacity, the sizes it is verified at
    build.py    the compile of a folder (Build), every graph under the interrupt guard
    ranks.py    the compile of a folder with --tp: each rank's MindIR
    report.py   report.json and the summary of a folder's compile
    run.py      generate: the prompts, the MindSpore child, the result
    check.py    generate --check: onnxruntime through the same decode loop, the tokens forced

The names below are imported on first use, so that importing the schema (as the export and the deploy
bundle do) does not import the compile.
"""

_PUBLIC = {
    "compile_generation": "build", "is_generation_source": "build", "Build": "build", "summary": "report",
    "generate": "run", "GenerationResult": "run", "parse_input_ids": "run", "read_input_ids_file": "run",
    "sampling_options": "run", "ascend_available": "run", "fits_in_memory": "run",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """The public name `name`, from the module that defines it."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'graphconv.generation' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"graphconv.generation.{_PUBLIC[name]}"), name)
