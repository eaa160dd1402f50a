"""LayerNorm in upstream's integer form, LayerNorm's default (docs/semantics/normalization.md, "LayerNorm, GroupNorm
and InstanceNorm, upstream form"): the quantized keys and values, the integer forward against an independent
python-int reference written from that page, float vs dequantized, IR write → re-read, the per-layer choice of form,
and errors. The exact form has its tests in tests/ops/test_normalization.py; tests/test_golden_corpus.py compares the
quantized layers with upstream's."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.config.presets import preset_settings
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.ops import normalization
from quantopt.ops.normalization import isqrt_table, table_inverse_sqrt
from quantopt.pipeline import quantize_model, run_quantized

C = 16
RNG = np.random.default_rng(4321)
GAMMA = RNG.normal(1.0, 0.4, C).astype(np.float32)
BETA = RNG.normal(0.0, 0.5, C).astype(np.float32)

# (name, IR shape, params, constants)
CASES: List[Tuple[str, List[int], Dict[str, Any], Dict[str, Any]]] = [
    ("affine", [1, 6, C], {"axis": [-1], "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("plain", [1, 6, C], {"axis": [-1], "epsilon": 1e-5}, {}),
    ("bias-only", [1, 6, C], {"axis": [-1], "epsilon": 1e-5}, {"biases": BETA}),
    ("2axes", [1, 2, 3, C], {"axis": [2, 3], "epsilon": 1e-5},
     {"weights": RNG.normal(1.0, 0.3, 3 * C).astype(np.float32)}),
    ("short", [1, 5, 3], {"axis": [-1], "epsilon": 1e-5},  # N = 3: a negative var_shift at 8 bits
     {"weights": GAMMA[:3], "biases": BETA[:3]}),
    ("long", [1, 2, 20000], {"axis": [-1], "epsilon": 1e-5}, {}),  # sqrt(N) > 127: the normalized range shrinks
]
CASE_IDS = [c[0] for c in CASES]

SYM, ASYM = "per_tensor_symmetric_full_range", "per_tensor_asymmetric"
W_TENSOR, W_CHANNEL = "per_tensor_symmetric_restricted_range", "per_channel_symmetric_restricted_range"
MODES = [(8, SYM, W_TENSOR), (8, ASYM, W_CHANNEL), (16, SYM, W_TENSOR), (16, SYM, W_CHANNEL)]
MODE_IDS = ["a8", "a8-asym-wch", "a16", "a16-wch"]


def activations(shape: Sequence[int], batch: int, seed: int, outliers: int = 4) -> torch.Tensor:
    """Transformer-like activations: a per-channel offset, unit noise, a few large outliers."""
    r = np.random.default_rng(seed)
    x = r.normal(0.3, 1.0, [batch] + list(shape[1:])).astype(np.float32)
    x += r.normal(0.0, 0.5, shape[-1]).astype(np.float32)
    flat = x.reshape(-1)
    flat[r.integers(0, flat.size, outliers)] *= 15.0
    return torch.from_numpy(x)


def one_layer(shape: Sequence[int], params: Dict[str, Any], consts: Dict[str, Any]):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer("LayerNorm", [x], [list(shape)], name="op", params=dict(params), constants=dict(consts))
    return b.build([y])


def quantized(case, bits: int, mode: str, wmode: str, **extra: Any):
    _, shape, params, consts = case
    g = one_layer(shape, params, consts)
    data = [activations(shape, 2, 5 + i) for i in range(3)]
    s = dict(q_bits_activation=bits, q_bits_weight=bits, q_mode_activation=mode, q_mode_weight=wmode,
             q_strategy_activation="extrema", **extra)
    return g, quantize_model(g, data, s), data


# --- independent reference (python ints) --------------------------------------------------------------------------
def table() -> List[int]:
    return [min(32767, int(math.floor(32768 / math.sqrt(1 + j / 64) + 0.5))) for j in range(193)]


def rhe(v: int, k: int) -> int:
    """round_half_even(v / 2^k); k <= 0 multiplies."""
    if k <= 0:
        return v << -k
    q, r = v >> k, v & ((1 << k) - 1)
    half = 1 << (k - 1)
    return q + (1 if r > half or (r == half and q & 1) else 0)


def rhe_div(a: int, b: int) -> int:
    q, r = divmod(a, b)
    return q + (1 if 2 * r > b or (2 * r == b and q & 1) else 0)


def ref_isqrt(v: int, t: Sequence[int]) -> int:
    """≈ 2^31 / sqrt(v): v normalized into [2^30, 2^31) by a left shift of k <= 30, e = 31 - k; table index and
    15-bit fraction from the top bits of v (v / 2 if e is odd), interpolated, shifted right by (e - 1) / 2."""
    k = min(30, max(0, 31 - v.bit_length()))
    u, e = v << k, 31 - k
    f = u >> 1 if e % 2 else u
    i = max((f >> 23) - 64, 0)
    a = (f >> 8) & 0x7FFF
    return ((t[i] << 16) - 2 * a * (t[i] - t[i + 1])) >> ((e - 1) >> 1)


def _int_range(bits: int, signed: bool) -> Tuple[int, int]:
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def ref_forward(node, x_q: np.ndarray) -> np.ndarray:
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    p = node.params
    axes = sorted(a % x_q.ndim for a in p["axis"])
    assert axes == list(range(axes[0], x_q.ndim)), "the reference handles trailing axes"
    n_el = int(np.prod([x_q.shape[a] for a in axes]))
    rows = x_q.reshape(-1, n_el).astype(object)
    in_bits = (int(inp.qmax) - int(inp.qmin)).bit_length()
    lo, hi = _int_range(int(out.qbits), int(out.qmin) < 0)
    t = table()
    m_n, k_n = int(p["norm_scale_value"]), int(p["norm_shift_value"])
    channels = x_q.shape[-1]  # per-channel constants run along the last axis, whatever gamma's rank

    def per_element(key: str) -> List[int]:
        v = [int(a) for a in node.constants[key].betensor.reshape(-1).tolist()]
        return v if len(v) == n_el else [v[c % channels] for c in range(n_el)]

    if "scale" in node.constants:
        mults, shifts = per_element("scale"), per_element("shift")
    else:
        mults, shifts = [int(p["scale_value"])] * n_el, [int(p["shift_value"])] * n_el
    w = node.constants.get("weights")
    gamma = [int(v) for v in w.betensor.reshape(-1).tolist()] if w is not None else None
    if gamma is not None:
        zp = per_element("weights_zp") if "weights_zp" in node.constants else [int(p["weights_zp"])] * len(gamma)
        gamma = [g + int(z) for g, z in zip(gamma, zp)]
    b = node.constants.get("biases")
    beta = [int(v) for v in b.betensor.reshape(-1).tolist()] if b is not None else [0] * n_el
    zp_out, qmin, qmax = int(round(float(out.zerop))), int(out.qmin), int(out.qmax)
    y = np.zeros(rows.shape, dtype=np.int64)
    for r, row in enumerate(rows):
        vals = [int(v) for v in row]
        mean = rhe_div(sum(vals), n_el)
        d = [v - mean for v in vals]
        ss = sum(e * e for e in d)
        if in_bits <= 8:
            vs = int(p["var_shift_value"])
            var = ss >> vs if vs >= 0 else ss << -vs
            g = (ref_isqrt(var, t) + 32768) >> 16
            normed = [min(max(rhe(e * g * m_n, 8 + k_n), lo), hi) for e in d]
        else:
            g = min(max(rhe(((ref_isqrt(ss // n_el, t) + 32768) >> 16) * m_n, k_n), 0), 65535)
            normed = [min(max(rhe((e >> 1) * g, 7), lo), hi) for e in d]
        for c, n in enumerate(normed):
            acc = n * gamma[c] + beta[c] if gamma is not None else n
            y[r, c] = min(max(rhe(acc * mults[c], shifts[c]) - zp_out, qmin), qmax)
    return y.reshape(x_q.shape)


# --- the table and the inverse square root -------------------------------------------------------------------------
def test_table_samples_the_inverse_square_root() -> None:
    t = isqrt_table()
    assert t.tolist() == table()
    assert t.numel() == 193 and t[0] == 32767 and t[-1] == 16384 and t[1] == 32515
    assert bool((t[1:] <= t[:-1]).all())


def test_table_inverse_sqrt_matches_reference_and_math() -> None:
    r = np.random.default_rng(2)
    values = [0, 1, 2, 3, 255, 2 ** 29, 2 ** 30 - 1, 2 ** 30, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1]
    values += [int(v) for v in r.integers(1, 2 ** 32, 300, dtype=np.int64)]
    got = table_inverse_sqrt(torch.tensor(values, dtype=torch.int64), isqrt_table()).tolist()
    t = table()
    assert got == [ref_isqrt(v, t) for v in values]
    for v, g in zip(values[1:], got[1:]):  # what it stands for: 2^31 / sqrt(v), to the table's precision
        assert abs(g * math.sqrt(v) / 2 ** 31 - 1) < 2 ** -12
    with pytest.raises(ValueError, match="2\\^32"):
        table_inverse_sqrt(torch.tensor([2 ** 33]), isqrt_table())


# --- quantize ------------------------------------------------------------------------------------------------------
def test_quantized_keys_8_and_16_bits() -> None:
    """N = 32: 8 bits var_shift 2 and norm_shift 1; 16 bits the multiplier of s_norm / 127 = 32767.5/sqrt(32)/127
    (23353 · 2^-9, as upstream writes for this N); gamma/beta as weights/biases with scale s_norm · s_w."""
    case = ("n32", [1, 4, 32], {"axis": [-1], "epsilon": 1e-5},
            {"weights": RNG.normal(1, 0.3, 32).astype(np.float32), "biases": RNG.normal(0, 0.3, 32).astype(np.float32)})
    _, q8, _ = quantized(case, 8, SYM, W_TENSOR)
    n = q8.node("op")
    assert (n.params["var_shift_value"], n.params["norm_scale_value"], n.params["norm_shift_value"]) == (2, 1, 1)
    assert "norm_frac_bits" not in n.params and "eps_value" not in n.params
    lut = n.constants["lut"]
    assert lut.dtype.value == "int16" and lut.betensor.tolist() == table()
    assert n.constants["weights"].dtype.value == "int8" and n.constants["biases"].dtype.value == "int32"
    s_norm = np.float32(127.5 / math.sqrt(32))
    w_scale = np.float32(127 / np.abs(case[3]["weights"]).max())
    assert n.params["weights_scale"] == pytest.approx(float(w_scale), rel=1e-6) and n.params["weights_zp"] == 0
    assert n.params["biases_scale"] == pytest.approx(float(s_norm * w_scale), rel=1e-6)
    assert "scale_value" in n.params and "scale" not in n.constants
    _, q16, _ = quantized(case, 16, SYM, W_TENSOR)
    n = q16.node("op")
    assert (n.params["var_shift_value"], n.params["norm_scale_value"], n.params["norm_shift_value"]) == (0, 23353, 9)
    assert n.constants["weights"].dtype.value == "int16"


def test_per_channel_weights_give_per_channel_multipliers_without_a_shared_shift() -> None:
    _, qg, _ = quantized(CASES[0], 8, ASYM, W_CHANNEL)
    n = qg.node("op")
    assert n.constants["scale"].betensor.numel() == C and n.constants["shift"].betensor.numel() == C
    assert n.constants["weights_scale"].betensor.numel() == C
    assert len(set(n.constants["shift"].betensor.tolist())) > 1  # not unified (upstream's LayerNorm)
    assert params_of(n, n.outputs[0]).qmin < 0


def test_long_rows_shrink_the_normalized_range() -> None:
    """sqrt(N) > 127 at 8 bits: the normalized tensor's range is ±sqrt(N)·2^adj, adj = ceil(log2(127.5/sqrt(N)/4))."""
    _, qg, _ = quantized(CASES[5], 8, SYM, W_TENSOR)
    n = qg.node("op")
    adj = math.ceil(math.log2(127.5 / math.sqrt(20000) / 4))
    var_shift = math.ceil(math.log2(20000)) - 4
    var_shift += var_shift & 1
    assert n.params["norm_shift_value"] == (var_shift >> 1) + adj and adj < 0


