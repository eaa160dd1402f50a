"""RotaryEmbedding: float forward against a numpy rotation written from docs/semantics/transformer.md (complex
multiplication of feature pairs), quantized params (float32 ratios as upstream computes them), integer forward
equal to a Python-Fraction reference (exact rationals, round half to even) in symmetric and asymmetric modes,
dequantized output close to float, IR write -> re-read bit identity, and bad params."""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from range_helpers import range_of

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


def caches(positions: int, half: int):
    inv = 1.0 / (10000.0 ** (np.arange(half) / half))
    ang = np.arange(positions)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_graph(shape: List[int], dim: int, interleaved: bool, heads: Optional[int] = None, positions: bool = False,
               cache_shape=(9, 4)):
    b = GraphBuilder("t")
    x = b.input("x", shape)
    cos, sin = caches(cache_shape[0], cache_shape[1])
    c = b.layer("Constant", [], [list(cos.shape)], name="cos", constants={"weights": cos})
    s = b.layer("Constant", [], [list(sin.shape)], name="sin", constants={"weights": sin})
    ins = [x, c, s]
    if positions:
        ins.append(b.input("pos", [shape[0], shape[-2]], dtype=Dtype.INT32))
    params: Dict[str, Any] = {"rotary_embedding_dim": dim, "interleaved": interleaved}
    if heads is not None:
        params["num_heads"] = heads
    y = b.layer("RotaryEmbedding", ins, [shape], name="op", params=params)
    return b.build([y])


def ref_pairs(x4: np.ndarray, dim: int, interleaved: bool):
    """Index pairs (i, j) of the rotated features: real part at i, imaginary at j."""
    half = dim // 2
    return [(2 * k, 2 * k + 1) if interleaved else (k, k + half) for k in range(half)]


def ref_rope(x: np.ndarray, dim: int, interleaved: bool, heads: Optional[int], pos: Optional[np.ndarray]):
    cos, sin = caches(9, 4)
    x4 = x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3) if x.ndim == 3 else x
    y = x4.astype(np.float64).copy()
    b, h, s, _ = x4.shape
    for bi in range(b):
        for si in range(s):
            p = si if pos is None else int(pos[bi, si])
            for k, (i, j) in enumerate(ref_pairs(x4, dim, interleaved)):
                rot = complex(float(cos[p, k]), float(sin[p, k]))
                v = (x4[bi, :, si, i].astype(np.float64) + 1j * x4[bi, :, si, j]) * rot
                y[bi, :, si, i], y[bi, :, si, j] = v.real, v.imag
    if x.ndim == 3:
        y = y.transpose(0, 2, 1, 3).reshape(x.shape)
    return y


CASES = [([2, 2, 5, 8], 6, False, None), ([1, 5, 16], 6, True, 2), ([1, 2, 4, 6], 0, False, None)]


def feeds(seed: int, shape: List[int], positions: bool = False):
    rng = np.random.default_rng(seed)
    f = [torch.from_numpy(rng.normal(0.3, 1.2, size=shape).astype(np.float32))]
    if positions:
        f.append(torch.from_numpy(rng.integers(0, 9, size=(shape[0], shape[-2]))))
    return f


@pytest.mark.parametrize("shape,dim,interleaved,heads", CASES)
def test_rope_float(shape, dim, interleaved, heads) -> None:
    for positions in (False, True):
        g = rope_graph(shape, dim, interleaved, heads, positions)
        f = feeds(1, shape, positions)
        got = g.forward(f)[0].numpy()
        pos = f[1].numpy() if positions else None
        want = ref_rope(f[0].numpy(), dim or shape[-1] if heads is None else dim, interleaved, heads, pos)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        rest = (dim or 10 ** 6)
        if heads is None and rest < shape[-1]:  # the features beyond rotary_embedding_dim pass unchanged
            np.testing.assert_array_equal(got[..., rest:], f[0].numpy()[..., rest:])


