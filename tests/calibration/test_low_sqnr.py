"""`min_activation_sqnr_db` (calibration/low_sqnr.py): the expected SQNR of a range on a histogram against closed
forms and an independent numpy computation, and the promotion it drives: a layer whose outputs a few channels
dominate gets 16 bits, a layer a better 8-bit range fixes keeps 8 bits, ordinary layers are left alone, and the
quantized graph is the same as without the field when nothing falls below it."""
from __future__ import annotations

import dataclasses
import math
from typing import List

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine, to_float
from quantopt.calibration.histogram_search import expected_sqnr_db
from quantopt.calibration.low_sqnr import PROMOTED_BITS, layer_sqnr_db, promote_low_sqnr_activations
from quantopt.config.presets import preset_settings
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model, run_quantized

BINS = 4096


def _uniform(lo: float, hi: float) -> torch.Tensor:
    return torch.ones(BINS, dtype=torch.float64)


def test_sqnr_of_a_uniform_histogram_is_the_textbook_value() -> None:
    """Uniform on [-1, 1] over its own range at 8 bits: signal 1/3, noise step^2 / 12 with step 2/255, so
    10 log10(255^2) = 48.13 dB; at 16 bits 96.33 dB."""
    assert expected_sqnr_db(_uniform(-1, 1), -1.0, 1.0, -1.0, 1.0, 8) == pytest.approx(20 * math.log10(255), abs=1e-3)
    assert expected_sqnr_db(_uniform(-1, 1), -1.0, 1.0, -1.0, 1.0, 16) == pytest.approx(20 * math.log10(65535),
                                                                                         abs=1e-3)


def test_sqnr_with_clipping_matches_the_integral() -> None:
    """Uniform on [-1, 1] clipped to [-0.5, 0.5]: clip error 2 * (1/2) * integral_0.5^1 (x - 0.5)^2 dx = 1/24, plus
    half the values inside with step 1/255."""
    step = 1.0 / 255
    noise = 1.0 / 24 + 0.5 * step ** 2 / 12
    expected = 10 * math.log10((1.0 / 3) / noise)
    assert expected_sqnr_db(_uniform(-1, 1), -1.0, 1.0, -0.5, 0.5, 8) == pytest.approx(expected, abs=1e-3)


def test_sqnr_against_numpy_on_a_random_histogram() -> None:
    rng = np.random.default_rng(3)
    h = rng.integers(0, 50, 300).astype(np.float64)
    lo, hi, a, b = -2.0, 5.0, -1.5, 3.0
    c = lo + (np.arange(300) + 0.5) * (hi - lo) / 300
    noise = (h * (c - np.clip(c, a, b)) ** 2).sum() + h[(c >= a) & (c <= b)].sum() * ((b - a) / 255) ** 2 / 12
    expected = 10 * np.log10((h * c ** 2).sum() / noise)
    got = expected_sqnr_db(torch.from_numpy(h), lo, hi, a, b, 8)
    assert got == pytest.approx(float(expected), abs=1e-9)
    assert expected_sqnr_db(torch.zeros(8), lo, hi, a, b, 8) is None


# ------------------------------------------------------------------------------------------------ promotion
def _model():
    """x -> fc_out, which passes input feature 0 (zero but for rare spikes of 1000: 0.2% of the outputs carry nearly
    all the energy, so no 8-bit range keeps both them and the rest), and beside it x -> fc_plain, which ignores it."""
    r = np.random.default_rng(0)
    g = GraphBuilder("outliers")
    x = g.input("x", [64, 16])
    w = r.normal(0, 0.2, (16, 16)).astype(np.float32)
    w[:, 0] = 1.0
    a = g.layer("FullyConnected", [x], [[64, 16]], name="fc_out", params=dict(num_output=16, with_activation="NONE"),
                constants={"weights": w, "biases": np.zeros(16, np.float32)})
    w2 = r.normal(0, 0.2, (16, 16)).astype(np.float32)
    w2[:, 0] = 0.0
    b = g.layer("FullyConnected", [x], [[64, 16]], name="fc_plain", params=dict(num_output=16, with_activation="NONE"),
                constants={"weights": w2, "biases": np.zeros(16, np.float32)})
    return g.build([a, b])


