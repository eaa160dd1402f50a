"""Activations (every Activation method and standalone type) and Softmax: integer forward against an independent
python-int reference written from docs/integer-semantics.md, float-vs-dequantized cosine, upstream's sigmoid LUT
example, the golden IRs' Activation/Softmax parameters recomputed by our quantize functions, IR write → re-read."""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, shared_model_dir
from quant_helpers import params_of, set_quant
from range_helpers import set_range

from quantopt.analysis.similarity import cosine
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.params import QuantMode, linear_quant_params

SHAPE = [1, 4, 5, 6]
PRELU_SLOPE = np.linspace(-0.3, 0.6, 6).astype(np.float32)

# (layer type, params, constants): every Activation method and every standalone type
ACTIVATION_CASES: List[Tuple[str, Dict[str, Any], Dict[str, Any]]] = [
    ("Activation", {"method": "NONE"}, {}),
    ("Activation", {"method": "RELU"}, {}),
    ("Activation", {"method": "RELU6"}, {}),
    ("Activation", {"method": "CLIP", "clip_min": -1.5, "clip_max": 2.0}, {}),
    ("Activation", {"method": "CLIP", "clip_min": 0.5, "clip_max": 3.0}, {}),
    ("Activation", {"method": "LEAKYRELU", "negative_slope_value": 0.1}, {}),
    ("Activation", {"method": "LEAKYRELU", "negative_slope": 0.2}, {}),
    ("Activation", {"method": "PRELU"}, {"negative_slope": PRELU_SLOPE.reshape(1, 1, 1, 6)}),
    ("Activation", {"method": "PRELU"}, {"negative_slope": np.tile(PRELU_SLOPE, (1, 4, 5, 1))}),
    ("Activation", {"method": "PRELU", "negative_slope": 0.25}, {}),
    ("Activation", {"method": "SIGMOID"}, {}),
    ("Activation", {"method": "TANH"}, {}),
    ("Activation", {"method": "HARDSWISH"}, {}),
    ("Activation", {"method": "HARDSIGMOID", "alpha": 0.2, "beta": 0.5, "clip_min": 0.0, "clip_max": 1.0}, {}),
    ("Activation", {"method": "HARDSIGMOID", "alpha": 0.3, "beta": 0.1, "clip_min": -0.5, "clip_max": 0.8}, {}),
    ("Activation", {"method": "ELU", "alpha": 0.7}, {}),
    ("Activation", {"method": "SELU"}, {}),
    ("Activation", {"method": "CELU", "alpha": 1.5}, {}),
    ("Activation", {"method": "GELU"}, {}),
    ("Activation", {"method": "GELU", "approximate": "tanh"}, {}),
    ("Activation", {"method": "SILU"}, {}),
    ("Activation", {"method": "SWISH", "alpha": 1.3}, {}),
    ("Activation", {"method": "MISH"}, {}),
    ("Activation", {"method": "SOFTPLUS"}, {}),
    ("Activation", {"method": "SOFTSIGN"}, {}),
    ("RELU", {}, {}),
    ("RELU6", {}, {}),
    ("Clip", {"clip_min": -0.5, "clip_max": 1.0}, {}),
    ("LeakyRELU", {"negative_slope_value": 0.05}, {}),
    ("PRELU", {}, {"negative_slope": PRELU_SLOPE}),
    ("Sigmoid", {}, {}),
    ("Tanh", {}, {}),
    ("HardSigmoid", {"alpha": 0.2, "beta": 0.5}, {}),
    ("Hardswish", {}, {}),
    ("ELU", {"alpha": 1.0}, {}),
    ("SELU", {}, {}),
    ("CELU", {"alpha": 0.8}, {}),
    ("GELU", {}, {}),
    ("Silu", {}, {}),
    ("Swish", {"alpha": 0.9}, {}),
    ("MISH", {}, {}),
    ("Softplus", {}, {}),
    ("Softsign", {}, {}),
]


def _case_id(case: Tuple[str, Dict[str, Any], Dict[str, Any]]) -> str:
    """Readable, deterministic test id: type, method, parameter values, slope shape."""
    optype, params, consts = case
    parts = [optype] + [f"{k}={v}" for k, v in params.items()]
    if "negative_slope" in consts:
        parts.append("slope" + "x".join(str(d) for d in np.shape(consts["negative_slope"])))
    return "-".join(parts)


