"""The float32 FullyConnected of upstream's float forward, summed in one fixed, documented order.

Upstream runs FullyConnected as torch's float32 linear; its goldens were made where that is MKL's kernels on an
x86-64 machine, on one thread (docs/golden-differences.md). Their order, written out here, makes the calibrated
ranges of the goldens' FullyConnected layers identical, on any machine and for any batch size. Upstream
calibrates one sample at a time, so the rows of one sample (`group_rows`, e.g. 16 for a sample [1, 16, 32]) make
one GEMM of M rows, and MKL picks its kernel, and so its order, by M, N and K. All arithmetic is float32; p_k =
x_k · W[n, k] is the rounded product, except where a fused multiply-add (fma) is named.

One row (M = 1):
- Columns come in blocks of four (n < 4·floor(N/4)); each is a *quad* dot product with the head
  h = ((K - 1) mod 4) + 1. The remaining columns (N mod 4) come in pairs, then a single one: the first of a pair
  and the single one are *wide* dot products, the second of a pair a *narrow* one, all with the head h = min(4, K).
- quad(h): the first h products are summed in order; that sum starts lane 0 of four lanes, which then take the
  following products round-robin (lane j gets p_{h+4i+j}) while four are left; result (l0 + l2) + (l1 + l3); any
  last products (fewer than four) are then added in order.
- wide(h): the first h products are summed in order; the next 8·floor((K - h)/8) products go, four at a time,
  alternately to two four-lane accumulators (the first one's lane 0 starts from the head sum), which are added
  lane by lane before (l0 + l2) + (l1 + l3); the last products are then added in order. narrow(h): as wide, with
  one four-lane accumulator taking the same products in the same order.
- The bias is added last.

Several rows (M >= 2), row r of the group starting at float offset r·K of an aligned buffer:
- N = 1: the one-row order with rows and columns swapped: rows r < 4·floor(M/4) are quad dot products, the others
  pairs (wide, narrow) and a single wide one, as the columns above; the bias last.
- M >= 4 and N >= 12, *packed*: K is cut into blocks (one block for K <= 192; two of floor(K/2) and a last one of
  the odd product for K <= 384; else blocks of 192 and the rest); each block is summed from zero by fma in order
  of k; the output starts as the bias and each block's sum is added to it in turn (all rows: on one thread MKL
  also runs the rows after 4·floor(M/4) through this kernel).
- Otherwise (M < 4, N < 12), *aligned*: row r's head h = min(K, (-r·K) mod 4) is the products up to the next
  16-byte boundary; columns n < 4·floor(N/4) are quad(h), the others wide(h); the bias last.

tests/ops/test_fc_order.py checks this against a scalar reference and, where torch runs on MKL, against MKL.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

MAX_LANE_ELEMENTS = 1 << 22
"""Partial sums held at once (rows x columns x 4); more rows are summed in chunks."""
MAX_TILE_PRODUCTS = 1 << 18
"""Products made and summed at once (1 MiB of float32), so that they are summed while still in cache."""
MIN_TILE_COLUMNS, MIN_TILE_GROUPS = 64, 8
"""A tile spans at least this many columns (long contiguous passes) and, where that allows, this many groups."""
PACKED_MIN_ROWS, PACKED_MIN_COLUMNS = 4, 12
"""The smallest GEMM (rows, columns) MKL sums with its packed fma kernel."""
PACKED_BLOCK = 192
"""The packed kernel's K block."""
CHAIN_RUN_ELEMENTS = 1 << 15
"""Products of the packed order made at once (256 KiB of float64)."""
_LOW_BITS, _MIDPOINT = np.int64((1 << 29) - 1), np.int64(1 << 28)
"""float64 bits below float32 precision, and their pattern at a float32 rounding midpoint."""


def _head_sum(x: np.ndarray, w: np.ndarray, h: int) -> np.ndarray:
    """Sum of the first h >= 1 products in order: [B, K] x [C, K] -> [B, C]."""
    s = x[:, None, 0] * w[None, :, 0]
    for k in range(1, h):
        s = s + x[:, None, k] * w[None, :, k]
    return s


