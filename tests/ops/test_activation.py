"""Float forward of Activation (every method) and the standalone activation op types, against torch."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Sequence

import pytest
import torch
import torch.nn.functional as F

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder

IR_SHAPE = [1, 4, 5, 6]  # the IR says batch 1; the tests feed batch 2 or 3
ATOL = 1e-6


def run_layer(optype: str, x: torch.Tensor, ir_shape: Sequence[int] = IR_SHAPE,
              params: Mapping[str, Any] | None = None,
              constants: Mapping[str, Any] | None = None) -> torch.Tensor:
    """One-node graph: Input → layer; returns the layer output for `x`."""
    b = GraphBuilder("t")
    inp = b.input("x", ir_shape)
    out = b.layer(optype, [inp], [list(ir_shape)], name="act", params=params, constants=constants)
    return b.build([out]).forward([x])[0]


def sample(batch: int = 2, shape: Sequence[int] = IR_SHAPE, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(batch, *shape[1:]) * 4.0


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-6)


# method, params, torch reference
METHOD_CASES = [
    ("NONE", {}, lambda x: x),
    ("RELU", {}, F.relu),
    ("RELU6", {}, F.relu6),
    ("LEAKYRELU", {"negative_slope": 0.2}, lambda x: F.leaky_relu(x, 0.2)),
    ("LEAKYRELU", {}, lambda x: F.leaky_relu(x, 0.01)),
    ("LEAKYRELU", {"negative_slope_value": 0.3}, lambda x: F.leaky_relu(x, 0.3)),
    ("PRELU", {"negative_slope": 0.25}, lambda x: F.leaky_relu(x, 0.25)),
    ("CLIP", {"clip_min": -1.5, "clip_max": 2.0}, lambda x: torch.clamp(x, -1.5, 2.0)),
    ("SIGMOID", {}, torch.sigmoid),
    ("TANH", {}, torch.tanh),
    ("HARDSWISH", {}, F.hardswish),
    ("HARDSIGMOID", {"alpha": 0.2, "beta": 0.5, "clip_min": 0.0, "clip_max": 1.0},
     lambda x: torch.clamp(0.2 * x + 0.5, 0.0, 1.0)),
    ("HARDSIGMOID", {}, lambda x: torch.clamp(0.2 * x + 0.5, 0.0, 1.0)),
    ("HARDSIGMOID", {"alpha": 1.0 / 6.0, "beta": 0.5}, F.hardsigmoid),
    ("HARDSIGMOID", {"alpha": 0.3, "beta": 0.1, "clip_min": -0.5, "clip_max": 0.8},
     lambda x: torch.clamp(0.3 * x + 0.1, -0.5, 0.8)),
    ("ELU", {"alpha": 0.7}, lambda x: F.elu(x, 0.7)),
    ("ELU", {}, F.elu),
    ("SELU", {}, F.selu),
    ("SELU", {"alpha": 1.2, "gamma": 0.9}, lambda x: 0.9 * F.elu(x, 1.2)),
    ("CELU", {"alpha": 1.5}, lambda x: F.celu(x, 1.5)),
    ("CELU", {}, F.celu),
    ("GELU", {}, F.gelu),
    ("GELU", {"approximate": "NONE"}, F.gelu),
    ("GELU", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    ("SILU", {}, F.silu),
    ("SWISH", {"alpha": 1.5}, lambda x: x * torch.sigmoid(1.5 * x)),
    ("SWISH", {}, F.silu),
    ("MISH", {}, F.mish),
    ("SOFTPLUS", {}, F.softplus),
    ("SOFTSIGN", {}, F.softsign),
]


@pytest.mark.parametrize("method,params,ref", METHOD_CASES,
                         ids=[f"{m}-{'-'.join(p) or 'default'}" for m, p, _ in METHOD_CASES])
def test_activation_method(method: str, params: Dict[str, Any], ref: Callable) -> None:
    x = sample(batch=2)
    close(run_layer("Activation", x, params={"method": method, **params}), ref(x))


def test_activation_method_is_case_insensitive() -> None:
    x = sample()
    close(run_layer("Activation", x, params={"method": "sigmoid"}), torch.sigmoid(x))


def test_activation_2d_input_other_batch() -> None:
    x = sample(batch=5, shape=[1, 10])
    close(run_layer("Activation", x, ir_shape=[1, 10], params={"method": "TANH"}), torch.tanh(x))


# standalone op type, params, torch reference
STANDALONE_CASES = [
    ("RELU", {}, F.relu),
    ("RELU6", {}, F.relu6),
    ("LeakyRELU", {"negative_slope": 0.1}, lambda x: F.leaky_relu(x, 0.1)),
    ("PRELU", {"negative_slope": 0.3}, lambda x: F.leaky_relu(x, 0.3)),
    ("Clip", {"clip_min": 0.0, "clip_max": 3.0}, lambda x: torch.clamp(x, 0.0, 3.0)),
    ("Sigmoid", {}, torch.sigmoid),
    ("Tanh", {}, torch.tanh),
    ("HardSigmoid", {"alpha": 0.2, "beta": 0.5}, lambda x: torch.clamp(0.2 * x + 0.5, 0.0, 1.0)),
    ("Hardswish", {}, F.hardswish),
    ("ELU", {"alpha": 0.5}, lambda x: F.elu(x, 0.5)),
    ("SELU", {}, F.selu),
    ("CELU", {"alpha": 2.0}, lambda x: F.celu(x, 2.0)),
    ("GELU", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    ("Silu", {}, F.silu),
    ("Swish", {"alpha": 2.0}, lambda x: x * torch.sigmoid(2.0 * x)),
    ("MISH", {}, F.mish),
    ("Softplus", {}, F.softplus),
    ("Softsign", {}, F.softsign),
]


@pytest.mark.parametrize("optype,params,ref", STANDALONE_CASES, ids=[c[0] for c in STANDALONE_CASES])
def test_standalone_activation_type(optype: str, params: Dict[str, Any], ref: Callable) -> None:
    x = sample(batch=3, seed=1)
    close(run_layer(optype, x, params=params), ref(x))


def test_standalone_type_needs_no_method_param() -> None:
    """A standalone type fixes its function, so it needs no `method` parameter."""
    x = sample()
    close(run_layer("Sigmoid", x), torch.sigmoid(x))


def test_softplus_is_stable_for_large_inputs() -> None:
    x = torch.tensor([[-200.0, 0.0, 100.0, 200.0]])
    y = run_layer("Activation", x, ir_shape=[1, 4], params={"method": "SOFTPLUS"})
    assert torch.isfinite(y).all()
    close(y, F.softplus(x))


# ------------------------------------------------------------------------------------------------ PRELU
def test_prelu_hwc_slope_constant_at_batch_3() -> None:
    """mtcnn_onet stores the slope as [1,H,W,C]; it must broadcast over the actual batch."""
    torch.manual_seed(2)
    slope = torch.rand(1, 4, 5, 6)
    x = sample(batch=3, seed=3)
    y = run_layer("Activation", x, params={"method": "PRELU"}, constants={"negative_slope": slope})
    assert y.shape == (3, 4, 5, 6)
    for i in range(3):  # each sample uses the same [H,W,C] slope
        close(y[i], torch.maximum(x[i], torch.zeros(())) + slope[0] * torch.minimum(x[i], torch.zeros(())))


def test_prelu_per_channel_slope_matches_torch_prelu() -> None:
    torch.manual_seed(4)
    slope = torch.rand(6)
    x = sample(batch=3, seed=5)
    y = run_layer("PRELU", x, constants={"negative_slope": slope})
    close(y, F.prelu(x.permute(0, 3, 1, 2), slope).permute(0, 2, 3, 1))


def test_prelu_after_fully_connected() -> None:
    """mtcnn_onet also has a [256] slope on a [1,256] FC output."""
    torch.manual_seed(6)
    slope = torch.rand(256)
    x = sample(batch=4, shape=[1, 256], seed=7)
    y = run_layer("Activation", x, ir_shape=[1, 256], params={"method": "PRELU"},
                  constants={"negative_slope": slope})
    close(y, F.prelu(x, slope))


def test_prelu_slope_that_does_not_broadcast_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="does not broadcast"):
        run_layer("Activation", sample(), params={"method": "PRELU"},
                  constants={"negative_slope": torch.rand(1, 4, 5, 7)})


def test_prelu_without_slope_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="negative_slope"):
        run_layer("Activation", sample(), params={"method": "PRELU"})


# ------------------------------------------------------------------------------------------------ errors
def test_unknown_method_is_an_ir_error_naming_the_layer() -> None:
    with pytest.raises(IRError, match=r"layer 'act'.*unsupported Activation method 'FOO'"):
        run_layer("Activation", sample(), params={"method": "FOO"})


def test_missing_method_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="method"):
        run_layer("Activation", sample())


def test_unknown_gelu_approximation_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="approximate 'erf'"):
        run_layer("Activation", sample(), params={"method": "GELU", "approximate": "erf"})


def test_clip_without_bounds_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="clip_max"):
        run_layer("Activation", sample(), params={"method": "CLIP", "clip_min": 0.0})


@pytest.mark.parametrize("method", ["CLIP", "HARDSIGMOID"])
def test_inverted_clip_bounds_are_an_ir_error(method: str) -> None:
    with pytest.raises(IRError, match="greater than clip_max"):
        run_layer("Activation", sample(), params={"method": method, "clip_min": 2.0, "clip_max": 1.0})


def test_non_numeric_parameter_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="'alpha' must be a number"):
        run_layer("Activation", sample(), params={"method": "ELU", "alpha": "abc"})


def test_celu_zero_alpha_is_an_ir_error() -> None:
    with pytest.raises(IRError, match="alpha"):
        run_layer("CELU", sample(), params={"alpha": 0.0})
