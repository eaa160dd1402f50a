"""The per-run report (JSON + self-contained HTML with inline SVG charts) and the progress bars."""
from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from quantopt.analysis.report import (
    build_report,
    collect_histograms,
    histogram_svg,
    layer_bits,
    nice_ticks,
    render_html,
    report_json,
    value_histogram,
    worst_layers,
    worst_tensors,
    write_report,
)
from quantopt.analysis.similarity import LayerSimilarity, layer_similarity
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model
from quantopt.progress import Progress, format_duration, progress, progress_enabled


def tiny_model():
    """x[1,4] → FC(6, RELU) → FC(3)."""
    r = np.random.default_rng(0)
    g = GraphBuilder("tiny")
    x = g.input("x", [1, 4])
    a = g.layer("FullyConnected", [x], [[1, 6]], name="fc1", params=dict(num_output=6, with_activation="RELU"),
                constants={"weights": r.normal(0, 0.5, (6, 4)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 6).astype(np.float32)})
    b = g.layer("FullyConnected", [a], [[1, 3]], name="fc2", params=dict(num_output=3, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.5, (3, 6)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 3).astype(np.float32)})
    return g.build([b])


def tiny_batches(n: int = 3):
    r = np.random.default_rng(1)
    return [torch.from_numpy(r.normal(0, 1, (4, 4)).astype(np.float32)) for _ in range(n)]


SIMS = [LayerSimilarity(0, "x", "Input", "x", 1.0, 0.0, 1.0, 0.0),
        LayerSimilarity(1, "conv", "Convolution", "conv_out", 0.99, 0.01, 0.995, 0.005),
        LayerSimilarity(2, "relu", "Activation", "relu_out", 0.98, 0.02, 0.999, 0.001),
        LayerSimilarity(3, "fc", "FullyConnected", "fc_out", 0.95, 0.05, 0.97, 0.03)]
SUMMARY = {"model": "demo", "inputs": ["x"], "outputs": ["fc_out"], "float_metrics": {"TopKMetric(1)": 0.75},
           "quant_metrics": {"TopKMetric(1)": 0.5}, "steps": [("statistics", 1.25), ("calibrate and quantize", 0.5)],
           "wall_time": 2.0, "warnings": 1, "files": ["out/demo_o.txt"]}


def demo_report():
    hist = {"fc_out": {"layer": "fc", "type": "FullyConnected", "tensor": "fc_out",
                       **value_histogram(torch.tensor([-1.0, 0.0, 0.5, 1.0]), torch.tensor([-0.5, 0.0, 0.5, 0.5]),
                                         bins=4)}}
    layers = [{"layer_id": 3, "name": "fc", "type": "FullyConnected",
               "outputs": [{"tensor": "fc_out", "dtype": "int8", "qbits": 8, "qinvariant": False,
                            "per_channel": False, "scale": 12.5}],
               "constants": {"weights": {"dtype": "int4", "qbits": 4, "per_channel": True, "scale_min": 1.0,
                                         "scale_max": 2.0}}}]
    return build_report(SUMMARY, SIMS, layers, hist, worst_count=2)


# ------------------------------------------------------------------------------------------------ JSON data

def test_value_histogram_hand_computed() -> None:
    h = value_histogram(torch.tensor([-1.0, 0.0, 0.5, 1.0]), torch.tensor([-0.5, 0.0, 0.5, 0.5]), bins=4)
    # shared range [-1, 1], bins [-1,-.5) [-.5,0) [0,.5) [.5,1]
    assert (h["lo"], h["hi"]) == (-1.0, 1.0)
    assert h["float_counts"] == [1, 0, 1, 2]
    assert h["quant_counts"] == [0, 1, 1, 2]
    assert h["float"] == {"min": -1.0, "max": 1.0, "mean": 0.125, "std": pytest.approx(0.7395, abs=1e-4)}
    # cos = (0.5 + 0 + 0.25 + 0.5) / (sqrt(2.25) * sqrt(0.75))
    assert h["cosine"] == pytest.approx(1.25 / (1.5 * 0.75 ** 0.5))
    assert h["numel"] == 4 and h["nonfinite"] == 0


