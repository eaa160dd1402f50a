"""Global calibration: the `global_calibration` parser (upstream syntax, one-line errors naming the field), and
each implemented method lowering the layer reconstruction error of a small model with 4-bit weights and
outliers, deterministically, without touching layers outside its scope."""
from __future__ import annotations

import logging
from typing import List

import numpy as np
import pytest
import torch
from conftest import shared_model_dir
from global_helpers import RecordedLog

from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.config.perlayer import IdRangeSelector, OpTypeSelector, RegexSelector
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.log import LOGGER
from quantopt.pipeline import run_quantized
from quantopt.quantizer import quantize_graph
from quantopt.tuning.global_methods import (
    GlobalCalibrationKind,
    apply_global_calibration,
    calibrate_globally,
    format_global_calibration,
    parse_global_calibration,
    reconstruction_errors,
)

PER_TENSOR = "per_tensor_symmetric_restricted_range"
PER_CHANNEL = "per_channel_symmetric_restricted_range"


# ------------------------------------------------------------------------------------------------ parser
def test_none_and_empty_give_no_method() -> None:
    assert parse_global_calibration("none") == []
    assert parse_global_calibration(" NONE ") == []
    assert parse_global_calibration("") == []
    assert format_global_calibration([]) == "none"


def test_defaults_fill_missing_positional_params() -> None:
    (m,) = parse_global_calibration("easy_quant[2, 1, 0.6]")
    assert m.name == "easy_quant" and m.given == 3 and m.scope is None
    assert m.params == (2, 1, 0.6, 2.0, 10, 4)
    assert m.param("batches") == 2 and isinstance(m.param("nsteps"), int) and m.param("alpha") == 0.6
    (a,) = parse_global_calibration("adaround[10,3,32]")  # upstream's example
    assert a.params == (10, 3, 32, 0.001, 0.01, 20, 2, 0.2)
    (b,) = parse_global_calibration("bias_correction")
    assert b.params == (1,) and b.given == 0


def test_methods_joined_by_ampersand_with_scopes() -> None:
    specs = parse_global_calibration("easy_quant[1][Convolution, fullyconnected] & adaround[1,2]{c.*} & "
                                     "bias_correction[][(0,1),(4,4)]")
    assert [s.name for s in specs] == ["easy_quant", "adaround", "bias_correction"]
    assert isinstance(specs[0].scope, OpTypeSelector) and specs[0].scope.names == ["Convolution", "fullyconnected"]
    assert isinstance(specs[1].scope, RegexSelector) and specs[1].scope.pattern == "c.*"
    assert isinstance(specs[2].scope, IdRangeSelector) and specs[2].scope.ranges == [(0, 1), (4, 4)]
    assert format_global_calibration(specs) == \
        "easy_quant[1][Convolution,fullyconnected]&adaround[1,2]{c.*}&bias_correction[][(0,1),(4,4)]"
    assert parse_global_calibration(format_global_calibration(specs)) == specs
    g = _model()
    scoped = {s.name: [n.name for n in g.nodes if s.in_scope(n)] for s in specs}
    assert scoped["easy_quant"] == ["c1", "c2", "fc"]
    assert scoped["adaround"] == ["c1", "c2"]
    assert scoped["bias_correction"] == ["x", "c1", "fc"]  # layer ids 0, 1 and 4


@pytest.mark.parametrize("text, fragment", [
    ("easy_qunt", "unknown method 'easy_qunt'; did you mean easy_quant"),
    ("foo[1]", "unknown method 'foo'; known methods:"),
    ("smooth_quant_zy[0.5,0,0,1,10,1]", "not implemented yet"),
    ("easy_quant[a]", "parameter 'a' in [a] is not a number"),
    ("easy_quant[Convolution]", "a scope follows them"),
    ("easy_quant[1,1,0.5,2,10,4,7]", "easy_quant takes at most 6 parameters"),
    ("easy_quant[1.5]", "batches=1.5 must be an integer"),
    ("easy_quant[0]", "batches=0 must be >= 1"),
    ("easy_quant[1,1,2,1]", "needs 0 < alpha <= beta"),
    ("adaround[1,1,1,0]", "needs lr > 0"),
    ("adaround[1,1,1,0.01,0.01,20,2,1]", "warm_start=1 must be in [0, 1)"),
    ("easy_quant[1][Foo]", "unknown operator type(s) Foo"),
    ("easy_quant[1][]", "empty scope []"),
    ("easy_quant[1][(3,1)]", "range (3,1) in [(3,1)] is empty"),
    ("easy_quant[1][(1,2),x]", "must be layer-id ranges"),
    ("easy_quant[1]{(}", "invalid regex scope"),
    ("easy_quant[1", "missing ']'"),
    ("easy_quant&&adaround", "empty method"),
    ("easy_quant&", "empty method"),
    ("easy_quant[1][Convolution][FullyConnected]", "one scope per method"),
    ("easy_quant(1)", "expected '[' after the method name"),
    ("easy_quant[1]x", "expected a scope"),
    ("[1]", "does not start with a method name"),
])
def test_rejected_syntax_is_a_one_line_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_global_calibration(text)
    message = str(info.value)
    assert fragment in message
    assert "field 'global_calibration'" in message and "\n" not in message
    with pytest.raises(ValueError):  # what the cfg reader turns into "file:line: field ...: invalid value"
        GlobalCalibrationKind().parse(text)


