"""Geometry / resampling / layout ops: float forward against independent torch/numpy references, integer forward
against python-int references written from docs/semantics/geometry.md, float-vs-dequantized cosine, IR write →
re-read → bit-identical integers, and clear errors for bad or unsupported params."""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_helpers import params_of, set_quant

import quantopt.ops.geometry  # noqa: F401  (registers the family even when used alone)
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range"), (16, "per_tensor_asymmetric")]


def rng_data(shape: Sequence[int], seed: int, n: int = 3, loc: float = 0.2, std: float = 1.5) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(loc, std, size=shape).astype(np.float32)) for _ in range(n)]


def smooth_data(shape: Sequence[int], seed: int, n: int = 3) -> List[torch.Tensor]:
    """Images that vary smoothly in space (what resampling is for): low-frequency sinusoids plus a little noise."""
    r = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        grids = np.meshgrid(*[np.linspace(0, 1, s) for s in shape[1:-1]], indexing="ij")
        base = sum(np.sin(2 * math.pi * r.uniform(0.3, 1.2) * gi + r.uniform(0, 6)) for gi in grids)
        x = base[None, ..., None] * r.uniform(0.5, 2.0, size=(shape[0],) + (1,) * (len(shape) - 2) + (shape[-1],))
        x = x + r.normal(0, 0.05, size=shape)
        out.append(torch.from_numpy(x.astype(np.float32)))
    return out


def settings(bits: int, mode: str) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32)


def one_layer(optype: str, params: Mapping[str, Any], in_shape: Sequence[int], out_shapes: Sequence[Sequence[int]],
              extra_inputs: Sequence[Tuple[str, Sequence[int], Dtype]] = (),
              constants: Optional[Mapping[str, Any]] = None,
              constant_dtypes: Optional[Mapping[str, Dtype]] = None,
              const_inputs: Sequence[Tuple[str, np.ndarray, Dtype]] = ()):
    b = GraphBuilder("t")
    names = [b.input("x", list(in_shape))]
    for name, shape, dtype in extra_inputs:
        names.append(b.input(name, list(shape), dtype=dtype))
    for name, value, dtype in const_inputs:
        names.append(b.layer("Constant", [], [list(value.shape)], name=name, constants={"weights": value},
                             constant_dtypes={"weights": dtype}, output_dtypes=[dtype]))
    y = b.layer(optype, names, [list(s) for s in out_shapes], name="op", params=dict(params),
                constants=dict(constants or {}), constant_dtypes=dict(constant_dtypes or {}))
    return b.build(y if isinstance(y, list) else [y])


# --- python-int helpers (from the docs) --------------------------------------------------------------------------
def rhe(v: int, s: int) -> int:
    """round_half_even(v / 2^s) for python ints, s >= 0."""
    if s == 0:
        return v
    f, r = divmod(v, 1 << s)
    half = 1 << (s - 1)
    return f + (1 if r > half or (r == half and f % 2 == 1) else 0)


def rhe_frac(v: Fraction) -> int:
    f = math.floor(v)
    r = v - f
    return f + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and f % 2 == 1) else 0)


def np_rhe(acc: np.ndarray, s: int) -> np.ndarray:
    return np.vectorize(lambda v: rhe(int(v), s), otypes=[np.int64])(acc)


def qinfo(node, t) -> Tuple[int, int, int]:
    q = params_of(node, t)
    return int(q.zerop), int(q.qmin), int(q.qmax)


# ================================================================================================ Resize reference
def ref_src(mode: str, i: int, n_in: int, n_out: int, ratio: Optional[float]) -> Fraction:
    step = 1 / Fraction(ratio) if ratio else Fraction(n_in, n_out)
    h = Fraction(1, 2)
    if mode == "align_corners":
        return Fraction(i * (n_in - 1), n_out - 1) if n_out > 1 else Fraction(0)
    if mode == "asymmetric":
        return i * step
    if mode == "tf_half_pixel_for_nn":
        return (i + h) * step
    if mode == "pytorch_half_pixel" and n_out == 1:
        return Fraction(0)
    return (i + h) * step - h


def ref_kernel(d: Fraction, a: Fraction) -> Fraction:
    d = abs(d)
    if d <= 1:
        return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    if d < 2:
        return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return Fraction(0)


def ref_taps(method: str, mode: str, nmode: str, n_in: int, n_out: int, ratio: Optional[float], a: float,
             s: Optional[int]) -> List[Tuple[List[int], List[Any]]]:
    """Per output index: (taps, weights) — exact Fractions (s None) or S-bit integers summing to 2^S."""
    res = []
    for i in range(n_out):
        src = ref_src(mode, i, n_in, n_out, ratio)
        if method == "nearest":
            if nmode == "round_prefer_floor":
                j = math.ceil(src - Fraction(1, 2))
            elif nmode == "round_prefer_ceil":
                j = math.floor(src + Fraction(1, 2))
            elif nmode == "floor":
                j = math.floor(src)
            elif nmode == "ceil":
                j = math.ceil(src)
            else:
                j = math.ceil(src) if n_out < n_in else math.trunc(src)
            res.append(([min(max(j, 0), n_in - 1)], [1 if s is not None else Fraction(1)]))
        elif method == "linear":
            c = min(max(src, Fraction(0)), Fraction(n_in - 1))
            j0 = math.floor(c)
            lam = c - j0
            taps = [j0, min(j0 + 1, n_in - 1)]
            if s is None:
                res.append((taps, [1 - lam, lam]))
            else:
                b = rhe_frac(lam * (1 << s))
                res.append((taps, [(1 << s) - b, b]))
        else:
            j0 = math.floor(src)
            t = src - j0
            fa = Fraction(a)
            k = [ref_kernel(t + 1, fa), ref_kernel(t, fa), ref_kernel(1 - t, fa), ref_kernel(2 - t, fa)]
            taps = [min(max(j0 - 1 + m, 0), n_in - 1) for m in range(4)]
            if s is None:
                res.append((taps, k))
            else:
                w = [rhe_frac(v * (1 << s)) for v in k]
                w[1 if k[1] >= k[2] else 2] += (1 << s) - sum(w)
                res.append((taps, w))
    return res


