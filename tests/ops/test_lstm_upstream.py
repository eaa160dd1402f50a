"""BasicLSTM in upstream's integer form (lstm_integer_form = upstream, the default; docs/semantics/recurrent.md):
the cell's inner tensors recorded as placeholders by the float forward (against a numpy cell), the constants from
their calibrated ranges, the integer forward against an independent python-int reference written from the docs,
dequantized outputs against the float cell, the IR round trip, the q15 form kept behind the field, errors."""
from __future__ import annotations

import math
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from quant_helpers import (
    RECURRENT_STEPS,
    checked_requantization_bounds,
    choose_recurrent_steps,
    params_of,
    ran_as_chosen,
)
from range_helpers import range_of, set_range
from test_recurrent import build, feeds, lstm_weights, np_sigmoid

import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
from quantopt.analysis.similarity import cosine
from quantopt.config.presets import preset_settings
from quantopt.errors import IRError, UnsupportedError
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

T, IN, C = 4, 3, 5
CASES = [({}, "per_tensor_symmetric_restricted_range"),
         ({"direction": "reverse", "forget_bias": 1.0, "out_sequence": ["H", "C", "Y"]},
          "per_channel_symmetric_restricted_range")]


def settings(bits: int, wmode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation="per_tensor_asymmetric", q_mode_weight=wmode,
                q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32, q_strategy_activation="extrema", **extra)


def quantized(params: Dict[str, Any], bits: int, wmode: str, **extra: Any):
    _, w, b = lstm_weights(10)
    g = build("BasicLSTM", params, w, b)
    data = [feeds(s, "BasicLSTM") for s in (11, 12, 13)]
    return g, data, quantize_model(g, data, settings(bits, wmode, **extra))


# --- placeholders --------------------------------------------------------------------------------------------------
def test_float_forward_records_the_cell_tensors_as_placeholders() -> None:
    """h sequence, gate (i, f, o) and candidate/cell table inputs and outputs, one cell state per step; TANH is
    both the candidate's and the cell's activation, so those two placeholders hold both (upstream's layout)."""
    _, w, b = lstm_weights(2)
    g = build("BasicLSTM", {"forget_bias": 0.5}, w, b)
    x, h0, c0 = feeds(3, "BasicLSTM")
    g.forward([x, h0, c0])
    ph = g.node("op").placeholders
    assert [t.name for t in ph] == [f"op/{n}" for n in ("h_batch", "f_lut_in", "f_lut_out", "g_lut_in", "g_lut_out",
                                                         "h_lut_in", "h_lut_out")] + [f"op/c_state_{t}" for t in
                                                                                      range(T)]
    # independent numpy cell
    h, c = h0.numpy().astype(np.float64), c0.numpy().astype(np.float64)
    hs, gin, gout, cin, cout, cs = [], [], [], [], [], []
    for t in range(T):
        z = np.concatenate([x.numpy()[:, t], h], 1) @ w.astype(np.float64).T + b
        zi, zg, zf, zo = np.split(z, 4, axis=1)
        zf = zf + 0.5
        i, gg, f, o = np_sigmoid(zi), np.tanh(zg), np_sigmoid(zf), np_sigmoid(zo)
        c = f * c + i * gg
        h = o * np.tanh(c)
        hs.append(h)
        gin.append(np.concatenate([zi, zf, zo], 1))
        gout.append(np.concatenate([i, f, o], 1))
        cin.append(np.concatenate([zg, c], 1))
        cout.append(np.concatenate([gg, np.tanh(c)], 1))
        cs.append(c)
    want = [np.stack(v, 1) for v in (hs, gin, gout, cin, cout, cin, cout)] + cs
    for t, ref in zip(ph, want):
        np.testing.assert_allclose(t.betensor.numpy(), ref, atol=2e-6)
    kept = ph[0]
    g.forward([x, h0, c0])
    assert g.node("op").placeholders[0] is kept  # filled in place: statistics stay with the tensor


