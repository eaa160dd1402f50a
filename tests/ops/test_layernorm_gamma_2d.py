"""LayerNorm over several axes with gamma/beta of rank 2 (docs/semantics/normalization.md, "Gamma and beta over
several axes"), as the ONNX Parser writes `nn.LayerNorm([6, 24])`: the float forward against torch, the quantized
constants against an independent reference of the rule (per tensor, or per channel along gamma's last axis), and
the integer forward of both forms against independent python-int references written here; IR write → re-read and the
exact ONNX export. The one-axis cases are in tests/ops/test_layernorm_upstream.py and tests/ops/test_normalization.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_helpers import params_of
from test_layernorm_upstream import ref_isqrt

from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model

T, D = 6, 24
SHAPE = [1, T, D]
RNG = np.random.default_rng(2024)
GAMMA = RNG.normal(1.0, 0.4, (T, D)).astype(np.float32)
BETA = RNG.normal(0.0, 0.5, (T, D)).astype(np.float32)

SYM, ASYM = "per_tensor_symmetric_full_range", "per_tensor_asymmetric"
W_TENSOR, W_CHANNEL = "per_tensor_symmetric_restricted_range", "per_channel_symmetric_restricted_range"
W_CHANNEL_ASYM = "per_channel_asymmetric"
MODES = [(8, ASYM, W_TENSOR), (8, ASYM, W_CHANNEL), (8, SYM, W_CHANNEL_ASYM), (16, SYM, W_TENSOR),
         (16, SYM, W_CHANNEL)]
MODE_IDS = ["a8-wt", "a8-wch", "a8-wch-asym", "a16-wt", "a16-wch"]


def activations(batch: int, seed: int, outliers: int = 4) -> torch.Tensor:
    """Transformer-like activations: a per-feature offset, unit noise, a few large outliers."""
    r = np.random.default_rng(seed)
    x = r.normal(0.3, 1.0, [batch, T, D]).astype(np.float32) + r.normal(0.0, 0.5, D).astype(np.float32)
    flat = x.reshape(-1)
    flat[r.integers(0, flat.size, outliers)] *= 15.0
    return torch.from_numpy(x)


def quantized(bits: int, mode: str, wmode: str, consts: Dict[str, Any], **extra: Any):
    b = GraphBuilder("t")
    x = b.input("x", SHAPE)
    y = b.layer("LayerNorm", [x], [SHAPE], name="op", params={"axis": [1, 2], "epsilon": 1e-5},
                constants=dict(consts))
    g = b.build([y])
    data = [activations(2, 5 + i) for i in range(3)]
    s = dict(q_bits_activation=bits, q_bits_weight=bits, q_mode_activation=mode, q_mode_weight=wmode,
             q_strategy_activation="extrema", q_bits_bias=48 if bits > 8 else 32, **extra)
    return g, quantize_model(g, data, s), data


# --- independent references (python ints) ---------------------------------------------------------------------------
def rhe(v: int, k: int) -> int:
    """round_half_even(v / 2^k); k <= 0 multiplies."""
    if k <= 0:
        return v << -k
    q, r = divmod(v, 1 << k)
    return q + (1 if 2 * r > (1 << k) or (2 * r == (1 << k) and q % 2) else 0)


def rhe_div(a: int, b: int) -> int:
    q, r = divmod(a, b)
    return q + (1 if 2 * r > b or (2 * r == b and q % 2) else 0)


def clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def per_element(node, key: str, param: str) -> List[int]:
    """A value per element of one normalized row (T·D, row-major): a per-element constant as it is, a per-channel one
    (one value per column d of the last axis) repeated over the rows, or the layer's scalar param."""
    if key not in node.constants:
        return [int(node.params.get(param, 0))] * (T * D)
    v = [int(a) for a in node.constants[key].betensor.reshape(-1).tolist()]
    if len(v) == D:
        return [v[i % D] for i in range(T * D)]
    assert len(v) == T * D, f"{key}: {len(v)} values"
    return v


