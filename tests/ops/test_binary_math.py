"""Div, Pow, Mod, DivMod, SquaredDifference, Where, Logical, Bitwise, BitShift: float forward against numpy, integer
forward against an independent python-int reference written from docs/semantics/binary.md, float-vs-dequantized
cosine, IR write → re-read bit identity, and clear errors."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from quant_helpers import params_of

import quantopt.ops.binary_math  # noqa: F401  (registers the family even when imported alone)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

SHAPE = [1, 4, 5, 6]
# (bits, q_mode_activation, lut_items_in_bits); 16-bit asymmetric becomes symmetric
MODES = [
    (8, "per_tensor_asymmetric", 8),
    (8, "per_tensor_symmetric_full_range", 8),
    (8, "per_tensor_symmetric_restricted_range", 8),
    (16, "per_tensor_symmetric_full_range", 10),
    (16, "per_tensor_asymmetric", 12),
]


# --- data and graphs ------------------------------------------------------------------------------------------------
def normal(shape: Sequence[int], seed: int, loc: float = 0.3, std: float = 2.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(loc, std, size=list(shape)).astype(np.float32))


def ints(shape: Sequence[int], seed: int, lo: int, hi: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(lo, hi + 1, size=list(shape)).astype(np.int64))


def batch_shape(shape: Sequence[int], batch: int) -> List[int]:
    return [batch] + list(shape)[1:] if len(shape) == len(SHAPE) else list(shape)


def graph(optype: str, params: Dict[str, Any], in_shapes: Sequence[Sequence[int]],
          in_dtypes: Optional[Sequence[Dtype]] = None, out_dtypes: Optional[Sequence[Dtype]] = None,
          outputs: int = 1):
    b = GraphBuilder("t")
    names = [b.input(f"in{i}", list(s), dtype=(in_dtypes or [Dtype.FP32] * len(in_shapes))[i])
             for i, s in enumerate(in_shapes)]
    y = b.layer(optype, names, [SHAPE] * outputs, name="op", params=dict(params),
                output_dtypes=list(out_dtypes) if out_dtypes else None)
    return b.build(y if isinstance(y, list) else [y])


def settings(bits: int, mode: str, lut_bits: int = 8, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                q_strategy_activation="extrema", **extra)


# --- python-int helpers of the reference -----------------------------------------------------------------------------
def rs(v: int, n: int) -> int:
    """round_half_even(v / 2^n) (left shift for n <= 0), python ints."""
    if n <= 0:
        return v << -n
    q, r = divmod(v, 1 << n)
    half = 1 << (n - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def tparams(node, t) -> Tuple[float, int, int, int]:
    q = params_of(node, t)
    return float(q.scale), int(q.zerop), int(q.qmin), int(q.qmax)


def emax(node, t) -> int:
    _, zp, lo, hi = tparams(node, t)
    return max(abs(lo + zp), abs(hi + zp))


def elementwise(fn, *arrays: np.ndarray) -> np.ndarray:
    """Apply a python-int function element by element over broadcast arrays."""
    bs = np.broadcast_arrays(*[np.asarray(a, dtype=np.int64) for a in arrays])
    out = np.empty(bs[0].shape, dtype=np.int64)
    for idx in np.ndindex(out.shape):
        out[idx] = fn(*[int(b[idx]) for b in bs])
    return out


def wrap(v: int, lo: int, hi: int) -> int:
    return (v - lo) % (hi - lo + 1) + lo


def table_value(index: int, table: Sequence[int], in_bits: int) -> int:
    n = len(table)
    t = n.bit_length() - 1
    if in_bits <= t:
        return int(table[min(index, n - 1)])
    b = in_bits - t
    hi, lo = index >> b, index & ((1 << b) - 1)
    a = int(table[hi])
    c = int(table[hi + 1]) if hi + 1 < n else a
    return a + ((c - a) * lo) // (1 << b)


# --- references from docs/semantics/binary.md ------------------------------------------------------------------------
def ref_logical(node, xs: List[np.ndarray]) -> np.ndarray:
    method = node.params["method"]
    offs = [np.asarray(x, dtype=np.int64) + int(params_of(node, t).zerop) for x, t in zip(xs, node.inputs)]
    if method == "NOT":
        return (offs[0] == 0).astype(np.int64)
    if method in ("AND", "OR", "XOR"):
        fn = {"AND": np.logical_and, "OR": np.logical_or, "XOR": np.logical_xor}[method]
        return fn(offs[0] != 0, offs[1] != 0).astype(np.int64)
    ma, mb = node.params["scale_value"]
    fn = {"EQUAL": lambda p, q: p == q, "NOT_EQUAL": lambda p, q: p != q, "GREATER": lambda p, q: p > q,
          "GREATER_EQUAL": lambda p, q: p >= q, "LESS": lambda p, q: p < q, "LESS_EQUAL": lambda p, q: p <= q}[method]
    return elementwise(lambda x, y: int(fn(x * ma, y * mb)), offs[0], offs[1])


def ref_where(node, xs: List[np.ndarray]) -> np.ndarray:
    zc, zx, zy = (int(params_of(node, t).zerop) for t in node.inputs)
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    (mx, my), (nx, ny) = node.params["scale_value"], node.params["shift_value"]

    def one(cv: int, xv: int, yv: int) -> int:
        vx = clamp(rs((xv + zx) * mx, nx) - zp_out, qmin, qmax)
        vy = clamp(rs((yv + zy) * my, ny) - zp_out, qmin, qmax)
        return vx if cv + zc != 0 else vy
    return elementwise(one, *xs)


def ref_div_upstream(node, xs: List[np.ndarray]) -> np.ndarray:
    """Upstream's form: sign(Y) · X · lut(|Y|), lut over the divisor's codes (floor-interpolated when the table has
    fewer entries than codes), one requantization."""
    za, zb = (int(params_of(node, t).zerop) for t in node.inputs)
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    _, _, b_lo, b_hi = tparams(node, node.inputs[1])
    bits = (b_hi - b_lo).bit_length()
    lut = [int(v) for v in node.constants["lut"].betensor.tolist()]
    table_bits = len(lut).bit_length() - 1
    padded = lut + lut[-1:]
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])

    def entry(d: int) -> int:
        d = min(d, (1 << bits) - 1)
        if bits <= table_bits:
            return lut[d]
        k = bits - table_bits
        hi, lo = d >> k, d - ((d >> k) << k)
        return padded[hi] + (((padded[hi + 1] - padded[hi]) * lo) >> k)

    def one(av: int, bv: int) -> int:
        x, y = av + za, bv + zb
        return clamp(rs((-1 if y < 0 else 1) * x * entry(abs(y)) * m, n) - zp_out, qmin, qmax)
    return elementwise(one, *xs)


def ref_div(node, xs: List[np.ndarray]) -> np.ndarray:
    if "reciprocal_shift" not in node.params:
        return ref_div_upstream(node, xs)
    za, zb = (int(params_of(node, t).zerop) for t in node.inputs)
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    lut = [int(v) for v in node.constants["lut"].betensor.tolist()]
    t = len(lut).bit_length() - 1
    p = int(node.params["reciprocal_shift"])
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])

    def one(av: int, bv: int) -> int:
        x, y = av + za, bv + zb
        d = abs(y)
        e = max(0, d.bit_length() - t)
        i = d if e == 0 else (d + (1 << (e - 1))) >> e
        if i == 1 << t:
            i, e = 1 << (t - 1), e + 1
        sign = (y > 0) - (y < 0)
        return clamp(rs(sign * x * lut[i] * m, n + p + e) - zp_out, qmin, qmax)
    return elementwise(one, *xs)


def ref_pow(node, xs: List[np.ndarray]) -> np.ndarray:
    _, _, in_qmin, in_qmax = tparams(node, node.inputs[0])
    _, _, qmin, qmax = tparams(node, node.outputs[0])
    table = [int(v) for v in node.constants["lut"].betensor.tolist()]
    bits = (in_qmax - in_qmin).bit_length()
    offset = in_qmin - 1 if in_qmin < 0 and in_qmin == -in_qmax else in_qmin
    return elementwise(lambda v: clamp(table_value(clamp(v - offset, 0, (1 << bits) - 1), table, bits), qmin, qmax),
                       xs[0])


def ref_sqd(node, xs: List[np.ndarray]) -> np.ndarray:
    za, zb = (int(params_of(node, t).zerop) for t in node.inputs)
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    m, ma, mb = node.params["scale_value"]
    n, k = int(node.params["shift_value"]), int(node.params["diff_shift"])

    def one(av: int, bv: int) -> int:
        d = rs((av + za) * ma - (bv + zb) * mb, k)
        return clamp(rs(d * d * m, n) - zp_out, qmin, qmax)
    return elementwise(one, *xs)


def ref_mod(node, xs: List[np.ndarray]) -> np.ndarray:
    za, zb = (int(params_of(node, t).zerop) for t in node.inputs)
    _, zp_out, qmin, qmax = tparams(node, node.outputs[0])
    m, ma, mb = node.params["scale_value"]
    n = int(node.params["shift_value"])
    fmod = bool(node.params.get("fmod", False))

    def one(av: int, bv: int) -> int:
        x, y = (av + za) * ma, (bv + zb) * mb
        if y == 0:
            r = 0
        elif fmod:
            r = x - y * ((abs(x) // abs(y)) * (1 if (x < 0) == (y < 0) else -1))
        else:
            r = x - y * (x // y)
        return clamp(rs(r * m, n) - zp_out, qmin, qmax)
    return elementwise(one, *xs)


REFERENCES = {"Logical": ref_logical, "Where": ref_where, "Div": ref_div, "Pow": ref_pow,
              "SquaredDifference": ref_sqd, "Mod": ref_mod}


# --- cases: (type, params, input shapes, data maker(seed, batch) -> list of tensors) --------------------------------
def _two(seed: int, batch: int, shape_b: Sequence[int] = SHAPE, std_b: float = 2.0) -> List[torch.Tensor]:
    return [normal(batch_shape(SHAPE, batch), seed), normal(batch_shape(shape_b, batch), seed + 100, -0.2, std_b)]


def _divisor(seed: int, batch: int) -> List[torch.Tensor]:
    a, b = _two(seed, batch)
    return [a, torch.where(b.abs() < 0.3, torch.full_like(b, 0.3), b)]


def _mod(seed: int, batch: int) -> List[torch.Tensor]:
    a, b = _two(seed, batch, std_b=1.0)
    return [a, torch.where(b < 0, b - 1.0, b + 1.0)]


def _where(seed: int, batch: int) -> List[torch.Tensor]:
    c = ints(batch_shape(SHAPE, batch), seed, 0, 1).to(torch.float32)
    return [c] + _two(seed + 1, batch, [1, 1, 5, 6])


def _pow_pos(seed: int, batch: int) -> List[torch.Tensor]:
    return [normal(batch_shape(SHAPE, batch), seed).abs() + 0.2]


FLOAT_CASES: List[Tuple[str, Dict[str, Any], List[List[int]], Any]] = [
    ("Logical", {"method": "GREATER"}, [SHAPE, SHAPE], _two),
    ("Logical", {"method": "LESS_EQUAL"}, [SHAPE, [1, 1, 1, 6]], lambda s, n: _two(s, n, [1, 1, 1, 6])),
    ("Logical", {"method": "NOT_EQUAL"}, [SHAPE, SHAPE], _two),
    ("Logical", {"method": "AND"}, [SHAPE, SHAPE], lambda s, n: [torch.round(x) for x in _two(s, n)]),
    ("Logical", {"method": "XOR"}, [SHAPE, SHAPE], lambda s, n: [torch.round(x) for x in _two(s, n)]),
    ("Logical", {"method": "NOT"}, [SHAPE], lambda s, n: [torch.round(_two(s, n)[0])]),
    ("Where", {}, [SHAPE, SHAPE, [1, 1, 5, 6]], _where),
    ("Div", {}, [SHAPE, SHAPE], _divisor),
    ("Div", {}, [SHAPE, [1, 1, 1, 6]], lambda s, n: [_divisor(s, n)[0], torch.tensor([[[[0.5, -1.0, 2.0, -4.0,
                                                                                            3.0, 0.75]]]])]),
    ("Pow", {"exponent": 2}, [SHAPE], lambda s, n: _two(s, n)[:1]),
    ("Pow", {"exponent": 3}, [SHAPE], lambda s, n: _two(s, n)[:1]),
    ("Pow", {"exponent": 0.5}, [SHAPE], _pow_pos),
    ("Pow", {"exponent": -1.0}, [SHAPE], _pow_pos),
    ("SquaredDifference", {}, [SHAPE, SHAPE], _two),
    ("SquaredDifference", {}, [SHAPE, [1, 1, 1, 6]], lambda s, n: _two(s, n, [1, 1, 1, 6], 0.5)),
    ("Mod", {"fmod": False}, [SHAPE, SHAPE], _mod),
    ("Mod", {"fmod": True}, [SHAPE, SHAPE], _mod),
]


def _id(case) -> str:
    optype, params, shapes, _ = case
    return "-".join([optype] + [f"{k}={v}" for k, v in params.items()] + ["x".join(map(str, shapes[-1]))])


def numpy_reference(optype: str, params: Dict[str, Any], xs: List[np.ndarray]) -> np.ndarray:
    if optype == "Logical":
        m = params["method"]
        if m == "NOT":
            return np.logical_not(xs[0] != 0).astype(np.int64)
        if m in ("AND", "OR", "XOR"):
            return getattr(np, "logical_" + m.lower())(xs[0] != 0, xs[1] != 0).astype(np.int64)
        fn = {"GREATER": np.greater, "LESS_EQUAL": np.less_equal, "NOT_EQUAL": np.not_equal, "EQUAL": np.equal,
              "LESS": np.less, "GREATER_EQUAL": np.greater_equal}[m]
        return fn(xs[0], xs[1]).astype(np.int64)
    if optype == "Where":
        return np.where(xs[0] != 0, xs[1], xs[2])
    if optype == "Div":
        return xs[0] / xs[1]
    if optype == "Pow":
        return np.power(xs[0], np.float32(params["exponent"]))
    if optype == "SquaredDifference":
        return (xs[0] - xs[1]) ** 2
    if optype == "Mod":
        return np.fmod(xs[0], xs[1]) if params["fmod"] else np.mod(xs[0], xs[1])
    raise AssertionError(optype)


# --- 1. float forward == numpy --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", FLOAT_CASES, ids=_id)
def test_float_forward_matches_numpy(case) -> None:
    optype, params, shapes, data = case
    g = graph(optype, params, shapes)
    xs = data(1, 2)
    got = g.forward(xs)[0]
    want = numpy_reference(optype, params, [x.numpy() for x in xs])
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64), rtol=2e-6, atol=2e-6)


def test_float_divmod_bitwise_bitshift_match_numpy() -> None:
    a = ints([2, 4, 5, 6], 3, -128, 127)
    b = ints([2, 4, 5, 6], 4, -128, 127)
    sh = ints([2, 4, 5, 6], 5, 0, 9)
    i8 = [Dtype.INT8, Dtype.INT8]
    for method, fn in [("AND", np.bitwise_and), ("OR", np.bitwise_or), ("XOR", np.bitwise_xor)]:
        got = graph("Bitwise", {"method": method}, [SHAPE, SHAPE], i8, [Dtype.INT8]).forward([a, b])[0]
        np.testing.assert_array_equal(got.numpy(), fn(a.numpy().astype(np.int8), b.numpy().astype(np.int8)))
    got = graph("Bitwise", {"method": "NOT"}, [SHAPE], i8[:1], [Dtype.INT8]).forward([a])[0]
    np.testing.assert_array_equal(got.numpy(), np.bitwise_not(a.numpy().astype(np.int8)))
    for direction, fn in [("LEFT", np.left_shift), ("RIGHT", np.right_shift)]:
        got = graph("BitShift", {"direction": direction}, [SHAPE, SHAPE], i8, [Dtype.INT8]).forward([a, sh])[0]
        s = np.minimum(sh.numpy(), 8)
        want = fn(a.numpy().astype(np.int64), s)
        want = ((want + 128) % 256 - 128) if direction == "LEFT" else want
        np.testing.assert_array_equal(got.numpy(), want)
    bz = torch.where(b == 0, torch.ones_like(b), b)
    for mode in ("FLOOR", "TRUNC"):
        q, r = graph("DivMod", {"mode": mode}, [SHAPE, SHAPE], i8, [Dtype.INT8, Dtype.INT8], outputs=2).forward([a, bz])
        an, bn = a.numpy(), bz.numpy()
        want_q = np.floor_divide(an, bn) if mode == "FLOOR" else np.trunc(an / bn).astype(np.int64)
        want_r = an - bn * want_q
        np.testing.assert_array_equal(q.numpy(), (want_q + 128) % 256 - 128)
        np.testing.assert_array_equal(r.numpy(), (want_r + 128) % 256 - 128)


# --- 2. integer forward == independent reference ---------------------------------------------------------------------
def quantized(case, bits: int, mode: str, lut_bits: int, seed: int = 7, **extra: Any):
    optype, params, shapes, data = case
    g = graph(optype, params, shapes)
    calib = [data(seed + i, 2) for i in range(3)]
    return g, quantize_model(g, calib, settings(bits, mode, lut_bits, **extra))


def check_integer(qg, optype: str, xs: List[torch.Tensor]) -> np.ndarray:
    qg.forward(xs, keep_tensors=True)
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    out = params_of(node, node.outputs[0])
    assert int(got.min()) >= out.qmin and int(got.max()) <= out.qmax
    want = REFERENCES[optype](node, [t.betensor.numpy() for t in node.inputs])
    np.testing.assert_array_equal(got.numpy(), want)
    return got.numpy()


INT_CASES = [c for c in FLOAT_CASES if c[0] != "Logical" or c[1]["method"] in ("GREATER", "LESS_EQUAL", "XOR")]


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("case", INT_CASES, ids=_id)
def test_integer_forward_matches_reference(case, bits: int, mode: str, lut_bits: int) -> None:
    _, qg = quantized(case, bits, mode, lut_bits)
    # a batch of 3 (the IR batch is 1) and a wider spread than calibration: exercises broadcasting and saturation
    xs = case[3](50, 3)
    check_integer(qg, case[0], [x * 1.5 if x.is_floating_point() else x for x in xs])


def test_div_upstream_form_table_and_interpolation() -> None:
    """The default form is upstream's: a uint16 table of round(65535 / code) (entry 0 is 0) and one multiplier of
    the activation bits; a 16-bit divisor with a 2^8 table interpolates between entries (the reference above)."""
    case = ("Div", {}, [SHAPE, SHAPE], _divisor)
    _, qg = quantized(case, 8, "per_tensor_asymmetric", 8)
    node = qg.node("op")
    lut = node.constants["lut"]
    assert lut.dtype == Dtype.UINT16 and "reciprocal_shift" not in node.params
    expected = [0] + [min(65535, int(np.round(65535.0 / i))) for i in range(1, 256)]
    assert lut.betensor.tolist() == expected
    assert int(node.params["scale_value"]) < 256  # 8 multiplier bits at 8-bit activations
    _, qg16 = quantized(case, 16, "per_tensor_symmetric_full_range", 8)
    xs = case[3](62, 3)
    xs[1] = torch.cat([xs[1][:2], torch.linspace(0.3, 4.0, 120).reshape(1, 4, 5, 6)], dim=0)
    check_integer(qg16, "Div", xs)
    assert qg16.node("op").constants["lut"].betensor.numel() == 256


@pytest.mark.parametrize("bits,mode", [(8, "per_tensor_asymmetric"), (16, "per_tensor_symmetric_full_range")])
@pytest.mark.parametrize("case", [c for c in FLOAT_CASES if c[0] in ("Div", "Where")][:2], ids=["Div", "Where"])
def test_codes_outside_their_range_are_computed(case, bits: int, mode: str) -> None:
    """Div's divisor and Where's branches read their per-code results from tables over the codes; a hand-fed code
    outside [qmin, qmax] (below, above) is computed instead, as the reference computes every code."""
    _, qg = quantized(case, bits, mode, 8)
    qg.forward(case[3](63, 2), keep_tensors=True)
    node = qg.node("op")
    for t in node.inputs[1:]:
        q = params_of(node, t)
        codes = t.betensor.clone()
        codes.view(-1)[:4] = torch.tensor([q.qmin - 5, q.qmax + 7, q.qmin - 1, q.qmax], dtype=codes.dtype)
        t.betensor = codes
    node.forward()
    want = REFERENCES[case[0]](node, [t.betensor.numpy() for t in node.inputs])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), want)


def test_div_wide_divisor_uses_normalized_reciprocal() -> None:
    """16-bit divisor with a 2^8 table: the normalization path (e > 0, including the carry to 2^t) is exercised."""
    case = ("Div", {}, [SHAPE, SHAPE], _divisor)
    _, qg = quantized(case, 16, "per_tensor_symmetric_full_range", 8, div_integer_form="exact")
    node = qg.node("op")
    assert node.constants["lut"].betensor.numel() == 256 and node.constants["lut"].dtype == Dtype.UINT32
    assert node.params["reciprocal_shift"] == 8 + 15
    xs = case[3](60, 3)
    xs[1] = torch.cat([xs[1][:2], torch.linspace(0.3, 4.0, 120).reshape(1, 4, 5, 6)], dim=0)
    check_integer(qg, "Div", xs)
    q = node.inputs[1].betensor + int(params_of(node, node.inputs[1]).zerop)
    assert int(q.abs().max()) >= 256  # some divisors needed normalization


def test_div_by_zero_gives_float_zero() -> None:
    case = ("Div", {}, [SHAPE, SHAPE], _divisor)
    _, qg = quantized(case, 8, "per_tensor_asymmetric", 8)
    xs = case[3](61, 1)
    xs[1] = torch.zeros_like(xs[1])
    got = check_integer(qg, "Div", xs)
    op = qg.node("op")
    assert (got == -int(params_of(op, op.outputs[0]).zerop)).all()


# --- integer-only ops: exact --------------------------------------------------------------------------------------
INT_DTYPES = [(Dtype.INT8, -128, 127), (Dtype.UINT8, 0, 255), (Dtype.INT16, -32768, 32767)]


@pytest.mark.parametrize("dtype,lo,hi", INT_DTYPES)
def test_integer_ops_exact(dtype: Dtype, lo: int, hi: int) -> None:
    a = ints([2, 4, 5, 6], 11, lo, hi)
    b = ints([2, 4, 5, 6], 12, lo, hi)
    sh = ints([2, 4, 5, 6], 13, -1, dtype.bits + 1)
    d2 = [dtype, dtype]
    s = settings(8, "per_tensor_asymmetric")

    def run(optype: str, params: Dict[str, Any], feeds: List[torch.Tensor], outputs: int = 1) -> List[np.ndarray]:
        shapes = [SHAPE] * len(feeds)
        g = graph(optype, params, shapes, d2[:len(feeds)], [dtype] * outputs, outputs=outputs)
        qg = quantize_model(g, [feeds], s)
        op = qg.node("op")
        for t in op.outputs:
            q = params_of(op, t)
            assert q.qinvariant and t.dtype == dtype and (q.qmin, q.qmax) == (lo, hi)
        got = [t.numpy() for t in qg.forward(feeds)]
        floats = [t.numpy() for t in g.forward(feeds)]
        for x, y in zip(got, floats):
            np.testing.assert_array_equal(x, y)
        return got

    an, bn, shn = a.numpy(), b.numpy(), sh.numpy()
    for method, op in [("AND", lambda x, y: x & y), ("OR", lambda x, y: x | y), ("XOR", lambda x, y: x ^ y)]:
        (got,) = run("Bitwise", {"method": method}, [a, b])
        np.testing.assert_array_equal(got, elementwise(lambda x, y, f=op: wrap(f(x, y), lo, hi), an, bn))
    (got,) = run("Bitwise", {"method": "NOT"}, [a])
    np.testing.assert_array_equal(got, elementwise(lambda x: wrap(~x, lo, hi), an))
    bits = dtype.bits
    (got,) = run("BitShift", {"direction": "LEFT"}, [a, sh])
    np.testing.assert_array_equal(got, elementwise(lambda x, k: wrap(x << clamp(k, 0, bits), lo, hi), an, shn))
    (got,) = run("BitShift", {"direction": "RIGHT"}, [a, sh])
    np.testing.assert_array_equal(got, elementwise(lambda x, k: x >> clamp(k, 0, bits), an, shn))
    for mode in ("FLOOR", "TRUNC"):
        q, r = run("DivMod", {"mode": mode}, [a, b], outputs=2)

        def div(x: int, y: int, mode: str = mode) -> Tuple[int, int]:
            if y == 0:
                return 0, 0
            qq = x // y if mode == "FLOOR" else (abs(x) // abs(y)) * (1 if (x < 0) == (y < 0) else -1)
            return qq, x - y * qq
        np.testing.assert_array_equal(q, elementwise(lambda x, y: wrap(div(x, y)[0], lo, hi), an, bn))
        np.testing.assert_array_equal(r, elementwise(lambda x, y: wrap(div(x, y)[1], lo, hi), an, bn))
    for fmod in (False, True):
        g = graph("Mod", {"fmod": fmod}, [SHAPE, SHAPE], d2)
        qg = quantize_model(g, [[a, b]], s)
        got = qg.forward([a, b])[0].numpy()
        op = qg.node("op")
        assert params_of(op, op.outputs[0]).qinvariant and op.params["scale_value"] == [1, 1, 1]
        want = np.where(bn == 0, 0, np.fmod(an, np.where(bn == 0, 1, bn)) if fmod else
                        np.mod(an, np.where(bn == 0, 1, bn)))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method", ["EQUAL", "GREATER", "LESS_EQUAL", "AND", "NOT"])
def test_logical_on_integers_is_exact(method: str) -> None:
    a = ints([2, 4, 5, 6], 21, -3, 3)
    b = ints([2, 4, 5, 6], 22, -3, 3)
    feeds = [a] if method == "NOT" else [a, b]
    g = graph("Logical", {"method": method}, [SHAPE] * len(feeds), [Dtype.INT8] * len(feeds))
    qg = quantize_model(g, [feeds], settings(8, "per_tensor_asymmetric"))
    out = qg.node("op").outputs[0]
    assert params_of(qg.node("op"), out).qinvariant and out.dtype == Dtype.UINT8
    np.testing.assert_array_equal(qg.forward(feeds)[0].numpy(), g.forward(feeds)[0].numpy())


def test_logical_equal_params_compare_exactly_on_grid() -> None:
    """Same calibrated ranges → equal scales: upstream's multipliers [8192, 8192] (r = 1), comparisons are exact on the
    integer grid."""
    b = GraphBuilder("t")
    x = b.input("x", SHAPE)
    y = b.layer("Logical", [x, x], [SHAPE], name="op", params={"method": "GREATER_EQUAL"})
    g = b.build([y])
    qg = quantize_model(g, [[normal([2, 4, 5, 6], 30)]], settings(8, "per_tensor_asymmetric"))
    assert qg.node("op").params["scale_value"] == [8192, 8192]
    assert bool((qg.forward([normal([2, 4, 5, 6], 31)])[0] == 1).all())


def test_where_with_integer_branches_is_integer() -> None:
    c = ints([2, 4, 5, 6], 40, 0, 1)
    x = ints([2, 4, 5, 6], 41, -100, 100)
    y = ints([2, 4, 5, 6], 42, 0, 200)
    g = graph("Where", {}, [SHAPE] * 3, [Dtype.UINT8, Dtype.INT8, Dtype.INT16])
    qg = quantize_model(g, [[c, x, y]], settings(8, "per_tensor_asymmetric"))
    out = qg.node("op").outputs[0]
    oq = params_of(qg.node("op"), out)
    assert oq.qinvariant and oq.qbits == 16 and oq.qmin < 0
    np.testing.assert_array_equal(qg.forward([c, x, y])[0].numpy(), np.where(c.numpy() != 0, x.numpy(), y.numpy()))


def _masked_fill_graph(fill: float):
    """Where(condition, Constant(fill), x): a masked_fill, as torch's SDPA export writes after its Softmax."""
    b = GraphBuilder("t")
    c = b.input("cond", SHAPE, dtype=Dtype.UINT8)
    x = b.input("x", SHAPE)
    b.layer("Constant", [], [SHAPE], name="fill", constants={"weights": np.full(SHAPE, fill, np.float32)})
    y = b.layer("Where", [c, "fill", x], [SHAPE], name="op")
    return b.build([y])