def ref_resize(x: np.ndarray, out_sizes: Sequence[int], method: str, mode: str, nmode: str = "round_prefer_floor",
               ratios: Optional[Sequence[Optional[float]]] = None, a: float = -0.75,
               s: Optional[int] = None) -> np.ndarray:
    """Direct (non-separable) sum over all tap combinations: float64 (s None) or exact python-int + rhe."""
    spatial = x.shape[1:-1]
    ratios = ratios or [None] * len(spatial)
    taps = [ref_taps(method, mode, nmode, n_in, n_out, r, a, s) for n_in, n_out, r in zip(spatial, out_sizes, ratios)]
    out = np.zeros((x.shape[0], *out_sizes, x.shape[-1]), dtype=np.int64 if s is not None else np.float64)
    xs = x.astype(np.int64) if s is not None else x.astype(np.float64)
    for pos in itertools.product(*[range(n) for n in out_sizes]):
        per_axis = [taps[ax][p] for ax, p in enumerate(pos)]
        acc = 0
        for combo in itertools.product(*[list(zip(*pa)) for pa in per_axis]):
            w = 1
            for _, wt in combo:
                w = w * wt
            idx = tuple(j for j, _ in combo)
            acc = acc + (int(w) if s is not None else float(w)) * xs[(slice(None), *idx, slice(None))]
        out[(slice(None), *pos, slice(None))] = acc
    if s is not None and method != "nearest":
        out = np_rhe(out, s * len(spatial))
    return out


RESIZE_CASES: List[Tuple[List[int], List[int], Dict[str, Any]]] = [
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BILINEAR", "mode": "HALF_PIXEL"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BILINEAR", "mode": "ALIGN_CORNERS"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "LINEAR", "mode": "ASYMMETRIC"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BILINEAR", "mode": "PYTORCH_HALF_PIXEL"}),
    ([1, 8, 9, 2], [1, 3, 4, 2], {"method": "BILINEAR", "mode": "half_pixel"}),
    ([1, 4, 6, 2], [1, 8, 9, 2], {"method": "BILINEAR", "mode": "HALF_PIXEL", "ratio_y": 2.0, "ratio_x": 1.5}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BICUBIC", "mode": "HALF_PIXEL"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BICUBIC", "mode": "ALIGN_CORNERS"}),
    ([1, 6, 5, 3], [1, 4, 9, 3], {"method": "BICUBIC", "mode": "ASYMMETRIC", "cubic_coeff_a": -0.5}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "NEAREST", "mode": "HALF_PIXEL", "nearest_mode": "ROUND_PREFER_FLOOR"}),
    ([1, 5, 7, 3], [1, 10, 14, 3], {"method": "NEAREST", "mode": "HALF_PIXEL", "nearest_mode": "ROUND_PREFER_CEIL"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "NEAREST", "mode": "ASYMMETRIC", "nearest_mode": "FLOOR"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "NEAREST", "mode": "ALIGN_CORNERS", "nearest_mode": "CEIL"}),
    ([1, 9, 7, 3], [1, 4, 12, 3], {"method": "NEAREST", "mode": "ASYMMETRIC", "nearest_mode": "SIMPLE"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "NEAREST", "mode": "TF_HALF_PIXEL_FOR_NN", "nearest_mode": "FLOOR"}),
    ([1, 7, 4], [1, 11, 4], {"method": "LINEAR", "mode": "HALF_PIXEL"}),
    ([1, 5, 7, 3], [1, 1, 3, 3], {"method": "BILINEAR", "mode": "ALIGN_CORNERS"}),
    ([1, 5, 7, 3], [1, 9, 12, 3], {"method": "BILINEAR", "mode": "HALF_PIXEL", "size": [1, 9, 12, 3]}),
]
RESIZE_IDS = [f"{i}-{c[2]['method']}-{c[2].get('mode')}-{c[2].get('nearest_mode', '')}"
              for i, c in enumerate(RESIZE_CASES)]


def _resize_args(in_shape, out_shape, params) -> Dict[str, Any]:
    n_sp = len(in_shape) - 2
    ratio_keys = ["ratio_x", "ratio_y", "ratio_z"][:n_sp][::-1]
    ratios = [params.get(k) for k in ratio_keys]
    method = {"BILINEAR": "linear", "LINEAR": "linear", "BICUBIC": "cubic", "NEAREST": "nearest"}[params["method"]]
    return dict(out_sizes=out_shape[1:-1], method=method, mode=params["mode"].lower(),
                nmode=params.get("nearest_mode", "ROUND_PREFER_FLOOR").lower(), ratios=ratios,
                a=params.get("cubic_coeff_a", -0.75))


@pytest.mark.parametrize("case", RESIZE_CASES, ids=RESIZE_IDS)
def test_resize_float_matches_reference(case) -> None:
    in_shape, out_shape, params = case
    g = one_layer("Resize", params, in_shape, [out_shape])
    x = rng_data([2, *in_shape[1:]], 1)[0]
    got = g.forward([x])[0]
    want = ref_resize(x.numpy(), **_resize_args(in_shape, out_shape, params))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


TORCH_CASES = [({"method": "BILINEAR", "mode": "HALF_PIXEL"}, "bilinear", False),
               ({"method": "BILINEAR", "mode": "PYTORCH_HALF_PIXEL"}, "bilinear", False),
               ({"method": "BILINEAR", "mode": "ALIGN_CORNERS"}, "bilinear", True),
               ({"method": "BICUBIC", "mode": "HALF_PIXEL"}, "bicubic", False),
               ({"method": "BICUBIC", "mode": "ALIGN_CORNERS"}, "bicubic", True),
               ({"method": "NEAREST", "mode": "ASYMMETRIC", "nearest_mode": "FLOOR"}, "nearest", None),
               ({"method": "NEAREST", "mode": "TF_HALF_PIXEL_FOR_NN", "nearest_mode": "FLOOR"}, "nearest-exact", None),
               ({"method": "NEAREST", "mode": "HALF_PIXEL", "nearest_mode": "ROUND_PREFER_CEIL"}, "nearest-exact",
                None)]


