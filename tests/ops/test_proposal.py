"""Proposal (quantopt/ops/proposals.py): the float forward against a numpy reference written from
docs/semantics/proposals.md, the placeholders it records, the quantized params and tables against their formulas,
the integer forward against a python-int reference (its own table lookup) exactly and against the float output
(dequantized, close), IR round trip, and refused inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from range_helpers import range_of

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.hardware import DEFAULT_LUT_ITEMS_IN_BITS

A, M, H, W = 12, 5, 200, 300


def anchors() -> dict:
    rng = np.random.default_rng(7)
    return {"xcenter": rng.uniform(20, 280, A).astype(np.float32),
            "ycenter": rng.uniform(20, 180, A).astype(np.float32),
            "ha": rng.uniform(20, 90, A).astype(np.float32), "wa": rng.uniform(20, 120, A).astype(np.float32)}


def graph(thresh: float = 0.5, scores_shape=(1, A, 2)):
    b = GraphBuilder("t")
    s = b.input("scores", list(scores_shape))
    d = b.input("deltas", [1, A, 4])
    ys = b.layer("Proposal", [s, d], [[1, M], [1, M, 4], [1, 1], [1, 1]], name="op",
                 params={"width": W, "height": H, "score_threshold": thresh}, constants=anchors())
    return b.build(ys)


def feeds(seed: int) -> list:
    rng = np.random.default_rng(seed)
    fg = rng.uniform(0, 1, size=(1, A))
    return [torch.from_numpy(np.stack([1 - fg, fg], -1).astype(np.float32)),
            torch.from_numpy(rng.normal(0, 1, size=(1, A, 4)).astype(np.float32))]


def ref_float(scores, deltas, thresh):
    a = anchors()
    d = deltas[0].astype(np.float64) / np.array([10.0, 10.0, 5.0, 5.0])
    cy, cx = d[:, 0] * a["ha"] + a["ycenter"], d[:, 1] * a["wa"] + a["xcenter"]
    h, w = np.exp(d[:, 2]) * a["ha"], np.exp(d[:, 3]) * a["wa"]
    boxes = np.stack([np.clip(cy - h / 2, 0, H), np.clip(cx - w / 2, 0, W), np.clip(cy + h / 2, 0, H),
                      np.clip(cx + w / 2, 0, W)], -1)
    keep = [i for i in range(A) if scores[0, i, 1] > thresh][:M]
    out_s, out_b = np.zeros(M), np.zeros((M, 4))
    out_s[:len(keep)], out_b[:len(keep)] = scores[0, keep, 1], boxes[keep]
    return out_s, out_b, len(keep)


def test_float_forward() -> None:
    g = graph()
    f = feeds(1)
    s, b, c, ones = g.forward(f)
    ws, wb, wc = ref_float(f[0].numpy(), f[1].numpy(), 0.5)
    np.testing.assert_allclose(s[0].numpy(), ws, rtol=1e-6)
    np.testing.assert_allclose(b[0].numpy(), wb, rtol=1e-5, atol=1e-3)
    assert int(c[0, 0]) == wc and 0 < wc and float(ones[0, 0]) == 1.0
    node = g.node("op")
    assert [t.name for t in node.placeholders] == ["op/coords", "op/box"]
    assert node.placeholders[0].betensor.numel() == 14 * A and node.placeholders[1].betensor.numel() == 6 * A
    d = f[1][0].double() / torch.tensor([10.0, 10.0, 5.0, 5.0], dtype=torch.float64)
    assert torch.allclose(node.placeholders[1].betensor[4 * A:5 * A].double(), torch.exp(d[:, 2]), rtol=1e-5)


def ref_lookup(code: int, table: list, qmin: int, in_bits: int) -> int:
    idx = min(max(code - qmin, 0), 2 ** in_bits - 1)
    b = in_bits - int(math.log2(len(table)))
    if b <= 0:
        return table[idx]
    hi, lo = idx >> b, idx & ((1 << b) - 1)
    nxt = table[min(hi + 1, len(table) - 1)]
    return table[hi] + (((nxt - table[hi]) * lo) >> b)


@pytest.mark.parametrize("bits,mode", [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
                                       (16, "per_tensor_symmetric_full_range")])
def test_quantized(tmp_path, bits: int, mode: str) -> None:
    g = graph()
    qg = quantize_model(g, [feeds(s) for s in (2, 3, 4, 5)],
                        dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                             q_strategy_activation="extrema"))
    node = qg.node("op")
    s_t, d_t = node.inputs
    sq_p, dq_p = params_of(node, s_t), params_of(node, d_t)
    F = node.params["box_shift_value"]
    sa = float(params_of(node, node.outputs[1]).scale)
    fa = int(round(math.log2(sa)))
    assert sa == 2.0 ** fa and node.params["height"] == int(H * sa) and node.params["width"] == int(W * sa)
    # the coords placeholder's range (centres, sizes, edges) fits int16 at 2^Fa, but not at 2^(Fa + 1)
    ph = node.placeholders[0]
    big = max(abs(float(range_of(node, ph).min)), abs(float(range_of(node, ph).max)))
    assert big * sa <= 32767.5 and big * sa * 2 > 32767 / 2
    a = anchors()
    for k in ("ycenter", "xcenter", "ha", "wa"):
        want = np.clip(np.round(a[k].astype(np.float64) * sa), -32768, 32767)
        assert node.constants[k].betensor.reshape(-1).double().tolist() == want.tolist()
    d_bits = int(dq_p.qbits)
    qmin = -(2 ** (d_bits - 1)) if int(dq_p.qmin) < 0 else 0
    tables = {}
    for k, div, fn in (("ty_lut", 10.0, lambda x: x), ("th_lut", 5.0, np.exp), ("tx_lut", 10.0, lambda x: x),
                       ("tw_lut", 5.0, np.exp)):
        t = node.constants[k].betensor.to(torch.int64).tolist()
        tables[k] = t
        n = len(t)
        assert n == 2 ** min(d_bits, DEFAULT_LUT_ITEMS_IN_BITS)
        codes = np.linspace(qmin, qmin + 2 ** d_bits - 1, n)
        want = np.clip(np.round(fn((codes + int(dq_p.zerop)) / float(dq_p.scale) / div) * 2.0 ** F), -32768, 32767)
        assert np.abs(np.array(t) - want).max() <= 1
    thr = node.params["score_threshold_value"]
    assert thr == min(max(round(0.5 * float(sq_p.scale) - int(sq_p.zerop)), 0), 2 ** int(sq_p.qbits) - 1)

    f = feeds(9)
    s, b, c, ones = qg.forward(f)
    sq, dq = s_t.betensor.to(torch.int64), d_t.betensor.to(torch.int64)
    anc = {k: node.constants[k].betensor.reshape(-1).to(torch.int64).tolist() for k in ("ycenter", "xcenter", "ha",
                                                                                           "wa")}
    rows = []
    for i in range(A):
        ly, lx, lh, lw = (ref_lookup(int(dq[0, i, j]), tables[k], qmin, d_bits)
                          for j, k in enumerate(("ty_lut", "tx_lut", "th_lut", "tw_lut")))
        h, w = (lh * anc["ha"][i]) >> F, (lw * anc["wa"][i]) >> F
        cy, cx = ((ly * anc["ha"][i]) >> F) + anc["ycenter"][i], ((lx * anc["wa"][i]) >> F) + anc["xcenter"][i]
        hq, wq = node.params["height"], node.params["width"]
        rows.append([min(max(round((2 * cy - h) / 2), 0), hq), min(max(round((2 * cx - w) / 2), 0), wq),
                     min(max(round((2 * cy + h) / 2), 0), hq), min(max(round((2 * cx + w) / 2), 0), wq)])
    keep = [i for i in range(A) if int(sq[0, i, 1]) > thr][:M]
    assert int(c[0, 0]) == len(keep) and int(ones[0, 0]) == 1
    assert b[0, :len(keep)].tolist() == [rows[i] for i in keep]
    assert s[0, :len(keep)].tolist() == [int(sq[0, i, 1]) for i in keep]
    # dequantized boxes follow the float boxes (same selection on these samples)
    fs, fb, fc = ref_float(f[0].numpy(), f[1].numpy(), 0.5)
    assert fc == len(keep)
    assert np.abs(b[0, :fc].double().numpy() / sa - fb[:fc]).max() < 0.02 * max(H, W)
    before = [t.clone() for t in (s, b, c)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for x, y in zip(before, re.forward(f)):
        assert torch.equal(x.to(torch.int64), y.to(torch.int64))


def test_bad_inputs() -> None:
    with pytest.raises(IRError, match="scores must be"):
        graph(scores_shape=(1, A, 3)).forward([torch.zeros(1, A, 3), feeds(1)[1]])
    b = GraphBuilder("t")
    s = b.input("scores", [1, A, 2])
    d = b.input("deltas", [1, A, 4])
    ys = b.layer("Proposal", [s, d], [[1, M], [1, M, 4], [1, 1], [1, 1]], name="op",
                 params={"width": W, "height": H, "score_threshold": 0.5},
                 constants={k: v[:-1] for k, v in anchors().items()})
    with pytest.raises(IRError, match="anchor values"):
        b.build(ys).forward(feeds(1))
