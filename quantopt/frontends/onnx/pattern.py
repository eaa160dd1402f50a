"""Pattern-matching helpers shared by the fusion passes: who produces and who reads a tensor, constant values,
and the product-of-factors view of a Mul/Div tree (so that `0.5 * x * y`, `x * (y * 0.5)` and `(x * y) / 2` match
the same pattern whatever order an exporter wrote them in).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from .simplify import OGraph, ONode

FUSED_DOMAIN = "quantopt.fused"
"""Domain of the nodes the fusion passes create (ChannelAffine, Swish, Silu): their converters live in fused_ops.py;
an ONNX model can never contain this domain's ops, since the importer rejects other domains up front."""
CONST_TOL = 1e-6
"""Absolute tolerance for the constants of a pattern (the Parser compares with float32 resolution, 1e-6)."""


class Index:
    """Producers and consumers of every tensor of `g`, rebuilt by each pass (passes edit the graph)."""

    def __init__(self, g: OGraph) -> None:
        self.g = g
        self.producer: Dict[str, ONode] = {}
        self.consumers: Dict[str, List[ONode]] = {}
        for n in g.nodes:
            for t in n.outputs:
                if t:
                    self.producer[t] = n
            for t in n.inputs:
                if t:
                    self.consumers.setdefault(t, []).append(n)

    def single(self, tensor: str) -> Optional[ONode]:
        """The one node reading `tensor` (None if it has several readers or is a graph output)."""
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or tensor in self.g.outputs:
            return None
        return users[0]

    def private(self, tensor: str, reader: ONode) -> bool:
        """`tensor` is read by `reader` alone (twice counts as once) and is no graph output: an interior tensor a
        fusion may drop."""
        users = self.consumers.get(tensor, [])
        return bool(users) and all(u is reader for u in users) and tensor not in self.g.outputs

    def made_by(self, tensor: str, *ops: str) -> Optional[ONode]:
        n = self.producer.get(tensor)
        return n if n is not None and n.op in ops and n.domain in ("", "ai.onnx") else None


def scalar(g: OGraph, name: str) -> Optional[float]:
    """Value of a one-element numeric constant, else None."""
    v = g.consts.get(name)
    if v is None or v.size != 1 or not np.issubdtype(v.dtype, np.number):
        return None
    return float(v.reshape(-1)[0])


def f32(value: float) -> float:
    """A float32 constant as its shortest decimal (1e-05, not 9.999999747378752e-06), as attributes are read."""
    return float(str(np.float32(value)))


def close(value: Optional[float], target: float, tol: float = CONST_TOL) -> bool:
    return value is not None and abs(value - target) < tol


def other_input(node: ONode, tensor: str) -> Optional[str]:
    """The input of a two-input node that is not `tensor`."""
    ins = list(node.inputs)
    if len(ins) != 2 or tensor not in ins:
        return None
    return ins[1] if ins[0] == tensor else ins[0]


def const_and_var(g: OGraph, node: ONode) -> Optional[tuple]:
    """(constant input, activation input, constant's position) of a two-input node with exactly one constant."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if (a in g.consts) == (b in g.consts):
        return None
    return (a, b, 0) if a in g.consts else (b, a, 1)


@dataclass
class Product:
    """A Mul/Div tree read as scale * factor_1 * ... * factor_n (scale: the product of its scalar constants)."""
    scale: float = 1.0
    factors: List[str] = field(default_factory=list)
    nodes: List[ONode] = field(default_factory=list)
    """The Mul/Div nodes of the tree (the root first)."""


def product(g: OGraph, idx: Index, tensor: str, root: bool = True) -> Optional[Product]:
    """The tree of Mul (and Div by a scalar constant) nodes that computes `tensor`, descending through interior
    tensors only; None when a Div by a non-constant occurs inside it."""
    node = idx.made_by(tensor, "Mul", "Div")
    if node is None or (not root and not idx.private(tensor, _reader(idx, tensor))) or len(node.inputs) != 2:
        return Product(1.0, [tensor], [])
    out = Product(1.0, [], [node])
    a, b = node.inputs
    if node.op == "Div":
        d = scalar(g, b)
        if d is None or d == 0:
            return Product(1.0, [tensor], []) if not root else None
        out.scale /= d
        parts = [a]
    else:
        parts = [a, b]
    for t in parts:
        s = scalar(g, t)
        if s is not None:
            out.scale *= s
            continue
        sub = product(g, idx, t, root=False)
        if sub is None:
            return None
        out.scale *= sub.scale
        out.factors += sub.factors
        out.nodes += sub.nodes
    return out


def _reader(idx: Index, tensor: str) -> ONode:
    users = idx.consumers.get(tensor, [])
    return users[0] if users else ONode("", "", [], [], {})


def remove(g: OGraph, dead: Iterable[ONode]) -> None:
    ids = {id(n) for n in dead}
    if ids:
        g.nodes = [n for n in g.nodes if id(n) not in ids]


def replace(g: OGraph, old: ONode, new: ONode, dead: Sequence[ONode] = ()) -> None:
    """Put `new` where `old` was (topological order is kept: `new` reads only what `old`'s pattern read) and drop
    the pattern's other nodes."""
    g.nodes[next(i for i, n in enumerate(g.nodes) if n is old)] = new
    remove(g, [n for n in dead if n is not old])


def new_const(g: OGraph, name: str, value: np.ndarray) -> str:
    """Add a constant under a name no tensor has yet."""
    base, k = name, 1
    while name in g.consts or name in g.shapes:
        name = f"{base}_{k}"
        k += 1
    g.consts[name] = value
    g.shapes[name] = tuple(int(d) for d in np.shape(value))
    return name
