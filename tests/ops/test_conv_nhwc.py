"""The NHWC convolution kernels of the float and integer forwards (ops/_conv_nhwc.py) against torch's own NCHW
convolution, and the fast exact requantization and conversion helpers against their int64 definitions."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import quantopt.ops._conv_nhwc as kernels
from quantopt.ops._shared import broadcast_shape
from quantopt.quant.requant import requantize_float64, requantize_int
from quantopt.quant.rounding import MAGIC_EXACT, float64_to_int, int_to_float64, round_shift

CASES = [
    # (N, H, W, C, out_c, kh, kw, group, stride, dilation, pads (l, r, t, b))
    (1, 9, 11, 8, 16, 3, 3, 1, (1, 1), (1, 1), (1, 1, 1, 1)),
    (2, 10, 7, 6, 4, 1, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0)),
    (1, 12, 12, 6, 6, 1, 1, 1, (2, 1), (1, 1), (0, 0, 0, 0)),
    (1, 13, 9, 5, 5, 5, 5, 5, (2, 1), (1, 1), (2, 2, 2, 2)),  # depthwise, stride on H only
    (2, 8, 8, 4, 12, 3, 3, 4, (1, 2), (1, 1), (0, 1, 1, 0)),  # depthwise with channel multiplier 3
    (2, 12, 11, 6, 6, 3, 2, 6, (1, 2), (2, 3), (2, 1, 1, 2)),  # depthwise, dilation and stride on both axes
    (1, 11, 10, 8, 6, 3, 2, 2, (1, 1), (2, 1), (1, 0, 2, 1)),  # grouped, dilation, asymmetric pads
    (1, 7, 16, 3, 8, 3, 3, 1, (2, 2), (1, 1), (1, 1, 1, 1)),
    (3, 5, 5, 1, 2, 3, 3, 1, (1, 1), (1, 2), (2, 2, 2, 2)),
]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, group: int, stride: Tuple[int, int],
               dilation: Tuple[int, int], pads: Tuple[int, int, int, int], pad_value: float) -> torch.Tensor:
    xc = F.pad(x.permute(0, 3, 1, 2), pads, value=pad_value)
    y = F.conv2d(xc, w.permute(0, 3, 1, 2), bias, stride=stride, dilation=dilation, groups=group)
    return y.permute(0, 2, 3, 1)


@pytest.mark.parametrize("case", CASES)
def test_float64_matches_torch(case) -> None:
    n, h, w_, c, out_c, kh, kw, group, stride, dilation, pads = case
    g = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(n, h, w_, c, generator=g)
    w = torch.randn(out_c, kh, kw, c // group, generator=g)
    b = torch.randn(out_c, generator=g)
    y = kernels.conv2d_nhwc(x, w, b.double(), stride, dilation, pads, group, dtype=torch.float64)
    ref = _reference(x.double(), w.double(), b.double(), group, stride, dilation, pads, 0.0)
    assert y.dtype == torch.float64 and y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-13, atol=1e-12)
    # products of float32 operands are exact in float64: the float32 rounding agrees with torch's float64 result
    assert torch.equal(y.float(), ref.float())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_integers_are_exact_with_a_pad_value(case, dtype) -> None:
    """The integer forward's use: exact integers, padding with -zp, any exact float type."""
    n, h, w_, c, out_c, kh, kw, group, stride, dilation, pads = case
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-128, 128, (n, h, w_, c), generator=g)
    w = torch.randint(-127, 128, (out_c, kh, kw, c // group), generator=g)
    y = kernels.conv2d_nhwc(int_to_float64(x), w, None, stride, dilation, pads, group, pad_value=-5.0, dtype=dtype)
    ref = _reference(x.double(), w.double(), None, group, stride, dilation, pads, -5.0)
    assert torch.equal(y.double(), ref)


def test_banded_unfolding_gives_the_same_result(monkeypatch) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 17, 9, 4, generator=g)
    w = torch.randn(6, 3, 3, 4, generator=g)
    args = ((1, 1), (1, 1), (1, 1, 1, 1), 1)
    whole = kernels.conv2d_nhwc(x, w, None, *args, dtype=torch.float64)
    monkeypatch.setattr(kernels, "MAX_PATCH_ELEMENTS", 100)  # one output row per band
    assert torch.equal(kernels.conv2d_nhwc(x, w, None, *args, dtype=torch.float64), whole)


def test_padding_converts_and_fills_only_the_border() -> None:
    x = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).reshape(2, 3, 4, 2)
    y = kernels.pad_nhwc(x, (1, 2, 0, 3), -7.0, torch.float64)
    ref = F.pad(x.double(), (0, 0, 1, 2, 0, 3), value=-7.0)
    assert y.dtype == torch.float64 and torch.equal(y, ref)


def test_broadcast_shape_follows_numpy() -> None:
    for shapes in ([(2, 3), (3,)], [(1, 4, 1), (5, 1, 6)], [(), (3,)], [(2, 1), (1, 2), (2, 2)], [(0, 1), (1, 5)]):
        assert broadcast_shape(shapes) == np.broadcast_shapes(*shapes)
    with pytest.raises(ValueError):
        broadcast_shape([(2, 3), (4,)])


def test_fast_int_float_conversions_are_exact() -> None:
    edge = MAGIC_EXACT - 1
    x = torch.tensor([0, 1, -1, 2 ** 31 - 1, -(2 ** 31), 12345678901, -edge, edge], dtype=torch.int64)
    f = int_to_float64(x)
    assert torch.equal(f, x.to(torch.float64))
    assert torch.equal(float64_to_int(f), x)
    assert float64_to_int(torch.tensor([-0.0], dtype=torch.float64)).tolist() == [0]


@pytest.mark.parametrize("shift", [-3, 0, 1, 7, 15, 31, 40, 62, 63, 70])
def test_requantize_float_path_equals_the_int64_definition(shift: int) -> None:
    g = torch.Generator().manual_seed(shift + 100)
    acc = torch.randint(-(2 ** 30), 2 ** 30, (4000,), generator=g, dtype=torch.int64)
    # exact ties at every shift: multiples of 2^(shift-1)
    if 0 < shift < 40:
        acc[:200] = torch.arange(-100, 100) * (1 << (shift - 1))
    mult = 12345
    expected = torch.clamp(round_shift(acc * mult, shift) - 3, -(2 ** 15), 2 ** 15 - 1)
    assert torch.equal(requantize_int(acc, mult, shift, 3, -(2 ** 15), 2 ** 15 - 1), expected)
    assert torch.equal(requantize_float64(acc.double(), mult, shift, 3, -(2 ** 15), 2 ** 15 - 1), expected)


def test_requantize_per_channel_and_wide_accumulators() -> None:
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-(2 ** 40), 2 ** 40, (64, 8), generator=g, dtype=torch.int64)
    mult = torch.randint(1, 2 ** 15, (8,), generator=g, dtype=torch.int64)
    shift = torch.randint(10, 40, (8,), generator=g, dtype=torch.int64)
    expected = torch.clamp(round_shift(acc * mult, shift) - 0, -128, 127)
    assert torch.equal(requantize_int(acc, mult, shift, 0, -128, 127), expected)  # |acc*M| >= 2^53: int64 path
    small = acc >> 20
    expected = torch.clamp(round_shift(small * mult, shift), -128, 127)
    assert torch.equal(requantize_int(small, mult, shift, 0, -128, 127), expected)  # float64 path
