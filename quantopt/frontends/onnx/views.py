"""Chains of Reshape and Transpose layers reduced to their shortest equivalent, as the Parser's transpose and
reshape merging leaves them: a layout Transpose, a Reshape and a Transpose back that only regroup dims become one
Reshape, the reshapes around a fully connected layer cancel, and so on.

A chain is judged by where each output element comes from: the composite index map is computed on an index array
of the chain's source (so the result is exact for any shapes) and compared with a single Reshape, a single
Transpose, and the two-layer forms Transpose-then-Reshape and Reshape-then-Transpose.
"""
from __future__ import annotations

from itertools import permutations
from typing import List, Optional, Sequence, Tuple

import numpy as np

ViewOp = Tuple[str, Tuple[int, ...]]
"""("reshape", shape) or ("transpose", perm)."""
MAX_ELEMENTS = 1 << 22
"""Chains over larger tensors are left as they are (the index arrays would cost more than they save)."""
MAX_RANK = 6


def apply(shape: Sequence[int], ops: Sequence[ViewOp]) -> np.ndarray:
    """Index array of the chain's output: element i holds the flat source index it is read from."""
    idx = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(tuple(shape))
    for kind, arg in ops:
        idx = idx.reshape(arg) if kind == "reshape" else idx.transpose(arg)
    return idx


def out_shape(shape: Sequence[int], ops: Sequence[ViewOp]) -> Tuple[int, ...]:
    s = tuple(int(d) for d in shape)
    for kind, arg in ops:
        s = tuple(int(d) for d in arg) if kind == "reshape" else tuple(s[p] for p in arg)
    return s


def shortest(shape: Sequence[int], ops: Sequence[ViewOp]) -> Optional[List[ViewOp]]:
    """The fewest layers (0, 1 or 2) computing the chain `ops` from a tensor of `shape`; None when that needs 3 or
    more, or the tensor is too large to decide."""
    shape = tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    target = out_shape(shape, ops)
    if size > MAX_ELEMENTS or len(shape) > MAX_RANK or len(target) > MAX_RANK:
        return None
    idx = apply(shape, ops)
    flat = idx.reshape(-1)
    if np.array_equal(flat, np.arange(size)):
        return [] if target == shape else [("reshape", target)]
    base = np.arange(size, dtype=np.int64).reshape(shape)
    if len(target) == len(shape):
        for p in _perms(shape, target):
            if _starts_alike(shape, p, flat) and np.array_equal(base.transpose(p), idx):
                return [("transpose", p)]
    for p in permutations(range(len(shape))):
        if p != tuple(range(len(shape))) and _starts_alike(shape, p, flat) \
                and np.array_equal(base.transpose(p).reshape(-1), flat):
            return [("transpose", p), ("reshape", target)]
    for p in permutations(range(len(target))):
        mid = tuple(target[i] for i in np.argsort(p))
        if _starts_alike(mid, p, flat) and np.array_equal(base.reshape(mid).transpose(p), idx):
            return [("reshape", mid), ("transpose", tuple(int(a) for a in p))]
    return None


def _starts_alike(shape: Tuple[int, ...], perm: Sequence[int], flat: np.ndarray, count: int = 64) -> bool:
    """The first `count` elements of arange(shape).transpose(perm), read off the strides, equal `flat`'s: a cheap
    filter before the full comparison."""
    strides = np.cumprod((1,) + tuple(shape[::-1][:-1]))[::-1]
    out_shape = tuple(shape[a] for a in perm)
    k = min(count, flat.size)
    pos = np.unravel_index(np.arange(k), out_shape)
    head = sum(pos[i] * int(strides[a]) for i, a in enumerate(perm)) if perm else np.zeros(k, np.int64)
    return bool(np.array_equal(head, flat[:k]))


def _perms(shape: Tuple[int, ...], target: Tuple[int, ...]):
    """Permutations p with shape[p[i]] == target[i]."""
    for p in permutations(range(len(shape))):
        if all(shape[a] == t for a, t in zip(p, target)):
            yield tuple(p)
