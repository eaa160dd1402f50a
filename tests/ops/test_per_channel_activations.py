"""Per-channel activation quantization (per_channel_symmetric_*): MAC producers with one scale per output channel,
MAC consumers absorbing the input scales into their weights, pooling passing them on; integer forward against the
independent reference of test_int_mac, float-vs-dequantized cosine, IR round trip, template, and clear errors."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from test_int_mac import ref_conv, ref_requant, requant_params

from quantopt.analysis.similarity import cosine, to_float
from quantopt.analysis.template import build_template
from quantopt.config.layer_settings import LayerSettings, check_settings
from quantopt.errors import UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)
PER_CHANNEL = "per_channel_symmetric_full_range"


def _w(r: np.random.Generator, shape: List[int], std: float = 0.4) -> np.ndarray:
    return r.normal(0, std, shape).astype(np.float32)


def chain(seed: int = 0):
    """conv (channels of very different ranges, RELU6) → depthwise → MAX pool → conv → FC on the flattened map."""
    r = np.random.default_rng(seed)
    b = GraphBuilder("pc")
    x = b.input("x", [1, 8, 8, 3])
    wc = _w(r, [8, 3, 3, 3])
    wc[0] *= 8.0
    wc[1] *= 0.02  # a channel 400 times narrower than the widest: per tensor it keeps only a few levels
    c1 = b.layer("Convolution", [x], [[1, 8, 8, 8]], name="c1",
                 params=dict(num_output=8, group=1, with_activation="RELU6", **GEO),
                 constants={"weights": wc, "biases": _w(r, [8], 0.05)})
    dw = b.layer("DepthwiseConv", [c1], [[1, 8, 8, 8]], name="dw",
                 params=dict(num_output=8, group=8, multiplier=1, with_activation="NONE", **GEO),
                 constants={"weights": _w(r, [8, 3, 3, 1]), "biases": _w(r, [8], 0.1)})
    pool = b.layer("Pooling", [dw], [[1, 4, 4, 8]], name="pool",
                   params=dict(method="MAX", kernel_x=2, kernel_y=2, stride_x=2, stride_y=2))
    c2 = b.layer("Convolution", [pool], [[1, 4, 4, 6]], name="c2",
                 params=dict(num_output=6, group=2, with_activation="NONE", **GEO),
                 constants={"weights": _w(r, [6, 3, 3, 4]), "biases": _w(r, [6], 0.1)})
    return b.build([c2])


def data(seed: int, n: int = 4) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0, 1, [2, 8, 8, 3]).astype(np.float32)) for _ in range(n)]


def per_channel(layers, **extra: Any) -> Dict[str, Dict[str, Any]]:
    return {name: dict(q_mode_activation=PER_CHANNEL, **extra) for name in layers}


def ref_output(node, x_q: np.ndarray) -> np.ndarray:
    """The MAC output stage of docs/integer-semantics.md with per-channel fused-activation bounds."""
    acc = ref_conv(node, x_q)
    mult, shift = requant_params(node)
    out = params_of(node, node.outputs[0])
    y = ref_requant(acc, mult, shift, int(out.zerop), out.qmin, out.qmax)
    if node.params.get("with_activation") == "RELU6":
        scale = out.scale.numpy().astype(np.float64)
        hi = np.clip(np.round(6.0 * scale), out.qmin, out.qmax).astype(np.int64)
        y = np.minimum(y, hi)
    return y


@pytest.mark.parametrize("mode", ["per_channel_symmetric_full_range", "per_channel_symmetric_restricted_range"])
def test_integer_forward_matches_reference(mode: str) -> None:
    qg = quantize_model(chain(), data(1), per_layer={n: dict(q_mode_activation=mode) for n in ("c1", "dw")})
    c1, dw, pool, c2 = (qg.node(n) for n in ("c1", "dw", "pool", "c2"))
    for n in (c1, dw, pool):
        q = params_of(n, n.outputs[0])
        assert isinstance(q.scale, torch.Tensor) and q.scale.numel() == 8 and int(q.zerop) == 0
    assert c1.params["activation_quantization_axis"] == [3] and c2.params["activation_quantization_axis"] == [None]
    c1_scale = params_of(c1, c1.outputs[0]).scale
    assert c1_scale.max() / c1_scale.min() > 50  # the channels really got their own scales
    qg.forward([data(2, 1)[0]], keep_tensors=True)
    for node in (c1, dw, c2):
        np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_output(node, node.inputs[0].betensor
                                                                                    .numpy()))


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
def test_float_vs_dequantized_cosine(bits: int, threshold: float) -> None:
    graph = chain()
    calib = data(3)
    settings = dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                    q_strategy_activation="extrema")  # no clipping: the cosine measures rounding alone
    qg = quantize_model(graph, calib, settings, per_layer=per_channel(("c1", "dw", "c2"), **settings))
    graph.forward([calib[0]])
    want = graph.output_tensors[0].betensor.clone()
    assert cosine(want, run_quantized(qg, [calib[0]])[0]) > threshold


def test_narrow_channel_is_kept_where_per_tensor_loses_it() -> None:
    """Channel 1 of c1 is 400 times narrower than channel 0: per tensor it gets a handful of levels."""
    graph = chain()
    calib = data(4)
    graph.forward([calib[0]], keep_tensors=True)
    want = graph.node("c1").outputs[0].betensor[..., 1].clone()
    results = {}
    weights = dict(q_mode_weight="per_channel_symmetric_restricted_range")  # else the narrow filter rounds to 0
    for name, layers in (("tensor", {"c1": weights}), ("channel", per_channel(("c1",), **weights))):
        qg = quantize_model(graph, calib, per_layer=layers)
        qg.forward([calib[0]], keep_tensors=True)
        results[name] = cosine(want, to_float(qg.node("c1").outputs[0])[..., 1])
    assert results["channel"] > 0.999 > results["tensor"]


def test_written_ir_reloads_bit_identical_and_template_is_json(tmp_path) -> None:
    graph = chain()
    qg = quantize_model(graph, data(5), per_layer=per_channel(("c1", "dw")))
    txt, _ = write_ir(qg, str(tmp_path / "pc_o.txt"))
    text = open(txt).read()
    assert "layer_top_scale_offset" in text and "activation_quantization_axis=[3]" in text
    again = read_ir(txt)
    batch = [data(6, 1)[0]]
    assert torch.equal(run_quantized(qg, batch)[0], run_quantized(again, batch)[0])
    template = json.loads(json.dumps(build_template(graph, qg)))
    info = template["c1"]["just_for_display"]["quantization_info"]
    assert len(json.dumps(info)) > 0


def test_unsupported_consumers_and_modes_are_named() -> None:
    r = np.random.default_rng(7)
    b = GraphBuilder("bad")
    x = b.input("x", [1, 4, 4, 3])
    c = b.layer("Convolution", [x], [[1, 4, 4, 3]], name="c", params=dict(num_output=3, group=1,
                                                                          with_activation="NONE", **GEO),
                constants={"weights": _w(r, [3, 3, 3, 3]), "biases": _w(r, [3])})
    y = b.layer("Activation", [c], [[1, 4, 4, 3]], name="relu", params=dict(method="RELU"))
    z = b.layer("Reshape", [c], [[1, 48]], name="flat", params=dict(shape=[1, 48]))
    graph = b.build([y, z])
    calib = [torch.from_numpy(r.normal(size=[2, 4, 4, 3]).astype(np.float32)) for _ in range(2)]
    with pytest.raises(UnsupportedError, match=r"layer 'relu' \(Activation\): method RELU takes per-tensor"):
        quantize_model(graph, calib, per_layer=per_channel(("relu",)))
    with pytest.raises(UnsupportedError, match="per_channel_asymmetric"):
        check_settings(LayerSettings(q_mode_activation="per_channel_asymmetric"), graph.node("c"))


def test_fully_connected_and_batchnorm_chains() -> None:
    """FC → FC and conv → BatchNorm → conv with per-channel activations in between: integer FC against the
    reference, and float-vs-dequantized cosine."""
    r = np.random.default_rng(8)
    b = GraphBuilder("fc")
    x = b.input("x", [1, 16])
    w1 = _w(r, [12, 16])
    w1[3] *= 0.01
    f1 = b.layer("FullyConnected", [x], [[1, 12]], name="f1", params=dict(num_output=12, with_activation="NONE"),
                 constants={"weights": w1, "biases": _w(r, [12], 0.1)})
    f2 = b.layer("FullyConnected", [f1], [[1, 5]], name="f2", params=dict(num_output=5, with_activation="NONE"),
                 constants={"weights": _w(r, [5, 12]), "biases": _w(r, [5], 0.1)})
    graph = b.build([f2])
    calib = [torch.from_numpy(r.normal(size=[4, 16]).astype(np.float32)) for _ in range(3)]
    qg = quantize_model(graph, calib, dict(q_strategy_activation="extrema"), per_layer=per_channel(("f1",)))
    qg.forward([calib[0]], keep_tensors=True)
    node = qg.node("f2")
    x_q = node.inputs[0].betensor.numpy().astype(np.int64)
    w = node.constants["weights"].betensor.numpy().astype(np.int64)
    acc = x_q @ w.T + node.constants["biases"].betensor.numpy().astype(np.int64)
    mult, shift = requant_params(node)
    out = node.outputs[0]
    oq = params_of(node, out)
    np.testing.assert_array_equal(out.betensor.numpy(), ref_requant(acc, mult, shift, int(oq.zerop), oq.qmin,
                                                                    oq.qmax))
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > 0.99

    b = GraphBuilder("bn")
    x = b.input("x", [1, 6, 6, 3])
    c = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="c", params=dict(num_output=4, group=1,
                                                                          with_activation="NONE", **GEO),
                constants={"weights": _w(r, [4, 3, 3, 3]), "biases": _w(r, [4], 0.1)})
    bn = b.layer("BatchNorm", [c], [[1, 6, 6, 4]], name="bn", params=dict(axis=3, with_activation="RELU"),
                 constants={"weights": np.array([2.0, 0.05, -1.0, 0.5], np.float32),
                            "biases": np.array([0.1, 0.0, -0.2, 0.3], np.float32)})
    c2 = b.layer("Convolution", [bn], [[1, 6, 6, 2]], name="c2", params=dict(num_output=2, group=1,
                                                                             with_activation="NONE", **GEO),
                 constants={"weights": _w(r, [2, 3, 3, 4]), "biases": _w(r, [2], 0.1)})
    graph = b.build([c2])
    calib = [torch.from_numpy(r.normal(size=[2, 6, 6, 3]).astype(np.float32)) for _ in range(3)]
    qg = quantize_model(graph, calib, dict(q_strategy_activation="extrema"), per_layer=per_channel(("c", "bn")))
    bn = qg.node("bn")
    assert params_of(bn, bn.outputs[0]).scale.numel() == 4
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > 0.99


def concat_graph(act_b: str = "RELU", axis: int = -1):
    r = np.random.default_rng(9)
    b = GraphBuilder("cat")
    x = b.input("x", [1, 6, 6, 3])
    branches = []
    for name, act, out_c in (("a", "RELU", 4), ("b", act_b, 2 if axis == -1 else 4)):
        branches.append(b.layer("Convolution", [x], [[1, 6, 6, out_c]], name=name,
                                params=dict(num_output=out_c, group=1, with_activation=act, **GEO),
                                constants={"weights": _w(r, [out_c, 3, 3, 3]), "biases": _w(r, [out_c], 0.1)}))
    shape = [1, 6, 6, 6] if axis == -1 else [1, 12, 6, 4]
    cat = b.layer("Concat", branches, [shape], name="cat", params=dict(axis=axis))
    y = b.layer("Convolution", [cat], [[1, 6, 6, 2] if axis == -1 else [1, 12, 6, 2]], name="after",
                params=dict(num_output=2, group=1, with_activation="NONE", **GEO),
                constants={"weights": _w(r, [2, 3, 3, shape[-1]]), "biases": _w(r, [2], 0.1)})
    return b.build([y])


def test_concat_on_the_channel_axis_joins_the_scales(tmp_path) -> None:
    graph = concat_graph()
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(3)]
    qg = quantize_model(graph, calib, dict(q_strategy_activation="extrema"), per_layer=per_channel(("a",)))
    a, b, cat = qg.node("a").outputs[0], qg.node("b").outputs[0], qg.node("cat").outputs[0]
    sa, sb, sc = (params_of(qg.node(n), t).scale for n, t in (("a", a), ("b", b), ("cat", cat)))
    assert torch.equal(sc, torch.cat([sa.float(), torch.full((2,), float(sb))]))
    assert "scale_value" not in qg.node("cat").params
    qg.forward([calib[0]], keep_tensors=True)
    np.testing.assert_array_equal(cat.betensor.numpy(), np.concatenate([a.betensor.numpy(), b.betensor.numpy()],
                                                                        axis=-1))
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > 0.99
    txt, _ = write_ir(qg, str(tmp_path / "cat_o.txt"))
    assert torch.equal(run_quantized(qg, [calib[1]])[0], run_quantized(read_ir(txt), [calib[1]])[0])


def test_concat_of_per_channel_branches_needs_one_bit_width_and_zero_point_0() -> None:
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(2)]
    for other in (dict(q_bits_activation=16), dict(q_mode_activation="per_tensor_asymmetric")):
        with pytest.raises(UnsupportedError, match=r"'cat' \(Concat\): per-channel branches pass through unchanged"):
            quantize_model(concat_graph(act_b="NONE"), calib, per_layer={**per_channel(("a",)), "b": other})


@pytest.mark.parametrize("layers", [("a",), ("a", "b")])
def test_unsigned_per_channel_branch_beside_a_signed_one_becomes_signed(layers, caplog) -> None:
    """A RELU branch (unsigned) joined on the channels with a branch without activation (signed): the RELU branch
    gets signed outputs (passes/concat_signs.py) and the Concat passes both through; the float graph keeps its
    settings."""
    graph = concat_graph(act_b="NONE")
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(3)]
    with caplog.at_level("INFO", logger="quantopt"):
        qg = quantize_model(graph, calib, dict(q_strategy_activation="extrema"), per_layer=per_channel(layers))
    assert "1 layer(s) give signed outputs ('a')" in caplog.text
    a, b, cat = qg.node("a").outputs[0], qg.node("b").outputs[0], qg.node("cat").outputs[0]
    for n, t in (("a", a), ("b", b), ("cat", cat)):
        assert params_of(qg.node(n), t).qmin < 0, n
    assert not graph.node("a").settings.force_dtype_int and qg.node("a").settings.force_dtype_int
    qg.forward([calib[0]], keep_tensors=True)
    np.testing.assert_array_equal(cat.betensor.numpy(), np.concatenate([a.betensor.numpy(), b.betensor.numpy()],
                                                                        axis=-1))
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > 0.99


def test_branches_of_one_sign_are_left_alone(caplog) -> None:
    graph = concat_graph(act_b="RELU")
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(2)]
    with caplog.at_level("INFO", logger="quantopt"):
        qg = quantize_model(graph, calib, per_layer=per_channel(("a", "b")))
    assert "signed outputs" not in caplog.text and params_of(qg.node("a"), qg.node("a").outputs[0]).qmin == 0


def residual_graph(method: str = "ADD"):
    r = np.random.default_rng(10)
    b = GraphBuilder("res")
    x = b.input("x", [1, 6, 6, 3])
    branches = []
    for name, out_c, scale in (("a", 4, 1.0), ("b", 4, 0.05)):
        wc = _w(r, [out_c, 3, 3, 3]) * scale
        branches.append(b.layer("Convolution", [x], [[1, 6, 6, out_c]], name=name,
                                params=dict(num_output=out_c, group=1, with_activation="NONE", **GEO),
                                constants={"weights": wc, "biases": _w(r, [out_c], 0.05)}))
    y = b.layer("Eltwise", branches, [[1, 6, 6, 4]], name="op", params=dict(method=method, with_activation="NONE"))
    z = b.layer("Convolution", [y], [[1, 6, 6, 2]], name="after",
                params=dict(num_output=2, group=1, with_activation="NONE", **GEO),
                constants={"weights": _w(r, [2, 3, 3, 4]), "biases": _w(r, [2], 0.1)})
    return b.build([z])


def ref_eltwise(node) -> np.ndarray:
    method = str(node.params["method"]).upper()
    xs = [t.betensor.numpy().astype(np.int64) + int(params_of(node, t).zerop) for t in node.inputs]
    mult = node.constants["scale"].betensor.numpy().astype(np.int64)
    shift = node.constants["shift"].betensor.numpy().astype(np.int64)
    if method == "MUL":
        acc = xs[0] * xs[1]
    else:
        muls = node.constants["input_scale"].betensor.numpy().astype(np.int64).reshape(len(xs), -1)
        parts = [x * m for x, m in zip(xs, muls)]
        acc = {"ADD": np.add, "SUB": np.subtract, "MAX": np.maximum, "MIN": np.minimum}[method](*parts)
    out = params_of(node, node.outputs[0])
    return ref_requant(acc, np.broadcast_to(mult, acc.shape), np.broadcast_to(shift, acc.shape), int(out.zerop),
                       out.qmin, out.qmax)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("method,layers", [("ADD", ("a",)), ("SUB", ("a", "b")), ("MAX", ("a", "op")),
                                           ("MUL", ("a",)), ("ADD", ("a", "b", "op"))])
def test_eltwise_with_per_channel_scales(method: str, layers, bits: int, tmp_path) -> None:
    graph = residual_graph(method)
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(3)]
    settings = dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                    q_strategy_activation="extrema")
    qg = quantize_model(graph, calib, settings, per_layer=per_channel(layers, **settings))
    node = qg.node("op")
    assert node.constants["scale"].betensor.numel() == 4 and ("input_scale" in node.constants) == (method != "MUL")
    qg.forward([calib[0]], keep_tensors=True)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_eltwise(node))
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > (0.99 if bits == 8
                                                                                          else 0.9999)
    txt, _ = write_ir(qg, str(tmp_path / "res_o.txt"))
    assert torch.equal(run_quantized(qg, [calib[1]])[0], run_quantized(read_ir(txt), [calib[1]])[0])


@pytest.mark.parametrize("bits", [8, 16])
def test_a_nearly_constant_channel_beside_a_wide_one_aligns_to_the_wide_one(bits: int, caplog) -> None:
    """A residual Add where one branch's channel is nearly constant (a dead channel: its per-channel scale far finer
    than the other branch's) had its input scales more than 32767 times apart and was refused; that channel now
    aligns to 32767 times the coarsest scale (the fine input's whole range is below 1/128 of the coarse step), with
    an info line naming the layer, and the integer forward is the stored arithmetic, close to float."""
    graph = residual_graph("ADD")
    b = next(n for n in graph.nodes if n.name == "b")
    b.constants["weights"].betensor[2] *= 1e-7  # channel 2 of branch b: nearly constant (its bias only)
    b.constants["biases"].betensor[2] = 1e-6
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(3)]
    settings = dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                    q_strategy_activation="extrema")
    with caplog.at_level("INFO", logger="quantopt"):
        qg = quantize_model(graph, calib, settings, per_layer=per_channel(("a", "b", "op"), **settings))
    node = qg.node("op")
    muls = node.constants["input_scale"].betensor.reshape(2, -1)
    assert int(muls[:, 2].max()) <= 32767 and int(muls[0, 2]) == 32767  # branch a is the coarse one there
    qg.forward([calib[0]], keep_tensors=True)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_eltwise(node))
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > 0.99


def table_graph(method: str = "HARDSWISH"):
    r = np.random.default_rng(11)
    b = GraphBuilder("tab")
    x = b.input("x", [1, 6, 6, 3])
    wc = _w(r, [4, 3, 3, 3])
    wc[1] *= 0.05
    c = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="c", params=dict(num_output=4, group=1,
                                                                          with_activation="NONE", **GEO),
                constants={"weights": wc, "biases": _w(r, [4], 0.05)})
    act = b.layer("Activation", [c], [[1, 6, 6, 4]], name="act", params=dict(method=method))
    y = b.layer("Convolution", [act], [[1, 6, 6, 2]], name="after",
                params=dict(num_output=2, group=1, with_activation="NONE", **GEO),
                constants={"weights": _w(r, [2, 3, 3, 4]), "biases": _w(r, [2], 0.1)})
    return b.build([y])


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("method,layers", [("HARDSWISH", ("c",)), ("SIGMOID", ("c", "act"))])
def test_table_activations_take_one_table_per_channel(method: str, layers, bits: int, tmp_path) -> None:
    """A per-channel input gets one table per channel (from that channel's scale); the output may be per tensor."""
    from quantopt.quant.lut import lookup_lut

    graph = table_graph(method)
    calib = [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
             for s in range(3)]
    settings = dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                    q_strategy_activation="extrema", q_mode_weight="per_channel_symmetric_restricted_range")
    qg = quantize_model(graph, calib, settings, per_layer=per_channel(layers, **settings))
    node = qg.node("act")
    lut = node.constants["lut"].betensor
    assert lut.dim() == 2 and lut.shape[0] == 4
    qg.forward([calib[0]], keep_tensors=True)
    x, out = node.inputs[0], node.outputs[0]
    oq = params_of(node, out)
    qmin_in = int(params_of(node, x).qmin)
    for ch in range(4):  # each channel read through its own table, as a one-table lookup
        want = lookup_lut(x.betensor[..., ch], lut[ch], qmin_in, 8 if bits == 8 else 16, oq.qbits,
                          int(oq.qmin) < 0, in_restricted=False)
        want = torch.clamp(want, int(oq.qmin), int(oq.qmax))
        assert torch.equal(out.betensor[..., ch], want)
    graph.forward([calib[0]])
    assert cosine(graph.output_tensors[0].betensor, run_quantized(qg, [calib[0]])[0]) > (0.99 if bits == 8
                                                                                          else 0.999)
    txt, _ = write_ir(qg, str(tmp_path / "tab_o.txt"))
    assert torch.equal(run_quantized(qg, [calib[1]])[0], run_quantized(read_ir(txt), [calib[1]])[0])


# ------------------------------------------------------------------ per-tensor fallback, decided before statistics
def test_layers_whose_readers_cannot_take_per_channel_fall_back_with_one_warning(caplog) -> None:
    """A global per-channel mode on a graph with a broadcasting Mul, a per-tensor reader and a Concat on another axis:
    exactly the layers that cannot stay per channel fall back, listed in one warning; the others keep one scale per
    channel and the model quantizes end to end."""
    r = np.random.default_rng(3)
    b = GraphBuilder("fallback")
    x = b.input("x", [1, 4, 4, 3])

    def conv(name: str, src, out_c: int, in_c: int = 3):
        return b.layer("Convolution", [src], [[1, 4, 4, out_c]], name=name,
                       params=dict(num_output=out_c, group=1, with_activation="NONE", **GEO),
                       constants={"weights": _w(r, [out_c, 3, 3, in_c]), "biases": _w(r, [out_c])})

    keep = conv("keep", x, 4)  # read by a convolution only
    after = conv("after", keep, 4, in_c=4)
    gate = conv("gate", x, 1)  # one channel: the Mul broadcasts it over 4
    mul = b.layer("Mul", [after, gate], [[1, 4, 4, 4]], name="mul")
    flat_src = conv("flat_src", x, 3)
    flat = b.layer("Reshape", [flat_src], [[1, 48]], name="flat", params=dict(shape=[1, 48]))
    cat_src = conv("cat_src", x, 3)
    cat = b.layer("Concat", [cat_src, x], [[1, 8, 4, 3]], name="cat", params=dict(axis=1))
    graph = b.build([mul, flat, cat])
    calib = [torch.from_numpy(r.normal(size=[2, 4, 4, 3]).astype(np.float32)) for _ in range(2)]
    with caplog.at_level("WARNING", logger="quantopt"):
        qg = quantize_model(graph, calib, dict(q_mode_activation=PER_CHANNEL, q_strategy_activation="extrema"))
    warnings = [m for m in caplog.messages if "fall back to per-tensor" in m]
    assert len(warnings) == 1, caplog.messages
    for name, why in (("after", "read by 'mul' broadcasts along the channel axis"),
                      ("gate", "read by 'mul' broadcasts"), ("mul", "'mul' broadcasts along the channel axis (1, 4"),
                      ("flat_src", "read by 'flat' (Reshape), which takes per-tensor inputs only"),
                      ("cat_src", "read by 'cat' (Concat), which joins on another axis")):
        assert f"'{name}' ({why}" in warnings[0], (name, warnings[0])
        assert graph.node(name).settings.q_mode_activation == "per_tensor_symmetric_full_range"
    assert "'keep'" not in warnings[0] and "5 layer(s)" in warnings[0]
    assert graph.node("keep").settings.q_mode_activation == PER_CHANNEL
    assert params_of(qg.node("keep"), qg.node("keep").outputs[0]).scale.numel() == 4
    assert all(torch.as_tensor(params_of(qg.node(n), qg.node(n).outputs[0]).scale).numel() == 1
               for n in ("after", "gate", "mul", "flat_src", "cat_src"))
    graph.forward([calib[0]])
    outs = run_quantized(qg, [calib[0]])
    assert all(cosine(f.betensor, q) > 0.98 for f, q in zip(graph.output_tensors, outs))


def test_a_product_with_a_scalar_falls_back_and_names_it(caplog) -> None:
    """An element-wise layer with a scalar operand (no channel axis) under a per-channel mode: it falls back to
    per-tensor, its reason naming the scalar (the channel counts' listing had failed on it: fuzz cfg seed 193)."""
    r = np.random.default_rng(4)
    b = GraphBuilder("scalar")
    x = b.input("x", [1, 4, 4, 3])
    c = b.layer("Convolution", [x], [[1, 4, 4, 2]], name="c",
                params=dict(num_output=2, group=1, with_activation="NONE", **GEO),
                constants={"weights": _w(r, [2, 3, 3, 3]), "biases": _w(r, [2])})
    k = b.layer("Constant", [], [[]], name="k", constants={"weights": torch.tensor(2.0)})  # integer: stays a Mul
    y = b.layer("Mul", [c, k], [[1, 4, 4, 2]], name="mul")
    graph = b.build([y])
    calib = [torch.from_numpy(r.normal(size=[1, 4, 4, 3]).astype(np.float32)) for _ in range(2)]
    with caplog.at_level("WARNING", logger="quantopt"):
        quantize_model(graph, calib, dict(q_mode_activation=PER_CHANNEL, q_strategy_activation="extrema"))
    warnings = [m for m in caplog.messages if "fall back to per-tensor" in m]
    assert len(warnings) == 1 and "'mul' broadcasts along the channel axis (2 channels and a scalar)" in warnings[0]
    assert graph.node("mul").settings.q_mode_activation == "per_tensor_symmetric_full_range"


def test_a_long_fallback_list_is_cut_in_the_warning(caplog) -> None:
    """Ten convolutions each read by a Reshape: the warning names the first WARNED_FALLBACKS and counts the rest,
    the debug log names all ten."""
    r = np.random.default_rng(6)
    b = GraphBuilder("many")
    x = b.input("x", [1, 4, 4, 3])
    outs = []
    for i in range(10):
        c = b.layer("Convolution", [x], [[1, 4, 4, 2]], name=f"c{i}",
                    params=dict(num_output=2, group=1, with_activation="NONE", **GEO),
                    constants={"weights": _w(r, [2, 3, 3, 3]), "biases": _w(r, [2])})
        outs.append(b.layer("Reshape", [c], [[1, 32]], name=f"flat{i}", params=dict(shape=[1, 32])))
    graph = b.build(outs)
    calib = [torch.from_numpy(r.normal(size=[1, 4, 4, 3]).astype(np.float32)) for _ in range(2)]
    with caplog.at_level("DEBUG", logger="quantopt"):
        quantize_model(graph, calib, dict(q_mode_activation=PER_CHANNEL, q_strategy_activation="extrema"))
    warned = [m for m in caplog.messages if "fall back to per-tensor" in m]
    listed = [m for m in caplog.messages if "every layer falling back" in m]
    assert len(warned) == 1 and "10 layer(s)" in warned[0] and "and 2 more" in warned[0]
    assert sum(f"'c{i}'" in warned[0] for i in range(10)) == 8
    assert len(listed) == 1 and all(f"'c{i}'" in listed[0] for i in range(10))


def test_no_warning_when_every_per_channel_layer_can_stay(caplog) -> None:
    with caplog.at_level("WARNING", logger="quantopt"):
        qg = quantize_model(chain(), data(1, 2), per_layer=per_channel(("c1", "dw")))
    assert not [m for m in caplog.messages if "fall back" in m]
    assert params_of(qg.node("c1"), qg.node("c1").outputs[0]).scale.numel() == 8


POOLS = {
    "avg_2x2": ("Pooling", [1, 3, 3, 4], dict(method="AVG", kernel_x=2, kernel_y=2, stride_x=2, stride_y=2)),
    "avg_3x3_padded": ("Pooling", [1, 6, 6, 4], dict(method="AVG", kernel_x=3, kernel_y=3, stride_x=1, stride_y=1,
                                                     pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
                                                     count_include_pad=False)),
    "global_avg": ("GlobalPool", [1, 1, 1, 4], dict(method="AVG")),
    "max_2x2": ("Pooling", [1, 3, 3, 4], dict(method="MAX", kernel_x=2, kernel_y=2, stride_x=2, stride_y=2)),
}


def pool_graph(name: str):
    """(graph, calibration batches): a per-channel candidate conv (channels of very different ranges) -> POOLS[name]."""
    optype, out_shape, params = POOLS[name]
    r = np.random.default_rng(5)
    b = GraphBuilder("pool_pc")
    x = b.input("x", [1, 6, 6, 3])
    wc = _w(r, [4, 3, 3, 3])
    wc[0] *= 10.0
    wc[3] *= 0.05
    c1 = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="c1", params=dict(num_output=4, group=1,
                 with_activation="NONE", **GEO), constants={"weights": wc, "biases": _w(r, [4], 0.05)})
    pool = b.layer(optype, [c1], [out_shape], name="pool", params=params)
    return b.build([pool]), [torch.from_numpy(r.normal(0, 1, [1, 6, 6, 3]).astype(np.float32)) for _ in range(3)]


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_passes_per_channel_scales_on(name: str) -> None:
    """AVG and MAX pools (and a global average, an SE block's squeeze) of a per-channel activation work per channel
    with its scales: each channel's integers are those of the per-tensor integer pool on that channel (the scales
    cancel: in and out are the same), and the dequantized result is the float pool of the dequantized input within
    one step of its channel (the 8-bit multiplier of 1 / count approximates)."""
    from quantopt.ops.pooling import avg_requant

    optype, _, params = POOLS[name]
    graph, calib = pool_graph(name)
    qg = quantize_model(graph, calib, per_layer=per_channel(("c1",)))
    node = qg.node("pool")
    q_in, q_out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    assert q_in.scale.numel() == 4 and torch.equal(q_in.scale, q_out.scale)
    qg.forward([calib[0]], keep_tensors=True)
    got = node.outputs[0].betensor.numpy()
    xq = node.inputs[0].betensor.numpy().astype(np.float64)  # [1, 6, 6, 4], zero point 0
    if params["method"] == "MAX":
        want = xq.reshape(1, 3, 2, 3, 2, 4)[:, :, :, :, :2].max(axis=(2, 4))
    else:
        if optype == "GlobalPool":
            sums, counts = xq.sum(axis=(1, 2), keepdims=True), np.full((1, 1), 36.0)
        elif name == "avg_2x2":
            sums, counts = xq.reshape(1, 3, 2, 3, 2, 4).sum(axis=(2, 4)), np.full((3, 3), 4.0)
        else:
            padded = np.pad(xq, ((0, 0), (1, 1), (1, 1), (0, 0)))
            sums = sum(padded[:, i:i + 6, j:j + 6] for i in range(3) for j in range(3))
            real = np.pad(np.ones((6, 6)), 1)
            counts = sum(real[i:i + 6, j:j + 6] for i in range(3) for j in range(3))
        mult, shift = avg_requant(1.0, 1.0, torch.from_numpy(counts).reshape(1, 1, *counts.shape))
        factor = (mult.numpy() * np.power(2.0, -shift.numpy().astype(np.float64)))[0, 0]
        want = np.round(sums * factor[None, :, :, None])  # numpy rounds half to even
    np.testing.assert_array_equal(got, want.astype(np.int64))
    graph.forward([calib[0]], keep_tensors=True)
    scales = q_out.scale.numpy().astype(np.float64)
    float_pool = torch.from_numpy(xq / params_of(node, node.inputs[0]).scale.numpy())
    graph_pool = graph.node("pool")
    graph_pool.inputs[0].betensor = float_pool.to(torch.float32)
    graph_pool.forward()
    error = np.abs(got / scales - graph_pool.outputs[0].betensor.numpy())
    assert (error <= 1.01 / scales).all()  # a step: 1 / count is an 8-bit multiplier
