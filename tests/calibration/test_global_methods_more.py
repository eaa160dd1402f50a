"""Global calibration methods adaquant_zy, svd_quant, smooth_quant_zy, awq_zy, gptq_zy and mvn_correction: their
parameters, each lowering the error it targets on a small seeded model, float constants restorable, settings
promotion honoured by quantization, determinism, progress bars, and every method on a shared model."""
from __future__ import annotations

import logging
import re
from typing import Dict, List

import numpy as np
import pytest
import torch
from conftest import shared_model_dir
from global_helpers import RecordedLog
from quant_helpers import params_of

from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.log import LOGGER
from quantopt.pipeline import run_quantized
from quantopt.quantizer import quantize_graph
from quantopt.tuning.global_methods import (
    apply_global_calibration,
    calibrate_globally,
    parse_global_calibration,
    reconstruction_errors,
)

PER_TENSOR = "per_tensor_symmetric_restricted_range"
PER_CHANNEL = "per_channel_symmetric_restricted_range"


def _run(g, spec: str, batches) -> tuple:
    """apply_global_calibration with its log captured: (report, log lines)."""
    handler = RecordedLog()
    LOGGER.addHandler(handler)
    level = LOGGER.level
    LOGGER.setLevel(logging.DEBUG)
    try:
        report = apply_global_calibration(g, spec, batches)
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
    return report, handler.lines


def _calibrate(g, batches, **settings):
    s = LayerSettings(**settings)
    for n in g.nodes:
        n.settings = s
    collect_weight_statistics(g)
    collect_activation_statistics(g, [[b] for b in batches])
    calibrate_graph(g)
    return g


def _constants(g) -> Dict[tuple, torch.Tensor]:
    return {(n.name, k): t.betensor.clone() for n in g.nodes for k, t in n.constants.items()}


# ------------------------------------------------------------------------------------------------ parameters
def test_new_methods_parse_with_upstream_defaults() -> None:
    (a,) = parse_global_calibration("adaquant_zy[2,3,4]")
    assert a.params == (2, 3, 4, 1e-5, 1e-3, 1e-3, 0.1)
    assert (a.param("lr_weight"), a.param("lr_quant_param_activation")) == (1e-5, 0.1)  # declared order
    (g,) = parse_global_calibration("gptq_zy")
    assert g.params == (1, 1, 0.01, 128) and g.param("use_act_order") is True
    assert parse_global_calibration("gptq_zy[1,0]")[0].param("use_act_order") is False
    (s,) = parse_global_calibration("svd_quant[3]")
    assert s.params == (3, 0.5, 2.0, 10, 0.09) and isinstance(s.param("nsteps"), int)
    assert parse_global_calibration("smooth_quant_zy")[0].params == (0.5, 0, 0, 1, 10, 0)
    assert parse_global_calibration("awq_zy[10]")[0].params == (10, 0.0, 0)
    (m,) = parse_global_calibration("mvn_correction[1,0.7,2]")
    assert m.param("alpha") == 0.7 and m.param("beta") == 2 and isinstance(m.param("beta"), int)
    assert m.param("multiplier_bits") is None  # follows act_bits
    assert parse_global_calibration("mvn_correction")[0].param("alpha") is None  # 0.5 for mode 0, 1.0 otherwise
    # easy_quant's beta stays a float while mvn_correction's is an integer
    assert parse_global_calibration("easy_quant[1,1,0.5,1.5]")[0].param("beta") == 1.5


