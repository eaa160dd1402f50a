"""Quantization helpers shared by operator families: tensor params, weights, biases, requantization, integer I/O.

Ops call these from their quantize functions (which run once, in topological order, after calibration) and from
their integer forward. The integer forward of every op reads only what the quantized IR stores (tensor
scale/zp/range/dtype, node params and constants), so a re-loaded IR computes bit-identical outputs.
Quantized activations are int64 tensors holding values in [qmin, qmax].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..calibration.inf_mask import is_mask_tensor
from ..calibration.statistics import INF_MASK_THRESHOLD
from ..config.layer_settings import LayerSettings
from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import TensorQuant, quant_of, ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..log import OPT_INFO, OPT_WARN
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.given import GIVEN_PARAMS, GIVEN_VALUES
from ..quant.hardware import INT_INPUT_MAX_BITS, PRELU_SLOPE_SHIFT
from ..quant.params import QuantMode, QuantParams, integer_range, linear_quant_params, quantize
from ..quant.requant import (
    MAGIC_SCALED_BOUND,
    aiff_ahead_shift,
    bias_quantize,
    broadcasts_into,
    compress_bias,
    exact_int64,
    exact_int64_,
    float32_grid,
    fold_input_zero_point,
    group_ranges,
    linear_requantize,
    requantize_scaled_,
    round_scaled_,
    scale_shift,
    search_bias_clamp_bits,
    unify_shifts_for_aiff,
)
from ..quant.rounding import FLOAT32_EXACT, FLOAT64_EXACT
from ._slope import apply_int_slope, broadcasts_to, leaky_slope_code, prelu_slope_codes


# ------------------------------------------------------------------------------------------------ settings / params
def layer_settings(node: PyNode) -> LayerSettings:
    """The node's LayerSettings; hand-built graphs quantized without a cfg get the defaults."""
    if node.settings is None:
        node.settings = LayerSettings()
    return node.settings


def activation_mode(node: PyNode, bits: int) -> QuantMode:
    """The activation mode of the layer; activations wider than 8 bits are always symmetric."""
    mode = QuantMode.from_name(layer_settings(node).q_mode_activation)
    if bits > 8 and mode.is_asymmetric:
        mode = mode.to_symmetric()
    return mode


def set_params(node: PyNode, t: PyTensor, p: QuantParams, bits: int, axis: Optional[int] = None) -> TensorQuant:
    """Give `t` the parameters `p` (per channel along `axis` when `p` is) at `bits` bits; returns its entry."""
    q = quant_of(node).of(t)
    q.scale, q.zerop, q.qmin, q.qmax, q.qbits = p.scale, p.zerop, p.qmin, p.qmax, bits
    q.qinvariant = False
    q.axis = axis if p.per_channel else None
    t.dtype = p.dtype
    t.ir_range = None
    return q


def quantize_activation(node: PyNode, t: PyTensor, signed: bool, bits: Optional[int] = None,
                        per_channel_ok: bool = False) -> None:
    """Output params of `t` from its calibrated range with the layer's activation mode and bits. A per-channel mode
    gives one scale per channel of the last axis (zero point 0) where the layer supports it (`per_channel_ok`, see
    ops/_per_channel.py) and is refused elsewhere."""
    given = t.extra.get(GIVEN_PARAMS)
    if given is not None:  # a pre-quantized model's own params (compat_quantized_model, docs/compat-quantized.md)
        set_params(node, t, given, int(given.dtype.bits), axis=-1)
        return
    s = layer_settings(node)
    bits = int(bits or s.q_bits_activation)
    signed = bool(signed or s.force_dtype_int)
    table = ranges_of(node)
    r = table.get(t)
    if r.min is None or r.max is None:
        raise node._error(f"tensor '{t.name}' has no calibrated range; run calibration before quantization")
    mode = activation_mode(node, bits)
    if not mode.is_per_channel:
        set_params(node, t, linear_quant_params(r.min, r.max, bits, mode, signed), bits)
        return
    if not per_channel_ok:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel activation quantization "
                               f"({s.q_mode_activation}) is supported for the outputs of Convolution, DepthwiseConv, "
                               "FullyConnected, BatchNorm and Eltwise/Add/Sub/Mul only; use a per_tensor mode for this "
                               "layer",
                               field="quantize_method_for_activation", layer=node.name)
    rc = table.channels(t)
    if rc.min is None or rc.max is None:
        raise node._error(f"tensor '{t.name}' has no per-channel calibrated range; calibrate with the per-channel "
                          "mode set")
    p = linear_quant_params(rc.min, rc.max, bits, mode, signed)
    set_params(node, t, p, bits, axis=-1).zerop = 0  # symmetric: one zero point for all channels


def set_qinvariant(node: PyNode, t: PyTensor, bits: int, signed: bool) -> None:
    """An integer tensor used as is: scale 1, zero point 0, the full range of `bits`."""
    q = quant_of(node).of(t)
    q.scale, q.zerop, q.qbits, q.qinvariant, q.axis = 1.0, 0, bits, True, None
    q.qmin, q.qmax = integer_range(bits, signed)
    t.dtype = int_dtype_for_bits(bits, signed)
    t.ir_range = None


def copy_params(node: PyNode, dst: PyTensor, src: PyTensor) -> None:
    """Shape-only ops: the output carries the input's quantization unchanged."""
    table = quant_of(node)
    table.set(dst, table.get(src).copy())
    dst.dtype = src.dtype
    dst.ir_range = None


def params(node: PyNode, t: PyTensor) -> TensorQuant:
    """The quantization parameters of `t`, a tensor of `node` (read-only defaults when it has none)."""
    return quant_of(node).get(t)


