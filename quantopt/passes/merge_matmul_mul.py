"""`enable_pass_merge_matmul_mul` (on by default, as upstream): a constant positive factor applied to a MatMul's
result is folded into the MatMul before statistics (docs/user-guide.md, "Graph passes").

Why: attention scores are `(Q @ K^T) * (1/sqrt(d))`. Folded, the MatMul's output is calibrated after the factor and
its requantization multiplier carries it, so the scores need one rounding instead of two, and quantopt's IR has the
layers and scales upstream's has (docs/golden-differences.md).

What qualifies, walking from a MatMul without fused activation (or with RELU) whose output has one reader and is no
graph output:
* zero or more shape-only layers (`SHAPE_ONLY`), each the only reader of the previous output, none of whose
  outputs is a graph output (a constant Pad qualifies only with padding value 0);
* then either a Mul (or Eltwise MUL) without fused activation whose other input comes from layers fed by Constant
  layers only (the factor's subgraph: its only use is this input, none of its tensors is a graph input or output),
  holding one distinct value > 0, where the Mul does not broadcast the MatMul side to more elements; or a
  BatchNorm without mean/var whose weights hold one distinct value > 0 and whose biases are all 0 (or absent).

Then each MatMul (any fold above included) with one reader layer looks up its inputs for scaling BatchNorms, as
upstream's second step does: a breadth-first walk over the producers of its inputs, in input order, where a layer
with more than one reader (or a graph output) is passed over, a BatchNorm is collected (not walked through), a
shape-only layer hands on the producer of its first input, and any other layer ends the walk. When every collected
BatchNorm only scales by one positive value, their factors multiply the MatMul's (a factor commutes with the shape
moves and through the product) and they become identity Crops, as a folded Mul does. Attention written as
`(q · s) @ k^T` (the query scaled before the product) folds like `(q @ k^T) · s`.

The MatMul gets the parameter `fused_multiplier` (the factor as a float32 value): its float forward multiplies its
float32 result by it (after any fused activation), so the float model computes the same bits as before; its
quantize function folds it into the requantization multiplier and drops it, so a quantized IR never carries it (a
float layer of a mixed model keeps it). The Mul/BatchNorm stays, under its name, as an identity Crop
(`crops = [[0, d] ...]` over its output shape) reading only the previous layer, and the factor's layers are removed.
Each MatMul is folded once.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import networkx as nx
import numpy as np
import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_DEBUG, OPT_INFO
from ..registry.optype import OpType

FUSED_MULTIPLIER = "fused_multiplier"
"""MatMul IR key of a folded factor (read by ops/linear.py)."""

SHAPE_ONLY = frozenset({"Reshape", "Permute", "Transpose", "Squeeze", "Tile", "Repeat", "Pad", "StridedSlice",
                        "Slice", "Split", "Crop", "SpaceToDepth", "DepthToSpace", "SpaceToBatch", "BatchToSpace",
                        "BatchToDepth"})
"""Layers that only move or repeat values, so a factor commutes with them (upstream's list)."""
FOLDABLE_ACTIVATIONS = ("NONE", "RELU")
"""Fused activations of the MatMul that commute with a positive factor (a RELU6/CLIP bound would move)."""


def readers_by_tensor(graph: PyGraph) -> Dict[int, List[PyNode]]:
    """Tensor id -> the layers reading it, once per input slot."""
    out: Dict[int, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            out.setdefault(id(t), []).append(n)
    return out


def only_reader(node: PyNode, readers: Dict[int, List[PyNode]], io: Set[int]) -> Optional[PyNode]:
    """The one layer reading `node`'s outputs (one slot, no graph output among them), else None."""
    slots = [r for t in node.outputs for r in readers.get(id(t), [])]
    if len(slots) != 1 or any(id(t) in io for t in node.outputs):
        return None
    return slots[0]


def _commutes(node: PyNode) -> bool:
    """A shape-only layer; a constant-mode Pad only when it pads with 0."""
    if str(node.type) not in SHAPE_ONLY:
        return False
    if str(node.type) == "Pad":
        mode = str(node.params.get("mode", "CONSTANT")).upper()
        return mode != "CONSTANT" or float(node.params.get("constant_value", 0) or 0) == 0.0
    return True


def _single_positive(value: torch.Tensor) -> Optional[float]:
    """The one distinct value of a float tensor when it is > 0 (as a float32 value), else None."""
    if not value.is_floating_point() or value.numel() == 0:
        return None
    distinct = torch.unique(value.detach().to(torch.float32))
    if distinct.numel() != 1 or not float(distinct[0]) > 0.0 or not torch.isfinite(distinct[0]):
        return None
    return float(distinct[0])


def _activation(node: PyNode) -> str:
    return str(node.params.get("with_activation", "NONE")).upper()


def _is_mul(node: PyNode) -> bool:
    kind = str(node.type)
    if kind == "Eltwise":
        return str(node.params.get("method", "")).upper() == "MUL" and _activation(node) == "NONE"
    return kind == "Mul" and _activation(node) == "NONE"


def _factor_subgraph(graph: PyGraph, mul: PyNode, side: PyTensor, readers: Dict[int, List[PyNode]],
                     io: Set[int]) -> Optional[Tuple[List[PyNode], float]]:
    """The layers computing the Mul's other input and its factor, when they qualify (see the module doc)."""
    if len(mul.inputs) != 2 or sum(t is side for t in mul.inputs) != 1:
        return None
    other = mul.inputs[1] if mul.inputs[0] is side else mul.inputs[0]
    if other.pnode is None:
        return None
    names = nx.ancestors(graph.nx, other.pnode.name) | {other.pnode.name}
    members = [n for n in graph.nodes if n.name in names]
    if any(not n.inputs and str(n.type) != "Constant" for n in members):
        return None
    inside = {id(n) for n in members}
    outside_reads = [(r, t) for n in members for t in n.outputs for r in readers.get(id(t), [])
                     if id(r) not in inside]
    if outside_reads != [(mul, other)]:
        return None
    if any(id(t) in io for n in members for t in n.inputs + n.outputs):
        return None
    if int(mul.outputs[0].ir_numel) != int(side.ir_numel):
        return None
    for n in members:
        n.forward()
    factor = _single_positive(other.betensor)
    return None if factor is None else (members, factor)


def _scaling_batchnorm(node: PyNode) -> Optional[float]:
    """The factor of a BatchNorm that only scales by one positive value (no mean/var, zero biases)."""
    if str(node.type) != "BatchNorm" or "mean" in node.constants or "var" in node.constants:
        return None
    weights = node.constants.get("weights")
    biases = node.constants.get("biases")
    if weights is None or (biases is not None and bool((biases.betensor != 0).any())):
        return None
    return _single_positive(weights.betensor)


def _make_identity_crop(node: PyNode, keep: PyTensor) -> None:
    """The folded layer becomes a Crop of its whole output, reading `keep` only (settings and attrs stay)."""
    node.type = OpType.Crop
    node.inputs = [keep]
    node.params.clear()
    node.params["crops"] = [[0, int(d)] for d in node.outputs[0].ir_shape]
    node.constants.clear()
    node.placeholders = []


def merge_matmul_mul(graph: PyGraph) -> List[Tuple[str, str, float]]:
    """Fold qualifying factors into their MatMuls (module doc); returns (MatMul, folded layer, factor) per fold."""
    io = {id(t) for t in graph.input_tensors + graph.output_tensors}
    folds: List[Tuple[str, str, float]] = []
    removed: Set[str] = set()
    for mm in list(graph.nodes):
        if str(mm.type) != "MatMul" or mm.name in removed or FUSED_MULTIPLIER in mm.params:
            continue
        if _activation(mm) not in FOLDABLE_ACTIVATIONS:
            continue
        readers = readers_by_tensor(graph)
        prev, cur = mm, only_reader(mm, readers, io)
        while cur is not None and _commutes(cur):
            prev, cur = cur, only_reader(cur, readers, io)
        if cur is None:
            continue
        side = next(t for t in prev.outputs if any(t is i for i in cur.inputs))
        factor: Optional[float] = None
        members: List[PyNode] = []
        if _is_mul(cur):
            found = _factor_subgraph(graph, cur, side, readers, io)
            if found is not None:
                members, factor = found
        else:
            factor = _scaling_batchnorm(cur)
        if factor is None:
            continue
        OPT_DEBUG(f"merge_matmul_mul: '{cur.name}' ({cur.type}) folded into '{mm.name}' as factor {factor!r}; "
                  f"removed {[n.name for n in members]}")
        removed.update(n.name for n in members)
        graph.nodes = [n for n in graph.nodes if n.name not in removed]
        _make_identity_crop(cur, side)
        mm.params[FUSED_MULTIPLIER] = factor
        graph.finalize(graph.source_file)
        graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
        folds.append((mm.name, cur.name, factor))
    folds += _fold_input_batchnorms(graph)
    if folds:
        OPT_INFO(f"merge_matmul_mul: folded {len(folds)} constant factor(s) into MatMul layers: "
                 + ", ".join(f"{m} x {f:g} (via {c})" for m, c, f in folds))
    return folds


def _input_batchnorms(mm: PyNode, readers: Dict[int, List[PyNode]], io: Set[int]) -> List[PyNode]:
    """The BatchNorms found by the breadth-first walk up from `mm`'s inputs (module doc), in the order found."""
    found: List[PyNode] = []
    queue: List[Optional[PyNode]] = []
    for t in mm.inputs:
        if t.pnode is not None and all(t.pnode is not q for q in queue):
            queue.append(t.pnode)
        elif t.pnode is None:
            queue.append(None)
    while queue:
        head = queue.pop(0)
        if head is None:
            break
        reading = {id(r) for t in head.outputs for r in readers.get(id(t), [])}
        if len(reading) > 1 or any(id(t) in io for t in head.outputs):
            continue
        if str(head.type) == "BatchNorm":
            found.append(head)
        elif _commutes(head) and head.inputs:
            queue.append(head.inputs[0].pnode)
        else:
            break
    return found


def _fold_input_batchnorms(graph: PyGraph) -> List[Tuple[str, str, float]]:
    """Scaling BatchNorms above MatMuls with one reader layer folded into them (module doc); (MatMul, BatchNorm,
    factor) per fold."""
    io = {id(t) for t in graph.input_tensors + graph.output_tensors}
    folds: List[Tuple[str, str, float]] = []
    for mm in list(graph.nodes):
        if str(mm.type) != "MatMul" or _activation(mm) not in FOLDABLE_ACTIVATIONS:
            continue
        readers = readers_by_tensor(graph)
        if len({id(r) for t in mm.outputs for r in readers.get(id(t), [])}) != 1:
            continue
        norms = _input_batchnorms(mm, readers, io)
        factors = [_scaling_batchnorm(n) for n in norms]
        if not norms or any(f is None for f in factors):
            continue
        factor = float(mm.params.get(FUSED_MULTIPLIER, 1.0))
        for bn, f in zip(norms, factors):
            factor = float(np.float32(factor) * np.float32(f))
            OPT_DEBUG(f"merge_matmul_mul: BatchNorm '{bn.name}' above '{mm.name}' folded into it as factor {f!r}")
            _make_identity_crop(bn, bn.inputs[0])
            folds.append((mm.name, bn.name, float(f)))
        mm.params[FUSED_MULTIPLIER] = factor
        graph.finalize(graph.source_file)
    return folds
