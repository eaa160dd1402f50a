"""Pooling (MAX/AVG, 2-D and 1-D), BatchNorm, Pad and MatMul: integer forward against independent numpy/python-int
references written from docs/integer-semantics.md, float-vs-dequantized cosine, IR write → re-load
bit identity, and the IR keys the quantization adds."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from int_refs import avg_ref, rhe_div
from quant_helpers import params_of
from test_pooling import _out_size

from quantopt.analysis.similarity import cosine
from quantopt.errors import UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

# (activation mode, bits); 16-bit activations are always symmetric
ACT_MODES = [
    ("per_tensor_symmetric_full_range", 8),
    ("per_tensor_symmetric_restricted_range", 8),
    ("per_tensor_asymmetric", 8),
    ("per_tensor_symmetric_full_range", 16),
]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def data(shape: Sequence[int], seed: int, n: int = 3, loc: float = 0.3, scale: float = 1.0) -> List[torch.Tensor]:
    r = _rng(seed)
    return [torch.from_numpy(r.normal(loc, scale, size=shape).astype(np.float32)) for _ in range(n)]


def settings(mode: str, bits: int, **extra) -> Dict:
    s = {"q_mode_activation": mode, "q_bits_activation": bits, "q_strategy_activation": "extrema"}
    if bits > 8:
        s["q_bits_bias"] = 48
    s.update(extra)
    return s


# --- independent reference helpers (python ints, no quantopt rounding/requant code) -------------------------------
def ref_requant(acc: np.ndarray, mult, shift, zp_out: int, qmin: int, qmax: int) -> np.ndarray:
    """clamp(round_half_even(acc * M / 2^shift) - zp_out, qmin, qmax) elementwise with python integers."""
    acc = np.asarray(acc, dtype=np.int64)
    mult = np.broadcast_to(np.asarray(mult, dtype=np.int64), acc.shape)
    shift = np.broadcast_to(np.asarray(shift, dtype=np.int64), acc.shape)
    out = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        num, s = int(acc[idx]) * int(mult[idx]), int(shift[idx])
        v = num << (-s) if s <= 0 else rhe_div(num, 1 << s)
        out[idx] = min(max(v - zp_out, qmin), qmax)
    return out


def ref_act_bounds(node, y: np.ndarray) -> np.ndarray:
    """Fused RELU6/CLIP bounds quantized with the output params (RELU is the output range itself)."""
    act = str(node.params.get("with_activation", "NONE")).upper()
    if act not in ("RELU6", "CLIP"):
        return y
    out = params_of(node, node.outputs[0])
    lo, hi = (0.0, 6.0) if act == "RELU6" else (node.params["clip_min"], node.params["clip_max"])
    q = [min(max(int(np.round(np.float64(v) * np.float64(out.scale) - out.zerop)), out.qmin), out.qmax)
         for v in (lo, hi)]
    return np.clip(y, q[0], q[1])


def out_info(node) -> Tuple[int, int, int]:
    out = params_of(node, node.outputs[0])
    return int(out.zerop), int(out.qmin), int(out.qmax)


# ------------------------------------------------------------------------------------------------ Pooling
def pool_graph(method: str, k, s, pads, d=(1, 1), ceil=False, include: Optional[bool] = None,
               shape=(1, 9, 10, 5), one_d: bool = False):
    p = {"method": method, "kernel_y": k[0], "kernel_x": k[1], "stride_y": s[0], "stride_x": s[1],
         "pad_left": pads[0], "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3],
         "dilation_y": d[0], "dilation_x": d[1], "ceil_mode": ceil}
    if include is not None:
        p["count_include_pad"] = include
    if one_d:
        oh, ow = 1, _out_size(shape[1], k[1], s[1], d[1], pads[0], pads[1], ceil)
        out_shape = [shape[0], ow, shape[2]]
    else:
        oh = _out_size(shape[1], k[0], s[0], d[0], pads[2], pads[3], ceil)
        ow = _out_size(shape[2], k[1], s[1], d[1], pads[0], pads[1], ceil)
        out_shape = [shape[0], oh, ow, shape[3]]
    g = GraphBuilder("pool")
    y = g.layer("Pooling", [g.input("x", list(shape))], [out_shape], name="op", params=p)
    return g.build([y])


def ref_pool(node, x_q: np.ndarray) -> np.ndarray:
    """Window by window: MAX over the real cells; AVG = avg_ref(sum(x + zp), count) with count the
    real cells, or (count_include_pad) the cells inside the padded input; cells past it never count."""
    p = node.params
    one_d = x_q.ndim == 3
    x = x_q[:, None] if one_d else x_q
    zp = int(params_of(node, node.inputs[0]).zerop)
    zp_out, qmin, qmax = out_info(node)
    n, h, w, c = x.shape
    k, s, d = (p["kernel_y"], p["kernel_x"]), (p["stride_y"], p["stride_x"]), (p["dilation_y"], p["dilation_x"])
    left, right, top, bottom = p["pad_left"], p["pad_right"], p["pad_top"], p["pad_bottom"]
    if one_d:
        k, s, d, top, bottom = (1, k[1]), (1, s[1]), (1, d[1]), 0, 0
    oh = _out_size(h, k[0], s[0], d[0], top, bottom, p["ceil_mode"])
    ow = _out_size(w, k[1], s[1], d[1], left, right, p["ceil_mode"])
    include = bool(p.get("count_include_pad", False))
    y = np.empty((n, oh, ow, c), dtype=np.int64)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    rows = [i * s[0] - top + a * d[0] for a in range(k[0])]
                    cols = [j * s[1] - left + e * d[1] for e in range(k[1])]
                    vals = [int(x[b, r, q, ch]) for r in rows for q in cols if 0 <= r < h and 0 <= q < w]
                    if p["method"] == "MAX":
                        v = max(vals)
                    else:
                        inside = sum(1 for r in rows for q in cols if -top <= r < h + bottom and -left <= q < w + right)
                        v = avg_ref(sum(t + zp for t in vals), inside if include else len(vals), zp)
                    y[b, i, j, ch] = min(max(v, qmin), qmax)
    assert zp_out == zp
    return y[:, 0] if one_d else y


POOL_CASES = [
    # method, kernel, stride, pads (l, r, t, b), dilation, ceil, count_include_pad
    ("MAX", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False, None),
    ("MAX", (3, 2), (2, 3), (0, 2, 1, 0), (1, 1), True, None),
    ("MAX", (2, 3), (1, 2), (1, 0, 0, 1), (2, 1), True, None),
    ("AVG", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False, False),
    ("AVG", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False, True),
    ("AVG", (3, 2), (2, 3), (0, 2, 1, 0), (1, 1), True, True),
    ("AVG", (3, 2), (2, 3), (0, 2, 1, 0), (1, 1), True, False),
    ("AVG", (2, 2), (2, 2), (1, 0, 0, 1), (1, 2), True, True),
    ("AVG", (9, 10), (1, 1), (0, 0, 0, 0), (1, 1), False, False),  # global average
]


@pytest.mark.parametrize("mode,bits", ACT_MODES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_pooling_integer_forward_matches_reference(case, mode: str, bits: int) -> None:
    method, k, s, pads, d, ceil, include = case
    g = pool_graph(method, k, s, pads, d, ceil, include)
    qg = quantize_model(g, data([2, 9, 10, 5], 1), settings(mode, bits))
    node = qg.node("op")
    qg.forward([data([2, 9, 10, 5], 2, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_pool(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("mode,bits", ACT_MODES)
@pytest.mark.parametrize("method,include", [("MAX", None), ("AVG", True), ("AVG", False)])
def test_pooling_1d_integer_forward_matches_reference(method: str, include, mode: str, bits: int) -> None:
    g = pool_graph(method, (1, 3), (1, 2), (1, 2, 0, 0), ceil=True, include=include, shape=(2, 11, 4), one_d=True)
    qg = quantize_model(g, data([2, 11, 4], 3), settings(mode, bits))
    node = qg.node("op")
    qg.forward([data([2, 11, 4], 4, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_pool(node, node.inputs[0].betensor.numpy()))


def test_pooling_unsigned_input_with_padding() -> None:
    """Unsigned asymmetric input: padding must still count as float 0 (AVG) and never win (MAX)."""
    for method in ("MAX", "AVG"):
        g = pool_graph(method, (3, 3), (2, 2), (1, 1, 1, 1), ceil=True, include=True)
        xs = [x.abs() + 0.5 for x in data([2, 9, 10, 5], 5)]
        qg = quantize_model(g, xs, settings("per_tensor_asymmetric", 8))
        node = qg.node("op")
        assert params_of(node, node.inputs[0]).qmin == 0
        qg.forward([xs[0]])
        np.testing.assert_array_equal(node.outputs[0].betensor.numpy(),
                                      ref_pool(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("case", POOL_CASES)
def test_avg_pool_is_close_to_the_float_average(case) -> None:
    """The integer AVG is the float average of the dequantized input rounded to the output grid, up to the 8-bit
    multiplier's relative error (at most 2^-8 of |mean + zp| < 2^8 codes, i.e. one more step)."""
    method, k, s, pads, d, ceil, include = case
    g = pool_graph(method, k, s, pads, d, ceil, include)
    qg = quantize_model(g, data([2, 9, 10, 5], 6), settings("per_tensor_asymmetric", 8))
    node = qg.node("op")
    x = data([2, 9, 10, 5], 7, 1)[0]
    got = run_quantized(qg, x)[0]
    ip, op = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    x_deq = (node.inputs[0].betensor.to(torch.float64) + ip.zerop) / ip.scale
    want = g.forward([x_deq.to(torch.float32)])[0].to(torch.float64)
    assert float((got.to(torch.float64) - want).abs().max()) <= 1.5 / op.scale + 1e-5


