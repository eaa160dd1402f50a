"""Multiplier/shift approximation, shift unification, requantization, Eltwise multipliers and biases
(docs/integer-semantics.md), with upstream's worked examples of a per-tensor and a per-channel convolution and an
int8 Eltwise ADD."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from quantopt.quant.dtype import Dtype
from quantopt.quant.hardware import AIFF_MULTIPLIER_MAX
from quantopt.quant.params import linear_quant_params
from quantopt.quant.requant import (
    aiff_ahead_shift,
    bias_quantize,
    compress_bias,
    eltwise_multipliers,
    fold_input_zero_point,
    group_ranges,
    linear_requantize,
    linear_requantize_floor,
    requantize_float64_,
    requantize_float_in_bands,
    scale_shift,
    unify_shifts,
    unify_shifts_for_aiff,
)

# the int8 asymmetric Eltwise ADD example of docs/integer-semantics.md (Eltwise ADD/SUB/MAX/MIN)
A1 = dict(s0=44.694862, zp0=5, s1=44.760075, zp1=-15, s_out=31.199003, zp_out=-5)


def f32(v: float) -> float:
    return float(np.float32(v))


def exact_requant(x: int, m: int, shift: int, zp: int, lo: int, hi: int) -> int:
    """Infinite-precision reference: Python's round() on a Fraction rounds half to even."""
    return max(lo, min(hi, round(Fraction(x * m) / Fraction(2) ** shift) - zp))


# --- scale_shift ------------------------------------------------------------------------------------------------

def test_verified_example_shift_22_multiplier_128() -> None:
    assert scale_shift(3.046e-5, 8) == (128, 22, Dtype.UINT8, Dtype.INT8)


def test_example_conv_per_tensor() -> None:
    """Upstream's per-tensor convolution example: r = 66.123856 / (42.438183 * 182.07645) → shift 14, M 140 (uint8),
    biases_scale = s_in * s_w."""
    r = 66.123856 / (42.438183 * 182.07645)
    assert scale_shift(r, 8) == (140, 14, Dtype.UINT8, Dtype.INT8)
    assert f32(182.07645) == 182.07644653320312
    _, b_scale = bias_quantize(torch.zeros(1), 42.438183, 182.07645, 32)
    assert b_scale == 7726.99365234375


def test_ratio_exactly_one() -> None:
    assert scale_shift(1.0, 8)[:2] == (1, 0)
    assert scale_shift(1.0, 16)[:2] == (1, 0)
    m, s, _, _ = scale_shift(torch.ones(3), 8)
    assert m.tolist() == [1, 1, 1] and s.tolist() == [0, 0, 0]
    # only when every channel is exactly a power of two: a mixed tensor keeps its multipliers
    m, s, _, _ = scale_shift(torch.tensor([1.0, 0.3]), 8)
    assert m.tolist() != [1, 1]
    assert scale_shift(0.5, 8)[:2] == (128, 8)


@pytest.mark.parametrize("bits", [2, 4, 8, 12, 15, 16])
def test_multiplier_range_and_accuracy(bits: int) -> None:
    """M lies in [2^(mb-1), 2^mb - 1] and M·2^-shift is within half an LSB of r (uncapped shifts)."""
    mb = min(bits, 15)
    ratios = torch.logspace(-6, 3, 400, dtype=torch.float64)
    m, s, mdt, sdt = scale_shift(ratios, bits)
    r32 = ratios.to(torch.float32).to(torch.float64)
    assert mdt == (Dtype.UINT8 if bits <= 8 else Dtype.UINT16)
    assert sdt in (Dtype.INT8, Dtype.INT16)
    free = s < 31  # shifts not clipped by the 31 ceiling
    assert bool(free.any())
    assert int(m[free].min()) >= 2 ** (mb - 1) - 1 and int(m.max()) <= 2 ** mb
    err = (m.double() * torch.pow(2.0, -s.double()) - r32).abs() * torch.pow(2.0, s.double())
    assert float(err.max()) <= 0.5 + 1e-6
    for i in (0, 137, 399):  # tensor and scalar paths agree
        assert scale_shift(float(ratios[i]), bits)[:2] == (int(m[i]), int(s[i]))


