"""LayerNorm, GroupNorm, InstanceNorm, RMSNorm, MVN, LRN and Normalization: float forward against torch/numpy,
integer forward against an independent python-int reference written from docs/semantics/normalization.md,
float-vs-dequantized cosine on transformer-like data with outliers, IR write → re-read, bad params."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from int_refs import clamp, rhe_div
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.ops.normalization import inverse_sqrt, isqrt
from quantopt.pipeline import quantize_model, run_quantized

C = 16
RNG = np.random.default_rng(1234)
GAMMA = RNG.normal(1.0, 0.4, C).astype(np.float32)
BETA = RNG.normal(0.0, 0.5, C).astype(np.float32)
GAMMA_2D = RNG.normal(1.0, 0.3, (3, C)).astype(np.float32)

# (name, type, IR shape, params, constants)
CASES: List[Tuple[str, str, List[int], Dict[str, Any], Dict[str, Any]]] = [
    ("ln-affine", "LayerNorm", [1, 6, C], {"axis": [-1], "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("ln-plain", "LayerNorm", [1, 6, C], {"axis": [-1], "epsilon": 1e-5}, {}),
    ("ln-2axes", "LayerNorm", [1, 2, 3, C], {"axis": [2, 3], "epsilon": 1e-5}, {"weights": GAMMA_2D}),
    ("ln-bias-only", "LayerNorm", [1, 6, C], {"axis": [-1], "epsilon": 1e-3}, {"biases": BETA}),
    ("gn", "GroupNorm", [1, 3, 3, C], {"group": 4, "axis": -1, "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("in", "InstanceNorm", [1, 3, 4, C], {"epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("rms", "RMSNorm", [1, 6, C], {"axis": [-1], "epsilon": 1e-6}, {"weights": GAMMA}),
    ("mvn", "MVN", [1, 3, 4, C], {"axis": [1, 2], "epsilon": 1e-9}, {}),
    ("mvn-mean", "MVN", [1, 3, 4, C], {"axis": [1, 2], "epsilon": 1e-9, "normalize_variance": False}, {}),
    ("lrn", "LRN", [1, 3, 3, C], {"method": "ACROSS_CHANNELS", "size": 5, "alpha": 1e-2, "beta": 0.75,
                                   "bias": 1.0}, {}),
    ("lrn-even", "LRN", [1, 3, 3, C], {"size": 4, "alpha": 2e-3, "beta": 0.5, "bias": 2.0}, {}),
    ("l2", "Normalization", [1, 3, 3, C], {"method": "L2", "axis": -1}, {}),
    ("l2-2axes", "Normalization", [1, 3, 3, C], {"axis": [1, 2]}, {}),
]
CASE_IDS = [c[0] for c in CASES]

MODES = [(8, "per_tensor_symmetric_full_range", 8), (8, "per_tensor_asymmetric", 8),
         (8, "per_tensor_symmetric_restricted_range", 8), (16, "per_tensor_symmetric_full_range", 10)]


def activations(shape: Sequence[int], batch: int, seed: int, outliers: int = 4) -> torch.Tensor:
    """Transformer-like activations: a per-channel offset, unit noise, a few large outliers."""
    r = np.random.default_rng(seed)
    x = r.normal(0.3, 1.0, [batch] + list(shape[1:])).astype(np.float32)
    x += r.normal(0.0, 0.5, shape[-1]).astype(np.float32)
    flat = x.reshape(-1)
    flat[r.integers(0, flat.size, outliers)] *= 15.0
    return torch.from_numpy(x)


def one_layer(optype: str, shape: Sequence[int], params: Dict[str, Any], consts: Dict[str, Any]):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(optype, [x], [list(shape)], name="op", params=dict(params), constants=dict(consts))
    return b.build([y])


def settings(bits: int, mode: str, lut_bits: int) -> Dict[str, Any]:
    """LayerNorm in its exact form, which this file's reference implements (the upstream form, LayerNorm's default:
    tests/ops/test_layernorm_upstream.py)."""
    return dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                q_bits_bias=48 if bits > 8 else 32, q_strategy_activation="extrema", layernorm_integer_form="exact")


def quantized(case, bits: int, mode: str, lut_bits: int, seed: int = 5):
    _, optype, shape, params, consts = case
    g = one_layer(optype, shape, params, consts)
    data = [activations(shape, 2, seed + i) for i in range(3)]
    return g, quantize_model(g, data, settings(bits, mode, lut_bits)), data


# --- 1. float forward against torch / numpy -----------------------------------------------------------------------
def _float(optype: str, x: torch.Tensor, params: Dict[str, Any], consts: Dict[str, Any]) -> torch.Tensor:
    return one_layer(optype, list(x.shape), params, consts).forward([x])[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)


def test_float_layernorm_matches_torch() -> None:
    x = activations([2, 6, C], 2, 1)
    ref = F.layer_norm(x, [C], torch.from_numpy(GAMMA), torch.from_numpy(BETA), eps=1e-5)
    _close(_float("LayerNorm", x, {"axis": [-1], "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}), ref)
    x4 = activations([2, 2, 3, C], 2, 2)
    ref = F.layer_norm(x4, [3, C], torch.from_numpy(GAMMA_2D), None, eps=1e-5)
    _close(_float("LayerNorm", x4, {"axis": [2, 3], "epsilon": 1e-5}, {"weights": GAMMA_2D}), ref)


def test_float_groupnorm_instancenorm_match_torch() -> None:
    x = activations([2, 3, 3, C], 2, 3)
    nchw = x.permute(0, 3, 1, 2)
    g, b = torch.from_numpy(GAMMA), torch.from_numpy(BETA)
    ref = F.group_norm(nchw, 4, g, b, eps=1e-5).permute(0, 2, 3, 1)
    _close(_float("GroupNorm", x, {"group": 4, "axis": 3, "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
           ref)
    ref = F.instance_norm(nchw, weight=g, bias=b, eps=1e-5).permute(0, 2, 3, 1)
    _close(_float("InstanceNorm", x, {"epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}), ref)


def test_float_rmsnorm_mvn_match_reference() -> None:
    x = activations([2, 6, C], 2, 4)
    ref = F.rms_norm(x, [C], torch.from_numpy(GAMMA), eps=1e-6)
    _close(_float("RMSNorm", x, {"axis": [-1], "epsilon": 1e-6}, {"weights": GAMMA}), ref)
    x4 = activations([2, 3, 4, C], 2, 5).numpy().astype(np.float64)
    mean = x4.mean(axis=(1, 2), keepdims=True)
    std = np.sqrt(((x4 - mean) ** 2).mean(axis=(1, 2), keepdims=True) + 1e-9)
    got = _float("MVN", torch.from_numpy(x4.astype(np.float32)), {"axis": [1, 2], "epsilon": 1e-9}, {})
    _close(got, torch.from_numpy((x4 - mean) / std))
    got = _float("MVN", torch.from_numpy(x4.astype(np.float32)),
                 {"axis": [1, 2], "epsilon": 1e-9, "normalize_variance": False}, {})
    _close(got, torch.from_numpy(x4 - mean))


@pytest.mark.parametrize("size", [3, 4, 5])
def test_float_lrn_matches_torch(size: int) -> None:
    x = activations([2, 3, 3, C], 2, 6)
    ref = F.local_response_norm(x.permute(0, 3, 1, 2), size, alpha=1e-2, beta=0.75, k=1.5).permute(0, 2, 3, 1)
    _close(_float("LRN", x, {"size": size, "alpha": 1e-2, "beta": 0.75, "bias": 1.5}, {}), ref)


def test_float_l2_normalization_matches_torch() -> None:
    x = activations([2, 3, 3, C], 2, 7)
    _close(_float("Normalization", x, {"axis": -1}, {}), F.normalize(x, dim=-1, eps=1e-12))
    _close(_float("Normalization", x, {"axis": [1, 2], "method": "l2"}, {}),
           x / torch.sqrt((x * x).sum(dim=(1, 2), keepdim=True)))


# --- 2. integer forward against an independent python-int reference -------------------------------------------
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift) (left shift for shift <= 0)."""
    if shift <= 0:
        return num << -shift
    q, r = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def ref_rsqrt(q: int) -> Tuple[int, int]:
    e = q.bit_length()
    t = e - 30 + ((e - 30) % 2)
    qn = q >> t if t >= 0 else q << -t
    return math.isqrt((1 << 62) // qn), t


def _tparams(node, t) -> Tuple[int, int, int]:
    q = params_of(node, t)
    return int(q.zerop), int(q.qmin), int(q.qmax)


def _group_ids(node, shape: Sequence[int]) -> np.ndarray:
    """Group id of every element (which elements are normalized together)."""
    rank = len(shape)
    idx = np.indices(shape)
    kind = str(node.type)
    p = node.params
    if kind == "GroupNorm":
        axis = int(p.get("axis", -1)) % rank
        per = shape[axis] // int(p["group"])
        return idx[0] * 1000 + idx[axis] // per
    if kind == "InstanceNorm":
        axes = list(range(1, rank - 1))
    else:
        axes = [a % rank for a in (p["axis"] if isinstance(p["axis"], list) else [p["axis"]])]
    keep = [d for d in range(rank) if d not in axes]
    gid = np.zeros(shape, dtype=np.int64)
    for d in keep:
        gid = gid * shape[d] + idx[d]
    return gid


def _affine_dims(node, rank: int) -> List[int]:
    kind = str(node.type)
    if kind == "GroupNorm":
        return [int(node.params.get("axis", -1)) % rank]
    if kind == "InstanceNorm":
        return [rank - 1]
    return [a % rank for a in node.params["axis"]]


def _broadcast(node, key: str, shape: Sequence[int]) -> np.ndarray:
    dims = _affine_dims(node, len(shape))
    bshape = [shape[d] if d in dims else 1 for d in range(len(shape))]
    v = node.constants[key].betensor.numpy().astype(np.int64).reshape(bshape)
    return np.broadcast_to(v, shape)


def _requant_pairs(node, shape: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    if "scale" in node.constants:
        return _broadcast(node, "scale", shape), _broadcast(node, "shift", shape)
    return (np.full(shape, int(node.params["scale_value"])), np.full(shape, int(node.params["shift_value"])))


def ref_norm(node, x_q: np.ndarray) -> np.ndarray:
    zp, _, _ = _tparams(node, node.inputs[0])
    zp_o, qmin, qmax = _tparams(node, node.outputs[0])
    shape = x_q.shape
    v = x_q.astype(np.int64) + zp
    gid = _group_ids(node, shape)
    p = node.params
    frac = int(p["norm_frac_bits"])
    variance = not (str(node.type) == "MVN" and p.get("normalize_variance") is False)
    mult, shift = _requant_pairs(node, shape)
    out = np.zeros(shape, dtype=np.int64)
    norm = np.zeros(shape, dtype=np.int64)
    for g in np.unique(gid):
        where = np.argwhere(gid == g)
        vals = [int(v[tuple(w)]) for w in where]
        n = len(vals)
        m = 0 if str(node.type) == "RMSNorm" else rhe_div(sum(vals) << frac, n)
        ds = [(a << frac) - m for a in vals]
        if not variance:
            for w, d in zip(where, ds):
                w = tuple(w)
                out[w] = clamp(rhe(d * int(mult[w]), int(shift[w]) + frac) - zp_o, qmin, qmax)
            continue
        q = max(sum(d * d for d in ds) + n * int(p["eps_value"]), 1)
        r, t = ref_rsqrt(q)
        for w, d in zip(where, ds):
            norm[tuple(w)] = clamp(rhe(d * r * int(p["norm_scale_value"]), 31 + t // 2 + int(p["norm_shift_value"])),
                                   -32767, 32767)
    if not variance:
        return out
    w_b = _broadcast(node, "weights", shape) if "weights" in node.constants else None
    b_b = _broadcast(node, "biases", shape) if "biases" in node.constants else None
    for i in np.ndindex(shape):
        acc = int(norm[i])
        if w_b is not None:
            acc = acc * int(w_b[i]) + (int(b_b[i]) if b_b is not None else 0)
        out[i] = clamp(rhe(acc * int(mult[i]), int(shift[i])) - zp_o, qmin, qmax)
    return out


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


def ref_lrn(node, x_q: np.ndarray) -> np.ndarray:
    zp, _, _ = _tparams(node, node.inputs[0])
    zp_o, qmin, qmax = _tparams(node, node.outputs[0])
    p = node.params
    size = int(p["size"])
    table = [int(a) for a in node.constants["lut"].betensor.tolist()]
    v = x_q.astype(np.int64) + zp
    out = np.zeros(x_q.shape, dtype=np.int64)
    channels = x_q.shape[-1]
    for i in np.ndindex(x_q.shape):
        c = i[-1]
        sq = sum(int(v[i[:-1] + (k,)]) ** 2 for k in range(c - size // 2, c + (size - 1) // 2 + 1)
                 if 0 <= k < channels)
        u = clamp(rhe(sq * int(p["scale_sum_value"]), int(p["shift_sum_value"])), 0, 65535)
        level = table_value(u, table, 16)
        out[i] = clamp(rhe(int(v[i]) * level * int(p["scale_value"]), int(p["shift_value"])) - zp_o, qmin, qmax)
    return out


def ref_l2(node, x_q: np.ndarray) -> np.ndarray:
    zp, _, _ = _tparams(node, node.inputs[0])
    zp_o, qmin, qmax = _tparams(node, node.outputs[0])
    p = node.params
    rank = x_q.ndim
    axes = [a % rank for a in (p["axis"] if isinstance(p["axis"], list) else [p["axis"]])]
    v = x_q.astype(np.int64) + zp
    ss = (v * v).sum(axis=tuple(axes), keepdims=True)
    ss = np.broadcast_to(ss, x_q.shape)
    out = np.zeros(x_q.shape, dtype=np.int64)
    for i in np.ndindex(x_q.shape):
        q = max(int(ss[i]), int(p["eps_value"]), 1)
        r, t = ref_rsqrt(q)
        out[i] = clamp(rhe(int(v[i]) * r * int(p["scale_value"]), 31 + t // 2 + int(p["shift_value"])) - zp_o,
                       qmin, qmax)
    return out


def reference(node, x_q: np.ndarray) -> np.ndarray:
    kind = str(node.type)
    if kind == "LRN":
        return ref_lrn(node, x_q)
    if kind == "Normalization":
        return ref_l2(node, x_q)
    return ref_norm(node, x_q)


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_integer_forward_matches_reference(case, bits: int, mode: str, lut_bits: int) -> None:
    _, qg, _ = quantized(case, bits, mode, lut_bits)
    x = activations(case[2], 2, 99, outliers=6) * 1.3  # wider than calibration: exercises the clamps
    qg.forward([x])
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), reference(node, node.inputs[0].betensor.numpy()))


def test_inverse_sqrt_routine_is_exact() -> None:
    r = np.random.default_rng(3)
    values = [1, 2, 3, 2 ** 28 - 1, 2 ** 28, 2 ** 30 - 1, 2 ** 30, 2 ** 61 + 12345, 2 ** 62 - 1]
    values += [int(v) for v in r.integers(1, 2 ** 62, 200, dtype=np.int64)]
    q = torch.tensor(values, dtype=torch.int64)
    rr, tt = inverse_sqrt(q)
    for v, got_r, got_t in zip(values, rr.tolist(), tt.tolist()):
        assert (got_r, got_t) == ref_rsqrt(v)
        assert 2 ** 16 <= got_r <= 2 ** 17
        assert abs(got_r * 2.0 ** (-31 - got_t / 2) * math.sqrt(v) - 1) < 2 ** -15
    big = torch.tensor([0, 1, 15, 16, 2 ** 34, 2 ** 62 - 1], dtype=torch.int64)
    assert isqrt(big).tolist() == [math.isqrt(int(b)) for b in big.tolist()]


def test_quantized_ir_layout() -> None:
    """LayerNorm with gamma/beta: int8 weights, int32 biases, per-element uint8 scale / int8 shift constants,
    integer params only; the normalized-tensor multiplier is sqrt(N) * 32767/sqrt(N)."""
    _, qg, _ = quantized(CASES[0], 8, "per_tensor_symmetric_full_range", 8)
    node = qg.node("op")
    assert node.constants["weights"].dtype.value == "int8"
    assert node.constants["biases"].dtype.value == "int32"
    assert node.constants["scale"].betensor.numel() == C and node.constants["shift"].betensor.numel() == C
    assert (node.params["norm_scale_value"], node.params["norm_shift_value"]) == (32767, 0)
    for key in ("norm_frac_bits", "eps_value", "norm_scale_value", "norm_shift_value"):
        assert isinstance(node.params[key], int)
    assert params_of(node, node.outputs[0]).qmin < 0


# --- 3. float vs dequantized ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,lut_bits,threshold", [(8, "per_tensor_symmetric_full_range", 8, 0.99),
                                                          (8, "per_tensor_asymmetric", 8, 0.99),
                                                          (16, "per_tensor_symmetric_full_range", 10, 0.9999)])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float_vs_dequantized_cosine(case, bits: int, mode: str, lut_bits: int, threshold: float) -> None:
    g, qg, data = quantized(case, bits, mode, lut_bits)
    x = data[0]
    assert cosine(g.forward([x])[0].clone(), run_quantized(qg, x)[0]) > threshold


def test_layernorm_transformer_shape_cosine() -> None:
    """LayerNorm over 256 features of a [1, 32, 256] sequence with a few large outliers, 8 bits."""
    r = np.random.default_rng(8)
    case = ("ln", "LayerNorm", [1, 32, 256], {"axis": [-1], "epsilon": 1e-5},
            {"weights": r.normal(1, 0.2, 256).astype(np.float32), "biases": r.normal(0, 0.2, 256).astype(np.float32)})
    g, qg, data = quantized(case, 8, "per_tensor_asymmetric", 8)
    x = data[1]
    assert cosine(g.forward([x])[0].clone(), run_quantized(qg, x)[0]) > 0.99


# --- 4. IR write → re-read ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,lut_bits", [MODES[1], MODES[3]])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_written_ir_reloads_bit_identical(tmp_path, case, bits: int, mode: str, lut_bits: int) -> None:
    _, qg, _ = quantized(case, bits, mode, lut_bits)
    x = activations(case[2], 3, 11)
    before = qg.forward([x])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


# --- 5. errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,shape,params,consts,error,match", [
    ("GroupNorm", [1, 2, 2, C], {"group": 3, "epsilon": 1e-5}, {}, IRError, "divide"),
    ("GroupNorm", [1, 2, 2, C], {"epsilon": 1e-5}, {}, IRError, "group"),
    ("LayerNorm", [1, 4, C], {"axis": [-1]}, {}, IRError, "epsilon"),
    ("LayerNorm", [1, 4, C], {"axis": [5], "epsilon": 1e-5}, {}, IRError, "out of range"),
    ("LayerNorm", [1, 4, C], {"axis": [-1], "epsilon": 1e-5}, {"weights": np.ones(3, np.float32)}, IRError,
     "elements"),
    ("MVN", [1, 2, 2, C], {"epsilon": 1e-5}, {}, IRError, "axis"),
    ("LRN", [1, 2, 2, C], {"method": "WITHIN_CHANNEL", "size": 3, "alpha": 1e-4, "beta": 0.75, "bias": 1.0}, {},
     UnsupportedError, "WITHIN_CHANNEL"),
    ("LRN", [1, 2, 2, C], {"size": 3, "alpha": 1e-4, "beta": 0.75}, {}, IRError, "bias"),
    ("Normalization", [1, 2, 2, C], {"method": "L1", "axis": -1}, {}, UnsupportedError, "L1"),
])
def test_bad_params_are_clear_errors(optype, shape, params, consts, error, match) -> None:
    g = one_layer(optype, shape, params, consts)
    with pytest.raises(error, match=match):
        quantize_model(g, [activations(shape, 2, 12)])


def test_lrn_needs_positive_bias_to_quantize() -> None:
    g = one_layer("LRN", [1, 2, 2, C], {"size": 3, "alpha": 1e-4, "beta": 0.75, "bias": 0.0}, {})
    with pytest.raises(UnsupportedError, match="bias > 0"):
        quantize_model(g, [activations([1, 2, 2, C], 2, 13)])


PER_CHANNEL = "per_channel_symmetric_full_range"
"""Set for the layer itself, a per-channel mode it cannot produce is refused; a global one falls back to per
tensor (passes/per_channel_fallback.py, tests/ops/test_per_channel_activations.py)."""


@pytest.mark.parametrize("case", [CASES[0], CASES[9], CASES[11]], ids=["ln", "lrn", "l2"])
def test_per_channel_activation_mode_is_unsupported(case) -> None:
    _, optype, shape, params, consts = case
    g = one_layer(optype, shape, params, consts)
    with pytest.raises(UnsupportedError, match="per-channel"):
        quantize_model(g, [activations(shape, 2, 14)], per_layer={"op": {"q_mode_activation": PER_CHANNEL}})
