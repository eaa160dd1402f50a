"""FullyConnected's float32 summation order (ops/_fc_order.py) against a scalar reference written here from the
module's description, and, where torch runs on MKL on x86-64, against MKL's single-threaded SSE4.2 kernel itself."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from fractions import Fraction
from typing import List

import numpy as np
import pytest
import torch
from golden_helpers import cpu_vendor

from quantopt.ops import _fc_order as fc_order
from quantopt.ops._fc_order import linear_float32

f32 = np.float32


def _seq(values: List[np.float32]) -> np.float32:
    s = values[0]
    for v in values[1:]:
        s = f32(s + v)
    return s


def _pair(lanes: List[np.float32]) -> np.float32:
    return f32(f32(lanes[0] + lanes[2]) + f32(lanes[1] + lanes[3]))


def ref_quad(p: List[np.float32]) -> np.float32:
    h = (len(p) - 1) % 4 + 1
    lanes: List = [_seq(p[:h]), None, None, None]
    for i, v in enumerate(p[h:]):
        j = i % 4
        lanes[j] = v if lanes[j] is None else f32(lanes[j] + v)
    return lanes[0] if len(p) == h else _pair(lanes)


def ref_wide(p: List[np.float32], accumulators: int) -> np.float32:
    h = min(4, len(p))
    s = _seq(p[:h])
    n_body = 8 * ((len(p) - h) // 8)
    if n_body:
        accs = [[None] * 4 for _ in range(accumulators)]
        accs[0][0] = s
        for i, v in enumerate(p[h:h + n_body]):
            acc = accs[(i // 4) % accumulators]
            j = i % 4
            acc[j] = v if acc[j] is None else f32(acc[j] + v)
        lanes = accs[0] if accumulators == 1 else [f32(accs[0][j] + accs[1][j]) for j in range(4)]
        s = _pair(lanes)
    for v in p[h + n_body:]:
        s = f32(s + v)
    return s


def ref_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    n_out, k = w.shape
    main = 4 * (n_out // 4)
    rest = n_out - main
    y = np.empty((x.shape[0], n_out), np.float32)
    for r in range(x.shape[0]):
        for n in range(n_out):
            p = [f32(x[r, i] * w[n, i]) for i in range(k)]
            if n < main:
                d = ref_quad(p)
            else:
                q = n - main
                d = ref_wide(p, 1 if (q % 2 == 1 and q < 2 * (rest // 2)) else 2)
            y[r, n] = f32(d + b[n])
    return y


def ref_quad_head(p: List[np.float32], h: int) -> np.float32:
    """quad(h) of the module's description: head, four lanes while four products are left, then the tail."""
    s = _seq(p[:h]) if h else None
    k = h
    if len(p) - h >= 4:
        lanes: List = [s, None, None, None]
        while len(p) - k >= 4:
            for j in range(4):
                lanes[j] = p[k + j] if lanes[j] is None else f32(lanes[j] + p[k + j])
            k += 4
        s = _pair(lanes)
    for v in p[k:]:
        s = v if s is None else f32(s + v)
    return s


