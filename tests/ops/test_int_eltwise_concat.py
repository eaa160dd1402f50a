"""Eltwise (ADD/SUB/MUL/MAX/MIN), Add/Sub/Mul and Concat: integer forward against an independent numpy/python-int
reference written from docs/integer-semantics.md, float-vs-dequantized cosine, the Eltwise ADD example of
docs/integer-semantics.md, and IR
write → re-load bit identity."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant
from range_helpers import set_range

from quantopt.analysis.similarity import cosine
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import QuantOptError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.ops import eltwise as eltwise_module
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype
from quantopt.quant.rounding import round_shift

AMODES = ["per_tensor_symmetric_full_range", "per_tensor_symmetric_restricted_range", "per_tensor_asymmetric"]
BINARY = [("Eltwise", "ADD"), ("Eltwise", "SUB"), ("Eltwise", "MUL"), ("Eltwise", "MAX"), ("Eltwise", "MIN"),
          ("Add", None), ("Sub", None), ("Mul", None)]
SHAPE_A = [1, 5, 6, 8]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


# --- graphs -------------------------------------------------------------------------------------------------------
def binary_graph(optype: str, method: Optional[str], shape_b: Sequence[int] = SHAPE_A, act: str = "NONE",
                 in_dtype: Dtype = Dtype.FP32):
    g = GraphBuilder("bin")
    a = g.input("a", SHAPE_A, dtype=in_dtype)
    b = g.input("b", list(shape_b), dtype=in_dtype)
    params: Dict[str, object] = {"with_activation": act}
    if method is not None:
        params["method"] = method
    if act == "CLIP":
        params.update(clip_min=-0.7, clip_max=1.1)
    y = g.layer(optype, [a, b], [SHAPE_A], name="op", params=params)
    return g.build([y])


def binary_data(seed: int, shape_b: Sequence[int] = SHAPE_A, n: int = 3, batch: int = 2) -> List[List[torch.Tensor]]:
    """Batches of (a, b); a 4-D `shape_b` follows the batch, a lower-rank one is used as is (broadcast)."""
    r = _rng(seed)
    b_shape = [batch] + list(shape_b)[1:] if len(shape_b) == len(SHAPE_A) else list(shape_b)
    out = []
    for _ in range(n):
        a = r.normal(0.3, 1.0, size=[batch] + SHAPE_A[1:])
        b = r.normal(-0.2, 2.0, size=b_shape)
        out.append([_t(a), _t(b)])
    return out


def concat_graph(shapes: Sequence[Sequence[int]], axis: int = -1):
    g = GraphBuilder("cat")
    names = [g.input(f"x{i}", list(s)) for i, s in enumerate(shapes)]
    out_shape = list(shapes[0])
    out_shape[axis] = sum(s[axis] for s in shapes)
    y = g.layer("Concat", names, [out_shape], name="op", params={"axis": axis})
    return g.build([y])


# --- independent reference (python ints / numpy int64) ------------------------------------------------------------
def ref_round_shift(v: int, s: int) -> int:
    """round_half_even(v / 2^s) with python integers (a negative s multiplies)."""
    if s <= 0:
        return v << (-s)
    q, rem = divmod(v, 1 << s)
    half = 1 << (s - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def ref_requant(acc: np.ndarray, mult: int, shift: int, zp_out: int, qmin: int, qmax: int) -> np.ndarray:
    out = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        v = ref_round_shift(int(acc[idx]) * int(mult), int(shift)) - zp_out
        out[idx] = min(max(v, qmin), qmax)
    return out


def _zp(node, t) -> int:
    return int(round(float(params_of(node, t).zerop)))


def ref_activation(node, y: np.ndarray) -> np.ndarray:
    act = str(node.params.get("with_activation", "NONE")).upper()
    out = params_of(node, node.outputs[0])
    zp = _zp(node, node.outputs[0])
    if act == "RELU":
        return np.maximum(y, min(max(-zp, out.qmin), out.qmax))
    if act in ("RELU6", "CLIP"):
        lo, hi = (0.0, 6.0) if act == "RELU6" else (node.params["clip_min"], node.params["clip_max"])
        q = [min(max(int(np.round(np.float64(v) * np.float64(out.scale) - zp)), out.qmin), out.qmax) for v in (lo, hi)]
        return np.clip(y, q[0], q[1])
    return y


def ref_binary(node) -> np.ndarray:
    """The documented integer formula, from the node's IR fields and its (already computed) integer inputs."""
    method = str(node.params.get("method", {"Add": "ADD", "Sub": "SUB", "Mul": "MUL"}.get(str(node.type)))).upper()
    a_t, b_t = node.inputs
    out = params_of(node, node.outputs[0])
    a = a_t.betensor.numpy().astype(np.int64) + _zp(node, a_t)
    b = b_t.betensor.numpy().astype(np.int64) + _zp(node, b_t)
    if method == "MUL":
        acc = a * b
        mult, shift = node.params["scale_value"], node.params["shift_value"]
    else:
        mult, m0, m1 = node.params["scale_value"]
        shift = node.params["shift_value"]
        fa, fb = a * m0, b * m1
        acc = {"ADD": lambda x, y: x + y, "SUB": lambda x, y: x - y, "MAX": np.maximum, "MIN": np.minimum}[method](
            fa, fb)
    y = ref_requant(np.asarray(acc), mult, shift, _zp(node, node.outputs[0]), out.qmin, out.qmax)
    return ref_activation(node, y)


