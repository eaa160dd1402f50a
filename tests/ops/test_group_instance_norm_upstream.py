"""GroupNorm and InstanceNorm in upstream's integer form, their default (docs/semantics/normalization.md, "LayerNorm,
GroupNorm and InstanceNorm, upstream form"): the quantized keys, the integer forward against an independent
python-int reference that forms the groups from the channels itself, float vs dequantized, IR write -> re-read, the
exact form as a per-layer choice, and the shift unification upstream applies to GroupNorm only.
tests/test_golden_corpus.py (model `norms`) compares the quantized layers with upstream's."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from test_layernorm_upstream import _int_range, activations, ref_isqrt, rhe, rhe_div, table

from quantopt.analysis.similarity import cosine
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

C = 16
RNG = np.random.default_rng(97)
GAMMA = RNG.normal(1.0, 0.4, C).astype(np.float32)
BETA = RNG.normal(0.0, 0.5, C).astype(np.float32)

# (name, type, IR shape, params, constants)
CASES: List[Tuple[str, str, List[int], Dict[str, Any], Dict[str, Any]]] = [
    ("gn", "GroupNorm", [1, 5, 6, C], {"group": 4, "axis": 3, "epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("gn-plain", "GroupNorm", [1, 5, 6, C], {"group": 2, "axis": -1, "epsilon": 1e-5}, {}),
    ("gn-one", "GroupNorm", [1, 4, 4, C], {"group": 1, "axis": 3, "epsilon": 1e-5}, {"biases": BETA}),
    ("in", "InstanceNorm", [1, 5, 6, C], {"epsilon": 1e-5}, {"weights": GAMMA, "biases": BETA}),
    ("in-short", "InstanceNorm", [1, 2, 2, C], {"epsilon": 1e-5}, {"weights": GAMMA}),  # N = 4: var_shift < 0
]
CASE_IDS = [c[0] for c in CASES]

SYM, ASYM = "per_tensor_symmetric_full_range", "per_tensor_asymmetric"
W_TENSOR, W_CHANNEL = "per_tensor_symmetric_restricted_range", "per_channel_symmetric_restricted_range"
MODES = [(8, SYM, W_TENSOR), (8, ASYM, W_CHANNEL), (16, SYM, W_TENSOR), (16, SYM, W_CHANNEL)]
MODE_IDS = ["a8", "a8-asym-wch", "a16", "a16-wch"]


def one_layer(kind: str, shape: Sequence[int], params: Dict[str, Any], consts: Dict[str, Any]):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer(kind, [x], [list(shape)], name="op", params=dict(params), constants=dict(consts))
    return b.build([y])


def quantized(case, bits: int, mode: str, wmode: str, **extra: Any):
    _, kind, shape, params, consts = case
    g = one_layer(kind, shape, params, consts)
    data = [activations(shape, 2, 15 + i) for i in range(3)]
    s = dict(q_bits_activation=bits, q_bits_weight=bits, q_mode_activation=mode, q_mode_weight=wmode,
             q_strategy_activation="extrema", **extra)
    return g, quantize_model(g, data, s), data


# --- independent reference (python ints) --------------------------------------------------------------------------
def group_members(kind: str, params: Dict[str, Any], shape: Sequence[int]) -> List[List[int]]:
    """Flat indices of each normalization group of a channels-last tensor: GroupNorm, every element of a batch item
    whose channel lies in one group's C/group consecutive channels; InstanceNorm, one channel of a batch item."""
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    channels = shape[-1]
    members = []
    for b in range(shape[0]):
        if kind == "GroupNorm":
            width = channels // int(params["group"])
            members += [flat[b, ..., k:k + width].reshape(-1).tolist() for k in range(0, channels, width)]
        else:
            members += [flat[b, ..., c].reshape(-1).tolist() for c in range(channels)]
    return members


