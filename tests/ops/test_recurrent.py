"""BasicLSTM and GRUv3: float forward against torch.nn.LSTM / torch.nn.GRU and a numpy cell, integer forward against
an independent python-int reference written from docs/semantics/recurrent.md, float-vs-dequantized cosine, IR write
→ re-read, parameter errors."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

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

import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

N, T, IN, C = 2, 4, 3, 5
LSTM_PERM = [0, 2, 1, 3]  # torch gate blocks i, f, g, o -> BasicLSTM blocks i, g, f, o


def lstm_weights(seed: int) -> Tuple[torch.nn.LSTM, np.ndarray, np.ndarray]:
    torch.manual_seed(seed)
    m = torch.nn.LSTM(IN, C, batch_first=True)
    wi, wh = m.weight_ih_l0.detach(), m.weight_hh_l0.detach()
    bsum = (m.bias_ih_l0 + m.bias_hh_l0).detach()
    w = torch.cat([torch.cat([wi[k * C:(k + 1) * C], wh[k * C:(k + 1) * C]], 1) for k in LSTM_PERM], 0)
    b = torch.cat([bsum[k * C:(k + 1) * C] for k in LSTM_PERM])
    return m, w.numpy(), b.numpy()


def gru_weights(seed: int, version: str) -> Tuple[torch.nn.GRU, np.ndarray, np.ndarray]:
    """torch.nn.GRU gate blocks r, z, n map directly; GRUV1 keeps the hidden candidate bias as a fourth block."""
    torch.manual_seed(seed)
    m = torch.nn.GRU(IN, C, batch_first=True)
    w = torch.cat([m.weight_ih_l0.detach(), m.weight_hh_l0.detach()], 1)
    bi, bh = m.bias_ih_l0.detach(), m.bias_hh_l0.detach()
    b = torch.cat([bi[:2 * C] + bh[:2 * C], bi[2 * C:]] + ([bh[2 * C:]] if version == "GRUV1" else []))
    return m, w.numpy(), b.numpy()


def build(optype: str, params: Dict[str, Any], w: np.ndarray, b: np.ndarray, batch_h: int = 1):
    bld = GraphBuilder("rnn")
    x = bld.input("x", [1, T, IN])
    h = bld.input("h", [batch_h, C])
    ins = [x, h]
    if optype == "BasicLSTM":
        ins.append(bld.input("c", [batch_h, C]))
    seq = params.get("out_sequence", ["Y", "H", "C"] if optype == "BasicLSTM" else ["H"])
    shapes = [[1, T, C] if s == ("Y" if optype == "BasicLSTM" else "H") else [1, C] for s in seq]
    p = dict(time_steps=T, input_size=IN, cell_size=C, direction="forward", out_sequence=seq)
    p.update(params)
    outs = bld.layer(optype, ins, shapes, name="op", params=p, constants=dict(weights=w, biases=b))
    return bld.build(outs if isinstance(outs, list) else [outs])


def feeds(seed: int, optype: str, n: int = N, h_scale: float = 0.5, x_std: float = 1.0,
          h_batch: int = 0) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    hb = h_batch or n
    out = [torch.from_numpy(r.normal(0.2, x_std, (n, T, IN)).astype(np.float32)),
           torch.from_numpy((r.uniform(-1, 1, (hb, C)) * h_scale).astype(np.float32))]
    if optype == "BasicLSTM":
        out.append(torch.from_numpy(r.normal(0, 1.0, (hb, C)).astype(np.float32)))
    return out


# --- 1. float forward ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_lstm_float_matches_torch(direction: str) -> None:
    m, w, b = lstm_weights(0)
    g = build("BasicLSTM", {"direction": direction}, w, b)
    x, h0, c0 = feeds(1, "BasicLSTM")
    y, hn, cn = g.forward([x, h0, c0])
    xin = torch.flip(x, [1]) if direction == "reverse" else x
    ref, (rh, rc) = m(xin, (h0[None], c0[None]))
    ref = torch.flip(ref, [1]) if direction == "reverse" else ref
    torch.testing.assert_close(y, ref.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(hn, rh[0].detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(cn, rc[0].detach(), atol=1e-6, rtol=0)


def np_sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def np_lstm(x, h, c, w, b, forget_bias=0.0, threshold=np.inf, cell_clip=np.inf):
    """TF BasicLSTMCell equations, gate blocks i, j(g), f, o."""
    x, h, c = (np.asarray(v, np.float64) for v in (x, h, c))
    ys = []
    for t in range(x.shape[1]):
        z = np.concatenate([x[:, t], h], 1) @ np.asarray(w, np.float64).T + b
        zi, zg, zf, zo = np.split(z, 4, axis=1)
        i = np_sigmoid(np.clip(zi, -threshold, threshold))
        g = np.tanh(np.clip(zg, -threshold, threshold))
        f = np_sigmoid(np.clip(zf + forget_bias, -threshold, threshold))
        o = np_sigmoid(np.clip(zo, -threshold, threshold))
        c = np.clip(f * c + i * g, -cell_clip, cell_clip)
        h = o * np.tanh(c)
        ys.append(h)
    return np.stack(ys, 1), h, c


def test_lstm_float_forget_bias_threshold_cell_clip_match_numpy() -> None:
    _, w, b = lstm_weights(2)
    params = {"forget_bias": 1.0, "threshold": 1.5, "cell_clip": 0.8, "out_sequence": ["C", "Y"]}
    g = build("BasicLSTM", params, w, b)
    x, h0, c0 = feeds(3, "BasicLSTM", x_std=2.0)
    cn, y = g.forward([x, h0, c0])
    ry, _, rc = np_lstm(x.numpy(), h0.numpy(), c0.numpy(), w, b, 1.0, 1.5, 0.8)
    np.testing.assert_allclose(y.numpy(), ry, atol=2e-6)
    np.testing.assert_allclose(cn.numpy(), rc, atol=2e-6)


def test_lstm_float_forward_is_float64_rounded_once() -> None:
    """Upstream's BasicLSTM computes in float64: each output is the numpy float64 cell rounded once to float32, and
    the float64 value is kept for the readers of unrounded values."""
    _, w, b = lstm_weights(12)
    g = build("BasicLSTM", {"forget_bias": 0.5}, w, b)
    x, h0, c0 = feeds(13, "BasicLSTM", x_std=2.0)
    outs = g.forward([x, h0, c0], keep_tensors=True)  # graph outputs keep their float64 values only so
    refs = np_lstm(x.numpy(), h0.numpy(), c0.numpy(), w, b, 0.5)
    for out, t, ref in zip(outs, g.node("op").outputs, refs):
        assert out.dtype == torch.float32
        np.testing.assert_array_equal(out.numpy(), ref.astype(np.float32))
        wide = g.wide_values.get(t)
        assert wide is not None and wide.dtype == torch.float64
        np.testing.assert_allclose(wide.numpy(), ref, rtol=0, atol=1e-13)


def test_stacked_lstm_reads_the_first_layer_unrounded() -> None:
    """A BasicLSTM reading another's sequence output takes its float64 value, as upstream's second layer does."""
    _, w1, b1 = lstm_weights(14)
    torch.manual_seed(15)
    w2 = (torch.rand(4 * C, 2 * C) - 0.5).numpy()
    b2 = (torch.rand(4 * C) - 0.5).numpy()
    bld = GraphBuilder("stack")
    x, h, c = bld.input("x", [1, T, IN]), bld.input("h", [1, C]), bld.input("c", [1, C])
    p = dict(time_steps=T, cell_size=C, direction="forward", out_sequence=["Y"])
    y1 = bld.layer("BasicLSTM", [x, h, c], [[1, T, C]], name="l1", params={**p, "input_size": IN},
                   constants=dict(weights=w1, biases=b1))
    y2 = bld.layer("BasicLSTM", [y1, h, c], [[1, T, C]], name="l2", params={**p, "input_size": C},
                   constants=dict(weights=w2, biases=b2))
    g = bld.build([y2])
    xs, h0, c0 = feeds(16, "BasicLSTM", n=1, x_std=2.0)
    got = g.forward([xs, h0, c0])[0]
    first = np_lstm(xs.numpy(), h0.numpy(), c0.numpy(), w1, b1)[0]
    np.testing.assert_array_equal(got.numpy(), np_lstm(first, h0.numpy(), c0.numpy(), w2, b2)[0].astype(np.float32))


def np_gru_v3(x, h, w, b, threshold=np.inf):
    """Reset applied before the candidate matmul (ONNX linear_before_reset=0, TF GRUCell), gates r, z."""
    x, h = np.asarray(x, np.float64), np.asarray(h, np.float64)
    w = np.asarray(w, np.float64)
    ys = []
    for t in range(x.shape[1]):
        rz = np_sigmoid(np.clip(np.concatenate([x[:, t], h], 1) @ w[:2 * C].T + b[:2 * C], -threshold, threshold))
        r, z = rz[:, :C], rz[:, C:]
        n = np.tanh(np.clip(np.concatenate([x[:, t], r * h], 1) @ w[2 * C:].T + b[2 * C:3 * C],
                            -threshold, threshold))
        h = (1 - z) * n + z * h
        ys.append(h)
    return np.stack(ys, 1), h


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_gruv1_float_matches_torch_gru(direction: str) -> None:
    m, w, b = gru_weights(4, "GRUV1")
    g = build("GRUv3", {"version": "GRUV1", "direction": direction, "out_sequence": ["H", "Hn"]}, w, b)
    x, h0 = feeds(5, "GRUv3")
    y, hn = g.forward([x, h0])
    xin = torch.flip(x, [1]) if direction == "reverse" else x
    ref, rh = m(xin, h0[None])
    ref = torch.flip(ref, [1]) if direction == "reverse" else ref
    torch.testing.assert_close(y, ref.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(hn, rh[0].detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("params", [{}, {"threshold": 1.0, "out_sequence": ["Hn"]}])
def test_gruv3_float_matches_numpy(params: Dict[str, Any]) -> None:
    _, w, b = gru_weights(6, "GRUV3")
    g = build("GRUv3", params, w, b)
    x, h0 = feeds(7, "GRUv3", x_std=2.0)
    got = g.forward([x, h0])[0]
    ry, rh = np_gru_v3(x.numpy(), h0.numpy(), w, b, params.get("threshold", np.inf))
    np.testing.assert_allclose(got.numpy(), rh if params.get("out_sequence") == ["Hn"] else ry, atol=2e-6)


def test_initial_state_batch_one_is_shared() -> None:
    _, w, b = lstm_weights(8)
    g = build("BasicLSTM", {}, w, b)
    x, h0, c0 = feeds(9, "BasicLSTM", n=3, h_batch=1)
    y = g.forward([x, h0, c0])[0]
    ry, _, _ = np_lstm(x.numpy(), np.repeat(h0.numpy(), 3, 0), np.repeat(c0.numpy(), 3, 0), w, b)
    np.testing.assert_allclose(y.numpy(), ry, atol=2e-6)


# --- 2. integer forward == python-int reference -------------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift) with python ints (shift <= 0: exact left shift)."""
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def table(node, key: str, q: int, bits: int) -> int:
    """Q15 table read: index q + 2^(bits-1) (restricted range), high bits select, low bits interpolate (floor)."""
    tab = [int(v) for v in node.constants[key].betensor.tolist()]
    idx = clamp(q + 2 ** (bits - 1), 0, 2 ** bits - 1)
    tb = len(tab).bit_length() - 1
    if bits <= tb:
        v = tab[min(idx, len(tab) - 1)]
    else:
        s = bits - tb
        hi, lo = idx >> s, idx & ((1 << s) - 1)
        a = tab[hi]
        c = tab[hi + 1] if hi + 1 < len(tab) else a
        v = a + ((c - a) * lo) // (1 << s)
    return clamp(v, -32768, 32767)


