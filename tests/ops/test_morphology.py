"""Dilation, Erosion and Col2Im (ops/morphology.py): float forward against numpy loops written from
docs/semantics/morphology.md (TensorFlow's dilation2d / erosion2d, ONNX Col2Im; torch's fold too), quantize
(element with the activation bits, alignment factors), the integer forward against a python-int reference,
dequantized output close to float, a re-read IR bit-identical, and clear errors."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_helpers import params_of
from range_helpers import range_of

import quantopt.ops.morphology  # noqa: F401  (registers the family even when imported alone)
from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_asymmetric"), (8, "per_tensor_symmetric_full_range"), (16, "per_tensor_symmetric_full_range")]

WINDOWS = [
    dict(kernel_x=3, kernel_y=2, stride_x=2, stride_y=1, dilation_x=1, dilation_y=1, pad_left=0, pad_right=1,
         pad_top=1, pad_bottom=0),
    dict(kernel_x=2, kernel_y=2, stride_x=1, stride_y=2, dilation_x=2, dilation_y=1, pad_left=1, pad_right=1,
         pad_top=0, pad_bottom=1),
    dict(kernel_x=1, kernel_y=3, stride_x=1, stride_y=1, dilation_x=1, dilation_y=2, pad_left=0, pad_right=0,
         pad_top=2, pad_bottom=2),
]
SHAPE = [2, 6, 7, 3]


def out_hw(p: Dict[str, int]) -> List[int]:
    eh, ew = (p["kernel_y"] - 1) * p["dilation_y"] + 1, (p["kernel_x"] - 1) * p["dilation_x"] + 1
    return [(SHAPE[1] + p["pad_top"] + p["pad_bottom"] - eh) // p["stride_y"] + 1,
            (SHAPE[2] + p["pad_left"] + p["pad_right"] - ew) // p["stride_x"] + 1]


def element(p: Dict[str, int], seed: int, shift: float = 0.0) -> np.ndarray:
    r = np.random.default_rng(seed)
    return (r.normal(shift, 0.4, size=(SHAPE[3], p["kernel_y"], p["kernel_x"], 1))).astype(np.float32)


def graph(optype: str, p: Dict[str, int], w: np.ndarray):
    b = GraphBuilder("t")
    x = b.input("x", SHAPE)
    y = b.layer(optype, [x], [[SHAPE[0], *out_hw(p), SHAPE[3]]], name="op", params=dict(p),
                constants={"weights": w})
    return b.build([y])


def data(seed: int, count: int = 4) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0.2, 1.0, size=SHAPE).astype(np.float32)) for _ in range(count)]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_strategy_activation="extrema", **extra)


def ref(optype: str, x: np.ndarray, w: np.ndarray, p: Dict[str, int], exact: bool = False,
        a: Sequence[int] = (1, 1)) -> np.ndarray:
    """The window max (min) of x·a0 + w·a1 over the valid taps; exact: python ints."""
    n, h, wd, c = x.shape
    oh, ow = out_hw(p)
    out = np.zeros((n, oh, ow, c), dtype=object if exact else np.float32)
    kh, kw = w.shape[1], w.shape[2]
    for b in range(n):
        for y in range(oh):
            for xx in range(ow):
                for ch in range(c):
                    vals = []
                    for i in range(kh):
                        for j in range(kw):
                            r = y * p["stride_y"] + i * p["dilation_y"] - p["pad_top"]
                            col = xx * p["stride_x"] + j * p["dilation_x"] - p["pad_left"]
                            if 0 <= r < h and 0 <= col < wd:
                                if optype == "Dilation":
                                    wv = w[ch, i, j, 0]
                                else:
                                    wv = -w[ch, kh - 1 - i, kw - 1 - j, 0]
                                if exact:
                                    vals.append(int(x[b, r, col, ch]) * a[0] + int(wv) * a[1])
                                else:
                                    vals.append(np.float32(x[b, r, col, ch]) + np.float32(wv))
                    out[b, y, xx, ch] = max(vals) if optype == "Dilation" else min(vals)
    return out


@pytest.mark.parametrize("optype", ["Dilation", "Erosion"])
@pytest.mark.parametrize("window", range(len(WINDOWS)))
def test_float_forward(optype: str, window: int) -> None:
    p = WINDOWS[window]
    w = element(p, 1)
    x = data(2, 1)[0]
    (y,) = graph(optype, p, w).forward([x])
    np.testing.assert_array_equal(y.numpy(), ref(optype, x.numpy(), w, p))


def rhe_requant(acc: int, m: int, n: int, zp: int, lo: int, hi: int) -> int:
    from fractions import Fraction
    v = Fraction(acc * m, 2 ** n) if n >= 0 else Fraction(acc * m * 2 ** -n)
    f = v.numerator // v.denominator
    rem = v - f
    r = f + (1 if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2) else 0)
    return min(max(r - zp, lo), hi)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("optype", ["Dilation", "Erosion"])
@pytest.mark.parametrize("window", [0, 1])
def test_integer_forward(optype: str, window: int, bits: int, mode: str) -> None:
    p = WINDOWS[window]
    w = element(p, 3, shift=0.3 if window else 0.0)
    g = graph(optype, p, w)
    x = data(4, 1)[0]
    (fy,) = g.forward([x])
    fy = fy.clone()
    weight_mode = "per_tensor_asymmetric" if mode == "per_tensor_asymmetric" else "per_tensor_symmetric_full_range"
    qg = quantize_model(g, data(5) + [x], settings(bits, mode, q_mode_weight=weight_mode))
    node, inp, out = qg.nodes[-1], qg.input_tensors[0], qg.output_tensors[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    m, a_in, a_w = node.params["scale_value"]
    assert 1 <= a_in <= 32767 and 1 <= a_w <= 32767
    assert node.get_constant("weights").betensor.abs().max() <= 2 ** (bits - 1)
    if optype == "Erosion" or window == 0:
        assert int(oq.qmin) < 0
    (qy,) = qg.forward([x])
    wq = node.get_constant("weights").betensor.numpy().astype(np.int64) + int(node.params["weights_zp"])
    acc = ref(optype, inp.betensor.numpy().astype(np.int64) + int(iq.zerop), wq, p, exact=True, a=(a_in, a_w))
    expect = np.vectorize(lambda v: rhe_requant(v, m, int(node.params["shift_value"]), int(oq.zerop),
                                                int(oq.qmin), int(oq.qmax)))(acc).astype(np.int64)
    np.testing.assert_array_equal(qy.numpy(), expect)
    (dy,) = run_quantized(qg, [x])
    span = float(fy.abs().max())
    # 16 bits: the alignment factors keep 8 fraction bits (truncated), a relative error up to ~2^-8 on one term
    np.testing.assert_allclose(dy.numpy(), fy.numpy(), atol=(0.03 if bits == 8 else 0.004) * span)


def test_written_ir_reloads_bit_identical(tmp_path) -> None:
    p = WINDOWS[0]
    qg = quantize_model(graph("Erosion", p, element(p, 6)), data(7), settings(*MODES[0]))
    x = data(8, 1)
    before = qg.forward(x)[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    assert torch.equal(before, read_ir(txt).forward(x)[0])


@pytest.mark.parametrize("change,match", [
    ({"pad_top": 5, "kernel_y": 2, "dilation_y": 1}, "entirely in the padding"),
    ({"kernel_x": 9}, "larger than"),
    ({"stride_x": 0}, ">= 1"),
])
def test_bad_params(change: Dict[str, int], match: str) -> None:
    p = {**WINDOWS[0], **change}
    w = element({**WINDOWS[0], "kernel_x": p["kernel_x"]}, 9)
    b = GraphBuilder("t")
    x = b.input("x", SHAPE)
    y = b.layer("Dilation", [x], [[2, 6, 3, 3]], name="op", params=p, constants={"weights": w})
    with pytest.raises(IRError, match=match):
        b.build([y]).forward([torch.zeros(SHAPE)])


def test_element_shape_is_checked() -> None:
    p = WINDOWS[0]
    w = np.zeros((3, 3, 2, 1), dtype=np.float32)
    with pytest.raises(IRError, match="weights must have shape"):
        graph("Dilation", p, w).forward([torch.zeros(SHAPE)])


# ================================================================================================ Col2Im
def col2im_graph(cols: List[int], image: List[int], block: List[int], params: Dict[str, int]):
    b = GraphBuilder("t")
    x = b.input("x", cols)
    shapes = [b.layer("Constant", [], [[len(v)]], name=name, constants={"weights": np.array(v, dtype=np.int32)},
                      constant_dtypes={"weights": Dtype.INT32}, output_dtypes=[Dtype.INT32])
              for name, v in (("image_shape", image), ("block_shape", block))]
    c = cols[1] // int(np.prod(block))
    y = b.layer("Col2Im", [x, *shapes], [[cols[0], c, *image]], name="op", params=params)
    return b.build([y])


def ref_col2im(x: np.ndarray, image: List[int], block: List[int], stride: List[int], dil: List[int],
               pads: List[Sequence[int]], exact: bool = False) -> np.ndarray:
    """A loop over every (channel, tap, block position), ONNX Col2Im's definition."""
    n, ck, length = x.shape
    k = int(np.prod(block))
    c = ck // k
    counts = [(image[d] + pads[d][0] + pads[d][1] - ((block[d] - 1) * dil[d] + 1)) // stride[d] + 1
              for d in range(len(image))]
    out = np.zeros((n, c, *image), dtype=object if exact else np.float64)
    for b in range(n):
        for ch in range(c):
            for t, tap in enumerate(np.ndindex(*block)):
                for p, pos in enumerate(np.ndindex(*counts)):
                    coord = [pos[d] * stride[d] - pads[d][0] + tap[d] * dil[d] for d in range(len(image))]
                    if all(0 <= coord[d] < image[d] for d in range(len(image))):
                        v = x[b, ch * k + t, p]
                        out[(b, ch, *coord)] += int(v) if exact else float(v)
    return out


