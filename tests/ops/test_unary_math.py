"""Unary math ops (Abs, Negative, Sign, IsInf, IsNaN and the table ops) and the SHRINK / THRESHOLDEDRELU / CRELU /
BNLL activations: float forward against numpy/torch definitions, integer forward against an independent reference
written from docs/semantics/unary.md, float-vs-dequantized cosine, IR write → re-read, errors."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from range_helpers import range_of

import quantopt.ops.unary_math  # noqa: F401  (registers the ops even where quantopt.ops does not import it yet)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

SHAPE = [1, 4, 5, 6]

# (bits, q_mode_activation, lut_items_in_bits); 16-bit asymmetric becomes symmetric restricted range
MODES = [
    (8, "per_tensor_symmetric_full_range", 8),
    (8, "per_tensor_asymmetric", 8),
    (8, "per_tensor_symmetric_restricted_range", 8),
    (16, "per_tensor_symmetric_full_range", 8),
    (16, "per_tensor_asymmetric", 10),
]


# --- data ------------------------------------------------------------------------------------------------------
def _normal(loc: float, std: float) -> Callable[[np.random.Generator, Sequence[int]], np.ndarray]:
    return lambda r, shape: r.normal(loc, std, size=shape)


def _uniform(lo: float, hi: float) -> Callable[[np.random.Generator, Sequence[int]], np.ndarray]:
    return lambda r, shape: r.uniform(lo, hi, size=shape)


def _signed_uniform(lo: float, hi: float) -> Callable[[np.random.Generator, Sequence[int]], np.ndarray]:
    return lambda r, shape: r.uniform(lo, hi, size=shape) * r.choice([-1.0, 1.0], size=shape)


# table op → (numpy float64 reference, representative data inside its domain)
TABLE_OPS: Dict[str, Tuple[Callable[[np.ndarray], np.ndarray], Callable]] = {
    "Exp": (np.exp, _normal(0.0, 1.0)),
    "Log": (np.log, _uniform(0.05, 6.0)),
    "Erf": (None, _normal(0.0, 1.5)),
    "Sqrt": (np.sqrt, _uniform(0.0, 9.0)),
    "Rsqrt": (lambda x: 1.0 / np.sqrt(x), _uniform(0.3, 6.0)),
    "Reciprocal": (np.reciprocal, _signed_uniform(0.5, 4.0)),
    "Square": (np.square, _normal(0.2, 1.5)),
    "Floor": (np.floor, _normal(0.3, 3.0)),
    "Ceil": (np.ceil, _normal(0.3, 3.0)),
    "Round": (np.round, _normal(0.3, 3.0)),
    "Trunc": (np.trunc, _normal(0.3, 3.0)),
    "Acos": (np.arccos, _uniform(-0.95, 0.95)),
    "Acosh": (np.arccosh, _uniform(1.0, 6.0)),
    "Asin": (np.arcsin, _uniform(-0.95, 0.95)),
    "Asinh": (np.arcsinh, _normal(0.0, 3.0)),
    "Atan": (np.arctan, _normal(0.0, 3.0)),
    "Atanh": (np.arctanh, _uniform(-0.9, 0.9)),
    "Cosine": (np.cos, _normal(0.0, 2.0)),
    "Cosh": (np.cosh, _normal(0.0, 1.2)),
    "Sine": (np.sin, _normal(0.0, 2.0)),
    "Sinh": (np.sinh, _normal(0.0, 1.2)),
    "Tan": (np.tan, _uniform(-1.2, 1.2)),
}

# the float function each table is built from, applied in float32 (the spec's f)
TORCH_F = {
    "Exp": torch.exp, "Log": torch.log, "Erf": torch.erf, "Sqrt": torch.sqrt, "Rsqrt": torch.rsqrt,
    "Reciprocal": torch.reciprocal, "Square": torch.square, "Floor": torch.floor, "Ceil": torch.ceil,
    "Round": torch.round, "Trunc": torch.trunc, "Acos": torch.acos, "Acosh": torch.acosh, "Asin": torch.asin,
    "Asinh": torch.asinh, "Atan": torch.atan, "Atanh": torch.atanh, "Cosine": torch.cos, "Cosh": torch.cosh,
    "Sine": torch.sin, "Sinh": torch.sinh, "Tan": torch.tan,
}

ACT_CASES: List[Tuple[str, Dict[str, Any]]] = [
    ("SHRINK", {"lambd": 0.5, "bias": 0.2}),
    ("SHRINK", {}),
    ("THRESHOLDEDRELU", {"alpha": 0.7}),
    ("THRESHOLDEDRELU", {"alpha": -0.4}),
    ("BNLL", {}),
]


def data(kind: Callable, shape: Sequence[int], seed: int, n: int = 3) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(kind(r, shape).astype(np.float32)) for _ in range(n)]


def one_layer(optype: str, params: Optional[Mapping[str, Any]] = None, shape: Sequence[int] = SHAPE,
              out_shape: Optional[Sequence[int]] = None):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(optype, [x], [list(out_shape or shape)], name="op", params=dict(params or {}))
    return b.build([y])


def settings(bits: int, mode: str, lut_bits: int, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                q_bits_bias=48 if bits > 8 else 32, **extra)


def float_run(optype: str, x: torch.Tensor, params: Optional[Mapping[str, Any]] = None,
              out_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    return one_layer(optype, params, list(x.shape), out_shape).forward([x])[0]


# --- 1. float forward ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype", sorted(TABLE_OPS))
def test_table_op_float_forward(optype: str) -> None:
    ref, kind = TABLE_OPS[optype]
    x = data(kind, [2, 4, 5, 6], 0, 1)[0]
    got = float_run(optype, x)
    if ref is None:  # Erf: math.erf elementwise
        import math
        want = np.vectorize(math.erf)(x.numpy().astype(np.float64))
    else:
        want = ref(x.numpy().astype(np.float64))
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=2e-6)


def test_round_is_half_to_even_and_domain_errors_are_torch_like() -> None:
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -3.51]])
    assert float_run("Round", x).tolist() == [[0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 3.0, -4.0]]
    z = torch.tensor([[0.0, -1.0, 2.0]])
    assert float_run("Log", z)[0, 0].item() == -np.inf and np.isnan(float_run("Log", z)[0, 1].item())
    assert float_run("Reciprocal", z)[0, 0].item() == np.inf
    assert np.isnan(float_run("Acos", z)[0, 2].item()) and float_run("Atanh", torch.tensor([[1.0]])).item() == np.inf


def test_abs_negative_sign_float_forward() -> None:
    x = data(_normal(0.0, 2.0), [3, 4, 5, 6], 1, 1)[0]
    x[0, 0, 0, :3] = torch.tensor([0.0, -0.0, -3.0])
    np.testing.assert_array_equal(float_run("Abs", x).numpy(), np.abs(x.numpy()))
    np.testing.assert_array_equal(float_run("Negative", x).numpy(), -x.numpy())
    np.testing.assert_array_equal(float_run("Sign", x).numpy(), np.sign(x.numpy()))


@pytest.mark.parametrize("params,pos,neg", [({}, True, True), ({"detect_negative": False}, True, False),
                                             ({"detect_positive": "false"}, False, True)])
def test_isinf_float_forward(params: Dict[str, Any], pos: bool, neg: bool) -> None:
    x = torch.tensor([[np.inf, -np.inf, np.nan, 0.0, 3e38, -np.inf]], dtype=torch.float32)
    got = float_run("IsInf", x, params)
    want = (np.isposinf(x.numpy()) & pos) | (np.isneginf(x.numpy()) & neg)
    assert got.dtype == torch.uint8 and got.numpy().tolist() == want.astype(np.uint8).tolist()


def test_isnan_float_forward() -> None:
    x = torch.tensor([[np.inf, -np.inf, np.nan, 0.0, -1.0]], dtype=torch.float32)
    got = float_run("IsNaN", x)
    assert got.dtype == torch.uint8 and got.tolist() == [np.isnan(x.numpy()).astype(np.uint8).tolist()[0]]


def _np_shrink(x: np.ndarray, lambd: float, bias: float) -> np.ndarray:
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0.0))


def _np_act(method: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    if method == "SHRINK":
        return _np_shrink(x, params.get("lambd", 0.5), params.get("bias", 0.0))
    if method == "THRESHOLDEDRELU":
        return np.where(x > params.get("alpha", 1.0), x, 0.0)
    if method == "BNLL":
        return np.logaddexp(0.0, x)
    raise AssertionError(method)


@pytest.mark.parametrize("standalone", [False, True])
@pytest.mark.parametrize("method,params", ACT_CASES)
def test_new_activation_float_forward(method: str, params: Dict[str, Any], standalone: bool) -> None:
    x = data(_normal(0.0, 3.0), [2, 4, 5, 6], 2, 1)[0]
    x[0, 0, 0, :2] = torch.tensor([100.0, -100.0])  # BNLL must not overflow
    got = float_run(method, x, params) if standalone else float_run("Activation", x, {"method": method, **params})
    np.testing.assert_allclose(got.numpy(), _np_act(method, params, x.numpy().astype(np.float64)), rtol=1e-6,
                               atol=1e-6)


def test_shrink_matches_torch_soft_and_hard_shrink() -> None:
    x = data(_normal(0.0, 2.0), [2, 4, 5, 6], 3, 1)[0]
    np.testing.assert_allclose(float_run("SHRINK", x, {"lambd": 0.7, "bias": 0.7}).numpy(),
                               torch.nn.functional.softshrink(x, 0.7).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(float_run("SHRINK", x, {"lambd": 0.7, "bias": 0.0}).numpy(),
                                  torch.nn.functional.hardshrink(x, 0.7).numpy())


@pytest.mark.parametrize("axis,out_shape", [(None, [2, 4, 5, 12]), (-1, [2, 4, 5, 12]), (1, [2, 8, 5, 6]),
                                            (3, [2, 4, 5, 12])])
@pytest.mark.parametrize("standalone", [False, True])
def test_crelu_float_forward(axis: Optional[int], out_shape: List[int], standalone: bool) -> None:
    x = data(_normal(0.0, 2.0), [2, 4, 5, 6], 4, 1)[0]
    params = {} if axis is None else {"axis": axis}
    optype = "CRELU" if standalone else "Activation"
    if not standalone:
        params["method"] = "CRELU"
    got = float_run(optype, x, params, out_shape)
    a = -1 if axis is None else axis
    xn = x.numpy()
    want = np.concatenate([np.maximum(xn, 0), np.maximum(-xn, 0)], axis=a)
    assert list(got.shape) == out_shape
    np.testing.assert_array_equal(got.numpy(), want)


# --- independent integer reference (python ints, numpy float32 for the table construction) ----------------------
def rhe(num: int, shift: int) -> int:
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def tparams(node, t) -> Tuple[float, int, int, int]:
    q = params_of(node, t)
    return float(q.scale), int(q.zerop), int(q.qmin), int(q.qmax)


def ref_domain_clamp(optype: str, x: np.ndarray, s_in: float) -> np.ndarray:
    """docs/semantics/unary.md, 'Domain clamps', in float32."""
    h = np.float32(0.5 / s_in)
    if optype == "Sqrt":
        return np.maximum(x, np.float32(0))
    if optype == "Acosh":
        return np.maximum(x, np.float32(1))
    if optype in ("Acos", "Asin"):
        return np.clip(x, np.float32(-1), np.float32(1))
    if optype in ("Log", "Rsqrt"):
        return np.maximum(x, h)
    if optype == "Reciprocal":
        return np.where(np.abs(x) < h, np.where(x < 0, -h, h), x).astype(np.float32)
    if optype == "Atanh":
        b = np.float32(1.0 - min(float(h), 0.5))
        b = min(b, np.nextafter(np.float32(1), np.float32(0)))
        return np.clip(x, -b, b)
    return x


def ref_table(optype: str, node, fn: Callable[[torch.Tensor], torch.Tensor]) -> List[int]:
    """Table construction: N samples (float32 linspace, qmin prepended for a restricted range), dequantized with
    the float32 reciprocal of the scale, domain-clamped, f in float32, quantized in float32."""
    s_in, zp_in, in_qmin, in_qmax = tparams(node, node.inputs[0])
    s_out, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    b_in = (in_qmax - in_qmin).bit_length()
    n = 2 ** min(b_in, int(node.settings.lut_items_in_bits))
    if in_qmin < 0 and in_qmin == -in_qmax:
        pts = np.concatenate([[np.float32(in_qmin)], torch.linspace(in_qmin, in_qmax, n - 1).numpy()])
    else:
        pts = torch.linspace(in_qmin, in_qmax, n).numpy()
    x = (pts.astype(np.float32) + np.float32(zp_in)) * (np.float32(1.0) / np.float32(s_in))
    x = ref_domain_clamp(optype, x.astype(np.float32), s_in)
    y = fn(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy().astype(np.float32)
    assert np.isfinite(y).all() or optype in ("Exp", "Cosh", "Sinh"), "a table value comes from inf/NaN"
    q = np.round(np.float32(s_out) * y - np.float32(zp_out))
    q = np.nan_to_num(np.clip(q, qmin, qmax), nan=0.0)
    return [int(v) for v in q]


def ref_lookup(node, x_q: np.ndarray, table: Sequence[int], lut_dtype: Dtype) -> np.ndarray:
    _, _, in_qmin, in_qmax = tparams(node, node.inputs[0])
    _, _, qmin, qmax = tparams(node, node.outputs[0])
    b_in = (in_qmax - in_qmin).bit_length()
    o = in_qmin - 1 if (in_qmin < 0 and in_qmin == -in_qmax) else in_qmin
    n = len(table)
    t = n.bit_length() - 1
    lo_t, hi_t = lut_dtype.int_range()
    out = np.empty(x_q.shape, dtype=np.int64)
    for idx in np.ndindex(x_q.shape):
        i = clamp(int(x_q[idx]) - o, 0, (1 << b_in) - 1)
        if b_in <= t:
            y = table[min(i, n - 1)]
        else:
            k = b_in - t
            hi, lo = i >> k, i & ((1 << k) - 1)
            a = table[hi]
            c = table[hi + 1] if hi + 1 < n else a
            y = a + ((c - a) * lo) // (1 << k)
        out[idx] = clamp(clamp(y, lo_t, hi_t), qmin, qmax)
    return out


def ref_requant(node, values: np.ndarray) -> np.ndarray:
    """requant(v) = clamp(rhe(v * M, shift) - zp_out, qmin, qmax) for python-int values v."""
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    m, sh = int(node.params["scale_value"]), int(node.params["shift_value"])
    out = np.empty(values.shape, dtype=np.int64)
    for idx in np.ndindex(values.shape):
        out[idx] = clamp(rhe(int(values[idx]) * m, sh) - zp_out, qmin, qmax)
    return out


def check_int(qg, x: torch.Tensor, reference: Callable) -> np.ndarray:
    qg.forward([x])
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    out = params_of(node, node.outputs[0])
    assert int(got.min()) >= out.qmin and int(got.max()) <= out.qmax
    want = reference(node, node.inputs[0].betensor.numpy())
    np.testing.assert_array_equal(got.numpy(), want)
    return got.numpy()


def table_reference(optype: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def reference(node, x_q: np.ndarray) -> np.ndarray:
        lut = node.constants["lut"]
        assert lut.dtype == node.outputs[0].dtype and lut.betensor.numel() == len(ref_table(optype, node, fn))
        table = ref_table(optype, node, fn)
        assert lut.betensor.tolist() == table
        return ref_lookup(node, x_q, table, lut.dtype)
    return reference


def _wider(kind: Callable, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Evaluation data: the calibration distribution, scaled 1.3x around its mean (out-of-range ends too)."""
    x = data(kind, shape, seed, 1)[0]
    return (x - x.mean()) * 1.3 + x.mean()


