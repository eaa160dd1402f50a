"""NonZero, Unique, Compress, Filter, InTopK and SegmentReduce: float forward against plain numpy/python references
written from docs/semantics/selection.md, quantized params, integer forward against the same references run on the
integers (nonzero means q + zp != 0), SegmentReduce against a python-int requantization, IR write → re-read bit
identity, refused quantized index inputs and bad params."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema", **extra)


def sparse(shape, seed: int) -> torch.Tensor:
    """Normal values with about half of them exactly 0."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.2, 2.0, size=shape).astype(np.float32)
    x[rng.random(shape) < 0.5] = 0.0
    return torch.from_numpy(x)


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


def pad(a: np.ndarray, size: int, axis: int, fill) -> np.ndarray:
    """`a` padded with `fill` to `size` along `axis` (the IR's fixed size of a data-dependent output)."""
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths, constant_values=fill)


def one_op(optype: str, inputs, out_shapes, params=None, out_dtypes=None):
    """inputs: (name, shape, dtype) triples."""
    b = GraphBuilder("t")
    names = [b.input(n, s, dtype=d) for n, s, d in inputs]
    ys = b.layer(optype, names, out_shapes, name="op", params=params or {}, output_dtypes=out_dtypes)
    return b.build(ys if isinstance(ys, list) else [ys])


# --- NonZero -------------------------------------------------------------------------------------------------------
def ref_nonzero(mask: np.ndarray) -> np.ndarray:
    coords = [idx for idx in np.ndindex(mask.shape) if mask[idx]]
    return np.array(coords, dtype=np.int64).reshape(-1, mask.ndim).T


@pytest.mark.parametrize("bits,mode", MODES)
def test_nonzero(tmp_path, bits: int, mode: str) -> None:
    g = one_op("NonZero", [("x", [1, 3, 5], Dtype.FP32)], [[3, 15], [1]], out_dtypes=[Dtype.INT32, Dtype.INT32])
    x = sparse([1, 3, 5], 1)
    coords, count = g.forward([x])
    want = ref_nonzero(x.numpy() != 0)
    np.testing.assert_array_equal(coords.numpy(), pad(want, 15, 1, 0))
    assert count.tolist() == [want.shape[1]]
    qg = quantize_model(g, [[sparse([1, 3, 5], s)] for s in (2, 3)] + [[x]], settings(bits, mode))
    node = qg.node("op")
    out = node.outputs[0]
    assert params_of(node, out).qinvariant and out.dtype == (Dtype.UINT8 if bits == 8 else Dtype.UINT16)
    assert node.outputs[1].dtype == out.dtype
    qcoords, qcount = qg.forward([x])
    q = node.inputs[0].betensor.numpy()
    want_q = ref_nonzero(q + int(params_of(node, node.inputs[0]).zerop) != 0)
    np.testing.assert_array_equal(qcoords.numpy(), pad(want_q, 15, 1, 0))
    assert qcount.tolist() == [want_q.shape[1]]
    # a zero stays zero, a nonzero value of at least half a quantization step stays nonzero
    step = 1.0 / float(params_of(node, node.inputs[0]).scale)
    assert set(map(tuple, want_q.T)) >= set(tuple(c) for c in want.T if abs(float(x[tuple(c)])) > step)
    roundtrip(tmp_path, qg, [x])


def test_nonzero_count_wider_than_coordinates() -> None:
    """Every dim below 256 but 4096 elements: the coordinates are uint8, the count needs uint16."""
    g = one_op("NonZero", [("x", [16, 16, 16], Dtype.FP32)], [[3, 4096], [1]])
    x = torch.ones(16, 16, 16)
    qg = quantize_model(g, [[x]], settings(8, "per_tensor_symmetric_full_range"))
    node = qg.node("op")
    assert node.outputs[0].dtype == Dtype.UINT8 and node.outputs[1].dtype == Dtype.UINT16
    assert qg.forward([x])[1].tolist() == [4096]


# --- Unique --------------------------------------------------------------------------------------------------------
def ref_unique(items: list, sort: bool):
    """items: hashable elements (or slices as tuples) in scan order."""
    order = []
    first: Dict[Any, int] = {}
    counts: Dict[Any, int] = {}
    for i, v in enumerate(items):
        if v not in first:
            first[v] = i
            order.append(v)
        counts[v] = counts.get(v, 0) + 1
    if sort:
        order = sorted(order)
    pos = {v: j for j, v in enumerate(order)}
    return order, [first[v] for v in order], [pos[v] for v in items], [counts[v] for v in order]


