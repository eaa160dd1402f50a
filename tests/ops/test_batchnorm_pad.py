"""Float forward of BatchNorm (per-channel affine) and Pad against torch.nn.functional (and numpy.pad)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder

ATOL = 1e-5


def run_layer(optype: str, x: torch.Tensor, out_shape: Sequence[int], params: Dict,
              constants: Optional[Dict] = None, ir_batch: Optional[int] = None) -> torch.Tensor:
    b = GraphBuilder("t")
    shape, oshape = list(x.shape), list(out_shape)
    if ir_batch is not None:
        shape[0] = oshape[0] = ir_batch
    out = b.layer(optype, [b.input("x", shape)], [oshape], name="layer", params=params, constants=constants)
    return b.build([out]).forward([x])[0]


# ------------------------------------------------------------------------------------------------ BatchNorm
def _bn_stats(c: int):
    return torch.randn(c), torch.rand(c) + 0.5, torch.randn(c), torch.randn(c)  # mean, var, gamma, beta


def _fold(mean, var, gamma, beta, eps):
    """The Parser's folded BatchNorm: weights = gamma / sqrt(var + eps), biases = beta - mean * weights."""
    w = gamma / torch.sqrt(var + eps)
    return w, beta - mean * w


def test_batchnorm_folded_affine_matches_batch_norm():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, 4)
    mean, var, gamma, beta = _bn_stats(4)
    w, b = _fold(mean, var, gamma, beta, 1e-3)
    ref = F.batch_norm(x.permute(0, 3, 1, 2), mean, var, gamma, beta, training=False, eps=1e-3).permute(0, 2, 3, 1)
    y = run_layer("BatchNorm", x, x.shape, {"axis": 3, "epsilon": 1e-3, "with_activation": "NONE"},
                  {"weights": w, "biases": b}, ir_batch=1)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_batchnorm_mean_var_constants_are_applied():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 4, 3)
    mean, var, gamma, beta = _bn_stats(3)
    ref = F.batch_norm(x.permute(0, 3, 1, 2), mean, var, gamma, beta, training=False, eps=1e-5).permute(0, 2, 3, 1)
    y = run_layer("BatchNorm", x, x.shape, {"epsilon": 1e-5},
                  {"weights": gamma, "biases": beta, "mean": mean, "var": var})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_batchnorm_on_a_middle_axis_and_without_biases():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 7)
    w = torch.randn(5)
    ref = x * w.reshape(1, 5, 1)  # F.batch_norm refuses eps = 0 in some torch versions
    y = run_layer("BatchNorm", x, x.shape, {"axis": 1}, {"weights": w})
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


