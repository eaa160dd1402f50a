"""Softmax FAST_EXP and its selection rule, LogSoftmax and Hardmax: float forward against torch/numpy, integer
forward against an independent python-int reference written from docs/semantics/softmax.md, cosine, exact 0/1
Hardmax, IR write → re-read, bad params. (The LUT method is tested in test_int_activation_softmax.py.)"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, shared_model_dir
from int_refs import clamp
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.calibration.inf_mask import SOFTMAX_MASK_PARAM
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.ops import softmax as softmax_module
from quantopt.ops.softmax import fast_exp_tables, softmax_method
from quantopt.pipeline import quantize_model, run_quantized

MODES = [(8, "per_tensor_symmetric_full_range", 8), (8, "per_tensor_asymmetric", 8),
         (8, "per_tensor_symmetric_restricted_range", 8), (16, "per_tensor_symmetric_full_range", 10)]
SHAPES = [([1, 4, 10], -1), ([1, 6, 5], 1), ([1, 300], 1)]


def logits(shape: Sequence[int], seed: int, std: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.2, std, list(shape)).astype(np.float32))


def graph(optype: str, shape: Sequence[int], params: Dict[str, Any], consumer: str = "Reshape"):
    """optype → consumer (a Reshape keeps the Softmax off the graph outputs, so its rule picks FAST_EXP)."""
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(optype, [x], [list(shape)], name="op", params=dict(params))
    if consumer:
        y = b.layer(consumer, [y], [list(shape)], name="next", params={"shape": list(shape)})
    return b.build([y])


def settings(bits: int, mode: str, lut_bits: int) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                q_bits_bias=48 if bits > 8 else 32)


def quantized(optype: str, shape, params, bits: int, mode: str, lut_bits: int, consumer: str = "Reshape",
              **extra: Any):
    g = graph(optype, shape, params, consumer)
    data = [logits([2] + list(shape[1:]), 20 + i) for i in range(3)]
    return g, quantize_model(g, data, {**settings(bits, mode, lut_bits), **extra}), data


EXACT = dict(logsoftmax_integer_form="exact")
"""LogSoftmax in quantopt's exact form (the default is upstream's, tests/ops/test_logsoftmax_upstream.py)."""


# --- python-int reference ----------------------------------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    if shift <= 0:
        return num << -shift
    q, r = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def floor_shift(v: int, s: int) -> int:
    return v >> s if s >= 0 else v << -s


def interp(table: List[int], index: int, index_bits: int, end: int) -> int:
    t = len(table).bit_length() - 1
    b = index_bits - t
    hi, lo = index >> b, index & ((1 << b) - 1)
    a = table[hi]
    c = table[hi + 1] if hi + 1 < len(table) else end
    return a + (((c - a) * lo) >> b)


def rows_of(node, x_q: np.ndarray):
    axis = int(node.params.get("axis", -1)) % x_q.ndim
    moved = np.moveaxis(x_q.astype(np.int64), axis, -1)
    return axis, moved, moved.reshape(-1, moved.shape[-1])


def pow2_no_interp(table: List[int], v: int, frac: int, out_bits: int) -> int:
    """floor(table[top 8 fraction bits of v] * 2^(out_bits + floor(v / 2^frac) - 15)), v <= 0."""
    i = v >> frac
    j = (v - (i << frac)) >> (frac - 8)
    return floor_shift(table[j] << 15, 30 - out_bits - i)


def log2_terms(node, row: List[int]):
    """u per element and the power-of-two terms e (table path)."""
    p = node.params
    m, n, frac, out_q = (int(p["input_scale_value"]), int(p["input_shift_value"]), int(p["adjust_q"]),
                         int(p["pow2_out_q"]))
    table = [int(v) for v in node.constants["pow2_lut"].betensor.tolist()]
    top = max(row)
    us, es = [], []
    for v in row:
        u = floor_shift((v - top) * m, n - frac)
        i = u >> frac
        f = u - (i << frac)
        pv = interp(table, f, frac, 1 << 16)
        us.append(u)
        es.append((pv << out_q) >> min(15 - i, 62))
    return us, es


def ref_fast_exp(node, x_q: np.ndarray) -> np.ndarray:
    p = node.params
    out = params_of(node, node.outputs[0])
    zp, qmin, qmax = int(out.zerop), int(out.qmin), int(out.qmax)
    axis, moved, rows = rows_of(node, x_q)
    res = np.empty_like(rows)
    q = int(p["adjust_q"])
    for r, row in enumerate(rows.tolist()):
        if q >= 8:
            # upstream's log-domain form: no interpolation, Q15 log2 of the normalized sum, a second 2^x lookup
            table = [int(v) for v in node.constants["pow2_lut"].betensor.tolist()]
            m, n, big_p = int(p["input_scale_value"]), int(p["input_shift_value"]), int(p["pow2_out_q"])
            top = max(row)
            us = [floor_shift((v - top) * m, n - q) for v in row]
            total = clamp(sum(pow2_no_interp(table, u, q, big_p) for u in us), 1, 2 ** 31 - 1)
            lead = 31 - total.bit_length()
            mant = ((total << lead) >> 22) & 255
            log2_sum = ((round(math.log2(1 + mant / 256) * 2 ** 15) << 15) >> (30 - q)) - ((lead - (30 - big_p)) << q)
            bits = (qmax - qmin).bit_length()
            for j, u in enumerate(us):
                res[r, j] = clamp(pow2_no_interp(table, u - log2_sum, q, bits) - zp, qmin, qmax)
            continue
        m, n, big_p = int(p["input_scale_value"]), int(p["input_shift_value"]), int(p["pow2_out_q"])
        top = max(row)
        ls = [floor_shift((v - top) * m, n) for v in row]
        total = clamp(sum((1 << (big_p + v)) if big_p + v >= 0 else 0 for v in ls), 1, 2 ** 31 - 1)
        lead = 31 - total.bit_length()
        half = 1 if q == 1 and (total << lead) > 1518500250 else 0
        log2_sum = half - ((lead - (30 - big_p)) << q)
        bits = (qmax - qmin).bit_length()
        for j, v in enumerate(ls):
            z = (((v + bits) << q) - log2_sum) >> q
            res[r, j] = clamp(((1 << z) if z >= 0 else 0) - zp, qmin, qmax)
    return np.moveaxis(res.reshape(moved.shape), -1, axis)


def ref_logsoftmax(node, x_q: np.ndarray) -> np.ndarray:
    p = node.params
    out = params_of(node, node.outputs[0])
    zp, qmin, qmax = int(out.zerop), int(out.qmin), int(out.qmax)
    frac, out_q = int(p["adjust_q"]), int(p["pow2_out_q"])
    log_table = [int(v) for v in node.constants["log2_lut"].betensor.tolist()]
    axis, moved, rows = rows_of(node, x_q)
    res = np.empty_like(rows)
    for r, row in enumerate(rows.tolist()):
        us, es = log2_terms(node, row)
        total = sum(es)
        k = total.bit_length() - 1
        mant = ((total << 16) >> k) - (1 << 16)
        lg = interp(log_table, mant, 16, 1 << 16)
        log_sum = ((k - out_q) << frac) + (lg >> (16 - frac))
        for j, u in enumerate(us):
            res[r, j] = clamp(rhe((u - log_sum) * int(p["scale_value"]), int(p["shift_value"]) + frac) - zp,
                              qmin, qmax)
    return np.moveaxis(res.reshape(moved.shape), -1, axis)


def check_integer(qg, x: torch.Tensor, reference) -> None:
    qg.forward([x], keep_tensors=True)
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), reference(node, node.inputs[0].betensor.numpy()))


# --- 1. float forward -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_float_logsoftmax_matches_torch(shape, axis: int) -> None:
    x = logits(shape, 1)
    got = graph("LogSoftmax", shape, {"axis": axis}, consumer="").forward([x])[0]
    torch.testing.assert_close(got, torch.log_softmax(x, dim=axis))


def test_float_hardmax_is_onehot_of_first_maximum() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, 0.5, 0.4]])
    got = graph("Hardmax", [3, 4], {"axis": 1}, consumer="").forward([x])[0]
    want = np.zeros((3, 4), np.float32)
    for i, row in enumerate(x.numpy()):
        want[i, int(np.argmax(row))] = 1.0  # numpy argmax: first maximum, as ONNX Hardmax
    np.testing.assert_array_equal(got.numpy(), want)
    got0 = graph("Hardmax", [3, 4], {"axis": 0}, consumer="").forward([x])[0]
    np.testing.assert_array_equal(got0.numpy().argmax(axis=0), x.numpy().argmax(axis=0))


# --- 2. Softmax method selection --------------------------------------------------------------------------------
def test_selection_rule() -> None:
    assert softmax_method(graph("Softmax", [1, 10], {"axis": 1}, consumer="").node("op")) == "LUT"
    assert softmax_method(graph("Softmax", [1, 10], {"axis": 1}).node("op")) == "FAST_EXP"
    for consumer in ("NMS", "Sort", "ArgMinMax", "TopK", "InTopK"):
        assert softmax_method(graph("Softmax", [1, 10], {"axis": 1}, consumer=consumer).node("op")) == "LUT"
    explicit = graph("Softmax", [1, 10], {"axis": 1, "quantize_method": "lut"}).node("op")
    assert softmax_method(explicit) == "LUT"
    with pytest.raises(IRError, match="quantize_method"):
        softmax_method(graph("Softmax", [1, 10], {"axis": 1, "quantize_method": "EXACT"}).node("op"))


@functools.cache
def _golden(model: str):
    return read_ir(str(shared_model_dir(model) / "golden" / "A" / f"{model}_o.txt"))


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_rule_reproduces_golden_methods(model: str) -> None:
    """Every golden Softmax's method is what the rule picks on the float IR."""
    fl = read_ir(str(shared_model_dir(model) / f"{model}.txt"))
    golden = {n.name: n for n in _golden(model).nodes}
    nodes = [n for n in fl.nodes if str(n.type) == "Softmax"]
    if not nodes:
        pytest.skip("no Softmax layer")
    for n in nodes:
        assert softmax_method(n) == golden[n.name].params["quantize_method"]