def ref_int(qg, f) -> np.ndarray:
    """The integer rotation with exact rationals: round_half_even(r_cos·C·X1 ∓ r_sin·S·X2) - zp_out."""
    node = qg.node("op")
    tx = node.inputs[0]
    xq, cq, sq = (params_of(node, t) for t in node.inputs[:3])
    out = params_of(node, node.outputs[0])
    r = {k: Fraction(float(np.float32(node.params[k]))) for k in
         ("rotate_rescale_cos", "rotate_rescale_sin", "not_rotate_rescale")}
    qg.forward(f)
    x = tx.betensor.numpy().astype(np.int64) + int(xq.zerop)
    # the graph frees intermediate tensors after use: the caches are read from their Constant layers
    c = qg.node("cos").constants["weights"].betensor.numpy().astype(np.int64) + int(cq.zerop)
    s = qg.node("sin").constants["weights"].betensor.numpy().astype(np.int64) + int(sq.zerop)
    dim = int(node.params["rotary_embedding_dim"]) or x.shape[-1]
    interleaved = bool(node.params["interleaved"])
    y = np.zeros(x.shape, dtype=np.int64)

    def q(v: Fraction) -> int:
        return min(max(round(v) - int(out.zerop), int(out.qmin)), int(out.qmax))

    b, h, n, d = x.shape
    for idx in np.ndindex(b, h, n):
        bi, hi, si = idx
        for k, (i, j) in enumerate(ref_pairs(x, dim, interleaved)):
            x1, x2 = int(x[bi, hi, si, i]), int(x[bi, hi, si, j])
            cc, ss = int(c[si, k]), int(s[si, k])
            y[bi, hi, si, i] = q(r["rotate_rescale_cos"] * cc * x1 - r["rotate_rescale_sin"] * ss * x2)
            y[bi, hi, si, j] = q(r["rotate_rescale_sin"] * ss * x1 + r["rotate_rescale_cos"] * cc * x2)
        for i in range(dim, d):
            y[bi, hi, si, i] = q(r["not_rotate_rescale"] * int(x[bi, hi, si, i]))
    return y


@pytest.mark.parametrize("bits,mode", MODES)
def test_rope_quantized(tmp_path, bits: int, mode: str) -> None:
    shape = [2, 2, 5, 8]
    g = rope_graph(shape, 6, False)
    qg = quantize_model(g, [feeds(s, shape) for s in (2, 3, 4, 5, 6)], settings(bits, mode))
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    assert oq.qmin < 0 and oq.qbits == bits
    s_x, s_c, s_s, s_o = (np.float32(params_of(node, t).scale) for t in (node.inputs[0], node.inputs[1],
                                                                         node.inputs[2], out))
    assert np.float32(node.params["rotate_rescale_cos"]) == np.float32(s_o / np.float32(s_x * s_c))
    assert np.float32(node.params["not_rotate_rescale"]) == np.float32(s_o / s_x)
    for seed in (5, 6):
        f = feeds(seed, shape)
        got = qg.forward(f)[0].numpy()
        np.testing.assert_array_equal(got, ref_int(qg, f))
        deq = (got + float(oq.zerop)) / float(oq.scale)
        flt = g.forward(f)[0].numpy()
        tol = 2.5 / float(oq.scale) + 4.0 / float(params_of(node, node.inputs[0]).scale)
        assert np.abs(deq - np.clip(flt, range_of(node, out).min, range_of(node, out).max)).max() <= tol
    before = qg.forward(feeds(7, shape))[0].clone()
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert torch.equal(before, re.forward(feeds(7, shape))[0])


def test_rope_quantized_positions_and_3d() -> None:
    shape = [1, 5, 16]
    g = rope_graph(shape, 6, True, heads=2, positions=True)
    f = feeds(1, shape, True)
    qg = quantize_model(g, [feeds(s, shape, True) for s in (1, 2, 3)], settings(8, "per_tensor_symmetric_full_range"))
    got = qg.forward(f)[0].numpy()
    flt = g.forward(f)[0].numpy()
    out = params_of(qg.node("op"), qg.node("op").outputs[0])
    assert np.abs(got / float(out.scale) - flt).max() < 6.0 / float(out.scale)


def test_rope_bad_params() -> None:
    g = rope_graph([1, 2, 5, 8], 5, False)
    with pytest.raises(IRError, match="must be even"):
        g.forward(feeds(1, [1, 2, 5, 8]))
    g = rope_graph([1, 5, 16], 6, False)  # 3-D without num_heads
    with pytest.raises(IRError, match="num_heads"):
        g.forward(feeds(1, [1, 5, 16]))
    g = rope_graph([1, 2, 5, 8], 8, False, cache_shape=(9, 3))  # cache narrower than dim/2
    with pytest.raises(IRError, match="fewer than"):
        g.forward(feeds(1, [1, 2, 5, 8]))
    g = rope_graph([1, 2, 5, 8], 6, False, positions=True)
    with pytest.raises(IRError, match="position_ids must be in"):
        g.forward([feeds(1, [1, 2, 5, 8])[0], torch.full((1, 5), 9)])