def test_negative_shift_and_force_shift_positive() -> None:
    assert scale_shift(1000.0, 8)[:2] == (250, -2)
    assert scale_shift(1000.0, 8, force_shift_positive=True)[:2] == (255, 0)
    assert scale_shift(1e6, 16, force_shift_positive=True)[:2] == (AIFF_MULTIPLIER_MAX, 0)
    m, s, _, _ = scale_shift(torch.tensor([1000.0, 0.01]), 8, force_shift_positive=True)
    assert m.tolist() == [255, scale_shift(0.01, 8)[0]] and s.tolist() == [0, scale_shift(0.01, 8)[1]]


def test_shift_ceilings() -> None:
    assert scale_shift(1e-12, 8)[:2] == (0, 31)
    m, s, _, _ = scale_shift(1e-12, 8, shift_limit=63)
    assert s == math.floor(math.log2(255 / f32(1e-12))) and 128 <= m <= 255
    assert scale_shift(0.01, 8, limit_to_mult_bits=True)[1] == 8


def test_invalid_ratios() -> None:
    with pytest.raises(ValueError):
        scale_shift(float("nan"), 8)
    with pytest.raises(ValueError):
        scale_shift(-0.5, 8)


def test_ratio_is_approximated_in_float32() -> None:
    """A float64 ratio just below 2^-k·(M+0.5) would round differently in float64; upstream rounds to float32."""
    r = (140.5 - 1e-9) / 2 ** 14
    assert scale_shift(r, 8)[0] == math.floor(f32(r) * 2 ** 14 + 0.5)


# --- unify_shifts -----------------------------------------------------------------------------------------------

def test_unify_shifts_example_form() -> None:
    """Upstream's per-channel example's written result [266, 224, 252, 193] with shift 15: the first channel's own
    approximation has shift 14 (its ratio is below half the others) and is shifted up to the common 15."""
    ratios = torch.tensor([266, 224, 252, 193], dtype=torch.float64) / 2 ** 15
    m, s, _, _ = scale_shift(ratios, 8)
    assert m.tolist() == [133, 224, 252, 193] and s.tolist() == [14, 15, 15, 15]
    um, n = unify_shifts(m, s)
    assert um.tolist() == [266, 224, 252, 193] and n == 15


def test_unify_shifts_invariants() -> None:
    gen = torch.Generator().manual_seed(0)
    ratios = torch.exp(torch.empty(64).uniform_(-12, 0, generator=gen))
    m, s, _, _ = scale_shift(ratios, 8)
    um, n = unify_shifts(m, s)
    assert int(um.max()) <= AIFF_MULTIPLIER_MAX
    assert n == max(0, int(s.max())) - max(0, math.ceil(math.log2(max(int(x) << (max(0, int(s.max())) - int(y))
                                                                       for x, y in zip(m, s)) / 32767)))
    # error of a unified channel: its own approximation error plus at most one LSB of the common shift
    err = (um.double() * 2.0 ** -n - ratios.double()).abs()
    assert bool((err <= 2.0 ** -n + 0.5 * torch.pow(2.0, -s.double()) + 1e-12).all())
    big = ratios.double() > 64 * 2.0 ** -n  # so channels well above the new LSB keep a small relative error
    assert float((err / ratios.double())[big].max()) < 0.02


def test_unify_shifts_cap_and_zeroed_channel() -> None:
    um, n = unify_shifts([255, 128], [20, 2])
    assert n == 9 and um.tolist() == [0, 16384]  # 128 << 18 = 2^25 → 11 bits dropped; 255 >> 11 == 0
    um, n = unify_shifts([200, 100], [-3, -1])
    assert n == 0 and um.tolist() == [1600, 200]  # common shift is never negative: 2^3 folded into M


def test_group_ranges_pads_and_expands() -> None:
    mn = torch.tensor([-1.0, -2.0, -0.5, -4.0, -0.1])
    mx = torch.tensor([1.0, 0.5, 3.0, 0.2, 0.1])
    gmin, gmax, per = group_ranges(mn, mx, 2)
    assert per == 3
    assert gmin.tolist() == [-2.0, -2.0, -2.0, -4.0, -4.0]
    assert gmax.tolist() == [3.0, 3.0, 3.0, 0.2, 0.2] or torch.allclose(gmax, torch.tensor([3.0, 3, 3, 0.2, 0.2]))


def _ratio_fn(wmin: torch.Tensor, wmax: torch.Tensor, s_in: float, s_out: float):
    def fn(groups: int) -> torch.Tensor:
        gmin, gmax, _ = group_ranges(wmin, wmax, groups)
        ws = linear_quant_params(gmin, gmax, 8, "per_channel_symmetric_restricted_range", True).scale
        return torch.tensor(s_out, dtype=torch.float32) / (torch.tensor(s_in, dtype=torch.float32) * ws)
    return fn


