"""Control flow in ONNX graphs: an `If` whose condition folds to a constant is replaced by the nodes of the branch it
takes, so that exporters' shape checks (`if x.dim() == 2`, `if sr == 16000`) disappear once input shapes (and
inputs pinned by an initializer) are fixed. Conditions computed from activations cannot be decided at import time;
those Ifs, and Loop/Scan, are reported as unsupported by the importer.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np


def subgraphs(node: Any) -> List[Any]:
    """The GraphProtos held by a node's attributes (If branches, Loop/Scan bodies)."""
    import onnx
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def rename_inputs(node: Any, alias: Mapping[str, str]) -> None:
    """Apply `alias` (removed Identity outputs → their sources) to a node's inputs and to the outer-scope
    references inside its subgraphs (names defined inside a subgraph shadow outer ones and are left alone)."""
    if not alias:
        return
    for i, name in enumerate(node.input):
        if name in alias:
            node.input[i] = alias[name]
    for g in subgraphs(node):
        local = {i.name for i in g.initializer} | {i.name for i in g.input}
        local |= {o for n in g.node for o in n.output}
        inner = {k: v for k, v in alias.items() if k not in local}
        for n in g.node:
            rename_inputs(n, inner)


def if_condition(node: Any, consts: Mapping[str, np.ndarray]) -> Optional[bool]:
    """The value of an If's condition when it is a constant (a one-element tensor), else None."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx") or not node.input or node.input[0] not in consts:
        return None
    cond = np.asarray(consts[node.input[0]])
    if cond.size != 1:
        return None
    return bool(cond.reshape(-1)[0])


def inline_if(node: Any, consts: Dict[str, np.ndarray], names: set,
              constant_value: Callable[[Any], np.ndarray], clean: Callable[[str], str]) -> Optional[List[Any]]:
    """The nodes that replace an If with a constant condition: the taken branch's nodes (its Constant nodes and
    initializers go to `consts`), then one Identity per If output from the branch output. None when the
    condition is not constant."""
    import onnx
    cond = if_condition(node, consts)
    if cond is None:
        return None
    key = "then_branch" if cond else "else_branch"
    branch = next(a.g for a in node.attribute if a.name == key)
    if len(branch.output) != len(node.output):
        return None
    from onnx import numpy_helper
    for init in branch.initializer:
        consts[init.name] = numpy_helper.to_array(init)
    out: List[Any] = []
    for inner in branch.node:
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            consts[n.output[0]] = constant_value(n)
            continue
        base = clean(n.name or f"{node.name}/{n.op_type}")
        name, k = base, 1
        while name in names:
            name = f"{base}_{k}"
            k += 1
        names.add(name)
        n.name = name
        out.append(n)
    for i, (src, dst) in enumerate(zip(branch.output, node.output)):
        if dst:
            out.append(onnx.helper.make_node("Identity", [src.name], [dst], name=f"{node.name}/{key}_out{i}"))
            names.add(f"{node.name}/{key}_out{i}")
    return out
