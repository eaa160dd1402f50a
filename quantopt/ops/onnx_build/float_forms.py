"""Helpers of the float QDQ forms (DequantizeLinear → float op → QuantizeLinear) that several operator families
share: a float32 constant, the layout of an element-wise op, and how far a stored multiplier is from the
exact scale ratio it stands for (what `QDQGraph.rescale` multiplies by).
"""
from __future__ import annotations

import numpy as np

from ...graph.node import PyNode
from .._quant import tensor_scale
from .perms import Perm, channels_first
from .qdq_graph import QDQGraph, requant_ratio


def float_const(g: QDQGraph, node: PyNode, what: str, value: float) -> str:
    return g.const(f"{node.name}/{what}", np.array(value, dtype=np.float32))


def unary_perm(g: QDQGraph, node: PyNode) -> Perm:
    """Any layout the input already has (channels-first preferred): element-wise ops do not care."""
    x = node.inputs[0]
    return g.common_perm([x], g.rank(x), prefer=channels_first(g.rank(x)))


def requant_factor(node: PyNode, numerator: float) -> float:
    """M · 2^-N / (s_out / numerator): how far the stored multiplier is from the exact ratio it stands for."""
    return float(requant_ratio(node)[0]) * numerator / tensor_scale(node, node.outputs[0])
