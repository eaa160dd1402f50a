"""Range → quantization parameters, (de)quantization and rounding modes (docs/integer-semantics.md, Conventions)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantopt.quant.dtype import Dtype
from quantopt.quant.params import QuantMode, dequantize, integer_range, linear_quant_params, quantize
from quantopt.quant.rounding import RoundMode, round_by_mode, round_half_away, round_half_even

ALL_MODES = [m.value for m in QuantMode]
LINEAR_MODES = [m for m in QuantMode if not m.is_per_block]


def f32(v: float) -> float:
    return float(np.float32(v))


# --- QuantMode --------------------------------------------------------------------------------------------------

def test_nine_mode_names() -> None:
    assert ALL_MODES == [
        "per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range", "per_tensor_asymmetric",
        "per_channel_symmetric_restricted_range", "per_channel_symmetric_full_range", "per_channel_asymmetric",
        "per_block_symmetric_restricted_range", "per_block_symmetric_full_range", "per_block_asymmetric"]


@pytest.mark.parametrize("mode", list(QuantMode))
def test_mode_properties(mode: QuantMode) -> None:
    name = mode.value
    assert mode.is_per_channel == name.startswith("per_channel")
    assert mode.is_per_block == name.startswith("per_block")
    assert mode.is_per_tensor == name.startswith("per_tensor")
    assert mode.is_symmetric == ("_symmetric" in name)
    assert mode.is_asymmetric == (not mode.is_symmetric)
    assert mode.is_restricted == name.endswith("restricted_range")
    assert mode.is_full_range == (not mode.is_restricted)
    assert QuantMode.from_name(name.upper()) is mode
    assert mode.to_per_channel().is_per_channel and mode.to_per_tensor().is_per_tensor
    assert mode.to_symmetric().is_restricted and mode.to_asymmetric().is_asymmetric


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="per_tensor_asymmetric"):
        QuantMode.from_name("per_tensor_weird")


def test_per_block_is_rejected_by_the_linear_path() -> None:
    with pytest.raises(ValueError, match="per-block"):
        linear_quant_params(-1.0, 1.0, 8, "per_block_asymmetric", True)


# --- integer ranges ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(4, 17))
def test_integer_range(bits: int) -> None:
    assert integer_range(bits, False) == (0, 2 ** bits - 1)
    assert integer_range(bits, False, restricted=True) == (0, 2 ** bits - 1)
    assert integer_range(bits, True) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert integer_range(bits, True, restricted=True) == (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1)


def _expected_dtype(bits: int, signed: bool) -> Dtype:
    table = [(4, Dtype.ALIGNED_INT4, Dtype.ALIGNED_UINT4), (8, Dtype.INT8, Dtype.UINT8),
             (12, Dtype.ALIGNED_INT12, Dtype.ALIGNED_UINT12), (16, Dtype.INT16, Dtype.UINT16)]
    return next(s if signed else u for lim, s, u in table if bits <= lim)


@pytest.mark.parametrize("bits", range(4, 17))
@pytest.mark.parametrize("mode", LINEAR_MODES)
@pytest.mark.parametrize("signed", [True, False])
def test_params_for_all_modes_and_bits(bits: int, mode: QuantMode, signed: bool) -> None:
    fmin, fmax = -1.7, 2.3
    p = linear_quant_params(fmin, fmax, bits, mode, signed)
    qmin, qmax = integer_range(bits, signed, restricted=signed and mode.is_restricted)
    assert (p.qmin, p.qmax) == (qmin, qmax)
    assert p.dtype == _expected_dtype(bits, signed)
    q_range = np.float32(qmax - qmin)
    if mode.is_symmetric:
        f_range = np.float32(max(abs(fmin), abs(fmax))) * np.float32(2.0 if signed else 1.0)
        assert p.zerop == 0
    else:
        f_range = np.float32(fmax - fmin)
        expected_zp = float(np.round(np.float32(q_range / f_range) * np.float32(fmin))) - qmin
        lim = 2 ** (bits - 1) - 1
        assert p.zerop == int(min(max(expected_zp, -lim), lim))
    assert p.scale == float(np.float32(q_range / f_range))
    # zero is representable: quantize(0) dequantizes to exactly 0 whenever the zero point was not clamped
    q0 = quantize(0.0, p.scale, p.zerop, p.qmin, p.qmax)
    if p.qmin <= -p.zerop <= p.qmax:
        assert float(dequantize(q0, p.scale, p.zerop)) == 0.0


def test_symmetric_scales_int8() -> None:
    absmax = 3.5
    assert linear_quant_params(-absmax, 1.0, 8, "per_tensor_symmetric_full_range", True).scale == f32(127.5 / absmax)
    assert linear_quant_params(-absmax, 1.0, 8, "per_tensor_symmetric_restricted_range", True).scale == \
        f32(127 / absmax)
    assert linear_quant_params(0.0, absmax, 8, "per_tensor_symmetric_full_range", False).scale == f32(255 / absmax)


def test_golden_input_scales() -> None:
    """syn_resnet Input: A (EMA min/max of calib.npy, int8 symmetric full range) and B (extrema, asymmetric)."""
    a = linear_quant_params(-4.357547760009766, 3.959796667098999, 8, "per_tensor_symmetric_full_range", True)
    assert (a.scale, a.zerop) == (29.25957679748535, 0)
    b = linear_quant_params(-4.788214683532715, 4.412606239318848, 8, "per_tensor_asymmetric", True)
    assert (b.scale, b.zerop, b.dtype) == (27.71491813659668, -5, Dtype.INT8)


def test_example_asymmetric_params() -> None:
    """Upstream's example: [-2.757944, 2.947409] int8 asymmetric → scale 44.694862, zp 5 (the listed range is
    rounded to 7 digits, so the scale is compared to 2e-7 relative)."""
    p = linear_quant_params(-2.757944, 2.947409, 8, "per_tensor_asymmetric", True)
    assert p.scale == pytest.approx(44.694862, rel=2e-7)
    assert p.zerop == 5 == round(p.scale * -2.757944) + 128
    assert (p.qmin, p.qmax, p.dtype) == (-128, 127, Dtype.INT8)


def test_range_is_forced_to_contain_zero() -> None:
    assert linear_quant_params(1.0, 2.0, 8, "per_tensor_asymmetric", True) == \
        linear_quant_params(0.0, 2.0, 8, "per_tensor_asymmetric", True)
    assert linear_quant_params(-2.0, -1.0, 8, "per_tensor_asymmetric", False) == \
        linear_quant_params(-2.0, 0.0, 8, "per_tensor_asymmetric", False)


@pytest.mark.parametrize("mode", LINEAR_MODES)
def test_degenerate_range_gives_scale_one(mode: QuantMode) -> None:
    for lo, hi in [(0.0, 0.0), (-1e-9, 1e-9), (float("nan"), float("nan"))]:
        p = linear_quant_params(lo, hi, 8, mode, True)
        assert p.scale == 1.0
        # asymmetric: zerop = round(1 * 0) - qmin = 128, clamped to 127 (upstream keeps this quirk)
        assert p.zerop == (127 if mode.is_asymmetric else 0)
    assert linear_quant_params(0.0, 0.0, 8, "per_tensor_asymmetric", False).zerop == 0


def test_zero_point_is_clamped() -> None:
    p = linear_quant_params(-1e9, 1e-3, 8, "per_tensor_asymmetric", False)
    assert p.zerop == -127


def test_per_channel_matches_per_tensor_channel_by_channel() -> None:
    mins = torch.tensor([-1.0, -0.25, 0.0, -3.0])
    maxs = torch.tensor([2.0, 0.5, 0.0, 0.125])
    for mode in ("per_channel_symmetric_restricted_range", "per_channel_symmetric_full_range",
                 "per_channel_asymmetric"):
        p = linear_quant_params(mins, maxs, 8, mode, True)
        assert p.per_channel and p.scale.dtype == torch.float32 and p.zerop.dtype == torch.int64
        for c in range(4):
            s = linear_quant_params(float(mins[c]), float(maxs[c]), 8, mode.replace("channel", "tensor"), True)
            assert (float(p.scale[c]), int(p.zerop[c])) == (s.scale, s.zerop)


# --- quantize / dequantize --------------------------------------------------------------------------------------

def test_quantize_rounds_half_to_even_and_clamps() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75, 100.0, -100.0, float("nan")])
    q = quantize(x, 2.0, 0, -128, 127)
    assert q.tolist() == [0, 2, 2, 0, -2, 127, -128, 0]
    assert q.dtype == torch.int64


def test_quantize_subtracts_the_zero_point() -> None:
    """OPT convention: q = round(scale * x - zerop), x = (q + zerop) / scale."""
    q = quantize(torch.tensor([0.0, 1.0]), 10.0, -5, -128, 127)
    assert q.tolist() == [5, 15]
    assert dequantize(q, 10.0, -5).tolist() == [0.0, 1.0]


def test_quantize_round_modes() -> None:
    x = torch.tensor([0.5, 1.5, -0.5, -1.5, 0.2, -0.2])
    assert quantize(x, 1.0, 0, -9, 9, round_mode="NEAREST").tolist() == [1, 2, -1, -2, 0, 0]
    assert quantize(x, 1.0, 0, -9, 9, round_mode="FLOOR").tolist() == [0, 1, -1, -2, 0, -1]
    assert quantize(x, 1.0, 0, -9, 9, round_mode="CEIL").tolist() == [1, 2, 0, -1, 1, 0]
    assert quantize(x, 1.0, 0, -9, 9, round_mode="TRUNC").tolist() == [0, 1, 0, -1, 0, 0]


def test_per_channel_quantize_and_dequantize_along_axis() -> None:
    x = torch.ones(2, 3, 4)
    scale = torch.tensor([1.0, 2.0, 4.0])
    zp = torch.tensor([0, 1, -1])
    q = quantize(x, scale, zp, -128, 127, axis=1)
    assert q[0, :, 0].tolist() == [1, 1, 5]
    assert torch.allclose(dequantize(q, scale, zp, axis=1), x)
    assert quantize(x, scale, zp, -128, 127, axis=-2).tolist() == q.tolist()


def test_quantize_accepts_numpy_and_numbers() -> None:
    assert quantize(np.array([1.0, 2.0]), 3.0, 0, 0, 255).tolist() == [3, 6]
    assert int(quantize(0.5, 3.0, 0, 0, 255)) == 2


def test_float32_versus_float64_quantize() -> None:
    """float32 (upstream) decides this tie differently from exact arithmetic: 0.1f * 5 rounds to exactly 0.5."""
    x = torch.tensor([0.1], dtype=torch.float32)
    assert int(quantize(x, 5.0, 0, -128, 127)[0]) == 0  # float32: 0.1f*5 == 0.5 → round half even → 0
    assert int(quantize(x, 5.0, 0, -128, 127, compute_dtype=torch.float64)[0]) == 1  # 0.50000000745 → 1


# --- rounding ---------------------------------------------------------------------------------------------------

def test_round_half_even_and_away() -> None:
    xs = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999999999999996]
    assert [round_half_even(v) for v in xs] == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 2.0]
    assert [round_half_away(v) for v in xs] == [1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 2.0]


def test_nearest_is_exact_below_one_half() -> None:
    """floor(|x| + 0.5) would give 1 for the largest double below 0.5."""
    below = math.nextafter(0.5, 0.0)
    assert round_half_away(below) == 0.0
    assert round_half_away(-below) == 0.0
    big = 2.0 ** 52 + 1.0  # integers stay integers
    assert round_half_away(big) == big


def test_round_modes_keep_the_container_kind() -> None:
    assert isinstance(round_by_mode(np.array([1.5]), "CEIL"), np.ndarray)
    assert isinstance(round_by_mode(torch.tensor([1.5]), "FLOOR"), torch.Tensor)
    ints = torch.tensor([3, -4])
    assert round_by_mode(ints, "NEAREST") is ints
    assert RoundMode.from_name("round_to_even") is RoundMode.ROUND_TO_EVEN
    assert RoundMode.from_name("bogus") is RoundMode.ROUND_TO_EVEN
    assert round_by_mode(torch.tensor([2.5], dtype=torch.float64), RoundMode.TRUNC).tolist() == [2.0]


def test_a_zero_point_of_zero_is_not_subtracted_and_changes_nothing() -> None:
    """quantize skips the subtraction of a zero point given as the number 0 (symmetric params): the same integers
    as subtracting it (given as a tensor, which always subtracts), signed zeros, NaN, ties and the stepped path of
    large tensors included."""
    special = torch.tensor([-0.0, 0.0, 0.5, 1.5, 2.5, -2.5, float("nan"), float("inf"), -float("inf"), 1e30, 3.4e38])
    large = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 100
    for x in (special, large):
        for scale in (1.0, 0.37, torch.tensor([2.0])):
            want = quantize(x, scale, torch.tensor(0.0), -128, 127)
            for zp in (0, 0.0, np.int64(0)):
                assert torch.equal(quantize(x, scale, zp, -128, 127), want)


def test_dequantize_into_with_a_zero_point_of_zero_is_dequantize() -> None:
    """`dequantize_factors` gives no zero point for 0 (nothing to add to integers); `dequantize_into` then gives
    `dequantize`'s float32 bits, a float input's -0.0 turned into 0.0 as the addition of 0 does."""
    from quantopt.quant.params import dequantize_factors, dequantize_into

    ints = torch.randint(-32768, 32768, (1000,), generator=torch.Generator().manual_seed(4))
    floats = torch.tensor([-0.0, 0.0, 3.0, -7.0])
    for scale in (0.37, 1.0, 123.456):
        zp, inverse = dequantize_factors(scale, 0, torch.device("cpu"))
        assert zp is None
        for q in (ints, floats):
            got = dequantize_into(torch.empty(q.shape), q, zp, inverse)
            assert torch.equal(got.view(torch.int32), dequantize(q, scale, 0).view(torch.int32))
        zp, inverse = dequantize_factors(scale, 5, torch.device("cpu"))
        assert torch.equal(dequantize_into(torch.empty(ints.shape), ints, zp, inverse), dequantize(ints, scale, 5))