def ref_upstream(node, x_q: np.ndarray) -> np.ndarray:
    """Upstream's form: rounded mean, table inverse square root, normalized tensor at the activation bits, then
    (w_q + zp_w)·n + b_q requantized per element (per-channel constants along the last axis)."""
    p = node.params
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    n_el = T * D
    lo, hi = (-(1 << (int(out.qbits) - 1)), (1 << (int(out.qbits) - 1)) - 1)
    t = [int(a) for a in node.constants["lut"].betensor.tolist()]
    m_n, k_n = int(p["norm_scale_value"]), int(p["norm_shift_value"])
    gamma = [g + z for g, z in zip(per_element(node, "weights", ""), per_element(node, "weights_zp", "weights_zp"))]
    beta = per_element(node, "biases", "")
    mults, shifts = per_element(node, "scale", "scale_value"), per_element(node, "shift", "shift_value")
    zp_out, qmin, qmax = int(round(float(out.zerop))), int(out.qmin), int(out.qmax)
    rows = x_q.reshape(-1, n_el)
    y = np.zeros(rows.shape, dtype=np.int64)
    for r, row in enumerate(rows):
        vals = [int(v) for v in row]
        d = [v - rhe_div(sum(vals), n_el) for v in vals]
        ss = sum(e * e for e in d)
        if int(inp.qmax) - int(inp.qmin) < 256:
            vs = int(p["var_shift_value"])
            g = (ref_isqrt(ss >> vs if vs >= 0 else ss << -vs, t) + 32768) >> 16
            normed = [clamp(rhe(e * g * m_n, 8 + k_n), lo, hi) for e in d]
        else:
            g = clamp(rhe(((ref_isqrt(ss // n_el, t) + 32768) >> 16) * m_n, k_n), 0, 65535)
            normed = [clamp(rhe((e >> 1) * g, 7), lo, hi) for e in d]
        for c, n in enumerate(normed):
            y[r, c] = clamp(rhe((n * gamma[c] + beta[c]) * mults[c], shifts[c]) - zp_out, qmin, qmax)
    return y.reshape(x_q.shape)


def ref_rsqrt(q: int) -> Tuple[int, int]:
    e = q.bit_length()
    t = e - 30 + ((e - 30) % 2)
    return math.isqrt((1 << 62) // (q >> t if t >= 0 else q << -t)), t


def ref_exact(node, x_q: np.ndarray) -> np.ndarray:
    """quantopt's exact form: int64 mean with F fraction bits, integer inverse square root, 16-bit normalized tensor,
    per-element gamma/beta and multipliers."""
    p = node.params
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    n_el, frac = T * D, int(p["norm_frac_bits"])
    gamma, beta = per_element(node, "weights", ""), per_element(node, "biases", "")
    mults, shifts = per_element(node, "scale", "scale_value"), per_element(node, "shift", "shift_value")
    zp_out, qmin, qmax = int(out.zerop), int(out.qmin), int(out.qmax)
    rows = x_q.reshape(-1, n_el)
    y = np.zeros(rows.shape, dtype=np.int64)
    for r, row in enumerate(rows):
        vals = [int(v) + int(inp.zerop) for v in row]
        m = rhe_div(sum(vals) << frac, n_el)
        d = [(v << frac) - m for v in vals]
        rr, tt = ref_rsqrt(max(sum(e * e for e in d) + n_el * int(p["eps_value"]), 1))
        for c, e in enumerate(d):
            n = clamp(rhe(e * rr * int(p["norm_scale_value"]), 31 + tt // 2 + int(p["norm_shift_value"])),
                      -32767, 32767)
            y[r, c] = clamp(rhe((n * gamma[c] + beta[c]) * mults[c], shifts[c]) - zp_out, qmin, qmax)
    return y.reshape(x_q.shape)


# --- float forward ---------------------------------------------------------------------------------------------------
def test_float_forward_matches_torch_layer_norm() -> None:
    g, _, _ = quantized(8, ASYM, W_TENSOR, {"weights": GAMMA, "biases": BETA})
    x = activations(3, 7)
    want = F.layer_norm(x, [T, D], torch.from_numpy(GAMMA), torch.from_numpy(BETA), 1e-5)
    torch.testing.assert_close(g.forward([x])[0], want, rtol=1e-5, atol=1e-5)


# --- quantized constants ---------------------------------------------------------------------------------------------
def test_per_tensor_gamma_keeps_its_shape_with_scalar_params() -> None:
    _, qg, _ = quantized(8, ASYM, W_TENSOR, {"weights": GAMMA, "biases": BETA})
    n = qg.node("op")
    w_scale = np.float32(127) / np.float32(np.abs(GAMMA).max())
    assert n.params["weights_scale"] == pytest.approx(float(w_scale), rel=1e-6) and n.params["weights_zp"] == 0
    for key in ("weights", "biases"):
        assert list(n.constants[key].betensor.shape) == [T, D], key
    np.testing.assert_array_equal(n.constants["weights"].betensor.numpy(), np.round(GAMMA * w_scale))
    assert "scale" not in n.constants and "scale_value" in n.params and "weights_scale" not in n.constants
    assert n.constants["lut"].betensor.numel() == 193


@pytest.mark.parametrize("bits", [8, 16])
def test_per_channel_gamma_is_quantized_along_its_last_axis(bits: int) -> None:
    """One weights scale per column d: 2^(b-1)-1 / max_t |gamma[t, d]|; biases with s_norm · s_w[d]; scale/shift
    and the scale/zero-point constants of shape [D], gamma/beta of shape [T, D]."""
    _, qg, _ = quantized(bits, SYM if bits > 8 else ASYM, W_CHANNEL, {"weights": GAMMA, "biases": BETA})
    n = qg.node("op")
    qmax = 2 ** (bits - 1) - 1
    w_scale = np.float32(qmax) / np.abs(GAMMA).max(axis=0).astype(np.float32)
    got_ws = n.constants["weights_scale"].betensor.numpy()
    np.testing.assert_allclose(got_ws, w_scale, rtol=1e-6)
    np.testing.assert_array_equal(n.constants["weights"].betensor.numpy(), np.round(GAMMA * got_ws[None, :]))
    s_norm = np.float32((2 ** bits - 1) / 2 / math.sqrt(T * D))  # the normalized tensor's range is ±sqrt(N)
    b_scale = n.constants["biases_scale"].betensor.numpy()
    np.testing.assert_allclose(b_scale, s_norm * w_scale, rtol=1e-5)
    np.testing.assert_array_equal(n.constants["biases"].betensor.numpy(),
                                  np.clip(np.round(BETA * b_scale[None, :]), -2 ** 47, 2 ** 47 - 1))
    for key in ("scale", "shift", "weights_scale", "weights_zp", "biases_scale"):
        assert n.constants[key].betensor.numel() == D, key
    ratio = n.constants["scale"].betensor.double() * 2.0 ** -n.constants["shift"].betensor.double()
    s_out = float(params_of(n, n.outputs[0]).scale)
    np.testing.assert_allclose(ratio.numpy(), s_out / (s_norm * got_ws.astype(np.float64)), rtol=2 ** -(bits - 2))
    assert params_of(n, n.constants["weights"]).axis == 1


def test_gamma_alone_gets_zero_biases_of_its_shape() -> None:
    _, qg, _ = quantized(8, ASYM, W_CHANNEL, {"weights": GAMMA})
    b = qg.node("op").constants["biases"]
    assert list(b.betensor.shape) == [T, D] and not bool(b.betensor.any())


# --- integer forward -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("consts", [{"weights": GAMMA, "biases": BETA}, {"biases": BETA}], ids=["affine", "beta"])
def test_upstream_form_matches_reference(consts, bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(bits, mode, wmode, consts)
    qg.forward([activations(2, 99, outliers=6) * 1.3])  # wider than calibration: exercises the clamps
    node = qg.node("op")
    assert "lut" in node.constants and "norm_frac_bits" not in node.params
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(),
                                  ref_upstream(node, node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("bits,mode,wmode", [MODES[0], MODES[1], MODES[4]], ids=["a8-wt", "a8-wch", "a16-wch"])
def test_exact_form_matches_reference(bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(bits, mode, wmode, {"weights": GAMMA, "biases": BETA}, layernorm_integer_form="exact")
    qg.forward([activations(2, 98, outliers=6) * 1.3])
    node = qg.node("op")
    assert "norm_frac_bits" in node.params and node.constants["scale"].betensor.numel() == T * D
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_exact(node, node.inputs[0].betensor.numpy()))


# --- IR round trip, export -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode", [MODES[1], MODES[2], MODES[4]], ids=["a8-wch", "a8-wch-asym", "a16-wch"])
def test_written_ir_reloads_bit_identical(tmp_path, bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(bits, mode, wmode, {"weights": GAMMA, "biases": BETA})
    x = activations(3, 11)
    before = qg.forward([x])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)


@pytest.mark.parametrize("bits,mode,wmode", [MODES[1], MODES[2], MODES[4]], ids=["a8-wch", "a8-wch-asym", "a16-wch"])
def test_exact_onnx_export_computes_the_same_integers(bits: int, mode: str, wmode: str) -> None:
    pytest.importorskip("onnxruntime")
    from quantopt.exporters.agreement import measure_agreement

    _, qg, _ = quantized(bits, mode, wmode, {"weights": GAMMA, "biases": BETA})
    result = measure_agreement(qg, [activations(4, 21, outliers=8) * 1.2], per_layer=True)
    assert result.identical == 1.0 and result.max_steps == 0.0, result.outputs
