"""GRUv1/GRUv3 in upstream's integer form (gru_integer_form = upstream, the default; docs/semantics/recurrent.md):
the cell's inner tensors recorded as placeholders (against a numpy cell), the four weight blocks and the six
multiplier/shift pairs from their calibrated ranges (against an independent float32 computation), the integer
forward against a python-int reference written from the docs, dequantized outputs against the float cell, the IR
round trip, the q15 form kept behind the field, errors."""
from __future__ import annotations

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
from range_helpers import range_of
from test_lstm_upstream import approx, lookup, rq, sym_scale
from test_recurrent import IN, C, T, build, feeds, gru_weights, np_sigmoid

import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
from quantopt.analysis.similarity import cosine
from quantopt.config.presets import preset_settings
from quantopt.errors import IRError, UnsupportedError
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

CASES = [("GRUv1", {}, "per_tensor_symmetric_restricted_range"),
         ("GRUv1", {"direction": "reverse", "out_sequence": ["H", "Hn"]}, "per_channel_symmetric_restricted_range"),
         ("GRUv3", {"version": "GRUV3", "out_sequence": ["Hn"]}, "per_tensor_symmetric_restricted_range"),
         ("GRUv3", {"version": "GRUV3"}, "per_channel_symmetric_restricted_range")]


def version(optype: str, params: Dict[str, Any]) -> str:
    return params.get("version", "GRUV1" if optype == "GRUv1" else "GRUV3")


def settings(bits: int, wmode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation="per_tensor_asymmetric", q_mode_weight=wmode,
                q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32, q_strategy_activation="extrema", **extra)


def quantized(optype: str, params: Dict[str, Any], bits: int, wmode: str, **extra: Any):
    _, w, b = gru_weights(10, version(optype, params))
    g = build(optype, params, w, b)
    data = [feeds(s, optype) for s in (11, 12, 13)]
    return g, data, quantize_model(g, data, settings(bits, wmode, **extra))


# --- placeholders --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ver", ["GRUV1", "GRUV3"])
def test_float_forward_records_the_cell_tensors_as_placeholders(ver: str) -> None:
    _, w, b = gru_weights(2, ver)
    g = build("GRUv3", {"version": ver}, w, b)
    x, h0 = feeds(3, "GRUv3")
    g.forward([x, h0])
    ph = g.node("op").placeholders
    assert [t.name for t in ph] == [f"op/{n}" for n in ("state_batch", "f_lut_in", "f_lut_out", "g_lut_in",
                                                         "g_lut_out", "hidden_gate_out")]
    w64, h = w.astype(np.float64), h0.numpy().astype(np.float64)
    hs, fin, fout, gin, gout, hid = [], [], [], [], [], []
    for t in range(T):
        xt = x.numpy()[:, t].astype(np.float64)
        z = np.concatenate([xt, h], 1) @ w64[:2 * C].T + b[:2 * C]
        rz = np_sigmoid(z)
        r, u = rz[:, :C], rz[:, C:]
        if ver == "GRUV1":
            hn = h @ w64[2 * C:, IN:].T + b[3 * C:]
            pre = xt @ w64[2 * C:, :IN].T + b[2 * C:3 * C] + r * hn
        else:
            hn = np.zeros_like(h)
            pre = np.concatenate([xt, r * h], 1) @ w64[2 * C:].T + b[2 * C:3 * C]
        n = np.tanh(pre)
        h = (1 - u) * n + u * h
        for lst, v in zip((hs, fin, fout, gin, gout, hid), (h, z, rz, pre, n, hn)):
            lst.append(v)
    for t, ref in zip(ph, [np.stack(v, 1) for v in (hs, fin, fout, gin, gout, hid)]):
        np.testing.assert_allclose(t.betensor.numpy(), ref, atol=2e-6)


