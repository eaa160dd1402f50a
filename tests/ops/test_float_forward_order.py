"""The float forward of LayerNorm/RMSNorm/GroupNorm/InstanceNorm and GELU in upstream's float32 arithmetic
(docs/golden-differences.md, "Upstream's float forward"): the fixed row sums (contiguous rows, GroupNorm's strided
blocks, InstanceNorm's channels-last outer reduction) against scalar references written from their descriptions (and,
where torch sums with 256-bit vectors, against torch's own sums), the norms bit for bit against float32 references of
upstream's formula, the same result at any thread count, and GELU's two forms against upstream's expressions written
out with torch."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.ops._float_sum import axis_sum, block_row_sum, channel_row_sum, fixed_row_sum

F32 = np.float32
AVX2_TORCH = torch.backends.cpu.get_cpu_capability() == "AVX2"
"""torch's CPU sum uses 256-bit vectors here, the order fixed_row_sum reproduces."""

SIZES = [1, 3, 7, 8, 9, 15, 16, 31, 32, 33, 64, 100, 127, 384, 515, 1000, 2051, 9600]
"""Row lengths: below one vector, around the vector and four-vector boundaries, and long enough (9600: 300 groups of
four vectors) for the cascade's second level."""


def _rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    """Values of very different magnitudes, so that a change of summation order shows in the last bit."""
    r = np.random.default_rng(seed)
    return (r.standard_normal((n_rows, n)) * np.exp(3 * r.standard_normal((n_rows, n)))).astype(F32)


def _ceil_log2(v: int) -> int:
    return 1 if v <= 2 else (v - 1).bit_length()