def ref_concat(node) -> np.ndarray:
    out = params_of(node, node.outputs[0])
    zp_out = _zp(node, node.outputs[0])
    axis = node.params["axis"]
    parts = []
    for i, t in enumerate(node.inputs):
        x = t.betensor.numpy().astype(np.int64)
        if "scale_value" in node.params:
            x = ref_requant(x + _zp(node, t), node.params["scale_value"][i], node.params["shift_value"][i], zp_out,
                            out.qmin, out.qmax)
        parts.append(x)
    return np.clip(np.concatenate(parts, axis=axis), out.qmin, out.qmax)


def run_and_check(qg, inputs: Sequence[torch.Tensor]) -> None:
    qg.forward(list(inputs))
    node = qg.node("op")
    want = ref_concat(node) if str(node.type) == "Concat" else ref_binary(node)
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    out = params_of(node, node.outputs[0])
    assert int(got.min()) >= out.qmin and int(got.max()) <= out.qmax


# --- 1. integer forward vs reference ------------------------------------------------------------------------------
def test_round_shift_matches_python_half_even() -> None:
    vals = torch.tensor([-9, -7, -6, -5, -3, -2, -1, 0, 1, 2, 3, 5, 6, 7, 9, 2 ** 40 + 2 ** 9, -(2 ** 40) - 2 ** 9])
    for s in (-3, 0, 1, 2, 3, 10, 40, 63):
        got = round_shift(vals, s).tolist()
        assert got == [ref_round_shift(int(v), s) for v in vals.tolist()], s


@pytest.mark.parametrize("act", ["NONE", "RELU", "CLIP"])
@pytest.mark.parametrize("amode,bits", [("per_tensor_asymmetric", 8), ("per_tensor_symmetric_full_range", 16)])
@pytest.mark.parametrize("optype,method", [b for b in BINARY if b[0] == "Eltwise"])
def test_eltwise_in_bands_matches_the_reference(monkeypatch, optype: str, method: Optional[str], amode: str, bits: int,
                                                act: str) -> None:
    """Same-shaped large inputs are combined in bands of elements (`ops/eltwise.py` `_eltwise_in_bands`): with
    bands of 7 elements (a short last one) over 480 outputs, the reference's integers, fused activations included."""
    monkeypatch.setattr(eltwise_module, "ELTWISE_BAND_ELEMENTS", 7)
    seed = 300 + BINARY.index((optype, method))
    qg = quantize_model(binary_graph(optype, method, act=act), binary_data(seed),
                        {"q_mode_activation": amode, "q_bits_activation": bits})
    x = [v * 1.5 for v in binary_data(seed + 1, n=1)[0]]
    assert eltwise_module._bandable(qg.node("op"), *[qg.node(n).outputs[0] for n in ("a", "b")]) is False  # floats
    qg.forward(list(x), keep_tensors=True)
    node = qg.node("op")
    assert eltwise_module._bandable(node, *node.inputs)
    run_and_check(qg, x)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("amode", AMODES)
