"""Reductions over axes (`Reduce`: SUM, MEAN, MAX, MIN, PROD, L1, L2, VARIANCE, UNBIASED_VARIANCE, ANY, ALL) and
running reductions along one axis (`Cumulate`: SUM, PROD with exclusive/reverse).

Quantized (docs/semantics/reduce.md): sums are exact int64 sums of q + zp followed by one multiplier/shift (MEAN
folds 1/N into the ratio); MAX/MIN keep the input's params; products keep a normalized 31-bit running product
and count the bits dropped; L2 takes an exact integer square root; VARIANCE sums squared deviations from the
rounded integer mean; ANY/ALL give 0/1 integers.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS, WIDE_SHIFT_MAX
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import linear_quant_params
from ..quant.requant import range_dtype, requantize_int, scale_shift
from ..quant.rounding import FLOAT64_EXACT, bit_length, div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Int, Ints, Param, Text, quantized
from ..threads import one_thread
from ._eltwise_int import check_int64_bound, offset_absmax, set_integer_output
from ._lut_int import range_bits
from ._quant import (
    activation_mode,
    copy_params,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_params,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param, keeps_float64, upstream_layout
from .onnx_build import exact as onnx_exact
from .onnx_build.exact import DOUBLE, INT64, bit_length_int64, emit_integers, round_div_int64
from .onnx_build.perms import channels_first, reduced_perm
from .onnx_build.qdq_graph import QDQGraph, node_error, requant_ratio, same_qparams

REDUCE_METHODS = ("SUM", "MEAN", "MAX", "MIN", "PROD", "L1", "L2", "VARIANCE", "UNBIASED_VARIANCE", "ANY", "ALL")
CUMULATE_METHODS = ("SUM", "PROD")
_REDUCE = "docs/semantics/reduce.md"

PROD_ACC_BITS = 31
"""Products keep their running value within 31 magnitude bits (|acc| <= 2^31): after each factor the value is
shifted right (floor) by the bits it exceeds, and the dropped bits are counted and subtracted from the shift."""

L2_MAX_FRACTION_BITS = 15
"""L2: at most 15 fraction bits are kept by the integer square root of the sum of squares."""

SQRT_INPUT_BITS = 61
"""L2: the square-root operand S·4^f stays below 2^61 (int64 with headroom for the correction steps)."""


# ------------------------------------------------------------------------------------------------ helpers
def _axes(node: PyNode, rank: int) -> List[int]:
    raw = node.get_param("axis")
    values = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if not values:
        raise node._error("axis must list at least one dimension")
    return sorted({axis_param(node, a, rank) for a in values})


def _rows(x: torch.Tensor, axes: Sequence[int]) -> Tuple[torch.Tensor, List[int]]:
    """(x as [outer, n] with the reduced axes flattened last in row-major order, the keepdims output shape)."""
    keep = [d for d in range(x.dim()) if d not in axes]
    n = 1
    for a in axes:
        n *= int(x.shape[a])
    rows = x.permute(*keep, *axes).reshape(-1, n)
    return rows, [1 if d in axes else int(x.shape[d]) for d in range(x.dim())]


def _shape_out(node: PyNode, kept: List[int], axes: Sequence[int]) -> List[int]:
    if bool_param(node, "keepdims", True):
        return kept
    return [s for d, s in enumerate(kept) if d not in axes]


def _ir_count(node: PyNode, axes: Sequence[int]) -> int:
    shape = node.inputs[0].ir_shape
    n = 1
    for a in axes:
        n *= int(shape[a])
    return n


def _check_count(node: PyNode, n: int, n_ir: int) -> None:
    if n != n_ir:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the quantized ratio was built for {n_ir} "
                               f"reduced elements but the data has {n} (a reduced axis changed size, e.g. the batch)")


def _normalize_product(acc: torch.Tensor, dropped: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shift the running product right (floor) by the bits above PROD_ACC_BITS and count them."""
    k = torch.clamp(bit_length(acc.abs()) - PROD_ACC_BITS, min=0)
    return acc >> k, dropped + k