def test_placeholders_of_a_batch_run_per_group_hold_the_whole_batch() -> None:
    """The float cell runs once per IR-batch group; its placeholders are the concatenation, like its outputs."""
    _, w, b = lstm_weights(2)
    g = build("BasicLSTM", {}, w, b)
    x, h0, c0 = feeds(3, "BasicLSTM", n=3, h_batch=3)
    y = g.forward([x, h0, c0])[0]
    ph = g.node("op").placeholders
    assert ph[0].betensor.shape == (3, T, C) and torch.equal(ph[0].betensor, y)
    assert ph[-1].betensor.shape == (3, C)


# --- quantize ------------------------------------------------------------------------------------------------------
def approx(r: float, bits: int):
    """Independent float32 multiplier/shift: N = floor(log2((2^min(b,15) - 1) / r)) (at most 31), M = floor(r 2^N
    + 0.5), (1, 0) for an exact power of two."""
    r32 = np.float32(r)
    mb = min(bits, 15)
    n = min(int(np.floor(np.log2(np.float32(2.0 ** mb - 1) / r32))), 31)
    m = int(np.floor(r32 * np.float32(2.0 ** n) + np.float32(0.5)))
    return (1, 0) if m == 2 ** n else (m, n)


def sym_scale(lo: float, hi: float, bits: int) -> np.float32:
    return np.float32(2 ** (bits - 1) - 1) / np.float32(max(abs(min(lo, 0.0)), abs(max(hi, 0.0))))


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("params,wmode", CASES)
def test_constants_follow_the_placeholder_ranges(params: Dict[str, Any], wmode: str, bits: int) -> None:
    _, _, qg = quantized(params, bits, wmode)
    node = qg.node("op")
    ph = node.placeholders
    per_channel = "weights_scale" in node.constants
    head = 1 + 4 * C + C + 2 if per_channel else 5
    scale = node.constants["scale"].betensor.tolist()
    shift = node.constants["shift"].betensor.tolist()
    assert len(scale) == len(shift) == head + 2 * T
    assert node.constants["diff_shifts"].betensor.numel() == T
    h_scale = sym_scale(float(range_of(node, ph[0]).min), float(range_of(node, ph[0]).max), bits)
    s_x = np.float32(params_of(node, node.inputs[0]).scale)
    assert (scale[0], shift[0]) == approx(s_x / h_scale, bits)
    # cell state: step t rescales c_{t-1} to the candidate table's output scale, then to c_t's scale
    g_out = sym_scale(float(range_of(node, ph[4]).min), float(range_of(node, ph[4]).max), bits)
    f_out = sym_scale(float(range_of(node, ph[2]).min), float(range_of(node, ph[2]).max), bits)
    c_prev = np.float32(params_of(node, node.inputs[2]).scale)
    for t in range(T):
        c_t = sym_scale(float(range_of(node, ph[7 + t]).min), float(range_of(node, ph[7 + t]).max), bits)
        assert (scale[head + 2 * t], shift[head + 2 * t]) == approx(g_out / c_prev, bits)
        assert (scale[head + 2 * t + 1], shift[head + 2 * t + 1]) == approx(c_t / f_out / g_out, bits)
        c_prev = c_t
    for key in ("lut_it", "lut_ft", "lut_ot", "lut_ct", "lut_h"):
        table = node.constants[key].betensor
        assert table.numel() == 256 and int(table.abs().max()) <= 2 ** (bits - 1) - 1 + (bits == 8)
        if bits == 8:
            assert int(table[0]) == int(table[1])
    assert torch.equal(node.constants["lut_it"].betensor, node.constants["lut_ot"].betensor)
    assert node.params["lut_shift_value"] == (0 if bits == 8 else min(shift[0], min(shift[1:1 + (4 * C if per_channel
                                                                                                   else 1)]), 15))
    for t in node.outputs:
        q = params_of(node, t)
        assert (q.qmin, q.qmax, int(q.zerop)) == (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1, 0)


# --- integer forward -----------------------------------------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift); a negative shift multiplies."""
    if shift <= 0:
        return num << -shift
    q, r = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + 1 if r > half or (r == half and q % 2) else q


