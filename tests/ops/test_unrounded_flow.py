"""The float forward's flow of float64 convolution results (docs/architecture.md, "Float reference"): a
Convolution/DepthwiseConv hands its float64 result on unrounded (after a fused RELU6, CLIP, LEAKYRELU or PRELU
computed in float64; a fused RELU rounds) to convolutions, to the layers that compute in their input's float type
(layout moves, Concat, BatchNorm, CLIP/RELU6/LEAKYRELU/PRELU, Negative, Reduce MIN/MAX), which hand theirs on the
same way; every other reader and the graph outputs see float32. BILINEAR Resize reads float32 and hands on its
float64 result. Checked against independent float64 references written here."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.pipeline import quantize_model

H, W, C = 6, 6, 16


def _conv_params(act: str = "NONE", group: int = 1) -> Dict:
    return {"kernel_y": 1, "kernel_x": 1, "stride_y": 1, "stride_x": 1, "pad_left": 0, "pad_right": 0,
            "pad_top": 0, "pad_bottom": 0, "dilation_y": 1, "dilation_x": 1, "group": group, "with_activation": act}


def _conv_constants(rng: np.random.Generator, cin: int = C, cout: int = C) -> Dict[str, torch.Tensor]:
    return {"weights": torch.from_numpy(rng.standard_normal((cout, 1, 1, cin)).astype(np.float32)),
            "biases": torch.from_numpy(rng.standard_normal(cout).astype(np.float32))}


def _chain(act: str, reader: str, seed: int = 0) -> Tuple[PyGraph, Dict, Dict]:
    """Input -> 1x1 Convolution (fused `act`) -> `reader` layer; returns the graph and the two layers' constants."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("flow")
    x = b.input("x", [1, H, W, C])
    first = _conv_constants(rng)
    y = b.layer("Convolution", [x], [[1, H, W, C]], name="conv", params=_conv_params(act), constants=first)
    if reader == "Convolution":
        second = _conv_constants(rng)
        out = b.layer("Convolution", [y], [[1, H, W, C]], name="reader", params=_conv_params(), constants=second)
    elif reader == "DepthwiseConv":
        second = _conv_constants(rng, cin=1)
        out = b.layer("DepthwiseConv", [y], [[1, H, W, C]], name="reader", params=_conv_params(group=C),
                      constants=second)
    elif reader == "PRELU":
        second = {"negative_slope": torch.from_numpy(rng.uniform(0.05, 0.9, C).astype(np.float32))}
        out = b.layer("Activation", [y], [[1, H, W, C]], name="reader", params={"method": "PRELU"},
                      constants=second)
    else:  # an Eltwise ADD of the convolution with itself
        second = {}
        out = b.layer("Eltwise", [y, y], [[1, H, W, C]], name="reader", params={"method": "ADD"})
    return b.build([out]), first, second


def _inputs(seed: int = 1, batches: int = 4) -> List[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal((1, H, W, C)).astype(np.float32)) for _ in range(batches)]


def _conv64(x: np.ndarray, constants: Dict) -> np.ndarray:
    """1x1 convolution in float64 (exact enough: 16 products of float32 values), NHWC."""
    w = constants["weights"].numpy().astype(np.float64)[:, 0, 0, :]
    return x.astype(np.float64) @ w.T + constants["biases"].numpy().astype(np.float64)


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _run(graph: PyGraph, xs: Sequence[torch.Tensor]) -> List[np.ndarray]:
    return [graph.forward([x])[0].numpy() for x in xs]


def test_prelu_reads_the_unrounded_convolution() -> None:
    graph, conv, prelu = _chain("NONE", "PRELU")
    slope = prelu["negative_slope"].numpy().astype(np.float64)
    moved = 0
    for x, got in zip(_inputs(), _run(graph, _inputs())):
        c = _conv64(x.numpy(), conv)
        expected = _f32(np.where(c >= 0, c, c * slope))
        rounded_first = _f32(np.where(_f32(c) >= 0, _f32(c), _f32(c) * _f32(slope)))
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == np.float32
        moved += int((expected != rounded_first).sum())
    assert moved > 0, "the data must contain values where rounding the convolution first changes PReLU's result"