# --- 2. integer forward == reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("optype", sorted(TABLE_OPS))
def test_table_op_integer_forward(optype: str, bits: int, mode: str, lut_bits: int) -> None:
    _, kind = TABLE_OPS[optype]
    qg = quantize_model(one_layer(optype), data(kind, [2, 4, 5, 6], 10), settings(bits, mode, lut_bits))
    node = qg.node("op")
    assert node.outputs[0].dtype.bits == bits
    check_int(qg, _wider(kind, [3, 4, 5, 6], 11), table_reference(optype, TORCH_F[optype]))


@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[0], MODES[-1]])
@pytest.mark.parametrize("optype", ["Exp", "Sine", "Reciprocal"])
def test_table_op_codes_outside_the_input_range_are_looked_up(optype: str, bits: int, mode: str,
                                                              lut_bits: int) -> None:
    """The integer forward reads a memoized table of every input code's result; a hand-fed code outside [qmin, qmax]
    (below, above, far beyond) is looked up instead, as the reference clamps its index."""
    _, kind = TABLE_OPS[optype]
    qg = quantize_model(one_layer(optype), data(kind, [2, 4, 5, 6], 10), settings(bits, mode, lut_bits))
    qg.forward(data(kind, [1, 4, 5, 6], 12, 1), keep_tensors=True)
    node = qg.node("op")
    q = params_of(node, node.inputs[0])
    codes = node.inputs[0].betensor.clone()
    codes.view(-1)[:5] = torch.tensor([q.qmin - 5, q.qmax + 7, q.qmin - 1, q.qmax, -(1 << 40)], dtype=codes.dtype)
    node.inputs[0].betensor = codes
    node.forward()
    want = table_reference(optype, TORCH_F[optype])(node, codes.numpy())
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)


