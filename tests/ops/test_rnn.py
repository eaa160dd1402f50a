"""RNN (quantopt/ops/rnn.py): the float forward against a numpy reference for every activation and both
directions, the quantized params against their formulas, the integer forward against a python-int reference
exactly and against the float output (dequantized, close), IR round trip, and refused layers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_helpers import checked_requantization_bounds, params_of

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model

N, T, IN, C = 2, 5, 4, 6
_RNG = np.random.default_rng(0)
WEIGHTS = _RNG.normal(0, 0.5, (C, IN + C)).astype(np.float32)
BIASES = _RNG.normal(0, 0.2, C).astype(np.float32)
CLIP = {"clip_min": -0.5, "clip_max": 1.0}


def graph(act: str = "TANH", direction: str = "forward", h0_rows: int = N, weights=WEIGHTS, **extra):
    b = GraphBuilder("t")
    x = b.input("x", [N, T, IN])
    h = b.input("h0", [h0_rows, C])
    params = {"activations": act, "input_size": IN, "cell_size": C, "direction": direction, "time_steps": T}
    params.update(extra)
    ys = b.layer("RNN", [x, h], [[N, T, C], [N, C]], name="op", params=params,
                 constants={"weights": weights, "biases": BIASES})
    return b.build(ys)


def feeds(seed: int, h0_rows: int = N) -> list:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.normal(0.3, 1, (N, T, IN)).astype(np.float32)),
            torch.from_numpy(rng.normal(0, 0.3, (h0_rows, C)).astype(np.float32))]


def ref_float(x, h0, act, reverse=False, threshold=None):
    x = x.astype(np.float64)[:, ::-1] if reverse else x.astype(np.float64)
    w = WEIGHTS.astype(np.float64)
    h = h0.astype(np.float64)[np.arange(N) % h0.shape[0]]
    fns = {"TANH": np.tanh, "SIGMOID": lambda v: 1 / (1 + np.exp(-v)), "RELU": lambda v: np.maximum(v, 0),
           "CLIP": lambda v: np.clip(v, -0.5, 1.0), "SIGN_BIT": lambda v: (v < 0).astype(np.float64),
           "NONE": lambda v: v}
    ys = []
    for t in range(T):
        pre = x[:, t] @ w[:, :IN].T + h @ w[:, IN:].T + BIASES
        if threshold is not None:
            pre = np.clip(pre, -threshold, threshold)
        h = fns[act](pre)
        ys.append(h)
    y = np.stack(ys, 1)
    return (y[:, ::-1] if reverse else y), h


@pytest.mark.parametrize("act", ["TANH", "SIGMOID", "RELU", "CLIP", "SIGN_BIT", "NONE"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_float_forward(act: str, direction: str) -> None:
    extra = CLIP if act == "CLIP" else {}
    g = graph(act, direction, h0_rows=1, threshold=3.0, **extra)
    f = feeds(1, h0_rows=1)
    y, h = g.forward(f)
    wy, wh = ref_float(f[0].numpy(), f[1].numpy(), act, direction == "reverse", 3.0)
    np.testing.assert_allclose(y.numpy(), wy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h.numpy(), wh, rtol=1e-5, atol=1e-5)
    assert [t.name for t in g.node("op").placeholders] == ["op/h_state", "op/lut_in"]


def rq(v: int, m: int, n: int, lo: int, hi: int) -> int:
    """clamp(round_half_even(v * m / 2^n)) with python integers."""
    num = v * m
    if n <= 0:
        r = num << -n
    else:
        q, rem = divmod(num, 1 << n)
        r = q + (1 if 2 * rem > (1 << n) or (2 * rem == (1 << n) and q % 2) else 0)
    return min(max(r, lo), hi)


def ref_lookup(code: int, table: list, qmin: int, in_bits: int) -> int:
    idx = min(max(code - qmin, 0), 2 ** in_bits - 1)
    b = in_bits - int(math.log2(len(table)))
    if b <= 0:
        return table[idx]
    hi, lo = idx >> b, idx & ((1 << b) - 1)
    nxt = table[min(hi + 1, len(table) - 1)]
    return table[hi] + (((nxt - table[hi]) * lo) >> b)


def ref_int(node, xq: list, h0q: list, act: str, reverse: bool) -> tuple:
    p = node.params
    x_p, h0_p, y_p = (params_of(node, t) for t in (node.inputs[0], node.inputs[1], node.outputs[0]))
    w = node.constants["weights"].betensor.to(torch.int64).tolist()
    b = node.constants["biases"].betensor.to(torch.int64).reshape(-1).tolist()
    ms, ns = p["scale_value"], p["shift_value"]
    lo, hi = int(y_p.qmin), int(y_p.qmax)
    bits = int(y_p.qbits)
    big = 2 ** 62
    table = node.constants["lut"].betensor.to(torch.int64).tolist() if act in ("TANH", "SIGMOID") else None
    ys, hs = [], []
    for n in range(N):
        h = [rq(v + int(h0_p.zerop), p["init_h_scale_value"], p["init_h_shift_value"], lo, hi)
             for v in h0q[n % len(h0q)]]
        steps = list(range(T))[::-1] if reverse else list(range(T))
        out = {}
        for t in steps:
            xs = [v + int(x_p.zerop) for v in xq[n][t]]
            new = []
            for c in range(C):
                ax = sum(xs[i] * w[c][i] for i in range(IN))
                ah = sum(h[j] * w[c][IN + j] for j in range(C))
                acc = rq(ax, ms[0], ns[0], -big, big) + rq(ah, ms[1], ns[1], -big, big) + b[c]
                if act in ("TANH", "SIGMOID"):
                    code = rq(acc, ms[2], ns[2], -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
                    v = min(max(ref_lookup(code, table, -(2 ** (bits - 1)), bits), lo), hi)
                elif act == "CLIP":
                    v = rq(min(max(acc, p["clip_min"]), p["clip_max"]), ms[2], ns[2], lo, hi)
                else:
                    v = rq(max(acc, 0), ms[2], ns[2], lo, hi)
                new.append(v)
            h = new
            out[t] = h
        ys.append([out[t] for t in range(T)])
        hs.append(h)
    return ys, hs


@pytest.mark.parametrize("act,bits,direction", [("TANH", 8, "forward"), ("TANH", 16, "reverse"),
                                                ("SIGMOID", 8, "forward"), ("RELU", 8, "reverse"),
                                                ("CLIP", 16, "forward")])
def test_quantized(tmp_path, act: str, bits: int, direction: str) -> None:
    extra = CLIP if act == "CLIP" else {}
    g = graph(act, direction, **extra)
    qg = quantize_model(g, [feeds(s) for s in range(1, 6)],
                        dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                             q_strategy_activation="extrema"))
    node = qg.node("op")
    p = node.params
    x_t = node.inputs[0]
    x_q, y_q = params_of(node, x_t), params_of(node, node.outputs[0])
    s_wx, s_wh = p["weights_scale"]
    wmax = 2 ** (bits - 1) - 1
    assert math.isclose(s_wx, wmax / np.abs(WEIGHTS[:, :IN]).max(), rel_tol=1e-5)
    assert math.isclose(s_wh, wmax / np.abs(WEIGHTS[:, IN:]).max(), rel_tol=1e-5)
    s_h = float(y_q.scale)
    assert int(y_q.zerop) == 0 and float(params_of(node, node.outputs[1]).scale) == s_h
    s_acc = min(float(x_q.scale) * s_wx, s_h * s_wh)
    assert math.isclose(p["biases_scale"], s_acc, rel_tol=1e-6)
    for k, ratio in enumerate((s_acc / (float(x_q.scale) * s_wx), s_acc / (s_h * s_wh))):
        assert abs(p["scale_value"][k] * 2.0 ** -p["shift_value"][k] / ratio - 1) < 2 ** -14
    f = feeds(3)
    y, h = qg.forward(f)
    xq = x_t.betensor.to(torch.int64).tolist()
    h0q = node.inputs[1].betensor.to(torch.int64).tolist()
    wy, wh = ref_int(node, xq, h0q, act, direction == "reverse")
    assert y.to(torch.int64).tolist() == wy and h.to(torch.int64).tolist() == wh
    fy, _ = ref_float(f[0].numpy(), f[1].numpy(), act, direction == "reverse")
    tol = {"TANH": 0.08, "SIGMOID": 0.03, "RELU": 0.15, "CLIP": 0.01}[act]
    assert np.abs(y.double().numpy() / s_h - fy).max() < tol
    before = [y.clone(), h.clone()]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(f)):
        assert torch.equal(a.to(torch.int64), b.to(torch.int64))


def test_sign_bit_quantized() -> None:
    """SIGN_BIT outputs 0/1 integers: the integer layer agrees with the float one except where a pre-activation is
    within rounding of 0."""
    g = graph("SIGN_BIT")
    qg = quantize_model(g, [feeds(s) for s in range(1, 6)], dict(q_bits_activation=8, q_strategy_activation="extrema"))
    f = feeds(3)
    y, _ = qg.forward(f)
    fy, _ = ref_float(f[0].numpy(), f[1].numpy(), "SIGN_BIT")
    assert set(y.reshape(-1).tolist()) <= {0, 1}
    assert (y.numpy() != fy).mean() < 0.05
    assert params_of(qg.node("op"), qg.node("op").outputs[0]).qinvariant


def test_bad_layers() -> None:
    with pytest.raises(IRError, match="weights must be"):
        graph(weights=WEIGHTS[:, :-1]).forward(feeds(1))
    with pytest.raises(IRError, match="CLIP needs"):
        graph("CLIP").forward(feeds(1))
    with pytest.raises(IRError, match="time_steps"):
        graph(time_steps=T + 1).forward(feeds(1))
    with pytest.raises(IRError, match="initial state"):
        graph().forward([feeds(1)[0], torch.zeros(N, C + 1)])


@pytest.mark.parametrize("act,bits", [("TANH", 8), ("TANH", 16), ("SIGMOID", 8), ("RELU", 8), ("CLIP", 16)])
def test_quantized_bounds_hold_beyond_the_calibrated_range(monkeypatch, act: str, bits: int) -> None:
    """Each step's requantizations get the bounds the ranges prove (|h| within the output range, the weights'
    column sums) and its lookups codes in range: they hold, and the integers are the reference's, on inputs 20
    times the calibrated range."""
    checked = checked_requantization_bounds(monkeypatch)
    g = graph(act, "forward", **(CLIP if act == "CLIP" else {}))
    qg = quantize_model(g, [feeds(s) for s in range(1, 6)],
                        dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                             q_strategy_activation="extrema"))
    node = qg.node("op")
    x, h0 = feeds(3)
    y, h = qg.forward([x * 20, h0 * 20])
    wy, wh = ref_int(node, node.inputs[0].betensor.to(torch.int64).tolist(),
                     node.inputs[1].betensor.to(torch.int64).tolist(), act, False)
    assert y.to(torch.int64).tolist() == wy and h.to(torch.int64).tolist() == wh
    assert checked
