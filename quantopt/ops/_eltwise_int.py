"""Exact int64 requantization shared by the Eltwise/Add/Sub/Mul and Concat integer forwards.

Everything here is pure int64 torch arithmetic (no float rounding anywhere), so a kernel that follows
docs/integer-semantics.md reproduces it bit for bit. Overflow is ruled out up front from the integer
ranges stored in the IR (`check_int64_bound`) instead of being silently wrapped.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import TensorRange, TensorStatistics, ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..quant.requant import int64_to_float64, range_dtype
from ..quant.rounding import INT64_SAFE, MAGIC_EXACT, int_to_float64
from ._quant import (
    fused_activation,
    fused_activation_clamp,
    layer_settings,
    out_range,
    set_qinvariant,
    tensor_zp,
)


def offset_absmax(node: PyNode, t: PyTensor) -> int:
    """max |q + zp| over the tensor's integer range: the largest zero-point-corrected input magnitude."""
    lo, hi = out_range(node, t)
    zp = tensor_zp(node, t)
    return max(abs(lo + zp), abs(hi + zp))


def offset_value(node: PyNode, t: PyTensor, dtype: torch.dtype) -> torch.Tensor:
    """q + zp of a quantized tensor as `dtype` (float64 only where the caller's bound proves it exact)."""
    x = t.betensor
    if x.is_floating_point():  # integers held in a float tensor (a hand-fed input)
        x = torch.round(x.to(torch.float64))
    elif dtype == torch.float64 and offset_absmax(node, t) < MAGIC_EXACT:  # the stored range bounds the values
        zp = tensor_zp(node, t)
        if isinstance(zp, (int, float)):  # one allocation: the same exact values, the zero point added in place
            return int64_to_float64(x.to(torch.int64), zp)
        return int_to_float64(x.to(torch.int64)) + zp
    return x.to(dtype) + tensor_zp(node, t)


INT64_PRODUCT_LIMIT = 2 ** 63
"""Bound of an integer product taken as it is (multiplier 1, shift 0: no rounding added): int64 holds |v| < 2^63,
which covers the product of two int32 values (at most 2^62)."""


def check_int64_bound(node: PyNode, bound: int, what: str, limit: int = INT64_SAFE) -> None:
    """Refuse (rather than wrap) an integer pipeline whose worst-case intermediate reaches `limit` (2^62 where a
    rounding term or a left shift may still be added)."""
    if bound >= limit:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the worst-case {what} ({bound}) does not fit "
                               "the exact int64 integer forward; use narrower inputs")


def activation_clamp(node: PyNode, y: torch.Tensor) -> torch.Tensor:
    """Fused RELU/RELU6/CLIP in the integer domain.

    RELU is clamped at the quantized zero (-zp_out) as well: the output range alone realises it only when the
    output is unsigned, and `force_dtype_int` can make it signed. RELU6/CLIP use the shared bounds (whose lower bound
    is already the quantized 0 or clip_min).
    """
    if fused_activation(node) == "RELU":
        qmin, qmax = out_range(node, node.outputs[0])
        zero = min(max(-tensor_zp(node, node.outputs[0]), qmin), qmax)
        y = torch.clamp(y, min=zero)
    return fused_activation_clamp(node, y)


def set_integer_output(node: PyNode, out: PyTensor, signed: bool, input_bits: Sequence[int]) -> None:
    """Both inputs are integers (qinvariant): the output is an integer too (scale 1, zp 0).

    Bits: the smallest of 8/16/32 holding the calibrated extrema (signed if `signed`, forced signed by
    `force_dtype_int`), at least as wide as the widest input, as upstream.
    """
    lo, hi = _extrema(statistics_of(node).get(out), ranges_of(node).get(out), out)
    signed = bool(signed or layer_settings(node).force_dtype_int)
    dt = range_dtype(lo, hi, force_signed=signed)
    bits = max([dt.bits, *[int(b) for b in input_bits]])
    set_qinvariant(node, out, min(bits, 32), dt.is_signed)


def _extrema(st: TensorStatistics, r: TensorRange, t: PyTensor) -> Tuple[float, float]:
    if st.extrema_min is not None and st.extrema_max is not None:
        return float(st.extrema_min), float(st.extrema_max)
    if r.min is None or r.max is None:
        raise UnsupportedError(f"tensor '{t.name}' has no calibrated range; run calibration before quantization")
    return float(r.min), float(r.max)
