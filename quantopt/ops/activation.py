"""Element-wise activations: the `Activation` layer (one `method` per layer) and the standalone op types
(RELU, Sigmoid, Hardswish, ...) that the Parser may emit instead; both run the same float functions."""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import apply_fused_activation

# ONNX defaults, used when the IR leaves a parameter out.
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875
LEAKYRELU_SLOPE = 0.01
GELU_APPROXIMATIONS = ("none", "tanh")


def _number(node: PyNode, key: str, default: Any = None) -> float:
    """A numeric parameter (required when `default` is None); a non-number is an IR error naming the layer."""
    value = node.get_param(key, optional=default is not None, default_value=default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}") from None


def _slope_param(node: PyNode) -> float:
    """Scalar negative slope: OPT's own ops read `negative_slope_value`, the fused helper `negative_slope`."""
    key = "negative_slope" if "negative_slope" in node.params else "negative_slope_value"
    return _number(node, key, LEAKYRELU_SLOPE)


def _relu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return apply_fused_activation(node, x, "RELU")


def _relu6(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return apply_fused_activation(node, x, "RELU6")


def _clip(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    lo, hi = _number(node, "clip_min"), _number(node, "clip_max")
    if lo > hi:
        raise node._error(f"clip_min ({lo}) is greater than clip_max ({hi})")
    return apply_fused_activation(node, x, "CLIP")


def _leakyrelu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """The fused helper reads `negative_slope` (default 0.01); an IR that only has OPT's `negative_slope_value`
    must not silently fall back to that default."""
    if "negative_slope" in node.params or "negative_slope_value" not in node.params:
        return apply_fused_activation(node, x, "LEAKYRELU")
    return F.leaky_relu(x, _slope_param(node))


def _prelu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """Slope from the `negative_slope` constant (e.g. [C] or [1,H,W,C], broadcast over the actual batch),
    else from a scalar parameter."""
    slope = node.get_constant("negative_slope", optional=True)
    if slope is None:
        if "negative_slope" not in node.params and "negative_slope_value" not in node.params:
            raise node._error("PRELU needs a 'negative_slope' constant or a negative_slope parameter")
        return F.leaky_relu(x, _slope_param(node))
    try:
        shape = torch.broadcast_shapes(tuple(slope.betensor.shape), tuple(x.shape))
    except RuntimeError:
        shape = None
    if shape != tuple(x.shape):
        raise node._error(f"negative_slope constant of shape {list(slope.betensor.shape)} does not broadcast "
                          f"to the input shape {list(x.shape)}")
    return apply_fused_activation(node, x, "PRELU")


def _hardsigmoid(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """y = clip(alpha*x + beta, clip_min, clip_max); the Parser writes all four (ONNX defaults otherwise)."""
    alpha, beta = _number(node, "alpha", 0.2), _number(node, "beta", 0.5)
    lo, hi = _number(node, "clip_min", 0.0), _number(node, "clip_max", 1.0)
    if lo > hi:
        raise node._error(f"clip_min ({lo}) is greater than clip_max ({hi})")
    return torch.clamp(alpha * x + beta, lo, hi)


def _hardswish(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """x * clip(alpha*x + beta, 0, 1); the Parser writes no parameters, so ONNX's 1/6 and 0.5 apply."""
    alpha, beta = _number(node, "alpha", 1.0 / 6.0), _number(node, "beta", 0.5)
    return x * torch.clamp(alpha * x + beta, 0.0, 1.0)


def _elu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return F.elu(x, _number(node, "alpha", 1.0))


def _selu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return _number(node, "gamma", SELU_GAMMA) * F.elu(x, _number(node, "alpha", SELU_ALPHA))


def _celu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    alpha = _number(node, "alpha", 1.0)
    if alpha == 0.0:
        raise node._error("CELU alpha must not be 0")
    return F.celu(x, alpha)


def _gelu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    approx = str(node.get_param("approximate", optional=True, default_value="none")).lower()
    if approx not in GELU_APPROXIMATIONS:
        raise node._error(f"unsupported GELU approximate '{approx}' (supported: {', '.join(GELU_APPROXIMATIONS)})")
    return F.gelu(x, approximate=approx)


def _swish(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(_number(node, "alpha", 1.0) * x)


def _simple(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[PyNode, torch.Tensor], torch.Tensor]:
    """Adapt a parameterless torch function to the (node, x) signature of the method table."""
    def method(node: PyNode, x: torch.Tensor) -> torch.Tensor:
        return fn(x)
    return method


ACTIVATION_METHODS: Dict[str, Callable[[PyNode, torch.Tensor], torch.Tensor]] = {
    "NONE": _simple(lambda x: x),
    "RELU": _relu,
    "RELU6": _relu6,
    "LEAKYRELU": _leakyrelu,
    "PRELU": _prelu,
    "CLIP": _clip,
    "SIGMOID": _simple(torch.sigmoid),
    "TANH": _simple(torch.tanh),
    "HARDSWISH": _hardswish,
    "HARDSIGMOID": _hardsigmoid,
    "ELU": _elu,
    "SELU": _selu,
    "CELU": _celu,
    "GELU": _gelu,
    "SILU": _simple(F.silu),
    "SWISH": _swish,
    "MISH": _simple(F.mish),
    "SOFTPLUS": _simple(F.softplus),
    "SOFTSIGN": _simple(F.softsign),
}

# Standalone op types → the Activation method they compute (same parameters as that method).
STANDALONE_METHODS: Dict[str, str] = {
    "RELU": "RELU", "RELU6": "RELU6", "LeakyRELU": "LEAKYRELU", "PRELU": "PRELU", "Clip": "CLIP",
    "Sigmoid": "SIGMOID", "Tanh": "TANH", "HardSigmoid": "HARDSIGMOID", "Hardswish": "HARDSWISH",
    "ELU": "ELU", "SELU": "SELU", "CELU": "CELU", "GELU": "GELU", "Silu": "SILU", "Swish": "SWISH",
    "MISH": "MISH", "Softplus": "SOFTPLUS", "Softsign": "SOFTSIGN",
}


def activation_method(node: PyNode) -> str:
    """The method a node computes: `method` of an Activation layer, or fixed by a standalone op type."""
    if str(node.type) in STANDALONE_METHODS:
        return STANDALONE_METHODS[str(node.type)]
    method = str(node.get_param("method")).upper()
    if method not in ACTIVATION_METHODS:
        raise node._error(f"unsupported Activation method '{method}' "
                          f"(supported: {', '.join(sorted(ACTIVATION_METHODS))})")
    return method


@op_register([OpType.Activation] + [getattr(OpType, name) for name in STANDALONE_METHODS])
def activation_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    self.outputs[0].betensor = ACTIVATION_METHODS[activation_method(self)](self, x)
