"""Float forward of Convolution, DepthwiseConv, FullyConnected and MatMul against torch's own functions."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder

ATOL = 1e-5


def run_layer(optype: str, xs: Sequence[torch.Tensor], out_shape: Sequence[int], params: Dict,
              constants: Optional[Dict] = None, ir_batch: Optional[int] = None) -> torch.Tensor:
    """Build Input(s) -> one layer and run it; `ir_batch` writes a different batch size into the IR shapes."""
    b = GraphBuilder("t")
    names = []
    for i, x in enumerate(xs):
        shape = list(x.shape)
        if ir_batch is not None:
            shape[0] = ir_batch
        names.append(b.input(f"in{i}", shape))
    shape = list(out_shape)
    if ir_batch is not None:
        shape[0] = ir_batch
    out = b.layer(optype, names, [shape], name="layer", params=params, constants=constants)
    return b.build([out]).forward(list(xs))[0]


def conv_params(k, stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), group=1, num_output=None, act="NONE"):
    p = {"kernel_y": k[0], "kernel_x": k[1], "stride_y": stride[0], "stride_x": stride[1],
         "pad_left": pads[0], "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3],
         "dilation_y": dilation[0], "dilation_x": dilation[1], "group": group, "with_activation": act}
    if num_output is not None:
        p["num_output"] = num_output
    return p


def ref_conv(x_nhwc, w_ohwi, bias, stride, pads, dilation, group):
    x = F.pad(x_nhwc.permute(0, 3, 1, 2), pads)
    y = F.conv2d(x, w_ohwi.permute(0, 3, 1, 2), bias, stride=stride, dilation=dilation, groups=group)
    return y.permute(0, 2, 3, 1)


def _nhwc(y_nchw: torch.Tensor) -> torch.Tensor:
    return y_nchw.permute(0, 2, 3, 1)


# ------------------------------------------------------------------------------------------------ Convolution
CONV_CASES = [
    # cin, cout, kernel, stride, pads (l, r, t, b), dilation, group
    (3, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    (4, 6, (3, 3), (2, 2), (0, 1, 1, 0), (1, 1), 1),
    (4, 4, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1),
    (4, 6, (3, 3), (2, 1), (1, 2, 0, 1), (1, 2), 2),
    (6, 9, (1, 5), (1, 2), (2, 2, 0, 0), (1, 1), 3),
    (3, 5, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("cin,cout,k,stride,pads,dilation,group", CONV_CASES)
def test_convolution_matches_torch(cin, cout, k, stride, pads, dilation, group):
    torch.manual_seed(0)
    x = torch.randn(3, 9, 11, cin)
    w = torch.randn(cout, k[0], k[1], cin // group)
    bias = torch.randn(cout)
    ref = ref_conv(x, w, bias, stride, pads, dilation, group)
    y = run_layer("Convolution", [x], ref.shape, conv_params(k, stride, pads, dilation, group, cout),
                  {"weights": w, "biases": bias}, ir_batch=1)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_convolution_symmetric_padding_equals_torch_padding():
    torch.manual_seed(1)
    x = torch.randn(2, 8, 8, 3)
    w = torch.randn(4, 3, 3, 3)
    ref = _nhwc(F.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), None, stride=2, padding=1))
    y = run_layer("Convolution", [x], ref.shape, conv_params((3, 3), (2, 2), (1, 1, 1, 1)), {"weights": w})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_convolution_without_bias_is_zero_bias():
    torch.manual_seed(2)
    x = torch.randn(2, 6, 6, 4)
    w = torch.randn(5, 3, 3, 4)
    ref = ref_conv(x, w, None, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    y = run_layer("Convolution", [x], ref.shape, conv_params((3, 3), pads=(1, 1, 1, 1)), {"weights": w})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def _activation_case(act: str, channels: int):
    """(extra params, extra constants, reference function on NCHW) for one fused activation."""
    slope = torch.linspace(0.05, 0.5, channels)
    cases = {
        "NONE": ({}, {}, lambda t: t),
        "RELU": ({}, {}, F.relu),
        "RELU6": ({}, {}, F.relu6),
        "CLIP": ({"clip_min": -0.5, "clip_max": 0.75}, {}, lambda t: t.clamp(-0.5, 0.75)),
        "LEAKYRELU": ({"negative_slope": 0.2}, {}, lambda t: F.leaky_relu(t, 0.2)),
        "PRELU": ({}, {"negative_slope": slope}, lambda t: F.prelu(t, slope)),
    }
    return cases[act]


ACTIVATIONS = ["NONE", "RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU"]


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_convolution_fused_activation(act):
    torch.manual_seed(3)
    x = torch.randn(2, 7, 7, 3) * 3
    w = torch.randn(6, 3, 3, 3)
    bias = torch.randn(6)
    params, consts, fn = _activation_case(act, 6)
    ref = _nhwc(fn(F.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), bias, padding=1)))
    y = run_layer("Convolution", [x], ref.shape, {**conv_params((3, 3), pads=(1, 1, 1, 1), act=act), **params},
                  {"weights": w, "biases": bias, **consts})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ DepthwiseConv
@pytest.mark.parametrize("multiplier,stride,pads,dilation", [
    (1, (2, 1), (1, 1, 1, 1), (1, 1)),
    (2, (1, 1), (0, 2, 1, 0), (1, 1)),
    (1, (2, 2), (2, 2, 2, 2), (2, 2)),
])
def test_depthwise_conv_matches_torch(multiplier, stride, pads, dilation):
    torch.manual_seed(4)
    c = 5
    x = torch.randn(3, 10, 9, c)
    w = torch.randn(c * multiplier, 3, 3, 1)
    bias = torch.randn(c * multiplier)
    ref = ref_conv(x, w, bias, stride, pads, dilation, c)
    params = {**conv_params((3, 3), stride, pads, dilation, c, c * multiplier, act="RELU"), "multiplier": multiplier}
    y = run_layer("DepthwiseConv", [x], ref.shape, params, {"weights": w, "biases": bias}, ir_batch=1)
    torch.testing.assert_close(y, F.relu(ref), atol=ATOL, rtol=1e-5)


def test_depthwise_conv_group_defaults_to_input_channels():
    torch.manual_seed(5)
    x = torch.randn(1, 6, 6, 4)
    w = torch.randn(4, 3, 3, 1)
    ref = ref_conv(x, w, None, (1, 1), (1, 1, 1, 1), (1, 1), 4)
    params = conv_params((3, 3), pads=(1, 1, 1, 1))
    del params["group"]
    y = run_layer("DepthwiseConv", [x], ref.shape, params, {"weights": w})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("optype,w_shape,params,match", [
    ("Convolution", (6, 3, 3, 4), {"group": 3}, "group=3"),
    ("Convolution", (6, 3, 3, 4), {"kernel_x": 5}, "kernel_x=5"),
    ("Convolution", (6, 3, 3, 4), {"num_output": 7}, "num_output=7"),
    ("Convolution", (6, 3, 3, 4), {"stride_x": 0}, "stride_x"),
    ("Convolution", (6, 3, 3, 4), {"pad_left": -1}, "pad_left"),
    ("Convolution", (6, 3, 3, 4), {"with_activation": "GELU"}, "GELU"),
    ("Convolution", (6, 3, 3, 4), {"group": 1.5}, "group"),
    ("DepthwiseConv", (8, 3, 3, 2), {"group": 2}, "DepthwiseConv weights"),
    ("DepthwiseConv", (8, 3, 3, 1), {"group": 4, "multiplier": 3}, "multiplier=3"),
])
def test_convolution_rejects_bad_params(optype, w_shape, params, match):
    x = torch.randn(1, 6, 6, 4)
    base = conv_params((3, 3), pads=(1, 1, 1, 1))
    with pytest.raises(IRError, match=match):
        run_layer(optype, [x], (1, 6, 6, w_shape[0]), {**base, **params}, {"weights": torch.randn(*w_shape)})


def test_convolution_error_names_layer_and_rejects_non_nhwc():
    with pytest.raises(IRError, match="layer 'layer'.*4-D NHWC"):
        run_layer("Convolution", [torch.randn(1, 6, 4)], (1, 6, 4), conv_params((1, 1)),
                  {"weights": torch.randn(4, 1, 1, 4)})


# ------------------------------------------------------------------------------------------------ FullyConnected
@pytest.mark.parametrize("in_shape", [(5, 12), (3, 4, 12), (2, 1, 1, 12)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fully_connected_matches_linear(in_shape, with_bias):
    torch.manual_seed(6)
    x = torch.randn(*in_shape)
    w = torch.randn(7, 12)
    bias = torch.randn(7) if with_bias else None
    ref = F.linear(x, w, bias)
    consts = {"weights": w, **({"biases": bias} if with_bias else {})}
    y = run_layer("FullyConnected", [x], ref.shape, {"num_output": 7, "with_activation": "NONE"}, consts,
                  ir_batch=1)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_fully_connected_fused_activation(act):
    torch.manual_seed(7)
    x = torch.randn(4, 10) * 2
    w = torch.randn(6, 10)
    bias = torch.randn(6)
    params, consts, fn = _activation_case(act, 6)
    ref = fn(F.linear(x, w, bias))
    y = run_layer("FullyConnected", [x], ref.shape, {"num_output": 6, "with_activation": act, **params},
                  {"weights": w, "biases": bias, **consts})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("params,w_shape,match", [
    ({"num_output": 5}, (6, 10), "num_output=5"),
    ({}, (6, 9), "input features"),
    ({}, (6, 10, 1), "2-D"),
])
def test_fully_connected_rejects_bad_params(params, w_shape, match):
    with pytest.raises(IRError, match=match):
        run_layer("FullyConnected", [torch.randn(2, 10)], (2, 6), params, {"weights": torch.randn(*w_shape)})


# ------------------------------------------------------------------------------------------------ MatMul
@pytest.mark.parametrize("a_shape,b_shape,trans_a,trans_b", [
    ((3, 4, 5), (3, 5, 6), False, False),
    ((3, 5, 4), (3, 5, 6), True, False),
    ((3, 4, 5), (3, 6, 5), False, True),
    ((2, 1, 4, 5), (3, 6, 4), True, True),
    ((2, 4, 5), (5, 6), False, False),
])
def test_matmul_matches_torch(a_shape, b_shape, trans_a, trans_b):
    torch.manual_seed(8)
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    ref = torch.matmul(a.transpose(-1, -2) if trans_a else a, b.transpose(-1, -2) if trans_b else b)
    y = run_layer("MatMul", [a, b], ref.shape, {"trans_a": trans_a, "trans_b": trans_b})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_matmul_defaults_and_fused_activation():
    torch.manual_seed(9)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    ref = F.relu6(torch.matmul(a, b) * 2)
    y = run_layer("MatMul", [a * 2, b], ref.shape, {"with_activation": "RELU6"})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("a_shape,b_shape,params,match", [
    ((3, 4), (5, 6), {}, "cannot be multiplied"),
    ((4,), (4, 6), {"trans_a": True}, "trans_a=true"),
    ((3, 4), (4, 6), {"trans_b": "maybe"}, "trans_b"),
])
def test_matmul_rejects_bad_operands(a_shape, b_shape, params, match):
    with pytest.raises(IRError, match=match):
        run_layer("MatMul", [torch.randn(*a_shape), torch.randn(*b_shape)], (3, 6), params)


# ------------------------------------------------------------------------------------------------ shared IRs
_GEOMETRY_KEYS = {"kernel_x", "kernel_y", "stride_x", "stride_y", "pad_left", "pad_right", "pad_top", "pad_bottom",
                  "dilation_x", "dilation_y", "group", "with_activation", "method", "ceil_mode", "count_include_pad"}


def _run_model_layers(model: str, types: List[str]) -> int:
    """Run each distinct layer configuration of `types` in a shared Parser IR alone, on a batch of 2, against a
    torch reference (one layer per kernel/stride/pad/dilation/group/activation signature keeps it fast)."""
    from conftest import shared_model_dir

    from quantopt.ir.reader import read_ir

    folder = shared_model_dir(model)
    graph = read_ir(str(folder / f"{model}.txt"), str(folder / f"{model}.bin"))
    checked = 0
    seen = set()
    torch.manual_seed(10)
    for node in graph.nodes:
        signature = (str(node.type), tuple((k, str(v)) for k, v in node.params.items() if k in _GEOMETRY_KEYS))
        if str(node.type) not in types or signature in seen:
            continue
        seen.add(signature)
        x = torch.randn(2, *node.inputs[0].ir_shape[1:])
        node.inputs[0].betensor = x
        y = node.forward()[0]
        assert tuple(y.shape) == (2, *node.outputs[0].ir_shape[1:]), node.name
        w = node.constants["weights"].betensor
        bias = node.constants["biases"].betensor if "biases" in node.constants else None
        if str(node.type) == "FullyConnected":
            ref = F.linear(x, w, bias)
        else:
            p = node.params
            ref = ref_conv(x, w, bias, (p["stride_y"], p["stride_x"]),
                           (p["pad_left"], p["pad_right"], p["pad_top"], p["pad_bottom"]),
                           (p["dilation_y"], p["dilation_x"]), p["group"])
        act = str(node.params.get("with_activation", "NONE")).upper()
        ref = {"NONE": ref, "RELU": F.relu(ref), "RELU6": F.relu6(ref)}[act]
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        checked += 1
    return checked


@pytest.mark.parametrize("model", ["ppocr_cls", "syn_mobilenet", "mtcnn_onet"])
def test_shared_ir_conv_and_fc_layers(model):
    assert _run_model_layers(model, ["Convolution", "DepthwiseConv", "FullyConnected"]) > 0
