"""PyramidROIAlign (quantopt/ops/pyramid_roi.py): the float forward against a scalar python reference written from
docs/semantics/pyramid_roi.md, the quantized params against their formulas, the integer forward against a scalar
python-int reference of the same page (exactly) and against the float output (dequantized, close), IR round trip,
and refused params/inputs."""
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

SIDES = (16, 8, 4, 2)
SPATIAL = [1.0 / 32, 1.0 / 64, 1.0 / 128, 1.0 / 256]
MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def graph(sample=(2, 2), mode: str = "half_pixel", out=(3, 2), n: int = 6, **extra):
    b = GraphBuilder("t")
    ins = [b.input("boxes", [1, n, 4])] + [b.input(f"p{i}", [1, s, s, 3]) for i, s in enumerate(SIDES)]
    params = {"resize_height": out[0], "resize_width": out[1], "sample": list(sample),
              "spatial_scale_value": SPATIAL, "coordinate_transformation_mode": mode, "image_height": 512,
              "image_width": 480, **extra}
    y = b.layer("PyramidROIAlign", ins, [[n, out[0], out[1], 3]], name="op", params=params)
    return b.build([y])


def feeds(seed: int, n: int = 6) -> list:
    rng = np.random.default_rng(seed)
    lo, hi = np.array([[30.0, 100.0], [120.0, 210.0], [240.0, 430.0], [450.0, 478.0]])[np.arange(n) % 4].T
    side = rng.uniform(lo[:, None], hi[:, None], size=(n, 2))  # box sides in every level's range
    y0 = rng.uniform(0.0, 1.0, size=n) * (512.0 - side[:, 0])
    x0 = rng.uniform(0.0, 1.0, size=n) * (480.0 - side[:, 1])
    boxes = np.stack([y0, x0, y0 + side[:, 0], x0 + side[:, 1]], axis=-1)[None].astype(np.float32)
    maps = [rng.normal(0.0, 1.0, size=(1, s, s, 3)).astype(np.float32) for s in SIDES]
    return [torch.from_numpy(boxes)] + [torch.from_numpy(m) for m in maps]


# --- references -----------------------------------------------------------------------------------------------------
def ref_float(boxes, maps, sample, half: bool, out) -> np.ndarray:
    ph, pw = out
    res = np.zeros((len(boxes), ph, pw, maps[0].shape[-1]))
    for r, (y0, x0, y1, x1) in enumerate(boxes):
        area = (y1 - y0) * (x1 - x0)
        lv = min(max(math.floor(4 + math.log2(math.sqrt(area) / 224) + 1e-6), 2), 5) - 2
        fm, s, o = maps[lv][0], SPATIAL[lv], (0.5 if half else 0.0)
        h, w = fm.shape[:2]
        sy, ey, sx, ex = y0 * s - o, y1 * s - o, x0 * s - o, x1 * s - o
        ry, rx = ey - sy, ex - sx
        if not half:
            ry, rx = max(ry, 1.0), max(rx, 1.0)
        ny = sample[0] if sample[0] > 0 else math.ceil(ry / ph)
        nx = sample[1] if sample[1] > 0 else math.ceil(rx / pw)
        for i in range(ph):
            for j in range(pw):
                acc = np.zeros(fm.shape[-1])
                for a in range(ny):
                    y = sy + ry / ph * i + ry / ph / ny * (a + 0.5)
                    for c in range(nx):
                        x = sx + rx / pw * j + rx / pw / nx * (c + 0.5)
                        if y < -1 or y > h or x < -1 or x > w:
                            continue
                        y, x = min(max(y, 0), h - 1), min(max(x, 0), w - 1)
                        yl, xl = math.floor(y), math.floor(x)
                        yh, xh = min(yl + 1, h - 1), min(xl + 1, w - 1)
                        dy, dx = y - yl, x - xl
                        acc += (fm[yl, xl] * (1 - dy) * (1 - dx) + fm[yl, xh] * (1 - dy) * dx
                                + fm[yh, xl] * dy * (1 - dx) + fm[yh, xh] * dy * dx)
                res[r, i, j] = acc / (ny * nx)
    return res


def ref_int(node, boxes, maps, sample, half: bool, out) -> np.ndarray:
    """Python ints only; boxes/maps already offset by their zero points."""
    p = node.params
    ph, pw = out
    F = p["spatial_shift"]
    one = 1 << F
    oq = params_of(node, node.outputs[0])
    zp, qmin, qmax = int(oq.zerop), int(oq.qmin), int(oq.qmax)
    res = np.full((len(boxes), ph, pw, maps[0].shape[-1]), min(max(-zp, qmin), qmax), dtype=np.int64)
    for r, b in enumerate(boxes):
        area = (b[2] - b[0]) * (b[3] - b[1])
        lv = sum(area >= t for t in p["levels"])
        fm = maps[lv][0]
        h, w = fm.shape[:2]
        off = one // 2 if half else 0
        c = [min(max(round(Fraction(v * p["input_scale"][lv], 2 ** p["input_shift"][lv])), 0), 65535) - off
             for v in b]
        ry, rx = c[2] - c[0], c[3] - c[1]
        if not half:
            ry, rx = max(ry, one), max(rx, one)
        if ry <= 0 or rx <= 0:
            continue
        ny = sample[0] if sample[0] > 0 else -(-ry // (ph * one))
        nx = sample[1] if sample[1] > 0 else -(-rx // (pw * one))
        sty, stx = ry // ph, rx // pw
        by, bx = sty // (2 * ny), stx // (2 * nx)
        m, n = p["scale_value"][lv], p["shift_value"][lv]
        for i in range(ph):
            for j in range(pw):
                acc = np.zeros(fm.shape[-1], dtype=object)
                for a in range(ny):
                    y = c[0] + sty * i + by * (2 * a + 1)
                    for k in range(nx):
                        x = c[1] + stx * j + bx * (2 * k + 1)
                        yl, xl = y >> F, x >> F
                        if yl < -1 or yl > h or xl < -1 or xl > w:
                            continue
                        dy, dx = y - (yl << F), x - (xl << F)
                        yh, xh = min(max(yl + 1, 0), h - 1), min(max(xl + 1, 0), w - 1)
                        yl, xl = min(max(yl, 0), h - 1), min(max(xl, 0), w - 1)
                        acc = acc + (fm[yl, xl].astype(object) * (((one - dy) * (one - dx)) >> F)
                                     + fm[yl, xh].astype(object) * (((one - dy) * dx) >> F)
                                     + fm[yh, xl].astype(object) * ((dy * (one - dx)) >> F)
                                     + fm[yh, xh].astype(object) * ((dy * dx) >> F))
                for ch in range(fm.shape[-1]):
                    v = int(acc[ch]) * m
                    if not (sample[0] > 0 and sample[1] > 0):
                        v = v // (ny * nx)
                    res[r, i, j, ch] = min(max(round(Fraction(v, 2 ** (n + F))) - zp, qmin), qmax)
    return res


# --- tests ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sample,mode", [((2, 2), "half_pixel"), ((0, 0), "output_half_pixel"),
                                         ((1, 0), "HALF_PIXEL")])