def dot(row: Sequence[int], vec: Sequence[int]) -> int:
    return sum(int(a) * int(b) for a, b in zip(row, vec))


def ref_rnn(node, x_q: np.ndarray, h_q: np.ndarray, c_q) -> List[np.ndarray]:
    """The documented integer computation, element by element with python ints."""
    p = node.params
    kind = "LSTM" if str(node.type) == "BasicLSTM" else "GRU"
    bits, hf = p["gate_bits"], p["hidden_frac_bits"]
    hq = 2 ** (bits - 1) - 1
    w = node.constants["weights"].betensor.long()
    wzp = node.constants["weights_zp"].betensor.long().reshape(-1, 1) if "weights_zp" in node.constants else \
        int(p.get("weights_zp", 0))
    w = (w + wzp).tolist()
    bias = [int(v) for v in node.constants["biases"].betensor.tolist()]
    gm = node.constants["gate_scale"].betensor.tolist()
    gs = node.constants["gate_shift"].betensor.tolist()
    mh, nh = p["hidden_scale_value"], p["hidden_shift_value"]
    clamp0, clamp1 = p["gate_clamp_value"]
    rows = 4 * C if kind == "LSTM" else 3 * C
    act1_rows = range(C, 2 * C) if kind == "LSTM" else range(2 * C, 3 * C)
    zp = {t.name: int(params_of(node, t).zerop) for t in node.inputs}
    reverse = p["direction"] == "reverse"
    out_m, out_s = p["out_scale_value"], p["out_shift_value"]
    seq_name = "Y" if kind == "LSTM" else "H"
    results = {name: np.zeros((x_q.shape[0], T, C) if name == seq_name else (x_q.shape[0], C), np.int64)
               for name in p["out_sequence"]}
    for n in range(x_q.shape[0]):
        hrow = h_q[n % h_q.shape[0]]
        h = [clamp(rhe((int(v) + zp["h"]) * p["init_h_scale_value"], p["init_h_shift_value"]), -hq, hq)
             for v in hrow]
        if kind == "LSTM":
            crow = c_q[n % c_q.shape[0]]
            cf = p["cell_frac_bits"]
            c = [clamp(rhe((int(v) + zp["c"]) * p["init_c_scale_value"], p["init_c_shift_value"]),
                       -(2 ** 31 - 1), 2 ** 31 - 1) for v in crow]
            clip = p.get("cell_clip_value", 2 ** 31 - 1)
        prods: List[List[int]] = []
        for step in range(T):
            t = T - 1 - step if reverse else step
            x = [int(v) for v in x_q[n, t]]

            def gate(r: int, hvec: List[int], x: List[int] = x) -> int:
                acc = dot(w[r][:IN], x) + bias[r] + rhe(dot(w[r][IN:], hvec) * mh, nh)
                bound = clamp1 if r in act1_rows else clamp0
                return clamp(rhe(acc * gm[r], gs[r]), -bound, bound)
            if kind == "LSTM":
                gin = [gate(r, h) for r in range(rows)]
                i = [table(node, "lut_gate", v, bits) for v in gin[:C]]
                g = [table(node, "lut_cand", v, bits) for v in gin[C:2 * C]]
                f = [table(node, "lut_gate", v, bits) for v in gin[2 * C:3 * C]]
                o = [table(node, "lut_gate", v, bits) for v in gin[3 * C:]]
                c = [clamp(rhe(f[k] * c[k] * 2 ** 15 + i[k] * g[k] * 2 ** cf, 30), -clip, clip) for k in range(C)]
                cin = [clamp(rhe(v * p["cell_scale_value"], p["cell_shift_value"]), -hq, hq) for v in c]
                prod = [o[k] * table(node, "lut_cell", cin[k], bits) for k in range(C)]
            else:
                rz = [table(node, "lut_gate", gate(r, h), bits) for r in range(2 * C)]
                r_, z = rz[:C], rz[C:]
                if p.get("version") == "GRUV1":
                    hn = [dot(w[2 * C + k][IN:], h) + bias[3 * C + k] for k in range(C)]
                    hpart = [rhe(r_[k] * hn[k], 15) for k in range(C)]
                    pre = [dot(w[2 * C + k][:IN], x) + bias[2 * C + k] + rhe(hpart[k] * mh, nh) for k in range(C)]
                else:
                    rh = [rhe(r_[k] * h[k], 15) for k in range(C)]
                    pre = [dot(w[2 * C + k][:IN], x) + bias[2 * C + k] + rhe(dot(w[2 * C + k][IN:], rh) * mh, nh)
                           for k in range(C)]
                nn_ = [table(node, "lut_cand", clamp(rhe(pre[k] * gm[2 * C + k], gs[2 * C + k]), -clamp1, clamp1),
                             bits) for k in range(C)]
                prod = [(32768 - z[k]) * nn_[k] + z[k] * h[k] * 2 ** (15 - hf) for k in range(C)]
            h = [clamp(rhe(v, 30 - hf), -hq, hq) for v in prod]
            prods.append(prod)
        finals = {"H" if kind == "LSTM" else "Hn": prods[-1]}
        if kind == "LSTM":
            finals["C"] = c
        for idx, name in enumerate(p["out_sequence"]):
            out = params_of(node, node.outputs[idx])

            def req(v: int, idx: int = idx, out=out) -> int:
                return clamp(rhe(v * out_m[idx], out_s[idx]) - int(out.zerop), out.qmin, out.qmax)
            if name == seq_name:
                for step, prod in enumerate(prods):
                    t = T - 1 - step if reverse else step
                    results[name][n, t] = [req(v) for v in prod]
            else:
                results[name][n] = [req(v) for v in finals[name]]
    return [results[name] for name in p["out_sequence"]]


MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"), (16, "per_tensor_asymmetric")]
VARIANTS: List[Tuple[str, Dict[str, Any], str]] = [
    ("BasicLSTM", {}, "per_tensor_symmetric_restricted_range"),
    ("BasicLSTM", {"direction": "reverse", "forget_bias": 1.0, "threshold": 2.0, "cell_clip": 1.5,
                   "out_sequence": ["H", "C"]}, "per_channel_symmetric_restricted_range"),
    ("GRUv3", {"out_sequence": ["H", "Hn"]}, "per_channel_asymmetric"),
    ("GRUv3", {"version": "GRUV1", "direction": "reverse", "threshold": 3.0}, "per_tensor_symmetric_restricted_range"),
]


def settings(bits: int, mode: str, wmode: str, **extra: Any) -> Dict[str, Any]:
    """The cell settings of these tests: BasicLSTM in quantopt's q15 form (its upstream form:
    tests/ops/test_lstm_upstream.py)."""
    extra.setdefault("lstm_integer_form", "q15")
    extra.setdefault("gru_integer_form", "q15")
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_mode_weight=wmode, q_bits_weight=bits,
                q_bits_bias=48 if bits > 8 else 32, lut_items_in_bits=8 if bits == 8 else 10, **extra)


def quantized_case(optype: str, params: Dict[str, Any], bits: int, mode: str, wmode: str, **extra: Any):
    version = params.get("version", "GRUV3")
    _, w, b = lstm_weights(10) if optype == "BasicLSTM" else gru_weights(10, version)
    g = build(optype, params, w, b)
    data = [feeds(s, optype) for s in (11, 12, 13)]
    return g, data, quantize_model(g, data, settings(bits, mode, wmode, **extra))


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("optype,params,wmode", VARIANTS)
def test_integer_forward_matches_reference(optype: str, params: Dict[str, Any], wmode: str, bits: int,
                                           mode: str) -> None:
    _, _, qg = quantized_case(optype, params, bits, mode, wmode)
    x = feeds(14, optype, n=3, x_std=1.5, h_scale=0.8)
    qg.forward(x)
    node = qg.node("op")
    ins = [t.betensor.numpy() for t in node.inputs]
    got = [t.betensor for t in node.outputs]
    want = ref_rnn(node, ins[0], ins[1], ins[2] if optype == "BasicLSTM" else None)
    for g_, w_, t in zip(got, want, node.outputs):
        q = params_of(node, t)
        assert g_.dtype == torch.int64 and int(g_.min()) >= q.qmin and int(g_.max()) <= q.qmax
        np.testing.assert_array_equal(g_.numpy(), w_)


