"""Grouped forwards for per-batch outputs (graph/grouped.py, what metric evaluation and the mixed-precision search
run): the outputs of each batch, in order with its own extra, are the bits of one forward per batch, on every model
of the golden corpus (float graphs; quantized graphs of a subset, read dequantized as the metrics read them), and
graphs that hold one IR batch only fall back to one forward per batch."""
from __future__ import annotations

from typing import List

import pytest
import torch
from corpus_helpers import CORPUS, MODELS, ONE_IR_BATCH, corpus_model, ir_batches

from quantopt.analysis.similarity import to_float
from quantopt.graph import grouped
from quantopt.graph.grouped import batch_parts, groupable, grouped_outputs
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model

QUANTIZED = ["bilstm", "causal_sdpa", "convnext_block", "mbconv_se", "misc_convs", "norms", "op_if"]


def _load(model: str):
    graph, ir_batch, arrays = corpus_model(model)
    batches = ir_batches(arrays, ir_batch, 6)
    assert len(batches) >= 3
    return graph, ir_batch, batches


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64) if x.dtype == torch.float64 else x


def _assert_same(got: List[torch.Tensor], want: List[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert torch.equal(_bits(g.contiguous()), _bits(w.contiguous())), what


def _check(graph, ir_batch: int, batches, read, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        want = []
        for inputs in batches:
            graph.forward(inputs)
            want.append([read(t).clone() for t in graph.output_tensors])
        rows: List[int] = []
        forward = graph.forward

        def counted(inputs, *args, **kwargs):
            rows.append(int(inputs[0].shape[0]))
            return forward(inputs, *args, **kwargs)

        for group in (None, 2, 4):
            rows.clear()
            with monkeypatch.context() as m:
                m.setattr(graph, "forward", counted)
                got = [(outputs, extra) for outputs, extra in
                       grouped_outputs(graph, ((inputs, i) for i, inputs in enumerate(batches)), read, group)]
            assert [extra for _, extra in got] == list(range(len(batches)))
            for (outputs, i) in got:
                _assert_same(outputs, want[i], f"{what}, group {group}, batch {i}")
            if what.split()[0] in ONE_IR_BATCH:
                assert sum(rows) <= ir_batch * (2 * len(batches) - 1), rows  # one group tried, then alone
            else:
                assert max(rows) > ir_batch and sum(rows) == ir_batch * len(batches), rows


@pytest.mark.parametrize("model", MODELS)
def test_float_outputs_of_grouped_forwards(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, ir_batch, batches = _load(model)
    _check(graph, ir_batch, batches, lambda t: t.betensor, f"{model} float", monkeypatch)


@pytest.mark.parametrize("model", QUANTIZED)
def test_dequantized_outputs_of_grouped_quantized_forwards(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, ir_batch, batches = _load(model)
    qgraph = quantize_model(graph, batches[:2])
    _check(qgraph, ir_batch, batches, lambda t: to_float(t, qgraph.quant), f"{model} quantized", monkeypatch)


def test_batches_of_other_shapes_run_alone_in_order() -> None:
    graph, ir_batch, batches = _load("misc_convs")
    items = [(batches[0], "a"), (batches[1], "b"), ([torch.cat([*batches[2], *batches[3]])], "c"),
             (batches[4], "d"), (batches[5], "e")]
    with torch.no_grad():
        want = []
        for inputs, _ in items:
            graph.forward(inputs)
            want.append([t.betensor.clone() for t in graph.output_tensors])
        got = list(grouped_outputs(graph, iter(items), lambda t: t.betensor, group=8))
    assert [extra for _, extra in got] == ["a", "b", "c", "d", "e"]
    for (outputs, _), w in zip(got, want):
        _assert_same(outputs, w, "mixed shapes")


def test_what_groups_and_what_splits() -> None:
    graph, ir_batch, batches = _load("misc_convs")
    assert ir_batch == 1
    x = batches[0][0]
    assert groupable(graph, [x]) and groupable(graph, [torch.cat([x, x, x])])
    assert not groupable(graph, [x[0]]) and not groupable(graph, [x[..., :-1]])
    assert not groupable(graph, [])
    two = read_ir(CORPUS / "padding_mask" / "padding_mask.txt")
    a, b = (torch.zeros([int(d) for d in t.ir_shape]) for t in two.input_tensors)
    assert groupable(two, [a, b]) and groupable(two, [torch.cat([a, a]), torch.cat([b, b])])
    assert not groupable(two, [torch.cat([a, a]), b])  # b shared by the two IR batches of a
    value = torch.arange(24.0).reshape(6, 4)
    assert [p.tolist() for p in batch_parts(value, [2, 4], 3)] == [value[:2].tolist(), value[2:4].tolist(),
                                                                  value[4:].tolist()]
    assert batch_parts(value, [6, 4], 3) == [value] * 3  # the IR shape: the same in every batch
    assert batch_parts(value, [4, 4], 3) is None  # 6 rows are not 3 batches of whole IR batches
    assert batch_parts(value, [2, 3], 3) is None
    assert batch_parts(value, [3, 2, 4], 3) is None
    with pytest.raises(ValueError, match="at least 1"):
        list(grouped_outputs(graph, [(batches[0], 0)], lambda t: t.betensor, group=0))
    assert grouped.group_size(grouped.FORWARD_GROUP_BYTES) == 1
