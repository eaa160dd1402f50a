"""HeatmapMaxKeypoint (quantopt/ops/keypoints.py): the float forward against a plain python re-implementation of
the quadratic fit (docs/semantics/keypoints.md), quantized params, the integer forward against a python-integer
re-implementation of the documented fixed-point fit and against the float result, IR round trip, bad params."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str):
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema")


def graph(params=None, outputs: int = 3, size: int = 6):
    b = GraphBuilder("t")
    hm = b.input("hm", [3, size, size, 2])
    bx = b.input("boxes", [3, 4])
    shapes = [[3, 2, 1], [3, 2, 2], [3, 2, 1]][:outputs]
    return b.build(b.layer("HeatmapMaxKeypoint", [hm, bx], shapes, name="op", params=params or {}))


def inputs(seed: int, size: int = 6):
    rng = np.random.default_rng(seed)
    hm = rng.normal(0.0, 3.0, size=(3, size, size, 2))
    hm[0, 0, 2, 0] = 12.0  # a maximum on the border (mirrored neighbours)
    hm[1, 3, 3, 1] = 12.0  # an interior maximum
    x0, y0 = rng.uniform(0, 100, size=(2, 3))
    w, h = rng.uniform(10, 60, size=(2, 3))
    boxes = np.stack([x0, y0, x0 + w, y0 + h], axis=-1)
    boxes[2, 2] = boxes[2, 0] + 0.5  # a width below 1: clamped to 1
    return [torch.from_numpy(hm.astype(np.float32)), torch.from_numpy(boxes.astype(np.float32))]


def neighbourhood(m, r, c, size):
    def at(i, j):
        i = size - 2 if i >= size else (1 if i < 0 else i)
        j = size - 2 if j >= size else (1 if j < 0 else j)
        return m[i][j]
    return [[at(r + dh, c + dw) for dw in (-1, 0, 1)] for dh in (-1, 0, 1)]


def argmax_first(m):
    flat = [v for row in m for v in row]
    i = flat.index(max(flat))
    return i // len(m), i % len(m)


def ref_float(hm: np.ndarray, boxes: np.ndarray):
    size = hm.shape[1]
    scores, kps = [], []
    for r in range(hm.shape[0]):
        srow, krow = [], []
        for k in range(hm.shape[3]):
            m = hm[r, :, :, k].astype(np.float64).tolist()
            row, col = argmax_first(m)
            g = neighbourhood(m, row, col, size)
            b0, b1 = -(g[1][2] - g[1][0]) / 2, -(g[2][1] - g[0][1]) / 2
            a00 = g[1][0] - 2 * g[1][1] + g[1][2]
            a01 = (g[2][2] - g[2][0] - g[0][2] + g[0][0]) / 4
            a11 = g[0][1] - 2 * g[1][1] + g[2][1]
            det = a00 * a11 - a01 * a01
            d0 = d1 = 0.0
            score = g[1][1]
            if abs(det) >= 1e-5 + 1e-5 * a00 * a11:
                d0, d1 = (a11 * b0 - a01 * b1) / det, (a00 * b1 - a01 * b0) / det
                big = max(abs(d0), abs(d1))
                if big > 1.5:
                    d0, d1 = d0 * 1.5 / big, d1 * 1.5 / big
                score = g[1][1] - b0 * d0 - b1 * d1 + ((a00 * d0 + a01 * d1) * d0 + (a01 * d0 + a11 * d1) * d1) / 2
            x1, y1, x2, y2 = boxes[r].astype(np.float64)
            srow.append([score])
            krow.append([(col + d0 + 0.5) / size * max(x2 - x1, 1) + x1,
                         (row + d1 + 0.5) / size * max(y2 - y1, 1) + y1])
        scores.append(srow)
        kps.append(krow)
    return np.array(scores), np.array(kps)


def test_heatmap_float() -> None:
    g = graph()
    hm, bx = inputs(1)
    score, kp, zeros = g.forward([hm, bx])
    ws, wk = ref_float(hm.numpy(), bx.numpy())
    np.testing.assert_allclose(score.numpy(), ws, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(kp.numpy(), wk, rtol=1e-5, atol=1e-4)
    assert torch.equal(zeros, torch.zeros(3, 2, 1))


def rhe(f: Fraction) -> int:
    return round(f)


def ref_int(node, hq: list, bq: list):
    """The documented integer fit on python integers."""
    hp, bp = (params_of(node, t) for t in node.inputs)
    zh, zb = int(hp.zerop), int(bp.zerop)
    s = Fraction(float(hp.scale))
    size = len(hq[0])
    p = node.params
    scores, kps = [], []
    for r in range(len(hq)):
        srow, krow = [], []
        for k in range(len(hq[0][0][0])):
            m = [[hq[r][i][j][k] + zh for j in range(size)] for i in range(size)]
            row, col = argmax_first(m)
            g = neighbourhood(m, row, col, size)
            b0, b1 = -(g[1][2] - g[1][0]), -(g[2][1] - g[0][1])
            a00 = g[1][0] - 2 * g[1][1] + g[1][2]
            a01 = g[2][2] - g[2][0] - g[0][2] + g[0][0]
            a11 = g[0][1] - 2 * g[1][1] + g[2][1]
            det16 = 16 * a00 * a11 - a01 * a01
            d0 = d1 = 0
            s19 = g[1][1] * 2 ** 19
            if abs(det16) * 100000 >= 16 * s * s + 16 * a00 * a11:
                d0 = rhe(Fraction((8 * a11 * b0 - 2 * a01 * b1) * 256, det16))
                d1 = rhe(Fraction((8 * a00 * b1 - 2 * a01 * b0) * 256, det16))
                big = max(abs(d0), abs(d1))
                if big > 384:
                    d0, d1 = rhe(Fraction(d0 * 384, big)), rhe(Fraction(d1 * 384, big))
                s19 = g[1][1] * 2 ** 19 - (b0 * d0 + b1 * d1) * 2 ** 10 + 4 * a00 * d0 * d0 + \
                    2 * a01 * d0 * d1 + 4 * a11 * d1 * d1
            o0, o1 = params_of(node, node.outputs[0]), params_of(node, node.outputs[1])
            sc = rhe(Fraction(s19 * p["score_scale_value"], 2 ** (p["score_shift_value"] + 19))) - int(o0.zerop)
            srow.append([min(max(sc, int(o0.qmin)), int(o0.qmax))])
            x1, y1, x2, y2 = (v + zb for v in bq[r])
            w = max((x2 - x1) * 256, p["roi_min_size_value"])
            h = max((y2 - y1) * 256, p["roi_min_size_value"])
            vx = (col * 256 + d0 + 128) * w + x1 * 2 ** 16 * size
            vy = (row * 256 + d1 + 128) * h + y1 * 2 ** 16 * size
            kp = [rhe(Fraction(v * p["box_scale_value"], 2 ** (p["box_shift_value"] + 16))) - int(o1.zerop)
                  for v in (vx, vy)]
            krow.append([min(max(v, int(o1.qmin)), int(o1.qmax)) for v in kp])
        scores.append(srow)
        kps.append(krow)
    return scores, kps


@pytest.mark.parametrize("bits,mode", MODES)
def test_heatmap_quantized(tmp_path, bits: int, mode: str) -> None:
    g = graph()
    feeds = inputs(1)
    qg = quantize_model(g, [inputs(s) for s in (2, 3)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    h_t, b_t = node.inputs
    hp, bp = params_of(node, h_t), params_of(node, b_t)
    o0, o1, o2 = (params_of(node, t) for t in node.outputs)
    assert o0.qbits == hp.qbits and o1.qbits == bp.qbits
    assert node.params["roi_min_size_value"] == round(float(bp.scale) * 256)
    score, kp, zeros = qg.forward(feeds)
    ws, wk = ref_int(node, h_t.betensor.to(torch.int64).tolist(), b_t.betensor.to(torch.int64).tolist())
    assert score.tolist() == ws and kp.tolist() == wk
    assert torch.equal(zeros, torch.full((3, 2, 1), min(max(-int(o2.zerop), int(o2.qmin)), int(o2.qmax))))
    # close to the float op on the dequantized inputs
    deq = [((t.betensor.to(torch.float64) + int(q.zerop)) / float(q.scale)).numpy() for t, q in ((h_t, hp), (b_t, bp))]
    fs, fk = ref_float(*deq)
    got_s = (score.numpy() + int(o0.zerop)) / float(o0.scale)
    got_k = (kp.numpy() + int(o1.zerop)) / float(o1.scale)
    assert np.abs(got_s - fs).max() <= 1.5 / float(o0.scale) + 0.01 * np.abs(fs).max()
    assert np.abs(got_k - fk).max() <= 1.5 / float(o1.scale) + 0.02
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


def test_heatmap_bad_params() -> None:
    feeds = inputs(0)
    with pytest.raises(UnsupportedError, match="isSoftmax"):
        graph({"isSoftmax": True}).forward(feeds)
    b = GraphBuilder("t")
    hm = b.input("hm", [3, 6, 5, 2])
    bx = b.input("boxes", [3, 4])
    g = b.build(b.layer("HeatmapMaxKeypoint", [hm, bx], [[3, 2, 1], [3, 2, 2]], name="op"))
    with pytest.raises(IRError, match=r"\[R, S, S, K\]"):
        g.forward([torch.zeros(3, 6, 5, 2), feeds[1]])
    assert math.isfinite(float(graph(outputs=2).forward(feeds)[0].sum()))