def unique_graph(shape, params):
    return one_op("Unique", [("x", shape, Dtype.FP32)], [[int(np.prod(shape))]] * 4, params=params,
                  out_dtypes=[Dtype.FP32, Dtype.INT32, Dtype.INT32, Dtype.INT32])


def _choice(shape, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).choice([-1.5, 0.0, 0.75, 2.0], size=shape)
                            .astype(np.float32))


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("bits,mode", MODES)
def test_unique_flat(tmp_path, sort: bool, bits: int, mode: str) -> None:
    g = unique_graph([2, 6], {"sorted": sort})
    x = _choice([2, 6], 1)
    got = g.forward([x])
    want = ref_unique(x.reshape(-1).tolist(), sort)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.tolist() == (b if i == 2 else b + [0] * (12 - len(b)))
    qg = quantize_model(g, [[_choice([2, 6], s)] for s in (2, 3)] + [[x]], settings(bits, mode))
    node = qg.node("op")
    iq = params_of(node, node.inputs[0])
    assert params_of(node, node.outputs[0]).scale == iq.scale and node.outputs[0].dtype == node.inputs[0].dtype
    assert all(params_of(node, o).qinvariant and o.dtype == Dtype.INT32 for o in node.outputs[1:])
    qgot = qg.forward([x])
    qwant = ref_unique(node.inputs[0].betensor.reshape(-1).tolist(), sort)
    fill = min(max(-int(iq.zerop), iq.qmin), iq.qmax)
    for i, (a, b) in enumerate(zip(qgot, qwant)):
        assert a.tolist() == (b if i == 2 else b + [fill if i == 0 else 0] * (12 - len(b)))
    assert qgot[3].tolist()[:len(want[3])] == want[3]  # the 4 values stay distinct after quantization
    roundtrip(tmp_path, qg, [x])


@pytest.mark.parametrize("sort", [True, False])
def test_unique_axis(sort: bool) -> None:
    x = torch.tensor([[1.0, 2.0], [0.0, 5.0], [1.0, 2.0], [0.0, 1.0], [0.0, 5.0]])
    g = one_op("Unique", [("x", [5, 2], Dtype.FP32)], [[5, 2], [5], [5], [5]], params={"sorted": sort, "axis": 0},
               out_dtypes=[Dtype.FP32, Dtype.INT32, Dtype.INT32, Dtype.INT32])
    got = g.forward([x])
    rows = [tuple(r) for r in x.tolist()]
    values, first, inverse, counts = ref_unique(rows, sort)
    assert [tuple(r) for r in got[0].tolist()] == values + [(0.0, 0.0)] * 2
    assert got[1].tolist() == first + [0, 0] and got[2].tolist() == inverse and got[3].tolist() == counts + [0, 0]


def test_unique_bad_axis(tmp_path) -> None:
    g = unique_graph([5, 2], {"axis": 2})
    with pytest.raises(IRError, match="axis 2 is out of range"):
        g.forward([torch.zeros(5, 2)])
    text = write_ir(unique_graph([5, 2], {"axis": "NONE"}), str(tmp_path / "u.txt"))[0]
    open(text, "w").write(open(text).read().replace("axis=NONE", "axis=COLUMNS"))
    with pytest.raises(IRError, match="axis"):
        read_ir(text)


