"""The graph's side tables (graph/tables.py): statistics keyed by tensor name, shared entry by entry by graph clones
and detached layer copies, and the analysis results returned rather than stored on tensors."""
from __future__ import annotations

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.node import PyNode
from quantopt.graph.tables import StatisticsTable, TensorStatistics, statistics_of
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
    for name in ("stats", "similarity", "mse"):
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
