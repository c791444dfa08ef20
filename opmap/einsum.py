"""Einsum, decomposed at compile time (ops.einsum has no CPU kernel in MindSpore 2.10).

Each operand first loses its repeated labels (diagonals) and the labels no other operand or the output has
(summed). Operands are then combined left to right: a pair whose contraction is one label, with at most one
label of its own on each side, is a batched ops.matmul (attention's "bhqd,bhkd->bhqk", "bij,bjk->bik");
any other pair is a broadcast multiply and a sum over the labels nothing later needs. Last, the result is
transposed to the output's label order. Ellipsis dims get labels of their own, aligned from the right.
"""

from __future__ import annotations

import onnx_ir as ir

from opmap.registry import register

_MATMUL_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def parse(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Labels per operand and of the output; ellipsis dims become labels '0', '1', ... (right-aligned)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"equation {equation!r} has {len(terms)} operands, the node {len(ranks)}")
    ell = 0
    for t, r in zip(terms, ranks):
        if "..." in t:
            ell = max(ell, r - len(t.replace("...", "")))
    ell_labels = [str(i) for i in range(ell)]

    def expand(term: str, rank: int | None) -> list[str]:
        if "..." not in term:
            if rank is not None and len(term) != rank:
                raise ValueError(f"term {term!r} has {len(term)} labels for a rank-{rank} operand")
            return list(term)
        head, _, tail = term.partition("...")
        k = (rank - len(head) - len(tail)) if rank is not None else ell
        if k < 0:
            raise ValueError(f"term {term!r} has more labels than its operand's rank {rank}")
        return list(head) + ell_labels[ell - k:] + list(tail)

    operands = [expand(t, r) for t, r in zip(terms, ranks)]
    if arrow:
        output = expand(rhs, None)
    else:  # implicit output: the ellipsis, then the labels used once, alphabetically
        letters = [c for t in terms for c in t.replace("...", "")]
        output = ell_labels + sorted(c for c in set(letters) if letters.count(c) == 1)
    return operands, output


@register("Einsum", since=12)
def einsum(n):
    ranks = [n.require_rank(i) for i in range(n.n_inputs)]
    try:
        labels, output = parse(n.attr("equation"), ranks)
    except ValueError as e:
        n.fail(str(e))
    matmul_ok = n.dtype(0) in _MATMUL_TYPES
    xs = n.xs()
    terms = []
    for i, (x, lab) in enumerate(zip(xs, labels)):
        x, lab = _diagonals(n, x, lab)
        others = set(output).union(*(labels[j] for j in range(len(labels)) if j != i))
        x, lab = _sum_out(n, x, lab, [c for c in lab if c not in others])
        terms.append((x, lab))
    x, lab = terms[0]
    for k in range(1, len(terms)):
        needed = set(output).union(*(t[1] for t in terms[k + 1:]))
        x, lab = _pair(n, (x, lab), terms[k], needed, matmul_ok)
    x, lab = _sum_out(n, x, lab, [c for c in lab if c not in output])
    perm = tuple(lab.index(c) for c in output)
    return x if perm == tuple(range(len(perm))) else n.call("ops.transpose", x, perm)


def _diagonals(n, x, lab):
    """A label repeated within one operand takes the diagonal (ops.diagonal puts it last)."""
    lab = list(lab)
    while True:
        dup = next((c for c in lab if lab.count(c) > 1), None)
        if dup is None:
            return x, lab
        i = lab.index(dup)
        j = lab.index(dup, i + 1)
        x = n.call("ops.diagonal", x, 0, i, j)
        lab = [c for k, c in enumerate(lab) if k not in (i, j)] + [dup]


def _sum_out(n, x, lab, gone):
    if not gone:
        return x, lab
    axes = tuple(lab.index(c) for c in gone)
    return n.call("ops.sum", x, axes), [c for c in lab if c not in gone]


def _transpose(n, x, lab, order):
    perm = tuple(lab.index(c) for c in order)
    return x if perm == tuple(range(len(perm))) else n.call("ops.transpose", x, perm)


def _pair(n, a, b, needed, matmul_ok):
    (xa, la), (xb, lb) = a, b
    contract = [c for c in la if c in lb and c not in needed]
    batch = [c for c in la if c in lb and c in needed]
    left = [c for c in la if c not in lb]
    right = [c for c in lb if c not in la]
    if matmul_ok and len(contract) == 1 and len(left) <= 1 and len(right) <= 1:
        xa = _transpose(n, xa, la, batch + left + contract)
        xb = _transpose(n, xb, lb, batch + contract + right)
        if not left:
            xa = n.call("ops.expand_dims", xa, -2)
        if not right:
            xb = n.call("ops.expand_dims", xb, -1)
        y = n.call("ops.matmul", xa, xb)
        if not right:
            y = n.call("ops.squeeze", y, -1)
        if not left:
            y = n.call("ops.squeeze", y, -2 if right else -1)
        return y, batch + left + right
    # broadcast multiply in the order batch, left, right, contract; then sum the contraction
    order = batch + left + right + contract
    ya = _align(n, xa, la, order)
    yb = _align(n, xb, lb, order)
    return _sum_out(n, n.binop("*", ya, yb), order, contract)


def _align(n, x, lab, order):
    """x transposed to its labels' order within `order`, with size-1 dims for the labels it lacks."""
    mine = [c for c in order if c in lab]
    x = _transpose(n, x, lab, mine)
    for i, c in enumerate(order):
        if c not in lab:
            x = n.call("ops.expand_dims", x, i)
    return x