@pytest.mark.parametrize("optype,method", BINARY)
def test_binary_integer_forward_matches_reference(optype: str, method: Optional[str], amode: str, bits: int) -> None:
    seed = 100 + BINARY.index((optype, method))
    qg = quantize_model(binary_graph(optype, method), binary_data(seed),
                        {"q_mode_activation": amode, "q_bits_activation": bits})
    node = qg.node("op")
    if (method or optype.upper()) == "MUL":
        assert isinstance(node.params["scale_value"], int)
        assert node.params["scale_type"] == (Dtype.UINT8 if bits == 8 else Dtype.UINT16)
    else:
        assert len(node.params["scale_value"]) == 3
        assert node.params["scale_type"] == [Dtype.UINT16] * 3 and node.params["shift_type"] == Dtype.INT8
    assert params_of(node, node.outputs[0]).qmin < 0  # input a is signed in this data
    # 2 batches with a wider spread than calibration: exercises saturation too
    run_and_check(qg, [x * 1.5 for x in binary_data(seed + 1, n=1)[0]])


@pytest.mark.parametrize("optype,method", [("Eltwise", "MUL"), ("Mul", None), ("Eltwise", "ADD"),
                                           ("Eltwise", "SUB"), ("Eltwise", "MAX")])
@pytest.mark.parametrize("shape_b", [[1, 1, 1, 8], [1, 5, 1, 1], [8]])
def test_broadcasting_matches_reference(optype: str, method: Optional[str], shape_b: List[int]) -> None:
    """Squeeze-excite style [N,H,W,C] * [N,1,1,C] (batch 3 against an IR batch of 1), and other broadcasts."""
    qg = quantize_model(binary_graph(optype, method, shape_b), binary_data(7, shape_b, batch=3),
                        {"q_mode_activation": "per_tensor_asymmetric"})
    run_and_check(qg, binary_data(8, shape_b, n=1, batch=3)[0])


@pytest.mark.parametrize("amode", AMODES)
@pytest.mark.parametrize("act", ["RELU", "RELU6", "CLIP"])
@pytest.mark.parametrize("method", ["ADD", "SUB", "MUL", "MAX"])
def test_fused_activation_matches_reference(method: str, act: str, amode: str) -> None:
    qg = quantize_model(binary_graph("Eltwise", method, act=act), binary_data(21),
                        {"q_mode_activation": amode})
    node = qg.node("op")
    assert (params_of(node, node.outputs[0]).qmin < 0) == (act == "CLIP")  # clip_min < 0 keeps it signed
    run_and_check(qg, [x * 2.0 for x in binary_data(22, n=1)[0]])


def test_relu_with_force_dtype_int_stays_non_negative() -> None:
    """force_dtype_int makes a RELU output signed: the integer forward must still clamp at the quantized zero."""
    g = binary_graph("Eltwise", "SUB", act="RELU")
    data = binary_data(23)
    qg = quantize_model(g, data, {"force_dtype_int": True})
    node = qg.node("op")
    assert params_of(node, node.outputs[0]).qmin < 0 and node.outputs[0].dtype == Dtype.INT8
    run_and_check(qg, data[0])
    assert int(node.outputs[0].betensor.min()) >= -_zp(node, node.outputs[0])


@pytest.mark.parametrize("method", ["ADD", "SUB", "MAX", "MIN"])
def test_equal_input_scales_use_the_m11_form(method: str) -> None:
    """Both inputs with identical params: scale_value=[M, 1, 1] with M/shift for s_out / s_in."""
    r = _rng(30)
    data = []
    for _ in range(3):
        a = r.normal(0.0, 1.0, size=[2] + SHAPE_A[1:])
        data.append([_t(a), _t(np.flip(a, axis=1))])  # same values, so the same extrema and params
    qg = quantize_model(binary_graph("Eltwise", method), data, {"q_strategy_activation": "extrema",
                                                                "q_mode_activation": "per_tensor_asymmetric"})
    node = qg.node("op")
    a_t, b_t, out = (params_of(node, t) for t in (node.inputs[0], node.inputs[1], node.outputs[0]))
    assert a_t.scale == b_t.scale and a_t.zerop == b_t.zerop
    m, one0, one1 = node.params["scale_value"]
    assert (one0, one1) == (1, 1)
    ratio = out.scale / a_t.scale
    assert abs(m * 2.0 ** -node.params["shift_value"] / ratio - 1) < 2 ** -6
    assert node.params["scale_type"] == [Dtype.UINT16] * 3  # upstream declares uint16 however narrow M is
    run_and_check(qg, data[0])
    assert cosine(binary_graph("Eltwise", method).forward(data[0])[0],
                  run_quantized(qg, data[0])[0]) > 0.99


