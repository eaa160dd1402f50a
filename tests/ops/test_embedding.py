"""EmbeddingLookupSparse (ops/embedding.py): the float forward against a numpy re-implementation of TensorFlow's
embedding_lookup_sparse, the placeholders it records, quantize (params as docs/semantics/embedding.md states them),
the integer forward against an independent python-int reference written from that page, dequantized integer output
close to float, a re-read IR bit-identical, and clear errors for bad inputs and unsupported params."""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of

import quantopt.ops.embedding  # noqa: F401  (registers the op even when imported alone)
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_asymmetric"), (8, "per_tensor_symmetric_full_range"), (16, "per_tensor_symmetric_full_range")]
SEGMENTS = [0, 0, 1, 3, 3, 3, 4, 4]  # segment 2 is empty
IDS = [5, 1, 0, 3, 3, 2, 4, 1]


def settings(bits: int, mode: str) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_strategy_activation="extrema")


def graph(combiner: str, rows: int = 6, max_norm: Any = "NONE", n: int = 8):
    b = GraphBuilder("t")
    ins = [b.input("params", [6, 4]), b.input("segments", [n], dtype=Dtype.INT32),
           b.input("ids", [n], dtype=Dtype.INT32), b.input("weights", [n])]
    y = b.layer("EmbeddingLookupSparse", ins, [[rows, 4]], name="op",
                params={"combiner": combiner, "max_norm": max_norm})
    return b.build([y])


def feeds(seed: int, count: int = 4, w_lo: float = 0.2) -> List[List[torch.Tensor]]:
    r = np.random.default_rng(seed)
    return [[torch.from_numpy(r.normal(0.2, 1.0, size=(6, 4)).astype(np.float32)), torch.tensor(SEGMENTS),
             torch.tensor(IDS), torch.from_numpy(r.uniform(w_lo, 1.5, size=8).astype(np.float32))]
            for _ in range(count)]


def np_reference(p: np.ndarray, seg: Sequence[int], ids: Sequence[int], w: np.ndarray, combiner: str,
                 rows: int) -> np.ndarray:
    out = np.zeros((rows, p.shape[1]), dtype=np.float64)
    for j in range(rows):
        members = [i for i, s in enumerate(seg) if s == j]
        if not members:
            continue
        total = sum(p[ids[i]].astype(np.float64) * float(w[i]) for i in members)
        den = {"SUM": 1.0, "MEAN": sum(float(w[i]) for i in members),
               "SQRTN": np.sqrt(sum(float(w[i]) ** 2 for i in members))}[combiner]
        out[j] = total / den if den else 0.0
    return out


def bits_of(lo: int, hi: int, signed: bool) -> int:
    if lo < 0 or signed:
        b = 1
        while lo < -(2 ** (b - 1)) or hi > 2 ** (b - 1) - 1:
            b += 1
        return b
    return hi.bit_length()


def rhe(v: Fraction) -> int:
    f = v.numerator // v.denominator
    rem = v - f
    return f + (1 if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2) else 0)


TABLE = [min(32767, round(2 ** 15 / (1 + j / 64) ** 0.5)) for j in range(193)]

UPSTREAM_INVERSE_SQRT = [(0, 32767, 16), (1, 32767, 16), (2, 23170, 16), (3, 18919, 16), (100, 26214, 13),
                         (4999, 29661, 10), (1048575, 32767, 6), (700346781657, 20529, -3), (296633628802, 31543, -3),
                         (45050865998, 20235, -1), (18172327443, 31861, -1), (894200084524, 18167, -3),
                         (1003585370534, 17149, -3), (536870911, 23170, 2), (4398046511103, 32767, -5),
                         (255, 16416, 13), (8191, 23171, 10)]
"""(v, R, E) from upstream's inverse square root (run once as an oracle): R · 2^(E - 31) ≈ 1 / sqrt(v)."""


def ref_inverse_sqrt(v: int):
    """docs/semantics/embedding.md, SQRTN, with python ints (numpy only for the float32 logarithm)."""
    over = max(v.bit_length() - 31, 0)
    over += over & 1
    u = v >> over
    k = min(max(31 - u.bit_length(), 0), 30)
    u <<= k
    e = 31 - k
    f = u >> 1 if e % 2 else u
    i = max((f >> 23) - 64, 0)
    a = (f >> 8) % 2 ** 15
    g = ((TABLE[i] << 16) - 2 * a * (TABLE[i] - TABLE[i + 1])) >> ((e - 1) >> 1)
    bits = int(np.ceil(np.float32(np.log2(np.float64(np.float32(g))))))
    cut = max(bits - 15, 0)
    return min(max(g >> cut, 0), 32767), cut - over // 2


