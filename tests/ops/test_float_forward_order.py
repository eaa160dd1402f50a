"""The float forward of LayerNorm/RMSNorm and GELU in upstream's float32 arithmetic (docs/golden-differences.md,
"Upstream's float forward"): the fixed row sum against a scalar reference written from its description (and, where
torch runs its 256-bit CPU kernels, against torch's own sum), LayerNorm/RMSNorm bit for bit against a numpy float32
reference of upstream's formula, the same result at any thread count, and GELU's two forms against upstream's
expressions written out with torch."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.ops.normalization import fixed_row_sum

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
