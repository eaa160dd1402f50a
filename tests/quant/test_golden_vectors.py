"""The quant math against the real OPT outputs in tests/data/shared_models/<model>/golden/{A,B,C} (all 4 models; see
tests/conftest.py).

Golden configs: A = int8, per-tensor weights (DepthwiseConv forced per-channel), symmetric full-range activations,
`mean` calibration; B = per-channel weights, asymmetric activations, `extrema` calibration; C = 16-bit weights and
activations, LUTs of 2^10 entries. Everything a pure function can recompute from the IR (and the float IR / the
calibration data) is recomputed and compared exactly. Match counts at the time of writing (all 100 %):

    per-tensor Conv/FC scale_value/shift_value (A, B, C)     142 / 142
    per-channel unified scale/shift constants  (A, B, C)     113 / 113   (no per-N-channel fallback occurs)
    Eltwise ADD scale_value/shift_value        (A, B, C)      33 / 33
    Mul scale_value/shift_value                (A, B, C)      33 / 33
    weights_scale / quantized weights / biases_scale         255 / 255 each
    quantized biases (zero point folded, compressed)          255 / 255
    Activation LUTs (sigmoid, hardswish, hardsigmoid)         105 / 105
    Input layer scale/zp from calib.npy                        12 / 12

Mismatches met and understood while writing this (each now reproduced on purpose):
- 16-bit LUTs: 16 of 105 tables are off by one in 1-4 entries unless samples are dequantized as (q+zp)*(1/s)
  and quantized in float32 (true division: 98/105; float64 quantize: 92/105).
- 16-bit biases (golden C): upstream clamps b*s to int32 in float32, where 2^31-1 rounds to 2^31; positive
  overflow is therefore written as INT_MIN (int32 wrap) and the compression then drops one bit (k=1). Only
  `bias_quantize(..., upstream_float32_clip=True)` (and the same float32 bound for the clamp after zero-point
  folding) plus an int32 wrap reproduces the 19 affected C layers; the exact clip matches 66/85 C layers.
- the bias product b*s must be float32 (float64: 83/85 in A and B, 2/85 in C).
"""
from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, shared_model_dir
from quant_helpers import params_of

from quantopt.ir.reader import read_ir
from quantopt.quant import (
    bias_quantize,
    build_lut,
    compress_bias,
    eltwise_multipliers,
    fold_input_zero_point,
    group_ranges,
    linear_quant_params,
    quantize,
    scale_shift,
    unify_shifts_for_aiff,
)

GOLDENS = ("A", "B", "C")
ACT_BITS = {"A": 8, "B": 8, "C": 16}
WEIGHT_BITS = {"A": 8, "B": 8, "C": 16}
LUT_BITS = {"A": 8, "B": 8, "C": 10}
BIAS_BITS = 32
BIAS_EFFECTIVE_BITS = 32  # target X2
MAC_TYPES = ("Convolution", "FullyConnected", "DepthwiseConv")
WEIGHT_MODE = "per_tensor_symmetric_restricted_range"


@functools.cache
def golden(model: str, letter: str):
    folder = shared_model_dir(model)
    return read_ir(str(folder / "golden" / letter / f"{model}_o.txt"))


@functools.cache
def float_ir(model: str):
    folder = shared_model_dir(model)
    return read_ir(str(folder / f"{model}.txt"))


def f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32)


def _report(kind: str, matched: int, total: int, misses: List[str]) -> None:
    print(f"\n{kind}: {matched}/{total} match")
    assert total > 0, f"{kind}: nothing to compare"
    assert matched / total >= 0.95, f"{kind}: only {matched}/{total} match: {misses[:10]}"
    assert matched == total, f"{kind}: {total - matched} mismatches (expected none): {misses[:10]}"


def _mac_nodes(model: str, letter: str):
    for n in golden(model, letter).nodes:
        if str(n.type) in MAC_TYPES:
            yield n


