"""PostNMS1 and PostNMS2 (quantopt/ops/proposals.py): float forward against plain python references written from
docs/semantics/proposals.md, quantized params, the integer forward against the same references on the integers
(PostNMS1's normalized boxes against an exact rational requantization), IR round trip, refused non-integer index
inputs and bad input counts."""
from __future__ import annotations

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
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str):
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema")


def const(b: GraphBuilder, name: str, vals: list) -> str:
    data = np.array(vals, dtype=np.float32).reshape(1, -1)
    return b.layer("Constant", [], [list(data.shape)], name=name, constants={"weights": data})


def pixel_boxes(seed: int, n: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    y0, x0 = rng.uniform(0, 350, size=(2, 1, n))
    h, w = rng.uniform(10, 240, size=(2, 1, n))
    return torch.from_numpy(np.stack([y0, x0 * 1.3, y0 + h, x0 * 1.3 + w], axis=-1).astype(np.float32))


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


# --- PostNMS1 ------------------------------------------------------------------------------------------------------
KEEP, COUNTS = [3, 0, 7, 1, 2, 5, 9], [4, 3]


def pn1_graph(cnt: int = 6, keep=KEEP, counts=COUNTS):
    b = GraphBuilder("t")
    p = b.input("proposals", [1, 12, 4])
    ys = b.layer("PostNMS1", [p, const(b, "keep", keep), const(b, "counts", counts)], [[1, cnt, 4], [1, cnt, 4]],
                 name="op", params={"image_height": 600, "image_width": 800, "proposal_cnt": cnt})
    return b.build(ys)


def ref_pn1(boxes: list, cnt: int, fill, keep=KEEP, counts=COUNTS):
    out, offset = [], 0
    for c in counts:
        for _ in range(c):
            if len(out) >= cnt or len(out) >= len(keep):
                break
            idx = offset + keep[len(out)]
            if idx >= len(boxes):
                break
            out.append(list(boxes[idx]))
        offset += c
    return out, out + [[fill] * 4] * (cnt - len(out))


@pytest.mark.parametrize("cnt", [6, 8])
def test_post_nms1_float(cnt: int) -> None:
    g = pn1_graph(cnt)
    p = pixel_boxes(1, 12)
    kept, norm = g.forward([p])
    rows, want = ref_pn1(p[0].tolist(), cnt, 0.0)
    assert kept[0].tolist() == want
    np.testing.assert_allclose(norm[0].numpy(), np.array(want) / 800.0, rtol=1e-6)
    # class 1 starts at offset 4: 4 + 2, 4 + 5, 4 + 9 (beyond the 12 proposals: the class ends)
    assert len(rows) == (6 if cnt >= 6 else cnt) and rows[4] == p[0, 6].tolist()


@pytest.mark.parametrize("bits,mode", MODES)
def test_post_nms1_quantized(tmp_path, bits: int, mode: str) -> None:
    g = pn1_graph(8)
    p = pixel_boxes(1, 12)
    qg = quantize_model(g, [[pixel_boxes(s, 12)] for s in (2, 3)] + [[p]], settings(bits, mode))
    node = qg.node("op")
    p_t = node.inputs[0]
    o0, o1 = node.outputs
    pq, q0, q1 = (params_of(node, t) for t in (p_t, o0, o1))
    assert q0.scale == pq.scale and q0.zerop == pq.zerop and o0.dtype == p_t.dtype
    assert o1.dtype == Dtype.UINT16 and q1.qbits == 16
    kept, norm = qg.forward([p])
    pad = min(max(-int(pq.zerop), int(pq.qmin)), int(pq.qmax))
    rows, want = ref_pn1(p_t.betensor[0].to(torch.int64).tolist(), 8, pad)
    assert kept[0].tolist() == want
    m, n = node.params["nor_box_scale_value"], node.params["nor_box_shift_value"]
    zp1 = int(q1.zerop)
    want_norm = [[min(max(round(Fraction((v + int(pq.zerop)) * m, 2 ** n)) - zp1, 0), 65535) for v in r] for r in rows]
    pad1 = min(max(-zp1, 0), 65535)
    assert norm[0].tolist() == want_norm + [[pad1] * 4] * (8 - len(rows))
    # the normalized boxes dequantize to the kept boxes / 800 within the requantization's rounding
    deq_in = (np.array(rows, dtype=np.float64) + int(pq.zerop)) / float(pq.scale)
    deq = (norm[0, :len(rows)].numpy() + zp1) / float(q1.scale)
    assert np.abs(deq - deq_in / 800.0).max() <= 1.01 / float(q1.scale)
    roundtrip(tmp_path, qg, [p])


def test_post_nms1_errors() -> None:
    p = pixel_boxes(0, 12)
    b = GraphBuilder("t")
    x = b.input("proposals", [1, 12, 4])
    with pytest.raises(IRError, match="3 inputs"):
        b.build(b.layer("PostNMS1", [x], [[1, 6, 4], [1, 6, 4]], name="op")).forward([p])
    # an index input that is a quantized activation (not an integer tensor) is refused
    b = GraphBuilder("t")
    x = b.input("proposals", [1, 12, 4])
    k = b.input("keep", [1, 6])
    ys = b.layer("PostNMS1", [x, k, const(b, "counts", [6])], [[1, 6, 4], [1, 6, 4]], name="op")
    g = b.build(ys)
    keep = torch.tensor([[0.0, 1, 2, 3, 4, 5]])
    with pytest.raises(UnsupportedError, match="integer"):
        quantize_model(g, [[p, keep]], settings(8, "per_tensor_symmetric_full_range"))


# --- PostNMS2 ------------------------------------------------------------------------------------------------------
PER_CLASS, TOTAL, KEEP2 = [4, 3, 3], [2], [1, 0, 3, 2, 2, 0, 1, 0, 1, 2]


def pn2_graph(cnt: int = 5, total=TOTAL):
    b = GraphBuilder("t")
    d = b.input("detections", [1, 10, 4])
    ins = [d] + [const(b, name, vals) for name, vals in (("per_class", PER_CLASS), ("nms_per_class", [2, 2, 1]),
                                                         ("total", total), ("labels", [1, 2, 3]), ("keep", KEEP2))]
    return b.build(b.layer("PostNMS2", ins, [[1, cnt, 4], [1, cnt], [1]], name="op",
                           params={"proposal_cnt": cnt}))


def ref_pn2(boxes: list, cnt: int, total: int, fill):
    out, offset = [], 0
    for c in range(total):
        for j in range(PER_CLASS[c]):
            if offset + j >= len(KEEP2) or len(out) >= cnt:
                break
            out.append(list(boxes[offset + KEEP2[offset + j]]))
        offset += PER_CLASS[c]
    return out + [[fill] * 4] * (cnt - len(out)), offset


@pytest.mark.parametrize("cnt,total", [(5, 2), (10, 3)])
def test_post_nms2_float(cnt: int, total: int) -> None:
    g = pn2_graph(cnt, [total])
    d = pixel_boxes(1, 10)
    boxes, scores, count = g.forward([d])
    want, offset = ref_pn2(d[0].tolist(), cnt, total, 0.0)
    assert boxes[0].tolist() == want and scores.tolist() == [[0.0] * cnt] and count.tolist() == [offset]


@pytest.mark.parametrize("bits,mode", MODES)
def test_post_nms2_quantized(tmp_path, bits: int, mode: str) -> None:
    g = pn2_graph(10, [3])
    d = pixel_boxes(1, 10)
    qg = quantize_model(g, [[pixel_boxes(s, 10)] for s in (2, 3)] + [[d]], settings(bits, mode))
    node = qg.node("op")
    d_t = node.inputs[0]
    dq = params_of(node, d_t)
    assert params_of(node, node.outputs[0]).scale == dq.scale and params_of(node, node.outputs[2]).qinvariant
    boxes, scores, count = qg.forward([d])
    pad = min(max(-int(dq.zerop), int(dq.qmin)), int(dq.qmax))
    want, offset = ref_pn2(d_t.betensor[0].to(torch.int64).tolist(), 10, 3, pad)
    assert boxes[0].tolist() == want and scores.tolist() == [[pad] * 10] and count.tolist() == [offset]
    roundtrip(tmp_path, qg, [d])


def test_post_nms2_errors() -> None:
    b = GraphBuilder("t")
    x = b.input("detections", [1, 10, 4])
    with pytest.raises(IRError, match="6 inputs"):
        b.build(b.layer("PostNMS2", [x], [[1, 5, 4], [1, 5], [1]], name="op")).forward([pixel_boxes(0, 10)])
