"""The partition of a lowered program into blocks: the prologue, one block per repeated layer, the epilogue.

graphconv/compiler/layers.py decides, once, which layer every node of the program IR is in; the partition is
that decision as a value. Three users read it:
  - code generation renders it into block classes (codegen.render_blocks), one nn.Cell per block;
  - the block-by-block run (graphconv/runtime/blocks.py) builds one block at a time with only its weights,
    from `plan()`'s description: which values each block reads and makes, which weights it binds;
  - the layer-by-layer oracle (graphconv/verify/piecewise.py) cuts the ONNX graph at the same boundaries,
    by the ONNX names of the values the blocks pass on (`onnx_boundaries()`).

A block reads the program's inputs and values made by earlier blocks, and makes values read by later ones
(the last block: the program's outputs). Layers grouped into one Cell class are one `cell` node each; a layer
left inline (no class) is its nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from graphconv.compiler.program_ir import Attr, AttrValue, Node, Ref, Value


@dataclasses.dataclass(eq=False)
class Block:
    kind: str  # prologue | layer (one call of a layer class) | inline (a layer left inline) | epilogue
    name: str  # prologue | <list attr>[<index>] | <layer module path> | epilogue
    nodes: list[Node]
    inputs: list[Value] = dataclasses.field(default_factory=list)
    outputs: list[Value] = dataclasses.field(default_factory=list)
    layer_class: str | None = None  # a layer block's Cell class
    instance: tuple[str, int] | None = None  # a layer block's (CellList attribute, index) in the program
    weights: list[Attr] = dataclasses.field(default_factory=list)  # the Parameters it binds, in binding order


@dataclasses.dataclass(eq=False)
class Partition:
    blocks: list[Block]
    inputs: list[Value]  # the program's inputs, in construct's order
    outputs: list[Value]  # the program's outputs

    def boundary(self) -> list[Value]:
        """Every value passed between blocks (the program's inputs first), each once, in order of appearance."""
        seen: dict[int, Value] = {id(v): v for v in self.inputs}
        for b in self.blocks:
            for v in b.outputs:
                seen.setdefault(id(v), v)
        return list(seen.values())

    def onnx_boundaries(self) -> list[list[str]]:
        """Per block, the ONNX names of the values it passes on (those that hold an ONNX value)."""
        return [[v.onnx_name for v in b.outputs if v.onnx_name] for b in self.blocks]

    def plan(self, module: str) -> dict:
        """What the block-by-block run needs (JSON): the block module's path, and per block its class
        (`_Block<k>` there), kind, name, the boundary values it reads and makes (by number), and its weights
        (Parameter name, stored transposed, the Parameter's shape and dtype) in the order its Cell binds them;
        the ONNX name of each value."""
        number = {id(v): k for k, v in enumerate(self.boundary())}
        return {
            "module": module,
            "args": [number[id(v)] for v in self.inputs],
            "outputs": [number[id(v)] for v in self.outputs],
            "onnx_names": {str(number[id(v)]): v.onnx_name for v in self.boundary() if v.onnx_name},
            "blocks": [{"class": f"_Block{k}", "kind": b.kind, "name": b.name, "layer_class": b.layer_class,
                        "inputs": [number[id(v)] for v in b.inputs], "outputs": [number[id(v)] for v in b.outputs],
                        "weights": [[param_key(a), bool(a.param is not None and a.param.transposed), list(a.shape),
                                     a.dtype] for a in b.weights]}
                       for k, b in enumerate(self.blocks)],
        }


def param_key(a: Attr) -> str:
    """The weights-file key and Parameter name of an attribute bound from the weights."""
    if a.param is not None:
        return getattr(a.param, "name", None) or a.param.onnx_name
    return a.name


def is_weight(a: Attr) -> bool:
    """An attribute bound as a Parameter (a weight, or a constant too big for a literal)."""
    return a.param is not None or a.as_parameter


def reads(node: Node) -> Iterator[Value]:
    """Every value a node reads from outside itself: its arguments, and what its nested blocks read."""
    yield from node.inputs()
    if node.blocks:
        made = {id(o) for b in node.blocks for n in b.walk() for o in n.outputs}
        for b in node.blocks:
            for inner in b.walk():
                yield from (v for v in inner.inputs() if id(v) not in made)
            yield from (v for v in b.outputs if id(v) not in made)


def attrs_read(nodes: list[Node]) -> list[Attr]:
    """The attributes these nodes read, in order of first use."""
    found: dict[int, Attr] = {}
    for n in nodes:
        for v in reads(n):
            if isinstance(v, AttrValue):
                found.setdefault(id(v.attr), v.attr)
    return list(found.values())


def build(inputs: list[Value], outputs: list[Value], blocks: list[Block]) -> Partition:
    """The partition of a program whose body is these blocks' nodes, in order: each block's inputs (values it
    reads that are made before it) and outputs (values it makes that later blocks or the program's outputs
    read). The last block returns the program's outputs."""
    made_by: dict[int, int] = {}
    for k, b in enumerate(blocks):
        for n in b.nodes:
            for o in n.outputs:
                made_by[id(o)] = k
    args = {id(v) for v in inputs}
    wanted: list[dict[int, Value]] = [{} for _ in blocks]  # block -> values it must return, in order
    for k, b in enumerate(blocks):
        seen: dict[int, Value] = {}
        for n in b.nodes:
            for v in reads(n):
                if isinstance(v, (AttrValue, Ref)):
                    continue
                src = made_by.get(id(v))
                if (src is not None and src < k) or (src is None and id(v) in args):
                    seen.setdefault(id(v), v)
                    if src is not None:
                        wanted[src].setdefault(id(v), v)
        b.inputs = list(seen.values())
    last = len(blocks) - 1
    for v in outputs:  # the last block returns them: those made earlier (or given) are its inputs too
        src = made_by.get(id(v))
        if src is not None and src < last:
            wanted[src].setdefault(id(v), v)
        if (src is None or src < last) and not isinstance(v, (AttrValue, Ref)) and v not in blocks[last].inputs:
            blocks[last].inputs.append(v)
    for k, b in enumerate(blocks):
        b.outputs = list(outputs) if k == last else list(wanted[k].values())
        if b.kind != "layer":
            b.weights = [a for a in attrs_read(b.nodes + [_returning(b.outputs)]) if is_weight(a)]
    return Partition(blocks, list(inputs), list(outputs))


def _returning(values: list[Value]) -> Node:
    """A tuple node over a block's outputs (so that outputs that are attributes count as read)."""
    return Node("tuple", None, tuple(values))
