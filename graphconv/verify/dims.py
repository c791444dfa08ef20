"""Symbolic dims and the relations between them, so that generated reference inputs are ones the model runs on.

A decode step of an LLM has inputs whose sizes are not independent: input_ids [batch, seq], a cache
[batch, heads, past, head_dim] and an attention mask [batch, past + seq]. Relations come from two places:
  written   a dim_param that is an expression of other dims ("past + 1", "past_sequence_length +
            sequence_length", "2*s0"): integers, names, + - * // and parentheses;
  named     onnxruntime's tools' names for a decode step (CONVENTIONS: total_sequence_length =
            past_sequence_length + sequence_length)
  implied   the graph only runs if two dims agree (a mask of length `total` is added to scores over
            `past + seq` keys): onnxruntime's symbolic shape inference, with auto_merge, suggests the merge
            total = past + seq; a merge of two plain names makes them one.
`solve` picks sizes for the free dims (the caller's rule, or --dim) and derives the others. A user's
--inputs are checked against the same relations (`check_sizes`).
"""

from __future__ import annotations

import ast
import re

import onnx

from graphconv.errors import InputError
from graphconv.frontend.shapes import symbolic_inference

_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)
BATCH = re.compile(r"batch|^n$|^b$|^bs$|^N$", re.I)  # the names reference inputs size as a batch


def parse(text: str) -> ast.expr | None:
    """The expression tree of a dim name that is an expression; None for a plain name or anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(tree, ast.Name):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and not isinstance(node.op, _OPS):
            return None
        if not isinstance(node, (ast.BinOp, ast.Name, ast.Constant, ast.Load, *_OPS)) or \
                (isinstance(node, ast.Constant) and not isinstance(node.value, int)):
            return None
    return tree


def symbols(tree: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def evaluate(tree: ast.expr, sizes: dict[str, int]) -> int:
    if isinstance(tree, ast.Constant):
        return int(tree.value)
    if isinstance(tree, ast.Name):
        return sizes[tree.id]
    a, b = evaluate(tree.left, sizes), evaluate(tree.right, sizes)
    op = type(tree.op)
    return a + b if op is ast.Add else a - b if op is ast.Sub else a * b if op is ast.Mult else a // b


def implied_merges(model: onnx.ModelProto) -> dict[str, str]:
    """The symbolic shape inference's suggested merges (dim text -> dim text), with auto_merge: where two
    dims must agree for the graph to run. {} if it cannot run."""
    ssi = symbolic_inference(model, auto_merge=True)
    return {str(k): str(v) for k, v in ssi.suggested_merge_.items()} if ssi is not None else {}


# Dim names onnxruntime's tools write for a decode step without writing the relation: onnxruntime-genai's
# model builder (an attention_mask [batch_size, total_sequence_length] over past_sequence_length +
# sequence_length keys) and its transformers optimizer's GPT-2 (total_seq_len = past_seq_len + seq_len).
CONVENTIONS = {"total_sequence_length": "past_sequence_length + sequence_length",
               "total_seq_len": "past_seq_len + seq_len"}


def relations(names: list[str], model: onnx.ModelProto | None = None) -> dict[str, ast.expr]:
    """Derived dim -> its expression over other dims, for the symbolic dim `names` of the graph inputs."""
    derived: dict[str, ast.expr] = {n: tree for n in names if (tree := parse(n)) is not None}
    for name, text in CONVENTIONS.items():
        tree = parse(text)
        if name in names and name not in derived and symbols(tree) <= set(names) - set(derived):
            derived[name] = tree
    plain = [n for n in names if n not in derived]
    # The shape inference costs a walk of the graph (~1 s at 1.1B): only where two dims besides the batch
    # could be related (a plain forward pass has batch and seq only).
    if model is None or len({n for n in plain if not BATCH.search(n)}) < 2:
        return derived
    for a, b in implied_merges(model).items():
        for name, other in ((a, b), (b, a)):
            if name in plain and name not in derived:
                tree = parse(other) or (ast.Name(other) if other in plain and other != name else None)
                if tree is not None and name not in symbols(tree) and \
                        all(s in plain and s not in derived for s in symbols(tree)):
                    derived[name] = tree
                    break
    return derived


def solve(free_sizes: dict[str, tuple[int, int]], derived: dict[str, ast.expr]) -> dict[str, tuple[int, int]]:
    """Both cases' sizes of every dim: the free ones as given, each derived one from its expression."""
    sizes = dict(free_sizes)
    pending = dict(derived)
    while pending:
        ready = [n for n, t in pending.items() if symbols(t) <= set(sizes)]
        if not ready:
            raise InputError(f"the dims {sorted(pending)} are defined in terms of each other: give --inputs")
        for n in ready:
            tree = pending.pop(n)
            values = tuple(evaluate(tree, {k: v[c] for k, v in sizes.items()}) for c in range(2))
            if min(values) < 1:
                raise InputError(f"dim {n!r} = {ast.unparse(tree)} comes out as {values}: give --dim for "
                                 f"{', '.join(sorted(symbols(tree)))} or --inputs")
            sizes[n] = values
    return sizes


def check_sizes(seen: dict[str, list[tuple[str, int]]], derived: dict[str, ast.expr], where: str) -> None:
    """One input file's dims: each symbolic dim has one size across the inputs that use it, and each derived
    dim equals its expression. `seen`: dim -> [(input and axis, size)]."""
    sizes = {}
    for name, uses in seen.items():
        distinct = {s for _, s in uses}
        if len(distinct) > 1:
            raise InputError(f"{where}: dim {name!r} differs between inputs: "
                             + ", ".join(f"{u} is {s}" for u, s in uses))
        sizes[name] = uses[0][1]
    for name, tree in derived.items():
        if name in sizes and symbols(tree) <= set(sizes):
            want = evaluate(tree, sizes)
            if sizes[name] != want:
                given = ", ".join(f"{s} = {sizes[s]}" for s in sorted(symbols(tree)))
                raise InputError(f"{where}: {seen[name][0][0]} is {sizes[name]}, but dim {name!r} must be "
                                 f"{ast.unparse(tree)} = {want} ({given})")
