"""The global methods' `capture` (tuning/global_methods/_common.py): its forwards stop after the last named layer
and run several batches at a time (graph/grouped.py `layer_values`), and it gives, value for value, what a whole
forward per batch records, for float and quantized graphs of the golden corpus and any set of named layers."""
from __future__ import annotations

from typing import Dict, List, Set

import pytest
import torch
from corpus_helpers import corpus_model, ir_batches

from quantopt.graph.graph import PyGraph
from quantopt.graph.grouped import layer_values
from quantopt.graph.values import to_float
from quantopt.pipeline import quantize_model
from quantopt.tuning.global_methods._common import capture

MODELS = ["bilstm", "causal_sdpa", "convnext_block", "mbconv_se", "misc_convs", "norms", "op_if", "op_filter",
          "padding_mask", "transformer_encoder", "yolo_sppf"]


def _load(model: str):
    graph, ir_batch, arrays = corpus_model(model)
    return graph, ir_batches(arrays, ir_batch, 5)


def _whole_forwards(graph: PyGraph, batches, names: Set[str], quantized: bool) -> Dict[str, List[tuple]]:
    """The reference: one whole forward per batch, every named layer's values copied as it runs."""
    found: Dict[str, List[tuple]] = {name: [] for name in names}

    def value(t):
        return to_float(t, graph.quant).clone() if quantized else t.betensor.detach().clone()

    def hook(node) -> None:
        if node.name in found:
            found[node.name].append(([value(t) for t in node.inputs], [value(t) for t in node.outputs]))

    with torch.no_grad():
        for b in batches:
            graph.forward(list(b), after_node=hook)
    return found


def _assert_same(got: Dict[str, List[tuple]], want: Dict[str, List[tuple]], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert len(got[name]) == len(want[name]), (what, name)
        for (gi, go), (wi, wo) in zip(got[name], want[name]):
            for g, w in zip(gi + go, wi + wo):
                assert g.dtype == w.dtype and g.shape == w.shape, (what, name)
                assert torch.equal(g.nan_to_num(), w.nan_to_num()), (what, name)


@pytest.mark.parametrize("model", MODELS)
def test_capture_gives_the_values_of_whole_forwards(model: str) -> None:
    graph, batches = _load(model)
    assert len(batches) >= 3
    qgraph = quantize_model(graph, batches[:2])
    names = [n.name for n in graph.nodes]
    sets = [{names[0]}, {names[len(names) // 2]}, {names[-1]}, {names[1], names[-2]}, set(names)]
    for g, quantized in ((graph, False), (qgraph, True)):
        for wanted in sets:
            want = _whole_forwards(g, batches, wanted, quantized)
            _assert_same(capture(g, batches, wanted, quantized=quantized), want, f"{model} {sorted(wanted)[:2]}")
    # after a capture stopped early the graph still runs whole forwards as before
    with torch.no_grad():
        capture(graph, batches, {names[0]})
        outputs = [o.clone() for o in graph.forward(batches[0])]
        again = graph.forward(batches[0])
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(outputs, again))


def test_layer_values_group_sizes_and_order() -> None:
    graph, batches = _load("misc_convs")
    names = {graph.nodes[-1].name}
    want = _whole_forwards(graph, batches, names, False)
    for group in (1, 2, 3, None):
        got = layer_values(graph, batches, names, lambda t: t.betensor, group)
        _assert_same({n: [v[n] for v in got] for n in names}, want, f"group {group}")
    with pytest.raises(ValueError, match="at least 1"):
        layer_values(graph, batches, names, lambda t: t.betensor, 0)
    assert layer_values(graph, [], names, lambda t: t.betensor) == []