def test_rope_quantized_position_input_must_be_integer() -> None:
    b = GraphBuilder("t")
    x = b.input("x", [1, 1, 3, 4])
    c = b.input("c", [6, 2])
    s = b.input("s", [6, 2])
    p = b.input("p", [1, 3])  # a float position input is quantized, not exact integers
    y = b.layer("RotaryEmbedding", [x, c, s, p], [[1, 1, 3, 4]], name="op", params={})
    g = b.build([y])
    rng = np.random.default_rng(0)
    f = [torch.from_numpy(rng.normal(size=(1, 1, 3, 4)).astype(np.float32)),
         torch.rand(6, 2), torch.rand(6, 2), torch.tensor([[0.0, 1.0, 2.0]])]
    qg = quantize_model(g, [f], settings(8, "per_tensor_symmetric_full_range"))
    with pytest.raises(UnsupportedError, match="position_ids"):
        qg.forward(f)


# --- CacheUpdate ----------------------------------------------------------------------------------------------------
def cache_graph(positions: List[int], rows: int, blocks: int = 2, block: int = 1, n: Optional[int] = None):
    b = GraphBuilder("t")
    buf = b.input("buffer", [blocks, 1, 6, 8])
    entries = b.input("entries", [1, 2, len(positions) if n is None else n, 4])
    p = b.input("positions", [1, len(positions)], dtype=Dtype.INT32)
    y = b.layer("CacheUpdate", [buf, p, entries], [[1, 2, rows, 4], [blocks, 1, 6, 8]], name="op",
                params={"block_index": block}, outputs=["cached", "new_buffer"])
    return b.build(y)


def ref_cache(buf: np.ndarray, pos: List[int], entries: np.ndarray, block: int, rows: int, fill):
    """Plain loops: row p of the block gets entries[0, :, k, :] flattened (head-major); output 0 lists rows
    0..p (one position) or the positions, padded with `fill` to `rows`."""
    new = buf.copy()
    heads, n, hd = entries.shape[1:]
    for k, p in enumerate(pos):
        new[block, 0, p, :] = entries[0, :, k if n > 1 else 0, :].reshape(-1)
    read = list(range(pos[0] + 1)) if len(pos) == 1 else pos
    out = np.full((1, heads, rows, hd), fill, dtype=new.dtype)
    for j, r in enumerate(read[:rows]):
        out[0, :, j, :] = new[block, 0, r, :].reshape(heads, hd)
    return out, new


def cache_feeds(seed: int, pos: List[int], n: Optional[int] = None):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.normal(0, 1, size=(2, 1, 6, 8)).astype(np.float32)),
            torch.from_numpy(rng.normal(0.3, 1.6, size=(1, 2, len(pos) if n is None else n, 4)).astype(np.float32)),
            torch.tensor([pos])]


@pytest.mark.parametrize("pos,rows,n", [([3], 5, None), ([1, 4, 2], 3, None), ([0, 5], 2, 1)])
def test_cache_update_float(pos, rows, n) -> None:
    g = cache_graph(pos, rows, n=n)
    f = cache_feeds(1, pos, n)
    got, new = g.forward(f)
    want, want_new = ref_cache(f[0].numpy(), pos, f[1].numpy(), 1, rows, 0.0)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(new.numpy(), want_new)
    assert not np.array_equal(f[0].numpy(), want_new)  # the input buffer is not changed in place