def rq(v: int, m: int, n: int, lo: int, hi: int) -> int:
    return min(max(rhe(v * m, n), lo), hi)


def lookup(table: List[int], q: int, bits: int) -> int:
    idx = min(max(q + 2 ** (bits - 1), 0), 2 ** bits - 1)
    lut = table + table[-1:]
    d = bits - 8
    if d == 0:
        v = lut[idx]
    else:
        hi, lo = idx >> d, idx & ((1 << d) - 1)
        v = lut[hi] + (((lut[hi + 1] - lut[hi]) * lo) >> d)
    return min(max(v, -(2 ** (bits - 1))), 2 ** (bits - 1) - 1)


def ref_lstm(node, x: np.ndarray, h0: np.ndarray, c0: np.ndarray, bits: int) -> Dict[str, np.ndarray]:
    """The integer forward of docs/semantics/recurrent.md (BasicLSTM, upstream form) in python ints."""
    i32 = (-(2 ** 31), 2 ** 31 - 1)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w = node.constants["weights"].betensor.to(torch.int64)
    if "weights_zp" in node.constants:
        w = w + node.constants["weights_zp"].betensor.to(torch.int64).reshape(-1, 1)
    else:
        w = w + int(node.params["weights_zp"])
    w = w.tolist()
    b = node.constants["biases"].betensor.to(torch.int64).tolist()
    sc = node.constants["scale"].betensor.to(torch.int64).tolist()
    sh = node.constants["shift"].betensor.to(torch.int64).tolist()
    diffs = node.constants["diff_shifts"].betensor.to(torch.int64).tolist()
    tables = {k: node.constants[k].betensor.to(torch.int64).tolist() for k in ("lut_it", "lut_ft", "lut_ot",
                                                                                "lut_ct", "lut_h")}
    ls = int(node.params["lut_shift_value"])
    per_channel = len(sc) > 5 + 2 * T
    head = 1 + 4 * C + C + 2 if per_channel else 5

    def gate(r: int):  # multiplier/shift of gate row r (rows of the g block: the candidate pair)
        if C <= r < 2 * C:
            k = 1 + 4 * C + (r - C) if per_channel else 2
        else:
            k = 1 + r if per_channel else 1
        return sc[k], sh[k]

    i_shift = [gate(r)[1] for r in range(C)]
    reverse = node.params.get("direction") == "reverse"
    out: Dict[str, List] = {"Y": [], "H": [], "C": []}
    for n in range(x.shape[0]):
        h = [int(v) for v in h0[n % h0.shape[0]]]
        c = [int(v) for v in c0[n % c0.shape[0]]]
        ys = []
        steps = range(T - 1, -1, -1) if reverse else range(T)
        for k, t in enumerate(steps):
            xt = [int(v) for v in x[n, t]]
            gin = []
            for r in range(4 * C):
                xw = sum(xt[j] * w[r][j] for j in range(IN))
                hw = sum(h[j] * w[r][IN + j] for j in range(C))
                m, s = gate(r)
                if bits == 8:
                    acc = xw + rq(hw, sc[0], sh[0], *i32) + b[r]
                    gin.append(rq(acc, m, s, qmin, qmax))
                else:
                    row_shift = sh[1 + r] if per_channel else sh[1]  # the gate shift of row r, every block
                    hw_s = rq(rq(hw, 1, sh[0] - ls, *i32), sc[0], row_shift, *i32)
                    acc = rq(xw, 1, row_shift - ls, *i32) + hw_s + rq(b[r], 1, row_shift - ls, *i32)
                    acc = min(max(acc, i32[0]), i32[1])
                    if C <= r < 2 * C:
                        gin.append(rq(acc, m, s - i_shift[r - C] + ls, qmin, qmax))
                    else:
                        gin.append(rq(acc, m, ls, qmin, qmax))
            i = [lookup(tables["lut_it"], v, bits) for v in gin[:C]]
            g = [lookup(tables["lut_ct"], v, bits) for v in gin[C:2 * C]]
            f = [lookup(tables["lut_ft"], v, bits) for v in gin[2 * C:3 * C]]
            o = [lookup(tables["lut_ot"], v, bits) for v in gin[3 * C:]]
            d = diffs[k]
            c_tmp = [min(max(rq(i[j] * g[j], 1, d, *i32) + rq(f[j] * c[j], sc[head + 2 * k], sh[head + 2 * k] + d,
                                                                 *i32), i32[0]), i32[1]) for j in range(C)]
            cell_in = [rq(v, sc[head - 2], sh[head - 2] - d, qmin + 1, qmax) for v in c_tmp]
            h = [rq(o[j] * lookup(tables["lut_h"], cell_in[j], bits), sc[head - 1], sh[head - 1], qmin + 1, qmax)
                 for j in range(C)]
            c = [rq(v, sc[head + 2 * k + 1], sh[head + 2 * k + 1] - d, qmin + 1, qmax) for v in c_tmp]
            ys.append(h)
        out["Y"].append(ys[::-1] if reverse else ys)
        out["H"].append(h)
        out["C"].append(c)
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