def test_pooling_quantization_passes_params_through_and_adds_no_keys() -> None:
    for method, include in (("MAX", None), ("AVG", False)):
        g = pool_graph(method, (3, 3), (2, 2), (1, 1, 1, 1), include=include)
        qg = quantize_model(g, data([2, 9, 10, 5], 8), settings("per_tensor_asymmetric", 8))
        node, inp = qg.node("op"), qg.node("op").inputs[0]
        out = node.outputs[0]
        op, ip = params_of(node, out), params_of(node, inp)
        assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (ip.scale, ip.zerop, ip.qmin, ip.qmax, inp.dtype)
        assert set(node.params) - set(g.node("op").params) == {"is_perf_mode", "unquantifiable",
                                                               "activation_quantization_axis"}
        assert not node.constants


def test_quantizing_other_pooling_methods_is_unsupported() -> None:
    g = pool_graph("MAX", (2, 2), (2, 2), (0, 0, 0, 0))
    with pytest.raises(UnsupportedError, match="LP3"):
        _quantize_lp3(g)


def _quantize_lp3(g) -> None:
    """Calibrate as MAX, then ask for a quantization of a method that does not exist."""
    from quantopt.calibration.collect import calibrate_graph, collect_activation_statistics
    from quantopt.config.layer_settings import LayerSettings
    from quantopt.quantizer import quantize_graph

    g.node("op").params["method"] = "MAX"
    for n in g.nodes:
        n.settings = LayerSettings(q_strategy_activation="extrema")
    collect_activation_statistics(g, [[x] for x in data([1, 9, 10, 5], 9)])
    calibrate_graph(g)
    g.node("op").params["method"] = "LP3"
    quantize_graph(g)