def power_ratio(s_out: float, s_in: float, count: int, mult_bits: int = AIFF_MULTIPLIER_BITS) -> Tuple[int, int]:
    """(M, N) with M / 2^N ~ s_out / s_in^count, M in [2^(mb-1), 2^mb - 1]: L = log2(s_out) - count * log2(s_in)
    in float64, N = floor(log2(2^mb - 1) - L), M = floor(2^(L + N) + 0.5) (N is not capped: it may be large)."""
    lg = math.log2(float(s_out)) - int(count) * math.log2(float(s_in))
    top = 2 ** int(mult_bits) - 1
    n = math.floor(math.log2(top) - lg)
    m = min(math.floor(2.0 ** (lg + n) + 0.5), top)
    return int(m), int(n)


def isqrt(v: torch.Tensor) -> torch.Tensor:
    """floor(sqrt(v)) of non-negative int64 values below 2^62, exact (float64 estimate, then integer correction)."""
    r = torch.floor(torch.sqrt(v.to(torch.float64))).to(torch.int64)
    for _ in range(4):
        r = torch.where(r * r > v, r - 1, r)
        r = torch.where((r + 1) * (r + 1) <= v, r + 1, r)
    return r


def _wide_requant(node: PyNode, ratio: float) -> Tuple[int, int]:
    """15-bit multiplier and a shift up to WIDE_SHIFT_MAX for a ratio carrying s_in^-2 (L2 uses it for s_in^-1)."""
    s = layer_settings(node)
    m, n, mt, nt = scale_shift(ratio, AIFF_MULTIPLIER_BITS, force_shift_positive=s.force_shift_positive,
                               shift_limit=WIDE_SHIFT_MAX)
    store_requant(node, int(m), int(n), mt, range_dtype(min(int(n), 0), max(int(n), 0), force_signed=True))
    return int(m), int(n)


def _per_tensor_requant(node: PyNode) -> Tuple[int, int]:
    m, n = requant_of(node)
    if not isinstance(m, int) or not isinstance(n, int):
        raise node._error("quantized layer needs a per-tensor scale_value/shift_value")
    return m, n


# ------------------------------------------------------------------------------------------------ Reduce
REDUCE = declare_op(
    "Reduce",
    params={"method": Param(Text(choices=REDUCE_METHODS), "the reduction", required=True),
            "axis": Param(Ints(), "the reduced axes (negative: from the end)", required=True),
            "keepdims": Param(Bool(), "keep the reduced axes with size 1", default=True),
            "sqrt_fraction_bits": quantized(Int(lo=0), "L2, exact form: fraction bits kept by the integer square "
                                                       "root")},
    constants={"scale": "per-channel multipliers; refused (the integer forward needs scale_value)",
               "shift": "per-channel shifts; refused (the integer forward needs shift_value)",
               "sqrt_lut": "L2, upstream form: the square-root table over the 16-bit sum-of-squares placeholder"},
    integer="exact int64 reduction of q + zp, one multiplier/shift (MAX/MIN passthrough; L2: upstream's 16-bit "
            "placeholder and square-root table, or an exact integer square root)",
    semantics=f"{_REDUCE}#reduce",
    summary="Quantized: scale_value/shift_value (all but MAX, MIN, ANY, ALL).")


def _reduce_method(node: PyNode) -> str:
    method = str(node.get_param("method")).upper()
    if method not in REDUCE_METHODS:
        raise node._error(f"unsupported Reduce method '{method}' (supported: {', '.join(REDUCE_METHODS)})")
    return method


def _float_reduce(node: PyNode, method: str, rows: torch.Tensor) -> torch.Tensor:
    if method in ("ANY", "ALL"):
        nz = rows != 0
        return (nz.any(dim=1) if method == "ANY" else nz.all(dim=1)).to(torch.int64)
    r = rows if rows.is_floating_point() else rows.to(torch.float32)
    if method == "SUM":
        return r.sum(dim=1)
    if method == "MEAN":
        return r.mean(dim=1)
    if method == "MAX":
        return rows.amax(dim=1)
    if method == "MIN":
        return rows.amin(dim=1)
    if method == "PROD":
        return r.prod(dim=1)
    if method == "L1":
        return r.abs().sum(dim=1)
    if method == "L2":
        return torch.sqrt((r * r).sum(dim=1))
    d = r.shape[1] - (1 if method == "UNBIASED_VARIANCE" else 0)
    dev = r - r.mean(dim=1, keepdim=True)
    return (dev * dev).sum(dim=1) / d if d > 0 else torch.full(r.shape[:1], float("nan"), device=r.device)


