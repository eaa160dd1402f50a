"""DecodeBox, NMS and DetectionOutput: float forward against straightforward numpy implementations, integer forward
against an independent python-int reference written from docs/semantics/detection.md, float-vs-dequantized cosine
with exact selections on well-separated scores, IR write → re-read, parameter errors."""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant

import quantopt.ops.detection  # noqa: F401  (registers the ops)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

A, K, CN = 40, 4, 3  # anchors, score columns, classes (one background column)
MAXB, MAXC, NMSB = 30, 3, 16
R, DC = 10, 3  # DetectionOutput proposals and classes
VAR = [10.0, 10.0, 5.0, 5.0]


def anchors(seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    return np.stack([r.uniform(0, 1, A), r.uniform(0, 1, A), r.uniform(0.1, 0.4, A), r.uniform(0.1, 0.4, A)],
                    1).astype(np.float32)


def ssd_batch(seed: int, n: int = 2, separated: bool = False) -> List[torch.Tensor]:
    """Scores in (0, 1) and deltas; `separated`: scores differ from each other and from the 0.5 threshold by more
    than one 8-bit step (or are exact duplicates)."""
    r = np.random.default_rng(seed)
    if separated:
        grid = 0.023 + 0.006 * np.arange(A * K)  # distinct values more than one 8-bit step apart
        scores = np.stack([r.permutation(grid).reshape(A, K) for _ in range(n)])
        scores[np.abs(scores - 0.5) < 0.008] = 0.2  # exact duplicates tie the same way in float and integer
    else:
        scores = 1 / (1 + np.exp(-r.normal(0, 2, (n, A, K))))
    return [torch.from_numpy(scores.astype(np.float32)),
            torch.from_numpy(r.normal(0, 1.5, (n, A, 4)).astype(np.float32))]


def ssd_graph(params: Dict[str, Any], with_nms: bool = True, nms_params: Optional[Dict[str, Any]] = None):
    b = GraphBuilder("ssd")
    sc = b.input("sc", [1, A, K])
    de = b.input("de", [1, A, 4])
    p = dict(class_num=CN, score_threshold=0.5)
    p.update(params)
    outs = b.layer("DecodeBox", [sc, de], [[1, MAXB, 4], [1, MAXC], [1, 1], [1, MAXB], [1, MAXC]], name="dec",
                   params=p, constants=dict(weights=anchors()))
    tops = list(outs)
    if with_nms:
        nms = b.layer("NMS", [outs[0], outs[1], outs[2], outs[3]], [[1, NMSB, 4], [1, MAXC], [1, NMSB], [1, NMSB]],
                      name="nms", params={"iou_threshold": 0.45, "max_output_size": 6, **(nms_params or {})})
        tops += list(nms)
    return b.build(tops)


# --- independent float references ---------------------------------------------------------------------------------
def select_ssd(values: np.ndarray, passed: np.ndarray, max_box: int, max_class: int):
    cand = [(a, k) for a in range(values.shape[0]) for k in range(values.shape[1]) if passed[a, k]]
    if len(cand) > max_box:
        order = sorted(range(len(cand)), key=lambda j: (-values[cand[j]], j))[:max_box]
        cand = [cand[j] for j in sorted(order)]
    classes = sorted({k for _, k in cand})[:max_class]
    groups = [[(a, k) for a, k in cand if k == c] for c in classes]
    return [x for grp in groups for x in grp], [len(grp) for grp in groups], classes


def np_decode(scores, deltas, anc, thr, variance=VAR, clip=True, hmax=1.0, wmax=1.0):
    batch = scores.shape[0]
    ya, xa, ha, wa = (anc[:, k].astype(np.float64) for k in range(4))
    outs = [np.zeros((batch, MAXB, 4)), np.zeros((batch, MAXC)), np.zeros((batch, 1)), np.zeros((batch, MAXB)),
            np.zeros((batch, MAXC))]
    for n in range(batch):
        t = deltas[n].astype(np.float64)
        cy, cx = t[:, 0] / variance[0] * ha + ya, t[:, 1] / variance[1] * wa + xa
        h, w = np.exp(t[:, 2] / variance[2]) * ha, np.exp(t[:, 3] / variance[3]) * wa
        box = np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], 1)
        if clip:
            box = np.stack([np.clip(box[:, 0], 0, hmax), np.clip(box[:, 1], 0, wmax), np.clip(box[:, 2], 0, hmax),
                            np.clip(box[:, 3], 0, wmax)], 1)
        cls = scores[n][:, K - CN:]
        sel, counts, classes = select_ssd(cls, cls > thr, MAXB, MAXC)
        for j, (a, k) in enumerate(sel):
            outs[0][n, j] = box[a]
            outs[3][n, j] = cls[a, k]
        outs[1][n, :len(counts)] = counts
        outs[4][n, :len(classes)] = classes
        outs[2][n, 0] = len(classes)
    return outs


