"""Softmax along `axis` (default -1, negative counts from the end): float forward, and upstream's LUT method.

Quantized (docs/integer-semantics.md): an exp table indexed by x - max(x) (uint32 constant `lut`),
an int64 sum along the axis, an integer division, then the output requantization `scale_value/shift_value`
(the multiplier/shift of s_out itself: the table already holds e^(x - max) in units of 1/(2^20 - 1)).
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.optype import OpType
from ..quant.hardware import (
    SOFTMAX_DIVIDEND_BITS,
    SOFTMAX_LUT_AUTO_VALUE_BITS,
    SOFTMAX_ROW_BLOCK,
    SOFTMAX_SMALL_AXIS,
)
from ..quant.lut import lookup_lut, lut_size
from ..quant.params import dequantize
from ..quant.requant import range_dtype, requantize_int, scale_shift
from ..registry import op_register, quant_register
from ._lut_int import ceil_log2, constants_first, int_input, range_bits
from ._quant import (
    layer_settings,
    out_range,
    quantize_activation,
    requant_of,
    set_constant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param

LUT_VALUE_BITS = SOFTMAX_LUT_AUTO_VALUE_BITS
"""Table values are e^(x - max) * (2^20 - 1): the value bits upstream uses when it selects the LUT method itself
(`[2, 20]`), the case of every golden Softmax."""


def _axis(node: PyNode, rank: int) -> int:
    return axis_param(node, node.get_param("axis", optional=True, default_value=-1), rank)


def softmax_exp_lut(in_scale: float, in_zp: int, in_bits: int, lut_items_in_bits: int,
                    value_bits: int = LUT_VALUE_BITS) -> torch.Tensor:
    """The exp table, int64 (stored as uint32): entry i = clamp(round(exp(d_i/s + ln(2^value_bits - 1))), 0,
    2^value_bits - 1) where d_i are 2^min(in_bits, lut_items_in_bits) float32 points spread evenly over
    [-(2^in_bits - 1), 0] (the possible values of x - max(x)).

    Evaluated in float32 exactly as upstream, which goes through the zero point and cancels it:
    ((d_i + zp) * (1/s)) + (ln(2^v - 1) - zp/s). This reproduces every golden Softmax table bit for bit.
    """
    steps = lut_size(in_bits, lut_items_in_bits)
    top = 2 ** int(in_bits) - 1
    max_val = 2 ** int(value_bits) - 1
    s32 = torch.tensor(in_scale, dtype=torch.float32)
    offset = torch.log(torch.tensor(float(max_val), dtype=torch.float32)) - torch.tensor(float(in_zp)) / s32
    points = torch.linspace(0.0, float(top), steps=steps) - top
    lut = torch.exp(dequantize(points, in_scale, in_zp) + offset)
    return torch.clamp(torch.round(lut), 0, max_val).to(torch.int64)


@quant_register(OpType.Softmax)
def softmax_quantize(self: PyNode) -> None:
    """LUT method (upstream `quantize_method=LUT`): output unsigned from its calibrated range; exp table over the
    input codes; `scale_value/shift_value` approximate s_out with as many multiplier bits as the output has."""
    inp, out = self.inputs[0], self.outputs[0]
    if inp.qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    s = layer_settings(self)
    if s.q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' (Softmax): per-channel activation quantization is not "
                               "supported (upstream neither)")
    _axis(self, len(inp.ir_shape))
    quantize_activation(self, out, False)
    lut = softmax_exp_lut(tensor_scale(inp), tensor_zp(inp), range_bits(inp), int(s.lut_items_in_bits))
    set_constant(self, "lut", lut, range_dtype(0, 2 ** LUT_VALUE_BITS - 1))
    constants_first(self, ["lut"])
    self.params["quantize_method"] = "LUT"
    store_requant(self, *scale_shift(tensor_scale(out), int(out.qbits),
                                     force_shift_positive=s.force_shift_positive))


def softmax_integer_forward(node: PyNode) -> torch.Tensor:
    """e = lut[x - max + 2^b - 1] (interpolated for wide inputs), S = Σe (int64), then either
    z = floor((e·2^k + floor(S/2)) / S) requantized with (M, shift + k), k = 31 - ceil(log2(max lut)) (short rows)
    or r = floor(M·2^k / S) and e·r requantized with (1, shift + k), k = 31 - ceil(log2 M) (otherwise)."""
    inp, out = node.inputs[0], node.outputs[0]
    if str(node.get_param("quantize_method", optional=True, default_value="LUT")).upper() != "LUT":
        raise UnsupportedError(f"layer '{node.name}' (Softmax): only quantize_method=LUT has an integer forward "
                               f"(got {node.get_param('quantize_method')})")
    x, _ = int_input(node)
    axis = _axis(node, x.dim())
    lut = node.get_constant("lut")
    table = lut.betensor.to(torch.int64)
    bits = range_bits(inp)
    if x.numel() == 0:
        return x.clone()
    shifted = x - x.amax(dim=axis, keepdim=True) + (2 ** bits - 1)
    e = lookup_lut(shifted, table, 0, bits, lut.dtype.bits, lut.dtype.is_signed)
    total = e.sum(dim=axis, keepdim=True)
    den = torch.clamp(total, min=1)
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node._error("Softmax needs one scale_value/shift_value, not per-channel constants")
    lut_max = max(1, int(table.max()))
    base = SOFTMAX_DIVIDEND_BITS - 1 if lut_max == 1 else SOFTMAX_DIVIDEND_BITS
    qmin, qmax = out_range(out)
    zp = tensor_zp(out)
    axis_len = int(x.shape[axis])
    rows = x.numel() // axis_len
    if axis_len < SOFTMAX_SMALL_AXIS and rows % SOFTMAX_ROW_BLOCK == 0 and bits <= 8:
        k = base - ceil_log2(lut_max)
        z = torch.div((e << k) + (total >> 1), den, rounding_mode="floor")
        return requantize_int(z, mult, shift + k, zp, qmin, qmax)
    k = base - ceil_log2(mult)
    recip = torch.div(torch.tensor(mult << k, dtype=torch.int64), den, rounding_mode="floor")
    return requantize_int(e * recip, 1, shift + k, zp, qmin, qmax)


@op_register(OpType.Softmax)
def softmax_forward(self: PyNode) -> None:
    if self.quantized:
        self.outputs[0].betensor = softmax_integer_forward(self)
        return
    x = self.inputs[0].betensor
    axis = _axis(self, x.dim())
    self.outputs[0].betensor = torch.softmax(x, dim=axis)