# (bits, q_mode_activation, lut_items_in_bits); 16-bit asymmetric becomes symmetric *restricted* range
MODES = [
    (8, "per_tensor_symmetric_full_range", 8),
    (8, "per_tensor_asymmetric", 8),
    (8, "per_tensor_symmetric_restricted_range", 8),
    (16, "per_tensor_symmetric_full_range", 8),
    (16, "per_tensor_asymmetric", 10),
]


def calib(shape: Sequence[int], seed: int, n: int = 3, loc: float = 0.3, std: float = 2.0) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(loc, std, size=shape).astype(np.float32)) for _ in range(n)]


def one_layer(optype: str, params: Mapping[str, Any], consts: Mapping[str, Any], shape: Sequence[int] = SHAPE):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(optype, [x], [list(shape)], name="op", params=dict(params), constants=dict(consts))
    return b.build([y])


def settings(bits: int, mode: str, lut_bits: int, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                q_bits_bias=48 if bits > 8 else 32, **extra)


# --- independent reference: python integers only ---------------------------------------------------------------
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift) with python ints (shift <= 0: exact left shift)."""
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def out_code(value: float, scale: float, zp: int, qmin: int, qmax: int) -> int:
    """Quantized bound of a float: round_half_even(value*scale - zp) in float64, clamped."""
    return clamp(int(round(float(value) * float(scale) - zp)), qmin, qmax)


def ceil_log2(v: int) -> int:
    n = 0
    while (1 << n) < v:
        n += 1
    return n


def table_value(index: int, table: Sequence[int], in_bits: int) -> int:
    """Entry `index` of a 2^in_bits domain read from a 2^t table: high bits select, low bits interpolate
    (difference times low bits, floored division by 2^(in_bits - t)); the entry past the end repeats the last."""
    n = len(table)
    t = n.bit_length() - 1
    if in_bits <= t:
        return int(table[min(index, n - 1)])
    b = in_bits - t
    hi, lo = index >> b, index & ((1 << b) - 1)
    a = int(table[hi])
    c = int(table[hi + 1]) if hi + 1 < n else a
    return a + ((c - a) * lo) // (1 << b)


def tensor_params(node, t) -> Tuple[float, int, int, int]:
    q = params_of(node, t)
    return float(q.scale), int(q.zerop), int(q.qmin), int(q.qmax)


def ref_activation(node, x_q: np.ndarray) -> np.ndarray:
    """The documented integer computation of one Activation/standalone layer, element by element."""
    s_in, zp_in, in_qmin, in_qmax = tensor_params(node, node.inputs[0])
    s_out, zp_out, qmin, qmax = tensor_params(node, node.outputs[0])
    method = str(node.params.get("method", node.type)).upper()
    p = node.params
    out = np.empty(x_q.shape, dtype=np.int64)
    if "lut" in node.constants:
        table = [int(v) for v in node.constants["lut"].betensor.flatten().tolist()]
        lut_dtype = node.constants["lut"].dtype
        lo_t, hi_t = lut_dtype.int_range()
        in_bits = (in_qmax - in_qmin).bit_length()
        offset = in_qmin - 1 if (in_qmin < 0 and in_qmin == -in_qmax) else in_qmin
        for idx in np.ndindex(x_q.shape):
            i = clamp(int(x_q[idx]) - offset, 0, (1 << in_bits) - 1)
            out[idx] = clamp(clamp(table_value(i, table, in_bits), lo_t, hi_t), qmin, qmax)
        return out
    if method == "NONE":
        return x_q.astype(np.int64)
    m, sh = int(p["scale_value"]), int(p["shift_value"])
    if method in ("RELU", "RELU6", "CLIP"):
        lo, hi = qmin, qmax
        if method == "RELU6":
            hi = min(hi, out_code(6.0, s_out, zp_out, qmin, qmax))
        if method == "CLIP":
            lo = max(lo, out_code(p["clip_min"], s_out, zp_out, qmin, qmax))
            hi = min(hi, out_code(p["clip_max"], s_out, zp_out, qmin, qmax))
        for idx in np.ndindex(x_q.shape):
            v = int(x_q[idx]) + zp_in
            if method != "CLIP":
                v = max(v, 0)
            out[idx] = clamp(clamp(rhe(v * m, sh) - zp_out, qmin, qmax), lo, hi)
        return out
    # LEAKYRELU / PRELU
    if "negative_slope" in node.constants:
        slope = np.broadcast_to(node.constants["negative_slope"].betensor.numpy().astype(np.int64), x_q.shape)
    else:
        slope = np.broadcast_to(np.int64(p["negative_slope_value"]), x_q.shape)
    ns = int(p["negative_slope_shift"])
    for idx in np.ndindex(x_q.shape):
        v = int(x_q[idx]) + zp_in
        y = rhe(min(v, 0) * int(slope[idx]), ns) + max(v, 0)
        out[idx] = clamp(rhe(y * m, sh) - zp_out, qmin, qmax)
    return out


def ref_softmax(node, x_q: np.ndarray) -> np.ndarray:
    _, _, in_qmin, in_qmax = tensor_params(node, node.inputs[0])
    _, zp_out, qmin, qmax = tensor_params(node, node.outputs[0])
    axis = int(node.params.get("axis", -1)) % x_q.ndim
    table = [int(v) for v in node.constants["lut"].betensor.flatten().tolist()]
    bits = (in_qmax - in_qmin).bit_length()
    m, sh = int(node.params["scale_value"]), int(node.params["shift_value"])
    lut_max = max(table)
    base = 30 if lut_max == 1 else 31
    moved = np.moveaxis(x_q.astype(np.int64), axis, -1)
    length = moved.shape[-1]
    rows = moved.reshape(-1, length)
    short = length < 8 and rows.shape[0] % 128 == 0 and bits <= 8
    res = np.empty_like(rows)
    for r, row in enumerate(rows):
        top = max(int(v) for v in row)
        e = [table_value(clamp(int(v) - top + (1 << bits) - 1, 0, (1 << bits) - 1), table, bits) for v in row]
        total = sum(e)
        den = max(total, 1)
        for j, ej in enumerate(e):
            if short:
                k = base - ceil_log2(lut_max)
                z = ((ej << k) + (total >> 1)) // den
                v = rhe(z * m, sh + k)
            else:
                k = base - ceil_log2(m)
                v = rhe(ej * ((m << k) // den), sh + k)
            res[r, j] = clamp(v - zp_out, qmin, qmax)
    return np.moveaxis(res.reshape(moved.shape), -1, axis)


def run_and_check(qg, x: torch.Tensor, reference) -> None:
    qg.forward([x])
    node = qg.node("op")
    x_q = node.inputs[0].betensor.numpy()
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    out = params_of(node, node.outputs[0])
    assert int(got.min()) >= out.qmin and int(got.max()) <= out.qmax
    np.testing.assert_array_equal(got.numpy(), reference(node, x_q))


# --- 1. integer forward == reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=_case_id)
def test_activation_integer_forward_matches_reference(case, bits: int, mode: str, lut_bits: int) -> None:
    optype, params, consts = case
    g = one_layer(optype, params, consts)
    qg = quantize_model(g, calib([2, 4, 5, 6], 1), settings(bits, mode, lut_bits))
    # wider than the calibration data: exercises the saturating ends of the tables and the clamps
    run_and_check(qg, calib([3, 4, 5, 6], 2, 1, std=3.0)[0], ref_activation)


SOFTMAX_CASES = [
    ([1, 4, 5, 6], {"axis": -1}),
    ([1, 4, 5, 6], {"axis": 1}),
    ([1, 10], {"axis": 1}),
    ([128, 2], {"axis": 1}),  # short rows, 128 of them: the 'small axis' division variant at 8 bits
    ([1, 2, 256], {"axis": 2}),
    ([256, 3], {"axis": -1}),
]


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("shape,params", SOFTMAX_CASES)
def test_softmax_integer_forward_matches_reference(shape, params, bits: int, mode: str, lut_bits: int) -> None:
    g = one_layer("Softmax", params, {}, shape)
    qg = quantize_model(g, calib([max(2, shape[0]), *shape[1:]], 3, std=3.0), settings(bits, mode, lut_bits))
    node = qg.node("op")
    assert node.params["quantize_method"] == "LUT"
    assert node.constants["lut"].dtype.value == "uint32"
    assert params_of(node, node.outputs[0]).qmin == 0
    run_and_check(qg, calib(shape, 4, 1, std=4.0)[0], ref_softmax)


def test_softmax_short_row_variant_is_taken_and_differs() -> None:
    """Both division variants are exercised: the same rows at 128 and at 3 rows (upstream decides by row count)."""
    g = one_layer("Softmax", {"axis": 1}, {}, [128, 2])
    qg = quantize_model(g, calib([128, 2], 5, std=3.0), settings(8, "per_tensor_symmetric_full_range", 8))
    x = calib([128, 2], 6, 1, std=3.0)[0]
    run_and_check(qg, x, ref_softmax)
    run_and_check(qg, x[:3], ref_softmax)


# --- 2. float vs dequantized -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.99), (16, 10, 0.9999)])
@pytest.mark.parametrize("case", ACTIVATION_CASES + [("Softmax", {"axis": -1}, {}), ("Softmax", {"axis": 1}, {})],
                         ids=_case_id)
def test_float_vs_dequantized_cosine(case, bits: int, lut_bits: int, threshold: float) -> None:
    optype, params, consts = case
    g = one_layer(optype, params, consts)
    data = calib([2, 4, 5, 6], 7)
    qg = quantize_model(g, data, settings(bits, "per_tensor_symmetric_full_range", lut_bits,
                                          q_strategy_activation="extrema"))
    ref = g.forward([data[0]])[0].clone()
    got = run_quantized(qg, data[0])[0]
    assert cosine(ref, got) > threshold


# --- 3. Upstream's sigmoid LUT example -----------------------------------------------------------------------------
def _range_for_scale(scale: float, zp: int, bits: int, mode: str, signed: bool) -> Tuple[float, float]:
    """A float range whose linear_quant_params give exactly (scale, zp): f_range searched among float32 neighbours
    of q_range / scale."""
    qm = QuantMode.from_name(mode)
    probe = linear_quant_params(0.0, 1.0, bits, qm, signed)
    qmin, q_range = probe.qmin, probe.qmax - probe.qmin
    guess = np.float32(q_range / scale)
    cands = [guess]
    up = down = guess
    for _ in range(8):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
        cands += [up, down]
    for fr in cands:
        fr = float(fr)
        if qm.is_asymmetric:
            lo = (zp + qmin) / scale
            hi = lo + fr
        else:
            width = fr / 2 if signed else fr
            lo, hi = (-width if signed else 0.0), width
        p = linear_quant_params(lo, hi, bits, qm, signed)
        if p.scale == scale and p.zerop == zp:
            return lo, hi
    pytest.skip(f"no float range reproduces scale {scale} zp {zp}")


def _quantize_with_params(optype: str, params: Mapping[str, Any], consts: Mapping[str, Any],
                          shape: Sequence[int], inp: Tuple[float, int, int, int, Any], out_range: Tuple[float, float],
                          s: LayerSettings):
    """One layer quantized by its registered function with the input params given and the output calibrated to
    `out_range` (no data involved)."""
    g = one_layer(optype, params, consts, shape)
    for n in g.nodes:
        n.settings = s
    x = g.nodes[0].outputs[0]
    scale, zerop, qmin, qmax, x.dtype = inp
    set_quant(g.nodes[0], x, scale=scale, zerop=zerop, qmin=qmin, qmax=qmax, qbits=(qmax - qmin).bit_length(),
              qinvariant=False)
    g.nodes[0].quantized = True
    node = g.node("op")
    set_range(node, node.outputs[0], *out_range)
    node.quantize()
    return node


def test_example_sigmoid_lut() -> None:
    from quantopt.quant.dtype import Dtype

    s = LayerSettings(q_mode_activation="per_tensor_symmetric_full_range")
    node = _quantize_with_params("Activation", {"method": "SIGMOID"}, {}, [1, 8],
                                 (66.1239, 0, 0, 255, Dtype.UINT8), (0.0, 255.0 / 260.5147), s)
    out = node.outputs[0]
    op = params_of(node, out)
    assert (op.qmin, op.qmax, out.dtype) == (0, 255, Dtype.UINT8)
    assert abs(op.scale - 260.5147) < 1e-3
    lut = node.constants["lut"]
    assert lut.dtype == Dtype.UINT8 and lut.betensor.numel() == 256
    want = [min(255, max(0, round(1.0 / (1.0 + np.exp(-i / 66.1239)) * 260.5147))) for i in range(256)]
    assert lut.betensor.tolist() == want
    assert lut.betensor[:3].tolist() == [130, 131, 132] and int(lut.betensor[-1]) == 255
    # integer forward: output = lut[x_q] for an unsigned 8-bit input
    node.inputs[0].betensor = torch.arange(256, dtype=torch.int64).reshape(32, 8)
    node.forward()
    assert node.outputs[0].betensor.flatten().tolist() == want


# --- 4. the golden IRs' Activation / Softmax layers recomputed -----------------------------------------------------
GOLDEN_SETTINGS = {"A": ("per_tensor_symmetric_full_range", 8), "B": ("per_tensor_asymmetric", 8),
                   "C": ("per_tensor_symmetric_full_range", 10)}


@functools.cache
def _golden(model: str, letter: str):
    return read_ir(str(shared_model_dir(model) / "golden" / letter / f"{model}_o.txt"))


@functools.cache
def _float_ir(model: str):
    return read_ir(str(shared_model_dir(model) / f"{model}.txt"))


def _golden_layers(model: str, letter: str):
    return [n for n in _golden(model, letter).nodes if str(n.type) in ("Activation", "Softmax")]


def _top_range(t) -> Tuple[int, int]:
    r = t.ir_range
    r = r[0] if isinstance(r[0], (list, tuple)) else r
    return int(r[0]), int(r[1])


def _compare_quantized_layer(model: str, letter: str, gnode) -> List[str]:
    fnode = {n.name: n for n in _float_ir(model).nodes}[gnode.name]
    mode, lut_bits = GOLDEN_SETTINGS[letter]
    gi, go = gnode.inputs[0], gnode.outputs[0]
    gip, gop = params_of(gnode, gi), params_of(gnode, go)
    bits = go.dtype.bits
    s = LayerSettings(q_mode_activation=mode, q_bits_activation=bits, lut_items_in_bits=lut_bits)
    rng = _top_range(gi)
    inp = (gip.scale, gip.zerop, rng[0], rng[1], gi.dtype)
    act_mode = mode if bits <= 8 else "per_tensor_symmetric_full_range"
    out_rng = _range_for_scale(gop.scale, gop.zerop, bits, act_mode, go.dtype.is_signed)
    consts = {k: t.betensor.numpy() for k, t in fnode.constants.items()}
    node = _quantize_with_params(str(fnode.type), dict(fnode.params), consts, list(fnode.inputs[0].ir_shape), inp,
                                 out_rng, s)
    out = node.outputs[0]
    op = params_of(node, out)
    diffs = []
    if (op.scale, op.zerop, out.dtype, op.qmin, op.qmax) != (gop.scale, gop.zerop, go.dtype, *_top_range(go)):
        diffs.append(f"output params {(op.scale, op.zerop, out.dtype)}")
    for key, t in gnode.constants.items():
        mine = node.constants.get(key)
        if mine is None or mine.dtype != t.dtype or not torch.equal(mine.betensor.long().reshape(t.betensor.shape),
                                                                    t.betensor.long()):
            diffs.append(f"constant {key}")
        elif list(mine.betensor.shape) != list(t.betensor.shape):
            diffs.append(f"constant {key} shape {list(mine.betensor.shape)}")
    for key, v in gnode.params.items():
        if key in ("activation_quantization_axis", "is_perf_mode", "unquantifiable"):
            continue
        if node.params.get(key) != v:
            diffs.append(f"param {key}: {node.params.get(key)!r} != {v!r}")
    extra = set(node.params) - set(gnode.params) - {"is_perf_mode", "unquantifiable"}
    if extra:
        diffs.append(f"extra params {sorted(extra)}")
    return diffs


@pytest.mark.parametrize("letter", ["A", "B", "C"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_golden_activation_and_softmax_params(model: str, letter: str) -> None:
    """Every golden Activation (SIGMOID, HARDSWISH, HARDSIGMOID, PRELU) and Softmax layer: quantized by our
    functions from the golden input params and output scale, all its constants (lut, negative_slope) and params
    (scale_value, shift_value, their types, negative_slope_shift, quantize_method, ...) are identical."""
    layers = _golden_layers(model, letter)
    if not layers:
        pytest.skip("no Activation/Softmax layer")
    misses = {}
    for gnode in layers:
        diffs = _compare_quantized_layer(model, letter, gnode)
        if diffs:
            misses[gnode.name] = diffs
    assert not misses, misses


def test_golden_softmax_values_known() -> None:
    """The numbers the reference text quotes for upstream's Softmax appear in our output (mtcnn_onet A)."""
    gnode = next(n for n in _golden_layers("mtcnn_onet", "A") if str(n.type) == "Softmax")
    assert _compare_quantized_layer("mtcnn_onet", "A", gnode) == []
    assert (gnode.params["scale_value"], gnode.params["shift_value"]) == (128, -1)