def test_float_forward(sample, mode: str) -> None:
    f = feeds(1)
    (y,) = graph(sample, mode).forward(f)
    want = ref_float(f[0][0].double().tolist(), [m.double().numpy() for m in f[1:]], sample,
                     mode.lower() == "half_pixel", (3, 2))
    assert y.shape == (6, 3, 2, 3)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)


def test_levels_cover_every_map() -> None:
    """The data of the tests reaches every level (else the per-level multipliers would go untested)."""
    sides = [math.sqrt((b[2] - b[0]) * (b[3] - b[1])) for b in feeds(1)[0][0].tolist()]
    assert {min(max(math.floor(4 + math.log2(x / 224) + 1e-6), 2), 5) for x in sides} == {2, 3, 4, 5}


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("sample,coord", [((2, 2), "half_pixel"), ((0, 0), "output_half_pixel")])
def test_quantized(tmp_path, bits: int, mode: str, sample, coord: str) -> None:
    g = graph(sample, coord)
    calib = [feeds(s) for s in (2, 3, 4)]
    qg = quantize_model(g, calib, dict(q_bits_activation=bits, q_mode_activation=mode,
                                       q_bits_bias=48 if bits > 8 else 32, q_strategy_activation="extrema"))
    node = qg.node("op")
    s_b = float(params_of(node, node.inputs[0]).scale)
    s_out = float(params_of(node, node.outputs[0]).scale)
    F = node.params["spatial_shift"]
    assert F == math.floor(math.log2(65535 / (512 * SPATIAL[0])))
    assert node.params["levels"] == [int(t * t * s_b * s_b + 0.5) for t in (112, 224, 448)]
    for lv in range(4):
        m, n = node.params["input_scale"][lv], node.params["input_shift"][lv]
        assert m < 2 ** 15 and abs(m - SPATIAL[lv] * 2 ** F / s_b * 2 ** n) <= 0.5 + 1e-5 * m
        dm, dn = node.params["scale_value"][lv], node.params["shift_value"][lv]
        ratio = s_out / float(params_of(node, node.inputs[lv + 1]).scale) / (4 if sample[0] > 0 else 1)
        assert dm < 2 ** min(bits, 15) and abs(dm - ratio * 2 ** dn) <= 0.5 + 1e-3 * dm
    f = feeds(5)
    (y,) = qg.forward(f)
    boxes = (node.inputs[0].betensor[0].to(torch.int64) + int(params_of(node, node.inputs[0]).zerop)).tolist()
    maps = [(t.betensor.to(torch.int64) + int(params_of(node, t).zerop)).numpy() for t in node.inputs[1:]]
    want = ref_int(node, boxes, maps, sample, coord == "half_pixel", (3, 2))
    assert torch.equal(y.to(torch.int64), torch.from_numpy(want))
    (yf,) = g.forward(f)
    deq = (y.double() + int(params_of(node, node.outputs[0]).zerop)) / s_out
    assert (deq - yf.double()).abs().max() < 0.25 * float(yf.abs().max())
    assert (deq - yf.double()).abs().mean() < 0.05 * float(yf.abs().max())
    before = y.clone()
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert torch.equal(re.forward(f)[0], before)


def test_bad_params_and_inputs() -> None:
    f = feeds(1)
    with pytest.raises(UnsupportedError, match="proposal_normalized"):
        graph(proposal_normalized=True).forward(f)
    with pytest.raises(IRError, match="coordinate_transformation_mode"):
        graph(mode="aligned").forward(f)
    with pytest.raises(IRError, match="spatial_scale_value"):
        graph(spatial_scale_value=[0.5, 0.25]).forward(f)
    with pytest.raises(IRError, match="sample"):
        graph(sample=(2,)).forward(f)
    b = GraphBuilder("t")
    ins = [b.input("boxes", [1, 6, 4])] + [b.input(f"p{i}", [1, s, s, 3]) for i, s in enumerate(SIDES[:3])]
    y = b.layer("PyramidROIAlign", ins, [[6, 3, 2, 3]], name="op",
                params={"resize_height": 3, "resize_width": 2, "spatial_scale_value": SPATIAL,
                        "image_height": 512, "image_width": 480})
    with pytest.raises(IRError, match="5 inputs"):
        b.build([y]).forward(f[:4])
    with pytest.raises(IRError, match="boxes"):
        graph().forward([f[0][0]] + f[1:])
