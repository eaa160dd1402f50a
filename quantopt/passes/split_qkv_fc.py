"""`enable_pass_split_qkv_fc_in_transformer` (upstream's default, off): a FullyConnected whose only reader is a
Split along its feature axis (a transformer's fused query/key/value projection) becomes one FullyConnected per
part, before statistics (docs/user-guide.md, "Graph passes").

Why: query, key and value have different ranges; as one tensor they share one scale, so the smaller ones lose
precision. Split, each part is calibrated and quantized on its own (weights too, with per-tensor weights).

What qualifies: a FullyConnected with one output, read by nothing but one Split (one input slot) and no graph
output, where the Split cuts the last axis. Part i becomes the layer `<fc name><i>` (a new name when taken) with
rows [o_i, o_i + size_i) of the weights and biases and `num_output = size_i`, writing the Split's output i under
its name; the FullyConnected and the Split go. Each output element is the same dot product as before, so the float
model's outputs do not change. Upstream's own pass (zy_compass_4.2) fails on every graph tried: it stops with an
IndexError on a FullyConnected feeding a Split directly, and with a Reshape between the two (which it looks
through, giving the parts 2-D shapes) the run fails later when the layers are quantized; quantopt applies the
intended rewrite to the direct pair and leaves pairs with a Reshape between them alone.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_INFO
from ..registry.optype import OpType

FIELD = "enable_pass_split_qkv_fc_in_transformer"


def _split_sizes(split: PyNode) -> List[int]:
    return [int(t.ir_shape[-1]) for t in split.outputs]


def _qualifies(fc: PyNode, readers: Dict[int, List[PyNode]], io: Set[int]) -> Optional[PyNode]:
    """The Split the FullyConnected feeds when the pair qualifies (module doc), else None."""
    if len(fc.outputs) != 1 or id(fc.outputs[0]) in io or "weights" not in fc.constants:
        return None
    slots = readers.get(id(fc.outputs[0]), [])
    if len(slots) != 1 or str(slots[0].type) != "Split" or len(slots[0].outputs) < 2:
        return None
    split = slots[0]
    rank = len(fc.outputs[0].ir_shape)
    axis = int(split.params.get("axis", 0))
    if rank == 0 or axis % rank != rank - 1:
        return None
    if sum(_split_sizes(split)) != int(fc.outputs[0].ir_shape[-1]):
        return None
    return split


def _unique(name: str, taken: Set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _part(fc: PyNode, index: int, start: int, size: int, out: PyTensor, taken: Set[str]) -> PyNode:
    node = PyNode(_unique(f"{fc.name}{index}", taken), fc.type, fc.layer_id)
    node.params = fc.params.copy()
    node.params["num_output"] = size
    node.attrs = dict(fc.attrs)
    node.settings = fc.settings
    node.source = fc.source
    node.inputs = list(fc.inputs)
    for key, c in fc.constants.items():
        part = c.clone(f"{c.name}_{index}") if key in ("weights", "biases") else c.clone()
        if key in ("weights", "biases"):
            part.betensor = c.betensor[start:start + size].clone()
            part.ir_shape = tuple(part.betensor.shape)
        node.constants[key] = part
    node.outputs = [out]
    out.pnode = node
    return node


def split_qkv_fc(graph: PyGraph) -> List[Tuple[str, List[str]]]:
    """Split qualifying FullyConnected layers (module doc); returns (FullyConnected, new layers) per split."""
    io = {id(t) for t in graph.input_tensors + graph.output_tensors}
    readers: Dict[int, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            readers.setdefault(id(t), []).append(n)
    taken = {n.name for n in graph.nodes}
    done: List[Tuple[str, List[str]]] = []
    removed: Set[int] = set()
    added: List[PyNode] = []
    for fc in list(graph.nodes):
        if fc.type != OpType.FullyConnected:
            continue
        split = _qualifies(fc, readers, io)
        if split is None:
            continue
        parts, start = [], 0
        for i, (out, size) in enumerate(zip(split.outputs, _split_sizes(split))):
            parts.append(_part(fc, i, start, size, out, taken))
            start += size
        removed.update((id(fc), id(split)))
        added.extend(parts)
        done.append((fc.name, [p.name for p in parts]))
    if not done:
        return done
    graph.nodes = [n for n in graph.nodes if id(n) not in removed]
    for p in added:
        graph.add_node(p)
    graph.finalize(graph.source_file)
    graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    OPT_INFO(f"{FIELD}: " + "; ".join(f"'{fc}' -> {', '.join(parts)}" for fc, parts in done))
    return done
