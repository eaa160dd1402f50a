"""Per-layer forward memos (graph/memo.py): rebuilt whenever what they were built from changes, and the memoized
integer forwards (activation tables, convolution requantization, pooling plans) give the bits of the general path."""
from __future__ import annotations

import numpy as np
import torch
from quant_helpers import params_of

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.memo import Same, layer_key, memo
from quantopt.graph.node import PyNode
from quantopt.ops._quant import mac_finish
from quantopt.ops.activation import _integer_forward, activation_integer_forward, activation_method
from quantopt.ops.conv import conv2d_nhwc_int
from quantopt.pipeline import quantize_model

SHAPE = [1, 4, 5, 6]


def _quantized(optype: str, params: dict, consts: dict, shape=SHAPE, conv_out=None):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    out_shape = list(conv_out or shape)
    y = b.layer(optype, [x], [out_shape], name="op", params=dict(params), constants=dict(consts))
    g = b.build([y])
    r = np.random.default_rng(0)
    data = [torch.from_numpy(r.normal(0.0, 1.0, size=shape).astype(np.float32)) for _ in range(2)]
    return quantize_model(g, data), data


def _general(node: PyNode) -> torch.Tensor:
    x = node.inputs[0].betensor.to(torch.int64)
    return _integer_forward(node, activation_method(node), x, int(round(float(params_of(node, node.inputs[0]).zerop))))


def test_same_and_memo_follow_identity_version_and_key() -> None:
    t = torch.zeros(3)
    assert Same(t) == Same(t) and Same(t) != Same(torch.zeros(3))
    key = Same(t)
    t.add_(1.0)  # an in-place write bumps the version
    assert key != Same(t)
    node = PyNode("n", "Activation")
    calls = []
    assert memo(node, "m", (1, Same(t)), lambda: calls.append(1) or "a") == "a"
    assert memo(node, "m", (1, Same(t)), lambda: calls.append(1) or "b") == "a"
    t.mul_(2.0)
    assert memo(node, "m", (1, Same(t)), lambda: calls.append(1) or "c") == "c"
    assert len(calls) == 2
    node.params["method"] = "RELU"
    k1 = layer_key(node)
    node.params["method"] = "TANH"
    assert layer_key(node) != k1


def test_layer_key_follows_in_place_edits_of_list_params_and_dtype_params() -> None:
    from quantopt.quant.dtype import Dtype

    node = PyNode("n", "Convolution")
    node.params.update({"num_output": 8, "shift_type": Dtype.INT8, "axis": [None]})
    k1 = layer_key(node)
    assert layer_key(node) == k1
    node.params["axis"].append(3)  # the key holds the list object itself, and a frozen copy of its values
    k2 = layer_key(node)
    assert k2 != k1
    node.params["shift_type"] = Dtype.INT16
    k3 = layer_key(node)
    assert k3 != k2
    node.params["nested"] = [[1, 2], {"a": torch.zeros(2)}]
    k4 = layer_key(node)
    node.params["nested"][0][1] = 5
    assert layer_key(node) != k4
    node.params["nested"][0][1] = 2
    node.params["nested"][1]["a"].add_(1.0)  # a tensor inside a param: by identity and version
    assert layer_key(node) != k4
    node.params["table"] = np.arange(4)
    k5 = layer_key(node)
    node.params["table"] = np.arange(4)  # another array of the same values: the same key, compared as bytes
    assert layer_key(node) == k5
    node.params["table"] = np.arange(1, 5)
    assert layer_key(node) != k5


def test_prelu_table_matches_general_path_and_follows_its_constant() -> None:
    slope = np.tile(np.linspace(-0.3, 0.6, 6).astype(np.float32), (1, 4, 5, 1))  # repeated over H, W
    q, data = _quantized("Activation", {"method": "PRELU"}, {"negative_slope": slope})
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    assert "_memo_activation_table" in node.attrs  # the table path ran
    assert torch.equal(node.outputs[0].betensor, _general(node))
    node.constants["negative_slope"].betensor[..., 2] += 7  # in place: the table must be rebuilt
    node.forward()
    assert torch.equal(node.outputs[0].betensor, _general(node))
    # codes outside the tabulated ones, below and above, in the first and last channels: the general path
    x = node.inputs[0]
    x.betensor = x.betensor.clone()
    x.betensor[0, 0, 0, 0] = int(params_of(node, x).qmin) - 1
    x.betensor[0, 1, 1, 5] = int(params_of(node, x).qmax) + 1
    assert torch.equal(activation_integer_forward(node), _general(node))
    q.forward(data[0], keep_tensors=True)
    # slopes that differ along H, W: no table, the general path
    node.constants["negative_slope"].betensor.view(-1, 6)[3, 1] += 3
    node.forward()
    assert torch.equal(node.outputs[0].betensor, _general(node))


