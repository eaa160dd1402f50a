"""Grouped 3-D convolutions (Convolution3D, ConvTranspose3D) against float64 references on contiguous tensors.

torch 2.13's float32 grouped 3-D convolution and transposed convolution of a channels-last input by a permuted
(non-contiguous) weight view compute wrong sums on the CPU, by thousands where every sum is a small integer;
quantopt's layers hand torch contiguous weights (ops/mac_extra.py). Both the float forward and the integer forward
(whose sums below 2^24 run in float32) went through that call."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import quantopt.ops.mac_extra  # noqa: F401  (registers the ops)
from quantopt.graph.builder import GraphBuilder
from quantopt.ops._quant import effective_weights, mac_finish, mac_input
from quantopt.pipeline import quantize_model

RNG = np.random.default_rng(11)


def _conv3d_graph(group: int) -> Any:
    """x [1, D=4, H=5, W=6, C=8] -> Convolution3D (kernel d1 h3 w3, pads of H and W) with `group` groups."""
    b = GraphBuilder("conv3d")
    x = b.input("x", [1, 4, 5, 6, 8])
    params: Dict[str, Any] = dict(kernel_z=1, kernel_y=3, kernel_x=3, group=group, num_output=8, pad_y_begin=1,
                                  pad_y_end=1, pad_x_begin=1, pad_x_end=1, with_activation="NONE")
    y = b.layer("Convolution3D", [x], [[1, 4, 5, 6, 8]], name="conv", params=params, constants={
        "weights": RNG.integers(-20, 20, (8, 3, 3, 1, 8 // group)).astype(np.float32),
        "biases": RNG.normal(0, 1, 8).astype(np.float32)})
    return b.build([y])


def _reference(x_ndhwc: torch.Tensor, w_ir: torch.Tensor, group: int, pad_value: float = 0.0) -> torch.Tensor:
    """float64 conv3d on contiguous NCDHW data and [out, in/g, kd, kh, kw] weights, back to NDHWC."""
    xt = F.pad(x_ndhwc.double().permute(0, 4, 1, 2, 3).contiguous(), (1, 1, 1, 1, 0, 0), value=pad_value)
    wt = w_ir.double().permute(0, 4, 3, 1, 2).contiguous()
    return F.conv3d(xt, wt, groups=group).permute(0, 2, 3, 4, 1)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_grouped_convolution3d_float_forward(group: int) -> None:
    graph = _conv3d_graph(group)
    x = torch.from_numpy(RNG.integers(-8, 8, (1, 4, 5, 6, 8)).astype(np.float32))  # integers: exact in float32
    y = graph.forward([x])[0]
    node = graph.node("conv")
    sums = _reference(x, node.get_constant("weights").betensor, group)  # integers: exact in float32 too
    assert torch.equal(y, sums.float() + node.get_constant("biases").betensor)


@pytest.mark.parametrize("group", [1, 2, 8])
def test_grouped_convolution3d_integer_forward(group: int) -> None:
    graph = _conv3d_graph(group)
    data = [[torch.from_numpy(RNG.normal(0, 1, (1, 4, 5, 6, 8)).astype(np.float32))] for _ in range(3)]
    q = quantize_model(graph, data)
    q.forward(data[0], keep_tensors=True)
    node = q.node("conv")
    x, zp = mac_input(node)
    acc = _reference(x, effective_weights(node), group, pad_value=float(-zp))
    assert torch.equal(node.outputs[0].betensor, mac_finish(node, acc, planned=False))


def test_grouped_conv_transpose3d_float_forward() -> None:
    """ConvTranspose3D, 2 groups, stride 2 in H and W: against torch's float64 transposed convolution of the same
    weights in the ONNX layout [in_c, out_c/group, kd, kh, kw]."""
    b = GraphBuilder("convt3d")
    x = b.input("x", [1, 3, 4, 5, 8])
    w_onnx = RNG.integers(-20, 20, (8, 4, 1, 3, 3)).astype(np.float32)  # [in_c, out_c/g, kd, kh, kw], 2 groups
    # the IR's [out_c/group, kh, kw, kd, in_c]
    w_ir = np.ascontiguousarray(w_onnx.transpose(1, 3, 4, 2, 0))
    params = dict(kernel_z=1, kernel_y=3, kernel_x=3, stride_y=2, stride_x=2, group=2, num_output=8,
                  with_activation="NONE")
    y = b.layer("ConvTranspose3D", [x], [[1, 3, 9, 11, 8]], name="up", params=params,
                constants={"weights": w_ir, "biases": np.zeros(8, np.float32)})
    graph = b.build([y])
    xv = torch.from_numpy(RNG.integers(-8, 8, (1, 3, 4, 5, 8)).astype(np.float32))
    got = graph.forward([xv])[0]
    want = F.conv_transpose3d(xv.double().permute(0, 4, 1, 2, 3).contiguous(), torch.from_numpy(w_onnx).double(),
                              stride=(1, 2, 2), groups=2).permute(0, 2, 3, 4, 1)
    assert torch.equal(got.double(), want)
