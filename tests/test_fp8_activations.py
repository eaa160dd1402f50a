"""fp8 activations (quant_type w*afp8*, docs/low-bit.md, docs/semantics/fp8-activations.md): the fp8 rounding against
ml_dtypes and an exact rational re-implementation, each fp8 quant type end to end on a small graph, one layer's
output against an independent numpy computation, the IR keys and dtypes and a re-read IR computing the same values,
the borders to integer layers, and `activation_block_size`."""
from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from quant_helpers import params_of
from test_cli import example_cfg

from quantopt.cli import main
from quantopt.config.fields import FIELDS
from quantopt.config.quant_types import FP8_ACTIVATION_TYPES
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype
from quantopt.quant.fp8_activations import fp8_scale, round_fp4, round_fp8

E4M3, E5M2 = Dtype.FP8_E4M3FN, Dtype.FP8_E5M2
FORMATS = {E4M3: (3, -6, 448.0, ml_dtypes.float8_e4m3fn), E5M2: (2, -14, 57344.0, ml_dtypes.float8_e5m2)}


def _reference_round(v: float, dtype: Dtype) -> float:
    """Exact rational form of upstream's rounding: ties-to-even to 1+m significant bits at the value's own binary
    exponent, saturate, then below the smallest normal a multiple of the smallest subnormal, halves away from 0."""
    man, emin, largest, _ = FORMATS[dtype]
    if not math.isfinite(v):
        return 0.0
    x = Fraction(abs(v))
    if x == 0:
        return math.copysign(0.0, v)
    e = math.frexp(abs(v))[1] - 1
    step = Fraction(2) ** (e - man)
    m = min(round(x / step) * step, Fraction(largest))  # Fraction round() is ties-to-even
    if m < Fraction(2) ** emin:
        unit = Fraction(2) ** (emin - man)
        m = math.floor(m / unit + Fraction(1, 2)) * unit
    return math.copysign(float(m), v)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_fp8_is_ml_dtypes_round_to_nearest_even_on_normal_values(dtype: Dtype) -> None:
    man, emin, largest, np_type = FORMATS[dtype]
    rng = np.random.default_rng(0)
    x = (rng.uniform(1, 2, 20000) * 2.0 ** rng.integers(emin, 16, 20000) * rng.choice([-1, 1], 20000))
    x = x[np.abs(x) <= largest].astype(np.float32)
    ours = round_fp8(torch.from_numpy(x), dtype).numpy()
    np.testing.assert_array_equal(ours, x.astype(np_type).astype(np.float32))
    big = torch.tensor([largest * 1.5, -largest * 4, 3e38], dtype=torch.float32)
    assert round_fp8(big, dtype).tolist() == [largest, -largest, largest]  # saturates (ml_dtypes gives NaN/inf)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_fp8_matches_the_rational_reference_everywhere(dtype: Dtype) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(3000) * 2.0 ** rng.integers(-24, 18, 3000)).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30])])
    ours = round_fp8(torch.from_numpy(x), dtype).numpy()
    ref = np.array([_reference_round(float(v), dtype) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(np.signbit(ours[:3002]), np.signbit(ref[:3002]))


def test_subnormal_values_round_halves_away_from_zero_and_can_round_twice() -> None:
    unit = 2.0 ** -9  # smallest e4m3 subnormal
    x = torch.tensor([2.5 * unit, 2.48 * unit, 0.5 * unit, 0.49 * unit, 0.45 * unit, -1.5 * unit],
                     dtype=torch.float32)
    assert (round_fp8(x, E4M3) / unit).tolist() == [3.0, 3.0, 1.0, 1.0, 0.0, -2.0]
    rne = x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / unit
    assert rne.tolist() == [2.0, 2.0, 0.0, 0.0, 0.0, -2.0]  # what plain round-to-nearest-even would give


def test_scale_is_upstreams_float32_arithmetic() -> None:
    # |x|max and scale of a tensor of upstream's golden (tests/data/golden_corpus/op_fp8_fc_w4e4m3, fc1)
    assert float(fp8_scale(2.5395090579986572, E4M3)) == 176.41134643554688
    assert float(fp8_scale(0.0, E4M3)) == np.float32(448.0 / np.float32(1e-5))


def test_fp4_weights_round_by_upstreams_steps() -> None:
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.99, 7.0, -0.75, float("nan")])
    assert round_fp4(x).tolist() == [0.0, 0.5, 0.5, 1.0, 2.0, 2.0, 4.0, 6.0, 4.0, 6.0, -0.5, 0.0]


