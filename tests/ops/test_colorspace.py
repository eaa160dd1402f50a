"""RgbToYuv and YuvToRgb (ops/colorspace.py): float forward against a numpy re-implementation of
docs/semantics/colorspace.md, quantize (integer matrix and shift as upstream writes them), the integer forward against
a python-int reference, dequantized integers close to float, a re-read IR bit-identical, and clear errors."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from quant_helpers import params_of

import quantopt.ops.colorspace  # noqa: F401  (registers the family even when imported alone)
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

RGB2YUV = [0, 0, 0, 0, 128, 128, 0.2126, 0.7152, 0.0722, -0.114572, -0.385428, 0.5, 0.5, -0.454153, -0.045847]
YUV2RGB = [0, 128, 128, 0, 0, 0, 1.0, 0.0, 1.5748, 1.0, -0.187324, -0.468124, 1.0, 1.8556, 0.0]
H, W = 4, 6


def graph(optype: str, coefficient: List[float], in_dtype: Dtype = Dtype.UINT8, **extra: Any):
    in_shape, out_shape = ([1, H, W, 3], [1, H * W * 3 // 2]) if optype == "RgbToYuv" else \
        ([1, H * W * 3 // 2], [1, H, W, 3])
    b = GraphBuilder("t")
    x = b.input("x", in_shape, dtype=in_dtype)
    params: Dict[str, Any] = {"format": "I420", "bits": 8, "conversion": "BT709", "coefficient": list(coefficient),
                              "coefficient_dtype": "float32", "coefficient_shift": 0, **extra}
    y = b.layer(optype, [x], [out_shape], name="op", params=params, output_dtypes=[Dtype.UINT8])
    return b.build([y]), in_shape


def pixels(shape: List[int], seed: int, count: int = 3) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.integers(0, 256, size=shape)) for _ in range(count)]


def settings(**extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=8, q_mode_activation="per_tensor_symmetric_full_range", **extra)


# --- references --------------------------------------------------------------------------------------------------
def np_rgb2yuv(x: np.ndarray, coe: List[float]) -> np.ndarray:
    a, b, m = np.array(coe[:3]), np.array(coe[3:6]), np.array(coe[6:]).reshape(3, 3)
    out = []
    for img in x.astype(np.float64):
        yuv = np.einsum("jk,hwk->hwj", m, img - a) + b
        out.append(np.concatenate([yuv[:, :, 0].ravel(), yuv[::2, ::2, 1].ravel(), yuv[::2, ::2, 2].ravel()]))
    return np.clip(np.array(out), 0, 255)


def int_rgb2yuv(x: np.ndarray, coe: List[int], shift: int) -> np.ndarray:
    a, b, m = coe[:3], coe[3:6], [coe[6:9], coe[9:12], coe[12:15]]
    out = []
    for img in x:
        planes: List[List[int]] = [[], [], []]
        for yy in range(H):
            for xx in range(W):
                p = [int(v) for v in img[yy, xx]]
                for j in range(3):
                    if j and (yy % 2 or xx % 2):
                        continue
                    acc = sum(m[j][k] * (p[k] - int(a[k])) for k in range(3)) + int(b[j]) * 2 ** shift
                    planes[j].append(min(max((acc + 2 ** (shift - 1)) // 2 ** shift, 0), 255))
        out.append(planes[0] + planes[1] + planes[2])
    return np.array(out)


def upsample(c: np.ndarray, exact: bool) -> np.ndarray:
    def avg(num, den):
        if not exact:
            return num / den
        q, r = divmod(int(num), den)
        return q + (1 if 2 * r > den or (2 * r == den and q % 2) else 0)
    u = np.array([[c[y // 2, x // 2] for x in range(W)] for y in range(H)], dtype=np.float64 if not exact else object)
    r = u.copy()
    for y in range(1, H - 1, 2):
        for x in range(W):
            r[y, x] = avg(u[y - 1, x] + u[y + 1, x], 2)
    o = r.copy()
    for y in range(H):
        for x in range(1, W - 1):
            o[y, x] = avg(3 * r[y, x - 1] + r[y, x + 1], 4) if x % 2 else avg(r[y, x - 1] + 3 * r[y, x + 1], 4)
    return o


def yuv2rgb(x: np.ndarray, coe: List[float], shift: int, exact: bool) -> np.ndarray:
    a, b, m = coe[:3], coe[3:6], np.array(coe[6:]).reshape(3, 3)
    out = []
    q = H * W // 4
    for v in x:
        yy = v[:H * W].reshape(H, W)
        uu = upsample(v[H * W:H * W + q].reshape(H // 2, W // 2), exact)
        vv = upsample(v[H * W + q:].reshape(H // 2, W // 2), exact)
        img = np.zeros((H, W, 3), dtype=np.float64 if not exact else np.int64)
        for y in range(H):
            for xx in range(W):
                yuv = [yy[y, xx], uu[y, xx], vv[y, xx]]
                for j in range(3):
                    if exact:
                        acc = sum(int(m[j, k]) * (int(yuv[k]) - int(a[k])) for k in range(3))
                        val = (acc + 2 ** (shift - 1)) // 2 ** shift + int(b[j])
                    else:
                        val = sum(m[j, k] * (float(yuv[k]) - a[k]) for k in range(3)) + b[j]
                    img[y, xx, j] = min(max(val, 0), 255)
        out.append(img)
    return np.array(out)


# --- tests ---------------------------------------------------------------------------------------------------------
def test_rgbtoyuv_float_and_integer() -> None:
    g, shape = graph("RgbToYuv", RGB2YUV)
    x = pixels(shape, 1)
    (y,) = g.forward([x[0]])
    np.testing.assert_allclose(y.numpy(), np_rgb2yuv(x[0].numpy(), RGB2YUV), rtol=1e-6, atol=1e-4)
    qg = quantize_model(g, x, settings())
    node = qg.nodes[-1]
    assert node.params["coefficient_shift"] == 10 and node.params["coefficient"][6:9] == [218, 732, 74]
    assert node.params["coefficient"][9:] == [-117, -395, 512, 512, -465, -47]
    out = qg.output_tensors[0]
    oq = params_of(node, out)
    assert oq.qinvariant and out.dtype == Dtype.UINT8 and oq.scale == 1.0
    (yq,) = qg.forward([x[1]])
    np.testing.assert_array_equal(yq.numpy(), int_rgb2yuv(x[1].numpy(), node.params["coefficient"], 10))
    np.testing.assert_allclose(yq.numpy(), np_rgb2yuv(x[1].numpy(), RGB2YUV), atol=0.5 + 3 * 255 * 0.5 / 1024)


def test_yuvtorgb_float_and_integer() -> None:
    g, shape = graph("YuvToRgb", YUV2RGB)
    x = pixels(shape, 2)
    (y,) = g.forward([x[0]])
    np.testing.assert_allclose(y.numpy(), yuv2rgb(x[0].numpy(), YUV2RGB, 0, False), rtol=1e-6, atol=1e-4)
    qg = quantize_model(g, x, settings())
    node = qg.nodes[-1]
    assert node.params["coefficient_shift"] == 8
    assert node.params["coefficient"][6:] == [256, 0, 403, 256, -48, -120, 256, 475, 0]
    (yq,) = qg.forward([x[1]])
    np.testing.assert_array_equal(yq.numpy(), yuv2rgb(x[1].numpy(), node.params["coefficient"], 8, True))
    # the chroma averages round (at most 0.5 each step) and the 8-bit matrix is approximate
    assert np.abs(yq.numpy() - yuv2rgb(x[1].numpy(), YUV2RGB, 0, False)).max() <= 3.5


def test_coefficient_shift_scales_the_matrix() -> None:
    ints = RGB2YUV[:6] + [round(c * 1024) for c in RGB2YUV[6:]]
    g, shape = graph("RgbToYuv", ints, coefficient_shift=10)
    x = pixels(shape, 3, 1)[0]
    (y,) = g.forward([x])
    np.testing.assert_allclose(y.numpy(), np_rgb2yuv(x.numpy(), RGB2YUV[:6] + [c / 1024 for c in ints[6:]]),
                               rtol=1e-6, atol=1e-4)


def test_force_dtype_int_shifts_by_128() -> None:
    g, shape = graph("RgbToYuv", RGB2YUV)
    x = pixels(shape, 4)
    qg = quantize_model(g, x, settings(force_dtype_int=True))
    out = qg.output_tensors[0]
    oq = params_of(qg.nodes[-1], out)
    assert out.dtype == Dtype.INT8 and oq.zerop == 128 and not oq.qinvariant
    (deq,) = run_quantized(qg, [x[0]])
    np.testing.assert_array_equal(deq.numpy(), int_rgb2yuv(x[0].numpy(), qg.nodes[-1].params["coefficient"], 10))


@pytest.mark.parametrize("optype,coe", [("RgbToYuv", RGB2YUV), ("YuvToRgb", YUV2RGB)])
def test_written_ir_reloads_bit_identical(tmp_path, optype: str, coe) -> None:
    g, shape = graph(optype, coe)
    x = pixels(shape, 5)
    qg = quantize_model(g, x, settings())
    before = [t.clone() for t in qg.forward([x[0]])]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward([x[0]])
    assert torch.equal(before[0], after[0])


def test_float_input_is_refused_when_quantizing() -> None:
    g, shape = graph("RgbToYuv", RGB2YUV, in_dtype=Dtype.FP32)
    with pytest.raises(UnsupportedError, match="integer pixel tensor"):
        quantize_model(g, [t.to(torch.float32) for t in pixels(shape, 6)], settings())


@pytest.mark.parametrize("optype,params,error,match", [
    ("RgbToYuv", {"coefficient": [1.0, 2.0]}, IRError, "15 numbers"),
    ("RgbToYuv", {"format": "NV12"}, UnsupportedError, "NV12"),
    ("YuvToRgb", {"coefficient": [0.5] + YUV2RGB[1:]}, None, "integers"),
])
def test_bad_params(optype: str, params, error, match: str) -> None:
    g, shape = graph(optype, RGB2YUV if optype == "RgbToYuv" else YUV2RGB, **{k: v for k, v in params.items()
                                                                             if k != "coefficient"})
    if "coefficient" in params:
        g.nodes[-1].params["coefficient"] = params["coefficient"]
    x = pixels(shape, 7)
    if error is None:  # a fractional offset works in float, and is refused when quantizing
        g.forward([x[0]])
        with pytest.raises(UnsupportedError, match=match):
            quantize_model(g, x, settings())
        return
    with pytest.raises(error, match=match):
        g.forward([x[0]])


def test_odd_image_size_is_refused() -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 3, 4, 3], dtype=Dtype.UINT8)
    y = b.layer("RgbToYuv", [x], [[1, 18]], name="op", params={"coefficient": RGB2YUV})
    with pytest.raises(IRError, match="even"):
        b.build([y]).forward([torch.zeros(1, 3, 4, 3, dtype=torch.int64)])
