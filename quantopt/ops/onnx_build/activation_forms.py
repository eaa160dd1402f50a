"""The float ONNX form of every activation method (RELU → Relu, GELU → Gelu or its erf/tanh formula, PRELU
slopes laid out like the input, ...), the table the Activation mapping of ops/activation.py reads.
A module of its own: ops/activation.py names its integer forwards the same way (`_gelu`, `_prelu`, ...).
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import numpy as np
import torch

from ...graph.node import PyNode
from .._shared import axis_param
from . import exact
from .float_forms import float_const
from .perms import Perm
from .qdq_graph import QDQGraph


def _number(node: PyNode, key: str, default: float) -> float:
    return float(node.get_param(key, optional=True, default_value=default))


def _clip(g: QDQGraph, node: PyNode, x: str, lo: float, hi: float) -> str:
    return g.add("Clip", [x, float_const(g, node, "min", lo), float_const(g, node, "max", hi)])


def _broadcast_constant(values: np.ndarray, rank: int, perm: Perm) -> np.ndarray:
    """A constant broadcastable to an IR tensor of `rank`, laid out like the ONNX value `ir.transpose(perm)`."""
    values = values.reshape((1,) * (rank - values.ndim) + values.shape) if values.ndim < rank else values
    return np.ascontiguousarray(values.transpose(perm))


def _gelu(g: QDQGraph, node: PyNode, x: str) -> str:
    approx = str(node.get_param("approximate", optional=True, default_value="none")).lower()
    if g.opset >= 20:
        return g.add("Gelu", [x], approximate=approx)
    half_x = g.add("Mul", [x, float_const(g, node, "half", 0.5)])
    if approx == "tanh":
        cube = g.add("Mul", [g.add("Mul", [x, x]), x])
        inner = g.add("Add", [x, g.add("Mul", [cube, float_const(g, node, "c", 0.044715)])])
        t = g.add("Tanh", [g.add("Mul", [inner, float_const(g, node, "k", math.sqrt(2.0 / math.pi))])])
    else:
        t = g.add("Erf", [g.add("Mul", [x, float_const(g, node, "rsqrt2", 1.0 / math.sqrt(2.0))])])
    return g.add("Mul", [half_x, g.add("Add", [t, float_const(g, node, "one", 1.0)])])


def leakyrelu_slope(node: PyNode) -> float:
    if "negative_slope" in node.params:
        return float(node.params["negative_slope"])
    if "negative_slope_value" in node.params:
        shift = int(node.params.get("negative_slope_shift", node.outputs[0].dtype.bits))
        return float(node.params["negative_slope_value"]) * 2.0 ** -shift
    return 0.01


def prelu_slope(node: PyNode) -> np.ndarray:
    const = node.get_constant("negative_slope", optional=True)
    if const is None:
        return np.array([leakyrelu_slope(node)])
    shift = int(node.params.get("negative_slope_shift", 0))
    return const.betensor.to(torch.float64).numpy() * 2.0 ** -shift


def _prelu(g: QDQGraph, node: PyNode, x: str, perm: Perm) -> str:
    slope = prelu_slope(node)
    if slope.size == 1:
        return g.add("LeakyRelu", [x], alpha=float(slope.reshape(-1)[0]))
    slope = _broadcast_constant(slope, len(perm), perm).astype(np.float32)
    return g.add("PRelu", [x, g.const(f"{node.name}/slope", slope)])


def exact_prelu(g: QDQGraph, node: PyNode, perm: Perm) -> bool:
    const = node.get_constant("negative_slope", optional=True)
    if const is None:
        return False
    slope = _broadcast_constant(const.betensor.to(torch.int64).numpy(), len(perm), perm)
    return exact.prelu(g, node, slope, int(node.params.get("negative_slope_shift", 0)), perm)


def slope_rounding(g: QDQGraph, node: PyNode, value: str, slopes: np.ndarray) -> str:
    """The integer forward rounds x·slope to the input grid before requantizing (docs/integer-semantics.md,
    LEAKYRELU/PRELU); when multipliers are folded a QuantizeLinear/DequantizeLinear pair on the input grid (zero
    point 0) does the same, when the products fit int8 (int16 from opset 21)."""
    x = node.inputs[0]
    if not g.folds_multipliers:
        return value
    p = g.qparams(x)
    lo_x, hi_x = p.qmin - p.zero_point, p.qmax - p.zero_point  # x + zp_ir over the input range
    products = [lo_x * float(s) for s in slopes.reshape(-1)] + [0.0, float(max(hi_x, 0))]
    lo, hi = math.floor(min(products)), math.ceil(max(products))
    dtypes = [np.int8, np.int16] if g.opset >= 21 else [np.int8]
    dtype = next((d for d in dtypes if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max), None)
    if dtype is None:
        return value
    scale = g.const(f"{node.name}/grid_scale", np.array(p.scale, dtype=np.float32))
    zero = g.const(f"{node.name}/grid_zero_point", np.array(0, dtype=dtype))
    return g.add("DequantizeLinear", [g.add("QuantizeLinear", [value, scale, zero]), scale, zero])


def _hardsigmoid(g: QDQGraph, node: PyNode, x: str) -> str:
    alpha, beta = _number(node, "alpha", 0.2), _number(node, "beta", 0.5)
    lo, hi = _number(node, "clip_min", 0.0), _number(node, "clip_max", 1.0)
    if (lo, hi) == (0.0, 1.0):
        return g.add("HardSigmoid", [x], alpha=alpha, beta=beta)
    lin = g.add("Add", [g.add("Mul", [x, float_const(g, node, "alpha", alpha)]), float_const(g, node, "beta", beta)])
    return _clip(g, node, lin, lo, hi)


def _hardswish(g: QDQGraph, node: PyNode, x: str) -> str:
    if "alpha" not in node.params and "beta" not in node.params:
        return g.add("HardSwish", [x])
    gate = g.add("HardSigmoid", [x], alpha=_number(node, "alpha", 1.0 / 6.0), beta=_number(node, "beta", 0.5))
    return g.add("Mul", [x, gate])


def _swish(g: QDQGraph, node: PyNode, x: str, alpha: float) -> str:
    scaled = x if alpha == 1.0 else g.add("Mul", [x, float_const(g, node, "alpha", alpha)])
    return g.add("Mul", [x, g.add("Sigmoid", [scaled])])


def crelu_axis(node: PyNode, perm: Perm) -> int:
    return perm.index(axis_param(node, node.get_param("axis", optional=True, default_value=-1), len(perm)))


def _crelu(g: QDQGraph, node: PyNode, x: str, perm: Perm) -> str:
    axis = crelu_axis(node, perm)
    return g.add("Concat", [g.add("Relu", [x]), g.add("Relu", [g.add("Neg", [x])])], axis=axis)


ActivationFn = Callable[[QDQGraph, PyNode, str, Perm], str]


ACTIVATIONS: Dict[str, ActivationFn] = {
    "RELU": lambda g, n, x, p: g.add("Relu", [x]),
    "RELU6": lambda g, n, x, p: _clip(g, n, x, 0.0, 6.0),
    "CLIP": lambda g, n, x, p: _clip(g, n, x, float(n.get_param("clip_min")), float(n.get_param("clip_max"))),
    "LEAKYRELU": lambda g, n, x, p: g.add("LeakyRelu", [x], alpha=leakyrelu_slope(n)),
    "PRELU": _prelu,
    "SIGMOID": lambda g, n, x, p: g.add("Sigmoid", [x]),
    "TANH": lambda g, n, x, p: g.add("Tanh", [x]),
    "HARDSWISH": lambda g, n, x, p: _hardswish(g, n, x),
    "HARDSIGMOID": lambda g, n, x, p: _hardsigmoid(g, n, x),
    "ELU": lambda g, n, x, p: g.add("Elu", [x], alpha=_number(n, "alpha", 1.0)),
    "SELU": lambda g, n, x, p: g.add("Selu", [x], alpha=_number(n, "alpha", 1.67326319217681884765625),
                                     gamma=_number(n, "gamma", 1.05070102214813232421875)),
    "CELU": lambda g, n, x, p: g.add("Celu", [x], alpha=_number(n, "alpha", 1.0)),
    "GELU": lambda g, n, x, p: _gelu(g, n, x),
    "SILU": lambda g, n, x, p: _swish(g, n, x, 1.0),
    "SWISH": lambda g, n, x, p: _swish(g, n, x, _number(n, "alpha", 1.0)),
    "MISH": lambda g, n, x, p: g.add("Mish", [x]),
    "SOFTPLUS": lambda g, n, x, p: g.add("Softplus", [x]),
    "BNLL": lambda g, n, x, p: g.add("Softplus", [x]),
    "SOFTSIGN": lambda g, n, x, p: g.add("Softsign", [x]),
    "SHRINK": lambda g, n, x, p: g.add("Shrink", [x], lambd=_number(n, "lambd", 0.5), bias=_number(n, "bias", 0.0)),
    "THRESHOLDEDRELU": lambda g, n, x, p: g.add("ThresholdedRelu", [x], alpha=_number(n, "alpha", 1.0)),
    "CRELU": _crelu,
}


REQUANT_METHODS = ("RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU", "CRELU")
"""Activation methods computed by a multiplier/shift (s_out / s_in) rather than a table."""
