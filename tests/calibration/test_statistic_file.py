"""Statistic files: save the statistics of a graph, load them onto a fresh copy and calibrate it identically;
files made for another graph, of a newer format version, truncated, corrupt or pickled are refused in one line."""
from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from quantopt.calibration.statistic_file import (
    FORMAT_VERSION,
    STAT_FIELDS,
    graph_fingerprint,
    load_statistics,
    save_statistics,
    statistic_file_name,
)
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import DataError
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import run_quantized
from quantopt.quantizer import quantize_graph

GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1, group=1)


def model(seed: int = 0, fc_out: int = 5, c2_name: str = "c2", c2_type: str = "Convolution"):
    """x[1,6,6,3] → conv(RELU) → conv → add(skip) → reshape → FC."""
    r = np.random.default_rng(seed)
    g = GraphBuilder("stat")
    x = g.input("x", [1, 6, 6, 3])
    a = g.layer("Convolution", [x], [[1, 6, 6, 4]], name="c1", params=dict(num_output=4, with_activation="RELU", **GEO),
                constants={"weights": r.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 4).astype(np.float32)})
    if c2_type == "Convolution":
        b = g.layer("Convolution", [a], [[1, 6, 6, 4]], name=c2_name,
                    params=dict(num_output=4, with_activation="NONE", **GEO),
                    constants={"weights": r.normal(0, 0.3, (4, 3, 3, 4)).astype(np.float32),
                               "biases": r.normal(0, 0.1, 4).astype(np.float32)})
    else:
        b = g.layer(c2_type, [a], [[1, 6, 6, 4]], name=c2_name, params=dict(method="RELU"))
    c = g.layer("Eltwise", [a, b], [[1, 6, 6, 4]], name="add", params=dict(method="ADD", with_activation="NONE"))
    d = g.layer("Reshape", [c], [[1, 144]], name="flat", params=dict(shape=[1, 144]))
    e = g.layer("FullyConnected", [d], [[1, fc_out]], name="fc", params=dict(num_output=fc_out, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.2, (fc_out, 144)).astype(np.float32),
                           "biases": r.normal(0, 0.1, fc_out).astype(np.float32)})
    return g.build([e])


def batches(n: int = 3, seed: int = 1) -> List[List[torch.Tensor]]:
    r = np.random.default_rng(seed)
    return [[torch.from_numpy(r.normal(0, 1, (2, 6, 6, 3)).astype(np.float32))] for _ in range(n)]


def with_settings(g, act: str = "mean", weight_mode: str = "per_channel_symmetric_restricted_range"):
    s = dataclasses.replace(LayerSettings(), q_strategy_activation=act, q_mode_weight=weight_mode, histc_bins=512)
    for n in g.nodes:
        n.settings = s
    return g


def collected(act: str = "mean", seed: int = 0, **kw):
    g = with_settings(model(seed, **kw), act)
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches())
    return g


def ranges(g) -> Dict[str, tuple]:
    out = {}
    for n in g.nodes:
        for t in list(n.outputs) + list(n.constants.values()):
            vals = [v for r in (g.ranges.get(t), g.ranges.channels(t)) for v in (r.min, r.max)]
            out[f"{n.name}/{t.name}"] = tuple(v.tolist() if isinstance(v, torch.Tensor) else v for v in vals)
    return out


def stats_equal(a, b) -> bool:
    for name in STAT_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return a.batches == b.batches