def greedy_nms(boxes, scores, passed, suppress, limit) -> List[int]:
    order = sorted([i for i in range(len(scores)) if passed[i]], key=lambda i: (-scores[i], i))
    kept: List[int] = []
    for i in order:
        if len(kept) >= limit:
            break
        if all(not suppress(boxes[i], boxes[j]) for j in kept):
            kept.append(i)
    return kept


def inter_union(a, b):
    ay0, ay1 = min(a[0], a[2]), max(a[0], a[2])
    ax0, ax1 = min(a[1], a[3]), max(a[1], a[3])
    by0, by1 = min(b[0], b[2]), max(b[0], b[2])
    bx0, bx1 = min(b[1], b[3]), max(b[1], b[3])
    inter = max(0, min(ay1, by1) - max(ay0, by0)) * max(0, min(ax1, bx1) - max(ax0, bx0))
    return inter, (ay1 - ay0) * (ax1 - ax0) + (by1 - by0) * (bx1 - bx0) - inter


def run_nms(boxes, counts, total, scores, passed, suppress, limit):
    batch = boxes.shape[0]
    outs = [np.zeros((batch, NMSB, 4), dtype=boxes.dtype), np.zeros((batch, MAXC), dtype=boxes.dtype),
            np.zeros((batch, NMSB), dtype=boxes.dtype), np.zeros((batch, NMSB), dtype=boxes.dtype)]
    for n in range(batch):
        start = filled = 0
        for c in range(int(total[n, 0])):
            cnt = int(counts[n, c])
            if cnt == 0:
                continue
            blk = range(start, start + cnt)
            kept = greedy_nms([boxes[n, i] for i in blk], [scores[n, i] for i in blk], [passed[n, i] for i in blk],
                              suppress, limit)[:NMSB - filled]
            for j, i in enumerate(kept):
                outs[0][n, filled + j] = boxes[n, start + i]
                outs[2][n, filled + j] = scores[n, start + i]
                outs[3][n, filled + j] = start + i
            outs[1][n, c] = len(kept)
            filled += len(kept)
            start += cnt
    return outs


def float_suppress(t: float):
    def f(a, b) -> bool:
        inter, union = inter_union(a, b)
        return inter > t * union
    return f


# --- 1. float forward ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [{}, {"clip": False, "variance": [5.0, 5.0, 2.0, 2.0]},
                                    {"score_threshold": 0.2, "height_max": 0.8, "width_max": 0.9}])
def test_decodebox_and_nms_float_match_numpy(params: Dict[str, Any]) -> None:
    g = ssd_graph(params)
    data = ssd_batch(1)
    got = [t.numpy().astype(np.float64) for t in g.forward(data)]
    ref = np_decode(data[0].numpy(), data[1].numpy(), anchors(), params.get("score_threshold", 0.5),
                    params.get("variance", VAR), params.get("clip", True), params.get("height_max", 1.0),
                    params.get("width_max", 1.0))
    for a, b in zip(got[:5], ref):
        np.testing.assert_allclose(a, b, atol=2e-6)
    # NMS on the float DecodeBox outputs
    dec = [t.astype(np.float64) for t in got[:5]]
    nref = run_nms(dec[0], dec[1], dec[2], dec[3], dec[3] > -np.inf, float_suppress(0.45), 6)
    for a, b in zip(got[5:], nref):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert got[2][0, 0] > 0 and got[6].sum() > 0


