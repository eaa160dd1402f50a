"""The float64 fast paths of the exact integer rounding (quant/rounding.py `round_shift`, ops/linear.py
`requantize_exact`): where every value is below 2^53 the shift or the requantization runs as one float64 product
and torch.round (half to even); the results equal Python's exact half-to-even reference, ties included, and the
int64 paths' results where the bound does not hold."""
from __future__ import annotations

from fractions import Fraction

import torch

from quantopt.ops.linear import requantize_exact
from quantopt.quant.rounding import below_float64_exact, round_shift, round_shift_int64


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
        general = round_shift_int64(v, shift)
        assert torch.equal(fast, general), shift
        want = [round(Fraction(int(x), 2 ** shift)) for x in v[:300].tolist()]
        assert fast[:300].tolist() == want


def _exact(x: int, shift: int) -> int:
    """Python's round_shift: half to even for shift >= 0, a left shift saturating at +-2^62 for shift < 0."""
    if shift >= 0:
        return round(Fraction(x, 2 ** shift))
    y = x * 2 ** -shift
    return y if abs(y) < 2 ** 62 else (2 ** 62 if y > 0 else -(2 ** 62))


def test_round_shift_zero_and_left_shifts_and_per_channel_shifts_are_exact() -> None:
    """The fast paths for a shift of 0 (a copy: the input is never returned), left shifts that do not saturate,
    and per-channel tensor shifts in [0, 62] give Python's exact results, as the int64 path does; left shifts that
    saturate and per-channel shifts with negative entries take the int64 path."""
    g = torch.Generator().manual_seed(5)
    v = torch.cat([torch.randint(-(2 ** 40), 2 ** 40, (600,), generator=g, dtype=torch.int64),
                   torch.tensor([0, 1, -1, 2 ** 52 - 1, -(2 ** 52) + 1, 2 ** 20, -(2 ** 20)])])
    zero = round_shift(v, 0)
    assert torch.equal(zero, v) and zero.data_ptr() != v.data_ptr()
    for shift in (-1, -5, -21, -22, -40, -61, -62, -63):  # -22 and below saturate the largest values
        got = round_shift(v, shift).tolist()
        assert got == [_exact(int(x), shift) for x in v.tolist()] == round_shift_int64(v, shift).tolist(), shift
    rows = v[:600].reshape(60, 10)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        shifts = torch.randint(0, 63, (10,), generator=g).to(dtype)
        want = [[_exact(int(x), int(s)) for x, s in zip(row, shifts.tolist())] for row in rows.tolist()]
        assert round_shift(rows, shifts).tolist() == want == round_shift_int64(rows, shifts).tolist()
    mixed = torch.tensor([3, 0, -2, 63, 70, 1, -64, 9, 2, 5])
    want = [[_exact(int(x), int(s)) if s < 63 or abs(x) < 2 ** 62 else 0 for x, s in zip(row, mixed.tolist())]
            for row in rows.tolist()]
    assert round_shift(rows, mixed).tolist() == want


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
    assert torch.equal(round_shift(big, 2), round_shift_int64(big, 2))  # the int64 path: no float64 loss
    assert round_shift(big, 2).tolist() == [round(Fraction(int(x), 4)) for x in big.tolist()]


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