def test_per_tensor_conv_fc_multipliers() -> None:
    """scale_shift(s_out / (s_in * weights_scale), activation bits) == (scale_value, shift_value)."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        for letter in GOLDENS:
            for n in _mac_nodes(model, letter):
                if "scale_value" not in n.params:
                    continue
                s_out, s_in = params_of(n, n.outputs[0]).scale, params_of(n, n.inputs[0]).scale
                ratio = f32(s_out) / (f32(s_in) * f32(n.params["weights_scale"]))
                m, s, mdt, sdt = scale_shift(ratio, ACT_BITS[letter])
                p = n.params
                want = (p["scale_value"], p["shift_value"], p["scale_type"], p["shift_type"])
                total += 1
                if (m, s, mdt, sdt) == want:
                    matched += 1
                else:
                    misses.append(f"{model}/{letter}/{n.name}: {(m, s)} != {want[:2]}")
    _report("per-tensor Conv/FC multipliers", matched, total, misses)


def _weight_ranges(model: str, name: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = {n.name: n for n in float_ir(model).nodes}[name].constants["weights"].betensor.float()
    flat = w.reshape(w.shape[0], -1)
    return w, flat.min(dim=1).values, flat.max(dim=1).values


def _grouped_ratios(wmin: torch.Tensor, wmax: torch.Tensor, wbits: int, s_in: float, s_out: float):
    """ratio_fn for unify_shifts_for_aiff: s_out / (s_in * w_scale[c]) with weight ranges merged in groups."""
    def fn(groups: int) -> torch.Tensor:
        gmin, gmax, _ = group_ranges(wmin, wmax, groups)
        ws = linear_quant_params(gmin, gmax, wbits, "per_channel_symmetric_restricted_range", True).scale
        return f32(s_out) / (f32(s_in) * ws)
    return fn


def test_per_channel_unified_multipliers() -> None:
    """The per-channel `scale`/`shift` constants through the whole unify_shifts_for_aiff path, weight scales
    recomputed from the float weights (so the per-N-channel fallback would be exercised if it were needed)."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        for letter in GOLDENS:
            for n in _mac_nodes(model, letter):
                if "scale" not in n.constants:
                    continue
                _, wmin, wmax = _weight_ranges(model, n.name)
                ratios = _grouped_ratios(wmin, wmax, WEIGHT_BITS[letter], params_of(n, n.inputs[0]).scale,
                                         params_of(n, n.outputs[0]).scale)
                res = unify_shifts_for_aiff(ratios, wmin.numel(), ACT_BITS[letter])
                want_m = n.constants["scale"].betensor.long()
                want_s = n.constants["shift"].betensor.long()
                total += 1
                if torch.equal(res.multiplier, want_m) and torch.equal(res.shift, want_s) and res.group_size == 1:
                    matched += 1
                else:
                    misses.append(f"{model}/{letter}/{n.name}")
    _report("per-channel unified multipliers", matched, total, misses)


def test_eltwise_add_multipliers() -> None:
    """eltwise_multipliers(s0, s1, s_out, bits) == (scale_value=[M_out, M_in0, M_in1], shift_value)."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        for letter in GOLDENS:
            for n in golden(model, letter).nodes:
                if str(n.type) != "Eltwise" or str(n.params.get("method")).upper() != "ADD":
                    continue
                a, b, o = params_of(n, n.inputs[0]), params_of(n, n.inputs[1]), params_of(n, n.outputs[0])
                res = eltwise_multipliers(a.scale, b.scale, o.scale, ACT_BITS[letter], zp0=a.zerop, zp1=b.zerop)
                want = (list(n.params["scale_value"]), n.params["shift_value"])
                total += 1
                if (res.scale_value, res.shift_value) == want and res.scale_type == n.params["scale_type"] \
                        and res.shift_type == n.params["shift_type"]:
                    matched += 1
                else:
                    misses.append(f"{model}/{letter}/{n.name}: {res.scale_value, res.shift_value} != {want}")
    _report("Eltwise ADD multipliers", matched, total, misses)


def test_mul_multipliers() -> None:
    """Mul: scale_shift(s_out / (s0 * s1), activation bits) (docs/integer-semantics.md, Eltwise MUL)."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        for letter in GOLDENS:
            for n in golden(model, letter).nodes:
                if str(n.type) != "Mul" or "scale_value" not in n.params:
                    continue
                s_out, s0, s1 = (params_of(n, t).scale for t in (n.outputs[0], n.inputs[0], n.inputs[1]))
                ratio = f32(s_out) / (f32(s0) * f32(s1))
                m, s, _, _ = scale_shift(ratio, ACT_BITS[letter])
                total += 1
                if (m, s) == (n.params["scale_value"], n.params["shift_value"]):
                    matched += 1
                else:
                    misses.append(f"{model}/{letter}/{n.name}")
    if total:
        _report("Mul multipliers", matched, total, misses)


