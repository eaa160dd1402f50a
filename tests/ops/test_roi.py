"""RoiAlign, MaxRoiPool, ROIPooling and CropAndResize: float forward against onnxruntime / naive loops of the
ONNX / Caffe / TF definitions, integer forward against an independent python-int reference written from
docs/semantics/pooling.md, float-vs-dequantized cosine, IR write → re-read bit identity, and bad params."""
from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.errors import DataError, IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

F_BITS = 16
ONE = 1 << F_BITS
MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"), (16, "per_tensor_symmetric_full_range")]
FM = [2, 10, 12, 3]


BOXES16 = {"boxes": {"q_bits_activation": 16, "q_mode_activation": "per_tensor_symmetric_full_range"}}
"""Boxes are quantized with 16 bits in the accuracy tests: 8-bit box corners move samples by a tenth of a cell."""


def settings(bits: int, mode: str) -> Dict[str, Any]:
    s = {"q_mode_activation": mode, "q_bits_activation": bits, "q_strategy_activation": "extrema"}
    if bits > 8:
        s["q_bits_bias"] = 48
    return s


def feature(seed: int, shape: Sequence[int] = FM) -> torch.Tensor:
    """A smooth map (bilinear sampling of noise would make every quantization look bad)."""
    r = np.random.default_rng(seed)
    n, h, w, c = shape
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    base = np.stack([np.sin(0.5 * yy + 0.3 * k) + np.cos(0.4 * xx - 0.2 * k) for k in range(c)], -1)
    return torch.from_numpy((base[None] * r.uniform(0.5, 1.5, size=(n, 1, 1, c)) +
                             0.1 * r.normal(size=(n, h, w, c))).astype(np.float32))


def align_boxes(seed: int, r: int = 5, n: int = 2, scale: float = 2.0) -> torch.Tensor:
    """[R, 5] = (batch, y1, x1, y2, x2) in input-image units (feature cells / spatial scale)."""
    g = np.random.default_rng(seed)
    y1 = g.uniform(-1, 7, r)
    x1 = g.uniform(-1, 9, r)
    y2 = y1 + g.uniform(0.5, 6, r)
    x2 = x1 + g.uniform(0.5, 6, r)
    b = np.arange(r) % n
    return torch.from_numpy((np.stack([b / scale, y1, x1, y2, x2], 1) * scale).astype(np.float32))


def two_input_graph(optype: str, fm_shape, box_shape, out_shape, params, third: Optional[Sequence[int]] = None):
    b = GraphBuilder("t")
    ins = [b.input("x", list(fm_shape)), b.input("boxes", list(box_shape))]
    if third is not None:
        ins.append(b.input("idx", list(third), dtype=Dtype.INT32))
    y = b.layer(optype, ins, [list(out_shape)], name="op", params=params)
    return b.build([y])


def roundtrip_equal(tmp_path, qg, inputs: Sequence[torch.Tensor]) -> None:
    before = qg.forward(list(inputs))[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    after = re.forward(list(inputs))[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


# --- independent python-int helpers -------------------------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def rhe_div(num: int, den: int) -> int:
    q, rem = divmod(num, den)
    return q + (1 if 2 * rem > den or (2 * rem == den and q % 2 == 1) else 0)


def clamp(v, lo, hi):
    return min(max(v, lo), hi)


def pairs(node, key: str) -> List[tuple]:
    m, s = node.params[f"{key}_scale_value"], node.params[f"{key}_shift_value"]
    m, s = (m if isinstance(m, list) else [m]), (s if isinstance(s, list) else [s])
    return [(int(a), int(b)) for a, b in zip(m, s)]


def qparams(node, t):
    q = params_of(node, t)
    return int(q.zerop), int(q.qmin), int(q.qmax)


# --- ONNX Runtime (optional) ----------------------------------------------------------------------------------------
def ort_run(op: str, attrs: Dict[str, Any], inputs: Sequence[np.ndarray], opset: int = 16) -> np.ndarray:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = [f"i{k}" for k in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["o"], **attrs)], "g",
        [helper.make_tensor_value_info(nm, TensorProto.INT64 if a.dtype == np.int64 else TensorProto.FLOAT,
                                       list(a.shape)) for nm, a in zip(names, inputs)],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs)))[0]