def require_integer_input(node: PyNode, t: PyTensor, what: str) -> None:
    """An index/count/label input of a quantized layer must hold exact integers (an integer tensor)."""
    if not quant_of(node).get(t).qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the {what} input '{t.name}' must hold exact "
                               "integers (an integer tensor), not quantized values")


def refuse_per_channel(node: PyNode, t: PyTensor) -> None:
    """For operators whose integer forward takes one scale per tensor."""
    if quant_of(node).get(t).per_channel:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel params of '{t.name}' are not "
                               "supported")


def integer_index_input(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    """An index/count/label input as int64: float values truncated toward zero; in a quantized layer it must hold
    exact integers (an integer tensor), not quantized values."""
    if node.quantized:
        require_integer_input(node, t, what)
        return int_value(t)
    x = t.betensor
    return (torch.trunc(x.to(torch.float64)) if x.is_floating_point() else x).to(torch.int64)


def zero_code(node: PyNode, t: PyTensor) -> int:
    """The integer that stands for the float 0 in `t`'s params: clamp(-zp, qmin, qmax) (padding of quantized
    outputs)."""
    qmin, qmax = out_range(node, t)
    return min(max(-tensor_zp(node, t), qmin), qmax)


def is_signed(node: PyNode, t: PyTensor) -> bool:
    q = quant_of(node).get(t)
    return q.qmin is not None and q.qmin < 0


def _single(t: PyTensor, value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedError(f"tensor '{t.name}' has per-channel {what}; this op needs one")
        value = value.item()
    return float(value)


def tensor_zp(node: PyNode, t: PyTensor) -> int:
    """The per-tensor zero point of `t` (an error when it has one per channel)."""
    return int(round(_single(t, quant_of(node).get(t).zerop, "zero points")))


def scale_of(node: PyNode, t: PyTensor) -> Union[float, torch.Tensor]:
    """The scale as a float, or as a float32 vector along the last axis for a per-channel activation."""
    q = quant_of(node).get(t)
    if q.per_channel:
        return q.scale.to(torch.float32).reshape(-1)
    return _single(t, q.scale, "scales")


def tensor_scale(node: PyNode, t: PyTensor) -> float:
    """The per-tensor scale of `t` (an error when it has one per channel)."""
    return _single(t, quant_of(node).get(t).scale, "scales")


def out_range(node: PyNode, t: PyTensor) -> Tuple[int, int]:
    """(qmin, qmax) of a quantized tensor."""
    q = quant_of(node).get(t)
    if q.qmin is None or q.qmax is None:
        raise UnsupportedError(f"tensor '{t.name}' has no integer range: it is not quantized")
    return int(q.qmin), int(q.qmax)


def values_absmax(t: torch.Tensor) -> int:
    """max |t| of an integer tensor (0 when empty): one look at its values, for the bounds a layer's loop proves."""
    if not t.numel():
        return 0
    lo, hi = torch.aminmax(t)
    return max(-int(lo), int(hi))


def int_value(t: PyTensor) -> torch.Tensor:
    """The tensor's integer values as int64 (exact: float inputs must already hold integers)."""
    x = t.betensor
    if x.is_floating_point():
        return torch.round(x.to(torch.float64)).to(torch.int64)
    return x.to(torch.int64)


def insert_keys_after(node: PyNode, anchor: str, keys: Iterable[str]) -> None:
    """Place new IR keys right after `anchor` in the layer's written key order (upstream's layout)."""
    order: List[str] = node.attrs.setdefault("ir_key_order", [])
    keys = [k for k in keys if k not in order]
    pos = order.index(anchor) + 1 if anchor in order else len(order)
    order[pos:pos] = keys


def set_constant(node: PyNode, key: str, values: torch.Tensor, dtype: Dtype) -> PyTensor:
    """A new constant `key` of the layer, without quantization parameters (a former constant of that name, whose
    table entry has the same name, leaves none behind)."""
    t = PyTensor(f"{node.name}/{key}", values.detach().clone(), dtype, list(values.shape))
    node.constants[key] = t
    quant_of(node).drop(t)
    return t


def store_requant(node: PyNode, multiplier: Any, shift: Any, mult_dtype: Dtype, shift_dtype: Dtype) -> None:
    """Per-tensor `scale_value`/`shift_value` params, or per-channel `scale`/`shift` constants."""
    if isinstance(multiplier, torch.Tensor) and multiplier.numel() > 1:
        set_constant(node, "scale", multiplier.to(torch.int64), mult_dtype)
        set_constant(node, "shift", torch.as_tensor(shift).to(torch.int64), shift_dtype)
        for k in ("scale_value", "shift_value", "scale_type", "shift_type"):
            node.params.pop(k, None)
        return
    node.params["scale_value"] = int(multiplier)
    node.params["shift_value"] = int(shift)
    node.params["shift_type"] = shift_dtype
    node.params["scale_type"] = mult_dtype


def requant_of(node: PyNode) -> Tuple[Union[int, torch.Tensor], Union[int, torch.Tensor]]:
    """(multiplier, shift) stored by `store_requant`."""
    if "scale" in node.constants and "shift" in node.constants:
        return (node.constants["scale"].betensor.to(torch.int64).flatten(),
                node.constants["shift"].betensor.to(torch.int64).flatten())
    if "scale_value" not in node.params or "shift_value" not in node.params:
        raise node._error("quantized layer lacks its requantization multiplier/shift (scale_value/shift_value)")
    return int(node.params["scale_value"]), int(node.params["shift_value"])


def requant_scale_shift(node: PyNode, ratio: Any, mult_bits: Optional[int] = None) -> Tuple[Any, Any, Dtype, Dtype]:
    s = layer_settings(node)
    return scale_shift(ratio, mult_bits or s.mult_bits, force_shift_positive=s.force_shift_positive)


# ------------------------------------------------------------------------------------------------ MAC ops
def fused_activation(node: PyNode) -> str:
    return str(node.params.get("with_activation", "NONE")).upper()


def fused_output_signed(node: PyNode) -> bool:
    """Outputs of MAC/eltwise ops are unsigned iff a ReLU-like fused activation makes them non-negative."""
    act = fused_activation(node)
    if act in ("RELU", "RELU6"):
        return False
    if act == "CLIP":
        return float(node.get_param("clip_min")) < 0
    return True


SLOPE_ACTIVATIONS = ("LEAKYRELU", "PRELU")
"""Fused activations with a quantized negative slope (ops/_slope.py): MAC layers quantized by `quantize_mac` and
finished by `mac_finish` take them."""


def check_fused_activation_quantizable(node: PyNode, slopes: bool = False) -> None:
    """A clear error for a fused activation this layer type cannot quantize; `slopes`: LEAKYRELU and PRELU too."""
    act = fused_activation(node)
    allowed = ("NONE", "RELU", "RELU6", "CLIP") + (SLOPE_ACTIVATIONS if slopes else ())
    if act not in allowed:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): quantizing a fused {act} activation is not "
                               f"implemented for this layer type ({', '.join(allowed)} are)")


