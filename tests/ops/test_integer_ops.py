"""MatMulInteger and FakeQuantWithMinMaxVars.

MatMulInteger: exact int32 result against numpy int64 (a - a_zp) @ (b - b_zp) on integer model inputs, float and
quantized (integer output, scale 1), refused quantized float inputs, non-integer float inputs, three inputs.
FakeQuantWithMinMaxVars: float forward against a numpy re-implementation of TensorFlow's nudged fake quantization
(from docs/semantics/integer-models.md), narrow range, the three nudging branches; quantized params copied from the
input and the integer forward equal to the input integers clamped to the nudged range (plain Python reference)."""
from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype


def settings(bits: int = 8, mode: str = "per_tensor_symmetric_full_range", **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema", **extra)


# --- MatMulInteger --------------------------------------------------------------------------------------------------
def mmi_graph(a_shape, b_shape, out_shape, azp: int, bzp: int, dtype=Dtype.INT8, float_inputs: bool = False):
    b = GraphBuilder("t")
    a = b.input("a", a_shape, dtype=Dtype.FP32 if float_inputs else dtype)
    w = b.input("b", b_shape, dtype=Dtype.FP32 if float_inputs else dtype)
    y = b.layer("MatMulInteger", [a, w], [out_shape], name="op", params={"a_zero_point": azp, "b_zero_point": bzp},
                output_dtypes=[Dtype.INT32])
    return b.build([y])


@pytest.mark.parametrize("dtype,lo,hi", [(Dtype.INT8, -128, 128), (Dtype.UINT8, 0, 256), (Dtype.INT16, -32768, 32768)])
def test_matmul_integer_exact(tmp_path, dtype, lo: int, hi: int) -> None:
    g = mmi_graph([2, 3, 40], [2, 40, 5], [2, 3, 5], 7, -3, dtype)
    rng = np.random.default_rng(0)
    an = rng.integers(lo, hi, size=(2, 3, 40))
    bn = rng.integers(lo, hi, size=(2, 40, 5))
    want = np.clip((an - 7) @ (bn + 3), -2 ** 31, 2 ** 31 - 1)
    f = [torch.from_numpy(an), torch.from_numpy(bn)]
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), want)
    qg = quantize_model(g, [f], settings())
    out = qg.node("op").outputs[0]
    op = params_of(qg.node("op"), out)
    assert op.qinvariant and op.scale == 1.0 and out.dtype == Dtype.INT32 and (op.qmin, op.qmax) == (-2 ** 31,
                                                                                                     2 ** 31 - 1)
    np.testing.assert_array_equal(qg.forward(f)[0].numpy(), want)
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    np.testing.assert_array_equal(re.forward(f)[0].numpy(), want)


def test_matmul_integer_saturates_int32() -> None:
    g = mmi_graph([1, 1, 70000], [1, 70000, 1], [1, 1, 1], 0, 0, Dtype.INT16)
    f = [torch.full((1, 1, 70000), -32768), torch.full((1, 70000, 1), -32768)]
    assert int(g.forward(f)[0]) == 2 ** 31 - 1  # 70000 · 2^30 needs int64, then saturates


def test_matmul_integer_bad_inputs() -> None:
    g = mmi_graph([1, 2, 3], [1, 3, 2], [1, 2, 2], 0, 0, float_inputs=True)
    with pytest.raises(IRError, match="non-integer"):
        g.forward([torch.full((1, 2, 3), 0.5), torch.ones(1, 3, 2)])
    f = [torch.ones(1, 2, 3), torch.ones(1, 3, 2)]
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), np.full((1, 2, 2), 3))
    with pytest.raises(UnsupportedError, match="needs integer inputs"):
        quantize_model(g, [f], settings())  # float model inputs are quantized tensors, not integers
    g = mmi_graph([1, 2, 3], [1, 4, 2], [1, 2, 2], 0, 0)
    with pytest.raises(IRError, match="cannot be multiplied"):
        g.forward([torch.ones(1, 2, 3, dtype=torch.int64), torch.ones(1, 4, 2, dtype=torch.int64)])


def test_matmul_integer_three_inputs() -> None:
    b = GraphBuilder("t")
    a = b.input("a", [2, 2], dtype=Dtype.INT8)
    w = b.input("b", [2, 2], dtype=Dtype.INT8)
    z = b.input("z", [1], dtype=Dtype.INT8)
    y = b.layer("MatMulInteger", [a, w, z], [[2, 2]], name="op", output_dtypes=[Dtype.INT32])
    g = b.build([y])
    with pytest.raises(IRError, match="exactly 2 inputs"):
        g.forward([torch.ones(2, 2, dtype=torch.int64)] * 2 + [torch.zeros(1, dtype=torch.int64)])


