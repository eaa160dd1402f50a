"""The graph's side tables (graph/tables.py): statistics keyed by tensor name, shared entry by entry by graph clones
and detached layer copies; calibrated ranges keyed by tensor name, copied by clones and detached copies; and the
analysis results returned rather than stored on tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.node import PyNode
from quantopt.graph.tables import (
    QuantTable,
    RangeTable,
    StatisticsTable,
    TensorQuant,
    TensorRange,
    TensorStatistics,
    _Unquantized,
    quant_of,
    ranges_of,
    statistics_of,
)
from quantopt.graph.tensor import PyTensor
from quantopt.registry.optype import OpType


def _graph():
    b = GraphBuilder("t")
    x = b.input("x", [1, 4])
    y = b.layer("FullyConnected", [x], [[1, 3]], name="fc", params=dict(num_output=3, with_activation="NONE"),
                constants={"weights": np.ones((3, 4), np.float32), "biases": np.zeros(3, np.float32)})
    return b.build([y])


def test_of_creates_get_does_not() -> None:
    table = StatisticsTable()
    assert table.get("a").extrema_min is None and "a" not in table
    entry = table.of("a")
    assert table.of("a") is entry and table.get("a") is entry and "a" in table and len(table) == 1


def test_clone_shares_entries_and_replacing_one_leaves_the_other() -> None:
    g = _graph()
    out = g.node("fc").outputs[0]
    g.statistics.of(out).extrema_min = torch.tensor(-1.0)
    c = g.clone()
    assert c.statistics.get(c.node("fc").outputs[0]) is g.statistics.get(out)  # shared, as tensor clones did
    c.statistics.set(out.name, TensorStatistics())
    assert float(g.statistics.get(out).extrema_min) == -1.0  # the original keeps its entry


def test_no_stage_state_on_tensors() -> None:
    """Statistics, ranges, analysis results and quantization parameters live in side tables; a tensor has slots, so
    a stage cannot put them back on it by accident."""
    t = PyTensor("t")
    for name in ("stats", "similarity", "mse", "min", "max", "min_key_axis", "max_key_axis", "scale", "zerop", "qbits",
                 "qmin", "qmax", "qinvariant", "key_axis", "unrounded"):
        assert not hasattr(t, name)
    with pytest.raises(AttributeError):
        t.scale = 2.0  # type: ignore[attr-defined]


def test_detached_copy_and_standalone_layers_have_their_own_table() -> None:
    g = _graph()
    fc = g.node("fc")
    w = fc.constants["weights"]
    g.statistics.set(w, TensorStatistics(batches=1))
    m = fc.detached_copy()
    assert m.graph is None and statistics_of(m).get(w.name) is g.statistics.get(w)
    statistics_of(m).set(w.name, TensorStatistics())  # e.g. weights recalibrated on the copy
    assert g.statistics.get(w).batches == 1
    alone = PyNode("n", OpType.lookup("Activation"))
    statistics_of(alone).of("y").batches = 2
    assert statistics_of(alone).get("y").batches == 2


def test_range_table_keeps_per_tensor_and_per_channel_ranges_apart() -> None:
    table = RangeTable()
    assert table.get("w") == TensorRange() and table.channels("w").min is None and "w" not in table
    table.set("w", -1.0, 2.0)
    table.set_channels("w", torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 2.0]), axis=0)
    assert table.get("w") == TensorRange(-1.0, 2.0) and table.channels("w").axis == 0 and len(table) == 1
    table.set("w", -3.0, 3.0)
    assert torch.equal(table.channels("w").max, torch.tensor([1.0, 2.0]))  # calibrated separately


def test_clone_copies_ranges_and_editing_one_leaves_the_other() -> None:
    g = _graph()
    w = g.node("fc").constants["weights"]
    g.ranges.set(w, -1.0, 1.0)
    g.ranges.set_channels(w, -torch.ones(3), torch.ones(3))
    c = g.clone()
    assert c.ranges.get(w.name) == g.ranges.get(w)
    assert c.ranges.channels(w.name).max is not g.ranges.channels(w).max  # values cloned, as tensor clones did
    c.ranges.set(w.name, -2.0, 2.0)
    assert g.ranges.get(w) == TensorRange(-1.0, 1.0)


def test_detached_copy_takes_its_inputs_ranges_from_the_given_table() -> None:
    g = _graph()
    fc = g.node("fc")
    x, w = fc.inputs[0], fc.constants["weights"]
    g.ranges.set(x, -1.0, 1.0)
    g.ranges.set(w, -0.5, 0.5)
    other = RangeTable()
    other.set(x, -4.0, 4.0)
    m = fc.detached_copy(inputs=list(fc.inputs), input_ranges=other)
    assert ranges_of(m).get(x.name) == TensorRange(-4.0, 4.0) and ranges_of(m).get(w.name) == TensorRange(-0.5, 0.5)
    ranges_of(m).set(w.name, -9.0, 9.0)  # edited on the copy only
    assert g.ranges.get(w) == TensorRange(-0.5, 0.5)
    alone = PyNode("n", OpType.lookup("Activation"))
    alone.outputs = [PyTensor("y")]
    ranges_of(alone).set("y", 0.0, 6.0)
    g.add_node(alone)  # a layer built on its own brings its ranges into the graph's table
    assert g.ranges.get("y") == TensorRange(0.0, 6.0) and alone.detached_ranges is None


FIELDS = ("scale", "zerop", "qbits", "qmin", "qmax", "qinvariant", "axis")


def _fields(q: TensorQuant) -> tuple:
    return tuple(getattr(q, f) for f in FIELDS)


def test_quant_table_get_gives_read_only_defaults_and_of_creates() -> None:
    table = QuantTable()
    q = table.get("a")
    assert _fields(q) == (1.0, 0, None, None, None, False, None) and not q.per_channel
    assert "a" not in table and len(table) == 0  # reading creates nothing
    for field in FIELDS:
        with pytest.raises(AttributeError, match="QuantTable.of"):
            setattr(q, field, 2)
    assert _fields(table.get("b")) == (1.0, 0, None, None, None, False, None)  # the defaults are unchanged
    entry = table.of("a")
    assert _fields(entry) == _fields(q) and not isinstance(entry, _Unquantized)
    entry.scale, entry.zerop, entry.qbits, entry.qmin, entry.qmax = 4.0, -3, 8, -128, 127
    assert table.of("a") is entry and "a" in table and len(table) == 1
    assert _fields(table.get("a")) == (4.0, -3, 8, -128, 127, False, None)
    assert table.get(PyTensor("a")).scale == 4.0 and PyTensor("a") in table  # keyed by the tensor's name


def test_unquantized_defaults_cannot_be_written_but_their_copy_can() -> None:
    q = QuantTable().get("x")
    assert isinstance(q, _Unquantized)
    with pytest.raises(AttributeError):
        q.qinvariant = True
    assert QuantTable().get("y").qinvariant is False
    c = q.copy()  # what `table.set(new, table.get(old).copy())` stores for a tensor without parameters
    assert not isinstance(c, _Unquantized) and _fields(c) == _fields(q)
    c.scale = 2.0
    assert c.scale == 2.0 and q.scale == 1.0


def test_tensor_quant_per_channel_and_copy_clones_tensors() -> None:
    assert not TensorQuant(scale=3.0).per_channel and not TensorQuant(scale=torch.tensor([3.0])).per_channel
    q = TensorQuant(torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), 8, -127, 127, False, 0)
    assert q.per_channel
    c = q.copy()
    assert c.scale is not q.scale and c.zerop is not q.zerop
    assert torch.equal(c.scale, q.scale) and torch.equal(c.zerop, q.zerop)
    assert _fields(c)[2:] == (8, -127, 127, False, 0)
    c.scale[0] = 9.0
    c.zerop[1] = 5
    c.qbits = 16
    assert q.scale.tolist() == [1.0, 2.0] and q.zerop.tolist() == [0, 1] and q.qbits == 8


def test_quant_table_set_drop_copy_from_and_copy() -> None:
    table = QuantTable()
    table.set("w", TensorQuant(torch.tensor([1.0, 2.0]), 0, 8, -127, 127, False, 0))
    table.of("x").scale = 5.0
    other = QuantTable()
    other.copy_from(table, "w")  # the same name
    other.copy_from(table, "x", "y")  # renamed
    assert torch.equal(other.get("w").scale, table.get("w").scale) and other.get("w").scale is not table.get("w").scale
    assert other.get("y").scale == 5.0 and "x" not in other
    other.of("w").scale[0] = 7.0  # values cloned: the source keeps its own
    assert table.get("w").scale.tolist() == [1.0, 2.0]
    other.copy_from(table, "missing", "y")  # a source without parameters: the destination has none either
    assert "y" not in other and other.get("y").scale == 1.0
    copy = table.copy()
    assert len(copy) == 2 and copy.get("w").scale is not table.get("w").scale
    copy.of("x").scale = 6.0
    assert table.get("x").scale == 5.0
    only = table.copy(names=["x", "z"])
    assert "x" in only and "w" not in only and len(only) == 1
    table.drop("x")
    table.drop("never")  # nothing to forget: no error
    assert "x" not in table and table.get("x").scale == 1.0 and len(table) == 1 and "x" in copy


def test_quant_of_clone_detached_copy_and_add_node() -> None:
    """A graph's clone and a detached layer copy edit their parameters on their own; a layer built on its own has
    its own table, which it brings into the graph it is added to."""
    g = _graph()
    fc = g.node("fc")
    w, out = fc.constants["weights"], fc.outputs[0]
    q = quant_of(fc).of(w)
    q.scale, q.qbits, q.axis = torch.tensor([1.0, 2.0, 3.0]), 8, 0
    quant_of(fc).of(out).scale = 4.0
    c = g.clone()
    cw, cout = c.node("fc").constants["weights"], c.node("fc").outputs[0]
    assert c.quant.get(cw).scale.tolist() == [1.0, 2.0, 3.0] and c.quant.get(cout).scale == 4.0
    c.quant.of(cw).scale[0] = 9.0
    c.quant.of(cout).scale = 8.0
    assert g.quant.get(w).scale.tolist() == [1.0, 2.0, 3.0] and g.quant.get(out).scale == 4.0
    m = fc.detached_copy()
    mw = m.constants["weights"]
    assert quant_of(m).get(mw).scale.tolist() == [1.0, 2.0, 3.0] and quant_of(m).get(mw).axis == 0
    quant_of(m).of(mw).scale = torch.tensor([5.0, 5.0, 5.0])
    assert g.quant.get(w).scale.tolist() == [1.0, 2.0, 3.0]
    alone = PyNode("n", OpType.lookup("Activation"))
    alone.outputs = [PyTensor("z")]
    quant_of(alone).of(alone.outputs[0]).scale = 6.0
    assert quant_of(alone) is quant_of(alone) and quant_of(alone).get(alone.outputs[0]).scale == 6.0
    g.add_node(alone)
    assert g.quant.get(alone.outputs[0]).scale == 6.0 and quant_of(alone) is g.quant
