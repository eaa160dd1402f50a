"""Operators of models that are already integer or carry their own quantization: MatMulInteger, ConvInteger and
FakeQuantWithMinMaxVars.

MatMulInteger and ConvInteger (ONNX's) multiply integer tensors after subtracting their zero points, giving exact
int32 integers; they are only defined on integer (qinvariant) inputs, so they have no float/quantized distinction
beyond the output's params (ConvInteger folds the input zero point into its biases, as upstream).
FakeQuantWithMinMaxVars (TensorFlow's) rounds its float input to a `num_bits` grid over a nudged
[min, max]; quantized, the output is the input's integers (the grid is the quantization itself), clamped to the
nudged range. The integer semantics are in docs/semantics/integer-models.md.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

from ..config.upstream_defects import CONVINTEGER_PRODUCER_ZP
from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import TensorQuant, quant_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.params import QuantMode, dequantize, integer_range, linear_quant_params, quantize
from ..quant.rounding import FLOAT64_EXACT
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Bool, Float, Int, Param, quantized
from ._conv_nhwc import native_conv
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    layer_settings,
    out_range,
    set_constant,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param, float_biases, int_param

SEMANTICS = "docs/semantics/integer-models.md"

MATMUL_INTEGER_BITS = 32
"""MatMulInteger's output is int32 (ONNX's type; upstream writes int32, scale 1)."""

# ------------------------------------------------------------------------------------------------ MatMulInteger
MATMUL_INTEGER = declare_op(
    "MatMulInteger",
    params={"a_zero_point": Param(Int(), "zero point subtracted from the first input", default=0),
            "b_zero_point": Param(Int(), "zero point subtracted from the second input", default=0)},
    dtypes="int8/uint8/int16/uint16 integer inputs (scale 1) → int32 (scale 1)",
    integer="exact (a - a_zero_point) @ (b - b_zero_point), saturated to int32",
    semantics=f"{SEMANTICS}#matmulinteger",
    summary="Two integer inputs (torch.matmul broadcasting); the zero points are params, as the Parser writes them.")


def _zero_point(node: PyNode, key: str) -> int:
    v = node.get_param(key, optional=True, default_value=0)
    if isinstance(v, list):  # a per-row/column zero point: ONNX allows one, upstream reads a scalar
        if len(v) != 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): {key} must be one integer (a per-row or "
                                   f"per-column zero point is not supported), got {v}")
        v = v[0]
    return int(v)


def _integer_operand(node: PyNode, t: PyTensor) -> torch.Tensor:
    """The integer values of an input: quantized, it must be an integer tensor; float, it must hold integers."""
    if node.quantized:
        q = quant_of(node).get(t)
        if not q.qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' is a quantized tensor "
                                   f"(scale {q.scale}, zero point {q.zerop}); {node.type} needs integer inputs")
        return int_value(t)
    x = t.betensor
    if x.is_floating_point():
        if not bool(torch.all(x == torch.round(x))):
            raise node._error(f"input '{t.name}' holds non-integer values; {node.type} multiplies integers")
        return x.to(torch.float64).to(torch.int64)
    return x.to(torch.int64)


def _exact_matmul(node: PyNode, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 a @ b, in float64 when K·max|a|·max|b| proves every partial sum exact there, else int64 on the CPU."""
    if a.dim() == 0 or b.dim() == 0:
        raise node._error("MatMulInteger needs inputs of rank >= 1")
    k = int(a.shape[-1])
    bound = k * (int(a.abs().max()) if a.numel() else 0) * (int(b.abs().max()) if b.numel() else 0)
    try:
        if bound < FLOAT64_EXACT:
            return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int64)
        return torch.matmul(a.cpu(), b.cpu()).to(a.device)
    except RuntimeError as e:
        raise node._error(f"input shapes {list(a.shape)} and {list(b.shape)} cannot be multiplied: {e}") from None


@MATMUL_INTEGER.forward
def matmul_integer_forward(self: PyNode) -> None:
    """y = clamp((a - a_zero_point) @ (b - b_zero_point), int32) exactly; the same integers float or quantized."""
    if len(self.inputs) != 2:
        raise self._error(f"MatMulInteger needs exactly 2 inputs (zero points are params), got {len(self.inputs)}")
    a = _integer_operand(self, self.inputs[0]) - _zero_point(self, "a_zero_point")
    b = _integer_operand(self, self.inputs[1]) - _zero_point(self, "b_zero_point")
    lo, hi = integer_range(MATMUL_INTEGER_BITS, True)
    self.outputs[0].betensor = torch.clamp(_exact_matmul(self, a, b), lo, hi)


