"""Statistical moments: Moments (the mean and the population variance over some axes), SufficientStatistics (the sum
of deviations from a shift and the sum of their squares) and NormalizedMoments (mean and variance from those sums; its
squared mean is a placeholder whose calibrated range sets the scale of its table, as upstream).

Quantized, the mean output keeps the input's params, so it is the exactly rounded mean of the input integers; the
variance output is requantized from the exact integer sum of squared deviations with one rounding (upstream first
truncates the sum divided by the count, and for inputs over 8 bits rounds two 16-bit halves separately:
docs/semantics/moments.md gives both and the difference).
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.lut import lookup_lut, lut_size
from ..quant.params import dequantize, integer_range, linear_quant_params, quantize
from ..quant.requant import range_dtype, requantize_int, scale_shift
from ..quant.rounding import div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Axis, Bool, DtypeName, Float, Int, Ints, Param, Value, quantized
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    copy_params,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_scale_shift,
    set_constant,
    set_params,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param, broadcast_shape

SEMANTICS = "docs/semantics/moments.md"

INT64_BOUND = 2 ** 62
"""Exact int64 products stay below this (the simulator refuses a layer whose worst case reaches it)."""


def _per_tensor(node: PyNode, t: PyTensor) -> None:
    q = params(node, t)
    for what in ("scale", "zerop"):
        v = getattr(q, what)
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' has per-channel "
                                   "quantization; this op needs per-tensor scale and zero point")


def _axes(node: PyNode, rank: int) -> List[int]:
    raw = node.get_param("axis")
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    if not items:
        raise node._error("axis must name at least one dim")
    axes = sorted({axis_param(node, a, rank) for a in items})
    if len(axes) != len(items):
        raise node._error(f"axis {raw} names a dim twice")
    return axes


def rounded_ratio(num: torch.Tensor, den: int, shift: int) -> torch.Tensor:
    """Exact round_half_even(num / (den * 2^shift)) of a non-negative int64 tensor (`num` < 2^62, den >= 1; a
    negative shift multiplies, saturating at 2^62)."""
    if shift < 0:
        k = -shift
        big = num >= (INT64_BOUND >> min(k, 62)) if k < 62 else num > 0
        return torch.where(big, torch.full_like(num, INT64_BOUND), div_round_half_even(num << min(k, 62), den))
    if den.bit_length() + shift <= 62:
        return div_round_half_even(num, den << shift)
    return torch.zeros_like(num)  # den * 2^shift >= 2^62 > 2 * num: the ratio is below 1/2


# ------------------------------------------------------------------------------------------------ Moments
MOMENTS = declare_op(
    "Moments",
    params={"axis": Param(Axis(), "the reduced dims (negative count from the end)", required=True),
            "keepdims": Param(Bool(), "reduced dims stay with size 1", default=True),
            "var_scale_value": quantized(Int(lo=0), "variance multiplier M"),
            "var_scale_type": quantized(DtypeName(), "dtype of M"),
            "var_shift_value": quantized(Int(), "variance shift N"),
            "var_shift_type": quantized(DtypeName(), "dtype of N"),
            "input_scale_value": quantized(Int(lo=0), "input multiplier, always 1 (written as upstream; must be 1)"),
            "input_scale_type": quantized(DtypeName(), "its dtype"),
            "input_shift_value": quantized(Int(), "input shift, always 0 (written as upstream; must be 0)"),
            "input_shift_type": quantized(DtypeName(), "its dtype")},
    dtypes="float32 → output 0 (mean): the input's params; output 1 (variance): uint8/uint16 (int with "
           "force_dtype_int), or an integer tensor of twice the input's bits for an integer input",
    integer="exact: rounded integer mean; variance requantized from the exact sum of squared deviations",
    semantics=f"{SEMANTICS}#moments",
    summary="Outputs: the mean and the population variance over `axis`.")


@MOMENTS.forward
def moments_forward(self: PyNode) -> None:
    if len(self.outputs) != 2:
        raise self._error(f"needs two outputs (mean, variance), got {len(self.outputs)}")
    inp = self.inputs[0]
    x = inp.betensor
    axes = _axes(self, x.dim())
    keep = bool_param(self, "keepdims", True)
    mean_out, var_out = self.outputs
    if not self.quantized:
        # float32 std then squared, as upstream (its calibrated variance range is that of std * std)
        std, mean = torch.std_mean(x.to(torch.float32), dim=axes, keepdim=keep, unbiased=False)
        mean_out.betensor = mean
        var_out.betensor = std * std
        return
    if int(self.get_param("input_scale_value", optional=True, default_value=1)) != 1 or \
            int(self.get_param("input_shift_value", optional=True, default_value=0)) != 0:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): input_scale_value/input_shift_value other than "
                               "1/0 are not supported")
    q = x.to(torch.int64)
    n = math.prod(int(q.shape[a]) for a in axes)
    total = q.sum(dim=axes, keepdim=True)
    mean = div_round_half_even(total, n)
    dev = q - mean
    sq = (dev * dev).sum(dim=axes, keepdim=True)
    m = int(self.get_param("var_scale_value"))
    shift = int(self.get_param("var_shift_value"))
    qmin, qmax = out_range(self, var_out)
    emax = max(abs(v) for v in out_range(self, inp))
    if n * (2 * emax) ** 2 * max(m, 1) >= INT64_BOUND:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the variance accumulator of {n} values may "
                               "reach 2^62; reduce fewer elements")
    var = torch.clamp(rounded_ratio(sq * m, n, shift) - tensor_zp(self, var_out), qmin, qmax)
    if not keep:
        mean, var = mean.squeeze(axes), var.squeeze(axes)
    mean_out.betensor = mean
    var_out.betensor = var


@MOMENTS.quantize
def moments_quantize(self: PyNode) -> None:
    """Mean: the input's params. Variance: an integer input gives an integer output of twice its bits (M = 1,
    N = 0); otherwise calibrated, unsigned, with (M, N) = scale_shift(s_var / s_in^2, activation bits) as upstream
    (its multiplier has the activation's bits, not multiplier_bits)."""
    inp = self.inputs[0]
    check_quantized_inputs(self, [inp])
    _per_tensor(self, inp)
    mean_out, var_out = self.outputs
    copy_params(self, mean_out, inp)
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    signed = bool(s.force_dtype_int)
    q_in = params(self, inp)
    if q_in.qinvariant:
        set_qinvariant(self, var_out, min(2 * int(q_in.qbits), 32), signed)
        m, shift, m_type, shift_type = 1, 0, int_dtype_for_bits(bits, False), Dtype.INT8
    else:
        quantize_activation(self, var_out, signed, bits)
        s_in = tensor_scale(self, inp)
        m, shift, m_type, shift_type = requant_scale_shift(self, tensor_scale(self, var_out) / (s_in * s_in),
                                                           mult_bits=bits)
    self.params["var_scale_value"] = int(m)
    self.params["var_scale_type"] = m_type
    self.params["var_shift_value"] = int(shift)
    self.params["var_shift_type"] = shift_type
    self.params["input_scale_value"] = 1
    self.params["input_scale_type"] = int_dtype_for_bits(bits, False)
    self.params["input_shift_value"] = 0
    self.params["input_shift_type"] = Dtype.INT8


# ------------------------------------------------------------------------------------------------ SufficientStatistics
SS_MULTIPLIER_BITS = 16
"""Width of SufficientStatistics' four multipliers (upstream's fixed choice)."""

SS_ALIGN_BITS = 15
"""The inputs are aligned to one scale with up to 15 bits of headroom (upstream)."""

_I32 = (-2 ** 31, 2 ** 31 - 1)
_U32_MAX = 2 ** 32 - 1

SUFFICIENT_STATISTICS = declare_op(
    "SufficientStatistics",
    params={"axis": Param(Axis(), "the reduced dims (kept with size 1)", required=True),
            "scale_value": quantized(Ints(lo=0), "[M_out0, M_out1, M_in0, M_in1]"),
            "scale_type": quantized(Value("list of dtypes"), "their dtypes"),
            "shift_value": quantized(Ints(), "[N_out0, N_out1, N_in0, N_in1]"),
            "shift_type": quantized(Value("list of dtypes"), "their dtypes")},
    dtypes="float32 → output 0 signed, output 1 unsigned (activation bits; 32-bit integers for integer inputs)",
    integer="both inputs requantized to one scale, exact sums; output 0 truncated, output 1 floored (as upstream)",
    semantics=f"{SEMANTICS}#sufficientstatistics",
    summary="Inputs: x and a shift broadcast to it. Outputs: Σ (x - shift) and Σ (x - shift)² over `axis`.")


def signed_bits(lo: int, hi: int) -> int:
    """The fewest bits b whose signed range [-2^(b-1), 2^(b-1) - 1] holds [lo, hi] (upstream `range2bits`)."""
    b = 1
    while lo < -(1 << (b - 1)) or hi > (1 << (b - 1)) - 1:
        b += 1
    return b


@SUFFICIENT_STATISTICS.forward
def sufficient_statistics_forward(self: PyNode) -> None:
    if len(self.inputs) != 2 or len(self.outputs) != 2:
        raise self._error(f"needs two inputs (x, shift) and two outputs, got {len(self.inputs)} and "
                          f"{len(self.outputs)}")
    x_t, s_t = self.inputs
    x = x_t.betensor
    axes = _axes(self, x.dim())
    try:
        broadcast_shape([x.shape, s_t.betensor.shape])
    except ValueError:
        raise self._error(f"shift of shape {list(s_t.betensor.shape)} does not broadcast to the input "
                          f"{list(x.shape)}") from None
    out0, out1 = self.outputs
    if not self.quantized:
        m = x.to(torch.float32) - s_t.betensor.to(torch.float32)
        out0.betensor = torch.sum(m, axes, keepdim=True)
        out1.betensor = torch.sum(m * m, axes, keepdim=True)
        return
    mo0, mo1, mi0, mi1 = (int(v) for v in self.get_param("scale_value"))
    no0, no1, ni0, ni1 = (int(v) for v in self.get_param("shift_value"))
    xa = _requant(x.to(torch.int64) + tensor_zp(self, x_t), mi0, ni0)
    sa = _requant(s_t.betensor.to(torch.int64) + tensor_zp(self, s_t), mi1, ni1)
    m = xa - sa
    total = torch.clamp(m.sum(axes, keepdim=True), *_I32)
    lo0, hi0 = out_range(self, out0)
    prod = total * mo0
    trunc = torch.sign(prod) * torch.div(prod.abs(), 1 << no0, rounding_mode="floor") if no0 >= 0 else prod << -no0
    out0.betensor = torch.clamp(trunc - tensor_zp(self, out0), lo0, hi0)
    v = torch.clamp(m * m, 0, _U32_MAX)
    high = v >> 16
    high_sum = torch.clamp(high.sum(axes, keepdim=True), 0, _U32_MAX)
    low_sum = torch.clamp((v - (high << 16)).sum(axes, keepdim=True), 0, _U32_MAX)
    acc = (high_sum << 16) * mo1 + low_sum * mo1
    lo1, hi1 = out_range(self, out1)
    out1.betensor = torch.clamp((acc >> no1 if no1 >= 0 else acc << -no1) - tensor_zp(self, out1), lo1, hi1)


def _requant(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """clamp(round_half_even(x · m / 2^n), int32): the alignment of an input to the common scale."""
    return torch.clamp(round_shift(x * m, n), *_I32)


@SUFFICIENT_STATISTICS.quantize
def sufficient_statistics_quantize(self: PyNode) -> None:
    """Outputs: integer inputs give 32-bit integer outputs (scale 1); otherwise calibrated with the activation bits,
    output 0 signed, output 1 unsigned (signed with force_dtype_int). Then, as upstream, with b_i the signed bits of
    input i's integers plus zero point: r = max(2 (max(b_0, b_1) - 15), 1), L = min(max(0, 15 - b_0), max(0, 15 -
    b_1)), s = min(s_0, s_1) / r and the 16-bit multipliers of s / s_0 · 2^L, s / s_1 · 2^L, s_out0 / s / 2^L,
    s_out1 / s² / 2^2L."""
    x_t, s_t = self.inputs
    check_quantized_inputs(self, [x_t, s_t])
    for t in (x_t, s_t):
        _per_tensor(self, t)
    integer = (params(self, x_t).qinvariant, params(self, s_t).qinvariant)
    if integer[0] != integer[1]:
        OPT_WARN(f"layer '{self.name}' (SufficientStatistics): one input is an integer tensor and the other is not, "
                 "which may cost accuracy")
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    signs = (True, bool(s.force_dtype_int))
    for out, signed in zip(self.outputs, signs):
        if all(integer):
            set_qinvariant(self, out, 32, signed)
        else:
            quantize_activation(self, out, signed, bits)
    b0, b1 = (signed_bits(*(v + tensor_zp(self, t) for v in out_range(self, t))) for t in (x_t, s_t))
    reduce_multiplier = max(2 * (max(b0, b1) - SS_ALIGN_BITS), 1)
    left = min(max(0, SS_ALIGN_BITS - b0), max(0, SS_ALIGN_BITS - b1))
    s0, s1 = tensor_scale(self, x_t), tensor_scale(self, s_t)
    common = min(s0, s1) / reduce_multiplier
    ratios = [tensor_scale(self, self.outputs[0]) / common / 2 ** left,
              tensor_scale(self, self.outputs[1]) / (common * common) / 2 ** (2 * left),
              common / s0 * 2 ** left, common / s1 * 2 ** left]
    found = [requant_scale_shift(self, r, mult_bits=SS_MULTIPLIER_BITS) for r in ratios]
    self.params["shift_value"] = [int(f[1]) for f in found]
    self.params["shift_type"] = [f[3] for f in found]
    self.params["scale_value"] = [int(f[0]) for f in found]
    self.params["scale_type"] = [f[2] for f in found]


# ------------------------------------------------------------------------------------------------ NormalizedMoments
NM_PLACEHOLDER = "mean_square"
"""The layer's one placeholder `<layer>/mean_square`: (mean / counts)², whose calibrated range sets the table's
output scale (docs/semantics/moments.md)."""

NM_CLIP_MAX = 2 ** 15 - 1
"""Largest input-alignment multiplier (int16's maximum); halved when a zero point is not 0."""

NORMALIZED_MOMENTS = declare_op(
    "NormalizedMoments",
    params={"counts": Param(Float(), "the number of summed elements (truncated to an integer, as upstream)",
                            required=True),
            "mean_shift_value": quantized(Int(), "mean output shift N_mean"),
            "mean_shift_type": quantized(DtypeName(), "its dtype"),
            "mean_scale_value": quantized(Ints(lo=0), "[M_mean, M_in_mean, M_in_shift]"),
            "mean_scale_type": quantized(Value("list of dtypes"), "their dtypes"),
            "var_shift_value": quantized(Int(), "variance output shift N_var"),
            "var_shift_type": quantized(DtypeName(), "its dtype"),
            "var_scale_value": quantized(Ints(lo=0), "[M_var, M_in_var, M_in_square]"),
            "var_scale_type": quantized(Value("list of dtypes"), "their dtypes")},
    constants={"lut": "table of (mean / counts)² indexed by the mean input, unsigned, activation bits"},
    dtypes="float32 → output 0 (mean) signed when the mean and shift inputs are (or force_dtype_int), output 1 "
           "(variance) signed; activation bits",
    integer="aligned sums requantized with round half to even; the squared mean from a table (as upstream)",
    semantics=f"{SEMANTICS}#normalizedmoments",
    summary="Inputs: a sum, a sum of squares and a shift. Outputs: mean = sum / counts + shift and "
            "variance = squares / counts - (sum / counts)² (TensorFlow's normalize_moments).")


def _counts(node: PyNode) -> int:
    raw = float(node.get_param("counts"))
    counts = int(raw)
    if counts < 1:
        raise node._error(f"counts must be at least 1, got {raw:g}")
    return counts


def _nm_shapes(node: PyNode) -> None:
    if len(node.inputs) != 3 or len(node.outputs) != 2:
        raise node._error(f"needs three inputs (mean_ss, variance_ss, shift) and two outputs (mean, variance), got "
                          f"{len(node.inputs)} and {len(node.outputs)}")
    shapes = [tuple(t.betensor.shape) for t in node.inputs]
    try:
        broadcast_shape([shapes[0], shapes[2]])
        broadcast_shape([shapes[0], shapes[1]])
    except ValueError:
        raise node._error(f"input shapes {[list(s) for s in shapes]} do not broadcast (the shift and the variance "
                          "sum must broadcast with the mean sum)") from None


@NORMALIZED_MOMENTS.forward
def normalized_moments_forward(self: PyNode) -> None:
    _nm_shapes(self)
    counts = _counts(self)
    mean_t, var_t, shift_t = self.inputs
    out0, out1 = self.outputs
    if not self.quantized:
        mean = mean_t.betensor.to(torch.float32) / counts
        square = mean * mean
        out0.betensor = mean + shift_t.betensor.to(torch.float32)
        out1.betensor = var_t.betensor.to(torch.float32) / counts - square
        name = f"{self.name}/{NM_PLACEHOLDER}"
        if [t.name for t in self.placeholders] != [name]:
            self.placeholders = [PyTensor(name, square.detach())]
        else:
            self.placeholders[0].betensor = square.detach()
        return
    m_mean, m_in0, m_in1 = _three(self, "mean_scale_value")
    m_var, v_in0, v_in1 = _three(self, "var_scale_value")
    n_mean, n_var = int(self.get_param("mean_shift_value")), int(self.get_param("var_shift_value"))
    if "lut" not in self.constants:
        raise self._error("quantized layer lacks its 'lut' constant")
    table = self.constants["lut"].betensor.to(torch.int64).flatten()
    bits = int(params(self, mean_t).qbits)
    lo_m, _ = out_range(self, mean_t)
    emax = max(abs(v + tensor_zp(self, t)) for t in self.inputs for v in out_range(self, t))
    tmax = int(table.abs().max()) if table.numel() else 0
    bound = max(emax * (m_in0 + m_in1) * max(m_mean, 1), (emax * v_in0 + tmax * v_in1) * max(m_var, 1))
    if bound >= INT64_BOUND:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the aligned sums may reach 2^62; use fewer "
                               "input bits")
    mean_q = mean_t.betensor.to(torch.int64)
    acc0 = (mean_q + tensor_zp(self, mean_t)) * m_in0 + \
        (shift_t.betensor.to(torch.int64) + tensor_zp(self, shift_t)) * m_in1
    out0.betensor = requantize_int(acc0, m_mean, n_mean, tensor_zp(self, out0), *out_range(self, out0))
    try:
        square = lookup_lut(mean_q, table, integer_range(bits, lo_m < 0)[0], bits,
                            int(self.constants["lut"].dtype.bits), False)
    except ValueError as e:
        raise self._error(f"lut: {e}") from None
    acc1 = (var_t.betensor.to(torch.int64) + tensor_zp(self, var_t)) * v_in0 - square * v_in1
    out1.betensor = requantize_int(acc1, m_var, n_var, tensor_zp(self, out1), *out_range(self, out1))


def _three(node: PyNode, key: str) -> List[int]:
    value = node.get_param(key)
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise node._error(f"quantized layer needs '{key}' as a list of 3 integers, got {value!r}")
    return [int(v) for v in value]


def add_like_multipliers(s0: torch.Tensor, s1: torch.Tensor, s_out: torch.Tensor, clip_max: int,
                         mult_bits: int) -> Tuple[int, int, int, int, Dtype]:
    """(M_in0, M_in1, M_out, N_out, shift dtype) aligning two inputs of scales s0, s1 by cross-multiplication with
    15-bit approximations of each other's scale, multipliers capped at `clip_max` (docs/semantics/moments.md; float32
    arithmetic, as upstream)."""
    m0, n0, _, _ = scale_shift(s0, 16)
    m1, n1, _, _ = scale_shift(s1, 16)
    common = max(n0, n1)
    f32 = torch.float32
    mul0 = torch.tensor(float(m1 * 2 ** max(common - n1, 0)), dtype=f32)
    mul1 = torch.tensor(float(m0 * 2 ** max(common - n0, 0)), dtype=f32)
    rscale = s_out / (s1 * s0) / (2.0 ** common)
    shrink = torch.maximum(mul0, mul1) / float(clip_max)
    if float(shrink) > 1.0:
        mul0, mul1, rscale = mul0 / shrink, mul1 / shrink, rscale * shrink
    mul0 = int(torch.clamp(torch.round(mul0), 0, clip_max))
    mul1 = int(torch.clamp(torch.round(mul1), 0, clip_max))
    m, n, _, _ = scale_shift(rscale, mult_bits)
    if n < 0:
        m, n = max(1, min(clip_max, m * 2 ** (-n))), 0
    return mul0, mul1, int(m), int(n), range_dtype(-1, n)


@NORMALIZED_MOMENTS.quantize
def normalized_moments_quantize(self: PyNode) -> None:
    """Outputs from their calibrated ranges (activation bits; output 0 signed when the mean and shift inputs are,
    output 1 signed), the placeholder unsigned and symmetric; the table of (dequantized mean / counts)² on the
    placeholder's scale; the two add-like multiplier sets (docs/semantics/moments.md)."""
    _nm_shapes(self)
    counts = _counts(self)
    mean_t, var_t, shift_t = self.inputs
    check_quantized_inputs(self, [mean_t, var_t, shift_t])
    for t in self.inputs:
        _per_tensor(self, t)
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    name = f"{self.name}/{NM_PLACEHOLDER}"
    if len(self.placeholders) != 1 or self.placeholders[0].name != name:
        raise self._error(f"placeholder '{name}' is missing: the layer's float forward must run before quantization "
                          "(statistic files written before quantopt collected placeholders lack it: collect again)")
    plh = self.placeholders[0]
    r = ranges_of(self).get(plh)
    if r.min is None or r.max is None:
        raise self._error(f"placeholder '{name}' has no calibrated range (statistic files written before quantopt "
                          "collected placeholders lack it: collect the statistics again)")
    out0, out1 = self.outputs
    quantize_activation(self, out0, is_signed(self, mean_t) and is_signed(self, shift_t), bits)
    quantize_activation(self, out1, True, bits)
    mode = activation_mode(self, bits).to_symmetric()
    set_params(self, plh, linear_quant_params(r.min, r.max, bits, mode, False), bits)
    f32 = torch.float32

    def sc(t: PyTensor) -> torch.Tensor:
        return torch.tensor(tensor_scale(self, t), dtype=f32)

    clip0 = NM_CLIP_MAX // 2 if tensor_zp(self, mean_t) != 0 or tensor_zp(self, shift_t) != 0 else NM_CLIP_MAX
    mean0, mean1, m_mean, n_mean, mean_shift_type = add_like_multipliers(sc(mean_t) * counts, sc(shift_t), sc(out0),
                                                                         clip0, s.mult_bits)
    lo, hi = out_range(self, mean_t)
    steps = lut_size(int(params(self, mean_t).qbits), int(s.lut_items_in_bits))
    x = dequantize(torch.linspace(float(lo), float(hi), steps=steps), sc(mean_t), tensor_zp(self, mean_t))
    lut = quantize(torch.square(x / counts), sc(plh), tensor_zp(self, plh), *out_range(self, plh))
    set_constant(self, "lut", lut, int_dtype_for_bits(bits, False))
    clip1 = NM_CLIP_MAX // 2 if tensor_zp(self, var_t) != 0 else NM_CLIP_MAX
    var0, var1, m_var, n_var, var_shift_type = add_like_multipliers(sc(var_t) * counts, sc(plh), sc(out1), clip1,
                                                                    s.mult_bits)
    self.params["mean_shift_value"] = n_mean
    self.params["mean_shift_type"] = mean_shift_type
    self.params["mean_scale_value"] = [m_mean, mean0, mean1]
    self.params["mean_scale_type"] = [Dtype.UINT16] * 3
    self.params["var_shift_value"] = n_var
    self.params["var_shift_type"] = var_shift_type
    self.params["var_scale_value"] = [m_var, var0, var1]
    self.params["var_scale_type"] = [Dtype.UINT16] * 3
