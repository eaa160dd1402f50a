"""Memos of the float forward (float64 convolution constants, depthwise taps, PReLU slopes, pooling divisors) and the
faster integer Input, Eltwise and Softmax paths: the same bits as a fresh computation, before and after in-place
writes to constants, new constant tensors and param changes (graph/memo.py)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.node import PyNode
from quantopt.graph.tensor import PyTensor
from quantopt.ops import _conv_nhwc
from quantopt.ops.io import _quantize_per_tensor
from quantopt.pipeline import quantize_model
from quantopt.quant.params import quantize

SHAPE = [1, 6, 7, 4]


def _graph(optype: str, params: dict, consts: dict, out_shape: list, shape: Optional[list] = None):
    b = GraphBuilder("t")
    x = b.input("x", list(shape or SHAPE))
    y = b.layer(optype, [x], [list(out_shape)], name="op", params=dict(params), constants=dict(consts))
    g = b.build([y])
    r = np.random.default_rng(0)
    data = [torch.from_numpy(r.normal(0.0, 1.0, size=shape or SHAPE).astype(np.float32)) for _ in range(2)]
    return g, data


def _fresh(node: PyNode) -> PyNode:
    """The layer run again without any memo (private attrs are not copied), in a graph of its own so that it keeps
    its wide value as the original does."""
    m = node.detached_copy()
    m.quantized = node.quantized
    PyGraph(node.graph.name).add_node(m)
    m.forward()
    return m


def _wide(node: PyNode) -> Optional[torch.Tensor]:
    return node.graph.wide_values.get(node.outputs[0])


def _same_as_fresh(node: PyNode) -> None:
    node.forward()
    m = _fresh(node)
    out, ref = node.outputs[0], m.outputs[0]
    assert out.betensor.dtype == ref.betensor.dtype and torch.equal(out.betensor, ref.betensor)
    assert (_wide(node) is None) == (_wide(m) is None)
    if _wide(node) is not None:
        assert torch.equal(_wide(node), _wide(m))


def _conv(depthwise: bool, act: str = "NONE"):
    r = np.random.default_rng(3)
    out_c = 8 if depthwise else 5
    w = r.normal(0, 0.5, size=(out_c, 3, 3, 1 if depthwise else 4)).astype(np.float32)
    params = {"num_output": out_c, "kernel_x": 3, "kernel_y": 3, "stride_x": 1, "stride_y": 2, "pad_left": 1,
              "pad_right": 0, "pad_top": 1, "pad_bottom": 1, "group": 4 if depthwise else 1,
              "with_activation": act}
    if depthwise:
        params["multiplier"] = 2
    consts = {"weights": w, "biases": r.normal(0, 1, size=out_c).astype(np.float32)}
    return _graph("DepthwiseConv" if depthwise else "Convolution", params, consts, [1, 3, 6, out_c])


@pytest.mark.parametrize("depthwise", [False, True])
def test_conv_float_constants_follow_writes_and_new_tensors(depthwise: bool) -> None:
    g, data = _conv(depthwise)
    g.forward(data[0], keep_tensors=True)
    node = g.node("op")
    assert "_memo_conv_float_constants" in node.attrs
    first = _wide(node).clone()
    _same_as_fresh(node)
    node.constants["weights"].betensor[0, 1, 1, 0] += 1.0  # in place: the float64 copy must be rebuilt
    _same_as_fresh(node)
    assert not torch.equal(_wide(node), first)
    node.constants["biases"].betensor = node.constants["biases"].betensor * 2  # a new tensor
    _same_as_fresh(node)
    node.params["pad_left"], node.params["pad_right"] = 0, 1  # geometry
    _same_as_fresh(node)
    # the float64 sum itself: torch's float64 convolution of the same operands (exact products, same bits here)
    node.params["pad_left"], node.params["pad_right"] = 1, 0
    node.forward()
    x = node.inputs[0].betensor.permute(0, 3, 1, 2).to(torch.float64)
    w = node.constants["weights"].betensor.permute(0, 3, 1, 2).to(torch.float64)
    b = node.constants["biases"].betensor.to(torch.float64)
    ref = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 0, 1, 1)), w, b, stride=(2, 1),
                                     groups=4 if depthwise else 1).permute(0, 2, 3, 1)
    assert torch.allclose(_wide(node), ref, rtol=1e-12, atol=1e-12)


def test_conv_float_constants_are_not_kept_for_gradients() -> None:
    g, data = _conv(False)
    g.forward(data[0], keep_tensors=True)
    node = g.node("op")
    node.attrs.pop("_memo_conv_float_constants")
    w = node.constants["weights"]
    w.betensor = w.betensor.clone().requires_grad_(True)
    for _ in range(2):  # a kept conversion would make the second backward fail
        node.forward()
        _wide(node).sum().backward()
    assert "_memo_conv_float_constants" not in node.attrs and w.betensor.grad is not None


def test_depthwise_taps_given_or_not_give_the_same_bits() -> None:
    r = np.random.default_rng(5)
    x = torch.from_numpy(r.normal(size=(1, 5, 6, 3))).to(torch.float64)
    w = torch.from_numpy(r.normal(size=(6, 3, 2, 1))).to(torch.float64)
    args = (x, w, None, (1, 2), (2, 1), (1, 0, 2, 1), 3)
    assert torch.equal(_conv_nhwc.conv2d_nhwc(*args), _conv_nhwc.conv2d_nhwc(*args, taps=_conv_nhwc.depthwise_taps(w)))
    # taps of another dtype are not used
    f32 = [[t.to(torch.float32) for t in row] for row in _conv_nhwc.depthwise_taps(w)]
    assert torch.equal(_conv_nhwc.conv2d_nhwc(*args), _conv_nhwc.conv2d_nhwc(*args, taps=f32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_pad_small_and_large_paths_agree(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    x = (torch.arange(2 * 5 * 4 * 3) - 50).reshape(2, 5, 4, 3).to(dtype)
    for pads in [(1, 2, 0, 3), (0, 0, 1, 0), (2, 0, 0, 0)]:
        monkeypatch.setattr(_conv_nhwc, "SMALL_PAD_ELEMENTS", 1 << 30)
        small = _conv_nhwc.pad_nhwc(x, pads, -7.0, torch.float64)
        monkeypatch.setattr(_conv_nhwc, "SMALL_PAD_ELEMENTS", 0)
        large = _conv_nhwc.pad_nhwc(x, pads, -7.0, torch.float64)
        assert small.is_contiguous() and torch.equal(small, large)


def test_prelu_slope_follows_its_constant() -> None:
    slope = np.linspace(-0.5, 0.5, 4).astype(np.float32)
    g, data = _graph("Activation", {"method": "PRELU"}, {"negative_slope": slope}, SHAPE)
    g.forward(data[0], keep_tensors=True)
    node = g.node("op")
    _same_as_fresh(node)
    assert "_memo_prelu_slope" in node.attrs
    node.constants["negative_slope"].betensor.mul_(3.0)
    _same_as_fresh(node)
    x = node.inputs[0].betensor
    assert torch.equal(node.outputs[0].betensor, torch.where(x >= 0, x, x * node.constants["negative_slope"].betensor))
    node.constants["negative_slope"].betensor = torch.zeros(1, 5, 4)  # does not broadcast: still the error
    with pytest.raises(Exception, match="does not broadcast"):
        node.forward()


@pytest.mark.parametrize("method", ["AVG", "MAX"])
def test_pool_divisors_follow_params_and_shapes(method: str) -> None:
    params = {"method": method, "kernel_x": 3, "kernel_y": 3, "stride_x": 2, "stride_y": 2, "pad_left": 1,
              "pad_right": 1, "pad_top": 1, "pad_bottom": 0, "count_include_pad": False}
    g, data = _graph("Pooling", params, {}, [1, 3, 4, 4])
    g.forward(data[0], keep_tensors=True)
    node = g.node("op")
    _same_as_fresh(node)
    for change in ({"count_include_pad": True}, {"pad_bottom": 1}, {"count_include_pad": False}):
        node.params.update(change)
        _same_as_fresh(node)
    node.inputs[0].betensor = torch.randn(2, 6, 7, 4)  # a batch of 2
    _same_as_fresh(node)
    node.params["pad_left"] = 3  # a window covering only padding: refused on every forward
    for _ in range(2):
        with pytest.raises(Exception, match="only padding"):
            node.forward()


def test_integer_input_matches_quantize() -> None:
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 50, size=(1, 8, 8, 3)).astype(np.float32))
    x[0, 0, 0, :] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[0, 1, 0, 0] = 2.5 / 0.75  # a tie after scaling
    node = PyNode("in", "Input")  # a layer on its own: its own parameter table
    node.outputs = [PyTensor("x")]
    for scale, zp, lo, hi in [(0.75, -3, -128, 127), (torch.tensor(1.3), torch.tensor(7), 0, 255), (40.0, 0, -10, 10)]:
        set_quant(node, node.outputs[0], scale=scale, zerop=zp)
        assert torch.equal(_quantize_per_tensor(node, x, lo, hi), quantize(x, scale, zp, lo, hi))


def _quantized_graph(optype: str, params: dict, consts: dict, inputs: int = 1):
    b = GraphBuilder("t")
    xs = [b.input(f"x{i}", SHAPE) for i in range(inputs)]
    y = b.layer(optype, xs, [SHAPE], name="op", params=dict(params), constants=dict(consts))
    g = b.build([y])
    r = np.random.default_rng(1)
    data = [[torch.from_numpy(r.normal(0.0, 1.0 + i, size=SHAPE).astype(np.float32)) for i in range(inputs)]
            for _ in range(2)]
    return quantize_model(g, data), data


@pytest.mark.parametrize("method", ["ADD", "SUB"])
def test_integer_eltwise_add_sub_match_the_plain_formula(method: str) -> None:
    q, data = _quantized_graph("Eltwise", {"method": method}, {}, inputs=2)
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    a_t, b_t = node.inputs
    m_out, m0, m1 = (int(v) for v in node.params["scale_value"])
    shift = int(node.params["shift_value"])
    a = a_t.betensor.to(torch.int64) + int(params_of(node, a_t).zerop)
    b = b_t.betensor.to(torch.int64) + int(params_of(node, b_t).zerop)
    acc = a * m0 + b * m1 if method == "ADD" else a * m0 - b * m1
    out = params_of(node, node.outputs[0])
    y = torch.round(acc.to(torch.float64) * m_out / 2.0 ** shift) - int(out.zerop)
    ref = torch.clamp(y, int(out.qmin), int(out.qmax)).to(torch.int64)
    assert torch.equal(node.outputs[0].betensor, ref)


def test_softmax_lut_follows_its_table() -> None:
    q, data = _quantized_graph("Softmax", {"axis": -1}, {})
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    first = node.outputs[0].betensor.clone()
    assert "_memo_softmax_lut" in node.attrs
    _same_as_fresh(node)
    lut = node.constants["lut"].betensor
    lut.copy_(lut // 3)  # in place: a smaller maximum changes the division's scaling
    _same_as_fresh(node)
    assert not torch.equal(node.outputs[0].betensor, first)
