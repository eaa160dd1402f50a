"""Exact int8 GEMMs for the integer forward: torch's integer matrix product with int32 sums, where it is exact.

Products of two int8 values are at most 2^14 in magnitude, so int32 sums of up to INT8_MAX_TERMS of them are
exact, whatever the summation order. On CPUs with vector-neural-network instructions torch's int8 GEMM runs at many
times a float GEMM's rate (docs/performance.md, "Integer GEMMs"). Some CPU kernels are not exact, though: without
those instructions (or with DNNL_MAX_CPU_ISA capping oneDNN at AVX2) the 8-bit multiply-add sums pairs of products
into saturating 16-bit lanes. `int8_gemm_exact` therefore probes the kernel once per process on operands that
overflow such lanes. Other kernels are exact but slow: on a CPU without those instructions (AVX2 only) torch's
int8 GEMM ran at a fifteenth of the float64 GEMM's speed and made the integer forward twenty times slower.
`int8_gemm_fast` therefore times it once per process against torch's float32 GEMM of the same shape, and the
integer forward uses the int8 GEMM only where it is both exact and faster (`int8_gemm_used`); the integers are the
same either way.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..quant.int_matmul import exact_int_matmul
from ..quant.rounding import FLOAT64_EXACT

INT8_MAX_TERMS = (1 << 31) // (1 << 14) - 1
"""The longest int8 dot product int32 holds exactly."""


def int8_gemm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> [M, N] int32; exact for K <= INT8_MAX_TERMS where `int8_gemm_exact()`.
    Operands are passed in a plain row- or column-major layout (`_plain`)."""
    a, b = _plain(a), _plain(b)
    return torch._int_mm(a, b, out=out) if out is not None else torch._int_mm(a, b)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` [R, C] itself when its strides are row-major (C, 1), or column-major (1, R) with both sizes above 1;
    else a row-major copy. torch's CPU int8 GEMM reads other strides wrongly: a [1, N] view with strides (1, 1),
    which torch counts as contiguous (the transpose of an [N, 1] weight), gave values from outside the tensor."""
    rows, cols = (int(s) for s in t.shape)
    if t.stride() == (cols, 1) or (rows > 1 and cols > 1 and t.stride() == (1, rows)):
        return t
    return torch.empty((rows, cols), dtype=t.dtype, device=t.device).copy_(t)


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


SPEED_PROBE_SHAPE = (128, 256, 256)
"""(M, K, N) of the product `int8_gemm_fast` times: the size of a middle convolution's GEMM."""
SPEED_PROBE_RUNS = 3
"""Timed int8 runs at most; the first one clearly faster or clearly slower than float32 decides."""


def _best_seconds(fn: Callable[[], object], runs: int = 3) -> float:
    fn()  # the first call may allocate or pick kernels
    best = float("inf")
    for _ in range(runs):
        best = min(best, _seconds(fn))
    return best


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@functools.cache
def int8_gemm_fast() -> bool:
    """Whether torch's CPU int8 GEMM beats its float32 GEMM on a product of SPEED_PROBE_SHAPE in this process.
    With vector-neural-network instructions it ran at 5-10x the float32 rate, on an AVX2-only CPU at 1/36 of it:
    the margin either way is far beyond timing noise, and either choice gives the same integers. An int8 run
    faster than float32's best decides yes, one more than three times slower decides no (where the kernel is slow
    the probe then costs two of its runs: about 20 ms on that CPU)."""
    m, k, n = SPEED_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (k, n), generator=gen, dtype=torch.int8)
    af, bf = a.to(torch.float32), b.to(torch.float32)
    float32 = _best_seconds(lambda: torch.mm(af, bf))
    int8_gemm(a, b)  # the first call may allocate or pick kernels
    for _ in range(SPEED_PROBE_RUNS):
        t = _seconds(lambda: int8_gemm(a, b))
        if t < float32:
            return True
        if t > 3 * float32:
            return False
    return False


def int8_gemm_used() -> bool:
    """Whether the integer forward takes the int8 GEMM in this process: exact (`int8_gemm_exact`) and faster than
    the float kernels it replaces (`int8_gemm_fast`)."""
    return int8_gemm_exact() and int8_gemm_fast()


@dataclass(frozen=True)
class Int8Operand:
    """Integer values x written as int8 parts: x = sum of factor·part, plus `offset`. Each part carries its share of
    the padding value, so a padded convolution of x is the same sum of the parts' padded convolutions; a product
    with weights w is sum(factor·(part·w)) + offset·sum(w), exactly."""

    parts: Tuple[Tuple[torch.Tensor, int, int], ...]
    """(int8 values, their factor, their padding value)."""
    offset: int
    absmax: int
    """The largest |x| among the values and the padding value (as checked): |x·w| <= absmax · sum |w|."""


def split_int8(x: torch.Tensor, pad: int = 0) -> Optional[Int8Operand]:
    """Integer x (and a padding value `pad`) as int8 parts: one part where the values fit int8 as they are or less
    128 (uint8), two (high and low byte) where they fit int16 as they are or less 32768 (uint16); None otherwise.
    The values are checked, not assumed from the tensor's range."""
    if x.numel() == 0 or x.is_floating_point():
        return None
    lo, hi = (int(v) for v in torch.aminmax(x))
    lo, hi = min(lo, pad), max(hi, pad)
    absmax = max(-lo, hi)
    for offset in (0, 128):
        if lo - offset >= -128 and hi - offset <= 127:
            part = x if offset == 0 else x.to(torch.int32) - offset
            return Int8Operand(((part.to(torch.int8), 1, pad - offset),), offset, absmax)
    for offset in (0, 32768):
        if lo - offset >= -32768 and hi - offset <= 32767:
            wide = x.to(torch.int32) - offset if offset else x.to(torch.int32)
            high = (wide >> 8).to(torch.int8)
            low = (wide & 255).sub_(128).to(torch.int8)  # x - offset = 256·high + (low + 128)
            p = pad - offset
            return Int8Operand(((high, 256, p >> 8), (low, 1, (p & 255) - 128)), offset + 128, absmax)
    return None


def int8_accumulate(operand: Int8Operand, weight_sums: torch.Tensor,
                    product: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """The exact accumulator x·w as float64: the sum over `operand`'s parts of factor · product(part, its padding
    value) (an int8 GEMM or convolution with the weights), plus offset · `weight_sums` (per output channel, last
    axis)."""
    products = [(product(part, pad), factor) for part, factor, pad in operand.parts]
    if len(products) > 1 and all(y.dtype == torch.int32 for y, _ in products):
        combined = _combined_int32(products, weight_sums, operand.offset)
        if combined is not None:
            return combined
    acc: Optional[torch.Tensor] = None
    for y, factor in products:
        y = y.to(torch.float64)
        acc = (y if factor == 1 else y.mul_(factor)) if acc is None else acc.add_(y, alpha=factor)
    assert acc is not None
    return acc.add_(weight_sums.to(torch.float64), alpha=operand.offset) if operand.offset else acc


def _combined_int32(products: List[Tuple[torch.Tensor, int]], weight_sums: torch.Tensor,
                    offset: int) -> Optional[torch.Tensor]:
    """`int8_accumulate`'s sum of several int32 products (a 16-bit operand's high and low bytes) formed in int32 and
    converted to float64 once, where the products' extrema prove every partial sum within int32; None otherwise.
    Half the bytes of the float64 combination's passes: at 16 bits a 3136x96 by 96x384 FullyConnected spent more
    time combining than in its two GEMMs."""
    bound = abs(offset) * (int(weight_sums.abs().max()) if weight_sums.numel() else 0)
    for y, factor in products:
        lo, hi = (int(v) for v in torch.aminmax(y))
        bound += abs(factor) * max(-lo, hi)
    if bound >= 2 ** 31:
        return None
    (first, factor), rest = products[0], products[1:]
    acc = first.mul_(factor) if factor != 1 else first  # the products are this call's own tensors
    for y, f in rest:
        acc.add_(y, alpha=f)
    if offset:
        acc.add_(weight_sums.to(torch.int32), alpha=offset)
    return acc.to(torch.float64)


INT8_MATMUL_MIN_WEIGHTS = 1 << 13
"""Least weight-matrix size (K·N) for which `IntMatmul` takes the int8 GEMM: below it torch's int64 product of a
few rows costs less than splitting the operand into int8 parts."""


class IntMatmul:
    """`exact_int_matmul(a, w)` for one integer weight matrix w [K, N] that many products read (a recurrent cell's
    steps): through torch's int8 GEMM where w fits int8, the GEMM is used in this process (`int8_gemm_used`), the
    operand fits int16 and w is large enough to gain (INT8_MATMUL_MIN_WEIGHTS); else a float64 GEMM where a bound
    proves it exact (`_float64_product`), torch's int64 product otherwise. The same int64 values every way
    (`int8_accumulate`: int32 sums of int8 products, combined exactly in float64). Why: torch's int64 matrix
    product reads eight bytes per weight; at one row per step a 256 x 1024 weight matrix took 132 us per product,
    the int8 GEMM 4 us."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.to(torch.int64)
        # max over the output columns of sum |w|: |a @ w| <= max|a| * col_absmax
        self.col_absmax = int(self.w.abs().sum(dim=0).max()) if self.w.dim() == 2 and self.w.numel() else 0
        self.w8: Optional[torch.Tensor] = None
        self.sums: Optional[torch.Tensor] = None
        self.w64: Optional[torch.Tensor] = None
        if self.w.dim() != 2 or self.w.device.type != "cpu" or self.w.numel() < INT8_MATMUL_MIN_WEIGHTS \
                or int(self.w.shape[0]) > INT8_MAX_TERMS // 2 or not int8_gemm_used():
            return
        lo, hi = (int(v) for v in torch.aminmax(self.w))
        if -128 <= lo and hi <= 127:
            self.w8 = self.w.to(torch.int8).t().contiguous().t()  # column-major: the faster layout of the GEMM
            self.sums = self.w.sum(dim=0)

    def _float64_product(self, a: torch.Tensor, bound: Optional[int]) -> torch.Tensor:
        """a @ w as a float64 GEMM where max|a| · (max column sum of |w|) < 2^53 proves every partial sum exact,
        with w converted once (`exact_int_matmul` would look at the whole of w on every call); else
        `exact_int_matmul`. Why: without the int8 GEMM a recurrent cell's steps took the int64 product."""
        if a.is_floating_point() or self.w.dim() != 2:
            return exact_int_matmul(a, self.w)
        a_max = bound if bound is not None else (int(a.abs().max()) if a.numel() else 0)
        if a_max * self.col_absmax >= FLOAT64_EXACT:
            return exact_int_matmul(a, self.w)
        if self.w64 is None or self.w64.device != a.device:
            self.w64 = self.w.to(device=a.device, dtype=torch.float64)
        return torch.matmul(a.to(torch.float64), self.w64).to(torch.int64)

    def _float64_gemm(self, a: torch.Tensor, bound: int) -> Optional[torch.Tensor]:
        """a @ w as float64 integers (`a`: int64, or float64 holding integers, with max |a| <= `bound`) where this
        product is the float64 GEMM (`__call__` takes no int8 GEMM and the bound proves it exact), else None: a
        recurrent cell then converts neither its state before the product nor the product after it."""
        if (self.w8 is not None and a.device.type == "cpu" and a.dim() >= 1) or self.w.dim() != 2 \
                or bound * self.col_absmax >= FLOAT64_EXACT:
            return None
        if self.w64 is None or self.w64.device != a.device:
            self.w64 = self.w.to(device=a.device, dtype=torch.float64)
        return torch.matmul(a.to(torch.float64), self.w64)

    def __call__(self, a: torch.Tensor, bound: Optional[int] = None, as_float64: bool = False) -> torch.Tensor:
        """The int64 product a @ w; `bound`: a max |a| the caller has proven, which spares looking at the values
        where it shows `a` fits int8. `as_float64`: `a` may hold its integers as float64, and the product comes as
        float64 integers where it is the float64 GEMM (`_float64_gemm`), int64 otherwise (a recurrent step's state)."""
        if as_float64:
            product = self._float64_gemm(a, bound) if bound is not None else None
            if product is not None:
                return product
            a = a.to(torch.int64)
        if self.w8 is None or a.device.type != "cpu" or a.dim() < 1:
            return self._float64_product(a, bound)
        k, n = (int(s) for s in self.w.shape)
        rows = a.reshape(-1, k)
        if bound is not None and bound <= 127 and not rows.is_floating_point():
            # int8 as it is: the GEMM's int32 sums are the exact products
            return int8_gemm(rows.to(torch.int8), self.w8).to(torch.int64).reshape(*a.shape[:-1], n)
        operand = split_int8(rows)
        if operand is None:
            return self._float64_product(a, bound)
        w8, sums = self.w8, self.sums
        assert sums is not None
        acc = int8_accumulate(operand, sums, lambda part, _: int8_gemm(part, w8))
        return acc.to(torch.int64).reshape(*a.shape[:-1], n)
