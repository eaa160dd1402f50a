"""End-to-end through the CLI: listing commands, the bundled example, and one-line errors with exit codes."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quantopt.cli import main
from quantopt.config.fields import FIELDS

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"


def example_cfg(tmp_path: Path, extra: str = "", **override: str) -> Path:
    """A copy of the example cfg in tmp_path with absolute paths, so outputs stay out of the repo."""
    values = {
        "graph": str(EXAMPLE / "model" / "digits.txt"),
        "bin": str(EXAMPLE / "model" / "digits.bin"),
        "model_name": "digits",
        "dataset": "NumpyDataset",
        "calibration_data": str(EXAMPLE / "data" / "calib.npy"),
        "calibration_batch_size": "16",
        "data": str(EXAMPLE / "data" / "val.npy"),
        "label": str(EXAMPLE / "data" / "val_label.npy"),
        "metric": "TopKMetric",
        "metric_batch_size": "64",
        "output_dir": str(tmp_path / "out"),
    }
    values.update(override)
    body = "[Common]\n" + "".join(f"{k} = {v}\n" for k, v in values.items() if v is not None) + extra
    path = tmp_path / "opt.cfg"
    path.write_text(body)
    return path


def test_version(capsys):
    assert main(["--version"]) == 0
    assert "quantopt 0." in capsys.readouterr().out


def test_field_lists_every_field(capsys):
    assert main(["--field"]) == 0
    out = capsys.readouterr().out
    for name in FIELDS:
        assert f"  {name}\n" in out


def test_plugin_lists_datasets_metrics_and_ops(capsys):
    assert main(["--plugin"]) == 0
    out = capsys.readouterr().out
    for word in ("datasets:", "NumpyDataset", "NumpyMultiInputDataset", "metrics:", "TopKMetric(K",
                 "CosDistanceMetric", "Convolution", "Softmax", "forward 1.0"):
        assert word in out


def test_nothing_to_do_is_an_error(capsys):
    assert main([]) == 2


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "quantopt {import,run,export}" in out
    for command in ("import MODEL.onnx", "run MODEL.txt", "export MODEL_o.txt"):
        assert command in out


@pytest.mark.parametrize("word, hint", [("improt", "did you mean 'import'?"), ("rnu", "did you mean 'run'?"),
                                        ("frobnicate", "(commands: import, run, export; or quantopt --cfg FILE)")])
def test_mistyped_command_is_named(capsys, word, hint):
    assert main([word, "x.onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"unknown command '{word}'" in err[0] and hint in err[0], err


def test_internal_error_hint_follows_debug(capsys, caplog):
    from quantopt.cli_support import guarded

    def bug() -> int:
        raise ZeroDivisionError("a bug")

    assert guarded(bug, debug=False) == 1
    assert "(rerun with --debug for a traceback)" in caplog.text
    caplog.clear()
    assert guarded(bug, debug=True) == 1
    assert "Traceback" in capsys.readouterr().err
    assert "(the traceback is above)" in caplog.text and "rerun with --debug" not in caplog.text


def test_cfg_with_byte_order_mark_is_read(tmp_path):
    from quantopt.config.reader import read_cfg

    path = example_cfg(tmp_path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    cfg = read_cfg(str(path))
    assert cfg.model_name == "digits" and cfg.metric_batch_size == 64


@pytest.mark.skipif(not (EXAMPLE / "model" / "digits.txt").is_file(), reason="example not generated")
def _metric_line(err: str, name: str = "TopKMetric") -> tuple:
    line = err.split(f"metric {name}: ")[1].splitlines()[0]
    parts = dict(p.strip().split(" ", 1) for p in line.split(","))
    return float(parts["float"]), float(parts["quantized"]), float(parts["drop"])


@pytest.mark.parametrize("modes", [{}, {"quantize_method_for_weight": "per_channel_symmetric_restricted_range",
                                        "quantize_method_for_activation": "per_tensor_asymmetric"}])
def test_example_quantizes_within_one_point_of_float(tmp_path, capsys, modes):
    cfg = example_cfg(tmp_path, **modes)
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    err = capsys.readouterr().err
    float_top1, quant_top1, drop = _metric_line(err)
    assert float_top1 >= 0.95
    assert float_top1 - quant_top1 <= 0.01 and abs(drop - (float_top1 - quant_top1)) < 1e-6
    out = tmp_path / "out"
    for name in ("digits_o.txt", "digits_o.bin", "digits_opt_template.json", "digits_opt.log", "digits_report.json",
                 "digits_report.html"):
        assert (out / name).is_file(), name
    assert "zero-input forward check done" in (out / "digits_opt.log").read_text()


def test_console_script_from_other_folder(tmp_path):
    exe = shutil.which("quantopt")
    if exe is None:
        pytest.skip("quantopt console script not installed")
    out = subprocess.run([exe, "--plugin"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "NumpyDataset" in out.stdout


def _one_line_error(capsys, code, argv, phrase):
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("[ERROR]")]
    assert len(errors) == 1, err
    assert phrase in errors[0]
    assert "Traceback" not in "\n".join(err)


def test_missing_cfg_exit_2(capsys, tmp_path):
    _one_line_error(capsys, 2, ["--cfg", str(tmp_path / "none.cfg")], "cfg file not found")


def test_bad_ir_exit_3(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("model_name=m\n\nlayer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\n"
                   "layer_top=[x]\nlayer_top_shape=[[1,2]]\nlayer_top_type=[float99]\n")
    (tmp_path / "bad.bin").write_bytes(b"")
    cfg = tmp_path / "c.cfg"
    cfg.write_text(f"[Common]\ngraph = {bad}\noutput_dir = {tmp_path / 'o'}\n")
    _one_line_error(capsys, 3, ["--cfg", str(cfg)], f"{bad}:9")
    assert not (tmp_path / "o").exists()


def test_unknown_layer_type_exit_6_names_layer(capsys, tmp_path):
    txt = tmp_path / "u.txt"
    txt.write_text("model_name=m\ninput_tensors=[x]\noutput_tensors=[y]\n\n"
                   "layer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\nlayer_top=[x]\n"
                   "layer_top_shape=[[1,2]]\nlayer_top_type=[float32]\n\n"
                   "layer_id=1\nlayer_name=mystery\nlayer_type=FancyNewOp\nlayer_bottom=[x]\nlayer_top=[y]\n"
                   "layer_top_shape=[[1,2]]\nlayer_top_type=[float32]\n")
    (tmp_path / "u.bin").write_bytes(b"")
    cfg = tmp_path / "c.cfg"
    cfg.write_text(f"[Common]\ngraph = {txt}\noutput_dir = {tmp_path / 'o'}\n")
    _one_line_error(capsys, 6, ["--cfg", str(cfg)], "FancyNewOp (layer 'mystery')")


@pytest.mark.skipif(not (EXAMPLE / "model" / "digits.txt").is_file(), reason="example not generated")
def test_nan_data_exit_4(capsys, tmp_path):
    val = np.load(EXAMPLE / "data" / "val.npy")[:8].copy()
    val[5, 0, 3, 3] = np.nan
    np.save(tmp_path / "nan.npy", val)
    np.save(tmp_path / "lab.npy", np.zeros(8, dtype=np.int64))
    cfg = example_cfg(tmp_path, data=str(tmp_path / "nan.npy"), label=str(tmp_path / "lab.npy"), metric_batch_size="4")
    _one_line_error(capsys, 4, ["--cfg", str(cfg)], "nan.npy")


@pytest.mark.skipif(not (EXAMPLE / "model" / "digits.txt").is_file(), reason="example not generated")
def test_wrong_input_shape_exit_4(capsys, tmp_path):
    np.save(tmp_path / "wrong.npy", np.zeros((4, 1, 9, 9), dtype=np.float32))
    cfg = example_cfg(tmp_path, calibration_data=str(tmp_path / "wrong.npy"), data=None, label=None, metric=None)
    _one_line_error(capsys, 4, ["--cfg", str(cfg)], "samples have shape [1, 9, 9]")


def test_unknown_dataset_plugin_exit_5(capsys, tmp_path):
    np.save(tmp_path / "d.npy", np.zeros((2, 1, 8, 8), dtype=np.float32))
    if not (EXAMPLE / "model" / "digits.txt").is_file():
        pytest.skip("example not generated")
    cfg = example_cfg(tmp_path, dataset="NoSuchDataset", calibration_data=str(tmp_path / "d.npy"), data=None,
                      label=None, metric=None)
    _one_line_error(capsys, 5, ["--cfg", str(cfg)], "no dataset plugin named 'NoSuchDataset'")


def test_module_entry_point_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "quantopt.cli", "--version"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("quantopt ")


def test_statistic_file_round_trip_and_dump_through_the_cli(tmp_path):
    """save_statistic_info then statistic_file reproduces the IR byte for byte without a statistics pass;
    dump writes the per-layer tensors with an index."""
    first = tmp_path / "a"
    first.mkdir()
    cfg = example_cfg(first, "save_statistic_info = true\ndump = true\n" f"dump_dir = {first / 'dump'}\n",
                      data=None, label=None, metric=None)
    assert main(["--cfg", str(cfg)]) == 0
    stats = first / "out" / "digits_statistic_info.npz"
    assert stats.is_file() and (first / "dump" / "index.json").is_file()
    second = tmp_path / "b"
    second.mkdir()
    cfg2 = example_cfg(second, f"statistic_file = {stats}\n", data=None, label=None, metric=None,
                       calibration_data=None)
    assert main(["--cfg", str(cfg2)]) == 0
    for name in ("digits_o.txt", "digits_o.bin"):
        assert (first / "out" / name).read_bytes() == (second / "out" / name).read_bytes(), name


def test_global_calibration_runs_through_the_cli(tmp_path, capsys):
    cfg = example_cfg(tmp_path, "global_calibration = bias_correction[2] & easy_quant[1,1]\n", metric=None,
                      data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    log = (tmp_path / "out" / "digits_opt.log").read_text()
    assert "bias_correction" in log and "easy_quant" in log
    bad = example_cfg(tmp_path, "global_calibration = smooth_quant_zy[0.5,0,0,1,10,1]\n", metric=None, data=None,
                      label=None)
    assert main(["--cfg", str(bad)]) == 2
    assert "not implemented yet" in capsys.readouterr().err


def test_summary_block_lists_quantized_inputs_and_outputs(tmp_path, capsys):
    cfg = example_cfg(tmp_path, eval_original_model="false")
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    err = capsys.readouterr().err
    summary = err[err.index("quantopt report"):]
    assert "input  input_0: uint8, scale 255.0, zp 0, range [0, 255]" in summary
    assert "output /Softmax_0: uint8, scale " in summary
    report = json.loads((tmp_path / "out" / "digits_report.json").read_text())
    roles = [(io["role"], io["name"], io["dtype"]) for io in report["quantized_io"]]
    assert roles == [("input", "input_0", "uint8"), ("output", "/Softmax_0", "uint8")]


def test_preset_accurate_end_to_end(tmp_path, caplog):
    """The example quantizes with the preset; the log names the fields it set and the template shows them."""
    cfg = example_cfg(tmp_path, extra="preset = accurate\nunify_shifts_for_aiff = true\n")
    logger = logging.getLogger("quantopt")  # the console set-up turns propagation off: attach the capture directly
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="quantopt"):
            assert main(["--cfg", str(cfg)]) == 0
    finally:
        logger.removeHandler(caplog.handler)
    err = caplog.text
    assert "preset accurate: quantize_method_for_weight = per_channel_symmetric_restricted_range, " \
           "calibration_strategy_for_activation = quantile[99.99]" in err
    assert "unify_shifts_for_aiff = false" not in err  # written in the cfg: the cfg wins
    template = json.loads((tmp_path / "out" / "digits_opt_template.json").read_text())
    conv = template["/conv1/Conv"]
    assert conv["q_mode_weight"] == "per_channel_symmetric_restricted_range"
    assert conv["q_strategy_activation"] == "quantile[99.99]" and conv["unify_shifts_for_aiff"] is True
    assert _metric_line(err)[1] > 0.9