def quantize_fused_slope(node: PyNode) -> None:
    """A MAC layer's fused LEAKYRELU or PRELU slope, as the standalone layers quantize theirs (ops/_slope.py):
    LEAKYRELU writes the integer `negative_slope_value` and its `negative_slope_type` (the integer forward shifts
    by the output bits), PRELU the int16 `negative_slope` constant and `negative_slope_shift`. The layer's own
    requantization is untouched."""
    act = fused_activation(node)
    out = node.outputs[0]
    if act == "LEAKYRELU":
        slope = float(node.get_param("negative_slope", optional=True,
                                     default_value=node.get_param("negative_slope_value", optional=True,
                                                                  default_value=0.01)))
        try:
            q, q_dtype = leaky_slope_code(slope, int(params(node, out).qbits))
        except ValueError as e:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): fused {e}") from None
        node.params.pop("negative_slope", None)
        node.params["negative_slope_value"] = q
        node.params["negative_slope_type"] = q_dtype
    elif act == "PRELU":
        const = node.get_constant("negative_slope", optional=True)
        if const is None:
            raise node._error("a fused PRELU needs a 'negative_slope' constant")
        codes = prelu_slope_codes(const.betensor, len(node.inputs[0].ir_shape))
        if not broadcasts_to(codes.shape, out.ir_shape):
            raise node._error(f"negative_slope of shape {list(codes.shape)} does not broadcast to the output shape "
                              f"{list(out.ir_shape)}")
        set_constant(node, "negative_slope", codes, Dtype.INT16)
        node.params["negative_slope_shift"] = PRELU_SLOPE_SHIFT


def fused_int_slope(node: PyNode, acc: torch.Tensor) -> torch.Tensor:
    """A quantized MAC layer's fused LEAKYRELU/PRELU on its integer accumulator (bias added), int64; other
    activations leave it as it is."""
    act = fused_activation(node)
    if act == "LEAKYRELU":
        slope = torch.tensor(int(node.get_param("negative_slope_value")), dtype=torch.int64)
        shift = int(node.get_param("negative_slope_shift", optional=True,
                                   default_value=node.outputs[0].dtype.bits))
    elif act == "PRELU":
        slope = node.get_constant("negative_slope").betensor.to(torch.int64)
        shift = int(node.get_param("negative_slope_shift", optional=True, default_value=PRELU_SLOPE_SHIFT))
        if not broadcasts_to(slope.shape, acc.shape):
            raise node._error(f"negative_slope of shape {list(slope.shape)} does not broadcast to the output shape "
                              f"{list(acc.shape)}")
    else:
        return acc
    return apply_int_slope(acc, slope, shift)


def fused_activation_bounds(node: PyNode) -> Tuple[Union[int, torch.Tensor], Union[int, torch.Tensor]]:
    """Integer output bounds of a layer with a fused RELU/RELU6/CLIP: (q(lo), q(hi)) with
    q(v) = clamp(round_half_even(v * scale_out - zp_out), qmin, qmax) in float64; the output range otherwise."""
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    q_out = quant_of(node).get(out)
    act = fused_activation(node)
    if act not in ("RELU", "RELU6", "CLIP"):
        return qmin, qmax
    if act == "CLIP":
        lo_f, hi_f = float(node.get_param("clip_min")), float(node.get_param("clip_max"))
    else:
        lo_f, hi_f = 0.0, (6.0 if act == "RELU6" else None)

    def q(v: float) -> Union[int, torch.Tensor]:
        r = quantize(torch.tensor(v), q_out.scale, q_out.zerop, qmin, qmax, compute_dtype=torch.float64)
        return int(r) if r.numel() == 1 else r.to(torch.int64).reshape(-1)  # per channel: one bound each

    return q(lo_f), (qmax if hi_f is None else q(hi_f))


def fused_activation_clamp(node: PyNode, y: torch.Tensor) -> torch.Tensor:
    """Clamp an int64 output to `fused_activation_bounds`. For RELU on an unsigned output this is the range itself;
    it matters when the output is forced signed (`force_dtype_int`)."""
    if fused_activation(node) not in ("RELU", "RELU6", "CLIP"):
        return y
    lo, hi = fused_activation_bounds(node)
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):  # per-channel output: bounds per last axis
        return torch.clamp(y, torch.as_tensor(lo, dtype=y.dtype, device=y.device),
                           torch.as_tensor(hi, dtype=y.dtype, device=y.device))
    return torch.clamp(y, lo, hi)