# --- Compress ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [1, -1])
@pytest.mark.parametrize("bits,mode", MODES)
def test_compress(tmp_path, axis: int, bits: int, mode: str) -> None:
    shape = [1, 4, 6]
    n = shape[axis]
    g = one_op("Compress", [("x", shape, Dtype.FP32), ("c", [n + 2], Dtype.INT32)], [shape], params={"axis": axis})
    x = sparse(shape, 2)
    cond = torch.tensor([1, 0, 3, 0, 1, 1, 1, 1][:n + 2])
    keep = [i for i in range(n) if cond[i] != 0]
    want = pad(np.take(x.numpy(), keep, axis=axis), n, axis, 0.0)
    np.testing.assert_array_equal(g.forward([x, cond])[0].numpy(), want)
    qg = quantize_model(g, [[sparse(shape, s), cond] for s in (3, 4)] + [[x, cond]], settings(bits, mode))
    node = qg.node("op")
    iq, oq = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    assert oq.scale == iq.scale and oq.zerop == iq.zerop
    got = qg.forward([x, cond])[0]
    inp = node.inputs[0]
    fill = min(max(-int(iq.zerop), iq.qmin), iq.qmax)
    np.testing.assert_array_equal(got.numpy(), pad(np.take(inp.betensor.numpy(), keep, axis=axis), n, axis, fill))
    roundtrip(tmp_path, qg, [x, cond])


def test_compress_quantized_condition_uses_zero_point() -> None:
    """A float condition is quantized: a slice is kept where its float value is nonzero (q + zp != 0)."""
    g = one_op("Compress", [("x", [1, 4], Dtype.FP32), ("c", [4], Dtype.FP32)], [[1, 4]], params={"axis": 1})
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cond = torch.tensor([0.0, 1.0, 0.0, 0.5])
    qg = quantize_model(g, [[x, torch.tensor([-0.5, 1.0, 0.0, 0.5])], [x, cond]], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    assert int(params_of(node, node.inputs[1]).zerop) != 0
    got = qg.forward([x, cond])[0]
    iq = params_of(node, node.inputs[0])
    assert ((got.double() + float(iq.zerop)) / float(iq.scale)).round(decimals=1).tolist() == [[2.0, 4.0, 0.0, 0.0]]


# --- Filter --------------------------------------------------------------------------------------------------------
def filter_graph(axis: int):
    b = GraphBuilder("t")
    x1 = b.input("x1", [5, 3])
    x2 = b.input("x2", [5, 2])
    s = b.input("s", [5])
    ys = b.layer("Filter", [x1, x2, s], [[5, 3], [5, 2], []], name="op", params={"num": 2, "axis": axis},
                 output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32])
    return b.build(ys)


def ref_filter(x: np.ndarray, picked, fill) -> np.ndarray:
    out = np.full_like(x, fill)
    for j, i in enumerate(picked):
        out[j] = x[i]
    return out


@pytest.mark.parametrize("bits,mode", MODES)
def test_filter(tmp_path, bits: int, mode: str) -> None:
    g = filter_graph(0)
    sel = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0])
    feeds = [torch.randn(5, 3, generator=torch.Generator().manual_seed(1)) + 1.0,
             torch.randn(5, 2, generator=torch.Generator().manual_seed(2)), sel]
    picked = [1, 3, 4]
    y1, y2, count = g.forward(feeds)
    np.testing.assert_array_equal(y1.numpy(), ref_filter(feeds[0].numpy(), picked, 0.0))
    np.testing.assert_array_equal(y2.numpy(), ref_filter(feeds[1].numpy(), picked, 0.0))
    assert count.dim() == 0 and int(count) == 3
    calib = [[feeds[0] * k, feeds[1] * k, sel] for k in (0.5, 1.0)]
    qg = quantize_model(g, calib, settings(bits, mode))
    node = qg.node("op")
    c = node.outputs[2]
    assert params_of(node, c).qinvariant and c.dtype == Dtype.UINT16
    q1, q2, qcount = qg.forward(feeds)
    for got, inp in ((q1, node.inputs[0]), (q2, node.inputs[1])):
        iq = params_of(node, inp)
        fill = min(max(-int(iq.zerop), iq.qmin), iq.qmax)
        np.testing.assert_array_equal(got.numpy(), ref_filter(inp.betensor.numpy(), picked, fill))
    assert int(qcount) == 3
    roundtrip(tmp_path, qg, feeds)


def test_filter_bad_params() -> None:
    b = GraphBuilder("t")
    x1 = b.input("x1", [5, 3])
    s = b.input("s", [5])
    ys = b.layer("Filter", [x1, s], [[5, 3], []], name="op", params={"num": 2, "axis": 0})
    with pytest.raises(IRError, match="num 2 must equal"):
        b.build(ys).forward([torch.zeros(5, 3), torch.zeros(5)])
    g = filter_graph(1)
    with pytest.raises(IRError, match="the selector has 5 entries"):
        g.forward([torch.zeros(5, 3), torch.zeros(5, 2), torch.ones(5)])


