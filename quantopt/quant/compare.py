"""How close two tensors are: cosine similarity and mean squared error, in float64 on one thread.

Why here: the similarity analysis, the global calibration methods and the tests all compare float and dequantized
values with the same two numbers, and the numbers must not depend on the thread count (threads.py).
"""
from __future__ import annotations

import torch

from ..threads import one_thread


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors as flat float64 vectors; two all-zero tensors count as identical. Summed on
    one thread (`threads.one_thread`), so the value does not depend on the thread count."""
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    with one_thread():
        nx, ny = float(x.norm()), float(y.norm())
        if nx == 0.0 and ny == 0.0:
            return 1.0
        if nx == 0.0 or ny == 0.0:
            return 0.0
        return float(torch.dot(x, y) / (nx * ny))


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared difference in float64, summed on one thread (`threads.one_thread`)."""
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    with one_thread():
        return float(squared_difference_mean(x, y))


def squared_difference_mean(x: torch.Tensor, y: torch.Tensor) -> float:
    """mean((x - y)^2) of two flat float64 vectors (0 for empty ones), the difference squared in place: the values
    `(x - y) ** 2` gives (torch squares by one multiplication), with one large temporary instead of two."""
    if not x.numel():
        return 0.0
    d = x - y
    return float(d.mul_(d).mean())