# ------------------------------------------------------------------------------------------------ BatchNorm
def bn_graph(seed: int, axis: int = 3, act: str = "NONE", mean_var: bool = False, shape=(1, 6, 7, 5),
             weights_4d: bool = False):
    r = _rng(seed)
    c = shape[axis]
    w = r.uniform(0.2, 2.0, size=(c,)).astype(np.float32) * r.choice([-1, 1], size=(c,))
    consts = {"weights": w.reshape(1, 1, 1, c) if weights_4d else w,
              "biases": r.normal(0, 0.5, size=(c,)).astype(np.float32)}
    if mean_var:
        consts.update(mean=r.normal(0, 0.3, size=(c,)).astype(np.float32),
                      var=r.uniform(0.5, 2.0, size=(c,)).astype(np.float32))
    params = {"axis": axis, "epsilon": 1e-5, "with_activation": act}
    if act == "CLIP":
        params.update(clip_min=-0.5, clip_max=1.5)
    g = GraphBuilder("bn")
    y = g.layer("BatchNorm", [g.input("x", list(shape))], [list(shape)], name="op", params=params, constants=consts)
    return g.build([y])


def requant_params(node):
    if "scale" in node.constants:
        return node.constants["scale"].betensor.numpy(), node.constants["shift"].betensor.numpy()
    return node.params["scale_value"], node.params["shift_value"]