@pytest.mark.parametrize("fill, bits", [(0.0, 8), (0.0, 16), (3.0, 8)])
def test_where_integer_fill_branch(fill: float, bits: int) -> None:
    """A zero fill (an integer Constant) passes through with M = 1, N = 0 as upstream writes it: the zero's integers
    are the same with any multiplier. A non-zero integer fill is requantized to the output scale (upstream would pass
    its code through and mean 3 / s_out instead of 3)."""
    c = ints([2, 4, 5, 6], 43, 0, 1)
    x = normal([2, 4, 5, 6], 44, loc=0.0, std=1.0)
    g = _masked_fill_graph(fill)
    qg = quantize_model(g, [[c, x]], settings(bits, "per_tensor_asymmetric", 10 if bits == 16 else 8))
    node = qg.node("op")
    assert params_of(node, node.inputs[1]).qinvariant and not params_of(node, node.inputs[2]).qinvariant
    m, n = node.params["scale_value"][0], node.params["shift_value"][0]
    if fill == 0.0:
        assert (m, n) == (1, 0) and node.params["scale_type"][0] == (Dtype.UINT8 if bits == 8 else Dtype.UINT16)
    else:
        assert (m, n) != (1, 0)
    got = run_quantized(qg, [c, x])[0]
    want = g.forward([c, x])[0]
    out = params_of(node, node.outputs[0])
    x_scale = float(params_of(node, node.inputs[2]).scale)
    assert float((got - want).abs().max()) <= 1.0 / float(out.scale) + 1.0 / x_scale  # input and output rounding
    filled = c.numpy() != 0
    np.testing.assert_allclose(got.numpy()[filled], fill, atol=0.5 / float(out.scale) + 1e-6)