def _signedness(optype: str, input_signed: bool) -> bool:
    fixed = {"Exp": False, "Sqrt": False, "Rsqrt": False, "Square": False, "Acos": False, "Acosh": False,
             "Cosh": False, "Log": True, "Cosine": True, "Sine": True, "Tan": True}
    return fixed.get(optype, input_signed)


@pytest.mark.parametrize("optype", sorted(TABLE_OPS))
def test_table_op_output_signedness(optype: str) -> None:
    for kind, in_signed in ((_uniform(0.1, 0.9), False), (_uniform(-0.9, 0.9), True)):
        qg = quantize_model(one_layer(optype), data(kind, [2, 4, 5, 6], 12),
                            settings(8, "per_tensor_asymmetric", 8))
        node = qg.node("op")
        assert (params_of(node, node.inputs[0]).qmin < 0) == in_signed
        assert (params_of(node, node.outputs[0]).qmin < 0) == _signedness(optype, in_signed), (optype, in_signed)


ACT_FNS = {
    "SHRINK": lambda p: (lambda x: torch.where(x < -p.get("lambd", 0.5), x + p.get("bias", 0.0),
                                               torch.where(x > p.get("lambd", 0.5), x - p.get("bias", 0.0),
                                                           torch.zeros_like(x)))),
    "THRESHOLDEDRELU": lambda p: (lambda x: torch.where(x > p.get("alpha", 1.0), x, torch.zeros_like(x))),
    "BNLL": lambda p: (lambda x: torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))),
}


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("standalone", [False, True])
@pytest.mark.parametrize("method,params", ACT_CASES)
def test_new_activation_integer_forward(method: str, params: Dict[str, Any], standalone: bool, bits: int, mode: str,
                                        lut_bits: int) -> None:
    g = one_layer(method, params) if standalone else one_layer("Activation", {"method": method, **params})
    kind = _normal(0.3, 2.0)
    qg = quantize_model(g, data(kind, [2, 4, 5, 6], 13), settings(bits, mode, lut_bits))
    out = params_of(qg.node("op"), qg.node("op").outputs[0])
    signed = {"SHRINK": True, "BNLL": False}.get(method, params.get("alpha", 1.0) < 0)
    assert (out.qmin < 0) == signed
    check_int(qg, _wider(kind, [3, 4, 5, 6], 14), table_reference(method, ACT_FNS[method](params)))