def test_value_histogram_constant_and_nonfinite() -> None:
    h = value_histogram(torch.tensor([2.0, 2.0, float("nan")]), torch.tensor([2.0, 2.0, 2.0]), bins=2)
    assert (h["lo"], h["hi"]) == (1.5, 2.5)
    assert h["float_counts"] == [0, 2] and h["quant_counts"] == [0, 3] and h["nonfinite"] == 1
    json.dumps(h, allow_nan=False)


def test_value_histogram_of_one_huge_value_keeps_a_width() -> None:
    """A masked tensor holding only a huge constant (a dequantized -inf mask): the range stays non-empty after the
    9-digit rounding, and its chart renders (this was a ZeroDivisionError that left the HTML report unwritten)."""
    big = torch.full((4,), -2155905280.0)
    h = {"tensor": "t", "layer": "l", **value_histogram(big, big, bins=4)}
    assert h["lo"] < h["hi"]
    assert "<svg" in histogram_svg(h, 0)


def test_worst_layers_order() -> None:
    assert [s.name for s in worst_layers(SIMS, 2)] == ["fc", "conv"]
    assert worst_tensors(SIMS, 3) == ["fc_out", "conv_out", "relu_out"]


def test_report_json_content() -> None:
    r = demo_report()
    assert r["format"] == "quantopt-report" and r["version"] == 1 and r["model"] == "demo"
    assert r["metrics"] == [{"name": "TopKMetric(1)", "float": 0.75, "quant": 0.5, "drop": 0.25}]
    assert [s["name"] for s in r["similarity"]] == ["x", "conv", "relu", "fc"]
    assert [s["name"] for s in r["worst_layers"]] == ["fc", "conv"]
    assert r["histograms"][0]["tensor"] == "fc_out"
    assert r["steps"] == [{"name": "statistics", "seconds": 1.25}, {"name": "calibrate and quantize", "seconds": 0.5}]
    assert r["wall_time"] == 2.0 and r["warnings"] == 1
    json.loads(report_json(r))


def test_nonfinite_values_become_null() -> None:
    sims = [LayerSimilarity(0, "a", "Input", "a", float("nan"), float("inf"), 1.0, 0.0)]
    r = build_report({"model": "m", "float_metrics": {"m": float("nan")}}, sims)
    text = report_json(r)
    assert r["similarity"][0]["cumulative_cos"] is None and r["metrics"][0]["drop"] is None
    assert "NaN" not in text and "Infinity" not in text
    assert 'id="similarity-chart"' in render_html(r)


def test_nice_ticks() -> None:
    assert nice_ticks(0, 10, 5) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.95, 1.0, 5) == [0.95, 0.96, 0.97, 0.98, 0.99, 1.0]


# ------------------------------------------------------------------------------------------------ HTML

def test_html_has_the_chart_elements() -> None:
    page = render_html(demo_report())
    assert page.startswith("<!DOCTYPE html>")
    for needle in ('id="similarity-chart"', 'class="series series-cumulative"', 'class="series series-isolated"',
                   'id="bits-chart"', 'class="bar bar-act"', 'class="bar bar-weight"', 'id="steps-chart"',
                   'id="hist-0"', 'class="hist-float"', 'class="hist-quant"', 'id="metrics-table"',
                   'id="worst-table"', 'id="layers-table"', 'id="steps-table"'):
        assert needle in page, needle
    # 4 points on each similarity series, one histogram
    assert page.count('<circle class="point"') == 8
    assert page.count('class="chart histogram"') == 1
    assert "int4 (4 bits) per-channel" in page


def test_html_is_self_contained_and_escaped() -> None:
    sims = [LayerSimilarity(0, "a<b>&\"c", "Input", "t<1>", 1.0, 0.0, 1.0, 0.0)]
    page = render_html(build_report({"model": "<m>"}, sims))
    assert "a<b>" not in page and "a&lt;b&gt;&amp;&quot;c" in page and "&lt;m&gt;" in page
    assert not re.search(r"(https?:)?//[a-z]", page), "the page must not reference anything outside itself"
    assert "<script" not in page and "<link" not in page