def _add_in_order(s: Optional[np.ndarray], x: np.ndarray, w: np.ndarray, k0: int, k1: int) -> Optional[np.ndarray]:
    """s (or nothing) plus products k0 .. k1 - 1, one float32 addition at a time: [B, K] x [C, K] -> [B, C]."""
    for k in range(k0, k1):
        p = x[:, None, k] * w[None, :, k]
        s = p if s is None else s + p
    return s


LAYOUT_BLOCK_ROWS = 64
"""Rows transposed at once by `_group_layout`: a block's reads and writes stay in cache (a 8192x8192 weight: 1.0 s
transposed whole, 0.11 s in blocks of 64 rows, 0.17 s of 256)."""


def _group_layout(t: np.ndarray, h: int) -> np.ndarray:
    """[R, K] -> [count, lane, R]: element h + 4i + j at [i, j] for the whole groups of four after h, contiguous."""
    rows, count = int(t.shape[0]), (int(t.shape[1]) - h) // 4
    groups = t[:, h:h + 4 * count].reshape(rows, count, 4)
    out = np.empty((count, 4, rows), dtype=t.dtype)
    for r0 in range(0, rows, LAYOUT_BLOCK_ROWS):
        out[:, :, r0:r0 + LAYOUT_BLOCK_ROWS] = groups[r0:r0 + LAYOUT_BLOCK_ROWS].transpose(1, 2, 0)
    return out


class OrderedWeights:
    """Weights [N, K] as float32 numpy, with the four-column blocks already in the layout the sums read: made once
    per layer and reused by every forward while the weights are unchanged (the transposing copy costs more than a
    small layer's sums). The layouts for other heads (the aligned order) are made when first needed."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = np.ascontiguousarray(w.detach().to(device="cpu", dtype=torch.float32).numpy())
        k_total, n_out = int(self.w.shape[1]), int(self.w.shape[0])
        self.h = (k_total - 1) % 4 + 1
        self.main = 4 * (n_out // 4)
        self._layouts: Dict[int, Optional[np.ndarray]] = {}
        self.blocks = self.layout(self.h)

    def layout(self, h: int) -> Optional[np.ndarray]:
        """The four-column blocks' products after a head of h, [count, lane, 1, cols]; None without a group."""
        if h not in self._layouts:
            k_total = int(self.w.shape[1])
            self._layouts[h] = _group_layout(self.w[:self.main], h)[:, :, None, :] if k_total - h >= 4 else None
        return self._layouts[h]


def _quad(x: np.ndarray, w: np.ndarray, wg: Optional[np.ndarray], h: int) -> np.ndarray:
    """quad(h) for every row and column (`wg`: the columns' products' weights in `_group_layout`, [count, lane, 1,
    cols], or None when fewer than four products follow the head).

    The products are made and summed in tiles (a band of columns, a run of groups) small enough to stay in cache;
    each lane's running sum is carried from one run to the next. A tile's sum is one `np.add.reduce` over the
    leading axis of a C-contiguous array, which numpy performs as one element-wise addition of whole rows after
    another (pairwise summation applies only along the contiguous axis); tests/ops/test_fc_order.py checks the
    result against a scalar reference."""
    k_total = int(x.shape[1])
    s = _head_sum(x, w, h) if h else None
    if wg is None:
        out = _add_in_order(s, x, w, h, k_total)
        assert out is not None
        return out
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
                if s is not None:
                    part[0, 0] = s[:, c0:c1] + part[0, 0]
            else:  # later runs start from the running lanes
                part = terms[:g1 - g0 + 1, :, :, :c1 - c0]
                part[0] = lanes
                np.multiply(xg[g0:g1], wg[g0:g1, :, :, c0:c1], out=part[1:])
            lanes = np.add.reduce(part, axis=0)
        out[:, c0:c1] = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
    tail = _add_in_order(out, x, w, h + 4 * count, k_total)
    assert tail is not None
    return tail