def _int32_wrap(q: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(q.numpy().astype(np.int64).astype(np.int32)).long()


def test_weights_and_biases() -> None:
    """weights_scale, quantized weights, biases_scale and quantized biases recomputed from the float IR."""
    counts: Dict[str, List[int]] = {k: [0, 0] for k in ("weights_scale", "weights", "biases_scale", "biases")}
    misses: List[str] = []
    for model in MODEL_NAMES:
        fnodes = {n.name: n for n in float_ir(model).nodes}
        for letter in GOLDENS:
            wbits = WEIGHT_BITS[letter]
            for n in _mac_nodes(model, letter):
                if n.name not in fnodes:
                    continue
                w, wmin, wmax = _weight_ranges(model, n.name)
                per_channel = "weights_scale" in n.constants
                if per_channel:
                    p = linear_quant_params(wmin, wmax, wbits, "per_channel_symmetric_restricted_range", True)
                    want_ws = n.constants["weights_scale"].betensor.float()
                    ok = torch.equal(p.scale, want_ws)
                else:
                    p = linear_quant_params(float(w.min()), float(w.max()), wbits, WEIGHT_MODE, True)
                    ok = p.scale == n.params["weights_scale"]
                counts["weights_scale"][0] += ok
                counts["weights_scale"][1] += 1
                w_q = quantize(w, p.scale, p.zerop, p.qmin, p.qmax, axis=0 if per_channel else None)
                ok = torch.equal(w_q, n.constants["weights"].betensor.long())
                counts["weights"][0] += ok
                counts["weights"][1] += 1
                if not ok:
                    misses.append(f"weights {model}/{letter}/{n.name}")
                if "biases" not in n.constants:
                    continue
                b = fnodes[n.name].constants["biases"].betensor
                x = params_of(n, n.inputs[0])
                b_q, b_scale = bias_quantize(b, x.scale, p.scale, BIAS_BITS, upstream_float32_clip=True)
                want_bs = n.constants["biases_scale"].betensor.float() if per_channel else n.params["biases_scale"]
                ok = torch.equal(b_scale, want_bs) if per_channel else b_scale == want_bs
                counts["biases_scale"][0] += ok
                counts["biases_scale"][1] += 1
                # upstream clamps again after folding, in float32 too: the upper bound is 2^31, not 2^31 - 1
                folded = fold_input_zero_point(b_q, w_q, x.zerop, qmin=-(2 ** 31), qmax=2 ** 31)
                compressed, _ = compress_bias(folded, BIAS_EFFECTIVE_BITS)
                ok = torch.equal(_int32_wrap(compressed), n.constants["biases"].betensor.long())
                counts["biases"][0] += ok
                counts["biases"][1] += 1
                if not ok:
                    misses.append(f"biases {model}/{letter}/{n.name}")
    for kind, (matched, total) in counts.items():
        _report(kind, matched, total, misses)


def _hardsigmoid(alpha: float, beta: float):
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x * alpha + beta, 0.0, 1.0)
    return fn


LUT_FUNCS = {"SIGMOID": lambda n: torch.sigmoid, "HARDSWISH": lambda n: torch.nn.functional.hardswish,
             "HARDSIGMOID": lambda n: _hardsigmoid(n.params.get("alpha", 0.2), n.params.get("beta", 0.5))}


def _top_range(t) -> Tuple[int, int]:
    r = t.ir_range
    return tuple(r[0]) if isinstance(r[0], (list, tuple)) else tuple(r)


def test_activation_luts() -> None:
    """Every Activation `lut` constant rebuilt with build_lut from the input/output params."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        for letter in GOLDENS:
            for n in golden(model, letter).nodes:
                if str(n.type) != "Activation" or "lut" not in n.constants:
                    continue
                method = str(n.params["method"]).upper()
                if method not in LUT_FUNCS:
                    continue
                i, o = n.inputs[0], n.outputs[0]
                pi, po = params_of(n, i), params_of(n, o)
                lut = build_lut(LUT_FUNCS[method](n), pi.scale, pi.zerop, *_top_range(i), i.dtype.bits,
                                po.scale, po.zerop, *_top_range(o), lut_items_in_bits=LUT_BITS[letter])
                total += 1
                if torch.equal(lut, n.constants["lut"].betensor.long()):
                    matched += 1
                else:
                    misses.append(f"{model}/{letter}/{n.name}")
    _report("Activation LUTs", matched, total, misses)


def test_input_params_from_calibration_data() -> None:
    """The Input layer's scale/zp from calib.npy: A/C use the `mean` strategy (EMA of per-batch min/max with
    momentum 0.9), B uses `extrema`; calibration_batch_size = 1."""
    matched = total = 0
    misses: List[str] = []
    for model in MODEL_NAMES:
        data = np.load(shared_model_dir(model) / "calib.npy")
        rmin = rmax = None
        for batch in data:
            bmin, bmax = torch.tensor(batch.min()), torch.tensor(batch.max())
            rmin = bmin if rmin is None else 0.9 * rmin + 0.1 * bmin
            rmax = bmax if rmax is None else 0.9 * rmax + 0.1 * bmax
        ranges = {"A": (float(rmin), float(rmax)), "B": (float(data.min()), float(data.max())),
                  "C": (float(rmin), float(rmax))}
        modes = {"A": "per_tensor_symmetric_full_range", "B": "per_tensor_asymmetric",
                 "C": "per_tensor_symmetric_full_range"}
        for letter in GOLDENS:
            inp = golden(model, letter).nodes[0]
            t = inp.outputs[0]
            q = params_of(inp, t)
            p = linear_quant_params(*ranges[letter], ACT_BITS[letter], modes[letter], t.dtype.is_signed)
            total += 1
            if (p.scale, p.zerop, p.dtype) == (q.scale, q.zerop, t.dtype):
                matched += 1
            else:
                misses.append(f"{model}/{letter}: {(p.scale, p.zerop)} != {(q.scale, q.zerop)}")
    _report("Input params", matched, total, misses)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_golden_present(model: str) -> None:
    """Skips (via shared_model_dir) rather than fails when the reference models are not checked out."""
    assert (shared_model_dir(model) / "golden" / "A").is_dir()