# --- quantize ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params,wmode", CASES)
def test_constants_follow_the_weight_blocks_and_placeholder_ranges(optype: str, params: Dict[str, Any], wmode: str,
                                                                  bits: int) -> None:
    g, _, qg = quantized(optype, params, bits, wmode)
    node = qg.node("op")
    wf = g.node("op").constants["weights"].betensor.numpy().astype(np.float32)
    per_channel = wmode.startswith("per_channel")
    qmax = 2 ** (bits - 1) - 1
    blocks = [(slice(0, 2 * C), slice(0, IN)), (slice(0, 2 * C), slice(IN, IN + C)),
              (slice(2 * C, 3 * C), slice(0, IN)), (slice(2 * C, 3 * C), slice(IN, IN + C))]
    scales = []
    wq = node.constants["weights"].betensor.numpy()
    for rows, cols in blocks:
        blk = wf[rows, cols]
        absmax = np.abs(blk).max(axis=1) if per_channel else np.abs(blk).max()
        s = (np.float32(qmax) / np.asarray(absmax, np.float32)).astype(np.float32).reshape(-1)
        scales.append(s)
        want = np.clip(np.round(blk * (s.reshape(-1, 1) if per_channel else s[0])), -qmax, qmax)
        np.testing.assert_array_equal(wq[rows, cols], want)
    np.testing.assert_array_equal(node.constants["weights_scale"].betensor.numpy(), np.concatenate(scales))
    assert node.constants["weights_zp"].betensor.numel() == (6 * C if per_channel else 4)
    ph = node.placeholders
    h_scale = sym_scale(float(range_of(node, ph[0]).min), float(range_of(node, ph[0]).max), bits)
    s_x = np.float32(params_of(node, node.inputs[0]).scale)
    if per_channel:
        got_scale = node.constants["scale"].betensor.tolist()
        got_shift = node.constants["shift"].betensor.tolist()
        first = list(zip(got_scale[:2 * C], got_shift[:2 * C]))
        assert first == [approx(v, bits) for v in (s_x * scales[0]) / (h_scale * scales[1])]
    else:
        got_scale, got_shift = node.params["scale_value"], node.params["shift_value"]
        assert len(got_scale) == len(got_shift) == 6
        assert (got_scale[0], got_shift[0]) == approx((s_x * scales[0][0]) / (h_scale * scales[1][0]), bits)
        g_out = sym_scale(float(range_of(node, ph[4]).min), float(range_of(node, ph[4]).max), bits)
        assert (got_scale[4], got_shift[4]) == approx(h_scale / g_out, bits)
        f_out = sym_scale(float(range_of(node, ph[2]).min), float(range_of(node, ph[2]).max), bits)
        assert (got_scale[5], got_shift[5]) == approx(np.float32(1.0) / f_out, bits)
    for key in ("lut_rt", "lut_zt", "lut_ht"):
        assert node.constants[key].betensor.numel() == 256
    assert torch.equal(node.constants["lut_rt"].betensor, node.constants["lut_zt"].betensor)
    if version(optype, params) == "GRUV1" and not per_channel:
        hid = sym_scale(float(range_of(node, ph[5]).min), float(range_of(node, ph[5]).max), bits)
        want = approx(hid / (h_scale * scales[3][0]), bits)
        assert (node.params["hidden_scale_value"], node.params["hidden_shift_value"]) == want
    b_scale = node.constants["biases_scale"].betensor.numpy()
    np.testing.assert_array_equal(b_scale, np.concatenate([s_x * scales[0], s_x * scales[2]]))
    for t in node.outputs:
        q = params_of(node, t)
        assert (q.qmin, q.qmax, int(q.zerop)) == (-qmax, qmax, 0)