@REDUCE.forward
@keeps_float64(when=lambda node: _reduce_method(node) in ("MIN", "MAX"))
def reduce_forward(self: PyNode) -> None:
    method = _reduce_method(self)
    x = self.inputs[0].betensor
    axes = _axes(self, x.dim())
    rows, kept = _rows(x, axes)
    if self.quantized:
        y = _reduce_int(self, method, axes, rows)
    elif method in ("SUM", "MEAN") and x.is_floating_point():
        y = _float_sum_in_place(upstream_layout(self, x), axes, method)
    elif method == "L2":
        y = _float_l2(self, x, axes)
    else:
        with one_thread(int(rows.shape[0]) == 1):  # a float sum to one value: the same at any thread count
            y = _float_reduce(self, method, rows)
    self.outputs[0].betensor = y.reshape(_shape_out(self, kept, axes))


L2_PLACEHOLDER = "power2_sum"
"""Name suffix of an L2 layer's placeholder: the float sum of squares, calibrated for the upstream integer form."""


def _float_l2(node: PyNode, x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """sqrt of the float32 sum of squares over `axes` in the tensor's own layout, as upstream's float forward sums
    it (one thread: the same at any thread count); the sum is kept as the layer's placeholder."""
    xf = upstream_layout(node, x.to(torch.float32))  # upstream squares float32 values, a float64 input included
    with one_thread(True):
        total = torch.sum(xf * xf, dim=list(axes), keepdim=True)
    name = f"{node.name}/{L2_PLACEHOLDER}"
    if [t.name for t in node.placeholders] != [name]:
        node.placeholders = [PyTensor(name, total.detach().to(torch.float32))]
    else:
        node.placeholders[0].betensor = total.detach().to(torch.float32)
    return torch.sqrt(total)


def _float_sum_in_place(x: torch.Tensor, axes: Sequence[int], method: str) -> torch.Tensor:
    """Float SUM/MEAN as upstream's float forward computes them: torch's float32 sum over `axes` of the tensor in
    its own layout (a sum over a non-last axis adds whole rows in order, which rounds differently from a sum of
    the same values made contiguous), MEAN dividing that by the count; on one thread, so the result is the same at
    any thread count."""
    with one_thread(True):
        total = torch.sum(x.to(torch.float32), dim=list(axes), keepdim=True)
    if method == "SUM":
        return total
    return total / (x.numel() // max(1, total.numel()))


@REDUCE.quantize
def reduce_quantize(self: PyNode) -> None:
    """MAX/MIN copy the input's params, ANY/ALL give a 0/1 uint8 integer output; the others get output params from
    calibration (SUM/MEAN/PROD signed like the input, L1/L2/VARIANCE unsigned; SUM/PROD/L1 of an integer input
    give an integer output) and the multiplier/shift of their section in docs/semantics/reduce.md."""
    method = _reduce_method(self)
    bool_param(self, "keepdims", True)
    if len(self.inputs) != 1:
        raise self._error(f"expects 1 input, got {len(self.inputs)}")
    inp, out = self.inputs[0], self.outputs[0]
    q_in = params(self, inp)
    if q_in.qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    axes = _axes(self, len(inp.ir_shape))
    for key in ("scale_value", "shift_value", "scale_type", "shift_type", "sqrt_fraction_bits"):
        self.params.pop(key, None)
    self.constants.pop("sqrt_lut", None)
    if method in ("MAX", "MIN"):
        copy_params(self, out, inp)
        return
    if method in ("ANY", "ALL"):
        set_qinvariant(self, out, 8, layer_settings(self).force_dtype_int)
        return
    n = _ir_count(self, axes)
    signed = is_signed(self, inp) if method in ("SUM", "MEAN", "PROD") else False
    if q_in.qinvariant and method in ("SUM", "PROD", "L1"):
        set_integer_output(self, out, signed, [q_in.qbits or 8])
    else:
        quantize_activation(self, out, signed)
    s_in, s_out = tensor_scale(self, inp), tensor_scale(self, out)
    emax = offset_absmax(self, inp)
    if method in ("SUM", "L1", "MEAN"):
        ratio = s_out / s_in / (n if method == "MEAN" else 1)
        store_requant(self, *requant_scale_shift(self, torch.tensor(ratio, dtype=torch.float32)))
        m, _ = _per_tensor_requant(self)
        check_int64_bound(self, n * emax * m, "sum times M")
    elif method == "PROD":
        m, sh = power_ratio(s_out, s_in, n)
        store_requant(self, m, sh, Dtype.UINT16, range_dtype(min(sh, 0), max(sh, 0), force_signed=True))
    elif method == "L2" and layer_settings(self).reduce_l2_integer_form == "upstream":
        _l2_upstream_quantize(self, inp, out)
    elif method == "L2":
        m, _ = _wide_requant(self, s_out / s_in)
        bits = (n * emax * emax).bit_length()
        if bits > SQRT_INPUT_BITS:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): the sum of squares of {n} elements "
                                   f"(up to 2^{bits}) does not fit the exact int64 L2")
        self.params["sqrt_fraction_bits"] = min(L2_MAX_FRACTION_BITS, (SQRT_INPUT_BITS - bits) // 2)
    else:
        d = n - 1 if method == "UNBIASED_VARIANCE" else n
        if d <= 0:
            raise self._error(f"{method} over {n} element(s) is undefined")
        m, _ = _wide_requant(self, s_out / (s_in * s_in) / d)
        check_int64_bound(self, n * (2 * emax) ** 2 * m, "sum of squared deviations times M")


L2_PLACEHOLDER_BITS = 16
"""Upstream L2 form: the sum of squares is cut to its 16 high bits and requantized to a uint16 placeholder."""


def _l2_upstream_quantize(node: PyNode, inp: PyTensor, out: PyTensor) -> None:
    """Upstream's L2 form (docs/semantics/reduce.md): the sum-of-squares placeholder quantized symmetric unsigned
    16-bit from its calibrated range, `(M, N) = scale_shift(s_ph / s_in², 16)` with shifts up to 63, and the
    square-root table `sqrt_lut` from the placeholder's codes to the output's (2^min(input bits,
    lut_items_in_bits) entries, the output's dtype)."""
    name = f"{node.name}/{L2_PLACEHOLDER}"
    if [t.name for t in node.placeholders] != [name]:
        raise node._error(f"placeholder '{name}' is missing: the layer's float forward must run before quantization "
                          "(statistic files written before quantopt collected it lack it: collect again)")
    ph = node.placeholders[0]
    r = ranges_of(node).get(ph)
    if r.min is None or r.max is None:
        raise node._error(f"placeholder '{ph.name}' has no calibrated range (collect the statistics again)")
    mode = activation_mode(node, L2_PLACEHOLDER_BITS).to_symmetric()
    set_params(node, ph, linear_quant_params(r.min, r.max, L2_PLACEHOLDER_BITS, mode, False), L2_PLACEHOLDER_BITS)
    f32 = torch.float32
    s_in = torch.tensor(tensor_scale(node, inp), dtype=f32)
    ratio = torch.tensor(tensor_scale(node, ph), dtype=f32) / (s_in * s_in)
    s = layer_settings(node)
    m, n, mt, nt = scale_shift(ratio, L2_PLACEHOLDER_BITS, force_shift_positive=s.force_shift_positive,
                               shift_limit=WIDE_SHIFT_MAX)
    store_requant(node, int(m), int(n), mt, nt)
    qmin, qmax = out_range(node, out)
    q_in = params(node, inp)
    table = build_lut(torch.sqrt, tensor_scale(node, ph), 0, 0, (1 << L2_PLACEHOLDER_BITS) - 1,
                      int(q_in.qbits or range_bits(node, inp)), tensor_scale(node, out), tensor_zp(node, out), qmin,
                      qmax, int(s.lut_items_in_bits))
    set_constant(node, "sqrt_lut", table, out.dtype)


def _l2_upstream_int(node: PyNode, x: torch.Tensor, batch: int) -> torch.Tensor:
    """Upstream's L2 integer forward on rows of X = q + zp: S = ΣX² clamped to [0, 2^32 - 1]; per sample, with
    d = max(0, ceil(log2(max S)) - 16), S >> d clamped to uint16 and requantized by M · 2^-(N - d) into the uint16
    placeholder; the output is `sqrt_lut` looked up (interpolated) at it. Upstream takes d over the whole batch; per
    sample the result does not depend on what else is in the batch, and at batch 1 it is upstream's."""
    m, n = _per_tensor_requant(node)
    top = (1 << L2_PLACEHOLDER_BITS) - 1
    total = torch.clamp((x * x).sum(dim=1), 0, 2 ** 32 - 1)
    per_sample = total.reshape(batch, -1) if batch > 0 and total.numel() % batch == 0 else total.reshape(1, -1)
    peak = per_sample.amax(dim=1, keepdim=True)
    drop = torch.clamp(bit_length(torch.clamp(peak - 1, min=0)) - L2_PLACEHOLDER_BITS, min=0)  # ceil(log2 peak)
    squeezed = torch.clamp(per_sample >> drop, 0, top)
    placeholder = requantize_int(squeezed, m, n - drop, 0, 0, top)
    lut = node.get_constant("sqrt_lut")
    ldt = lut.dtype
    y = lookup_lut(placeholder, lut.betensor, 0, L2_PLACEHOLDER_BITS, ldt.bits, ldt.is_signed)
    return y.reshape(total.shape)


def _reduce_int(node: PyNode, method: str, axes: Sequence[int], rows_q: torch.Tensor) -> torch.Tensor:
    inp, out = node.inputs[0], node.outputs[0]
    rows_q = rows_q.to(torch.int64)
    if method in ("MAX", "MIN"):
        return rows_q.amax(dim=1) if method == "MAX" else rows_q.amin(dim=1)
    x = rows_q + tensor_zp(node, inp)
    if method in ("ANY", "ALL"):
        nz = x != 0
        return (nz.any(dim=1) if method == "ANY" else nz.all(dim=1)).to(torch.int64)
    n = int(x.shape[1])
    qmin, qmax = out_range(node, out)
    zp_out = tensor_zp(node, out)
    m, sh = _per_tensor_requant(node)
    emax = offset_absmax(node, inp)
    if method in ("MEAN", "PROD", "VARIANCE", "UNBIASED_VARIANCE"):
        _check_count(node, n, _ir_count(node, axes))
    if method in ("SUM", "MEAN", "L1"):
        check_int64_bound(node, n * emax * abs(m), "sum times M")
        acc = (x.abs() if method == "L1" else x).sum(dim=1)
        return torch.clamp(round_shift(acc * m, sh) - zp_out, qmin, qmax)
    if method == "PROD":
        acc = torch.ones(x.shape[0], dtype=torch.int64, device=x.device)
        dropped = torch.zeros_like(acc)
        for j in range(n):
            acc, dropped = _normalize_product(acc * x[:, j], dropped)
        return torch.clamp(round_shift(acc * m, sh - dropped) - zp_out, qmin, qmax)
    if method == "L2" and "sqrt_lut" in node.constants:
        batch = int(inp.betensor.shape[0]) if 0 not in axes and inp.betensor.dim() else 1
        return _l2_upstream_int(node, x, batch)
    if method == "L2":
        f = int(node.get_param("sqrt_fraction_bits"))
        if (n * emax * emax).bit_length() + 2 * f > SQRT_INPUT_BITS:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): the sum of squares of {n} elements does "
                                   "not fit the exact int64 L2")
        r = isqrt((x * x).sum(dim=1) << (2 * f))
        return torch.clamp(round_shift(r * m, sh + f) - zp_out, qmin, qmax)
    check_int64_bound(node, n * (2 * emax) ** 2 * abs(m), "sum of squared deviations times M")
    mean = div_round_half_even(x.sum(dim=1), n)
    dev = x - mean.unsqueeze(1)
    acc = (dev * dev).sum(dim=1)
    return torch.clamp(round_shift(acc * m, sh) - zp_out, qmin, qmax)


