"""Batches that are not whole IR batches (graph/batch_fit.py): a graph of IR batch 2 whose Reshape holds the whole
batch cannot run 1 or 3 samples; a short last batch keeps its whole IR batches (labels cut alike) and the rest is
left out with one warning; a batch size that is not a multiple is a config error naming the field; a graph whose
layers take any rows runs every batch as it is."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantopt.cli import main
from quantopt.graph.batch_fit import Fit, cut_label
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.ir.writer import write_ir


def _folding(batch: int = 2) -> PyGraph:
    """x [batch, 4] -> Reshape [batch·4] (dim 0 no longer the batch) -> Relu -> Reshape [batch, 4]."""
    g = GraphBuilder("folding")
    x = g.input("x", [batch, 4])
    flat = g.layer("Reshape", [x], [[batch * 4]], name="flat", params=dict(shape=[batch * 4]))
    act = g.layer("Activation", [flat], [[batch * 4]], name="relu", params=dict(method="RELU"))
    y = g.layer("Reshape", [act], [[batch, 4]], name="back", params=dict(shape=[batch, 4]))
    return g.build([y])


def _dense(batch: int = 2) -> PyGraph:
    """x [batch, 4] -> FullyConnected [batch, 3]: every layer takes any rows."""
    g = GraphBuilder("dense")
    x = g.input("x", [batch, 4])
    w = np.random.default_rng(0).normal(0, 0.5, (3, 4)).astype(np.float32)
    y = g.layer("FullyConnected", [x], [[batch, 3]], name="fc", params=dict(num_output=3, with_activation="NONE"),
                constants={"weights": w, "biases": np.zeros(3, np.float32)})
    return g.build([y])


def test_refusal_names_the_layer_and_is_found_once() -> None:
    fit = Fit(_folding())
    assert fit.refusal(2) is None and fit.refusal(4) is None  # whole IR batches: no forward needed
    why = fit.refusal(3)
    assert why is not None and "layer 'flat' (Reshape)" in why
    assert fit.refusal(1) is not None
    assert len(fit._runs) == 2


def test_any_rows_run_where_every_layer_takes_them() -> None:
    fit = Fit(_dense())
    x = torch.ones(3, 4)
    assert fit.refusal(3) is None and fit.refusal(1) is None
    inputs, label = fit.cut([x], torch.arange(3))
    assert inputs[0] is x and torch.equal(label, torch.arange(3)) and fit.dropped == 0


def test_a_short_batch_keeps_its_whole_ir_batches() -> None:
    fit = Fit(_folding())
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    inputs, label = fit.cut([x], [torch.arange(3), ["a", "b", "c"]])
    assert torch.equal(inputs[0], x[:2]) and torch.equal(label[0], torch.arange(2)) and label[1] == ["a", "b"]
    assert fit.dropped == 1 and "layer 'flat'" in fit.reason
    assert fit.cut([x[:1]]) is None and fit.dropped == 2


def test_an_inactive_fit_cuts_nothing() -> None:
    """Samples along another axis than dim 0 (data_batch_dim > 0, without_batch_dim): never cut."""
    fit = Fit(_folding(), active=False)
    x = torch.ones(3, 4)
    assert fit.ir_batch == 1 and fit.refusal(3) is None and fit.cut([x])[0][0] is x


def test_cut_label_along_an_axis_and_in_containers() -> None:
    label = {"t": torch.zeros(5, 3, 2), "plain": ["a", "b", "c"], "one": 7.0, "nested": (torch.zeros(3),)}
    cut = cut_label(label, 3, 2, axis=1)
    assert cut["t"].shape == (5, 2, 2) and cut["plain"] == ["a", "b"] and cut["one"] == 7.0
    assert cut["nested"][0].shape == (3,)  # one entry along axis 1 is not the samples' axis: left whole
    assert cut_label(torch.zeros(3, 4), 3, 2).shape == (2, 4)
    assert cut_label(torch.tensor(-float("inf")), 3, 2).dim() == 0


def _cfg(tmp_path: Path, graph: PyGraph, samples: int, batch: int, metric: bool = True) -> Path:
    write_ir(graph, str(tmp_path / "m.txt"), str(tmp_path / "m.bin"))
    x = np.random.default_rng(1).normal(0, 1, (samples, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "label.npy", np.maximum(x, 0))
    text = (f"[Common]\ngraph = {tmp_path / 'm.txt'}\nbin = {tmp_path / 'm.bin'}\ndataset = NumpyDataset\n"
            f"calibration_data = {tmp_path / 'x.npy'}\ncalibration_batch_size = {batch}\n"
            f"output_dir = {tmp_path / 'out'}\n")
    if metric:
        text += (f"data = {tmp_path / 'x.npy'}\nlabel = {tmp_path / 'label.npy'}\nmetric = CosDistanceMetric\n"
                 f"metric_batch_size = {batch}\n")
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(text)
    return cfg


def test_cli_leaves_out_the_short_last_batch_with_one_warning(tmp_path: Path, capsys) -> None:
    assert main(["--log-level", "info", "--cfg", str(_cfg(tmp_path, _folding(), 5, 2))]) == 0
    err = capsys.readouterr().err
    assert err.count("1 sample(s) of the last batch are left out") == 2  # calibration data and validation data
    assert "statistics collected over 2 calibration batch(es)" in err
    assert "float metric: " in err and "quantized metric: " in err


@pytest.mark.parametrize("field", ["calibration_batch_size", "metric_batch_size"])
def test_cli_refuses_a_batch_size_that_is_not_a_multiple(tmp_path: Path, capsys, field: str) -> None:
    cfg = _cfg(tmp_path, _folding(), 6, 2)
    text = cfg.read_text().replace(f"{field} = 2", f"{field} = 3")
    cfg.write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith(field))
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"opt.cfg:{line}: field '{field}': 3 is not a multiple of the IR's batch 2" in err
    assert "layer 'flat' (Reshape)" in err and not (tmp_path / "out" / "folding_o.txt").exists()


def test_cli_default_batch_sizes_follow_the_ir_batch_the_model_needs(tmp_path: Path, capsys) -> None:
    """Left at their default (1), calibration_batch_size and metric_batch_size become the IR's batch where a layer
    needs whole IR batches, said once each; the run gives what batch 2 set in the cfg gives."""
    cfg = _cfg(tmp_path, _folding(), 5, 2)
    set_text = cfg.read_text()
    cfg.write_text(set_text.replace("calibration_batch_size = 2\n", "").replace("metric_batch_size = 2\n", ""))
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    err = capsys.readouterr().err
    for field in ("calibration_batch_size", "metric_batch_size"):
        assert err.count(f"{field} = 2: the default 1 is not a whole IR batch of 2, which the model needs "
                         "(layer 'flat' (Reshape)") == 1, err
    assert err.count("1 sample(s) of the last batch are left out") == 2 and "quantized metric: " in err
    defaulted = (tmp_path / "out" / "folding_o.bin").read_bytes()
    cfg.write_text(set_text.replace(str(tmp_path / "out"), str(tmp_path / "set")))
    assert main(["--cfg", str(cfg)]) == 0
    assert (tmp_path / "set" / "folding_o.bin").read_bytes() == defaulted


def test_cli_default_batch_size_stays_where_the_model_runs_it(tmp_path: Path, capsys) -> None:
    cfg = _cfg(tmp_path, _dense(), 4, 2, metric=False)
    cfg.write_text(cfg.read_text().replace("calibration_batch_size = 2\n", ""))
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "the default 1" not in err and "statistics collected over 4 calibration batch(es)" in err


def test_cli_refuses_data_without_one_whole_ir_batch(tmp_path: Path, capsys) -> None:
    assert main(["--log-level", "info", "--cfg", str(_cfg(tmp_path, _folding(), 1, 2, metric=False))]) == 4
    assert "no batch of the data holds a whole IR batch of 2 samples" in capsys.readouterr().err


def test_cli_runs_short_batches_where_the_model_can(tmp_path: Path, capsys) -> None:
    assert main(["--log-level", "info", "--cfg", str(_cfg(tmp_path, _dense(), 5, 1, metric=False))]) == 0
    err = capsys.readouterr().err
    assert "left out" not in err and "statistics collected over 5 calibration batch(es)" in err