def test_output_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    pa, pb = write_report(str(a), demo_report()), write_report(str(b), demo_report())
    assert [Path(p).name for p in pa] == ["demo_report.json", "demo_report.html"]
    for x, y in zip(pa, pb):
        assert Path(x).read_bytes().replace(str(a).encode(), b"") == Path(y).read_bytes().replace(str(b).encode(),
                                                                                                   b"")
    data = json.loads(Path(pa[0]).read_text())
    assert data["files"][-2:] == pa


def test_report_from_a_quantized_graph(tmp_path: Path) -> None:
    g = tiny_model()
    qg = quantize_model(g, tiny_batches(), per_layer={"fc2": {"q_bits_weight": 4}})
    sims = layer_similarity(g, qg, tiny_batches(2))
    layers = layer_bits(qg)
    by_name = {r["name"]: r for r in layers}
    assert by_name["fc2"]["constants"]["weights"]["qbits"] == 4
    assert by_name["fc1"]["outputs"][0]["dtype"] in ("int8", "uint8")
    hist = collect_histograms(g, qg, [tiny_batches(1)[0]], worst_tensors(sims, 2), bins=16)
    assert len(hist) == 2
    for h in hist.values():
        assert sum(h["float_counts"]) == h["numel"] == sum(h["quant_counts"])
        assert h["cosine"] > 0.9
    report = build_report({"model": "tiny", "steps": [("x", 0.1)]}, sims, layers, hist)
    paths = write_report(str(tmp_path), report)
    page = Path(paths[1]).read_text()
    assert page.count('class="chart histogram"') == 2 and 'id="similarity-chart"' in page


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    exe = _chromium()
    if exe is None:
        pytest.skip("headless Chromium is not installed (Debian package 'chromium'); the render check needs it")
    html_path = write_report(str(tmp_path), demo_report())[1]
    try:
        proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                               f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", Path(html_path).as_uri()],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("headless Chromium did not finish within 60 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    for needle in ('id="similarity-chart"', 'class="series series-cumulative"', 'class="series series-isolated"',
                   'id="bits-chart"', 'id="steps-chart"', 'id="hist-0"', 'class="hist-quant"'):
        assert needle in dom, needle
    assert dom.count('class="point"') == 8


# ------------------------------------------------------------------------------------------------ progress

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_quiet_when_not_a_terminal(monkeypatch, capsys) -> None:
    monkeypatch.delenv("QUANTOPT_PROGRESS", raising=False)
    out = io.StringIO()
    assert list(progress(range(5), "stats", stream=out)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""
    assert list(progress(iter(range(3)), "stats")) == [0, 1, 2]  # stderr under pytest capture is no terminal
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("backend", ["builtin", "tqdm"])
def test_progress_draws_on_a_terminal(monkeypatch, backend: str) -> None:
    if backend == "tqdm":
        pytest.importorskip("tqdm")
    monkeypatch.delenv("QUANTOPT_PROGRESS", raising=False)
    out = _Tty()
    assert list(progress(range(4), "similarity", stream=out, backend=backend, min_interval=0)) == [0, 1, 2, 3]
    text = out.getvalue()
    assert "similarity" in text and "4/4" in text and "it/s" in text


def test_progress_env_override(monkeypatch) -> None:
    monkeypatch.setenv("QUANTOPT_PROGRESS", "0")
    assert not progress_enabled(_Tty())
    monkeypatch.setenv("QUANTOPT_PROGRESS", "1")
    assert progress_enabled(io.StringIO())


def test_progress_line_rate_and_eta() -> None:
    p = Progress(range(10), "metric", enabled=False)
    assert len(p) == 10
    assert p.render_line(4, 2.0) == "metric:  40%|#########               | 4/10 [00:02<00:03, 2.00 it/s]"
    assert Progress(iter([]), "calib", enabled=False).render_line(3, 6.0) == "calib: 3 [00:06, 2.00 s/it]"
    assert format_duration(3725) == "1:02:05" and format_duration(float("nan")) == "--:--"
    with pytest.raises(TypeError):
        len(Progress(iter([]), "x", enabled=False))


def test_progress_stops_cleanly_on_break() -> None:
    out = _Tty()
    for i in progress(range(100), "x", stream=out, backend="builtin", enabled=True):
        if i == 2:
            break
    assert out.getvalue().endswith("\r")
