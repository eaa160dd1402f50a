"""The statistics pass's grouped forwards (calibration/collect.py): batches run several at a time as one forward of
their concatenation give, field for field, the statistics of one forward per batch, on every model of the golden
corpus (transformers, recurrent layers with placeholders, OCR, detection, one-operator graphs, IR batches above
one, graphs that hold one IR batch only), with the strategies of each statistics path."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

import pytest
import torch
from corpus_helpers import MODELS, ONE_IR_BATCH, corpus_model, ir_batches

from quantopt.calibration.collect import collect_activation_statistics
from quantopt.calibration.statistics import plain_extrema, plain_extrema_rows
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import DataError
from quantopt.graph import grouped
from quantopt.graph.graph import PyGraph
from quantopt.graph.recorded import ForwardRecord
from quantopt.graph.tables import StatisticsTable, TensorStatistics

STRATEGIES = ["extrema", "3std", "kld", "extrema"]
"""Every fourth layer's activation strategy in turn: the extrema path, moments, a histogram."""


def _fields(stats: TensorStatistics) -> dict:
    out = {}
    for name in stats.__dataclass_fields__:
        v = getattr(stats, name)
        out[name] = (v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else v
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _statistics(graph: PyGraph) -> Dict[str, dict]:
    names = sorted({t.name for n in graph.nodes for t in [*n.outputs, *n.placeholders] if t in graph.statistics})
    return {name: _fields(graph.statistics.get(name)) for name in names}


def _load(model: str) -> tuple:
    graph, ir_batch, arrays = corpus_model(model)
    for i, n in enumerate(graph.nodes):
        n.settings = dataclasses.replace(
            LayerSettings(), q_mode_activation="per_channel_asymmetric" if i % 2 else "per_tensor_asymmetric",
            q_strategy_activation=STRATEGIES[i % len(STRATEGIES)], running_statistic_momentum=0.37)
    return graph, ir_batch, arrays


def _pass(graph: PyGraph, batches: List[List[torch.Tensor]], group, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(statistics, the batch sizes of the forwards run) of one pass from empty statistics."""
    graph.statistics = StatisticsTable()
    rows: List[int] = []
    forward = graph.forward

    def counted(inputs, *args, **kwargs):
        rows.append(int(inputs[0].shape[0]))
        return forward(inputs, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(graph, "forward", counted)
        assert collect_activation_statistics(graph, batches, group=group) == len(batches)
    return _statistics(graph), rows


def _assert_equal(got: Dict[str, dict], want: Dict[str, dict], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        for key in want[name]:
            assert _same(got[name][key], want[name][key]), f"{what}: '{name}' {key}"


@pytest.mark.parametrize("model", MODELS)
def test_grouped_forwards_give_the_statistics_of_one_forward_per_batch(model: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    graph, ir_batch, arrays = _load(model)
    batches = ir_batches(arrays, ir_batch, 5)
    assert len(batches) >= 3
    want, rows = _pass(graph, batches, 1, monkeypatch)
    assert rows == [ir_batch] * len(batches)
    for group in (None, 3):
        got, rows = _pass(graph, batches, group, monkeypatch)
        _assert_equal(got, want, f"{model}, group {group}")
        grouped = [r for r in rows if r > ir_batch]
        has_placeholders = any(n.placeholders for n in graph.nodes)
        if model in ONE_IR_BATCH or has_placeholders:  # tried once, then batch by batch
            assert len(grouped) <= 1 and len(rows) == len(batches) + len(grouped), rows
        else:
            assert grouped and sum(rows) == ir_batch * len(batches), rows


def test_batches_of_several_ir_batches_and_a_short_last_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration batches of two IR batches are grouped and split back by their own rows; a last batch of
    another shape runs alone."""
    graph, ir_batch, arrays = _load("misc_convs")
    batches = ir_batches(arrays, 2 * ir_batch, 4)
    batches.append([a[:ir_batch] for a in arrays])
    want, _ = _pass(graph, batches, 1, monkeypatch)
    got, rows = _pass(graph, batches, None, monkeypatch)
    _assert_equal(got, want, "batches of two")
    assert rows == [2 * ir_batch, 2 * ir_batch * (len(batches) - 2), ir_batch]


def test_recorded_batches_run_alone_and_hold_their_own_values(monkeypatch: pytest.MonkeyPatch) -> None:
    graph, ir_batch, arrays = _load("misc_convs")
    batches = ir_batches(arrays, ir_batch, 6)
    records = []
    for group in (1, None):
        graph.statistics = StatisticsTable()
        record = ForwardRecord(2)
        collect_activation_statistics(graph, batches, record, group=group)
        records.append(record)
    for one, other in zip(*(r.batches for r in records)):
        assert one.values.keys() == other.values.keys()
        for name, value in one.values.items():
            assert torch.equal(other.values[name], value), name
    assert len(records[1].batches) == 2


def test_nan_in_a_grouped_batch_names_that_batch() -> None:
    graph, ir_batch, arrays = _load("misc_convs")
    batches = ir_batches(arrays, ir_batch, 5)
    batches[3] = [b.clone() for b in batches[3]]
    batches[3][0].view(-1)[7] = math.nan
    with pytest.raises(DataError, match="calibration batch 3 has NaN values"):
        collect_activation_statistics(graph, batches, group=4)


def test_group_must_be_positive() -> None:
    graph, ir_batch, arrays = _load("misc_convs")
    with pytest.raises(ValueError, match="at least 1"):
        collect_activation_statistics(graph, ir_batches(arrays, ir_batch, 2), group=0)


def test_group_size_follows_the_output_bytes() -> None:
    assert grouped.group_size(0) == grouped.MAX_FORWARD_GROUP
    assert grouped.group_size(grouped.FORWARD_GROUP_BYTES // 3) == 3
    assert grouped.group_size(grouped.FORWARD_GROUP_BYTES + 1) == 1


def test_extrema_of_rows_equal_those_of_each_row() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g)
    x[1, 5] = math.nan
    x[2, 0] = -math.inf
    x[3, 9] = 1e31  # a mask value
    x[4, 2] = 5e9  # beyond the clipped range
    x[5] = 0.0
    for rows in (x, x.double(), (x.nan_to_num(0.0, 0.0, 0.0) * 100).clamp(-1e4, 1e4).to(torch.int64)):
        for threshold in (1e30, math.inf):
            assert plain_extrema_rows(rows, threshold) == [plain_extrema(r, threshold) for r in rows]


@pytest.mark.parametrize("strategy", ["3std", "kld"])
def test_statistics_do_not_depend_on_the_memory_layout(strategy: str) -> None:
    """A layer may return a permuted view at one batch size and a contiguous tensor at another (InstanceNorm
    does): the per-channel moments and histograms of the same values are the same bits either way."""
    from quantopt.calibration.collect import _stat_config
    from quantopt.calibration.statistics import update_statistics
    from quantopt.graph.node import PyNode

    node = PyNode("n", "Convolution")
    node.settings = dataclasses.replace(LayerSettings(), q_strategy_activation=strategy)
    cfg = _stat_config(node, strategy, key_axis=-1, activation=True)
    g = torch.Generator().manual_seed(11)
    nchw = torch.randn(2, 24, 13, 17, generator=g) * torch.linspace(0.1, 40.0, 24).reshape(1, -1, 1, 1)
    permuted = nchw.permute(0, 2, 3, 1)  # NHWC values, channels-first memory
    results = []
    for x in (permuted, permuted.contiguous()):
        stats = TensorStatistics()
        for i in range(3):
            update_statistics(stats, x * (1 + i), cfg, i)
        results.append(_fields(stats))
    field = {"3std": "running_std_key_axis", "kld": "running_histc_key_axis"}[strategy]
    assert results[0][field] is not None
    _assert_equal({"x": results[0]}, {"x": results[1]}, strategy)
