"""Quantized negative slopes of LEAKYRELU and PRELU, shared by the standalone activation layers and the MAC layers
that fuse them (`with_activation = LEAKYRELU | PRELU`); docs/integer-semantics.md, "LEAKYRELU and PRELU".

A LEAKYRELU slope becomes the integer `round(slope · 2^out_bits)` (shift: the output's bits), a PRELU slope tensor
int16 codes `clip(round_half_even(slope · 2^12))`. The integer forward adds `round_half_even(min(x, 0) · slope_q ·
2^-shift)` to `max(x, 0)`, exactly in int64, held within a 48-bit accumulator, before the layer's requantization.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

from ..quant.dtype import Dtype
from ..quant.hardware import PRELU_SLOPE_SHIFT, SLOPE_ACC_BITS
from ..quant.params import quantize
from ..quant.requant import range_dtype
from ..quant.rounding import round_shift


def leaky_slope_code(slope: float, out_bits: int) -> Tuple[int, Dtype]:
    """(integer slope, its dtype): round(slope · 2^out_bits), half to even as Python rounds, in the smallest
    dtype holding it. ValueError for a slope that is not finite or whose code needs more than 32 bits (the
    integer forward multiplies int64 codes by it)."""
    if not math.isfinite(slope):
        raise ValueError(f"LEAKYRELU slope {slope} is not a finite number")
    q = int(round(slope * 2 ** out_bits))
    if abs(q) >= 2 ** 31:
        raise ValueError(f"LEAKYRELU slope {slope} times 2^{out_bits} does not fit 32 bits")
    return q, range_dtype(min(q, 0), max(q, 0))


def prelu_slope_codes(values: torch.Tensor, input_rank: int) -> torch.Tensor:
    """int16 codes of PRELU slopes at shift `PRELU_SLOPE_SHIFT`. A slope tensor as deep as the input (the Parser
    writes [1, H, W, C]) whose slices along dim 0 are all equal keeps one slice, and a leading 1 is squeezed."""
    q = quantize(values.to(torch.float32), float(2 ** PRELU_SLOPE_SHIFT), 0, -32768, 32767)
    if q.dim() >= input_rank and q.dim() > 0 and q.shape[0] > 0:
        if bool((q == q[:1]).all()):
            q = q[:1]
        if q.shape[0] == 1:
            q = q.squeeze(0)
    return q


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of `shape` broadcasts to exactly `target` (numpy rules)."""
    if len(shape) > len(target):
        return False
    return all(int(s) in (1, int(t)) for s, t in zip(reversed(list(shape)), reversed(list(target))))


def apply_int_slope(x: torch.Tensor, slope: torch.Tensor, shift: int) -> torch.Tensor:
    """max(x, 0) + round_half_even(min(x, 0) · slope · 2^-shift) of integer `x` (any integer-valued dtype),
    exact in int64, clamped to the signed `SLOPE_ACC_BITS`-bit accumulator. `slope` broadcasts to `x`."""
    xi = x if x.dtype == torch.int64 else x.to(torch.int64)
    neg = round_shift(torch.clamp(xi, max=0) * slope.to(device=xi.device, dtype=torch.int64), shift)
    lim = 2 ** (SLOPE_ACC_BITS - 1)
    return torch.clamp(neg + torch.clamp(xi, min=0), -lim, lim - 1)

