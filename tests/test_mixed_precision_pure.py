"""The mixed-precision search takes and returns values: scoring a candidate never changes the float graph (settings,
calibrated ranges, constants, parameters), and the search returns its choice (`SearchResult.settings`) for the
caller to assign once (docs/mixed-precision.md)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from quantopt.calibration.collect import calibrate_graph
from quantopt.config.kinds_accuracy import AutoSearch
from quantopt.graph.graph import PyGraph
from quantopt.tuning.mixed_precision import cut_point_search, per_layer_search, promoted_settings, score_settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "calibration"))
from test_mixed_precision import _prepared  # noqa: E402

QUANT_KEYS = ("scale", "zerop", "qmin", "qmax", "qbits", "qinvariant", "axis")


def _value(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def snapshot(graph: PyGraph) -> Dict[str, Any]:
    """Everything a probe could leave on the float graph: each layer's settings and parameters, each tensor's
    ranges, quantization parameters and dtype, the constants' values, the statistics objects and the quantized copy."""
    snap: Dict[str, Any] = {"quantgraph": id(getattr(graph, "quantgraph", None))}
    table = graph.statistics
    for n in graph.nodes:
        tensors = [("in", t) for t in n.inputs] + [("out", t) for t in n.outputs]
        tensors += [(f"const {k}", t) for k, t in n.constants.items()] + [("ph", t) for t in n.placeholders]
        snap[n.name] = {
            "settings": (id(n.settings), n.settings), "params": repr(n.params), "quantized": n.quantized,
            "tensors": [(role, t.name, id(table.get(t)) if t in table else None,
                         {k: _value(getattr(graph.quant.get(t), k)) for k in QUANT_KEYS}, t.dtype,
                         [_value(v) for r in (graph.ranges.get(t), graph.ranges.channels(t)) for v in (r.min, r.max)],
                         t.betensor.detach().clone() if role.startswith("const") else None) for role, t in tensors]}
    return snap


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _calibrated(outlier: str):
    """The test chain with calibrated ranges on the float graph, so a probe that recalibrated it would show."""
    g, score = _prepared(outlier)
    calibrate_graph(g)
    return g, score


def _watched(g: PyGraph, score, calls: List[int]):
    """`score` that checks, at every call (one per probe), that the float graph is still as it was."""
    before = snapshot(g)

    def watched(qgraph) -> float:
        assert qgraph is not g
        assert _same(snapshot(g), before), "scoring a candidate changed the float graph"
        calls.append(1)
        return score(qgraph)
    return watched, before


@pytest.mark.parametrize("search", ["probe", "ranked", "cut", "unreachable"])
def test_no_probe_changes_the_float_graph(search):
    g, score = _calibrated("fc2")
    calls: List[int] = []
    watched, before = _watched(g, score, calls)
    auto = AutoSearch(3, 0.05, "L")
    if search == "probe":
        result = per_layer_search(g, watched, 1.0, auto)
    elif search == "ranked":
        result = per_layer_search(g, watched, 1.0, auto, ranking={"fc1": float("nan"), "fc3": 0.5, "fc2": 0.0})
    elif search == "cut":
        result = cut_point_search(g, watched, 1.0, auto)
    else:
        result = per_layer_search(g, watched, 1.0, AutoSearch(3, 0.5, "G"))
    assert len(calls) == result.evaluations > 1
    assert _same(snapshot(g), before)
    if search == "unreachable":
        assert not result.reached and result.settings == {}
    else:
        assert result.reached and result.promoted and list(result.settings) == result.promoted


def test_returned_settings_reproduce_the_final_score():
    g, score = _calibrated("fc2")
    original = {n.name: n.settings for n in g.nodes}
    result = per_layer_search(g, score, 1.0, AutoSearch(3, 0.05, "L"))
    assert result.settings == {name: promoted_settings(original[name], result.level) for name in result.promoted}
    assert "settings" not in result.as_dict()  # the report keeps its keys; the template records the settings
    assert score_settings(g, result.settings, score) == result.final_score
    for name, s in result.settings.items():  # what OptMaster does with the result
        g.node(name).settings = s
    assert score_settings(g, {}, score) == result.final_score


def test_snapshot_sees_what_an_in_place_probe_leaves():
    """The check above can fail: promoting a layer on the float graph and recalibrating it shows in the snapshot."""
    g, _ = _calibrated("fc2")
    before = snapshot(g)
    n = g.node("fc2")
    n.settings = promoted_settings(n.settings, "16bit")
    assert not _same(snapshot(g), before)
    g, _ = _calibrated("fc2")
    before = snapshot(g)
    t = g.node("fc2").outputs[0]
    g.ranges.set(t, g.ranges.get(t).min, g.ranges.get(t).max * 2)
    assert not _same(snapshot(g), before)
    g, _ = _calibrated("fc2")
    before = snapshot(g)
    g.node("fc3").constants["weights"].betensor[0, 0] += 1.0
    assert not _same(snapshot(g), before)