# ================================================================================================ RoiAlign
def align_params(method="AVG", pooled=(3, 3), sample=(2, 2), spatial=(0.5, 0.5), mode="HALF_PIXEL") -> Dict:
    return {"method": method, "pooled_shape": list(pooled), "sample": list(sample),
            "spatial_scale_value": list(spatial), "coordinate_transformation_mode": mode}


def naive_align_float(fm: np.ndarray, rois: np.ndarray, p: Dict) -> np.ndarray:
    """ONNX RoiAlign (upstream layout: rois = (batch, y1, x1, y2, x2)), one sample at a time."""
    n, h, w, c = fm.shape
    ph, pw = p["pooled_shape"]
    sy, sx = p["spatial_scale_value"]
    hp = p["coordinate_transformation_mode"] == "HALF_PIXEL"
    off = 0.5 if hp else 0.0
    out = np.zeros((rois.shape[0], ph, pw, c))
    for r in range(rois.shape[0]):
        b = int(round(float(rois[r, 0])))
        ys, xs = rois[r, 1] * sy - off, rois[r, 2] * sx - off
        rh, rw = rois[r, 3] * sy - off - ys, rois[r, 4] * sx - off - xs
        if not hp:
            rh, rw = max(rh, 1.0), max(rw, 1.0)
        nh = p["sample"][0] or math.ceil(rh / ph)
        nw = p["sample"][1] or math.ceil(rw / pw)
        for i, j in itertools.product(range(ph), range(pw)):
            vals = []
            for iy, ix in itertools.product(range(nh), range(nw)):
                y = ys + i * rh / ph + (iy + 0.5) * rh / ph / nh
                x = xs + j * rw / pw + (ix + 0.5) * rw / pw / nw
                if y < -1 or y > h or x < -1 or x > w:
                    vals.append(np.zeros(c) if p["method"] == "AVG" else np.zeros(c))
                    continue
                y, x = min(max(y, 0.0), h - 1.0), min(max(x, 0.0), w - 1.0)
                yl, xl = int(math.floor(y)), int(math.floor(x))
                yh, xh = min(yl + 1, h - 1), min(xl + 1, w - 1)
                dy, dx = y - yl, x - xl
                corners = [(1 - dy) * (1 - dx) * fm[b, yl, xl], (1 - dy) * dx * fm[b, yl, xh],
                           dy * (1 - dx) * fm[b, yh, xl], dy * dx * fm[b, yh, xh]]
                vals.append(sum(corners) if p["method"] == "AVG" else np.max(corners, 0))
            out[r, i, j] = np.mean(vals, 0) if p["method"] == "AVG" else np.max(vals, 0)
    return out