ACTIVATIONS = {
    "RELU": ({}, {}, F.relu),
    "RELU6": ({}, {}, F.relu6),
    "CLIP": ({"clip_min": -1.0, "clip_max": 0.5}, {}, lambda t: t.clamp(-1.0, 0.5)),
    "LEAKYRELU": ({"negative_slope": 0.1}, {}, lambda t: F.leaky_relu(t, 0.1)),
    "PRELU": ({}, {"negative_slope": torch.tensor([0.1, 0.2, 0.3, 0.4])},
              lambda t: F.prelu(t.permute(0, 3, 1, 2), torch.tensor([0.1, 0.2, 0.3, 0.4])).permute(0, 2, 3, 1)),
}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_batchnorm_fused_activation(act):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 3, 4) * 4
    w, b = torch.randn(4), torch.randn(4)
    params, consts, fn = ACTIVATIONS[act]
    y = run_layer("BatchNorm", x, x.shape, {"with_activation": act, **params}, {"weights": w, "biases": b, **consts})
    torch.testing.assert_close(y, fn(x * w + b), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("params,constants,match", [
    ({}, {"weights": torch.ones(3), "biases": torch.zeros(4)}, "'weights' must have 4"),
    ({}, {"weights": torch.ones(4), "biases": torch.zeros(5)}, "'biases' must have 4"),
    ({"axis": 4}, {"weights": torch.ones(4)}, "axis=4"),
    ({}, {"weights": torch.ones(4), "mean": torch.zeros(4)}, "'mean' and 'var'"),
    ({}, {"biases": torch.zeros(4)}, "'weights'"),
    ({"with_activation": "SWISH"}, {"weights": torch.ones(4)}, "SWISH"),
])
def test_batchnorm_rejects_bad_ir(params, constants, match):
    with pytest.raises(IRError, match=match):
        run_layer("BatchNorm", torch.randn(1, 2, 2, 4), (1, 2, 2, 4), params, constants)


# ------------------------------------------------------------------------------------------------ Pad
NHWC_PADS = [[0, 0], [1, 2], [2, 1], [0, 0]]
TORCH_PADS = (2, 1, 1, 2)  # F.pad on NCHW: (w_before, w_after, h_before, h_after)


def _pad_shape(shape, pairs):
    return [s + b + e for s, (b, e) in zip(shape, pairs)]


@pytest.mark.parametrize("mode,torch_mode", [("CONSTANT", "constant"), ("REFLECT", "reflect"), ("EDGE", "replicate")])
def test_pad_spatial_matches_torch(mode, torch_mode):
    torch.manual_seed(4)
    x = torch.randn(3, 5, 6, 2)
    kwargs = {"value": 1.5} if torch_mode == "constant" else {}
    ref = F.pad(x.permute(0, 3, 1, 2), TORCH_PADS, mode=torch_mode, **kwargs).permute(0, 2, 3, 1)
    params = {"pads": NHWC_PADS, "mode": mode, "constant_value": 1.5}
    y = run_layer("Pad", x, ref.shape, params, ir_batch=1)
    torch.testing.assert_close(y, ref)


def test_pad_flat_onnx_layout_equals_nested_layout():
    torch.manual_seed(5)
    x = torch.randn(2, 3, 4, 5)
    nested = [[0, 0], [1, 0], [0, 2], [3, 1]]
    flat = [b for b, _ in nested] + [e for _, e in nested]
    ref = F.pad(x, (3, 1, 0, 2, 1, 0), value=-2.0)
    for pads in (nested, flat):
        y = run_layer("Pad", x, ref.shape, {"pads": pads, "mode": "CONSTANT", "constant_value": -2.0})
        torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("mode", ["REFLECT", "SYMMETRIC", "EDGE"])
def test_pad_every_axis_and_wide_pads_match_numpy(mode):
    torch.manual_seed(6)
    x = torch.randn(2, 3, 4, 3)
    pairs = [[0, 1], [5, 4], [2, 7], [1, 2]]  # wider than the axis: numpy reflects repeatedly
    ref = np.pad(x.numpy(), pairs, mode=mode.lower() if mode != "EDGE" else "edge")
    y = run_layer("Pad", x, ref.shape, {"pads": pairs, "mode": mode})
    np.testing.assert_array_equal(y.numpy(), ref)


@pytest.mark.parametrize("mode", ["REFLECT", "SYMMETRIC", "EDGE"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8])
def test_pad_by_slices_matches_the_gather_and_numpy(mode, dtype):
    """Pads an axis can mirror are written by slices (`_pad_by_slices`), corners included; wider pads take the
    per-axis gather. Both give numpy.pad's values, bit for bit (NaN, -0.0 and inf copied as they are)."""
    from quantopt.ops.batchnorm_pad import _pad_by_slices, _source_index, pad_tensor

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 5, 6, 3, generator=g) * 50).to(dtype)
    if dtype.is_floating_point:
        x[0, 0, 0, 0], x[1, 4, 5, 2], x[0, 2, 3, 1] = float("nan"), -0.0, float("inf")
    limit = 4 if mode == "REFLECT" else 5
    for pairs in ([[0, 0], [1, 2], [2, 1], [0, 0]], [[1, 1], [limit, limit], [0, 3], [2, 0]],
                  [[0, 0], [limit + 1, 0], [1, 1], [0, 0]]):
        for source in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):  # contiguous and strided inputs
            got = pad_tensor(source, pairs, mode, 0.0)
            ref = np.pad(source.numpy(), pairs, mode=mode.lower() if mode != "EDGE" else "edge")
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.numpy().view(np.uint8), ref.view(np.uint8))
            fits = all(max(b, e) <= limit for b, e in pairs) or mode == "EDGE"
            assert (_pad_by_slices(source, pairs, mode) is not None) == fits
            gathered = source
            for axis, (b, e) in enumerate(pairs):
                gathered = gathered.index_select(axis, _source_index(mode, int(source.shape[axis]), b, e, x.device))
            assert torch.equal(got.view(torch.uint8) if dtype.is_floating_point else got,
                               gathered.view(torch.uint8) if dtype.is_floating_point else gathered)


def test_pad_defaults_and_integer_dtype():
    x = torch.arange(12, dtype=torch.int8).reshape(1, 2, 3, 2)
    y = run_layer("Pad", x, _pad_shape(x.shape, NHWC_PADS), {"pads": NHWC_PADS})
    assert y.dtype == torch.int8
    torch.testing.assert_close(y, F.pad(x.permute(0, 3, 1, 2), TORCH_PADS).permute(0, 2, 3, 1))


def test_pad_lowercase_mode_and_single_element_axis():
    x = torch.randn(2, 1, 3, 2)
    pairs = [[0, 0], [2, 1], [0, 0], [0, 0]]
    y = run_layer("Pad", x, _pad_shape(x.shape, pairs), {"pads": pairs, "mode": "reflect"})
    torch.testing.assert_close(y, x.expand(2, 4, 3, 2))


@pytest.mark.parametrize("params,match", [
    ({"pads": NHWC_PADS, "mode": "WRAP"}, "unsupported pad mode 'WRAP'"),
    ({"pads": [[0, 0], [1, 1], [1, 1]]}, "must hold 4 \\[before, after\\] pairs"),
    ({"pads": [0, 1, 1, 0, 0, 1]}, "fit neither"),
    ({"pads": [[0, 0], [-1, 1], [1, 1], [0, 0]]}, "negative pads"),
    ({"pads": [[0, 0], [1.5, 1], [1, 1], [0, 0]]}, "pads"),
    ({"pads": NHWC_PADS, "constant_value": "x"}, "constant_value"),
    ({"mode": "CONSTANT"}, "'pads'"),
])
def test_pad_rejects_bad_params(params, match):
    with pytest.raises(IRError, match=match):
        run_layer("Pad", torch.randn(1, 3, 3, 2), (1, 5, 5, 2), params)