def quantize_weights(node: PyNode, per_channel: bool, groups: Optional[int] = None,
                     key: str = "weights") -> QuantParams:
    """Quantize a weight constant in place (symmetric or asymmetric per the layer's weight mode).

    Per channel, the ranges are merged into `groups` consecutive channel groups (the unify_shifts fallback).
    """
    s = layer_settings(node)
    w = node.get_constant(key)
    given = w.extra.get(GIVEN_PARAMS)
    if given is not None:  # a pre-quantized model's integer weights, kept as they are (docs/compat-quantized.md)
        if per_channel != given.per_channel or (groups is not None and given.per_channel and
                                                 groups < given.scale.numel()):
            raise node._error(f"constant '{key}' keeps the given {'per-channel' if given.per_channel else 'per-tensor'}"
                              " quantization of the pre-quantized model, which this layer's settings cannot take")
        w.betensor = w.extra[GIVEN_VALUES].clone()
        set_params(node, w, given, int(given.dtype.bits), axis=0)
        return given
    table = ranges_of(node)
    if table.get(w).min is None:
        raise node._error(f"constant '{key}' has no calibrated range; run calibration before quantization")
    mode = QuantMode.from_name(s.q_mode_weight)
    _refuse_per_block(node, mode)
    mode = mode.to_per_channel() if per_channel else mode.to_per_tensor()
    bits = int(s.q_bits_weight)
    if per_channel:
        rc = table.channels(w)
        lo, hi = rc.min, rc.max
        if groups is not None and groups < lo.numel():
            lo, hi, _ = group_ranges(lo, hi, groups)
        p = linear_quant_params(lo, hi, bits, mode, True)
    else:
        r = table.get(w)
        p = linear_quant_params(r.min, r.max, bits, mode, True)
    w.betensor = quantize(w.betensor, p.scale, p.zerop, p.qmin, p.qmax, axis=0 if per_channel else None)
    set_params(node, w, p, bits, axis=0)
    return p


def _weight_ratio_fn(node: PyNode, s_in: float, s_out: Union[float, torch.Tensor]):
    s = layer_settings(node)
    w = node.get_constant("weights")
    mode = QuantMode.from_name(s.q_mode_weight).to_per_channel()

    def ratios(groups: int) -> torch.Tensor:
        """On the CPU, where `unify_shifts_for_aiff` derives the multipliers."""
        out = torch.as_tensor(s_out, dtype=torch.float32).cpu()
        given = w.extra.get(GIVEN_PARAMS)
        if given is not None and given.per_channel and groups == given.scale.numel():
            return out / (torch.tensor(s_in, dtype=torch.float32) * given.scale.cpu().to(torch.float32))
        rc = ranges_of(node).channels(w)
        lo, hi, _ = group_ranges(torch.as_tensor(rc.min).cpu(), torch.as_tensor(rc.max).cpu(), groups)
        ws = linear_quant_params(lo, hi, int(s.q_bits_weight), mode, True).scale
        return out / (torch.tensor(s_in, dtype=torch.float32) * ws)
    return ratios


def effective_weights(node: PyNode) -> torch.Tensor:
    """Integer weights plus their zero point (w_q + zp_w), int64: what the MAC multiplies."""
    w = node.get_constant("weights").betensor.to(torch.int64)
    if "weights_zp" in node.constants:
        zp = node.constants["weights_zp"].betensor.to(device=w.device, dtype=torch.int64).reshape(
            [-1] + [1] * (w.dim() - 1))
        return w + zp
    zp = int(node.params.get("weights_zp", 0))
    return w + zp if zp else w


def mac_weights(node: PyNode) -> Tuple[torch.Tensor, torch.dtype]:
    """(w_q + zp_w in its exact compute dtype, that dtype) for the integer forward of a MAC layer.

    Cached on the layer while its weight tensor and input range stay the same, so repeated forwards do not redo
    the conversion and the exactness bound (a clone or a re-read graph has new tensors and recomputes).
    """
    return _mac_weights_entry(node)[:2]


def mac_bound(node: PyNode) -> int:
    """A bound on |acc| of a MAC layer's integer accumulator x·(w_q + zp_w) (bias not added) from its input's stored
    range and its weights: max(|qmin|, |qmax|, |zp|) of the input (its values, and -zp for its padding) times the
    largest sum of |w| over the output channels; the bound that chose `mac_weights`' dtype, so that
    `mac_finish` need not look at the accumulator's extrema. Cached with `mac_weights`."""
    return _mac_weights_entry(node)[2]


def _mac_weights_entry(node: PyNode) -> Tuple[torch.Tensor, torch.dtype, int]:
    """(`mac_weights`' weights and dtype, `mac_bound`), cached on the layer while its weight tensor and its input's
    range and zero point stay the same."""
    w_q = node.get_constant("weights").betensor
    in_range = (*out_range(node, node.inputs[0]), int(tensor_zp(node, node.inputs[0])))
    cached = node.attrs.get("_mac_weights")
    if cached is not None and cached[0] is w_q and cached[1] == in_range:
        return cached[2]
    w = effective_weights(node)
    # the padding value -zp counts too (a zero point outside the range would otherwise be missed)
    dtype, bound = _exact_float_dtype_and_bound(max(abs(v) for v in in_range), w)
    entry = (w.to(dtype), dtype, bound)
    node.attrs["_mac_weights"] = (w_q, in_range, entry)
    return entry


def mac_weights_int8(node: PyNode) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
    """(w_q + zp_w as int8, its sum per output row as int64, the largest sum of |w| over the output rows) when every
    weight fits int8 (the operand of the integer GEMM, `_int8_gemm.int8_gemm`), else None; cached like
    `mac_weights`. The row sums let an input taken with an offset (uint8 values minus 128) be corrected exactly;
    the largest absolute row sum bounds the accumulator (|x·w| <= max|x| · it) for `mac_finish`."""
    w_q = node.get_constant("weights").betensor
    cached = node.attrs.get("_mac_weights_int8")
    if cached is not None and cached[0] is w_q:
        return cached[1]
    w = effective_weights(node)
    fits = w.numel() > 0 and int(w.min()) >= -128 and int(w.max()) <= 127
    rows = w.reshape(int(w.shape[0]), -1)
    value = (w.to(torch.int8), rows.sum(dim=1), int(row_abs_sums(rows).max())) if fits else None
    node.attrs["_mac_weights_int8"] = (w_q, value)
    return value