# ------------------------------------------------------------------------------------------------ Cumulate
CUMULATE = declare_op(
    "Cumulate",
    params={"method": Param(Text(choices=CUMULATE_METHODS), "running sum or product", required=True),
            "axis": Param(Int(), "the cumulated axis (negative: from the end)", required=True),
            "exclusive": Param(Bool(), "position i excludes element i", default=False),
            "reverse": Param(Bool(), "run from the last element to the first", default=False)},
    constants={"scale": "PROD quantized: per-position multipliers, uint16",
               "shift": "PROD quantized: per-position shifts, int32"},
    integer="exact running sum (or normalized running product), requantized per position",
    semantics=f"{_REDUCE}#cumulate",
    summary="Quantized SUM: scale_value/shift_value.")


def _cumulate_params(node: PyNode, rank: int) -> Tuple[str, int, bool, bool]:
    method = str(node.get_param("method")).upper()
    if method not in CUMULATE_METHODS:
        raise node._error(f"unsupported Cumulate method '{method}' (supported: {', '.join(CUMULATE_METHODS)})")
    axis = axis_param(node, node.get_param("axis"), rank)
    return method, axis, bool_param(node, "exclusive", False), bool_param(node, "reverse", False)


@CUMULATE.forward
def cumulate_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    method, axis, exclusive, reverse = _cumulate_params(self, x.dim())
    v = x.movedim(axis, -1)
    if reverse:
        v = v.flip(-1)
    if self.quantized:
        y = _cumulate_int(self, method, axis, exclusive, v.to(torch.int64))
    else:
        v = v if v.is_floating_point() else v.to(torch.float32)
        y = v.cumsum(-1) if method == "SUM" else v.cumprod(-1)
        if exclusive:
            first = torch.zeros_like(y[..., :1]) if method == "SUM" else torch.ones_like(y[..., :1])
            y = torch.cat([first, y[..., :-1]], dim=-1)
    if reverse:
        y = y.flip(-1)
    self.outputs[0].betensor = y.movedim(-1, axis).contiguous()