@MATMUL_INTEGER.quantize
def matmul_integer_quantize(self: PyNode) -> None:
    """Both inputs must be integer tensors (as upstream); the output is int32, scale 1, zero point 0."""
    if len(self.inputs) != 2:
        raise self._error(f"MatMulInteger needs exactly 2 inputs (zero points are params), got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    for t in self.inputs:
        q = quant_of(self).get(t)
        if not q.qinvariant:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): input '{t.name}' is a quantized float tensor "
                                   f"(scale {q.scale}); MatMulInteger needs integer inputs (an integer model input, "
                                   "an integer constant or the integer output of another layer)")
    set_qinvariant(self, self.outputs[0], MATMUL_INTEGER_BITS, True)


# ------------------------------------------------------------------------------------------------ ConvInteger
_GEOMETRY = {
    "kernel_x": Param(Int(lo=1), "kernel width; must match the weights"),
    "kernel_y": Param(Int(lo=1), "kernel height; must match the weights"),
    "stride_x": Param(Int(lo=1), "horizontal stride", default=1),
    "stride_y": Param(Int(lo=1), "vertical stride", default=1),
    "pad_left": Param(Int(lo=0), "padding before the width axis (with the input zero point)", default=0),
    "pad_right": Param(Int(lo=0), "padding after the width axis", default=0),
    "pad_top": Param(Int(lo=0), "padding before the height axis", default=0),
    "pad_bottom": Param(Int(lo=0), "padding after the height axis", default=0),
    "dilation_x": Param(Int(lo=1), "horizontal dilation", default=1),
    "dilation_y": Param(Int(lo=1), "vertical dilation", default=1),
    "group": Param(Int(lo=1), "channel groups: in_c = weights[3] * group, out_c % group == 0", default=1),
    "num_output": Param(Int(lo=1), "output channels; must match the weights"),
}

CONV_INTEGER = declare_op(
    "ConvInteger",
    params={**_GEOMETRY,
            "x_zero_point": Param(Int(), "zero point subtracted from the input (pads hold it)", default=0),
            "w_zero_point": Param(Int(), "zero point subtracted from the weights", default=0),
            "weights_scale": quantized(Float(), "1.0: the weights are integers"),
            "weights_zp": quantized(Int(), "-w_zero_point (upstream's zero point convention)"),
            "biases_scale": quantized(Float(), "1.0: the biases are integers"),
            "biases_zp": quantized(Int(), "0")},
    constants={"weights": "[O,kh,kw,I/g] integers", "biases": "[O] integers, absent means zero (quantized: the "
               "input zero point folded in, int32)"},
    dtypes="int8/uint8/int16/uint16 integer input (scale 1) → int32 (scale 1)",
    integer="exact conv(x - x_zero_point, w - w_zero_point) + biases, saturated to int32",
    semantics=f"{SEMANTICS}#convinteger",
    summary="NHWC input, OHWI weights, as Convolution; the zero points are params, as the Parser writes them.")

INT32_RANGE = integer_range(32, True)


def _conv_weights(node: PyNode) -> torch.Tensor:
    """The weights minus w_zero_point as int64 [O, kh, kw, I/g], checked against the params."""
    w = node.get_constant("weights").betensor
    if w.dim() != 4:
        raise node._error(f"weights must be 4-D OHWI [out_c, kh, kw, in_c/group], got shape {list(w.shape)}")
    if w.is_floating_point() and not bool(torch.all(w == torch.round(w))):
        raise node._error("weights hold non-integer values; ConvInteger multiplies integers")
    for key, size in (("num_output", w.shape[0]), ("kernel_y", w.shape[1]), ("kernel_x", w.shape[2])):
        value = int_param(node, key, None)
        if value is not None and value != int(size):
            raise node._error(f"parameter {key}={value} does not match weights shape {list(w.shape)}")
    return w.to(torch.float64).to(torch.int64) - _zero_point(node, "w_zero_point")


