"""fp8-activation layers (quant_type w*afp8*, docs/low-bit.md, docs/semantics/fp8-activations.md): the quantize and
quantized forward of the layer types upstream has fp8 kernels for, called by their declarations (FullyConnected,
Convolution, DepthwiseConv, MatMul, Input) and by Quantize/DeQuantize at the borders.

An fp8 tensor of the quantized graph holds float32 values on the fp8 grid of its dtype (float8_e4m3fn or
float8_e5m2) with a float32 scale (value = q / scale), zero point 0 and the range ±largest finite value. A MAC layer
computes acc = x_q·w_q + b_q in float64 (fp8 or int4 weights, float32 biases b_q = float32(b · s_in · s_w)) and
requantizes y = round_fp8(float32(acc · scale_value)) with the float32 ratio scale_value = s_out / (s_in · s_w): no
integer multiplier and shift. A layer is fp8 when its output dtype is: a re-read IR runs the same forward.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple, Union

import torch

from ..config.quant_types import fp8_layer_formats
from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.fp8_activations import FP8_FORMATS, fp8_largest, fp8_scale, quantize_fp8, requantize_fp8, round_fp4
from ..quant.params import QuantMode, linear_quant_params
from ._quant import fused_activation, insert_keys_after, layer_settings, quantize_weights, set_constant, tensor_scale

Compute = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def layer_formats(node: PyNode) -> Optional[Tuple[Dtype, Dtype, int]]:
    """(activation dtype, weight dtype, weight bits) when the layer's quant_type gives its type fp8 activations."""
    if node.settings is None:
        return None
    f = fp8_layer_formats(getattr(node.settings, "quant_type", "disable"), str(node.type))
    return None if f is None else (Dtype(f[0]), Dtype(f[1]), int(f[2]))


def is_fp8(node: PyNode, t: PyTensor) -> bool:
    """Whether `t`, a quantized tensor of `node`, holds fp8 values."""
    return t.dtype in FP8_FORMATS and quant_of(node).get(t).qmin is not None


def fp8_layer(node: PyNode) -> bool:
    """Whether the quantized forward of `node` is the fp8 one (its output is fp8)."""
    return bool(node.quantized and node.outputs and is_fp8(node, node.outputs[0]))


def _f32(v: Union[float, torch.Tensor]) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64).to(torch.float32) if not isinstance(v, torch.Tensor) \
        else v.to(torch.float32)


def set_fp8_params(node: PyNode, t: PyTensor, dtype: Dtype) -> None:
    """Per-tensor fp8 params of `t` from its calibrated range: scale = largest / (|x|max + 1e-5) in float32."""
    r = ranges_of(node).get(t)
    if r.min is None or r.max is None:
        raise node._error(f"tensor '{t.name}' has no calibrated range; run calibration before quantization")
    absmax = max(abs(float(r.min)), abs(float(r.max)))
    largest = fp8_largest(dtype)
    q = quant_of(node).of(t)
    q.scale, q.zerop = float(fp8_scale(absmax, dtype)), 0.0
    q.qmin, q.qmax, q.qbits, q.qinvariant = -largest, largest, 8, False
    t.dtype, t.ir_range = dtype, None


def _settings_for_fp8(node: PyNode, weight_bits: int) -> None:
    """The bits and symmetric modes upstream gives a layer of an fp8 quant_type (recorded in its settings, so the
    per-layer template shows what the layer used)."""
    s = layer_settings(node)
    node.settings = dataclasses.replace(
        s, q_bits_activation=8, q_bits_weight=weight_bits, q_bits_bias=32, lut_items_in_bits=8,
        q_mode_activation=QuantMode.from_name(s.q_mode_activation).to_symmetric().value,
        q_mode_weight=QuantMode.from_name(s.q_mode_weight).to_symmetric().value)


