"""HardClip: y = clamp(gain * x, -limit, limit), an operator plugin in one file (docs/plugins.md, 4.1).

Quantized, with s = sign(gain) and M * 2**-N approximating |gain| * scale_y / scale_x:

    y_q = clamp(round_half_even(s * (x_q + zp_x) * M * 2**-N) - zp_y, max(qmin, lo), min(qmax, hi))

where lo and hi are the output integers of -limit and +limit (the params limit_lo and limit_hi).
"""
import numpy as np
import torch

from quantopt import PyNode
from quantopt.ops.api import (
    Float,
    Int,
    Param,
    declare_op,
    int_value,
    out_range,
    quantize,
    quantize_activation,
    quantized,
    requant_of,
    requant_scale_shift,
    requantize_int,
    store_requant,
    tensor_scale,
    tensor_zp,
)

GAIN_DEFAULT = 1.0

HARDCLIP = declare_op(
    "HardClip",
    params={
        "gain": Param(Float(), "multiplies the input", default=GAIN_DEFAULT),
        "limit": Param(Float(), "the output bound (> 0): y is clamped to [-limit, limit]", required=True),
        "limit_lo": quantized(Int(), "the output integer of -limit"),
        "limit_hi": quantized(Int(), "the output integer of +limit"),
    },
    integer="requantization by gain * s_out / s_in, clamped to the integers of -limit and limit",
    semantics="docs/plugins.md#41-writing-an-operator",
    summary="y = clamp(gain * x, -limit, limit)",
    version="1.0",
)


def hardclip_params(node: PyNode):
    """(gain, limit); the IR reader has checked that both are finite numbers, the sign of limit is checked here."""
    gain = float(node.get_param("gain", optional=True, default_value=GAIN_DEFAULT))
    limit = float(node.get_param("limit"))
    if limit <= 0:
        raise node._error(f"limit must be > 0, got {limit}")  # an IR error naming the layer's line
    return gain, limit


@HARDCLIP.forward
def hardclip_forward(self: PyNode) -> None:
    gain, limit = hardclip_params(self)
    if not self.quantized:
        self.outputs[0].betensor = torch.clamp(self.inputs[0].betensor * gain, -limit, limit)
        return
    inp, out = self.inputs[0], self.outputs[0]
    acc = int_value(inp) + tensor_zp(self, inp)  # proportional to the float input
    if gain < 0:
        acc = -acc
    mult, shift = requant_of(self)
    qmin, qmax = out_range(self, out)
    lo = max(qmin, int(self.get_param("limit_lo")))
    hi = min(qmax, int(self.get_param("limit_hi")))
    out.betensor = requantize_int(acc, mult, shift, tensor_zp(self, out), lo, hi)


@HARDCLIP.quantize
def hardclip_quantize(self: PyNode) -> None:
    gain, limit = hardclip_params(self)
    inp, out = self.inputs[0], self.outputs[0]
    quantize_activation(self, out, signed=True)  # scale, zero point and dtype from the calibrated range
    ratio = abs(gain) * tensor_scale(self, out) / tensor_scale(self, inp)
    store_requant(self, *requant_scale_shift(self, ratio))  # scale_value, shift_value
    qmin, qmax = out_range(self, out)
    for key, bound in (("limit_lo", -limit), ("limit_hi", limit)):
        value = torch.tensor(bound, dtype=torch.float64)
        self.params[key] = int(quantize(value, tensor_scale(self, out), tensor_zp(self, out), qmin, qmax,
                                        compute_dtype=torch.float64))


@HARDCLIP.export
def hardclip_export(g, node: PyNode) -> None:
    """The integer forward in ONNX, exactly: x_q + zp_x in float64, times s * M * 2**-N, Round (half to even),
    then QuantizeLinear with scale 1 after a Clip to [limit_lo, limit_hi]."""
    from onnx import TensorProto  # only the export needs onnx

    gain, _ = hardclip_params(node)
    mult, shift = requant_of(node)
    codes = g.add("Cast", [g.float_value(node.inputs[0], unit=True)], to=TensorProto.DOUBLE)
    factor = np.array((-1.0 if gain < 0 else 1.0) * mult * 2.0 ** -shift, dtype=np.float64)
    scaled = g.add("Mul", [codes, g.const(f"{node.name}/multiplier", factor)])
    rounded = g.add("Cast", [g.add("Round", [scaled])], to=TensorProto.FLOAT)
    bounds = (int(node.get_param("limit_lo")), int(node.get_param("limit_hi")))
    g.quantize(node.outputs[0], rounded, unit=True, bounds=bounds)
