"""Graph inputs and constants: float forward, quantization, integer forward."""
from __future__ import annotations

import numpy as np
import torch

from ..calibration.inf_mask import is_mask_tensor
from ..calibration.statistics import INF_MASK_THRESHOLD
from ..config.upstream_defects import MASK_AS_DATA
from ..graph.memo import freeze, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.hardware import INT_INPUT_MAX_BITS
from ..quant.params import integer_range, quantize
from ..registry import declare_op
from ..registry.schema import Float, Int, quantized
from . import _fp8
from ._quant import integer_bits, layer_settings, out_range, quantize_activation, set_qinvariant
from .onnx_build.qdq_graph import ONNX_INT_TYPES, QDQGraph, node_error

INPUT = declare_op(
    "Input", summary="The fed data",
    dtypes="float32 → int8/uint8/int16/uint16; integer inputs stay integer (qinvariant, at most 32 bits)",
    integer="quantize the fed floats with the output params", semantics="integer-semantics.md#input")


@INPUT.forward
def input_forward(self: PyNode) -> None:
    """The executor has already placed the fed data on the output tensor; a quantized Input quantizes it:
    q = clamp(round_half_even(x · scale − zp), qmin, qmax), float32 like upstream; integer inputs pass through."""
    out = self.outputs[0]
    if out.betensor.numel() == 0 and out.ir_numel != 0:
        raise self._error("no data was fed to this input")
    if not self.quantized or _fp8.input_forward(self):  # fp8 inputs: ops/_fp8.py
        return
    x = out.betensor
    qmin, qmax = out_range(self, out)
    q = quant_of(self).get(out)
    if q.qinvariant:
        xi = torch.round(x.to(torch.float64)) if x.is_floating_point() else x
        out.betensor = torch.clamp(xi.to(torch.int64), qmin, qmax)
    elif x.dtype == torch.float32 and _scalar(q.scale) and _scalar(q.zerop):
        out.betensor = _quantize_per_tensor(self, x, qmin, qmax)
    else:
        out.betensor = quantize(x, q.scale, q.zerop, qmin, qmax)


def _scalar(v: object) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0)


