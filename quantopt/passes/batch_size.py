"""`modify_batch_dim`: the graph's batch size changed before any model work, so the written IR is made for
another batch size than the float IR (compile once for batch 4, say).

Every layer output but a Constant's has its dim 0 scaled the same way: a dim 0 equal to the first input's batch
becomes the new batch, a multiple `k * batch` of it (heads or time steps folded into dim 0) becomes `k * new`.
Reshape `shape` params follow their output, and a Slice or StridedSlice that took all of dim 0 still does. Every
other parameter is left as the IR has it: the zero-input forward check that follows reports, naming the layer, any
layer whose parameters hold the old batch size (a layer the float forward then computes for another shape than
the IR declares), so a rewrite never passes silently wrong. Constants keep their shapes: they broadcast over the
batch or belong to one sample.
"""
from __future__ import annotations

from typing import List

from ..errors import ConfigError
from ..graph.graph import PyGraph
from ..log import OPT_INFO


def _scaled(dim0: int, old: int, new: int) -> int:
    if dim0 == old:
        return new
    if old > 0 and dim0 % old == 0:
        return dim0 // old * new
    return dim0


def modify_batch_size(graph: PyGraph, batch: int) -> int:
    """Rewrite `graph` for batch size `batch` (see the module docstring); returns the previous batch size."""
    if not graph.input_tensors or not graph.input_tensors[0].ir_shape:
        raise ConfigError("modify_batch_dim needs a model whose first input has a batch dimension",
                          field="modify_batch_dim")
    old = int(graph.input_tensors[0].ir_shape[0])
    if old == batch:
        return old
    changed: List[str] = []
    for node in graph.nodes:
        if str(node.type) == "Constant":
            continue
        before = [int(t.ir_shape[0]) if t.ir_shape else None for t in node.outputs]
        for t in node.outputs:
            if t.ir_shape:
                t.ir_shape = (_scaled(int(t.ir_shape[0]), old, batch),) + tuple(t.ir_shape[1:])
        if str(node.type) == "Reshape" and "shape" in node.params and node.outputs:
            node.params["shape"] = [int(d) for d in node.outputs[0].ir_shape]
        if str(node.type) in ("Slice", "StridedSlice") and node.inputs:
            _whole_dim0(node, old, batch)
        if before != [int(t.ir_shape[0]) if t.ir_shape else None for t in node.outputs]:
            changed.append(node.name)
    OPT_INFO(f"modify_batch_dim: batch size {old} -> {batch} ({len(changed)} layer(s) rewritten)")
    return old


def _whole_dim0(node, old: int, new: int) -> None:
    """A slice that kept every row of dim 0 keeps every row of the new dim 0."""
    begin, end = list(node.params.get("begin", [])), list(node.params.get("end", []))
    strides = list(node.params.get("strides", [])) or [1] * len(begin)
    if not begin or not end or int(begin[0]) != 0 or int(strides[0]) != 1:
        return
    size = int(node.inputs[0].ir_shape[0]) if node.inputs[0].ir_shape else None
    if size is None:
        return
    old_size = size // new * old if new else size
    if int(end[0]) >= old_size:
        end[0] = size
        node.params["end"] = end