@pytest.mark.parametrize("bits,mode", MODES + [(8, "per_tensor_symmetric_restricted_range")])
@pytest.mark.parametrize("optype,params,wmode", VARIANTS[:1] + VARIANTS[2:3])
def test_outputs_are_symmetric_restricted_whatever_the_mode(optype: str, params: Dict[str, Any], wmode: str,
                                                            bits: int, mode: str) -> None:
    """Upstream's rule (docs/semantics/recurrent.md): scale (2^(b-1) - 1) / max|x|, zero point 0, [-qmax, qmax]."""
    _, _, qg = quantized_case(optype, params, bits, mode, wmode)
    qmax = 2 ** (bits - 1) - 1
    for t in qg.node("op").outputs:
        r = range_of(qg.node("op"), t)
        absmax = max(abs(float(r.min)), abs(float(r.max)))
        q = params_of(qg.node("op"), t)
        assert (q.qmin, q.qmax, int(q.zerop)) == (-qmax, qmax, 0), t.name
        assert float(q.scale) == pytest.approx(qmax / absmax, rel=1e-6), t.name


def test_per_channel_activation_mode_set_for_the_cell_is_refused() -> None:
    _, w, b = lstm_weights(10)
    g = build("BasicLSTM", {}, w, b)
    mode = "per_channel_symmetric_full_range"
    with pytest.raises(UnsupportedError, match="per-channel activation"):
        quantize_model(g, [feeds(11, "BasicLSTM")], settings(8, mode, "per_tensor_symmetric_restricted_range"),
                       per_layer={"op": {"q_mode_activation": mode}})


