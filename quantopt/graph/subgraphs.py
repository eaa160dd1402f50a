"""Subgraphs of control-flow layers (If branches, Loop bodies): each is a PyGraph of its own, attached to the layer
that runs it as `node.attrs["subgraphs"]` (parameter name -> PyGraph, e.g. `then_branch`), the way the IR reader
attaches the subgraph sections it reads (docs/ir-format.md, "Subgraph sections").

In a quantized model the control-flow layer and its subgraphs run in float (docs/semantics/control-flow.md): the
stage-1 pass `control_op_preprocess` prepares float-typed copies as `node.attrs["float_subgraphs"]`, which the
quantized copy of the layer runs and the IR writer writes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

from .graph import PyGraph
from .node import PyNode


def node_subgraphs(node: PyNode) -> Dict[str, PyGraph]:
    """The subgraphs `node` runs: its float-typed copies once it is a float layer of a quantized model, else the
    ones it was read or built with."""
    if node.params.get("unquantifiable") is True and "float_subgraphs" in node.attrs:
        return node.attrs["float_subgraphs"]
    return node.attrs.get("subgraphs", OrderedDict())


def all_subgraphs(graph: PyGraph) -> List[PyGraph]:
    """Every subgraph the graph's layers run, nested ones included, each once, in the order of their sections in
    the IR they were read from (built ones after, by name): the order the IR writer writes them in."""
    found: Dict[int, PyGraph] = {}
    stack = [graph]
    while stack:
        g = stack.pop()
        for n in g.nodes:
            for sub in node_subgraphs(n).values():
                if id(sub) not in found:
                    found[id(sub)] = sub
                    stack.append(sub)
    return sorted(found.values(), key=lambda s: (getattr(s, "ir_line", None) is None, getattr(s, "ir_line", 0),
                                                 s.name))


def set_subgraphs(node: PyNode, subgraphs: Dict[str, PyGraph]) -> None:
    """Attach subgraphs built in Python to `node` (parameter -> graph; the parameter gets the graph's name)."""
    node.attrs["subgraphs"] = OrderedDict(subgraphs)
    for key, sub in subgraphs.items():
        sub.header["subgraph_name"] = sub.name
        node.params[key] = sub.name
