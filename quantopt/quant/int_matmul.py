"""Exact integer matrix products on any torch device.

CUDA has no int64 GEMM (`matmul`, `addmm`, `baddbmm` refuse Long tensors there), and the CPU's is not a BLAS
kernel: 10-40x slower than its float64 GEMM on the same shapes. Integer products of the integer forward are
therefore computed as float64 GEMMs wherever a bound proves every partial sum an integer below 2^53 (then any
summation order gives the exact result, the int64 GEMM's), on the CPU in int64 otherwise.
"""
from __future__ import annotations

import torch

from .rounding import FLOAT64_EXACT


def _absmax(x: torch.Tensor) -> int:
    return int(x.abs().max()) if x.numel() else 0


def exact_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 `a @ b` (torch.matmul's broadcasting), exact on every device; the result is on `a`'s device."""
    a, b = a.to(torch.int64), b.to(torch.int64)
    k = int(a.shape[-1]) if a.dim() else 1
    if k * _absmax(a) * _absmax(b) < FLOAT64_EXACT:
        return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int64)
    if a.device.type == "cpu":
        return torch.matmul(a, b)
    return torch.matmul(a.cpu(), b.cpu()).to(a.device)
