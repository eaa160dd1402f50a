"""FullyConnected's float forward groups the rows of one IR sample as upstream's GEMM does (ops/_fc_order.py):
the same per-sample result at any batch, the several-row order for small samples, and beyond GEMM_ORDER_MAX_MACS
multiply-adds (where no affordable emulation of the order exists) torch's own float32 GEMM one sample at a time on
one thread; one row is always summed in the one-row order."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quantopt.graph.builder import GraphBuilder
from quantopt.ops._fc_order import linear_float32
from quantopt.ops.linear import GEMM_ORDER_MAX_MACS
from quantopt.threads import one_thread


def _fc(rows: int, k: int, n: int, seed: int = 0):
    r = np.random.default_rng(seed)
    g = GraphBuilder("fc")
    x = g.input("x", [rows, k])  # a 2-D IR input: one sample is all its rows
    w = r.normal(0, 0.3, (n, k)).astype(np.float32)
    b = r.normal(0, 0.1, n).astype(np.float32)
    y = g.layer("FullyConnected", [x], [[rows, n]], name="fc", params=dict(num_output=n, with_activation="NONE"),
                constants={"weights": w, "biases": b})
    return g.build([y]), torch.from_numpy(w), torch.from_numpy(b)


@pytest.mark.parametrize("rows, k, n, grouped", [(16, 32, 32, True), (4, 200, 12, True), (64, 128, 160, False)])
def test_sample_rows_and_batches(rows: int, k: int, n: int, grouped: bool) -> None:
    assert (rows * k * n <= GEMM_ORDER_MAX_MACS) == grouped
    graph, w, b = _fc(rows, k, n)
    x = torch.from_numpy(np.random.default_rng(1).normal(0, 1, (3 * rows, k)).astype(np.float32))
    one, = graph.forward([x[:rows]])
    one = one.clone()
    three, = graph.forward([x])  # three samples in one batch, concatenated along dim 0
    assert torch.equal(three[:rows], one)
    if grouped:
        assert torch.equal(one, linear_float32(x[:rows], w, b, group_rows=rows))
        # the several-row order is another rounding than one row at a time
        assert not torch.equal(one, linear_float32(x[:rows], w, b, group_rows=1))
    else:
        with one_thread():
            blas = F.linear(x[:rows], w, b)
        assert torch.equal(one, blas)
        assert not torch.equal(one, linear_float32(x[:rows], w, b, group_rows=1))


@pytest.mark.parametrize("k, n", [(1024, 1100), (2048, 1000)])
def test_one_row_keeps_the_upstream_order_at_any_size(k: int, n: int) -> None:
    """A one-row sample (a CNN's classifier) is summed in MKL's one-row order whatever its size."""
    assert k * n > GEMM_ORDER_MAX_MACS
    graph, w, b = _fc(1, k, n)
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 1, (2, k)).astype(np.float32))
    out, = graph.forward([x])
    assert torch.equal(out, linear_float32(x, w, b, group_rows=1))


@pytest.mark.parametrize("given", [1, 3, 5])
def test_rows_that_are_not_whole_ir_samples_are_one_sample(given: int) -> None:
    """A batch that is not a whole number of IR samples (fewer samples than an IR batch of several, after
    modify_batch_dim) runs as one sample of all its rows, in the order of that many rows, instead of failing."""
    graph, w, b = _fc(2, 24, 16)
    x = torch.from_numpy(np.random.default_rng(3).normal(0, 1, (given, 24)).astype(np.float32))
    out, = graph.forward([x])
    assert out.shape == (given, 16)
    assert torch.equal(out, linear_float32(x, w, b, group_rows=given))
    if given > 1:  # the several-row order of `given` rows, not each row alone
        assert not torch.equal(out, linear_float32(x, w, b, group_rows=1))
