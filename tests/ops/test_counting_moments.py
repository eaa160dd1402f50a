"""Count and ZeroFraction (ops/counting.py), Moments, SufficientStatistics and NormalizedMoments (ops/moments.py): float
forward against numpy, quantize (params and tables as docs/semantics/counting.md and moments.md state them), the
integer forward against independent python-int references written from those pages, dequantized integer output
close to float, a re-read IR bit-identical, and clear errors for bad params."""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant
from range_helpers import range_of, set_range

import quantopt.ops.counting  # noqa: F401  (registers the family even when imported alone)
import quantopt.ops.moments  # noqa: F401
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_asymmetric"), (8, "per_tensor_symmetric_full_range"), (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_strategy_activation="extrema", **extra)


def one(optype: str, params: Dict[str, Any], in_shape: Sequence[int], out_shapes: List[List[int]],
        dtype: Dtype = Dtype.FP32):
    b = GraphBuilder("t")
    x = b.input("x", list(in_shape), dtype=dtype)
    y = b.layer(optype, [x], out_shapes, name="op", params=dict(params))
    return b.build(y if isinstance(y, list) else [y])


def data(shape: Sequence[int], seed: int, count: int = 4, std: float = 1.2, mean: float = 0.1) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(mean, std, size=list(shape)).astype(np.float32)) for _ in range(count)]


def rhe(v: Fraction) -> int:
    """round half to even of a rational."""
    f = v.numerator // v.denominator
    rem = v - f
    return f + (1 if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2) else 0)


# ================================================================================================ Count
def np_count(x: np.ndarray, bins: int, lo: float, hi: float, discrete: bool) -> np.ndarray:
    """numpy.histogram semantics: equal bins over [a, b], the last bin closed; half-open when not discrete."""
    a, b = min(lo, hi), max(lo, hi)
    out = []
    for row in x.reshape(x.shape[0], -1).astype(np.float64):
        if discrete:
            h, _ = np.histogram(row, bins=bins, range=(a, b))
        else:
            inside = row[(row >= a) & (row < b)]
            h, _ = np.histogram(inside, bins=bins, range=(a, b))
        out.append(h[::-1] if lo > hi else h)
    return np.array(out, dtype=np.float64)


