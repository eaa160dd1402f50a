"""FullyConnected's float32 summation order (ops/_fc_order.py) against a scalar reference written here from the
module's description, and, where torch runs on MKL on x86-64, against MKL's single-threaded SSE4.2 kernel itself."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import List

import numpy as np
import pytest
import torch

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


def test_rows_are_summed_alone_and_leading_axes_kept() -> None:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((2, 5, 37)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((10, 37)).astype(np.float32))
    y = linear_float32(x, w, None)
    assert y.shape == (2, 5, 10) and y.dtype == torch.float32
    assert torch.equal(y[1, 3], linear_float32(x[1, 3:4], w, None)[0])
    assert torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)


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
for k, n in json.loads(sys.argv[1]):
    x, w, b = torch.randn(1, k), torch.randn(n, k), torch.randn(n)
    out.append([x.tolist(), w.tolist(), b.tolist(), F.linear(x, w, b).tolist()])
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkl.is_available(),
                    reason="needs torch on MKL on x86-64 to run MKL's SSE4.2 kernel")
def test_equals_mkl_single_threaded_sse42_kernel() -> None:
    """The order is the one MKL's SSE4.2 kernel uses (upstream's goldens were made with it)."""
    shapes = [[32, 10], [64, 10], [200, 2], [256, 4], [256, 2], [1152, 8], [13, 3], [5, 5], [21, 1]]
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS="SSE4_2", MKL_NUM_THREADS="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", MKL_SCRIPT, json.dumps(shapes)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    for x, w, b, y in json.loads(run.stdout):
        got = linear_float32(torch.tensor(x), torch.tensor(w), torch.tensor(b))
        assert torch.equal(got, torch.tensor(y)), f"K={len(x[0])}, N={len(w)}"


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
    assert torch.equal(graph.forward([x])[0], linear_float32(x, w, b))
    graph.node("fc").settings = dataclasses.replace(LayerSettings(), fc_float_summation="float64")
    exact = (x.double() @ w.double().T + b.double()).float()
    assert torch.equal(graph.forward([x])[0], exact)
    assert not torch.equal(exact, linear_float32(x, w, b))


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