# ------------------------------------------------------------------------------------------------ graphs


def _graph():
    """Input -> FullyConnected -> Reshape -> FullyConnected(RELU) -> Sigmoid, and a MatMul of the first FC's
    output with itself transposed."""
    rng = np.random.default_rng(20)
    b = GraphBuilder("fp8")
    x = b.input("x", [1, 4, 16])
    h = b.layer("FullyConnected", [x], [[1, 4, 12]], name="fc1", params={"num_output": 12, "with_activation": "NONE"},
                constants={"weights": rng.standard_normal((12, 16)).astype(np.float32) * 0.4,
                           "biases": rng.standard_normal(12).astype(np.float32) * 0.1})
    r = b.layer("Reshape", [h], [[1, 4, 3, 4]], name="reshape", params={"shape": [1, 4, 3, 4]})
    f = b.layer("Reshape", [r], [[1, 4, 12]], name="flat", params={"shape": [1, 4, 12]})
    h2 = b.layer("FullyConnected", [f], [[1, 4, 6]], name="fc2", params={"num_output": 6, "with_activation": "RELU"},
                 constants={"weights": rng.standard_normal((6, 12)).astype(np.float32) * 0.4,
                            "biases": rng.standard_normal(6).astype(np.float32) * 0.1})
    y = b.layer("Sigmoid", [h2], [[1, 4, 6]], name="sigmoid")
    t = b.layer("Transpose", [h], [[1, 12, 4]], name="transpose", params={"perm": [0, 2, 1]})
    m = b.layer("MatMul", [h, t], [[1, 4, 4]], name="matmul", params={"trans_a": False, "trans_b": False})
    return b.build([y, m])


def _data(n: int = 6):
    rng = np.random.default_rng(3)
    return [torch.from_numpy(rng.standard_normal((1, 4, 16)).astype(np.float32)) for _ in range(n)]


def _quantized(quant_type: str, **settings):
    return quantize_model(_graph(), _data(), settings={"quant_type": quant_type, **settings})


def _dtypes(q) -> dict:
    return {n.name: n.outputs[0].dtype.value for n in q.nodes}


FP8_ALL = {"x": "float8_e4m3fn", "fc1": "float8_e4m3fn", "reshape": "float8_e4m3fn", "flat": "float8_e4m3fn",
           "fc2": "float8_e4m3fn", "transpose": "float8_e4m3fn", "matmul": "float8_e4m3fn", "sigmoid": "uint8"}


@pytest.mark.parametrize("quant_type, expected", [
    ("wfp8e4m3afp8e4m3", FP8_ALL),
    ("wfp8afp8", FP8_ALL),
    ("wfp8e5m2afp8e5m2", {k: v.replace("e4m3fn", "e5m2") for k, v in FP8_ALL.items()}),
    ("w4afp8e4m3", {"x": "int8", "fc1": "float8_e4m3fn", "reshape": "float8_e4m3fn", "flat": "float8_e4m3fn",
                    "fc2": "float8_e4m3fn", "transpose": "float8_e4m3fn", "matmul": "int8", "sigmoid": "uint8"}),
    ("wfp4afp8e4m3", {"x": "int8", "fc1": "float8_e4m3fn", "fc2": "float8_e4m3fn", "matmul": "int8"}),
    ("w4afp8e5m2", {"x": "int8", "fc1": "int8", "fc2": "uint8", "matmul": "int8", "sigmoid": "uint8"}),
    ("wfp4afp8e5m2", {"x": "int8", "fc1": "int8", "fc2": "uint8", "matmul": "int8"}),
])
def test_each_fp8_quant_type_end_to_end(quant_type: str, expected: dict, tmp_path: Path) -> None:
    graph = _graph()
    data = _data()
    q = quantize_model(graph, data, settings={"quant_type": quant_type})
    dtypes = _dtypes(q)
    assert {k: dtypes[k] for k in expected} == expected
    x = _data(1)[0] * 0.9
    float_out = [t.clone() for t in graph.forward([x])]
    ours = run_quantized(q, x)
    for f, o in zip(float_out, ours):
        cos = torch.nn.functional.cosine_similarity(f.reshape(1, -1).double(), o.reshape(1, -1).double()).item()
        assert cos > 0.98, (quant_type, cos)
    raw = [t.betensor.clone() for t in q.output_tensors]
    txt = tmp_path / "q.txt"
    write_ir(q, str(txt))
    again = read_ir(str(txt))
    again.forward([x])
    for a, b in zip(raw, again.output_tensors):
        assert torch.equal(a.to(torch.float64), b.betensor.to(torch.float64))  # a re-read IR computes the same