@pytest.mark.parametrize("text, fragment", [
    ("smooth_quant_zy[0.5,0,0,1,10,1]", "insert_norm_if_none=1 (inserting an identity BatchNorm"),
    ("awq_zy[20,0,1]", "not implemented yet"),
    ("gptq_zy[1,2]", "use_act_order=2 must be 0 or 1"),
    ("gptq_zy[1,1,-1]", "perc_damp=-1 must be >= 0"),
    ("gptq_zy[1,1,0.01,0]", "block_size=0 must be >= 1"),
    ("svd_quant[0,2,1]", "needs 0 < alpha <= beta"),
    ("svd_quant[0,0.5,2,10,1]", "thresh=1 must be in [0, 1)"),
    ("svd_quant[1.5]", "mode=1.5 must be an integer"),
    ("awq_zy[20,1.5]", "max_shrink=1.5 must be in [0, 1]"),
    ("awq_zy[0]", "n_grid=0 must be >= 1"),
    ("smooth_quant_zy[1.5]", "0 <= default_alpha <= 1"),
    ("smooth_quant_zy[0.5,1,0.8,0.2]", "alpha_min <= alpha_max"),
    ("mvn_correction[1,1,0.5]", "beta=0.5 must be an integer"),
    ("mvn_correction[1,1,0,0,7]", "act_bits=7 must be in [8, 16]"),
    ("mvn_correction[1,1,0,0,16,16,48,10,20]", "multiplier_bits=20 must be in [2, 15]"),
    ("adaquant_zy[1,1,1,0,0,0,0]", "not all 0"),
    ("adaquant_zy[1,1,1,-1]", "learning rates must be >= 0"),
])
def test_invalid_parameters_are_one_line_config_errors(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_global_calibration(text)
    assert fragment in str(info.value) and "field 'global_calibration'" in str(info.value)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ MAC model
GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)


def _mac_model(seed: int = 0):
    """conv(RELU) -> depthwise conv(RELU) -> reshape -> FC, each weight tensor with one outlier."""
    r = np.random.default_rng(seed)
    g = GraphBuilder("mac")
    x = g.input("x", [1, 5, 5, 4])
    w1 = r.normal(0, 0.3, (8, 3, 3, 4)).astype(np.float32)
    w1[0, 1, 1, 0] = 2.5
    a = g.layer("Convolution", [x], [[1, 5, 5, 8]], name="conv", constants={
        "weights": w1, "biases": r.normal(0, 0.1, 8).astype(np.float32)},
        params=dict(num_output=8, with_activation="RELU", group=1, **GEO))
    w2 = r.normal(0, 0.3, (8, 3, 3, 1)).astype(np.float32)
    w2[3, 0, 0, 0] = -2.0
    b = g.layer("DepthwiseConv", [a], [[1, 5, 5, 8]], name="dw", constants={
        "weights": w2, "biases": r.normal(0, 0.1, 8).astype(np.float32)},
        params=dict(num_output=8, with_activation="RELU", group=8, **GEO))
    d = g.layer("Reshape", [b], [[1, 200]], name="flat", params=dict(shape=[1, 200]))
    w3 = r.normal(0, 0.1, (6, 200)).astype(np.float32)
    w3[2, 5] = 1.0
    e = g.layer("FullyConnected", [d], [[1, 6]], name="fc", params=dict(num_output=6, with_activation="NONE"),
                constants={"weights": w3, "biases": r.normal(0, 0.1, 6).astype(np.float32)})
    return g.build([e])


def _mac_data(n: int = 3, batch: int = 8) -> List[torch.Tensor]:
    r = np.random.default_rng(1)
    return [torch.from_numpy(r.normal(0.5, 1, (batch, 5, 5, 4)).astype(np.float32)) for _ in range(n)]