# --- integer forward -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_integer_forward_matches_reference(case, bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(case, bits, mode, wmode)
    x = activations(case[1], 2, 99, outliers=6) * 1.3  # wider than calibration: exercises the clamps
    qg.forward([x])
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref_forward(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("bits,mode,wmode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_int64_passes_match_reference_too(monkeypatch, case, bits: int, mode: str, wmode: str) -> None:
    """The forward's float64 passes apply to every case here; the int64 passes they stand in for (kept where a
    bound fails) give the reference's integers as well."""
    _, qg, _ = quantized(case, bits, mode, wmode)
    x = activations(case[1], 2, 99, outliers=6) * 1.3
    node = qg.node("op")
    taken: List[bool] = []
    float64_form = normalization._upstream_form_float64
    monkeypatch.setattr(normalization, "_upstream_form_float64",
                        lambda *a: taken.append(float64_form(*a) is not None))
    qg.forward([x])
    assert taken == [True]
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_forward(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("bits,mode,wmode", [MODES[0], MODES[2]], ids=["a8", "a16"])
def test_extreme_and_constant_rows_match_reference(bits: int, mode: str, wmode: str) -> None:
    """Rows at the range limits, constant rows (zero variance) and rows alternating between the limits."""
    _, qg, _ = quantized(CASES[0], bits, mode, wmode)
    node = qg.node("op")
    inp = params_of(node, node.inputs[0])
    lo, hi = int(inp.qmin), int(inp.qmax)
    alt = torch.tensor([lo, hi] * (C // 2))
    x = torch.stack([torch.full([C], lo), torch.full([C], hi), torch.zeros(C, dtype=torch.int64), alt,
                     torch.randint(lo, hi + 1, [C], generator=torch.Generator().manual_seed(3))]).reshape(1, 5, C)
    node.inputs[0].betensor = x.to(torch.int64)
    node.forward()
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_forward(node, x.numpy()))


# --- float vs dequantized, re-read -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode,threshold", [(8, SYM, W_TENSOR, 0.98), (8, ASYM, W_CHANNEL, 0.98),
                                                       (16, SYM, W_TENSOR, 0.999)])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=["affine", "plain", "long"])
def test_float_vs_dequantized_cosine(case, bits: int, mode: str, wmode: str, threshold: float) -> None:
    """At 16 bits the per-row gain round(2^15 / sqrt(V)) has few significant bits (docs/semantics/normalization.md),
    so the 16-bit bound is looser than the exact form's."""
    g, qg, data = quantized(case, bits, mode, wmode)
    x = data[0]
    assert cosine(g.forward([x])[0].clone(), run_quantized(qg, x)[0]) > threshold


@pytest.mark.parametrize("bits,mode,wmode", [MODES[1], MODES[3]], ids=["a8-asym-wch", "a16-wch"])
def test_written_ir_reloads_bit_identical(tmp_path, bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(CASES[0], bits, mode, wmode)
    x = activations(CASES[0][1], 3, 11)
    before = qg.forward([x])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)
    assert "lut" in re.node("op").constants and "var_shift_value" in re.node("op").params


# --- the choice of form, errors --------------------------------------------------------------------------------------
def test_exact_form_is_a_per_layer_choice_and_the_accurate_preset_takes_it() -> None:
    _, up, _ = quantized(CASES[0], 8, SYM, W_TENSOR)
    assert "lut" in up.node("op").constants and "norm_frac_bits" not in up.node("op").params
    _, ex, _ = quantized(CASES[0], 8, SYM, W_TENSOR, layernorm_integer_form="exact")
    assert "norm_frac_bits" in ex.node("op").params and "lut" not in ex.node("op").constants
    assert preset_settings("accurate")["layernorm_integer_form"] == "exact"


def test_mixed_input_and_output_bits_are_refused_naming_the_field() -> None:
    _, shape, params, consts = CASES[0]
    g = one_layer(shape, params, consts)
    data = [activations(shape, 2, 3)]
    with pytest.raises(UnsupportedError, match="layernorm_integer_form = exact"):
        quantize_model(g, data, per_layer={"op": {"q_bits_activation": 16}})
    qg = quantize_model(g, data, per_layer={"op": {"q_bits_activation": 16, "layernorm_integer_form": "exact"}})
    assert "norm_frac_bits" in qg.node("op").params


def test_missing_table_is_an_ir_error() -> None:
    _, qg, _ = quantized(CASES[1], 8, SYM, W_TENSOR)
    node = qg.node("op")
    del node.constants["lut"]
    with pytest.raises(IRError, match="lut"):
        qg.forward([activations(CASES[1][1], 1, 2)])


@pytest.mark.parametrize("bits,mode,wmode", [MODES[1], MODES[3]], ids=["a8-asym-wch", "a16-wch"])
def test_exact_onnx_export_computes_the_same_integers(bits: int, mode: str, wmode: str) -> None:
    """The QDQ export ("exact" mode) runs the upstream form in int64: onnxruntime gives quantopt's integers."""
    pytest.importorskip("onnxruntime")
    from quantopt.exporters.agreement import measure_agreement
    from quantopt.exporters.onnx_qdq import convert_graph

    case = ("n32", [1, 5, 32], {"axis": [-1], "epsilon": 1e-5},
            {"weights": RNG.normal(1, 0.3, 32).astype(np.float32), "biases": RNG.normal(0, 0.3, 32).astype(np.float32)})
    _, qg, _ = quantized(case, bits, mode, wmode)
    result = measure_agreement(qg, [activations(case[1], 4, 21, outliers=8) * 1.2], per_layer=True)
    assert result.identical == 1.0 and result.max_steps == 0.0, result.outputs
    assert not convert_graph(qg)[1].float_layers
