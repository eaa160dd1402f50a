"""Exact integer matrix products on any torch device.

CUDA has no int64 GEMM (`matmul`, `addmm`, `baddbmm` refuse Long tensors there). Integer products of the integer
forward are therefore computed as float64 GEMMs where a bound proves every partial sum an integer below 2^53
(then any summation order gives the exact result), and on the CPU in int64 otherwise. On the CPU the int64 GEMM
is used as before, so CPU results do not change.
"""
from __future__ import annotations

import torch

from .rounding import FLOAT64_EXACT


def _absmax(x: torch.Tensor) -> int:
    return int(x.abs().max()) if x.numel() else 0


def exact_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 `a @ b` (torch.matmul's broadcasting), exact on every device; the result is on `a`'s device."""
    a, b = a.to(torch.int64), b.to(torch.int64)
    if a.device.type == "cpu":
        return torch.matmul(a, b)
    k = int(a.shape[-1]) if a.dim() else 1
    if k * _absmax(a) * _absmax(b) < FLOAT64_EXACT:
        return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int64)
    return torch.matmul(a.cpu(), b.cpu()).to(a.device)
