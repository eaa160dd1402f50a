"""Convolution / DepthwiseConv / FullyConnected: integer forward against an independent numpy int64 reference
(docs/integer-semantics.md, MAC ops), float-vs-dequantized cosine, and IR write → re-load bit identity."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

MODES = [
    ("per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range"),
    ("per_channel_symmetric_restricted_range", "per_tensor_asymmetric"),
    ("per_tensor_asymmetric", "per_tensor_asymmetric"),
    ("per_channel_asymmetric", "per_tensor_symmetric_restricted_range"),
]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def conv_graph(seed: int, act: str = "NONE", depthwise: bool = False, group: int = 1, with_bias: bool = True):
    r = _rng(seed)
    cin, cout = (6, 6) if depthwise else (6, 8)
    g = GraphBuilder("conv")
    x = g.input("x", [1, 9, 9, cin])
    w = r.normal(0, 0.5, size=(cout, 3, 3, 1 if depthwise else cin // group)).astype(np.float32)
    consts = {"weights": w}
    if with_bias:
        consts["biases"] = r.normal(0, 0.3, size=(cout,)).astype(np.float32)
    params = dict(num_output=cout, kernel_x=3, kernel_y=3, stride_x=2, stride_y=1, pad_left=1, pad_right=0,
                  pad_top=2, pad_bottom=1, dilation_x=1, dilation_y=1, group=cin if depthwise else group,
                  with_activation=act)
    if act == "CLIP":
        params.update(clip_min=-0.5, clip_max=1.5)
    y = g.layer("DepthwiseConv" if depthwise else "Convolution", [x], [[1, 10, 4, cout]], name="conv",
                params=params, constants=consts)
    return g.build([y])


def fc_graph(seed: int, act: str = "NONE"):
    r = _rng(seed)
    g = GraphBuilder("fc")
    x = g.input("x", [1, 20])
    y = g.layer("FullyConnected", [x], [[1, 7]], name="fc",
                params=dict(num_output=7, with_activation=act),
                constants={"weights": r.normal(0, 0.4, size=(7, 20)).astype(np.float32),
                           "biases": r.normal(0, 0.2, size=(7,)).astype(np.float32)})
    return g.build([y])


def calib(shape, seed: int, n: int = 4):
    r = _rng(seed)
    return [torch.from_numpy(r.normal(0.3, 1.0, size=shape).astype(np.float32)) for _ in range(n)]


# --- independent reference (numpy int64, written from docs/integer-semantics.md) ---------------------------------
def ref_requant(acc: np.ndarray, mult, shift, zp_out: int, qmin: int, qmax: int) -> np.ndarray:
    """round_half_even(acc * M / 2^shift) - zp_out, clamped; exact with python integers."""
    acc = acc.astype(np.int64)
    mult = np.broadcast_to(np.asarray(mult, dtype=np.int64), acc.shape)
    shift = np.broadcast_to(np.asarray(shift, dtype=np.int64), acc.shape)
    out = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        num = int(acc[idx]) * int(mult[idx])
        s = int(shift[idx])
        if s <= 0:
            v = num << (-s)
        else:
            q, rem = divmod(num, 1 << s)  # floor division, 0 <= rem < 2^s
            half = 1 << (s - 1)
            v = q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)
        out[idx] = min(max(v - zp_out, qmin), qmax)
    return out


def ref_conv(node, x_q: np.ndarray) -> np.ndarray:
    p = node.params
    w = node.constants["weights"].betensor.numpy().astype(np.int64)
    if "weights_zp" in node.constants:
        w = w + node.constants["weights_zp"].betensor.numpy().astype(np.int64).reshape(-1, 1, 1, 1)
    else:
        w = w + int(p.get("weights_zp", 0))
    b = node.constants["biases"].betensor.numpy().astype(np.int64)
    zp_in = int(params_of(node, node.inputs[0]).zerop)
    n, h, wd, cin = x_q.shape
    xp = np.full((n, h + p["pad_top"] + p["pad_bottom"], wd + p["pad_left"] + p["pad_right"], cin), -zp_in,
                 dtype=np.int64)
    xp[:, p["pad_top"]:p["pad_top"] + h, p["pad_left"]:p["pad_left"] + wd, :] = x_q
    cout, kh, kw, cin_g = w.shape
    group = p["group"]
    oh = (xp.shape[1] - kh) // p["stride_y"] + 1
    ow = (xp.shape[2] - kw) // p["stride_x"] + 1
    acc = np.zeros((n, oh, ow, cout), dtype=np.int64)
    per_group_out = cout // group
    for co in range(cout):
        gi = co // per_group_out
        for i in range(oh):
            for j in range(ow):
                patch = xp[:, i * p["stride_y"]:i * p["stride_y"] + kh, j * p["stride_x"]:j * p["stride_x"] + kw,
                           gi * cin_g:(gi + 1) * cin_g]
                acc[:, i, j, co] = (patch * w[co]).reshape(n, -1).sum(axis=1) + b[co]
    return acc


def requant_params(node):
    if "scale" in node.constants:
        return node.constants["scale"].betensor.numpy(), node.constants["shift"].betensor.numpy()
    return node.params["scale_value"], node.params["shift_value"]


def ref_clamp_act(node, y: np.ndarray) -> np.ndarray:
    act = node.params.get("with_activation", "NONE")
    out = params_of(node, node.outputs[0])
    if act not in ("RELU", "RELU6", "CLIP"):
        return y
    lo, hi = {"RELU": (0.0, 1e30), "RELU6": (0.0, 6.0)}.get(act, (node.params.get("clip_min"),
                                                                   node.params.get("clip_max")))
    q = [min(max(int(np.round(np.float64(v) * np.float64(out.scale) - out.zerop)), out.qmin), out.qmax)
         for v in (lo, hi)]
    return np.clip(y, q[0], q[1])


def check_against_reference(qg, x_float: torch.Tensor) -> None:
    qg.forward([x_float])
    node = qg.node("conv") if any(n.name == "conv" for n in qg.nodes) else qg.node("fc")
    x_q = node.inputs[0].betensor.numpy()
    if node.type == "FullyConnected":
        w = node.constants["weights"].betensor.numpy().astype(np.int64) + int(node.params.get("weights_zp", 0))
        if "weights_zp" in node.constants:
            w = node.constants["weights"].betensor.numpy().astype(np.int64) + \
                node.constants["weights_zp"].betensor.numpy().astype(np.int64)[:, None]
        acc = x_q.astype(np.int64) @ w.T + node.constants["biases"].betensor.numpy().astype(np.int64)
    else:
        acc = ref_conv(node, x_q)
    mult, shift = requant_params(node)
    out = params_of(node, node.outputs[0])
    want = ref_clamp_act(node, ref_requant(acc, mult, shift, int(out.zerop), out.qmin, out.qmax))
    got = node.outputs[0].betensor.numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wmode,amode", MODES)
@pytest.mark.parametrize("act", ["NONE", "RELU", "RELU6", "CLIP"])
def test_conv_integer_forward_matches_reference(wmode: str, amode: str, act: str) -> None:
    g = conv_graph(1, act)
    qg = quantize_model(g, calib([2, 9, 9, 6], 2), {"q_mode_weight": wmode, "q_mode_activation": amode})
    check_against_reference(qg, calib([3, 9, 9, 6], 3, 1)[0])


@pytest.mark.parametrize("wmode", [m[0] for m in MODES])
def test_depthwise_and_grouped_conv_match_reference(wmode: str) -> None:
    for g in (conv_graph(4, "RELU", depthwise=True), conv_graph(5, "NONE", group=2)):
        qg = quantize_model(g, calib([2, 9, 9, 6], 6), {"q_mode_weight": wmode})
        check_against_reference(qg, calib([2, 9, 9, 6], 7, 1)[0])


@pytest.mark.parametrize("wmode,amode", MODES)
def test_fc_integer_forward_matches_reference(wmode: str, amode: str) -> None:
    qg = quantize_model(fc_graph(8, "RELU"), calib([4, 20], 9), {"q_mode_weight": wmode, "q_mode_activation": amode})
    check_against_reference(qg, calib([5, 20], 10, 1)[0])


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("build", ["conv", "depthwise", "fc"])
def test_float_vs_dequantized_cosine(bits: int, threshold: float, build: str) -> None:
    g = {"conv": lambda: conv_graph(11), "depthwise": lambda: conv_graph(12, depthwise=True),
         "fc": lambda: fc_graph(13)}[build]()
    shape = [2, 20] if build == "fc" else [2, 9, 9, 6]
    data = calib(shape, 14)
    # extrema calibration: the test data lies inside the calibrated range, so only rounding error remains
    qg = quantize_model(g, data, {"q_bits_activation": bits, "q_bits_weight": bits, "q_bits_bias": 48 if bits > 8
                                  else 32, "q_strategy_activation": "extrema"})
    ref = g.forward([data[0]])[0].clone()
    got = run_quantized(qg, data[0])[0]
    assert cosine(ref, got) > threshold


def test_sixteen_bit_with_remain_shift_matches_reference() -> None:
    g = conv_graph(15)
    qg = quantize_model(g, calib([2, 9, 9, 6], 16), {"q_bits_activation": 16, "q_bits_weight": 16,
                                                     "q_bits_bias": 48, "remain_shift": 8})
    node = qg.node("conv")
    assert node.params["remain_shift"] == 8
    qg.forward([calib([1, 9, 9, 6], 17, 1)[0]])
    x_q = node.inputs[0].betensor.numpy()
    acc_nobias = ref_conv(node, x_q) - node.constants["biases"].betensor.numpy().astype(np.int64)
    mult, shift = requant_params(node)
    d = shift - 8
    # pre-shift: round-half-even of acc / 2^d clipped to int32, plus the bias floor-shifted by d and clipped
    pre = ref_requant(acc_nobias, 1, d, 0, -(2 ** 31), 2 ** 31 - 1)
    b = np.clip(node.constants["biases"].betensor.numpy().astype(np.int64) >> d, -(2 ** 31), 2 ** 31 - 1)
    out = params_of(node, node.outputs[0])
    want = ref_requant(pre + b, mult, 8, int(out.zerop), out.qmin, out.qmax)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)


@pytest.mark.parametrize("wmode,amode", MODES)
def test_written_ir_reloads_bit_identical(tmp_path, wmode: str, amode: str) -> None:
    g = conv_graph(18, "RELU")
    data = calib([2, 9, 9, 6], 19)
    qg = quantize_model(g, data, {"q_mode_weight": wmode, "q_mode_activation": amode})
    before = qg.forward([data[0]])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    after = re.forward([data[0]])[0]
    assert torch.equal(before, after)
