"""Independent integer references shared by the operator tests: plain Python integers, no quantopt code."""
from __future__ import annotations

import numpy as np


def rhe_div(num: int, den: int) -> int:
    """round_half_even(num / den) for Python ints, den > 0."""
    q, rem = divmod(num, den)  # floor division, 0 <= rem < den
    return q + (1 if 2 * rem > den or (2 * rem == den and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def avg_ref(total: int, count: int, zp_out: int, s_in: float = 1.0, s_out: float = 1.0) -> int:
    """Integer AVG pooling (docs/integer-semantics.md, Pooling AVG): the window sum clamped to [-2^31, 2^31] times
    the 8-bit approximation M / 2^N of s_out / s_in / count (numpy float32 steps), rounded half to even, minus
    zp_out."""
    ratio = np.float32(np.float32(s_out) / np.float32(s_in)) / np.float32(count)
    shift = min(int(np.floor(np.log2(np.float32(255.0) / ratio))), 31)
    mult = int(np.floor(ratio * np.float32(2.0 ** shift) + np.float32(0.5)))
    num = min(max(total, -2 ** 31), 2 ** 31) * mult
    return (num << -shift if shift <= 0 else rhe_div(num, 1 << shift)) - zp_out