def _refuse_per_block(node: PyNode, mode: QuantMode) -> None:
    """Per-block weights need a scale per block inside the accumulation, which the integer MAC does not have: they
    serve weight-only layers (float activations), as upstream's."""
    if mode.is_per_block:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-block weights ({mode.value}) are for "
                               "weight-only layers (trigger_float_op *_act_*_wht, or quant_type w4afp16, wfp4afp16, "
                               "...); an integer layer takes per_tensor or per_channel weights",
                               field="quantize_method_for_weight", layer=node.name)


def quantize_mac(node: PyNode, per_channel: bool, groups: int = 1) -> None:
    """Convolution / DepthwiseConv / FullyConnected quantization (upstream `linear_op_quantize`).

    Output params from the calibrated output range (unsigned after RELU/RELU6/CLIP>=0); weights symmetric or
    asymmetric per tensor, per channel, or per group for grouped convs; requant ratio s_out / (s_in * s_w) as
    multiplier/shift (per channel: one shift shared by all channels, `unify_shifts_for_aiff`); biases quantized
    with scale s_in * s_w, the input zero point folded in, then limited to `bias_effective_bits`. A per-channel
    input's scales are already in the float weights (passes/absorb_scales.py ran before): the input counts with
    scale 1 and zero point 0.
    """
    from ._per_channel import input_scales_absorbed

    check_fused_activation_quantizable(node, slopes=True)
    s = layer_settings(node)
    _refuse_per_block(node, QuantMode.from_name(s.q_mode_weight))
    inp, out = node.inputs[0], node.outputs[0]
    if input_scales_absorbed(node):
        s_in, zp_in = 1.0, 0
    else:
        s_in, zp_in = tensor_scale(node, inp), tensor_zp(node, inp)
    quantize_activation(node, out, fused_output_signed(node), per_channel_ok=True)
    s_out = scale_of(node, out)
    w = node.get_constant("weights")
    channels = int(w.betensor.shape[0])
    # a per-channel output keeps one shift per channel: its ratios spread with the channels' ranges, and a shared
    # shift would zero the multipliers of the narrow ones
    per_out = isinstance(s_out, torch.Tensor)
    unify = s.unify_shifts_for_aiff and not per_out
    if per_out and not (per_channel or groups > 1):  # per-tensor weights, per-channel output
        wp = quantize_weights(node, per_channel=False)
        ratios = s_out / (torch.tensor(s_in, dtype=torch.float32) * torch.tensor(wp.scale, dtype=torch.float32))
        unified = unify_shifts_for_aiff(lambda _groups: ratios, channels, s.mult_bits, initial_groups=channels,
                                        force_shift_positive=s.force_shift_positive, unify=False)
        store_requant(node, unified.multiplier, unified.shift, unified.mult_dtype, unified.shift_dtype)
    elif per_channel or groups > 1:
        unified = unify_shifts_for_aiff(_weight_ratio_fn(node, s_in, s_out), channels, s.mult_bits,
                                        initial_groups=channels if per_channel else groups,
                                        force_shift_positive=s.force_shift_positive, unify=unify)
        if unified.fell_back:
            OPT_WARN(f"layer '{node.name}': multipliers of some channels vanished under a shared shift; weights are "
                     f"quantized per {unified.group_size} channels")
        wp = quantize_weights(node, per_channel=True, groups=unified.groups)
        store_requant(node, unified.multiplier, unified.shift, unified.mult_dtype, unified.shift_dtype)
    else:
        wp = quantize_weights(node, per_channel=False)
        ratio = torch.tensor(s_out, dtype=torch.float32) / (torch.tensor(s_in, dtype=torch.float32) *
                                                            torch.tensor(wp.scale, dtype=torch.float32))
        store_requant(node, *requant_scale_shift(node, ratio))
    # one output channel is written as per-tensor params, as upstream writes a one-element field
    per_channel_weights = isinstance(wp.scale, torch.Tensor) and wp.scale.numel() > 1
    if per_channel_weights:
        set_constant(node, "weights_scale", wp.scale.to(torch.float32), Dtype.FP32)
        set_constant(node, "weights_zp", wp.zerop.to(torch.int64), Dtype.INT32)
    else:
        node.params["weights_scale"] = float(wp.scale)
        node.params["weights_zp"] = int(wp.zerop)
    w_eff = effective_weights(node)
    bias_bits = int(s.q_bits_bias)
    b_lo, b_hi = integer_range(bias_bits, True)
    b = node.get_constant("biases", optional=True)
    b_float = b.betensor if b is not None else torch.zeros(channels)
    b_q, b_scale = bias_quantize(b_float, s_in, wp.scale, bias_bits)
    if s.bias_effective_bits_auto_adaption:
        clamp_bits = search_bias_clamp_bits(b_float, b_q, b_scale, s.effective_bias_bits, bias_bits)
        if clamp_bits is not None:
            b_q = torch.clamp(b_q, -(2 ** (clamp_bits - 1)), 2 ** (clamp_bits - 1) - 1)
            OPT_INFO(f"layer '{node.name}': bias_effective_bits_auto_adaption clamps the biases to {clamp_bits} bits "
                     f"before keeping their top {s.effective_bias_bits} bits")
    if zp_in:  # (a zero point folds nothing: b_q is already within the bias range)
        # upstream adds the fold to its float32 bias tensor: beyond 2^24 the sum lands on float32's grid
        b_q = torch.clamp(float32_grid(fold_input_zero_point(b_q, w_eff, zp_in)), b_lo, b_hi)
    b_q, _ = compress_bias(b_q, s.effective_bias_bits)
    if bool((b_q == b_hi).any() or (b_q == b_lo).any()):
        OPT_WARN(f"layer '{node.name}': quantized biases saturate at {bias_bits} bits (input scale x weight scale "
                 f"is large); consider bias_bits = 48" + (" for 16-bit activations" if s.q_bits_activation > 8
                                                         else ""))
    bias_dtype = Dtype.INT32 if bias_bits <= 32 else Dtype.INT64
    if b is None:
        b = set_constant(node, "biases", b_q, bias_dtype)
        insert_keys_after(node, "weights", ["biases"])
    b.betensor = b_q
    b.dtype = bias_dtype
    qb = quant_of(node).of(b)
    qb.scale, qb.zerop, qb.qbits = b_scale, 0, bias_bits
    qb.axis = 0 if isinstance(b_scale, torch.Tensor) and b_scale.numel() > 1 else None
    if per_channel_weights:
        set_constant(node, "biases_scale", torch.as_tensor(b_scale, dtype=torch.float32), Dtype.FP32)
        set_constant(node, "biases_zp", torch.zeros(1, dtype=torch.int64), Dtype.INT64)
    else:
        node.params["biases_scale"] = float(b_scale)
        node.params["biases_zp"] = 0
    insert_keys_after(node, "biases", [k for k in ("scale", "shift", "weights_scale", "weights_zp", "biases_scale",
                                                   "biases_zp") if k in node.constants])
    if s.remain_shift is not None:
        node.params["remain_shift"] = int(s.remain_shift)
    quantize_fused_slope(node)