def one_line_data_error(exc: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(exc.value)
    assert isinstance(exc.value, DataError)
    assert "\n" not in msg and str(path) in msg
    return msg


# --------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("act", ["mean", "kld", "3std", "extrema"])
def test_round_trip_gives_identical_statistics_ranges_and_quantized_output(tmp_path: Path, act: str) -> None:
    src = collected(act)
    path = tmp_path / statistic_file_name("stat")
    assert save_statistics(src, str(path)) == str(path)
    dst = with_settings(model(), act)  # a fresh graph, no statistics pass
    with pytest.raises(DataError, match="no statistics were collected"):
        calibrate_graph(dst)
    count = load_statistics(dst, str(path))
    assert count == sum(len(n.outputs) for n in dst.nodes) + 3  # outputs + the three weights
    for fn, dn in zip(src.nodes, dst.nodes):
        for ft, dt in zip([*fn.outputs, *fn.constants.values()], [*dn.outputs, *dn.constants.values()]):
            assert stats_equal(src.statistics.get(ft), dst.statistics.get(dt)), (fn.name, ft.name)
    if act == "kld":
        assert dst.statistics.get(dst.node("c1").outputs[0]).running_histc is not None
    assert dst.statistics.get(dst.node("c1").constants["weights"]).extrema_min_key_axis.shape == (4,)
    calibrate_graph(src)
    calibrate_graph(dst)
    assert ranges(src) == ranges(dst)
    qs, qd = quantize_graph(src), quantize_graph(dst)
    x = batches(1, seed=7)[0]
    for a, b in zip(run_quantized(qs, x), run_quantized(qd, x)):
        assert torch.equal(a, b)
    for a, b in zip(qs.output_tensors, qd.output_tensors):
        assert torch.equal(a.betensor, b.betensor)


def test_file_is_plain_npz_with_documented_header(tmp_path: Path) -> None:
    g = collected()
    path = tmp_path / "s.npz"
    save_statistics(g, str(path))
    with np.load(path, allow_pickle=False) as data:
        header = json.loads(data["header"].tobytes().decode("utf-8"))
        assert all(data[k].dtype.kind in "fu" for k in data.files)
    # no placeholders in this graph: the version 1 layout (tests/calibration/test_placeholder_statistics.py: 2)
    assert header["format"] == "quantopt-statistics" and header["format_version"] == 1 < FORMAT_VERSION
    assert header["fingerprint"] == graph_fingerprint(g)
    assert [r["name"] for r in header["layers"]] == [n.name for n in g.nodes]
    kinds = {(e["layer"], e["kind"], e["key"]) for e in header["entries"]}
    assert ("c1", "constant", "weights") in kinds and ("c1", "constant", "biases") not in kinds
    assert ("fc", "output", 0) in kinds
    assert not list(tmp_path.glob(".statistics-*"))  # the temporary file was renamed into place


def test_fingerprint_ignores_weights_and_layer_order_but_not_structure() -> None:
    assert graph_fingerprint(model(0)) == graph_fingerprint(model(5))
    assert graph_fingerprint(model()) != graph_fingerprint(model(fc_out=6))


# --------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw, expected", [
    (dict(fc_out=6), "tensor 'fc' of layer 'fc' has shape [1, 6] in the graph but [1, 5] in the file"),
    (dict(c2_name="conv2"), "layer 'conv2' (Convolution) of the graph is not in the file"),
    (dict(c2_type="Activation"), "layer 'c2' is Activation in the graph but Convolution in the file"),
    (dict(seed=3), "constant 'weights' of layer 'c1' holds different values"),
])
def test_file_for_a_different_graph_is_refused_naming_the_difference(tmp_path: Path, kw, expected: str) -> None:
    path = tmp_path / "s.npz"
    save_statistics(collected(), str(path))
    other = with_settings(model(**kw))
    before = [other.statistics.get(t) for n in other.nodes for t in n.outputs]
    with pytest.raises(DataError) as exc:
        load_statistics(other, str(path))
    assert expected in one_line_data_error(exc, path)
    assert [other.statistics.get(t) for n in other.nodes for t in n.outputs] == before  # nothing was changed


def rewrite_header(path: Path, edit) -> None:
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays["header"].tobytes().decode("utf-8"))
    edit(header)
    arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.npz"
    save_statistics(collected(), str(path))
    rewrite_header(path, lambda h: h.update(format_version=FORMAT_VERSION + 1, quantopt_version="9.0"))
    with pytest.raises(DataError) as exc:
        load_statistics(with_settings(model()), str(path))
    msg = one_line_data_error(exc, path)
    assert f"format version {FORMAT_VERSION + 1}" in msg and "newer" in msg


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "text", "pickle", "not_ours", "missing_array",
                                    "bad_shape", "missing_entry"])