def ref_count_int(q: np.ndarray, zp: int, bins: int, lo: int, hi: int, discrete: bool) -> np.ndarray:
    a, b = min(lo, hi), max(lo, hi)
    out = np.zeros((q.shape[0], bins), dtype=np.int64)
    for r, row in enumerate(q.reshape(q.shape[0], -1)):
        for v in row:
            x = int(v) + zp
            if x < a or x > b or (not discrete and x == b):
                continue
            out[r, min((x - a) * bins // (b - a), bins - 1)] += 1
    return out[:, ::-1] if lo > hi else out


COUNT_CASES = [(8, -2.0, 2.0, True), (5, 1.5, -1.0, True), (6, -1.0, 2.0, False), (3, 0.0, 1.0, True)]


@pytest.mark.parametrize("bins,lo,hi,discrete", COUNT_CASES)
def test_count_float_matches_numpy(bins: int, lo: float, hi: float, discrete: bool) -> None:
    g = one("Count", {"nbins": bins, "min": lo, "max": hi, "discrete": discrete}, [2, 5, 7], [[2, bins]])
    # values on a 1/16 grid, away from the float32 edge ambiguity of bin borders that are not on the grid
    x = torch.round(data([2, 5, 7], 1, 1)[0] * 16) / 16
    (y,) = g.forward([x])
    np.testing.assert_array_equal(y.numpy(), np_count(x.numpy(), bins, lo, hi, discrete))


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("bins,lo,hi,discrete", COUNT_CASES)
def test_count_integer_forward(bins: int, lo: float, hi: float, discrete: bool, bits: int, mode: str) -> None:
    g = one("Count", {"nbins": bins, "min": lo, "max": hi, "discrete": discrete}, [2, 5, 7], [[2, bins]])
    qg = quantize_model(g, data([2, 5, 7], 2), settings(bits, mode))
    node, inp, out = qg.nodes[-1], qg.input_tensors[0], qg.output_tensors[0]
    ip, op = params_of(node, inp), params_of(node, out)
    s = float(ip.scale)
    assert node.params["min"] == float(round(lo * s)) and node.params["max"] == float(round(hi * s))
    assert op.qinvariant and op.zerop == 0 and out.dtype == Dtype.UINT16
    x = data([2, 5, 7], 3, 1)[0]
    (y,) = qg.forward([x])
    expect = ref_count_int(inp.betensor.numpy(), int(ip.zerop), bins, int(node.params["min"]),
                           int(node.params["max"]), discrete)
    np.testing.assert_array_equal(y.numpy(), expect)
    # the counts agree with float's but for elements next to a bin border (the quantization step)
    diff = np.abs(y.numpy() - np_count(x.numpy(), bins, lo, hi, discrete)).sum()
    assert diff <= 0.15 * x.numel()


def test_count_force_int_and_wide_rows() -> None:
    g = one("Count", {"nbins": 4, "min": -1.0, "max": 1.0}, [1, 70000], [[1, 4]])
    qg = quantize_model(g, data([1, 70000], 4, 2), settings(8, "per_tensor_symmetric_full_range",
                                                            force_dtype_int=True))
    assert qg.output_tensors[0].dtype == Dtype.INT32


@pytest.mark.parametrize("params,error,match", [
    ({"nbins": 4, "min": 1.0, "max": 1.0}, IRError, "no width"),
    ({"nbins": 4, "min": 2.0, "max": 1.0, "discrete": False}, IRError, "min < max"),
    ({"nbins": 0, "min": 0.0, "max": 1.0}, IRError, "nbins"),
    ({"min": 0.0, "max": 1.0}, IRError, "nbins"),
])
def test_count_bad_params(params, error, match) -> None:
    g = one("Count", params, [1, 6], [[1, 4]])
    with pytest.raises(error, match=match):
        g.forward([torch.zeros(1, 6)])


def test_count_bounds_on_one_integer_are_refused() -> None:
    g = one("Count", {"nbins": 2, "min": 0.0, "max": 0.001}, [1, 8], [[1, 2]])
    with pytest.raises(UnsupportedError, match="same input integer"):
        quantize_model(g, data([1, 8], 5, 2), settings(8, "per_tensor_symmetric_full_range"))


# ================================================================================================ ZeroFraction
def sparse(shape: Sequence[int], seed: int, count: int = 3) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = r.normal(0, 1, size=list(shape))
        x = np.sign(x) * (np.abs(x) + 0.3) * (r.random(x.shape) < r.random())
        out.append(torch.from_numpy(x.astype(np.float32)))
    return out


@pytest.mark.parametrize("bits,mode,force", [(8, "per_tensor_asymmetric", False), (8, MODES[1][1], True),
                                             (16, MODES[2][1], False)])
def test_zerofraction(bits: int, mode: str, force: bool) -> None:
    shape = [3, 4, 5]
    g = one("ZeroFraction", {}, shape, [[3]])
    x = sparse(shape, 6, 1)[0]
    (y,) = g.forward([x])
    np.testing.assert_allclose(y.numpy(), (x.numpy() == 0).reshape(3, -1).mean(1), rtol=1e-6)
    qg = quantize_model(g, sparse(shape, 7), settings(bits, mode, force_dtype_int=force))
    node, inp, out = qg.nodes[-1], qg.input_tensors[0], qg.output_tensors[0]
    ip, op = params_of(node, inp), params_of(node, out)
    m = 2 ** bits - 1
    assert node.params["output_scale"] == m and op.scale == m
    assert op.zerop == (2 ** (bits - 1) if force else 0)
    (yq,) = qg.forward([x])
    n = 20
    zeros = ((inp.betensor.numpy().astype(np.int64) + int(ip.zerop)) == 0).reshape(3, -1).sum(1)
    expect = [min(max((int(z) * m + n // 2) // n - int(op.zerop), int(op.qmin)), int(op.qmax)) for z in zeros]
    assert yq.tolist() == expect
    deq = run_quantized(qg, [x])[0]
    np.testing.assert_allclose(deq.numpy(), y.numpy(), atol=0.5 / m + 1e-6)


# ================================================================================================ Moments
def moments_graph(axis: Any, keep: bool, shape: Sequence[int] = (2, 4, 5, 3), dtype: Dtype = Dtype.FP32):
    axes = [a % len(shape) for a in (axis if isinstance(axis, list) else [axis])]
    oshape = [1 if d in axes else s for d, s in enumerate(shape)] if keep else \
        [s for d, s in enumerate(shape) if d not in axes]
    return one("Moments", {"axis": axis, "keepdims": keep}, shape, [oshape, oshape], dtype=dtype)


def ref_moments_int(node, q: np.ndarray, axes: List[int]) -> np.ndarray:
    """Mean and variance integers per docs/semantics/moments.md, with python ints and Fractions."""
    out = params_of(node, node.outputs[1])
    m, n_sh = int(node.params["var_scale_value"]), int(node.params["var_shift_value"])
    rest = [d for d in range(q.ndim) if d not in axes]
    rows = np.transpose(q, rest + axes).reshape(-1, int(np.prod([q.shape[a] for a in axes])))
    means, vars_ = [], []
    for row in rows:
        xs = [int(v) for v in row]
        n = len(xs)
        mean = rhe(Fraction(sum(xs), n))
        t = sum((v - mean) ** 2 for v in xs)
        v = rhe(Fraction(t * m, n * 2 ** n_sh) if n_sh >= 0 else Fraction(t * m * 2 ** -n_sh, n))
        means.append(mean)
        vars_.append(min(max(v - int(out.zerop), int(out.qmin)), int(out.qmax)))
    return np.array(means), np.array(vars_)


MOMENT_AXES = [([1, 2], True), ([-1], False), ([0, 3], True)]


@pytest.mark.parametrize("axis,keep", MOMENT_AXES)
def test_moments_float(axis, keep) -> None:
    g = moments_graph(axis, keep)
    x = data([2, 4, 5, 3], 8, 1)[0]
    mean, var = g.forward([x])
    ax = tuple(a % 4 for a in axis)
    np.testing.assert_allclose(mean.numpy(), x.numpy().astype(np.float64).mean(ax, keepdims=keep), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(var.numpy(), x.numpy().astype(np.float64).var(ax, keepdims=keep), rtol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("axis,keep", MOMENT_AXES)
def test_moments_integer(axis, keep, bits: int, mode: str) -> None:
    g = moments_graph(axis, keep)
    x = data([2, 4, 5, 3], 9, 1, std=1.5, mean=0.4)[0]
    fmean, fvar = (t.clone() for t in g.forward([x]))
    qg = quantize_model(g, data([2, 4, 5, 3], 10, std=1.5, mean=0.4), settings(bits, mode))
    node, inp = qg.nodes[-1], qg.input_tensors[0]
    mean_t, var_t = qg.output_tensors
    mp, vp, ip = (params_of(node, t) for t in (mean_t, var_t, inp))
    assert (mp.scale, mp.zerop, mean_t.dtype) == (ip.scale, ip.zerop, inp.dtype)
    assert not vp.qinvariant and int(vp.qmin) == 0
    assert node.params["input_scale_value"] == 1 and node.params["input_shift_value"] == 0
    qmean, qvar = qg.forward([x])
    axes = sorted(a % 4 for a in axis)
    emean, evar = ref_moments_int(node, inp.betensor.numpy(), axes)
    np.testing.assert_array_equal(qmean.numpy().reshape(-1), emean)
    np.testing.assert_array_equal(qvar.numpy().reshape(-1), evar)
    dmean, dvar = run_quantized(qg, [x])
    assert list(dmean.shape) == list(fmean.shape) and list(dvar.shape) == list(fvar.shape)
    np.testing.assert_allclose(dmean.numpy(), fmean.numpy(), atol=2.0 / float(ip.scale))
    rel = 0.05 if bits == 8 else 0.002
    np.testing.assert_allclose(dvar.numpy(), fvar.numpy(), atol=rel * float(fvar.max()) + 1.0 / float(vp.scale))


def test_moments_integer_input() -> None:
    g = moments_graph([1, 2], True, dtype=Dtype.INT8)
    r = np.random.default_rng(11)
    xs = [torch.from_numpy(r.integers(-50, 50, size=(2, 4, 5, 3))) for _ in range(2)]
    qg = quantize_model(g, xs, settings(8, "per_tensor_symmetric_full_range"))
    var_t = qg.output_tensors[1]
    assert params_of(qg.nodes[-1], var_t).qinvariant and var_t.dtype == Dtype.UINT16
    assert qg.nodes[-1].params["var_scale_value"] == 1
    mean, var = qg.forward([xs[0]])
    emean, evar = ref_moments_int(qg.nodes[-1], xs[0].numpy(), [1, 2])
    np.testing.assert_array_equal(mean.numpy().reshape(-1), emean)
    np.testing.assert_array_equal(var.numpy().reshape(-1), evar)


def test_moments_ir_round_trip(tmp_path) -> None:
    qg = quantize_model(moments_graph([1, 2], False), data([2, 4, 5, 3], 12), settings(*MODES[0]))
    x = data([2, 4, 5, 3], 13, 1)
    before = [t.clone() for t in qg.forward(x)]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("params,match", [({"axis": [1, 1]}, "twice"), ({"axis": [7]}, "out of range"),
                                          ({"axis": []}, "at least one")])
def test_moments_bad_axis(params, match) -> None:
    g = one("Moments", params, [1, 4, 5, 3], [[1, 1, 5, 3], [1, 1, 5, 3]])
    with pytest.raises(IRError, match=match):
        g.forward([torch.zeros(1, 4, 5, 3)])


# ================================================================================================ SufficientStatistics
def ss_graph(x_shape: Sequence[int], s_shape: Sequence[int], axis: List[int], dtype: Dtype = Dtype.FP32):
    out = [1 if d in [a % len(x_shape) for a in axis] else s for d, s in enumerate(x_shape)]
    b = GraphBuilder("t")
    x, s = b.input("x", list(x_shape), dtype=dtype), b.input("shift", list(s_shape), dtype=dtype)
    outs = b.layer("SufficientStatistics", [x, s], [out, out], name="op", params={"axis": axis})
    return b.build(outs)


def ref_ss_int(node, xq: np.ndarray, sq: np.ndarray, axes: List[int]):
    """docs/semantics/moments.md, SufficientStatistics, with python ints."""
    x_t, s_t = (params_of(node, t) for t in node.inputs)
    o0, o1 = (params_of(node, t) for t in node.outputs)
    mo0, mo1, mi0, mi1 = node.params["scale_value"]
    no0, no1, ni0, ni1 = node.params["shift_value"]

    def align(v: int, m: int, n: int) -> int:
        return min(max(rhe(Fraction(v * m, 2 ** n)), -2 ** 31), 2 ** 31 - 1)

    xa = np.vectorize(lambda v: align(int(v) + int(x_t.zerop), mi0, ni0), otypes=[object])(xq)
    sa = np.vectorize(lambda v: align(int(v) + int(s_t.zerop), mi1, ni1), otypes=[object])(sq)
    m = xa - sa
    total = m.sum(axis=tuple(axes), keepdims=True)
    sq_sum = (m * m).sum(axis=tuple(axes), keepdims=True)

    def first(a: int) -> int:
        a = min(max(int(a), -2 ** 31), 2 ** 31 - 1) * mo0
        t = abs(a) // 2 ** no0 * (1 if a >= 0 else -1)
        return min(max(t - int(o0.zerop), int(o0.qmin)), int(o0.qmax))

    def second(v: int) -> int:
        return min(max(int(v) * mo1 // 2 ** no1 - int(o1.zerop), int(o1.qmin)), int(o1.qmax))

    return np.vectorize(first)(total).astype(np.int64), np.vectorize(second)(sq_sum).astype(np.int64)


SS_CASES = [([2, 4, 5, 3], [1, 1, 1, 3], [1, 2]), ([2, 6, 4], [2, 1, 4], [1]), ([3, 8], [1], [0, 1])]


@pytest.mark.parametrize("x_shape,s_shape,axis", SS_CASES)
def test_sufficient_statistics_float(x_shape, s_shape, axis) -> None:
    g = ss_graph(x_shape, s_shape, axis)
    x, s = data(x_shape, 20, 1)[0], data(s_shape, 21, 1)[0]
    a, b = g.forward([x, s])
    m = x.numpy().astype(np.float64) - s.numpy()
    np.testing.assert_allclose(a.numpy(), m.sum(tuple(axis), keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.numpy(), (m * m).sum(tuple(axis), keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("x_shape,s_shape,axis", SS_CASES)
def test_sufficient_statistics_integer(x_shape, s_shape, axis, bits: int, mode: str) -> None:
    g = ss_graph(x_shape, s_shape, axis)
    batches = list(zip(data(x_shape, 22), data(s_shape, 23, std=0.5)))
    x, s = data(x_shape, 24, 1)[0], data(s_shape, 25, 1, std=0.5)[0]
    fa, fb = (t.clone() for t in g.forward([x, s]))
    qg = quantize_model(g, batches, settings(bits, mode))
    node = qg.nodes[-1]
    assert len(node.params["scale_value"]) == 4 and len(node.params["shift_type"]) == 4
    o0, o1 = (params_of(node, t) for t in qg.output_tensors)
    assert int(o0.qmin) < 0 and int(o1.qmin) == 0
    qa, qb = qg.forward([x, s])
    ea, eb = ref_ss_int(node, qg.input_tensors[0].betensor.numpy(), qg.input_tensors[1].betensor.numpy(), axis)
    np.testing.assert_array_equal(qa.numpy(), ea)
    np.testing.assert_array_equal(qb.numpy(), eb)
    da, db = run_quantized(qg, [x, s])
    span_a = float(fa.abs().max())
    np.testing.assert_allclose(da.numpy(), fa.numpy(), atol=(0.06 if bits == 8 else 0.01) * span_a + 0.05)
    np.testing.assert_allclose(db.numpy(), fb.numpy(), atol=(0.04 if bits == 8 else 0.002) * float(fb.max()))


def test_sufficient_statistics_integer_inputs() -> None:
    g = ss_graph([2, 6], [1], [1], dtype=Dtype.INT8)
    r = np.random.default_rng(26)
    x, s = torch.from_numpy(r.integers(-100, 100, size=(2, 6))), torch.tensor([7])
    qg = quantize_model(g, [(x, s)], settings(8, "per_tensor_symmetric_full_range"))
    assert all(q.qinvariant and q.qbits == 32 for q in (params_of(qg.nodes[-1], t) for t in qg.output_tensors))
    a, b = qg.forward([x, s])
    m = x.numpy() - 7
    np.testing.assert_array_equal(a.numpy(), m.sum(1, keepdims=True))
    np.testing.assert_array_equal(b.numpy(), (m * m).sum(1, keepdims=True))


def test_sufficient_statistics_bad_shift_shape() -> None:
    g = ss_graph([2, 6], [4], [1])
    with pytest.raises(IRError, match="broadcast"):
        g.forward([torch.zeros(2, 6), torch.zeros(4)])


@pytest.mark.parametrize("which", ["Count", "ZeroFraction", "SufficientStatistics"])
def test_written_ir_reloads_bit_identical(tmp_path, which: str) -> None:
    if which == "Count":
        g, batches = one("Count", {"nbins": 5, "min": -1.5, "max": 2.0}, [2, 5, 7], [[2, 5]]), data([2, 5, 7], 40)
    elif which == "ZeroFraction":
        g, batches = one("ZeroFraction", {}, [3, 4, 5], [[3]]), sparse([3, 4, 5], 41)
    else:
        g = ss_graph([2, 4, 5, 3], [1, 1, 1, 3], [1, 2])
        batches = list(zip(data([2, 4, 5, 3], 42), data([1, 1, 1, 3], 43)))
    qg = quantize_model(g, batches, settings(*MODES[0]))
    feed = list(batches[0]) if isinstance(batches[0], tuple) else [batches[0]]
    before = [t.clone() for t in qg.forward(feed)]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward(feed)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ================================================================================================ NormalizedMoments
def nm_graph(shapes: Sequence[Sequence[int]] = ((2, 4, 3), (2, 4, 3), (1, 4, 3)), counts: float = 24.0):
    b = GraphBuilder("t")
    ins = [b.input(n, list(s)) for n, s in zip(("mean_ss", "variance_ss", "shift"), shapes)]
    out = list(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    outs = b.layer("NormalizedMoments", ins, [out, out], name="op", params={"counts": counts})
    return b.build(outs)


def nm_data(seed: int, count: int = 4, n: int = 24, shift_shape: Sequence[int] = (1, 4, 3)) -> List[tuple]:
    """sufficient statistics of n values per position around a shift (so the variance is positive)."""
    r = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        shift = r.normal(0.4, 0.5, size=list(shift_shape))
        d = r.normal(0.6, 1.2, size=[n, 2, 4, 3]) - shift
        out.append(tuple(torch.from_numpy(v.astype(np.float32)) for v in (d.sum(0), (d * d).sum(0), shift)))
    return out


def ref_nm_lut(node) -> np.ndarray:
    """The table per docs/semantics/moments.md in numpy float32."""
    m_t, plh = params_of(node, node.inputs[0]), params_of(node, node.placeholders[0])
    c = int(node.params["counts"])
    steps = 2 ** min(int(m_t.qbits), 8)
    p = np.linspace(float(m_t.qmin), float(m_t.qmax), steps).astype(np.float32)
    v = (p + np.float32(m_t.zerop)) * (np.float32(1.0) / np.float32(m_t.scale))
    y = np.square(v / np.float32(c)) * np.float32(plh.scale)
    return np.clip(np.round(y), int(plh.qmin), int(plh.qmax)).astype(np.int64)


def ref_nm_int(node, qm: np.ndarray, qv: np.ndarray, qs: np.ndarray):
    """The integer forward of docs/semantics/moments.md with python ints and Fractions."""
    m_t, v_t, s_t = (params_of(node, t) for t in node.inputs)
    o0, o1 = (params_of(node, t) for t in node.outputs)
    lut = [int(v) for v in node.constants["lut"].betensor.flatten()]
    mm, p0, p1 = node.params["mean_scale_value"]
    mv, v0, v1 = node.params["var_scale_value"]
    nm, nv = int(node.params["mean_shift_value"]), int(node.params["var_shift_value"])
    bits = int(m_t.qbits)
    lo = -2 ** (bits - 1) if int(m_t.qmin) < 0 else 0
    sub = bits - int(np.log2(len(lut)))

    def req(acc: int, m: int, n: int, o) -> int:
        return min(max(rhe(Fraction(acc * m, 2 ** n)) - int(o.zerop), int(o.qmin)), int(o.qmax))

    def square(q: int) -> int:
        i = q - lo
        hi, low = i >> sub, i - ((i >> sub) << sub)
        nxt = lut[min(hi + 1, len(lut) - 1)]
        return lut[hi] + (((nxt - lut[hi]) * low) >> sub)

    qm, qv, qs = np.broadcast_arrays(qm, qv, qs)
    a = [req((int(m) + int(m_t.zerop)) * p0 + (int(s) + int(s_t.zerop)) * p1, mm, nm, o0)
         for m, s in zip(qm.flat, qs.flat)]
    b = [req((int(v) + int(v_t.zerop)) * v0 - square(int(m)) * v1, mv, nv, o1) for m, v in zip(qm.flat, qv.flat)]
    return np.array(a).reshape(qm.shape), np.array(b).reshape(qm.shape)


def test_normalized_moments_float_and_placeholder() -> None:
    g = nm_graph(counts=24.9)  # truncated to 24, as upstream
    m, v, s = nm_data(60, 1)[0]
    a, b = (t.clone() for t in g.forward([m, v, s]))
    mean = m.numpy().astype(np.float64) / 24
    np.testing.assert_allclose(a.numpy(), mean + s.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), v.numpy() / 24 - mean * mean, rtol=1e-4, atol=1e-5)
    node = g.nodes[-1]
    assert [t.name for t in node.placeholders] == ["op/mean_square"]
    np.testing.assert_allclose(node.placeholders[0].betensor.numpy(), mean * mean, rtol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("shift_shape", [(1, 4, 3), (2, 4, 3)])
def test_normalized_moments_integer(bits: int, mode: str, shift_shape) -> None:
    g = nm_graph(((2, 4, 3), (2, 4, 3), shift_shape))
    batches = nm_data(61, shift_shape=shift_shape)
    feed = list(batches[1])  # inside the calibrated ranges: no input clipping
    fa, fb = (t.clone() for t in g.forward(feed))
    qg = quantize_model(g, batches, settings(bits, mode))
    node = qg.nodes[-1]
    plh = params_of(node, node.placeholders[0])
    assert int(plh.qmin) == 0 and int(plh.zerop) == 0 and int(plh.qbits) == bits
    assert node.params["mean_scale_type"] == [Dtype.UINT16] * 3 and node.params["var_scale_type"] == [Dtype.UINT16] * 3
    assert node.constants["lut"].dtype == (Dtype.UINT8 if bits == 8 else Dtype.UINT16)
    np.testing.assert_array_equal(node.constants["lut"].betensor.numpy(), ref_nm_lut(node))
    clip = 16383 if any(int(params_of(node, t).zerop) for t in (node.inputs[0], node.inputs[2])) else 32767
    assert max(node.params["mean_scale_value"][1:]) <= clip
    o0, o1 = (params_of(node, t) for t in qg.output_tensors)
    assert int(o1.qmin) < 0
    qa, qb = qg.forward(feed)
    ea, eb = ref_nm_int(node, *(t.betensor.numpy() for t in qg.input_tensors))
    np.testing.assert_array_equal(qa.numpy(), ea)
    np.testing.assert_array_equal(qb.numpy(), eb)
    da, db = run_quantized(qg, feed)
    m_t, v_t, s_t = node.inputs
    mp, vp, sp = (params_of(node, t) for t in node.inputs)
    # half a step of each input term and of the output, plus 1% for the multipliers' and the table's rounding
    tol0 = 0.5 / float(mp.scale) / 24 + 0.5 / float(sp.scale) + 0.5 / float(o0.scale) + 0.01 * float(fa.abs().max())
    tol1 = 0.5 / float(vp.scale) / 24 + 1.0 / float(plh.scale) + 0.5 / float(o1.scale) + 0.01 * float(fb.abs().max())
    if bits > 8:  # the table's samples drift by up to 2^bits / 256 codes from the codes that read them (documented)
        r = range_of(node, m_t)
        tol1 += 2 * float(r.max - r.min) / 24 * 2 ** bits / 256 / float(mp.scale) / 24
    np.testing.assert_allclose(da.numpy(), fa.numpy(), atol=tol0)
    np.testing.assert_allclose(db.numpy(), fb.numpy(), atol=tol1)


def test_normalized_moments_ir_round_trip(tmp_path) -> None:
    g = nm_graph()
    batches = nm_data(63)
    qg = quantize_model(g, batches, settings(*MODES[0]))
    feed = list(batches[0])
    before = [t.clone() for t in qg.forward(feed)]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward(feed)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("counts,match", [(0.5, "counts must be at least 1"), (-3.0, "counts must be at least 1")])
def test_normalized_moments_bad_counts(counts: float, match: str) -> None:
    g = nm_graph(counts=counts)
    with pytest.raises(IRError, match=match):
        g.forward(list(nm_data(64, 1)[0]))


def test_normalized_moments_bad_shapes() -> None:
    g = nm_graph(((2, 4, 3), (2, 4, 3), (1, 4, 3)))
    with pytest.raises(IRError, match="do not broadcast"):
        g.forward([torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), torch.zeros(5)])


def test_normalized_moments_needs_placeholder_range() -> None:
    g = nm_graph()
    node = g.nodes[-1]
    node.placeholders = []  # as from a float forward that never ran
    from quantopt.ops.moments import normalized_moments_quantize
    for t in list(node.inputs) + list(node.outputs):
        set_range(node, t, -1.0, 1.0)
        set_quant(node, t, scale=100.0, zerop=0, qbits=8, qmin=-128, qmax=127)
    with pytest.raises(IRError, match="placeholder 'op/mean_square' is missing"):
        normalized_moments_quantize(node)