def _conv_int(node: PyNode, x: torch.Tensor, w: torch.Tensor, pad_value: int,
              bias: torch.Tensor) -> torch.Tensor:
    """Exact NHWC conv of int64 `x` (padded with `pad_value`) with int64 OHWI `w` plus int64 `bias`, in float64
    (refused when the bound K·max|x|·max|w| + max|b| does not prove it exact), saturated to int32."""
    if x.dim() != 4:
        raise node._error(f"input must be 4-D NHWC, got shape {list(x.shape)}")
    in_c, out_c, cin_g = int(x.shape[3]), int(w.shape[0]), int(w.shape[3])
    group = int_param(node, "group", 1)
    if cin_g * group != in_c or out_c % group:
        raise node._error(f"group={group} with weights {list(w.shape)} does not fit {in_c} input channels "
                          "(needs in_c == weights[3] * group and out_c % group == 0)")
    pads = [int_param(node, k, 0, minimum=0) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom")]
    stride = (int_param(node, "stride_y", 1), int_param(node, "stride_x", 1))
    dilation = (int_param(node, "dilation_y", 1), int_param(node, "dilation_x", 1))
    k = int(w.shape[1]) * int(w.shape[2]) * cin_g
    xmax = max(abs(int(x.min())), abs(int(x.max())), abs(pad_value)) if x.numel() else abs(pad_value)
    bound = k * xmax * (int(w.abs().max()) if w.numel() else 0) + (int(bias.abs().max()) if bias.numel() else 0)
    if bound >= FLOAT64_EXACT:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the accumulator bound {bound} is beyond 2^53; "
                               "the exact integer convolution supports smaller kernels or narrower integers")
    xf = F.pad(x.to(torch.float64).permute(0, 3, 1, 2), pads, value=float(pad_value))
    need = ((int(w.shape[1]) - 1) * dilation[0] + 1, (int(w.shape[2]) - 1) * dilation[1] + 1)
    if int(xf.shape[2]) < need[0] or int(xf.shape[3]) < need[1]:
        raise node._error(f"padded input {list(xf.shape[2:])} (HW) is smaller than the dilated kernel {list(need)}")
    with native_conv(xf.device):  # exact on a GPU too: no FFT/Winograd algorithm (see native_conv)
        y = F.conv2d(xf, w.to(device=xf.device, dtype=torch.float64).permute(0, 3, 1, 2),
                     bias.to(device=xf.device, dtype=torch.float64), stride=stride, dilation=dilation, groups=group)
    y = y.permute(0, 2, 3, 1).contiguous()
    ir_shape = node.outputs[0].ir_shape
    if ir_shape is not None and len(ir_shape) == 4 and [int(d) for d in ir_shape[1:3]] != list(y.shape[1:3]):
        raise node._error(f"kernel, stride, dilation and pads give an output of {list(y.shape[1:3])} (HW) but "
                          f"layer_top_shape says {[int(d) for d in ir_shape[1:3]]}")
    return torch.clamp(y.to(torch.int64), *INT32_RANGE)


def _integer_biases(node: PyNode, out_c: int, device: torch.device) -> torch.Tensor:
    b = float_biases(node, out_c, torch.zeros((), dtype=torch.float64, device=device))
    if b is None:
        return torch.zeros(out_c, dtype=torch.int64, device=device)
    if not bool(torch.all(b == torch.round(b))):
        raise node._error("biases hold non-integer values; ConvInteger adds integers")
    return b.to(torch.int64)


@CONV_INTEGER.forward
def conv_integer_forward(self: PyNode) -> None:
    """Float: conv(x - x_zero_point, w - w_zero_point) + biases, pads 0 after the subtraction. Quantized: conv of
    the input padded with x_zero_point with w - w_zero_point, plus the biases that hold the folded zero point; the
    same integers unless the folded biases saturated int32."""
    w = _conv_weights(self)
    bias = _integer_biases(self, int(w.shape[0]), w.device)
    xzp = _zero_point(self, "x_zero_point")
    x = _integer_operand(self, self.inputs[0])
    if self.quantized:
        self.outputs[0].betensor = _conv_int(self, x, w, xzp, bias)
    else:
        self.outputs[0].betensor = _conv_int(self, x - xzp, w, 0, bias)


@CONV_INTEGER.quantize
def conv_integer_quantize(self: PyNode) -> None:
    """The input must be an integer tensor, left unchanged (upstream rewrites its producer's zero point to
    -x_zero_point; `upstream_defects = convinteger_producer_zp` does too). Weights: their integers, scale 1, zero
    point -w_zero_point, in their IR dtype. Biases: b - x_zero_point · sum(w - w_zero_point) per output channel,
    saturated to int32. Output: int32, scale 1."""
    inp = self.inputs[0]
    check_quantized_inputs(self, [inp])
    q_in = quant_of(self).get(inp)
    if not q_in.qinvariant:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): input '{inp.name}' is a quantized float tensor "
                               f"(scale {q_in.scale}); ConvInteger needs an integer input (an integer model input or "
                               "the integer output of another layer)")
    wt = self.get_constant("weights")
    w = _conv_weights(self)
    wdtype = wt.ir_dtype  # kept as the IR has it, as upstream (integer values even in a float32 constant)
    lo, hi = INT32_RANGE if wdtype.is_float else integer_range(wdtype.bits, wdtype.is_signed)
    wzp = _zero_point(self, "w_zero_point")
    set_constant(self, "weights", torch.clamp(w + wzp, lo, hi), wdtype)
    table = quant_of(self)
    table.set(self.constants["weights"], TensorQuant(scale=1.0, zerop=-wzp, qbits=32 if wdtype.is_float
                                                     else wdtype.bits, qmin=lo, qmax=hi, qinvariant=True))
    folded = _integer_biases(self, int(w.shape[0]), w.device) - w.reshape(int(w.shape[0]), -1).sum(dim=1) * _zero_point(
        self, "x_zero_point")
    set_constant(self, "biases", torch.clamp(folded, *INT32_RANGE), Dtype.INT32)
    table.set(self.constants["biases"], TensorQuant(1.0, 0, 32, *INT32_RANGE, qinvariant=True))
    self.params.update(weights_scale=1.0, weights_zp=-wzp, biases_scale=1.0, biases_zp=0)
    set_qinvariant(self, self.outputs[0], 32, True)
    if CONVINTEGER_PRODUCER_ZP in layer_settings(self).upstream_defects:
        table.of(inp).zerop = -_zero_point(self, "x_zero_point")


