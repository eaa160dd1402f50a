"""UpsampleByIndex and OverlapAdd: float forward against plain-python loops written from docs/semantics/sampling.md,
quantized params, integer forward against the same loops on the integers (OverlapAdd: a python-int requantization),
IR write → re-read bit identity, refused quantized argmax input and bad params."""
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


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


def rs(v: int, n: int) -> int:
    """round_half_even(v / 2^n) with python ints; n <= 0: exact left shift."""
    if n <= 0:
        return v << -n
    q, r = divmod(v, 1 << n)
    half = 1 << (n - 1)
    return q + (1 if r > half or (r == half and q % 2) else 0)


# --- UpsampleByIndex -----------------------------------------------------------------------------------------------
IN_SHAPE = (2, 2, 3, 2)
TOP = (4, 6, 2)


def ref_unpool(values: np.ndarray, arg: np.ndarray, mode: str, top, fill) -> np.ndarray:
    """Loop over the values in scan order (NHWC, or NCHW for HW/NCHW); later writes win."""
    n, h, w, c = values.shape
    th, tw, tc = top
    nchw = mode in ("HW", "NCHW")
    flat = np.full(n * th * tw * tc, fill, dtype=values.dtype)
    order = [(b, y, x, ch) for b in range(n) for ch in range(c) for y in range(h) for x in range(w)] if nchw else \
        [(b, y, x, ch) for b in range(n) for y in range(h) for x in range(w) for ch in range(c)]
    for b, y, x, ch in order:
        p = int(arg[b, y, x, ch])
        if mode == "HW":
            p += b * th * tw * tc + ch * th * tw
        elif mode == "HWC":
            p += b * th * tw * tc
        if 0 <= p < flat.size:
            flat[p] = values[b, y, x, ch]
    if nchw:
        return flat.reshape(n, tc, th, tw).transpose(0, 2, 3, 1)
    return flat.reshape(n, th, tw, tc)


def unpool_graph(mode: str):
    b = GraphBuilder("t")
    x = b.input("x", list(IN_SHAPE))
    a = b.input("a", list(IN_SHAPE), dtype=Dtype.INT32)
    y = b.layer("UpsampleByIndex", [x, a], [[IN_SHAPE[0], *TOP]], name="op", params={"flatten_dim": mode})
    return b.build([y])


def unpool_args(mode: str, seed: int) -> torch.Tensor:
    th, tw, tc = TOP
    limit = {"HW": th * tw, "HWC": th * tw * tc, "NHWC": IN_SHAPE[0] * th * tw * tc,
             "NCHW": IN_SHAPE[0] * th * tw * tc}[mode]
    # a few out-of-range and negative positions, and duplicates (small range)
    return torch.from_numpy(np.random.default_rng(seed).integers(-2, limit + 3, size=IN_SHAPE))