def _quantize_per_tensor(node: PyNode, x: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """`quantize(x, scale, zerop, qmin, qmax)` of float32 data with a per-tensor scale and zero point, the same
    float32 operations in the same order, with the 0-d float32 scale and zero point memoized per layer
    (graph/memo.py) and the steps after the first in place: the Input layer runs on every integer forward."""
    q = quant_of(node).get(node.outputs[0])
    s, z = memo(node, "input_quantize", (freeze(q.scale), freeze(q.zerop)),
                lambda: (torch.as_tensor(q.scale).to(torch.float32), torch.as_tensor(q.zerop).to(torch.float32)))
    y = (s * x).sub_(z).round_().clamp_(qmin, qmax).nan_to_num_(nan=0.0)
    return y.to(torch.int64)


@INPUT.quantize
def input_quantize(self: PyNode) -> None:
    """Integer IR inputs are used as is; float inputs get params from their range, unsigned iff never negative."""
    out = self.outputs[0]
    s = layer_settings(self)
    if not out.ir_dtype.is_float:
        bits = min(out.ir_dtype.bits, INT_INPUT_MAX_BITS)
        set_qinvariant(self, out, bits, out.ir_dtype.is_signed)
        return
    emin, lo = statistics_of(self).get(out).extrema_min, ranges_of(self).get(out).min
    signed = bool(emin is not None and float(emin) < 0) or (emin is None and lo is not None and lo < 0)
    if s.qinvariant:
        set_qinvariant(self, out, s.q_bits_activation, signed or s.force_dtype_int)
        return
    if _fp8.quantize_input(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        return
    quantize_activation(self, out, signed)


CONSTANT = declare_op(
    "Constant",
    params={"weights_scale": quantized(Float(), "scale of the stored integers (the output's scale)"),
            "weights_zp": quantized(Int(), "zero point of the stored integers (the output's zero point)")},
    constants={"weights": "the output's values; ±inf allowed for attention masks"},
    dtypes="float32 → activation dtype, or integer (qinvariant) when all values are integers",
    integer="stored already quantized with the output params", semantics="integer-semantics.md#constant")


KEEP_IR_INTEGER = "keep_ir_integer_dtype"
"""`PyTensor.extra` key: this integer Constant output is read only by layers that take it as it is (If/Loop, set by
passes/float_islands.py), so it keeps its IR integer dtype, as upstream leaves such a constant unquantized."""


@CONSTANT.forward
def constant_forward(self: PyNode) -> None:
    """Outputs the `weights` constant, broadcast over the current batch if the IR shape has a batch dim of 1.
    Quantized, the constant already holds the output's integer values."""
    w = self.get_constant("weights").betensor
    self.outputs[0].betensor = w.reshape(self.outputs[0].ir_shape) if w.numel() == self.outputs[0].ir_numel else w


@CONSTANT.quantize
def constant_quantize(self: PyNode) -> None:
    """All-integer constants are used as integers (scale 1) of the narrowest type holding them, or of their IR
    dtype when only If/Loop layers read them (KEEP_IR_INTEGER); others are quantized with the output's params. A float
    constant holding mask values (±inf, |x| >= 1e30: -FLT_MAX is an integer-valued float) is quantized from its
    calibrated range, its mask values saturating (calibration/inf_mask.py), never taken as an int32 of scale 1
    (except with `upstream_defects = mask_as_data`, as upstream does); so is a finite mask whose statistics left its
    mask values out (calibration/finite_mask.py: 0 and -100 are integers too)."""
    out = self.outputs[0]
    w = self.get_constant("weights")
    s = layer_settings(self)
    values = w.betensor
    mask = values.is_floating_point() and MASK_AS_DATA not in s.upstream_defects and (
        bool((values.abs() >= INF_MASK_THRESHOLD).any()) or is_mask_tensor(statistics_of(self).get(out)))
    if mask and s.qinvariant:
        OPT_WARN(f"layer '{self.name}' (Constant): set_qinvariant_for_start_nodes names a constant holding mask "
                 f"values (±inf or |x| >= {INF_MASK_THRESHOLD:g}); they saturate to the integer range")
    if mask and not s.qinvariant:
        quantize_activation(self, out, float(ranges_of(self).get(out).min) < 0 or bool((values < 0).any()))
    elif out.extra.get(KEEP_IR_INTEGER) and not out.ir_dtype.is_float and out.ir_dtype.bits >= 8:
        set_qinvariant(self, out, out.ir_dtype.bits, out.ir_dtype.is_signed)
    elif not values.is_floating_point() or s.qinvariant or \
            (bool(torch.isfinite(values).all()) and bool((values == torch.round(values)).all())):
        lo, hi = (float(values.min()), float(values.max())) if values.numel() else (0.0, 0.0)
        set_qinvariant(self, out, *integer_bits(lo, hi))
    else:
        quantize_activation(self, out, float(ranges_of(self).get(out).min) < 0)
    qmin, qmax = out_range(self, out)
    table = quant_of(self)
    q = table.get(out)
    w.betensor = quantize(values, q.scale, q.zerop, qmin, qmax) if values.is_floating_point() else values
    w.dtype = out.dtype
    qw = table.of(w)
    qw.scale, qw.zerop, qw.qmin, qw.qmax, qw.qbits = q.scale, q.zerop, qmin, qmax, q.qbits
    # the IR names the stored integers' params as a weight-carrying layer's, as upstream (scalar params: a Constant's
    # output is per tensor, quantize_activation refuses per-channel modes here)
    self.params["weights_scale"] = float(q.scale)
    self.params["weights_zp"] = int(q.zerop)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def takes_float(node: PyNode, t: PyTensor) -> bool:
    """Whether a graph input `t` (the output of the Input layer `node`) is fed floats: a float IR input, or the
    quantized input of an IR quantopt wrote (its dtype is the integer one, its scale the real one). Integer inputs
    used as they are (scale 1) take integers."""
    return t.ir_dtype.is_float or not quant_of(node).get(t).qinvariant


@INPUT.export
def convert_input(g: QDQGraph, node: PyNode) -> None:
    """A float graph input quantized by QuantizeLinear; an integer input (scale 1, zero point 0) is used as is, or
    declared int64 and saturated to its IR type (`int64_inputs`)."""
    t = node.outputs[0]
    shape = g.io_shape(t)
    if takes_float(node, t):
        g.inputs.append(g.value_info(t.name, "FLOAT", shape))
        g.quantize(t, t.name, exact=True)
        return
    if t.ir_dtype not in ONNX_INT_TYPES or t.ir_dtype != t.dtype:
        raise node_error(node, f"integer input of dtype {t.ir_dtype} (quantized as {t.dtype}) has no QDQ mapping")
    if not g.int64_inputs:
        g.inputs.append(g.value_info(t.name, ONNX_INT_TYPES[t.ir_dtype][0], shape))
        g.set_int(t, t.name)
        return
    # an int64 feed (the source model's type for token ids and masks), saturated to the IR type as quantopt reads it
    g.inputs.append(g.value_info(t.name, "INT64", shape))
    lo, hi = integer_range(t.ir_dtype.bits, t.ir_dtype.is_signed)
    bounds = [g.const(f"{t.name}_{k}", np.array(v, dtype=np.int64)) for k, v in (("min", lo), ("max", hi))]
    g.set_int(t, g.add("Cast", [g.add("Clip", [t.name, *bounds])], to=g.elem_type(t.ir_dtype)))


@CONSTANT.export
def convert_constant(g: QDQGraph, node: PyNode) -> None:
    """The stored integers become an initializer of the output dtype."""
    t = node.outputs[0]
    p = g.qparams(t)
    values = node.get_constant("weights").betensor.cpu().to(torch.int64) + p.offset
    if values.numel() == t.ir_numel:
        values = values.reshape(t.ir_shape)
    g.set_int(t, g.const(f"{t.name}_q", values.numpy().astype(ONNX_INT_TYPES[p.dtype][1])))
