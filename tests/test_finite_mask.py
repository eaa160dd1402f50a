"""Attention masks of finite values (calibration/finite_mask.py, docs/statistics-and-dump.md "Masks with finite
values"): which chains are found, and that their mask positions leave the statistics, saturate and get probability 0,
as the infinite masks of tests/test_inf_mask.py do, while the float graph keeps adding the finite values."""
from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional

import mask_models
import numpy as np
import pytest
import torch

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.analysis.similarity import layer_similarity
from quantopt.calibration.finite_mask import FINITE_MASK_MIN, finite_mask_thresholds
from quantopt.calibration.inf_mask import SOFTMAX_MASK_PARAM, is_mask_tensor
from quantopt.calibration.statistic_file import load_statistics, save_statistics
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.compare import cosine

HEADS, WINDOWS = 2, 3
SEQ = mask_models.SEQ
ON = {"detect_finite_masks": True}


def window_mask(fill: float) -> np.ndarray:
    """A shifted-window mask as Swin makes it: 0 within a region, `fill` across regions, per window."""
    regions = np.array([[0] * 5 + [1] * 3, [0] * 3 + [1] * 5, [0] * 8])
    mask = np.zeros((1, WINDOWS, 1, SEQ, SEQ), np.float32)
    for w in range(WINDOWS):
        r = regions[w]
        mask[0, w, 0] = np.where(r[:, None] != r[None, :], fill, 0.0)
    return mask


def swin_like(fill: float, softmax_input: str = "Reshape", values: Optional[np.ndarray] = None) -> PyGraph:
    """scores [1, windows, heads, 8, 8] + a Constant mask [1, windows, 1, 8, 8] -> Reshape -> Softmax (or the Add
    straight into Softmax, or into a Sigmoid: no Softmax)."""
    g = GraphBuilder("swin_like")
    scores = g.input("scores", [1, WINDOWS, HEADS, SEQ, SEQ])
    mask_values = window_mask(fill) if values is None else values
    mask = g.layer("Constant", [], [list(mask_values.shape)], name="mask", constants={"weights": mask_values})
    add = g.layer("Add", [scores, mask], [[1, WINDOWS, HEADS, SEQ, SEQ]], name="add",
                  params={"with_activation": "NONE"})
    if softmax_input == "Reshape":
        flat = g.layer("Reshape", [add], [[WINDOWS, HEADS, SEQ, SEQ]], name="flat",
                       params={"shape": [WINDOWS, HEADS, SEQ, SEQ]})
        out = g.layer("Softmax", [flat], [[WINDOWS, HEADS, SEQ, SEQ]], name="softmax", params={"axis": -1})
    elif softmax_input == "Add":
        out = g.layer("Softmax", [add], [[1, WINDOWS, HEADS, SEQ, SEQ]], name="softmax", params={"axis": -1})
    else:
        out = g.layer("Sigmoid", [add], [[1, WINDOWS, HEADS, SEQ, SEQ]], name="softmax")
    return g.build([out])