def test_convolution_reads_the_unrounded_convolution() -> None:
    graph, first, second = _chain("NONE", "Convolution")
    moved = 0
    for x, got in zip(_inputs(), _run(graph, _inputs())):
        c = _conv64(x.numpy(), first)
        np.testing.assert_array_equal(got, _f32(_conv64(c, second)))
        moved += int((_f32(_conv64(c, second)) != _f32(_conv64(_f32(c), second))).sum())
    assert moved > 0


def test_depthwise_convolution_reads_the_unrounded_convolution() -> None:
    graph, first, second = _chain("NONE", "DepthwiseConv")
    w = second["weights"].numpy().astype(np.float64)[:, 0, 0, 0]
    b = second["biases"].numpy().astype(np.float64)
    moved = 0
    for x, got in zip(_inputs(), _run(graph, _inputs())):
        c = _conv64(x.numpy(), first)
        np.testing.assert_array_equal(got, _f32(c * w + b))
        moved += int((_f32(c * w + b) != _f32(_f32(c) * w + b)).sum())
    assert moved > 0


def test_fused_activation_and_other_readers_see_float32() -> None:
    graph, first, second = _chain("RELU", "Convolution")
    for x, got in zip(_inputs(), _run(graph, _inputs())):
        c = _f32(np.maximum(_conv64(x.numpy(), first), 0.0))
        np.testing.assert_array_equal(got, _f32(_conv64(c, second)))
    graph, first, _ = _chain("NONE", "Eltwise")
    for x, got in zip(_inputs(), _run(graph, _inputs())):
        c = _f32(_conv64(x.numpy(), first))
        np.testing.assert_array_equal(got, c + c)


def test_only_a_float_forward_keeps_an_unrounded_value() -> None:
    graph, _, _ = _chain("NONE", "PRELU")
    graph.forward(_inputs()[:1], keep_tensors=True)
    conv_out = graph.node("conv").outputs[0]
    wide = graph.wide_values.get(conv_out)
    assert wide is not None and wide.dtype == torch.float64
    assert torch.equal(wide.to(torch.float32), conv_out.betensor)
    prelu_wide = graph.wide_values.get(graph.node("reader").outputs[0])  # PReLU keeps its float64 result too
    assert prelu_wide is not None and prelu_wide.dtype == torch.float64
    quantized = quantize_model(graph, _inputs())
    q_out = quantized.node("conv").outputs[0]
    quantized.forward(_inputs()[:1], keep_tensors=True)
    assert quantized.wide_values.get(q_out) is None and len(quantized.wide_values) == 0
    quantized.wide_values.keep(q_out, torch.zeros(q_out.betensor.shape, dtype=torch.float64))  # a planted value
    reader = quantized.node("reader")
    before = reader.outputs[0].betensor.clone()
    reader.forward()  # the integer forward never reads a wide value
    assert torch.equal(reader.outputs[0].betensor, before)
    quantized.forward(_inputs()[:1], keep_tensors=True)
    assert quantized.wide_values.get(q_out) is None  # every forward assigns a new value: the planted one is stale
    conv_out.betensor = torch.zeros(1)  # a new value (fake quant, isolated similarity): the old wide value is stale
    assert graph.wide_values.get(conv_out) is None
    graph.forward(_inputs()[:1], keep_tensors=True)
    conv_out.release()
    assert graph.wide_values.get(conv_out) is None


FUSED = {"RELU6": {}, "CLIP": {"clip_min": -0.5, "clip_max": 0.7}, "LEAKYRELU": {"negative_slope_value": 0.1},
         "PRELU": {}}


def _act64(act: str, c: np.ndarray, slope: np.ndarray) -> np.ndarray:
    if act == "RELU6":
        return np.clip(c, 0.0, 6.0)
    if act == "CLIP":
        return np.clip(c, -0.5, 0.7)
    if act == "LEAKYRELU":
        return np.where(c >= 0, c, c * 0.1)
    return np.where(c >= 0, c, c * slope)


