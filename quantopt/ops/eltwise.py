"""Element-wise binary ops: `Eltwise` (ADD/SUB/MUL/MAX/MIN) and the standalone Add, Sub, Mul, all with numpy
broadcasting (e.g. squeeze-excite [N,H,W,C] * [N,1,1,C]) and an optional fused `with_activation`."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

import torch

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import apply_fused_activation

ELTWISE_METHODS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ADD": torch.add,
    "SUB": torch.sub,
    "MUL": torch.mul,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
}
# Methods whose result does not depend on how more than two inputs are grouped.
NARY_METHODS = ("ADD", "MAX", "MIN")
STANDALONE_METHODS: Dict[str, str] = {"Add": "ADD", "Sub": "SUB", "Mul": "MUL"}


def eltwise_method(node: PyNode) -> str:
    """`method` of an Eltwise layer, or the one fixed by a standalone Add/Sub/Mul."""
    if str(node.type) in STANDALONE_METHODS:
        return STANDALONE_METHODS[str(node.type)]
    method = str(node.get_param("method")).upper()
    if method not in ELTWISE_METHODS:
        raise node._error(f"unsupported Eltwise method '{method}' (supported: {', '.join(ELTWISE_METHODS)})")
    return method


def _check_inputs(node: PyNode, method: str, xs: List[torch.Tensor]) -> None:
    """Input count and broadcast compatibility, reported with the layer name instead of a torch error."""
    if len(xs) < 2 or (len(xs) > 2 and method not in NARY_METHODS):
        wanted = "at least 2" if method in NARY_METHODS else "exactly 2"
        raise node._error(f"{method} needs {wanted} inputs, got {len(xs)}")
    try:
        torch.broadcast_shapes(*(tuple(x.shape) for x in xs))
    except RuntimeError:
        raise node._error(f"input shapes {[list(x.shape) for x in xs]} do not broadcast") from None


@op_register([OpType.Eltwise, OpType.Add, OpType.Sub, OpType.Mul])
def eltwise_forward(self: PyNode) -> None:
    method = eltwise_method(self)
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, method, xs)
    y = functools.reduce(ELTWISE_METHODS[method], xs)
    self.outputs[0].betensor = apply_fused_activation(self, y)