def ref_abs_negative(node, x_q: np.ndarray) -> np.ndarray:
    """Abs: requantized |x + zp_in|. Negative: -(x + zp_in) - zp_out on the input's grid (upstream's form)."""
    zp_in = int(params_of(node, node.inputs[0]).zerop)
    v = x_q.astype(np.int64) + zp_in
    if str(node.type) == "Negative":
        out = params_of(node, node.outputs[0])
        return np.clip(-v - int(out.zerop), out.qmin, out.qmax)
    return ref_requant(node, np.abs(v))


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("optype", ["Abs", "Negative"])
def test_abs_negative_integer_forward(optype: str, bits: int, mode: str, lut_bits: int) -> None:
    kind = _normal(0.4, 2.0)
    qg = quantize_model(one_layer(optype), data(kind, [2, 4, 5, 6], 15), settings(bits, mode, lut_bits))
    out = qg.node("op").outputs[0]
    assert (params_of(qg.node("op"), out).qmin < 0) == (optype == "Negative") and out.dtype.bits == bits
    if optype == "Negative":  # the input's scale; the zero point moved so that -(-128) still fits
        q_in, q_out = params_of(qg.node("op"), qg.node("op").inputs[0]), params_of(qg.node("op"), out)
        assert q_out.scale == q_in.scale and "scale_value" not in qg.node("op").params
        assert q_out.zerop == (1 - q_in.zerop if q_in.qmin < 0 else -q_in.zerop - q_out.qmax)
    check_int(qg, _wider(kind, [3, 4, 5, 6], 16), ref_abs_negative)