def test_lut_table_follows_lut_and_out_of_range_inputs() -> None:
    q, data = _quantized("Activation", {"method": "SIGMOID"}, {})
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    first = node.outputs[0].betensor.clone()
    assert torch.equal(first, _general(node))
    lut = node.constants["lut"].betensor
    lut.copy_(lut.flip(0))  # in place
    node.forward()
    assert torch.equal(node.outputs[0].betensor, _general(node)) and not torch.equal(node.outputs[0].betensor, first)
    x = node.inputs[0]
    x.betensor = x.betensor.clone()
    x.betensor[0, 0, 0, 0] = int(params_of(node, x).qmax) + 50  # outside the tabulated codes: the general path
    assert torch.equal(activation_integer_forward(node), _general(node))
    x.betensor[0, 0, 0, 0] = int(params_of(node, x).qmin) - 50
    assert torch.equal(activation_integer_forward(node), _general(node))


def test_conv_requantization_matches_mac_finish_and_follows_params() -> None:
    w = np.random.default_rng(1).normal(0, 0.3, size=(5, 3, 3, 6)).astype(np.float32)
    params = {"num_output": 5, "kernel_x": 3, "kernel_y": 3, "stride_x": 1, "stride_y": 1, "pad_left": 1,
              "pad_right": 1, "pad_top": 1, "pad_bottom": 1, "group": 1, "with_activation": "RELU6"}
    q, data = _quantized("Convolution", params, {"weights": w, "biases": np.linspace(-1, 1, 5).astype(np.float32)},
                         conv_out=[1, 4, 5, 5])
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    assert "_memo_mac_finish" in node.attrs
    reference = mac_finish(node, conv2d_nhwc_int(node, depthwise=False), planned=False)
    assert torch.equal(node.outputs[0].betensor, reference)
    for change in (lambda: node.params.__setitem__("shift_value", int(node.params["shift_value"]) + 1),
                   lambda: node.constants["biases"].betensor.add_(1000),
                   lambda: node.params.__setitem__("with_activation", "NONE")):
        change()
        node.forward()
        reference = mac_finish(node, conv2d_nhwc_int(node, depthwise=False), planned=False)
    assert torch.equal(node.outputs[0].betensor, reference)


def test_same_values_match_views_of_the_same_memory_at_the_same_version() -> None:
    """`SameValues` (the analysis's cache key for constants' outputs): another reshape of the same memory matches;
    other memory with equal values, another layout of the same memory, or a write in between does not."""
    from quantopt.graph.memo import SameValues

    w = torch.arange(12.0)
    key = SameValues(w.reshape(3, 4))
    assert key == SameValues(w.reshape(3, 4))  # a new view object each time, as a Constant layer's forward makes
    assert key != SameValues(w.clone().reshape(3, 4))
    assert key != SameValues(w.reshape(4, 3))
    assert key != SameValues(w.reshape(3, 4).t())
    assert key != SameValues(w.reshape(3, 4).to(torch.float64))
    w.add_(1.0)
    assert key != SameValues(w.reshape(3, 4))


def test_sixteen_bit_table_of_many_channels_is_one_column() -> None:
    """At 16 bits an activation whose channels map alike (per-tensor params, a table over the codes) tabulates its
    65536 codes once, not once per channel (576 channels took seconds per layer to tabulate); per-channel slopes
    keep a table per channel only while it stays small, else the general path. The same integers either way."""
    b = GraphBuilder("t")
    shape = [1, 2, 2, 576]
    x = b.input("x", shape)
    y = b.layer("Activation", [x], [shape], name="op", params={"method": "HARDSWISH"})
    g = b.build([y])
    r = np.random.default_rng(1)
    data = [torch.from_numpy(r.normal(0.0, 2.0, size=shape).astype(np.float32)) for _ in range(2)]
    q = quantize_model(g, data, {"q_bits_activation": 16})
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    qmin, qmax, table = node.attrs["_memo_activation_table"][1]
    assert table.numel() == qmax - qmin + 1 == 65536  # one column
    assert torch.equal(node.outputs[0].betensor, _general(node))
    slope = np.tile(np.linspace(-0.3, 0.6, 576).astype(np.float32), (1, 2, 2, 1))
    q, data = _quantized("Activation", {"method": "PRELU"}, {"negative_slope": slope}, shape=shape)
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    assert torch.equal(node.outputs[0].betensor, _general(node))  # 8 bits: 256 codes x 576 channels, tabulated
    assert "_memo_activation_table" in node.attrs
    b = GraphBuilder("t16")
    x = b.input("x", shape)
    y = b.layer("Activation", [x], [shape], name="op", params={"method": "PRELU"},
                constants={"negative_slope": slope})
    g = b.build([y])
    q = quantize_model(g, data, {"q_bits_activation": 16})
    q.forward(data[0], keep_tensors=True)
    node = q.node("op")
    assert torch.equal(node.outputs[0].betensor, _general(node))  # 65536 codes x 576 channels: not tabulated
    assert "_memo_activation_table" not in node.attrs