def ref_bn(node, x_q: np.ndarray) -> np.ndarray:
    """acc = x_q * (w_q + zp_w) + b_q per channel of `axis`, per-channel requant, fused activation bounds."""
    axis = node.params["axis"] % x_q.ndim
    w = node.constants["weights"].betensor.numpy().astype(np.int64).reshape(-1)
    if "weights_zp" in node.constants:  # per-channel weights
        zp_w = node.constants["weights_zp"].betensor.numpy().astype(np.int64).reshape(-1)
    else:  # per-tensor weights: one zero point
        zp_w = np.int64(node.params["weights_zp"])
    b = node.constants["biases"].betensor.numpy().astype(np.int64).reshape(-1)
    x = np.moveaxis(x_q.astype(np.int64), axis, -1)
    acc = x * (w + zp_w) + b
    mult, shift = requant_params(node)
    zp_out, qmin, qmax = out_info(node)
    y = ref_act_bounds(node, ref_requant(acc, mult, shift, zp_out, qmin, qmax))
    return np.moveaxis(y, -1, axis)


@pytest.mark.parametrize("mode,bits", ACT_MODES)
@pytest.mark.parametrize("act", ["NONE", "RELU", "RELU6", "CLIP"])
def test_batchnorm_integer_forward_matches_reference(act: str, mode: str, bits: int) -> None:
    g = bn_graph(10, act=act)
    qg = quantize_model(g, data([2, 6, 7, 5], 11), settings(mode, bits))
    node = qg.node("op")
    qg.forward([data([2, 6, 7, 5], 12, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_bn(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("scale_up", [1, 2 ** 20])
def test_batchnorm_inputs_within_and_beyond_the_float64_bound_match_reference(scale_up: int) -> None:
    """The one multiply-add path (`_quant.scaled_product_finish`) takes inputs whose products stay below 2^53;
    inputs 2^20 times larger (products beyond it) take the accumulator's path: both the reference's integers."""
    g = bn_graph(10, act="RELU6")
    qg = quantize_model(g, data([2, 6, 7, 5], 11), settings(*ACT_MODES[0]))
    node = qg.node("op")
    qg.forward([data([2, 6, 7, 5], 12, 1)[0]])
    x = node.inputs[0].betensor * scale_up
    x[0, 0, 0, :2] = torch.tensor([-128, 127]) * scale_up
    node.inputs[0].betensor = x
    node.forward()
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_bn(node, x.numpy()))


@pytest.mark.parametrize("wmode", ["per_channel_asymmetric", "per_tensor_symmetric_full_range"])
@pytest.mark.parametrize("mode,bits", ACT_MODES[2:])
def test_batchnorm_weight_modes_and_4d_weights_match_reference(tmp_path, wmode: str, mode: str, bits: int) -> None:
    g = bn_graph(41, act="CLIP", weights_4d=True)
    qg = quantize_model(g, data([2, 6, 7, 5], 42), settings(mode, bits, q_mode_weight=wmode))
    node = qg.node("op")
    assert list(node.constants["weights"].ir_shape) == [5]
    x = data([2, 6, 7, 5], 43, 1)[0]
    before = qg.forward([x])[0].clone()
    np.testing.assert_array_equal(before.numpy(), ref_bn(node, node.inputs[0].betensor.numpy()))
    txt, _ = write_ir(qg, str(tmp_path / "bn.txt"))
    assert torch.equal(read_ir(txt).forward([x])[0], before)


@pytest.mark.parametrize("mode,bits", ACT_MODES[2:])
def test_batchnorm_middle_axis_and_mean_var_match_reference(mode: str, bits: int) -> None:
    g = bn_graph(13, axis=1, mean_var=True, shape=(1, 4, 6, 3))
    qg = quantize_model(g, data([2, 4, 6, 3], 14), settings(mode, bits))
    node = qg.node("op")
    assert "mean" not in node.constants and "var" not in node.constants
    qg.forward([data([2, 4, 6, 3], 15, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_bn(node, node.inputs[0].betensor.numpy()))


def test_batchnorm_weights_default_to_16_bits_and_store_per_channel_requant() -> None:
    per_channel = settings("per_tensor_asymmetric", 8, q_mode_weight="per_channel_symmetric_restricted_range")
    qg = quantize_model(bn_graph(16), data([2, 6, 7, 5], 17), per_channel)
    node = qg.node("op")
    assert node.constants["weights"].dtype == Dtype.INT16
    assert node.constants["biases"].dtype == Dtype.INT32
    assert node.constants["scale"].dtype == Dtype.UINT16 and node.constants["shift"].dtype == Dtype.INT8
    assert node.constants["scale"].betensor.numel() == 5
    assert node.settings.q_bits_weight == 16  # what the layer used, as the JSON template shows it


def test_batchnorm_per_tensor_weights_store_one_requant_pair() -> None:
    """Per-tensor weight modes give one weight scale and one multiplier/shift pair, as upstream's linear layers."""
    qg = quantize_model(bn_graph(16), data([2, 6, 7, 5], 17), settings("per_tensor_asymmetric", 8))
    node = qg.node("op")
    assert node.constants["weights"].dtype == Dtype.INT16
    assert "scale" not in node.constants and "weights_scale" not in node.constants
    assert isinstance(node.params["weights_scale"], float) and node.params["shift_type"] == Dtype.INT8
    assert int(node.constants["weights"].betensor.abs().max()) == 32767
    wide = quantize_model(bn_graph(16), data([2, 6, 7, 5], 17), settings("per_tensor_asymmetric", 8,
                                                                           q_bits_weight=16, q_bits_bias=48))
    assert wide.node("op").constants["weights"].dtype == Dtype.INT16


@pytest.mark.parametrize("bits,dtype", [(8, Dtype.INT8), (12, Dtype.ALIGNED_INT12), (4, Dtype.ALIGNED_INT4)])
def test_batchnorm_weight_bits_set_for_the_layer_are_honoured(bits: int, dtype: Dtype) -> None:
    """A per-layer q_bits_weight below 16 wins over BatchNorm's 16-bit default; the weights use that range."""
    qg = quantize_model(bn_graph(16), data([2, 6, 7, 5], 17), settings("per_tensor_asymmetric", 8),
                        per_layer={"op": {"q_bits_weight": bits}})
    node = qg.node("op")
    w = node.constants["weights"]
    assert w.dtype == dtype and node.settings.q_bits_weight == bits
    assert int(w.betensor.abs().max()) <= 2 ** (bits - 1) - 1
    assert int(w.betensor.abs().max()) > 2 ** (bits - 2)  # the range is used, not just bounded


# ------------------------------------------------------------------------------------------------ Pad
NHWC_PADS = [[0, 0], [1, 2], [2, 0], [0, 1]]


def pad_graph(mode: str, value: float = 0.0, pads=NHWC_PADS, shape=(1, 5, 6, 3)):
    out_shape = [s + b + e for s, (b, e) in zip(shape, pads)]
    g = GraphBuilder("pad")
    y = g.layer("Pad", [g.input("x", list(shape))], [out_shape], name="op",
                params={"pads": pads, "mode": mode, "constant_value": value})
    return g.build([y])


def ref_pad_value(node, node_in, value: float) -> int:
    """The quantized constant: round_half_even(float32(scale) * float32(v) - zp), clamped (node_in: node's input)."""
    q = params_of(node, node_in)
    v = np.float32(q.scale) * np.float32(value) - np.float32(q.zerop)
    return int(min(max(int(np.round(v)), q.qmin), q.qmax))


NP_MODES = {"CONSTANT": "constant", "REFLECT": "reflect", "SYMMETRIC": "symmetric", "EDGE": "edge"}


@pytest.mark.parametrize("mode,bits", ACT_MODES)
@pytest.mark.parametrize("pad_mode,value", [("CONSTANT", 0.0), ("CONSTANT", -0.77), ("CONSTANT", 100.0),
                                            ("REFLECT", 0.0), ("SYMMETRIC", 0.0), ("EDGE", 0.0)])
def test_pad_integer_forward_matches_reference(pad_mode: str, value: float, mode: str, bits: int) -> None:
    g = pad_graph(pad_mode, value)
    qg = quantize_model(g, data([2, 5, 6, 3], 18), settings(mode, bits))
    node = qg.node("op")
    inp = node.inputs[0]
    assert node.params["constant_value"] == ref_pad_value(node, inp, value)
    qg.forward([data([2, 5, 6, 3], 19, 1)[0]])
    x = inp.betensor.numpy()
    kw = {"constant_values": node.params["constant_value"]} if pad_mode == "CONSTANT" else {}
    want = np.pad(x, [tuple(p) for p in NHWC_PADS], mode=NP_MODES[pad_mode], **kw)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)
    out = node.outputs[0]
    op, ip = params_of(node, out), params_of(node, inp)
    assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (ip.scale, ip.zerop, ip.qmin, ip.qmax, inp.dtype)


# ------------------------------------------------------------------------------------------------ MatMul
MATMUL_CASES = [
    # a shape, b shape, trans_a, trans_b
    ((2, 3, 4, 6), (3, 6, 5), False, False),  # batch broadcasting
    ((2, 6, 4), (2, 5, 6), True, True),
    ((1, 7, 9), (9, 4), False, False),
    ((3, 9, 7), (1, 4, 9), True, True),
]


def matmul_graph(a_shape, b_shape, ta: bool, tb: bool, act: str = "NONE", in_dtype: Dtype = Dtype.FP32):
    a_t = np.zeros(a_shape)
    b_t = np.zeros(b_shape)
    a_t = np.swapaxes(a_t, -1, -2) if ta else a_t
    b_t = np.swapaxes(b_t, -1, -2) if tb else b_t
    out_shape = list(np.matmul(a_t, b_t).shape)
    params = {"trans_a": ta, "trans_b": tb, "with_activation": act}
    if act == "CLIP":
        params.update(clip_min=-0.5, clip_max=1.5)
    g = GraphBuilder("mm")
    y = g.layer("MatMul", [g.input("a", list(a_shape), in_dtype), g.input("b", list(b_shape), in_dtype)],
                [out_shape], name="op", params=params)
    return g.build([y])


def mm_data(a_shape, b_shape, seed: int, n: int = 3) -> List[List[torch.Tensor]]:
    return [[a, b] for a, b in zip(data(a_shape, seed, n, loc=0.2), data(b_shape, seed + 100, n, loc=-0.4))]


def ref_matmul_acc(node) -> np.ndarray:
    ta, tb = node.inputs
    a = ta.betensor.numpy().astype(np.int64) + int(params_of(node, ta).zerop)
    b = tb.betensor.numpy().astype(np.int64) + int(params_of(node, tb).zerop)
    if node.params["trans_a"]:
        a = np.swapaxes(a, -1, -2)
    if node.params["trans_b"]:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


def ref_matmul(node) -> np.ndarray:
    zp_out, qmin, qmax = out_info(node)
    acc = ref_matmul_acc(node)
    return ref_act_bounds(node, ref_requant(acc, node.params["scale_value"], node.params["shift_value"], zp_out,
                                            qmin, qmax))


@pytest.mark.parametrize("mode,bits", ACT_MODES)
@pytest.mark.parametrize("case", MATMUL_CASES)
def test_matmul_integer_forward_matches_reference(case, mode: str, bits: int) -> None:
    a_shape, b_shape, ta, tb = case
    g = matmul_graph(a_shape, b_shape, ta, tb)
    qg = quantize_model(g, mm_data(a_shape, b_shape, 20), settings(mode, bits))
    node = qg.node("op")
    qg.forward(mm_data(a_shape, b_shape, 21, 1)[0])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_matmul(node))


@pytest.mark.parametrize("shift", [1, 2, 3, 9, 24])
@pytest.mark.parametrize("mode,bits", [("per_tensor_asymmetric", 8), ("per_tensor_symmetric_full_range", 16)])
def test_matmul_requantization_at_every_shift_matches_reference(shift: int, mode: str, bits: int) -> None:
    """The float accumulator's requantization, by the addition of 1.5·2^52 (shift >= 3) or by round_ (smaller
    shifts), against the reference with the layer's multiplier and zero point, at shifts the quantizer did not pick
    (both read the params alike)."""
    a_shape, b_shape, ta, tb = MATMUL_CASES[0]
    g = matmul_graph(a_shape, b_shape, ta, tb)
    qg = quantize_model(g, mm_data(a_shape, b_shape, 24), settings(mode, bits))
    node = qg.node("op")
    node.params["shift_value"] = shift
    node.params["scale_value"] = 3 + 2 ** max(0, shift - 4)  # outputs spread over the range, the clamps reached
    qg.forward(mm_data(a_shape, b_shape, 25, 1)[0])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_matmul(node))


@pytest.mark.parametrize("act", ["RELU", "RELU6", "CLIP"])
def test_matmul_fused_activation_matches_reference(act: str) -> None:
    a_shape, b_shape, ta, tb = MATMUL_CASES[0]
    g = matmul_graph(a_shape, b_shape, ta, tb, act=act)
    qg = quantize_model(g, mm_data(a_shape, b_shape, 22), settings("per_tensor_asymmetric", 8))
    node = qg.node("op")
    assert (params_of(node, node.outputs[0]).qmin < 0) == (act == "CLIP")
    qg.forward(mm_data(a_shape, b_shape, 23, 1)[0])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_matmul(node))


def test_matmul_16_bit_remain_shift_matches_reference() -> None:
    a_shape, b_shape, ta, tb = MATMUL_CASES[2]
    g = matmul_graph(a_shape, b_shape, ta, tb)
    qg = quantize_model(g, mm_data(a_shape, b_shape, 24), settings("per_tensor_symmetric_full_range", 16,
                                                                     remain_shift=4))
    node = qg.node("op")
    assert node.params["remain_shift"] == 4
    qg.forward(mm_data(a_shape, b_shape, 25, 1)[0])
    shift = node.params["shift_value"]
    assert shift > 4
    pre = ref_requant(ref_matmul_acc(node), 1, shift - 4, 0, -(2 ** 31), 2 ** 31 - 1)
    zp_out, qmin, qmax = out_info(node)
    want = ref_requant(pre, node.params["scale_value"], 4, zp_out, qmin, qmax)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)