def ref_crelu(node, x_q: np.ndarray) -> np.ndarray:
    v = x_q.astype(np.int64) + int(params_of(node, node.inputs[0]).zerop)
    axis = int(node.params.get("axis", -1))
    return ref_requant(node, np.concatenate([np.maximum(v, 0), np.maximum(-v, 0)], axis=axis))


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("optype,params,out_shape", [("CRELU", {}, [1, 4, 5, 12]),
                                                     ("CRELU", {"axis": 1}, [1, 8, 5, 6]),
                                                     ("Activation", {"method": "CRELU", "axis": 3}, [1, 4, 5, 12])])
def test_crelu_integer_forward(optype: str, params: Dict[str, Any], out_shape: List[int], bits: int, mode: str,
                               lut_bits: int) -> None:
    kind = _normal(0.4, 2.0)
    qg = quantize_model(one_layer(optype, params, SHAPE, out_shape), data(kind, [2, 4, 5, 6], 17),
                        settings(bits, mode, lut_bits))
    assert params_of(qg.node("op"), qg.node("op").outputs[0]).qmin == 0
    got = check_int(qg, _wider(kind, [3, 4, 5, 6], 18), ref_crelu)
    assert got.shape[0] == 3


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
def test_sign_isinf_isnan_integer_forward(bits: int, mode: str, lut_bits: int) -> None:
    kind = _normal(0.2, 2.0)
    for optype in ("Sign", "IsInf", "IsNaN"):
        qg = quantize_model(one_layer(optype), data(kind, [2, 4, 5, 6], 19), settings(bits, mode, lut_bits))
        out = qg.node("op").outputs[0]
        oq = params_of(qg.node("op"), out)
        assert oq.qinvariant and oq.scale == 1.0 and oq.zerop == 0
        if optype == "Sign":
            assert out.dtype == Dtype.INT8 and (oq.qmin, oq.qmax) == (-128, 127)
            x = _wider(kind, [3, 4, 5, 6], 20)
            x[0, 0, 0, 0] = 0.0
            got = check_int(qg, x, lambda n, x: np.sign(x.astype(np.int64) + int(params_of(n, n.inputs[0]).zerop)))
            assert set(np.unique(got).tolist()) == {-1, 0, 1}
        else:
            assert out.dtype == Dtype.UINT8 and (oq.qmin, oq.qmax) == (0, 255)
            check_int(qg, _wider(kind, [3, 4, 5, 6], 20), lambda n, x: np.zeros(x.shape, dtype=np.int64))


