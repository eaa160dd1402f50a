"""gptq_zy and awq_zy on weight-only FullyConnected layers with per-block weights (`quantize_method_for_weight =
per_block_*`, `weight_block_size`): int4 (symmetric restricted/full range, asymmetric) and fp4 e2m1 weights. The
layer outputs are checked against plain numpy with the weights dequantized from the quantized graph's own
constants, the block scales against their formulas on the original float weights."""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from global_helpers import RecordedLog

from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.log import LOGGER
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quantizer import quantize_graph
from quantopt.tuning.global_methods import apply_global_calibration, reconstruction_errors

BLOCK = 8
FCS = ("fc0", "fc_a", "fc_b")
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
INT4_SYM = ("float16_act_int_wht", "per_block_symmetric_restricted_range")
INT4_FULL = ("float16_act_int_wht", "per_block_symmetric_full_range")
INT4_ASYM = ("float16_act_int_wht", "per_block_asymmetric")
FP4 = ("float16_act_fp4e2m1fn_wht", "per_block_symmetric_restricted_range")


def _model():
    """FC -> LayerNorm (two outlier channels) -> Reshape -> two FCs (one with RELU), 32 channels."""
    r = np.random.default_rng(0)
    g = GraphBuilder("blocks")
    x = g.input("x", [1, 6, 32])
    h = g.layer("FullyConnected", [x], [[1, 6, 32]], name="fc0", params=dict(num_output=32, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (32, 32)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 32).astype(np.float32)})
    gamma = r.normal(1, 0.1, 32).astype(np.float32)
    gamma[[3, 21]] = [25.0, -18.0]
    n = g.layer("LayerNorm", [h], [[1, 6, 32]], name="norm", params=dict(axis=[-1], epsilon=1e-5),
                constants={"weights": gamma, "biases": r.normal(0, 0.1, 32).astype(np.float32)})
    s = g.layer("Reshape", [n], [[1, 2, 3, 32]], name="shape", params=dict(shape=[1, 2, 3, 32]))
    a = g.layer("FullyConnected", [s], [[1, 2, 3, 24]], name="fc_a", params=dict(num_output=24, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.2, (24, 32)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 24).astype(np.float32)})
    b = g.layer("FullyConnected", [s], [[1, 2, 3, 16]], name="fc_b", params=dict(num_output=16, with_activation="RELU"),
                constants={"weights": r.normal(0, 0.2, (16, 32)).astype(np.float32)})
    return g.build([a, b])


def _data(n: int = 2, batch: int = 8) -> List[torch.Tensor]:
    r = np.random.default_rng(1)
    return [torch.from_numpy(r.normal(0, 1, (batch, 6, 32)).astype(np.float32)) for _ in range(n)]


def _layer_settings(kind: Tuple[str, str]) -> Dict[str, object]:
    return dict(trigger_float_op=kind[0], q_bits_weight=4, q_mode_weight=kind[1], weight_block_size=BLOCK)


def _calibrated(kind: Tuple[str, str]):
    """The model calibrated with 16-bit integer layers and weight-only FullyConnected layers of `kind`."""
    g = _model()
    base = dict(q_bits_activation=16, q_bits_bias=48, lut_items_in_bits=10, layernorm_integer_form="exact")
    for n in g.nodes:
        n.settings = LayerSettings(**base, **(_layer_settings(kind) if n.name in FCS else {}))
    data = _data()
    collect_weight_statistics(g)
    collect_activation_statistics(g, [[b] for b in data])
    calibrate_graph(g)
    return g, data


def _run(g, spec: str, data) -> Tuple[List[str], List[str]]:
    handler = RecordedLog()
    LOGGER.addHandler(handler)
    level = LOGGER.level
    LOGGER.setLevel(logging.DEBUG)
    try:
        report = apply_global_calibration(g, spec, data, log_loss=False)
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
    return report[spec], handler.lines


def _dequantized(qnode) -> np.ndarray:
    """(q + zp) / scale per block, from the layer's constants, in numpy."""
    w = qnode.constants["weights"].betensor.numpy().astype(np.float64)
    scale = qnode.constants["weights_scale"].betensor.numpy().astype(np.float64)
    zp = qnode.constants["weights_zp"].betensor.numpy().astype(np.float64) if "weights_zp" in qnode.constants \
        else np.zeros_like(scale)
    blocks = w.reshape(-1, BLOCK)
    return ((blocks + zp[:, None]) / scale[:, None]).reshape(w.shape)


