"""exact_int_matmul: int64 products equal to the CPU's int64 GEMM, in float64 wherever the bound allows."""
from __future__ import annotations

import pytest
import torch
from fake_cuda import fake_cuda

from quantopt.quant.int_matmul import exact_int_matmul

SHAPES = [((3, 5), (5, 4)), ((2, 3, 5), (5, 4)), ((2, 3, 5), (2, 5, 1)), ((5,), (5, 2))]


@pytest.mark.parametrize("shape_a,shape_b", SHAPES)
@pytest.mark.parametrize("hi", [2 ** 15, 2 ** 40])
def test_cpu_gives_the_int64_gemm(shape_a, shape_b, hi: int) -> None:
    """Within the float64 bound and beyond it (2^40 · 2^15 · 5 > 2^53, int64 then), the int64 GEMM's values."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-hi, hi, shape_a, generator=g)
    b = torch.randint(-32768, 32768, shape_b, generator=g)
    got = exact_int_matmul(a, b)
    assert got.dtype == torch.int64 and torch.equal(got, torch.matmul(a, b))


@pytest.mark.parametrize("big", [False, True])
def test_device_result_is_exact(big: bool) -> None:
    """Within the float64 bound the device computes in float64; beyond it (2^40 · 2^20 · 8 > 2^53) the CPU does."""
    g = torch.Generator().manual_seed(1)
    hi = 2 ** 40 if big else 2 ** 15
    a = torch.randint(-hi, hi, (4, 8), generator=g)
    b = torch.randint(-2 ** 20, 2 ** 20, (8, 3), generator=g)
    want = torch.matmul(a, b)
    with fake_cuda():
        got = exact_int_matmul(a.to("cuda"), b.to("cuda"))
        assert got.device.type == "cuda" and got.dtype == torch.int64
        got = got.cpu()
    assert torch.equal(got, want)