def test_fast_exp_quantized_params() -> None:
    _, qg, _ = quantized("Softmax", [1, 4, 10], {"axis": -1}, 8, "per_tensor_asymmetric", 8)
    node = qg.node("op")
    p = node.params
    assert p["quantize_method"] == "FAST_EXP" and p["adjust_q"] == 8 and p["pow2_out_q"] == 31 - 3
    assert p["input_scale_value"] < 2 ** 13 and p["input_scale_type"].value == "uint16"
    out = params_of(node, node.outputs[0])
    assert (out.qmin, out.qmax, out.zerop, out.scale) == (0, 255, 0, 255.0)
    lut = node.constants["pow2_lut"]
    assert lut.dtype.value == "uint16" and lut.betensor.numel() == 256 and int(lut.betensor[0]) == 2 ** 15


# --- 3. integer forward against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[0], MODES[1], MODES[3]])
@pytest.mark.parametrize("shape,axis", SHAPES)
@pytest.mark.parametrize("adjust_q", [None, 1, 0, 11, 13])
def test_fast_exp_integer_matches_reference(shape, axis: int, bits: int, mode: str, lut_bits: int, adjust_q) -> None:
    """adjust_q 8 (the default) and 11: u, e and the output by tables (`fast_exp_tables`); 13: by the arithmetic;
    0 and 1: the power-of-two path."""
    params = {"axis": axis} if adjust_q is None else {"axis": axis, "adjust_q": adjust_q}
    _, qg, _ = quantized("Softmax", shape, params, bits, mode, lut_bits)
    node = qg.node("op")
    assert node.params["quantize_method"] == "FAST_EXP"
    assert (fast_exp_tables(node, torch.device("cpu")) is not None) == (adjust_q in (None, 11))
    check_integer(qg, logits([3] + list(shape[1:]), 4, std=5.0), ref_fast_exp)