def test_borders_convert_through_float16(tmp_path: Path) -> None:
    q = _quantized("w4afp8e4m3")
    by_name = {n.name: n for n in q.nodes}
    fc1 = by_name["fc1"]
    quant = fc1.inputs[0].pnode
    deq = quant.inputs[0].pnode
    assert (str(quant.type), str(deq.type)) == ("Quantize", "DeQuantize")
    assert deq.inputs[0].name == "x" and deq.outputs[0].dtype == Dtype.FP16
    assert quant.outputs[0].dtype == E4M3 and quant.params["quantize_zp"] == 0.0
    sig = by_name["sigmoid"]  # fp8 -> integer border before the Sigmoid
    assert str(sig.inputs[0].pnode.type) == "Quantize" and sig.inputs[0].dtype == Dtype.UINT8
    assert str(sig.inputs[0].pnode.inputs[0].pnode.type) == "DeQuantize"
    # the Quantize computes round_fp8(float32(scale * float16 value))
    q.forward(_data(1), keep_tensors=True)
    scale = np.float32(quant.params["quantize_scale"])
    f16 = deq.outputs[0].betensor.numpy().astype(np.float32)
    expect = [_reference_round(float(v), E4M3) for v in (scale * f16).ravel()]
    np.testing.assert_array_equal(quant.outputs[0].betensor.numpy().ravel(), np.float32(expect))


