"""Statistics for the tensors a statistic file lacks (`ignore_missing_statistic`).

A statistic file made for an earlier version of a graph (a layer added, renamed or re-weighted) has no usable
statistics for some tensors. Rather than giving up, as the default does, this fills them in:
* a weight constant gets statistics from its own values (exactly what the statistics pass would compute);
* a layer output takes those of the nearest tensor with statistics: first its producer's inputs, walking up, then
  its readers' outputs, walking down (upstream fills from parent or child layers the same way). Per-channel parts
  are kept only when the channel count (last axis) matches.
A tensor with no neighbour that has statistics is an error naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import TensorStatistics
from ..graph.tensor import PyTensor
from .collect import weight_statistics

Missing = Tuple[PyNode, str, PyTensor]
"""(layer, "output" or "constant", tensor)."""


def _channels(t: PyTensor) -> Optional[int]:
    return int(t.ir_shape[-1]) if t.ir_shape else None


def _borrowed(stats: TensorStatistics, source: PyTensor, target: PyTensor) -> TensorStatistics:
    """`stats` of `source` for `target`: per-channel parts only when the channel counts agree."""
    if stats.extrema_min_key_axis is None or _channels(source) == _channels(target):
        return stats
    return dataclasses.replace(stats, **{f.name: None for f in dataclasses.fields(stats)
                                         if f.name.endswith("_key_axis")})


def fill_missing(graph: PyGraph, missing: Sequence[Missing], known: Dict[str, TensorStatistics]) -> \
        Tuple[Dict[int, TensorStatistics], List[str]]:
    """Statistics for every missing tensor, keyed by `id(tensor)`, and the names of those no neighbour could give
    statistics to. `known` maps output tensor names to the statistics loaded for them."""
    filled: Dict[int, TensorStatistics] = {}
    available: Dict[str, Tuple[PyTensor, TensorStatistics]] = {}
    tensors = {t.name: t for n in graph.nodes for t in n.outputs}
    for name, stats in known.items():
        if name in tensors:
            available[name] = (tensors[name], stats)
    outputs: List[Tuple[PyNode, PyTensor]] = []
    for node, kind, t in missing:
        if kind == "constant":
            filled[id(t)] = weight_statistics(node, t)
        else:
            outputs.append((node, t))
    readers: Dict[str, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            readers.setdefault(t.name, []).append(n)
    pending = list(outputs)
    for direction in ("up", "down"):
        order = pending if direction == "up" else list(reversed(pending))
        left = []
        for node, t in order:
            neighbours = node.inputs if direction == "up" else \
                [o for r in readers.get(t.name, []) for o in r.outputs]
            source = next((available[x.name] for x in neighbours if x.name in available), None)
            if source is None:
                left.append((node, t))
                continue
            stats = _borrowed(source[1], source[0], t)
            filled[id(t)] = stats
            available[t.name] = (t, stats)
        pending = left if direction == "up" else list(reversed(left))
    return filled, [t.name for _, t in pending]
