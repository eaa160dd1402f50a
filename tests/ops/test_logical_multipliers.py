"""Logical comparisons take upstream's input multipliers (docs/semantics/binary.md, Logical): hand-computed vectors,
including the golden op_if's mixed case (an integer input of scale 1 against a quantized one)."""
from __future__ import annotations

import pytest
from quant_helpers import set_quant

from quantopt.graph.node import PyNode
from quantopt.graph.tensor import PyTensor
from quantopt.ops.binary_math import _comparison_multipliers


def tensor(node: PyNode, name: str, scale: float, invariant: bool) -> PyTensor:
    """An input of `node` with the given parameters (kept in the layer's own table: it is in no graph)."""
    t = PyTensor(name)
    set_quant(node, t, scale=scale, zerop=0, qinvariant=invariant)
    return t


@pytest.mark.parametrize("sa,ia,sb,ib,want", [
    (10.0, False, 100.0, False, (32767, 3276)),   # r = 10: f = 32767 / 10, M = s_big / s_i * f truncated
    (100.0, False, 10.0, False, (3276, 32767)),
    (2.0, False, 3.0, False, (12288, 8192)),      # r = 1.5: f = 8192
    (1365.0, False, 1.0, True, (6, 8192)),        # integer input counts as the larger scale: 8192 / 1365
    (0.5, False, 1.0, True, (16384, 8192)),
    (1.0, True, 1.0, True, (1, 1)),
])
def test_multipliers_follow_upstream(sa: float, ia: bool, sb: float, ib: bool, want) -> None:
    node = PyNode("cmp", "Logical")
    assert _comparison_multipliers(node, tensor(node, "a", sa, ia), tensor(node, "b", sb, ib)) == want