# --- InTopK --------------------------------------------------------------------------------------------------------
def ref_in_top_k(x: np.ndarray, target, k: int, largest: bool) -> list:
    out = []
    for row, t in zip(x, target):
        n = len(row)
        if not -n <= t < n or k == 0:
            out.append(0)
            continue
        v = row[t % n]
        better = sum(1 for u in row if (u > v if largest else u < v))
        out.append(int(better < min(k, n)))
    return out


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("bits,mode", MODES)
def test_in_top_k(tmp_path, largest: bool, bits: int, mode: str) -> None:
    g = one_op("InTopK", [("x", [6, 5], Dtype.FP32), ("t", [6], Dtype.INT32)], [[6]],
               params={"k": 2, "largest": largest}, out_dtypes=[Dtype.UINT8])
    x = torch.tensor([[0.1, 0.5, 0.5, 0.2, -1.0]] * 2 + [[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    target = torch.tensor([1, 3, 0, -4, 7, 2])
    want = ref_in_top_k(x.numpy(), target.tolist(), 2, largest)
    assert g.forward([x, target])[0].tolist() == want
    qg = quantize_model(g, [[x, target]], settings(bits, mode))
    out = qg.node("op").outputs[0]
    assert params_of(qg.node("op"), out).qinvariant and out.dtype == Dtype.UINT8
    q = qg.node("op").inputs[0]
    got = qg.forward([x, target])[0].tolist()
    assert got == ref_in_top_k(q.betensor.numpy(), target.tolist(), 2, largest)
    roundtrip(tmp_path, qg, [x, target])


def test_in_top_k_refuses_quantized_targets() -> None:
    g = one_op("InTopK", [("x", [2, 5], Dtype.FP32), ("t", [2], Dtype.FP32)], [[2]], params={"k": 1})
    with pytest.raises(UnsupportedError, match="target input"):
        quantize_model(g, [[torch.randn(2, 5), torch.tensor([1.0, 3.0])]], settings(8, "per_tensor_asymmetric"))


# --- SegmentReduce -------------------------------------------------------------------------------------------------
def rs(v: int, n: int) -> int:
    """round_half_even(v / 2^n) with python ints; n <= 0: exact left shift."""
    if n <= 0:
        return v << -n
    q, r = divmod(v, 1 << n)
    half = 1 << (n - 1)
    return q + (1 if r > half or (r == half and q % 2) else 0)


def ref_segment_sum(x: np.ndarray, ids: list, zero) -> np.ndarray:
    segments = ids[-1] + 1
    out = np.full((segments,) + x.shape[1:], zero, dtype=x.dtype)
    for j in range(segments):
        rows = [x[i] for i, s in enumerate(ids) if s == j]
        if rows:
            acc = rows[0].copy()
            for r in rows[1:]:
                acc = acc + r
            out[j] = acc
    return out


@pytest.mark.parametrize("bits,mode", MODES)
def test_segment_reduce(tmp_path, bits: int, mode: str) -> None:
    g = one_op("SegmentReduce", [("x", [6, 2, 3], Dtype.FP32), ("i", [6], Dtype.INT32)], [[6, 2, 3]],
               params={"method": "SUM"})
    ids = torch.tensor([0, 0, 2, 2, 2, 4])

    def feed(seed):
        return [torch.from_numpy(np.random.default_rng(seed).normal(0.5, 1.0, size=(6, 2, 3)).astype(np.float32)),
                ids]

    f = feed(1)
    want = pad(ref_segment_sum(f[0].numpy(), ids.tolist(), 0.0), 6, 0, 0.0)
    np.testing.assert_allclose(g.forward(f)[0].numpy(), want, rtol=0, atol=1e-6)
    qg = quantize_model(g, [feed(s) for s in (2, 3)] + [f], settings(bits, mode))
    node = qg.node("op")
    inp, out = node.inputs[0], params_of(node, node.outputs[0])
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    assert m < 2 ** max(16, bits)
    got = qg.forward(f)[0]
    x_q = inp.betensor.numpy().astype(np.int64) + int(params_of(node, inp).zerop)
    acc = pad(ref_segment_sum(x_q, ids.tolist(), 0), 6, 0, 0)
    want_q = np.vectorize(lambda a: min(max(rs(int(a) * m, n) - int(out.zerop), out.qmin), out.qmax))(acc)
    np.testing.assert_array_equal(got.numpy(), want_q)
    deq = (got.double() + float(out.zerop)) / float(out.scale)
    assert float((deq - torch.from_numpy(want)).abs().max()) < (0.1 if bits == 8 else 0.002)
    roundtrip(tmp_path, qg, f)


def test_segment_reduce_refuses_other_methods() -> None:
    g = one_op("SegmentReduce", [("x", [3, 2], Dtype.FP32), ("i", [3], Dtype.INT32)], [[3, 2]],
               params={"method": "MAX"})
    with pytest.raises(UnsupportedError, match="method MAX is not supported"):
        g.forward([torch.zeros(3, 2), torch.tensor([0, 1, 1])])


def test_segment_reduce_pads_and_cuts_ids() -> None:
    g = one_op("SegmentReduce", [("x", [4, 1], Dtype.FP32), ("i", [3], Dtype.INT32)], [[4, 1]],
               params={"method": "SUM"})
    x = torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    assert g.forward([x, torch.tensor([0, 1, 1])])[0].reshape(-1).tolist() == [1.0, 14.0, 0.0, 0.0]  # 1 repeated
    g = one_op("SegmentReduce", [("x", [2, 1], Dtype.FP32), ("i", [3], Dtype.INT32)], [[3, 1]],
               params={"method": "SUM"})
    assert g.forward([x[:2], torch.tensor([0, 2, 3])])[0].reshape(-1).tolist() == [1.0, 0.0, 2.0]  # last id cut
    g = one_op("SegmentReduce", [("x", [2, 1], Dtype.FP32), ("i", [2], Dtype.INT32)], [[2, 1]],
               params={"method": "SUM"})
    assert g.forward([x[:2], torch.tensor([0, 4])])[0].reshape(-1).tolist() == [1.0, 0.0]  # more segments: cut


# --- AccidentalHits ------------------------------------------------------------------------------------------------
def ref_hits(true: np.ndarray, cand: np.ndarray, size: int):
    rows, cols = [], []
    for b in range(true.shape[0]):
        for j in range(true.shape[1]):
            for k in range(len(cand)):
                if true[b, j] == cand[k]:
                    rows.append(b)
                    cols.append(k)
    n = min(len(rows), size)
    return rows[:n] + [0] * (size - n), cols[:n] + [0] * (size - n), [n]


@pytest.mark.parametrize("size", [16, 3])
def test_accidental_hits(tmp_path, size: int) -> None:
    g = one_op("AccidentalHits", [("t", [3, 2], Dtype.INT32), ("c", [6], Dtype.INT32)], [[size], [size], [1]],
               out_dtypes=[Dtype.INT32] * 3)
    true = torch.tensor([[1, 4], [7, 7], [0, 2]])
    cand = torch.tensor([4, 7, 1, 4, 9, 7])
    want = ref_hits(true.numpy(), cand.numpy(), size)
    assert [t.tolist() for t in g.forward([true, cand])] == list(want)
    qg = quantize_model(g, [[true, cand]], settings(8, "per_tensor_asymmetric"))
    outs = qg.node("op").outputs
    assert [o.dtype for o in outs] == [Dtype.UINT16] * 3 and all(params_of(qg.node("op"), o).qinvariant for o in outs)
    assert [t.tolist() for t in qg.forward([true, cand])] == list(want)
    roundtrip(tmp_path, qg, [true, cand])
    qg = quantize_model(g, [[true, cand]], settings(16, "per_tensor_symmetric_full_range", force_dtype_int=True))
    assert [o.dtype for o in qg.node("op").outputs] == [Dtype.INT16] * 3


def test_accidental_hits_refuses_quantized_classes() -> None:
    g = one_op("AccidentalHits", [("t", [3, 2], Dtype.FP32), ("c", [6], Dtype.INT32)], [[8], [8], [1]])
    with pytest.raises(UnsupportedError, match="true class input"):
        quantize_model(g, [[torch.rand(3, 2) * 3, torch.arange(6)]], settings(8, "per_tensor_asymmetric"))
