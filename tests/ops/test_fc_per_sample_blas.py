"""FullyConnected samples of several rows beyond GEMM_ORDER_MAX_MACS (ops/linear.py, `linear_per_sample`): torch's
float32 GEMM one IR sample at a time on one thread, which is what upstream's float32 forward computes at batch one
on the same machine. The reference here is torch's kernel called directly, sample by sample, on one thread."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.builder import GraphBuilder
from quantopt.ops.linear import GEMM_ORDER_MAX_MACS, linear_per_sample
from quantopt.threads import one_thread

ROWS, K, N = 48, 96, 320  # 1.47M multiply-adds per sample: beyond the emulated order's bound


def _graph(w: torch.Tensor, b: torch.Tensor):
    g = GraphBuilder("fc_large")
    i = g.input("x", [1, ROWS, K])
    out = g.layer("FullyConnected", [i], [[1, ROWS, N]], name="fc", params={"num_output": N},
                  constants={"weights": w, "biases": b})
    return g.build([out])


def _data(seed: int = 21):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((4, ROWS, K)).astype(np.float32))
    w = torch.from_numpy((0.1 * rng.standard_normal((N, K))).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with one_thread():
        return torch.stack([F.linear(x[i], w, b) for i in range(x.shape[0])])


def test_large_sample_takes_torchs_kernel_per_sample_whatever_the_batch() -> None:
    assert ROWS * K * N > GEMM_ORDER_MAX_MACS
    x, w, b = _data()
    graph = _graph(w, b)
    ref = _reference(x, w, b)
    batched = graph.forward([x])[0]
    assert torch.equal(batched, ref)
    for i in range(x.shape[0]):  # a sample's bits do not depend on the batch it is in
        assert torch.equal(graph.forward([x[i:i + 1]])[0][0], ref[i])


def test_not_the_float64_sum() -> None:
    """The path is torch's float32 kernel, not the exactly rounded float64 sum that `fc_float_summation = float64`
    takes (otherwise the test above could not tell the two apart)."""
    x, w, b = _data()
    graph = _graph(w, b)
    exact = (x.double() @ w.double().T + b.double()).float()
    assert not torch.equal(graph.forward([x])[0], exact)
    graph.node("fc").settings = dataclasses.replace(LayerSettings(), fc_float_summation="float64")
    assert torch.equal(graph.forward([x])[0], exact)


def test_thread_count_does_not_change_the_bits() -> None:
    """Few rows and many inputs is the shape where a multi-threaded GEMM splits its sums between threads; the
    per-sample GEMM runs on one thread, so two threads give one thread's bits."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((3, 6, 2048)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((1536, 2048)).astype(np.float32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_per_sample(x, w, None, 6)
        torch.set_num_threads(2)
        two = linear_per_sample(x, w, None, 6)
        assert torch.get_num_threads() == 2  # restored after the GEMMs
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_rows_that_do_not_split_into_samples_are_one_sample() -> None:
    """An input whose rows are no multiple of the IR sample's (a dynamic dimension) is summed as one GEMM; an empty
    input gives an empty output."""
    x, w, b = _data()
    flat = x.reshape(-1, K)[:50]
    with one_thread():
        ref = F.linear(flat, w, b)
    assert torch.equal(linear_per_sample(flat, w, b, ROWS), ref)
    assert linear_per_sample(flat[:0], w, b, ROWS).shape == (0, N)
