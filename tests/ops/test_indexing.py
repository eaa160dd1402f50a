"""Index, gather, scatter and sort ops (Gather, GatherElements, GatherND, ScatterND, ScatterElements, OneHot, TopK,
Sort, ArgMinMax): float forward against numpy loops, integer forward against python-int references written from
docs/semantics/indexing.md, exact index outputs, float vs dequantized cosine, IR write → re-read bit identity,
refused float index inputs and parameter errors."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [
    (8, "per_tensor_symmetric_full_range"),
    (8, "per_tensor_asymmetric"),
    (16, "per_tensor_symmetric_full_range"),
]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema", **extra)


def normal(shape: Sequence[int], seed: int, std: float = 2.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.3, std, size=shape).astype(np.float32))


def ints(shape: Sequence[int], lo: int, hi: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(lo, hi, size=shape)).to(torch.int64)


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    for a, b in zip(before, re.forward(feeds)):
        assert b.dtype == torch.int64 and torch.equal(a, b)


def check_cosine(g, qg, feeds, bits: int) -> None:
    for a, b in zip(g.forward(feeds), run_quantized(qg, feeds)):
        a = a.clone()
        assert cosine(a, b) > (0.99 if bits == 8 else 0.9999)


def zp(node, t) -> int:
    return int(params_of(node, t).zerop)


def rs(v: int, n: int) -> int:
    """round_half_even(v / 2^n) with python ints; n <= 0: exact left shift."""
    if n <= 0:
        return v << -n
    q, r = divmod(v, 1 << n)
    half = 1 << (n - 1)
    return q + (1 if r > half or (r == half and q % 2) else 0)


# --- Gather --------------------------------------------------------------------------------------------------------
def gather_graph(data_shape, idx_shape, params, out_shape, const_idx=None):
    b = GraphBuilder("t")
    x = b.input("x", data_shape)
    inputs = [x]
    consts = {}
    if const_idx is None:
        inputs.append(b.input("i", idx_shape, dtype=Dtype.INT32))
    else:
        consts = {"indices": const_idx}
    y = b.layer("Gather", inputs, [out_shape], name="op", params=params, constants=consts,
                constant_dtypes={"indices": Dtype.INT32})
    return b.build([y])


def ref_gather(x: np.ndarray, idx: np.ndarray, axis: int, batch_dims: int, fill) -> np.ndarray:
    """Loops over the output (docs: Gather)."""
    b = batch_dims
    out_shape = x.shape[:axis] + idx.shape[b:] + x.shape[axis + 1:]
    out = np.empty(out_shape, dtype=x.dtype)
    n = x.shape[axis]
    for o in np.ndindex(out_shape):
        batch = o[:b]
        pre = o[b:axis]
        ipos = o[axis:axis + idx.ndim - b]
        post = o[axis + idx.ndim - b:]
        k = int(idx[batch + ipos])
        if -n <= k < n:
            out[o] = x[batch + pre + (k % n,) + post]
        else:
            out[o] = fill
    return out


GATHER_CASES = [
    # (data shape, index shape, params, output shape, constant indices or None)
    ([1, 4, 6], [3], {"axis": 2}, [1, 4, 3], None),
    ([1, 4, 6], [2, 2], {"axis": 1}, [1, 2, 2, 6], None),
    ([1, 4, 6], [5], {"axis": -1}, [1, 4, 5], np.array([0, 5, -1, 7, -8])),
    ([1, 4, 6], [1, 3], {"axis": 2, "batch_dims": 1}, [1, 4, 3], None),
]


def _gather_feeds(case, seed: int, batch: int = 2):
    data_shape, idx_shape, params, _, const = case
    x = normal([batch, *data_shape[1:]], seed)
    if const is not None:
        return [x]
    n = data_shape[params["axis"]]
    shape = [batch, *idx_shape[1:]] if params.get("batch_dims") else idx_shape
    return [x, ints(shape, -n - 1, n + 1, seed + 100)]


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: str(c[2]) + ("-const" if c[4] is not None else ""))
@pytest.mark.parametrize("bits,mode", MODES)
def test_gather(tmp_path, case, bits: int, mode: str) -> None:
    data_shape, idx_shape, params, out_shape, const = case
    g = gather_graph(data_shape, idx_shape, params, out_shape, const)
    feeds = _gather_feeds(case, 1)
    idx = const if const is not None else feeds[1].numpy()
    axis = params["axis"] % len(data_shape)
    want = ref_gather(feeds[0].numpy(), idx, axis, params.get("batch_dims", 0), 0.0)
    np.testing.assert_array_equal(g.forward(feeds)[0].numpy(), want)
    qg = quantize_model(g, [_gather_feeds(case, s) for s in (2, 3)] + [feeds], settings(bits, mode))
    node = qg.node("op")
    out, data = node.outputs[0], node.inputs[0]
    op, dp = params_of(node, out), params_of(node, data)
    assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (dp.scale, dp.zerop, dp.qmin, dp.qmax, data.dtype)
    got = qg.forward(feeds)[0]
    fill = min(max(-zp(node, data), dp.qmin), dp.qmax)
    np.testing.assert_array_equal(got.numpy(), ref_gather(data.betensor.numpy(), idx, axis,
                                                          params.get("batch_dims", 0), fill))
    check_cosine(g, qg, feeds, bits)
    roundtrip(tmp_path, qg, feeds)


def test_gather_float_index_constant_with_integers_is_stored_as_int32() -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 4, 6])
    y = b.layer("Gather", [x], [[1, 4, 3]], name="op", params={"axis": 2},
                constants={"indices": np.array([1.0, 0.0, 5.0], dtype=np.float32)})
    g = b.build([y])
    qg = quantize_model(g, [normal([2, 4, 6], 4)], settings(8, "per_tensor_asymmetric"))
    c = qg.node("op").constants["indices"]
    assert c.dtype == Dtype.INT32 and c.betensor.tolist() == [1, 0, 5]


# --- GatherElements, GatherND ---------------------------------------------------------------------------------------
def two_input_graph(optype: str, data_shape, idx_shape, params, out_shape):
    b = GraphBuilder("t")
    x = b.input("x", data_shape)
    i = b.input("i", idx_shape, dtype=Dtype.INT32)
    y = b.layer(optype, [x, i], [out_shape], name="op", params=params)
    return b.build([y])


def ref_gather_elements(x: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    n = x.shape[axis]
    out = np.empty(idx.shape, dtype=x.dtype)
    for p in np.ndindex(idx.shape):
        k = int(idx[p])
        if k >= n:
            k = n - 1
        elif k < 0:
            k = k + n if k + n >= 0 else n - 1
        src = list(p)
        src[axis] = k
        out[p] = x[tuple(src)]
    return out


def ref_gather_nd(x: np.ndarray, idx: np.ndarray, b: int, fill) -> np.ndarray:
    k = idx.shape[-1]
    rest = x.shape[b + k:]
    out = np.empty(idx.shape[:-1] + rest, dtype=x.dtype)
    for p in np.ndindex(idx.shape[:-1]):
        tup = [int(v) for v in idx[p]]
        dims = x.shape[b:b + k]
        if all(-n <= v < n for v, n in zip(tup, dims)):
            out[p] = x[p[:b] + tuple(v % n for v, n in zip(tup, dims))]
        else:
            out[p] = fill
    return out


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("bits,mode", MODES)
def test_gather_elements(tmp_path, axis: int, bits: int, mode: str) -> None:
    g = two_input_graph("GatherElements", [2, 4, 6], [2, 3, 5], {"axis": axis}, [2, 3, 5])
    n = [2, 4, 6][axis]

    def feeds(seed):
        return [normal([2, 4, 6], seed), ints([2, 3, 5], -n - 2, n + 2, seed + 50)]

    f = feeds(1)
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), ref_gather_elements(f[0].numpy(), f[1].numpy(), axis))
    qg = quantize_model(g, [feeds(s) for s in (2, 3)] + [f], settings(bits, mode))
    got = qg.forward(f)[0]
    node = qg.node("op")
    np.testing.assert_array_equal(got.numpy(), ref_gather_elements(node.inputs[0].betensor.numpy(), f[1].numpy(),
                                                                   axis))
    check_cosine(g, qg, f, bits)
    roundtrip(tmp_path, qg, f)


@pytest.mark.parametrize("data_shape,idx_shape,b,out_shape", [
    ([1, 4, 6, 2], [3, 2], 0, [3, 6, 2]),
    ([2, 4, 6, 2], [2, 3, 2], 1, [2, 3, 2]),
    ([2, 4, 6], [2, 5, 2], 0, [2, 5, 6]),
])
@pytest.mark.parametrize("bits,mode", MODES)
def test_gather_nd(tmp_path, data_shape, idx_shape, b: int, out_shape, bits: int, mode: str) -> None:
    g = two_input_graph("GatherND", data_shape, idx_shape, {"batch_dims": b}, out_shape)
    lim = max(data_shape[b:b + idx_shape[-1]])

    def feeds(seed):
        return [normal(data_shape, seed), ints(idx_shape, -lim, lim + 1, seed + 50)]

    f = feeds(1)
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), ref_gather_nd(f[0].numpy(), f[1].numpy(), b, 0.0))
    qg = quantize_model(g, [feeds(s) for s in (2, 3)] + [f], settings(bits, mode))
    node = qg.node("op")
    data = node.inputs[0]
    got = qg.forward(f)[0]
    dp = params_of(node, data)
    fill = min(max(-zp(node, data), dp.qmin), dp.qmax)
    np.testing.assert_array_equal(got.numpy(), ref_gather_nd(data.betensor.numpy(), f[1].numpy(), b, fill))
    check_cosine(g, qg, f, bits)
    roundtrip(tmp_path, qg, f)


# --- ScatterND, ScatterElements -------------------------------------------------------------------------------------
def scatter_graph(optype: str, data_shape, idx_shape, upd_shape, params):
    b = GraphBuilder("t")
    x = b.input("x", data_shape)
    i = b.input("i", idx_shape, dtype=Dtype.INT32)
    u = b.input("u", upd_shape)
    y = b.layer(optype, [x, i, u], [data_shape], name="op", params=params)
    return b.build([y])


def scatter_targets_nd(data_shape, idx: np.ndarray) -> List[Any]:
    """(update row index, target tuple) in row-major order; out-of-range rows dropped (docs: ScatterND)."""
    k = idx.shape[-1]
    rows = idx.reshape(-1, k)
    out = []
    for j, row in enumerate(rows):
        dims = data_shape[:k]
        if all(-n <= int(v) < n for v, n in zip(row, dims)):
            out.append((j, tuple(int(v) % n for v, n in zip(row, dims))))
    return out


def scatter_targets_elements(data_shape, idx: np.ndarray, axis: int) -> List[Any]:
    n = data_shape[axis]
    out = []
    for p in np.ndindex(idx.shape):
        k = int(idx[p])
        k = k + n if k < 0 else k
        k = min(max(k, 0), n - 1)
        t = list(p)
        t[axis] = k
        out.append((p, tuple(t)))
    return out


def ref_scatter_float(x: np.ndarray, upd_rows, targets, reduction: str) -> np.ndarray:
    out = x.astype(np.float64).copy()
    for j, t in targets:
        u = upd_rows[j].astype(np.float64)
        if reduction == "NONE":
            out[t] = u
        elif reduction == "ADD":
            out[t] = out[t] + u
        elif reduction == "MUL":
            out[t] = out[t] * u
        elif reduction == "MAX":
            out[t] = np.maximum(out[t], u)
        else:
            out[t] = np.minimum(out[t], u)
    return out


def ref_scatter_int(node, d_q: np.ndarray, upd_rows, targets, reduction: str) -> np.ndarray:
    """Docs: ScatterND integer computation, element by element with python ints."""
    zd, zu, op = zp(node, node.inputs[0]), zp(node, node.inputs[2]), params_of(node, node.outputs[0])
    (md, mu), (nd, nu) = node.params["scale_value"], node.params["shift_value"]
    t = np.empty(d_q.shape, dtype=object)
    for p in np.ndindex(d_q.shape):
        t[p] = rs((int(d_q[p]) + zd) * md, nd)
    for j, tgt in targets:
        row = np.asarray(upd_rows[j])
        cur = np.asarray(t[tgt], dtype=object)
        res = np.empty(row.shape, dtype=object)
        for e in np.ndindex(row.shape):
            uu = int(row[e]) + zu
            c = cur[e] if cur.shape else cur.item()
            if reduction == "MUL":
                res[e] = min(max(rs(c * uu * mu, nu), -2 ** 31), 2 ** 31 - 1)
            else:
                v = rs(uu * mu, nu)
                res[e] = {"NONE": v, "ADD": c + v, "MAX": max(c, v), "MIN": min(c, v)}[reduction]
        t[tgt] = res if res.shape else res.item()
    return np.vectorize(lambda v: min(max(v - int(op.zerop), op.qmin), op.qmax), otypes=[np.int64])(t)


SCATTER_REDUCTIONS = ["NONE", "ADD", "MUL", "MAX", "MIN"]


@pytest.mark.parametrize("reduction", SCATTER_REDUCTIONS)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("bits,mode", MODES)
def test_scatter_nd(tmp_path, reduction: str, k: int, bits: int, mode: str) -> None:
    data_shape = [4, 5]
    m = 6
    idx_shape = [m, k]
    upd_shape = [m] + data_shape[k:]
    g = scatter_graph("ScatterND", data_shape, idx_shape, upd_shape, {"reduction": reduction})

    def feeds(seed):
        idx = ints(idx_shape, -4, 5, seed + 50)  # duplicates and out-of-range rows (4 on a dim of 4)
        return [normal(data_shape, seed), idx, normal(upd_shape, seed + 7, std=1.0)]

    f = feeds(1)
    targets = scatter_targets_nd(data_shape, f[1].numpy())
    want = ref_scatter_float(f[0].numpy(), f[2].numpy(), targets, reduction)
    np.testing.assert_allclose(g.forward(f)[0].numpy(), want, rtol=1e-5, atol=1e-5)
    qg = quantize_model(g, [feeds(s) for s in (2, 3)] + [f], settings(bits, mode))
    node = qg.node("op")
    if reduction == "NONE":
        assert node.params["scale_value"][0] == 1 and node.params["shift_value"][0] == 0
    got = qg.forward(f)[0]
    np.testing.assert_array_equal(got.numpy(), ref_scatter_int(node, node.inputs[0].betensor.numpy(),
                                                               node.inputs[2].betensor.numpy(), targets, reduction))
    check_cosine(g, qg, f, bits)
    roundtrip(tmp_path, qg, f)


@pytest.mark.parametrize("reduction", SCATTER_REDUCTIONS)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("bits,mode", MODES)
def test_scatter_elements(tmp_path, reduction: str, axis: int, bits: int, mode: str) -> None:
    data_shape, idx_shape = [4, 6], [3, 4]
    g = scatter_graph("ScatterElements", data_shape, idx_shape, idx_shape, {"reduction": reduction, "axis": axis})
    n = data_shape[axis]

    def feeds(seed):
        return [normal(data_shape, seed), ints(idx_shape, -n - 1, n + 1, seed + 50), normal(idx_shape, seed + 7, 1.0)]

    f = feeds(1)
    targets = scatter_targets_elements(data_shape, f[1].numpy(), axis)
    want = ref_scatter_float(f[0].numpy(), f[2].numpy(), targets, reduction)
    np.testing.assert_allclose(g.forward(f)[0].numpy(), want, rtol=1e-5, atol=1e-5)
    qg = quantize_model(g, [feeds(s) for s in (2, 3)] + [f], settings(bits, mode))
    node = qg.node("op")
    got = qg.forward(f)[0]
    np.testing.assert_array_equal(got.numpy(), ref_scatter_int(node, node.inputs[0].betensor.numpy(),
                                                               node.inputs[2].betensor.numpy(), targets, reduction))
    check_cosine(g, qg, f, bits)
    roundtrip(tmp_path, qg, f)


def test_scatter_none_with_equal_params_moves_integers_exactly() -> None:
    """Data and updates from one Split: equal params, so NONE writes the update integers unchanged."""
    b = GraphBuilder("t")
    x = b.input("x", [2, 6])
    d, u = b.layer("Split", [x], [[1, 6], [1, 6]], name="split", params={"axis": 0, "splits": [1, 1]})
    i = b.input("i", [1, 2], dtype=Dtype.INT32)
    y = b.layer("ScatterElements", [d, i, b.layer("Slice", [u], [[1, 2]], name="sl",
                                                   params={"begin": [0, 0], "end": [1, 2]})],
                [[1, 6]], name="op", params={"axis": 1})
    g = b.build([y])
    f = [normal([2, 6], 1), torch.tensor([[4, 1]])]
    qg = quantize_model(g, [f], settings(8, "per_tensor_asymmetric"))
    got = qg.forward(f)[0]
    xq = qg.node("split").inputs[0].betensor
    want = xq[0:1].clone()
    want[0, 4], want[0, 1] = xq[1, 0], xq[1, 1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("optype", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("bits,mode", MODES)
def test_scatter_of_float_updates_into_a_buffer_of_zeros(tmp_path, optype: str, bits: int, mode: str) -> None:
    """Float updates written into a constant of zeros (torch's `new_zeros` then a slice assignment: Longformer's
    sliding-window scores): the zeros are an integer tensor of scale 1, whose params the output used to copy, which
    rounded every update to 0. The output now takes its calibrated range; the integers follow the documented form."""
    b = GraphBuilder("t")
    zeros = b.layer("Constant", [], [[4, 8]], name="zeros", constants={"weights": np.zeros((4, 8), np.float32)})
    u = b.input("u", [2, 8])
    if optype == "ScatterND":
        idx = b.layer("Constant", [], [[2, 1]], name="idx", constants={"weights": np.array([[0], [2]], np.int64)},
                      constant_dtypes={"weights": Dtype.INT32}, output_dtypes=[Dtype.INT32])
        targets = [(0, (0,)), (1, (2,))]
    else:
        idx = b.layer("Constant", [], [[2, 8]], name="idx",
                      constants={"weights": np.array([[1] * 8, [3] * 8], np.int64)},
                      constant_dtypes={"weights": Dtype.INT32}, output_dtypes=[Dtype.INT32])
        targets = None
    g = b.build([b.layer(optype, [zeros, idx, u], [[4, 8]], name="op", params={"axis": 0} if targets is None else {})])
    feeds = [[normal([2, 8], seed, std=0.05)] for seed in range(4)]
    qg = quantize_model(g, feeds, settings(bits, mode))
    assert not params_of(qg.node("op"), qg.node("op").outputs[0]).qinvariant
    check_cosine(g, qg, feeds[0], bits)
    if targets is not None:
        node = qg.node("op")
        got = qg.forward(feeds[0], keep_tensors=True)[0]
        upd_q = node.inputs[2].betensor.numpy()
        np.testing.assert_array_equal(got.numpy(), ref_scatter_int(node, node.inputs[0].betensor.numpy(), upd_q,
                                                                   targets, "NONE"))
    roundtrip(tmp_path, qg, feeds[0])


# --- OneHot ---------------------------------------------------------------------------------------------------------
def ref_onehot(idx: np.ndarray, depth: int, off, on, axis: int, dtype) -> np.ndarray:
    rank = idx.ndim + 1
    axis = axis % rank
    out_shape = idx.shape[:axis] + (depth,) + idx.shape[axis:]
    out = np.full(out_shape, off, dtype=dtype)
    for p in np.ndindex(idx.shape):
        k = int(idx[p])
        if -depth <= k < depth:
            out[p[:axis] + (k % depth,) + p[axis:]] = on
    return out


@pytest.mark.parametrize("values,axis", [([0.0, 1.0], -1), ([-1.0, 3.0], 1), ([0.5, -0.25], 0)])
@pytest.mark.parametrize("bits,mode", MODES)
def test_onehot(tmp_path, values, axis: int, bits: int, mode: str) -> None:
    depth = 5
    out_shape = [2, 7]
    out_shape.insert(axis % 3, depth)
    b = GraphBuilder("t")
    i = b.input("i", [2, 7], dtype=Dtype.INT32)
    y = b.layer("OneHot", [i], [out_shape], name="op", params={"depth": depth, "values": values, "axis": axis})
    g = b.build([y])
    f = [ints([2, 7], -depth - 2, depth + 2, 1)]
    np.testing.assert_array_equal(g.forward(f)[0].numpy(),
                                  ref_onehot(f[0].numpy(), depth, values[0], values[1], axis, np.float32))
    qg = quantize_model(g, [f], settings(bits, mode))
    node = qg.node("op")
    out = params_of(node, node.outputs[0])
    qmax = 2 ** (bits - 1) - 1 if min(values) < 0 else 2 ** bits - 1
    scale = qmax / max(abs(v) for v in values)
    assert float(out.scale) == scale and int(out.zerop) == 0 and out.qmax == qmax
    assert node.params["values"] == [round(v * scale) for v in values]
    got = qg.forward(f)[0]
    np.testing.assert_array_equal(got.numpy(), ref_onehot(f[0].numpy(), depth, *node.params["values"], axis,
                                                          np.int64))
    check_cosine(g, qg, f, bits)
    roundtrip(tmp_path, qg, f)


# --- TopK, Sort, ArgMinMax ------------------------------------------------------------------------------------------
def ref_sort(a: np.ndarray, axis: int, descending: bool, last_first: bool = False):
    """Python sorted() per line: key (value, index) with ties by index (reversed index for last_first)."""
    moved = np.moveaxis(a, axis, -1)
    vals = np.empty_like(moved)
    idxs = np.empty(moved.shape, dtype=np.int64)
    n = moved.shape[-1]
    for p in np.ndindex(moved.shape[:-1]):
        line = [float(v) for v in moved[p]]
        sign = -1.0 if descending else 1.0
        order = sorted(range(n), key=lambda i: (sign * line[i], -i if last_first else i))
        idxs[p] = order
        vals[p] = [line[i] for i in order]
    return np.moveaxis(vals, -1, axis), np.moveaxis(idxs, -1, axis)


def one_layer(optype, params, in_shape, out_shapes):
    b = GraphBuilder("t")
    x = b.input("x", in_shape)
    y = b.layer(optype, [x], out_shapes, name="op", params=params)
    return b.build(y if isinstance(y, list) else [y])


def tied(shape, seed):
    """Values on a coarse grid: many ties, also after quantization."""
    return torch.round(normal(shape, seed) * 2) / 2


TOPK_CASES = [
    {"k": 3, "axis": -1},
    {"k": 2, "axis": 1, "largest": False},
    {"k": 4, "axis": 2, "select_index": "last"},
    {"k": 6, "axis": -1, "largest": False, "sorted": False, "select_index": "last"},
]


@pytest.mark.parametrize("params", TOPK_CASES, ids=str)
@pytest.mark.parametrize("bits,mode", MODES)
def test_topk(tmp_path, params, bits: int, mode: str) -> None:
    shape = [1, 4, 6]
    axis = params["axis"] % 3
    out_shape = list(shape)
    out_shape[axis] = params["k"]
    g = one_layer("TopK", params, shape, [out_shape, out_shape])
    f = [tied([2, 4, 6], 1)]
    largest = params.get("largest", True)
    last = params.get("select_index") == "last"
    v, i = ref_sort(f[0].numpy(), axis, largest, last)
    fv, fi = g.forward(f)
    np.testing.assert_array_equal(fv.numpy(), np.take(v, range(params["k"]), axis=axis))
    np.testing.assert_array_equal(fi.numpy(), np.take(i, range(params["k"]), axis=axis))
    qg = quantize_model(g, [tied([2, 4, 6], s) for s in (2, 3)] + f, settings(bits, mode))
    node = qg.node("op")
    idx_t = node.outputs[1]
    assert params_of(node, idx_t).qinvariant and idx_t.dtype == Dtype.UINT16
    qv, qi = qg.forward(f)
    v, i = ref_sort(node.inputs[0].betensor.numpy(), axis, largest, last)
    np.testing.assert_array_equal(qv.numpy(), np.take(v, range(params["k"]), axis=axis))
    np.testing.assert_array_equal(qi.numpy(), np.take(i, range(params["k"]), axis=axis))
    assert cosine(fv, run_quantized(qg, f)[0]) > (0.99 if bits == 8 else 0.9999)
    roundtrip(tmp_path, qg, f)


@pytest.mark.parametrize("params", [{"k": 3, "axis": -1}, {"k": 5, "axis": 1, "largest": False},
                                    {"k": 2, "axis": -1, "select_index": "last"},
                                    {"k": 10, "axis": 1, "largest": False, "select_index": "last"}], ids=str)
def test_topk_of_a_few_selects_before_it_sorts(params) -> None:
    """k of at most a quarter of the axis is selected first, then sorted (`_top_k`): the reference's values (signed
    zeros included) and indices on data with many ties, a row of one value, and the integers of the same data."""
    shape = [2, 40, 3] if params["axis"] == 1 else [2, 3, 40]
    axis = params["axis"] % 3
    out_shape = list(shape)
    out_shape[axis] = params["k"]
    x = tied(shape, 5)
    x = torch.where(x == 0, torch.where(normal(shape, 6) > 0, 0.0, -0.0), x)  # zeros of both signs: ties
    x.narrow(0, 1, 1).fill_(1.5)  # every value of the second sample tied
    largest, last = params.get("largest", True), params.get("select_index") == "last"
    g = one_layer("TopK", params, shape, [out_shape, out_shape])
    for data in (x, (x * 2).to(torch.int64)):
        v, i = ref_sort(data.numpy(), axis, largest, last)
        fv, fi = g.forward([data])
        want = np.take(v, range(params["k"]), axis=axis)
        np.testing.assert_array_equal(fv.numpy(), want)
        np.testing.assert_array_equal(np.signbit(fv.numpy()), np.signbit(want))
        np.testing.assert_array_equal(fi.numpy(), np.take(i, range(params["k"]), axis=axis))


def test_topk_with_nan_sorts_the_whole_axis() -> None:
    """NaN, which torch orders as the largest value, takes the whole stable sort: torch's own order."""
    from quantopt.ops.indexing import _sort_along, _top_k

    x = tied([2, 40], 7)
    x[0, [3, 17]] = float("nan")
    for largest in (True, False):
        v, i = _top_k(x, 1, 4, largest, False)
        rv, ri = _sort_along(x, 1, largest, False)
        assert torch.equal(i, ri[:, :4]) and torch.equal(v.isnan(), rv[:, :4].isnan())