@pytest.mark.parametrize("spec, mode, bits", [
    ("gptq_zy[3]", PER_TENSOR, 4),
    ("gptq_zy[3,0,0.01,16]", PER_CHANNEL, 4),
    ("adaquant_zy[3,20,4,1e-3,1e-3,3e-3,1e-2]", PER_TENSOR, 4),
    ("adaquant_zy[3,20,4,1e-3,1e-3,3e-3,1e-2]", PER_CHANNEL, 4),
    ("svd_quant[0]", PER_TENSOR, 8),
    ("svd_quant[1]", PER_TENSOR, 8),
    ("svd_quant[3]", PER_TENSOR, 4),
])
def test_method_lowers_the_error_it_targets(spec: str, mode: str, bits: int) -> None:
    data = _mac_data()
    plain = _calibrate(_mac_model(), data, q_bits_weight=bits, q_mode_weight=mode)
    reference = plain.clone()
    before = reconstruction_errors(plain, reference, data)
    g = _calibrate(_mac_model(), data, q_bits_weight=bits, q_mode_weight=mode)
    report, lines = _run(g, spec, data)
    after = reconstruction_errors(g, reference, data)
    changed = report[str(parse_global_calibration(spec)[0])]
    assert changed, f"{spec}: nothing changed"
    # the model output (fc) error is what svd_quant aims at; the others lower the summed layer error clearly
    assert after["fc"] < before["fc"], (before, after)
    if not spec.startswith("svd_quant"):
        assert sum(after.values()) < 0.85 * sum(before.values()), (before, after)
    assert any(f"layer '{changed[0]}'" in line for line in lines)  # what changed is logged, per layer
    name = spec.split("[")[0]
    assert any(line.startswith(name) and "->" in line for line in lines)  # the method's own loss before/after
    q = quantize_graph(g)
    assert run_quantized(q, data[0])[0].shape == (8, 6)


def test_gptq_integers_are_what_quantization_writes() -> None:
    data = _mac_data()
    g = _calibrate(_mac_model(), data, q_bits_weight=4)
    plain = quantize_graph(_calibrate(_mac_model(), data, q_bits_weight=4))
    report = apply_global_calibration(g, "gptq_zy[3]", data, log_loss=False)
    assert report["gptq_zy[3]"] == ["conv", "dw", "fc"]
    q = quantize_graph(g)
    for name in report["gptq_zy[3]"]:
        w_q = q.node(name).constants["weights"].betensor
        assert not torch.equal(w_q, plain.node(name).constants["weights"].betensor)
        # the stored float weights sit exactly on the quantization grid
        w = g.node(name).constants["weights"].betensor
        qn = q.node(name)
        scale = torch.as_tensor(params_of(qn, qn.constants["weights"]).scale).reshape([-1] + [1] * (w.dim() - 1))
        assert torch.allclose(w * scale, w_q.float(), atol=1e-3)


def test_methods_are_deterministic() -> None:
    spec = "svd_quant[1] & adaquant_zy[2,2,8,1e-3,1e-3,1e-2,1e-2] & gptq_zy[2]"
    runs = []
    for _ in range(2):
        data = _mac_data()
        g = _calibrate(_mac_model(), data, q_bits_weight=4, q_mode_weight=PER_CHANNEL)
        apply_global_calibration(g, spec, data, log_loss=False)
        q = quantize_graph(g)
        ranges = [(g.ranges.get(t).min, g.ranges.get(t).max) for n in g.nodes for t in n.outputs]
        runs.append((_constants(g), ranges, run_quantized(q, data[0])[0]))
    assert runs[0][0].keys() == runs[1][0].keys()
    assert all(torch.equal(runs[0][0][k], runs[1][0][k]) for k in runs[0][0])
    assert runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2])


