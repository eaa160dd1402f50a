"""Statistics and local calibration of a layer's placeholders (tensors inside a layer that its float forward sets):
the statistics pass folds them like outputs, calibrate_graph gives them ranges with the layer's activation strategy,
and statistic files save and load them (creating the placeholders of a layer that has not run yet)."""
from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from quantopt.calibration.statistic_file import FORMAT_VERSION, load_statistics, save_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import DataError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.tensor import PyTensor

PH_NAMES = ("fc/pre_double", "fc/never_set")


def tiny(seed: int = 0):
    """x[1,4] → FC(3) → FC(2); layer `fc` sets two placeholders in its float forward (one stays empty)."""
    r = np.random.default_rng(seed)
    g = GraphBuilder("ph")
    x = g.input("x", [1, 4])
    a = g.layer("FullyConnected", [x], [[1, 3]], name="fc", params=dict(num_output=3, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.5, (3, 4)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 3).astype(np.float32)})
    b = g.layer("FullyConnected", [a], [[1, 2]], name="fc2", params=dict(num_output=2, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.5, (2, 3)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 2).astype(np.float32)})
    graph = g.build([b])
    graph.node("fc").attrs["forward_override"] = _forward_with_placeholders
    return graph


def _forward_with_placeholders(node, fn) -> None:
    """The layer's own forward, then 2 * output - 1 into placeholder 0 (created on the first run, reused after)."""
    fn(node)
    if not node.placeholders:
        node.placeholders = [PyTensor(name) for name in PH_NAMES]
    node.placeholders[0].betensor = 2.0 * node.outputs[0].betensor - 1.0


def with_settings(g, act: str = "extrema", mode: str = "per_tensor_asymmetric"):
    s = dataclasses.replace(LayerSettings(), q_strategy_activation=act, q_mode_activation=mode)
    for n in g.nodes:
        n.settings = s
    return g


def batches(n: int = 3, seed: int = 1) -> List[List[torch.Tensor]]:
    r = np.random.default_rng(seed)
    return [[torch.from_numpy(r.normal(0, 1, (5, 4)).astype(np.float32))] for _ in range(n)]


def reference_placeholder(seed: int = 0) -> np.ndarray:
    """2 * (x @ W^T + b) - 1 over every batch, in float64 numpy (independent of the graph's forward)."""
    r = np.random.default_rng(seed)
    w = r.normal(0, 0.5, (3, 4)).astype(np.float32).astype(np.float64)
    b = r.normal(0, 0.1, 3).astype(np.float32).astype(np.float64)
    return np.stack([2.0 * (x[0].numpy().astype(np.float64) @ w.T + b) - 1.0 for x in batches()])


def collected(act: str = "extrema", mode: str = "per_tensor_asymmetric"):
    g = with_settings(tiny(), act, mode)
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches())
    return g


def test_statistics_pass_folds_placeholders_like_outputs() -> None:
    g = collected()
    ph, empty = g.node("fc").placeholders
    ref = reference_placeholder()
    st = g.statistics.get(ph)
    assert st.batches == 3
    assert float(st.extrema_min) == pytest.approx(ref.min(), abs=1e-5)
    assert float(st.extrema_max) == pytest.approx(ref.max(), abs=1e-5)
    # `mean` strategies read the running per-batch extrema: the last batch's minimum is in them too
    assert st.extrema_min_key_axis is None  # per tensor only
    assert g.statistics.get(empty).extrema_min is None  # never set: no statistics
    assert g.node("fc2").placeholders == []


@pytest.mark.parametrize("mode", ["per_tensor_asymmetric", "per_tensor_symmetric_restricted_range"])
def test_calibrate_graph_gives_placeholders_the_layer_strategy_ranges(mode: str) -> None:
    g = collected(mode=mode)
    calibrate_graph(g)
    ph, empty = g.node("fc").placeholders
    ref = reference_placeholder()
    lo, hi = min(0.0, ref.min()), max(0.0, ref.max())  # a symmetric mode widens the range when quantizing only
    assert float(g.ranges.get(ph).min) == pytest.approx(lo, abs=1e-5)
    assert float(g.ranges.get(ph).max) == pytest.approx(hi, abs=1e-5)
    assert g.ranges.get(empty).min is None and g.ranges.get(empty).max is None


