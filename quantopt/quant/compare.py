"""How close two tensors are: cosine similarity and mean squared error, in float64 on one thread.

Why here: the similarity analysis, the global calibration methods and the tests all compare float and dequantized
values with the same two numbers, and the numbers must not depend on the thread count (threads.py).

The sums stream over the two tensors in cache-sized steps: each step converts a slice of each to float64 into a
reused buffer and adds its dot products (x.x, y.y, (x-y).(x-y); x.y follows from them) to float64 totals.
Converting whole activations to float64 first cost two large allocations per comparison, and their page faults and
memory passes made the per-layer analysis several times the forwards it compares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..threads import one_thread
from .params import dequantize_factors, dequantize_into

STEP_ELEMENTS = 1 << 17
"""Elements per streaming step: two float64 buffers of 1 MiB each (measured fastest on one core between 2^14 and
2^20: fewer steps cost fewer calls, and the buffers still stay in the caches)."""
DEVICE_STEP_ELEMENTS = 1 << 24
"""Elements per step on a GPU, where caches do not decide and each step costs kernel launches: two 128 MiB
buffers at most."""


class StepBuffers:
    """The step buffers of `cosines_and_mses` (two float64, one float32 for dequantized slices), kept by a caller
    that compares many tensors (the similarity analysis): allocating them for each comparison cost a fifth of its
    time, and a fresh float32 slice per step another tenth."""

    def __init__(self) -> None:
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None
        self._f: Optional[torch.Tensor] = None
        self._factors: Dict[Tuple[float, int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def factors(self, scale: float, zerop: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """`dequantize_factors(scale, zerop, device)`, formed once per params: forming them cost a quarter of
        comparing a small layer's output."""
        key = (scale, zerop, str(device))
        if key not in self._factors:
            self._factors[key] = dequantize_factors(scale, zerop, device)
        return self._factors[key]

    def get(self, elements: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two float64 buffers and one float32 buffer of at least `elements` values on `device`."""
        if self._x is None or self._x.numel() < elements or self._x.device != device:
            self._x = torch.empty(elements, dtype=torch.float64, device=device)
            self._y = torch.empty(elements, dtype=torch.float64, device=device)
            self._f = torch.empty(elements, dtype=torch.float32, device=device)
        assert self._y is not None and self._f is not None
        return self._x, self._y, self._f


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


@dataclass(frozen=True)
class Dequantized:
    """Integer values with per-tensor params, compared as their dequantized floats: each step dequantizes its own
    slice (`quant.params.dequantize_into`, the same values as dequantizing the whole tensor), so no float copy of the
    whole tensor is made."""
    values: torch.Tensor
    scale: float
    zerop: int

    def numel(self) -> int:
        return self.values.numel()


Other = Union[torch.Tensor, Dequantized]


def _slice(other: Other, factors: Optional[Tuple[torch.Tensor, torch.Tensor]], start: int, stop: int,
           buffer: torch.Tensor) -> torch.Tensor:
    """`other`'s values [start, stop) as floats: a plain slice, or a `Dequantized` slice written into the float32
    `buffer` with its params `factors` (`quant.params.dequantize_factors`, formed once per comparison)."""
    if factors is None:
        assert not isinstance(other, Dequantized)
        return other[start:stop]
    assert isinstance(other, Dequantized)
    return dequantize_into(buffer[:stop - start], other.values[start:stop], *factors)


def _sums(x: torch.Tensor, others: Sequence[Other], buffers: StepBuffers) -> Tuple[float, List[List[float]]]:
    """(x.x, [[y.y, x.y, (x-y).(x-y)] per y in `others`]) of flat tensors of one length, in float64, summed step by
    step in a fixed order (the caller holds one thread); x.x is summed once for all of them. x.y is not a dot product
    of its own: it is (x.x + y.y - (x-y).(x-y)) / 2, exact up to the sums' own rounding (three float64 sums of
    about the same size; the difference is small where x and y are close, as compared values are), and one pass
    over each step fewer, a sixth of the comparison's time. The steps' dot products stay on the tensors' device
    until all are queued and are read back at once: on a GPU each read is a synchronization, and one per step and
    product made the analysis slower there than its forwards."""
    n = x.numel()
    for other in others:
        if other.numel() != n:
            raise ValueError(f"cannot compare tensors of {n} and {other.numel()} elements")
    step = min(n, STEP_ELEMENTS if x.device.type == "cpu" else DEVICE_STEP_ELEMENTS)
    bx, by, bf = buffers.get(step, x.device)
    factors = [buffers.factors(o.scale, o.zerop, x.device) if isinstance(o, Dequantized) else None for o in others]
    parts: List[torch.Tensor] = []
    for start in range(0, n, step):
        m = min(step, n - start)
        cx = bx[:m].copy_(x[start:start + m])
        parts.append(torch.dot(cx, cx))
        for other, f in zip(others, factors):
            cy = by[:m].copy_(_slice(other, f, start, start + m, bf))
            parts.append(torch.dot(cy, cy))
            d = cy.sub_(cx)  # y - x: the negation of x - y, so the same squares
            parts.append(torch.dot(d, d))
    values = iter(torch.stack(parts).tolist())
    xx = 0.0
    sums = [[0.0, 0.0] for _ in others]
    for _ in range(0, n, step):  # the steps' products added in step order, as float64
        xx += next(values)
        for acc in sums:
            acc[0] += next(values)
            acc[1] += next(values)
    return xx, [[yy, (xx + yy - dd) / 2, dd] for yy, dd in sums]


def cosines_and_mses(a: torch.Tensor, others: Sequence[Other],
                     buffers: Optional[StepBuffers] = None) -> List[Tuple[float, float]]:
    """(cosine similarity, mean squared difference) of `a` against each of `others` (tensors, or integer values
    with their params as `Dequantized`) as flat float64 vectors, in one pass over `a` for all of them; two all-zero
    vectors count as identical (cosine 1), an all-zero one against another as orthogonal (0), empty ones have MSE 0.
    Summed on one thread (`threads.one_thread`) in a fixed order, so the values do not depend on the thread count
    (nor on how many others are compared at once). `buffers`: step buffers to reuse (a caller comparing many
    tensors)."""
    x = _flat(a)
    flat = [o if isinstance(o, Dequantized) else _flat(o) for o in others]
    flat = [Dequantized(o.values.reshape(-1), o.scale, o.zerop) if isinstance(o, Dequantized) else o for o in flat]
    if not x.numel():
        for o in flat:
            if o.numel():
                raise ValueError(f"cannot compare tensors of 0 and {o.numel()} elements")
        return [(1.0, 0.0) for _ in flat]
    with one_thread():
        xx, sums = _sums(x, flat, buffers or StepBuffers())
    nx = math.sqrt(xx)
    results = []
    for yy, xy, dd in sums:
        ny = math.sqrt(yy)
        if nx == 0.0 and ny == 0.0:
            cos = 1.0
        elif nx == 0.0 or ny == 0.0:
            cos = 0.0
        else:
            cos = xy / (nx * ny)
        results.append((cos, dd / x.numel()))
    return results


def cosine_and_mse(a: torch.Tensor, b: torch.Tensor, buffers: Optional[StepBuffers] = None) -> Tuple[float, float]:
    """(cosine similarity, mean squared difference) of two tensors as flat float64 vectors (`cosines_and_mses`)."""
    return cosines_and_mses(a, [b], buffers)[0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors as flat float64 vectors (`cosines_and_mses`)."""
    return cosine_and_mse(a, b)[0]


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared difference in float64 (`cosines_and_mses`)."""
    return cosine_and_mse(a, b)[1]