# --- FakeQuantWithMinMaxVars ----------------------------------------------------------------------------------------
def fq_graph(lo: float, hi: float, bits: int = 8, narrow: bool = False):
    b = GraphBuilder("t")
    x = b.input("x", [2, 50])
    y = b.layer("FakeQuantWithMinMaxVars", [x], [[2, 50]], name="op",
                params={"min": lo, "max": hi, "num_bits": bits, "narrow_range": narrow})
    return b.build([y])


def ref_fake_quant(x: np.ndarray, lo: float, hi: float, bits: int, narrow: bool) -> np.ndarray:
    """Nudge [lo, hi], then round x to the grid of the unsigned asymmetric params of the nudged range."""
    f32 = np.float32
    lo, hi = f32(lo), f32(hi)
    if lo > 0:
        lo_a, hi_a = f32(0), f32(hi - lo)
    elif hi < 0:
        lo_a, hi_a = f32(lo - hi), f32(0)
    else:
        step = f32((hi - lo) / f32(2 ** bits - 1))
        lo_a = f32(step * np.round(lo / step))
        hi_a = f32(hi + lo_a - lo)
    mn, mx = min(float(lo_a), 0.0), max(float(hi_a), 0.0)
    qmax = 2 ** bits - 1
    scale = f32(f32(qmax) / f32(mx - mn))
    zp = int(np.clip(np.round(scale * f32(mn)), -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1))
    q = np.clip(np.round(scale * x.astype(np.float32) - f32(zp)), 1 if narrow else 0, qmax)
    y = (q + f32(zp)).astype(np.float32) * f32(f32(1) / scale)
    return np.clip(y, lo_a, hi_a)


@pytest.mark.parametrize("lo,hi,bits,narrow", [(-1.3, 2.1, 8, False), (-1.3, 2.1, 8, True), (0.4, 3.0, 4, False),
                                               (-3.0, -0.5, 8, False), (-2.0, 2.0, 16, False)])
def test_fake_quant_float(lo: float, hi: float, bits: int, narrow: bool) -> None:
    g = fq_graph(lo, hi, bits, narrow)
    x = np.random.default_rng(1).uniform(-4, 4, size=(2, 50)).astype(np.float32)
    got = g.forward([torch.from_numpy(x)])[0].numpy()
    want = ref_fake_quant(x, lo, hi, bits, narrow)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert len(np.unique(got)) <= 2 ** bits


@pytest.mark.parametrize("mode", ["per_tensor_symmetric_full_range", "per_tensor_asymmetric"])
def test_fake_quant_quantized(tmp_path, mode: str) -> None:
    g = fq_graph(-1.3, 2.1)
    rng = np.random.default_rng(2)
    calib = [[torch.from_numpy(rng.uniform(-3, 3, size=(2, 50)).astype(np.float32))] for _ in range(3)]
    qg = quantize_model(g, calib, settings(8, mode))
    node = qg.node("op")
    inp, out = node.inputs[0], node.outputs[0]
    ip, op = params_of(node, inp), params_of(node, out)
    assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (ip.scale, ip.zerop, ip.qmin, ip.qmax,
                                                                     inp.dtype)
    f = [torch.from_numpy(rng.uniform(-3, 3, size=(2, 50)).astype(np.float32))]
    got = qg.forward(f)[0].numpy()
    q_in = qg.node("op").inputs[0].betensor.numpy()
    s, zp = float(ip.scale), int(ip.zerop)
    step = np.float32(np.float32(np.float32(2.1) - np.float32(-1.3)) / np.float32(255))
    lo_adj = np.float32(step * np.round(np.float32(-1.3) / step))
    hi_adj = np.float32(np.float32(2.1) + lo_adj - np.float32(-1.3))
    q_lo = max(int(ip.qmin), math.ceil(float(lo_adj) * s) - zp)
    q_hi = min(int(ip.qmax), math.floor(float(hi_adj) * s) - zp)
    np.testing.assert_array_equal(got, np.clip(q_in, q_lo, q_hi))
    assert (got == q_lo).any() and (got == q_hi).any()  # the clamp is exercised
    deq = (got + zp) / s
    np.testing.assert_allclose(deq, g.forward(f)[0].numpy(), atol=1.01 / s + float(step))
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    np.testing.assert_array_equal(re.forward(f)[0].numpy(), got)


def test_fake_quant_bad_params(tmp_path) -> None:
    g = fq_graph(2.0, 1.0)
    with pytest.raises(IRError, match="must not be below"):
        g.forward([torch.zeros(2, 50)])
    path = write_ir(fq_graph(-1.0, 1.0, bits=1), str(tmp_path / "f.txt"))[0]
    with pytest.raises(IRError, match="num_bits"):  # the declared kind: 2 <= num_bits <= 16
        read_ir(path)