def test_kind_parses_and_describes() -> None:
    kind = GlobalCalibrationKind()
    assert [s.name for s in kind.parse("bias_correction&adaround")] == ["bias_correction", "adaround"]
    assert "easy_quant" in kind.allowed() and "{regex}" in kind.allowed()


# ------------------------------------------------------------------------------------------------ methods
GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1, group=1)


def _model(seed: int = 0):
    """conv(RELU) -> conv(RELU) -> reshape -> FC, each weight tensor with one outlier."""
    r = np.random.default_rng(seed)
    g = GraphBuilder("gc")
    x = g.input("x", [1, 6, 6, 4])
    w1 = r.normal(0, 0.3, (8, 3, 3, 4)).astype(np.float32)
    w1[0, 1, 1, 0] = 2.5
    a = g.layer("Convolution", [x], [[1, 6, 6, 8]], name="c1", params=dict(num_output=8, with_activation="RELU", **GEO),
                constants={"weights": w1, "biases": r.normal(0, 0.1, 8).astype(np.float32)})
    w2 = r.normal(0, 0.2, (8, 3, 3, 8)).astype(np.float32)
    w2[3, 0, 0, 1] = -1.8
    b = g.layer("Convolution", [a], [[1, 6, 6, 8]], name="c2", params=dict(num_output=8, with_activation="RELU", **GEO),
                constants={"weights": w2, "biases": r.normal(0, 0.1, 8).astype(np.float32)})
    d = g.layer("Reshape", [b], [[1, 288]], name="flat", params=dict(shape=[1, 288]))
    w3 = r.normal(0, 0.1, (6, 288)).astype(np.float32)
    w3[2, 5] = 1.0
    e = g.layer("FullyConnected", [d], [[1, 6]], name="fc", params=dict(num_output=6, with_activation="NONE"),
                constants={"weights": w3, "biases": r.normal(0, 0.1, 6).astype(np.float32)})
    return g.build([e])


def _data(n: int = 3, seed: int = 1, batch: int = 8) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0.5, 1, (batch, 6, 6, 4)).astype(np.float32)) for _ in range(n)]


def _calibrated(weight_mode: str = PER_TENSOR, weight_bits: int = 4):
    g = _model()
    s = LayerSettings(q_bits_weight=weight_bits, q_mode_weight=weight_mode)
    for n in g.nodes:
        n.settings = s
    collect_weight_statistics(g)
    collect_activation_statistics(g, [[b] for b in _data()])
    calibrate_graph(g)
    return g


def _state(g):
    """Everything global calibration may change: ranges, weights and biases."""
    out = {}
    for n in g.nodes:
        for t in list(n.outputs) + list(n.constants.values()):
            for key, r in (("tensor", g.ranges.get(t)), ("channels", g.ranges.channels(t))):
                for end, v in (("min", r.min), ("max", r.max)):
                    out[(n.name, t.name, key, end)] = v.clone() if isinstance(v, torch.Tensor) else v
        for key, t in n.constants.items():
            out[(n.name, key, "value")] = t.betensor.clone()
    return out


