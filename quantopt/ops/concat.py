"""Concat along `axis` (negative counts from the end)."""
from __future__ import annotations

from typing import List

import torch

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import axis_param


def _batch_broadcast(xs: List[torch.Tensor], axis: int) -> List[torch.Tensor]:
    """Inputs stored with batch 1 (constants) follow the actual batch of the others when not joining on dim 0."""
    if axis == 0 or len({x.shape[0] for x in xs}) <= 1:
        return xs
    batch = max(x.shape[0] for x in xs)
    return [x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 else x for x in xs]


@op_register(OpType.Concat)
def concat_forward(self: PyNode) -> None:
    xs = [t.betensor for t in self.inputs]
    if not xs:
        raise self._error("Concat needs at least one input")
    ranks = {x.dim() for x in xs}
    if len(ranks) != 1:
        raise self._error(f"inputs have different ranks: {[list(x.shape) for x in xs]}")
    axis = axis_param(self, self.get_param("axis"), ranks.pop())
    xs = _batch_broadcast(xs, axis)
    try:
        self.outputs[0].betensor = torch.cat(xs, dim=axis)
    except RuntimeError:
        raise self._error(f"input shapes {[list(x.shape) for x in xs]} cannot be concatenated on axis {axis}") \
            from None