# --- 3. float vs dequantized --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.99), (16, 10, 0.9999)])
@pytest.mark.parametrize("case", [c for c in FLOAT_CASES if c[0] != "Logical"], ids=_id)
def test_float_vs_dequantized_cosine(case, bits: int, lut_bits: int, threshold: float) -> None:
    # upstream's Div table holds 65535 / code: at 16 bits large divisors get entries of 1 or 2, so 0.9999 needs the
    # exact form (the default form's own bound is checked in test_div_upstream_form_is_coarse_at_16_bits)
    extra = {"div_integer_form": "exact"} if case[0] == "Div" and bits == 16 else {}
    g, qg = quantized(case, bits, "per_tensor_asymmetric", lut_bits, **extra)
    xs = case[3](7, 2)
    ref = g.forward(xs)[0].clone().to(torch.float32)
    got = run_quantized(qg, xs)[0]
    if case[0] == "Mod" and bits == 8:
        # 8-bit inputs move a few values across a period boundary of the remainder, whatever the kernel does:
        # measure the operator's own error against the float remainder of the dequantized inputs instead
        qg.forward(xs, keep_tensors=True)
        op = qg.node("op")
        deq = [run_quantized_input(op, t) for t in op.inputs]
        ref = g.forward(deq)[0].clone().to(torch.float32)
    assert cosine(ref, got) > threshold