def ref_align_int(node, fm_q: np.ndarray, box_q: np.ndarray) -> np.ndarray:
    """Docs: fixed-point box edges, positions S + rhe_div(R*(2k+1), 2*P*n), weights (2^F - frac, frac), AVG =
    rhe_div(sum, count*2^2F) - zp, MAX = rhe_div(max corner product, 2^2F) - zp."""
    p = node.params
    zp, qmin, qmax = qparams(node, node.inputs[0])
    bzp = int(params_of(node, node.inputs[1]).zerop)
    (my, ny), (mx, nx) = pairs(node, "coord")
    (mb, nb), = pairs(node, "batch")
    n, h, w, c = fm_q.shape
    ph, pw = p["pooled_shape"]
    hp = p["coordinate_transformation_mode"] == "HALF_PIXEL"
    off = ONE // 2 if hp else 0
    out = np.zeros((box_q.shape[0], ph, pw, c), dtype=np.int64)

    def axis(c1: int, c2: int, pooled: int, ratio: int, size: int):
        s, e = c1 - off, c2 - off
        rr = e - s if hp else max(e - s, ONE)
        cnt = ratio if ratio > 0 else max(-((-rr) // (pooled * ONE)), 0)
        taps = []
        for k in range(pooled * cnt):
            pos = s + rhe_div(rr * (2 * k + 1), 2 * pooled * cnt)
            ok = -ONE <= pos <= size * ONE
            pos = clamp(pos, 0, (size - 1) * ONE)
            lo = pos >> F_BITS
            fr = pos - lo * ONE
            taps.append([(lo, (ONE - fr) if ok else 0), (min(lo + 1, size - 1), fr if ok else 0)])
        return cnt, taps

    for r in range(box_q.shape[0]):
        v = [int(t) + bzp for t in box_q[r]]
        b = rhe(v[0] * mb, nb)
        cy, cx = axis(rhe(v[1] * my, ny), rhe(v[3] * my, ny), ph, p["sample"][0], h), \
            axis(rhe(v[2] * mx, nx), rhe(v[4] * mx, nx), pw, p["sample"][1], w)
        for i, j, ch in itertools.product(range(ph), range(pw), range(c)):
            acc, best = 0, None
            for ty in cy[1][i * cy[0]:(i + 1) * cy[0]]:
                for tx in cx[1][j * cx[0]:(j + 1) * cx[0]]:
                    prods = [wy * wx * (int(fm_q[b, yy, xx, ch]) + zp) for yy, wy in ty for xx, wx in tx]
                    acc += sum(prods)
                    best = max(prods) if best is None else max(best, max(prods))
            if cy[0] * cx[0] == 0:
                y = 0
            elif p["method"] == "AVG":
                y = rhe_div(acc, cy[0] * cx[0] * ONE * ONE)
            else:
                y = rhe_div(best, ONE * ONE)
            out[r, i, j, ch] = clamp(y - zp, qmin, qmax)
    return out


ALIGN_CASES = [
    align_params("AVG", sample=(2, 2)),
    align_params("AVG", sample=(0, 0)),
    align_params("AVG", pooled=(2, 3), sample=(1, 3), spatial=(0.5, 0.25), mode="OUTPUT_HALF_PIXEL"),
    align_params("MAX", sample=(2, 2)),
    align_params("MAX", pooled=(3, 2), sample=(0, 2), mode="OUTPUT_HALF_PIXEL"),
]


@pytest.mark.parametrize("p", ALIGN_CASES, ids=lambda p: f"{p['method']}-{p['sample']}-{p['pooled_shape']}")
def test_roialign_float_matches_naive_definition(p: Dict) -> None:
    x, rois = feature(1), align_boxes(2)
    g = two_input_graph("RoiAlign", FM, [5, 5], [5, *p["pooled_shape"], 3], p)
    y = g.forward([x, rois])[0]
    np.testing.assert_allclose(y.numpy(), naive_align_float(x.numpy().astype(np.float64), rois.numpy(), p),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,mode,sample", [("AVG", "HALF_PIXEL", 2), ("AVG", "OUTPUT_HALF_PIXEL", 0),
                                                ("MAX", "OUTPUT_HALF_PIXEL", 2)])
def test_roialign_float_matches_onnxruntime(method: str, mode: str, sample: int) -> None:
    p = align_params(method, pooled=(3, 4), sample=(sample, sample), spatial=(0.5, 0.5), mode=mode)
    x, rois = feature(3), align_boxes(4)
    y = two_input_graph("RoiAlign", FM, [5, 5], [5, 3, 4, 3], p).forward([x, rois])[0]
    r = rois.numpy()
    ref = ort_run("RoiAlign", {"output_height": 3, "output_width": 4, "sampling_ratio": sample,
                               "spatial_scale": 0.5, "mode": method.lower(),
                               "coordinate_transformation_mode": mode.lower()},
                  [x.permute(0, 3, 1, 2).contiguous().numpy(), r[:, [2, 1, 4, 3]].copy(),
                   r[:, 0].astype(np.int64)])
    np.testing.assert_allclose(y.numpy(), ref.transpose(0, 2, 3, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("p", ALIGN_CASES, ids=lambda p: f"{p['method']}-{p['sample']}-{p['pooled_shape']}")
def test_roialign_integer_matches_reference(p: Dict, bits: int, mode: str) -> None:
    g = two_input_graph("RoiAlign", FM, [5, 5], [5, *p["pooled_shape"], 3], p)
    cal = [[feature(s), align_boxes(s + 10)] for s in (5, 6)]
    qg = quantize_model(g, cal,
                        settings(bits, mode), per_layer=BOXES16)
    node = qg.node("op")
    x, rois = feature(7), align_boxes(8)
    y = qg.forward([x, rois])[0].numpy()
    np.testing.assert_array_equal(y, ref_align_int(node, node.inputs[0].betensor.numpy(),
                                                   node.inputs[1].betensor.numpy()))
    out, inp = node.outputs[0], node.inputs[0]
    oq, iq = params_of(node, out), params_of(node, inp)
    assert (oq.scale, oq.zerop, out.dtype) == (iq.scale, iq.zerop, inp.dtype)
    assert node.params["coord_fraction_bits"] == F_BITS
    assert cosine(g.forward([x, rois])[0], run_quantized(qg, [x, rois])[0]) > 0.99


def test_roialign_8bit_boxes_bit_exact() -> None:
    p = align_params("AVG", sample=(0, 2))
    g = two_input_graph("RoiAlign", FM, [5, 5], [5, 3, 3, 3], p)
    qg = quantize_model(g, [[feature(s), align_boxes(s + 10)] for s in (5, 6)],
                        settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    assert params_of(node, node.inputs[1]).qbits == 8
    y = qg.forward([feature(7), align_boxes(8)])[0].numpy()
    np.testing.assert_array_equal(y, ref_align_int(node, node.inputs[0].betensor.numpy(),
                                                   node.inputs[1].betensor.numpy()))


def test_roialign_negative_batch_index_gives_zeros_and_too_large_is_an_error() -> None:
    p = align_params()
    g = two_input_graph("RoiAlign", FM, [2, 5], [2, 3, 3, 3], p)
    rois = torch.tensor([[-1.0, 0, 0, 6, 6], [0.0, 0, 0, 6, 6]])
    y = g.forward([feature(9), rois])[0]
    assert torch.all(y[0] == 0) and not torch.all(y[1] == 0)
    with pytest.raises(DataError, match="batch index 2"):
        g.forward([feature(9), torch.tensor([[2.0, 0, 0, 6, 6], [0.0, 0, 0, 6, 6]])])


# ================================================================================================ MaxRoiPool
def ref_maxroipool_float(fm: np.ndarray, rois: np.ndarray, spatial, pooled) -> np.ndarray:
    """Caffe ROIPooling: corners round(v * spatial) (half up), size max(end - start + 1, 1), bins floor/ceil."""
    n, h, w, c = fm.shape
    ph, pw = pooled
    out = np.zeros((rois.shape[0], ph, pw, c), dtype=fm.dtype)
    for r in range(rois.shape[0]):
        b = int(round(float(rois[r, 0])))
        y1, x1 = math.floor(rois[r, 1] * spatial[0] + 0.5), math.floor(rois[r, 2] * spatial[1] + 0.5)
        y2, x2 = math.floor(rois[r, 3] * spatial[0] + 0.5), math.floor(rois[r, 4] * spatial[1] + 0.5)
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i, j in itertools.product(range(ph), range(pw)):
            hs = clamp(math.floor(i * rh / ph) + y1, 0, h)
            he = clamp(math.ceil((i + 1) * rh / ph) + y1, 0, h)
            ws = clamp(math.floor(j * rw / pw) + x1, 0, w)
            we = clamp(math.ceil((j + 1) * rw / pw) + x1, 0, w)
            if hs < he and ws < we:
                out[r, i, j] = fm[b, hs:he, ws:we].max(axis=(0, 1))
    return out


def test_maxroipool_float_matches_caffe_and_onnxruntime() -> None:
    x, rois = feature(11), align_boxes(12, scale=4.0)
    g = two_input_graph("MaxRoiPool", FM, [5, 5], [5, 3, 2, 3], {"spatial": [0.25, 0.25]})
    y = g.forward([x, rois])[0].numpy()
    np.testing.assert_array_equal(y, ref_maxroipool_float(x.numpy(), rois.numpy(), (0.25, 0.25), (3, 2)))
    r = rois.numpy()
    ref = ort_run("MaxRoiPool", {"pooled_shape": [3, 2], "spatial_scale": 0.25},
                  [x.permute(0, 3, 1, 2).contiguous().numpy(), r[:, [0, 2, 1, 4, 3]].copy()], opset=13)
    np.testing.assert_allclose(y, ref.transpose(0, 2, 3, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,mode", MODES)
def test_maxroipool_integer_matches_reference(bits: int, mode: str) -> None:
    g = two_input_graph("MaxRoiPool", FM, [5, 5], [5, 3, 2, 3], {"spatial": [0.25, 0.5]})
    qg = quantize_model(g, [[feature(s), align_boxes(s + 1, scale=4.0)] for s in (13, 15)],
                        settings(bits, mode), per_layer=BOXES16)
    node = qg.node("op")
    x, rois = feature(17), align_boxes(18, scale=4.0)
    y = qg.forward([x, rois])[0].numpy()
    fm_q, box_q = node.inputs[0].betensor.numpy(), node.inputs[1].betensor.numpy()
    zp, qmin, qmax = qparams(node, node.inputs[0])
    bzp = int(params_of(node, node.inputs[1]).zerop)
    (my, ny), (mx, nx) = pairs(node, "coord")
    (mb, nb), = pairs(node, "batch")

    def half_up(v: int, m: int, s: int) -> int:  # floor(v*m/2^s + 1/2)
        return (v * m) << -s if s <= 0 else (v * m + (1 << (s - 1))) >> s

    ref = np.full((5, 3, 2, 3), clamp(-zp, qmin, qmax), dtype=np.int64)
    for r in range(5):
        v = [int(t) + bzp for t in box_q[r]]
        b = rhe(v[0] * mb, nb)
        y1, x1, y2, x2 = half_up(v[1], my, ny), half_up(v[2], mx, nx), half_up(v[3], my, ny), half_up(v[4], mx, nx)
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i, j in itertools.product(range(3), range(2)):
            hs, he = clamp(y1 + (i * rh) // 3, 0, 10), clamp(y1 + -((-(i + 1) * rh) // 3), 0, 10)
            ws, we = clamp(x1 + (j * rw) // 2, 0, 12), clamp(x1 + -((-(j + 1) * rw) // 2), 0, 12)
            if hs < he and ws < we:
                ref[r, i, j] = fm_q[b, hs:he, ws:we].max(axis=(0, 1))
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x, rois])[0], run_quantized(qg, [x, rois])[0]) > 0.99


# ================================================================================================ ROIPooling
def norm_boxes(seed: int, r: int = 4) -> torch.Tensor:
    """[1, R, 4] normalized (y0, x0, y1, x1)."""
    g = np.random.default_rng(seed)
    lo = g.uniform(0.0, 0.5, (r, 2))
    hi = lo + g.uniform(0.2, 0.5, (r, 2))
    return torch.from_numpy(np.concatenate([lo, hi], 1)[None].astype(np.float32))


def ref_roipooling_float(fm: np.ndarray, boxes: np.ndarray, out_hw) -> np.ndarray:
    """Upstream ROIPooling: y0 = b0*fh/rh ... index i = int(r*y0 + i*(y1 + 1 - y0)) clipped, batch 0."""
    _, fh, fw, c = fm.shape
    rh, rw = out_hw
    out = np.zeros((boxes.shape[1], rh, rw, c), dtype=fm.dtype)
    for j in range(boxes.shape[1]):
        y0, y1 = boxes[0, j, 0] * fh / rh, boxes[0, j, 2] * fh / rh
        x0, x1 = boxes[0, j, 1] * fw / rw, boxes[0, j, 3] * fw / rw
        ys = [clamp(int(rh * y0 + i * (y1 + 1 - y0)), 0, fh - 1) for i in range(rh)]
        xs = [clamp(int(rw * x0 + i * (x1 + 1 - x0)), 0, fw - 1) for i in range(rw)]
        out[j] = fm[0][np.ix_(ys, xs)]
    return out


def test_roipooling_float_matches_upstream_definition() -> None:
    x, boxes = feature(19), norm_boxes(20)
    g = two_input_graph("ROIPooling", [1, 10, 12, 3], [1, 4, 4], [4, 5, 4, 3], {})
    y = g.forward([x[:1], boxes])[0].numpy()
    np.testing.assert_array_equal(y, ref_roipooling_float(x[:1].numpy().astype(np.float64), boxes.numpy()
                                                          .astype(np.float64), (5, 4)).astype(np.float32))


@pytest.mark.parametrize("bits,mode", MODES)
def test_roipooling_integer_matches_reference(bits: int, mode: str) -> None:
    g = two_input_graph("ROIPooling", [1, 10, 12, 3], [1, 4, 4], [4, 5, 4, 3], {})
    qg = quantize_model(g, [[feature(s)[:1], norm_boxes(s + 1)] for s in (21, 23)],
                        settings(bits, mode), per_layer=BOXES16)
    node = qg.node("op")
    x, boxes = feature(25)[:1], norm_boxes(26)
    y = qg.forward([x, boxes])[0].numpy()
    fm_q, box_q = node.inputs[0].betensor.numpy(), node.inputs[1].betensor.numpy()
    bzp = int(params_of(node, node.inputs[1]).zerop)
    (my, ny), (mx, nx) = pairs(node, "coord")
    ref = np.zeros((4, 5, 4, 3), dtype=np.int64)

    def trunc_div(a: int, b: int) -> int:
        q = abs(a) // b
        return q if a >= 0 else -q

    for r in range(4):
        v = [int(t) + bzp for t in box_q[0, r]]
        a_y, b_y, a_x, b_x = rhe(v[0] * my, ny), rhe(v[2] * my, ny), rhe(v[1] * mx, nx), rhe(v[3] * mx, nx)
        ys = [clamp(trunc_div(5 * a_y + i * (b_y - a_y + 5 * ONE), 5 * ONE), 0, 9) for i in range(5)]
        xs = [clamp(trunc_div(4 * a_x + i * (b_x - a_x + 4 * ONE), 4 * ONE), 0, 11) for i in range(4)]
        ref[r] = fm_q[0][np.ix_(ys, xs)]
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x, boxes])[0], run_quantized(qg, [x, boxes])[0]) > 0.99


# ================================================================================================ CropAndResize
def crop_boxes(seed: int, r: int = 4) -> torch.Tensor:
    """[R, 4] normalized (y1, x1, y2, x2), some partly outside [0, 1] to exercise the extrapolation."""
    g = np.random.default_rng(seed)
    lo = g.uniform(-0.2, 0.6, (r, 2))
    hi = lo + g.uniform(0.2, 0.6, (r, 2))
    return torch.from_numpy(np.concatenate([lo, hi], 1).astype(np.float32))


def ref_crop_float(fm: np.ndarray, boxes: np.ndarray, idx: np.ndarray, crop, method: str, extra: float) -> np.ndarray:
    """TF crop_and_resize, position by position."""
    n, h, w, c = fm.shape
    ch, cw = crop
    out = np.zeros((boxes.shape[0], ch, cw, c))
    for r in range(boxes.shape[0]):
        y1, x1, y2, x2 = (float(v) for v in boxes[r])
        b = int(idx[r])
        for i, j in itertools.product(range(ch), range(cw)):
            in_y = y1 * (h - 1) + i * (y2 - y1) * (h - 1) / (ch - 1) if ch > 1 else 0.5 * (y1 + y2) * (h - 1)
            in_x = x1 * (w - 1) + j * (x2 - x1) * (w - 1) / (cw - 1) if cw > 1 else 0.5 * (x1 + x2) * (w - 1)
            if not (0 <= in_y <= h - 1 and 0 <= in_x <= w - 1):
                out[r, i, j] = extra
                continue
            if method == "NEAREST":
                out[r, i, j] = fm[b, int(math.floor(in_y + 0.5)), int(math.floor(in_x + 0.5))]
                continue
            t, bt = int(math.floor(in_y)), int(math.ceil(in_y))
            lf, rt = int(math.floor(in_x)), int(math.ceil(in_x))
            dy, dx = in_y - t, in_x - lf
            top = fm[b, t, lf] + (fm[b, t, rt] - fm[b, t, lf]) * dx
            bot = fm[b, bt, lf] + (fm[b, bt, rt] - fm[b, bt, lf]) * dx
            out[r, i, j] = top + (bot - top) * dy
    return out


CROP_CASES = [("BILINEAR", (5, 6), 0.0), ("NEAREST", (4, 3), -0.5), ("BILINEAR", (1, 4), 0.7)]


@pytest.mark.parametrize("method,crop,extra", CROP_CASES)
def test_cropandresize_float_matches_tf_definition(method: str, crop, extra: float) -> None:
    x, boxes, idx = feature(27), crop_boxes(28), torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    p = {"crop_size": list(crop), "method": method, "extrapolation_value": extra}
    g = two_input_graph("CropAndResize", FM, [4, 4], [4, *crop, 3], p, third=[4])
    y = g.forward([x, boxes, idx])[0]
    ref = ref_crop_float(x.numpy().astype(np.float64), boxes.numpy(), idx.numpy(), crop, method, extra)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("method,crop,extra", CROP_CASES)
def test_cropandresize_integer_matches_reference(method: str, crop, extra: float, bits: int, mode: str) -> None:
    p = {"crop_size": list(crop), "method": method, "extrapolation_value": extra}
    g = two_input_graph("CropAndResize", FM, [4, 4], [4, *crop, 3], p, third=[4])
    idx = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    qg = quantize_model(g, [[feature(s), crop_boxes(s + 1), idx] for s in (29, 31)],
                        settings(bits, mode), per_layer=BOXES16)
    node = qg.node("op")
    x, boxes = feature(33), crop_boxes(34)
    y = qg.forward([x, boxes, idx])[0].numpy()
    fm_q, box_q = node.inputs[0].betensor.numpy(), node.inputs[1].betensor.numpy()
    zp, qmin, qmax = qparams(node, node.inputs[0])
    bzp = int(params_of(node, node.inputs[1]).zerop)
    (m, s), = pairs(node, "coord")
    fill = int(node.params["extrapolation_qvalue"])
    n, h, w, c = fm_q.shape
    ch, cw = crop
    ref = np.zeros((4, ch, cw, c), dtype=np.int64)

    def pos(c1: int, c2: int, size: int, crop_n: int, i: int) -> int:
        if crop_n > 1:
            return rhe_div(((crop_n - 1 - i) * c1 + i * c2) * (size - 1), crop_n - 1)
        return rhe_div((c1 + c2) * (size - 1), 2)

    def taps(pv: int, size: int):
        pv = clamp(pv, 0, (size - 1) * ONE)
        if method == "NEAREST":
            return [(min((pv + ONE // 2) >> F_BITS, size - 1), ONE)]
        lo = pv >> F_BITS
        return [(lo, ONE - (pv - lo * ONE)), (min(lo + 1, size - 1), pv - lo * ONE)]

    for r in range(4):
        y1, x1, y2, x2 = (rhe((int(t) + bzp) * m, s) for t in box_q[r])
        b = int(idx[r])
        for i, j, k in itertools.product(range(ch), range(cw), range(c)):
            py, px = pos(y1, y2, h, ch, i), pos(x1, x2, w, cw, j)
            if not (0 <= py <= (h - 1) * ONE and 0 <= px <= (w - 1) * ONE):
                ref[r, i, j, k] = clamp(fill, qmin, qmax)
                continue
            acc = sum(wy * wx * (int(fm_q[b, yy, xx, k]) + zp) for yy, wy in taps(py, h) for xx, wx in taps(px, w))
            ref[r, i, j, k] = clamp(rhe_div(acc, ONE * ONE) - zp, qmin, qmax)
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x, boxes, idx])[0], run_quantized(qg, [x, boxes, idx])[0]) > 0.99


# ================================================================================================ round trips / errors
@pytest.mark.parametrize("optype", ["RoiAlign", "MaxRoiPool", "ROIPooling", "CropAndResize"])
def test_reloads_bit_identical(tmp_path, optype: str) -> None:
    idx = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    if optype == "RoiAlign":
        g = two_input_graph(optype, FM, [5, 5], [5, 3, 3, 3], align_params("MAX", sample=(0, 0)))
        make = [lambda s: feature(s), lambda s: align_boxes(s)]
    elif optype == "MaxRoiPool":
        g = two_input_graph(optype, FM, [5, 5], [5, 3, 3, 3], {"spatial": [0.25, 0.25]})
        make = [lambda s: feature(s), lambda s: align_boxes(s, scale=4.0)]
    elif optype == "ROIPooling":
        g = two_input_graph(optype, [1, 10, 12, 3], [1, 4, 4], [4, 5, 4, 3], {})
        make = [lambda s: feature(s)[:1], lambda s: norm_boxes(s)]
    else:
        g = two_input_graph(optype, FM, [4, 4], [4, 5, 6, 3], {"crop_size": [5, 6], "method": "BILINEAR",
                                                               "extrapolation_value": 0.0}, third=[4])
        make = [lambda s: feature(s), lambda s: crop_boxes(s), lambda s: idx]
    qg = quantize_model(g, [[f(s) for f in make] for s in (40, 41)], settings(8, "per_tensor_asymmetric"))
    roundtrip_equal(tmp_path, qg, [f(42) for f in make])


@pytest.mark.parametrize("params,match", [
    ({**align_params(), "method": "MIN"}, "method 'MIN'"),
    ({**align_params(), "coordinate_transformation_mode": "ASYMMETRIC"}, "coordinate_transformation_mode"),
    ({**align_params(), "pooled_shape": [3]}, "pooled_shape"),
    ({**align_params(), "sample": [-1, 2]}, "sample"),
    ({**align_params(), "spatial_scale_value": [0.0, 1.0]}, "spatial_scale_value"),
])
def test_roialign_bad_params(params: Dict, match: str) -> None:
    g = two_input_graph("RoiAlign", FM, [5, 5], [5, 3, 3, 3], params)
    with pytest.raises(IRError, match=match):
        g.forward([feature(1), align_boxes(2)])


def test_other_bad_inputs() -> None:
    g = two_input_graph("MaxRoiPool", FM, [5, 4], [5, 3, 3, 3], {"spatial": [0.25, 0.25]})
    with pytest.raises(IRError, match=r"boxes must be \[R, 5\]"):
        g.forward([feature(1), torch.zeros(5, 4)])
    g = two_input_graph("CropAndResize", FM, [4, 4], [4, 2, 2, 3], {"crop_size": [2, 2], "method": "AREA"}, third=[4])
    with pytest.raises(IRError, match="method 'AREA'"):
        g.forward([feature(1), crop_boxes(2), torch.zeros(4, dtype=torch.int32)])
    g = two_input_graph("CropAndResize", FM, [4, 4], [4, 2, 2, 3], {"crop_size": [2, 2]}, third=[4])
    with pytest.raises(DataError, match="batch index 5"):
        g.forward([feature(1), crop_boxes(2), torch.tensor([0, 5, 0, 0], dtype=torch.int32)])


def test_cropandresize_float_box_indices_are_not_quantizable() -> None:
    b = GraphBuilder("t")
    ins = [b.input("x", FM), b.input("boxes", [4, 4]), b.input("idx", [4])]
    y = b.layer("CropAndResize", ins, [[4, 2, 2, 3]], name="op", params={"crop_size": [2, 2]})
    g = b.build([y])
    cal = [[feature(s), crop_boxes(s), torch.tensor([0.0, 1.0, 1.0, 0.0])] for s in (1, 2)]
    with pytest.raises(UnsupportedError, match="integer tensor"):
        quantize_model(g, cal, settings(8, "per_tensor_asymmetric"))