@pytest.mark.parametrize("mode", ["per_tensor_symmetric_restricted_range", "per_channel_symmetric_restricted_range"])
def test_fc_output_equals_an_independent_numpy_computation(mode: str) -> None:
    q = _quantized("wfp8e4m3afp8e4m3", q_mode_weight=mode)
    q.forward(_data(1), keep_tensors=True)
    fc2 = {n.name: n for n in q.nodes}["fc2"]
    x = fc2.inputs[0].betensor.numpy().astype(np.float64)
    w = fc2.constants["weights"].betensor.numpy().astype(np.float64)
    b = fc2.constants["biases"].betensor.numpy().astype(np.float64)
    assert fc2.constants["weights"].dtype == E4M3 and fc2.constants["biases"].dtype == Dtype.FP32
    # the weights are on the fp8 grid: ml_dtypes holds them exactly
    np.testing.assert_array_equal(w, w.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    ratio = (fc2.constants["scale"].betensor.numpy() if "scale" in fc2.constants
             else np.float32(fc2.params["scale_value"]))
    acc = np.maximum(x @ w.T + b, 0.0)  # fused RELU
    y32 = (acc * np.float64(np.float32(ratio))).astype(np.float32)
    expect = np.array([_reference_round(float(v), E4M3) for v in y32.ravel()], dtype=np.float32)
    np.testing.assert_array_equal(fc2.outputs[0].betensor.numpy().ravel(), expect)
    s_in, s_out = np.float32(params_of(fc2, fc2.inputs[0]).scale), np.float32(params_of(fc2, fc2.outputs[0]).scale)
    w_scale = (fc2.constants["weights_scale"].betensor.numpy() if "weights_scale" in fc2.constants
               else np.float32(fc2.params["weights_scale"]))
    np.testing.assert_array_equal(np.float32(ratio), np.float32(s_out / (s_in * w_scale)))


def test_ir_keys_and_dtypes_as_upstream_writes_them(tmp_path: Path) -> None:
    txt = tmp_path / "q.txt"
    write_ir(_quantized("wfp8e4m3afp8e4m3"), str(txt))
    layers = {}
    for block in txt.read_text().split("\n\n")[1:]:
        kv = dict(line.split("=", 1) for line in block.strip().splitlines())
        layers[kv["layer_name"]] = kv
    fc = layers["fc1"]
    assert fc["layer_top_type"] == "[float8_e4m3fn]" and fc["layer_top_range"] == "[[-448.0,448.0]]"
    assert fc["layer_top_zp"] == "[0.0]" and fc["weights_type"] == "float8_e4m3fn" and fc["biases_type"] == "float32"
    assert fc["scale_type"] == "float32" and "shift_value" not in fc and fc["weights_zp"] == "0.0"
    assert float(fc["scale_value"]) == np.float32(float(fc["scale_value"]))
    assert layers["x"]["layer_top_type"] == "[float8_e4m3fn]" and layers["reshape"]["layer_top_type"] == \
        "[float8_e4m3fn]"
    assert layers["sigmoid"]["layer_bottom_type"] == "[uint8]"
    assert layers["fc2_int_quantize"]["layer_bottom_type"] == "[float16]"
    assert layers["fc2_int_dequantize"]["layer_bottom_type"] == "[float8_e4m3fn]"
    write_ir(_quantized("wfp8e4m3afp8e4m3", q_mode_weight="per_channel_symmetric_restricted_range"), str(txt))
    text = txt.read_text()
    assert "weights_zp_type=float8_e4m3fn" in text and "scale_type=float32\nscale_offset=" in text
    assert "biases_zp_type=int64" in text


def test_an_unsupported_fused_activation_is_an_error() -> None:
    graph = _graph()
    next(n for n in graph.nodes if n.name == "fc2").params["with_activation"] = "RELU6"
    with pytest.raises(UnsupportedError, match="fused RELU6 activation in an fp8 layer"):
        quantize_model(graph, _data(), settings={"quant_type": "wfp8afp8"})


def test_float_layers_next_to_fp8_layers_are_an_error() -> None:
    with pytest.raises(UnsupportedError, match="does not combine float layers with fp8"):
        quantize_model(_graph(), _data(), settings={"quant_type": "wfp8afp8"},
                       per_layer={"sigmoid": {"trigger_float_op": "float16_preferred"}})


def test_cli_runs_an_fp8_quant_type(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "quant_type = wfp8e4m3afp8e4m3\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    text = (tmp_path / "out" / "digits_o.txt").read_text()
    assert "layer_type=Convolution" in text and "weights_type=float8_e4m3fn" in text
    graph = read_ir(str(tmp_path / "out" / "digits_o.txt"))
    assert any(n.outputs[0].dtype == E4M3 for n in graph.nodes if str(n.type) == "Convolution")


# ------------------------------------------------------------------------------------------------ cfg


def _cfg(tmp_path: Path, text: str):
    (tmp_path / "m.txt").write_text("")
    path = tmp_path / "q.cfg"
    path.write_text("[Common]\ngraph = m.txt\ncalibrate_with_zero_inputs = true\n" + text)
    return read_cfg(str(path))


def test_activation_block_size_accepts_upstreams_default_only(tmp_path: Path) -> None:
    assert _cfg(tmp_path, "").activation_block_size.get(None) == 256
    assert _cfg(tmp_path, "activation_block_size = 256\n").activation_block_size.get(None) == 256
    with pytest.raises(ConfigError, match="per-block activation scales, which neither quantopt nor upstream"):
        _cfg(tmp_path, "activation_block_size = 128\nquant_type = wfp8e4m3afp8e4m3\n")
    with pytest.raises(ConfigError, match="activation_block_size"):
        _cfg(tmp_path, "activation_block_size = -4\n")


def test_quant_type_field_lists_the_fp8_types(tmp_path: Path) -> None:
    allowed = FIELDS["quant_type"].kind.allowed()
    assert all(name in allowed for name in FP8_ACTIVATION_TYPES)
    with pytest.raises(ConfigError, match="not a quant_type name"):
        _cfg(tmp_path, "quant_type = wfp8\n")
    assert _cfg(tmp_path, "quant_type = WFP8AFP8\n").quant_type.get(None) == "wfp8afp8"


# ------------------------------------------------------------------------------------------------ convolutions

GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)


def _conv_graph():
    """Input -> Convolution (RELU) -> DepthwiseConv -> grouped Convolution (group 2)."""
    r = np.random.default_rng(5)
    b = GraphBuilder("conv8")
    x = b.input("x", [1, 6, 6, 3])
    c1 = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="c1",
                 params=dict(num_output=4, group=1, with_activation="RELU", **GEO),
                 constants={"weights": r.normal(0, 0.4, [4, 3, 3, 3]).astype(np.float32),
                            "biases": r.normal(0, 0.1, [4]).astype(np.float32)})
    dw = b.layer("DepthwiseConv", [c1], [[1, 6, 6, 4]], name="dw",
                 params=dict(num_output=4, group=4, multiplier=1, with_activation="NONE", **GEO),
                 constants={"weights": r.normal(0, 0.4, [4, 3, 3, 1]).astype(np.float32),
                            "biases": r.normal(0, 0.1, [4]).astype(np.float32)})
    c2 = b.layer("Convolution", [dw], [[1, 6, 6, 4]], name="c2",
                 params=dict(num_output=4, group=2, with_activation="NONE", **GEO),
                 constants={"weights": r.normal(0, 0.4, [4, 3, 3, 2]).astype(np.float32),
                            "biases": r.normal(0, 0.1, [4]).astype(np.float32)})
    return b.build([c2])