@pytest.mark.parametrize("params,torch_mode,align", TORCH_CASES)
@pytest.mark.parametrize("in_hw,out_hw", [((5, 7), (9, 12)), ((8, 9), (3, 5))])
def test_resize_float_matches_torch_interpolate(params, torch_mode, align, in_hw, out_hw) -> None:
    g = one_layer("Interp", params, [1, *in_hw, 3], [[1, *out_hw, 3]])
    x = rng_data([2, *in_hw, 3], 2)[0]
    got = g.forward([x])[0]
    want = F.interpolate(x.permute(0, 3, 1, 2), size=out_hw, mode=torch_mode, align_corners=align).permute(0, 2, 3, 1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", RESIZE_CASES, ids=RESIZE_IDS)
def test_resize_integer_matches_reference(case, bits: int, mode: str) -> None:
    in_shape, out_shape, params = case
    optype = "Interp" if RESIZE_CASES.index(case) % 2 else "Resize"  # one operator under two names
    g = one_layer(optype, params, in_shape, [out_shape])
    qg = quantize_model(g, rng_data([2, *in_shape[1:]], 3), settings(bits, mode))
    node = qg.node("op")
    s = int(node.params["interp_shift_value"])
    assert s == (0 if params["method"] == "NEAREST" else 13)
    assert node.params["interp_shift_type"] == Dtype.INT8
    inp, out = node.inputs[0], node.outputs[0]
    ip, op = params_of(node, inp), params_of(node, out)
    assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (ip.scale, ip.zerop, ip.qmin, ip.qmax, inp.dtype)
    qg.forward([rng_data([3, *in_shape[1:]], 4, 1, std=2.5)[0]])  # wider than calibration: clamps exercised
    x_q = node.inputs[0].betensor.numpy()
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    want = ref_resize(x_q, s=s, **_resize_args(in_shape, out_shape, params))
    _, qmin, qmax = qinfo(node, out)
    np.testing.assert_array_equal(got.numpy(), np.clip(want, qmin, qmax))


def test_resize_documented_example() -> None:
    """docs example: in 4 → out 8 HALF_PIXEL, output 3 reads q[1]=10, q[2]=13 with weights (6144, 2048) → 11."""
    g = one_layer("Resize", {"method": "LINEAR", "mode": "HALF_PIXEL"}, [1, 4, 1], [[1, 8, 1]])
    qg = quantize_model(g, [torch.tensor([[[0.0], [1.0], [2.0], [3.0]]])], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    node.inputs[0].betensor = torch.tensor([[[0], [10], [13], [20]]], dtype=torch.int64)
    node.forward()
    assert int(node.outputs[0].betensor[0, 3, 0]) == 11


@pytest.mark.parametrize("params", [{"method": "BILINEAR", "mode": "HALF_PIXEL"},
                                    {"method": "BICUBIC", "mode": "ALIGN_CORNERS"},
                                    {"method": "NEAREST", "mode": "HALF_PIXEL"}])
@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
def test_resize_cosine(params, bits: int, threshold: float) -> None:
    g = one_layer("Resize", params, [1, 12, 10, 4], [[1, 20, 23, 4]])
    data = smooth_data([2, 12, 10, 4], 5)
    qg = quantize_model(g, data, settings(bits, "per_tensor_symmetric_full_range"))
    assert cosine(g.forward([data[0]])[0].clone(), run_quantized(qg, data[0])[0]) > threshold


# ================================================================================================ GridSample
def ref_grid_float(x: np.ndarray, grid: np.ndarray, method: str, padding: str, align: bool) -> np.ndarray:
    """PyTorch grid_sample definition, float64 loops, channels last."""
    n, h, w, c = x.shape
    _, ho, wo, _ = grid.shape
    out = np.zeros((n, ho, wo, c))

    def unnorm(v, size):
        return (v + 1) / 2 * (size - 1) if align else ((v + 1) * size - 1) / 2

    def pad(coord, size):
        if padding == "border":
            return min(max(coord, 0), size - 1)
        if padding == "reflection":
            lo2, hi2 = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
            if lo2 == hi2:
                return 0.0
            mn, span = lo2 / 2, (hi2 - lo2) / 2
            v = abs(coord - mn)
            extra = math.fmod(v, span)
            flips = math.floor(v / span)
            coord = extra + mn if flips % 2 == 0 else span - extra + mn
            return min(max(coord, 0), size - 1)
        return coord

    def px(b, yy, xx):
        return x[b, yy, xx] if 0 <= yy < h and 0 <= xx < w else np.zeros(c)

    for b, i, j in itertools.product(range(n), range(ho), range(wo)):
        ix = pad(unnorm(float(grid[b, i, j, 0]), w), w)
        iy = pad(unnorm(float(grid[b, i, j, 1]), h), h)
        if method == "nearest":
            out[b, i, j] = px(b, int(np.rint(iy)), int(np.rint(ix)))
            continue
        x0, y0 = math.floor(ix), math.floor(iy)
        tx, ty = ix - x0, iy - y0
        out[b, i, j] = ((1 - ty) * (1 - tx) * px(b, y0, x0) + (1 - ty) * tx * px(b, y0, x0 + 1)
                        + ty * (1 - tx) * px(b, y0 + 1, x0) + ty * tx * px(b, y0 + 1, x0 + 1))
    return out


def ref_grid_int(node, x_q: np.ndarray, g_q: np.ndarray) -> np.ndarray:
    """docs GridSample integer computation with python ints."""
    zp_x, qmin, qmax = qinfo(node, node.inputs[0])
    zp_g = int(params_of(node, node.inputs[1]).zerop)
    m, k, f = int(node.params["scale_value"]), int(node.params["shift_value"]), int(node.params["interp_shift_value"])
    method = str(node.params["method"]).lower()
    padding = str(node.params["padding_mode"]).lower()
    align = bool(node.params["align_corners"])
    n, h, w, c = x_q.shape
    _, ho, wo, _ = g_q.shape
    z0 = min(max(-zp_x, qmin), qmax)
    e = max(k, 0)

    def coord(gv: int, size: int) -> int:
        a, bb = (size - 1, 0) if align else (size, 1)
        big = (gv + zp_g) * m
        num = big * a * 2 ** (e - k) + (a - bb) * 2 ** e
        sh = e + 1 - f
        cc = rhe(num, sh) if sh >= 0 else num * 2 ** (-sh)
        top = (size - 1) * 2 ** f
        if padding == "border":
            cc = min(max(cc, 0), top)
        elif padding == "reflection":
            tl, th = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
            if tl == th:
                return 0
            low, span = tl * 2 ** (f - 1), (th - tl) * 2 ** (f - 1)
            v = abs(cc - low)
            fl, r = divmod(v, span)
            cc = r + low if fl % 2 == 0 else span - r + low
            cc = min(max(cc, 0), top)
        return cc

    def px(b, yy, xx):
        return [int(v) for v in x_q[b, yy, xx]] if 0 <= yy < h and 0 <= xx < w else [z0] * c

    out = np.zeros((n, ho, wo, c), dtype=np.int64)
    for b, i, j in itertools.product(range(n), range(ho), range(wo)):
        cx, cy = coord(int(g_q[b, i, j, 0]), w), coord(int(g_q[b, i, j, 1]), h)
        if method == "nearest":
            vals = px(b, rhe(cy, f), rhe(cx, f))
        else:
            x0, y0 = cx >> f, cy >> f
            lx, ly = cx - (x0 << f), cy - (y0 << f)
            one = 1 << f
            acc = [0] * c
            for dy, wy in ((0, one - ly), (1, ly)):
                for dx, wx in ((0, one - lx), (1, lx)):
                    p = px(b, y0 + dy, x0 + dx)
                    acc = [a_ + wy * wx * v for a_, v in zip(acc, p)]
            vals = [rhe(v, 2 * f) for v in acc]
        out[b, i, j] = [min(max(v, qmin), qmax) for v in vals]
    return out


GRID_CASES = [(m, p, a) for m in ("BILINEAR", "NEAREST") for p in ("ZEROS", "BORDER", "REFLECTION")
              for a in (False, True)]


def grid_graph(method: str, padding: str, align: bool):
    return one_layer("GridSample", {"method": method, "padding_mode": padding, "align_corners": align},
                     [1, 6, 7, 3], [[1, 4, 5, 3]], extra_inputs=[("grid", [1, 4, 5, 2], Dtype.FP32)])


def grid_data(seed: int, n: int = 3, spread: float = 1.3) -> List[List[torch.Tensor]]:
    r = np.random.default_rng(seed)
    return [[torch.from_numpy(r.normal(0.2, 1.5, size=(2, 6, 7, 3)).astype(np.float32)),
             torch.from_numpy(r.uniform(-spread, spread, size=(2, 4, 5, 2)).astype(np.float32))] for _ in range(n)]


@pytest.mark.parametrize("method,padding,align", GRID_CASES)
def test_gridsample_float_matches_reference(method: str, padding: str, align: bool) -> None:
    g = grid_graph(method, padding, align)
    x, grid = grid_data(6, 1)[0]
    got = g.forward([x, grid])[0]
    want = ref_grid_float(x.numpy().astype(np.float64), grid.numpy().astype(np.float64), method.lower(),
                          padding.lower(), align)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("method,padding,align", GRID_CASES)
def test_gridsample_integer_matches_reference(method: str, padding: str, align: bool, bits: int, mode: str) -> None:
    g = grid_graph(method, padding, align)
    qg = quantize_model(g, grid_data(7), settings(bits, mode))
    node = qg.node("op")
    assert node.params["interp_shift_value"] == 13 and node.params["scale_type"] == Dtype.UINT16
    out, inp = node.outputs[0], node.inputs[0]
    op, ip = params_of(node, out), params_of(node, inp)
    assert (op.scale, op.zerop, out.dtype) == (ip.scale, ip.zerop, inp.dtype)
    qg.forward(grid_data(8, 1, spread=1.6)[0])
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    want = ref_grid_int(node, node.inputs[0].betensor.numpy(), node.inputs[1].betensor.numpy())
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("method,padding,align", [("BILINEAR", "ZEROS", False), ("BILINEAR", "BORDER", True),
                                                  ("BILINEAR", "REFLECTION", False), ("NEAREST", "BORDER", False)])
@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.999)])
def test_gridsample_cosine(method: str, padding: str, align: bool, bits: int, threshold: float) -> None:
    g = grid_graph(method, padding, align)
    r = np.random.default_rng(9)
    data = [[smooth_data([2, 6, 7, 3], 10 + i, 1)[0],
             torch.from_numpy(r.uniform(-1.1, 1.1, size=(2, 4, 5, 2)).astype(np.float32))] for i in range(3)]
    qg = quantize_model(g, data, settings(bits, "per_tensor_symmetric_full_range"))
    assert cosine(g.forward(data[0])[0].clone(), run_quantized(qg, data[0])[0]) > threshold