def test_integer_inputs() -> None:
    """Integer (scale 1) inputs: Abs / Negative give exact integer outputs, Floor..Trunc pass them through."""
    b = GraphBuilder("t")
    x = b.input("x", [1, 6], dtype=Dtype.INT8)
    outs = [b.layer(t, [x], [[1, 6]], name=t) for t in ("Abs", "Negative", "Floor", "Round", "Sign")]
    g = b.build(outs)
    feed = torch.tensor([[-128, -5, 0, 3, 127, -1]], dtype=torch.int64)
    qg = quantize_model(g, [feed.to(torch.float32)])
    res = dict(zip(("Abs", "Negative", "Floor", "Round", "Sign"), run_quantized(qg, feed.to(torch.float32))))
    assert res["Abs"].tolist() == [[128, 5, 0, 3, 127, 1]] and qg.node("Abs").outputs[0].dtype == Dtype.UINT8
    assert res["Negative"].tolist() == [[128, 5, 0, -3, -127, 1]]
    assert qg.node("Negative").outputs[0].dtype == Dtype.INT16
    assert res["Floor"].tolist() == feed.tolist() == res["Round"].tolist()
    assert "lut" not in qg.node("Floor").constants
    assert res["Sign"].tolist() == [[-1, -1, 0, 1, 1, -1]]


# --- restricted domains -------------------------------------------------------------------------------------------
def test_lut_output_range_calibrated_keeps_finite_ends() -> None:
    """By default (upstream's choice) a finite calibrated end beyond the table's values is kept: Log of data with
    values near 0 keeps its calibrated minimum; `lut_output_range = table` cuts it to the table's lowest value."""
    calib = data(_uniform(0.0005, 4.0), [2, 4, 5, 6], 23)
    calib[0][0, 0, 0, 0] = 0.0005
    wide = quantize_model(one_layer("Log"), calib, settings(8, "per_tensor_asymmetric", 8))
    cut = quantize_model(one_layer("Log"), calib, settings(8, "per_tensor_asymmetric", 8, lut_output_range="table"))
    low_wide = float(range_of(wide.node("op"), wide.node("op").outputs[0]).min)
    low_cut = float(range_of(cut.node("op"), cut.node("op").outputs[0]).min)
    h = 0.5 / float(params_of(cut.node("op"), cut.node("op").inputs[0]).scale)  # the table's smallest sample
    assert low_wide < float(np.log(h)) - 0.5 and low_cut >= float(np.log(h)) - 1e-3
    lut = cut.node("op").constants["lut"].betensor
    assert int(lut.min()) == params_of(cut.node("op"), cut.node("op").outputs[0]).qmin  # the cut range is used
    # the input code of float 0 is a pole: log(0) = -inf saturates to the output's minimum, as upstream's table
    node = wide.node("op")
    q_in = params_of(node, node.inputs[0])
    zero_code = -int(q_in.zerop)
    assert int(node.constants["lut"].betensor[zero_code - int(q_in.qmin)]) == params_of(node, node.outputs[0]).qmin


@pytest.mark.parametrize("optype,kind", [("Log", _uniform(-1.0, 4.0)), ("Rsqrt", _uniform(-1.0, 4.0)),
                                         ("Reciprocal", _uniform(-2.0, 2.0)), ("Sqrt", _uniform(-1.0, 4.0)),
                                         ("Acos", _uniform(-1.5, 1.5)), ("Asin", _uniform(-1.5, 1.5)),
                                         ("Atanh", _uniform(-1.5, 1.5)), ("Acosh", _uniform(-1.0, 4.0))])
@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[1], MODES[3]])
def test_out_of_domain_calibration_gives_finite_tables(optype: str, kind: Callable, bits: int, mode: str,
                                                       lut_bits: int) -> None:
    """Calibration data outside the domain (the float output has inf/NaN, e.g. log(0)): the table is built from
    clamped samples only, and the output range comes from finite values (not from ±2^31)."""
    calib = data(kind, [2, 4, 5, 6], 21)
    calib[0][0, 0, 0, :3] = torch.tensor([0.0, 1.0, -1.0])  # exact poles: log(0), 1/0, atanh(±1)
    qg = quantize_model(one_layer(optype), calib, settings(bits, mode, lut_bits, lut_output_range="table"))
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    s_in = float(params_of(node, node.inputs[0]).scale)
    h = 0.5 / s_in
    bound = {"Log": abs(np.log(h)) + 10, "Rsqrt": 1 / np.sqrt(h) + 10, "Reciprocal": 1 / h + 10,
             "Atanh": abs(np.arctanh(1 - min(h, 0.5))) + 10}.get(optype, 10.0)
    r = range_of(node, out)
    assert max(abs(float(r.min)), abs(float(r.max))) <= bound
    q_range = oq.qmax - oq.qmin
    assert float(oq.scale) >= q_range / (4 * bound)
    check_int(qg, _wider(kind, [3, 4, 5, 6], 22), table_reference(optype, TORCH_F[optype]))