@pytest.mark.parametrize("optype,method", [("Eltwise", "ADD"), ("Eltwise", "MUL"), ("Sub", None), ("Eltwise", "MAX")])
def test_integer_inputs_give_integer_output(optype: str, method: Optional[str]) -> None:
    """Two qinvariant (integer) inputs: output scale 1, zp 0, the exact integer result, multipliers all 1."""
    r = _rng(40)
    data = [[torch.from_numpy(r.integers(-20, 20, size=[2] + SHAPE_A[1:])).to(torch.int8),
             torch.from_numpy(r.integers(-20, 20, size=[2] + SHAPE_A[1:])).to(torch.int8)] for _ in range(2)]
    qg = quantize_model(binary_graph(optype, method, in_dtype=Dtype.INT8), data)
    node = qg.node("op")
    out = node.outputs[0]
    op = params_of(node, out)
    assert op.qinvariant and op.scale == 1.0 and op.zerop == 0
    m = node.params["scale_value"]
    assert (m == 1) if isinstance(m, int) else (m == [1, 1, 1])
    assert node.params["shift_value"] == 0
    qg.forward(data[0])
    a, b = (x.to(torch.int64) for x in data[0])
    fn = {"ADD": torch.add, "MUL": torch.mul, "SUB": torch.sub, "MAX": torch.maximum}[method or optype.upper()]
    want = torch.clamp(fn(a, b), op.qmin, op.qmax)
    assert torch.equal(out.betensor, want)
    assert op.qbits >= 8


@pytest.mark.parametrize("optype,method", [("Eltwise", "MUL"), ("Mul", None)])
def test_int32_products_are_exact_at_the_extremes(optype: str, method: Optional[str]) -> None:
    """Two int32 integer inputs (an attention mask times its cumulative sum, DeBERTa's pairwise mask): the
    worst-case product 2^62 fits int64, so the layer quantizes and multiplies exactly, extremes included; the
    output saturates to int32 as upstream's does."""
    lo, hi = -2 ** 31, 2 ** 31 - 1
    a = torch.tensor([lo, lo, hi, 7, -3, 46341] * 40, dtype=torch.int64).reshape(SHAPE_A).to(torch.int32)
    b = torch.tensor([lo, 1, hi, -9, 0, 46341] * 40, dtype=torch.int64).reshape(SHAPE_A).to(torch.int32)
    data = [[a, b]]
    qg = quantize_model(binary_graph(optype, method, in_dtype=Dtype.INT32), data)
    out = qg.node("op").outputs[0]
    op = params_of(qg.node("op"), out)
    assert op.qinvariant and (op.qmin, op.qmax) == (lo, hi)
    qg.forward(data[0])
    want = [max(lo, min(hi, int(x) * int(y))) for x, y in zip(a.flatten().tolist(), b.flatten().tolist())]
    assert out.betensor.flatten().tolist() == want


def nary_graph(method: str, count: int, act: str = "NONE"):
    g = GraphBuilder("n")
    xs = [g.input(f"x{i}", SHAPE_A) for i in range(count)]
    y = g.layer("Eltwise", xs, [SHAPE_A], name="op", params={"method": method, "with_activation": act})
    return g.build([y])


def nary_data(seed: int, count: int, n: int = 3) -> List[List[torch.Tensor]]:
    """Inputs of clearly different ranges (scales 0.3 .. 3 apart), so the alignment multipliers differ."""
    r = _rng(seed)
    return [[_t(r.normal(0.1 * i, 0.5 + i, size=[2] + SHAPE_A[1:])) for i in range(count)] for _ in range(n)]


def ref_nary_multipliers(scales: Sequence[float], s_out: float) -> List[int]:
    """docs/integer-semantics.md (N inputs): M_i = rhe(2^P · s_max / s_i), P the largest shift keeping M_i <= 32767."""
    f32 = np.float32
    top = max(f32(s) for s in scales)
    ratios = [float(top / f32(s)) for s in scales]
    power = int(np.floor(np.log2(32767 / max(ratios))))
    return [int(round(r * 2.0 ** power)) for r in ratios]


def ref_nary(node) -> np.ndarray:
    method = str(node.params["method"]).upper()
    mult, *muls = node.params["scale_value"]
    acc = None
    for t, m in zip(node.inputs, muls):
        v = (t.betensor.numpy().astype(np.int64) + _zp(node, t)) * m
        acc = v if acc is None else {"ADD": np.add, "MAX": np.maximum, "MIN": np.minimum}[method](acc, v)
    out = params_of(node, node.outputs[0])
    return ref_activation(node, ref_requant(acc, mult, node.params["shift_value"], _zp(node, node.outputs[0]),
                                            out.qmin, out.qmax))


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("amode", AMODES)
@pytest.mark.parametrize("method,count,act", [("ADD", 3, "NONE"), ("MAX", 3, "NONE"), ("MIN", 4, "NONE"),
                                               ("ADD", 4, "RELU"), ("ADD", 3, "CLIP")])
