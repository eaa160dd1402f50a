"""The float forward's 1x1 convolutions of large maps run in bands of rows (ops/_conv_nhwc.py,
PLAIN_BAND_ELEMENTS): every output bit must be the one a single GEMM over all rows gives, with the bias added the
same way, at the shapes of the PP-OCR models, at odd map sizes and at a batch of several samples."""
from __future__ import annotations

import pytest
import torch

import quantopt.ops._conv_nhwc as kernels

SHAPES = [
    ((1, 160, 160, 48), 96), ((1, 160, 160, 96), 24), ((1, 320, 320, 24), 12), ((1, 80, 80, 96), 192),
    ((1, 24, 160, 64), 64), ((1, 75, 75, 48), 96), ((1, 19, 19, 384), 96), ((3, 38, 38, 96), 48),
    ((1, 150, 150, 16), 32), ((2, 41, 59, 120), 360),
]


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return kernels.conv2d_nhwc(x, w, b, (1, 1), (1, 1), (0, 0, 0, 0), 1, dtype=torch.float64)


@pytest.mark.parametrize("shape,out_c", SHAPES)
def test_banded_plain_gemm_equals_one_gemm(shape, out_c, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(out_c + shape[1])
    # magnitudes spread over many binades, so a changed summation order shows in the last bits
    x = (torch.randn(shape, generator=gen) * torch.exp(3 * torch.randn(shape, generator=gen))).float()
    w = torch.randn(out_c, 1, 1, shape[3], generator=gen).float().double()
    b = torch.randn(out_c, generator=gen).float().double()
    assert x.numel() > kernels.PLAIN_BAND_ELEMENTS or out_c * x.numel() // shape[3] > kernels.PLAIN_BAND_ELEMENTS
    banded, banded_no_bias = _conv(x, w, b), _conv(x, w, None)
    monkeypatch.setattr(kernels, "PLAIN_BAND_ELEMENTS", 1 << 62)  # one GEMM over all rows, bias added after
    whole, whole_no_bias = _conv(x, w, b), _conv(x, w, None)
    assert banded.dtype == whole.dtype == torch.float64 and banded.shape == whole.shape
    assert torch.equal(banded, whole)
    assert torch.equal(banded_no_bias, whole_no_bias)


def test_bands_leave_small_and_differentiable_layers_to_one_gemm(monkeypatch) -> None:
    calls = []
    original = kernels._plain_gemm_bands

    def counting(x, w, bias):
        out = original(x, w, bias)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "_plain_gemm_bands", counting)
    w = torch.randn(8, 1, 1, 4).double()
    _conv(torch.randn(1, 4, 4, 4), w, None)  # small
    big = torch.randn(1, 256, 256, 4, requires_grad=True)
    with torch.enable_grad():
        _conv(big, w.requires_grad_(True), None)  # a gradient-based method's forward
    _conv(torch.randn(1, 256, 256, 4), w.detach(), None)
    assert calls == [False, False, True]


@pytest.mark.parametrize("shape,kernel,stride", [((1, 96, 96, 16), 3, 1), ((1, 40, 40, 192), 5, 1),
                                                 ((2, 33, 47, 48), 3, 2), ((1, 64, 64, 24), 3, 1)])
def test_depthwise_bias_added_band_by_band_equals_once(shape, kernel, stride, monkeypatch) -> None:
    """A banded depthwise convolution adds its bias to each band after the band's last tap: the same additions,
    in the same order per element, as one after the whole convolution (one band)."""
    gen = torch.Generator().manual_seed(kernel + shape[3])
    x = (torch.randn(shape, generator=gen) * torch.exp(3 * torch.randn(shape, generator=gen))).float()
    c = shape[3]
    w = torch.randn(c, kernel, kernel, 1, generator=gen).float().double()
    b = torch.randn(c, generator=gen).float().double()
    p = kernel // 2

    def run() -> torch.Tensor:
        return kernels.conv2d_nhwc(x, w, b, (stride, stride), (1, 1), (p, p, p, p), c, dtype=torch.float64)

    monkeypatch.setattr(kernels, "DEPTHWISE_BAND_ELEMENTS", 1 << 12)  # several bands
    banded = run()
    monkeypatch.setattr(kernels, "DEPTHWISE_BAND_ELEMENTS", 1 << 62)  # one band, the bias added after
    whole = run()
    assert torch.equal(banded, whole)


def test_depthwise_on_a_gpu_is_one_band(monkeypatch) -> None:
    """On a GPU (the stand-in device of tests/fake_cuda.py) the depthwise output is one band, each tap one pass over
    all of it (bands there would only multiply kernel launches), with the bits of the CPU's bands."""
    from fake_cuda import CUDA, fake_cuda

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 48, 80, 64, generator=gen)
    w = torch.randn(64, 3, 3, 1, generator=gen).double()
    b = torch.randn(64, generator=gen).double()
    monkeypatch.setattr(kernels, "DEPTHWISE_BAND_ELEMENTS", 1 << 12)  # several bands on the CPU
    calls = []
    rows = kernels._depthwise_rows
    monkeypatch.setattr(kernels, "_depthwise_rows", lambda *a, **k: calls.append(a[4]) or rows(*a, **k))
    on_cpu = kernels.conv2d_nhwc(x, w, b, (1, 1), (1, 1), (1, 1, 1, 1), 64, dtype=torch.float64)
    assert len(calls) > 1
    calls.clear()
    with fake_cuda():
        on_gpu = kernels.conv2d_nhwc(x.to(CUDA), w.to(CUDA), b.to(CUDA), (1, 1), (1, 1), (1, 1, 1, 1), 64,
                                     dtype=torch.float64)
        assert on_gpu.device == CUDA
        on_gpu = on_gpu.cpu()
    assert calls == [(0, 48)]
    assert torch.equal(on_gpu, on_cpu)