ROW_SUM_BLOCK_ELEMENTS = 1 << 20
"""Weights whose |w| `row_abs_sums` makes at once: a large layer's weights (a VGG or BERT-size FullyConnected)
are not copied whole."""


def row_abs_sums(rows: torch.Tensor) -> torch.Tensor:
    """The sum of |w| over each row of a 2-D tensor (rows of about ROW_SUM_BLOCK_ELEMENTS at a time)."""
    n, k = int(rows.shape[0]), int(rows.shape[1])
    step = max(1, ROW_SUM_BLOCK_ELEMENTS // max(k, 1))
    if step >= n:
        return rows.abs().sum(dim=1)
    return torch.cat([rows[r:r + step].abs().sum(dim=1) for r in range(0, n, step)])


def exact_float_dtype(x_absmax: int, w_eff: torch.Tensor) -> torch.dtype:
    """float32 when every partial sum of x·w is provably below 2^24 (then exact), else float64 (exact to 2^53)."""
    return _exact_float_dtype_and_bound(x_absmax, w_eff)[0]


def _exact_float_dtype_and_bound(x_absmax: int, w_eff: torch.Tensor) -> Tuple[torch.dtype, int]:
    """(`exact_float_dtype`, the bound max|x| · max over the outputs of sum |w| on every partial sum)."""
    per_out = row_abs_sums(w_eff.reshape(w_eff.shape[0], -1))
    bound = int(per_out.max()) * int(x_absmax) if per_out.numel() else 0
    return (torch.float32 if bound < FLOAT32_EXACT else torch.float64), bound


def mac_finish(node: PyNode, acc: torch.Tensor, owned: bool = False, planned: bool = True,
               bound: Optional[float] = None) -> torch.Tensor:
    """Integer accumulator (float64 holding exact ints, bias not yet added) → requantized int64 output.

    acc + b, optionally through the 48→32-bit `remain_shift` hand-over, then
    y = clamp(round_half_even((acc + b) · M · 2^-shift) - zp_out, qmin, qmax) per tensor or per output channel
    (last axis), then the fused RELU6/CLIP bounds. The usual case runs from a per-layer plan (`_finish_plan`:
    biases, M·2^-shift and bounds memoized, graph/memo.py), whose derivation costs more than the arithmetic on small
    inputs; `planned=False` computes without it (the reference the plan is tested against). `owned`: `acc` is the
    caller's temporary and may be overwritten. `bound`: a bound on |acc| the caller proved from the values it
    summed (the int8 GEMMs: max |x| · max sum |w|), which spares the plan its own pass over the accumulator's
    extrema.
    """
    if planned:
        fast = _planned_finish(node, acc, owned, bound)
        if fast is not None:
            return fast
    out = node.outputs[0]
    mult, shift = requant_of(node)
    b = node.get_constant("biases").betensor.to(device=acc.device, dtype=torch.float64).reshape(-1)
    remain = node.params.get("remain_shift")
    common = shift if isinstance(shift, int) else (int(shift[0]) if bool((shift == shift[0]).all()) else None)
    if remain is not None and common is not None and _wide_mac(node):
        acc, rest = aiff_ahead_shift(acc, common, int(remain), bias=b)
        shift = rest if isinstance(shift, int) else torch.full_like(shift, rest)
    else:
        acc = acc + b
    if fused_activation(node) in SLOPE_ACTIVATIONS:
        acc = fused_int_slope(node, acc)
    qmin, qmax = out_range(node, out)
    fast = _requantize_exact_float64(acc, mult, shift, tensor_zp(node, out), qmin, qmax)
    if fast is not None:
        return fused_activation_clamp(node, fast)
    axis = -1 if isinstance(mult, torch.Tensor) else None
    y = linear_requantize(acc, mult, shift, tensor_zp(node, out), qmin, qmax, axis=axis)
    return fused_activation_clamp(node, y)


@dataclass
class _FinishPlan:
    """What `mac_finish` derives from the layer alone, memoized per layer and device (`_finish_plan`)."""

    b: torch.Tensor
    """the biases, float64"""
    b_absmax: float
    factor: torch.Tensor
    """M·2^-shift (one value or one per output channel), float64"""
    b_scaled: torch.Tensor
    """b · factor: exact where |b·M| < 2^53, which every use checks"""
    m_absmax: float
    zp_out: float
    qmin: int
    qmax: int
    lo: Any
    """the fused activation's bounds (None: none)"""
    hi: Any
    scaled: bool
    """`requantize_scaled_`'s rounding by addition applies: every shift >= 3 and the output range small"""


def _finish_plan(node: PyNode, device: torch.device) -> Optional[_FinishPlan]:
    """The layer's `_FinishPlan`, or None where the plan does not apply (a `remain_shift` hand-over, slope
    activations, shifts beyond ±900)."""
    def build() -> Optional[_FinishPlan]:
        if node.params.get("remain_shift") is not None or fused_activation(node) in SLOPE_ACTIVATIONS:
            return None
        out = node.outputs[0]
        mult, shift = requant_of(node)
        b = node.get_constant("biases").betensor.to(device=device, dtype=torch.float64).reshape(-1)
        m = torch.as_tensor(mult, dtype=torch.float64).cpu()
        s = torch.as_tensor(shift, dtype=torch.float64).cpu()
        if not -900 < float(s.min()) <= float(s.max()) < 900:
            return None
        qmin, qmax = out_range(node, out)
        lo: Any = None
        hi: Any = None
        if fused_activation(node) in ("RELU", "RELU6", "CLIP"):
            lo, hi = fused_activation_bounds(node)
            if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):  # per-channel output
                lo = torch.as_tensor(lo, dtype=torch.int64, device=device)
                hi = torch.as_tensor(hi, dtype=torch.int64, device=device)
        scaled = float(s.min()) >= 3 and max(abs(qmin), abs(qmax)) + abs(tensor_zp(node, out)) < MAGIC_SCALED_BOUND
        factor = (m * torch.pow(2.0, -s)).to(device)  # formed on the CPU: CUDA's pow is not correctly rounded
        b_absmax = float(b.abs().max()) if b.numel() else 0.0
        return _FinishPlan(b, b_absmax, factor, b * factor, float(m.abs().max()), float(tensor_zp(node, out)), qmin,
                           qmax, lo, hi, scaled)

    return memo(node, "mac_finish", (layer_key(node), device), build)