def _factor_counts(length: int, exclusive: bool) -> List[int]:
    return [j if exclusive else j + 1 for j in range(length)]


@CUMULATE.quantize
def cumulate_quantize(self: PyNode) -> None:
    """Output params from calibration (signed like the input; an integer input gives an integer output of the
    narrowest type holding its calibrated extrema, however wide the input, as upstream). SUM:
    one 15-bit multiplier/shift for s_out / s_in. PROD: per-position constants `scale` (uint16) / `shift` (int32)
    for s_out / s_in^k, k the number of factors at that position."""
    inp, out = self.inputs[0], self.outputs[0]
    if len(self.inputs) != 1:
        raise self._error(f"expects 1 input, got {len(self.inputs)}")
    q_in = params(self, inp)
    if q_in.qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    method, axis, exclusive, _ = _cumulate_params(self, len(inp.ir_shape))
    for key in ("scale_value", "shift_value", "scale_type", "shift_type"):
        self.params.pop(key, None)
    self.constants.pop("scale", None)
    self.constants.pop("shift", None)
    signed = is_signed(self, inp)
    if q_in.qinvariant:
        set_integer_output(self, out, signed, [8])
    else:
        quantize_activation(self, out, signed)
    s_in, s_out = tensor_scale(self, inp), tensor_scale(self, out)
    length = int(inp.ir_shape[axis])
    s = layer_settings(self)
    if method == "SUM":
        m, n, mt, nt = scale_shift(torch.tensor(s_out / s_in, dtype=torch.float32), AIFF_MULTIPLIER_BITS,
                                   force_shift_positive=s.force_shift_positive)
        store_requant(self, int(m), int(n), mt, nt)
        check_int64_bound(self, length * offset_absmax(self, inp) * int(m), "running sum times M")
        return
    pairs = [power_ratio(s_out, s_in, k) for k in _factor_counts(length, exclusive)]
    set_constant(self, "scale", torch.tensor([p[0] for p in pairs], dtype=torch.int64), Dtype.UINT16)
    set_constant(self, "shift", torch.tensor([p[1] for p in pairs], dtype=torch.int64), Dtype.INT32)


