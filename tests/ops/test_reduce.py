"""Reduce (every method) and Cumulate (SUM/PROD, exclusive, reverse): float forward against numpy, integer forward
against an independent python-int reference written from docs/semantics/reduce.md, float-vs-dequantized cosine,
IR write → re-read bit identity, and clear errors."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
from quant_helpers import params_of

import quantopt.ops.reduce  # noqa: F401  (registers the family even when imported alone)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

SHAPE = [1, 4, 5, 6]
MODES = [
    (8, "per_tensor_asymmetric"),
    (8, "per_tensor_symmetric_full_range"),
    (8, "per_tensor_symmetric_restricted_range"),
    (16, "per_tensor_symmetric_full_range"),
    (16, "per_tensor_asymmetric"),
]
METHODS = ["SUM", "MEAN", "MAX", "MIN", "PROD", "L1", "L2", "VARIANCE", "UNBIASED_VARIANCE", "ANY", "ALL"]


def out_shape(axes: Sequence[int], keepdims: bool) -> List[int]:
    axes = [a % 4 for a in axes]
    return [1 if d in axes else s for d, s in enumerate(SHAPE)] if keepdims else \
        [s for d, s in enumerate(SHAPE) if d not in axes]


def data(method: str, shape: Sequence[int], seed: int, scale: float = 1.0) -> torch.Tensor:
    r = np.random.default_rng(seed)
    if method == "PROD":
        x = r.normal(0.6, 0.6, size=list(shape))
    elif method in ("ANY", "ALL"):
        x = np.round(r.normal(0.5, 1.0, size=list(shape)))
    else:
        x = r.normal(0.3, 2.0, size=list(shape))
    return torch.from_numpy((x * scale).astype(np.float32))


def one(optype: str, params: Dict[str, Any], oshape: Sequence[int], in_dtype: Dtype = Dtype.FP32,
        out_dtype: Dtype = Dtype.FP32):
    b = GraphBuilder("t")
    x = b.input("x", SHAPE, dtype=in_dtype)
    y = b.layer(optype, [x], [list(oshape)], name="op", params=dict(params), output_dtypes=[out_dtype])
    return b.build([y])


def settings(bits: int, mode: str) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_strategy_activation="extrema")


# --- cases ----------------------------------------------------------------------------------------------------------
AXES = [([2, 3], True), ([-1], False), ([1], True)]
REDUCE_CASES = [(m, axes, keep) for m in METHODS for axes, keep in AXES
                if not (m == "PROD" and axes == [2, 3])]  # a product of 30 factors is not representative at 8 bits
CUMULATE_CASES = [(m, axis, exc, rev) for m in ("SUM", "PROD") for axis in (1, -1) for exc in (False, True)
                  for rev in (False, True)]


def reduce_graph(method: str, axes: List[int], keep: bool):
    params: Dict[str, Any] = {"method": method, "axis": axes}
    if not keep:
        params["keepdims"] = False
    return one("Reduce", params, out_shape(axes, keep))


def cumulate_graph(method: str, axis: int, exclusive: bool, reverse: bool):
    return one("Cumulate", {"method": method, "axis": axis, "exclusive": exclusive, "reverse": reverse}, SHAPE)


def _rid(case) -> str:
    return "-".join(str(v) for v in case)


# --- numpy float references -----------------------------------------------------------------------------------------
def np_reduce(method: str, x: np.ndarray, axes: List[int], keep: bool) -> np.ndarray:
    ax = tuple(a % x.ndim for a in axes)
    x = x.astype(np.float64)
    fns = {"SUM": lambda: np.sum(x, ax, keepdims=keep), "MEAN": lambda: np.mean(x, ax, keepdims=keep),
           "MAX": lambda: np.max(x, ax, keepdims=keep), "MIN": lambda: np.min(x, ax, keepdims=keep),
           "PROD": lambda: np.prod(x, ax, keepdims=keep), "L1": lambda: np.sum(np.abs(x), ax, keepdims=keep),
           "L2": lambda: np.sqrt(np.sum(x * x, ax, keepdims=keep)),
           "VARIANCE": lambda: np.var(x, ax, keepdims=keep), "UNBIASED_VARIANCE": lambda: np.var(x, ax, ddof=1,
                                                                                                keepdims=keep),
           "ANY": lambda: np.any(x != 0, ax, keepdims=keep).astype(np.int64),
           "ALL": lambda: np.all(x != 0, ax, keepdims=keep).astype(np.int64)}
    return fns[method]()


def np_cumulate(method: str, x: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    v = np.moveaxis(x.astype(np.float64), axis, -1)
    if reverse:
        v = v[..., ::-1]
    y = np.cumsum(v, -1) if method == "SUM" else np.cumprod(v, -1)
    if exclusive:
        first = np.zeros_like(y[..., :1]) if method == "SUM" else np.ones_like(y[..., :1])
        y = np.concatenate([first, y[..., :-1]], -1)
    if reverse:
        y = y[..., ::-1]
    return np.moveaxis(y, -1, axis)


# --- python-int references from docs/semantics/reduce.md ----------------------------------------------------------
def rs(v: int, n: int) -> int:
    if n <= 0:
        return v << -n
    if n >= 63:
        return 0
    q, r = divmod(v, 1 << n)
    half = 1 << (n - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def prod_step(acc: int, s: int, factor: int) -> Tuple[int, int]:
    acc *= factor
    k = max(0, abs(acc).bit_length() - 31)
    return acc >> k, s + k


def ref_reduce(node, x_q: np.ndarray, axes: List[int], keep: bool) -> np.ndarray:
    method = node.params["method"]
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    zp_in, zp_out, qmin, qmax = int(inp.zerop), int(out.zerop), int(out.qmin), int(out.qmax)
    ax = [a % x_q.ndim for a in axes]
    rest = [d for d in range(x_q.ndim) if d not in ax]
    rows = np.transpose(x_q, rest + ax).reshape(-1, int(np.prod([x_q.shape[a] for a in ax])))
    m, n_sh = int(node.params.get("scale_value", 1)), int(node.params.get("shift_value", 0))
    if method == "L2" and "sqrt_lut" in node.constants:
        y = ref_l2_upstream(node, rows, x_q.shape[0] if 0 not in ax else 1, zp_in, m, n_sh)
        kept = [1 if d in ax else x_q.shape[d] for d in range(x_q.ndim)]
        y = y.reshape(kept)
        return y if keep else y.reshape([s for d, s in enumerate(kept) if d not in ax])
    res = []
    for row in rows:
        q = [int(v) for v in row]
        xs = [v + zp_in for v in q]
        n = len(xs)
        if method == "MAX":
            res.append(max(q))
            continue
        if method == "MIN":
            res.append(min(q))
            continue
        if method in ("ANY", "ALL"):
            res.append(int((any if method == "ANY" else all)(v != 0 for v in xs)))
            continue
        if method in ("SUM", "MEAN"):
            acc, sh = sum(xs), n_sh
        elif method == "L1":
            acc, sh = sum(abs(v) for v in xs), n_sh
        elif method == "PROD":
            acc, s = 1, 0
            for v in xs:
                acc, s = prod_step(acc, s, v)
            sh = n_sh - s
        elif method == "L2":
            f = int(node.params["sqrt_fraction_bits"])
            acc, sh = math.isqrt(sum(v * v for v in xs) * 4 ** f), n_sh + f
        else:
            total = sum(xs)
            qd, rem = divmod(total, n)
            mean = qd + (1 if 2 * rem > n or (2 * rem == n and qd % 2 == 1) else 0)
            acc, sh = sum((v - mean) ** 2 for v in xs), n_sh
        res.append(clamp(rs(acc * m, sh) - zp_out, qmin, qmax))
    kept = [1 if d in ax else x_q.shape[d] for d in range(x_q.ndim)]
    y = np.array(res, dtype=np.int64).reshape(kept)
    return y if keep else y.reshape([s for d, s in enumerate(kept) if d not in ax])


def ref_l2_upstream(node, rows: np.ndarray, batch: int, zp_in: int, m: int, n_sh: int) -> np.ndarray:
    """docs/semantics/reduce.md, L2 upstream form, in python ints: per sample d = max(0, ceil(log2(max S)) - 16),
    the uint16 placeholder rs(min(S >> d, 65535) · M, N - d) and the interpolated table lookup."""
    lut = [int(v) for v in node.constants["sqrt_lut"].betensor.flatten()]
    step = 16 - int(math.log2(len(lut)))
    padded = lut + lut[-1:]
    totals = [min(sum((int(v) + zp_in) ** 2 for v in row), 2 ** 32 - 1) for row in rows]
    per = len(totals) // batch
    out = []
    for b in range(batch):
        group = totals[b * per:(b + 1) * per]
        peak = max(group)
        drop = max(0, ((peak - 1).bit_length() if peak >= 1 else 0) - 16)
        for t in group:
            ph = clamp(rs(min(t >> drop, 65535) * m, n_sh - drop), 0, 65535)
            hi, lo = ph >> step, ph & ((1 << step) - 1)
            out.append(padded[hi] + (((padded[hi + 1] - padded[hi]) * lo) >> step))
    return np.array(out, dtype=np.int64)


def ref_cumulate(node, x_q: np.ndarray) -> np.ndarray:
    p = node.params
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    zp_in, zp_out, qmin, qmax = int(inp.zerop), int(out.zerop), int(out.qmin), int(out.qmax)
    axis = int(p["axis"]) % x_q.ndim
    v = np.moveaxis(x_q.astype(np.int64), axis, -1)
    if p["reverse"]:
        v = v[..., ::-1]
    y = np.empty(v.shape, dtype=np.int64)
    for idx in np.ndindex(v.shape[:-1]):
        xs = [int(t) + zp_in for t in v[idx]]
        if p["method"] == "SUM":
            m, sh = int(p["scale_value"]), int(p["shift_value"])
            acc = 0
            for j, xv in enumerate(xs):
                if not p["exclusive"]:
                    acc += xv
                y[idx + (j,)] = clamp(rs(acc * m, sh) - zp_out, qmin, qmax)
                if p["exclusive"]:
                    acc += xv
        else:
            mult = [int(t) for t in node.constants["scale"].betensor.tolist()]
            shift = [int(t) for t in node.constants["shift"].betensor.tolist()]
            acc, s = 1, 0
            for j, xv in enumerate(xs):
                if not p["exclusive"]:
                    acc, s = prod_step(acc, s, xv)
                y[idx + (j,)] = clamp(rs(acc * mult[j], shift[j] - s) - zp_out, qmin, qmax)
                if p["exclusive"]:
                    acc, s = prod_step(acc, s, xv)
    if p["reverse"]:
        y = y[..., ::-1]
    return np.moveaxis(y, -1, axis)


# --- 1. float forward == numpy --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", REDUCE_CASES, ids=_rid)
def test_reduce_float_matches_numpy(case) -> None:
    method, axes, keep = case
    x = data(method, [2, 4, 5, 6], 1)
    got = reduce_graph(method, axes, keep).forward([x])[0]
    want = np_reduce(method, x.numpy(), axes, keep)
    assert list(got.shape) == list(want.shape)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", CUMULATE_CASES, ids=_rid)
def test_cumulate_float_matches_numpy(case) -> None:
    method, axis, exclusive, reverse = case
    x = data(method, [2, 4, 5, 6], 2)
    got = cumulate_graph(*case).forward([x])[0]
    np.testing.assert_allclose(got.numpy().astype(np.float64), np_cumulate(method, x.numpy(), axis, exclusive,
                                                                           reverse), rtol=2e-5, atol=2e-5)


# --- 2. integer forward == reference --------------------------------------------------------------------------------
def _check(qg, x: torch.Tensor, reference) -> np.ndarray:
    qg.forward([x], keep_tensors=True)
    node = qg.node("op")
    got = node.outputs[0].betensor
    out = params_of(node, node.outputs[0])
    assert got.dtype == torch.int64 and int(got.min()) >= out.qmin and int(got.max()) <= out.qmax
    np.testing.assert_array_equal(got.numpy(), reference(node, node.inputs[0].betensor.numpy()))
    return got.numpy()


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", REDUCE_CASES, ids=_rid)
def test_reduce_integer_matches_reference(case, bits: int, mode: str) -> None:
    method, axes, keep = case
    g = reduce_graph(method, axes, keep)
    qg = quantize_model(g, [data(method, [2, 4, 5, 6], 10 + i) for i in range(2)], settings(bits, mode))
    node = qg.node("op")
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    if method in ("MAX", "MIN"):
        assert (out.scale, out.zerop) == (inp.scale, inp.zerop)
    if method in ("ANY", "ALL"):
        assert out.qinvariant and node.outputs[0].dtype == Dtype.UINT8
    if method in ("L1", "L2", "VARIANCE", "UNBIASED_VARIANCE"):
        assert out.qmin == 0
    # batch 3 (IR batch 1), wider than calibration: saturation and clamping
    _check(qg, data(method, [3, 4, 5, 6], 20, scale=1.3), lambda n, xq: ref_reduce(n, xq, axes, keep))


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("axes,keep", AXES)
def test_l2_exact_form_matches_reference(axes: List[int], keep: bool, bits: int, mode: str) -> None:
    """`reduce_l2_integer_form = exact`: the exact integer square root with sqrt_fraction_bits, no table."""
    g = reduce_graph("L2", axes, keep)
    qg = quantize_model(g, [data("L2", [2, 4, 5, 6], 10 + i) for i in range(2)],
                        {**settings(bits, mode), "reduce_l2_integer_form": "exact"})
    node = qg.node("op")
    assert "sqrt_fraction_bits" in node.params and "sqrt_lut" not in node.constants
    _check(qg, data("L2", [3, 4, 5, 6], 20, scale=1.3), lambda n, xq: ref_reduce(n, xq, axes, keep))


def test_l2_upstream_form_is_per_sample() -> None:
    """The upstream form's 16-bit cut is taken per sample: a sample's output does not depend on the others in the
    batch (upstream takes it over the whole batch; at batch 1 both agree)."""
    g = reduce_graph("L2", [2, 3], True)
    qg = quantize_model(g, [data("L2", [2, 4, 5, 6], 10 + i) for i in range(2)], settings(8, MODES[0][1]))
    assert "sqrt_lut" in qg.node("op").constants and "sqrt_fraction_bits" not in qg.node("op").params
    small, large = data("L2", [1, 4, 5, 6], 3, scale=0.2), data("L2", [1, 4, 5, 6], 4, scale=3.0)
    alone = qg.forward([small])[0].clone()
    together = qg.forward([torch.cat([small, large])])[0]
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", CUMULATE_CASES, ids=_rid)
def test_cumulate_integer_matches_reference(case, bits: int, mode: str) -> None:
    qg = quantize_model(cumulate_graph(*case), [data(case[0], [2, 4, 5, 6], 30 + i) for i in range(2)],
                        settings(bits, mode))
    node = qg.node("op")
    if case[0] == "PROD":
        assert node.constants["scale"].dtype == Dtype.UINT16 and node.constants["shift"].dtype == Dtype.INT32
        assert node.constants["scale"].betensor.numel() == SHAPE[case[1]]
    _check(qg, data(case[0], [3, 4, 5, 6], 40, scale=1.2), ref_cumulate)


def test_prod_normalization_and_large_shifts() -> None:
    """Products that overflow 31 bits (16-bit inputs) and a shift far beyond 31 are handled as documented."""
    g = reduce_graph("PROD", [2, 3], True)
    x = data("PROD", [2, 4, 5, 6], 50) * 3
    qg = quantize_model(g, [x], settings(16, "per_tensor_symmetric_full_range"))
    assert int(qg.node("op").params["shift_value"]) > 62
    got = _check(qg, x, lambda n, xq: ref_reduce(n, xq, [2, 3], True))
    assert (got != 0).any()


@pytest.mark.parametrize("method", ["SUM", "PROD", "L1", "MAX", "ANY"])
def test_reduce_integer_input_is_exact(method: str) -> None:
    x = torch.from_numpy(np.random.default_rng(60).integers(-3, 4, size=[2, 4, 5, 6]))
    g = one("Reduce", {"method": method, "axis": [3]}, [1, 4, 5, 1], in_dtype=Dtype.INT8, out_dtype=Dtype.INT32)
    qg = quantize_model(g, [x], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    assert params_of(node, node.outputs[0]).qinvariant
    np.testing.assert_array_equal(qg.forward([x])[0].numpy(), g.forward([x])[0].numpy().astype(np.int64))


# --- 3. float vs dequantized --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("case", REDUCE_CASES, ids=_rid)
def test_reduce_cosine(case, bits: int, threshold: float) -> None:
    """At 16 bits L2 takes the exact form: upstream's stores the sum of squares in 32 bits, which 16-bit codes
    overflow (test_l2_upstream_form_saturates_at_32_bits)."""
    method, axes, keep = case
    g = reduce_graph(method, axes, keep)
    calib = [data(method, [2, 4, 5, 6], 70 + i) for i in range(2)]
    extra = {"reduce_l2_integer_form": "exact"} if bits == 16 else {}
    qg = quantize_model(g, calib, {**settings(bits, "per_tensor_asymmetric"), **extra})
    ref = g.forward([calib[0]])[0].clone().to(torch.float32)
    assert cosine(ref, run_quantized(qg, calib[0])[0]) > threshold


def test_l2_upstream_form_saturates_at_32_bits() -> None:
    """Upstream's L2 form keeps the sum of squares in 32 bits before its 16-bit cut: with 16-bit codes a sum of 20
    squares passes 2^32 and the largest norms saturate there, as on upstream's backend; the exact form does not."""
    g = reduce_graph("L2", [2, 3], True)
    calib = [data("L2", [2, 4, 5, 6], 70 + i) for i in range(2)]
    ref = g.forward([calib[0]])[0].clone().to(torch.float32)
    results = {}
    for form in ("upstream", "exact"):
        qg = quantize_model(g, calib, {**settings(16, "per_tensor_asymmetric"), "reduce_l2_integer_form": form})
        results[form] = run_quantized(qg, calib[0])[0]
    x_scale = params_of(qg.node("op"), qg.node("op").inputs[0]).scale
    limit = math.sqrt(2 ** 32 - 1) / x_scale  # the largest norm a uint32 sum of squares holds
    top = ref.flatten().argmax()
    assert float(ref.flatten()[top]) > limit
    assert float(results["upstream"].flatten()[top]) < limit + 0.05 < float(ref.flatten()[top]) - 0.5
    assert abs(float(results["exact"].flatten()[top]) - float(ref.flatten()[top])) < 0.01


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("case", CUMULATE_CASES, ids=_rid)
def test_cumulate_cosine(case, bits: int, threshold: float) -> None:
    g = cumulate_graph(*case)
    calib = [data(case[0], [2, 4, 5, 6], 80 + i) for i in range(2)]
    qg = quantize_model(g, calib, settings(bits, "per_tensor_asymmetric"))
    ref = g.forward([calib[0]])[0].clone()
    assert cosine(ref, run_quantized(qg, calib[0])[0]) > threshold