def test_nary_eltwise_matches_reference(method: str, count: int, act: str, amode: str, bits: int) -> None:
    graph = nary_graph(method, count, act)
    if act == "CLIP":
        graph.node("op").params.update(clip_min=-0.7, clip_max=1.1)
    settings = dict(q_mode_activation=amode, q_bits_activation=bits)
    qg = quantize_model(graph, nary_data(52, count), settings)
    node = qg.node("op")
    assert len(node.params["scale_value"]) == count + 1
    in_scales = [params_of(node, t).scale for t in node.inputs]
    assert node.params["scale_value"][1:] == ref_nary_multipliers(in_scales, params_of(node, node.outputs[0]).scale)
    for batch in nary_data(53, count, n=2):
        qg.forward(batch)
        np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_nary(node))
    data = nary_data(52, count)[0]  # a calibration batch: no saturation beyond the calibrated range
    graph.forward(data)
    want = graph.output_tensors[0].betensor.clone()
    assert cosine(want, run_quantized(qg, data)[0]) > (0.99 if bits == 8 else 0.9999)


def test_nary_equal_inputs_use_the_m11_form_and_reload(tmp_path) -> None:
    g = GraphBuilder("n")
    x = g.input("x", SHAPE_A)
    y = g.layer("Eltwise", [x, x, x], [SHAPE_A], name="op", params={"method": "ADD", "with_activation": "NONE"})
    r = _rng(55)
    qg = quantize_model(g.build([y]), [[_t(r.normal(size=[2] + SHAPE_A[1:]))] for _ in range(2)])
    assert qg.node("op").params["scale_value"][1:] == [1, 1, 1]
    txt, _ = write_ir(qg, str(tmp_path / "n_o.txt"))
    again = read_ir(txt)
    batch = [_t(r.normal(size=[2] + SHAPE_A[1:]))]
    assert torch.equal(run_quantized(qg, batch)[0], run_quantized(again, batch)[0])


def test_nary_sub_mul_and_unsupported_activation_raise() -> None:
    r = _rng(50)
    for method in ("SUB", "MUL"):  # refused by the float forward already, as an IR error naming the layer
        with pytest.raises(QuantOptError, match="'op'.*exactly 2 inputs"):
            quantize_model(nary_graph(method, 3), [[_t(r.normal(size=SHAPE_A)) for _ in range(3)]])
    with pytest.raises(UnsupportedError, match="LEAKYRELU"):
        quantize_model(binary_graph("Eltwise", "ADD", act="LEAKYRELU"), binary_data(51))


# --- 2. float vs dequantized --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("optype,method", BINARY)
def test_binary_float_vs_dequantized_cosine(optype: str, method: Optional[str], bits: int, threshold: float) -> None:
    g = binary_graph(optype, method, shape_b=[1, 1, 1, 8] if (method or optype.upper()) == "MUL" else SHAPE_A)
    data = binary_data(60, [1, 1, 1, 8] if (method or optype.upper()) == "MUL" else SHAPE_A)
    qg = quantize_model(g, data, {"q_bits_activation": bits, "q_strategy_activation": "extrema"})
    ref = g.forward(data[0])[0].clone()
    assert cosine(ref, run_quantized(qg, data[0])[0]) > threshold


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
def test_concat_float_vs_dequantized_cosine(bits: int, threshold: float) -> None:
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5]])
    r = _rng(61)
    data = [[_t(r.normal(0, 1, size=[2, 4, 4, 3])), _t(np.abs(r.normal(0, 3, size=[2, 4, 4, 5])))] for _ in range(3)]
    qg = quantize_model(g, data, {"q_bits_activation": bits, "q_strategy_activation": "extrema"})
    assert "scale_value" in qg.node("op").params
    ref = g.forward(data[0])[0].clone()
    assert cosine(ref, run_quantized(qg, data[0])[0]) > threshold