def _planned_finish(node: PyNode, acc: torch.Tensor, owned: bool,
                    bound: Optional[float] = None) -> Optional[torch.Tensor]:
    """`mac_finish`'s result from the layer's memoized plan (`_finish_plan`), or None (acc untouched) where the plan
    does not apply: a `remain_shift` hand-over, shifts beyond ±900, an accumulator whose products may leave float64's
    exact range, NaN. `owned`: `acc` is the caller's temporary and is overwritten (the bound is then checked on acc
    and max|b|, which only sends more accumulators to the general path, whose result is the same); `bound`: the
    caller's bound on |acc| (finite integers), taken instead of the accumulator's extrema."""
    plan = _finish_plan(node, acc.device) if acc.dtype == torch.float64 and acc.numel() else None
    if plan is None:
        return None
    if owned and broadcasts_into(plan.b.shape, acc.shape):
        if bound is not None:
            a_lo, a_hi = -float(bound), float(bound)
        else:
            a_lo, a_hi = (float(v) for v in torch.aminmax(acc))
        if not (math.isfinite(a_lo) and math.isfinite(a_hi) and math.isfinite(plan.b_absmax)) \
                or (max(-a_lo, a_hi) + plan.b_absmax) * plan.m_absmax >= FLOAT64_EXACT:
            return None
        if plan.scaled and broadcasts_into(plan.factor.shape, acc.shape):
            # (acc + b)·f = acc·f + b·f: each term and the sum exact (|(acc + b)·M| < 2^53, one shift per channel),
            # so one multiply-add in place of the bias and the scaling; then the rounding by addition
            y = round_scaled_(torch.addcmul(plan.b_scaled, acc, plan.factor, out=acc), int(plan.zp_out), plan.qmin,
                              plan.qmax)
            return y if plan.lo is None else torch.clamp(y, plan.lo, plan.hi)
        y = acc.add_(plan.b)
    else:
        y = acc + plan.b
        y_lo, y_hi = (float(v) for v in torch.aminmax(y))
        if not (math.isfinite(y_lo) and math.isfinite(y_hi)) or max(-y_lo, y_hi) * plan.m_absmax >= FLOAT64_EXACT:
            return None
    if plan.scaled:  # |y * M| < 2^53 (checked above) and every shift >= 3: |y * factor| < 2^50
        y = requantize_scaled_(y, plan.factor, int(plan.zp_out), plan.qmin, plan.qmax)
    else:
        y = exact_int64_(y.mul_(plan.factor).round_().sub_(plan.zp_out).clamp_(float(plan.qmin), float(plan.qmax)),
                         plan.qmin, plan.qmax)
    if plan.lo is None:
        return y
    return torch.clamp(y, plan.lo, plan.hi)