# --- 4. IR round trip ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode", [MODES[0], MODES[3]])
def test_written_ir_reloads_bit_identical(tmp_path, bits: int, mode: str) -> None:
    graphs = [(f"r{i}", reduce_graph(*c), c[0]) for i, c in enumerate(REDUCE_CASES)]
    graphs += [(f"c{i}", cumulate_graph(*c), c[0]) for i, c in enumerate(CUMULATE_CASES)]
    for name, g, method in graphs:
        x = data(method, [2, 4, 5, 6], 90)
        qg = quantize_model(g, [x], settings(bits, mode))
        before = qg.forward([x])[0].clone()
        re = read_ir(write_ir(qg, str(tmp_path / f"{name}.txt"))[0])
        assert all(n.quantized for n in re.nodes)
        assert torch.equal(before, re.forward([x])[0]), name


# --- 5. errors ------------------------------------------------------------------------------------------------------
def test_bad_params_are_ir_errors() -> None:
    x = data("SUM", [1, 4, 5, 6], 100)
    with pytest.raises(IRError, match="unsupported Reduce method 'MEDIAN'"):
        one("Reduce", {"method": "MEDIAN", "axis": [1]}, [1, 1, 5, 6]).forward([x])
    with pytest.raises(IRError, match="axis 4 is out of range"):
        one("Reduce", {"method": "SUM", "axis": [4]}, [1, 1, 5, 6]).forward([x])
    with pytest.raises(IRError, match="missing required parameter 'axis'"):
        one("Reduce", {"method": "SUM"}, [1, 1, 5, 6]).forward([x])
    with pytest.raises(IRError, match="'keepdims' must be true or false"):
        one("Reduce", {"method": "SUM", "axis": [1], "keepdims": "yes"}, [1, 1, 5, 6]).forward([x])
    with pytest.raises(IRError, match="unsupported Cumulate method 'MAX'"):
        one("Cumulate", {"method": "MAX", "axis": 1}, SHAPE).forward([x])
    g = one("Reduce", {"method": "UNBIASED_VARIANCE", "axis": [0]}, [1, 4, 5, 6])
    with pytest.raises(IRError, match="over 1 element"):
        quantize_model(g, [x], settings(8, "per_tensor_asymmetric"))