def test_unify_shifts_for_aiff_without_fallback() -> None:
    wmax = torch.tensor([0.5, 0.4, 0.6, 0.45])
    res = unify_shifts_for_aiff(_ratio_fn(-wmax, wmax, 40.0, 60.0), 4, 8)
    assert res.groups == 4 and res.group_size == 1 and not res.fell_back
    assert len(set(res.shift.tolist())) == 1 and int(res.multiplier.min()) > 0
    assert (res.mult_dtype, res.shift_dtype) == (Dtype.UINT16, Dtype.INT8)


def test_unify_shifts_for_aiff_falls_back_to_channel_groups() -> None:
    """A channel with a 10^5 times smaller range is zeroed by the common shift → per-2-channel quantization."""
    wmax = torch.tensor([1.0, 1.0, 1.0, 1e-5])
    fn = _ratio_fn(-wmax, wmax, 1.0, 1.0)
    first = unify_shifts(*scale_shift(fn(4), 8)[:2])[0]
    assert int(first.min()) == 0
    res = unify_shifts_for_aiff(fn, 4, 8)
    assert res.fell_back and res.groups == 2 and res.group_size == 2
    assert int(res.multiplier.min()) > 0 and len(set(res.shift.tolist())) == 1
    raw = unify_shifts_for_aiff(fn, 4, 8, unify=False)
    assert raw.groups == 4 and len(set(raw.shift.tolist())) == 2


def test_unify_shifts_for_aiff_single_group_gives_up() -> None:
    res = unify_shifts_for_aiff(lambda g: torch.tensor([1e-12, 1.0]), 2, 8)
    assert res.groups == 1 and int(res.multiplier.min()) == 0


# --- linear_requantize ------------------------------------------------------------------------------------------

def test_eltwise_example_integer_forward() -> None:
    """y = clamp(round_half_even(((a+5)·22917 + (b-15)·22884)·128·2^-22) + 5, -128, 127) on hand-picked inputs."""
    res = eltwise_multipliers(A1["s0"], A1["s1"], A1["s_out"], 8, A1["zp0"], A1["zp1"])
    m_out, m0, m1 = res.scale_value
    cases = [(-128, -128), (127, 127), (0, 0), (10, -20), (-5, 15), (64, -64), (100, 27), (-100, -27)]
    for a, b in cases:
        acc = (a + A1["zp0"]) * m0 + (b + A1["zp1"]) * m1
        y = int(linear_requantize(acc, m_out, res.shift_value, A1["zp_out"], -128, 127))
        assert y == exact_requant(acc, 128, 22, -5, -128, 127)
        fa = (a + 5) / A1["s0"]
        fb = (b - 15) / A1["s1"]
        lo, hi = (-128 - 5) / A1["s_out"], (127 - 5) / A1["s_out"]
        assert abs((y - 5) / A1["s_out"] - max(min(fa + fb, hi), lo)) < 1.01 / A1["s_out"]  # float add ±1 LSB
    assert int(linear_requantize(0, 128, 22, -5, -128, 127)) == 5


def test_requantize_half_to_even_ties() -> None:
    # x·M·2^-s = k + 0.5 exactly
    x = torch.tensor([1, 3, 5, -1, -3], dtype=torch.int64)
    assert linear_requantize(x, 1, 1, 0, -100, 100).tolist() == [0, 2, 2, 0, -2]
    assert linear_requantize_floor(x, 1, 1, 0, -100, 100).tolist() == [0, 1, 2, -1, -2]


def test_requantize_is_exact_for_int32_accumulators() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-(2 ** 31), 2 ** 31 - 1, (2000,), generator=gen, dtype=torch.int64)
    m = torch.randint(1, 32768, (2000,), generator=gen, dtype=torch.int64)
    s = torch.randint(0, 32, (2000,), generator=gen, dtype=torch.int64)
    y = linear_requantize(x.reshape(-1, 1), m, s, 3, -(2 ** 40), 2 ** 40, axis=0)
    for i in range(0, 2000, 37):
        assert int(y[i, 0]) == exact_requant(int(x[i]), int(m[i]), int(s[i]), 3, -(2 ** 40), 2 ** 40)


