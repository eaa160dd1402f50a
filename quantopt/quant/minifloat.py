"""Bit-exact conversion between small float formats (fp8/fp6/fp4) and float32, without extra dependencies.

Each format is stored one element per byte in the IR's .bin (docs/ir-format.md, section 6); the code in the low bits.
"""
from __future__ import annotations

from functools import cache

import numpy as np


@cache
def decode_table(exp_bits: int, man_bits: int, bias: int, ieee_special: bool, nan_all_ones: bool) -> np.ndarray:
    """float32 value of every code of a 1+exp+man bit format.

    `ieee_special`: the all-ones exponent holds inf/NaN (e5m2). `nan_all_ones`: only the all-ones code (per sign)
    is NaN (e4m3fn). Otherwise every code is finite (fp6/fp4).
    """
    nbits = 1 + exp_bits + man_bits
    codes = np.arange(2 ** nbits, dtype=np.int64)
    sign = np.where((codes >> (nbits - 1)) & 1, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    normal = (1.0 + man / 2.0 ** man_bits) * np.power(2.0, exp - bias)
    subnormal = (man / 2.0 ** man_bits) * 2.0 ** (1 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    emax = (1 << exp_bits) - 1
    if ieee_special:
        values = np.where((exp == emax) & (man == 0), sign * np.inf, values)
        values = np.where((exp == emax) & (man != 0), np.copysign(np.nan, sign), values)
    elif nan_all_ones:
        values = np.where((exp == emax) & (man == (1 << man_bits) - 1), np.copysign(np.nan, sign), values)
    values = values.astype(np.float32)
    if ieee_special:
        # keep NaN payloads in the top float32 mantissa bits so that encode() gives back the same code
        nan_codes = (exp == emax) & (man != 0)
        bits = ((codes >> (nbits - 1)) << 31) | (0xFF << 23) | (man << (23 - man_bits))
        values = np.where(nan_codes, bits.astype(np.uint32).view(np.float32), values)
    return values


def decode(codes: np.ndarray, fmt: tuple) -> np.ndarray:
    table = decode_table(*fmt)
    nbits = 1 + fmt[0] + fmt[1]
    return table[np.asarray(codes, dtype=np.int64) & ((1 << nbits) - 1)]


def encode(values: np.ndarray, fmt: tuple) -> np.ndarray:
    """Round float values to the nearest code (ties to the even code), saturating to the largest finite value."""
    table = decode_table(*fmt)
    nbits = 1 + fmt[0] + fmt[1]
    half = 2 ** (nbits - 1)
    positive = table[:half]
    finite = np.isfinite(positive)
    pos_codes = np.nonzero(finite)[0]
    pos_vals = positive[finite].astype(np.float64)
    order = np.argsort(pos_vals, kind="stable")
    pos_codes, pos_vals = pos_codes[order], pos_vals[order]
    v = np.asarray(values, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        flat = v.reshape(-1).astype(np.float64)
    neg = np.signbit(v.reshape(-1))
    mag = np.abs(flat)
    idx = np.clip(np.searchsorted(pos_vals, mag), 1, len(pos_vals) - 1)
    lo, hi = pos_vals[idx - 1], pos_vals[idx]
    pick_hi = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (pos_codes[idx] % 2 == 0))
    chosen = np.where(pick_hi, pos_codes[idx], pos_codes[idx - 1])
    chosen = np.where(mag <= pos_vals[0], pos_codes[0], chosen)
    chosen = np.where(mag >= pos_vals[-1], pos_codes[-1], chosen)
    inf_code = np.nonzero(np.isinf(positive))[0]
    if inf_code.size:
        chosen = np.where(np.isinf(mag), inf_code[0], chosen)
    nan_codes = np.nonzero(np.isnan(positive))[0]
    nan_code = nan_codes[-1] if nan_codes.size else pos_codes[-1]
    if fmt[3]:
        payload = (v.reshape(-1).view(np.uint32) >> (23 - fmt[1])) & ((1 << fmt[1]) - 1)
        payload = np.where(payload == 0, 1, payload)
        nan_code = ((1 << fmt[0]) - 1) << fmt[1] | payload
    chosen = np.where(np.isnan(flat), nan_code, chosen)
    chosen = chosen + np.where(neg, half, 0)
    return chosen.astype(np.uint8).reshape(v.shape)


E4M3FN = (4, 3, 7, False, True)
E5M2 = (5, 2, 15, True, False)
E2M3FN = (2, 3, 1, False, False)
E3M2FN = (3, 2, 3, False, False)
E2M1FN = (2, 1, 1, False, False)