def _numpy_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """NHWC 3x3 convolution, stride 1, zero padding 1, weights [out, kh, kw, in/group], in float64."""
    n, h, wd, c = x.shape
    out = w.shape[0]
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    y = np.zeros((n, h, wd, out))
    cin, cout = c // group, out // group
    for o in range(out):
        g = o // cout
        for i in range(h):
            for j in range(wd):
                y[:, i, j, o] = (xp[:, i:i + 3, j:j + 3, g * cin:(g + 1) * cin] * w[o]).sum(axis=(1, 2, 3)) + b[o]
    return y


@pytest.mark.parametrize("quant_type", ["wfp8e4m3afp8e4m3", "wfp8e5m2afp8e5m2"])
def test_convolutions_equal_an_independent_numpy_computation(quant_type: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    data = [torch.from_numpy(rng.standard_normal((1, 6, 6, 3)).astype(np.float32)) for _ in range(4)]
    q = quantize_model(_conv_graph(), data, settings={"quant_type": quant_type})
    dtype = E4M3 if "e4m3" in quant_type else E5M2
    q.forward(data[:1], keep_tensors=True)
    nodes = {n.name: n for n in q.nodes}
    assert all(nodes[k].outputs[0].dtype == dtype for k in ("x", "c1", "dw", "c2"))
    assert nodes["dw"].constants["weights_scale"].betensor.numel() == 4  # DepthwiseConv: per channel
    c2_scales = nodes["c2"].constants["weights_scale"].betensor.tolist()  # grouped: one scale per group
    assert c2_scales[0] == c2_scales[1] and c2_scales[2] == c2_scales[3] and c2_scales[0] != c2_scales[2]
    for name, group, relu in (("c1", 1, True), ("dw", 4, False), ("c2", 2, False)):
        n = nodes[name]
        x = n.inputs[0].betensor.numpy().astype(np.float64)
        w = n.constants["weights"].betensor.numpy().astype(np.float64)
        b = n.constants["biases"].betensor.numpy().astype(np.float64)
        acc = _numpy_conv(x, w, b, group)
        acc = np.maximum(acc, 0.0) if relu else acc
        ratio = (n.constants["scale"].betensor.numpy() if "scale" in n.constants
                 else np.float32(n.params["scale_value"]))
        y32 = (acc * np.float64(np.float32(ratio))).astype(np.float32)
        expect = np.array([_reference_round(float(v), dtype) for v in y32.ravel()], dtype=np.float32)
        np.testing.assert_array_equal(n.outputs[0].betensor.numpy().ravel(), expect, err_msg=name)


def test_matmul_equals_an_independent_numpy_computation() -> None:
    q = _quantized("wfp8e4m3afp8e4m3")
    q.forward(_data(1), keep_tensors=True)
    mm = {n.name: n for n in q.nodes}["matmul"]
    a, b = (t.betensor.numpy().astype(np.float64) for t in mm.inputs)
    assert all(t.dtype == E4M3 for t in mm.inputs) and "shift_value" not in mm.params
    ratio = np.float32(mm.params["scale_value"])
    s_out, s0, s1 = (params_of(mm, t).scale for t in (mm.outputs[0], mm.inputs[0], mm.inputs[1]))
    assert ratio == np.float32(np.float32(s_out) / (np.float32(s0) * np.float32(s1)))
    y32 = ((a @ b) * np.float64(ratio)).astype(np.float32)
    expect = np.array([_reference_round(float(v), E4M3) for v in y32.ravel()], dtype=np.float32)
    np.testing.assert_array_equal(mm.outputs[0].betensor.numpy().ravel(), expect)