# ------------------------------------------------------------------------------------------------ Norm -> FC model
def _norm_model(norm: str = "LayerNorm", affine: bool = True, extra_reader: bool = False):
    """FC -> norm (a few outlier channels) -> Reshape -> two FCs (one with RELU), channels last."""
    r = np.random.default_rng(0)
    g = GraphBuilder("ln")
    x = g.input("x", [1, 6, 16])
    b0 = r.normal(0, 0.1, 16).astype(np.float32)
    if not affine:
        b0[3] = 40.0  # an outlier channel of the normalized output without gamma
    h = g.layer("FullyConnected", [x], [[1, 6, 16]], name="fc0", params=dict(num_output=16, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (16, 16)).astype(np.float32), "biases": b0})
    gamma = r.normal(1, 0.1, 16).astype(np.float32)
    gamma[[3, 11]] = [25.0, -18.0]
    beta = r.normal(0, 0.1, 16).astype(np.float32)
    params = {"BatchNorm": dict(axis=-1), "GroupNorm": dict(axis=-1, group=4, epsilon=1e-5),
              "InstanceNorm": dict(epsilon=1e-5)}.get(norm, dict(axis=[-1], epsilon=1e-5))
    n = g.layer(norm, [h], [[1, 6, 16]], name="norm", params=params,
                constants={"weights": gamma, "biases": beta} if affine else {})
    s = g.layer("Reshape", [n], [[1, 2, 3, 16]], name="shape", params=dict(shape=[1, 2, 3, 16]))
    a = g.layer("FullyConnected", [s], [[1, 2, 3, 12]], name="fc_a", params=dict(num_output=12, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.2, (12, 16)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 12).astype(np.float32)})
    b = g.layer("FullyConnected", [s], [[1, 2, 3, 8]], name="fc_b", params=dict(num_output=8, with_activation="RELU"),
                constants={"weights": r.normal(0, 0.2, (8, 16)).astype(np.float32)})
    outputs = [a, b]
    if extra_reader:
        outputs.append(g.layer("Eltwise", [n, h], [[1, 6, 16]], name="add", params=dict(method="ADD",
                                                                                          with_activation="NONE")))
    return g.build(outputs)


def _norm_data(n: int = 2, batch: int = 8) -> List[torch.Tensor]:
    r = np.random.default_rng(1)
    return [torch.from_numpy(r.normal(0, 1, (batch, 6, 16)).astype(np.float32)) for _ in range(n)]


@pytest.mark.parametrize("spec, norm, affine, limit", [
    ("smooth_quant_zy", "LayerNorm", True, 0.5),
    ("smooth_quant_zy[0.5,1,0,1,5]", "RMSNorm", True, 0.7),
    ("smooth_quant_zy", "GroupNorm", True, 0.75),
    ("smooth_quant_zy", "BatchNorm", True, 0.95),  # its output error is mostly its input's, times gamma
    ("awq_zy[10,0.3]", "LayerNorm", True, 0.5),
    ("awq_zy[10]", "LayerNorm", False, 0.8),
])
def test_smoothing_lowers_fc_error_keeps_float_model_and_restores(spec: str, norm: str, affine: bool,
                                                                   limit: float) -> None:
    data = _norm_data()
    exact = dict(layernorm_integer_form="exact")  # the norm's own rounding as small as quantopt makes it
    plain = _calibrate(_norm_model(norm, affine), data, **exact)
    reference = plain.clone()
    fcs = ["fc_a", "fc_b"]
    before = reconstruction_errors(plain, reference, data, fcs)
    g = _calibrate(_norm_model(norm, affine), data, **exact)
    original = _constants(g)
    report, lines = _run(g, spec, data)
    changed = report[str(parse_global_calibration(spec)[0])]
    assert set(changed) >= {"fc_a", "fc_b"}
    after = reconstruction_errors(g, reference, data, fcs)
    assert sum(after.values()) < limit * sum(before.values()), (before, after)
    assert any("norm 'norm' -> 'fc_a', 'fc_b'" in line and "mse" in line for line in lines)
    # the smoothing itself keeps the float model: the smoothed constants compute the same outputs
    x = data[0]
    for got, want in zip(g.forward([x]), reference.forward([x])):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    if affine:
        assert not torch.equal(g.node("norm").constants["weights"].betensor, original[("norm", "weights")])
    else:
        assert "weights" in g.node("norm").constants  # added to carry the smoothing
    q = quantize_graph(g)
    assert run_quantized(q, x)[0].shape == (8, 2, 3, 12)


def test_norm_with_other_readers_is_not_smoothed() -> None:
    data = _norm_data()
    g = _calibrate(_norm_model(extra_reader=True), data)
    original = _constants(g)
    report, lines = _run(g, "smooth_quant_zy & awq_zy", data)
    assert report == {"smooth_quant_zy": [], "awq_zy": []}
    assert any("norm 'norm' (LayerNorm) skipped: its output reaches layer 'add' (Eltwise)" in line for line in lines)
    assert all(torch.equal(v, original[k]) for k, v in _constants(g).items())