def _check_input(node: PyNode, t: PyTensor, dtype: Dtype) -> None:
    if not is_fp8(node, t) or t.dtype != dtype:
        raise node._error(f"input '{t.name}' is {t.dtype.value}, not {dtype.value}: an fp8 layer reads fp8 tensors "
                          "(the quantizer inserts DeQuantize/Quantize layers before it)")


def _check_activation(node: PyNode) -> None:
    act = fused_activation(node)
    if act not in ("NONE", "RELU"):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): a fused {act} activation in an fp8 layer "
                               f"(quant_type {node.settings.quant_type}) is not implemented yet; NONE and RELU are",
                               field="quant_type", layer=node.name)


def _activated(node: PyNode, acc: torch.Tensor) -> torch.Tensor:
    """The accumulator through the layer's fused activation (RELU: max(acc, 0), as upstream before requantizing)."""
    return torch.clamp(acc, min=0.0) if fused_activation(node) == "RELU" else acc


# ------------------------------------------------------------------------------------------------ Input


def quantize_input(node: PyNode) -> bool:
    """An fp8 Input (float IR input under a wfp8* quant_type): per-tensor fp8 params; False when not fp8."""
    f = layer_formats(node)
    out = node.outputs[0]
    if f is None or not out.ir_dtype.is_float:
        return False
    _settings_for_fp8(node, f[2])
    set_fp8_params(node, out, f[0])
    return True


def input_forward(node: PyNode) -> bool:
    """Quantize the fed floats of an fp8 Input: round_fp8(float32(scale · x)); False when the Input is not fp8."""
    out = node.outputs[0]
    if not is_fp8(node, out):
        return False
    out.betensor = quantize_fp8(out.betensor, tensor_scale(node, out), out.dtype)
    return True


# ------------------------------------------------------------------------------------------------ weights


def _weight_ranges(node: PyNode, w: PyTensor, per_channel: bool, groups: int) -> torch.Tensor:
    """float32 |w|max per tensor (0-d), per output channel, or per group of channels repeated to each channel."""
    table = ranges_of(node)
    r = table.get(w)
    if r.min is None:
        raise node._error("constant 'weights' has no calibrated range; run calibration before quantization")
    if not (per_channel or groups > 1):
        return _f32(max(abs(float(r.min)), abs(float(r.max))))
    lo, hi = table.channels(w).min, table.channels(w).max
    if lo is None or hi is None:
        raise node._error("constant 'weights' has no per-channel calibrated range")
    r = torch.maximum(_f32(hi).abs(), _f32(lo).abs()).reshape(-1)
    if per_channel:
        return r
    n = int(r.numel())
    size = math.ceil(n / groups)
    padded = torch.nn.functional.pad(r, (0, groups * size - n))
    return padded.reshape(groups, size).amax(dim=1).repeat_interleave(size)[:n]


def _quantize_weights(node: PyNode, wdt: Dtype, per_channel: bool, groups: int) -> torch.Tensor:
    """Quantize the weights in place to `wdt`; returns their float32 scale (0-d or per output channel)."""
    w = node.get_constant("weights")
    values = w.betensor.to(torch.float32)
    bounds: Optional[Tuple[float, float]] = None  # (qmin, qmax); the int4 weights get theirs from quantize_weights
    if wdt in FP8_FORMATS:
        scale = fp8_scale(_weight_ranges(node, w, per_channel, groups), wdt)
        w.betensor = quantize_fp8(values.reshape(values.shape[0], -1).T, scale, wdt).T.reshape(values.shape) \
            if scale.dim() else quantize_fp8(values, scale, wdt)
        largest = fp8_largest(wdt)
        bounds = -largest, largest
    elif wdt == Dtype.ALIGNED_INT4:
        p = quantize_weights(node, per_channel=per_channel)
        scale = _f32(p.scale)
    elif wdt == Dtype.FP4_E2M1FN:
        mode = QuantMode.from_name(layer_settings(node).q_mode_weight)
        mode = mode.to_per_channel() if per_channel else mode.to_per_tensor()
        r = ranges_of(node).channels(w) if per_channel else ranges_of(node).get(w)
        lo, hi = r.min, r.max
        p = linear_quant_params(lo, hi, 4, mode, True)
        scale = _f32(p.scale)
        s = scale.reshape([-1] + [1] * (values.dim() - 1)) if scale.dim() else scale
        w.betensor = torch.clamp(round_fp4(s * values), p.qmin, p.qmax)
        bounds = p.qmin, p.qmax
    else:
        raise node._error(f"weights of type {wdt.value} are not an fp8 layer's weight type")
    w.dtype, w.ir_range = wdt, None
    qw = quant_of(node).of(w)
    if bounds is not None:
        qw.qmin, qw.qmax = bounds
    qw.qbits, qw.zerop, qw.qinvariant, qw.scale = wdt.bits, 0, False, scale
    qw.axis = 0 if qw.per_channel else None
    return scale


