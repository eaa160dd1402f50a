"""Layouts as axis permutations: an ONNX value is an IR tensor transposed by a perm (qdq_graph.py, "Layouts").

Kept apart from the graph because the mappings reason about layouts (a Slice's or a Reduce's output layout)
without touching the graph.
"""
from __future__ import annotations

from typing import Sequence, Tuple

Perm = Tuple[int, ...]


def identity(rank: int) -> Perm:
    return tuple(range(rank))


def operand_perm(rank: int, transposed: bool) -> Perm:
    """The layout of a matrix product's operand: the IR layout, its last two axes swapped when `transposed`
    (trans_a/trans_b read as a layout, no Transpose of their own)."""
    perm = list(identity(rank))
    if transposed:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return tuple(perm)


def channels_first(rank: int) -> Perm:
    """The perm taking a channels-last IR tensor to channels-first (NHWC → NCHW, NWC → NCW, ...)."""
    return (0, rank - 1, *range(1, rank - 1)) if rank >= 3 else identity(rank)


def inverse(perm: Sequence[int]) -> Perm:
    inv = [0] * len(perm)
    for i, a in enumerate(perm):
        inv[a] = i
    return tuple(inv)


def compose(first: Sequence[int], then: Sequence[int]) -> Perm:
    """The perm of `x.transpose(first).transpose(then)`."""
    return tuple(first[t] for t in then)


def reduced_perm(perm: Perm, axes: Sequence[int]) -> Perm:
    """The layout of `ir.transpose(perm)` reduced over IR `axes` without keepdims, in terms of the output IR."""
    kept = [a for a in range(len(perm)) if a not in axes]
    new_index = {a: i for i, a in enumerate(kept)}
    return tuple(new_index[a] for a in perm if a not in axes)