def ref_wide_head(p: List[np.float32], h: int) -> np.float32:
    """wide(h): head, two four-lane accumulators over 8·floor((K - h)/8) products, then the tail."""
    s = _seq(p[:h]) if h else None
    n_body = 8 * ((len(p) - h) // 8)
    if n_body:
        accs: List[List] = [[s, None, None, None], [None] * 4]
        for i, v in enumerate(p[h:h + n_body]):
            acc, j = accs[(i // 4) % 2], i % 4
            acc[j] = v if acc[j] is None else f32(acc[j] + v)
        s = _pair([f32(accs[0][j] + accs[1][j]) for j in range(4)])
    for v in p[h + n_body:]:
        s = v if s is None else f32(s + v)
    return s


def fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """float32 fma, exactly rounded (ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    cands = [near, np.nextafter(near, f32(np.inf)), np.nextafter(near, f32(-np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))
    return f32(best)


def ref_k_blocks(k: int) -> List[int]:
    if k <= 192:
        return [0, k]
    size = k // 2 if k <= 384 else 192
    cut = list(range(0, size * (k // size) + 1, size))
    return cut if cut[-1] == k else cut + [k]


def ref_gemm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One GEMM of M rows in the order of the module's description, one scalar at a time."""
    m, k = x.shape
    n_out = w.shape[0]
    if m == 1:
        return ref_linear(x, w, b)
    y = np.empty((m, n_out), np.float32)
    main_rows = 4 * (m // 4)
    packed = m >= 4 and n_out >= 12
    for r in range(m):
        for n in range(n_out):
            p = [f32(x[r, i] * w[n, i]) for i in range(k)]
            if n_out == 1:
                if r < main_rows:
                    d = ref_quad(p)
                else:
                    q, rest = r - main_rows, m - main_rows
                    d = ref_wide(p, 1 if (q % 2 == 1 and q < 2 * (rest // 2)) else 2)
                y[r, n] = f32(d + b[n])
            elif packed:
                cut = ref_k_blocks(k)
                c = b[n]
                for k0, k1 in zip(cut[:-1], cut[1:]):
                    s = f32(0)
                    for i in range(k0, k1):
                        s = fma32(x[r, i], w[n, i], s)
                    c = f32(c + s)
                y[r, n] = c
            else:
                h = min(k, (-r * k) % 4)
                d = ref_quad_head(p, h) if n < 4 * (n_out // 4) else ref_wide_head(p, h)
                y[r, n] = f32(d + b[n])
    return y


K_VALUES = (1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 19, 20, 21, 27, 28, 33, 64, 65, 130)
SHAPES = [(k, n) for k in K_VALUES for n in (1, 2, 3, 4, 5, 7)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_the_scalar_reference(k: int, n: int) -> None:
    rng = np.random.default_rng(k * 100 + n)
    x = rng.standard_normal((3, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    got = linear_float32(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(got, ref_linear(x, w, b))


GEMM_SHAPES = [(m, k, n) for m in (2, 3, 5, 6, 13) for k in (3, 8, 13, 33) for n in (1, 2, 5, 12, 17)] \
    + [(4, 197, 12), (4, 400, 12), (16, 32, 32)]


@pytest.mark.parametrize("m,k,n", GEMM_SHAPES)
def test_several_rows_match_the_scalar_reference(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 10000 + k * 100 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    got = linear_float32(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), group_rows=m).numpy()
    np.testing.assert_array_equal(got, ref_gemm(x, w, b))


@pytest.mark.parametrize("block", [1, 3, 64])
def test_blocked_group_layout_matches_the_reference(block: int, monkeypatch) -> None:
    """Weights laid out in blocks of rows (`LAYOUT_BLOCK_ROWS`, a last partial block included) give the sums of
    the reference; more output columns than a block, so every block is used."""
    monkeypatch.setattr(fc_order, "LAYOUT_BLOCK_ROWS", block)
    rng = np.random.default_rng(block)
    x = rng.standard_normal((3, 23)).astype(np.float32)
    w = rng.standard_normal((70, 23)).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    got = linear_float32(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(got, ref_linear(x, w, b))
    layout = fc_order._group_layout(w, 3)
    np.testing.assert_array_equal(layout, w[:, 3:23].reshape(70, 5, 4).transpose(1, 2, 0))


@pytest.mark.parametrize("run_elements", [1, 1 << 15])
def test_packed_order_where_sums_fall_on_float32_midpoints(run_elements: int, monkeypatch) -> None:
    """Where a float64 step sum of the packed order lands exactly on a float32 rounding midpoint while the exact
    sum lies just below it, rounding that float64 sum would round up (ties to even) and the fma rounds down: those
    outputs are summed again exactly, and every output equals the scalar fma reference. Rows 0 and 1 build that
    case, (2^24 + 2) + (1 + 2^-23)(1 - 2^-23) = 2^24 + 3 - 2^-46; the other rows are ordinary. Both ways of
    stepping are run: one step over all outputs at a time (large layers) and runs of steps (small ones)."""
    monkeypatch.setattr(fc_order, "CHAIN_RUN_ELEMENTS", run_elements)
    rng = np.random.default_rng(11)
    m, k, n = 6, 9, 13
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x[:2] = 0
    x[:2, 0], x[:2, 1] = 2.0 ** 24 + 2, 1 + 2.0 ** -23
    w[:, 0], w[:, 1] = 1, 1 - 2.0 ** -23
    b = rng.standard_normal(n).astype(np.float32)
    got = linear_float32(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), group_rows=m).numpy()
    np.testing.assert_array_equal(got, ref_gemm(x, w, b))
    # rounding the float64 sums alone would have given 2^24 + 4 there
    assert fma32(x[0, 1], w[0, 1], f32(2.0 ** 24 + 2)) == f32(2.0 ** 24 + 2)
    assert f32(np.float64(f32(2.0 ** 24 + 2)) + np.float64(x[0, 1]) * np.float64(w[0, 1])) == f32(2.0 ** 24 + 4)


def test_fma_reference_rounds_exactly() -> None:
    """The test's own fma: one rounding, not a rounded product then a rounded sum."""
    a, c = f32(1 + 2 ** -12), f32(-(1 + 2 ** -11))  # a·a = 1 + 2^-11 + 2^-24: rounded alone, 1 + 2^-11
    assert fma32(a, a, c) == f32(2 ** -24)
    assert f32(f32(a * a) + c) == 0


def test_rows_grouped_per_sample_and_leading_axes_kept() -> None:
    """A 2-D x sums each row alone; a batched x [B, rows, K] sums each sample's rows as one GEMM, so a sample's
    result does not depend on the batch it is in; group_rows groups a 2-D x the same way."""
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((3, 16, 37)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((20, 37)).astype(np.float32))
    y = linear_float32(x, w, None)
    assert y.shape == (3, 16, 20) and y.dtype == torch.float32
    assert torch.equal(y[1], linear_float32(x[1:2], w, None)[0])
    assert torch.equal(y.reshape(48, 20), linear_float32(x.reshape(48, 37), w, None, group_rows=16))
    flat = x.reshape(48, 37)
    assert torch.equal(linear_float32(flat, w, None)[5], linear_float32(flat[5:6], w, None)[0])
    assert not torch.equal(y.reshape(48, 20), linear_float32(flat, w, None))  # the grouping matters
    assert torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="groups of 5"):
        linear_float32(flat, w, None, group_rows=5)


def test_differs_from_an_exact_sum_somewhere() -> None:
    """The order is not the exactly rounded sum: otherwise the test above could not tell orders apart."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((64, 200)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((10, 200)).astype(np.float32))
    exact = (x.double() @ w.double().T).float()
    assert not torch.equal(linear_float32(x, w, None), exact)


MKL_SCRIPT = """
import json, sys, torch, torch.nn.functional as F
torch.manual_seed(0)
out = []
for m, k, n in json.loads(sys.argv[1]):
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out.append([x.tolist(), w.tolist(), b.tolist(), F.linear(x, w, b).tolist()])
print(json.dumps(out))
"""


def _mkl_sse42(shapes: List[List[int]]) -> list:
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS="SSE4_2", MKL_NUM_THREADS="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", MKL_SCRIPT, json.dumps(shapes)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(run.stdout)


NEEDS_MKL = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkl.is_available(),
    reason="needs torch on MKL on x86-64 to run MKL's SSE4.2 kernel")


@NEEDS_MKL
def test_equals_mkl_single_threaded_sse42_kernel_one_row() -> None:
    """The order is the one MKL's SSE4.2 kernel uses for one row (a CNN's classifier), on any x86 CPU."""
    shapes = [[1, k, n] for k, n in [[32, 10], [64, 10], [200, 2], [256, 4], [256, 2], [1152, 8], [13, 3], [5, 5],
                                     [21, 1]]]
    for x, w, b, y in _mkl_sse42(shapes):
        got = linear_float32(torch.tensor(x), torch.tensor(w), torch.tensor(b), group_rows=len(x))
        assert torch.equal(got, torch.tensor(y)), f"M={len(x)}, K={len(x[0])}, N={len(w)}"


@NEEDS_MKL
@pytest.mark.skipif(cpu_vendor() != "AuthenticAMD",
                    reason="MKL runs other several-row SSE4.2 kernels on this CPU vendor; the order is that of the "
                           "AMD CPU the upstream goldens were made on (their conformance tests run everywhere)")
def test_equals_mkl_single_threaded_sse42_kernel_several_rows() -> None:
    """The order is the one MKL's SSE4.2 kernels use for several rows on an AMD CPU, where upstream's goldens were
    made: the corpus's transformer layers, and every kernel (aligned, packed, leftover rows, N = 1). On an Intel
    CPU MKL dispatches these shapes to other kernels (checked on a Xeon with AVX-512: every several-row shape
    differed in a few ulps), so there the reference is the goldens alone."""
    shapes = [[16, 32, 32], [16, 32, 64], [16, 64, 32], [16, 32, 40], [32, 32, 37], [12, 32, 10], [3, 13, 7],
              [5, 32, 12], [7, 8, 20], [13, 33, 17], [4, 400, 12], [6, 200, 24], [7, 13, 1], [2, 1000, 8]]
    for x, w, b, y in _mkl_sse42(shapes):
        got = linear_float32(torch.tensor(x), torch.tensor(w), torch.tensor(b), group_rows=len(x))
        assert torch.equal(got, torch.tensor(y)), f"M={len(x)}, K={len(x[0])}, N={len(w)}"


def _fc_graph(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    from quantopt.graph.builder import GraphBuilder

    g = GraphBuilder("fc")
    i = g.input("x", list(x.shape))
    out = g.layer("FullyConnected", [i], [[int(x.shape[0]), int(w.shape[0])]], name="fc",
                  params={"num_output": int(w.shape[0])}, constants={"weights": w, "biases": b})
    return g.build([out])


def test_fc_float_summation_field_chooses_the_sum() -> None:
    """The cfg field `fc_float_summation`: upstream's float32 order by default, float64 rounded once on request."""
    import dataclasses

    from quantopt.config.layer_settings import LayerSettings

    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.standard_normal((16, 200)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((10, 200)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(10).astype(np.float32))
    graph = _fc_graph(x, w, b)
    assert torch.equal(graph.forward([x])[0], linear_float32(x, w, b, group_rows=16))  # one IR sample: 16 rows
    graph.node("fc").settings = dataclasses.replace(LayerSettings(), fc_float_summation="float64")
    exact = (x.double() @ w.double().T + b.double()).float()
    assert torch.equal(graph.forward([x])[0], exact)
    assert not torch.equal(exact, linear_float32(x, w, b, group_rows=16))


def test_fc_float_summation_field_is_read_from_the_cfg(tmp_path) -> None:
    from quantopt.config.reader import read_cfg
    from quantopt.errors import ConfigError

    (tmp_path / "m.txt").write_text("")
    base = "[Common]\ngraph = m.txt\ncalibrate_with_zero_inputs = true\n"
    (tmp_path / "ok.cfg").write_text(base + "fc_float_summation = float64\n")
    assert read_cfg(str(tmp_path / "ok.cfg")).fc_float_summation == "float64"
    (tmp_path / "bad.cfg").write_text(base + "fc_float_summation = fast\n")
    with pytest.raises(ConfigError, match="fc_float_summation"):
        read_cfg(str(tmp_path / "bad.cfg"))
