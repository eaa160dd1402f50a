"""compat_quantized_model: a pre-quantized ONNX QDQ model (onnxruntime's quantize_static) or a quantized IR keeps its
own quantization (docs/compat-quantized.md)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from quantopt.cli import main  # noqa: E402
from quantopt.config.reader import read_cfg  # noqa: E402
from quantopt.errors import ConfigError  # noqa: E402
from quantopt.frontends.onnx import import_onnx  # noqa: E402
from quantopt.frontends.onnx_qdq import import_onnx_qdq  # noqa: E402
from quantopt.ir.reader import read_ir  # noqa: E402
from quantopt.ir.writer import write_ir  # noqa: E402
from quantopt.passes.compat_quantized import CompatOptions  # noqa: E402
from quantopt.pipeline import quantize_model, quantize_prequantized, run_quantized  # noqa: E402

SHAPE = (1, 3, 6, 6)


def _float_model(path: Path) -> None:
    """Conv -> Relu -> 1x1 Conv, added to the Relu output -> Flatten -> Gemm (seeded weights)."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    b1 = rng.normal(0, 0.1, 4).astype(np.float32)
    w2 = rng.normal(0, 0.4, (4, 4, 1, 1)).astype(np.float32)
    b2 = rng.normal(0, 0.1, 4).astype(np.float32)
    w3 = rng.normal(0, 0.2, (10, 4 * 6 * 6)).astype(np.float32)
    b3 = rng.normal(0, 0.1, 10).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], name="conv2"),
             helper.make_node("Add", ["c2", "r1"], ["s"], name="add"),
             helper.make_node("Flatten", ["s"], ["f"], axis=1, name="flatten"),
             helper.make_node("Gemm", ["f", "W3", "B3"], ["y"], transB=1, name="fc")]
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(w1, "W1"), (b1, "B1"), (w2, "W2"), (b2, "B2"), (w3, "W3"), (b3, "B3")]]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))


