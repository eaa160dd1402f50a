"""Calibrated ranges in tests. They live in a side table keyed by tensor name (quantopt/graph/tables.py), not on
the tensor: the graph's table, or the layer's own for a layer outside a graph. A test that reads or sets the range
of a tensor it holds goes through the layer that names it."""
from __future__ import annotations

from typing import Optional, Union

import torch

from quantopt.graph.node import PyNode
from quantopt.graph.tables import TensorRange, ranges_of
from quantopt.graph.tensor import PyTensor

Bound = Optional[Union[float, torch.Tensor]]


def range_of(node: PyNode, t: PyTensor) -> TensorRange:
    """The per-tensor calibrated range of `t`, a tensor of `node` (min/max None when it has none)."""
    return ranges_of(node).get(t)


def set_range(node: PyNode, t: PyTensor, lo: Bound, hi: Bound) -> None:
    """Give `t`, a tensor of `node`, the per-tensor calibrated range [lo, hi] (None, None: none)."""
    ranges_of(node).set(t, lo, hi)
