"""GenerateProposals (quantopt/ops/generate_proposals.py): the float forward against a numpy reference written from
docs/semantics/proposals.md (anchor grid, decode, clip, sort, min-size filter, NMS), the quantized params and tables
against their formulas, the integer forward against a python-int reference exactly and against the float output
(dequantized, close), IR round trip, and refused inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model

H, W, A, P, PRE = 4, 5, 3, 6, 30
IMG_H, IMG_W, MIN_SIZE, IOU = 64, 80, 4.0, 0.6
BASE = np.array([[-8, -8, 23, 23], [-20, -10, 35, 25], [-5, -16, 20, 31]], np.float32)


def graph(weights=BASE, deltas_ch: int = 4 * A):
    b = GraphBuilder("t")
    s = b.input("scores", [1, H, W, A])
    d = b.input("deltas", [1, H, W, deltas_ch])
    im = b.input("im_info", [1, 3])
    ys = b.layer("GenerateProposals", [s, d, im], [[1, P], [1, P, 4], [1, P, 1], [1, 1]], name="op",
                 params={"pre_nms_topn": PRE, "post_nms_topn": P, "image_height": IMG_H, "image_width": IMG_W,
                         "min_size": MIN_SIZE, "iou_threshold": IOU}, constants={"weights": weights})
    return b.build(ys)


def feeds(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.uniform(0, 1, (1, H, W, A)).astype(np.float32)),
            torch.from_numpy(rng.normal(0, 0.3, (1, H, W, 4 * A)).astype(np.float32)),
            torch.tensor([[float(IMG_H), float(IMG_W), 1.0]])]


def ref_anchors() -> np.ndarray:
    """(w, h, xc, yc) per (row, column, anchor), stride 16."""
    rows = []
    for y in range(H):
        for x in range(W):
            for a in BASE.astype(np.float64):
                x1, y1, x2, y2 = a + [16 * x, 16 * y, 16 * x, 16 * y]
                w, h = x2 - x1 + 1, y2 - y1 + 1
                rows.append([w, h, x1 + w / 2, y1 + h / 2])
    return np.array(rows)


def ref_nms(boxes, scores, pre, post, min_side, one, suppress) -> list:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:pre]
    order = [i for i in order if boxes[i][2] - boxes[i][0] + one > min_side and boxes[i][3] - boxes[i][1] + one
             > min_side]
    kept = []
    while order and len(kept) < post:
        i = order.pop(0)
        kept.append(i)
        rest = []
        for j in order:
            iw = max(0, min(boxes[i][2], boxes[j][2]) - max(boxes[i][0], boxes[j][0]) + one)
            ih = max(0, min(boxes[i][3], boxes[j][3]) - max(boxes[i][1], boxes[j][1]) + one)
            ai = (boxes[i][2] - boxes[i][0] + one) * (boxes[i][3] - boxes[i][1] + one)
            aj = (boxes[j][2] - boxes[j][0] + one) * (boxes[j][3] - boxes[j][1] + one)
            if not suppress(iw * ih, ai + aj - iw * ih):
                rest.append(j)
        order = rest
    return kept


def ref_float(scores, deltas):
    an = ref_anchors()
    d = deltas.reshape(-1, 4).astype(np.float64)
    w, h = np.exp(d[:, 2]) * an[:, 0], np.exp(d[:, 3]) * an[:, 1]
    cx, cy = d[:, 0] * an[:, 0] + an[:, 2], d[:, 1] * an[:, 1] + an[:, 3]
    boxes = np.stack([np.clip(cx - w / 2, 0, IMG_W - 1), np.clip(cy - h / 2, 0, IMG_H - 1),
                      np.clip(cx + w / 2, 0, IMG_W - 1), np.clip(cy + h / 2, 0, IMG_H - 1)], -1)
    sc = scores.reshape(-1)
    kept = ref_nms(boxes.tolist(), sc.tolist(), PRE, P, MIN_SIZE, 1.0, lambda i, u: i / u > IOU)
    return sc[kept], boxes[kept], kept


def test_float_forward() -> None:
    g = graph()
    f = feeds(1)
    s, b, idx, c = g.forward(f)
    ws, wb, kept = ref_float(f[0].numpy(), f[1].numpy())
    assert int(c[0, 0]) == len(kept) == P
    np.testing.assert_allclose(s[0].numpy(), ws, rtol=1e-6)
    np.testing.assert_allclose(b[0].numpy(), wb, rtol=1e-5, atol=1e-3)
    assert idx.abs().sum() == 0
    node = g.node("op")
    assert [t.name for t in node.placeholders] == ["op/coords", "op/box"]
    assert node.placeholders[0].betensor.numel() == 14 * H * W * A


def test_anchors_per_position_and_suppression() -> None:
    """[H*W*A, 4] anchors are (w, h, xc, yc) as they are; identical boxes leave one survivor."""
    an = ref_anchors().astype(np.float32)
    g = graph(weights=an)
    f = feeds(2)
    f[1] = torch.zeros_like(f[1])
    s, b, _, c = g.forward(f)
    ws, wb, kept = ref_float(f[0].numpy(), f[1].numpy())
    assert int(c[0, 0]) == len(kept)
    np.testing.assert_allclose(b[0, :len(kept)].numpy(), wb, atol=1e-4)
    f[0] = torch.full_like(f[0], 0.5)
    f[1] = torch.zeros_like(f[1])
    g2 = graph(weights=np.tile(an[:1], (H * W * A, 1)))
    assert int(g2.forward(f)[3][0, 0]) == 1


@pytest.mark.parametrize("bits,mode", [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
                                       (16, "per_tensor_symmetric_full_range")])
def test_quantized(tmp_path, bits: int, mode: str) -> None:
    g = graph()
    qg = quantize_model(g, [feeds(s) for s in (2, 3, 4, 5)],
                        dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                             q_strategy_activation="extrema"))
    node = qg.node("op")
    s_t, d_t = node.inputs[0], node.inputs[1]
    sp, dp = params_of(node, s_t), params_of(node, d_t)
    sa, F = node.params["anchor_scale"], node.params["delta_shift"]
    assert sa == 2 ** int(round(math.log2(sa))) and float(params_of(node, node.outputs[1]).scale) == sa
    assert node.params["min_size"] == int((MIN_SIZE - 1) * sa) and node.params["iou_threshold"] == int(IOU * 2048)
    an = ref_anchors()
    for key, col in (("wa_q", 0), ("ha_q", 1), ("xcenter_a_q", 2), ("ycenter_a_q", 3)):
        want = np.clip(np.round(an[:, col] * sa), -32768, 32767)
        assert node.constants[key].betensor.reshape(-1).double().tolist() == want.tolist()
    d_bits = int(dp.qbits)
    qmin = -(2 ** (d_bits - 1)) if int(dp.qmin) < 0 else 0
    tables = {}
    for key, fn in (("xy_lut", lambda x: x), ("wh_lut", np.exp)):
        t = node.constants[key].betensor.to(torch.int64).tolist()
        codes = np.linspace(qmin, qmin + 2 ** d_bits - 1, len(t))
        want = np.clip(np.round(fn((codes + int(dp.zerop)) / float(dp.scale)) * 2.0 ** F), -32768, 32767)
        assert np.abs(np.array(t) - want).max() <= 1
        tables[key] = t

    def lookup(code: int, table: list) -> int:
        idx = min(max(code - qmin, 0), 2 ** d_bits - 1)
        b = d_bits - int(math.log2(len(table)))
        if b <= 0:
            return table[idx]
        hi, lo = idx >> b, idx & ((1 << b) - 1)
        nxt = table[min(hi + 1, len(table) - 1)]
        return table[hi] + (((nxt - table[hi]) * lo) >> b)

    f = feeds(9)
    s, b, idx, c = qg.forward(f)
    sq = s_t.betensor.to(torch.int64).reshape(-1).tolist()
    dq = d_t.betensor.to(torch.int64).reshape(-1, 4).tolist()
    anc = {k: node.constants[k].betensor.reshape(-1).to(torch.int64).tolist()
           for k in ("ycenter_a_q", "xcenter_a_q", "ha_q", "wa_q")}
    boxes = []
    for i, (tx, ty, tw, th) in enumerate(dq):
        hh = (lookup(th, tables["wh_lut"]) * anc["ha_q"][i]) >> F
        ww = (lookup(tw, tables["wh_lut"]) * anc["wa_q"][i]) >> F
        cy = ((lookup(ty, tables["xy_lut"]) * anc["ha_q"][i]) >> F) + anc["ycenter_a_q"][i]
        cx = ((lookup(tx, tables["xy_lut"]) * anc["wa_q"][i]) >> F) + anc["xcenter_a_q"][i]
        ym, xm = IMG_H * sa - sa, IMG_W * sa - sa
        boxes.append([min(max(cx - ww // 2, 0), xm), min(max(cy - hh // 2, 0), ym),
                      min(max(cx + ww // 2, 0), xm), min(max(cy + hh // 2, 0), ym)])
    iou_q = node.params["iou_threshold"]
    kept = ref_nms(boxes, sq, PRE, P, node.params["min_size"], 0, lambda i, u: i * 2048 > iou_q * u)
    assert int(c[0, 0]) == len(kept)
    assert b[0, :len(kept)].tolist() == [boxes[i] for i in kept]
    assert s[0, :len(kept)].tolist() == [sq[i] for i in kept]
    # dequantized: the same selection as the float layer here, boxes within a pixel
    fs, fb, fkept = ref_float(f[0].numpy(), f[1].numpy())
    assert fkept == kept
    assert np.abs(b[0].double().numpy() / sa - fb).max() < 1.0
    assert np.abs(s[0].double().numpy() / float(sp.scale) - fs).max() < 2.0 / float(sp.scale)
    before = [t.clone() for t in (s, b, idx, c)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for x, y in zip(before, re.forward(f)):
        assert torch.equal(x.to(torch.int64), y.to(torch.int64))


def test_bad_inputs() -> None:
    with pytest.raises(IRError, match="deltas"):
        graph(deltas_ch=4 * A + 1).forward([feeds(1)[0], torch.zeros(1, H, W, 4 * A + 1), feeds(1)[2]])
    with pytest.raises(IRError, match="base anchors"):
        graph(weights=BASE[:2]).forward(feeds(1))
    b = GraphBuilder("t")
    s = b.input("scores", [1, H, W, A])
    d = b.input("deltas", [1, H, W, 4 * A])
    ys = b.layer("GenerateProposals", [s, d], [[1, P], [1, P, 4], [1, P, 1], [1, 1]], name="op",
                 params={"pre_nms_topn": PRE, "post_nms_topn": P, "image_height": IMG_H, "image_width": IMG_W,
                         "min_size": MIN_SIZE, "iou_threshold": IOU}, constants={"weights": BASE})
    with pytest.raises(IRError, match="expects 3 inputs"):
        b.build(ys).forward(feeds(1)[:2])
