"""The graph's side tables (graph/tables.py): statistics keyed by tensor name, shared entry by entry by graph clones
and detached layer copies; calibrated ranges keyed by tensor name, copied by clones and detached copies; and the
analysis results returned rather than stored on tensors."""
from __future__ import annotations

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.node import PyNode
from quantopt.graph.tables import RangeTable, StatisticsTable, TensorRange, TensorStatistics, ranges_of, statistics_of
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


def test_no_statistics_or_analysis_fields_on_tensors() -> None:
    t = PyTensor("t")
    for name in ("stats", "similarity", "mse", "min", "max", "min_key_axis", "max_key_axis"):
        assert not hasattr(t, name)


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