# --- 3. The Eltwise ADD example of docs/integer-semantics.md --------------------------------------------------------
def test_eltwise_example_add() -> None:
    g = binary_graph("Eltwise", "ADD")
    node = g.node("op")
    node.settings = LayerSettings(q_mode_activation="per_tensor_asymmetric")
    for t, (s, zp) in zip(node.inputs, [(44.694862, 5), (44.760075, -15)]):
        set_quant(node, t, scale=s, zerop=zp, qmin=-128, qmax=127, qbits=8, qinvariant=False)
        t.dtype = Dtype.INT8
    out = node.outputs[0]
    s_out = 31.199003
    set_range(node, out, -133 / s_out, -133 / s_out + 255 / s_out)  # → s_out, zp_out = -5 (int8 asymmetric)
    node.quantize()
    op = params_of(node, out)
    assert abs(op.scale - s_out) < 1e-4 and op.zerop == -5 and (op.qmin, op.qmax) == (-128, 127)
    assert node.params["scale_value"] == [128, 22917, 22884]
    assert node.params["shift_value"] == 22
    assert node.params["scale_type"] == [Dtype.UINT16] * 3 and node.params["shift_type"] == Dtype.INT8
    # y = clamp(round_half_even(((a+5)*22917 + (b-15)*22884) * 128 * 2^-22) + 5, -128, 127), by hand:
    # (10, 20): 458175*128/2^22 = 13.98 → 14 → 19;  (0, 0): -6.98 → -7 → -2;  (-50, 77): 11.83 → 12 → 17;
    # (100, -100): -6.88 → -7 → -2;  saturation at both ends
    a = torch.tensor([10, 0, -50, 100, -128, 127], dtype=torch.int64)
    b = torch.tensor([20, 0, 77, -100, -128, 127], dtype=torch.int64)
    node.inputs[0].betensor, node.inputs[1].betensor = a, b
    node.forward()
    assert out.betensor.tolist() == [19, -2, 17, -2, -128, 127]


# --- 5. Concat ------------------------------------------------------------------------------------------------------
def test_concat_passthrough_writes_no_params() -> None:
    """Scales within concat_threshold (1.03 < 1.05) and equal zero points: values pass through unchanged."""
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5]])
    r = _rng(70)
    data = []
    for _ in range(2):
        a = r.uniform(-1.0, 1.0, size=[2, 4, 4, 3])
        b = r.uniform(-1.0, 1.0, size=[2, 4, 4, 5])
        a[0, 0, 0, 0], b[0, 0, 0, 0] = 1.0, 1.03  # extrema 1.0 and 1.03 in every batch
        data.append([_t(a), _t(b)])
    qg = quantize_model(g, data, {"q_strategy_activation": "extrema"})
    node = qg.node("op")
    assert not any(k in node.params for k in ("scale_value", "shift_value", "scale_type", "shift_type"))
    s = [params_of(node, t).scale for t in node.inputs] + [params_of(node, node.outputs[0]).scale]
    assert 1.0 < max(s) / min(s) <= 1.05
    qg.forward(data[0])
    want = torch.cat([t.betensor for t in node.inputs], dim=-1)
    assert torch.equal(node.outputs[0].betensor, want)
    run_and_check(qg, data[1])


def test_concat_identical_branches_copy_params() -> None:
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 3]], axis=1)
    r = _rng(71)
    data = []
    for _ in range(2):
        a = r.normal(0, 1, size=[2, 4, 4, 3])
        data.append([_t(a), _t(a[:, ::-1])])
    qg = quantize_model(g, data, {"q_strategy_activation": "extrema", "q_mode_activation": "per_tensor_asymmetric"})
    node = qg.node("op")
    x0, out = node.inputs[0], node.outputs[0]
    xp, op = params_of(node, x0), params_of(node, out)
    assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (xp.scale, xp.zerop, xp.qmin, xp.qmax, x0.dtype)
    assert "scale_value" not in node.params
    run_and_check(qg, data[0])


@pytest.fixture(params=["arithmetic", "tables"])
def concat_path(request, monkeypatch) -> str:
    """The requantized Concat by arithmetic, or with every branch read from its table of codes at any size."""
    from quantopt.ops import concat as concat_module

    monkeypatch.setattr(concat_module, "CONCAT_TABLE_MIN_ELEMENTS", 0 if request.param == "tables" else 1 << 62)
    return request.param


def _tables_used(qg) -> bool:
    return "_memo_concat_branch_table_0" in qg.node("op").attrs