@pytest.mark.parametrize("axis,descending", [(-1, True), (1, False), (0, True)])
@pytest.mark.parametrize("bits,mode", MODES)
def test_sort(tmp_path, axis: int, descending: bool, bits: int, mode: str) -> None:
    shape = [3, 4, 6]
    g = one_layer("Sort", {"axis": axis, "descending": descending}, shape, [shape, shape])
    f = [tied(shape, 1)]
    v, i = ref_sort(f[0].numpy(), axis % 3, descending)
    fv, fi = g.forward(f)
    np.testing.assert_array_equal(fv.numpy(), v)
    np.testing.assert_array_equal(fi.numpy(), i)
    qg = quantize_model(g, [tied(shape, s) for s in (2, 3)] + f, settings(bits, mode))
    node = qg.node("op")
    qv, qi = qg.forward(f)
    v, i = ref_sort(node.inputs[0].betensor.numpy(), axis % 3, descending)
    np.testing.assert_array_equal(qv.numpy(), v)
    np.testing.assert_array_equal(qi.numpy(), i)
    assert params_of(node, node.outputs[1]).qinvariant and node.outputs[1].dtype == Dtype.UINT16
    assert cosine(fv, run_quantized(qg, f)[0]) > (0.99 if bits == 8 else 0.9999)
    roundtrip(tmp_path, qg, f)


