"""No import cycle among graphconv/, passes/, opmap/ and the zoo (models/, installed as graphconv.zoo): every
import statement (at module level or inside a function: a lazy import is still a dependency) is an edge to the
module it names, and the graph of modules must have no cycle. (A package's __init__ is a facade:
`from graphconv.errors import X` depends on graphconv.errors, not on everything graphconv/__init__.py
re-exports; graphconv/__init__.py imports its pipeline lazily, so at run time that holds too.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("graphconv", "passes", "opmap")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    # The zoo: the repository's models/ folder, which installs as graphconv.zoo (graphconv/zoo links to it)
    for path in (ROOT / "models").rglob("*.py"):
        parts = ["graphconv", "zoo", *path.relative_to(ROOT / "models").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                parts = t.split(".")
                for k in range(len(parts), 0, -1):  # the deepest module the name reaches
                    prefix = ".".join(parts[:k])
                    if prefix in modules:
                        if prefix != name:
                            edges[name].add(prefix)
                        break
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_imports():
    """The check can fail: the walk finds the edges it must (lowering imports opmap, opmap the node context)."""
    edges = _edges(_modules())
    assert "opmap" in edges["graphconv.compiler.lowering"]
    assert "graphconv.compiler.node_context" in edges["graphconv.compiler.lowering"]
    assert "graphconv.zoo.architectures" in edges["graphconv.tools.matrix"]  # the zoo, by its installed name
    assert "graphconv.zoo._common" in edges["graphconv.zoo.llama"]  # and its relative imports
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


# The layers of the data path, lowest first: a module imports only from its own layer or below (a lazy import
# inside a function counts). Package prefixes; the longest match wins.
LAYERS = [
    ("graphconv.zoo",),  # the test zoo: PyTorch factories, importing nothing of graphconv
    ("graphconv.errors", "graphconv.version", "graphconv.progress", "graphconv.workspace", "graphconv.interrupts",
     "graphconv.onnx_domains", "graphconv.dtypes", "graphconv.json_io",
     "graphconv.generation.schema"),  # shared contracts (generation.json: the export and the bundle write it)
    ("graphconv.frontend",),                          # load an ONNX model, its weights and their names
    ("graphconv.verify.compare", "graphconv.verify.reference", "graphconv.verify.census",
     "graphconv.verify.dims", "graphconv.verify.outputs", "graphconv.verify.integer_products",
     "graphconv.verify.exact", "graphconv.verify.observed_ranks",
     "graphconv.verify.quantized_census"),  # the oracle's side
    ("passes", "opmap", "graphconv.compiler"),          # graph passes, op mappings, the compiler to MindSpore
    ("graphconv.runtime", "graphconv.quantize"),      # what runs compiled programs: MindSpore children
    ("graphconv.verify.debug", "graphconv.verify.piecewise", "graphconv.verify.precision_checks",
     "graphconv.deploy", "graphconv.report",
     "graphconv.frontend.export", "graphconv.frontend.hf_export"),  # what runs a stage of the above end to end
    ("graphconv.options", "graphconv.pipeline", "graphconv.verification", "graphconv.stage_results",
     "graphconv.stage_context", "graphconv.oracle_stage",
     "graphconv.generation", "graphconv.parallel"),
    ("graphconv.tools", "graphconv.cli", "graphconv.__main__", "graphconv",
     "graphconv.zoo.examples"),  # commands on top (the zoo's examples/make_examples.py exports with graphconv)
]


def _layer(module: str) -> int:
    best, rank = -1, None
    for k, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), k
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_no_import_reaches_a_higher_layer():
    edges = _edges(_modules())
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "imports from a lower layer to a higher one: " + "; ".join(upward)


def test_the_compile_path_imports_no_test_zoo_and_no_torch():
    """The test zoo (PyTorch factories in models/, installed as graphconv.zoo): only `graphconv export` and
    `graphconv matrix` resolve zoo names, lazily; nothing else in the product imports it, nor torch (an install
    without the torch extra compiles and inspects)."""
    # graphconv.frontend.hf_export: `graphconv export CHECKPOINT_DIR`, torch and transformers imported inside
    # its functions (the CLI imports it only for `export`); graphconv.frontend.weightless_export, its fake-weight
    # exporter, is imported only from inside hf_export's functions; graphconv.frontend.tokenizer imports
    # transformers' AutoTokenizer inside `load`, for `generate --prompt` only; graphconv.frontend.export_rewrites,
    # imported by hf_export only, imports torch inside the rewrites it swaps in while tracing;
    # graphconv.frontend.quantized_checkpoint, imported by hf_export only, dequantizes checkpoint tensors in torch;
    # graphconv.frontend.tasks reads transformers' auto classes inside `infer`, for `export --task auto` only;
    # graphconv.frontend.quantized_linears, quantized_activations, compressed_tensors, gptq_awq and msmodelslim,
    # imported by hf_export and quantized_checkpoint only, give quantized checkpoint tensors to the export in torch
    allowed = {"graphconv.frontend.export", "graphconv.frontend.hf_export", "graphconv.frontend.weightless_export",
               "graphconv.frontend.tokenizer", "graphconv.tools.matrix", "graphconv.frontend.export_rewrites",
               "graphconv.frontend.quantized_checkpoint", "graphconv.frontend.tasks",
               "graphconv.frontend.quantized_linears", "graphconv.frontend.compressed_tensors",
               "graphconv.frontend.gptq_awq", "graphconv.frontend.msmodelslim",
               "graphconv.frontend.quantized_activations"}
    found = []
    for name, path in _modules().items():
        if name in allowed or name == "graphconv.zoo" or name.startswith("graphconv.zoo."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{name} imports {n}" for n in names
                      if n.split(".")[0] in ("models", "torch", "transformers")
                      or n == "graphconv.zoo" or n.startswith("graphconv.zoo.")]
    assert not found, "; ".join(found)


# What the compiler must not import: it writes programs; graphconv/runtime runs them (processes, threads,
# signals, the MindSpore children).
_PROCESS_MACHINERY = ("subprocess", "threading", "signal", "multiprocessing", "concurrent", "select", "atexit",
                      "graphconv.runtime")


def test_the_compiler_imports_no_process_thread_or_signal_machinery():
    found = []
    for name, path in _modules().items():
        if not name.startswith("graphconv.compiler"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{name} imports {n}" for n in names
                      if any(n == m or n.startswith(m + ".") for m in _PROCESS_MACHINERY)]
    assert not found, "; ".join(found)


def test_no_module_reads_generated_code_with_ast():
    """Code generation renders the partition into block classes (graphconv/compiler/partition.py); nothing that
    writes, runs or schedules generated code parses it back. (ast elsewhere reads other things: dim
    expressions, graphconv's own source for the bundle's scripts.)"""
    near_generated = ("graphconv.compiler", "graphconv.runtime", "graphconv.pipeline", "graphconv.scheduling")
    readers = [name for name, path in _modules().items() if name.startswith(near_generated)
               and any("ast" in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""])
                       for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom)))]
    assert not readers, "modules importing ast: " + ", ".join(readers)


def test_the_zoo_installs_inside_graphconv():
    """The zoo installs as graphconv.zoo: graphconv/zoo links to the repository's models/ folder, and the
    distribution's package list has no top-level `models` (passes and opmap stay: plugins import them)."""
    import tomllib

    assert (ROOT / "graphconv" / "zoo").resolve() == (ROOT / "models").resolve()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["graphconv*", "passes*", "opmap*"]
    assert "models" not in setuptools["package-data"] and "graphconv.zoo" in setuptools["package-data"]