def test_mean_over_the_batch_axis_runs_per_sample() -> None:
    """A reduction over the IR batch axis reduces each sample alone at another batch (quantopt.graph.batch)."""
    g = one("Reduce", {"method": "MEAN", "axis": [0, 1]}, [1, 1, 5, 6])
    qg = quantize_model(g, [data("MEAN", [1, 4, 5, 6], 101)], settings(8, "per_tensor_asymmetric"))
    x = data("MEAN", [2, 4, 5, 6], 103)
    whole = qg.forward([x])[0].clone()
    assert torch.equal(whole, torch.cat([qg.forward([x[i:i + 1]])[0] for i in range(2)]))


def test_mean_over_a_resized_axis_is_refused() -> None:
    g = one("Reduce", {"method": "MEAN", "axis": [1]}, [1, 4, 5, 6])
    qg = quantize_model(g, [data("MEAN", [1, 4, 5, 6], 101)], settings(8, "per_tensor_asymmetric"))
    with pytest.raises(UnsupportedError, match="reduced elements"):
        qg.forward([data("MEAN", [1, 3, 5, 6], 103)])


def test_float_sum_over_a_middle_axis_keeps_the_layout_order() -> None:
    """Float ReduceSum/ReduceMean over a non-last axis: torch's float32 sum of the tensor in its own layout (rows
    added in order, as upstream's float forward sums), not of the values made contiguous (another rounding)."""
    from quantopt.graph.builder import GraphBuilder

    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((1, 16, 16, 8)).astype(np.float32))
    for method in ("SUM", "MEAN"):
        b = GraphBuilder("r")
        inp = b.input("x", [1, 16, 16, 8])
        y = b.layer("Reduce", [inp], [[1, 1, 16, 8]], name="op", params={"method": method, "axis": [1]})
        got = b.build([y]).forward([x])[0]
        expected = torch.sum(x, dim=[1], keepdim=True)
        expected = expected if method == "SUM" else expected / 16
        assert torch.equal(got, expected), method
    contiguous = x.permute(0, 2, 3, 1).contiguous().sum(-1)
    assert not torch.equal(contiguous, torch.sum(x, dim=[1]))  # the orders differ on this data