@pytest.mark.parametrize("amode", AMODES)
def test_concat_requant_matches_reference(amode: str, concat_path: str) -> None:
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5], [1, 4, 4, 2]])
    r = _rng(72)
    data = [[_t(r.normal(0, 1, size=[2, 4, 4, 3])), _t(r.normal(0.5, 4, size=[2, 4, 4, 5])),
             _t(r.normal(0, 0.1, size=[2, 4, 4, 2]))] for _ in range(3)]
    qg = quantize_model(g, data, {"q_mode_activation": amode})
    node = qg.node("op")
    assert len(node.params["scale_value"]) == 3 and len(node.params["shift_value"]) == 3
    assert node.params["scale_type"] == [Dtype.UINT8] * 3 and node.params["shift_type"] == [Dtype.INT8] * 3
    run_and_check(qg, [x * 1.3 for x in data[0]])
    assert _tables_used(qg) == (concat_path == "tables")


def test_concat_branch_codes_outside_their_range_are_computed(concat_path: str) -> None:
    """A hand-fed code outside a branch's [qmin, qmax] (below, above) leaves the tables: the arithmetic gives the
    reference's integers."""
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5]])
    r = _rng(75)
    data = [[_t(r.normal(0, 1, size=[2, 4, 4, 3])), _t(r.normal(0.5, 4, size=[2, 4, 4, 5]))] for _ in range(3)]
    qg = quantize_model(g, data, {"q_mode_activation": "per_tensor_asymmetric"})
    qg.forward(data[0])
    node = qg.node("op")
    for t, codes in zip(node.inputs, ([-200, 300], [255, -129])):
        x = t.betensor.clone()
        x.view(-1)[:2] = torch.tensor(codes, dtype=x.dtype)
        t.betensor = x
    node.forward()
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_concat(node))


@pytest.mark.parametrize("axis,bits", [(-1, 8), (1, 8), (2, 16)])
def test_concat_written_into_one_output_matches_reference(monkeypatch, axis: int, bits: int) -> None:
    """Branches requantized by the rounding by addition straight into their slices of one output (`_concat_scaled`)
    give the reference's integers, on any axis, and are the path such a layer takes."""
    from quantopt.ops import concat as concat_module

    results = []
    real = concat_module._concat_scaled
    monkeypatch.setattr(concat_module, "_concat_scaled", lambda *a: results.append(real(*a)) or results[-1])
    shapes = [[1, 4, 4, 3], [1, 4, 4, 3], [1, 4, 4, 3]]
    for i, s in enumerate(shapes):
        s[axis] += i
    g = concat_graph(shapes, axis)
    r = _rng(74)
    data = [[_t(r.normal(0.2 * i, 1 + 2 * i, size=[2] + s[1:])) for i, s in enumerate(shapes)] for _ in range(3)]
    qg = quantize_model(g, data, {"q_bits_activation": bits})
    run_and_check(qg, [x * 1.3 for x in data[0]])  # beyond the calibrated ranges: clamped
    assert results and results[-1] is not None


def test_concat_mixed_signed_unsigned_branches(concat_path: str) -> None:
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5]])
    r = _rng(73)
    data = [[_t(r.normal(0, 1, size=[2, 4, 4, 3])), _t(np.abs(r.normal(0, 1, size=[2, 4, 4, 5])))] for _ in range(3)]
    qg = quantize_model(g, data)
    node = qg.node("op")
    assert node.inputs[0].dtype == Dtype.INT8 and node.inputs[1].dtype == Dtype.UINT8
    assert node.outputs[0].dtype == Dtype.INT8
    assert "scale_value" in node.params
    run_and_check(qg, data[0])


def test_concat_mixed_8_and_16_bit_branches(concat_path: str) -> None:
    """Output bits = the widest branch (16); the 8-bit branch is requantized with a 16-bit multiplier."""
    g = concat_graph([[1, 4, 4, 3], [1, 4, 4, 5]])
    r = _rng(74)
    data = [[_t(r.normal(0, 1, size=[2, 4, 4, 3])), _t(r.normal(0, 2, size=[2, 4, 4, 5]))] for _ in range(3)]
    qg = quantize_model(g, data, per_layer={"x1": {"q_bits_activation": 16}})
    node = qg.node("op")
    assert params_of(node, node.inputs[0]).qbits == 8 and params_of(node, node.inputs[1]).qbits == 16
    assert params_of(node, node.outputs[0]).qbits == 16 and node.outputs[0].dtype == Dtype.INT16
    assert node.params["scale_type"] == [Dtype.UINT16] * 2
    run_and_check(qg, data[0])
    ref = g.forward(data[0])[0].clone()
    assert cosine(ref, run_quantized(qg, data[0])[0]) > 0.99