# --- 3. float vs dequantized ------------------------------------------------------------------------------------
def _cos(optype: str, params: Mapping[str, Any], kind: Callable, bits: int, lut_bits: int,
         out_shape: Optional[Sequence[int]] = None) -> float:
    g = one_layer(optype, params, SHAPE, out_shape)
    calib = data(kind, [2, 4, 5, 6], 30)
    qg = quantize_model(g, calib, settings(bits, "per_tensor_symmetric_full_range", lut_bits,
                                           q_strategy_activation="extrema"))
    ref = g.forward([calib[0]])[0].clone()
    return cosine(ref, run_quantized(qg, calib[0])[0])


@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.99), (16, 10, 0.9995)])
@pytest.mark.parametrize("optype", sorted(set(TABLE_OPS) - {"Floor", "Ceil", "Round", "Trunc"}))
def test_table_op_cosine(optype: str, bits: int, lut_bits: int, threshold: float) -> None:
    assert _cos(optype, {}, TABLE_OPS[optype][1], bits, lut_bits) > threshold


@pytest.mark.parametrize("optype,bits,lut_bits,threshold", [
    *[(t, 8, 8, 0.99) for t in ("Floor", "Ceil", "Round", "Trunc")],
    *[(t, 16, 10, 0.998) for t in ("Floor", "Ceil", "Round", "Trunc")], ("Floor", 16, 16, 0.99999)])
def test_rounding_op_cosine(optype: str, bits: int, lut_bits: int, threshold: float) -> None:
    """Step functions: a table smaller than the input range interpolates across each step (a ramp 2^(16-10)
    codes wide at 16 bits); a full 2^16 table is exact at every code."""
    assert _cos(optype, {}, TABLE_OPS[optype][1], bits, lut_bits) > threshold


@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.99), (16, 10, 0.999)])
@pytest.mark.parametrize("optype,params,out_shape", [
    ("Abs", {}, None), ("Negative", {}, None), ("CRELU", {}, [1, 4, 5, 12]), ("SHRINK", {"lambd": 0.5, "bias": 0.2},
                                                                              None),
    ("THRESHOLDEDRELU", {"alpha": 0.7}, None), ("BNLL", {}, None), ("Activation", {"method": "BNLL"}, None)])
def test_other_ops_cosine(optype: str, params: Dict[str, Any], out_shape, bits: int, lut_bits: int,
                          threshold: float) -> None:
    assert _cos(optype, params, _normal(0.3, 2.0), bits, lut_bits, out_shape) > threshold


def test_sign_output_exact_where_float_sign_is_clear() -> None:
    """Sign is exact except for inputs that quantize to zero (|x| below half an input step)."""
    g = one_layer("Sign")
    calib = data(_normal(0.0, 2.0), [2, 4, 5, 6], 31)
    qg = quantize_model(g, calib)
    got = run_quantized(qg, calib[0])[0]
    step = 1.0 / float(params_of(qg.node("op"), qg.node("op").inputs[0]).scale)
    clear = calib[0].abs() > step
    assert torch.equal(got[clear], torch.sign(calib[0])[clear])


# --- 4. IR write → re-read -----------------------------------------------------------------------------------------
ROUNDTRIP = [(t, {}, None) for t in sorted(TABLE_OPS)] + [
    ("Abs", {}, None), ("Negative", {}, None), ("Sign", {}, None), ("IsInf", {"detect_negative": False}, None),
    ("IsNaN", {}, None), ("CRELU", {"axis": 1}, [1, 8, 5, 6]), ("SHRINK", {"lambd": 0.3, "bias": 0.1}, None),
    ("THRESHOLDEDRELU", {"alpha": -0.2}, None), ("BNLL", {}, None),
    ("Activation", {"method": "CRELU"}, [1, 4, 5, 12]), ("Activation", {"method": "SHRINK"}, None)]


