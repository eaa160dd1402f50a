"""GetValidCount, FilterBoxes and BoundingBox (quantopt/ops/boxes.py): float forward against plain numpy references
written from docs/semantics/boxes.md, quantized params, the integer forward against python-integer references (the
selections decided with exact rationals on the dequantized inputs, BoundingBox's decode recomputed from its stored
tables) and against the float reference, IR write → re-read bit identity, and bad params."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Dict

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema", **extra)


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


def boxes(rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
    y0, x0 = rng.uniform(0.0, 0.6, size=(2, batch, n))
    h, w = rng.uniform(0.02, 0.4, size=(2, batch, n))
    return np.stack([y0, x0, y0 + h, x0 + w], axis=-1).astype(np.float32)


def rat(q: int, p) -> Fraction:
    """The exact float value of code q of a tensor with parameters p (params_of)."""
    return (Fraction(int(q)) + int(p.zerop)) / Fraction(float(p.scale))


# --- GetValidCount -------------------------------------------------------------------------------------------------
def gvc_graph(params):
    b = GraphBuilder("t")
    x = b.input("rows", [2, 10, 6])
    ys = b.layer("GetValidCount", [x], [[2], [2, 10, 6], [2, 10]], name="op", params=params,
                 output_dtypes=[Dtype.INT32, Dtype.FP32, Dtype.INT32])
    return b.build(ys)


def gvc_rows(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ids = rng.choice([-1.0, 0.0, 1.0, 2.0], size=(2, 10, 1))
    scores = rng.uniform(-0.2, 1.0, size=(2, 10, 1))
    return torch.from_numpy(np.concatenate([ids, scores, boxes(rng, 2, 10)], axis=-1).astype(np.float32))


def ref_gvc(rows: list, keep, fill):
    """rows: per batch item a list of rows; keep(row) -> bool."""
    counts, data, index = [], [], []
    for item in rows:
        kept = [i for i, r in enumerate(item) if keep(r)]
        counts.append(len(kept))
        data.append([item[i] for i in kept] + [[fill] * len(item[0])] * (len(item) - len(kept)))
        index.append(kept + [-1] * (len(item) - len(kept)))
    return counts, data, index


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("id_index", [0, -1])
def test_get_valid_count(tmp_path, bits: int, mode: str, id_index: int) -> None:
    params = {"score_threshold": 0.3, "score_index": 1, "id_index": id_index}
    g = gvc_graph(params)
    x = gvc_rows(1)
    count, data, index = g.forward([x])
    want = ref_gvc(x.tolist(), lambda r: r[1] > 0.3 and (id_index < 0 or r[0] >= 0), -1.0)
    assert count.tolist() == want[0] and data.tolist() == want[1] and index.tolist() == want[2]
    qg = quantize_model(g, [[gvc_rows(s)] for s in (2, 3)] + [[x]], settings(bits, mode))
    node = qg.node("op")
    t = node.inputs[0]
    tq, oq = params_of(node, t), [params_of(node, o) for o in node.outputs]
    assert node.outputs[0].dtype == Dtype.INT16 and node.outputs[2].dtype == Dtype.INT16
    assert oq[0].qinvariant and oq[2].qinvariant
    assert oq[1].scale == tq.scale and oq[1].zerop == tq.zerop and node.outputs[1].dtype == t.dtype
    assert node.params["score_threshold_type"] == t.dtype
    qcount, qdata, qindex = qg.forward([x])
    q = t.betensor.to(torch.int64).tolist()
    pad = min(max(round(-float(tq.scale) - int(tq.zerop)), int(tq.qmin)), int(tq.qmax))
    qwant = ref_gvc(q, lambda r: rat(r[1], tq) > Fraction(0.3) and (id_index < 0 or rat(r[0], tq) >= 0), pad)
    assert qcount.tolist() == qwant[0] and qdata.tolist() == qwant[1] and qindex.tolist() == qwant[2]
    # the quantized selection agrees with the float one away from the threshold
    step = 1.0 / float(tq.scale)
    clear = [[i for i, r in enumerate(item) if abs(r[1] - 0.3) > step] for item in x.tolist()]
    for b in range(2):
        assert {i for i in clear[b] if i in want[2][b]} == {i for i in clear[b] if i in qwant[2][b]}
    roundtrip(tmp_path, qg, [x])


def test_get_valid_count_bad_params() -> None:
    x = gvc_rows(0)
    with pytest.raises(IRError, match="score_index"):
        gvc_graph({"score_threshold": 0.3, "score_index": 6}).forward([x])
    with pytest.raises(IRError, match="score_index"):
        gvc_graph({"score_threshold": 0.3}).forward([x])


# --- FilterBoxes ---------------------------------------------------------------------------------------------------
PER_CLASS, LABELS, TOTAL = [4, 0, 3, 3], [1, 3, 2, 5], [3]


def fb_graph(params, cap: int = 6, per_class=PER_CLASS, total=TOTAL):
    b = GraphBuilder("t")
    bx = b.input("boxes", [1, 10, 4])
    sc = b.input("scores", [1, 10])
    consts = []
    for name, vals in (("per_class", per_class), ("labels", LABELS), ("total", total)):
        data = np.array(vals, dtype=np.float32).reshape(1, -1)
        consts.append(b.layer("Constant", [], [list(data.shape)], name=name, constants={"weights": data}))
    ys = b.layer("FilterBoxes", [bx, sc] + consts, [[1, cap, 4], [1, cap], [1, 4], [1, 4], [1, 1]], name="op",
                 params=params, output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32, Dtype.INT32, Dtype.INT32])
    return b.build(ys)


def fb_inputs(seed: int):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(boxes(rng, 1, 10)), torch.from_numpy(rng.uniform(0, 1, (1, 10)).astype(np.float32))]


def ref_fb(bxs: list, scs: list, keep, cap: int, fill, per_class=PER_CLASS, total=TOTAL):
    """One batch item: bxs [B][4], scs [B]; keep(box, score) -> bool."""
    out_b, out_s, nums, labs = [], [], [], []
    start = 0
    for c in range(total[0]):
        n = per_class[c]
        kept = [i for i in range(start, start + n) if keep(bxs[i], scs[i])][:cap - len(out_b)]
        start += n
        if kept:
            out_b += [bxs[i] for i in kept]
            out_s += [scs[i] for i in kept]
            nums.append(len(kept))
            labs.append(LABELS[c])
        if len(out_b) >= cap:
            break
    k = len(out_b)
    return (out_b + [[fill[0]] * 4] * (cap - k), out_s + [fill[1]] * (cap - k), nums + [0] * (4 - len(nums)),
            labs + [0] * (4 - len(labs)), [len(nums)])


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("cap", [6, 3])
def test_filter_boxes(tmp_path, bits: int, mode: str, cap: int) -> None:
    params = {"score_threshold": 0.25, "min_size": [0.1, 0.12], "maxnum": cap}
    g = fb_graph(params, cap)
    feeds = fb_inputs(1)
    got = [o.reshape(-1).tolist() if i >= 2 else o[0].tolist() for i, o in enumerate(g.forward(feeds))]
    bx, sc = feeds[0][0].tolist(), feeds[1][0].tolist()
    want = ref_fb(bx, sc, lambda b, s: s > 0.25 and b[2] - b[0] >= 0.1 and b[3] - b[1] >= 0.12, cap, (0.0, 0.0))
    assert got == [list(w) for w in want]
    assert 0 < want[4][0]
    qg = quantize_model(g, [fb_inputs(s) for s in (2, 3, 4)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    b_t, s_t = node.inputs[:2]
    for o, t in zip(node.outputs, node.inputs):
        po, pt = params_of(node, o), params_of(node, t)
        assert o.dtype == t.dtype and po.scale == pt.scale and po.zerop == pt.zerop
    assert all(isinstance(v, int) for v in node.params["min_size"]) and isinstance(node.params["score_threshold"], int)
    qgot = [o.reshape(-1).tolist() if i >= 2 else o[0].tolist() for i, o in enumerate(qg.forward(feeds))]
    qb, qs = b_t.betensor[0].to(torch.int64).tolist(), s_t.betensor[0].to(torch.int64).tolist()
    bq, sq = params_of(node, b_t), params_of(node, s_t)
    sb = Fraction(float(bq.scale))

    def keep(b, s):
        return (rat(s, sq) > Fraction(0.25) and Fraction(b[2] - b[0]) / sb >= Fraction(0.1)
                and Fraction(b[3] - b[1]) / sb >= Fraction(0.12))

    pads = tuple(min(max(-int(p.zerop), int(p.qmin)), int(p.qmax)) for p in (bq, sq))
    assert qgot == [list(w) for w in ref_fb(qb, qs, keep, cap, pads)]
    roundtrip(tmp_path, qg, feeds)


def test_filter_boxes_bad_params() -> None:
    feeds = fb_inputs(0)
    with pytest.raises(IRError, match="min_size"):
        fb_graph({"min_size": [0.1]}).forward(feeds)
    with pytest.raises(IRError, match="5 inputs"):
        b = GraphBuilder("t")
        x = b.input("boxes", [1, 10, 4])
        b.build(b.layer("FilterBoxes", [x], [[1, 6, 4]] * 5, name="op", params={"min_size": [0, 0]})).forward(
            [feeds[0]])


# --- BoundingBox ---------------------------------------------------------------------------------------------------
def bb_graph(params):
    b = GraphBuilder("t")
    p = b.input("proposals", [1, 12, 4])
    d = b.input("deltas", [1, 12, 4])
    return b.build([b.layer("BoundingBox", [p, d], [[1, 12, 4]], name="op", params=params)])


def bb_inputs(seed: int):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(boxes(rng, 1, 12)),
            torch.from_numpy(rng.normal(0.0, 1.2, size=(1, 12, 4)).astype(np.float32))]


def ref_bb(p: np.ndarray, d: np.ndarray, div) -> np.ndarray:
    p, d = p.astype(np.float64), d.astype(np.float64)
    out = np.zeros_like(p)
    for i in np.ndindex(p.shape[:-1]):
        y0, x0, y1, x1 = p[i]
        h, w = y1 - y0, x1 - x0
        cy = (y0 + y1) / 2 + d[i][0] / div[0] * h
        cx = (x0 + x1) / 2 + d[i][1] / div[1] * w
        hh, ww = math.exp(d[i][2] / div[2]) * h, math.exp(d[i][3] / div[3]) * w
        out[i] = [cy - hh / 2, cx - ww / 2, cy + hh / 2, cx + ww / 2]
    return np.clip(out, 0.0, 1.0)


def table_value(table: list, q: int, p) -> int:
    """The documented lookup (p: the input's parameters): entries every 2^b codes from qmin, linear interpolation
    floored."""
    idx = q - int(p.qmin)
    bits = int(p.qmax - p.qmin).bit_length()
    b = bits - (len(table) - 1).bit_length() + 1
    hi, r = idx >> b, idx & ((1 << b) - 1)
    return table[hi] + math.floor(Fraction((table[hi + 1] - table[hi]) * r, 1 << b))


@pytest.mark.parametrize("bits,mode", MODES)
def test_bounding_box(tmp_path, bits: int, mode: str) -> None:
    div = [10.0, 8.0, 5.0, 4.0]
    g = bb_graph({"std_div": div})
    feeds = bb_inputs(1)
    (y,) = g.forward(feeds)
    np.testing.assert_allclose(y.numpy(), ref_bb(feeds[0].numpy(), feeds[1].numpy(), div), atol=1e-6)
    qg = quantize_model(g, [bb_inputs(s) for s in (2, 3, 4)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    assert out.dtype == Dtype.INT16 and float(oq.scale) == 32767.0 and int(oq.zerop) == 0
    (qy,) = qg.forward(feeds)
    p_t, d_t = node.inputs
    p_p, d_p = params_of(node, p_t), params_of(node, d_t)
    pq = (p_t.betensor.to(torch.float64) + int(p_p.zerop)) / float(p_p.scale)
    dq = (d_t.betensor.to(torch.float64) + int(d_p.zerop)) / float(d_p.scale)
    want = ref_bb(pq.numpy(), dq.numpy(), div) * 32767
    assert np.abs(qy.numpy() - want).max() <= 3
    # recompute the documented integer decode with python integers
    lf, m, n = (int(node.params[k]) for k in ("lut_frac_bits", "box_out_scale_value", "box_out_shift_value"))
    tabs = [node.constants[k].betensor.to(torch.int64).tolist() for k in ("lut_ty", "lut_tx", "lut_th", "lut_tw")]
    zp = int(p_p.zerop)
    pi, di = p_t.betensor.to(torch.int64).tolist(), d_t.betensor.to(torch.int64).tolist()
    for r in range(12):
        y0, x0, y1, x1 = pi[0][r]
        ly, lx, lh, lw = (table_value(tabs[k], di[0][r][k], d_p) for k in range(4))
        h, w = y1 - y0, x1 - x0
        yc = 2 * ly * h + ((y0 + y1 + 2 * zp) << lf)
        xc = 2 * lx * w + ((x0 + x1 + 2 * zp) << lf)
        for k, v in enumerate((yc - lh * h, xc - lw * w, yc + lh * h, xc + lw * w)):
            num = v * m
            qq = num // (1 << n)
            rem = num - qq * (1 << n)
            if 2 * rem > (1 << n) or (2 * rem == (1 << n) and qq % 2):
                qq += 1
            assert int(qy[0, r, k]) == min(max(qq, 0), 32767)
    roundtrip(tmp_path, qg, feeds)


def test_bounding_box_bad_params() -> None:
    feeds = bb_inputs(0)
    with pytest.raises(IRError, match="std_div"):
        bb_graph({"std_div": [10.0, 10.0, 0.0, 5.0]}).forward(feeds)
    with pytest.raises(IRError, match="std_div"):
        bb_graph({"std_div": [10.0, 10.0, 5.0]}).forward(feeds)
    with pytest.raises(UnsupportedError, match="coordinate_order XY"):
        bb_graph({"coordinate_order": "XY"}).forward(feeds)


# --- MultiboxTransformLoc ------------------------------------------------------------------------------------------
VAR = [0.1, 0.12, 0.2, 0.25]


def mb_graph(params):
    b = GraphBuilder("t")
    c = b.input("scores", [2, 4, 10])
    d = b.input("deltas", [2, 40])
    a = b.input("anchors", [1, 10, 4])
    ys = b.layer("MultiboxTransformLoc", [c, d, a], [[2, 10, 6], [2]], name="op", params=params,
                 output_dtypes=[Dtype.FP32, Dtype.INT32])
    return b.build(ys)


def mb_inputs(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, size=(2, 4, 10))
    scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    anchors = boxes(np.random.default_rng(99), 1, 10)[..., [1, 0, 3, 2]]
    return [torch.from_numpy(scores.astype(np.float32)),
            torch.from_numpy(rng.normal(0.0, 1.0, size=(2, 40)).astype(np.float32)), torch.from_numpy(anchors)]


def ref_mb(scores: list, keep, decode, fill_id, fill):
    """scores [N][C][A]; keep(score) -> bool; decode(b, a) -> (xmin, ymin, xmax, ymax)."""
    rows, counts = [], []
    for b, item in enumerate(scores):
        kept = []
        for a in range(len(item[0])):
            col = [item[c][a] for c in range(1, len(item))]
            best = max(col)
            if keep(best):
                kept.append([col.index(best), best] + list(decode(b, a)))
        counts.append(len(kept))
        rows.append(kept + [[fill_id] + [fill] * 5] * (len(item[0]) - len(kept)))
    return rows, counts


def test_multibox_transform_loc_float() -> None:
    g = mb_graph({"variance": VAR, "score_threshold": 0.4})
    c, d, a = mb_inputs(1)
    rows, counts = g.forward([c, d, a])
    dd = d.numpy().reshape(2, 10, 4)
    an = a.numpy()[0]

    def decode(b, i):
        p = an[i][[1, 0, 3, 2]][None]
        dl = (dd[b, i][[1, 0, 3, 2]] * np.array([VAR[1], VAR[0], VAR[3], VAR[2]]))[None]
        y = ref_bb(p, dl, [1.0, 1.0, 1.0, 1.0])[0]
        return y[[1, 0, 3, 2]]

    want_rows, want_counts = ref_mb(c.tolist(), lambda s: s > 0.4, decode, -1.0, -1.0)
    assert counts.tolist() == want_counts and 0 < min(want_counts) and max(want_counts) < 10
    np.testing.assert_allclose(rows.numpy(), np.array(want_rows), atol=1e-6)


@pytest.mark.parametrize("bits,mode", MODES)
def test_multibox_transform_loc_quantized(tmp_path, bits: int, mode: str) -> None:
    g = mb_graph({"variance": VAR, "score_threshold": 0.4})
    feeds = mb_inputs(1)
    qg = quantize_model(g, [mb_inputs(s) for s in (2, 3)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    c_t, d_t, a_t = node.inputs
    c_p = params_of(node, c_t)
    assert node.outputs[0].dtype == Dtype.INT16 and float(params_of(node, node.outputs[0]).scale) == 32767.0
    assert node.outputs[1].dtype == Dtype.UINT16 and params_of(node, node.outputs[1]).qinvariant
    rows, counts = qg.forward(feeds)
    cq = c_t.betensor.to(torch.int64).tolist()
    keep = []
    want_rows, want_counts = ref_mb(cq, lambda s: rat(s, c_p) > Fraction(0.4), lambda b, a: [0] * 4, -1, -32767)
    assert counts.tolist() == want_counts
    got = rows.numpy()
    want = np.array(want_rows)
    np.testing.assert_array_equal(got[..., 0], want[..., 0])  # class ids (raw integers), padding -1
    for b in range(2):
        n = want_counts[b]
        np.testing.assert_array_equal(got[b, n:, 1:], -32767)
        keep.append(n)
        # scores: the code of the kept score at scale 32767, within the multiplier's rounding
        s = np.array([float(rat(v, c_p)) for v in want[b, :n, 1]])
        assert np.abs(got[b, :n, 1] - s * 32767).max() <= 1.0
    # boxes: the float decode of the dequantized inputs, within a few codes
    deq = [(t.betensor.to(torch.float64) + int(params_of(node, t).zerop)) / float(params_of(node, t).scale)
           for t in (c_t, d_t, a_t)]
    dd = deq[1].numpy().reshape(2, 10, 4)
    an = deq[2].numpy().reshape(10, 4)
    for b in range(2):
        kept = [i for i in range(10) if float(max(deq[0][b, 1:, i])) > 0.4 and
                rat(max(cq[b][k][i] for k in range(1, 4)), c_p) > Fraction(0.4)]
        assert len(kept) == keep[b]
        for r, i in enumerate(kept):
            dl = (dd[b, i][[1, 0, 3, 2]] * np.array([VAR[1], VAR[0], VAR[3], VAR[2]]))[None]
            y = ref_bb(an[i][[1, 0, 3, 2]][None], dl, [1.0] * 4)[0][[1, 0, 3, 2]] * 32767
            assert np.abs(got[b, r, 2:] - y).max() <= 3
    roundtrip(tmp_path, qg, feeds)


def test_multibox_transform_loc_bad_params() -> None:
    feeds = mb_inputs(0)
    with pytest.raises(IRError, match="variance"):
        mb_graph({"variance": [0.1, 0.1, 0.2], "score_threshold": 0.4}).forward(feeds)
    with pytest.raises(IRError, match="variance"):
        mb_graph({"variance": [0.1, 0.0, 0.2, 0.2], "score_threshold": 0.4}).forward(feeds)
    with pytest.raises(IRError, match="variance"):
        mb_graph({"score_threshold": 0.4}).forward(feeds)


# --- Region --------------------------------------------------------------------------------------------------------
ANCHORS = [1.0, 1.5, 2.5, 2.0]


def region_graph(max_box: int = 96, compensate: bool = True, anchors=ANCHORS, grid=4):
    b = GraphBuilder("t")
    x = b.input("x", [1, grid, 4, 2, 8])
    ys = b.layer("Region", [x], [[1, max_box], [1, max_box, 4], [1, 3], [1, 3], [1, 1]], name="op",
                 params={"anchors": anchors, "obj_thresh": 0.3, "grid_height": grid, "grid_width": 4,
                         "box_per_grid": 2, "max_box_num": max_box, "class_num": 3, "grid_compensate": compensate})
    return b.build(ys)


def region_input(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.2, 1.5, size=(1, 4, 4, 2, 8)).astype(np.float32))


def ref_region(cands: list, max_box: int, classes: int = 3):
    """cands: (score, class, box) in scan order → the five outputs of one item (lists)."""
    if len(cands) > max_box:
        cands = sorted(cands, key=lambda c: -c[0])[:max_box]
    cands = sorted(cands, key=lambda c: c[1])  # stable: scan / score order within a class
    labels = sorted({c[1] for c in cands})
    n = len(cands)
    return ([c[0] for c in cands] + [0] * (max_box - n), [list(c[2]) for c in cands] + [[0] * 4] * (max_box - n),
            [sum(c[1] == k for c in cands) for k in labels] + [0] * (classes - len(labels)),
            labels + [0] * (classes - len(labels)), [len(labels)])


def float_region_cands(x: np.ndarray, compensate: bool, thr: float = 0.3):
    x = x.astype(np.float64)
    out = []
    gh, gw = x.shape[0], x.shape[1]
    half = 0.5 if compensate and gh % 2 == 0 and gw % 2 == 0 else 0.0
    for r in range(gh):
        for c in range(gw):
            for k in range(2):
                v = x[r, c, k]
                conf = 1 / (1 + math.exp(-v[4]))
                e = np.exp(v[5:] - v[5:].max())
                for cls in range(3):
                    sc = conf * e[cls] / e.sum()
                    if sc > thr:
                        cx = (c - half + 1 / (1 + math.exp(-v[0]))) / gw
                        cy = (r - half + 1 / (1 + math.exp(-v[1]))) / gh
                        w = ANCHORS[2 * k] * math.exp(v[2]) / gw
                        h = ANCHORS[2 * k + 1] * math.exp(v[3]) / gh
                        box = np.clip([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], 0, 1)
                        out.append((sc, cls, box))
    return out


@pytest.mark.parametrize("max_box,compensate", [(96, True), (96, False), (5, True)])
def test_region_float(max_box: int, compensate: bool) -> None:
    g = region_graph(max_box, compensate)
    x = region_input(1)
    got = g.forward([x])
    cands = float_region_cands(x[0].numpy(), compensate)
    want = ref_region(cands, max_box)
    np.testing.assert_allclose(got[0][0].numpy(), want[0], atol=1e-6)
    np.testing.assert_allclose(got[1][0].numpy(), np.array(want[1]), atol=1e-6)
    assert [o[0].tolist() for o in got[2:]] == [[float(v) for v in w] for w in want[2:]]
    assert len(cands) > 5 and want[4][0] >= 2  # the max_box_num = 5 case picks


def int_region_cands(node, q: list, compensate: bool):
    """The documented integer Region on python integers (tables from the node, Fractions for every division)."""
    t = params_of(node, node.inputs[0])
    lo, hi = int(t.qmin), int(t.qmax)
    bits = (hi - lo).bit_length()
    levels = 2 ** bits - 1
    tab = {k: node.constants[k].betensor.to(torch.int64).tolist() for k in ("sigmoid_table", "softmax_table",
                                                                          "exp_table", "anchor_table")}

    def look(name, v, start):
        table = tab[name]
        b = bits - (len(table) - 1).bit_length() + 1
        idx = min(max(v, start), start + levels) - start
        i, r = idx >> b, idx & ((1 << b) - 1)
        return table[i] + math.floor(Fraction((table[i + 1] - table[i]) * r, 1 << b))

    def rnd(f: Fraction) -> int:
        return round(f)  # python's round of a Fraction: half to even

    thr, fe, cs = (int(node.params[k]) for k in ("obj_thresh", "region_table_bits", "col_shift"))
    out = []
    for r in range(4):
        for c in range(4):
            for k in range(2):
                v = q[r][c][k]
                conf = look("sigmoid_table", v[4], lo)
                m = max(v[5:])
                e = [look("softmax_table", u - m, -levels) for u in v[5:]]
                for cls in range(3):
                    score = Fraction(conf * e[cls] * levels, sum(e) << 15)
                    if score > thr:
                        half = Fraction(1, 2) if compensate else 0
                        cx = c - half + Fraction(look("sigmoid_table", v[0], lo), 1 << 15)
                        cy = r - half + Fraction(look("sigmoid_table", v[1], lo), 1 << 15)
                        w = Fraction(tab["anchor_table"][2 * k] * look("exp_table", v[2], lo), 1 << (10 + fe))
                        h = Fraction(tab["anchor_table"][2 * k + 1] * look("exp_table", v[3], lo), 1 << (10 + fe))
                        box = [min(max(rnd((cy - h / 2) * 2 ** cs / 4), 0), 2 ** cs),
                               min(max(rnd((cx - w / 2) * 2 ** cs / 4), 0), 2 ** cs),
                               min(max(rnd((cy + h / 2) * 2 ** cs / 4), 0), 2 ** cs),
                               min(max(rnd((cx + w / 2) * 2 ** cs / 4), 0), 2 ** cs)]
                        out.append((score, cls, box))
    return out


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("max_box", [96, 5])
def test_region_quantized(tmp_path, bits: int, mode: str, max_box: int) -> None:
    g = region_graph(max_box)
    x = region_input(1)
    qg = quantize_model(g, [[region_input(s)] for s in (2, 3)] + [[x]], settings(bits, mode))
    node = qg.node("op")
    t = node.inputs[0]
    levels = 2 ** bits - 1
    o = node.outputs
    op = [params_of(node, ot) for ot in o]
    assert float(op[0].scale) == levels and int(op[0].zerop) == 0
    assert o[0].dtype == (Dtype.UINT8 if bits == 8 else Dtype.UINT16)
    assert o[1].dtype == Dtype.INT16 and float(op[1].scale) == 2.0 ** node.params["col_shift"]
    assert node.params["col_shift"] == 13 and node.params["obj_thresh"] == math.floor(0.3 * levels)
    assert [x.dtype for x in o[2:]] == [Dtype.UINT16, Dtype.INT16, Dtype.UINT16]
    got = qg.forward([x])
    q = t.betensor.to(torch.int64)[0].tolist()
    cands = int_region_cands(node, q, True)
    want = ref_region(cands, max_box)
    want_scores = [round(s) if s else 0 for s in want[0]]
    assert got[0][0].tolist() == want_scores
    assert got[1][0].tolist() == want[1]
    assert [v[0].tolist() for v in got[2:]] == list(want[2:])
    # close to the float Region of the dequantized input
    if max_box == 96:
        tq = params_of(node, t)
        deq = ((t.betensor.to(torch.float64) + int(tq.zerop)) / float(tq.scale))[0].numpy()
        fwant = ref_region(float_region_cands(deq, True, math.floor(0.3 * levels) / levels), max_box)
        assert got[2][0].tolist() == fwant[2]
        # 8 bits: within 2 output codes; 16 bits: the 2^8-entry tables' interpolation error dominates
        assert np.abs(got[0][0].numpy() / levels - np.array(fwant[0])).max() <= max(2.0 / levels, 1e-4)
        assert np.abs(got[1][0].numpy() / 2.0 ** 13 - np.array(fwant[1])).max() < 2e-3
    roundtrip(tmp_path, qg, [x])


def test_region_bad_params() -> None:
    x = region_input(0)
    with pytest.raises(IRError, match="anchors"):
        region_graph(anchors=[1.0, 2.0]).forward([x])
    with pytest.raises(IRError, match="grid_height"):
        b = GraphBuilder("t")
        xi = b.input("x", [1, 4, 4, 2, 8])
        b.build(b.layer("Region", [xi], [[1, 9], [1, 9, 4], [1, 3], [1, 3], [1, 1]], name="op",
                        params={"anchors": ANCHORS, "obj_thresh": 0.3, "grid_height": 5})).forward([x])


# --- RegionFuse ----------------------------------------------------------------------------------------------------
def fuse_graph():
    b = GraphBuilder("t")
    outs = []
    for i, grid in enumerate((4, 2)):
        x = b.input(f"x{i}", [1, grid, 4, 2, 8])  # grid rows 4 and 2, columns 4
        outs.append(b.layer("Region", [x], [[1, 96], [1, 96, 4], [1, 3], [1, 3], [1, 1]], name=f"region{i}",
                            params={"anchors": ANCHORS, "obj_thresh": 0.3, "max_box_num": 96}))
    ins = [outs[i][k] for k in range(5) for i in range(2)]
    return b.build(b.layer("RegionFuse", ins, [[1, 150], [1, 150, 4], [1, 3], [1, 3], [1, 1]], name="op"))


def fuse_inputs(seed: int):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.normal(0.2, 1.5, size=(1, g, 4, 2, 8)).astype(np.float32)) for g in (4, 2)]


def ref_fuse(a: list, b: list, cap: int = 150):
    """a, b: the five Region outputs of one item as lists (scores, boxes, counts, labels, total)."""
    blocks: Dict[int, list] = {}
    for item in (a, b):
        start = 0
        for c in range(int(item[4][0])):
            n = int(item[2][c])
            blocks.setdefault(int(item[3][c]), []).append([(item[0][j], item[1][j]) for j in range(start, start + n)])
            start += n
    scores, bxs, counts, labels = [], [], [], []
    for lab in sorted(blocks):
        rows = [r for blk in blocks[lab] for r in blk]
        scores += [r[0] for r in rows]
        bxs += [list(r[1]) for r in rows]
        counts.append(len(rows))
        labels.append(lab)
    n = len(scores)
    return (scores + [0] * (cap - n), bxs + [[0] * 4] * (cap - n), counts + [0] * (3 - len(counts)),
            labels + [0] * (3 - len(labels)), [len(labels)])


def region_lists(g, name: str) -> list:
    return [g.node(name).outputs[k].betensor[0].tolist() for k in range(5)]


@pytest.mark.parametrize("bits,mode", MODES)
def test_region_fuse(tmp_path, bits: int, mode: str) -> None:
    g = fuse_graph()
    feeds = fuse_inputs(1)
    got = g.forward(feeds, keep_tensors=True)
    want = ref_fuse(region_lists(g, "region0"), region_lists(g, "region1"))
    assert got[0][0].tolist() == want[0] and got[1][0].tolist() == want[1]
    assert [o[0].tolist() for o in got[2:]] == [[float(v) for v in w] for w in want[2:]]
    assert want[4][0] == 3 and sum(want[2]) > 10
    qg = quantize_model(g, [fuse_inputs(s) for s in (2, 3)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    levels = 2 ** bits - 1
    assert float(params_of(node, node.outputs[0]).scale) == levels
    assert float(params_of(node, node.outputs[1]).scale) == 32767.0
    assert node.outputs[1].dtype == Dtype.INT16
    got = qg.forward(feeds, keep_tensors=True)
    r0, r1 = region_lists(qg, "region0"), region_lists(qg, "region1")
    # scores: same scale in and out (identity); boxes: from scale 2^13 (grid width 4) to 32767, rounded half to even
    for item, name in ((r0, "region0"), (r1, "region1")):
        assert float(params_of(qg.node(name), qg.node(name).outputs[1]).scale) == 2.0 ** 13
        item[1] = [[round(Fraction(int(v) * 32767, 2 ** 13)) for v in box] for box in item[1]]
    want = ref_fuse(r0, r1)
    assert got[0][0].tolist() == [int(v) for v in want[0]]
    assert np.abs(got[1][0].numpy() - np.array(want[1])).max() <= 1  # the 15-bit multipliers of 32767 / 2^cs
    assert [o[0].tolist() for o in got[2:]] == [[int(v) for v in w] for w in want[2:]]
    roundtrip(tmp_path, qg, feeds)


def test_region_fuse_bad_inputs() -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 4])
    with pytest.raises(IRError, match="10 inputs"):
        b.build(b.layer("RegionFuse", [x], [[1, 4], [1, 4, 4], [1, 3], [1, 3], [1, 1]], name="op")).forward(
            [torch.zeros(1, 4)])