def test_sort_index_bits_follow_axis_length() -> None:
    g = one_layer("Sort", {"axis": 1}, [1, 70000], [[1, 70000], [1, 70000]])
    qg = quantize_model(g, [normal([1, 70000], 1)], settings(8, "per_tensor_asymmetric", force_dtype_int=True))
    out = qg.node("op").outputs[1]
    assert out.dtype == Dtype.INT32 and params_of(qg.node("op"), out).qinvariant


def ref_argminmax(a: np.ndarray, axis: int, method: str, last: bool) -> np.ndarray:
    moved = np.moveaxis(a, axis, -1)
    out = np.empty(moved.shape[:-1] + (1,), dtype=np.int64)
    for p in np.ndindex(moved.shape[:-1]):
        line = list(moved[p])
        best = max(line) if method == "MAX" else min(line)
        hits = [i for i, v in enumerate(line) if v == best]
        out[p] = hits[-1] if last else hits[0]
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("method,axis,last", [("MAX", 2, False), ("MIN", 1, False), ("MAX", -1, True),
                                              ("MIN", 0, True)])
@pytest.mark.parametrize("bits,mode", MODES)
def test_argminmax(tmp_path, method: str, axis: int, last: bool, bits: int, mode: str) -> None:
    shape = [2, 4, 6]
    out_shape = list(shape)
    out_shape[axis] = 1
    g = one_layer("ArgMinMax", {"method": method, "axis": axis, "select_last_index": last}, shape, [out_shape])
    f = [tied(shape, 1)]
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), ref_argminmax(f[0].numpy(), axis % 3, method, last))
    qg = quantize_model(g, [tied(shape, s) for s in (2, 3)] + f, settings(bits, mode))
    node = qg.node("op")
    # max(16, bits) bits, as upstream
    assert params_of(node, node.outputs[0]).qinvariant and node.outputs[0].dtype == Dtype.UINT16
    got = qg.forward(f)[0]
    np.testing.assert_array_equal(got.numpy(), ref_argminmax(node.inputs[0].betensor.numpy(), axis % 3, method,
                                                             last))
    roundtrip(tmp_path, qg, f)