# ================================================================================================ layout ops
def ref_depth_to_space(x: np.ndarray, by: int, bx: int, mode: str) -> np.ndarray:
    n, h, w, c = x.shape
    co = c // (by * bx)
    out = np.zeros((n, h * by, w * bx, co), dtype=x.dtype)
    for hh, ww, i, j, cc in itertools.product(range(h), range(w), range(by), range(bx), range(co)):
        k = (i * bx + j) * co + cc if mode == "DCR" else cc * by * bx + i * bx + j
        out[:, hh * by + i, ww * bx + j, cc] = x[:, hh, ww, k]
    return out


def ref_space_to_depth(x: np.ndarray, by: int, bx: int) -> np.ndarray:
    n, h, w, c = x.shape
    out = np.zeros((n, h // by, w // bx, by * bx * c), dtype=x.dtype)
    for hh, ww, i, j, cc in itertools.product(range(h // by), range(w // bx), range(by), range(bx), range(c)):
        out[:, hh, ww, (i * bx + j) * c + cc] = x[:, hh * by + i, ww * bx + j, cc]
    return out


def ref_space_to_batch(x: np.ndarray, by: int, bx: int, pads: Sequence[int], fill: float) -> np.ndarray:
    left, right, top, bottom = pads
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), constant_values=fill)
    n, h, w, c = xp.shape
    out = np.zeros((n * by * bx, h // by, w // bx, c), dtype=x.dtype)
    for nn, hh, ww, i, j in itertools.product(range(n), range(h // by), range(w // bx), range(by), range(bx)):
        out[(i * bx + j) * n + nn, hh, ww] = xp[nn, hh * by + i, ww * bx + j]
    return out


def ref_batch_to_space(x: np.ndarray, by: int, bx: int, crops: Sequence[int]) -> np.ndarray:
    left, right, top, bottom = crops
    nb, h, w, c = x.shape
    n = nb // (by * bx)
    t = np.zeros((n, h * by, w * bx, c), dtype=x.dtype)
    for nn, hh, ww, i, j in itertools.product(range(n), range(h), range(w), range(by), range(bx)):
        t[nn, hh * by + i, ww * bx + j] = x[(i * bx + j) * n + nn, hh, ww]
    return t[:, top:h * by - bottom, left:w * bx - right]


def ref_channel_shuffle(x: np.ndarray, group: int, splits: int) -> List[np.ndarray]:
    c = x.shape[-1]
    out = np.zeros_like(x)
    for g_, k in itertools.product(range(group), range(c // group)):
        out[..., k * group + g_] = x[..., g_ * (c // group) + k]
    return np.split(out, splits, axis=-1)


def ref_repeat(x: np.ndarray, reps: np.ndarray, axis: Optional[int], length: int, fill: float) -> np.ndarray:
    if axis is None:
        x, axis = x.reshape(-1), 0
    parts = []
    for i in range(x.shape[axis]):
        parts += [np.take(x, [i], axis=axis)] * int(reps[i])
    y = np.concatenate(parts, axis=axis)
    if y.shape[axis] >= length:
        return np.take(y, range(length), axis=axis)
    pad_shape = list(y.shape)
    pad_shape[axis] = length - y.shape[axis]
    return np.concatenate([y, np.full(pad_shape, fill, dtype=y.dtype)], axis=axis)


def ref_reverse_sequence(x: np.ndarray, lens: Sequence[int], batch_axis: int, time_axis: int) -> np.ndarray:
    out = x.copy()
    t_len = x.shape[time_axis]
    for b in range(x.shape[batch_axis]):
        n = min(max(int(lens[b] if len(lens) > 1 else lens[0]), 0), t_len)
        for t in range(n):
            src = [slice(None)] * x.ndim
            dst = [slice(None)] * x.ndim
            src[batch_axis] = dst[batch_axis] = b
            src[time_axis], dst[time_axis] = n - 1 - t, t
            out[tuple(dst)] = x[tuple(src)]
    return out


REPEATS = np.array([2, 0, 1, 3], dtype=np.int32)
SEQ_LENS = np.array([3, 7], dtype=np.int32)

# (name, optype, params, in shape, out shapes, build kwargs, reference(x, fill) -> list of outputs)
LAYOUT_CASES: List[Tuple[str, str, Dict[str, Any], List[int], List[List[int]], Dict[str, Any], Any]] = [
    ("d2s-dcr", "DepthToSpace", {"block_size_x": 2, "block_size_y": 2, "mode": "DCR"}, [1, 3, 4, 8],
     [[1, 6, 8, 2]], {}, lambda x, f: [ref_depth_to_space(x, 2, 2, "DCR")]),
    ("d2s-crd", "DepthToSpace", {"block_size_x": 3, "block_size_y": 2, "mode": "CRD"}, [1, 3, 4, 12],
     [[1, 6, 12, 2]], {}, lambda x, f: [ref_depth_to_space(x, 2, 3, "CRD")]),
    ("s2d", "SpaceToDepth", {"block_size_x": 2, "block_size_y": 3}, [1, 6, 4, 3], [[1, 2, 2, 18]], {},
     lambda x, f: [ref_space_to_depth(x, 3, 2)]),
    ("s2b", "SpaceToBatch", {"block_size_x": 2, "block_size_y": 2, "pad_left": 1, "pad_right": 1, "pad_top": 0,
                             "pad_bottom": 2}, [1, 4, 6, 3], [[4, 3, 4, 3]], {},
     lambda x, f: [ref_space_to_batch(x, 2, 2, (1, 1, 0, 2), f)]),
    ("b2s", "BatchToSpace", {"block_size_x": 2, "block_size_y": 2, "crop_left": 1, "crop_right": 0, "crop_top": 0,
                             "crop_bottom": 1}, [4, 3, 4, 3], [[1, 5, 7, 3]], {},
     lambda x, f: [ref_batch_to_space(x, 2, 2, (1, 0, 0, 1))]),
    ("shuffle", "ChannelShuffle", {"group": 3, "splits": 1}, [1, 3, 4, 12], [[1, 3, 4, 12]], {},
     lambda x, f: ref_channel_shuffle(x, 3, 1)),
    ("shuffle-split", "ChannelShuffle", {"group": 2, "splits": 2}, [1, 3, 4, 8], [[1, 3, 4, 4], [1, 3, 4, 4]], {},
     lambda x, f: ref_channel_shuffle(x, 2, 2)),
    ("crop", "Crop", {"crops": [[0, 1], [1, 4], [0, 3], [2, 5]]}, [1, 5, 4, 6], [[1, 3, 3, 3]], {},
     lambda x, f: [x[:, 1:4, 0:3, 2:5]]),
    ("tile", "Tile", {"repeats": [1, 2, 1, 3]}, [1, 3, 4, 2], [[1, 6, 4, 6]], {},
     lambda x, f: [np.tile(x, (1, 2, 1, 3))]),
    ("repeat-input", "Repeat", {"axis": 2}, [1, 3, 4, 2], [[1, 3, 7, 2]],
     {"const_inputs": [("reps", REPEATS, Dtype.INT32)]}, lambda x, f: [ref_repeat(x, REPEATS, 2, 7, f)]),
    ("repeat-pad", "Repeat", {"axis": 2}, [1, 3, 4, 2], [[1, 3, 9, 2]],
     {"constants": {"repeats": REPEATS}, "constant_dtypes": {"repeats": Dtype.INT32}},
     lambda x, f: [ref_repeat(x, REPEATS, 2, 9, f)]),
    ("repeat-cut", "Repeat", {"axis": 2}, [1, 3, 4, 2], [[1, 3, 5, 2]],
     {"const_inputs": [("reps", REPEATS, Dtype.INT32)]}, lambda x, f: [ref_repeat(x, REPEATS, 2, 5, f)]),
    ("revseq", "ReverseSequence", {"batch_axis": 0, "time_axis": 1}, [2, 8, 3], [[2, 8, 3]],
     {"const_inputs": [("lens", SEQ_LENS, Dtype.INT32)]}, lambda x, f: [ref_reverse_sequence(x, SEQ_LENS, 0, 1)]),
    ("revseq-t0", "ReverseSequence", {"batch_axis": 1, "time_axis": 0}, [2, 8, 3], [[2, 8, 3]],
     {"const_inputs": [("lens", np.array([2], dtype=np.int32), Dtype.INT32)]},
     lambda x, f: [ref_reverse_sequence(x, [2], 1, 0)]),
    ("revseq-all", "ReverseSequence", {"batch_axis": 0, "time_axis": 2}, [2, 3, 5], [[2, 3, 5]], {},
     lambda x, f: [ref_reverse_sequence(x, [5], 0, 2)]),
]


def layout_graph(case):
    _, optype, params, in_shape, out_shapes, kwargs, _ = case
    return one_layer(optype, params, in_shape, out_shapes, **kwargs)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layout_float_matches_reference(case) -> None:
    g = layout_graph(case)
    x = rng_data(case[3], 11, 1)[0]
    got = g.forward([x])
    want = case[6](x.numpy(), 0.0)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layout_integer_matches_reference(case, bits: int, mode: str) -> None:
    g = layout_graph(case)
    qg = quantize_model(g, rng_data(case[3], 12), settings(bits, mode))
    node = qg.node("op")
    qg.forward([rng_data(case[3], 13, 1)[0]])
    inp = node.inputs[0]
    zp, qmin, qmax = qinfo(node, inp)
    ip = params_of(node, inp)
    for out in node.outputs:
        op = params_of(node, out)
        assert (op.scale, op.zerop, op.qmin, op.qmax, out.dtype) == (ip.scale, ip.zerop, qmin, qmax, inp.dtype)
    want = case[6](inp.betensor.numpy(), min(max(-zp, qmin), qmax))
    for out, w in zip(node.outputs, want):
        assert out.betensor.dtype == torch.int64
        np.testing.assert_array_equal(out.betensor.numpy(), w)
    # float vs dequantized: pure data movement loses nothing beyond the input quantization
    x = rng_data(case[3], 12, 1)[0]
    ref = g.forward([x])[0].clone()
    assert cosine(ref, run_quantized(qg, x)[0]) > (0.99 if bits == 8 else 0.9999)


def test_actual_batch_differs_from_ir() -> None:
    """SpaceToBatch → BatchToSpace on a batch of 3 with an IR batch of 1 round-trips, float and quantized."""
    b = GraphBuilder("t")
    x = b.input("x", [1, 4, 6, 3])
    t = b.layer("SpaceToBatch", [x], [[4, 3, 4, 3]], name="s2b",
                params={"block_size_x": 2, "block_size_y": 2, "pad_left": 1, "pad_right": 1, "pad_bottom": 2})
    y = b.layer("BatchToSpace", [t], [[1, 4, 6, 3]], name="b2s",
                params={"block_size_x": 2, "block_size_y": 2, "crop_left": 1, "crop_right": 1, "crop_bottom": 2})
    g = b.build([y])
    data = rng_data([3, 4, 6, 3], 14)
    assert torch.equal(g.forward([data[0]])[0], data[0])
    qg = quantize_model(g, data, settings(8, "per_tensor_asymmetric"))
    qg.forward([data[1]])
    assert torch.equal(qg.node("b2s").outputs[0].betensor, qg.node("x").outputs[0].betensor)


# ================================================================================================ IR round trip
ROUNDTRIP = ([("Resize", c[2], c[0], [c[1]], {}) for c in RESIZE_CASES[::3]]
             + [("GridSample", {"method": m, "padding_mode": p, "align_corners": a}, [1, 6, 7, 3], [[1, 4, 5, 3]],
                 {"extra_inputs": [("grid", [1, 4, 5, 2], Dtype.FP32)]}) for m, p, a in GRID_CASES[::2]]
             + [(c[1], c[2], c[3], c[4], c[5]) for c in LAYOUT_CASES])
# resampling ops in 8-bit asymmetric and 16-bit; data movement (no params of its own) in one mode
ROUNDTRIP_RUNS = [(c, m) for c in ROUNDTRIP for m in ([MODES[1], MODES[2]] if c[0] in ("Resize", "GridSample")
                                                      else [MODES[1 + len(c[1]) % 2]])]


@pytest.mark.parametrize("case,bits_mode", ROUNDTRIP_RUNS,
                         ids=[f"{i}-{c[0]}-{m[0]}" for i, (c, m) in enumerate(ROUNDTRIP_RUNS)])
def test_written_ir_reloads_bit_identical(tmp_path, case, bits_mode: Tuple[int, str]) -> None:
    optype, params, in_shape, out_shapes, kwargs = case
    bits, mode = bits_mode
    g = one_layer(optype, params, in_shape, out_shapes, **kwargs)
    if optype == "GridSample":
        data, x = grid_data(15), grid_data(16, 1, 1.5)[0]
    else:
        data, x = rng_data(in_shape, 15), [rng_data(in_shape, 16, 1, std=2.5)[0]]
    qg = quantize_model(g, data, settings(bits, mode))
    before = [t.clone() for t in qg.forward(x)]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    after = re.forward(x)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert b.dtype == torch.int64 and torch.equal(a, b)


# ================================================================================================ errors
BAD_PARAMS = [
    ("Resize", {"method": "SPLINE", "mode": "HALF_PIXEL"}, [1, 4, 4, 2], [1, 8, 8, 2], IRError, "resize method"),
    ("Resize", {"method": "BILINEAR", "mode": "CORNERS"}, [1, 4, 4, 2], [1, 8, 8, 2], IRError, "coordinate mode"),
    ("Resize", {"method": "NEAREST", "mode": "ASYMMETRIC", "nearest_mode": "UP"}, [1, 4, 4, 2], [1, 8, 8, 2],
     IRError, "nearest_mode"),
    ("Resize", {"method": "BILINEAR", "mode": "HALF_PIXEL", "ratio_x": -2.0}, [1, 4, 4, 2], [1, 8, 8, 2], IRError,
     "ratio_x"),
    ("Resize", {"method": "BILINEAR", "size": [1, 8, 8]}, [1, 4, 4, 2], [1, 8, 8, 2], IRError, "size"),
    ("Resize", {"method": "AREA", "mode": "HALF_PIXEL"}, [1, 4, 4, 2], [1, 2, 2, 2], UnsupportedError, "AREA"),
    ("Resize", {"method": "BILINEAR", "mode": "TF_CROP_AND_RESIZE"}, [1, 4, 4, 2], [1, 8, 8, 2], UnsupportedError,
     "TF_CROP_AND_RESIZE"),
    ("Resize", {"method": "BILINEAR", "mode": "HALF_PIXEL", "antialias": True}, [1, 8, 8, 2], [1, 4, 4, 2],
     UnsupportedError, "antialias"),
    ("Resize", {"method": "BICUBIC", "mode": "HALF_PIXEL", "exclude_outside": True}, [1, 4, 4, 2], [1, 8, 8, 2],
     UnsupportedError, "exclude_outside"),
    ("DepthToSpace", {"block_size_x": 2, "block_size_y": 2, "mode": "XYZ"}, [1, 2, 2, 8], [1, 4, 4, 2], IRError,
     "DCR or CRD"),
    ("DepthToSpace", {"block_size_x": 3, "block_size_y": 3}, [1, 2, 2, 8], [1, 6, 6, 1], IRError, "multiple"),
    ("DepthToSpace", {"block_size_y": 2}, [1, 2, 2, 8], [1, 4, 4, 2], IRError, "block_size_x"),
    ("SpaceToDepth", {"block_size_x": 0, "block_size_y": 2}, [1, 4, 4, 2], [1, 2, 2, 8], IRError, ">= 1"),
    ("SpaceToBatch", {"block_size_x": 3, "block_size_y": 2}, [1, 4, 4, 2], [6, 2, 1, 2], IRError, "multiple"),
    ("BatchToSpace", {"block_size_x": 3, "block_size_y": 3}, [4, 2, 2, 2], [1, 6, 6, 2], IRError, "multiple"),
    ("ChannelShuffle", {"group": 3}, [1, 2, 2, 8], [1, 2, 2, 8], IRError, "multiple"),
    ("Crop", {"crops": [[0, 1], [0, 9], [0, 2], [0, 2]]}, [1, 4, 4, 2], [1, 4, 2, 2], IRError, "out of range"),
    ("Crop", {"crops": [[0, 1], [0, 2]]}, [1, 4, 4, 2], [1, 2, 4, 2], IRError, "one"),
    ("Tile", {"repeats": [1, 0, 1, 1]}, [1, 4, 4, 2], [1, 4, 4, 2], IRError, "repeats"),
    ("Tile", {"repeats": "two"}, [1, 4, 4, 2], [1, 4, 4, 2], IRError, "list of integers"),
    ("Repeat", {"axis": 1}, [1, 4, 4, 2], [1, 8, 4, 2], IRError, "repeats"),
    ("ReverseSequence", {"batch_axis": 1, "time_axis": 1}, [1, 4, 4, 2], [1, 4, 4, 2], IRError, "differ"),
]


@pytest.mark.parametrize("optype,params,in_shape,out_shape,error,match", BAD_PARAMS,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_PARAMS)])
def test_bad_params_raise_clear_errors(optype, params, in_shape, out_shape, error, match) -> None:
    g = one_layer(optype, params, in_shape, [out_shape])
    with pytest.raises(error, match=match) as info:
        g.forward([torch.zeros(in_shape)])
    assert "'op'" in str(info.value)


@pytest.mark.parametrize("params,match", [({"method": "BICUBIC", "padding_mode": "ZEROS"}, "BICUBIC"),
                                          ({"method": "BILINEAR", "padding_mode": "WRAP"}, "padding_mode")])
def test_gridsample_bad_params(params, match) -> None:
    g = one_layer("GridSample", params, [1, 6, 7, 3], [[1, 4, 5, 3]], extra_inputs=[("grid", [1, 4, 5, 2],
                                                                                       Dtype.FP32)])
    with pytest.raises((IRError, UnsupportedError), match=match):
        g.forward(grid_data(1, 1)[0])


def test_gridsample_grid_shape_error() -> None:
    g = one_layer("GridSample", {"method": "BILINEAR"}, [1, 6, 7, 3], [[1, 4, 5, 3]],
                  extra_inputs=[("grid", [1, 4, 5, 3], Dtype.FP32)])
    with pytest.raises(IRError, match="grid must be"):
        g.forward([torch.zeros(1, 6, 7, 3), torch.zeros(1, 4, 5, 3)])


def test_quantized_resize_needs_interp_shift() -> None:
    g = one_layer("Resize", {"method": "BILINEAR", "mode": "HALF_PIXEL"}, [1, 4, 4, 2], [[1, 8, 8, 2]])
    data = rng_data([1, 4, 4, 2], 17)
    qg = quantize_model(g, data, settings(8, "per_tensor_asymmetric"))
    del qg.node("op").params["interp_shift_value"]
    with pytest.raises(IRError, match="interp_shift_value"):
        qg.forward([data[0]])


def test_unsupported_quantize_is_reported_at_quantization() -> None:
    g = one_layer("Resize", {"method": "AREA", "mode": "HALF_PIXEL"}, [1, 4, 4, 2], [[1, 2, 2, 2]])
    node = g.node("op")
    inp = node.inputs[0]
    set_quant(node, inp, scale=10.0, zerop=0, qmin=-128, qmax=127, qbits=8)
    inp.dtype = Dtype.INT8
    with pytest.raises(UnsupportedError, match="'op'.*AREA"):
        node.quantize()


def test_repeat_needs_integer_repeats() -> None:
    """A float (quantized) repeats tensor cannot drive an integer Repeat."""
    g = one_layer("Repeat", {"axis": 2}, [1, 3, 4, 2], [[1, 3, 7, 2]], extra_inputs=[("reps", [4], Dtype.FP32)])
    reps = torch.tensor([2.0, 0.0, 1.0, 3.0])
    with pytest.raises(UnsupportedError, match="integer"):
        quantize_model(g, [[d, reps] for d in rng_data([1, 3, 4, 2], 18)], settings(8, "per_tensor_asymmetric"))


INTERP_CASES = [c for c in RESIZE_CASES if c[2]["method"] != "NEAREST"]


@pytest.mark.parametrize("band,int64", [(1, False), (300, False), (1, True)], ids=["rows", "few", "int64"])
@pytest.mark.parametrize("case", INTERP_CASES, ids=[f"{i}" for i in range(len(INTERP_CASES))])
def test_resize_integer_in_bands_and_in_int64_matches_reference(monkeypatch, case, band: int, int64: bool) -> None:
    """The float64 form in bands of one or a few output rows, and the int64 form (the float64 bound made to
    fail), give the reference's integers; batch 3, 16 bits (the widest sums)."""
    geometry = quantopt.ops.geometry
    monkeypatch.setattr(geometry, "INTERP_BAND_ELEMENTS", band)
    if int64:
        monkeypatch.setattr(geometry, "FLOAT64_EXACT", 0)
    in_shape, out_shape, params = case
    g = one_layer("Resize", params, in_shape, [out_shape])
    qg = quantize_model(g, rng_data([2, *in_shape[1:]], 3), settings(16, "per_tensor_asymmetric"))
    node = qg.node("op")
    qg.forward([rng_data([3, *in_shape[1:]], 4, 1, std=2.5)[0]])
    got = node.outputs[0].betensor
    want = ref_resize(node.inputs[0].betensor.numpy(), s=13, **_resize_args(in_shape, out_shape, params))
    _, qmin, qmax = qinfo(node, node.outputs[0])
    np.testing.assert_array_equal(got.numpy(), np.clip(want, qmin, qmax))


def _bilinear_whole(x: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """The upstream-form float64 bilinear sum written on whole tensors (the four products, summed in order)."""
    h_in, w_in = int(x.shape[1]), int(x.shape[2])
    y0, x0 = torch.clamp(torch.floor(ys), 0, h_in - 1), torch.clamp(torch.floor(xs), 0, w_in - 1)
    y1, x1 = torch.clamp(torch.ceil(ys), max=h_in - 1), torch.clamp(torch.ceil(xs), max=w_in - 1)
    dy, dx = ys - y0, xs - x0
    wy, wx, dy, dx = (1 - dy)[:, None, None], (1 - dx)[None, :, None], dy[:, None, None], dx[None, :, None]
    y0, y1, x0, x1 = (v.long() for v in (y0, y1, x0, x1))
    top, bottom = x.index_select(1, y0), x.index_select(1, y1)
    return (top.index_select(2, x0) * (wy * wx) + top.index_select(2, x1) * (wy * dx)
            + bottom.index_select(2, x0) * (dy * wx) + bottom.index_select(2, x1) * (dy * dx))


@pytest.mark.parametrize("band", [1, 150, 1 << 16])
@pytest.mark.parametrize("mode", ["HALF_PIXEL", "ALIGN_CORNERS", "ASYMMETRIC", "PYTORCH_HALF_PIXEL"])
def test_bilinear_float_bands_give_the_whole_tensor_sums(monkeypatch, band: int, mode: str) -> None:
    geometry = quantopt.ops.geometry
    monkeypatch.setattr(geometry, "BILINEAR_BAND_ELEMENTS", band)
    g = one_layer("Resize", {"method": "BILINEAR", "mode": mode}, [1, 6, 9, 5], [[1, 13, 7, 5]])
    node = g.node("op")
    x = rng_data([2, 6, 9, 5], 7)[0]
    node.inputs[0].betensor = x
    got = geometry._bilinear_float64(node, x)
    ys = geometry._source_coordinates(mode.lower(), 6, 13, None)
    xs = geometry._source_coordinates(mode.lower(), 9, 7, None)
    want = _bilinear_whole(x, ys, xs)
    assert got.dtype == torch.float64 and torch.equal(got, want)