# ---------------------------------------------------------------------------------------------- FakeQuantWithMinMaxVars
FAKE_QUANT = declare_op(
    "FakeQuantWithMinMaxVars",
    params={"min": Param(Float(), "lower end of the quantization range (before nudging)", required=True),
            "max": Param(Float(), "upper end of the quantization range (before nudging)", required=True),
            "num_bits": Param(Int(lo=2, hi=16), "bits of the grid", default=8),
            "narrow_range": Param(Bool(), "the grid starts at 1 instead of 0 (2^num_bits - 1 levels)",
                                  default=False)},
    dtypes=PASSTHROUGH_DTYPES,
    integer="passthrough of the input's integers clamped to the nudged [min, max]",
    semantics=f"{SEMANTICS}#fakequantwithminmaxvars",
    summary="TensorFlow's fake quantization: float y = the input rounded to a num_bits grid over the nudged "
            "[min, max], clamped to it.")


def _nudged(node: PyNode) -> Tuple[float, float]:
    """(min_adj, max_adj) in float32 as upstream nudges them: a range above 0 moves down to start at 0, one below 0
    moves up to end at 0, otherwise min moves to the nearest multiple of (max - min) / (2^bits - 1)."""
    lo = torch.tensor(float(node.get_param("min")), dtype=torch.float32)
    hi = torch.tensor(float(node.get_param("max")), dtype=torch.float32)
    bits = int(node.get_param("num_bits", optional=True, default_value=8))
    if not bool(hi >= lo):
        raise node._error(f"max={float(hi)} must not be below min={float(lo)}")
    if lo > 0:
        return 0.0, float(hi - lo)
    if hi < 0:
        return float(lo - hi), 0.0
    step = (hi - lo) / float((1 << bits) - 1)
    if float(step) == 0.0:
        return 0.0, 0.0
    lo_adj = step * torch.round(lo / step)
    return float(lo_adj), float(hi + lo_adj - lo)


@FAKE_QUANT.forward
def fake_quant_forward(self: PyNode) -> None:
    """Float: q = clamp(round_half_even(x·s - zp), narrow_range, 2^bits - 1) with upstream's unsigned asymmetric
    params of the nudged range, then (q + zp)/s clamped to it (float32). Quantized: the input's integers clamped to
    the integers of the nudged range (the output has the input's params)."""
    lo, hi = _nudged(self)
    inp, out = self.inputs[0], self.outputs[0]
    if self.quantized:
        q = int_value(inp)
        s, zp = tensor_scale(self, inp), tensor_zp(self, inp)
        qmin, qmax = out_range(self, out)
        # ceil(lo·s) and floor(hi·s): float32 times float32 is exact in float64
        q_lo = max(qmin, min(qmax, math.ceil(lo * s) - zp))
        q_hi = max(qmin, min(qmax, math.floor(hi * s) - zp))
        out.betensor = torch.clamp(q, q_lo, max(q_lo, q_hi))
        return
    bits = int(self.get_param("num_bits", optional=True, default_value=8))
    p = linear_quant_params(lo, hi, bits, QuantMode.from_name("per_tensor_asymmetric"), False)
    qmin = 1 if bool_param(self, "narrow_range", False) else 0
    x = inp.betensor
    dtype = x.dtype if x.is_floating_point() else torch.float32
    q = quantize(x, p.scale, p.zerop, qmin, int(p.qmax))
    y = torch.clamp(dequantize(q, p.scale, p.zerop), lo, hi)
    out.betensor = y.to(dtype)


@FAKE_QUANT.quantize
def fake_quant_quantize(self: PyNode) -> None:
    """The output carries the input's params (upstream copies scale, zero point, bits, dtype and qinvariant)."""
    check_quantized_inputs(self, self.inputs[:1])
    copy_params(self, self.outputs[0], self.inputs[0])