@pytest.mark.parametrize("method,last", [("MAX", False), ("MIN", False), ("MAX", True), ("MIN", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int16])
@pytest.mark.parametrize("shape,axis", [([1, 21, 40, 30], 1), ([2, 5, 1100], 1), ([3, 4, 50, 30], 0)])
def test_argminmax_over_an_outer_axis_is_torchs(monkeypatch, method: str, last: bool, dtype: torch.dtype,
                                               shape: List[int], axis: int) -> None:
    """The reductions' form (an outer axis of many columns) gives torch's own indices: first or last of ties
    (values drawn from a few integers, so most columns tie), signed zeros equal; with a NaN, torch's own."""
    import quantopt.ops.indexing as indexing

    out_shape = list(shape)
    out_shape[axis] = 1
    g = one_layer("ArgMinMax", {"method": method, "axis": axis, "select_last_index": last}, shape, [out_shape])
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(-3, 4, shape, generator=gen).to(dtype)
    if dtype.is_floating_point:
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=gen) < 0.5, -0.0, 0.0).to(dtype)
    fn = torch.argmax if method == "MAX" else torch.argmin
    src = torch.flip(x, dims=[axis]) if last else x
    want = (shape[axis] - 1 - fn(src, dim=axis, keepdim=True)) if last else fn(src, dim=axis, keepdim=True)
    calls = []
    real = indexing._outer_extreme_index
    monkeypatch.setattr(indexing, "_outer_extreme_index", lambda *a: calls.append(real(*a)) or calls[-1])
    got = g.forward([x])[0]
    assert calls and calls[-1] is not None  # the reductions' form ran
    assert got.dtype == torch.int64 and torch.equal(got, want)
    if dtype.is_floating_point:
        x.view(-1)[7] = float("nan")
        src = torch.flip(x, dims=[axis]) if last else x
        want = (shape[axis] - 1 - fn(src, dim=axis, keepdim=True)) if last else fn(src, dim=axis, keepdim=True)
        assert torch.equal(g.forward([x])[0], want) and calls[-1] is None


