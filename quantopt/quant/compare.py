"""How close two tensors are: cosine similarity and mean squared error, in float64 on one thread.

Why here: the similarity analysis, the global calibration methods and the tests all compare float and dequantized
values with the same two numbers, and the numbers must not depend on the thread count (threads.py).

The sums stream over the two tensors in cache-sized steps: each step converts a slice of each to float64 into a
reused buffer and adds its four dot products (x.x, y.y, x.y, (x-y).(x-y)) to float64 totals. Converting whole
activations to float64 first cost two large allocations per comparison, and their page faults and memory passes
made the per-layer analysis several times the forwards it compares.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..threads import one_thread

STEP_ELEMENTS = 1 << 17
"""Elements per streaming step: two float64 buffers of 1 MiB each (measured fastest on one core between 2^14 and
2^20: fewer steps cost fewer calls, and the buffers still stay in the caches)."""


class StepBuffers:
    """The two float64 step buffers of `cosine_and_mse`, kept by a caller that compares many tensors (the similarity
    analysis): allocating them for each comparison cost a fifth of its time."""

    def __init__(self) -> None:
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None

    def get(self, elements: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of at least `elements` float64 values on `device`."""
        if self._x is None or self._x.numel() < elements or self._x.device != device:
            self._x = torch.empty(elements, dtype=torch.float64, device=device)
            self._y = torch.empty(elements, dtype=torch.float64, device=device)
        assert self._y is not None
        return self._x, self._y


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _sums(x: torch.Tensor, y: torch.Tensor, buffers: StepBuffers) -> Tuple[float, float, float, float]:
    """(x.x, y.y, x.y, (x-y).(x-y)) of two flat tensors of one length, in float64, summed step by step in a fixed
    order (the caller holds one thread)."""
    n = x.numel()
    if y.numel() != n:
        raise ValueError(f"cannot compare tensors of {n} and {y.numel()} elements")
    step = min(n, STEP_ELEMENTS)
    bx, by = buffers.get(step, x.device)
    xx = yy = xy = dd = 0.0
    for start in range(0, n, step):
        m = min(step, n - start)
        cx = bx[:m].copy_(x[start:start + m])
        cy = by[:m].copy_(y[start:start + m])
        xx += float(torch.dot(cx, cx))
        yy += float(torch.dot(cy, cy))
        xy += float(torch.dot(cx, cy))
        d = cx.sub_(cy)
        dd += float(torch.dot(d, d))
    return xx, yy, xy, dd


def cosine_and_mse(a: torch.Tensor, b: torch.Tensor, buffers: Optional[StepBuffers] = None) -> Tuple[float, float]:
    """(cosine similarity, mean squared difference) of two tensors as flat float64 vectors, in one pass over each;
    two all-zero tensors count as identical (cosine 1), an all-zero one against another as orthogonal (0), empty
    tensors have MSE 0. Summed on one thread (`threads.one_thread`) in a fixed order, so the values do not depend
    on the thread count. `buffers`: step buffers to reuse (a caller comparing many tensors)."""
    x, y = _flat(a), _flat(b)
    if not x.numel():
        return 1.0, 0.0
    with one_thread():
        xx, yy, xy, dd = _sums(x, y, buffers or StepBuffers())
    nx, ny = math.sqrt(xx), math.sqrt(yy)
    if nx == 0.0 and ny == 0.0:
        cos = 1.0
    elif nx == 0.0 or ny == 0.0:
        cos = 0.0
    else:
        cos = xy / (nx * ny)
    return cos, dd / x.numel()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors as flat float64 vectors (`cosine_and_mse`)."""
    return cosine_and_mse(a, b)[0]


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared difference in float64 (`cosine_and_mse`)."""
    return cosine_and_mse(a, b)[1]