def _reference_items_sum(items: List[Any], zero: Any) -> Any:
    """Four interleaved accumulators over groups of four items, each a four-level cascade whose levels move up every
    `step` groups; leftover items join accumulator 0, then accumulators 1-3 are added to it (items: float32 scalars
    or 8-lane float32 vectors)."""
    groups = len(items) // 4
    power = max(4, _ceil_log2(groups) // 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = [[zero] * 4 for _ in range(4)]
    i = 0
    while i + step <= groups:
        for _ in range(step):
            for k in range(4):
                acc[0][k] = acc[0][k] + items[4 * i + k]
            i += 1
        for level in range(1, 4):
            for k in range(4):
                acc[level][k] = acc[level][k] + acc[level - 1][k]
                acc[level - 1][k] = zero
            if i & (mask << (level * power)):
                break
    for j in range(i, groups):
        for k in range(4):
            acc[0][k] = acc[0][k] + items[4 * j + k]
    for level in range(1, 4):
        for k in range(4):
            acc[0][k] = acc[0][k] + acc[level][k]
    first = acc[0][0]
    for item in items[4 * groups:]:
        first = first + item
    for k in range(1, 4):
        first = first + acc[0][k]
    return first


def reference_row_sum(row: np.ndarray) -> np.float32:
    """One row summed as fixed_row_sum's docstring describes, with numpy float32 scalars and 8-lane vectors."""
    n = row.size
    if n < 8:
        return _reference_items_sum([F32(v) for v in row], F32(0))
    vectors = [row[8 * i:8 * i + 8].copy() for i in range(n // 8)]
    lanes = _reference_items_sum(vectors, np.zeros(8, F32))
    total = F32(0)
    for v in row[8 * (n // 8):]:
        total = F32(total + v)
    for v in lanes:
        total = F32(total + v)
    return total


@pytest.mark.parametrize("n", SIZES)
def test_fixed_row_sum_matches_scalar_reference(n: int) -> None:
    x = _rows(3, n, n)
    got = fixed_row_sum(torch.from_numpy(x)).numpy()
    want = np.array([reference_row_sum(r) for r in x], dtype=F32)
    assert got.dtype == F32 and got.view(np.int32).tolist() == want.view(np.int32).tolist()


@pytest.mark.skipif(not AVX2_TORCH, reason="torch's CPU sum here does not use 256-bit vectors")
def test_fixed_row_sum_is_torch_avx2_sum() -> None:
    """Upstream's float forward sums with torch on one thread; on a 256-bit machine that is fixed_row_sum's order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in list(range(1, 130)) + SIZES + [4096, 70000]:
            x = torch.from_numpy(_rows(2, n, 7 + n))
            assert torch.equal(fixed_row_sum(x), torch.sum(x, dim=1)), n
    finally:
        torch.set_num_threads(threads)


def _norm_layer(kind: str, shape: Sequence[int], axis: List[int], eps: float, consts: Dict[str, np.ndarray]):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(kind, [x], [list(shape)], name="n", params={"axis": axis, "epsilon": eps}, constants=consts)
    return b.build([y])


def _reference_norm(x: np.ndarray, eps: float, gamma: np.ndarray, beta: np.ndarray, rms: bool) -> np.ndarray:
    """Upstream's float LayerNorm/RMSNorm over the last axis, each step rounded to float32: mean = sum / N,
    var = sum((x - mean)²) / N, r = 1 / (var + eps)^0.5, y = gamma · ((x - mean) · r) + beta."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = np.empty_like(rows)
    for i, row in enumerate(rows):
        mean = F32(0) if rms else F32(reference_row_sum(row) / F32(n))
        c = (row - mean).astype(F32)
        var = F32(reference_row_sum((c * c).astype(F32)) / F32(n))
        # torch's float32 square root, as upstream's pow(·, 0.5) (on some torch builds not correctly rounded)
        std = torch.pow(torch.tensor([F32(var + F32(eps))]), 0.5).numpy()[0]
        r = F32(F32(1) / std)
        out[i] = gamma * (c * r) + beta
    return out.reshape(x.shape)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("n", [5, 32, 384, 1000])
def test_norm_float_forward_is_upstreams_float32(kind: str, n: int) -> None:
    shape = [1, 6, n]
    r = np.random.default_rng(n)
    x = (_rows(6, n, 100 + n) + F32(0.7)).reshape(shape)
    gamma, beta = r.normal(1, 0.3, n).astype(F32), r.normal(0, 0.3, n).astype(F32)
    got = _norm_layer(kind, shape, [2], 1e-5, {"weights": gamma, "biases": beta}).forward([torch.from_numpy(x)])[0]
    want = _reference_norm(x, 1e-5, gamma, beta, rms=kind == "RMSNorm")
    assert got.dtype == torch.float32
    assert got.numpy().view(np.int32).tolist() == want.view(np.int32).tolist()


def test_norm_float_forward_is_the_same_at_any_thread_count() -> None:
    """One row of 70000 elements: torch would split that sum across threads; the fixed order does not."""
    shape = [1, 1, 70000]
    x = torch.from_numpy(_rows(1, 70000, 3).reshape(shape))
    g = _norm_layer("LayerNorm", shape, [2], 1e-5, {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = g.forward([x])[0]
        torch.set_num_threads(4)
        four = g.forward([x])[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    b = GraphBuilder("t")
    i = b.input("x", list(x.shape))
    y = b.layer("Activation", [i], [list(x.shape)], name="g", params={"method": "GELU", "approximate": approximate})
    return b.build([y]).forward([x])[0]


def test_gelu_float_forms_are_upstreams() -> None:
    """erf form: torch's float32 GELU; tanh form: x · (0.5 · (1 + tanh(sqrt(2/π)₃₂ · (x + 0.044715 · x³)))) step by
    step in float32, which differs from torch's fused tanh GELU in the last bit on some inputs."""
    x = torch.cat([torch.linspace(-9, 9, 40001), torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 3])
    x = x.reshape(1, -1)
    assert torch.equal(_gelu(x, "NONE"), torch.nn.functional.gelu(x))
    c = torch.sqrt(torch.tensor(2 / math.pi, dtype=torch.float32))
    cube = x * x * x
    phi = 0.5 * (1 + torch.tanh(c * (x + 0.044715 * cube)))
    got = _gelu(x, "TANH")
    assert torch.equal(got, x * phi)
    assert not torch.equal(got, torch.nn.functional.gelu(x, approximate="tanh"))  # the rounding this test is about


def test_fixed_row_sum_refuses_other_tensors() -> None:
    with pytest.raises(ValueError, match="2-D float32"):
        fixed_row_sum(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32"):
        fixed_row_sum(torch.zeros(4))


def test_norm_float_forward_stays_differentiable() -> None:
    """Global calibration differentiates through float forwards: the fixed sum gives way to torch's mean there."""
    shape = [1, 4, 32]
    x = torch.from_numpy(_rows(4, 32, 11).reshape(shape)).requires_grad_(True)
    g = _norm_layer("LayerNorm", shape, [2], 1e-5, {})
    y = g.forward([x])[0]
    (y * torch.arange(32.0)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    torch.testing.assert_close(y.detach(), g.forward([x.detach()])[0], rtol=1e-5, atol=1e-5)


# --- GroupNorm's strided blocks and InstanceNorm's outer reduction ---------------------------------------------------
def _torch_sums_in_8_lanes() -> bool:
    """torch's one-thread CPU sum of a contiguous row takes fixed_row_sum's 8-lane order on this build (a 512-bit
    capable build may still reduce with 256-bit vectors: measured, not assumed from the CPU capability)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.from_numpy(_rows(8, 1000, 5))
        return torch.equal(fixed_row_sum(x), torch.sum(x, dim=1))
    finally:
        torch.set_num_threads(threads)


TORCH_8_LANES = _torch_sums_in_8_lanes()

LAYOUTS = [(1, 16, 16, 16), (2, 7, 9, 3), (1, 33, 31, 40), (3, 5, 5, 64), (2, 1, 1, 5), (1, 300, 1, 12),
           (1, 8, 8, 1), (1, 17, 3, 7)]
"""[B, H, W, C]: the probe model's shape, kept axes shorter than a vector and than four scalars, one and several blocks
of four vectors, a single spatial cell, one channel."""


def _reference_cascade(items: List[Any], zero: Any) -> Any:
    """torch's plain cascade of a sequence (no interleaving): blocks of `step` items into level 0, moved up a level
    every `step` blocks, the levels added to level 0 at the end."""
    power = max(4, _ceil_log2(len(items)) // 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = [zero] * 4
    i = 0
    while i + step <= len(items):
        for _ in range(step):
            acc[0] = acc[0] + items[i]
            i += 1
        for level in range(1, 4):
            acc[level] = acc[level] + acc[level - 1]
            acc[level - 1] = zero
            if i & (mask << (level * power)):
                break
    for item in items[i:]:
        acc[0] = acc[0] + item
    for level in range(1, 4):
        acc[0] = acc[0] + acc[level]
    return acc[0]


def _reference_channel_sums(x: np.ndarray) -> np.ndarray:
    """x [S, C] summed over S per channel, channel by channel: a plain cascade for the channels below the last
    multiple of 32 (C >= 8) or of 4 (C < 8), four interleaved accumulators for the rest; C = 1 a contiguous row."""
    size, channels = x.shape
    if channels == 1:
        return np.array([reference_row_sum(x[:, 0])], dtype=F32)
    block = 32 if channels >= 8 else 4
    cut = channels // block * block
    out = [_reference_cascade([F32(v) for v in x[:, c]], F32(0)) if c < cut
           else _reference_items_sum([F32(v) for v in x[:, c]], F32(0)) for c in range(channels)]
    return np.array(out, dtype=F32)


def _reference_block_sums(x: np.ndarray, width: int) -> np.ndarray:
    """x [S, C] summed per group of `width` channels: each cell's group summed as a contiguous row, the cells' sums
    added in order from 0; one channel per group is one strided run with four interleaved accumulators."""
    out = []
    for k in range(0, x.shape[1], width):
        part = x[:, k:k + width]
        if width == 1:
            out.append(_reference_items_sum([F32(v) for v in part[:, 0]], F32(0)))
            continue
        total = F32(0)
        for cell in part:
            total = F32(total + reference_row_sum(cell))
        out.append(total)
    return np.array(out, dtype=F32)


def _channels_last(shape: Sequence[int], seed: int) -> np.ndarray:
    r = np.random.default_rng(seed)
    scale = np.exp(2 * r.standard_normal(shape[-1])).astype(F32)
    return (r.standard_normal(shape) * scale + r.standard_normal(shape[-1])).astype(F32)


@pytest.mark.parametrize("shape", LAYOUTS, ids=[str(s) for s in LAYOUTS])
def test_channel_row_sum_matches_scalar_reference(shape: Tuple[int, ...]) -> None:
    b, h, w, c = shape
    x = _channels_last(shape, sum(shape))
    got = channel_row_sum(torch.from_numpy(x).permute(0, 3, 1, 2).reshape(b * c, h * w), c).numpy()
    want = np.concatenate([_reference_channel_sums(x[i].reshape(h * w, c)) for i in range(b)])
    assert got.view(np.int32).tolist() == want.view(np.int32).tolist()


@pytest.mark.parametrize("shape", LAYOUTS, ids=[str(s) for s in LAYOUTS])
def test_block_row_sum_matches_scalar_reference(shape: Tuple[int, ...]) -> None:
    b, h, w, c = shape
    x = _channels_last(shape, 3 * sum(shape))
    for groups in sorted({1, 2, 4, c} & {d for d in range(1, c + 1) if c % d == 0}):
        rows = torch.from_numpy(x).reshape(b, h * w, groups, c // groups).permute(0, 2, 1, 3).reshape(b * groups, -1)
        got = block_row_sum(rows.contiguous(), h * w if groups > 1 else 1).numpy()
        if groups == 1:
            want = np.array([reference_row_sum(x[i].reshape(-1)) for i in range(b)], dtype=F32)
        else:
            want = np.concatenate([_reference_block_sums(x[i].reshape(h * w, c), c // groups) for i in range(b)])
        assert got.view(np.int32).tolist() == want.view(np.int32).tolist(), groups


def _torch_upstream_norm(x: torch.Tensor, kind: str, groups: int, eps: float, gamma: torch.Tensor,
                         beta: torch.Tensor) -> torch.Tensor:
    """Upstream's float GroupNorm/InstanceNorm written with torch in its layout: GroupNorm reduces each channel chunk
    (a strided view) over all non-batch axes, InstanceNorm the channels-last tensor over its spatial axes; mean and
    variance as torch means, the reciprocal of (var + eps)^0.5 multiplied in, then gamma · n + beta."""
    axes = list(range(1, x.dim())) if kind == "GroupNorm" else list(range(1, x.dim() - 1))
    chunks = x.split(x.shape[-1] // groups, dim=-1) if kind == "GroupNorm" else [x]
    means, gains = [], []
    for t in chunks:
        mean = torch.mean(t, dim=axes, keepdim=True)
        var = torch.mean((t - mean) ** 2, dim=axes, keepdim=True)
        means.append(mean.expand_as(t))
        gains.append((1.0 / torch.pow(var + eps, 0.5)).expand_as(t))
    return gamma * ((x - torch.cat(means, -1)) * torch.cat(gains, -1)) + beta


@pytest.mark.skipif(not TORCH_8_LANES, reason="torch's CPU sum here does not use 256-bit vectors")
@pytest.mark.parametrize("kind,groups", [("GroupNorm", 4), ("GroupNorm", 1), ("GroupNorm", 16), ("InstanceNorm", 1)])
@pytest.mark.parametrize("shape", [(1, 16, 16, 16), (2, 9, 7, 16), (1, 40, 40, 16)], ids=["16x16", "b2", "40x40"])
def test_group_and_instance_norm_float_forward_is_torch_in_upstreams_layout(kind: str, groups: int,
                                                                            shape: Tuple[int, ...]) -> None:
    x = torch.from_numpy(_channels_last(shape, 41))
    r = np.random.default_rng(2)
    gamma, beta = r.normal(1, 0.3, shape[-1]).astype(F32), r.normal(0, 0.3, shape[-1]).astype(F32)
    b = GraphBuilder("t")
    i = b.input("x", list(shape))
    params = {"group": groups, "axis": 3, "epsilon": 1e-5} if kind == "GroupNorm" else {"epsilon": 1e-5}
    y = b.layer(kind, [i], [list(shape)], name="n", params=params, constants={"weights": gamma, "biases": beta})
    got = b.build([y]).forward([x])[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = _torch_upstream_norm(x, kind, groups, 1e-5, torch.from_numpy(gamma), torch.from_numpy(beta))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


AXIS_CASES = [((1, 16, 12), 2), ((2, 16, 12), 1), ((3, 5, 7, 9), 0), ((3, 5, 7, 9), 1), ((3, 5, 7, 9), 3),
              ((2, 1000), 1), ((5, 300, 2), 1), ((1, 12, 16, 40), 2), ((7,), 0)]
"""(shape, axis): the reduced axis last (a contiguous row) or inside (an outer reduction), kept axes shorter and
longer than a vector."""


@pytest.mark.parametrize("shape,axis", AXIS_CASES, ids=[f"{s}-{a}" for s, a in AXIS_CASES])
def test_axis_sum_is_the_row_or_outer_order(shape: Tuple[int, ...], axis: int) -> None:
    """axis_sum is fixed_row_sum on the rows of a last-axis reduction and channel_row_sum on an inner one, and, where
    torch sums in 8 lanes on one thread, torch's own keepdim sum."""
    x = torch.from_numpy(np.exp(3 * np.random.default_rng(len(shape) + axis).standard_normal(shape)).astype(F32))
    got = axis_sum(x, axis)
    outer, length = int(np.prod(shape[:axis])), shape[axis]
    inner = int(np.prod(shape[axis + 1:]))
    rows = x.reshape(outer, length, inner).permute(0, 2, 1).reshape(outer * inner, length).contiguous()
    want = fixed_row_sum(rows) if inner == 1 else channel_row_sum(rows, inner)
    assert torch.equal(got.reshape(-1), want.reshape(-1)) and list(got.shape) == [*shape[:axis], 1, *shape[axis + 1:]]
    if TORCH_8_LANES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(got, x.sum(axis, keepdim=True))
        finally:
            torch.set_num_threads(threads)