# ------------------------------------------------------------------------------------------------ MAC layers


def quantize_mac(node: PyNode, per_channel: bool, groups: int = 1) -> bool:
    """fp8 Convolution / DepthwiseConv / FullyConnected (upstream's fp8 conv quantize); False when not fp8.

    Output fp8 params; weights fp8 (scale largest / (|w|max + 1e-5) per tensor, per channel, or per group
    repeated to its channels), int4 or fp4 (integer params of 4 bits); biases float32 b · (s_in · s_w);
    scale_value (or a per-channel `scale` constant) = s_out / (s_in · s_w) in float32."""
    f = layer_formats(node)
    if f is None:
        return False
    act, wdt, wbits = f
    _check_activation(node)
    _settings_for_fp8(node, wbits)
    inp, out = node.inputs[0], node.outputs[0]
    _check_input(node, inp, act)
    set_fp8_params(node, out, act)
    s_in, s_out = _f32(tensor_scale(node, inp)), _f32(tensor_scale(node, out))
    s_w = _quantize_weights(node, wdt, per_channel, groups)
    ratio = s_out / (s_in * s_w)
    b_scale = s_in * s_w
    w = node.get_constant("weights")
    channels = int(w.betensor.shape[0])
    b = node.get_constant("biases", optional=True)
    b_float = b.betensor.to(torch.float32) if b is not None else torch.zeros(channels, device=w.betensor.device)
    lim = torch.finfo(torch.float32).max
    b_q = torch.clamp(b_scale.to(b_float.device) * b_float, -lim, lim)  # one float32 product: IEEE on any device
    if b is None:
        b = set_constant(node, "biases", b_q, Dtype.FP32)
        insert_keys_after(node, "weights", ["biases"])
    b.betensor, b.dtype = b_q, Dtype.FP32
    qb = quant_of(node).of(b)
    qb.scale, qb.zerop, qb.qbits = b_scale, 0, 32
    qb.axis = 0 if qb.per_channel else None
    for k in ("scale_value", "shift_value", "scale_type", "shift_type", "weights_scale", "weights_zp",
              "biases_scale", "biases_zp"):
        node.params.pop(k, None)
    for k in ("scale", "shift", "weights_scale", "weights_zp", "biases_scale", "biases_zp"):
        node.constants.pop(k, None)
    if ratio.dim():
        set_constant(node, "scale", ratio, Dtype.FP32)
        set_constant(node, "weights_scale", s_w, Dtype.FP32)
        zp_dtype = wdt if wdt in FP8_FORMATS else Dtype.INT32
        set_constant(node, "weights_zp", torch.zeros(channels, dtype=torch.float32 if wdt in FP8_FORMATS
                                                     else torch.int64), zp_dtype)
        set_constant(node, "biases_scale", b_scale, Dtype.FP32)
        set_constant(node, "biases_zp", torch.zeros(1, dtype=torch.int64), Dtype.INT64)
        insert_keys_after(node, "biases", ["scale", "weights_scale", "weights_zp", "biases_scale", "biases_zp"])
    else:
        node.params["scale_value"] = float(ratio)
        node.params["scale_type"] = Dtype.FP32
        node.params["weights_scale"] = float(s_w)
        node.params["weights_zp"] = 0.0 if wdt in FP8_FORMATS else 0
        node.params["biases_scale"] = float(b_scale)
        node.params["biases_zp"] = 0
    return True