def _wide_or_narrow(x: np.ndarray, w: np.ndarray, accumulators: int, h: int) -> np.ndarray:
    """wide(h) (two accumulators) or narrow(h) (one) for every row of x and each of the few columns of w:
    [B, K] x [C, K] -> [B, C]."""
    k_total = int(x.shape[1])
    s = _head_sum(x, w, h) if h else None
    n_body = 8 * ((k_total - h) // 8)
    if n_body:
        rows, cols, groups = int(x.shape[0]), int(w.shape[0]), n_body // 4
        # [groups, rows, cols, lane]
        products = np.ascontiguousarray((x[:, None, h:h + n_body] * w[None, :, h:h + n_body])
                                        .reshape(rows, cols, groups, 4).transpose(2, 0, 1, 3))
        if s is not None:  # the first accumulator's lane 0 starts from the head sum
            products[0, :, :, 0] = s + products[0, :, :, 0]
        lanes = np.add.reduce(products[0::accumulators], axis=0)  # groups taken in turn by the accumulators
        for a in range(1, accumulators):
            lanes = lanes + np.add.reduce(products[a::accumulators], axis=0)
        s = (lanes[..., 0] + lanes[..., 2]) + (lanes[..., 1] + lanes[..., 3])
    out = _add_in_order(s, x, w, h + n_body, k_total)
    assert out is not None
    return out


def _rest_columns(x: np.ndarray, w: np.ndarray, h: int) -> np.ndarray:
    """The one-row order's columns after the blocks of four (pairs: wide, narrow; a single one: wide)."""
    rest = int(w.shape[0])
    out = np.empty((int(x.shape[0]), rest), dtype=np.float32)
    for r in range(rest):
        second_of_pair = r % 2 == 1 and r < 2 * (rest // 2)
        out[:, r:r + 1] = _wide_or_narrow(x, w[r:r + 1], 1 if second_of_pair else 2, h)
    return out


def _dot_rows(x: np.ndarray, weights: OrderedWeights) -> np.ndarray:
    """One-row order: [B, K] x [N, K] -> [B, N] float32, each row as a GEMM of one row."""
    w, main = weights.w, weights.main
    n_out = int(w.shape[0])
    out = np.empty((int(x.shape[0]), n_out), dtype=np.float32)
    if main:
        out[:, :main] = _quad(x, w[:main], weights.blocks, weights.h)
    if n_out > main:
        out[:, main:] = _rest_columns(x, w[main:], min(4, int(w.shape[1])))
    return out


def _aligned(x: np.ndarray, weights: OrderedWeights, h: int) -> np.ndarray:
    """Aligned order for rows of one head h: [B, K] x [N, K] -> [B, N]."""
    w, main = weights.w, weights.main
    out = np.empty((int(x.shape[0]), int(w.shape[0])), dtype=np.float32)
    if main:
        out[:, :main] = _quad(x, w[:main], weights.layout(h), h)
    if int(w.shape[0]) > main:
        out[:, main:] = _wide_or_narrow(x, w[main:], 2, h)
    return out


def _fma_add(acc: np.ndarray, p: np.ndarray, buf: np.ndarray) -> None:
    """acc <- fma(x, w, acc) in float32, exactly rounded, in place, given the exact float64 products p = x · w
    (acc, p, buf of one shape, buf float64).

    The float64 product is exact and so is, almost always, rounding the float64 sum to float32; only a float64 sum
    that falls on a float32 rounding midpoint may hide the sum's remainder, and those few are nudged one float64
    step towards it (round to odd) before the float32 rounding."""
    np.add(p, acc, out=buf)
    mid = _at_midpoint(buf)
    if mid.any():
        idx = np.nonzero(mid)
        q, a, s = p[idx], acc[idx].astype(np.float64), buf[idx]
        t = s - q
        e = (q - (s - t)) + (a - t)  # the exact sum is s + e
        step = np.where(e == 0, 0, np.where((e > 0) == (s > 0), 1, -1))
        buf[idx] = (s.view(np.int64) + step).view(np.float64)
    acc[...] = buf


def _at_midpoint(s: np.ndarray) -> np.ndarray:
    """Where a float64 value lies on a float32 rounding midpoint (its bits below float32 precision are 100...0)."""
    return (s.view(np.int64) & _LOW_BITS) == _MIDPOINT


def _fma_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each output's fma chain from zero over k in order: x [R, Kb], w [Kb, N] (float64, float32 values) ->
    float32 [R, N].

    Products are made a run of steps at a time and each step is two whole-array passes (the float64 sum written
    over its product, then rounded to float32): the float32 rounding of the float64 sum is the fma's, except where
    that sum sits on a float32 midpoint. The few outputs where any step did are summed again, alone, by the exact
    step (`_fma_add`). Per-step numpy calls, not products, dominate a small layer, so this is what makes the packed
    order affordable; the run's buffers are small enough to be reused from the heap rather than mapped afresh."""
    rows, kb, cols = int(x.shape[0]), int(x.shape[1]), int(w.shape[1])
    run = max(1, min(kb, CHAIN_RUN_ELEMENTS // max(1, rows * cols)))
    if run == 1:  # outputs too many for a run of steps: each step exact at once, its passes long enough
        acc = np.zeros((rows, cols), dtype=np.float32)
        p, buf = np.empty((rows, cols), dtype=np.float64), np.empty((rows, cols), dtype=np.float64)
        for k in range(kb):
            _fma_add(acc, np.multiply(x[:, k:k + 1], w[k:k + 1], out=p), buf)
        return acc
    products = np.empty((run, rows, cols), dtype=np.float64)
    low_bits = np.empty((run, rows, cols), dtype=np.int64)
    acc = np.zeros((rows, cols), dtype=np.float32)
    hit = np.zeros((rows, cols), dtype=bool)
    xt = np.ascontiguousarray(x.T)
    for k0 in range(0, kb, run):
        k1 = min(kb, k0 + run)
        part = products[:k1 - k0]
        np.multiply(xt[k0:k1, :, None], w[k0:k1, None, :], out=part)  # p_k, then step k's float64 sum there
        for step in part:
            np.add(step, acc, out=step)
            acc[...] = step
        at_mid = np.bitwise_and(part.view(np.int64), _LOW_BITS, out=low_bits[:k1 - k0]) == _MIDPOINT
        if at_mid.any():  # rare: only then find the outputs
            hit |= at_mid.any(axis=0)
    redo = np.nonzero(hit)
    if redo[0].size:
        r, c = redo
        xe, we = x[r], w[:, c].T  # [E, Kb] each: the operands of the outputs summed again
        exact = np.zeros(r.size, dtype=np.float32)
        buf = np.empty(r.size, dtype=np.float64)
        for k in range(kb):
            _fma_add(exact, xe[:, k] * we[:, k], buf)
        acc[r, c] = exact
    return acc


def _k_blocks(k_total: int) -> list:
    """The packed kernel's K blocks as (start, stop)."""
    if k_total <= PACKED_BLOCK:
        cut = [0, k_total]
    else:
        size = k_total // 2 if k_total <= 2 * PACKED_BLOCK else PACKED_BLOCK
        cut = list(range(0, size * (k_total // size) + 1, size))
        if cut[-1] != k_total:
            cut.append(k_total)
    return list(zip(cut[:-1], cut[1:]))


def _packed(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    """Packed order with the bias: [B, K] x [N, K] -> [B, N] (rows chunked to bound the float64 buffers)."""
    rows, n_out = int(x.shape[0]), int(w.shape[0])
    out = np.empty((rows, n_out), dtype=np.float32)
    x64, w64 = x.astype(np.float64), w.T.astype(np.float64)  # w64 [K, N]
    blocks = _k_blocks(int(x.shape[1]))
    step = max(1, MAX_TILE_PRODUCTS // max(1, n_out))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        c = None if b is None else np.broadcast_to(b, (r1 - r0, n_out)).astype(np.float32)
        for k0, k1 in blocks:
            acc = _fma_chain(x64[r0:r1, k0:k1], w64[k0:k1])
            c = acc if c is None else c + acc
        assert c is not None
        out[r0:r1] = c
    return out


def _with_bias(y: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    return y if b is None else y + b


def _group_sums(x: np.ndarray, weights: OrderedWeights, b: Optional[np.ndarray], m: int) -> np.ndarray:
    """Every group of m rows as one GEMM in MKL's order: x [G·m, K] -> [G·m, N], bias included."""
    w = weights.w
    n_out, k_total = int(w.shape[0]), int(w.shape[1])
    if m == 1:
        return _with_bias(_dot_rows(x, weights), b)
    xs = x.reshape(-1, m, k_total)
    out = np.empty((int(xs.shape[0]), m, n_out), dtype=np.float32)
    main_rows = 4 * (m // 4)
    if n_out == 1:  # the one-row order with rows and columns swapped
        if main_rows:
            h = (k_total - 1) % 4 + 1
            wl = _group_layout(w, h)[:, :, None, :] if k_total - h >= 4 else None
            out[:, :main_rows, 0] = _quad(xs[:, :main_rows].reshape(-1, k_total), w, wl, h) \
                .reshape(-1, main_rows)
        for r in range(main_rows, m):
            q = r - main_rows
            second_of_pair = q % 2 == 1 and q < 2 * ((m - main_rows) // 2)
            out[:, r] = _wide_or_narrow(xs[:, r], w, 1 if second_of_pair else 2, min(4, k_total))
        return _with_bias(out, b).reshape(-1, n_out)
    packed_rows = 0
    if m >= PACKED_MIN_ROWS and n_out >= PACKED_MIN_COLUMNS:
        packed_rows = m
        out[:, :packed_rows] = _packed(xs[:, :packed_rows].reshape(-1, k_total), w, b).reshape(-1, packed_rows, n_out)
    for h in range(4):  # the aligned order: rows by the head their offset gives
        rows = [r for r in range(packed_rows, m) if min(k_total, (-r * k_total) % 4) == h]
        if rows:
            y = _aligned(xs[:, rows].reshape(-1, k_total), weights, h)
            out[:, rows] = _with_bias(y, b).reshape(-1, len(rows), n_out)
    return out.reshape(-1, n_out)


def linear_float32(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                   prepared: Optional[OrderedWeights] = None, group_rows: Optional[int] = None) -> torch.Tensor:
    """y = x @ w.T + b over the last axis of a float32 `x`, summed in the module's order; float32 result on x's
    device (the sums themselves are computed with numpy on the CPU). `prepared`: `OrderedWeights(w)` kept by the
    caller across forwards. `group_rows`: rows of one sample, summed as one GEMM as upstream's batch-of-one
    calibration sums them (the rows of the FullyConnected's input in the IR); by default the rows of x[i] (those of
    a sample x[i] of a batched 3-D or higher x), or each row alone for a 2-D x."""
    weights = prepared if prepared is not None else OrderedWeights(w)
    n_out = int(weights.w.shape[0])
    x32 = x.detach().to(device="cpu", dtype=torch.float32)
    lead = tuple(x32.shape[:-1])
    rows = x32.reshape(-1, int(x32.shape[-1])).numpy()
    total = int(rows.shape[0])
    if group_rows is None:
        group_rows = int(np.prod(lead[1:], dtype=np.int64)) if len(lead) >= 2 else 1
    if group_rows < 1 or (total and total % group_rows):
        raise ValueError(f"{total} rows do not split into groups of {group_rows}")
    bias = None if b is None else b.detach().to(device="cpu", dtype=torch.float32).numpy()
    per_row = max(1, 4 * n_out)
    step = group_rows * max(1, MAX_LANE_ELEMENTS // (per_row * group_rows))
    parts = [_group_sums(rows[i:i + step], weights, bias, group_rows) for i in range(0, total, step)]
    y = np.concatenate(parts) if parts else np.empty((0, n_out), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)).reshape(*lead, n_out).to(x.device)