def _check_block_grid(qnode, float_weights: np.ndarray, kind: Tuple[str, str]) -> None:
    """Every block's values lie on its grid, and its scale is the one of the original float block."""
    w = qnode.constants["weights"].betensor.numpy().reshape(-1, BLOCK)
    scale = qnode.constants["weights_scale"].betensor.numpy().astype(np.float64)
    blocks = float_weights.reshape(-1, BLOCK).astype(np.float64)
    absmax = np.abs(blocks).max(axis=1)
    assert qnode.params["weight_block_size"] == BLOCK and scale.shape == (blocks.shape[0],)
    if kind == FP4:
        assert np.isin(np.abs(w), E2M1).all()
        np.testing.assert_allclose(scale, 6.0 / (absmax + 1e-5), rtol=1e-6)
        return
    assert w.dtype == np.int64 or np.issubdtype(w.dtype, np.integer)
    if kind == INT4_ASYM:
        lo, hi = np.minimum(blocks.min(axis=1), 0), np.maximum(blocks.max(axis=1), 0)
        np.testing.assert_allclose(scale, 15.0 / (hi - lo), rtol=1e-6)
        zp = qnode.constants["weights_zp"].betensor.numpy()
        assert (w >= -8).all() and (w <= 7).all() and np.abs(zp).max() <= 7
        return
    qmin = -7 if kind == INT4_SYM else -8
    np.testing.assert_allclose(scale, (7 - qmin) / (2 * absmax), rtol=1e-6)
    assert (w >= qmin).all() and (w <= 7).all()
    assert not qnode.constants["weights_zp"].betensor.any()


def _fc_inputs(g, data) -> Dict[str, np.ndarray]:
    """Float inputs of every FullyConnected on the calibration data, rows of their last axis."""
    found: Dict[str, List[np.ndarray]] = {n: [] for n in FCS}

    def hook(node) -> None:
        if node.name in found:
            x = node.inputs[0].betensor.numpy().astype(np.float64)
            found[node.name].append(x.reshape(-1, x.shape[-1]))

    for b in data:
        g.forward([b], after_node=hook)
    return {k: np.concatenate(v) for k, v in found.items()}


def _output_error(x: np.ndarray, w: np.ndarray, w_q: np.ndarray) -> float:
    return float(((x @ (w_q - w).T) ** 2).sum())


@pytest.mark.parametrize("kind, spec, batches", [
    (INT4_SYM, "gptq_zy", 1), (INT4_SYM, "gptq_zy[1,0,0.01,16]", 1), (INT4_FULL, "gptq_zy", 1),
    (INT4_ASYM, "gptq_zy[2]", 2), (FP4, "gptq_zy", 1), (FP4, "gptq_zy[2,0]", 2)])
def test_gptq_lowers_block_output_error_on_the_block_grid(kind, spec, batches) -> None:
    plain, data = _calibrated(kind)
    floats = {n: plain.node(n).constants["weights"].betensor.numpy().copy() for n in FCS}
    x = _fc_inputs(plain, data[:batches])  # the calibration batches GPTQ uses
    q_plain = quantize_graph(plain)
    g, _ = _calibrated(kind)
    changed, lines = _run(g, spec, data)
    assert changed == list(FCS), lines
    assert any("blocks of 8" in line for line in lines)
    q = quantize_graph(g)
    for name in FCS:
        qn, pn = q.node(name), q_plain.node(name)
        _check_block_grid(qn, floats[name], kind)
        # the block scales come from the original weights: those of plain rounding to nearest
        assert torch.equal(qn.constants["weights_scale"].betensor, pn.constants["weights_scale"].betensor)
        assert not torch.equal(qn.constants["weights"].betensor, pn.constants["weights"].betensor)
        e_gptq = _output_error(x[name], floats[name], _dequantized(qn))
        e_rtn = _output_error(x[name], floats[name], _dequantized(pn))
        # fc0 reads white noise (little for GPTQ to exploit); the others read correlated norm outputs
        assert e_gptq < (0.98 if name == "fc0" else 0.6) * e_rtn, (name, e_gptq, e_rtn)
    # the quantized forward computes with exactly those weights: fc_b's output against numpy
    seen = {}

    def hook(node) -> None:
        if node.name == "fc_b":
            seen["x"] = node.inputs[0].betensor.numpy().astype(np.float64).reshape(-1, 32)
            seen["y"] = node.outputs[0].betensor.numpy().reshape(-1, 16).copy()

    q.forward([data[0]], after_node=hook)
    want = np.maximum(seen["x"] @ _dequantized(q.node("fc_b")).T, 0).astype(np.float16).astype(np.float32)
    got = seen["y"]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("kind, spec", [(INT4_SYM, "awq_zy[10]"), (INT4_ASYM, "awq_zy[10,0.3]"),
                                        (FP4, "awq_zy[10,0.3]")])
