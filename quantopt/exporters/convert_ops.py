"""QDQ export of element-wise layers: Eltwise/Add/Sub/Mul, activations (Activation and the standalone types), the
unary math table ops, Softmax/LogSoftmax/Hardmax.

Each is DequantizeLinear → the float ONNX op → QuantizeLinear, computed in a layout the inputs already have. Table
(LUT) methods export the float function the table was built from, so onnxruntime's float result may round to the
neighbouring integer where the table's sample does not.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import numpy as np
import torch

from ..graph.node import PyNode
from ..ops._lut_int import range_bits
from ..ops._quant import tensor_scale
from ..ops._shared import axis_param
from ..ops.activation import STANDALONE_METHODS as ACTIVATION_STANDALONE
from ..ops.activation import activation_method
from ..ops.eltwise import STANDALONE_METHODS as ELTWISE_STANDALONE
from ..ops.eltwise import eltwise_method
from ..ops.unary_math import domain_clamp
from . import convert_exact
from .convert_mac import fused_activation
from .qdq_graph import Perm, QDQGraph, channels_first, converter, node_error, requant_ratio, same_qparams

ELTWISE_OPS = {"ADD": "Add", "SUB": "Sub", "MUL": "Mul", "MAX": "Max", "MIN": "Min"}

UNARY_OPS: Dict[str, List[str]] = {
    "Abs": ["Abs"], "Negative": ["Neg"], "Exp": ["Exp"], "Log": ["Log"], "Erf": ["Erf"], "Sqrt": ["Sqrt"],
    "Rsqrt": ["Sqrt", "Reciprocal"], "Reciprocal": ["Reciprocal"], "Floor": ["Floor"], "Ceil": ["Ceil"],
    "Round": ["Round"], "Acos": ["Acos"], "Acosh": ["Acosh"], "Asin": ["Asin"], "Asinh": ["Asinh"],
    "Atan": ["Atan"], "Atanh": ["Atanh"], "Cosine": ["Cos"], "Cosh": ["Cosh"], "Sine": ["Sin"], "Sinh": ["Sinh"],
    "Tan": ["Tan"], "Sign": ["Sign"], "Square": ["Mul"],
}
"""Unary IR types → the chain of ONNX ops computing them (each applied to the previous result; Mul squares)."""


def _number(node: PyNode, key: str, default: float) -> float:
    return float(node.get_param(key, optional=True, default_value=default))


def _f32(g: QDQGraph, node: PyNode, what: str, value: float) -> str:
    return g.const(f"{node.name}/{what}", np.array(value, dtype=np.float32))


def _clip(g: QDQGraph, node: PyNode, x: str, lo: float, hi: float) -> str:
    return g.add("Clip", [x, _f32(g, node, "min", lo), _f32(g, node, "max", hi)])


def unary_perm(g: QDQGraph, node: PyNode) -> Perm:
    """Any layout the input already has (channels-first preferred): element-wise ops do not care."""
    x = node.inputs[0]
    return g.common_perm([x], g.rank(x), prefer=channels_first(g.rank(x)))


def _broadcast_constant(values: np.ndarray, rank: int, perm: Perm) -> np.ndarray:
    """A constant broadcastable to an IR tensor of `rank`, laid out like the ONNX value `ir.transpose(perm)`."""
    values = values.reshape((1,) * (rank - values.ndim) + values.shape) if values.ndim < rank else values
    return np.ascontiguousarray(values.transpose(perm))


# ------------------------------------------------------------------------------------------------ activations
def _gelu(g: QDQGraph, node: PyNode, x: str) -> str:
    approx = str(node.get_param("approximate", optional=True, default_value="none")).lower()
    if g.opset >= 20:
        return g.add("Gelu", [x], approximate=approx)
    half_x = g.add("Mul", [x, _f32(g, node, "half", 0.5)])
    if approx == "tanh":
        cube = g.add("Mul", [g.add("Mul", [x, x]), x])
        inner = g.add("Add", [x, g.add("Mul", [cube, _f32(g, node, "c", 0.044715)])])
        t = g.add("Tanh", [g.add("Mul", [inner, _f32(g, node, "k", math.sqrt(2.0 / math.pi))])])
    else:
        t = g.add("Erf", [g.add("Mul", [x, _f32(g, node, "rsqrt2", 1.0 / math.sqrt(2.0))])])
    return g.add("Mul", [half_x, g.add("Add", [t, _f32(g, node, "one", 1.0)])])


def _leakyrelu_slope(node: PyNode) -> float:
    if "negative_slope" in node.params:
        return float(node.params["negative_slope"])
    if "negative_slope_value" in node.params:
        shift = int(node.params.get("negative_slope_shift", node.outputs[0].dtype.bits))
        return float(node.params["negative_slope_value"]) * 2.0 ** -shift
    return 0.01


def _prelu_slope(node: PyNode) -> np.ndarray:
    const = node.get_constant("negative_slope", optional=True)
    if const is None:
        return np.array([_leakyrelu_slope(node)])
    shift = int(node.params.get("negative_slope_shift", 0))
    return const.betensor.to(torch.float64).numpy() * 2.0 ** -shift


def _prelu(g: QDQGraph, node: PyNode, x: str, perm: Perm) -> str:
    slope = _prelu_slope(node)
    if slope.size == 1:
        return g.add("LeakyRelu", [x], alpha=float(slope.reshape(-1)[0]))
    slope = _broadcast_constant(slope, len(perm), perm).astype(np.float32)
    return g.add("PRelu", [x, g.const(f"{node.name}/slope", slope)])


def _exact_prelu(g: QDQGraph, node: PyNode, perm: Perm) -> bool:
    const = node.get_constant("negative_slope", optional=True)
    if const is None:
        return False
    slope = _broadcast_constant(const.betensor.to(torch.int64).numpy(), len(perm), perm)
    return convert_exact.prelu(g, node, slope, int(node.params.get("negative_slope_shift", 0)), perm)


def _slope_rounding(g: QDQGraph, node: PyNode, value: str, slopes: np.ndarray) -> str:
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
    lin = g.add("Add", [g.add("Mul", [x, _f32(g, node, "alpha", alpha)]), _f32(g, node, "beta", beta)])
    return _clip(g, node, lin, lo, hi)


def _hardswish(g: QDQGraph, node: PyNode, x: str) -> str:
    if "alpha" not in node.params and "beta" not in node.params:
        return g.add("HardSwish", [x])
    gate = g.add("HardSigmoid", [x], alpha=_number(node, "alpha", 1.0 / 6.0), beta=_number(node, "beta", 0.5))
    return g.add("Mul", [x, gate])


def _swish(g: QDQGraph, node: PyNode, x: str, alpha: float) -> str:
    scaled = x if alpha == 1.0 else g.add("Mul", [x, _f32(g, node, "alpha", alpha)])
    return g.add("Mul", [x, g.add("Sigmoid", [scaled])])


def _crelu_axis(node: PyNode, perm: Perm) -> int:
    return perm.index(axis_param(node, node.get_param("axis", optional=True, default_value=-1), len(perm)))


def _crelu(g: QDQGraph, node: PyNode, x: str, perm: Perm) -> str:
    axis = _crelu_axis(node, perm)
    return g.add("Concat", [g.add("Relu", [x]), g.add("Relu", [g.add("Neg", [x])])], axis=axis)


ActivationFn = Callable[[QDQGraph, PyNode, str, Perm], str]
ACTIVATIONS: Dict[str, ActivationFn] = {
    "RELU": lambda g, n, x, p: g.add("Relu", [x]),
    "RELU6": lambda g, n, x, p: _clip(g, n, x, 0.0, 6.0),
    "CLIP": lambda g, n, x, p: _clip(g, n, x, float(n.get_param("clip_min")), float(n.get_param("clip_max"))),
    "LEAKYRELU": lambda g, n, x, p: g.add("LeakyRelu", [x], alpha=_leakyrelu_slope(n)),
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


def requant_factor(node: PyNode, numerator: float) -> float:
    """M · 2^-N / (s_out / numerator): how far the stored multiplier is from the exact ratio it stands for."""
    return float(requant_ratio(node)[0]) * numerator / tensor_scale(node.outputs[0])


@converter("Activation", *ACTIVATION_STANDALONE)
def convert_activation(g: QDQGraph, node: PyNode) -> None:
    """The float op; requantizing methods are scaled by the multiplier's rounding first (RELU/RELU6/CLIP clamp
    on the output grid) or afterwards (the slope methods)."""
    method = activation_method(node)
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if method == "NONE":
        if not same_qparams(x, y):
            raise node_error(node, "method NONE with different input and output quantization")
        g.set_int(y, g.int_value(x, perm), perm)
        return
    if method not in ACTIVATIONS:
        raise node_error(node, f"activation method {method} has no QDQ mapping")
    if convert_exact.try_table(g, node, perm):
        return
    if method == "PRELU" and _exact_prelu(g, node, perm):
        return
    if method == "CRELU" and convert_exact.crelu(g, node, perm, _crelu_axis(node, perm)):
        return
    value = g.float_value(x, perm)
    factor = requant_factor(node, tensor_scale(x)) if method in REQUANT_METHODS else 1.0
    if method in ("RELU", "RELU6", "CLIP"):
        value = g.rescale(value, factor)
    value = ACTIVATIONS[method](g, node, value, perm)
    if method in ("LEAKYRELU", "PRELU"):
        slopes = _prelu_slope(node) if method == "PRELU" else np.array([_leakyrelu_slope(node)])
        value = _slope_rounding(g, node, value, slopes)
    if method in ("LEAKYRELU", "PRELU", "CRELU"):
        value = g.rescale(value, factor)
    g.quantize(y, value, perm, exact=method not in REQUANT_METHODS)


def _domain(g: QDQGraph, node: PyNode, value: str) -> str:
    """The clamp quantopt's table applies to a function with a restricted domain (ops.unary_math.domain_clamp):
    Reciprocal moves |x| < h to ±h, the others clip to their domain; the bounds are read off that clamp."""
    clamp = domain_clamp(str(node.type), tensor_scale(node.inputs[0]))
    if clamp is None:
        return value
    if str(node.type) == "Reciprocal":
        h = float(clamp(torch.tensor(0.0)))
        near_zero = g.add("Less", [g.add("Abs", [value]), _f32(g, node, "h", h)])
        signed_h = g.add("Where", [g.add("Less", [value, _f32(g, node, "zero", 0.0)]), _f32(g, node, "neg_h", -h),
                                   _f32(g, node, "pos_h", h)])
        return g.add("Where", [near_zero, signed_h, value])
    lo, hi = (float(clamp(torch.tensor(v))) for v in (-math.inf, math.inf))
    bounds = [_f32(g, node, "min", lo) if math.isfinite(lo) else "", _f32(g, node, "max", hi) if math.isfinite(hi)
              else ""]
    return g.add("Clip", [value, *bounds])


@converter(*UNARY_OPS)
def convert_unary(g: QDQGraph, node: PyNode) -> None:
    """The float function (after quantopt's domain clamp for Log, Sqrt, Reciprocal, ...)."""
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if convert_exact.try_table(g, node, perm):
        return
    value = g.float_value(x, perm)
    if "lut" in node.constants:
        value = _domain(g, node, value)
    for op in UNARY_OPS[str(node.type)]:
        value = g.add(op, [value, value] if op == "Mul" else [value])  # Square: x · x
    if "lut" not in node.constants and "scale_value" in node.params:  # Abs, Negative: a multiplier s_out / s_in
        value = g.rescale(value, requant_factor(node, tensor_scale(x)))
    g.quantize(y, value, perm, exact="lut" in node.constants)


# ------------------------------------------------------------------------------------------------ binary
@converter("Eltwise", *ELTWISE_STANDALONE)
def convert_eltwise(g: QDQGraph, node: PyNode) -> None:
    """Both inputs in one layout (numpy broadcasting is preserved when ranks are equal), then the fused
    activation."""
    method = eltwise_method(node)
    if method not in ELTWISE_OPS:
        raise node_error(node, f"Eltwise method {method} has no QDQ mapping")
    ranks = {g.rank(t) for t in node.inputs}
    rank = g.rank(node.outputs[0])
    perm = g.common_perm(node.inputs, rank, prefer=channels_first(rank)) if ranks == {rank} else tuple(range(rank))
    if convert_exact.eltwise(g, node, method, perm if ranks == {rank} else None):
        return
    if "scale" in node.constants:
        raise node_error(node, "per-channel Eltwise multipliers are exported in the exact mode only")
    values = [g.float_value(t, perm) if ranks == {rank} else g.float_value(t) for t in node.inputs]
    y = node.outputs[0]
    if method == "MUL" or len(values) != 2:
        out = values[0]
        for v in values[1:]:
            out = g.add(ELTWISE_OPS[method], [out, v])
        if method == "MUL" and len(values) == 2:
            out = g.rescale(out, requant_factor(node, tensor_scale(node.inputs[0]) * tensor_scale(node.inputs[1])))
    else:
        # y = ((a + zp_a) M_a + (b + zp_b) M_b) M_out 2^-N: each input carries its own multiplier
        m_out, m_a, m_b = (float(v) for v in node.get_param("scale_value"))
        common = m_out * 2.0 ** -float(node.get_param("shift_value")) / tensor_scale(y)
        a, b = (g.rescale(v, m * common * tensor_scale(t), f"requant{i}")
                for i, (v, m, t) in enumerate(zip(values, (m_a, m_b), node.inputs)))
        out = g.add(ELTWISE_OPS[method], [a, b])
    g.quantize(y, fused_activation(g, node, out), perm)


# ------------------------------------------------------------------------------------------------ softmax family
@converter("Softmax", "LogSoftmax", "Hardmax")
def convert_softmax(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    axis = perm.index(axis_param(node, node.get_param("axis", optional=True, default_value=-1), len(perm)))
    if str(node.type) == "Softmax" and (convert_exact.softmax_lut(g, node, perm, axis)
                                        or convert_exact.softmax_fast_exp(g, node, perm, axis)):
        return
    if str(node.type) == "LogSoftmax" and convert_exact.logsoftmax(g, node, perm, axis):
        return
    out = g.add(str(node.type), [g.float_value(x, perm)], axis=axis)
    if str(node.type) == "Softmax" and str(node.params.get("quantize_method", "LUT")).upper() == "LUT":
        out = g.rescale(out, requant_factor(node, 1.0))  # the table's e/S times M · 2^-N stands for softmax · s_out
    elif str(node.type) == "Softmax" and str(node.params.get("quantize_method")).upper() == "FAST_EXP" \
            and int(node.params.get("adjust_q", 0)) >= 8:
        # FAST_EXP table path: the integers are 2^(b_out + log2 softmax), i.e. softmax · 2^b_out, not softmax · s_out
        out = g.rescale(out, 2.0 ** range_bits(y) / tensor_scale(y))
    g.quantize(y, out, perm, lossless=str(node.type) == "Hardmax")


# ------------------------------------------------------------------------------------------------ Pow, Div
@converter("Pow")
def convert_pow(g: QDQGraph, node: PyNode) -> None:
    """x ^ exponent (the constant param): quantopt's table as a Gather ("exact"), else the float Pow."""
    if "exponent" not in node.params or len(node.inputs) != 1:
        raise node_error(node, "only Pow with a constant exponent is quantized and exported")
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if convert_exact.try_table(g, node, perm):
        return
    exponent = g.const(f"{node.name}/exponent", np.array(float(node.get_param("exponent")), dtype=np.float32))
    g.quantize(y, g.add("Pow", [g.float_value(x, perm), exponent]), perm, exact=True)


@converter("Div")
def convert_div(g: QDQGraph, node: PyNode) -> None:
    """a / b: quantopt's reciprocal-table division in int64 ("exact"), else the float Div scaled by the
    multiplier's rounding."""
    if len(node.inputs) != 2:
        raise node_error(node, f"needs 2 inputs, got {len(node.inputs)}")
    a, b = node.inputs
    y = node.outputs[0]
    rank = g.rank(y)
    same_rank = {g.rank(a), g.rank(b)} == {rank}
    perm = g.common_perm(node.inputs, rank, prefer=channels_first(rank)) if same_rank else tuple(range(rank))
    if convert_exact.div(g, node, perm if same_rank else None):
        return
    values = [g.float_value(t, perm) if same_rank else g.float_value(t) for t in node.inputs]
    out = g.rescale(g.add("Div", values), requant_factor(node, tensor_scale(a) / tensor_scale(b)))
    g.quantize(y, out, perm)