# --- integer forward -----------------------------------------------------------------------------------------------
def ref_gru(node, x: np.ndarray, h0: np.ndarray, bits: int) -> Dict[str, np.ndarray]:
    """The integer forward of docs/semantics/recurrent.md (GRU, upstream form) in python ints."""
    i32 = (-(2 ** 31), 2 ** 31 - 1)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    v1 = node.params.get("version", "GRUV1" if str(node.type) == "GRUv1" else "GRUV3") == "GRUV1"
    w = node.constants["weights"].betensor.to(torch.int64).tolist()
    zp = node.constants["weights_zp"].betensor.to(torch.int64).tolist()
    blocks = [(0, 2 * C, 0, IN), (0, 2 * C, IN, IN + C), (2 * C, 3 * C, 0, IN), (2 * C, 3 * C, IN, IN + C)]
    k = 0
    for bi, (r0, r1, c0, c1) in enumerate(blocks):
        for r in range(r0, r1):
            z = zp[k] if len(zp) > 4 else zp[bi]
            k += len(zp) > 4
            for c in range(c0, c1):
                w[r][c] += z
    b = node.constants["biases"].betensor.to(torch.int64).tolist()
    per_channel = "scale" in node.constants
    if per_channel:
        sc = node.constants["scale"].betensor.to(torch.int64).tolist()
        sh = node.constants["shift"].betensor.to(torch.int64).tolist()
        starts = [0, 2 * C, 4 * C, 5 * C, 6 * C, 6 * C + 1]

        def pair(i: int, row: int):
            return (sc[starts[i] + row], sh[starts[i] + row]) if i < 4 else (sc[starts[i]], sh[starts[i]])
        if v1:
            hm = node.constants["hidden_scale"].betensor.tolist()
            hn = node.constants["hidden_shift"].betensor.tolist()
    else:
        sc, sh = node.params["scale_value"], node.params["shift_value"]

        def pair(i: int, row: int):
            return sc[i], sh[i]
        if v1:
            hm, hn = [node.params["hidden_scale_value"]] * C, [node.params["hidden_shift_value"]] * C
    rt = node.constants["lut_rt"].betensor.to(torch.int64).tolist()
    ht = node.constants["lut_ht"].betensor.to(torch.int64).tolist()
    rem = 10
    reverse = node.params.get("direction") == "reverse"
    out: Dict[str, List] = {"H": [], "Hn": []}

    def pre(i: int, row: int) -> int:  # 16 bits: what shift i exceeds remain_shift by, applied first
        return max(pair(i, row)[1] - rem, 0) if bits > 8 else 0

    def post(i: int, row: int) -> int:
        return min(pair(i, row)[1], rem) if bits > 8 else pair(i, row)[1]

    for n in range(x.shape[0]):
        h = [int(v) for v in h0[n % h0.shape[0]]]
        ys = []
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            xt = [int(v) for v in x[n, t]]
            gates = []
            for r in range(2 * C):
                xg = sum(xt[j] * w[r][j] for j in range(IN))
                hg = sum(h[j] * w[r][IN + j] for j in range(C))
                m0 = pair(0, r)[0]
                hg = rq(rq(hg, 1, pre(0, r), *i32), m0, post(0, r) + pre(1, r), *i32)
                acc = rq(xg, 1, pre(1, r), *i32) + hg + rq(b[r], 1, pre(1, r), *i32)
                gates.append(lookup(rt, rq(acc, pair(1, r)[0], post(1, r), qmin, qmax), bits))
            rr, u = gates[:C], gates[C:]
            new_h = []
            cand = []
            for j in range(C):
                r = 2 * C + j
                xc = sum(xt[i] * w[r][i] for i in range(IN))
                if v1:
                    bh = rq(b[3 * C + j], 1, pre(2, j), *i32)
                    hc = rr[j] * rq(sum(h[i] * w[r][IN + i] for i in range(C)) + bh, hm[j], hn[j], qmin, qmax)
                else:
                    hr = [rq(rr[i] * h[i], 1, bits, *i32) for i in range(C)]
                    hc = sum(hr[i] * w[r][IN + i] for i in range(C))
                hc = rq(rq(hc, 1, pre(2, j), *i32), pair(2, j)[0], post(2, j) + pre(3, j), *i32)
                acc = rq(xc, 1, pre(3, j), *i32) + hc + rq(b[r], 1, pre(3, j), *i32)
                cand.append(lookup(ht, rq(acc, pair(3, j)[0], post(3, j), qmin, qmax), bits))
            for j in range(C):
                cu = rq((qmax - u[j]) * cand[j], pair(4, 0)[0], pair(4, 0)[1], *i32)
                new_h.append(rq(cu + u[j] * h[j], pair(5, 0)[0], pair(5, 0)[1], qmin + 1, qmax))
            h = new_h
            ys.append(h)
        out["H"].append(ys[::-1] if reverse else ys)
        out["Hn"].append(h)
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


