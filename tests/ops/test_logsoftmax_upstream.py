"""LogSoftmax in upstream's integer form (logsoftmax_integer_form = upstream, the default; docs/semantics/softmax.md):
its written params and table against their description, the integer forward against an independent numpy float32
reference of the formula (torch's one-thread sum and float32 log, as upstream's forward takes them), both forms
selectable (per layer, preset), the field listed by `quantopt --field`, and the exporter's refusal of this form."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.cli import main
from quantopt.config.presets import preset_settings
from quantopt.errors import UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

F32 = np.float32
MODES = [(8, "per_tensor_symmetric_full_range", 8), (8, "per_tensor_asymmetric", 8),
         (8, "per_tensor_symmetric_restricted_range", 8), (16, "per_tensor_symmetric_full_range", 10),
         (16, "per_tensor_symmetric_full_range", 16)]
SHAPES = [([1, 4, 10], -1), ([1, 6, 5], 1), ([1, 300], 1), ([2, 3, 4, 9], 2)]
AVX2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
"""torch's one-thread CPU sum takes the 8-lane order upstream's goldens were made with (tests/conftest.py sets it)."""


def logits(shape: Sequence[int], seed: int, std: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0.2, std, list(shape)).astype(np.float32))


def quantized(shape, axis: int, bits: int, mode: str, lut_bits: int, **extra: Any):
    b = GraphBuilder("t")
    x = b.input("x", list(shape))
    y = b.layer("LogSoftmax", [x], [list(shape)], name="op", params={"axis": axis})
    g = b.build([y])
    data = [logits([2] + list(shape[1:]), 30 + i) for i in range(3)]
    cfg: Dict[str, Any] = dict(q_bits_activation=bits, q_mode_activation=mode, lut_items_in_bits=lut_bits,
                               q_bits_bias=48 if bits > 8 else 32, **extra)
    return g, quantize_model(g, data, cfg), data


def expected_output_params(bits: int, mode: str):
    """Scale and zero point of the fixed range [-16, 0] (upstream's rule), and the full signed range."""
    top = 2 ** bits - 1
    if mode == "per_tensor_asymmetric":
        scale = top / 16.0
        return scale, round(-16.0 * scale) + (top + 1) // 2, -(top + 1) // 2, top // 2  # code = round(x·s) - zp
    levels = top / 2 if mode.endswith("full_range") else (2 ** (bits - 1) - 1)
    return levels / 16.0, 0, -(top + 1) // 2, top // 2


def reference(node, x_q: np.ndarray) -> np.ndarray:
    """The upstream form's formula in numpy float32, written from docs/semantics/softmax.md."""
    table = node.constants["lut_exp"].betensor.numpy().astype(F32)
    q0, q1 = (F32(v) for v in node.params["quantize_scale"])
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    bits = int(inp.qmax - inp.qmin).bit_length()
    axis = int(node.params["axis"]) % x_q.ndim
    d = x_q.astype(np.int64) - x_q.max(axis=axis, keepdims=True)
    index = d + (2 ** bits - 1)
    t_bits = table.size.bit_length() - 1
    padded = np.concatenate([table, table[-1:]])
    if bits <= t_bits:
        terms = padded[index]
    else:
        k = bits - t_bits
        hi, lo = index >> k, index & ((1 << k) - 1)
        step = (padded[hi + 1] - padded[hi]) * lo.astype(F32)
        terms = padded[hi] + step / F32(2 ** k)
    assert terms.dtype == F32
    total = torch.from_numpy(terms).sum(axis, keepdim=True)  # upstream's float32 sum: torch's, on one thread
    log_total = torch.log(total).numpy()
    y = d.astype(F32) * q0 - log_total * q1
    assert y.dtype == F32
    return np.clip(np.round(y).astype(np.int64) - int(out.zerop), int(out.qmin), int(out.qmax))


@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
def test_upstream_form_params(bits: int, mode: str, lut_bits: int) -> None:
    _, qg, _ = quantized([1, 4, 10], -1, bits, mode, lut_bits)
    node = qg.node("op")
    out, inp = params_of(node, node.outputs[0]), params_of(node, node.inputs[0])
    scale, zp, qmin, qmax = expected_output_params(bits, mode)
    assert (float(out.scale), int(out.zerop), out.qmin, out.qmax) == (scale, zp, qmin, qmax)
    assert node.outputs[0].dtype.value == f"int{bits}"
    s_in = F32(inp.scale)
    assert node.params["quantize_scale"] == [float(F32(scale) / s_in), scale]
    p = node.params
    assert (p["scale_value"], p["shift_value"]) == (1, 0)
    assert (p["scale_type"].value, p["shift_type"].value) == (f"uint{bits}", "int8")
    assert not {"pow2_lut", "log2_lut"} & set(node.constants) and "adjust_q" not in p
    lut = node.constants["lut_exp"]
    table = lut.betensor.numpy()
    n = 2 ** min(bits, lut_bits)
    assert lut.dtype.value == "float32" and table.shape == (n,) and table[-1] == 1.0
    points = np.linspace(0.0, 2.0 ** bits - 1, n)[::-1]
    np.testing.assert_allclose(table, np.exp(-points / float(s_in)), rtol=2e-6, atol=1e-30)
    assert qg.ranges.get(node.outputs[0]).min == -16.0 and qg.ranges.get(node.outputs[0]).max == 0.0


@pytest.mark.skipif(not AVX2, reason="the reference sums with torch, whose order is the 8-lane one only with AVX2")
@pytest.mark.parametrize("bits,mode,lut_bits", MODES)
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_upstream_form_integer_matches_reference(shape, axis: int, bits: int, mode: str, lut_bits: int) -> None:
    _, qg, _ = quantized(shape, axis, bits, mode, lut_bits)
    x = logits([3] + list(shape[1:]), 5, std=5.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        qg.forward([x], keep_tensors=True)
        node = qg.node("op")
        got = node.outputs[0].betensor
        want = reference(node, node.inputs[0].betensor.numpy())
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("bits,lut_bits,threshold", [(8, 8, 0.995), (16, 10, 0.9999)])
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_upstream_form_tracks_the_clipped_float(shape, axis: int, bits: int, lut_bits: int,
                                                threshold: float) -> None:
    """The form represents log-probabilities clipped to [-16, 0]: against those, the dequantized output is close."""
    g, qg, data = quantized(shape, axis, bits, "per_tensor_symmetric_full_range", lut_bits)
    want = torch.clamp(g.forward([data[0]])[0], -16.0, 0.0).double().flatten()
    node = qg.node("op")
    qg.forward([data[0]], keep_tensors=True)
    out = params_of(node, node.outputs[0])
    got = ((node.outputs[0].betensor + int(out.zerop)).double() / float(out.scale)).flatten()
    cos = float(torch.dot(want, got) / (want.norm() * got.norm()))
    assert cos > threshold


def test_forms_are_selectable_per_layer_and_by_preset() -> None:
    _, up, _ = quantized([1, 4, 10], -1, 8, "per_tensor_symmetric_full_range", 8)
    _, ex, _ = quantized([1, 4, 10], -1, 8, "per_tensor_symmetric_full_range", 8, logsoftmax_integer_form="exact")
    assert "lut_exp" in up.node("op").constants and "log2_lut" in ex.node("op").constants
    assert "quantize_scale" not in ex.node("op").params
    assert preset_settings("accurate")["logsoftmax_integer_form"] == "exact"
    b = GraphBuilder("t")
    y = b.layer("LogSoftmax", [b.input("x", [1, 8])], [[1, 8]], name="op", params={"axis": -1})
    per_layer = quantize_model(b.build([y]), [logits([2, 8], 1)],
                               per_layer={"op": {"logsoftmax_integer_form": "exact"}})
    assert "log2_lut" in per_layer.node("op").constants


def test_field_is_listed(capsys) -> None:
    assert main(["--field"]) == 0
    assert "  logsoftmax_integer_form\n" in capsys.readouterr().out


def test_older_integer_table_is_refused() -> None:
    """An integer lut_exp is the form of targets older than X2, which quantopt does not simulate."""
    _, qg, _ = quantized([1, 4, 10], -1, 8, "per_tensor_symmetric_full_range", 8)
    node = qg.node("op")
    node.constants["lut_exp"].dtype = Dtype.UINT32
    with pytest.raises(UnsupportedError, match="older than X2"):
        qg.forward([logits([1, 4, 10], 2)])