class _Reader(quantization.CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.data = iter([{"x": rng.normal(0, 1, SHAPE).astype(np.float32)} for _ in range(8)])

    def get_next(self):  # noqa: ANN201 - onnxruntime's interface
        return next(self.data, None)


_BUILT: dict = {}


def qdq_model(tmp_path: Path, activation: str = "QUInt8", weight: str = "QInt8", per_channel: bool = True) -> Path:
    """A QDQ model written by onnxruntime's quantize_static from the seeded float model (built once per form)."""
    key = (activation, weight, per_channel)
    if key in _BUILT and _BUILT[key].is_file():
        return _BUILT[key]
    fp = tmp_path / "float.onnx"
    _float_model(fp)
    out = tmp_path / f"qdq_{activation}_{weight}_{int(per_channel)}.onnx"
    _BUILT[key] = out
    quantization.quantize_static(str(fp), str(out), _Reader(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=per_channel, activation_type=getattr(quantization.QuantType, activation),
                                 weight_type=getattr(quantization.QuantType, weight))
    return out


def _ort_reference(path: Path, x: np.ndarray) -> np.ndarray:
    # onnxruntime's optimized QLinearConv saturates some u8 x s8 products on x86 (its int16 pair sums); the
    # unoptimized graph is the QDQ model's own float definition
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _inputs(count: int = 12):
    return [np.random.default_rng(100 + i).normal(0, 1, SHAPE).astype(np.float32) for i in range(count)]


def _max_steps(path: Path, qgraph) -> float:
    step = 1.0 / float(qgraph.quant.get(qgraph.output_tensors[0]).scale)
    worst = 0.0
    for x in _inputs():
        ref = _ort_reference(path, x)
        got = run_quantized(qgraph, torch.from_numpy(x))[0].numpy()
        worst = max(worst, float(np.abs(ref - got).max()) / step)
    return worst


def _onnx_inits(path: Path) -> dict:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def _layer(qgraph, onnx_name: str):
    return next(n for n in qgraph.nodes if n.name.startswith(onnx_name) and "transpose" not in n.name)


def test_qdq_import_keeps_scales_zero_points_and_weights(tmp_path):
    path = qdq_model(tmp_path)
    inits = _onnx_inits(path)
    qg = quantize_prequantized(import_onnx_qdq(str(path)))
    # activations: scale = float32(1 / s), zerop = -zp
    x = qg.quant.get(qg.input_tensors[0])
    assert x.scale == float(np.float32(1.0 / np.float64(inits["x_scale"])))
    assert x.zerop == -int(inits["x_zero_point"])
    conv1 = _layer(qg, "conv1")
    assert qg.quant.get(conv1.outputs[0]).scale == float(np.float32(1.0 / np.float64(inits["r1_scale"])))
    # weights: the same integers (IR layout OHWI), the same per-channel scales
    w = conv1.constants["weights"].betensor.numpy().transpose(0, 3, 1, 2)
    assert np.array_equal(w, inits["W1_quantized"].astype(np.int64))
    assert np.array_equal(conv1.constants["weights_scale"].betensor.numpy(),
                          (1.0 / inits["W1_scale"].astype(np.float64)).astype(np.float32))
    assert not conv1.constants["weights_zp"].betensor.any()
    # biases: onnxruntime's int32 biases, with quantopt's fold of the input zero point (b - zp_x * sum(w))
    folded = inits["B1_quantized"].astype(np.int64) - int(inits["x_zero_point"]) * w.sum(axis=(1, 2, 3))
    assert np.array_equal(conv1.constants["biases"].betensor.numpy(), folded)
    fc = _layer(qg, "fc")
    assert sorted(fc.constants["weights"].betensor.numpy().ravel().tolist()) == \
        sorted(inits["W3_quantized"].astype(np.int64).ravel().tolist())


@pytest.mark.parametrize("activation,weight,per_channel", [("QUInt8", "QInt8", True), ("QInt8", "QInt8", False),
                                                           ("QInt8", "QInt8", True)])
def test_qdq_forward_matches_onnxruntime(tmp_path, activation, weight, per_channel):
    path = qdq_model(tmp_path, activation, weight, per_channel)
    qg = quantize_prequantized(import_onnx_qdq(str(path)))
    assert _max_steps(path, qg) <= 1.0 + 1e-4  # measured: at most one output step (float vs integer rounding)


def test_int8_to_uint8(tmp_path):
    path = qdq_model(tmp_path, "QInt8", "QInt8", True)
    plain = quantize_prequantized(import_onnx_qdq(str(path)))
    moved = quantize_prequantized(import_onnx_qdq(str(path)), options=CompatOptions(
        compat_quantized_model_int8_to_uint8=True))
    relu = _layer(plain, "conv1").outputs[0]
    relu_moved = _layer(moved, "conv1").outputs[0]
    q, q_moved = plain.quant.get(relu), moved.quant.get(relu_moved)
    assert (relu.dtype.value, q.zerop) == ("int8", 128)  # onnxruntime's relu output: zero point -128
    assert (relu_moved.dtype.value, q_moved.zerop, q_moved.qmin, q_moved.qmax) == ("uint8", 0, 0, 255)
    assert q_moved.scale == q.scale
    for x in _inputs(4):
        a = run_quantized(plain, torch.from_numpy(x))[0]
        b = run_quantized(moved, torch.from_numpy(x))[0]
        assert torch.equal(a, b)


def test_asymmetric_weights_strategy_and_force_weight_asym(tmp_path):
    path = qdq_model(tmp_path, "QUInt8", "QUInt8", False)
    inits = _onnx_inits(path)
    assert int(inits["W1_zero_point"]) != 0
    with pytest.raises(ConfigError, match="compat_quantized_model_strategy"):
        quantize_prequantized(import_onnx_qdq(str(path)))
    wide = quantize_prequantized(import_onnx_qdq(str(path)), options=CompatOptions(
        compat_quantized_model_strategy="8bAsymWeightTo16bSymWeight"))
    conv1 = _layer(wide, "conv1")
    w = conv1.constants["weights"]
    assert w.dtype.value == "int16" and conv1.params["weights_zp"] == 0
    expect = inits["W1_quantized"].astype(np.int64) - int(inits["W1_zero_point"])
    assert np.array_equal(w.betensor.numpy().transpose(0, 3, 1, 2), expect)
    kept = quantize_prequantized(import_onnx_qdq(str(path)), options=CompatOptions(
        compat_quantized_model_force_weight_asym=True))
    k1 = _layer(kept, "conv1")
    assert k1.constants["weights"].dtype.value == "uint8"
    assert k1.params["weights_zp"] == -int(inits["W1_zero_point"])
    assert np.array_equal(k1.constants["weights"].betensor.numpy().transpose(0, 3, 1, 2),
                          inits["W1_quantized"].astype(np.int64))
    for x in _inputs(4):  # the same effective weights: the same integers out
        assert torch.equal(run_quantized(wide, torch.from_numpy(x))[0], run_quantized(kept, torch.from_numpy(x))[0])
    assert _max_steps(path, wide) <= 1.0 + 1e-4


def test_unify_shifts_mode(tmp_path):
    path = qdq_model(tmp_path)
    auto = _layer(quantize_prequantized(import_onnx_qdq(str(path))), "conv1")
    none = _layer(quantize_prequantized(import_onnx_qdq(str(path)), options=CompatOptions(
        compat_quantized_model_unify_shifts_mode="none")), "conv1")
    assert len(set(auto.constants["shift"].betensor.tolist())) == 1
    assert len(set(none.constants["shift"].betensor.tolist())) > 1
    # upstream's compat flow requantizes with 13-bit multipliers
    assert int(none.constants["scale"].betensor.max()) >= 2 ** 12


def _cfg(tmp_path: Path, name: str, lines: str) -> Path:
    p = tmp_path / name
    (tmp_path / "m.onnx").write_bytes(b"")  # the graph field needs an existing file; errors come before it is read
    p.write_text("[Common]\n" + lines)
    return p


@pytest.mark.parametrize("line,field", [
    ("compat_quantized_model_strategy = sym", "compat_quantized_model_strategy"),
    ("compat_quantized_model_ops = conv", "compat_quantized_model_ops"),
    ("compat_quantized_model_unify_shifts_mode = max", "compat_quantized_model_unify_shifts_mode"),
    ("compat_quantized_model_left_shift_bits = 8", "compat_quantized_model_left_shift_bits"),
    ("compat_quantized_model_simplify_dequantize_quantize = false",
     "compat_quantized_model_simplify_dequantize_quantize"),
    ("compat_quantized_model_eliminate_cast = maybe", "compat_quantized_model_eliminate_cast"),
])
def test_refused_values_are_cfg_errors(tmp_path, line, field):
    cfg = _cfg(tmp_path, "a.cfg", f"graph = m.onnx\ncompat_quantized_model = true\n{line}\n")
    with pytest.raises(ConfigError, match=field):
        read_cfg(str(cfg))


@pytest.mark.parametrize("lines,field", [
    ("compat_quantized_model_int8_to_uint8 = true\n", "compat_quantized_model_int8_to_uint8"),
    ("compat_quantized_model = true\nglobal_calibration = bias_correction\n", "global_calibration"),
])
def test_cross_field_errors(tmp_path, lines, field, capsys):
    cfg = _cfg(tmp_path, "b.cfg", "graph = m.onnx\noutput_dir = out\n" + lines)
    assert main(["--cfg", str(cfg)]) == 2
    assert field in capsys.readouterr().err


def test_float_model_with_compat_is_an_error(tmp_path, capsys):
    fp = tmp_path / "float.onnx"
    _float_model(fp)
    cfg = _cfg(tmp_path, "c.cfg", f"graph = {fp}\noutput_dir = {tmp_path / 'out'}\ncompat_quantized_model = true\n")
    assert main(["--cfg", str(cfg)]) == 2
    assert "carries no quantization" in capsys.readouterr().err


def test_cli_qdq_then_quantized_ir_round_trip(tmp_path):
    path = qdq_model(tmp_path)
    out = tmp_path / "out"
    cfg = _cfg(tmp_path, "q.cfg", f"graph = {path}\nmodel_name = tiny\noutput_dir = {out}\n"
                                  "compat_quantized_model = true\n")
    assert main(["--cfg", str(cfg)]) == 0
    ir = read_ir(str(out / "tiny_o.txt"))
    qg = quantize_prequantized(import_onnx_qdq(str(path)))
    for x in _inputs(4):  # the written IR computes what the in-process quantized graph does
        assert torch.equal(run_quantized(ir, torch.from_numpy(x))[0], run_quantized(qg, torch.from_numpy(x))[0])
    assert _max_steps(path, ir) <= 1.0 + 1e-4
    # the quantized IR in again: kept as it is, written again byte for byte (the bin) and bit-identical outputs
    out2 = tmp_path / "out2"
    cfg2 = _cfg(tmp_path, "r.cfg", f"graph = {out / 'tiny_o.txt'}\nmodel_name = tiny2\noutput_dir = {out2}\n"
                                   "compat_quantized_model = true\n")
    assert main(["--cfg", str(cfg2)]) == 0
    assert (out / "tiny_o.bin").read_bytes() == (out2 / "tiny2_o.bin").read_bytes()
    ir2 = read_ir(str(out2 / "tiny2_o.txt"))
    for x in _inputs(4):
        assert torch.equal(run_quantized(ir2, torch.from_numpy(x))[0], run_quantized(ir, torch.from_numpy(x))[0])


def test_calibrated_quantized_ir_round_trip_is_bit_identical(tmp_path):
    fp = tmp_path / "float.onnx"
    _float_model(fp)
    graph = import_onnx(str(fp))
    qg = quantize_model(graph, [torch.from_numpy(x) for x in _inputs(4)])
    txt, _ = write_ir(qg, str(tmp_path / "cal_o.txt"))
    out = tmp_path / "kept"
    cfg = _cfg(tmp_path, "k.cfg", f"graph = {txt}\nmodel_name = kept\noutput_dir = {out}\n"
                                  "compat_quantized_model = true\n")
    assert main(["--cfg", str(cfg)]) == 0
    kept = read_ir(os.path.join(out, "kept_o.txt"))
    for x in _inputs(6):
        assert torch.equal(run_quantized(kept, torch.from_numpy(x))[0], run_quantized(qg, torch.from_numpy(x))[0])
    # int8_to_uint8 applies to QDQ models only: refused on a quantized IR
    cfg2 = _cfg(tmp_path, "k2.cfg", f"graph = {txt}\noutput_dir = {out}\ncompat_quantized_model = true\n"
                                    "compat_quantized_model_int8_to_uint8 = true\n")
    assert main(["--cfg", str(cfg2)]) == 2
