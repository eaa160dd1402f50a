"""Pooling L1/L2, GlobalPool, AdaptivePool, Pooling3D, MaxPoolingWithArgMax and MaxUnpool: float forward against
torch / onnxruntime / naive loops, integer forward against an independent python-int reference written from
docs/semantics/pooling.md, float-vs-dequantized cosine, IR write → re-read bit identity, and bad params."""
from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from int_refs import avg_ref, clamp, rhe_div
from quant_helpers import params_of
from test_pooling import _out_size

from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"), (16, "per_tensor_symmetric_full_range")]


def data(shape: Sequence[int], seed: int, n: int = 3, loc: float = 0.3, scale: float = 1.0) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(loc, scale, size=shape).astype(np.float32)) for _ in range(n)]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    s = {"q_mode_activation": mode, "q_bits_activation": bits, "q_strategy_activation": "extrema",
         "lut_items_in_bits": 10 if bits > 8 else 8}
    if bits > 8:
        s["q_bits_bias"] = 48
    s.update(extra)
    return s


def one_layer(optype: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]],
              params: Dict[str, Any], in_dtypes: Optional[Sequence[Dtype]] = None):
    b = GraphBuilder("t")
    ins = [b.input(f"x{i}", list(s), dtype=(in_dtypes or [Dtype.FP32] * len(in_shapes))[i])
           for i, s in enumerate(in_shapes)]
    outs = b.layer(optype, ins, [list(s) for s in out_shapes], name="op", params=params)
    return b.build(outs if isinstance(outs, list) else [outs])


def roundtrip_equal(tmp_path, qg, inputs: Sequence[torch.Tensor]) -> None:
    before = [t.clone() for t in qg.forward(list(inputs))]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    after = re.forward(list(inputs))
    for a, b in zip(before, after):
        assert b.dtype == torch.int64 and torch.equal(a, b)