def _data(n: int = 8, spikes: bool = True) -> List[torch.Tensor]:
    r = np.random.default_rng(1 if spikes else 2)
    out = []
    for i in range(n):
        x = r.normal(0, 1, (64, 16)).astype(np.float32)
        x[:, 0] = 0.0
        if spikes and i == 0:
            x[0, 0] = 1000.0
        out.append(torch.from_numpy(x))
    return out


def _quantize(threshold: float):
    """The model quantized with the preset and `threshold`; its input is 16-bit by a rule of the user's (the
    promotion never changes the model's input dtype, and an 8-bit input would already lose the ordinary values)."""
    g = _model()
    q = quantize_model(g, _data(), settings={**preset_settings("accurate"), "min_activation_sqnr_db": threshold},
                       per_layer={"x": {"q_bits_activation": 16}})
    return g, q


def test_outlier_layer_gets_16_bits_and_its_error_drops() -> None:
    g, q = _quantize(30.0)
    assert q.node("fc_out").settings.q_bits_activation == PROMOTED_BITS
    assert q.node("fc_out").settings.q_strategy_activation == "mse"
    assert q.node("fc_plain").settings.q_bits_activation == 8
    assert q.node("fc_plain").settings.q_strategy_activation == "quantile[99.99]"
    assert str(q.node("fc_out").outputs[0].dtype.value) == "int16"
    assert q.node("x").settings.q_bits_activation == 16 and q.node("x").settings.q_strategy_activation != "mse"
    x = _data(1, spikes=False)[0]
    g0, q0 = _quantize(0.0)
    assert q0.node("fc_out").settings.q_bits_activation == 8
    ref = g.forward([x])[0]
    with_field = cosine(run_quantized(q, x)[0], ref)
    without = cosine(run_quantized(q0, x)[0], ref)
    assert without < 0.9 < 0.999 < with_field, (without, with_field)


def test_the_best_range_decides_and_other_layers_keep_their_range() -> None:
    """Promotion is judged on the least-error range at the layer's bits: a threshold between the calibrated range's
    SQNR and the best range's promotes nothing and changes no range; one above the best range's promotes."""
    g = _model()
    quantize_model(g, _data(), settings={**preset_settings("accurate"), "min_activation_sqnr_db": 0.0})
    plain = g.node("fc_plain")
    before, best = layer_sqnr_db(plain), layer_sqnr_db(plain, best_range=True)
    assert best >= before - 1e-9  # the least-error range is at least as good as the percentile one
    ranges = (g.ranges.get(plain.outputs[0]).min, g.ranges.get(plain.outputs[0]).max)

    def with_threshold(value: float) -> dict:
        for n in g.nodes:
            n.settings = dataclasses.replace(n.settings, min_activation_sqnr_db=value)
        return {p.layer: p for p in promote_low_sqnr_activations(g)}

    assert "fc_plain" not in with_threshold(best - 0.01)
    r = g.ranges.get(plain.outputs[0])
    assert (r.min, r.max) == ranges and plain.settings.q_bits_activation == 8
    done = with_threshold(best + 0.5)
    assert done["fc_plain"].sqnr_db == pytest.approx(best)
    assert plain.settings.q_bits_activation == PROMOTED_BITS and done["fc_plain"].promoted_sqnr_db > best + 40