def test_matmul_of_integer_inputs_is_an_exact_integer_passthrough() -> None:
    a_shape, b_shape, ta, tb = MATMUL_CASES[0]
    g = matmul_graph(a_shape, b_shape, ta, tb, in_dtype=Dtype.INT8)
    r = _rng(26)
    feeds = [[torch.from_numpy(r.integers(-20, 20, size=a_shape)).to(torch.int8),
              torch.from_numpy(r.integers(-20, 20, size=b_shape)).to(torch.int8)] for _ in range(2)]
    qg = quantize_model(g, feeds, settings("per_tensor_symmetric_full_range", 8))
    node = qg.node("op")
    out = node.outputs[0]
    op = params_of(node, out)
    assert op.qinvariant and op.scale == 1.0 and op.zerop == 0 and out.dtype == Dtype.INT16
    assert (node.params["scale_value"], node.params["shift_value"]) == (1, 0)
    qg.forward(feeds[0])
    want = np.matmul(feeds[0][0].numpy().astype(np.int64), feeds[0][1].numpy().astype(np.int64))
    np.testing.assert_array_equal(out.betensor.numpy(), want)


def test_matmul_ir_keys_and_dtypes() -> None:
    a_shape, b_shape, ta, tb = MATMUL_CASES[1]
    qg = quantize_model(matmul_graph(a_shape, b_shape, ta, tb), mm_data(a_shape, b_shape, 27),
                        settings("per_tensor_symmetric_full_range", 8))
    p = qg.node("op").params
    assert p["scale_type"] == Dtype.UINT8 and p["shift_type"] == Dtype.INT8
    assert isinstance(p["scale_value"], int) and isinstance(p["shift_value"], int)
    assert "remain_shift" not in p


