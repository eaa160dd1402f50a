"""The integer forward of DepthwiseConv and Convolution by oneDNN's float32 convolution (ops/conv.py,
`_conv_int_onednn`, where the layer's bound puts it in float32 and the int8 GEMM is not used) gives the integers of
this package's kernels it replaces (the per-tap depthwise kernel, the unfolded GEMMs): zero points, asymmetric pads,
strides, dilations, groups and channel multipliers included."""
from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch
from test_int8_gemm import _conv_graph as int8_conv_graph
from test_int8_gemm import reference_gemm

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.ops import _conv_nhwc, conv
from quantopt.pipeline import quantize_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch without oneDNN: the per-tap kernel is the only one")


def _depthwise_graph(seed: int, k: int, stride, dilation, pads, multiplier: int, c: int = 6,
                     size=(13, 11)) -> PyGraph:
    r = np.random.default_rng(seed)
    g = GraphBuilder("dw")
    x = g.input("x", [1, size[0], size[1], c])
    ho = (size[0] + pads[2] + pads[3] - dilation[0] * (k - 1) - 1) // stride[0] + 1
    wo = (size[1] + pads[0] + pads[1] - dilation[1] * (k - 1) - 1) // stride[1] + 1
    params = dict(num_output=c * multiplier, kernel_y=k, kernel_x=k, stride_y=stride[0], stride_x=stride[1],
                  pad_left=pads[0], pad_right=pads[1], pad_top=pads[2], pad_bottom=pads[3], dilation_y=dilation[0],
                  dilation_x=dilation[1], group=c, multiplier=multiplier, with_activation="NONE")
    y = g.layer("DepthwiseConv", [x], [[1, ho, wo, c * multiplier]], name="dw", params=params,
                constants={"weights": r.normal(0, 0.5, (c * multiplier, k, k, 1)).astype(np.float32),
                           "biases": r.normal(0, 0.3, c * multiplier).astype(np.float32)})
    return g.build([y])


def _conv_graph(seed: int, k: int, stride, dilation, pads, group: int) -> PyGraph:
    """A Convolution of 8 to 12 channels over 13x11 (test_int8_gemm's graph)."""
    return int8_conv_graph(seed, pads, stride, dilation, cin=8, cout=12, size=(13, 11), group=group, k=k)


def _both_ways(monkeypatch, graph: PyGraph, shape: List[int], amode: str) -> None:
    """The quantized graph's output through oneDNN equals the output through this package's kernels, and oneDNN
    ran."""
    r = np.random.default_rng(4)
    data = [torch.from_numpy(r.normal(0.5, 1.0, shape).astype(np.float32)) for _ in range(3)]
    q = quantize_model(graph, data[:2], {"q_mode_activation": amode})
    monkeypatch.setattr(conv, "int8_gemm_used", lambda: False)
    monkeypatch.setattr(conv, "ONEDNN_MIN_MACS", 1)  # these small layers take oneDNN too
    calls: List[int] = []
    onednn = conv._conv_int_onednn

    def spy(*args):
        calls.append(1)
        return onednn(*args)

    monkeypatch.setattr(conv, "_conv_int_onednn", spy)
    fast = q.forward([data[2]])[0].clone()
    assert calls
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert torch.equal(fast, q.forward([data[2]])[0])


@pytest.mark.parametrize("amode", ["per_tensor_symmetric_full_range", "per_tensor_asymmetric"])
@pytest.mark.parametrize("kind,k,stride,dilation,pads,groups", [
    ("conv", 3, (1, 1), (1, 1), (1, 1, 1, 1), 1),
    ("conv", 1, (1, 1), (1, 1), (0, 0, 0, 0), 1),
    ("conv", 5, (2, 1), (1, 1), (0, 2, 3, 1), 2),
    ("conv", 3, (1, 2), (2, 1), (2, 0, 1, 2), 4),
    ("depthwise", 3, (1, 1), (1, 1), (1, 1, 1, 1), 1),  # groups: the channel multiplier
    ("depthwise", 5, (2, 1), (1, 1), (0, 2, 3, 1), 2),
    ("depthwise", 3, (1, 2), (2, 1), (2, 0, 1, 2), 1),
])
def test_onednn_gives_this_packages_kernels_integers(monkeypatch, amode, kind, k, stride, dilation, pads,
                                                     groups) -> None:
    if kind == "conv":
        _both_ways(monkeypatch, _conv_graph(5, k, stride, dilation, pads, groups), [2, 13, 11, 8], amode)
    else:
        _both_ways(monkeypatch, _depthwise_graph(3, k, stride, dilation, pads, groups), [2, 13, 11, 6], amode)


def test_small_convolutions_keep_the_gemm_kernels(monkeypatch) -> None:
    """Below ONEDNN_MIN_MACS a Convolution keeps this package's kernels (oneDNN's set-up per call costs more there);
    a DepthwiseConv takes oneDNN at any size."""
    r = np.random.default_rng(4)
    monkeypatch.setattr(conv, "int8_gemm_used", lambda: False)
    calls: List[str] = []
    onednn = conv._conv_int_onednn
    monkeypatch.setattr(conv, "_conv_int_onednn", lambda node, *a: calls.append(str(node.type)) or onednn(node, *a))
    for graph, c in ((_conv_graph(5, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1), 8),
                     (_depthwise_graph(3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1), 6)):
        data = [torch.from_numpy(r.normal(0.5, 1.0, [2, 13, 11, c]).astype(np.float32)) for _ in range(2)]
        quantize_model(graph, data[:1], {}).forward([data[1]])
    assert calls == ["DepthwiseConv"]


@pytest.mark.parametrize("group,cout,k", [(4, 8, 3), (8, 16, 3), (8, 8, 1)])
def test_grouped_convolutions_take_onednn_before_the_int8_gemms(monkeypatch, group: int, cout: int, k: int) -> None:
    """From ONEDNN_MIN_GROUPS groups on, a grouped Convolution whose bound allows float32 runs as one oneDNN call
    even where the int8 GEMM is used (that takes one GEMM per group), with the int8 GEMMs' integers."""
    assert group >= conv.ONEDNN_MIN_GROUPS
    r = np.random.default_rng(6)
    graph = int8_conv_graph(6, (1, 1, 0, 1), (1, 1), (1, 1), cin=8, cout=cout, size=(9, 7), group=group, k=k)
    data = [torch.from_numpy(r.normal(0.5, 1.0, [2, 9, 7, 8]).astype(np.float32)) for _ in range(3)]
    q = quantize_model(graph, data[:2], {})
    monkeypatch.setattr(conv, "int8_gemm_used", lambda: True)
    gemms: List[int] = []
    monkeypatch.setattr(_conv_nhwc, "int8_gemm", reference_gemm(gemms))  # exact on any CPU (AVX2's is not)
    calls: List[int] = []
    onednn = conv._conv_int_onednn
    monkeypatch.setattr(conv, "_conv_int_onednn", lambda *a: calls.append(1) or onednn(*a))
    fast = q.forward([data[2]])[0].clone()
    assert calls == [1] and not gemms
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # the int8 GEMMs, one per group
    assert torch.equal(fast, q.forward([data[2]])[0]) and len(gemms) == group