def test_fused_activations_but_relu_keep_the_float64_sums() -> None:
    """A fused RELU6/CLIP/LEAKYRELU/PRELU works on the float64 sums and the next convolution reads its float64 result;
    the layer's own output is that result rounded once."""
    for act, extra in FUSED.items():
        rng = np.random.default_rng(3)
        b = GraphBuilder("fused")
        x = b.input("x", [1, H, W, C])
        first, second = _conv_constants(rng), _conv_constants(rng)
        slope = rng.uniform(0.05, 0.5, C).astype(np.float32)
        consts = dict(first, negative_slope=torch.from_numpy(slope)) if act == "PRELU" else first
        y = b.layer("Convolution", [x], [[1, H, W, C]], name="conv", params={**_conv_params(act), **extra},
                    constants=consts)
        out = b.layer("Convolution", [y], [[1, H, W, C]], name="reader", params=_conv_params(), constants=second)
        graph = b.build([out, y])
        moved = 0
        for xin in _inputs():
            got, mid = (t.numpy() for t in graph.forward([xin]))
            a = _act64(act, _conv64(xin.numpy(), first), slope.astype(np.float64))
            np.testing.assert_array_equal(mid, _f32(a), err_msg=act)
            np.testing.assert_array_equal(got, _f32(_conv64(a, second)), err_msg=act)
            moved += int((_f32(_conv64(a, second)) != _f32(_conv64(_f32(a), second))).sum())
        assert moved > 0, act


def _moves(b: GraphBuilder, y: str) -> str:
    """Transpose to NCHW and back, Slice off nothing, Concat with itself, Slice the first half: every layout move
    a float64 value passes through on its way to the next convolution."""
    t = b.layer("Transpose", [y], [[1, C, H, W]], name="to_nchw", params={"perm": [0, 3, 1, 2]})
    t = b.layer("Transpose", [t], [[1, H, W, C]], name="to_nhwc", params={"perm": [0, 2, 3, 1]})
    t = b.layer("Reshape", [t], [[1, H * W, C]], name="flat", params={"shape": [1, H * W, C]})
    t = b.layer("Reshape", [t], [[1, H, W, C]], name="unflat", params={"shape": [1, H, W, C]})
    t = b.layer("Concat", [t, t], [[1, H, W, 2 * C]], name="twice", params={"axis": 3})
    return b.layer("Slice", [t], [[1, H, W, C]], name="half", params={"begin": [0, 0, 0, 0], "end": [1, H, W, C]})


def test_layout_moves_batchnorm_and_negative_hand_on_float64() -> None:
    rng = np.random.default_rng(4)
    first, second = _conv_constants(rng), _conv_constants(rng)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    b = GraphBuilder("moves")
    x = b.input("x", [1, H, W, C])
    y = b.layer("Convolution", [x], [[1, H, W, C]], name="conv", params=_conv_params(), constants=first)
    t = _moves(b, y)
    t = b.layer("BatchNorm", [t], [[1, H, W, C]], name="bn", params={"axis": 3},
                constants={"weights": torch.from_numpy(gamma), "biases": torch.from_numpy(beta)})
    t = b.layer("Negative", [t], [[1, H, W, C]], name="neg")
    out = b.layer("Convolution", [t], [[1, H, W, C]], name="reader", params=_conv_params(), constants=second)
    graph = b.build([out])
    moved = 0
    for xin in _inputs():
        got = graph.forward([xin])[0].numpy()
        c = -(_conv64(xin.numpy(), first) * gamma.astype(np.float64) + beta.astype(np.float64))
        np.testing.assert_array_equal(got, _f32(_conv64(c, second)))
        moved += int((_f32(_conv64(c, second)) != _f32(_conv64(_f32(c), second))).sum())
    assert moved > 0


def test_pooling_and_eltwise_still_read_float32() -> None:
    """The layers upstream computes in float32 (pooling, Eltwise, table activations) read the rounded value, and
    their result carries no float64 value on."""
    rng = np.random.default_rng(5)
    first, second = _conv_constants(rng), _conv_constants(rng)
    b = GraphBuilder("pool")
    x = b.input("x", [1, H, W, C])
    y = b.layer("Convolution", [x], [[1, H, W, C]], name="conv", params=_conv_params(), constants=first)
    t = b.layer("Activation", [y], [[1, H, W, C]], name="sig", params={"method": "SIGMOID"})
    out = b.layer("Convolution", [t], [[1, H, W, C]], name="reader", params=_conv_params(), constants=second)
    graph = b.build([out])
    for xin in _inputs():
        got = graph.forward([xin])[0].numpy()
        s = torch.sigmoid(torch.from_numpy(_f32(_conv64(xin.numpy(), first)))).numpy()
        np.testing.assert_array_equal(got, _f32(_conv64(s, second)))