def test_div_upstream_form_is_coarse_at_16_bits() -> None:
    case = next(c for c in FLOAT_CASES if c[0] == "Div")
    g, qg = quantized(case, 16, "per_tensor_asymmetric", 10)
    xs = case[3](7, 2)
    ref = g.forward(xs)[0].clone().to(torch.float32)
    upstream = cosine(ref, run_quantized(qg, xs)[0])
    _, qe = quantized(case, 16, "per_tensor_asymmetric", 10, div_integer_form="exact")
    assert 0.999 < upstream < cosine(ref, run_quantized(qe, xs)[0])


def run_quantized_input(node, t) -> torch.Tensor:
    q = params_of(node, t)
    return (t.betensor.to(torch.float64) + float(q.zerop)).div(float(q.scale)).to(torch.float32)


@pytest.mark.parametrize("case", [c for c in FLOAT_CASES if c[0] == "Logical"], ids=_id)
def test_logical_agrees_with_float(case) -> None:
    """0/1 outputs: at least 98 % agreement at 8 bits (only near-equal pairs can flip)."""
    g, qg = quantized(case, 8, "per_tensor_asymmetric", 8)
    xs = case[3](7, 2)
    ref = g.forward(xs)[0].clone()
    got = run_quantized(qg, xs)[0]
    assert float((ref.to(torch.float32) == got).to(torch.float32).mean()) >= 0.98