def score_feeds(n: int, seed: int, spread: float = 2.0) -> List[List[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [[torch.from_numpy(rng.normal(0, spread, (1, WINDOWS, HEADS, SEQ, SEQ)).astype(np.float32))]
            for _ in range(n)]


def padding_mask_model(fill: float, form: str, subtract: str = "") -> PyGraph:
    """mask_models.padding_mask_model with this file's heads (Where, Mul or BatchNorm forms of a padding mask, added
    or subtracted)."""
    return mask_models.padding_mask_model(fill, form, HEADS, subtract)


def padding_feeds(n: int, seed: int) -> List[List[torch.Tensor]]:
    return mask_models.padding_feeds(n, seed, HEADS)


def _node(graph: PyGraph, name: str):
    return next(n for n in graph.nodes if n.name == name)


# ------------------------------------------------------------------------------------------------ detection
def test_chains_found_and_their_thresholds() -> None:
    assert finite_mask_thresholds(swin_like(-100.0)) == {"mask": 50.0, "add": 50.0, "flat": 50.0}
    assert finite_mask_thresholds(swin_like(-1e4, softmax_input="Add")) == {"mask": 5e3, "add": 5e3}
    assert finite_mask_thresholds(padding_mask_model(-1e9, "Where")) == {"zero": 5e8, "neg": 5e8, "mask": 5e8,
                                                                         "add": 5e8}
    assert finite_mask_thresholds(padding_mask_model(-1e4, "Mul")) == {"neg": 5e3, "mask": 5e3, "add": 5e3}
    assert finite_mask_thresholds(padding_mask_model(-1e4, "BatchNorm")) == {"mask": 5e3, "add": 5e3}
    # subtracted from the scores: the signs turned (Funnel's `scores - 1e6 * (1 - keep)`)
    assert finite_mask_thresholds(padding_mask_model(1e6, "Mul", subtract="Sub")) == {"neg": 5e5, "mask": 5e5,
                                                                                      "add": 5e5}
    assert finite_mask_thresholds(padding_mask_model(1e4, "BatchNorm", subtract="Eltwise")) == {"mask": 5e3,
                                                                                                 "add": 5e3}
    assert finite_mask_thresholds(padding_mask_model(-1e6, "Mul", subtract="Sub")) == {}  # subtracting -1e6 adds
    # several mask values: half of the one nearest zero
    two = window_mask(-100.0)
    two[two == -100.0] = -300.0
    two[0, 0, 0, 0, 7] = -FINITE_MASK_MIN
    assert finite_mask_thresholds(swin_like(0.0, values=two))["add"] == FINITE_MASK_MIN / 2


@pytest.mark.parametrize("case", ["bias", "alibi", "no_zero", "positive", "no_softmax", "where_two_fills",
                                  "mul_small", "batchnorm_not_cancelling"])
def test_not_a_finite_mask(case: str) -> None:
    """Biases, slopes and anything not reaching a Softmax stay data."""
    if case == "bias":  # a relative-position bias of small values: shifts scores, masks nothing
        graph = swin_like(-10.0)
    elif case == "alibi":  # distances times a slope: many values, some near zero
        d = np.abs(np.arange(SEQ)[:, None] - np.arange(SEQ)[None, :]).astype(np.float32)
        graph = swin_like(0.0, values=np.broadcast_to(-20.0 * d, (1, WINDOWS, 1, SEQ, SEQ)).copy())
    elif case == "no_zero":
        graph = swin_like(0.0, values=np.full((1, WINDOWS, 1, SEQ, SEQ), -100.0, np.float32))
    elif case == "positive":
        graph = swin_like(100.0)
    elif case == "no_softmax":
        graph = swin_like(-100.0, softmax_input="Sigmoid")
    elif case == "where_two_fills":
        graph = padding_mask_model(-1e9, "Where")
        _node(graph, "zero").constants["weights"].betensor = torch.full((1, 1, 1, SEQ), -5.0)
    elif case == "mul_small":  # a scaled keep flag of -10: a bias of the kept positions, not a mask
        graph = padding_mask_model(-10.0, "Mul")
    else:  # keep * w + b with w + b != 0: the kept positions are shifted, so this is no mask
        graph = padding_mask_model(-1e4, "BatchNorm")
        _node(graph, "mask").constants["weights"].betensor += 1.0
    assert finite_mask_thresholds(graph) == {}
    quantize_model(graph, score_feeds(2, 0) if case not in ("where_two_fills", "mul_small", "batchnorm_not_cancelling")
                   else padding_feeds(2, 0), settings=ON)
    assert not any(is_mask_tensor(graph.statistics.get(t)) for n in graph.nodes for t in n.outputs)


# ------------------------------------------------------------------------------------------------ quantization
def test_window_mask_keeps_the_scores_range_and_zeroes_masked_positions() -> None:
    graph = swin_like(-100.0)
    q = quantize_model(graph, score_feeds(6, 0), settings=ON)
    for name in ("mask", "add", "flat"):
        st = graph.statistics.get(_node(graph, name).outputs[0])
        assert is_mask_tensor(st) and float(st.inf_mask_threshold) == 50.0
    add = _node(graph, "add").outputs[0]
    assert float(graph.statistics.get(add).extrema_min) > -15.0, "the -100 positions are left out"
    mask = _node(q, "mask")
    assert not q.quant.get(mask.outputs[0]).qinvariant, "0/-100 are integers, but this constant is a mask"
    assert _node(q, "softmax").params[SOFTMAX_MASK_PARAM] is True
    masked = torch.from_numpy(window_mask(-100.0) != 0).expand(1, WINDOWS, HEADS, SEQ, SEQ).reshape(
        WINDOWS, HEADS, SEQ, SEQ)
    for batch in score_feeds(4, 1):
        with torch.no_grad():
            want = graph.forward(batch)[0]
        got = run_quantized(q, batch)[0]
        assert float(got[masked].abs().max()) == 0.0
        assert float(want[masked].abs().max()) < 1e-30, "the float graph still adds -100"
        assert cosine(got, want) > 0.999


@pytest.mark.parametrize("settings", [{}, dict(ON, upstream_defects=frozenset({"mask_as_data"}))])
def test_finite_mask_is_more_accurate_than_taking_it_as_data(settings: dict) -> None:
    """Without detect_finite_masks (the default, upstream's way), or with mask_as_data, the -100 sets the Add's
    range: the scores get about 5x coarser codes, and the advice names the Add."""
    from quantopt.analysis.advisor import advise

    feeds = score_feeds(6, 0)
    ours = quantize_model(swin_like(-100.0), feeds, settings=ON)
    plain = swin_like(-100.0)
    theirs = quantize_model(plain, feeds, settings=settings)
    assert not any(is_mask_tensor(plain.statistics.get(t)) for n in plain.nodes for t in n.outputs)
    advice = [a for a in advise(plain, theirs) if a.field == "detect_finite_masks = true"]
    assert [a.layer for a in advice] == ([] if settings else ["add"])
    scale_ours = ours.quant.get(_node(ours, "add").outputs[0]).scale
    scale_theirs = theirs.quant.get(_node(theirs, "add").outputs[0]).scale
    assert scale_ours > 4 * scale_theirs
    graph = swin_like(-100.0)
    errors = []
    for q in (ours, theirs):
        err = 0.0
        for batch in score_feeds(4, 2):
            with torch.no_grad():
                want = graph.forward(batch)[0]
            err += float((run_quantized(q, batch)[0] - want).abs().mean())
        errors.append(err)
    assert errors[0] < 0.5 * errors[1], errors


@pytest.mark.parametrize("form,fill,subtract", [("Where", -1e9, ""), ("Where", -1e4, ""), ("Mul", -1e4, ""),
                                                ("Mul", -100.0, ""), ("BatchNorm", -1e4, ""), ("BatchNorm", -1e9, ""),
                                                ("Mul", 1e6, "Sub"), ("Where", 1e9, "Eltwise"),
                                                ("BatchNorm", 1e4, "Sub")])
def test_padding_masks_of_finite_values(form: str, fill: float, subtract: str) -> None:
    """Added (a negative fill) or subtracted (a positive one: Funnel's form) padding masks."""
    graph = padding_mask_model(fill, form, subtract=subtract)
    q = quantize_model(graph, padding_feeds(8, 0), settings=ON)
    assert _node(q, "softmax").params[SOFTMAX_MASK_PARAM] is True
    assert q.quant.get(_node(q, "add").outputs[0]).scale > 5.0
    for batch in padding_feeds(5, 3):
        keep = batch[1].reshape(-1) > 0
        with torch.no_grad():
            want = graph.forward(batch)[0]
        got = run_quantized(q, batch)[0]
        if bool((~keep).any()):
            assert float(got[..., ~keep].abs().max()) == 0.0
        assert cosine(got, want) > 0.99


def test_similarity_leaves_finite_mask_positions_out() -> None:
    graph = swin_like(-100.0)
    q = quantize_model(graph, score_feeds(6, 0), settings=ON)
    sims = {s.name: s for s in layer_similarity(graph, q, score_feeds(2, 3))}
    add = sims["add"]
    assert math.isfinite(add.cumulative_mse) and add.cumulative_mse < 0.05 and add.isolated_cos > 0.999
    assert "mask position" in add.note


def test_statistic_file_keeps_the_threshold(tmp_path: Path) -> None:
    graph = swin_like(-100.0)
    quantize_model(graph, score_feeds(3, 0), settings=ON)
    path = save_statistics(graph, str(tmp_path / "stats.npz"))
    again = swin_like(-100.0)
    load_statistics(again, path)
    st = again.statistics.get(_node(again, "add").outputs[0])
    assert float(st.inf_mask_threshold) == 50.0 and is_mask_tensor(st)


def test_scores_beyond_the_threshold_are_named(caplog: pytest.LogCaptureFixture) -> None:
    """Scores of at least half the mask value are not told from mask values: a warning names the layer."""
    with caplog.at_level("WARNING", logger="quantopt"):
        quantize_model(swin_like(-100.0), score_feeds(2, 0, spread=30.0), settings=ON)
    assert any("'add'" in r.getMessage() and "left out of the statistics" in r.getMessage() for r in caplog.records)


def test_export_is_exact() -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from quantopt.exporters.agreement import measure_agreement

    q = quantize_model(swin_like(-100.0), score_feeds(6, 0), settings=ON)
    agreement = measure_agreement(q, [torch.cat([b[0] for b in score_feeds(2, 4)]).numpy()])
    assert agreement.identical == 1.0, agreement


@pytest.mark.parametrize("field", [False, True])
def test_cli_run_with_and_without_the_field(field: bool, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Through `quantopt --cfg`: without the field the advice names the Add and the IR's Softmax has no mask rule;
    with it the log names the mask layers and the written Softmax saturates its masked inputs."""
    from quantopt.cli import main
    from quantopt.ir.reader import read_ir
    from quantopt.ir.writer import write_ir

    write_ir(swin_like(-100.0), str(tmp_path / "m.txt"))
    np.save(tmp_path / "calib.npy", np.concatenate([b[0].numpy() for b in score_feeds(4, 0)]))
    (tmp_path / "opt.cfg").write_text(
        "[Common]\ngraph = m.txt\nbin = m.bin\nmodel_name = m\ndataset = numpydataset\n"
        f"calibration_data = calib.npy\ncalibration_batch_size = 1\noutput_dir = out\n"
        f"detect_finite_masks = {str(field).lower()}\n")
    assert main(["--cfg", str(tmp_path / "opt.cfg")]) == 0
    err = capsys.readouterr().err
    written = read_ir(str(tmp_path / "out" / "m_o.txt"))
    softmax = _node(written, "softmax")
    assert bool(softmax.params.get(SOFTMAX_MASK_PARAM, False)) is field
    assert ("inf mask detected" in err) is field
    assert ("fix: detect_finite_masks = true" in err) is not field