def ref_sqrtn(node, acc, qw: np.ndarray, req) -> np.ndarray:
    p_t, w_t = params_of(node, node.inputs[0]), params_of(node, node.inputs[3])
    (m0, m1), (n0, n1) = node.params["scale_value"], node.params["shift_value"]
    pre = int(node.params["reciprocal_shift_value"])
    p_signed = int(p_t.qmin) + int(p_t.zerop) < 0
    bits = int(p_t.qbits)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if p_signed else (0, 2 ** bits - 1)
    squares = [0] * len(acc)
    for i, s in enumerate(SEGMENTS):
        squares[s] += (int(qw[i]) + int(w_t.zerop)) ** 2

    def clamp(v: int, b: int) -> int:
        return min(max(v, -(2 ** (b - 1))), 2 ** (b - 1) - 1)

    res = []
    for row, sq in zip(acc, squares):
        r, e = ref_inverse_sqrt(sq)
        line = []
        for a in row:
            x = min(max(rhe(Fraction(a * m0, 2 ** n0)), lo), hi)
            x = clamp(clamp(x * m1, 32) >> pre, 16)
            x = clamp(x * r, 32)
            line.append(req(x, 1, n1 + 31 - pre - e))
        res.append(line)
    return np.array(res)


def test_inverse_sqrt_matches_upstream_and_reference() -> None:
    from quantopt.ops.embedding import inverse_sqrt, isqrt_table
    assert isqrt_table().tolist() == TABLE
    v = torch.tensor([t[0] for t in UPSTREAM_INVERSE_SQRT] + list(range(0, 3000, 7)) + [2 ** k + d for k in range(40)
                                                                                      for d in (-1, 0, 1)])
    r, e = inverse_sqrt(v, isqrt_table())
    assert list(zip(r.tolist()[:17], e.tolist()[:17])) == [t[1:] for t in UPSTREAM_INVERSE_SQRT]
    assert list(zip(r.tolist(), e.tolist())) == [ref_inverse_sqrt(int(x)) for x in v]
    good = v > 0
    approx = r[good].double() * 2.0 ** (e[good].double() - 31)
    np.testing.assert_allclose(approx.numpy(), 1 / np.sqrt(v[good].double().numpy()), rtol=2e-3)


def ref_int(node, qp: np.ndarray, qw: np.ndarray, rows: int) -> np.ndarray:
    """docs/semantics/embedding.md, Integer, with python ints."""
    p_t, w_t = params_of(node, node.inputs[0]), params_of(node, node.inputs[3])
    out = params_of(node, node.outputs[0])
    combiner = str(node.params["combiner"]).upper()
    zp_p, zp_w = int(p_t.zerop), int(w_t.zerop)

    def req(x: int, mul: int, sh: int) -> int:
        v = rhe(Fraction(x * mul, 2 ** sh)) if sh >= 0 else x * mul * 2 ** -sh
        return min(max(v - int(out.zerop), int(out.qmin)), int(out.qmax))

    acc = [[0] * qp.shape[1] for _ in range(rows)]
    wsum = [0] * rows
    for i, (s, k) in enumerate(zip(SEGMENTS, IDS)):
        v = int(qw[i]) + zp_w
        wsum[s] += v
        for c in range(qp.shape[1]):
            acc[s][c] += (int(qp[k, c]) + zp_p) * v
    if combiner == "SQRTN":
        return ref_sqrtn(node, acc, qw, req)
    m, n = int(node.params["scale_value"]), int(node.params["shift_value"])
    if combiner == "SUM":
        return np.array([[req(a, m, n) for a in row] for row in acc])
    p_signed, w_signed = int(p_t.qmin) + zp_p < 0, int(w_t.qmin) + zp_w < 0
    big = [a * m for row in acc for a in row]
    e0 = max(bits_of(min(big), max(big), p_signed) - 32, 0)
    e1 = max(bits_of(min(wsum), max(wsum), w_signed) - 16, 0)
    lo32, hi32 = (-(2 ** 31), 2 ** 31 - 1) if p_signed else (0, 2 ** 32 - 1)
    lo16, hi16 = (-(2 ** 15), 2 ** 15 - 1) if w_signed else (0, 2 ** 16 - 1)
    res = []
    for j, row in enumerate(acc):
        wj = min(max(wsum[j] >> e1, lo16), hi16)
        line = []
        for a in row:
            bj = min(max((a * m) >> e0, lo32), hi32)
            q = 0 if wj == 0 else int(Fraction(bj, wj))  # int() of a Fraction truncates toward zero
            line.append(req(q, 1, n - e0 + e1))
        res.append(line)
    return np.array(res)