@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[1], MODES[2], MODES[4]])
@pytest.mark.parametrize("optype,params,out_shape", ROUNDTRIP, ids=[f"{c[0]}-{c[1]}" for c in ROUNDTRIP])
def test_written_ir_reloads_bit_identical(tmp_path, optype: str, params: Dict[str, Any], out_shape,
                                          bits: int, mode: str, lut_bits: int) -> None:
    kind = TABLE_OPS[optype][1] if optype in TABLE_OPS else _normal(0.3, 2.0)
    qg = quantize_model(one_layer(optype, params, SHAPE, out_shape), data(kind, [2, 4, 5, 6], 40),
                        settings(bits, mode, lut_bits))
    x = _wider(kind, [3, 4, 5, 6], 41)
    before = qg.forward([x])[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


def test_chain_reloads_bit_identical(tmp_path) -> None:
    b = GraphBuilder("chain")
    t = b.input("x", SHAPE)
    for i, optype in enumerate(["Abs", "Sqrt", "Log", "Negative", "Exp", "Floor", "BNLL"]):
        t = b.layer(optype, [t], [SHAPE], name=f"l{i}")
    g = b.build([t])
    calib = data(_normal(0.0, 2.0), [2, 4, 5, 6], 42)
    qg = quantize_model(g, calib, settings(8, "per_tensor_asymmetric", 8))
    before = qg.forward([calib[1]])[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "c.txt"))[0])
    assert torch.equal(before, re.forward([calib[1]])[0])


# --- 5. errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params,out_shape,match", [
    ("SHRINK", {"lambd": "wide"}, None, "lambd"),
    ("THRESHOLDEDRELU", {"alpha": [1, 2]}, None, "alpha"),
    ("CRELU", {"axis": 4}, [1, 4, 5, 12], "axis"),
    ("CRELU", {"axis": "c"}, [1, 4, 5, 12], "axis"),
    ("IsInf", {"detect_negative": "maybe"}, None, "detect_negative"),
])
def test_bad_params_are_ir_errors(optype: str, params: Dict[str, Any], out_shape, match: str) -> None:
    g = one_layer(optype, params, SHAPE, out_shape)
    with pytest.raises(IRError, match=rf"layer 'op' \({optype}\).*{match}"):
        g.forward([data(_normal(0, 1), [1, 4, 5, 6], 50, 1)[0]])


def test_crelu_output_shape_must_double_the_axis() -> None:
    g = one_layer("CRELU", {"axis": 1}, SHAPE, [1, 4, 5, 12])  # float forward works, the IR shape is wrong
    with pytest.raises(IRError, match="output shape"):
        quantize_model(g, data(_normal(0, 1), [2, 4, 5, 6], 51))


PER_CHANNEL = "per_channel_symmetric_full_range"
"""Set for the layer itself, a per-channel mode it cannot produce is refused; a global one falls back to per
tensor (passes/per_channel_fallback.py, tests/ops/test_per_channel_activations.py)."""


@pytest.mark.parametrize("optype", ["Exp", "Abs", "Negative"])
def test_per_channel_activation_mode_is_unsupported(optype: str) -> None:
    with pytest.raises(UnsupportedError, match="per-channel"):
        quantize_model(one_layer(optype), data(_normal(0, 1), [2, 4, 5, 6], 52),
                       per_layer={"op": {"q_mode_activation": PER_CHANNEL}})


def test_missing_lut_is_an_ir_error() -> None:
    qg = quantize_model(one_layer("Exp"), data(_normal(0, 1), [2, 4, 5, 6], 53))
    del qg.node("op").constants["lut"]
    with pytest.raises(IRError, match="lut"):
        qg.forward([data(_normal(0, 1), [1, 4, 5, 6], 54, 1)[0]])


@pytest.mark.parametrize("optype,expected", [("Square", "calibrated"), ("Exp", "table")])
def test_finite_valued_tables_keep_the_calibrated_output_range(optype: str, expected: str) -> None:
    """With the `mean` strategy, the calibrated maximum of x^2 (a running mean of each batch's maximum) lies above
    the square of the input's calibrated bound (a convex function of a mean), so above the table's largest value;
    Square keeps it, as upstream's, while a function that can give inf (Exp) has its range limited to the tabulated
    values."""
    calib = [torch.from_numpy(x) for x in np.random.default_rng(4).standard_normal((6, 2, 4, 5, 6), np.float32)]
    calib[0] *= 3.0  # batches of different spreads: the running mean of max(x^2) > (running mean of max|x|)^2
    qg = quantize_model(one_layer(optype), calib,
                        settings(8, "per_tensor_symmetric_full_range", 8, q_strategy_activation="mean"))
    node = qg.node("op")
    s_in = float(params_of(node, node.inputs[0]).scale)
    table_max = float(TORCH_F[optype](torch.tensor([-128 / s_in, 127 / s_in])).max())
    r_max = float(range_of(node, node.outputs[0]).max)
    if expected == "calibrated":
        assert r_max > table_max * 1.05
    else:
        assert r_max <= table_max * (1 + 1e-6)