def test_exact_requant_and_division_helpers_against_python_ints() -> None:
    """The int64 helpers behind MatMul and AVG, on ties, negative values, huge accumulators and shifts <= 0."""
    from quantopt.ops.linear import requantize_exact
    from quantopt.quant.rounding import div_round_half_even, round_shift

    r = _rng(40)
    acc = np.concatenate([r.integers(-2 ** 40, 2 ** 40, size=300), r.integers(-64, 64, size=200),
                          np.array([2 ** 62, -(2 ** 62), 0, 1, -1, 3, -3, 5, -5])]).astype(np.int64)
    t = torch.from_numpy(acc)
    for mult, shift in [(1, 1), (3, 2), (255, 8), (32767, 31), (17955, 29), (1, 0), (5, -3), (32767, -20)]:
        got = requantize_exact(t, mult, shift).numpy()
        want = [(int(a) * mult) << (-shift) if shift <= 0 else rhe_div(int(a) * mult, 1 << shift) for a in acc]
        want = np.clip(np.array([min(max(v, -(2 ** 41)), 2 ** 41) for v in want]), -(2 ** 40), 2 ** 40)
        np.testing.assert_array_equal(np.clip(got, -(2 ** 40), 2 ** 40), want, err_msg=f"M={mult} shift={shift}")
    small = torch.from_numpy(acc[300:])
    for shift in (1, 2, 5):
        np.testing.assert_array_equal(round_shift(small, shift).numpy(),
                                      [rhe_div(int(a), 1 << shift) for a in acc[300:]])
    num = torch.from_numpy(r.integers(-5000, 5000, size=400))
    den = torch.from_numpy(r.integers(1, 12, size=400))
    np.testing.assert_array_equal(div_round_half_even(num, den).numpy(),
                                  [rhe_div(int(a), int(b)) for a, b in zip(num, den)])