@pytest.mark.parametrize("consumer", ["Reshape", ""], ids=["FAST_EXP", "LUT"])
@pytest.mark.parametrize("shape", [[2, 9, 12], [2, 64, 6]], ids=["long_rows", "short_rows"])
@pytest.mark.parametrize("masked", [False, True])
def test_bands_of_rows_give_the_whole_tensors_integers(monkeypatch, consumer: str, shape, masked: bool) -> None:
    """The integer Softmax runs on bands of rows of a large input (`by_row_bands`): with bands of 7 to 40 elements
    (one to a few rows, the last band short) the integers are those of the whole tensor at once, by either method,
    with masked inputs, and the LUT method keeps the form the whole input's row count chooses (128 short rows of 6)."""
    params = {"axis": -1}
    _, qg, _ = quantized("Softmax", shape, params, 8, "per_tensor_asymmetric", 8, consumer=consumer)
    node = qg.node("op")
    assert node.params["quantize_method"] == ("FAST_EXP" if consumer else "LUT")
    if masked:
        node.params[SOFTMAX_MASK_PARAM] = True
    x = logits(shape, 11, std=5.0)
    if masked:
        x[0, 1, 2:5] = -1e4
        x[1, 3, :] = -1e4
    whole = run_quantized(qg, x)[0].clone()
    for band in (7, 12, 40):
        monkeypatch.setattr(softmax_module, "SOFTMAX_BAND_ELEMENTS", band)
        monkeypatch.setattr(softmax_module.by_row_bands, "__defaults__", (band,))
        assert torch.equal(run_quantized(qg, x)[0], whole), band


