"""The graph's wide values (graph/wide_values.py): a float64 result is returned only with the very value it was
rounded from, the executor drops it with the intermediate it releases, batch groups split and join it, a graph
clone carries it, and a layer run outside a graph keeps and reads none."""
from __future__ import annotations

import gc
from typing import List

import numpy as np
import pytest
import torch

from quantopt.graph import batch
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.tensor import PyTensor
from quantopt.graph.wide_values import WideValues

H, W, C = 4, 5, 8


def _params(act: str = "NONE") -> dict:
    return {"kernel_y": 1, "kernel_x": 1, "stride_y": 1, "stride_x": 1, "pad_left": 0, "pad_right": 0,
            "pad_top": 0, "pad_bottom": 0, "dilation_y": 1, "dilation_x": 1, "group": 1, "with_activation": act}


def _constants(rng: np.random.Generator) -> dict:
    return {"weights": torch.from_numpy(rng.standard_normal((C, 1, 1, C)).astype(np.float32)),
            "biases": torch.from_numpy(rng.standard_normal(C).astype(np.float32))}


def _chain() -> PyGraph:
    """Input -> Convolution -> Convolution -> PReLU: each reader takes the previous layer's float64 result."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("wide")
    x = b.input("x", [1, H, W, C])
    y = b.layer("Convolution", [x], [[1, H, W, C]], name="conv1", params=_params(), constants=_constants(rng))
    z = b.layer("Convolution", [y], [[1, H, W, C]], name="conv2", params=_params(), constants=_constants(rng))
    slope = {"negative_slope": torch.from_numpy(rng.uniform(0.05, 0.9, C).astype(np.float32))}
    out = b.layer("Activation", [z], [[1, H, W, C]], name="prelu", params={"method": "PRELU"}, constants=slope)
    return b.build([out])


def _data(batch_size: int = 1, seed: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((batch_size, H, W, C)).astype(np.float32))


def test_a_wide_value_is_returned_only_with_the_value_it_was_rounded_from() -> None:
    table, t = WideValues(), PyTensor("t", torch.ones(3))
    wide = torch.full((3,), 1.0, dtype=torch.float64)
    table.keep(t, wide)
    assert table.get(t) is wide
    t.betensor = t.betensor  # the same object: still current
    assert table.get(t) is wide
    t.betensor = torch.ones(3)  # an equal value, but another tensor
    assert table.get(t) is None
    table.keep(t, wide)
    t.betensor.add_(1.0)  # written in place: no longer the value it was rounded from
    assert table.get(t) is None
    table.keep(t, wide)
    table.keep(t, None)
    assert table.get(t) is None and len(table) == 0


def test_an_entry_goes_with_the_value_it_was_kept_with() -> None:
    table, t = WideValues(), PyTensor("t", torch.ones(3))
    table.keep(t, torch.zeros(3, dtype=torch.float64))
    t.betensor = torch.zeros(3)  # the old value is freed: so is its wide value
    gc.collect()
    assert len(table) == 0


def test_an_entry_goes_with_its_tensor() -> None:
    table, t = WideValues(), PyTensor("t", torch.ones(3))
    table.keep(t, torch.zeros(3, dtype=torch.float64))
    del t  # a tensor no longer in the graph (a layer removed by a pass): its wide value is freed with it
    gc.collect()
    assert len(table) == 0


def test_the_executor_drops_the_wide_value_of_each_intermediate_it_releases() -> None:
    graph = _chain()
    graph.forward([_data()])
    assert len(graph.wide_values) == 0  # conv1, conv2 and prelu kept theirs, released with their values or at the end
    graph.forward([_data()], keep_tensors=True)
    assert [graph.wide_values.get(graph.node(n).outputs[0]) is not None for n in ("conv1", "conv2", "prelu")] == \
        [True, True, True]


def _per_sample(graph: PyGraph, x: torch.Tensor) -> List[torch.Tensor]:
    return [graph.forward([x[i:i + 1]], keep_tensors=True)[0].clone() for i in range(int(x.shape[0]))]


def test_batch_groups_split_and_join_wide_values(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _chain()
    x = _data(batch_size=3)
    alone = _per_sample(graph, x)
    wides = []
    for i in range(3):
        graph.forward([x[i:i + 1]], keep_tensors=True)
        wides.append(graph.wide_values.get(graph.node("conv1").outputs[0]).clone())
    # convolutions run once on the whole batch; make them run per group, reading and keeping wide values per group
    monkeypatch.setitem(batch.BATCH_RULES, "Convolution", batch.per_group)
    monkeypatch.setitem(batch.BATCH_RULES, "Activation", batch.per_group)
    y = graph.forward([x], keep_tensors=True)[0]
    assert torch.equal(y, torch.cat(alone, dim=0))
    conv1 = graph.node("conv1").outputs[0]
    kept = graph.wide_values.get(conv1)
    assert kept is not None and torch.equal(kept, torch.cat(wides, dim=0))
    graph.node("conv2").forward()  # conv2 alone, per group: its input gets its wide value back afterwards
    assert graph.wide_values.get(conv1) is kept


def test_a_graph_clone_carries_the_wide_values() -> None:
    graph = _chain()
    graph.forward([_data()], keep_tensors=True)
    copy = graph.clone()
    for name in ("conv1", "conv2"):
        t, c = graph.node(name).outputs[0], copy.node(name).outputs[0]
        assert c.betensor is not t.betensor and copy.wide_values.get(c) is graph.wide_values.get(t)
    prelu = copy.node("prelu")
    prelu.forward()  # reads the clone's float64 conv2 result, as the original did
    assert torch.equal(prelu.outputs[0].betensor, graph.node("prelu").outputs[0].betensor)


def test_a_layer_outside_a_graph_keeps_and_reads_no_wide_value() -> None:
    graph = _chain()
    graph.forward([_data()], keep_tensors=True)
    conv2 = graph.node("conv2")
    copy = conv2.detached_copy()  # outside any graph: reads its input's float32 value
    assert copy.graph is None
    copy.forward()
    x = conv2.inputs[0].betensor.to(torch.float64)
    w = conv2.constants["weights"].betensor.to(torch.float64)[:, 0, 0, :]
    rounded_first = (x @ w.T + conv2.constants["biases"].betensor.to(torch.float64)).to(torch.float32)
    assert torch.equal(copy.outputs[0].betensor, rounded_first)
    assert not torch.equal(conv2.outputs[0].betensor, rounded_first)  # in the graph it reads the float64 value