@pytest.mark.parametrize("bits,mode", MODES)
def test_cache_update_quantized(tmp_path, bits: int, mode: str) -> None:
    pos, rows = [3], 5
    g = cache_graph(pos, rows)
    qg = quantize_model(g, [cache_feeds(s, pos) for s in (2, 3, 4)], settings(bits, mode))
    node = qg.node("op")
    tb, _, te = node.inputs
    bp, ep = params_of(node, tb), params_of(node, te)
    for out in node.outputs:  # both outputs carry the entries' params
        oq = params_of(node, out)
        assert (oq.scale, oq.zerop, out.dtype, oq.qmin, oq.qmax) == (ep.scale, ep.zerop, te.dtype, ep.qmin, ep.qmax)
    assert bp.scale != ep.scale
    f = cache_feeds(5, pos)
    got, new = (t.numpy() for t in qg.forward(f))
    qb, qe = tb.betensor.numpy().astype(np.int64), te.betensor.numpy().astype(np.int64)
    # the buffer's integers re-expressed in the entries' scale: exact rationals, round half to even
    sb, se = Fraction(float(np.float32(bp.scale))), Fraction(float(np.float32(ep.scale)))
    conv = np.vectorize(lambda q: min(max(round((int(q) + int(bp.zerop)) * se / sb) - int(ep.zerop), int(ep.qmin)),
                                      int(ep.qmax)))
    fill = min(max(-int(ep.zerop), int(ep.qmin)), int(ep.qmax))
    want, want_new = ref_cache(conv(qb).astype(np.int64), pos, qe, 1, rows, fill)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(new, want_new)
    flt = g.forward(f)[1].numpy()
    deq = (new + float(ep.zerop)) / float(ep.scale)
    r = qg.ranges.get(te)
    assert np.abs(deq - np.clip(flt, r.min, r.max)).max() < 1.01 / float(ep.scale) + 1.01 / float(bp.scale)
    before = [t.clone() for t in qg.forward(f)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(f)):
        assert torch.equal(a, b)


def test_cache_update_bad() -> None:
    g = cache_graph([3], 4, block=2)
    with pytest.raises(IRError, match="block_index=2"):
        g.forward(cache_feeds(1, [3]))
    g = cache_graph([6], 4)
    with pytest.raises(IRError, match="positions must be in"):
        g.forward(cache_feeds(1, [6]))
    g = cache_graph([1, 2], 2, n=3)
    with pytest.raises(IRError, match="3 entries for 2 positions"):
        g.forward(cache_feeds(1, [1, 2], n=3))


# --- SlotUpdate and QueryRebatch -------------------------------------------------------------------------------------
SLOTS = [[0, 2, 4], [2, 3]]


def slot_graph(slots=SLOTS, positions: int = 5, x_dtype=Dtype.FP32):
    b = GraphBuilder("t")
    x = b.input("x", [2, len(slots), 3, 4], dtype=x_dtype)
    ins = [x] + [b.input(f"i{k}", [len(s)], dtype=Dtype.INT32) for k, s in enumerate(slots)]
    y = b.layer("SlotUpdate", ins, [[2, positions, 4]], name="op")
    return b.build([y])


def slot_feeds(seed: int, slots=SLOTS):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.normal(0.2, 1.3, size=(2, len(slots), 3, 4)).astype(np.float32))] + \
        [torch.tensor(s) for s in slots]


def ref_slot(x: np.ndarray, slots, positions: int) -> np.ndarray:
    out = np.zeros((x.shape[0], positions, x.shape[3]), dtype=x.dtype)
    for i, idx in enumerate(slots):
        for k, p in enumerate(idx):
            out[:, p] += x[:, i, k]
    return out