@pytest.mark.parametrize("steps", RECURRENT_STEPS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params,wmode", CASES)
def test_integer_forward_matches_reference(monkeypatch, optype: str, params: Dict[str, Any], wmode: str, bits: int,
                                           steps: str) -> None:
    """Bit for bit against the reference, each way the steps run (quant_helpers.RECURRENT_STEPS)."""
    stepped = choose_recurrent_steps(monkeypatch, steps, ["gru_steps"])
    _, _, qg = quantized(optype, params, bits, wmode)
    qg.forward(feeds(14, optype, n=3, x_std=1.5, h_scale=0.8))
    node = qg.node("op")
    x, h0 = (t.betensor.numpy() for t in node.inputs)
    want = ref_gru(node, x, h0, bits)
    for name, t in zip(node.params["out_sequence"], node.outputs):
        assert t.betensor.dtype == torch.int64
        np.testing.assert_array_equal(t.betensor.numpy(), want[name], err_msg=name)
    assert ran_as_chosen(stepped, steps)


@pytest.mark.parametrize("numpy_steps", [True, False])
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params,wmode", CASES)
def test_requantization_bounds_hold(monkeypatch, optype: str, params: Dict[str, Any], wmode: str, bits: int,
                                    numpy_steps: bool) -> None:
    """The bound each step gives a requantization (from clamps, table entries and weight sums) is at least the
    largest |value| it requantizes, on inputs far outside the calibrated range too, in the numpy steps and the
    torch steps."""
    from quantopt.ops import _recurrent_steps

    if not numpy_steps:
        monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_VALUES", 0)
    checked = checked_requantization_bounds(monkeypatch)
    _, _, qg = quantized(optype, params, bits, wmode)
    for x_std in (1.5, 20.0):
        qg.forward(feeds(14, optype, n=3, x_std=x_std, h_scale=0.8))
    assert checked


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params,wmode", CASES)
def test_dequantized_outputs_are_close_to_float(optype: str, params: Dict[str, Any], wmode: str, bits: int) -> None:
    """Upstream's form is coarse whatever the bits (docs/semantics/recurrent.md: the update gate's complement is
    taken as qmax - u, and a GRUV1's hidden candidate is rescaled by its integer multiplier): cosine above 0.96 on
    gates that saturate; the q15 form stays above 0.999."""
    _, w, b = gru_weights(10, version(optype, params))
    g = build(optype, params, w * 3, b)
    data = [feeds(s, optype, x_std=3.0, n=8) for s in (11, 12, 13)]
    qg = quantize_model(g, data, settings(bits, wmode))
    q15 = quantize_model(g, data, settings(bits, wmode, gru_integer_form="q15"))
    ref = [t.clone() for t in g.forward(data[0])]
    for a, b, c in zip(ref, run_quantized(qg, data[0]), run_quantized(q15, data[0])):
        assert cosine(a, b) > 0.96
        assert cosine(a, c) > 0.999


def test_ir_round_trip_is_bit_identical(tmp_path) -> None:
    for k, (optype, params, wmode) in enumerate(CASES):
        _, _, qg = quantized(optype, params, 16 if k % 2 else 8, wmode)
        x = feeds(15, optype)
        before = [t.clone() for t in qg.forward(x)]
        re = read_ir(write_ir(qg, str(tmp_path / f"q{k}.txt"))[0])
        for a, b in zip(before, re.forward(x)):
            assert torch.equal(a, b)


# --- the q15 form and errors ---------------------------------------------------------------------------------------
def test_q15_form_is_kept_behind_the_field_and_the_accurate_preset() -> None:
    _, _, qg = quantized("GRUv1", {}, 8, "per_tensor_symmetric_restricted_range", gru_integer_form="q15")
    node = qg.node("op")
    assert "gate_scale" in node.constants and "lut_rt" not in node.constants
    assert preset_settings("accurate")["gru_integer_form"] == "q15"


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params,wmode", CASES)
def test_onnx_export_is_exact(optype: str, params: Dict[str, Any], wmode: str, bits: int) -> None:
    """The upstream form unrolled over the time steps in int64 (ops/recurrent.py `_convert_gru_upstream`; reset
    before and after the hidden product): onnxruntime gives the integer forward's outputs exactly, from an initial
    state of one row for two sequences too; the float modes have no form for it."""
    from quantopt.exporters.agreement import measure_agreement
    from quantopt.exporters.onnx_qdq import build_onnx_qdq

    _, _, qg = quantized(optype, params, bits, wmode)
    for inputs in (feeds(14, optype, n=2, x_std=1.5, h_scale=0.8), feeds(15, optype, n=2, h_batch=1)):
        result = measure_agreement(qg, inputs, per_layer=True)
        assert result.identical == 1.0 and min(result.layers.values()) == 1.0
    with pytest.raises(UnsupportedError, match="exact mode only"):
        build_onnx_qdq(qg, scales="effective")


def test_missing_placeholder_ranges_and_bad_zero_points_are_named() -> None:
    from quantopt.ops.recurrent import gru_upstream_forward, gru_upstream_quantize, rnn_spec

    _, w, b = gru_weights(10, "GRUV1")
    g = build("GRUv1", {}, w, b)
    qg = quantize_model(g, [feeds(11, "GRUv1")], settings(8, "per_tensor_symmetric_restricted_range"))
    node = g.node("op")
    full = node.placeholders
    node.placeholders = full[:5]
    with pytest.raises(IRError, match="placeholder 'op/hidden_gate_out' is missing"):
        gru_upstream_quantize(node, rnn_spec(node))
    qnode = qg.node("op")
    qnode.constants["weights_zp"].betensor = torch.zeros(3, dtype=torch.int64)
    qnode.inputs[0].betensor = torch.zeros(1, T, IN, dtype=torch.int64)
    qnode.inputs[1].betensor = torch.zeros(1, C, dtype=torch.int64)
    with pytest.raises(IRError, match="weights_zp' must hold 4 or 30 values"):
        gru_upstream_forward(qnode, rnn_spec(qnode))


def test_per_block_weights_are_refused_by_name() -> None:
    _, w, b = gru_weights(10, "GRUV1")
    g = build("GRUv1", {}, w, b)
    with pytest.raises(UnsupportedError, match="per-block weights are not supported by the upstream GRU form"):
        quantize_model(g, [feeds(11, "GRUv1")], settings(8, "per_block_symmetric_restricted_range"))