# --- 4. IR write → re-read → bit identity -------------------------------------------------------------------------
ROUNDTRIP = [c for c in FLOAT_CASES if not (c[0] == "Logical" and c[1]["method"] in ("AND", "NOT", "NOT_EQUAL"))]


@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[0], MODES[3]])
@pytest.mark.parametrize("case", ROUNDTRIP, ids=_id)
def test_written_ir_reloads_bit_identical(tmp_path, case, bits: int, mode: str, lut_bits: int) -> None:
    _, qg = quantized(case, bits, mode, lut_bits)
    xs = case[3](8, 3)
    before = [t.clone() for t in qg.forward(xs)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    after = re.forward(xs)
    assert all(torch.equal(p, q) and q.dtype == torch.int64 for p, q in zip(before, after))


def test_integer_ops_reload_bit_identical(tmp_path) -> None:
    a = ints([2, 4, 5, 6], 70, -128, 127)
    b = ints([2, 4, 5, 6], 71, -128, 127)
    s = ints([2, 4, 5, 6], 72, 0, 7)
    for optype, params, feeds, outputs in [("Bitwise", {"method": "XOR"}, [a, b], 1),
                                           ("BitShift", {"direction": "LEFT"}, [a, s], 1),
                                           ("DivMod", {"mode": "TRUNC"}, [a, b], 2),
                                           ("Mod", {"fmod": False}, [a, b], 1),
                                           ("Logical", {"method": "LESS"}, [a, b], 1)]:
        g = graph(optype, params, [SHAPE, SHAPE], [Dtype.INT8] * 2, [Dtype.INT8] * outputs, outputs=outputs)
        qg = quantize_model(g, [feeds], settings(8, "per_tensor_asymmetric"))
        before = [t.clone() for t in qg.forward(feeds)]
        re = read_ir(write_ir(qg, str(tmp_path / f"{optype}.txt"))[0])
        assert all(torch.equal(p, q) for p, q in zip(before, re.forward(feeds))), optype


# --- 5. errors ------------------------------------------------------------------------------------------------------
def test_bad_params_are_ir_errors() -> None:
    x = [normal([1, 4, 5, 6], 80), normal([1, 4, 5, 6], 81)]
    with pytest.raises(IRError, match="unsupported method 'BOTH'"):
        graph("Logical", {"method": "BOTH"}, [SHAPE, SHAPE]).forward(x)
    with pytest.raises(IRError, match="unsupported direction 'UP'"):
        graph("BitShift", {"direction": "UP"}, [SHAPE, SHAPE]).forward(x)
    with pytest.raises(IRError, match="unsupported mode 'ROUND'"):
        graph("DivMod", {"mode": "ROUND"}, [SHAPE, SHAPE], outputs=2).forward(x)
    with pytest.raises(IRError, match="missing required parameter 'method'"):
        graph("Bitwise", {}, [SHAPE, SHAPE]).forward(x)
    with pytest.raises(IRError, match="'fmod' must be true or false"):
        graph("Mod", {"fmod": "maybe"}, [SHAPE, SHAPE]).forward(x)
    with pytest.raises(IRError, match="'exponent' must be a number"):
        graph("Pow", {"exponent": "two"}, [SHAPE]).forward(x[:1])
    with pytest.raises(IRError, match="do not broadcast"):
        graph("Div", {}, [SHAPE, [1, 4, 5, 6]]).forward([x[0], normal([1, 4, 5, 4], 82)])
    with pytest.raises(IRError, match="expects 1 input"):
        graph("Logical", {"method": "NOT"}, [SHAPE, SHAPE]).forward(x)


@pytest.mark.parametrize("optype,params", [("Bitwise", {"method": "AND"}), ("BitShift", {"direction": "LEFT"}),
                                           ("DivMod", {"mode": "FLOOR"})])
def test_integer_only_ops_refuse_float_inputs(optype: str, params: Dict[str, Any]) -> None:
    outputs = 2 if optype == "DivMod" else 1
    g = graph(optype, params, [SHAPE, SHAPE], outputs=outputs)
    data = [[torch.round(normal([2, 4, 5, 6], 90) * 3), torch.round(normal([2, 4, 5, 6], 91) * 3) + 20]]
    with pytest.raises(UnsupportedError, match="only defined on integer tensors"):
        quantize_model(g, data, settings(8, "per_tensor_asymmetric"))


def test_pow_with_tensor_exponent_is_unsupported() -> None:
    g = graph("Pow", {}, [SHAPE, SHAPE])
    data = [[normal([2, 4, 5, 6], 92).abs(), normal([2, 4, 5, 6], 93)]]
    assert torch.allclose(g.forward(data[0])[0], torch.pow(data[0][0], data[0][1]))
    with pytest.raises(UnsupportedError, match="quantizing Pow needs a constant exponent"):
        quantize_model(g, data, settings(8, "per_tensor_asymmetric"))


def test_where_needs_three_inputs() -> None:
    g = graph("Where", {}, [SHAPE])
    with pytest.raises(UnsupportedError, match="three-input form"):
        g.forward([normal([1, 4, 5, 6], 94)])