def test_slot_update_float() -> None:
    g = slot_graph()
    f = slot_feeds(1)
    np.testing.assert_allclose(g.forward(f)[0].numpy(), ref_slot(f[0].numpy(), SLOTS, 5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,mode", MODES)
def test_slot_update_quantized(tmp_path, bits: int, mode: str) -> None:
    g = slot_graph()
    qg = quantize_model(g, [slot_feeds(s) for s in (2, 3, 4, 5)], settings(bits, mode))
    node = qg.node("op")
    x_t, out = node.inputs[0], node.outputs[0]
    xq, oq = params_of(node, x_t), params_of(node, out)
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    ratio = np.float32(np.float32(oq.scale) / np.float32(xq.scale))
    assert m < 2 ** bits and abs(m / 2.0 ** n - ratio) <= ratio * 2.0 ** (1 - bits) + 2.0 ** -n
    assert node.params["shift_type"] == Dtype.INT8
    f = slot_feeds(5)
    got = qg.forward(f)[0].numpy()
    acc = ref_slot(x_t.betensor.numpy().astype(np.int64) + int(xq.zerop), SLOTS, 5)
    want = np.vectorize(lambda a: min(max(round(Fraction(int(a) * m, 2 ** n)) - int(oq.zerop), int(oq.qmin)),
                                      int(oq.qmax)))(acc)
    np.testing.assert_array_equal(got, want)
    deq = (got + float(oq.zerop)) / float(oq.scale)
    assert np.abs(deq - g.forward(f)[0].numpy()).max() < 2.5 / float(oq.scale) + 3.0 / float(xq.scale)
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert torch.equal(re.forward(f)[0], qg.forward(f)[0])


def test_slot_update_integer_input() -> None:
    g = slot_graph(x_dtype=Dtype.INT8)
    x = torch.from_numpy(np.random.default_rng(0).integers(70, 100, size=(2, 2, 3, 4)))  # position 2 sums to > 127
    f = [x] + [torch.tensor(s) for s in SLOTS]
    qg = quantize_model(g, [f], settings(8, "per_tensor_symmetric_full_range"))
    out = qg.node("op").outputs[0]
    assert params_of(qg.node("op"), out).qinvariant and out.dtype == Dtype.INT16  # sums of two int8 values
    np.testing.assert_array_equal(qg.forward(f)[0].numpy(), ref_slot(x.numpy(), SLOTS, 5))


def test_slot_update_bad() -> None:
    g = slot_graph([[0, 2, 5], [1]])
    with pytest.raises(IRError, match=r"values in \[0, 5\)"):
        g.forward(slot_feeds(1, [[0, 2, 5], [1]]))
    g = slot_graph([[0, 1, 2, 3], [1]])
    with pytest.raises(IRError, match="4 entries"):
        g.forward([torch.zeros(2, 2, 3, 4), torch.tensor([0, 1, 2, 3]), torch.tensor([1])])


QUERIES = [[0, 2, 5], [1, 3]]


def rebatch_graph(length: int = 3):
    b = GraphBuilder("t")
    x = b.input("x", [2, 6, 4])
    ins = [x] + [b.input(f"i{k}", [len(q)], dtype=Dtype.INT32) for k, q in enumerate(QUERIES)]
    y = b.layer("QueryRebatch", ins, [[2, len(QUERIES), length, 4]], name="op")
    return b.build([y])


def ref_rebatch(x: np.ndarray, queries, length: int, fill) -> np.ndarray:
    out = np.full((x.shape[0], len(queries), length, x.shape[2]), fill, dtype=x.dtype)
    for i, q in enumerate(queries):
        for k, p in enumerate(q):
            out[:, i, k] = x[:, p]
    return out


@pytest.mark.parametrize("bits,mode", MODES)
def test_query_rebatch(bits: int, mode: str) -> None:
    g = rebatch_graph(4)
    rng = np.random.default_rng(bits)
    feeds_of = [[torch.from_numpy(rng.normal(0.5, 1.0, size=(2, 6, 4)).astype(np.float32))] +
                [torch.tensor(q) for q in QUERIES] for _ in range(3)]
    f = feeds_of[0]
    np.testing.assert_array_equal(g.forward(f)[0].numpy(), ref_rebatch(f[0].numpy(), QUERIES, 4, 0.0))
    qg = quantize_model(g, feeds_of, settings(bits, mode))
    node = qg.node("op")
    x_t, out = node.inputs[0], node.outputs[0]
    xq, oq = params_of(node, x_t), params_of(node, out)
    assert (oq.scale, oq.zerop, out.dtype) == (xq.scale, xq.zerop, x_t.dtype)
    got = qg.forward(f)[0].numpy()
    fill = min(max(-int(oq.zerop), int(oq.qmin)), int(oq.qmax))
    np.testing.assert_array_equal(got, ref_rebatch(x_t.betensor.numpy(), QUERIES, 4, fill))
    assert np.abs((got + float(oq.zerop)) / float(oq.scale) - g.forward(f)[0].numpy()).max() <= \
        0.51 / float(oq.scale)


def test_query_rebatch_bad() -> None:
    g = rebatch_graph(2)
    with pytest.raises(IRError, match="more than the output's dim 2"):
        g.forward([torch.zeros(2, 6, 4)] + [torch.tensor(q) for q in QUERIES])
    g = rebatch_graph(3)
    with pytest.raises(IRError, match=r"values in \[0, 6\)"):
        g.forward([torch.zeros(2, 6, 4), torch.tensor([0, 6, 1]), torch.tensor([1, 2])])