def test_mean_strategy_averages_the_per_batch_extrema_of_a_placeholder() -> None:
    g = collected(act="mean")
    calibrate_graph(g)
    ph = g.node("fc").placeholders[0]
    ref = reference_placeholder()
    # running_statistic_momentum 0.9 (default): r = 0.9 * r + 0.1 * batch value, starting from the first batch
    mom = LayerSettings().running_statistic_momentum
    rmin, rmax = ref[0].min(), ref[0].max()
    for b in ref[1:]:
        rmin, rmax = mom * rmin + (1 - mom) * b.min(), mom * rmax + (1 - mom) * b.max()
    assert float(g.ranges.get(ph).min) == pytest.approx(min(0.0, rmin), abs=1e-5)
    assert float(g.ranges.get(ph).max) == pytest.approx(max(0.0, rmax), abs=1e-5)


def test_round_trip_creates_placeholders_of_a_layer_that_has_not_run(tmp_path: Path) -> None:
    src = collected()
    path = tmp_path / "ph_statistic_info.npz"
    save_statistics(src, str(path))
    with zipfile.ZipFile(path) as z:
        header = json.loads(np.load(z.open("header.npy")).tobytes().decode("utf-8"))
    assert header["format_version"] == FORMAT_VERSION == 2
    kinds = [e["kind"] for e in header["entries"]]
    assert kinds.count("placeholder") == 2
    dst = with_settings(tiny())
    assert dst.node("fc").placeholders == []
    count = load_statistics(dst, str(path))
    assert count == 3 + 2 + 2  # outputs of x, fc, fc2 + the two weights + the two placeholders
    ph = dst.node("fc").placeholders
    assert [t.name for t in ph] == list(PH_NAMES)
    assert list(ph[0].ir_shape) == [5, 3]
    assert torch.equal(dst.statistics.get(ph[0]).extrema_min,
                       src.statistics.get(src.node("fc").placeholders[0]).extrema_min)
    assert dst.statistics.get(ph[1]).extrema_min is None
    calibrate_graph(src)
    calibrate_graph(dst)
    r_dst, r_src = dst.ranges.get(dst.node("fc").placeholders[0]), src.ranges.get(src.node("fc").placeholders[0])
    assert (float(r_dst.min), float(r_dst.max)) == (float(r_src.min), float(r_src.max))
    # the next float forward fills the loaded placeholders in place (same objects, statistics kept)
    kept = dst.node("fc").placeholders[0]
    dst.forward(batches(1)[0])
    assert dst.node("fc").placeholders[0] is kept and kept.betensor.shape == (5, 3)
    assert dst.statistics.get(kept).batches == 3


def test_graph_without_placeholders_still_writes_version_1(tmp_path: Path) -> None:
    g = with_settings(tiny())
    del g.node("fc").attrs["forward_override"]
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches())
    path = tmp_path / "v1.npz"
    save_statistics(g, str(path))
    with zipfile.ZipFile(path) as z:
        header = json.loads(np.load(z.open("header.npy")).tobytes().decode("utf-8"))
    assert header["format_version"] == 1
    assert all(e["kind"] != "placeholder" for e in header["entries"])


def test_file_without_placeholder_statistics_leaves_them_empty(tmp_path: Path) -> None:
    g = with_settings(tiny())
    override = g.node("fc").attrs.pop("forward_override")
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches())
    path = tmp_path / "old.npz"
    save_statistics(g, str(path))  # an old-style file: no placeholder entries
    dst = collected()  # its placeholders have statistics from its own pass
    dst.node("fc").attrs["forward_override"] = override
    assert dst.statistics.get(dst.node("fc").placeholders[0]).extrema_min is not None
    load_statistics(dst, str(path))
    assert dst.statistics.get(dst.node("fc").placeholders[0]).extrema_min is None  # nothing stale
    calibrate_graph(dst)
    assert dst.ranges.get(dst.node("fc").placeholders[0]).min is None


def _rewrite_header(path: Path, out: Path, edit) -> None:
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays["header"].tobytes().decode("utf-8"))
    edit(header)
    arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    np.savez_compressed(out, **arrays)


def test_bad_placeholder_entries_are_refused(tmp_path: Path) -> None:
    src = collected()
    path = tmp_path / "good.npz"
    save_statistics(src, str(path))

    def drop_name(h):
        next(e for e in h["entries"] if e["kind"] == "placeholder")["tensor"] = 7

    def as_version_1(h):
        h["format_version"] = 1

    for edit, match in ((drop_name, "corrupt entry for placeholder 0 of layer 'fc'"),
                        (as_version_1, "invalid entry")):
        bad = tmp_path / "bad.npz"
        _rewrite_header(path, bad, edit)
        dst = with_settings(tiny())
        with pytest.raises(DataError, match=match):
            load_statistics(dst, str(bad))
        assert dst.node("fc").placeholders == []  # nothing changed