@pytest.mark.parametrize("mode", ["HW", "HWC", "NHWC", "NCHW"])
@pytest.mark.parametrize("bits,qmode", MODES)
def test_upsample_by_index(tmp_path, mode: str, bits: int, qmode: str) -> None:
    g = unpool_graph(mode)
    x = torch.randn(*IN_SHAPE, generator=torch.Generator().manual_seed(1)) + 0.5
    a = unpool_args(mode, 2)
    want = ref_unpool(x.numpy(), a.numpy(), mode, TOP, 0.0)
    np.testing.assert_array_equal(g.forward([x, a])[0].numpy(), want)
    qg = quantize_model(g, [[x * 0.5, a], [x, a]], settings(bits, qmode))
    node = qg.node("op")
    inp, out = node.inputs[0], node.outputs[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    assert (oq.scale, oq.zerop, out.dtype) == (iq.scale, iq.zerop, inp.dtype)
    fill = min(max(-int(iq.zerop), iq.qmin), iq.qmax)
    got = qg.forward([x, a])[0]
    np.testing.assert_array_equal(got.numpy(), ref_unpool(inp.betensor.numpy(), a.numpy(), mode, TOP, fill))
    roundtrip(tmp_path, qg, [x, a])


def test_upsample_by_index_errors() -> None:
    g = unpool_graph("HW")
    with pytest.raises(IRError, match="must both be"):
        g.forward([torch.zeros(*IN_SHAPE), torch.zeros(2, 2, 3, 1, dtype=torch.int64)])
    b = GraphBuilder("t")
    x = b.input("x", list(IN_SHAPE))
    a = b.input("a", list(IN_SHAPE))  # float positions: quantized they would not be exact
    y = b.layer("UpsampleByIndex", [x, a], [[IN_SHAPE[0], *TOP]], name="op", params={"flatten_dim": "HW"})
    with pytest.raises(UnsupportedError, match="positions must be exact integers"):
        quantize_model(b.build([y]), [[torch.randn(*IN_SHAPE), torch.rand(*IN_SHAPE) * 5]],
                       settings(8, "per_tensor_asymmetric"))


# --- OverlapAdd ----------------------------------------------------------------------------------------------------
def overlap_graph(frames: int, length: int, step: int, dtype: Dtype = Dtype.FP32):
    b = GraphBuilder("t")
    x = b.input("x", [1, 2, frames, length], dtype=dtype)
    y = b.layer("OverlapAdd", [x], [[1, 2, (frames - 1) * step + length]], name="op", params={"frame_step": step})
    return b.build([y])


def ref_overlap(x: np.ndarray, step: int) -> np.ndarray:
    frames, length = x.shape[-2:]
    out = np.zeros(x.shape[:-2] + ((frames - 1) * step + length,), dtype=x.dtype)
    for f in range(frames):
        for j in range(length):
            out[..., f * step + j] += x[..., f, j]
    return out


@pytest.mark.parametrize("step", [1, 3, 4])
@pytest.mark.parametrize("bits,mode", MODES)
def test_overlap_add(tmp_path, step: int, bits: int, mode: str) -> None:
    g = overlap_graph(5, 4, step)

    def feed(seed):
        return torch.from_numpy(np.random.default_rng(seed).normal(0.3, 1.0, size=(1, 2, 5, 4)).astype(np.float32))

    x = feed(1)
    want = ref_overlap(x.numpy().astype(np.float64), step)
    np.testing.assert_allclose(g.forward([x])[0].numpy(), want, rtol=0, atol=1e-5)
    qg = quantize_model(g, [[feed(s)] for s in (2, 3)] + [[x]], settings(bits, mode))
    node = qg.node("op")
    inp, out = node.inputs[0], node.outputs[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    assert m < 2 ** bits and out.dtype.is_signed == (iq.qmin < 0)
    got = qg.forward([x])[0]
    acc = ref_overlap(inp.betensor.numpy().astype(np.int64) + int(iq.zerop), step)
    want_q = np.vectorize(lambda v: min(max(rs(int(v) * m, n) - int(oq.zerop), oq.qmin), oq.qmax))(acc)
    np.testing.assert_array_equal(got.numpy(), want_q)
    deq = (got.double() + float(oq.zerop)) / float(oq.scale)
    assert float((deq - torch.from_numpy(want)).abs().max()) < (0.1 if bits == 8 else 0.002)
    roundtrip(tmp_path, qg, [x])


def test_overlap_add_integer_input() -> None:
    g = overlap_graph(3, 2, 1, Dtype.INT16)
    x = torch.tensor([[[[1, 2], [300, -4], [5, 6]]] * 2])
    want = ref_overlap(x.numpy(), 1)
    qg = quantize_model(g, [[x]], settings(8, "per_tensor_symmetric_full_range"))
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    assert oq.qinvariant and out.dtype == Dtype.UINT16  # sums 1, 302, 1, 6
    np.testing.assert_array_equal(qg.forward([x])[0].numpy(), want)


def test_overlap_add_bad_step() -> None:
    g = overlap_graph(3, 2, 3)
    with pytest.raises(IRError, match="frame_step 3 must be in"):
        g.forward([torch.zeros(1, 2, 3, 2)])


# --- AffineGrid ----------------------------------------------------------------------------------------------------
def affine_graph(dims, align: bool):
    k = len(dims)
    b = GraphBuilder("t")
    theta = b.input("theta", [1, k, k + 1])
    size = b.layer("Constant", [], [[k + 2]], name="size",
                   constants={"weights": np.array([1, 1, *dims], dtype=np.float32)})
    y = b.layer("AffineGrid", [theta, size], [[1, *dims, k]], name="op", params={"align_corners": align})
    return b.build([y])


def ref_coords(n: int, align: bool) -> np.ndarray:
    """Normalized pixel-centre coordinates in [-1, 1]."""
    i = np.arange(n, dtype=np.float64)
    return (2 * i + 1) / n - 1 if not align else (2 * i / (n - 1) - 1 if n > 1 else np.zeros(1))


def ref_affine(theta: np.ndarray, dims, align: bool) -> np.ndarray:
    k = len(dims)
    axes = [ref_coords(d, align) for d in dims]  # (z,) y, x
    out = np.zeros((theta.shape[0], *dims, k))
    for idx in np.ndindex(*dims):
        point = np.array([axes[a][idx[a]] for a in reversed(range(k))] + [1.0])  # x, y (, z), 1
        out[(slice(None), *idx)] = np.einsum("bij,j->bi", theta, point)
    return out


@pytest.mark.parametrize("dims", [(5, 7), (3, 4, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("bits,mode", MODES)
def test_affine_grid(tmp_path, dims, align: bool, bits: int, mode: str) -> None:
    k = len(dims)
    g = affine_graph(dims, align)

    def feed(seed):
        r = np.random.default_rng(seed)
        theta = np.eye(k, k + 1) * r.uniform(0.6, 1.2) + r.normal(0, 0.2, size=(k, k + 1))
        return [torch.from_numpy(theta[None].astype(np.float32))]

    f = feed(1)
    want = ref_affine(f[0].numpy().astype(np.float64), dims, align)
    np.testing.assert_allclose(g.forward(f)[0].numpy(), want, rtol=0, atol=2e-6)
    qg = quantize_model(g, [feed(s) for s in (2, 3, 4)] + [f], settings(bits, mode))
    node = qg.node("op")
    inp, out = node.inputs[0], node.outputs[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    frac = int(node.params["multiplier_bits"])
    assert frac == max(8, min(14, int(np.ceil(np.log2(max(dims)))) + 1))
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    luts = {}
    for name, size in zip(("w_lut", "h_lut", "d_lut"), reversed(dims)):
        lut = node.constants[name]
        assert lut.dtype == Dtype.INT16
        expect = np.clip(np.round(ref_coords(size, align) * 2 ** frac), -32768, 32767)
        assert np.abs(lut.betensor.numpy() - expect).max() <= 1  # float32 grid vs exact: at most one unit
        luts[name] = lut.betensor.tolist()
    got = qg.forward(f)[0]
    t = (inp.betensor.to(torch.int64) + int(iq.zerop))[0].tolist()
    lut_list = [luts[nm] for nm in ("w_lut", "h_lut", "d_lut")[:k]]
    want_q = np.zeros((1, *dims, k), dtype=np.int64)
    for idx in np.ndindex(*dims):
        coord = [lut_list[a][idx[k - 1 - a]] for a in range(k)]  # x, y (, z)
        for i in range(k):
            acc = sum(t[i][j] * coord[j] for j in range(k)) + (t[i][k] << frac)
            acc = min(max(acc, -2 ** 31), 2 ** 31 - 1)
            want_q[(0, *idx, i)] = min(max(rs(acc * m, n) - int(oq.zerop), oq.qmin), oq.qmax)
    np.testing.assert_array_equal(got.numpy(), want_q)
    deq = (got.double() + float(oq.zerop)) / float(oq.scale)
    # 16 bits: the tables' 2^-frac resolution (frac = 8 here) bounds the error, not the output scale
    assert float((deq - torch.from_numpy(want)).abs().max()) < (0.05 if bits == 8 else 4 * 2.0 ** -frac)
    roundtrip(tmp_path, qg, f)


def test_affine_grid_bad_theta() -> None:
    g = affine_graph((4, 4), False)
    with pytest.raises(IRError, match="theta must be"):
        g.forward([torch.zeros(1, 3, 4)])


# --- FractionalPool ------------------------------------------------------------------------------------------------
# Values of the C++ standard library (g++ / libstdc++), from this program:
#   std::mt19937 d; d.discard(9999); d()                                     -> 4123659995 (the standard's check)
#   std::mt19937 g(s); std::uniform_real_distribution<double>(0, 1)(g)       -> LIBSTDCXX_UNIFORM[s]
#   std::mt19937 h(s); std::vector<int> v{0..n-1}; std::shuffle(v.begin(), v.end(), h)  -> LIBSTDCXX_SHUFFLE[s, n]
LIBSTDCXX_UNIFORM = {1: 0.99718480823026556, 7: 0.22733907496470684, 12345: 0.89015471328273787}
LIBSTDCXX_SHUFFLE = {(1, 6): [1, 0, 2, 5, 3, 4], (1, 7): [1, 0, 6, 3, 5, 4, 2], (7, 5): [3, 0, 1, 2, 4],
                     (12345, 6): [0, 4, 3, 5, 1, 2]}


def test_fractional_sequences_follow_the_cxx_library() -> None:
    from quantopt.ops.sampling import _MT19937, _shuffle, _uniform_real

    g = _MT19937(5489)
    for _ in range(9999):
        g()
    assert g() == 4123659995
    for seed, value in LIBSTDCXX_UNIFORM.items():
        assert _uniform_real(_MT19937(seed)) == value
    for (seed, n), order in LIBSTDCXX_SHUFFLE.items():
        assert _shuffle(list(range(n)), _MT19937(seed)) == order


@pytest.mark.parametrize("pseudo", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_fractional_sequence_shape(pseudo: bool, seed: int) -> None:
    from quantopt.ops.sampling import fractional_sequence

    for n_in, n_out in ((10, 7), (9, 4), (16, 5), (6, 6)):
        seq = fractional_sequence(n_in, n_out, pseudo, seed)
        steps = np.diff(seq)
        k = n_in // n_out
        assert seq[0] == 0 and seq[-1] == n_in and len(seq) == n_out + 1
        assert set(steps.tolist()) <= {k, k + 1} and (steps == k + 1).sum() == n_in - k * n_out
        assert fractional_sequence(n_in, n_out, pseudo, seed) == seq  # deterministic, seed 0 included


def ref_fractional(x: np.ndarray, rows, cols, overlap: bool, fn) -> np.ndarray:
    n, h, w, c = x.shape
    out = np.zeros((n, len(rows) - 1, len(cols) - 1, c), dtype=np.float64)
    e = 1 if overlap else 0
    for i in range(len(rows) - 1):
        for j in range(len(cols) - 1):
            win = x[:, rows[i]:min(rows[i + 1] + e, h), cols[j]:min(cols[j + 1] + e, w), :]
            out[:, i, j, :] = fn(win.reshape(n, -1, c))
    return out


def mult_shift_8(r: float):
    """The 8-bit multiplier/shift of docs/integer-semantics.md, Requantization, in float32 like the rule."""
    r32 = np.float32(r)
    shift = int(np.floor(np.log2(np.float32(255.0) / r32)))
    m = int(np.floor(r32 * np.float32(2.0 ** shift) + np.float32(0.5)))
    return (1, 0) if m == 2 ** shift else (m, shift)


@pytest.mark.parametrize("method", ["MAX", "AVG"])
@pytest.mark.parametrize("pseudo,overlap", [(True, False), (False, True)])
@pytest.mark.parametrize("bits,mode", MODES)
def test_fractional_pool(tmp_path, method: str, pseudo: bool, overlap: bool, bits: int, mode: str) -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 10, 9, 3])
    ys = b.layer("FractionalPool", [x], [[1, 7, 4, 3], [8], [5]], name="op",
                 params={"method": method, "seed": 7, "pseudo": pseudo, "overlap": overlap},
                 output_dtypes=[Dtype.FP32, Dtype.INT32, Dtype.INT32])
    g = b.build(ys)

    def feed(seed):
        return [torch.from_numpy(np.random.default_rng(seed).normal(0.3, 1.0, size=(1, 10, 9, 3)).astype(np.float32))]

    f = feed(1)
    y, rows, cols = g.forward(f)
    rows, cols = rows.tolist(), cols.tolist()
    fn = (lambda v: v.max(axis=1)) if method == "MAX" else (lambda v: v.mean(axis=1))
    np.testing.assert_allclose(y.numpy(), ref_fractional(f[0].numpy().astype(np.float64), rows, cols, overlap, fn),
                               rtol=0, atol=1e-6)
    qg = quantize_model(g, [feed(s) for s in (2, 3)] + [f], settings(bits, mode))
    node = qg.node("op")
    inp, out = node.inputs[0], node.outputs[0]
    iq, oq = params_of(node, inp), params_of(node, out)
    assert (oq.scale, oq.zerop, out.dtype) == (iq.scale, iq.zerop, inp.dtype)
    assert [o.dtype for o in node.outputs[1:]] == [Dtype.INT16, Dtype.INT16]
    qy, qrows, qcols = qg.forward(f)
    assert qrows.tolist() == rows and qcols.tolist() == cols
    q = inp.betensor.numpy().astype(np.int64)
    if method == "MAX":
        want = ref_fractional(q, rows, cols, overlap, lambda v: v.max(axis=1))
    else:
        def avg(v):
            m, n = mult_shift_8(1.0 / v.shape[1])
            return np.vectorize(lambda s: min(max(rs(int(s) * m, n), oq.qmin), oq.qmax))(v.sum(axis=1))
        want = ref_fractional(q, rows, cols, overlap, avg)
    np.testing.assert_array_equal(qy.numpy(), want.astype(np.int64))
    roundtrip(tmp_path, qg, f)