@pytest.mark.parametrize("extra", [{}, {"force_dtype_int": True}])
@pytest.mark.parametrize("zp", [None, 5, -3])
def test_fast_exp_tables_match_the_arithmetic_on_masked_inputs(monkeypatch, extra: Dict[str, Any], zp) -> None:
    """With `mask_saturated_input`, the table path (output table offset by the zero point and clamped, masked
    positions filled with clamp(-zp)) gives the arithmetic path's integers: rows partly at qmin, a row wholly at
    qmin (it keeps its terms) and columns at qmin; with the output's zero point as quantized and moved (both paths
    read it alike)."""
    _, qg, _ = quantized("Softmax", [1, 4, 10], {"axis": -1}, 8, "per_tensor_asymmetric", 8, **extra)
    node = qg.node("op")
    node.params[SOFTMAX_MASK_PARAM] = True
    if zp is not None:
        monkeypatch.setattr(softmax_module, "tensor_zp", lambda _node, _t: zp)
    x = logits([3, 4, 10], 9, std=5.0)
    x[0, 1, 3:7] = -1e4
    x[1, 2, :] = -1e4
    x[2, :, ::3] = -1e4
    assert fast_exp_tables(node, torch.device("cpu")) is not None
    qg.forward([x], keep_tensors=True)
    x_q = node.inputs[0].betensor
    qmin = int(params_of(node, node.inputs[0]).qmin)
    assert int((x_q == qmin).sum()) >= 4 + 10 + 16 and bool((x_q[1, 2] == qmin).all())
    with_tables = run_quantized(qg, x)[0].clone()
    monkeypatch.setattr(softmax_module, "fast_exp_tables", lambda _node, _device: None)
    assert torch.equal(with_tables, run_quantized(qg, x)[0])


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_logsoftmax_integer_matches_reference(shape, axis: int, bits: int, mode: str, lut_bits: int) -> None:
    _, qg, _ = quantized("LogSoftmax", shape, {"axis": axis}, bits, mode, lut_bits, **EXACT)
    assert "log2_lut" in qg.node("op").constants and "lut_exp" not in qg.node("op").constants
    check_integer(qg, logits([3] + list(shape[1:]), 5, std=5.0), ref_logsoftmax)


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
def test_hardmax_is_exact(bits: int, mode: str, lut_bits: int) -> None:
    g, qg, _ = quantized("Hardmax", [1, 4, 10], {"axis": -1}, bits, mode, lut_bits, consumer="")
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    assert oq.qinvariant and (oq.scale, oq.zerop, oq.qmin, oq.qmax) == (1.0, 0, 0, 255)
    x = logits([3, 4, 10], 6)
    x[0, 0, :3] = 5.0  # a tie: the first index wins
    qg.forward([x], keep_tensors=True)
    x_q = node.inputs[0].betensor.numpy()
    want = np.zeros(x_q.shape, np.int64)
    idx = np.argmax(x_q, axis=-1)
    np.put_along_axis(want, idx[..., None], 1, axis=-1)
    np.testing.assert_array_equal(out.betensor.numpy(), want)
    assert int(out.betensor[0, 0, 0]) == 1 and int(out.betensor[0, 0, 1:].sum()) == 0
    # without ties in the quantized codes, the float one-hot is reproduced exactly
    ties = (x_q == x_q.max(axis=-1, keepdims=True)).sum(axis=-1) > 1
    ref = g.forward([x])[0].numpy()
    np.testing.assert_array_equal(run_quantized(qg, x)[0].numpy()[~ties], ref[~ties])


