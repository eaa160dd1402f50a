"""The float32 sums of upstream's float forward, in the fixed orders torch's single-threaded CPU reduction takes with
256-bit vectors (docs/golden-differences.md): a contiguous row (`fixed_row_sum`), a row read as strided blocks
(`block_row_sum`), a reduction over an outer axis with a contiguous kept axis (`channel_row_sum`), and any axis of a
contiguous tensor (`axis_sum`). Shared by the operator families that reproduce such a sum (op modules import only
helpers like this one, never each other). numpy float32 arithmetic throughout: the result depends on neither the
machine nor the thread count."""
from __future__ import annotations

from typing import Any, List

import numpy as np
import torch

from ._lut_int import ceil_log2

SUM_LANES = 8
"""Lanes of the vector accumulators of the fixed float32 row sum (torch's CPU sum with 256-bit vectors)."""

SUM_ILP = 4
"""Vector accumulators interleaved by the fixed float32 row sum."""

SUM_LEVELS = 4
"""Levels of the cascade that groups the fixed float32 row sum's partial sums."""


def _fold(t: np.ndarray, axis: int) -> np.ndarray:
    """Left-to-right float sum of `t` along `axis`, starting from 0 (zeros where the axis is empty)."""
    acc = np.zeros(t.shape[:axis] + t.shape[axis + 1:], dtype=t.dtype)
    index: List[Any] = [slice(None)] * axis
    for k in range(t.shape[axis]):
        acc = acc + t[tuple(index + [k])]
    return acc