@pytest.mark.parametrize("combiner", ["SUM", "MEAN", "SQRTN"])
def test_float_forward_and_placeholders(combiner: str) -> None:
    g = graph(combiner)
    f = feeds(1, 1)[0]
    y = g.forward(f)[0]
    expect = np_reference(f[0].numpy(), SEGMENTS, IDS, f[3].numpy(), combiner, 6)
    np.testing.assert_allclose(y.numpy(), expect, rtol=1e-5, atol=1e-6)
    node = g.nodes[-1]
    assert [t.name for t in node.placeholders] == ["op/params_sum", "op/weights_sum"]
    np.testing.assert_allclose(node.placeholders[0].betensor.numpy(),
                               np_reference(f[0].numpy(), SEGMENTS, IDS, f[3].numpy(), "SUM", 6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("combiner", ["SUM", "MEAN", "SQRTN"])
def test_integer_forward(combiner: str, bits: int, mode: str) -> None:
    g = graph(combiner)
    batches = feeds(2)
    feed = batches[1]
    fy = g.forward(feed)[0].clone()
    qg = quantize_model(g, batches, settings(bits, mode))
    node = qg.nodes[-1]
    p_t, w_t = params_of(node, node.inputs[0]), params_of(node, node.inputs[3])
    out = params_of(node, qg.output_tensors[0])
    ratio = float(out.scale) / float(p_t.scale) / (float(w_t.scale) if combiner == "SUM" else 1.0)
    if combiner == "SQRTN":
        s_ps = float(params_of(node, node.placeholders[0]).scale)
        (m0, m1), (n0, n1) = node.params["scale_value"], node.params["shift_value"]
        assert m0 * 2.0 ** -n0 == pytest.approx(s_ps / float(p_t.scale) / float(w_t.scale), rel=2.0 ** -(bits - 2))
        assert m1 * 2.0 ** -n1 == pytest.approx(float(out.scale) * float(w_t.scale) / s_ps, rel=2.0 ** -(bits - 2))
        assert node.constants["lut"].dtype == Dtype.INT16 and node.constants["lut"].betensor.tolist() == TABLE
    else:
        mult_bits = bits if combiner == "SUM" else 16  # M has at least mult_bits - 1 significant bits
        assert node.params["scale_value"] * 2.0 ** -node.params["shift_value"] == pytest.approx(
            ratio, rel=2.0 ** -(min(mult_bits, 15) - 1))
    qy = qg.forward(feed)[0]
    expect = ref_int(node, qg.input_tensors[0].betensor.numpy(), qg.input_tensors[3].betensor.numpy(), 6)
    np.testing.assert_array_equal(qy.numpy(), expect)
    dy = run_quantized(qg, feed)[0]
    span = float(fy.abs().max())
    np.testing.assert_allclose(dy.numpy(), fy.numpy(), atol=(0.05 if bits == 8 else 0.003) * span)
    assert float(dy[2].abs().max()) <= 1.0 / float(out.scale)  # the empty segment stays (about) 0
    assert float(dy[5].abs().max()) <= 1.0 / float(out.scale)  # the row beyond the last segment too


@pytest.mark.parametrize("combiner", ["MEAN", "SQRTN"])
def test_ir_round_trip(tmp_path, combiner: str) -> None:
    g = graph(combiner)
    batches = feeds(3)
    qg = quantize_model(g, batches, settings(*MODES[0]))
    before = qg.forward(batches[0])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    assert torch.equal(read_ir(txt).forward(batches[0])[0], before)


def test_max_norm_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="max_norm"):
        graph("SUM", max_norm=1.5).forward(feeds(4, 1)[0])


@pytest.mark.parametrize("change,match", [
    (lambda f: f.__setitem__(2, torch.tensor([5, 1, 0, 3, 3, 2, 6, 1])), r"ids must lie in \[0, 6\)"),
    (lambda f: f.__setitem__(1, torch.tensor([0, 1, 0, 3, 3, 3, 4, 4])), "sorted"),
    (lambda f: f.__setitem__(1, torch.tensor([0, 0, 1, 3, 3, 3, 4, 6])), "beyond the output's 6 rows"),
])
def test_bad_inputs(change, match: str) -> None:
    f = feeds(5, 1)[0]
    change(f)
    with pytest.raises(IRError, match=match):
        graph("SUM").forward(f)


def test_bad_combiner_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="combiner must be one of"):
        graph("MAX").forward(feeds(6, 1)[0])