# --- 5. IR write → re-read → bit-identical integer forward -------------------------------------------------------
ROUNDTRIP_CASES = [c for c in ACTIVATION_CASES if c[0] == "Activation"] + [
    ("PRELU", {}, {"negative_slope": PRELU_SLOPE}), ("LeakyRELU", {"negative_slope_value": 0.05}, {}),
    ("Sigmoid", {}, {}), ("Softmax", {"axis": 1}, {}), ("Softmax", {"axis": -1}, {})]


@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[1], MODES[2], MODES[4]])
@pytest.mark.parametrize("case", ROUNDTRIP_CASES, ids=_case_id)
def test_written_ir_reloads_bit_identical(tmp_path, case, bits: int, mode: str, lut_bits: int) -> None:
    optype, params, consts = case
    g = one_layer(optype, params, consts)
    data = calib([2, 4, 5, 6], 8)
    qg = quantize_model(g, data, settings(bits, mode, lut_bits))
    x = calib([3, 4, 5, 6], 9, 1, std=3.0)[0]
    before = qg.forward([x])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


def test_chain_reloads_bit_identical(tmp_path) -> None:
    """Several layers in a row (each consumes the previous one's quantized output), written and re-read."""
    b = GraphBuilder("chain")
    t = b.input("x", SHAPE)
    for i, (optype, params, consts) in enumerate([("Activation", {"method": "PRELU"},
                                                   {"negative_slope": PRELU_SLOPE}),
                                                  ("Activation", {"method": "HARDSWISH"}, {}),
                                                  ("Clip", {"clip_min": -0.2, "clip_max": 2.5}, {}),
                                                  ("Activation", {"method": "TANH"}, {}),
                                                  ("Softmax", {"axis": -1}, {})]):
        t = b.layer(optype, [t], [SHAPE], name=f"l{i}", params=params, constants=consts)
    g = b.build([t])
    data = calib([2, 4, 5, 6], 10)
    qg = quantize_model(g, data, settings(8, "per_tensor_asymmetric", 8))
    before = qg.forward([data[1]])[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "c.txt"))[0])
    assert torch.equal(before, re.forward([data[1]])[0])
    assert cosine(g.forward([data[1]])[0], run_quantized(qg, data[1])[0]) > 0.99