@pytest.mark.parametrize("steps", RECURRENT_STEPS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("params,wmode", CASES)
def test_integer_forward_matches_reference(monkeypatch, params: Dict[str, Any], wmode: str, bits: int,
                                           steps: str) -> None:
    """Bit for bit against the reference, each way the steps run (quant_helpers.RECURRENT_STEPS)."""
    stepped = choose_recurrent_steps(monkeypatch, steps, ["lstm_steps"])
    _, _, qg = quantized(params, bits, wmode)
    qg.forward(feeds(14, "BasicLSTM", n=3, x_std=1.5, h_scale=0.8))
    node = qg.node("op")
    x, h0, c0 = (t.betensor.numpy() for t in node.inputs)
    want = ref_lstm(node, x, h0, c0, bits)
    for name, t in zip(node.params["out_sequence"], node.outputs):
        assert t.betensor.dtype == torch.int64
        np.testing.assert_array_equal(t.betensor.numpy(), want[name], err_msg=name)
    assert ran_as_chosen(stepped, steps)


@pytest.mark.parametrize("numpy_steps", [True, False])
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("params,wmode", CASES)
def test_requantization_bounds_hold(monkeypatch, params: Dict[str, Any], wmode: str, bits: int,
                                    numpy_steps: bool) -> None:
    """The bound each step gives a requantization (from clamps, table entries and weight sums) is at least the
    largest |value| it requantizes, on inputs far outside the calibrated range too, in the numpy steps and the
    torch steps."""
    from quantopt.ops import _recurrent_steps

    if not numpy_steps:
        monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_VALUES", 0)
    checked = checked_requantization_bounds(monkeypatch)
    _, _, qg = quantized(params, bits, wmode)
    for x_std in (1.5, 20.0):
        qg.forward(feeds(14, "BasicLSTM", n=3, x_std=x_std, h_scale=0.8))
    assert checked


@pytest.mark.parametrize("bits,wmode,threshold", [(8, "per_tensor_symmetric_restricted_range", 0.98),
                                                  (8, "per_channel_symmetric_restricted_range", 0.98),
                                                  (16, "per_tensor_symmetric_restricted_range", 0.999),
                                                  (16, "per_channel_symmetric_restricted_range", 0.9)])
def test_dequantized_sequence_is_close_to_float(bits: int, wmode: str, threshold: float) -> None:
    """Y (and C, at the scale of the last cell state) dequantize close to the float cell. 16 bits with per-channel
    weights loses accuracy in upstream's form (docs/semantics/recurrent.md: its candidate rows are shifted by the
    input gate's shifts); the q15 form does not."""
    g, data, qg = quantized({}, bits, wmode)
    ref = [t.clone() for t in g.forward(data[0])]
    got = run_quantized(qg, data[0])
    assert cosine(ref[0], got[0]) > threshold
    np.testing.assert_allclose(got[0].numpy(), ref[0].numpy(), atol=0.1 if threshold > 0.95 else 0.5)
    _, _, q15 = quantized({}, bits, wmode, lstm_integer_form="q15")
    assert cosine(ref[0], run_quantized(q15, data[0])[0]) > (0.98 if bits == 8 else 0.9999)


def test_ir_round_trip_is_bit_identical(tmp_path) -> None:
    _, _, qg = quantized(CASES[1][0], 16, CASES[1][1])
    x = feeds(15, "BasicLSTM")
    before = [t.clone() for t in qg.forward(x)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(x)):
        assert torch.equal(a, b)


# --- the q15 form and errors ---------------------------------------------------------------------------------------
def test_q15_form_is_kept_behind_the_field_and_the_accurate_preset() -> None:
    _, _, qg = quantized({}, 8, "per_tensor_symmetric_restricted_range", lstm_integer_form="q15")
    node = qg.node("op")
    assert "gate_scale" in node.constants and "scale" not in node.constants and "lut_it" not in node.constants
    assert preset_settings("accurate")["lstm_integer_form"] == "q15"


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("params,wmode", CASES)
def test_onnx_export_is_exact(params: Dict[str, Any], wmode: str, bits: int) -> None:
    """The upstream form unrolled over the time steps in int64 (ops/recurrent.py `_convert_lstm_upstream`):
    onnxruntime gives the integer forward's outputs exactly, from an initial state of one row for two sequences
    too; the float modes have no form for it."""
    from quantopt.exporters.agreement import measure_agreement
    from quantopt.exporters.onnx_qdq import build_onnx_qdq

    _, _, qg = quantized(params, bits, wmode)
    for inputs in (feeds(14, "BasicLSTM", n=2, x_std=1.5, h_scale=0.8), feeds(15, "BasicLSTM", n=2, h_batch=1)):
        result = measure_agreement(qg, inputs, per_layer=True)
        assert result.identical == 1.0 and min(result.layers.values()) == 1.0
    with pytest.raises(UnsupportedError, match="exact mode only"):
        build_onnx_qdq(qg, scales="effective")


def test_missing_placeholder_ranges_are_named() -> None:
    _, w, b = lstm_weights(10)
    g = build("BasicLSTM", {}, w, b)
    data = [feeds(11, "BasicLSTM")]
    qg = quantize_model(g, data, settings(8, "per_tensor_symmetric_restricted_range"))  # fine with them
    assert "scale" in qg.node("op").constants
    from quantopt.ops.recurrent import lstm_upstream_quantize, rnn_spec

    node = g.node("op")
    full = node.placeholders
    node.placeholders = full[:3]
    with pytest.raises(IRError, match="placeholder 'op/g_lut_in' is missing"):
        lstm_upstream_quantize(node, rnn_spec(node))
    node.placeholders = full
    for t in full:
        set_range(node, t, None, None)
    with pytest.raises(IRError, match="placeholder 'op/f_lut_in' has no calibrated range"):
        lstm_upstream_quantize(node, rnn_spec(node))


def test_table_bound_clamps_the_gate_range() -> None:
    """The gate table input range is clamped to ±4.564205 (8 bits): with a wide gate range the input scale is
    256 · 127 / 4.564205 (the 8-bit gate multipliers carry 8 more shift bits)."""
    _, w, b = lstm_weights(10)
    g = build("BasicLSTM", {}, w * 6.0, b)
    data = [feeds(s, "BasicLSTM", x_std=3.0) for s in (11, 12)]
    qg = quantize_model(g, data, settings(8, "per_tensor_symmetric_restricted_range"))
    node = qg.node("op")
    ph = node.placeholders[1]
    assert max(abs(float(range_of(node, ph).min)), float(range_of(node, ph).max)) > 4.6
    s_x, s_w = np.float32(params_of(node, node.inputs[0]).scale), np.float32(node.params["weights_scale"])
    in_scale = np.float32(127) / np.float32(4.564205) * np.float32(256)
    m, n = approx(in_scale / (s_x * s_w), 8)
    assert (int(node.constants["scale"].betensor[1]), int(node.constants["shift"].betensor[1])) == (m, n + 8)
    assert math.isfinite(float(params_of(node, node.outputs[0]).scale))