def scaled_product_finish(node: PyNode, x: torch.Tensor) -> Optional[torch.Tensor]:
    """`mac_finish(node, x · w)` for integer `x` (int64, channels last) times the layer's per-channel effective
    weights w along the last axis (a BatchNorm), without forming the accumulator: with f = M·2^-shift,
    (x·w + b)·f = x·(w·f) + b·f, each term and their sum exact where (max|x|·max|w| + max|b|)·max|M| < 2^53 (one
    look at x's extrema proves it), so one multiply-add and the rounding by addition replace the conversion, the
    product, the extrema of the accumulator, the bias and the scaling: four passes over the map instead of nine.
    None (nothing done) where the layer's plan does not apply (`_planned_finish`'s cases) or the bound fails."""
    if x.dtype != torch.int64 or not x.numel():
        return None
    plan = _finish_plan(node, x.device)
    if plan is None or not plan.scaled or not broadcasts_into(plan.b_scaled.shape, x.shape):
        return None

    def build() -> Tuple[torch.Tensor, int]:
        w = effective_weights(node).reshape(-1).to(device=x.device, dtype=torch.float64)
        return w * plan.factor, int(w.abs().max()) if w.numel() else 0

    w_scaled, w_absmax = memo(node, "scaled_product_finish", (layer_key(node), x.device), build)
    if not broadcasts_into(w_scaled.shape, x.shape):
        return None
    if (values_absmax(x) * w_absmax + plan.b_absmax) * plan.m_absmax >= FLOAT64_EXACT:
        return None
    # |x·w·f + b·f| < 2^50 (every shift >= 3): the rounding by addition applies. x is converted first and the sum
    # written into it: torch's addcmul into a new tensor follows the broadcast first operand's strides, and took
    # 14.7 ms on a 320x320x16 map where the conversion and the in-place addcmul take 2.5 ms (AVX2 machine)
    xf = x.to(torch.float64)
    y = round_scaled_(torch.addcmul(plan.b_scaled, xf, w_scaled, out=xf), int(plan.zp_out), plan.qmin, plan.qmax)
    return y if plan.lo is None else torch.clamp(y, plan.lo, plan.hi)


def _requantize_exact_float64(acc: torch.Tensor, mult: Union[int, torch.Tensor], shift: Union[int, torch.Tensor],
                              zp_out: Union[int, float], qmin: int, qmax: int) -> Optional[torch.Tensor]:
    """`linear_requantize` of a fresh float64 accumulator of finite integers (channels last), done in place in
    four passes, when one look at its extrema proves |acc * M| < 2^53 (the usual case); None otherwise, for the
    general path (NaN, wide accumulators, per-channel zero points)."""
    if acc.dtype != torch.float64 or not acc.numel() or isinstance(zp_out, torch.Tensor):
        return None
    lo, hi = (float(v) for v in torch.aminmax(acc))
    m = torch.as_tensor(mult, dtype=torch.float64).cpu()
    s = torch.as_tensor(shift, dtype=torch.float64).cpu()
    if not (math.isfinite(lo) and math.isfinite(hi)) or max(-lo, hi) * float(m.abs().max()) >= FLOAT64_EXACT:
        return None
    if not -900 < float(s.min()) <= float(s.max()) < 900:
        return None
    factor = (m * torch.pow(2.0, -s)).to(acc.device)  # formed on the CPU: CUDA's pow is not correctly rounded
    y = acc.mul_(factor).round_().sub_(float(zp_out)).clamp_(float(qmin), float(qmax))
    return exact_int64(y, qmin, qmax)


def _wide_mac(node: PyNode) -> bool:
    w = node.get_constant("weights")
    table = quant_of(node)
    return (table.get(node.inputs[0]).qbits or 8) > 8 or (table.get(w).qbits or w.dtype.bits) > 8


def mac_input(node: PyNode) -> Tuple[torch.Tensor, int]:
    """(int64 input values, zero point) of a MAC op."""
    return int_value(node.inputs[0]), tensor_zp(node, node.inputs[0])


def check_quantized_inputs(node: PyNode, inputs: Sequence[PyTensor]) -> None:
    for t in inputs:
        if quant_of(node).get(t).qmin is None:
            raise node._error(f"input '{t.name}' is not quantized; quantize the producer first")


def integer_output_bits(node: PyNode, signed: bool) -> int:
    """Bits of an all-integer (qinvariant) output: the smallest of 8/16/32 holding its observed extrema."""
    out = node.outputs[0]
    st, r = statistics_of(node).get(out), ranges_of(node).get(out)
    lo = st.extrema_min if st.extrema_min is not None else r.min
    hi = st.extrema_max if st.extrema_max is not None else r.max
    lo, hi = float(lo if lo is not None else 0.0), float(hi if hi is not None else 0.0)
    for bits in (8, 16):
        qmin, qmax = integer_range(bits, signed)
        if qmin <= lo and hi <= qmax:
            return bits
    return 32


# ------------------------------------------------------------------------------------------------ integer constants
def integer_bits(lo: float, hi: float) -> Tuple[int, bool]:
    """(bits, signed) of the narrowest integer type holding [lo, hi], as upstream types an integer-valued Constant:
    unsigned when lo >= 0 unless hi > 65535 (then int32), of 8, 16 or 32 bits."""
    signed = lo < 0 or hi > 65535
    for bits in (8, 16):
        qmin, qmax = integer_range(bits, signed)
        if qmin <= lo and hi <= qmax:
            return bits, signed
    return INT_INPUT_MAX_BITS, signed


def integer_constant_range(node: PyNode) -> Optional[Tuple[float, float]]:
    """(min, max) of a Constant layer whose values are all integers (finite, no mask values: see
    `constant_quantize` in ops/io.py), else None: such a constant is quantized as exact integers (scale 1)."""
    if str(node.type) != "Constant" or "weights" not in node.constants:
        return None
    if node.outputs and is_mask_tensor(statistics_of(node).get(node.outputs[0])):  # a finite mask (its statistics)
        return None
    values = node.constants["weights"].betensor
    if values.is_floating_point():
        if not bool(torch.isfinite(values).all()) or bool((values.abs() >= INF_MASK_THRESHOLD).any()) or \
                not bool((values == torch.round(values)).all()):
            return None
    return (float(values.min()), float(values.max())) if values.numel() else (0.0, 0.0)