def test_concat_of_integers_passes_through() -> None:
    g = GraphBuilder("ci")
    a = g.input("a", [1, 6], dtype=Dtype.INT8)
    b = g.input("b", [1, 4], dtype=Dtype.INT16)
    y = g.layer("Concat", [a, b], [[1, 10]], name="op", params={"axis": 1})
    graph = g.build([y])
    data = [[torch.arange(-3, 3, dtype=torch.int8).reshape(1, 6), torch.tensor([[-300, 0, 5, 300]], dtype=torch.int16)]]
    qg = quantize_model(graph, data)
    node = qg.node("op")
    out = node.outputs[0]
    assert params_of(node, out).qinvariant and out.dtype == Dtype.INT16 and "scale_value" not in node.params
    qg.forward(data[0])
    assert out.betensor.tolist() == [[-3, -2, -1, 0, 1, 2, -300, 0, 5, 300]]


# --- 4. IR write → reload ----------------------------------------------------------------------------------------
def mixed_graph():
    """Residual add, SE-style Mul, SUB+RELU, MAX with an equal-scale pair, and two Concats."""
    g = GraphBuilder("mix")
    x = g.input("x", [1, 4, 4, 6])
    s = g.input("s", [1, 1, 1, 6])
    add = g.layer("Add", [x, x], [[1, 4, 4, 6]], name="add", params={"with_activation": "NONE"})
    mul = g.layer("Mul", [add, s], [[1, 4, 4, 6]], name="mul", params={"with_activation": "NONE"})
    sub = g.layer("Eltwise", [mul, x], [[1, 4, 4, 6]], name="sub", params={"method": "SUB", "with_activation": "RELU"})
    mx = g.layer("Eltwise", [x, x], [[1, 4, 4, 6]], name="max", params={"method": "MAX", "with_activation": "NONE"})
    cat = g.layer("Concat", [sub, mx, mul], [[1, 4, 4, 18]], name="cat", params={"axis": 3})
    cat2 = g.layer("Concat", [x, x], [[1, 4, 8, 6]], name="cat2", params={"axis": 2})
    return g.build([cat, cat2])


@pytest.mark.parametrize("amode,bits", [(AMODES[0], 8), (AMODES[1], 8), (AMODES[2], 8), (AMODES[0], 16)])
def test_written_ir_reloads_bit_identical(tmp_path, amode: str, bits: int) -> None:
    g = mixed_graph()
    r = _rng(80)
    data = [[_t(r.normal(0.2, 1, size=[2, 4, 4, 6])), _t(r.uniform(0, 1, size=[2, 1, 1, 6]))] for _ in range(3)]
    qg = quantize_model(g, data, {"q_mode_activation": amode, "q_bits_activation": bits})
    assert "scale_value" in qg.node("cat").params and "scale_value" not in qg.node("cat2").params
    before = [t.clone() for t in qg.forward(data[0])]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    text = open(txt, encoding="utf-8").read()
    assert "scale_type=[uint16,uint16,uint16]" in text or "scale_type=[uint8,uint16,uint16]" in text
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    for name in ("add", "mul", "sub", "max", "cat"):
        assert re.node(name).params["scale_value"] == qg.node(name).params["scale_value"]
        assert re.node(name).params["shift_value"] == qg.node(name).params["shift_value"]
    after = re.forward(data[0], keep_tensors=True)
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    for name in ("add", "mul", "sub", "max", "cat", "cat2"):
        run_and_check_node(re.node(name))


def run_and_check_node(node) -> None:
    want = ref_concat(node) if str(node.type) == "Concat" else ref_binary(node)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)


# --- upstream-written IRs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("letter", ["A", "B", "C"])
def test_golden_eltwise_and_mul_layers_run_the_documented_formula(letter: str) -> None:
    """The integer forward reads upstream's quantized Eltwise/Mul layers as written (lists, dtypes, zero points)."""
    from conftest import MODEL_NAMES, shared_model_dir

    r = _rng(90)
    count = 0
    for model in MODEL_NAMES:
        g = read_ir(str(shared_model_dir(model) / "golden" / letter / f"{model}_o.txt"))
        for node in g.nodes:
            if str(node.type) not in ("Eltwise", "Mul", "Add", "Sub", "Concat"):
                continue
            for t in node.inputs:
                q = params_of(node, t)
                t.betensor = torch.from_numpy(r.integers(q.qmin, q.qmax + 1, size=t.ir_shape)).to(torch.int64)
            node.forward()
            run_and_check_node(node)
            count += 1
    assert count > 0
