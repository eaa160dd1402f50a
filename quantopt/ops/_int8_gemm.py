"""Exact int8 GEMMs for the integer forward: torch's integer matrix product with int32 sums, where it is exact.

Products of two int8 values are at most 2^14 in magnitude, so int32 sums of up to INT8_MAX_TERMS of them are
exact, whatever the summation order. On CPUs with vector-neural-network instructions torch's int8 GEMM runs at many
times a float GEMM's rate (docs/performance.md, "Integer GEMMs"). Some CPU kernels are not exact, though: without
those instructions (or with DNNL_MAX_CPU_ISA capping oneDNN at AVX2) the 8-bit multiply-add sums pairs of products
into saturating 16-bit lanes. `int8_gemm_exact` therefore probes the kernel once per process on operands that
overflow such lanes, and the integer forward uses the int8 GEMM only where the probe found it exact.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

INT8_MAX_TERMS = (1 << 31) // (1 << 14) - 1
"""The longest int8 dot product int32 holds exactly."""


def int8_gemm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> [M, N] int32; exact for K <= INT8_MAX_TERMS where `int8_gemm_exact()`."""
    return torch._int_mm(a, b, out=out) if out is not None else torch._int_mm(a, b)


def _probe_operands() -> list:
    """(a, b) pairs whose products fill a 16-bit pair sum past its range, in every sign combination, at lengths
    with and without a tail after blocks of 4, 16 and 64, and at random extremes."""
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for m, k, n in ((4, 64, 4), (17, 67, 9), (3, 1031, 5), (33, 256, 48)):
        for va, vb in ((127, 127), (-128, -128), (-128, 127), (127, -128)):
            pairs.append((torch.full((m, k), va, dtype=torch.int8), torch.full((k, n), vb, dtype=torch.int8)))
        extremes = torch.tensor([-128, -127, 127], dtype=torch.int8)
        pairs.append((extremes[torch.randint(0, 3, (m, k), generator=gen)],
                      extremes[torch.randint(0, 3, (k, n), generator=gen)]))
        pairs.append((torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8),
                      torch.randint(-128, 128, (k, n), generator=gen, dtype=torch.int8)))
    return pairs


@functools.cache
def int8_gemm_exact() -> bool:
    """Whether torch's CPU int8 GEMM gives the exact integer products in this process (its kernels are fixed when
    the process starts: CPU features, DNNL_MAX_CPU_ISA). False also where torch has no CPU int8 GEMM."""
    if not hasattr(torch, "_int_mm"):
        return False
    for a, b in _probe_operands():
        try:
            got = int8_gemm(a, b)
        except RuntimeError:  # a torch build without a CPU kernel for it: the float kernels stay
            return False
        if not torch.equal(got.to(torch.int64), a.to(torch.int64) @ b.to(torch.int64)):
            return False
    return True
