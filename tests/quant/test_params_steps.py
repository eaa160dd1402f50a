"""quantize and dequantize step through large tensors in cache-sized pieces (quant/params.py, CHUNK_ELEMENTS): the
stepped results must equal the whole-tensor arithmetic element for element, for every parameter layout the stepped
path takes and the ones it must leave to the whole-tensor path."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

from quantopt.quant import params
from quantopt.quant.params import dequantize, quantize
from quantopt.quant.rounding import RoundMode


def both(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], torch.Tensor]) -> tuple:
    """(whole-tensor result, stepped result with steps of 64 elements)."""
    monkeypatch.setattr(params, "CHUNK_ELEMENTS", 1 << 40)
    whole = fn()
    monkeypatch.setattr(params, "CHUNK_ELEMENTS", 64)
    return whole, fn()


def values(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 40
    flat = x.view(-1)
    flat[::97] = float("nan")
    flat[5::101] = float("inf")
    flat[7::103] = -float("inf")
    flat[11::37] = torch.round(flat[11::37]) + 0.5  # ties for the rounding modes
    return x


@pytest.mark.parametrize("mode", list(RoundMode))
@pytest.mark.parametrize("case", ["per_tensor", "last_axis", "last_axis_flat_params", "axis0", "strided",
                                  "float64", "numpy", "columns_wider_than_a_step"])
def test_stepped_quantize_equals_whole(monkeypatch: pytest.MonkeyPatch, case: str, mode: RoundMode) -> None:
    shape = (3, 50, 24) if case != "columns_wider_than_a_step" else (4, 300)
    x: Any = values(shape, 1)
    channels = shape[-1]
    scale: Any = 3.7
    zerop: Any = -5
    axis = None
    if case in ("last_axis", "columns_wider_than_a_step"):
        scale, zerop, axis = torch.linspace(0.5, 9.0, channels), torch.arange(channels) - 7, -1
    elif case == "last_axis_flat_params":  # axis None: 1-d params broadcast along the last axis
        scale, zerop = torch.linspace(0.5, 9.0, channels), torch.arange(channels) - 7
    elif case == "axis0":
        scale, zerop, axis = torch.linspace(0.5, 9.0, shape[0]), torch.arange(shape[0]) - 1, 0
    elif case == "strided":
        x = x.transpose(0, 2)
    elif case == "float64":
        x = x.to(torch.float64)
    elif case == "numpy":
        x = x.numpy()
    whole, stepped = both(monkeypatch, lambda: quantize(x, scale, zerop, -128, 127, mode, axis=axis))
    assert stepped.dtype == torch.int64 and stepped.shape == whole.shape
    assert torch.equal(stepped, whole)


@pytest.mark.parametrize("mode", list(RoundMode))
@pytest.mark.parametrize("bits", [8, 16, 24])
def test_codes_through_int32_equal_the_direct_conversion(monkeypatch: pytest.MonkeyPatch, mode: RoundMode,
                                                         bits: int) -> None:
    """float32 codes within ±2^24 reach int64 by way of int32 (NARROW_CODES); with that route off (the direct
    float32 -> int64 conversion) every code is the same: NaN, ±inf, ties and both clamps included."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    x = values((3, 50, 24), 2) * (1 << max(0, bits - 8))
    for scale, zerop in ((3.7, -5), (0.01, 0)):
        narrow = quantize(x, scale, zerop, lo, hi, mode)
        monkeypatch.setattr(params, "NARROW_CODES", -1)
        direct = quantize(x, scale, zerop, lo, hi, mode)
        monkeypatch.undo()
        assert narrow.dtype == torch.int64 and torch.equal(narrow, direct)
        assert int(narrow.min()) == lo and int(narrow.max()) == hi  # both clamps reached


@pytest.mark.parametrize("case", ["per_tensor", "last_axis", "axis0", "strided", "float_input", "int32"])
def test_stepped_dequantize_equals_whole(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-(1 << 20), 1 << 20, (3, 50, 24), generator=g)  # beyond 2^24 after the zero point: rounding
    q[0, 0, :4] = torch.tensor([(1 << 24) + 1, -(1 << 25) - 3, 0, 1 << 40])
    scale: Any = 0.37
    zerop: Any = 12345
    axis = None
    if case == "last_axis":
        scale, zerop, axis = torch.linspace(0.01, 9.0, 24), torch.arange(24) * 1000, -1
    elif case == "axis0":
        scale, zerop, axis = torch.tensor([0.5, 3.0, 7.0]), torch.tensor([1, -2, 3]), 0
    elif case == "strided":
        q = q.transpose(0, 2)
    elif case == "float_input":
        q = q.to(torch.float32)
    elif case == "int32":
        q = q.to(torch.int32)
    before = q.clone()
    whole, stepped = both(monkeypatch, lambda: dequantize(q, scale, zerop, axis=axis))
    assert stepped.dtype == torch.float32 and stepped.shape == whole.shape
    assert torch.equal(stepped, whole)
    assert torch.equal(q, before)  # the caller's tensor is never changed in place


def test_steps_cover_every_row_once() -> None:
    rows = torch.empty(1000, 7)
    seen = np.zeros(1000, dtype=int)
    for part in params._steps(rows):
        seen[part] += 1
    assert (seen == 1).all()


RANGE_ENDS = [0.0, -0.0, 1e-45, -1e-45, 1.1920929e-07, 1.1920928e-07, 5.96e-08, 3.4e38, -3.4e38, 1e39, -1e39,
              2.5, -2.5, 0.5, 127.5, 1e-30, 65535.0, 1 / 3, float("nan"), float("inf"), -float("inf"), 1.69e38,
              -1.69e38, 8.5e37, 1.7e38, 2.0 ** -126, 6.0e-39]


@pytest.mark.parametrize("mode", ["per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range",
                                  "per_tensor_asymmetric"])
@pytest.mark.parametrize("bits", [1, 2, 8, 16, 25, 32])
def test_per_tensor_params_on_python_floats_equal_the_tensor_path(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                                  bits: int) -> None:
    """linear_quant_params' per-tensor scale and zero point on Python floats (`_per_tensor_params`) are those of its
    float32 tensor arithmetic, for ranges over the whole float32 range, its ends, subnormals, NaN and infinities."""
    rng = np.random.default_rng(bits)
    found = list(rng.standard_normal(120) * 10.0 ** rng.integers(-45, 39, 120)) + RANGE_ENDS
    pairs = [(a, b) for a in RANGE_ENDS for b in RANGE_ENDS] + [tuple(rng.choice(found, 2)) for _ in range(150)]
    fast = [[params.linear_quant_params(lo, hi, bits, mode, signed) for lo, hi in pairs] for signed in (True, False)]
    monkeypatch.setattr(params, "_per_tensor_params", lambda *args: None)
    for signed, got in zip((True, False), fast):
        for (lo, hi), g in zip(pairs, got):
            w = params.linear_quant_params(lo, hi, bits, mode, signed)
            assert type(g.scale) is float and type(g.zerop) is int
            assert (g.scale == w.scale or (np.isnan(g.scale) and np.isnan(w.scale))) and g.zerop == w.zerop, \
                (lo, hi, signed, g, w)
            assert (g.qmin, g.qmax, g.dtype) == (w.qmin, w.qmax, w.dtype)
