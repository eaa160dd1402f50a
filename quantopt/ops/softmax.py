"""Softmax along `axis` (default -1, negative counts from the end)."""
from __future__ import annotations

import torch

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import axis_param


@op_register(OpType.Softmax)
def softmax_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=-1), x.dim())
    self.outputs[0].betensor = torch.softmax(x, dim=axis)