COL2IM = [
    ([2, 8, 15], [5, 6], [2, 2], dict(stride_x=2, stride_y=1, pad_left=1, pad_bottom=1), [1, 2], [1, 1],
     [(0, 1), (1, 0)]),
    ([1, 18, 15], [6, 5], [3, 2], dict(stride_y=2, dilation_x=2, pad_top=1, pad_bottom=1, pad_left=1,
                                       pad_right=1), [2, 1], [1, 2], [(1, 1), (1, 1)]),
    ([1, 8, 18], [3, 4, 5], [2, 2, 1], dict(stride_x=2, pad_x_begin=1, pad_z_end=1, dilation_y=2),
     [1, 1, 2], [1, 2, 1], [(0, 1), (0, 0), (1, 0)]),
]


@pytest.mark.parametrize("case", range(len(COL2IM)))
def test_col2im_float(case: int) -> None:
    cols, image, block, params, stride, dil, pads = COL2IM[case]
    g = col2im_graph(cols, image, block, params)
    x = torch.from_numpy(np.random.default_rng(30).normal(size=cols).astype(np.float32))
    (y,) = g.forward([x])
    np.testing.assert_allclose(y.numpy(), ref_col2im(x.numpy(), image, block, stride, dil, pads), rtol=1e-6,
                               atol=1e-6)
    if case == 1:  # symmetric padding: torch's fold is an independent second reference
        fold = F.fold(x, image, block, dilation=dil, padding=[p[0] for p in pads], stride=stride)
        np.testing.assert_allclose(y.numpy(), fold.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", range(len(COL2IM)))
def test_col2im_integer(case: int, bits: int, mode: str) -> None:
    cols, image, block, params, stride, dil, pads = COL2IM[case]
    g = col2im_graph(cols, image, block, params)
    r = np.random.default_rng(31)
    xs = [torch.from_numpy(r.normal(0.3, 1.0, size=cols).astype(np.float32)) for _ in range(4)]
    (fy,) = g.forward([xs[0]])
    fy = fy.clone()
    qg = quantize_model(g, xs, settings(bits, mode))
    node, inp, out = qg.nodes[-1], qg.input_tensors[0], qg.output_tensors[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    (qy,) = qg.forward([xs[0]])
    acc = ref_col2im(inp.betensor.numpy().astype(np.int64) + int(iq.zerop), image, block, stride, dil, pads,
                     exact=True)
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    expect = np.vectorize(lambda v: rhe_requant(v, m, n, int(oq.zerop), int(oq.qmin), int(oq.qmax)))(acc)
    np.testing.assert_array_equal(qy.numpy(), expect.astype(np.int64))
    (dy,) = run_quantized(qg, [xs[0]])
    r = range_of(node, out)
    inside = (fy.numpy() >= r.min) & (fy.numpy() <= r.max)  # the calibrated range clips the others
    span = float(fy.abs().max())
    assert np.abs(dy.numpy() - fy.numpy())[inside].max() <= (0.04 if bits == 8 else 0.002) * span


@pytest.mark.parametrize("image,block,match", [([5, 7], [2, 2], "blocks"), ([5, 6], [3, 3], "multiple"),
                                               ([5, 6, 2], [2, 2], "same rank"), ([1, 6], [2, 2], "larger")])
def test_col2im_bad_shapes(image, block, match: str) -> None:
    g = col2im_graph([1, 8, 15], image, block if len(block) == len(image) else block, {})
    if len(block) != len(image):
        g.nodes[-1].inputs[2].betensor = torch.tensor(block, dtype=torch.int32)
    with pytest.raises(IRError, match=match):
        g.forward([torch.zeros(1, 8, 15)])