def _cascade(v: np.ndarray) -> np.ndarray:
    """Sum over axis 1 of v [R, S, ...] in a cascade of SUM_LEVELS levels: blocks of `step` consecutive items are
    folded, `step` consecutive block sums make a level-2 sum and so on; the last level folds all the level below, and
    the unfinished remainder of each level is added at the end, lowest level first."""
    size = int(v.shape[1])
    step = 1 << max(4, ceil_log2(max(size, 1)) // SUM_LEVELS)
    sums = v
    partial = []
    for level in range(SUM_LEVELS):
        n = int(sums.shape[1])
        if level == SUM_LEVELS - 1:
            partial.append(_fold(sums, 1))
            break
        full = n // step * step
        partial.append(_fold(sums[:, full:], 1))
        if full == 0:  # the levels above would all be empty: their partial sums 0, and a sum that is never -0 stays
            break      # the same when 0 is added to it
        sums = _fold(sums[:, :full].reshape(sums.shape[0], n // step, step, *sums.shape[2:]), 2)
    out = partial[0]
    for p in partial[1:]:
        out = out + p
    return out


def _interleaved_sum(x: np.ndarray) -> np.ndarray:
    """Sum over axis 1 of x [R, n, ...]: SUM_ILP interleaved accumulators over the first n // SUM_ILP * SUM_ILP items
    (each summed by `_cascade`), the leftover items added to the first accumulator, then the others added to it."""
    rows, n = int(x.shape[0]), int(x.shape[1])
    groups = n // SUM_ILP
    acc = _cascade(x[:, :groups * SUM_ILP].reshape(rows, groups, SUM_ILP, *x.shape[2:]))
    first = acc[:, 0]
    for k in range(groups * SUM_ILP, n):
        first = first + x[:, k]
    for k in range(1, SUM_ILP):
        first = first + acc[:, k]
    return first


def fixed_row_sum(rows: torch.Tensor) -> torch.Tensor:
    """Float32 sum of each row of `rows` [R, N] in one fixed order, that of torch's single-threaded CPU reduction of a
    contiguous row with 256-bit vectors (upstream's float LayerNorm statistics, docs/golden-differences.md): rows of
    N >= SUM_LANES are read as N // SUM_LANES vectors summed by `_interleaved_sum`; the trailing N % SUM_LANES elements
    are folded from 0, then the vector's lanes added in order. Shorter rows are summed element by element with
    `_interleaved_sum`. The result depends on neither the machine nor the thread count."""
    if rows.dtype != torch.float32 or rows.dim() != 2:
        raise ValueError(f"fixed_row_sum takes a 2-D float32 tensor, got {rows.dtype} of shape {list(rows.shape)}")
    x = rows.detach().cpu().numpy()
    n_rows, n = x.shape
    if n < SUM_LANES:
        out = _interleaved_sum(x)
    else:
        vectors = n // SUM_LANES
        lanes = _interleaved_sum(x[:, :vectors * SUM_LANES].reshape(n_rows, vectors, SUM_LANES))
        out = _fold(x[:, vectors * SUM_LANES:], 1)
        for k in range(SUM_LANES):
            out = out + lanes[:, k]
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(rows.device)


OUTER_SUM_ROWS = 4
"""torch's CPU outer reduction (kept axis contiguous) sums blocks of this many vectors, or of this many scalars when the
kept axis is shorter than one vector, in one plain cascade each."""


def block_row_sum(rows: torch.Tensor, blocks: int) -> torch.Tensor:
    """Float32 sum of each row of `rows` [R, N] read as `blocks` consecutive blocks of N / blocks elements, in the
    order of torch's single-threaded CPU sum of a strided view whose blocks are contiguous but not adjacent
    (upstream's GroupNorm mean over a channel chunk): each block summed by `fixed_row_sum`, the block sums folded
    in order from 0. One block is `fixed_row_sum` itself; blocks of one element are a single strided run, summed by
    `_interleaved_sum`."""
    if blocks <= 1:
        return fixed_row_sum(rows)
    n_rows, n = int(rows.shape[0]), int(rows.shape[1])
    if rows.dtype != torch.float32 or rows.dim() != 2 or n % blocks:
        raise ValueError(f"block_row_sum takes a 2-D float32 tensor whose rows split into {blocks} blocks, got "
                         f"{rows.dtype} of shape {list(rows.shape)}")
    if n == blocks:
        out = _interleaved_sum(rows.detach().cpu().numpy())
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(rows.device)
    sums = fixed_row_sum(rows.reshape(n_rows * blocks, n // blocks)).cpu().numpy().reshape(n_rows, blocks)
    return torch.from_numpy(np.ascontiguousarray(_fold(sums, 1), dtype=np.float32)).to(rows.device)


def channel_row_sum(rows: torch.Tensor, channels: int) -> torch.Tensor:
    """Float32 sum of each row of `rows` [B*C, S] (row b*C + c: channel c of a channels-last [B, S, C] tensor) in the
    order of torch's single-threaded CPU sum over S with C kept and contiguous (upstream's InstanceNorm statistics):
    with C >= SUM_LANES the channels below the last multiple of OUTER_SUM_ROWS * SUM_LANES are summed in a plain
    cascade (`_cascade`), the rest by `_interleaved_sum`; with 1 < C < SUM_LANES the same with blocks of
    OUTER_SUM_ROWS channels; C = 1 is one contiguous row (`fixed_row_sum`)."""
    if rows.dtype != torch.float32 or rows.dim() != 2 or int(rows.shape[0]) % max(channels, 1):
        raise ValueError(f"channel_row_sum takes a 2-D float32 tensor of rows batch x {channels} channels, got "
                         f"{rows.dtype} of shape {list(rows.shape)}")
    if channels <= 1:
        return fixed_row_sum(rows)
    size = int(rows.shape[1])
    x = rows.detach().cpu().numpy().reshape(-1, channels, size).transpose(0, 2, 1)  # [B, S, C]
    block = OUTER_SUM_ROWS * (SUM_LANES if channels >= SUM_LANES else 1)
    cut = channels // block * block
    out = np.concatenate([_cascade(x[:, :, :cut]), _interleaved_sum(x[:, :, cut:])], axis=1)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(-1), dtype=np.float32)).to(rows.device)


def axis_sum(t: torch.Tensor, axis: int) -> torch.Tensor:
    """Float32 sum of a tensor along `axis` (kept, size 1), in the order of torch's single-threaded CPU
    `t.sum(axis, keepdim=True)` of a contiguous tensor: read as [outer, L, inner], the reduced axis is a contiguous row
    (`fixed_row_sum`) when inner is 1, else an outer reduction with the inner axis kept (`channel_row_sum`). Summed
    on the CPU, returned on `t`'s device."""
    if t.dtype != torch.float32:
        raise ValueError(f"axis_sum takes a float32 tensor, got {t.dtype}")
    shape = list(t.shape)
    length = int(shape[axis])
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64)) if axis + 1 < len(shape) else 1
    outer = int(np.prod(shape[:axis], dtype=np.int64)) if axis > 0 else 1
    kept = shape[:axis] + [1] + shape[axis + 1:]
    if t.numel() == 0 or length == 0:
        return torch.zeros(kept, dtype=torch.float32, device=t.device)
    x = t.detach().cpu().contiguous().reshape(outer, length, inner)
    if inner == 1:
        sums = fixed_row_sum(x.reshape(outer, length))
    else:
        sums = channel_row_sum(x.permute(0, 2, 1).reshape(outer * inner, length), inner)
    return sums.reshape(kept).to(t.device)