# --- index inputs must be integers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("optype", ["Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "OneHot"])
def test_float_index_input_is_refused(optype: str) -> None:
    b = GraphBuilder("t")
    x = None if optype == "OneHot" else b.input("x", [2, 4])
    i = b.input("i", [2, 1])  # float32: quantized as an activation, not exact integers
    feeds = [] if x is None else [normal([2, 4], 1)]
    feeds.append(torch.tensor([[1.0], [0.0]]))
    if optype == "OneHot":
        y = b.layer(optype, [i], [[2, 1, 3]], name="op", params={"depth": 3, "values": [0, 1]})
    elif optype.startswith("Scatter"):
        u_shape = [2, 1] if optype == "ScatterElements" else [2, 4]
        u = b.input("u", u_shape)
        feeds.append(normal(u_shape, 2))
        y = b.layer(optype, [x, i, u], [[2, 4]], name="op", params={"axis": 1})
    else:
        y = b.layer(optype, [x, i], [[2, 1] if optype != "Gather" else [2, 2, 1]], name="op", params={"axis": 1})
    g = b.build([y])
    with pytest.raises(UnsupportedError, match="indices must be exact integers"):
        quantize_model(g, [feeds], settings(8, "per_tensor_asymmetric"))


def test_non_integer_index_constant_is_refused() -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 4])
    y = b.layer("Gather", [x], [[1, 2]], name="op", params={"axis": 1},
                constants={"indices": np.array([0.5, 1.0], dtype=np.float32)})
    g = b.build([y])
    with pytest.raises(UnsupportedError, match="non-integer"):
        quantize_model(g, [normal([1, 4], 1)], settings(8, "per_tensor_asymmetric"))