def test_requantize_per_channel_axis_and_negative_shift() -> None:
    x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    y = linear_requantize(x, torch.tensor([1, 2, 4, 8]), torch.tensor([0, 1, 2, -1]), 0, -1000, 1000, axis=1)
    assert y[:, 3].tolist() == [48, 112, 176]
    assert torch.equal(y[:, :3], x[:, :3])
    yf = linear_requantize_floor(x, torch.tensor([1, 2, 4, 8]), torch.tensor([0, 1, 2, -1]), 0, -1000, 1000, axis=1)
    assert torch.equal(yf, y)


# --- Eltwise ----------------------------------------------------------------------------------------------------

def test_eltwise_example_multipliers() -> None:
    assert scale_shift(A1["s0"], 16)[:2] == (22884, 9)
    assert scale_shift(A1["s1"], 16)[:2] == (22917, 9)
    res = eltwise_multipliers(A1["s0"], A1["s1"], A1["s_out"], 8, A1["zp0"], A1["zp1"])
    assert res.scale_value == [128, 22917, 22884] and res.shift_value == 22
    assert res.scale_type == [Dtype.UINT16] * 3 and res.shift_type == Dtype.INT8 and not res.unified


def test_eltwise_clipping_with_compensation() -> None:
    """Disproportional scales: the larger cross multiplier is shrunk to 32767 and the output ratio compensates."""
    s0, s1, so = 1000.0, 0.5, 40.0
    res = eltwise_multipliers(s0, s1, so, 16, 1, 2)
    m, m0, m1 = res.scale_value
    assert m1 == 32767 and 0 < m0 < 32767
    eff = m * 2.0 ** -res.shift_value
    assert eff * m1 == pytest.approx(so / s1, rel=1e-3)
    assert eff * m0 == pytest.approx(so / s0, rel=0.5 / m0 + 1e-3)


def test_eltwise_negative_output_shift_is_folded() -> None:
    s0, s1, so = 1.0, 1.1, 1e8
    m0, n0, _, _ = scale_shift(s0, 16)
    rscale = so / (s0 * s1) / 2 ** max(n0, scale_shift(s1, 16)[1])
    m, s, _, _ = scale_shift(rscale, 8)
    assert s < 0
    res = eltwise_multipliers(s0, s1, so, 8, 0, 3)
    assert res.shift_value == 0 and res.scale_value[0] == m * 2 ** -s <= 32767
    huge = eltwise_multipliers(s0, s1, 1e10, 8, 0, 3)
    assert huge.shift_value == 0 and huge.scale_value[0] == 32767


def test_eltwise_unified_form_for_equal_scales() -> None:
    add = eltwise_multipliers(20.0, 20.0, 10.0, 8, 3, 3)
    assert add.unified and add.scale_value[1:] == [1, 1]
    assert (add.scale_value[0], add.shift_value) == scale_shift(0.5, 8)[:2]
    sub = eltwise_multipliers(20.0, 20.0, 10.0, 8, 3, 3, method="SUB")
    assert sub.scale_value == [1, 1, 1] and sub.shift_value == 0
    # different zero points, or scales further apart than the threshold, use the full scheme
    assert not eltwise_multipliers(20.0, 20.0, 10.0, 8, 3, 4).unified
    assert not eltwise_multipliers(20.0, 20.5, 10.0, 8).unified
    assert eltwise_multipliers(20.0, 20.5, 10.0, 8, unify_threshold=1.05).unified


# --- biases -----------------------------------------------------------------------------------------------------

def test_bias_quantize_and_clip() -> None:
    b = torch.tensor([0.1, -0.2, 1e6, -1e6, 0.0])
    q, scale = bias_quantize(b, 100.0, 50.0, 16)
    assert scale == 5000.0
    assert q.tolist() == [500, -1000, 32767, -32768, 0]
    q, _ = bias_quantize(b, 100.0, 50.0, 32)
    assert q.tolist() == [500, -1000, 2 ** 31 - 1, -(2 ** 31), 0]
    q, _ = bias_quantize(b, 100.0, 50.0, 32, upstream_float32_clip=True)
    assert q.tolist()[2] == 2 ** 31  # float32(2^31 - 1) == 2^31: the upstream quirk seen in the golden 16-bit IRs


def test_bias_quantize_per_channel_in_float32() -> None:
    b = torch.tensor([1.5, -2.25])
    q, scale = bias_quantize(b, 3.0, torch.tensor([2.0, 4.0]), 32)
    assert torch.equal(scale, torch.tensor([6.0, 12.0])) and q.tolist() == [9, -27]
    big, _ = bias_quantize(torch.tensor([16777217.0 / 3.0]), 3.0, 1.0, 32)
    assert int(big[0]) % 2 == 0  # float32 spacing above 2^24, as upstream