def test_nothing_below_the_threshold_changes_nothing() -> None:
    """With a threshold no tensor falls under, the quantized graph is bit-identical to the one without the field."""
    _, q_off = _quantize(0.0)
    g = _model()
    q_low = quantize_model(g, _data(), settings={**preset_settings("accurate"), "min_activation_sqnr_db": 1e-3},
                           per_layer={"x": {"q_bits_activation": 16}})
    assert promote_low_sqnr_activations(g) == []
    x = _data(1, spikes=False)[0]
    for a, b in zip(run_quantized(q_off, x), run_quantized(q_low, x)):
        assert torch.equal(a, b)
    assert all(to_float(t) is not None for t in q_low.output_tensors)


def test_histograms_are_collected_for_the_check_whatever_the_strategy() -> None:
    g = _model()
    quantize_model(g, _data(), settings={"q_strategy_activation": "extrema", "min_activation_sqnr_db": 30.0})
    assert g.statistics.get(g.node("fc_out").outputs[0]).running_histc is not None
    assert g.node("fc_out").settings.q_bits_activation == PROMOTED_BITS
    g2 = _model()
    quantize_model(g2, _data(), settings={"q_strategy_activation": "extrema"})
    # off: upstream's statistics, nothing more
    assert g2.statistics.get(g2.node("fc_out").outputs[0]).running_histc is None


def test_cfg_field_and_preset(tmp_path) -> None:
    (tmp_path / "m.txt").write_text("")
    base = "[Common]\ngraph = m.txt\n"
    cfg = tmp_path / "a.cfg"
    cfg.write_text(base + "min_activation_sqnr_db = 25 & <[FullyConnected]:30>\n")
    c = read_cfg(str(cfg))
    assert c.min_activation_sqnr_db is not None
    cfg.write_text(base + "preset = accurate\n")
    assert read_cfg(str(cfg)).preset_fields.get("min_activation_sqnr_db") == "30"
    assert preset_settings("accurate")["min_activation_sqnr_db"] == 30.0
    for bad in ("-1", "101", "loud"):
        cfg.write_text(base + f"min_activation_sqnr_db = {bad}\n")
        with pytest.raises(ConfigError, match="min_activation_sqnr_db"):
            read_cfg(str(cfg))


# ------------------------------------------------------------------------------------------------ weight ranges
def test_per_channel_weight_range_search_lowers_every_channels_error() -> None:
    """`calibration_strategy_for_weight = mse` with per-channel weights searches each output channel's range on its
    own histogram: at 4 bits, where clipping a Laplace tail pays (ACIQ), every channel's weight quantization error
    is clearly below that of its extrema range; channels of different spread get different clips."""
    r = np.random.default_rng(5)
    w = (r.laplace(0, 1.0, (8, 1024)) * np.linspace(0.05, 0.4, 8)[:, None]).astype(np.float32)
    per_channel = "per_channel_symmetric_restricted_range"
    errors = {}
    for strategy in ("extrema", "mse"):
        q = quantize_model(_rebuild(w), _fc_data(), settings={"q_mode_weight": per_channel, "q_bits_weight": 4,
                                                              "q_strategy_weight": strategy})
        wq = q.node("fc").constants["weights"].betensor.to(torch.float64)
        scale = params_of(q.node("fc"), q.node("fc").constants["weights"]).scale
        deq = wq / torch.as_tensor(scale, dtype=torch.float64).reshape(-1, 1)
        errors[strategy] = ((deq - torch.from_numpy(w).double()) ** 2).mean(dim=1)
    assert bool((errors["mse"] < 0.8 * errors["extrema"]).all()), errors


def _rebuild(w: np.ndarray):
    g = GraphBuilder("w")
    x = g.input("x", [4, w.shape[1]])
    y = g.layer("FullyConnected", [x], [[4, w.shape[0]]], name="fc",
                params=dict(num_output=w.shape[0], with_activation="NONE"),
                constants={"weights": w, "biases": np.zeros(w.shape[0], np.float32)})
    return g.build([y])


def _fc_data() -> List[torch.Tensor]:
    r = np.random.default_rng(6)
    return [torch.from_numpy(r.normal(0, 1, (4, 1024)).astype(np.float32)) for _ in range(2)]
