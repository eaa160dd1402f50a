"""The faster exact integer paths (in-place requantization, rounding by addition of 1.5 * 2^52, float64 Concat,
AVG pooling and ConvTranspose, in-place Eltwise MUL/ADD) give the bits of the general paths on random data with
edge values (ties, range ends, large accumulators), and the memoized plans follow what they depend on."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant

from quantopt.graph.builder import GraphBuilder
from quantopt.ops import concat as concat_mod
from quantopt.ops import mac_extra, pooling
from quantopt.ops._quant import int_value, mac_finish, tensor_zp
from quantopt.ops.conv import conv2d_nhwc_int
from quantopt.pipeline import quantize_model
from quantopt.quant.requant import (
    exact_int64,
    exact_int64_,
    int64_to_float64,
    requantize_float64,
    requantize_float64_,
    requantize_int,
    requantize_scaled_,
)
from quantopt.quant.rounding import MAGIC_EXACT, int_to_float64

SHAPE = [1, 4, 5, 6]


def _edge_accumulators(rng: np.random.Generator, limit: int, n: int = 4000) -> torch.Tensor:
    """Random integers of |.| < limit with the ends, 0, ±1 and many odd values (ties after a shift of 1)."""
    values = np.concatenate([rng.integers(-limit + 1, limit, n), 2 * rng.integers(-1000, 1000, n) + 1,
                             [0, 1, -1, limit - 1, -(limit - 1), limit // 2, -(limit // 2)]])
    return torch.from_numpy(values.astype(np.float64))


@pytest.mark.parametrize("mult,shift,zp,qmin,qmax", [
    (1, 1, 0, -128, 127), (1, 3, 0, -128, 127), (12345, 20, -7, -128, 127), (32767, 30, 128, 0, 255),
    (3, 3, 5, -32768, 32767), (255, 8, -3, -(2 ** 31), 2 ** 31 - 1), (1, 0, 0, -128, 127), (7, -2, 1, -128, 127)])
def test_scaled_and_in_place_requantization_equal_requantize_float64(mult, shift, zp, qmin, qmax) -> None:
    rng = np.random.default_rng(shift + 40)
    acc = _edge_accumulators(rng, min(2 ** 53 // max(mult, 1), 2 ** 40))
    expected = requantize_float64(acc, mult, shift, zp, qmin, qmax)
    assert torch.equal(requantize_float64_(acc.clone(), mult, shift, zp, qmin, qmax), expected)
    assert torch.equal(requantize_int(acc.to(torch.int64), mult, shift, zp, qmin, qmax), expected)
    if shift >= 3:
        factor = torch.tensor(float(mult), dtype=torch.float64) * torch.pow(2.0, -torch.tensor(float(shift),
                                                                                              dtype=torch.float64))
        assert torch.equal(requantize_scaled_(acc.clone(), factor, zp, qmin, qmax), expected)


def test_per_channel_in_place_requantization_and_ties() -> None:
    acc = torch.arange(-40, 40, dtype=torch.float64).reshape(-1, 4)  # odd values: ties after shift 1 and 2
    m, s = torch.tensor([1, 3, 5, 7]), torch.tensor([1, 2, 3, 4])
    expected = requantize_float64(acc, m, s, 2, -8, 7)
    assert torch.equal(requantize_float64_(acc.clone(), m, s, 2, -8, 7), expected)
    ties = torch.tensor([-5.0, -3.0, -1.0, 1.0, 3.0, 5.0, 7.0], dtype=torch.float64) * 4  # x.5 after a shift of 3
    expected = requantize_float64(ties, 1, 3, 0, -100, 100)
    assert expected.tolist() == [-2, -2, 0, 0, 2, 2, 4]  # half to even
    factor = torch.tensor(0.125, dtype=torch.float64)
    assert torch.equal(requantize_scaled_(ties.clone(), factor, 0, -100, 100), expected)
    # a factor that does not broadcast into acc: the general function (a new tensor)
    small = torch.arange(4, dtype=torch.float64)
    wide = torch.tensor([[1], [2]])
    assert torch.equal(requantize_float64_(small.clone(), wide, 3, 0, -8, 7), requantize_float64(small, wide, 3, 0,
                                                                                                  -8, 7))


def test_conversions_equal_the_general_ones_at_their_limits() -> None:
    x = torch.tensor([0, 1, -1, MAGIC_EXACT - 1, -(MAGIC_EXACT - 1), 123456789, -987654321], dtype=torch.int64)
    assert torch.equal(int64_to_float64(x), int_to_float64(x)) and torch.equal(int64_to_float64(x), x.double())
    y = x.double()
    assert torch.equal(exact_int64_(y.clone(), -(MAGIC_EXACT - 1), MAGIC_EXACT - 1), x)
    big = torch.tensor([2.0 ** 52, -(2.0 ** 52)], dtype=torch.float64)  # beyond the fast range: plain conversion
    assert torch.equal(exact_int64_(big.clone(), -(2 ** 52), 2 ** 52), exact_int64(big, -(2 ** 52), 2 ** 52))
    strided = y.reshape(1, -1).t()  # any strides
    assert torch.equal(exact_int64_(strided.clone().t().t(), -(MAGIC_EXACT - 1), MAGIC_EXACT - 1), x.reshape(-1, 1))


@pytest.mark.parametrize("size", [7, 5000])
@pytest.mark.parametrize("plus", [0, 5, -128, 127.0, 2 ** 50, -(2 ** 50), 0.5, MAGIC_EXACT])
def test_conversion_with_an_added_zero_point(size: int, plus) -> None:
    """int64_to_float64(x, plus) is x + plus in float64 on both paths (the large one folds an integer `plus` into its
    magic constant), at the ends of the exact range; a fractional or huge `plus` is added after the conversion."""
    rng = np.random.default_rng(size)
    edges = [0, 1, -1, MAGIC_EXACT - 1, -(MAGIC_EXACT - 1), 2 ** 50, -(2 ** 50)]
    x = torch.from_numpy(np.concatenate([edges, rng.integers(-(2 ** 40), 2 ** 40, size - len(edges))]))
    want = x.double() + plus if abs(plus) < MAGIC_EXACT else x.double().add_(plus)
    got = int64_to_float64(x, plus)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def _graph(optype: str, params: dict, consts: dict, shapes, out_shape, seed: int = 0, scales=None):
    b = GraphBuilder("t")
    xs = [b.input(f"x{i}", list(s)) for i, s in enumerate(shapes)]
    y = b.layer(optype, xs, [list(out_shape)], name="op", params=dict(params), constants=dict(consts))
    g = b.build([y])
    r = np.random.default_rng(seed)
    scales = scales or [1.0] * len(shapes)
    data = [[torch.from_numpy(r.normal(0.0, sc, size=s).astype(np.float32)) for s, sc in zip(shapes, scales)]
            for _ in range(2)]
    q = quantize_model(g, data)
    q.forward(data[0], keep_tensors=True)
    return q, q.node("op")


def test_conv_owned_finish_equals_mac_finish_and_follows_shift_and_zero_point() -> None:
    w = np.random.default_rng(1).normal(0, 0.3, size=(5, 3, 3, 6)).astype(np.float32)
    params = {"num_output": 5, "kernel_x": 3, "kernel_y": 3, "stride_x": 1, "stride_y": 1, "pad_left": 1,
              "pad_right": 1, "pad_top": 1, "pad_bottom": 1, "group": 1}
    q, node = _graph("Convolution", params, {"weights": w, "biases": np.linspace(-1, 1, 5).astype(np.float32)},
                     [SHAPE], [1, 4, 5, 5])
    scaled = node.attrs["_memo_mac_finish"][1].scaled
    for change in (lambda: None, lambda: node.params.__setitem__("shift_value", 2),  # below 3: the rounding path
                   lambda: node.params.__setitem__("shift_value", 9),
                   lambda: set_quant(node, node.outputs[0], zerop=torch.tensor(-3)),
                   lambda: node.constants["biases"].betensor.add_(2 ** 41)):  # |(acc + b) M| >= 2^53: mac_finish
        change()
        node.forward()
        acc = conv2d_nhwc_int(node, depthwise=False)
        expected = mac_finish(node, acc.clone(), planned=False)
        assert torch.equal(node.outputs[0].betensor, expected)
        assert torch.equal(mac_finish(node, acc.clone(), owned=True), expected)
        assert torch.equal(mac_finish(node, acc), expected)
    assert scaled is True
    node.params["shift_value"] = 2
    node.forward()
    assert node.attrs["_memo_mac_finish"][1].scaled is False  # rebuilt for the new shift


def test_batchnorm_equals_mac_finish() -> None:
    c = SHAPE[-1]
    r = np.random.default_rng(3)
    consts = {"weights": r.normal(1.0, 0.5, size=c).astype(np.float32),
              "biases": r.normal(0.0, 0.5, size=c).astype(np.float32)}
    q, node = _graph("BatchNorm", {"axis": -1}, consts, [SHAPE], SHAPE)
    x = int_value(node.inputs[0]).double()
    w = (node.constants["weights"].betensor.to(torch.int64) + int(node.params.get("weights_zp", 0))).double()
    assert torch.equal(node.outputs[0].betensor, mac_finish(node, x * w, planned=False))


@pytest.mark.parametrize("optype,params", [("Mul", {}), ("Eltwise", {"method": "MUL"}),
                                            ("Eltwise", {"method": "ADD"}), ("Eltwise", {"method": "SUB"})])
@pytest.mark.parametrize("shapes", [[SHAPE, SHAPE], [SHAPE, [1, 1, 1, 6]], [[1, 1, 1, 6], SHAPE]])
def test_eltwise_in_place_equals_int64_reference(optype, params, shapes) -> None:
    q, node = _graph(optype, params, {}, shapes, SHAPE, seed=5, scales=[1.0, 3.0])
    a, b = (int_value(t) + tensor_zp(node, t) for t in node.inputs)
    method = params.get("method", "MUL")
    out = node.outputs[0]
    qmin, qmax = int(params_of(node, out).qmin), int(params_of(node, out).qmax)
    if method == "MUL":
        m, s = int(node.params["scale_value"]), int(node.params["shift_value"])
        acc = a * b
    else:
        m, m0, m1 = (int(v) for v in node.params["scale_value"])
        s = int(node.params["shift_value"])
        acc = a * m0 + b * m1 if method == "ADD" else a * m0 - b * m1
    expected = requantize_int(acc, m, s, tensor_zp(node, out), qmin, qmax)
    assert torch.equal(node.outputs[0].betensor, expected)
    assert node.inputs[0].betensor.dtype == torch.int64  # the inputs were not written into


def test_concat_float64_path_equals_general_path(monkeypatch) -> None:
    q, node = _graph("Concat", {"axis": 3}, {}, [SHAPE, [1, 4, 5, 3]], [1, 4, 5, 9], seed=7, scales=[1.0, 5.0])
    assert "scale_value" in node.params
    fast = node.outputs[0].betensor.clone()
    monkeypatch.setattr(concat_mod, "_concat_float64", lambda *a: None)
    node.forward()
    assert torch.equal(node.outputs[0].betensor, fast)


@pytest.mark.parametrize("k,st,pads,d,include", [((2, 2), (2, 2), (0, 0, 0, 0), (1, 1), None),
                                                    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False),
                                                    ((3, 2), (1, 1), (1, 0, 2, 1), (1, 1), True),
                                                    ((2, 2), (1, 1), (0, 0, 0, 0), (2, 2), None)])
def test_avg_pool_float64_path_equals_general_path(monkeypatch, k, st, pads, d, include) -> None:
    shape = [1, 9, 10, 5]
    oh = (shape[1] + pads[2] + pads[3] - d[0] * (k[0] - 1) - 1) // st[0] + 1
    ow = (shape[2] + pads[0] + pads[1] - d[1] * (k[1] - 1) - 1) // st[1] + 1
    p = {"method": "AVG", "kernel_y": k[0], "kernel_x": k[1], "stride_y": st[0], "stride_x": st[1],
         "pad_left": pads[0], "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3],
         "dilation_y": d[0], "dilation_x": d[1]}
    if include is not None:
        p["count_include_pad"] = include
    calls = []
    real = pooling._avg_int_float64
    monkeypatch.setattr(pooling, "_avg_int_float64", lambda *a: calls.append(1) or real(*a))
    q, node = _graph("Pooling", p, {}, [shape], [1, oh, ow, 5], seed=11, scales=[3.0])
    fast = node.outputs[0].betensor.clone()
    assert calls and calls[-1] == 1
    monkeypatch.setattr(pooling, "_avg_int_float64", lambda *a: None)
    node.forward()
    assert torch.equal(node.outputs[0].betensor, fast)
    x = node.inputs[0]
    set_quant(node, x, zerop=torch.tensor(int(params_of(node, x).zerop) + 3))  # another zero point: same again
    node.forward()
    general = node.outputs[0].betensor.clone()
    monkeypatch.setattr(pooling, "_avg_int_float64", real)
    node.forward()
    assert torch.equal(node.outputs[0].betensor, general)


@pytest.mark.parametrize("act,stride", [("NONE", (2, 2)), ("RELU", (2, 3))])
def test_convtranspose_float_path_equals_general_path(monkeypatch, act, stride) -> None:
    r = np.random.default_rng(13)
    cin, cout, k = 4, 6, (3, 2)
    w_ir = np.transpose(r.normal(0, 0.4, size=(cin, cout) + k).astype(np.float32), (1, 2, 3, 0))
    params = dict(num_output=cout, group=1, with_activation=act, kernel_y=k[0], kernel_x=k[1], stride_y=stride[0],
                  stride_x=stride[1], dilation_y=1, dilation_x=1, pad_top=0, pad_bottom=0, pad_left=0, pad_right=0,
                  output_padding_y=0, output_padding_x=0)
    spatial = (4, 3)
    out = [(n - 1) * s + kk for n, s, kk in zip(spatial, stride, k)]
    consts = {"weights": w_ir, "biases": r.normal(0, 0.3, size=cout).astype(np.float32)}
    q, node = _graph("ConvTranspose", params, consts, [[1, *spatial, cin]], [1, *out, cout], seed=13, scales=[2.0])
    fast = node.outputs[0].betensor.clone()
    assert mac_extra._convt_int_float(node, int_value(node.inputs[0]) + tensor_zp(node, node.inputs[0]),
                                      *_convt_args(node)) is not None
    monkeypatch.setattr(mac_extra, "_convt_int_float", lambda *a: None)
    node.forward()
    assert torch.equal(node.outputs[0].betensor, fast)


def _convt_args(node):
    """(wt, sums, group, geo, x_absmax, w_sum) as `_convt_int` derives them."""
    x, zp = mac_extra.mac_input(node)
    group, geo = mac_extra._convt_setup(node, x, node.get_constant("weights").betensor.shape)
    wt, sums, w_sum = node.attrs["_convt_int_weights"][2]
    return wt, sums, group, geo, mac_extra._input_absmax(node, node.inputs[0], zp), w_sum