def _cumulate_int(node: PyNode, method: str, axis: int, exclusive: bool, v: torch.Tensor) -> torch.Tensor:
    """v: input integers with the cumulated axis last (already flipped for reverse)."""
    inp, out = node.inputs[0], node.outputs[0]
    x = v + tensor_zp(node, inp)
    length = int(x.shape[-1])
    qmin, qmax = out_range(node, out)
    zp_out = tensor_zp(node, out)
    if method == "SUM":
        m, sh = _per_tensor_requant(node)
        check_int64_bound(node, length * offset_absmax(node, inp) * abs(m), "running sum times M")
        acc = x.cumsum(-1)
        if exclusive:
            acc = acc - x
        return torch.clamp(round_shift(acc * m, sh) - zp_out, qmin, qmax)
    mult = node.get_constant("scale").betensor.to(torch.int64).flatten()
    shift = node.get_constant("shift").betensor.to(torch.int64).flatten()
    if mult.numel() != length or shift.numel() != length:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the quantized constants cover {mult.numel()} "
                               f"positions but the cumulated axis has {length}")
    acc = torch.ones(x.shape[:-1], dtype=torch.int64, device=x.device)
    dropped = torch.zeros_like(acc)
    ys = []
    for j in range(length):
        if not exclusive:
            acc, dropped = _normalize_product(acc * x[..., j], dropped)
        ys.append(torch.clamp(round_shift(acc * mult[j], shift[j] - dropped) - zp_out, qmin, qmax))
        if exclusive:
            acc, dropped = _normalize_product(acc * x[..., j], dropped)
    return torch.stack(ys, dim=-1)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