# ------------------------------------------------------------------------------------------------ mvn_correction
def _mvn_model():
    """FC (rare large outputs) -> LayerNorm -> FC."""
    r = np.random.default_rng(0)
    g = GraphBuilder("mvn")
    x = g.input("x", [1, 16])
    h = g.layer("FullyConnected", [x], [[1, 24]], name="fc0", params=dict(num_output=24, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (24, 16)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 24).astype(np.float32)})
    n = g.layer("LayerNorm", [h], [[1, 24]], name="norm", params=dict(axis=[-1], epsilon=1e-5),
                constants={"weights": r.normal(1, 0.1, 24).astype(np.float32),
                           "biases": r.normal(0, 0.1, 24).astype(np.float32)})
    y = g.layer("FullyConnected", [n], [[1, 8]], name="fc1", params=dict(num_output=8, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (8, 24)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 8).astype(np.float32)})
    return g.build([y])


def _mvn_data(n: int = 2, batch: int = 16) -> List[torch.Tensor]:
    r = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = r.normal(0, 1, (batch, 16)).astype(np.float32)
        x[i, 2] = 40.0  # one outlier sample per batch
        out.append(torch.from_numpy(x))
    return out


def test_mvn_correction_mode0_clips_the_ancestor_range() -> None:
    data = _mvn_data()
    plain = _calibrate(_mvn_model(), data)
    reference = plain.clone()
    names = ["norm", "fc1"]
    before = reconstruction_errors(plain, reference, data, names)
    g = _calibrate(_mvn_model(), data)
    fc0 = g.node("fc0").outputs[0]
    old = (g.ranges.get(fc0).min, g.ranges.get(fc0).max)
    report, lines = _run(g, "mvn_correction", data)
    assert report == {"mvn_correction": ["fc0"]}
    new = (g.ranges.get(fc0).min, g.ranges.get(fc0).max)
    assert -old[0] > -new[0] > 0 and new[1] == -new[0]  # a narrower symmetric range
    after = reconstruction_errors(g, reference, data, names)
    assert after["norm"] < before["norm"] and after["fc1"] < before["fc1"], (before, after)
    assert any("ancestor 'fc0' (FullyConnected)" in line and "norm output mse" in line for line in lines)


def test_mvn_correction_promotion_is_honoured_by_quantization() -> None:
    data = _mvn_data()
    exact = dict(layernorm_integer_form="exact")  # upstream's form keeps 2-4 significant bits of gain at 16 bits
    plain = _calibrate(_mvn_model(), data, **exact)
    reference = plain.clone()
    before = reconstruction_errors(plain, reference, data, ["norm", "fc1"])
    g = _calibrate(_mvn_model(), data, **exact)
    report, lines = _run(g, "mvn_correction[1,1,1]", data)  # beta=1: the model input is promoted too
    assert report == {"mvn_correction[1,1,1]": ["x", "fc0", "norm"]}
    assert any("3 layer(s) promoted to 16-bit activations" in line for line in lines)
    q = quantize_graph(g)
    for name in ("x", "fc0", "norm"):
        assert g.node(name).settings.q_bits_activation == 16
        out = params_of(q.node(name), q.node(name).outputs[0])
        assert out.qbits == 16 and out.qmax == 32767
    fc0 = q.node("fc0")
    assert params_of(fc0, fc0.constants["weights"]).qbits == 16 and params_of(fc0, fc0.constants["biases"]).qbits == 48
    fc1 = q.node("fc1")
    assert g.node("fc1").settings.q_bits_activation == 8 and params_of(fc1, fc1.outputs[0]).qbits == 8
    after = reconstruction_errors(g, reference, data, ["norm", "fc1"])
    assert after["norm"] < 0.01 * before["norm"] and after["fc1"] < 0.1 * before["fc1"]