def requant_ratio(node: PyNode) -> Union[float, torch.Tensor]:
    """The float32 requant ratio of an fp8 layer: the `scale` constant (per channel) or `scale_value`."""
    c = node.constants.get("scale")
    if c is not None:
        return c.betensor.to(torch.float32).reshape(-1)
    if "scale_value" not in node.params:
        raise node._error("an fp8 layer needs scale_value (or a per-channel scale constant)")
    return float(node.get_param("scale_value"))


def mac_forward(node: PyNode, compute: Compute) -> None:
    """y = round_fp8(float32(act(acc) · scale_value)), acc = compute(x_q, w_q, b_q) in float64 (exact products,
    the biases added once; act: the fused RELU or none; see docs/semantics/fp8-activations.md)."""
    x = node.inputs[0].betensor.to(torch.float64)
    w = node.get_constant("weights").betensor.to(device=x.device, dtype=torch.float64)
    b = node.get_constant("biases", optional=True)
    bias = b.betensor.to(device=x.device, dtype=torch.float64).reshape(-1) if b is not None else None
    out = node.outputs[0]
    out.betensor = requantize_fp8(_activated(node, compute(x, w, bias)), requant_ratio(node), out.dtype)


# ------------------------------------------------------------------------------------------------ MatMul


def quantize_matmul(node: PyNode) -> bool:
    """fp8 MatMul: output fp8 params, scale_value = s_out · fused_multiplier / (s_a · s_b) in float32; False when
    not fp8. Both inputs must be fp8 of the layer's activation type."""
    f = layer_formats(node)
    if f is None:
        return False
    act = f[0]
    _check_activation(node)
    _settings_for_fp8(node, f[2])
    for t in node.inputs:
        _check_input(node, t, act)
    out = node.outputs[0]
    set_fp8_params(node, out, act)
    factor = node.params.pop("fused_multiplier", None)
    s_out = _f32(tensor_scale(node, out))
    if factor is not None:
        s_out = s_out * float(factor)
    ratio = s_out / (_f32(tensor_scale(node, node.inputs[0])) * _f32(tensor_scale(node, node.inputs[1])))
    for k in ("scale_value", "shift_value", "scale_type", "shift_type"):
        node.params.pop(k, None)
    node.params["scale_value"] = float(ratio)
    node.params["scale_type"] = Dtype.FP32
    return True


def matmul_forward(node: PyNode, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """y = round_fp8(float32(a_q @ b_q · scale_value)), the product in float64."""
    a, b = (t.betensor.to(torch.float64) for t in node.inputs)
    out = node.outputs[0]
    out.betensor = requantize_fp8(_activated(node, compute(a, b)), requant_ratio(node), out.dtype)


# ------------------------------------------------------------------------------------------------ borders


def quantize_to_fp8(node: PyNode, dtype: Dtype) -> None:
    """A Quantize layer with an fp8 output (before an fp8 layer): params from the float tensor's range."""
    out = node.outputs[0]
    set_fp8_params(node, out, dtype)
    node.params["quantize_scale"] = tensor_scale(node, out)
    node.params["quantize_zp"] = 0.0
    node.params["round_mode"] = "ROUND_TO_EVEN"


def fp8_quantize_forward(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """The fp8 values of a Quantize layer's float input: round_fp8(float32(quantize_scale · x))."""
    return quantize_fp8(x, float(node.get_param("quantize_scale")), node.outputs[0].dtype)


__all__ = ["fp8_layer", "fp8_quantize_forward", "input_forward", "is_fp8", "layer_formats", "mac_forward",
           "matmul_forward", "quantize_input", "quantize_mac", "quantize_matmul", "quantize_to_fp8", "requant_ratio",
           "set_fp8_params"]
