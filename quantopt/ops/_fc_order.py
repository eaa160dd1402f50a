"""The float32 FullyConnected of upstream's float forward, summed in one fixed, documented order.

Upstream runs FullyConnected as torch's float32 linear; its goldens were made where that is MKL's single-threaded
SSE4.2 kernel (docs/golden-differences.md). That kernel's order, written out here, makes every calibrated range of
the goldens' FullyConnected layers identical, on any machine and for any batch size (each row is summed as a batch
of one). All arithmetic is float32: every product is rounded, then added one float32 addition at a time (no fused
multiply-add). For an input row x [K] and weights W [N, K], with p_k = x_k · W[n, k]:

- Columns come in blocks of four (n < 4·floor(N/4)); each is a *quad* dot product. The remaining columns (N mod 4)
  come in pairs, then a single one: the first of a pair and the single one are *wide* dot products, the second of
  a pair a *narrow* one.
- quad: the first h = ((K - 1) mod 4) + 1 products are summed in order; that sum starts lane 0 of four lanes, which
  then take the remaining products round-robin (lane j gets p_{h+4i+j}, i = 0, 1, ...). Result (l0 + l2) + (l1 + l3).
- wide: the first h = min(4, K) products are summed in order; the next 8·floor((K - h)/8) products go, four at a
  time, alternately to two four-lane accumulators (the first one's lane 0 starts from the head sum), which are
  added lane by lane before (l0 + l2) + (l1 + l3); the last (K - h) mod 8 products are then added in order.
- narrow: as wide, with one four-lane accumulator taking the same products in the same order.
- The bias is added last.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

MAX_LANE_ELEMENTS = 1 << 22
"""Partial sums held at once (rows x columns x 4); more rows are summed in chunks."""
MAX_TILE_PRODUCTS = 1 << 18
"""Products made and summed at once (1 MiB of float32), so that they are summed while still in cache."""
MIN_TILE_COLUMNS, MIN_TILE_GROUPS = 64, 8
"""A tile spans at least this many columns (long contiguous passes) and, where that allows, this many groups."""


def _head_sum(x: np.ndarray, w: np.ndarray, h: int) -> np.ndarray:
    """Sum of the first h products in order: [B, K] x [C, K] -> [B, C]."""
    s = x[:, None, 0] * w[None, :, 0]
    for k in range(1, h):
        s = s + x[:, None, k] * w[None, :, k]
    return s


def _group_layout(t: np.ndarray, h: int) -> np.ndarray:
    """[R, K] -> [count, lane, R]: element h + 4i + j at [i, j], contiguous."""
    rows, count = int(t.shape[0]), (int(t.shape[1]) - h) // 4
    return np.ascontiguousarray(t[:, h:].reshape(rows, count, 4).transpose(1, 2, 0))


class OrderedWeights:
    """Weights [N, K] as float32 numpy, with the four-column blocks already in the layout the sums read: made once
    per layer and reused by every forward while the weights are unchanged (the transposing copy costs more than a
    small layer's sums)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = np.ascontiguousarray(w.detach().to(device="cpu", dtype=torch.float32).numpy())
        k_total, n_out = int(self.w.shape[1]), int(self.w.shape[0])
        self.h = (k_total - 1) % 4 + 1
        self.main = 4 * (n_out // 4)
        self.blocks = _group_layout(self.w[:self.main], self.h)[:, :, None, :] if k_total > self.h else None


def _quad(x: np.ndarray, w: np.ndarray, wg: Optional[np.ndarray]) -> np.ndarray:
    """Blocks of four columns (`wg`: their products' weights in `_group_layout`, [count, lane, 1, cols]).

    The products are made and summed in tiles (a band of columns, a run of groups) small enough to stay in cache;
    each lane's running sum is carried from one run to the next. A tile's sum is one `np.add.reduce` over the
    leading axis of a C-contiguous array, which numpy performs as one element-wise addition of whole rows after
    another (pairwise summation applies only along the contiguous axis); tests/ops/test_fc_order.py checks the
    result against a scalar reference."""
    k_total = int(x.shape[1])
    h = (k_total - 1) % 4 + 1
    s = _head_sum(x, w, h)
    if k_total == h:
        return s
    count = (k_total - h) // 4
    rows, cols = int(x.shape[0]), int(w.shape[0])
    # [count, lane, rows, 1] and [count, lane, 1, cols]: product p_{h+4i+j} of group i at lane j, with the columns
    # innermost so every element-wise pass runs over contiguous rows
    xg = _group_layout(x, h)[:, :, :, None]
    tile = min(cols, max(MIN_TILE_COLUMNS, MAX_TILE_PRODUCTS // (4 * rows * MIN_TILE_GROUPS)))
    run = max(1, MAX_TILE_PRODUCTS // (4 * rows * tile))
    out = np.empty((rows, cols), dtype=np.float32)
    terms = np.empty((min(run, count) + 1, 4, rows, tile), dtype=np.float32)
    for c0 in range(0, cols, tile):
        c1 = min(cols, c0 + tile)
        lanes = None
        for g0 in range(0, count, run):
            g1 = min(count, g0 + run)
            if lanes is None:  # the first run: lane 0 starts from the head sum, the others from their product
                part = terms[:g1 - g0, :, :, :c1 - c0]
                np.multiply(xg[g0:g1], wg[g0:g1, :, :, c0:c1], out=part)  # each product rounded to float32
                part[0, 0] = s[:, c0:c1] + part[0, 0]
            else:  # later runs start from the running lanes
                part = terms[:g1 - g0 + 1, :, :, :c1 - c0]
                part[0] = lanes
                np.multiply(xg[g0:g1], wg[g0:g1, :, :, c0:c1], out=part[1:])
            lanes = np.add.reduce(part, axis=0)
        out[:, c0:c1] = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
    return out


def _wide_or_narrow(x: np.ndarray, w: np.ndarray, accumulators: int) -> np.ndarray:
    """One column (w [1, K]) as a wide (two accumulators) or narrow (one) dot product: [B, K] -> [B, 1]."""
    k_total = int(x.shape[1])
    h = min(4, k_total)
    s = _head_sum(x, w, h)[:, 0]
    n_body = 8 * ((k_total - h) // 8)
    if n_body:
        rows, groups = int(x.shape[0]), n_body // 4
        products = np.ascontiguousarray((x[:, h:h + n_body] * w[0, h:h + n_body]).reshape(rows, groups, 4)
                                        .transpose(1, 0, 2))  # [groups, rows, lane]
        products[0, :, 0] = s + products[0, :, 0]  # the first accumulator's lane 0 starts from the head sum
        lanes = np.add.reduce(products[0::accumulators], axis=0)  # groups taken in turn by the accumulators
        for a in range(1, accumulators):
            lanes = lanes + np.add.reduce(products[a::accumulators], axis=0)
        s = (lanes[:, 0] + lanes[:, 2]) + (lanes[:, 1] + lanes[:, 3])
    for k in range(h + n_body, k_total):
        s = s + x[:, k] * w[0, k]
    return s[:, None]


def _dot_rows(x: np.ndarray, weights: OrderedWeights) -> np.ndarray:
    """[B, K] x [N, K] -> [B, N] float32 in the order above."""
    w, main = weights.w, weights.main
    n_out = int(w.shape[0])
    out = np.empty((int(x.shape[0]), n_out), dtype=np.float32)
    if main:
        out[:, :main] = _quad(x, w[:main], weights.blocks)
    rest = n_out - main
    for r in range(rest):
        n = main + r
        second_of_pair = r % 2 == 1 and r < 2 * (rest // 2)
        out[:, n:n + 1] = _wide_or_narrow(x, w[n:n + 1], 1 if second_of_pair else 2)
    return out


def linear_float32(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                   prepared: Optional[OrderedWeights] = None) -> torch.Tensor:
    """y = x @ w.T + b over the last axis of a float32 `x`, summed in the module's order; float32 result on x's
    device (the sums themselves are computed with numpy on the CPU). `prepared`: `OrderedWeights(w)` kept by the
    caller across forwards."""
    weights = prepared if prepared is not None else OrderedWeights(w)
    n_out = int(weights.w.shape[0])
    x32 = x.detach().to(device="cpu", dtype=torch.float32)
    lead = tuple(x32.shape[:-1])
    rows = x32.reshape(-1, int(x32.shape[-1])).numpy()
    step = max(1, MAX_LANE_ELEMENTS // max(1, 4 * n_out))
    parts = [_dot_rows(rows[i:i + step], weights) for i in range(0, int(rows.shape[0]), step)]
    y = np.concatenate(parts) if parts else np.empty((0, n_out), dtype=np.float32)
    if b is not None:
        y = y + b.detach().to(device="cpu", dtype=torch.float32).numpy()
    return torch.from_numpy(y).reshape(*lead, n_out).to(x.device)
