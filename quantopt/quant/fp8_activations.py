"""fp8 activations (upstream's quant types w*afp8*, docs/low-bit.md): the scale of an fp8 tensor and the rounding of
float32 values to the fp8 grid exactly as upstream's optimizer rounds them. Pure math on torch tensors, no graph.

Rounding of a float32 value v (scaled already, `round_fp8`), two steps, as upstream:

1. to the format's mantissa width at v's own binary exponent e = floor(log2|v|), ties to even, with no lower bound
   on e (so a value below the smallest normal keeps 1 + m significant bits), then clamped to ±largest finite;
2. encoded: a normal result is exact; a result below the smallest normal is rounded again to a multiple of the
   smallest subnormal, halves away from zero.

So the result equals IEEE round-to-nearest-even with saturation except in the subnormal range, where step 2 rounds
halves away from zero and can round a value twice (2.48 units → 2.5 → 3). Finite values beyond the largest saturate
to it; NaN and ±inf give 0 (upstream's exponent of an infinite value is not finite, so its rounding yields NaN,
which it sets to 0).
"""
from __future__ import annotations

from typing import Dict, Tuple, Union

import torch

from .dtype import Dtype

# dtype -> (mantissa bits, smallest normal exponent, largest finite value)
FP8_FORMATS: Dict[Dtype, Tuple[int, int, float]] = {
    Dtype.FP8_E4M3FN: (3, -6, 448.0),
    Dtype.FP8_E5M2: (2, -14, 57344.0),
}
SCALE_GUARD = 1e-5
"""Added (in float32) to |x|max before scale = largest / |x|max, as upstream: an all-zero tensor gets a finite
scale."""


def fp8_largest(dtype: Dtype) -> float:
    """The largest finite value of an fp8 activation dtype (qmax; qmin is its negative)."""
    return FP8_FORMATS[_check(dtype)][2]


def _check(dtype: Dtype) -> Dtype:
    if dtype not in FP8_FORMATS:
        raise ValueError(f"{dtype} is not an fp8 activation dtype (float8_e4m3fn or float8_e5m2)")
    return dtype


def fp8_scale(absmax: Union[float, torch.Tensor], dtype: Dtype) -> torch.Tensor:
    """float32 scale = largest / (float32(|x|max) + 1e-5), per tensor (a 0-d tensor) or per channel (a vector).

    Both steps are torch's float32 tensor-with-Python-number operations, as upstream's: the guard and the largest
    value enter as Python floats (torch rounds such a sum differently from a sum of two float32 tensors by one unit
    in the last place on some values)."""
    r = torch.as_tensor(absmax, dtype=torch.float64).to(torch.float32).clone()
    r += SCALE_GUARD
    return fp8_largest(dtype) / r


def round_fp8(x: torch.Tensor, dtype: Dtype) -> torch.Tensor:
    """float32 values of `x` (taken as float32) rounded to the fp8 grid of `dtype` as described in the module doc."""
    man, emin, largest = FP8_FORMATS[_check(dtype)]
    v = x.to(torch.float32)
    nan = ~torch.isfinite(v)
    v = torch.where(nan, torch.zeros_like(v), v)
    mag = v.abs()
    # step 1: ties-to-even at the value's own exponent (frexp gives mag = f * 2^k with f in [0.5, 1))
    _, k = torch.frexp(torch.where(mag > 0, mag, torch.ones_like(mag)))
    e = (k - 1).to(torch.float64)
    m = torch.round(mag.to(torch.float64) * torch.pow(2.0, man - e)) * torch.pow(2.0, e - man)
    m = torch.clamp(m, max=largest)
    # step 2: below the smallest normal, a multiple of the smallest subnormal, halves away from zero
    unit = 2.0 ** (emin - man)
    sub = torch.floor(m / unit + 0.5) * unit
    m = torch.where(m < 2.0 ** emin, sub, m)
    y = torch.copysign(m, v.to(torch.float64)).to(torch.float32)
    return torch.where(nan, torch.zeros_like(y), y)


def quantize_fp8(x: torch.Tensor, scale: Union[float, torch.Tensor], dtype: Dtype) -> torch.Tensor:
    """fp8 values (float32) of float `x`: round_fp8(float32(scale · x)), zero point 0, as upstream's Input and
    Quantize layers; `scale` is float32 (a scalar, or a vector broadcast along the last axis)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return round_fp8(s * x.to(torch.float32), dtype)


def requantize_fp8(acc: torch.Tensor, scale_value: Union[float, torch.Tensor], dtype: Dtype) -> torch.Tensor:
    """Output of an fp8 MAC layer: round_fp8(float32(acc · scale_value)), the product taken in float64 of the
    float64 accumulator and the float32 `scale_value` (per channel: a vector along the last axis)."""
    s = torch.as_tensor(scale_value, dtype=torch.float32, device=acc.device).to(torch.float64)
    return round_fp8((acc.to(torch.float64) * s).to(torch.float32), dtype)


FP4_STEPS = ((0.25, 0.0, True), (0.75, 0.5, True), (1.25, 1.0, True), (1.75, 1.5, False), (2.5, 2.0, True),
             (3.5, 3.0, False), (5.0, 4.0, False))
"""fp4 e2m1 rounding of upstream's fp4 weights under an fp8 quant_type: (bound, value, bound included) per step:
|x| up to the bound (inclusive or not) gives the value, beyond the last bound 6. It differs from ties-to-even at
0.75 (gives 0.5) and 5 (gives 6)."""


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """float32 values of `x` on the fp4 e2m1 grid by upstream's steps (FP4_STEPS); NaN gives 0."""
    v = x.to(torch.float32)
    mag = v.abs()
    y = torch.full_like(mag, 6.0)
    for bound, value, inclusive in reversed(FP4_STEPS):
        y = torch.where(mag <= bound if inclusive else mag < bound, torch.full_like(mag, value), y)
    y = torch.where(torch.isnan(v), torch.zeros_like(y), torch.copysign(y, v))
    return y


__all__ = ["FP4_STEPS", "FP8_FORMATS", "SCALE_GUARD", "fp8_largest", "fp8_scale", "quantize_fp8", "requantize_fp8",
           "round_fp4", "round_fp8"]
