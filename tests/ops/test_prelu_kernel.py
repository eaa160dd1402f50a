"""The float PRELU by torch's vectorized kernel (ops/_shared.py `PreluKernel`) against the form it replaces,
`where(x >= 0, x, x · slope)`, bit for bit: signed zeros, infinities, NaN and subnormal inputs, negative, zero and
-0.0 slopes, per-channel rows repeated over [1, H, W, C], scalar slopes, float32 and float64."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.node import PyNode
from quantopt.ops._shared import _prelu_kernel, apply_fused_activation

SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-310, -1e-310, 1e-45, -1e-45, 3.0, -3.0]


def prelu_node(shape: Sequence[int], slope: Optional[torch.Tensor] = None,
               params: Optional[Dict[str, Any]] = None) -> PyNode:
    b = GraphBuilder("t")
    inp = b.input("x", list(shape))
    constants = {} if slope is None else {"negative_slope": slope}
    out = b.layer("Activation", [inp], [list(shape)], name="act", params={"method": "PRELU", **(params or {})},
                  constants=constants)
    graph = b.build([out])
    return next(n for n in graph.nodes if n.name == "act")


def with_specials(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with every special value at several positions of every channel."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    flat = x.reshape(-1)
    picks = torch.randint(0, flat.numel(), (4 * len(SPECIALS),), generator=g)
    for i, p in enumerate(picks.tolist()):
        flat[p] = SPECIALS[i % len(SPECIALS)]
    zeros = torch.randint(0, flat.numel(), (flat.numel() // 8,), generator=g)
    flat[zeros[::2]] = 0.0
    flat[zeros[1::2]] = -0.0
    return x


def where_form(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, x, x * slope.to(x.dtype))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    bits = torch.int64 if actual.dtype == torch.float64 else torch.int32
    same = actual.contiguous().view(bits) == expected.contiguous().view(bits)
    assert bool((same | both_nan).all()), f"{int((~(same | both_nan)).sum())} values differ"


def slopes(kind: str, channels: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.rand(channels, generator=g) * 0.5
    if kind == "negative":
        row = -row
    elif kind == "mixed":
        row[::2] = -row[::2]
        row[1] = 0.0
        row[3 % channels] = -0.0
    elif kind == "minus_zero":
        row[:] = -0.0
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["positive", "negative", "mixed", "minus_zero"])
@pytest.mark.parametrize("shape,slope_shape", [
    ([2, 4, 5, 6], [6]), ([2, 4, 5, 6], [1, 4, 5, 6]), ([3, 7, 6], [6]), ([4, 6], [6]), ([1, 256], [256]),
])
def test_kernel_matches_where_bit_for_bit(dtype: torch.dtype, kind: str, shape: Sequence[int],
                                          slope_shape: Sequence[int]) -> None:
    channels = int(shape[-1])
    row = slopes(kind, channels, seed=len(shape) + channels)
    slope = row.expand(*slope_shape).contiguous() if len(slope_shape) > 1 else row
    node = prelu_node([1, *shape[1:]], slope)
    x = with_specials(shape, dtype, seed=channels)
    with torch.no_grad():
        assert _prelu_kernel(node, slope.to(dtype), x) is not None  # the vectorized kernel is taken
        assert_same_bits(apply_fused_activation(node, x, "PRELU"), where_form(x, slope))


@pytest.mark.parametrize("value", [0.25, -0.25, 0.0, -0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scalar_slope_matches_where(value: float, dtype: torch.dtype) -> None:
    node = prelu_node([1, 4, 5, 6], params={"negative_slope": value})
    x = with_specials([3, 4, 5, 6], dtype, seed=11)
    with torch.no_grad():
        assert_same_bits(apply_fused_activation(node, x, "PRELU"), where_form(x, torch.tensor(value, dtype=dtype)))


@pytest.mark.parametrize("case", ["varying_rows", "infinite_slope", "nan_slope", "one_axis"])
def test_other_slopes_keep_the_where_form(case: str) -> None:
    """Slopes the kernel cannot take (rows that differ, a non-finite slope) and a one-axis input still give the
    `where` form's values."""
    g = torch.Generator().manual_seed(5)
    shape, slope = [2, 4, 5, 6], torch.rand(1, 4, 5, 6, generator=g) - 0.5
    if case == "infinite_slope":
        slope = slope[0, 0, 0].clone()
        slope[2] = math.inf
    elif case == "nan_slope":
        slope = slope[0, 0, 0].clone()
        slope[1] = math.nan
    elif case == "one_axis":
        shape, slope = [6], slope[0, 0, 0].clone()
    node = prelu_node([1, *shape[1:]] if len(shape) > 1 else shape, slope)
    x = with_specials(shape, torch.float64, seed=6)
    with torch.no_grad():
        assert _prelu_kernel(node, slope.to(torch.float64), x) is None
        assert_same_bits(apply_fused_activation(node, x, "PRELU"), where_form(x, slope))


def test_gradient_forward_keeps_the_where_form() -> None:
    """With a gradient wanted (a gradient-based method's forward), the differentiable `where` form runs: its
    gradient at x = 0 is 1, as before."""
    slope = torch.full((6,), -0.25)
    node = prelu_node([1, 4, 5, 6], slope)
    x = torch.zeros(1, 4, 5, 6, requires_grad=True)
    assert _prelu_kernel(node, slope, x) is None
    apply_fused_activation(node, x, "PRELU").sum().backward()
    assert x.grad is not None and bool((x.grad == 1).all())


def test_kernel_follows_a_slope_written_in_place() -> None:
    """The kernel is memoized per slope tensor and version: an in-place change of the slopes is seen."""
    slope = torch.full((1, 4, 5, 6), 0.5)
    node = prelu_node([1, 4, 5, 6], slope)
    x = -torch.ones(2, 4, 5, 6)
    with torch.no_grad():
        assert bool((apply_fused_activation(node, x, "PRELU") == -0.5).all())
        node.constants["negative_slope"].betensor.mul_(-1)
        assert bool((apply_fused_activation(node, x, "PRELU") == 0.5).all())
