"""The float64 fast paths of the exact integer rounding (quant/rounding.py `round_shift`, ops/linear.py
`requantize_exact`): where every value is below 2^53 the shift or the requantization runs as one float64 product
and torch.round (half to even); the results equal Python's exact half-to-even reference, ties included, and the
int64 paths' results where the bound does not hold."""
from __future__ import annotations

from fractions import Fraction

import torch

from quantopt.ops.linear import requantize_exact
from quantopt.quant.rounding import below_float64_exact, round_shift


def _values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-(2 ** 40), 2 ** 40, (4000,), generator=g, dtype=torch.int64)
    ties = torch.arange(-64, 64, dtype=torch.int64) * 8 + 4  # exact halves for shift 3
    return torch.cat([v, ties, torch.tensor([0, 1, -1, 2 ** 52 - 1, -(2 ** 52) + 1])])


def test_round_shift_fast_path_is_exact_half_even() -> None:
    v = _values(1)
    assert below_float64_exact(v)
    for shift in (1, 3, 7, 20, 45, 62):
        fast = round_shift(v, shift)
        general = round_shift(v, torch.tensor(shift))  # a tensor shift takes the int64 path
        assert torch.equal(fast, general), shift
        want = [round(Fraction(int(x), 2 ** shift)) for x in v[:300].tolist()]
        assert fast[:300].tolist() == want


def test_requantize_exact_fast_path_is_exact_half_even() -> None:
    v = _values(2) >> 20  # accumulators below 2^20, times 15-bit multipliers: below 2^53
    for mult, shift in ((1, 1), (173, 9), (32767, 22), (128, 7), (21465, 31)):
        assert below_float64_exact(v, mult)
        got = requantize_exact(v, mult, shift)
        want = [round(Fraction(int(x) * mult, 2 ** shift)) for x in v.tolist()]
        assert got.tolist() == want, (mult, shift)


def test_bound_refuses_values_at_2_53() -> None:
    assert not below_float64_exact(torch.tensor([2 ** 53], dtype=torch.int64))
    assert not below_float64_exact(torch.tensor([-(2 ** 50)], dtype=torch.int64), 8)
    assert below_float64_exact(torch.tensor([], dtype=torch.int64))
    big = torch.tensor([2 ** 60 + 3, -(2 ** 60) - 5], dtype=torch.int64)
    assert torch.equal(round_shift(big, 2), round_shift(big, torch.tensor(2)))  # the int64 path: no float64 loss


def test_bit_length_matches_python_on_both_paths() -> None:
    """`bit_length` by the float64 exponent below 2^53 and by the shift ladder above: Python's int.bit_length at
    every power of two and its neighbours, zero, random values, and values from 2^53 to 2^62."""
    from quantopt.quant.rounding import bit_length

    edges = {0, 1} | {v for k in range(1, 63) for v in (2 ** k - 1, 2 ** k, 2 ** k + 1) if v < 2 ** 63}
    g = torch.Generator().manual_seed(4)
    small = sorted(v for v in edges if v < 2 ** 53) + torch.randint(0, 2 ** 53, (2000,), generator=g).tolist()
    large = sorted(v for v in edges if v >= 2 ** 53)
    for values in (small, large, [0, 5, 2 ** 60]):  # the last mixes both ranges: the ladder
        got = bit_length(torch.tensor(values, dtype=torch.int64)).tolist()
        assert got == [int(v).bit_length() for v in values]
    assert bit_length(torch.tensor([[3, 4], [0, 1]])).tolist() == [[2, 3], [0, 1]]  # shape kept
