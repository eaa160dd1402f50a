"""Cosine similarity and MSE (quant/compare.py): golden values, the streamed float64 sums against a direct float64
reference, and the fused forms (several tensors against one, integers dequantized step by step) against the plain
one, bit for bit."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantopt.quant import compare
from quantopt.quant.compare import Dequantized, StepBuffers, cosine, cosine_and_mse, cosines_and_mses, mse
from quantopt.quant.params import dequantize


def test_golden_values() -> None:
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == 0.0
    assert cosine(torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0])) == 1.0
    assert cosine(torch.tensor([3.0, 4.0]), torch.tensor([-3.0, -4.0])) == -1.0
    assert cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert cosine(torch.zeros(3), torch.ones(3)) == 0.0
    assert mse(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 6.0])) == (4.0 + 9.0) / 3
    assert cosine_and_mse(torch.empty(0), torch.empty(0)) == (1.0, 0.0)
    assert math.isnan(cosine(torch.tensor([float("nan"), 1.0]), torch.ones(2)))


@pytest.mark.parametrize("kind", ["close", "independent", "opposite", "scaled"])
def test_streamed_sums_match_a_float64_reference(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """x.y is derived from x.x, y.y and (x-y).(x-y): the cosine stays within float64 rounding of the direct one
    whether the vectors are close (the usual case) or far apart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_007, generator=g)
    noise = torch.randn(10_007, generator=g)
    y = {"close": x + 1e-3 * noise, "independent": noise, "opposite": -x + 1e-2 * noise, "scaled": 3 * x}[kind]
    xd, yd = x.double().numpy(), y.double().numpy()
    want_cos = float(np.dot(xd, yd) / (np.linalg.norm(xd) * np.linalg.norm(yd)))
    want_mse = float(np.mean((xd - yd) ** 2))
    for step in (64, 1000, 1 << 17):
        monkeypatch.setattr(compare, "STEP_ELEMENTS", step)
        cos, err = cosine_and_mse(x, y)
        assert cos == pytest.approx(want_cos, rel=1e-14, abs=1e-14)
        assert err == pytest.approx(want_mse, rel=1e-12)


@pytest.mark.parametrize("step", [64, 1 << 17])
def test_fused_forms_equal_the_plain_one(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    monkeypatch.setattr(compare, "STEP_ELEMENTS", step)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, 25, generator=g) * 7
    q1 = torch.randint(-128, 128, (3, 40, 25), generator=g)
    q2 = torch.randint(0, 256, (3, 40, 25), generator=g)
    floats = x + torch.randn(3, 40, 25, generator=g)
    plain = [cosine_and_mse(x, dequantize(q1, 17.5, 0)), cosine_and_mse(x, dequantize(q2, 9.25, -128)),
             cosine_and_mse(x, floats)]
    buffers = StepBuffers()
    fused = cosines_and_mses(x, [Dequantized(q1, 17.5, 0), Dequantized(q2, 9.25, -128), floats], buffers)
    assert fused == plain
    assert cosines_and_mses(x, [floats], buffers) == plain[2:]  # the buffers are reused, not changed in meaning


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_dequantized_steps_round_as_dequantize(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Integers whose dequantized floats round in float32 (beyond 2^24 after the zero point, where the int16 range
    allows) compare as `dequantize`'s values, step by step into the reused float32 buffer."""
    monkeypatch.setattr(compare, "STEP_ELEMENTS", 96)
    g = torch.Generator().manual_seed(5)
    info = torch.iinfo(dtype)
    q = torch.randint(max(info.min, -(1 << 26)), min(info.max, 1 << 26), (1000,), generator=g).to(dtype)
    x = dequantize(q, 0.37, 12345) + torch.randn(1000, generator=g)
    assert cosines_and_mses(x, [Dequantized(q, 0.37, 12345)], StepBuffers()) == \
        [cosine_and_mse(x, dequantize(q, 0.37, 12345))]


def test_reused_buffers_keep_each_comparisons_params() -> None:
    """A caller's buffers form each (scale, zero point)'s factors once: comparisons with other params on the same
    buffers still dequantize with their own."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-100, 100, (500,), generator=g)
    x = torch.randn(500, generator=g)
    buffers = StepBuffers()
    for scale, zerop in ((0.5, 3), (0.5, 7), (0.25, 3), (0.5, 3)):
        want = cosine_and_mse(x, dequantize(q, scale, zerop))
        assert cosines_and_mses(x, [Dequantized(q, scale, zerop)], buffers) == [want]


def test_mismatched_sizes_are_an_error() -> None:
    with pytest.raises(ValueError, match="4 and 5"):
        cosine(torch.ones(4), torch.ones(5))
    with pytest.raises(ValueError, match="0 and 2"):
        cosines_and_mses(torch.empty(0), [Dequantized(torch.ones(2, dtype=torch.int64), 1.0, 0)])


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300_000, generator=g)
    y = x + torch.randn(300_000, generator=g) * 1e-2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cosine_and_mse(x, y)
        torch.set_num_threads(2)
        two = cosine_and_mse(x, y)
    finally:
        torch.set_num_threads(before)
    assert one == two
