"""Builders of the unrolled integer LSTM/GRU cells of the "exact" export (the mappings are in ops/recurrent.py):
int64 clamps and rounding shifts, Q15 table lookups as Gathers, float64 MatMuls of integers. Kept apart
from the mappings because they depend on the QDQ graph only, not on the recurrent operators' constants.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from ...graph.node import PyNode
from ...quant.lut import lookup_lut
from .exact import INT64, round_div_int64
from .qdq_graph import QDQGraph

SMALL_CONSTANT = 4096
"""Elements up to which `CellOps.const` recognizes a constant it made already by its values; larger ones (weight
matrices) by their memory."""


class CellOps:
    """Small builders bound to one layer (constant names carry the layer and a counter). A constant asked for again
    (the same values: the hidden weights of every step) is the one made before: one copy per layer, not one per
    time step (a bidirectional LSTM of 256 units over 80 steps was a 699 MB model)."""

    def __init__(self, g: QDQGraph, node: PyNode) -> None:
        self.g, self.node, self.count = g, node, 0
        self._made: Dict[tuple, Tuple[str, np.ndarray]] = {}

    def const(self, value: object, dtype: object) -> str:
        a = np.asarray(value, dtype=dtype)
        if a.size <= SMALL_CONSTANT:
            key: tuple = (a.dtype.str, a.shape, a.tobytes())
        else:  # kept alive below, so no other array takes this memory while the key is held
            key = (a.dtype.str, a.shape, a.strides, a.__array_interface__["data"][0])
        made = self._made.get(key)
        if made is None:
            self.count += 1
            made = self._made[key] = (self.g.const(f"{self.node.name}/c{self.count}", a), a)
        return made[0]

    def i64(self, value: object) -> str:
        return self.const(value, np.int64)

    def f64(self, value: object) -> str:
        return self.const(value, np.float64)

    def clamp(self, value: str, bound: object) -> str:
        """clamp(value, -bound, bound) for int64 values (bound a number or one per column)."""
        bound = np.asarray(bound, dtype=np.int64)
        return self.g.add("Max", [self.g.add("Min", [value, self.i64(bound)]), self.i64(-bound)])

    def rshift(self, value: str, shift: object) -> str:
        """round_half_even(value / 2^shift) for int64 values; shifts <= 0 multiply (per column where a vector)."""
        s = np.asarray(shift, dtype=np.int64)
        if np.any(s < 0):
            value = self.g.add("Mul", [value, self.i64(np.left_shift(1, np.maximum(-s, 0)))])
        if np.all(s <= 0):
            return value
        return round_div_int64(self.g, self.node, value, self.i64(np.left_shift(1, np.maximum(s, 0))))

    def table(self, key: str, bits: int) -> str:
        """quantopt's Q15 lookup of `key` for every gate input integer in [-hq, hq] (index = input + hq)."""
        hq = 2 ** (bits - 1) - 1
        values = lookup_lut(torch.arange(-hq, hq + 1), self.node.get_constant(key).betensor, -hq, bits, 16, True,
                            in_restricted=True)
        return self.i64(values.numpy())

    def look(self, table: str, gate_in: str, hq: int) -> str:
        return self.g.add("Gather", [table, self.g.add("Add", [gate_in, self.i64(hq)])], axis=0)

    def columns(self, value: str, start: int, end: int) -> str:
        return self.g.add("Slice", [value, self.i64([start]), self.i64([end]), self.i64([-1])])

    def matmul(self, value: str, weights: np.ndarray) -> str:
        """value @ weights with integers in float64 (exact: the sums stay below 2^53), as int64."""
        return self.g.add("Cast", [self.g.add("MatMul", [value, self.f64(weights)])], to=INT64)

    def gates(self, acc: str, mult: np.ndarray, shift: np.ndarray, bound: np.ndarray) -> str:
        """clamp(rs(acc · gate_scale, gate_shift), ±gate_clamp) per row, int64."""
        scaled = self.g.add("Mul", [acc, self.i64(mult * np.left_shift(1, np.maximum(-shift, 0)))])
        return self.clamp(round_div_int64(self.g, self.node, scaled,
                                          self.i64(np.left_shift(1, np.maximum(shift, 0)))), bound)

    def requant(self, value: str, mult: object, shift: object, zerop: int, lo: int, hi: int) -> str:
        """clamp(round_half_even(value · mult / 2^shift) − zerop, lo, hi) for int64 values, mult and shift one or one
        per column (a left shift where negative): a `Requantizer` of the upstream forms' steps, exactly (every
        value · mult well below 2^63)."""
        v = self.rshift(self.g.add("Mul", [value, self.i64(mult)]), shift)
        if zerop:
            v = self.g.add("Sub", [v, self.i64(zerop)])
        return self.g.add("Max", [self.g.add("Min", [v, self.i64(hi)]), self.i64(lo)])

    def look_codes(self, table: str, codes: str, offsets: object) -> str:
        """The entries of a flat int64 `table` at codes plus `offsets` (one, or one per column: where each column's
        table starts, less the codes' least value)."""
        return self.g.add("Gather", [table, self.g.add("Add", [codes, self.i64(offsets)])], axis=0)