def test_truncated_or_corrupt_file_is_refused_in_one_line(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s.npz"
    save_statistics(collected(), str(path))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("e1.extrema_max.npy")
        at = info.header_offset + 30 + len(info.filename) + info.compress_size // 2
        path.write_bytes(raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "text":
        path.write_text("header = not a statistic file\n")
    elif damage == "pickle":  # the upstream format: a pickled dict in a .npy
        with open(path, "wb") as f:
            np.save(f, np.array({"c1": {"c1": {"extrema_min": 0.0}}}, dtype=object), allow_pickle=True)
    elif damage == "not_ours":
        with open(path, "wb") as f:
            np.savez(f, a=np.zeros(3))
    elif damage == "missing_array":
        rewrite_header(path, lambda h: h["entries"][1]["arrays"].update(extrema_max="nowhere"))
    elif damage == "bad_shape":
        rewrite_header(path, lambda h: h["entries"][1]["arrays"].update(
            extrema_max=h["entries"][1]["arrays"]["running_histc"]
            if "running_histc" in h["entries"][1]["arrays"] else "e4.extrema_min_key_axis"))
    elif damage == "missing_entry":
        rewrite_header(path, lambda h: h["entries"].pop(2))
    g = with_settings(model())
    with pytest.raises(DataError) as exc:
        load_statistics(g, str(path))
    msg = one_line_data_error(exc, path)
    if damage == "pickle":
        assert "pickle" in msg and "never loads" in msg
    if damage == "missing_entry":
        assert "has no statistics for" in msg
    assert all(g.statistics.get(t).extrema_min is None for n in g.nodes for t in n.outputs)


def test_missing_file_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.npz"
    with pytest.raises(DataError) as exc:
        load_statistics(with_settings(model()), str(path))
    assert "no such statistic file" in one_line_data_error(exc, path)


@pytest.mark.parametrize("saved, wanted, missing", [("mean", "kld", "histogram"), ("mean", "3std", "mean/std/mad")])
def test_statistics_a_strategy_needs_must_be_in_the_file(tmp_path: Path, saved: str, wanted: str,
                                                         missing: Optional[str]) -> None:
    path = tmp_path / "s.npz"
    save_statistics(collected(saved), str(path))
    with pytest.raises(DataError) as exc:
        load_statistics(with_settings(model(), wanted), str(path))
    msg = one_line_data_error(exc, path)
    assert f"has no {missing}" in msg and f"'{wanted}'" in msg
    # the check can be turned off (e.g. to inspect a file)
    assert load_statistics(with_settings(model(), wanted), str(path), check_strategies=False) > 0


# --------------------------------------------------------------------------------------------- ignore_missing_statistic
@pytest.mark.parametrize("kw, filled", [
    (dict(seed=3), {"c1.weights", "c2.weights", "fc.weights"}),  # other weights: recomputed from the new values
    (dict(c2_name="conv2"), {"conv2", "conv2.weights"}),  # a renamed layer: its output borrows c1's statistics
    (dict(fc_out=6), {"fc", "fc.weights"}),  # another shape: the FC output borrows its input's statistics
])
def test_ignore_missing_fills_from_weights_and_neighbours(tmp_path: Path, kw, filled, caplog) -> None:
    path = tmp_path / "s.npz"
    saved = collected()
    save_statistics(saved, str(path))
    other = with_settings(model(**kw))
    with caplog.at_level("WARNING", logger="quantopt"):
        load_statistics(other, str(path), ignore_missing=True)
    warning = " ".join(r.getMessage() for r in caplog.records if "ignore_missing_statistic" in r.getMessage())
    named = set(warning.split("weights or neighbours: ", 1)[1].split(", "))
    assert named == filled
    fresh = with_settings(model(**kw))  # what the statistics pass gives the new weights
    collect_weight_statistics(fresh)
    by_name = {n.name: n for n in other.nodes}
    for n in fresh.nodes:
        for key, t in n.constants.items():
            if key == "weights":
                assert stats_equal(other.statistics.get(by_name[n.name].constants[key]), fresh.statistics.get(t)), \
                    (n.name, key)
    old = {t.name: saved.statistics.get(t) for n in saved.nodes for t in n.outputs}
    new = {t.name: other.statistics.get(t) for n in other.nodes for t in n.outputs}
    if "conv2" in filled:
        assert stats_equal(new["conv2"], old["c1"]) and stats_equal(new["add"], old["add"])
    if "fc" in filled:
        assert stats_equal(new["fc"], old["flat"]) and not stats_equal(new["fc"], old["fc"])
    calibrate_graph(other)  # the filled statistics calibrate
    assert all(other.ranges.get(t).min is not None for n in other.nodes for t in n.outputs)


def test_ignore_missing_without_any_neighbour_is_refused(tmp_path: Path) -> None:
    g = GraphBuilder("one")
    x = g.input("x", [1, 4])
    y = g.layer("Activation", [x], [[1, 4]], name="act", params=dict(method="RELU"))
    one = with_settings(g.build([y]))
    collect_activation_statistics(one, [[torch.ones(1, 4)]])
    path = tmp_path / "s.npz"
    save_statistics(one, str(path))
    g = GraphBuilder("one")
    x = g.input("x2", [1, 4])
    y = g.layer("Activation", [x], [[1, 4]], name="act2", params=dict(method="RELU"))
    other = with_settings(g.build([y]))
    with pytest.raises(DataError) as exc:
        load_statistics(other, str(path), ignore_missing=True)
    assert "no statistics for tensor 'x2' and none for any tensor around it" in one_line_data_error(exc, path)