def detout_graph(params: Dict[str, Any]):
    b = GraphBuilder("frcnn")
    cf = b.input("cf", [1, R, DC + 1])
    en = b.input("en", [1, R, DC, 4])
    pr = b.input("pr", [1, R, 4])
    p = dict(score_threshold=0.3, image_height=100.0, image_width=120.0, variance=[10.0, 10.0, 5.0, 5.0])
    p.update(params)
    outs = b.layer("DetectionOutput", [cf, en, pr], [[1, 20], [1, 20, 4], [1, DC], [1, DC], [1, 1]], name="do",
                   params=p)
    return b.build(list(outs))


def detout_batch(seed: int, n: int = 2, caffe: bool = False, separated: bool = False) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    y0, x0 = r.uniform(0, 60, (n, R)), r.uniform(0, 80, (n, R))
    p = np.stack([y0, x0, y0 + r.uniform(10, 40, (n, R)), x0 + r.uniform(10, 40, (n, R))], -1)
    if caffe:
        p = p[..., [1, 0, 3, 2]]
    if separated:
        grid = 0.05 + 0.0213 * np.arange(R * (DC + 1))
        conf = np.stack([r.permutation(grid).reshape(R, DC + 1) for _ in range(n)])
        conf[np.abs(conf - 0.3) < 0.01] = 0.25
    else:
        e = np.exp(r.normal(0, 1.5, (n, R, DC + 1)))
        conf = e / e.sum(-1, keepdims=True)
    return [torch.from_numpy(conf.astype(np.float32)),
            torch.from_numpy(r.normal(0, 1.0, (n, R, DC, 4)).astype(np.float32)),
            torch.from_numpy(p.astype(np.float32))]


def np_detout(conf, enc, prop, thr, variance, height, width, caffe):
    batch = conf.shape[0]
    outs = [np.zeros((batch, 20)), np.zeros((batch, 20, 4)), np.zeros((batch, DC)), np.zeros((batch, DC)),
            np.zeros((batch, 1))]
    for n in range(batch):
        e = enc[n].astype(np.float64)
        p = prop[n].astype(np.float64)
        if caffe:
            e, p = e[..., [1, 0, 3, 2]], p[..., [1, 0, 3, 2]]
        cy, cx = ((p[:, 0] + p[:, 2]) / 2)[:, None], ((p[:, 1] + p[:, 3]) / 2)[:, None]
        ha, wa = (p[:, 2] - p[:, 0])[:, None], (p[:, 3] - p[:, 1])[:, None]
        y, x = e[..., 0] / variance[0] * ha + cy, e[..., 1] / variance[1] * wa + cx
        h, w = np.exp(e[..., 2] / variance[2]) * ha, np.exp(e[..., 3] / variance[3]) * wa
        box = np.stack([np.clip(y - h / 2, 0, height), np.clip(x - w / 2, 0, width), np.clip(y + h / 2, 0, height),
                        np.clip(x + w / 2, 0, width)], -1)
        sc = conf[n][:, 1:]
        j = 0
        classes: List[int] = []
        counts: List[int] = []
        for k in range(DC):
            for r_ in range(R):
                if sc[r_, k] > thr and j < 20:
                    outs[0][n, j], outs[1][n, j] = sc[r_, k], box[r_, k]
                    if not classes or classes[-1] != k:
                        classes.append(k)
                        counts.append(0)
                    counts[-1] += 1
                    j += 1
        outs[2][n, :len(counts)] = counts
        outs[3][n, :len(classes)] = classes
        outs[4][n, 0] = len(classes)
    return outs


@pytest.mark.parametrize("caffe", [False, True])
def test_detectionoutput_float_matches_numpy(caffe: bool) -> None:
    params = {"anchor_mode": "caffe_detection"} if caffe else {}
    g = detout_graph(params)
    data = detout_batch(2, caffe=caffe)
    got = [t.numpy().astype(np.float64) for t in g.forward(data)]
    ref = np_detout(*(t.numpy() for t in data), 0.3, [10.0, 10.0, 5.0, 5.0], 100.0, 120.0, caffe)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=3e-5)
    assert got[4].sum() > 0


