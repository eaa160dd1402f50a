"""Graph core: topological order, the executor's memory release, clone independence, node accessors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantopt import Dtype, OpType
from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.node import PyNode


def _chain():
    b = GraphBuilder("chain")
    x = b.input("x", [1, 4])
    a = b.layer("Activation", [x], [[1, 4]], name="relu", params={"method": "RELU"})
    s = b.layer("Activation", [a], [[1, 4]], name="sig", params={"method": "SIGMOID"})
    t = b.layer("Activation", [a], [[1, 4]], name="tanh", params={"method": "TANH"})
    out = b.layer("Eltwise", [s, t], [[1, 4]], name="add", params={"method": "ADD", "with_activation": "NONE"})
    return b.build([out])


def test_forward_frees_intermediates_but_keeps_inputs_and_outputs():
    g = _chain()
    x = torch.tensor([[-1.0, 0.0, 1.0, 2.0]])
    (y,) = g.forward([x])
    expected = torch.sigmoid(torch.relu(x)) + torch.tanh(torch.relu(x))
    assert torch.allclose(y, expected)
    tensors = g.tensors()
    assert tensors["x"].betensor.numel() == 4 and tensors["add"].betensor.numel() == 4
    for name in ("relu", "sig", "tanh"):
        assert tensors[name].betensor.numel() == 0, name
    g.forward([x], keep_tensors=True)
    assert all(g.tensors()[n].betensor.numel() == 4 for n in ("relu", "sig", "tanh"))


def test_after_node_hook_sees_every_node_in_order():
    g = _chain()
    seen = []
    g.forward([torch.zeros(1, 4)], after_node=lambda n: seen.append(n.name))
    assert seen[0] == "x" and seen[1] == "relu" and seen[-1] == "add" and len(seen) == 5


def test_topological_order_ignores_file_order():
    b = GraphBuilder("order")
    x = b.input("x", [1, 2])
    y = b.layer("Activation", [x], [[1, 2]], name="first", params={"method": "RELU"})
    out = b.layer("Activation", [y], [[1, 2]], name="second", params={"method": "RELU"})
    b._nodes.reverse()  # file order: consumer before producer
    g = b.build([out])
    assert [n.name for n in g.nodes] == ["x", "first", "second"]
    assert list(g.nx.successors("first")) == ["second"]


def test_clone_is_independent():
    g = _chain()
    c = g.clone()
    assert [n.name for n in c.nodes] == [n.name for n in g.nodes]
    assert all(a is not b for a, b in zip(c.nodes, g.nodes))
    c.nodes[1].params["method"] = "TANH"
    assert g.nodes[1].params["method"] == "RELU"
    x = torch.randn(3, 4)
    assert torch.allclose(c.forward([x])[0], torch.sigmoid(torch.tanh(x)) + torch.tanh(torch.tanh(x)))


def test_feed_by_name_and_wrong_count():
    g = _chain()
    y = g.forward({"x": torch.ones(2, 4)})[0]
    assert y.shape == (2, 4)
    from quantopt.errors import DataError

    with pytest.raises(DataError, match="1 input"):
        g.forward([torch.ones(1, 4), torch.ones(1, 4)])


def test_node_accessors_and_errors():
    b = GraphBuilder("n")
    x = b.input("x", [1, 2])
    out = b.layer("FullyConnected", [x], [[1, 3]], name="fc", params={"num_output": 3, "with_activation": "NONE"},
                  constants={"weights": np.ones((3, 2), np.float32), "biases": np.zeros(3, np.float32)})
    g = b.build([out])
    fc: PyNode = g.node("fc")
    assert fc.type == OpType.FullyConnected and repr(fc.type) == "OpType.FullyConnected"
    assert fc.get_param("num_output") == 3
    assert fc.get_param("missing", optional=True, default_value=7) == 7
    with pytest.raises(IRError, match="missing required parameter 'kernel_x'"):
        fc.get_param("kernel_x")
    assert fc.get_constant("weights").dtype is Dtype.FP32
    with pytest.raises(IRError, match="missing required constant 'lut'"):
        fc.get_constant("lut")
    g.forward([torch.ones(5, 2)], keep_tensors=True)
    assert fc.current_batch_size == 5
    assert fc.constants["weights"].name == "fcweights"


def test_zero_inputs_follow_ir_shapes_and_dtypes():
    b = GraphBuilder("z")
    x = b.input("x", [1, 3, 2])
    i = b.input("i", [1, 4], dtype=Dtype.INT32)
    b.layer("Activation", [x], [[1, 3, 2]], name="r", params={"method": "RELU"})
    g = b.build(["r", i])
    feeds = g.zero_inputs()
    assert feeds[0].shape == (1, 3, 2) and feeds[0].dtype == torch.float32
    assert feeds[1].dtype == torch.int64


def test_deepcopy_runs_like_the_original(tmp_path):
    """copy.deepcopy is clone(): the copy runs (its free-after-last-use plan follows its own tensors), also for a
    graph read from files whose weights are memory-mapped."""
    import copy
    from pathlib import Path

    from quantopt.ir.reader import read_ir

    example = Path(__file__).resolve().parents[1] / "examples" / "digits" / "model" / "digits.txt"
    graph = read_ir(str(example))
    x = torch.from_numpy(np.random.default_rng(0).normal(size=[2, 1, 8, 8]).astype(np.float32))
    expected = graph.forward([x])[0].clone()
    twin = copy.deepcopy(graph)
    assert twin is not graph and twin.nodes[0] is not graph.nodes[0]
    assert torch.equal(twin.forward([x])[0], expected)
    assert torch.equal(graph.forward([x])[0], expected)