# --- 4. float vs dequantized ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.99), (16, 10, 0.9999)])
@pytest.mark.parametrize("mode", ["per_tensor_symmetric_full_range", "per_tensor_asymmetric"])
@pytest.mark.parametrize("optype", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_float_vs_dequantized_cosine(optype: str, shape, axis: int, mode: str, bits: int, lut_bits: int,
                                     threshold: float) -> None:
    g, qg, data = quantized(optype, shape, {"axis": axis}, bits, mode, lut_bits, **EXACT)
    assert cosine(g.forward([data[0]])[0].clone(), run_quantized(qg, data[0])[0]) > threshold


# --- 5. IR write → re-read ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params", [("Softmax", {"axis": -1}), ("Softmax", {"axis": 1, "adjust_q": 1}),
                                           ("LogSoftmax", {"axis": -1}), ("Hardmax", {"axis": 1})])
@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[1], MODES[3]])
@pytest.mark.parametrize("form", ["upstream", "exact"])
def test_written_ir_reloads_bit_identical(tmp_path, optype: str, params, bits: int, mode: str,
                                          lut_bits: int, form: str) -> None:
    if form == "exact" and optype != "LogSoftmax":
        pytest.skip("the field selects LogSoftmax's form only")
    _, qg, _ = quantized(optype, [1, 4, 10], params, bits, mode, lut_bits, logsoftmax_integer_form=form)
    x = logits([3, 4, 10], 7, std=4.0)
    before = qg.forward([x])[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    if optype == "Softmax":
        assert re.node("op").params["quantize_method"] == "FAST_EXP"
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


# --- 6. errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params,match", [("Softmax", {"axis": -1, "adjust_q": 4}, "adjust_q"),
                                                 ("LogSoftmax", {"axis": -1, "adjust_q": 1}, "adjust_q"),
                                                 ("LogSoftmax", {"axis": 3}, "out of range"),
                                                 ("Hardmax", {"axis": 2.5}, "axis")])
def test_bad_params_are_clear_errors(optype: str, params, match: str) -> None:
    with pytest.raises(IRError, match=match):
        quantized(optype, [1, 4, 10], params, 8, "per_tensor_asymmetric", 8, **EXACT)


PER_CHANNEL = "per_channel_symmetric_full_range"
"""Set for the layer itself, a per-channel mode it cannot produce is refused; a global one falls back to per
tensor (passes/per_channel_fallback.py, tests/ops/test_per_channel_activations.py)."""


@pytest.mark.parametrize("optype", ["Softmax", "LogSoftmax"])
def test_per_channel_activation_mode_is_unsupported(optype: str) -> None:
    g = graph(optype, [1, 4, 10], {"axis": -1})
    with pytest.raises(UnsupportedError, match="per-channel"):
        quantize_model(g, [logits([2, 4, 10], 8)], per_layer={"op": {"q_mode_activation": PER_CHANNEL}})