# ------------------------------------------------------------------------------------------------ all ops
def _build(op: str, variant: int = 0):
    """(float graph, calibration batches) of each op."""
    if op == "max":
        return pool_graph("MAX", (3, 3), (2, 2), (1, 1, 1, 1), ceil=True), data([2, 9, 10, 5], 30)
    if op == "avg":
        return (pool_graph("AVG", (3, 3), (2, 2), (1, 0, 1, 1), ceil=True, include=bool(variant)),
                data([2, 9, 10, 5], 31))
    if op == "avg1d":
        return (pool_graph("AVG", (1, 3), (1, 1), (1, 1, 0, 0), include=True, shape=(2, 11, 4), one_d=True),
                data([2, 11, 4], 32))
    if op == "bn":
        return bn_graph(33, act="RELU", mean_var=bool(variant)), data([2, 6, 7, 5], 34)
    if op == "pad":
        return pad_graph(["CONSTANT", "REFLECT", "EDGE"][variant], -0.3), data([2, 5, 6, 3], 35)
    a_shape, b_shape, ta, tb = MATMUL_CASES[variant]
    return matmul_graph(a_shape, b_shape, ta, tb), mm_data(a_shape, b_shape, 36)


OPS = [("max", 0), ("avg", 0), ("avg", 1), ("avg1d", 0), ("bn", 0), ("bn", 1), ("pad", 0), ("pad", 1),
       ("matmul", 0), ("matmul", 1)]


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("op,variant", OPS)
def test_float_vs_dequantized_cosine(op: str, variant: int, bits: int, threshold: float) -> None:
    g, batches = _build(op, variant)
    qg = quantize_model(g, batches, settings("per_tensor_symmetric_full_range", bits, q_bits_weight=bits))
    feed = batches[0] if isinstance(batches[0], list) else [batches[0]]
    ref = g.forward(feed)[0].clone()
    got = run_quantized(qg, feed)[0]
    assert cosine(ref, got) > threshold


@pytest.mark.parametrize("mode,bits", [ACT_MODES[0], ACT_MODES[2], ACT_MODES[3]])
@pytest.mark.parametrize("op,variant", OPS + [("pad", 2)])
def test_written_ir_reloads_bit_identical(tmp_path, op: str, variant: int, mode: str, bits: int) -> None:
    g, batches = _build(op, variant)
    qg = quantize_model(g, batches, settings(mode, bits))
    feed = batches[1] if isinstance(batches[1], list) else [batches[1]]
    before = qg.forward(feed)[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    after = re.forward(feed)[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)