# --- 3. float vs dequantized ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.999)])
@pytest.mark.parametrize("optype,params", [("BasicLSTM", {}), ("BasicLSTM", {"forget_bias": 1.0}),
                                           ("GRUv3", {"out_sequence": ["H", "Hn"]}),
                                           ("GRUv3", {"version": "GRUV1"})])
def test_float_vs_dequantized_cosine(optype: str, params: Dict[str, Any], bits: int, threshold: float) -> None:
    g, data, qg = quantized_case(optype, params, bits, "per_tensor_symmetric_full_range",
                                 "per_channel_symmetric_restricted_range", q_strategy_activation="extrema")
    ref = [t.clone() for t in g.forward(data[0])]
    got = run_quantized(qg, data[0])
    for r, q in zip(ref, got):
        assert cosine(r, q) > threshold


# --- 4. IR round trip ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params,wmode", VARIANTS)
def test_ir_write_read_bit_identical(tmp_path, optype: str, params: Dict[str, Any], wmode: str) -> None:
    _, _, qg = quantized_case(optype, params, 8, "per_tensor_asymmetric", wmode)
    x = feeds(15, optype)
    before = [t.clone() for t in qg.forward(x)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    after = re.forward(x)
    for a, b in zip(before, after):
        assert a.dtype == torch.int64 and torch.equal(a, b)


# --- 5. errors ----------------------------------------------------------------------------------------------------
def test_bad_params_are_ir_errors() -> None:
    _, w, b = lstm_weights(16)
    x, h0, c0 = feeds(17, "BasicLSTM")
    with pytest.raises(IRError, match="weights must have shape"):
        build("BasicLSTM", {}, w[:, :-1], b).forward([x, h0, c0])
    with pytest.raises(IRError, match="direction"):
        build("BasicLSTM", {"direction": "sideways"}, w, b).forward([x, h0, c0])
    with pytest.raises(IRError, match="out_sequence"):
        build("BasicLSTM", {"out_sequence": ["Y", "Q"]}, w, b).forward([x, h0, c0])
    with pytest.raises(IRError, match="time_steps"):
        build("BasicLSTM", {"time_steps": 0}, w, b).forward([x, h0, c0])
    with pytest.raises(IRError, match="input sequence"):
        build("BasicLSTM", {}, w, b).forward([x[:, :2], h0, c0])


def test_unsupported_variants_name_the_layer() -> None:
    _, w, b = gru_weights(18, "GRUV3")
    x, h0 = feeds(19, "GRUv3")
    with pytest.raises(UnsupportedError, match="'op'.*RELU"):
        build("GRUv3", {"activations": ["SIGMOID", "RELU"]}, w, b).forward([x, h0])
    with pytest.raises(UnsupportedError, match="bidirectional"):
        build("GRUv3", {"direction": "bidirectional"}, w, b).forward([x, h0])
    g = build("GRUv3", {}, w, b)
    with pytest.raises(UnsupportedError, match="12-bit"):
        quantize_model(g, [feeds(20, "GRUv3")], settings(12, "per_tensor_symmetric_full_range",
                                                         "per_tensor_symmetric_restricted_range"))


def test_gruv1_float_forward_records_the_cell_tensors_as_placeholders() -> None:
    """state sequence, gate and candidate table inputs/outputs and the hidden candidate product (upstream's list),
    against a numpy GRUV1 cell; the calibration reads them like outputs (docs/statistics-and-dump.md)."""
    _, w, b = gru_weights(4, "GRUV1")
    g = build("GRUv3", {"version": "GRUV1", "threshold": 1.5}, w, b)
    x, h0 = feeds(5, "GRUv3")
    g.forward([x, h0])
    ph = g.node("op").placeholders
    names = ["state_batch", "f_lut_in", "f_lut_out", "g_lut_in", "g_lut_out", "hidden_gate_out"]
    assert [t.name for t in ph] == [f"op/{n}" for n in names]
    w64, b64 = w.astype(np.float64), b.astype(np.float64)
    h = h0.numpy().astype(np.float64)
    got: Dict[str, List[np.ndarray]] = {n: [] for n in names}
    for t in range(T):
        xt = x.numpy()[:, t].astype(np.float64)
        zrz = np.clip(np.concatenate([xt, h], 1) @ w64[:2 * C].T + b64[:2 * C], -1.5, 1.5)
        rz = np_sigmoid(zrz)
        r, z = rz[:, :C], rz[:, C:]
        hn = h @ w64[2 * C:, IN:].T + b64[3 * C:]
        pre = np.clip(xt @ w64[2 * C:, :IN].T + b64[2 * C:3 * C] + r * hn, -1.5, 1.5)
        n = np.tanh(pre)
        h = (1 - z) * n + z * h
        for name, v in zip(names, (h, zrz, rz, pre, n, hn)):
            got[name].append(v)
    for t, name in zip(ph, names):
        np.testing.assert_allclose(t.betensor.numpy(), np.stack(got[name], 1), atol=2e-6, err_msg=name)


@pytest.mark.parametrize("steps", RECURRENT_STEPS)
@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("optype,params,wmode", VARIANTS)
def test_q15_step_bounds_hold_and_match_the_reference(monkeypatch, optype: str, params: Dict[str, Any],
                                                      wmode: str, bits: int, mode: str, steps: str) -> None:
    """The q15 LSTM and GRU steps give their requantizations and lookups the bounds their ranges prove (|h| <= hq,
    the tables' entries, the weights' column sums, the cell clip): each bound holds and the integers are the
    reference's, on inputs far outside the calibrated range too; each way the steps run
    (quant_helpers.RECURRENT_STEPS)."""
    stepped = choose_recurrent_steps(monkeypatch, steps, ["q15_lstm_steps", "q15_gru_steps"])
    checked = checked_requantization_bounds(monkeypatch)
    _, _, qg = quantized_case(optype, params, bits, mode, wmode)
    node = qg.node("op")
    for x_std in (1.5, 20.0):
        qg.forward(feeds(14, optype, n=3, x_std=x_std, h_scale=0.8))
        ins = [t.betensor.numpy() for t in node.inputs]
        for got, want in zip(node.outputs, ref_rnn(node, ins[0], ins[1], ins[2] if len(ins) > 2 else None)):
            np.testing.assert_array_equal(got.betensor.numpy(), want)
    assert checked
    assert ran_as_chosen(stepped, steps)
