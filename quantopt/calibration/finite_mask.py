"""Attention masks of finite values (-100, -1e4, -1e9): found from the graph, then treated as the infinite ones.

Swin's shifted windows add a constant mask of 0 and -100 to the attention scores before Softmax; other exports add
-1e4 or -1e9. Taken as data, such a value stretches the range of the scores it is added to (a -100 beside scores of
±10 makes their 8-bit step about five times coarser) while it only ever serves to give a probability of about
e^-100 = 0. calibration/inf_mask.py already handles masks of ±inf and |x| >= 1e30; this module finds the finite ones
so that the same rules apply to them (docs/statistics-and-dump.md, "Masks with finite values"):

* a *finite mask* reaches one input of an Add (Eltwise ADD) through layers that only move or repeat values, where
  the Add's output reaches a Softmax through layers that only move values, and is one of (or, subtracted from the
  scores by a Sub or Eltwise SUB, one of these with the signs turned: Funnel's `scores - 1e6 * (1 - keep)`)
  - a Constant layer whose float values are 0 and values of at most -`FINITE_MASK_MIN` (nothing else, at least one
    of each): Swin's shifted-window mask;
  - a Where choosing between two such Constants (one all 0, the other all at most -`FINITE_MASK_MIN`): a padding
    mask of -1e9 or -1e4 made from the input's keep flags;
  - a Mul (Eltwise MUL) of a tensor by a Constant whose values are all one value of at most -`FINITE_MASK_MIN`:
    BERT's `(1 - keep) * -10000`;
  - a BatchNorm computing `keep · w + b` with `w + b = 0` and every `b` at most -`FINITE_MASK_MIN`: the Parser's
    fold of that product;
* each layer of such a chain (the Constant, the layers after it, the Add, the layers up to the Softmax) collects its
  statistics with a mask threshold of half the mask value nearest zero instead of 1e30: the mask positions are left
  out of the statistics and counted as mask values, and the rest of the inf-mask rules follow (the scores keep their
  own range, a mask position saturates to the integer minimum, the Softmax gives it probability 0 exactly);
* the float graph is not changed: its forward still adds -100.

All this only with the cfg field `detect_finite_masks` (off by default: upstream takes these values as data, and
the accuracy advice names the chains it finds, analysis/advisor.py); `upstream_defects = mask_as_data` turns it
off with the infinite masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from .inf_mask import arithmetic_method

FINITE_MASK_MIN = 64.0
"""A mask value is at most -this: e^-64 is about 1.6e-28, a probability no quantized Softmax can show, and a
constant whose values are 0 and -64 or lower is not a bias of the scores but a mask (relative-position biases
and ALiBi slopes hold values near zero too)."""

MOVING = frozenset({"Reshape", "Transpose", "Permute", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
"""Layers that only move values: between the Add and the Softmax, and between the Constant and the Add."""
REPEATING = frozenset({"Tile", "Repeat", "Expand", "BroadcastTo"})
"""Layers that repeat values: allowed between the Constant and the Add (a mask broadcast over heads)."""


def _walk_back(t: PyTensor, kinds: frozenset, path: List[PyNode]) -> Optional[PyNode]:
    """The layer making `t`, past the layers of `kinds` (only moving or repeating values; each appended to `path`,
    read through its first input, the others being shapes); None where the walk reaches a graph input."""
    node = t.pnode
    while node is not None and str(node.type) in kinds and len(node.outputs) == 1 and node.inputs:
        path.append(node)
        node = node.inputs[0].pnode
    return node if node is None or str(node.type) not in kinds else None


def _constant_values(node: Optional[PyNode]) -> Optional[torch.Tensor]:
    """The finite float values of a Constant layer, else None."""
    if node is None or str(node.type) != "Constant" or node.inputs or "weights" not in node.constants:
        return None
    values = node.constants["weights"].betensor
    if not values.is_floating_point() or not values.numel() or not bool(torch.isfinite(values).all()):
        return None
    return values


def _constant_mask_value(node: PyNode, path: List[PyNode], sign: float) -> Optional[float]:
    """The mask value nearest zero of a Constant of 0 and values of at most -FINITE_MASK_MIN, else None; `sign`:
    -1 where the mask is subtracted (its values then count negated), else 1."""
    values = _constant_values(node)
    if values is None:
        return None
    values = values * sign
    nonzero = values[values != 0]
    if nonzero.numel() == 0 or nonzero.numel() == values.numel():
        return None
    nearest = float(nonzero.max())
    return nearest if nearest <= -FINITE_MASK_MIN else None


def _chosen_mask_value(node: PyNode, path: List[PyNode], sign: float) -> Optional[float]:
    """The mask value of a Where choosing between an all-zero Constant and one of mask values (their layers appended
    to `path`), else None."""
    if str(node.type) != "Where" or len(node.inputs) != 3:
        return None
    found: List[PyNode] = []
    sources = [_walk_back(t, MOVING | REPEATING, found) for t in node.inputs[1:]]
    branches = [_constant_values(n) for n in sources]
    if any(b is None for b in branches):
        return None
    branches = [b * sign for b in branches]
    zero = [bool((b == 0).all()) for b in branches]
    if zero.count(True) != 1:
        return None
    nearest = float(branches[zero.index(False)].max())
    if nearest > -FINITE_MASK_MIN:
        return None
    path.extend(found + [n for n in sources if n is not None])
    return nearest


def _scaled_mask_value(node: PyNode, path: List[PyNode], sign: float) -> Optional[float]:
    """The mask value of a Mul of a tensor by a Constant of one value of at most -FINITE_MASK_MIN (the Constant's
    layers appended to `path`), else None."""
    if arithmetic_method(node) != "MUL" or len(node.inputs) != 2:
        return None
    for inp in node.inputs:
        found: List[PyNode] = []
        source = _walk_back(inp, MOVING | REPEATING, found)
        values = _constant_values(source)
        if values is not None and bool((values == values.reshape(-1)[0]).all()):
            fill = float(values.reshape(-1)[0]) * sign
            if fill <= -FINITE_MASK_MIN:
                path.extend(found + [source])
                return fill
    return None


def _batchnorm_mask_value(node: PyNode, path: List[PyNode], sign: float) -> Optional[float]:
    """The mask value of a BatchNorm computing `keep · w + b` with `w + b = 0` and every `b` at most
    -FINITE_MASK_MIN (the Parser's fold of `(1 - keep) · fill`), else None."""
    if str(node.type) != "BatchNorm":
        return None
    w, b = node.constants.get("weights"), node.constants.get("biases")
    if w is None or b is None or b.betensor.numel() == 0 or w.betensor.shape != b.betensor.shape:
        return None
    if not bool(torch.isfinite(b.betensor).all()) or not bool((w.betensor + b.betensor == 0).all()):
        return None
    nearest = float((b.betensor * sign).max())
    return nearest if nearest <= -FINITE_MASK_MIN else None


def _mask_source(t: PyTensor, chain: List[PyNode], sign: float) -> Optional[float]:
    """The mask value (as the scores get it: negated where `sign` is -1, a subtracted mask) of the finite mask `t`
    comes from through moving and repeating layers (those layers and the mask's layers appended to `chain`), else
    None."""
    node = _walk_back(t, MOVING | REPEATING, chain)
    if node is None:
        return None
    for find in (_constant_mask_value, _chosen_mask_value, _scaled_mask_value, _batchnorm_mask_value):
        value = find(node, chain, sign)
        if value is not None:
            chain.append(node)
            return value
    return None


@dataclass(frozen=True)
class FiniteMask:
    """One finite-mask chain: the Add (or Sub) that adds (subtracts) the mask, the mask value nearest zero as the
    scores get it, and every layer of the chain (the mask's layers, the Add, the layers up to the Softmax)."""
    add: PyNode
    value: float
    layers: Tuple[PyNode, ...]


def finite_masks(graph: PyGraph) -> List[FiniteMask]:
    """Every finite-mask chain of `graph` (module docstring), in the order of their Softmax layers."""
    found: List[FiniteMask] = []
    for softmax in graph.nodes:
        if str(softmax.type) != "Softmax" or not softmax.inputs:
            continue
        after: List[PyNode] = []
        node = _walk_back(softmax.inputs[0], MOVING, after)
        method = arithmetic_method(node) if node is not None else ""
        if node is None or method not in ("ADD", "SUB") or len(node.inputs) != 2:
            continue
        for index, inp in enumerate(node.inputs):
            chain: List[PyNode] = []
            value = _mask_source(inp, chain, -1.0 if method == "SUB" and index == 1 else 1.0)
            if value is not None:
                found.append(FiniteMask(node, value, tuple(chain + [node] + after)))
    return found


def finite_mask_thresholds(graph: PyGraph) -> Dict[str, float]:
    """Layer name -> the mask threshold its statistics use, for every layer of a finite-mask chain (module
    docstring): half the magnitude of the chain's mask value nearest zero (the smallest where chains share a
    layer). Empty for a graph without one."""
    thresholds: Dict[str, float] = {}
    for mask in finite_masks(graph):
        threshold = -mask.value / 2.0
        for n in mask.layers:
            thresholds[n.name] = min(threshold, thresholds.get(n.name, threshold))
    return thresholds
