"""The float forward's flow of float64 convolution results (docs/architecture.md, "Float reference"): a
Convolution/DepthwiseConv without fused activation hands its float64 result on unrounded to convolutions and PReLU;
every other reader, a fused activation and the graph outputs see it rounded to float32. Checked against an
independent float64 reference written here."""
from __future__ import annotations

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
    assert graph.wide_values.get(graph.node("reader").outputs[0]) is None
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
