"""Graph inputs and constants."""
from __future__ import annotations

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register


@op_register(OpType.Input)
def input_forward(self: PyNode) -> None:
    """The executor has already placed the fed data on the output tensor; check it against the IR shape."""
    out = self.outputs[0]
    if out.betensor.numel() == 0 and out.ir_numel != 0:
        raise self._error("no data was fed to this input")


@op_register(OpType.Constant)
def constant_forward(self: PyNode) -> None:
    """Outputs the `weights` constant, broadcast over the current batch if the IR shape has a batch dim of 1."""
    w = self.get_constant("weights").betensor
    self.outputs[0].betensor = w.reshape(self.outputs[0].ir_shape) if w.numel() == self.outputs[0].ir_numel else w