# --- parameter errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params,match", [
    ("TopK", {"k": 7, "axis": -1}, "outside"),
    ("TopK", {"k": 2, "select_index": "middle"}, "select_index"),
    ("ArgMinMax", {"method": "MEAN", "axis": 1}, "MAX or MIN"),
    ("ArgMinMax", {"method": "MAX", "axis": 3}, "out of range"),
    ("Sort", {"axis": 1, "descending": "maybe"}, "true or false"),
    ("Gather", {"axis": 1}, "indices"),
])
def test_bad_params_are_ir_errors(optype: str, params: Dict[str, Any], match: str) -> None:
    outs = [[1, 6], [1, 6]] if optype in ("TopK", "Sort") else [[1, 6]]
    g = one_layer(optype, params, [1, 6], outs)
    with pytest.raises(IRError, match=match):
        g.forward([torch.zeros(1, 6)])


@pytest.mark.parametrize("optype,params,match", [
    ("ScatterND", {"reduction": "MEAN"}, "reduction"),
    ("ScatterElements", {"reduction": "ADD", "axis": 0}, "same shape"),
])
def test_bad_scatter_is_ir_error(optype: str, params: Dict[str, Any], match: str) -> None:
    g = scatter_graph(optype, [4, 5], [2, 1], [2, 5], params)
    with pytest.raises(IRError, match=match):
        g.forward([normal([4, 5], 1), torch.tensor([[1], [2]]), normal([2, 5], 2)])


def test_onehot_bad_values() -> None:
    b = GraphBuilder("t")
    i = b.input("i", [2], dtype=Dtype.INT32)
    y = b.layer("OneHot", [i], [[2, 3]], name="op", params={"depth": 3, "values": [1.0]})
    with pytest.raises(IRError, match="off_value, on_value"):
        b.build([y]).forward([torch.tensor([0, 1])])


def test_argminmax_index_type_follows_upstream_and_widens_past_its_range() -> None:
    for shape, bits, force_int, expected in [([2, 6], 8, False, Dtype.UINT16), ([2, 6], 8, True, Dtype.INT16),
                                             ([2, 70000], 8, False, Dtype.UINT32), ([2, 40000], 8, True, Dtype.INT32)]:
        g = one_layer("ArgMinMax", {"method": "MAX", "axis": 1}, shape, [[shape[0], 1]])
        data = [torch.from_numpy(np.random.default_rng(0).normal(0, 1, shape).astype(np.float32))]
        qg = quantize_model(g, [data], dict(q_bits_activation=bits, force_dtype_int=force_int))
        assert qg.node("op").outputs[0].dtype == expected, (shape, force_int)