def ref_forward(node, kind: str, x_q: np.ndarray) -> np.ndarray:
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    p = node.params
    channels = x_q.shape[-1]
    values = [int(v) for v in x_q.reshape(-1).tolist()]
    in_bits = (int(inp.qmax) - int(inp.qmin)).bit_length()
    lo, hi = _int_range(int(out.qbits), int(out.qmin) < 0)
    t = table()
    m_n, k_n = int(p["norm_scale_value"]), int(p["norm_shift_value"])
    if "scale" in node.constants:
        mults = [int(v) for v in node.constants["scale"].betensor.reshape(-1).tolist()]
        shifts = [int(v) for v in node.constants["shift"].betensor.reshape(-1).tolist()]
    else:
        mults, shifts = [int(p["scale_value"])] * channels, [int(p["shift_value"])] * channels
    w = node.constants.get("weights")
    gamma = None
    if w is not None:
        zp = node.constants["weights_zp"].betensor.reshape(-1).tolist() if "weights_zp" in node.constants \
            else [int(p["weights_zp"])] * channels
        gamma = [int(g) + int(z) for g, z in zip(w.betensor.reshape(-1).tolist(), zp)]
    b = node.constants.get("biases")
    beta = [int(v) for v in b.betensor.reshape(-1).tolist()] if b is not None else [0] * channels
    zp_out, qmin, qmax = int(round(float(out.zerop))), int(out.qmin), int(out.qmax)
    y = [0] * len(values)
    for idx in group_members(kind, p, list(x_q.shape)):
        n_el = len(idx)
        mean = rhe_div(sum(values[i] for i in idx), n_el)
        d = {i: values[i] - mean for i in idx}
        ss = sum(e * e for e in d.values())
        if in_bits <= 8:
            vs = int(p["var_shift_value"])
            g = (ref_isqrt(ss >> vs if vs >= 0 else ss << -vs, t) + 32768) >> 16
            normed = {i: min(max(rhe(e * g * m_n, 8 + k_n), lo), hi) for i, e in d.items()}
        else:
            g = min(max(rhe(((ref_isqrt(ss // n_el, t) + 32768) >> 16) * m_n, k_n), 0), 65535)
            normed = {i: min(max(rhe((e >> 1) * g, 7), lo), hi) for i, e in d.items()}
        for i, n in normed.items():
            c = i % channels
            acc = n * gamma[c] + beta[c] if gamma is not None else n + beta[c]
            y[i] = min(max(rhe(acc * mults[c], shifts[c]) - zp_out, qmin), qmax)
    return np.array(y, dtype=np.int64).reshape(x_q.shape)


# --- quantize ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gn", "in"])
def test_quantized_keys_are_upstreams(case) -> None:
    """N = 5*6*4 = 120 (GroupNorm) and 30 (InstanceNorm): at 8 bits var_shift = ceil(log2 N) - 4 rounded up to even,
    norm_shift = var_shift / 2; the int16 table; gamma/beta as weights/biases with per-tensor params."""
    count = 120 if case[1] == "GroupNorm" else 30
    _, q8, _ = quantized(case, 8, SYM, W_TENSOR)
    n = q8.node("op")
    var_shift = int(np.ceil(np.log2(count))) - 4
    var_shift += var_shift & 1
    assert (n.params["var_shift_value"], n.params["norm_scale_value"], n.params["norm_shift_value"]) == \
        (var_shift, 1, var_shift >> 1)
    assert "norm_frac_bits" not in n.params and "eps_value" not in n.params
    assert n.constants["lut"].dtype.value == "int16" and n.constants["lut"].betensor.tolist() == table()
    assert n.constants["weights"].dtype.value == "int8" and n.constants["biases"].dtype.value == "int32"
    assert "weights_scale" in n.params and "biases_scale" in n.params and "scale_value" in n.params
    _, q16, _ = quantized(case, 16, SYM, W_TENSOR)
    n = q16.node("op")
    assert n.params["var_shift_value"] == 0 and n.params["norm_scale_value"] > 1
    assert n.constants["weights"].dtype.value == "int16"


def test_groupnorm_shares_one_shift_and_instancenorm_does_not() -> None:
    """Per-channel weights: upstream unifies GroupNorm's shifts as unify_shifts_for_aiff says (default true) and
    never InstanceNorm's (nor LayerNorm's)."""
    _, gq, _ = quantized(CASES[0], 8, ASYM, W_CHANNEL)
    g = gq.node("op")
    assert g.constants["scale"].betensor.numel() == C and len(set(g.constants["shift"].betensor.tolist())) == 1
    _, iq, _ = quantized(CASES[3], 8, ASYM, W_CHANNEL)
    i = iq.node("op")
    assert i.constants["scale"].betensor.numel() == C and len(set(i.constants["shift"].betensor.tolist())) > 1
    _, gq2, _ = quantized(CASES[0], 8, ASYM, W_CHANNEL, unify_shifts_for_aiff=False)
    assert len(set(gq2.node("op").constants["shift"].betensor.tolist())) > 1


# --- integer forward -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_integer_forward_matches_reference(case, bits: int, mode: str, wmode: str) -> None:
    _, qg, _ = quantized(case, bits, mode, wmode)
    x = activations(case[2], 2, 77, outliers=6) * 1.3  # wider than calibration: exercises the clamps
    qg.forward([x])
    node = qg.node("op")
    got = node.outputs[0].betensor
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), ref_forward(node, case[1], node.inputs[0].betensor.numpy()))


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gn", "in"])
def test_constant_and_extreme_groups_match_reference(case) -> None:
    """Groups at the range limits and constant groups (zero variance)."""
    _, qg, _ = quantized(case, 8, SYM, W_TENSOR)
    node = qg.node("op")
    inp = params_of(node, node.inputs[0])
    x = torch.randint(int(inp.qmin), int(inp.qmax) + 1, case[2], generator=torch.Generator().manual_seed(5))
    x[..., :4] = int(inp.qmin)
    x[..., 4:8] = int(inp.qmax)
    x[..., 8:12] = 0
    node.inputs[0].betensor = x
    node.forward()
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_forward(node, case[1], x.numpy()))


# --- float vs dequantized, re-read, the exact form -------------------------------------------------------------------
@pytest.mark.parametrize("bits,mode,wmode,threshold", [(8, SYM, W_TENSOR, 0.98), (8, ASYM, W_CHANNEL, 0.98),
                                                       (16, SYM, W_TENSOR, 0.999)])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gn", "in"])
def test_float_vs_dequantized_cosine(case, bits: int, mode: str, wmode: str, threshold: float) -> None:
    g, qg, data = quantized(case, bits, mode, wmode)
    x = data[0]
    assert cosine(g.forward([x])[0].clone(), run_quantized(qg, x)[0]) > threshold


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gn", "in"])
def test_written_ir_reloads_bit_identical(tmp_path, case) -> None:
    _, qg, _ = quantized(case, 8, ASYM, W_CHANNEL)
    x = activations(case[2], 3, 11)
    before = qg.forward([x])[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    after = re.forward([x])[0]
    assert after.dtype == torch.int64 and torch.equal(before, after)
    assert "lut" in re.node("op").constants and "var_shift_value" in re.node("op").params


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gn", "in"])
def test_exact_form_is_a_per_layer_choice(case) -> None:
    _, ex, _ = quantized(case, 8, SYM, W_TENSOR, layernorm_integer_form="exact")
    assert "norm_frac_bits" in ex.node("op").params and "lut" not in ex.node("op").constants