def test_awq_lowers_block_fc_error_and_keeps_the_float_model(kind, spec) -> None:
    plain, data = _calibrated(kind)
    reference = plain.clone()
    before = reconstruction_errors(plain, reference, data, ["fc_a", "fc_b"])
    g, _ = _calibrated(kind)
    changed, lines = _run(g, spec, data)
    assert set(changed) >= {"norm", "fc_a", "fc_b"}, lines
    after = reconstruction_errors(g, reference, data, ["fc_a", "fc_b"])
    assert sum(after.values()) < 0.7 * sum(before.values()), (before, after)
    assert any("norm 'norm' -> 'fc_a', 'fc_b': alpha=" in line for line in lines)
    shrink = [line for line in lines if "weight range x" in line]
    for got, want in zip(g.forward([data[0]]), reference.forward([data[0]])):
        if "x 1;" in shrink[0]:  # without clipping the smoothing keeps the float model exactly
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    q = quantize_graph(g)
    for name in ("fc_a", "fc_b"):
        _check_block_grid(q.node(name), g.node(name).constants["weights"].betensor.numpy(), kind)


def test_awq_block_clipping_clips_every_block() -> None:
    """A clipping ratio of a per-block layer clips each block to that fraction of its own range."""
    awq = __import__("quantopt.tuning.global_methods.awq_zy", fromlist=["_shrink"])
    g, _ = _calibrated(INT4_ASYM)
    node = g.node("fc_a")
    w = node.constants["weights"].betensor.clone().reshape(-1, BLOCK)
    pair = type("P", (), {"fcs": [node]})()
    awq._shrink([node], pair, 0.5, {"fc_a"})
    got = node.constants["weights"].betensor.reshape(-1, BLOCK)
    lo, hi = torch.clamp(w.min(dim=1).values, max=0) * 0.5, torch.clamp(w.max(dim=1).values, min=0) * 0.5
    assert torch.equal(got, torch.maximum(torch.minimum(w, hi[:, None]), lo[:, None]))
    assert torch.allclose(got.max(dim=1).values, torch.clamp(w.max(dim=1).values * 0.5, min=0))


@pytest.mark.parametrize("kind, gcal", [(INT4_SYM, "awq_zy[10] & gptq_zy[2]"), (FP4, "gptq_zy[2,1,0.01,8]")])
def test_quantize_model_writes_an_ir_that_runs_identically(tmp_path, kind, gcal) -> None:
    data = _data()
    settings = dict(q_bits_activation=16, q_bits_bias=48, lut_items_in_bits=10)
    per_layer = {n: _layer_settings(kind) for n in FCS}
    plain = quantize_model(_model(), data, settings=settings, per_layer=per_layer)
    q = quantize_model(_model(), data, settings=settings, per_layer=per_layer, global_calibration=gcal)
    assert not torch.equal(q.node("fc_a").constants["weights"].betensor,
                           plain.node("fc_a").constants["weights"].betensor)
    txt, _ = write_ir(q, str(tmp_path / "m.txt"))
    text = open(txt).read()
    assert text.count("weight_block_size=8") == 3
    r = read_ir(txt)
    for name in FCS:
        for key in ("weights", "weights_scale"):
            assert torch.equal(r.node(name).constants[key].betensor, q.node(name).constants[key].betensor)
    g = _model()
    for x in _data(2, 4):
        a, b = run_quantized(q, x)[0], run_quantized(r, x)[0]
        assert torch.equal(a, b)
        ref = g.forward([x])[0]
        yp = run_quantized(plain, x)[0]
        assert float(((a - ref) ** 2).mean()) < float(((yp - ref) ** 2).mean())
