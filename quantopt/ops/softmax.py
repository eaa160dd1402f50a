"""Softmax along `axis` (default -1, negative counts from the end)."""
from __future__ import annotations

import torch

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register


def _axis(node: PyNode, rank: int) -> int:
    """`axis` as a non-negative dim; out of range is an IR error naming the layer, not a torch IndexError."""
    axis = node.get_param("axis", optional=True, default_value=-1)
    try:
        if isinstance(axis, bool) or (isinstance(axis, float) and not axis.is_integer()):
            raise ValueError(axis)
        value = int(axis)
    except (TypeError, ValueError):
        raise node._error(f"axis must be an integer, got {axis!r}") from None
    if not -rank <= value < rank:
        raise node._error(f"axis {value} is out of range for a {rank}-D input")
    return value % rank


@op_register(OpType.Softmax)
def softmax_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    self.outputs[0].betensor = torch.softmax(x, dim=_axis(self, x.dim()))