# --- ConvInteger ----------------------------------------------------------------------------------------------------
CONV_PARAMS = {"kernel_x": 2, "kernel_y": 3, "stride_x": 1, "stride_y": 2, "pad_left": 0, "pad_right": 1,
               "pad_top": 1, "pad_bottom": 1, "dilation_x": 2, "dilation_y": 1, "group": 2, "num_output": 4}


def convi_graph(w: np.ndarray, bias: np.ndarray, xzp: int, wzp: int, out_hw, in_dtype=Dtype.UINT8, **over: Any):
    b = GraphBuilder("t")
    x = b.input("x", [2, 6, 7, 4], dtype=in_dtype)
    params = {**CONV_PARAMS, "x_zero_point": xzp, "w_zero_point": wzp, **over}
    y = b.layer("ConvInteger", [x], [[2, *out_hw, 4]], name="op", params=params,
                constants={"weights": w, "biases": bias},
                constant_dtypes={"weights": Dtype.INT8, "biases": Dtype.INT32}, output_dtypes=[Dtype.INT32])
    return b.build([y])


def ref_conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray, xzp: int, wzp: int) -> np.ndarray:
    """Plain loops over NHWC/OHWI: zero padding of x - xzp, groups of 2, dilation (1, 2), stride (2, 1)."""
    xs = np.pad(x.astype(np.int64) - xzp, ((0, 0), (1, 1), (0, 1), (0, 0)))
    ws = w.astype(np.int64) - wzp
    n, hp, wp, cin = xs.shape
    oc, kh, kw, cg = ws.shape
    oh, ow = (hp - kh) // 2 + 1, (wp - ((kw - 1) * 2 + 1)) // 1 + 1
    y = np.zeros((n, oh, ow, oc), dtype=np.int64)
    for o in range(oc):
        g = o // (oc // 2)
        for i in range(oh):
            for j in range(ow):
                patch = xs[:, 2 * i:2 * i + kh, j:j + 2 * kw - 1:2, g * cg:(g + 1) * cg]
                y[:, i, j, o] = (patch * ws[o]).reshape(n, -1).sum(axis=1) + bias[o]
    return y


def test_conv_integer_exact(tmp_path) -> None:
    rng = np.random.default_rng(4)
    w = rng.integers(-128, 128, size=(4, 3, 2, 2))
    bias = rng.integers(-1000, 1000, size=4)
    x = rng.integers(0, 256, size=(2, 6, 7, 4))
    g = convi_graph(w, bias, 130, -5, (3, 6))
    f = [torch.from_numpy(x)]
    want = ref_conv(x, w, bias, 130, -5)
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), want)
    qg = quantize_model(g, [f], settings())
    node = qg.node("op")
    out = node.outputs[0]
    op = params_of(node, out)
    assert op.qinvariant and out.dtype == Dtype.INT32 and op.scale == 1.0 and op.zerop == 0
    assert (node.params["weights_zp"], node.params["weights_scale"], node.params["biases_zp"]) == (5, 1.0, 0)
    np.testing.assert_array_equal(node.constants["weights"].betensor.numpy(), w)
    folded = bias - (w + 5).reshape(4, -1).sum(axis=1) * 130  # the input zero point in the biases
    np.testing.assert_array_equal(node.constants["biases"].betensor.numpy(), folded)
    assert params_of(node, node.inputs[0]).zerop == 0  # the producer's params are not rewritten
    np.testing.assert_array_equal(qg.forward(f)[0].numpy(), want)
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    np.testing.assert_array_equal(re.forward(f)[0].numpy(), want)


def test_conv_integer_bad() -> None:
    w = np.ones((4, 3, 2, 2), dtype=np.int64)
    g = convi_graph(w, np.zeros(4), 0, 0, (3, 5))
    with pytest.raises(IRError, match="layer_top_shape"):
        g.forward([torch.zeros(2, 6, 7, 4, dtype=torch.int64)])
    g = convi_graph(w, np.zeros(4), 0, 0, (3, 6), group=3)
    with pytest.raises(IRError, match="group=3"):
        g.forward([torch.zeros(2, 6, 7, 4, dtype=torch.int64)])
    g = convi_graph(w, np.zeros(4), 0, 0, (3, 6), num_output=5)
    with pytest.raises(IRError, match="num_output=5"):
        g.forward([torch.zeros(2, 6, 7, 4, dtype=torch.int64)])
    g = convi_graph(w, np.zeros(4), 0, 0, (3, 6), in_dtype=Dtype.FP32)
    f = [torch.zeros(2, 6, 7, 4)]
    g.forward(f)
    with pytest.raises(UnsupportedError, match="needs an integer input"):
        quantize_model(g, [f], settings())
