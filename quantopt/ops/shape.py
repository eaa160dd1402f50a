"""Ops that only move data: Transpose, Reshape. Quantized, they carry their input's params unchanged and move
the integer values exactly like floats."""
from __future__ import annotations

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register, quant_register
from ._quant import copy_params


@op_register(OpType.Transpose)
def transpose_forward(self: PyNode) -> None:
    perm = [int(p) for p in self.get_param("perm")]
    self.outputs[0].betensor = self.inputs[0].betensor.permute(*perm).contiguous()


@op_register(OpType.Reshape)
def reshape_forward(self: PyNode) -> None:
    """IR `shape` includes the batch dim of the IR; the actual batch may differ, so dim 0 follows the input."""
    x = self.inputs[0].betensor
    shape = [int(s) for s in self.get_param("shape")]
    ir_batch = self.inputs[0].ir_shape[0] if self.inputs[0].ir_shape else 1
    if shape and x.dim() > 0 and x.shape[0] != ir_batch and shape[0] == ir_batch:
        shape[0] = x.shape[0]
    self.outputs[0].betensor = x.reshape(shape)


@quant_register([OpType.Transpose, OpType.Reshape])
def shape_only_quantize(self: PyNode) -> None:
    copy_params(self.outputs[0], self.inputs[0])