# --- errors ------------------------------------------------------------------------------------------------------
PER_CHANNEL = "per_channel_symmetric_full_range"
"""Set for the layer itself, a per-channel mode it cannot produce is refused; a global one falls back to per
tensor (passes/per_channel_fallback.py, tests/ops/test_per_channel_activations.py)."""


@pytest.mark.parametrize("optype,params", [("Softmax", {"axis": -1}), ("Activation", {"method": "RELU"}),
                                           ("Activation", {"method": "LEAKYRELU", "negative_slope": 0.1})])
def test_per_channel_activation_mode_is_unsupported(optype: str, params: Dict[str, Any]) -> None:
    """Softmax and the multiplier methods refuse per-channel modes (the table methods take them:
    tests/ops/test_per_channel_activations.py)."""
    g = one_layer(optype, params, {})
    with pytest.raises(UnsupportedError, match="per-channel"):
        quantize_model(g, calib([2, 4, 5, 6], 11), per_layer={"op": {"q_mode_activation": PER_CHANNEL}})


def test_prelu_slope_not_broadcasting_is_an_error() -> None:
    from quantopt.errors import IRError

    g = one_layer("Activation", {"method": "PRELU"}, {"negative_slope": np.ones(5, dtype=np.float32)})
    with pytest.raises(IRError):
        quantize_model(g, calib([2, 4, 5, 6], 12))