# --- 2. integer forward == python-int reference -------------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def table_read(node, key: str, q: int, t) -> int:
    """Decode table entry for delta code q: index q - qmin (q - qmin + 1 for a restricted range), high bits select,
    low bits interpolate with a floored division."""
    tab = [int(v) for v in node.constants[key].betensor.tolist()]
    tp = params_of(node, t)
    bits = (tp.qmax - tp.qmin).bit_length()
    offset = tp.qmin - 1 if (tp.qmin < 0 and tp.qmin == -tp.qmax) else tp.qmin
    idx = clamp(q - offset, 0, 2 ** bits - 1)
    tb = len(tab).bit_length() - 1
    if bits <= tb:
        return tab[min(idx, len(tab) - 1)]
    s = bits - tb
    hi, lo = idx >> s, idx & ((1 << s) - 1)
    a = tab[hi]
    c = tab[hi + 1] if hi + 1 < len(tab) else a
    return clamp(a + ((c - a) * lo) // (1 << s), -2 ** 31, 2 ** 31 - 1)


def int_decode(node, tq: Sequence[int], deltas, cy2: int, cx2: int, ha: int, wa: int, box_out, clip: bool):
    p = node.params
    lf = p["lut_frac_bits"]
    ly, lx, lh, lw = (table_read(node, k, int(tq[i]), deltas) for i, k in enumerate(("lut_ty", "lut_tx", "lut_th",
                                                                                      "lut_tw")))
    y2, x2 = 2 * ly * ha + cy2 * 2 ** lf, 2 * lx * wa + cx2 * 2 ** lf
    h, w = lh * ha, lw * wa
    bp = params_of(node, box_out)
    zp = int(bp.zerop)
    v = [clamp(rhe(u * p["box_scale_value"], p["box_shift_value"]) - zp, bp.qmin, bp.qmax)
         for u in (y2 - h, x2 - w, y2 + h, x2 + w)]
    if not clip:
        return v
    lo = clamp(-zp, bp.qmin, bp.qmax)
    return [clamp(v[0], lo, p["height"]), clamp(v[1], lo, p["width"]), clamp(v[2], lo, p["height"]),
            clamp(v[3], lo, p["width"])]


def ref_decodebox(node, sq: np.ndarray, tq: np.ndarray) -> List[np.ndarray]:
    p = node.params
    anc = node.constants["weights"].betensor.long().reshape(-1, 4).tolist()
    batch = sq.shape[0]
    outs = [np.zeros((batch, MAXB, 4), np.int64), np.zeros((batch, MAXC), np.int64), np.zeros((batch, 1), np.int64),
            np.zeros((batch, MAXB), np.int64), np.zeros((batch, MAXC), np.int64)]
    for n in range(batch):
        cls = sq[n][:, K - CN:].astype(np.int64)
        sel, counts, classes = select_ssd(cls, cls > p["score_threshold_value"], MAXB, MAXC)
        for j, (a, k) in enumerate(sel):
            ya, xa, ha, wa = anc[a]
            outs[0][n, j] = int_decode(node, tq[n, a], node.inputs[1], 2 * ya, 2 * xa, ha, wa, node.outputs[0],
                                       p.get("clip", True))
            outs[3][n, j] = cls[a, k]
        outs[1][n, :len(counts)] = counts
        outs[4][n, :len(classes)] = classes
        outs[2][n, 0] = len(classes)
    return outs


def int_suppress(t_q: int, sh: int):
    def f(a, b) -> bool:
        inter, union = inter_union([int(v) for v in a], [int(v) for v in b])
        return inter * 2 ** sh > t_q * union
    return f


MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"), (16, "per_tensor_asymmetric")]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=8 if bits == 8 else 10, **extra)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("params", [{}, {"clip": False}])
def test_decodebox_nms_integer_matches_reference(params: Dict[str, Any], bits: int, mode: str) -> None:
    g = ssd_graph(params, nms_params={"score_threshold": 0.6})
    qg = quantize_model(g, [ssd_batch(s) for s in (3, 4)], settings(bits, mode))
    data = ssd_batch(5, n=3)
    qg.forward(data)
    dec, nms = qg.node("dec"), qg.node("nms")
    got = [t.betensor for t in dec.outputs]
    want = ref_decodebox(dec, dec.inputs[0].betensor.numpy(), dec.inputs[1].betensor.numpy())
    for a, b in zip(got, want):
        assert a.dtype == torch.int64
        np.testing.assert_array_equal(a.numpy(), b)
    ins = [t.betensor.numpy().astype(np.int64) for t in nms.inputs]
    p = nms.params
    nref = run_nms(ins[0], ins[1], ins[2], ins[3], ins[3] > p["score_threshold_value"],
                   int_suppress(p["iou_threshold_value"], p["iou_threshold_shift"]), 6)
    for a, b in zip([t.betensor for t in nms.outputs], nref):
        np.testing.assert_array_equal(a.numpy(), b)
    assert int(nms.outputs[1].betensor.sum()) > 0


def ref_detout(node, conf: np.ndarray, enc: np.ndarray, prop: np.ndarray, caffe: bool) -> List[np.ndarray]:
    p = node.params
    batch = conf.shape[0]
    zp = int(params_of(node, node.inputs[2]).zerop)
    outs = [np.zeros((batch, 20), np.int64), np.zeros((batch, 20, 4), np.int64), np.zeros((batch, DC), np.int64),
            np.zeros((batch, DC), np.int64), np.zeros((batch, 1), np.int64)]
    for n in range(batch):
        j = 0
        classes: List[int] = []
        counts: List[int] = []
        for k in range(DC):
            for r_ in range(R):
                s = int(conf[n, r_, k + 1])
                if s > p["score_threshold_value"] and j < 20:
                    e = [int(v) for v in enc[n, r_, k]]
                    q = [int(v) for v in prop[n, r_]]
                    if caffe:
                        e, q = [e[1], e[0], e[3], e[2]], [q[1], q[0], q[3], q[2]]
                    outs[0][n, j] = s
                    outs[1][n, j] = int_decode(node, e, node.inputs[1], q[0] + q[2] + 2 * zp, q[1] + q[3] + 2 * zp,
                                               q[2] - q[0], q[3] - q[1], node.outputs[1], True)
                    if not classes or classes[-1] != k:
                        classes.append(k)
                        counts.append(0)
                    counts[-1] += 1
                    j += 1
        outs[2][n, :len(counts)] = counts
        outs[3][n, :len(classes)] = classes
        outs[4][n, 0] = len(classes)
    return outs


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("caffe", [False, True])
def test_detectionoutput_integer_matches_reference(caffe: bool, bits: int, mode: str) -> None:
    g = detout_graph({"anchor_mode": "caffe_detection"} if caffe else {})
    qg = quantize_model(g, [detout_batch(s, caffe=caffe) for s in (6, 7)], settings(bits, mode))
    qg.forward(detout_batch(8, n=3, caffe=caffe))
    node = qg.node("do")
    want = ref_detout(node, *(t.betensor.numpy() for t in node.inputs), caffe)
    for a, b in zip([t.betensor for t in node.outputs], want):
        assert a.dtype == torch.int64
        np.testing.assert_array_equal(a.numpy(), b)
    assert int(node.outputs[4].betensor.sum()) > 0


# --- 3. float vs dequantized, exact selections ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 16])
def test_ssd_head_cosine_and_exact_indices(bits: int) -> None:
    g = ssd_graph({})
    data = [ssd_batch(s, separated=True) for s in (9, 10)]
    qg = quantize_model(g, data, settings(bits, "per_tensor_symmetric_full_range", q_strategy_activation="extrema"))
    ref = [t.clone() for t in g.forward(data[0])]
    got = run_quantized(qg, data[0])
    for idx in (1, 2, 4, 6, 8):  # counts, totals, labels, NMS counts and kept indices: exact
        assert params_of(qg.nodes[-1], qg.output_tensors[idx]).qinvariant
        assert torch.equal(ref[idx], got[idx]), idx
    for idx in (0, 3, 5, 7):  # boxes and scores
        assert cosine(ref[idx], got[idx]) > (0.99 if bits == 8 else 0.9999)
    assert qg.output_tensors[0].dtype in (Dtype.UINT16, Dtype.INT16)


@pytest.mark.parametrize("bits", [8, 16])
def test_detectionoutput_cosine_and_exact_counts(bits: int) -> None:
    g = detout_graph({})
    data = [detout_batch(s, separated=True) for s in (11, 12)]
    qg = quantize_model(g, data, settings(bits, "per_tensor_symmetric_full_range", q_strategy_activation="extrema"))
    ref = [t.clone() for t in g.forward(data[0])]
    got = run_quantized(qg, data[0])
    for idx in (2, 3, 4):
        assert torch.equal(ref[idx], got[idx])
    for idx in (0, 1):
        assert cosine(ref[idx], got[idx]) > (0.99 if bits == 8 else 0.9999)


def test_score_threshold_code_is_exact() -> None:
    """q > T  <=>  (q + zp) / s > threshold, checked over the whole integer range."""
    from quantopt.graph.node import PyNode
    from quantopt.graph.tensor import PyTensor
    from quantopt.ops.detection import score_threshold_code
    t = PyTensor("s")
    node = PyNode("detect", "DetectionOutput")
    node.inputs = [t]
    for scale, zp, thr in [(255.0, 0, 0.5), (127.5, -128, 0.3), (3.0, 5, 2.0), (65535.0 / 0.97, 0, 0.6)]:
        set_quant(node, t, scale=scale, zerop=zp, qmin=-300, qmax=70000)
        code = score_threshold_code(node, thr, t)
        for q in range(-300, 70000, 7):
            assert (q > code) == (Fraction(q + zp) / Fraction(scale) > Fraction(thr))


# --- 4. IR round trip ---------------------------------------------------------------------------------------------
def test_ir_write_read_bit_identical(tmp_path) -> None:
    g = ssd_graph({})
    qg = quantize_model(g, [ssd_batch(s) for s in (13, 14)], settings(8, "per_tensor_asymmetric"))
    data = ssd_batch(15)
    before = [t.clone() for t in qg.forward(data)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(data)):
        assert a.dtype == torch.int64 and torch.equal(a, b)
    g2 = detout_graph({})
    qg2 = quantize_model(g2, [detout_batch(s) for s in (16, 17)], settings(16, "per_tensor_symmetric_full_range"))
    d2 = detout_batch(18)
    before = [t.clone() for t in qg2.forward(d2)]
    re2 = read_ir(write_ir(qg2, str(tmp_path / "d.txt"))[0])
    for a, b in zip(before, re2.forward(d2)):
        assert torch.equal(a, b)


# --- 5. errors ----------------------------------------------------------------------------------------------------
def test_bad_params_are_errors() -> None:
    data = ssd_batch(19)
    with pytest.raises(IRError, match="variance"):
        ssd_graph({"variance": [1.0, 2.0]}, with_nms=False).forward(data)
    with pytest.raises(IRError, match="class_num"):
        ssd_graph({"class_num": 9}, with_nms=False).forward(data)
    with pytest.raises(IRError, match="iou_threshold"):
        ssd_graph({}, nms_params={"iou_threshold": 1.5}).forward(data)
    with pytest.raises(UnsupportedError, match="'nms'.*GAUSSIAN"):
        ssd_graph({}, nms_params={"method": "GAUSSIAN"}).forward(data)
    with pytest.raises(IRError, match="anchor_mode"):
        detout_graph({"anchor_mode": "yolo"}).forward(detout_batch(20))
    with pytest.raises(IRError, match="image_height"):
        g = detout_graph({})
        g.node("do").params.pop("image_height")
        g.forward(detout_batch(20))


def test_anchor_input_is_unsupported() -> None:
    b = GraphBuilder("x")
    sc, de, an = b.input("sc", [1, A, K]), b.input("de", [1, A, 4]), b.input("an", [A, 4])
    outs = b.layer("DecodeBox", [sc, de, an], [[1, MAXB, 4], [1, MAXC], [1, 1], [1, MAXB], [1, MAXC]],
                   params=dict(class_num=CN, score_threshold=0.5))
    g = b.build(list(outs))
    with pytest.raises(UnsupportedError, match="anchors given as an input"):
        g.forward(ssd_batch(21) + [torch.from_numpy(anchors())])
