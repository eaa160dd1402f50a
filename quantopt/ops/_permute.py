"""A permuted tensor written contiguous, by blocked 2-D transposes where the permutation is one.

Why: `x.permute(*perm).contiguous()` copies element by element in the output's order. Where the output's innermost
axis is not the input's (NHWC -> NCHW, or [seq, d] -> [d, seq]), every element read lands in another cache line,
and for 4- and 8-byte elements with a power-of-two row stride the reads also collide in the cache's sets: a
[1, 160, 160, 64] float32 map took about 10 ms to go NHWC -> NCHW on one thread, against about 1.2 ms for torch's
blocked 2-D transpose of the same data ([25600, 64] -> [64, 25600]). Such permutations move a block of trailing
axes in front of the axes before it (a rotation of the axes after an unmoved prefix), which is a 2-D transpose of
each prefix index's [A, B] matrix; those go through torch's blocked 2-D copy. The values are the same either way
(a copy), so nothing depends on which path ran.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

BLOCKED_MIN_BYTES = 1 << 21
"""Matrices smaller than this (2 MiB) go through the ordinary copy: while a matrix fits in a core's cache the
ordinary copy is as fast or faster (measured over [HW, C] float32 and float64 matrices, HW 400-25600 and C 16-512:
from 2 MiB up the blocked copy took 1.1-9x less time where C >= 24 and C <= HW, below it up to 4x more)."""

BLOCKED_MIN_COLUMNS = 24
"""Fewer input columns (the trailing block that moves in front, such as the channels of NHWC -> NCHW) than this
take the ordinary copy: a few channels are read from one cache line anyway."""

BLOCKED_MAX_MATRICES = 64
"""At most this many [A, B] matrices (the product of the unmoved leading axes) are transposed one call each; more
take the ordinary copy, whose single call then costs less than the loop."""


def rotation(perm: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(k, j) when `perm` keeps axes [0, k) and then takes axes [j, rank) before [k, j) (k < j < rank), i.e. the
    permuted tensor is a batch of 2-D transposes; None for any other permutation (the identity included)."""
    rank = len(perm)
    k = 0
    while k < rank and perm[k] == k:
        k += 1
    if k >= rank - 1:
        return None
    j = perm[k]
    if j <= k or list(perm[k:]) != list(range(j, rank)) + list(range(k, j)):
        return None
    return k, j


def permuted_copy(x: torch.Tensor, perm: Sequence[int]) -> torch.Tensor:
    """`x.permute(*perm).contiguous()`, the same values and shape, by blocked 2-D transposes where `perm` is a
    rotation (`rotation`) of a contiguous CPU tensor into matrices [rows, cols] of at least BLOCKED_MIN_BYTES with
    BLOCKED_MIN_COLUMNS <= cols <= rows (the slow case of the ordinary copy: NHWC -> NCHW of a large map; the
    other way round it is fast); the ordinary copy otherwise."""
    if (x.numel() * x.element_size() < BLOCKED_MIN_BYTES or x.device.type != "cpu" or not x.is_contiguous()
            or (torch.is_grad_enabled() and x.requires_grad)):
        return x.permute(*perm).contiguous()
    perm = [int(p) for p in perm]
    plan = rotation(perm)
    if plan is None:
        return x.permute(*perm).contiguous()
    k, j = plan
    shape: List[int] = [int(s) for s in x.shape]
    batch, rows, cols = math.prod(shape[:k]), math.prod(shape[k:j]), math.prod(shape[j:])
    if (cols < BLOCKED_MIN_COLUMNS or cols > rows or rows * cols * x.element_size() < BLOCKED_MIN_BYTES
            or batch > BLOCKED_MAX_MATRICES):
        return x.permute(*perm).contiguous()
    src = x.reshape(batch, rows, cols)
    out = torch.empty(batch, cols, rows, dtype=x.dtype, device=x.device)
    for b in range(batch):
        out[b].copy_(src[b].t())
    return out.reshape([shape[p] for p in perm])
