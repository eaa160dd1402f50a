"""Quantization parameters in tests. They live in a side table keyed by tensor name (quantopt/graph/tables.py), not
on the tensor: the graph's table, or the layer's own for a layer outside a graph. A test that reads or sets the
parameters of a tensor it holds goes through a layer that names it (of the graph that holds the tensor)."""
from __future__ import annotations

from typing import Any, List

import numpy as np

from quantopt.graph.node import PyNode
from quantopt.graph.tables import TensorQuant, quant_of
from quantopt.graph.tensor import PyTensor

_FIELDS = ("scale", "zerop", "qbits", "qmin", "qmax", "qinvariant", "axis")


def params_of(node: PyNode, t: PyTensor) -> TensorQuant:
    """The parameters of `t`, a tensor of `node` (read-only; the defaults when it has none)."""
    return quant_of(node).get(t)


def set_quant(node: PyNode, t: PyTensor, **fields: Any) -> TensorQuant:
    """Set fields (scale, zerop, qbits, qmin, qmax, qinvariant, axis) of the parameters of `t`, a tensor of `node`;
    returns its entry."""
    unknown = set(fields) - set(_FIELDS)
    if unknown:
        raise TypeError(f"unknown quantization fields {sorted(unknown)}")
    q = quant_of(node).of(t)
    for key, value in fields.items():
        setattr(q, key, value)
    return q


def checked_requantization_bounds(monkeypatch) -> List[int]:
    """Make every `Requantizer` call given a bound assert it against the values it requantizes, and every table
    lookup told its codes are in range assert that (the bounds a recurrent step proves from its ranges), in the
    torch steps and the numpy steps (ops/_recurrent_steps.py) alike; the returned list counts the checks."""
    from quantopt.ops._recurrent_steps import StepLookup, StepRequant
    from quantopt.quant.lut import PreparedLut
    from quantopt.quant.requant import Requantizer

    checked: List[int] = []
    plain = Requantizer.__call__
    plain_lookup = PreparedLut.__call__
    plain_take = PreparedLut.take_indexed

    def call(self, acc, bound=None, minus=0, as_float64=False):
        if bound is not None and acc.numel():
            assert int(acc.abs().max()) <= bound
            checked.append(1)
        return plain(self, acc, bound, minus, as_float64)

    def lookup(self, codes, in_range=False):
        if in_range and codes.numel():
            assert self.covers(int(codes.min()), int(codes.max()))
            checked.append(1)
        return plain_lookup(self, codes, in_range)

    def take(self, index, dtype=None):  # positions of codes a requantization gave offset: in range
        if index.numel():
            codes = index + self.index_offset(int(index.shape[-1]), index.device)
            assert self.covers(int(codes.min()), int(codes.max()))
            checked.append(1)
        return plain_take(self, index) if dtype is None else plain_take(self, index, dtype)

    plain_biased = StepRequant._biased
    plain_step_lookup = StepLookup.__call__

    def biased(self, acc):
        if acc.size:
            assert float(np.abs(acc).max()) <= self.bound
            checked.append(1)
        return plain_biased(self, acc)

    def step_lookup(self, positions):  # positions of codes clamped to a range the table covers
        if positions.size:
            entries = (positions >> self.shift) + self.base + (1 if self.shift else 0)  # the last entry read
            assert 0 <= int(positions.min()) and int(entries.max()) < self.table.size
            checked.append(1)
        return plain_step_lookup(self, positions)

    monkeypatch.setattr(Requantizer, "__call__", call)
    monkeypatch.setattr(StepRequant, "_biased", biased)
    monkeypatch.setattr(StepLookup, "__call__", step_lookup)
    monkeypatch.setattr(PreparedLut, "__call__", lookup)
    monkeypatch.setattr(PreparedLut, "take_indexed", take)
    return checked
