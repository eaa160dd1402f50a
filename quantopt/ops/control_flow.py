"""Control flow: Switch.

Switch passes on the first of its inputs that holds data (a TensorFlow-style merge of the branches of a cond: the
branch not taken hands over an empty tensor). Quantized, output i carries input i's params as upstream; the
selected input's integers are re-expressed exactly in output 0's quantization when they come from another input
quantized differently. If and Loop (ONNX subgraph operators) are not supported: quantopt's graphs have no
subgraphs. The integer semantics are in docs/semantics/control-flow.md.
"""
from __future__ import annotations

import math

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..quant.rounding import div_round_half_even
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ._quant import (
    copy_params,
    int_value,
    layer_settings,
    out_range,
    quantize_activation,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/control-flow.md"

INT64_BOUND = 1 << 62

SWITCH = declare_op(
    "Switch", params={}, dtypes=PASSTHROUGH_DTYPES,
    integer="passthrough of the first non-empty input (re-expressed exactly in output 0's scale when it differs)",
    semantics=f"{SEMANTICS}#switch",
    summary="Output 0 is the first input with at least one element (input 0 when all are empty).")


def _selected(node: PyNode) -> int:
    if not node.inputs:
        raise node._error("needs at least one input")
    for i, t in enumerate(node.inputs):
        if t.betensor.numel() > 0:
            return i
    return 0


def _rescale(node: PyNode, src: PyTensor, dst: PyTensor) -> torch.Tensor:
    """round_half_even((q + zp_src) · s_dst / s_src) - zp_dst clamped to dst's range, the float32 scales taken as
    exact rationals (the identity for equal params)."""
    q = int_value(src)
    qmin, qmax = out_range(dst)
    s_src = float(torch.tensor(tensor_scale(src), dtype=torch.float32))
    s_dst = float(torch.tensor(tensor_scale(dst), dtype=torch.float32))
    zp_src, zp_dst = tensor_zp(src), tensor_zp(dst)
    if s_src == s_dst:
        return torch.clamp(q + zp_src - zp_dst, qmin, qmax)
    (n_dst, d_dst), (n_src, d_src) = s_dst.as_integer_ratio(), s_src.as_integer_ratio()
    num, den = n_dst * d_src, n_src * d_dst
    g = math.gcd(num, den)
    num, den = num // g, den // g
    lo, hi = out_range(src)
    if max(abs(lo + zp_src), abs(hi + zp_src)) * num >= INT64_BOUND or 2 * den >= INT64_BOUND:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the scales of '{src.name}' ({s_src}) and "
                               f"'{dst.name}' ({s_dst}) are too far apart to re-express the integers exactly")
    return torch.clamp(div_round_half_even((q + zp_src) * num, den) - zp_dst, qmin, qmax)


@SWITCH.forward
def switch_forward(self: PyNode) -> None:
    """Output 0 = the first non-empty input; quantized, in output 0's quantization."""
    if len(self.outputs) != 1:
        raise self._error(f"has {len(self.outputs)} outputs; Switch has one")
    k = _selected(self)
    src = self.inputs[k]
    if self.quantized and src.betensor.numel() > 0:
        self.outputs[0].betensor = _rescale(self, src, self.outputs[0])
    else:
        self.outputs[0].betensor = src.betensor


@SWITCH.quantize
def switch_quantize(self: PyNode) -> None:
    """Output i carries input i's params (upstream); an input without params gives, as upstream, a float one its
    calibrated range (signed, the layer's activation bits and mode), an integer one scale 1 with its own dtype."""
    if len(self.outputs) != 1:
        raise self._error(f"has {len(self.outputs)} outputs; Switch has one")
    inp, out = self.inputs[0], self.outputs[0]
    if inp.qmin is not None:
        copy_params(out, inp)
    elif inp.ir_dtype.is_float:
        quantize_activation(self, out, True, int(layer_settings(self).q_bits_activation))
    else:
        set_qinvariant(out, inp.ir_dtype.bits, inp.ir_dtype.is_signed)