def _equal(x, y) -> bool:
    if x is None or y is None:
        return x is y
    return torch.equal(torch.as_tensor(x), torch.as_tensor(y))


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spec, mode", [
    ("bias_correction[3]", PER_TENSOR),
    ("easy_quant[3]", PER_TENSOR),
    ("easy_quant[3,1,0.5,2,10,0]", PER_CHANNEL),
    ("adaround[3,10,8,0.01]", PER_TENSOR),
    ("adaround[3,10,8,0.01]", PER_CHANNEL),
])
def test_method_lowers_layer_reconstruction_error(spec: str, mode: str) -> None:
    plain = _calibrated(mode)
    reference = plain.clone()
    before = reconstruction_errors(plain, reference, _data())
    g = _calibrated(mode)
    handler = RecordedLog()
    LOGGER.addHandler(handler)
    level = LOGGER.level
    LOGGER.setLevel(logging.DEBUG)
    try:
        report = apply_global_calibration(g, spec, _data())
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
    after = reconstruction_errors(g, reference, _data())
    changed = report[str(parse_global_calibration(spec)[0])]
    assert changed, f"{spec}: no layer changed"
    assert sum(after.values()) < 0.8 * sum(before.values()), (before, after)
    assert after["fc"] < before["fc"]
    assert any("->" in line and "mse" in line for line in handler.lines)  # loss before/after is logged
    assert any(f"layer '{changed[0]}'" in line for line in handler.lines)  # what changed, per layer


def test_methods_are_deterministic_and_quantize_to_the_same_integers() -> None:
    spec = "bias_correction[2] & easy_quant[2,1,0.5,2,6,0] & adaround[2,3,8,0.01]"
    runs = []
    for _ in range(2):
        g = _calibrated(PER_CHANNEL)
        apply_global_calibration(g, spec, _data(), log_loss=False)
        q = quantize_graph(g)
        runs.append((_state(g), run_quantized(q, _data()[0])[0]))
    assert _same(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def test_scope_limits_the_layers_touched() -> None:
    g = _calibrated()
    before = _state(g)
    report = apply_global_calibration(g, "bias_correction[2]{fc} & easy_quant[1][FullyConnected]", _data(),
                                      log_loss=False)
    assert report == {"bias_correction[2]{fc}": ["fc"], "easy_quant[1][FullyConnected]": ["fc"]}
    after = _state(g)
    changed = {k[0] for k in before if not _equal(before[k], after[k])}
    # only fc's biases and ranges: its input comes from a Reshape, whose params follow its own input, so the
    # input range is not searched
    assert changed == {"fc"}
    assert torch.equal(before[("c2", "weights", "value")], after[("c2", "weights", "value")])
    assert not torch.equal(before[("fc", "biases", "value")], after[("fc", "biases", "value")])


def test_calibrate_globally_returns_a_copy_and_leaves_the_float_graph() -> None:
    g = _calibrated()
    original = _state(g)
    plain_q = quantize_graph(_calibrated())
    result = calibrate_globally(g, "adaround[3,10,8,0.01] & bias_correction[3]", _data(), log_loss=False)
    report = result.changed
    q = quantize_graph(result.graph)
    assert _same(original, _state(g))  # constants, ranges and settings of the float graph: untouched
    assert not _same(original, _state(result.graph))  # the copy carries the calibrated constants
    # the quantized copy keeps the calibrated integers: adaround's layers have other integer weights
    for name in report["adaround[3,10,8,0.01]"]:
        assert not torch.equal(q.node(name).constants["weights"].betensor,
                               plain_q.node(name).constants["weights"].betensor)
        diff = q.node(name).constants["weights"].betensor - plain_q.node(name).constants["weights"].betensor
        assert int(diff.abs().max()) == 1  # only up/down rounding decisions changed
    float_out = g.forward([_data()[0]])[0]
    assert torch.allclose(float_out, _model().forward([_data()[0]])[0])


def test_no_method_leaves_graph_untouched() -> None:
    g = _calibrated()
    before = _state(g)
    assert apply_global_calibration(g, "none", _data()) == {}
    assert _same(before, _state(g))


def test_shared_model_runs_every_method() -> None:
    folder = shared_model_dir("syn_resnet")
    from quantopt.ir.reader import read_ir

    g = read_ir(str(folder / "syn_resnet.txt"))
    calib = torch.from_numpy(np.load(folder / "calib.npy"))
    batches = [[calib[i:i + 2]] for i in range(0, min(len(calib), 4), 2)]
    for n in g.nodes:
        n.settings = LayerSettings()
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches)
    calibrate_graph(g)
    reference = g.clone()
    before = sum(reconstruction_errors(g, reference, batches).values())
    report = apply_global_calibration(g, "easy_quant[1,1,0.5,2,5] & bias_correction[2] & adaround[1,1,2]", batches,
                                      log_loss=False)
    assert all(report.values())
    after = sum(reconstruction_errors(g, reference, batches).values())
    assert after < before
    q = quantize_graph(g)
    assert run_quantized(q, batches[0])[0].shape == g.forward(batches[0])[0].shape