def test_fold_input_zero_point_any_layout() -> None:
    w = torch.arange(2 * 3 * 3 * 4, dtype=torch.int64).reshape(2, 3, 3, 4) - 30  # OHWI
    b = torch.tensor([10, -10])
    out = fold_input_zero_point(b, w, -6)
    assert out.tolist() == [10 - 6 * int(w[0].sum()), -10 - 6 * int(w[1].sum())]
    fc = torch.tensor([[1, 2, 3], [-1, -2, -3]])
    assert fold_input_zero_point(torch.tensor([0.0, 0.0]), fc, 5).tolist() == [30, -30]
    assert fold_input_zero_point(torch.tensor([0, 0]), fc, 2 ** 40, qmin=-100, qmax=100).tolist() == [100, -100]


def test_compress_bias_keeps_top_bits() -> None:
    b = torch.tensor([40000, -3, 5, -40001])
    out, k = compress_bias(b, 16)
    assert k == 1 and out.tolist() == [40000, -4, 4, -40002]  # arithmetic shift: floor toward -inf
    out, k = compress_bias(torch.tensor([123, -77]), 16)
    assert k == 0 and out.tolist() == [123, -77]
    out, k = compress_bias(torch.tensor([2 ** 20, -5]), 16)
    assert k == math.ceil(math.log2(2 ** 20 / 32767)) == 6 and out.tolist() == [2 ** 20, -64]
    # the negative side uses -2^(N-1): -65536 needs only one dropped bit
    assert compress_bias(torch.tensor([-65536, 3]), 16)[1] == 1
    assert compress_bias(torch.tensor([], dtype=torch.int64), 16)[1] == 0


def test_aiff_ahead_shift() -> None:
    acc = torch.tensor([2 ** 40 + 3 * 2 ** 9, -(2 ** 10) - 2 ** 8], dtype=torch.float64)
    bias = torch.tensor([1025, -1025])
    data, remain = aiff_ahead_shift(acc, shift=30, remain_shift=20, bias=bias)
    assert remain == 20
    assert data.tolist() == [2 ** 30 + 2 + 1, -1 + (-2)]  # round-half-even(…) then bias >> 10 (floor)
    data, remain = aiff_ahead_shift(torch.tensor([2.0 ** 40]), shift=10, remain_shift=20)
    assert remain == 10 and data.tolist() == [2 ** 31 - 1]


def test_float32_grid_rounds_beyond_2_24_half_to_even() -> None:
    from quantopt.quant.requant import float32_grid

    v = torch.tensor([5, -(2 ** 24) - 1, 2 ** 24 + 1, 2 ** 24 + 3, -18070759, 2 ** 31 - 1], dtype=torch.int64)
    assert float32_grid(v).tolist() == [5, -(2 ** 24), 2 ** 24, 2 ** 24 + 4, -18070760, 2 ** 31]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mult,shift,zp,qmin,qmax", [(19381, 22, 0, -128, 127), (3, 1, -7, 0, 255),
                                                     (25000, 30, 128, 0, 255), (1, 0, 0, -32768, 32767)])
def test_requantize_in_bands_is_the_whole_requantization(dtype, mult: int, shift: int, zp: int, qmin: int,
                                                         qmax: int) -> None:
    """Bands of 64 elements (a short last one) through one buffer: the integers of the whole accumulator converted
    to float64 and requantized at once, for float32 and float64 accumulators of exact integers (ties included)."""
    g = torch.Generator().manual_seed(shift)
    acc = torch.randint(-(1 << 20), 1 << 20, (3, 7, 29), generator=g).to(dtype)
    acc.view(-1)[:4] = torch.tensor([2 ** (shift - 1) if shift else 0, -(2 ** (shift - 1)) if shift else 0,
                                     3 * 2 ** (shift - 1) if shift else 1, 0], dtype=dtype)
    whole = requantize_float64_(acc.to(torch.float64, copy=True), mult, shift, zp, qmin, qmax)
    banded = requantize_float_in_bands(acc, mult, shift, zp, qmin, qmax, band=64)
    assert banded.dtype == torch.int64 and torch.equal(banded, whole)
    assert torch.equal(requantize_float_in_bands(acc.clone(), mult, shift, zp, qmin, qmax), whole)  # one band
