"""linear_requantize is exact beyond float64's integer range: 48-bit accumulators times 15-bit multipliers."""
from __future__ import annotations

import random

import torch

from quantopt.quant.requant import linear_requantize


def _reference(x: int, m: int, s: int) -> int:
    q, r = divmod(x * m, 1 << s)
    half = 1 << (s - 1)
    return q + (1 if r > half or (r == half and q % 2) else 0)


def test_wide_products_round_exactly() -> None:
    rng = random.Random(3)
    xs, ms, ss, refs = [], [], [], []
    while len(xs) < 400:
        x, m, s = rng.randint(-2 ** 47, 2 ** 47), rng.randint(1, 2 ** 15 - 1), rng.randint(1, 60)
        ref = _reference(x, m, s)
        if abs(ref) < 2 ** 31:
            xs.append(x), ms.append(m), ss.append(s), refs.append(ref)
    got = linear_requantize(torch.tensor(xs, dtype=torch.float64).reshape(-1, 1),
                            torch.tensor(ms).reshape(-1), torch.tensor(ss).reshape(-1), 0, -2 ** 31, 2 ** 31 - 1,
                            axis=0)
    assert got.reshape(-1).tolist() == refs


def test_ties_at_the_int64_path_round_half_to_even() -> None:
    for x in (2 ** 45 + 2 ** 12, 2 ** 45 + 3 * 2 ** 12, -(2 ** 45 + 2 ** 12)):  # x * 2^8 / 2^21 = k + 0.5
        got = int(linear_requantize(torch.tensor([x], dtype=torch.float64), 2 ** 8, 21, 0, -2 ** 40, 2 ** 40)[0])
        assert got == _reference(x, 2 ** 8, 21)
        assert got % 2 == 0