def _bilinear_reference(x: np.ndarray, h_out: int, w_out: int, ratio: float) -> np.ndarray:
    """HALF_PIXEL bilinear with a ratio, written out pixel by pixel in Python floats (float64): coordinate
    (i + 0.5) * (1 / ratio) - 0.5, neighbours floor (at least 0) and ceil (at most the last), weights as products
    of (1 - d) and d, the four terms summed top-left, top-right, bottom-left, bottom-right."""
    _, h_in, w_in, ch = x.shape
    out = np.zeros((1, h_out, w_out, ch))
    for i in range(h_out):
        cy = (i + 0.5) * (1.0 / ratio) - 0.5
        y0, y1 = max(math.floor(cy), 0), min(math.ceil(cy), h_in - 1)
        dy = cy - y0
        for j in range(w_out):
            cx = (j + 0.5) * (1.0 / ratio) - 0.5
            x0, x1 = max(math.floor(cx), 0), min(math.ceil(cx), w_in - 1)
            dx = cx - x0
            for k in range(ch):
                v = float(x[0, y0, x0, k]) * ((1 - dy) * (1 - dx)) + float(x[0, y0, x1, k]) * ((1 - dy) * dx)
                v = v + float(x[0, y1, x0, k]) * (dy * (1 - dx))
                out[0, i, j, k] = v + float(x[0, y1, x1, k]) * (dy * dx)
    return out


def test_bilinear_resize_in_upstream_form_hands_on_float64() -> None:
    rng = np.random.default_rng(6)
    second = _conv_constants(rng, cin=4, cout=4)
    b = GraphBuilder("resize")
    x = b.input("x", [1, 3, 5, 4])
    y = b.layer("Resize", [x], [[1, 6, 10, 4]], name="up",
                params={"method": "BILINEAR", "mode": "HALF_PIXEL", "ratio_x": 2.0, "ratio_y": 2.0})
    out = b.layer("Convolution", [y], [[1, 6, 10, 4]], name="reader", params=_conv_params(), constants=second)
    graph = b.build([out, y])
    for _ in range(3):
        xin = rng.standard_normal((1, 3, 5, 4)).astype(np.float32)
        got, up = (t.numpy() for t in graph.forward([torch.from_numpy(xin)]))
        ref = _bilinear_reference(xin, 6, 10, 2.0)
        np.testing.assert_array_equal(up, _f32(ref))
        np.testing.assert_array_equal(got, _f32(_conv64(ref, second)))


def test_div_of_two_convolutions_stays_float64() -> None:
    """Upstream's Div computes in its inputs' type: two unrounded convolution results give a float64 quotient, which
    the next convolution reads unrounded."""
    rng = np.random.default_rng(8)
    first, second, third = _conv_constants(rng), _conv_constants(rng), _conv_constants(rng)
    second["biases"] = second["biases"] + 20.0  # keep the divisor away from 0
    b = GraphBuilder("div")
    x = b.input("x", [1, H, W, C])
    num = b.layer("Convolution", [x], [[1, H, W, C]], name="num", params=_conv_params(), constants=first)
    den = b.layer("Convolution", [x], [[1, H, W, C]], name="den", params=_conv_params(), constants=second)
    q = b.layer("Div", [num, den], [[1, H, W, C]], name="div")
    out = b.layer("Convolution", [q], [[1, H, W, C]], name="reader", params=_conv_params(), constants=third)
    graph = b.build([out])
    moved = 0
    for xin in _inputs():
        got = graph.forward([xin])[0].numpy()
        ratio = _conv64(xin.numpy(), first) / _conv64(xin.numpy(), second)
        np.testing.assert_array_equal(got, _f32(_conv64(ratio, third)))
        moved += int((_f32(_conv64(ratio, third)) != _f32(_conv64(_f32(ratio), third))).sum())
    assert moved > 0
