"""Quantization parameters in tests. They live in a side table keyed by tensor name (quantopt/graph/tables.py), not
on the tensor: the graph's table, or the layer's own for a layer outside a graph. A test that reads or sets the
parameters of a tensor it holds goes through a layer that names it (of the graph that holds the tensor)."""
from __future__ import annotations

from typing import Any, List, Sequence

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


RECURRENT_STEPS = ["numpy", "small", "int64"]
"""The ways a recurrent cell's integer steps run: the numpy steps (ops/_recurrent_steps.py), the torch steps'
small-step path (codes requantized straight to table positions, the state in float64), their int64 path."""


def choose_recurrent_steps(monkeypatch, steps: str, functions: Sequence[str]) -> List[Any]:
    """Make the recurrent cells take the steps named `steps` (RECURRENT_STEPS) and record what each numpy-steps
    function of ops/recurrent.py named in `functions` returned (None where the numpy steps did not run): the caller
    asserts with `ran_as_chosen` that the chosen steps ran."""
    from quantopt.ops import _recurrent_steps, recurrent

    if steps != "numpy":
        monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_VALUES", 0)
    if steps == "int64":
        monkeypatch.setattr(recurrent, "SMALL_CONVERSION", 0)
    results: List[Any] = []
    for name in functions:
        plain = getattr(recurrent, name)
        monkeypatch.setattr(recurrent, name, lambda *a, plain=plain: results.append(plain(*a)) or results[-1])
    return results


def ran_as_chosen(results: List[Any], steps: str) -> bool:
    """Whether the numpy steps ran in every call where chosen (`choose_recurrent_steps`), and in none otherwise."""
    return bool(results) and all((v is not None) == (steps == "numpy") for v in results)