REDUCE_OPS = {"MEAN": "ReduceMean", "SUM": "ReduceSum", "MAX": "ReduceMax", "MIN": "ReduceMin", "PROD": "ReduceProd",
              "L1": "ReduceL1", "L2": "ReduceL2"}


@REDUCE.export
def convert_reduce(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    if method not in REDUCE_OPS:
        raise node_error(node, f"reduce method {method} has no QDQ mapping ({', '.join(REDUCE_OPS)} do)")
    rank = g.rank(x)
    raw = node.get_param("axis")
    axes = sorted({axis_param(node, a, rank) for a in (raw if isinstance(raw, (list, tuple)) else [raw])})
    keepdims = bool_param(node, "keepdims", True)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    onnx_axes = sorted(perm.index(a) for a in axes)
    out_perm = perm if keepdims else reduced_perm(perm, axes)
    count = int(np.prod([int(x.ir_shape[a]) for a in axes]))
    if method == "L2" and "sqrt_lut" in node.constants:
        _export_l2_upstream(g, node, perm, onnx_axes, keepdims, out_perm, batch_reduced=0 in axes)
        return
    if onnx_exact.reduce_sum(g, node, method, perm, onnx_axes, keepdims, out_perm, count):
        return
    out = g.add(REDUCE_OPS[method], [g.float_value(x, perm), g.ints(f"{node.name}/axes", onnx_axes)],
                keepdims=int(keepdims))
    if method in ("SUM", "MEAN"):  # one multiplier for s_out / s_in (/ count)
        ratio = float(requant_ratio(node)[0])
        out = g.rescale(out, ratio * tensor_scale(node, x) * (count if method == "MEAN" else 1) / tensor_scale(node, y))
    g.quantize(y, out, out_perm, lossless=method in ("MAX", "MIN") and same_qparams(node, x, y))


def _export_l2_upstream(g: QDQGraph, node: PyNode, perm: Sequence[int], axes: Sequence[int], keepdims: bool,
                        out_perm: Sequence[int], batch_reduced: bool) -> None:
    """Upstream's L2 form in int64, in every scale mode (its output codes come from the table, no float form
    follows them): S = ΣX² clipped to 2^32 - 1, d per sample from the bit length of max S - 1, S >> d clipped to
    uint16, round_half_even(S · M / 2^(N - d)), then the interpolated table lookup (`_l2_upstream_int`)."""
    m, n = _per_tensor_requant(node)
    if not batch_reduced and int(perm[0]) != 0:
        raise node_error(node, "the per-sample L2 needs the batch axis first in the exported layout")
    table = node.get_constant("sqrt_lut").betensor.to(torch.int64).reshape(-1).cpu().numpy()
    size_bits = int(round(math.log2(table.size))) if table.size else -1
    if table.size == 0 or 1 << size_bits != table.size or size_bits > L2_PLACEHOLDER_BITS:
        raise node_error(node, f"sqrt_lut holds {table.size} entries; 2^N up to 2^16 are exported")
    if bool((np.diff(table) < 0).any()):
        raise node_error(node, "sqrt_lut decreases somewhere: its interpolation has no exact ONNX form")

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    pow2 = int64("pow2", [1 << k for k in range(63)])
    x = g.add("Cast", [onnx_exact.codes(g, node.inputs[0], list(perm))], to=INT64)
    total = g.add("ReduceSum", [g.add("Mul", [x, x]), g.ints(f"{node.name}/axes", list(axes))], keepdims=1)
    total = g.add("Clip", [total, int64("sum_min", 0), int64("sum_max", 2 ** 32 - 1)])
    rank = len(perm)
    peak_axes = list(range(rank)) if batch_reduced else list(range(1, rank))
    peak = g.add("ReduceMax", [total, g.ints(f"{node.name}/peak_axes", peak_axes)], keepdims=1) if peak_axes \
        else total
    below = g.add("Max", [g.add("Sub", [peak, int64("one", 1)]), int64("zero", 0)])
    drop = g.add("Max", [g.add("Sub", [bit_length_int64(g, node, below, "peak"), int64("kept", L2_PLACEHOLDER_BITS)]),
                         int64("drop_min", 0)])
    top = (1 << L2_PLACEHOLDER_BITS) - 1
    squeezed = g.add("Clip", [g.add("Div", [total, g.add("Gather", [pow2, drop], axis=0)]), int64("ph_min", 0),
                              int64("ph_max", top)])
    k = g.add("Sub", [int64("shift", n), drop])
    left = g.add("Gather", [pow2, g.add("Max", [g.add("Neg", [k]), int64("left_min", 0)])], axis=0)
    right = g.add("Gather", [pow2, g.add("Max", [k, int64("right_min", 0)])], axis=0)
    scaled = g.add("Mul", [g.add("Mul", [squeezed, int64("multiplier", m)]), left])
    placeholder = g.add("Clip", [round_div_int64(g, node, scaled, right), int64("req_min", 0), int64("req_max", top)])
    step_bits = L2_PLACEHOLDER_BITS - size_bits
    lut = int64("sqrt_lut", np.concatenate([table, table[-1:]]))
    hi = g.add("Div", [placeholder, int64("step", 1 << step_bits)])
    lo = g.add("Sub", [placeholder, g.add("Mul", [hi, int64("step_back", 1 << step_bits)])])
    base = g.add("Gather", [lut, hi], axis=0)
    rise = g.add("Sub", [g.add("Gather", [lut, g.add("Add", [hi, int64("next", 1)])], axis=0), base])
    value = g.add("Add", [base, g.add("Div", [g.add("Mul", [rise, lo]), int64("step_div", 1 << step_bits)])])
    if not keepdims:
        value = g.add("Squeeze", [value, g.ints(f"{node.name}/squeezed", list(axes))])
    emit_integers(g, node, node.outputs[0], g.add("Cast", [value], to=DOUBLE), tuple(out_perm))


@CUMULATE.export
def convert_cumulate(g: QDQGraph, node: PyNode) -> None:
    """Cumulate SUM: CumSum of (q + zp_in) in float64 (exact below 2^53), `exclusive` and `reverse` as ONNX's,
    then round_half_even(· M · 2^-N) - zp_out clamped: the integer forward's integers. PROD has no exact form."""
    x = node.inputs[0]
    rank = g.rank(x)
    method, axis, exclusive, reverse = _cumulate_params(node, rank)
    if method != "SUM":
        raise node_error(node, f"Cumulate {method} has no exact QDQ form (SUM has)")
    m, n = _per_tensor_requant(node)
    length = int(x.ir_shape[axis])
    if length * offset_absmax(node, x) * abs(int(m)) >= FLOAT64_EXACT:
        raise node_error(node, "the running sum times M leaves float64's exact integers; no exact form")
    perm = onnx_exact.shared_perm(g, [x], rank)
    onnx_axis = perm.index(axis) if perm is not None else axis
    total = g.add("CumSum", [onnx_exact.codes(g, x, perm), g.ints(f"{node.name}/axis", [onnx_axis])],
                  exclusive=int(exclusive), reverse=int(reverse))
    onnx_exact.requantize(g, node, total, float(m) * 2.0 ** -int(n), perm)