# ------------------------------------------------------------------------------------------------ progress bars
def test_progress_bars_are_drawn_on_request(monkeypatch, capsys) -> None:
    data = _mac_data(1)
    g = _calibrate(_mac_model(), data, q_bits_weight=4)
    monkeypatch.setenv("QUANTOPT_PROGRESS", "1")
    apply_global_calibration(g, "gptq_zy & bias_correction", data, log_loss=False)
    err = _without_log_lines(capsys.readouterr().err)
    assert "gptq_zy" in err and "bias_correction" in err
    monkeypatch.setenv("QUANTOPT_PROGRESS", "0")
    apply_global_calibration(g, "gptq_zy", data, log_loss=False)
    assert "gptq_zy" not in _without_log_lines(capsys.readouterr().err)


def _without_log_lines(err: str) -> str:
    """stderr without log records (a console handler an earlier test set up may write them there too)."""
    return re.sub(r"^\[(DEBUG|INFO|WARNING|WARN|ERROR)\][^\n]*\n?", "", err, flags=re.M)


# ------------------------------------------------------------------------------------------------ shared model
def test_every_method_runs_on_the_smallest_shared_model() -> None:
    folder = shared_model_dir("syn_resnet")
    from quantopt.ir.reader import read_ir

    g = read_ir(str(folder / "syn_resnet.txt"))
    batches = [[torch.from_numpy(np.load(folder / "calib.npy"))[:2]]]
    for n in g.nodes:
        n.settings = LayerSettings()
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches)
    calibrate_graph(g)
    float_out = g.forward(batches[0])[0].clone()
    spec = ("smooth_quant_zy & awq_zy[4] & mvn_correction[1] & svd_quant[0,0.5,2,4] & svd_quant[2] & "
            "svd_quant[3,0.5,2,4] & easy_quant[1,1,0.5,2,4] & bias_correction & gptq_zy & adaquant_zy[1,1,2] & "
            "adaround[1,1,2]")
    original = _constants(g)
    result = calibrate_globally(g, spec, batches, log_loss=False)
    report = result.changed
    assert [s.split("[")[0] for s in report] == [s.name for s in parse_global_calibration(spec)]
    assert report["gptq_zy"] and report["svd_quant[2]"]
    q = quantize_graph(result.graph)
    assert _constants(g).keys() == original.keys()  # the float graph is left as it was
    assert all(torch.equal(v, original[k]) for k, v in _constants(g).items())
    assert torch.equal(g.forward(batches[0])[0], float_out)
    out = run_quantized(q, batches[0])[0]
    assert out.shape == float_out.shape and bool(torch.isfinite(out.float()).all())


@pytest.mark.parametrize("spec", ["bias_correction", "adaround[1,1,8]", "easy_quant[1,1,0.5,2,4]", "gptq_zy",
                                  "adaquant_zy[1,1,8]", "svd_quant[0]", "awq_zy[4]"])
@pytest.mark.parametrize("float_type", ["float16_preferred", "bfloat16_preferred", "float32_preferred"])
def test_weight_methods_leave_a_layer_that_stays_float(spec: str, float_type: str) -> None:
    """A MAC layer kept float (`trigger_float_op`) has no integer weight grid: the weight methods skip it with a
    log line and calibrate the others (found by benchmarks/fuzz_cfg_runs.py, docs/robustness.md)."""
    data = _mac_data()
    g = _calibrate(_mac_model(), data)
    g.node("dw").settings = LayerSettings(trigger_float_op=float_type)
    report, lines = _run(g, spec, data)
    changed = report[str(parse_global_calibration(spec)[0])]
    assert "dw" not in changed, changed
    if not spec.startswith(("svd_quant", "awq_zy")):  # those two search output ranges, not weight grids
        assert any("'dw' skipped: it stays float" in line for line in lines), lines
    q = quantize_graph(g)
    assert not q.node("dw").quantized
    out = run_quantized(q, data[0])[0]
    assert out.shape == (8, 6) and bool(torch.isfinite(out.float()).all())