# --- independent reference helpers (python ints, no quantopt code) -----------------------------------------------
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift); shift <= 0 is an exact left shift."""
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


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


def axis_windows(n: int, k: int, s: int, d: int, before: int, after: int, ceil: bool) -> List[List[Tuple[int, str]]]:
    """Per output cell: (position, 'real' | 'pad' | 'out') for each kernel tap."""
    out = _out_size(n, k, s, d, before, after, ceil)
    cells = []
    for o in range(out):
        taps = []
        for j in range(k):
            pos = o * s - before + j * d
            kind = "real" if 0 <= pos < n else ("pad" if -before <= pos < n + after else "out")
            taps.append((pos, kind))
        cells.append(taps)
    return cells


def pool_params(method: str, k=(2, 2), s=(2, 2), pads=(0, 0, 0, 0), d=(1, 1), ceil=False, include=None) -> Dict:
    p = {"method": method, "kernel_y": k[0], "kernel_x": k[1], "stride_y": s[0], "stride_x": s[1],
         "pad_left": pads[0], "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3],
         "dilation_y": d[0], "dilation_x": d[1], "ceil_mode": ceil}
    if include is not None:
        p["count_include_pad"] = include
    return p


def pool_out_shape(shape: Sequence[int], p: Dict) -> List[int]:
    oh = _out_size(shape[1], p["kernel_y"], p["stride_y"], p["dilation_y"], p["pad_top"], p["pad_bottom"],
                   p["ceil_mode"])
    ow = _out_size(shape[2], p["kernel_x"], p["stride_x"], p["dilation_x"], p["pad_left"], p["pad_right"],
                   p["ceil_mode"])
    return [shape[0], oh, ow, shape[3]]


def naive_lp_float(x: np.ndarray, p: Dict, power: int) -> np.ndarray:
    """ONNX LpPool: (sum over the window of |x|^p)^(1/p), padding and outside cells count as 0."""
    n, h, w, c = x.shape
    rows = axis_windows(h, p["kernel_y"], p["stride_y"], p["dilation_y"], p["pad_top"], p["pad_bottom"],
                        p["ceil_mode"])
    cols = axis_windows(w, p["kernel_x"], p["stride_x"], p["dilation_x"], p["pad_left"], p["pad_right"],
                        p["ceil_mode"])
    y = np.zeros((n, len(rows), len(cols), c))
    for i, rw in enumerate(rows):
        for j, cl in enumerate(cols):
            acc = np.zeros((n, c))
            for (r, kr), (q, kq) in itertools.product(rw, cl):
                if kr == "real" and kq == "real":
                    acc += np.abs(x[:, r, q, :].astype(np.float64)) ** power
            y[:, i, j, :] = acc ** (1.0 / power)
    return y


def ref_lp_int(node, x_q: np.ndarray, p: Dict, power: int) -> np.ndarray:
    """Docs: S = sum |x+zp|^p over real cells, min(S, 2^32-1); L1: rhe(S*M, N) - zp_out; L2: code = clamp(rhe(S*M,
    N), 0, 65535), sqrt_lut read at code over a 2^16 domain (interpolated), clamped."""
    zp = int(params_of(node, node.inputs[0]).zerop)
    out = params_of(node, node.outputs[0])
    zp_out, qmin, qmax = int(out.zerop), int(out.qmin), int(out.qmax)
    m, sh = int(node.params["scale_value"]), int(node.params["shift_value"])
    n, h, w, c = x_q.shape
    rows = axis_windows(h, p["kernel_y"], p["stride_y"], p["dilation_y"], p["pad_top"], p["pad_bottom"],
                        p["ceil_mode"])
    cols = axis_windows(w, p["kernel_x"], p["stride_x"], p["dilation_x"], p["pad_left"], p["pad_right"],
                        p["ceil_mode"])
    if power == 2:
        lut = node.constants["sqrt_lut"]
        table = [int(v) for v in lut.betensor.flatten().tolist()]
        lo_t, hi_t = lut.dtype.int_range()
    y = np.zeros((n, len(rows), len(cols), c), dtype=np.int64)
    for b, ch in itertools.product(range(n), range(c)):
        for i, rw in enumerate(rows):
            for j, cl in enumerate(cols):
                s = sum(abs(int(x_q[b, r, q, ch]) + zp) ** power for (r, kr), (q, kq) in itertools.product(rw, cl)
                        if kr == "real" and kq == "real")
                s = min(s, 2 ** 32 - 1)
                if power == 1:
                    v = rhe(s * m, sh) - zp_out
                else:
                    code = clamp(rhe(s * m, sh), 0, 65535)
                    v = clamp(table_value(code, table, 16), lo_t, hi_t)
                y[b, i, j, ch] = clamp(v, qmin, qmax)
    return y


def ref_window_int(x_q: np.ndarray, rows, cols, method: str, zp: int, include: bool, qmin: int,
                   qmax: int, exact_div: bool = False) -> np.ndarray:
    """MAX over real cells, or AVG = avg_ref(sum(x+zp), count) (AdaptivePool, `exact_div`: rhe_div(sum, count) - zp;
    count: real, or real+pad with include)."""
    n, _, _, c = x_q.shape
    y = np.zeros((n, len(rows), len(cols), c), dtype=np.int64)
    for b, ch in itertools.product(range(n), range(c)):
        for i, rw in enumerate(rows):
            for j, cl in enumerate(cols):
                taps = [(r, q) for (r, kr), (q, kq) in itertools.product(rw, cl) if kr == "real" and kq == "real"]
                vals = [int(x_q[b, r, q, ch]) for r, q in taps]
                if method == "MAX":
                    v = max(vals)
                else:
                    count = (sum(1 for _, kr in rw if kr != "out") * sum(1 for _, kq in cl if kq != "out")
                             if include else len(vals))
                    total = sum(t + zp for t in vals)
                    v = rhe_div(total, count) - zp if exact_div else avg_ref(total, count, zp)
                y[b, i, j, ch] = clamp(v, qmin, qmax)
    return y


# --- ONNX Runtime reference (optional) ----------------------------------------------------------------------------
def ort_run(op: str, attrs: Dict[str, Any], inputs: Sequence[np.ndarray], n_out: int = 1,
            out_types: Optional[Sequence[int]] = None, opset: int = 18) -> List[np.ndarray]:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    def ttype(a: np.ndarray) -> int:
        return TensorProto.INT64 if a.dtype == np.int64 else TensorProto.FLOAT

    names = [f"i{k}" for k in range(len(inputs))]
    outs = [f"o{k}" for k in range(n_out)]
    types = out_types or [TensorProto.FLOAT] * n_out
    graph = helper.make_graph(
        [helper.make_node(op, names, outs, **attrs)], "g",
        [helper.make_tensor_value_info(nm, ttype(a), list(a.shape)) for nm, a in zip(names, inputs)],
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs)))


# ================================================================================================ Pooling L1 / L2
LP_CASES = [
    # method, kernel, stride, pads (l, r, t, b), dilation, ceil
    ("L1", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False),
    ("L2", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False),
    ("L2", (2, 3), (1, 2), (0, 2, 1, 0), (1, 1), True),
    ("L1", (2, 2), (2, 1), (1, 0, 0, 1), (2, 1), True),
    ("L2", (9, 10), (1, 1), (0, 0, 0, 0), (1, 1), False),
]
SHAPE = [1, 9, 10, 4]


@pytest.mark.parametrize("case", LP_CASES)
def test_lp_pool_float_matches_naive_definition(case) -> None:
    method, k, s, pads, d, ceil = case
    p = pool_params(method, k, s, pads, d, ceil)
    x = data([2, 9, 10, 4], 1)[0]
    g = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], p)
    y = g.forward([x])[0]
    ref = naive_lp_float(x.numpy(), p, 1 if method == "L1" else 2)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["L1", "L2"])
def test_lp_pool_float_matches_onnxruntime(method: str) -> None:
    p = pool_params(method, (3, 2), (2, 1), (1, 0, 1, 1))
    x = data([2, 9, 10, 4], 2)[0]
    y = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], p).forward([x])[0]
    ref = ort_run("LpPool", {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 1, 1, 0],
                             "p": 1 if method == "L1" else 2}, [x.permute(0, 3, 1, 2).contiguous().numpy()])[0]
    np.testing.assert_allclose(y.numpy(), ref.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", LP_CASES)
def test_lp_pool_integer_matches_reference(case, bits: int, mode: str) -> None:
    method, k, s, pads, d, ceil = case
    p = pool_params(method, k, s, pads, d, ceil)
    g = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], p)
    qg = quantize_model(g, data([2, 9, 10, 4], 3), settings(bits, mode))
    node = qg.node("op")
    x = data([2, 9, 10, 4], 4, 1)[0]
    y = qg.forward([x])[0]
    assert params_of(node, node.outputs[0]).qmin == 0  # L1/L2 outputs are unsigned
    np.testing.assert_array_equal(y.numpy(), ref_lp_int(node, node.inputs[0].betensor.numpy(), p,
                                                        1 if method == "L1" else 2))
    assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > 0.99


def test_lp_pool_quantized_ir_keys_and_lut() -> None:
    p = pool_params("L2", (3, 3), (2, 2), (1, 1, 1, 1))
    g = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], p)
    qg = quantize_model(g, data([2, 9, 10, 4], 5), settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    assert node.constants["sqrt_lut"].betensor.numel() == 256
    assert node.constants["sqrt_lut"].dtype == node.outputs[0].dtype == Dtype.UINT8
    assert {"scale_value", "shift_value", "scale_type", "shift_type"} <= set(node.params)
    assert 0 < node.params["scale_value"] < 2 ** 15
    g1 = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], {**p, "method": "L1"})
    q1 = quantize_model(g1, data([2, 9, 10, 4], 5), settings(8, "per_tensor_asymmetric"))
    assert "sqrt_lut" not in q1.node("op").constants


@pytest.mark.parametrize("method", ["L1", "L2"])
def test_lp_pool_reloads_bit_identical(tmp_path, method: str) -> None:
    p = pool_params(method, (3, 3), (2, 2), (1, 1, 1, 1), ceil=True)
    g = one_layer("Pooling", [SHAPE], [pool_out_shape(SHAPE, p)], p)
    qg = quantize_model(g, data([2, 9, 10, 4], 6), settings(16, "per_tensor_symmetric_full_range"))
    roundtrip_equal(tmp_path, qg, [data([3, 9, 10, 4], 7, 1, scale=2.0)[0]])


# ================================================================================================ GlobalPool
@pytest.mark.parametrize("method", ["MAX", "AVG", "L1", "L2"])
def test_globalpool_float(method: str) -> None:
    x = data([2, 5, 6, 3], 8)[0]
    g = one_layer("GlobalPool", [[1, 5, 6, 3]], [[1, 1, 1, 3]], {"method": method, "pad_left": 0, "pad_right": 0})
    y = g.forward([x])[0]
    ref = {"MAX": x.amax(dim=(1, 2), keepdim=True), "AVG": x.mean(dim=(1, 2), keepdim=True),
           "L1": x.abs().sum(dim=(1, 2), keepdim=True), "L2": (x * x).sum(dim=(1, 2), keepdim=True).sqrt()}[method]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if method in ("L1", "L2"):
        o = ort_run("GlobalLpPool", {"p": 1 if method == "L1" else 2}, [x.permute(0, 3, 1, 2).contiguous().numpy()])
        np.testing.assert_allclose(y.numpy(), o[0].transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("method,include", [("MAX", None), ("AVG", False), ("AVG", True), ("L1", None),
                                            ("L2", None)])
def test_globalpool_integer_matches_reference(method: str, include, bits: int, mode: str) -> None:
    params = {"method": method, "pad_left": 1, "pad_right": 0, "pad_top": 0, "pad_bottom": 1}
    if include is not None:
        params["count_include_pad"] = include
    g = one_layer("GlobalPool", [[1, 5, 6, 3]], [[1, 1, 1, 3]], params)
    qg = quantize_model(g, data([2, 5, 6, 3], 9), settings(bits, mode))
    node = qg.node("op")
    x = data([2, 5, 6, 3], 10, 1)[0]
    y = qg.forward([x])[0].numpy()
    xq = node.inputs[0].betensor.numpy()
    if method in ("L1", "L2"):
        p = pool_params(method, (6, 7), (1, 1), (1, 0, 0, 1))
        ref = ref_lp_int(node, xq, p, 1 if method == "L1" else 2)
    else:
        rows, cols = axis_windows(5, 6, 1, 1, 0, 1, False), axis_windows(6, 7, 1, 1, 1, 0, False)
        out = params_of(node, node.outputs[0])
        ref = ref_window_int(xq, rows, cols, method, int(params_of(node, node.inputs[0]).zerop), bool(include),
                             out.qmin, out.qmax)
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > 0.99


# ================================================================================================ AdaptivePool
@pytest.mark.parametrize("method", ["MAX", "AVG"])
@pytest.mark.parametrize("in_hw,out_hw", [((7, 9), (3, 4)), ((5, 5), (5, 5)), ((6, 10), (4, 3))])
def test_adaptivepool_float_matches_torch(method: str, in_hw, out_hw) -> None:
    x = data([2, *in_hw, 3], 11)[0]
    g = one_layer("AdaptivePool", [[1, *in_hw, 3]], [[1, *out_hw, 3]], {"method": method, "output_size": list(out_hw)})
    y = g.forward([x])[0]
    fn = F.adaptive_max_pool2d if method == "MAX" else F.adaptive_avg_pool2d
    ref = fn(x.permute(0, 3, 1, 2), out_hw).permute(0, 2, 3, 1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_adaptivepool_three_d_input_is_hwc() -> None:
    x = data([7, 9, 3], 12)[0]
    g = one_layer("AdaptivePool", [[7, 9, 3]], [[3, 4, 3]], {"method": "AVG", "output_size": [3, 4]})
    ref = F.adaptive_avg_pool2d(x.permute(2, 0, 1)[None], (3, 4))[0].permute(1, 2, 0)
    torch.testing.assert_close(g.forward([x])[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("method", ["MAX", "AVG"])
def test_adaptivepool_integer_matches_reference(method: str, bits: int, mode: str) -> None:
    g = one_layer("AdaptivePool", [[1, 7, 9, 3]], [[1, 3, 4, 3]], {"method": method, "output_size": [3, 4]})
    qg = quantize_model(g, data([2, 7, 9, 3], 13), settings(bits, mode))
    node = qg.node("op")
    x = data([2, 7, 9, 3], 14, 1)[0]
    y = qg.forward([x])[0].numpy()
    xq = node.inputs[0].betensor.numpy()

    def windows(n: int, o: int):  # [floor(i*n/o), ceil((i+1)*n/o))
        return [[(t, "real") for t in range((i * n) // o, math.ceil((i + 1) * n / o))] for i in range(o)]

    out, inp = params_of(node, node.outputs[0]), params_of(node, node.inputs[0])
    ref = ref_window_int(xq, windows(7, 3), windows(9, 4), method, int(inp.zerop), False, out.qmin, out.qmax,
                         exact_div=True)
    np.testing.assert_array_equal(y, ref)
    assert (out.scale, out.zerop, node.outputs[0].dtype) == (inp.scale, inp.zerop, node.inputs[0].dtype)
    assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > 0.99


# ================================================================================================ Pooling3D
def params3d(method: str, k, s, pads, d=(1, 1, 1), ceil=False, include=None) -> Dict:
    p = {"method": method, "ceil_mode": ceil}
    for a, kk, ss, dd, (b, e) in zip("zyx", k, s, d, pads):
        p.update({f"kernel_{a}": kk, f"stride_{a}": ss, f"dilation_{a}": dd, f"pad_{a}_begin": b, f"pad_{a}_end": e})
    if include is not None:
        p["count_include_pad"] = include
    return p


def out3d(shape: Sequence[int], p: Dict) -> List[int]:
    return [shape[0]] + [_out_size(shape[1 + i], p[f"kernel_{a}"], p[f"stride_{a}"], p[f"dilation_{a}"],
                                   p[f"pad_{a}_begin"], p[f"pad_{a}_end"], p["ceil_mode"])
                         for i, a in enumerate("zyx")] + [shape[4]]


CASES3D = [
    ("MAX", (2, 3, 3), (2, 2, 2), ((0, 1), (1, 1), (1, 0)), (1, 1, 1), True, None),
    ("AVG", (2, 3, 3), (1, 2, 2), ((1, 1), (1, 1), (1, 1)), (1, 1, 1), False, True),
    ("AVG", (2, 3, 2), (2, 2, 3), ((0, 1), (1, 0), (0, 2)), (1, 1, 1), True, False),
    ("MAX", (2, 2, 2), (1, 1, 2), ((0, 0), (0, 0), (1, 1)), (2, 1, 2), False, None),
]
SHAPE3D = [1, 5, 6, 7, 3]


def naive_pool3d(x: np.ndarray, p: Dict, method: str, integer: bool = False, zp: int = 0, qmin: int = 0,
                 qmax: int = 0) -> np.ndarray:
    include = bool(p.get("count_include_pad", False))
    wins = [axis_windows(x.shape[1 + i], p[f"kernel_{a}"], p[f"stride_{a}"], p[f"dilation_{a}"],
                         p[f"pad_{a}_begin"], p[f"pad_{a}_end"], p["ceil_mode"]) for i, a in enumerate("zyx")]
    y = np.zeros([x.shape[0]] + [len(w) for w in wins] + [x.shape[4]], dtype=np.int64 if integer else np.float64)
    for i, j, k in itertools.product(*[range(len(w)) for w in wins]):
        taps = list(itertools.product(wins[0][i], wins[1][j], wins[2][k]))
        real = [(a[0], b[0], c[0]) for a, b, c in taps if a[1] == b[1] == c[1] == "real"]
        inside = sum(1 for a, b, c in taps if "out" not in (a[1], b[1], c[1]))
        vals = np.stack([x[:, z, r, q, :] for z, r, q in real]).astype(np.int64 if integer else np.float64)
        if method == "MAX":
            y[:, i, j, k, :] = vals.max(0)
        elif not integer:
            y[:, i, j, k, :] = vals.sum(0) / (inside if include else len(real))
        else:
            cnt = inside if include else len(real)
            s = vals.sum(0) + zp * len(real)
            y[:, i, j, k, :] = [[clamp(rhe_div(int(t), cnt) - zp, qmin, qmax) for t in row] for row in s]
    return y


@pytest.mark.parametrize("case", CASES3D)
def test_pooling3d_float_matches_naive_and_torch(case) -> None:
    method, k, s, pads, d, ceil, include = case
    p = params3d(method, k, s, pads, d, ceil, include)
    x = data([2, 5, 6, 7, 3], 15)[0]
    y = one_layer("Pooling3D", [SHAPE3D], [out3d(SHAPE3D, p)], p).forward([x])[0]
    np.testing.assert_allclose(y.numpy(), naive_pool3d(x.numpy(), p, method), rtol=1e-5, atol=1e-5)
    if method == "MAX" and d == (1, 1, 1) and all(b == e for b, e in pads) and all(b <= kk // 2 for (b, _), kk in
                                                                                  zip(pads, k)):
        ref = F.max_pool3d(x.permute(0, 4, 1, 2, 3), k, s, padding=[b for b, _ in pads], ceil_mode=ceil)
        torch.testing.assert_close(y, ref.permute(0, 2, 3, 4, 1))


def test_pooling3d_avg_matches_torch_count_include_pad() -> None:
    p = params3d("AVG", (3, 3, 3), (2, 2, 2), ((1, 1), (1, 1), (1, 1)), include=True)
    x = data([2, 5, 6, 7, 3], 16)[0]
    y = one_layer("Pooling3D", [SHAPE3D], [out3d(SHAPE3D, p)], p).forward([x])[0]
    ref = F.avg_pool3d(x.permute(0, 4, 1, 2, 3), 3, 2, padding=1, count_include_pad=True).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", CASES3D)
def test_pooling3d_integer_matches_reference(case, bits: int, mode: str) -> None:
    method, k, s, pads, d, ceil, include = case
    p = params3d(method, k, s, pads, d, ceil, include)
    g = one_layer("Pooling3D", [SHAPE3D], [out3d(SHAPE3D, p)], p)
    qg = quantize_model(g, data([2, 5, 6, 7, 3], 17), settings(bits, mode))
    node = qg.node("op")
    x = data([2, 5, 6, 7, 3], 18, 1)[0]
    y = qg.forward([x])[0].numpy()
    out = params_of(node, node.outputs[0])
    ref = naive_pool3d(node.inputs[0].betensor.numpy(), p, method, True, int(params_of(node, node.inputs[0]).zerop),
                       out.qmin, out.qmax)
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > 0.99


# ================================================================================================ ArgMax / Unpool
def argmax_params(flatten: str, order: int = 0, k=(3, 3), s=(2, 2), pads=(1, 1, 1, 1), d=(1, 1), ceil=False) -> Dict:
    p = pool_params("MAX", k, s, pads, d, ceil)
    p.pop("method")
    p.update(flatten_dim=flatten, storage_order=order)
    return p


def argmax_graph(p: Dict, shape=(1, 8, 9, 3)):
    out = pool_out_shape(shape, {**p, "method": "MAX"})
    return one_layer("MaxPoolingWithArgMax", [shape], [out, out], p)


def ref_argmax(x: np.ndarray, p: Dict) -> Tuple[np.ndarray, np.ndarray]:
    """First maximal real cell in row-major window order; index by flatten_dim / storage_order."""
    n, h, w, c = x.shape
    rows = axis_windows(h, p["kernel_y"], p["stride_y"], p["dilation_y"], p["pad_top"], p["pad_bottom"],
                        p["ceil_mode"])
    cols = axis_windows(w, p["kernel_x"], p["stride_x"], p["dilation_x"], p["pad_left"], p["pad_right"],
                        p["ceil_mode"])
    vals = np.zeros((n, len(rows), len(cols), c), dtype=x.dtype)
    idx = np.zeros((n, len(rows), len(cols), c), dtype=np.int64)
    for b, ch in itertools.product(range(n), range(c)):
        for i, rw in enumerate(rows):
            for j, cl in enumerate(cols):
                best = None
                for (r, kr), (q, kq) in itertools.product(rw, cl):
                    if kr == kq == "real" and (best is None or x[b, r, q, ch] > x[b, best[0], best[1], ch]):
                        best = (r, q)
                r, q = best
                base = q * h + r if p["storage_order"] else r * w + q
                fd = p["flatten_dim"]
                idx[b, i, j, ch] = {"HW": base, "HWC": base * c + ch, "NHWC": b * h * w * c + base * c + ch,
                                    "NCHW": b * c * h * w + ch * h * w + base}[fd]
                vals[b, i, j, ch] = x[b, r, q, ch]
    return vals, idx


def test_argmax_float_matches_torch_and_onnxruntime() -> None:
    x = data([2, 8, 9, 3], 19)[0]
    p = argmax_params("HW", pads=(1, 1, 1, 1))
    vals, idx = argmax_graph(p).forward([x])
    tv, ti = F.max_pool2d(x.permute(0, 3, 1, 2), 3, 2, padding=1, return_indices=True)
    torch.testing.assert_close(vals, tv.permute(0, 2, 3, 1))
    assert torch.equal(idx, ti.permute(0, 2, 3, 1))
    for order in (0, 1):
        _, idx = argmax_graph(argmax_params("NCHW", order)).forward([x])
        ov, oi = ort_run("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                     "storage_order": order}, [x.permute(0, 3, 1, 2).contiguous().numpy()], 2,
                         out_types=[1, 7])
        np.testing.assert_array_equal(idx.numpy(), oi.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("flatten,order,ceil,d", [("HW", 0, False, (1, 1)), ("HWC", 1, True, (1, 1)),
                                                  ("NHWC", 0, True, (2, 1)), ("NCHW", 1, False, (1, 2))])
def test_argmax_float_index_conventions(flatten: str, order: int, ceil: bool, d) -> None:
    x = data([2, 8, 9, 3], 20)[0]
    p = argmax_params(flatten, order, ceil=ceil, d=d, pads=(1, 0, 0, 1))
    vals, idx = argmax_graph(p).forward([x])
    rv, ri = ref_argmax(x.numpy(), p)
    np.testing.assert_array_equal(vals.numpy(), rv)
    np.testing.assert_array_equal(idx.numpy(), ri)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("flatten,order", [("HW", 0), ("NHWC", 1), ("NCHW", 0)])
def test_argmax_integer_matches_reference(flatten: str, order: int, bits: int, mode: str) -> None:
    p = argmax_params(flatten, order, ceil=True)
    g = argmax_graph(p)
    # coarse data: many ties, so the first-maximum rule matters
    cal = [torch.round(t * 2) / 2 for t in data([2, 8, 9, 3], 21)]
    qg = quantize_model(g, cal, settings(bits, mode))
    node = qg.node("op")
    x = torch.round(data([2, 8, 9, 3], 22, 1)[0] * 2) / 2
    vals, idx = qg.forward([x])
    rv, ri = ref_argmax(node.inputs[0].betensor.numpy(), p)
    np.testing.assert_array_equal(vals.numpy(), rv)
    np.testing.assert_array_equal(idx.numpy(), ri)
    assert params_of(node, node.outputs[1]).qinvariant and node.outputs[1].dtype == Dtype.INT32
    assert params_of(node, node.outputs[0]).scale == params_of(node, node.inputs[0]).scale
    fv, fi = g.forward([x])
    assert cosine(fv, run_quantized(qg, x)[0]) > 0.99


def unpool_graph(flatten: str, shape=(1, 8, 9, 3)):
    p = argmax_params(flatten, k=(2, 2), s=(2, 2), pads=(0, 0, 0, 0))
    out = pool_out_shape(shape, {**p, "method": "MAX"})
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    v, i = b.layer("MaxPoolingWithArgMax", [x], [out, out], name="am", params=p,
                   output_dtypes=[Dtype.FP32, Dtype.INT32])
    y = b.layer("MaxUnpool", [v, i], [list(shape)], name="op", params={"flatten_dim": flatten})
    return b.build([y, v, i])


def ref_unpool(values: np.ndarray, idx: np.ndarray, out_shape: Sequence[int], flatten: str, fill) -> np.ndarray:
    n, h, w, c = values.shape
    _, oh, ow, oc = out_shape
    nchw = flatten in ("HW", "NCHW")
    flat = np.full(n * oh * ow * oc, fill, dtype=values.dtype)
    for b, i, j, ch in itertools.product(range(n), range(h), range(w), range(c)):
        t = int(idx[b, i, j, ch])
        if flatten == "HW":
            t += (b * oc + ch) * oh * ow
        elif flatten == "HWC":
            t += b * oh * ow * oc
        if 0 <= t < flat.size:
            flat[t] = values[b, i, j, ch]
    if nchw:
        return flat.reshape(n, oc, oh, ow).transpose(0, 2, 3, 1)
    return flat.reshape(n, oh, ow, oc)


@pytest.mark.parametrize("flatten", ["HW", "HWC", "NHWC", "NCHW"])
def test_maxunpool_float_inverts_argmax(flatten: str) -> None:
    x = data([2, 8, 9, 3], 23)[0]
    g = unpool_graph(flatten)
    y = g.forward([x])[0]
    tv, ti = F.max_pool2d(x.permute(0, 3, 1, 2), 2, 2, return_indices=True)
    ref = F.max_unpool2d(tv, ti, 2, 2, output_size=(8, 9)).permute(0, 2, 3, 1)
    torch.testing.assert_close(y, ref)


def test_maxunpool_float_matches_onnxruntime() -> None:
    r = np.random.default_rng(24)
    v = r.normal(size=(2, 3, 4, 4)).astype(np.float32)
    idx = np.stack([r.permutation(8 * 9)[:16].reshape(4, 4) for _ in range(6)]).reshape(2, 3, 4, 4)
    idx = idx + (np.arange(6).reshape(2, 3, 1, 1) * 72)
    o = ort_run("MaxUnpool", {"kernel_shape": [2, 2], "strides": [2, 2]},
                [v, idx.astype(np.int64), np.array([2, 3, 8, 9], dtype=np.int64)], opset=11)[0]
    b = GraphBuilder("t")
    vi = b.input("v", [2, 4, 4, 3])
    ii = b.input("i", [2, 4, 4, 3], dtype=Dtype.INT32)
    y = b.layer("MaxUnpool", [vi, ii], [[2, 8, 9, 3]], name="op", params={"flatten_dim": "NCHW"})
    out = b.build([y]).forward([torch.from_numpy(v.transpose(0, 2, 3, 1).copy()),
                                torch.from_numpy(idx.transpose(0, 2, 3, 1).copy())])[0]
    np.testing.assert_array_equal(out.numpy(), o.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("flatten", ["HW", "NHWC"])
def test_maxunpool_integer_matches_reference(tmp_path, flatten: str, bits: int, mode: str) -> None:
    g = unpool_graph(flatten)
    qg = quantize_model(g, data([2, 8, 9, 3], 25), settings(bits, mode))
    node = qg.node("op")
    x = data([2, 8, 9, 3], 26, 1)[0]
    y, v, i = (t.numpy() for t in qg.forward([x]))
    zp = int(params_of(node, node.inputs[0]).zerop)
    out = params_of(node, node.outputs[0])
    fill = clamp(-zp, int(out.qmin), int(out.qmax))
    ref = ref_unpool(v, i, [2, 8, 9, 3], flatten, fill)
    np.testing.assert_array_equal(y, ref)
    assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > 0.99
    roundtrip_equal(tmp_path, qg, [x])


def test_maxunpool_ignores_out_of_range_and_last_duplicate_wins() -> None:
    b = GraphBuilder("t")
    vi = b.input("v", [1, 1, 4, 1])
    ii = b.input("i", [1, 1, 4, 1], dtype=Dtype.INT32)
    y = b.layer("MaxUnpool", [vi, ii], [[1, 2, 2, 1]], name="op", params={"flatten_dim": "NHWC"})
    out = b.build([y]).forward([torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 4, 1),
                                torch.tensor([3, -1, 3, 9]).reshape(1, 1, 4, 1)])[0]
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 3.0]


# ================================================================================================ round trips
@pytest.mark.parametrize("optype", ["GlobalPool", "AdaptivePool", "Pooling3D", "MaxPoolingWithArgMax"])
def test_reloads_bit_identical(tmp_path, optype: str) -> None:
    if optype == "GlobalPool":
        g = one_layer(optype, [[1, 5, 6, 3]], [[1, 1, 1, 3]], {"method": "L2"})
        shape = [3, 5, 6, 3]
    elif optype == "AdaptivePool":
        g = one_layer(optype, [[1, 7, 9, 3]], [[1, 3, 4, 3]], {"method": "AVG", "output_size": [3, 4]})
        shape = [3, 7, 9, 3]
    elif optype == "Pooling3D":
        p = params3d("AVG", (2, 3, 2), (2, 2, 3), ((0, 1), (1, 0), (0, 2)), ceil=True, include=True)
        g = one_layer(optype, [SHAPE3D], [out3d(SHAPE3D, p)], p)
        shape = [3] + SHAPE3D[1:]
    else:
        g = argmax_graph(argmax_params("NHWC", 1, ceil=True))
        shape = [3, 8, 9, 3]
    qg = quantize_model(g, data([2] + shape[1:], 27), settings(8, "per_tensor_asymmetric"))
    roundtrip_equal(tmp_path, qg, [data(shape, 28, 1, scale=2.0)[0]])


# ================================================================================================ errors
@pytest.mark.parametrize("optype,in_shape,out_shape,params,match", [
    ("Pooling", [1, 6, 6, 2], [1, 3, 3, 2], pool_params("LP3"), "method 'LP3'"),
    ("AdaptivePool", [1, 6, 6, 2], [1, 3, 3, 2], {"method": "L2", "output_size": [3, 3]}, "method 'L2'"),
    ("AdaptivePool", [1, 6, 6, 2], [1, 3, 3, 2], {"method": "AVG", "output_size": [3]}, "output_size"),
    ("AdaptivePool", [1, 6, 6, 2], [1, 3, 3, 2], {"method": "AVG"}, "output_size"),
    ("Pooling3D", [1, 4, 4, 4, 2], [1, 2, 2, 2, 2], {"method": "MAX", "kernel_z": 2, "kernel_y": 2}, "kernel_x"),
    ("Pooling3D", [1, 4, 4, 4, 2], [1, 2, 2, 2, 2], {**params3d("MAX", (2, 2, 2), (2, 2, 2),
                                                                ((0, 0), (0, 0), (3, 0)))}, "only padding"),
    ("Pooling3D", [1, 4, 4, 4, 2], [1, 2, 2, 2, 2], {**params3d("L1", (2, 2, 2), (2, 2, 2),
                                                                ((0, 0), (0, 0), (0, 0)))}, "method 'L1'"),
    ("MaxPoolingWithArgMax", [1, 6, 6, 2], [1, 3, 3, 2], {**argmax_params("CHW", pads=(0, 0, 0, 0))}, "flatten_dim"),
    ("MaxPoolingWithArgMax", [1, 6, 6, 2], [1, 3, 3, 2], {**argmax_params("HW", 2, pads=(0, 0, 0, 0))},
     "storage_order"),
    ("GlobalPool", [1, 6, 6, 2], [1, 1, 1, 2], {"method": "MIN"}, "method 'MIN'"),
])
def test_bad_params_are_ir_errors(optype: str, in_shape, out_shape, params, match: str) -> None:
    outs = [out_shape, out_shape] if optype == "MaxPoolingWithArgMax" else [out_shape]
    g = one_layer(optype, [in_shape], outs, params)
    with pytest.raises(IRError, match=match):
        g.forward([torch.randn(*in_shape)])


def test_maxunpool_float_indices_are_not_quantizable() -> None:
    b = GraphBuilder("t")
    vi = b.input("v", [1, 2, 2, 1])
    ii = b.input("i", [1, 2, 2, 1])  # a float tensor: quantized, it would not hold exact indices
    y = b.layer("MaxUnpool", [vi, ii], [[1, 4, 4, 1]], name="op", params={"flatten_dim": "NHWC"})
    g = b.build([y])
    cal = [[torch.randn(1, 2, 2, 1), torch.randint(0, 16, (1, 2, 2, 1)).float()] for _ in range(2)]
    with pytest.raises(UnsupportedError, match="indices"):
        quantize_model(g, cal, settings(8, "per_tensor_asymmetric"))
