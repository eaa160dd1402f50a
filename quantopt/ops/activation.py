"""Element-wise activations: the `Activation` layer (one `method` per layer) and the standalone op types
(RELU, Sigmoid, Hardswish, ...) that the Parser may emit instead; both run the same float functions.

Quantized (docs/integer-semantics.md, docs/semantics/unary.md for SHRINK/THRESHOLDEDRELU/CRELU/BNLL):
RELU/RELU6/CLIP requantize s_out/s_in with a multiplier/shift and clamp to the quantized bounds; CRELU
concatenates relu(x) and relu(-x) and requantizes the same way; LEAKYRELU/PRELU also quantize the negative slope
(shift = output bits, resp. 12); every other method is a lookup table `lut` over the input integer range; NONE
passes the input through.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..quant.dtype import Dtype
from ..quant.hardware import PRELU_SLOPE_SHIFT
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import quantize
from ..quant.requant import requantize_int
from ..registry import declare_op
from ..registry.schema import Axis, DtypeName, Float, Int, Param, Text, Value, quantized
from ._lut_int import constants_first, int_input, is_restricted, range_bits, take_codes
from ._quant import (
    copy_params,
    layer_settings,
    out_range,
    params,
    quant_of,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import FUSED_ACTIVATIONS, apply_fused_activation, axis_param, broadcast_shape, keeps_float64
from ._slope import apply_int_slope, broadcasts_to, leaky_slope_code, prelu_slope_codes
from .onnx_build import exact as onnx_exact
from .onnx_build.activation_forms import (
    ACTIVATIONS,
    REQUANT_METHODS,
    crelu_axis,
    exact_prelu,
    leakyrelu_slope,
    prelu_slope,
    slope_rounding,
)
from .onnx_build.float_forms import requant_factor, unary_perm
from .onnx_build.qdq_graph import ONNX_INT_TYPES, QDQGraph, node_error, same_qparams

# ONNX defaults, used when the IR leaves a parameter out.
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875
LEAKYRELU_SLOPE = 0.01
GELU_APPROXIMATIONS = ("none", "tanh")
GELU_TANH_CUBIC = 0.044715
"""Cubic coefficient of GELU's tanh approximation."""
SHRINK_LAMBD = 0.5
SHRINK_BIAS = 0.0
THRESHOLDEDRELU_ALPHA = 1.0
CRELU_AXIS = -1
"""CRELU concatenates along the channel axis, the last one in the IR's channels-last layout (TensorFlow's default)."""


# --------------------------------------------------------------------------------------------- declarations
METHOD_NAMES = ("NONE", "RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU", "SIGMOID", "TANH", "HARDSWISH", "HARDSIGMOID",
                "ELU", "SELU", "CELU", "GELU", "SILU", "SWISH", "MISH", "SOFTPLUS", "SOFTSIGN", "SHRINK",
                "THRESHOLDEDRELU", "CRELU", "BNLL")
"""The `method` values of an Activation layer (the keys of ACTIVATION_METHODS)."""

_SLOPE = ("LEAKYRELU", "PRELU")
_REQUANT = ("RELU", "RELU6", "CLIP", "CRELU") + _SLOPE
_TABLE_METHODS = tuple(m for m in METHOD_NAMES if m not in ("NONE",) + _REQUANT)
_UPSTREAM_TABLE = "upstream's float-table approximation; not read"

_ACTIVATION_KEYS: Dict[str, Tuple[Param, Tuple[str, ...]]] = {
    "alpha": (Param(Float(), "ELU, CELU, SWISH, THRESHOLDEDRELU: alpha (1.0); SELU: alpha (1.6733); HARDSIGMOID, "
                             "HARDSWISH: the slope of alpha*x + beta (0.2 resp. 1/6)"),
              ("ELU", "CELU", "SWISH", "THRESHOLDEDRELU", "SELU", "HARDSIGMOID", "HARDSWISH")),
    "beta": (Param(Float(), "HARDSIGMOID, HARDSWISH: the offset of alpha*x + beta (0.5)"),
             ("HARDSIGMOID", "HARDSWISH")),
    "gamma": (Param(Float(), "SELU: the output scale (1.0507)"), ("SELU",)),
    "clip_min": (Param(Float(infinite=True), "CLIP: the lower bound (required); HARDSIGMOID: the lower clamp (0)"),
                 ("CLIP", "HARDSIGMOID")),
    "clip_max": (Param(Float(infinite=True), "CLIP: the upper bound (required); HARDSIGMOID: the upper clamp (1)"),
                 ("CLIP", "HARDSIGMOID")),
    "approximate": (Param(Text(choices=GELU_APPROXIMATIONS), "GELU: none (the erf form, default) or tanh, any case"),
                    ("GELU",)),
    "lambd": (Param(Float(), "SHRINK: the threshold (0.5)"), ("SHRINK",)),
    "bias": (Param(Float(), "SHRINK: what values beyond the threshold move towards 0 (0)"), ("SHRINK",)),
    "axis": (Param(Int(), "CRELU: the concatenation axis, negative counts from the end", default=CRELU_AXIS),
             ("CRELU",)),
    "negative_slope": (Param(Float(), "LEAKYRELU, PRELU: the scalar slope (read before negative_slope_value); PRELU "
                                      "also takes it as a constant broadcast to the input (int16 over "
                                      "2^negative_slope_shift when quantized)"), _SLOPE),
    "negative_slope_value": (Param(Float(), "LEAKYRELU, PRELU: the scalar slope when negative_slope is absent "
                                            "(LEAKYRELU: 0.01); quantized LEAKYRELU: the integer slope over "
                                            "2^negative_slope_shift"), _SLOPE),
    "negative_slope_shift": (quantized(Int(), "LEAKYRELU, PRELU: fraction bits of the quantized slope (LEAKYRELU: "
                                              "the output bits, PRELU: 12)"), _SLOPE),
    "negative_slope_type": (quantized(DtypeName(), "LEAKYRELU: the dtype of the quantized negative_slope_value"),
                            ("LEAKYRELU",)),
    "with_activation": (Param(Text(choices=FUSED_ACTIVATIONS), "not read (a MAC layer's fused activation)"), ()),
    "lut_mode": (quantized(Text(), f"{_UPSTREAM_TABLE} (NORMAL, MIRROR, ...)"), ()),
    "index_scale_value": (quantized(Float(), f"{_UPSTREAM_TABLE}: the index scale"), ()),
    "index_offset_value": (quantized(Float(), f"{_UPSTREAM_TABLE}: the index offset"), ()),
    "value_offset_value": (quantized(Float(), f"{_UPSTREAM_TABLE}: the value offset"), ()),
    "index_scale_type": (quantized(DtypeName(), f"{_UPSTREAM_TABLE}: the index scale's dtype"), ()),
    "index_offset_type": (quantized(DtypeName(), f"{_UPSTREAM_TABLE}: the index offset's dtype"), ()),
    "value_offset_type": (quantized(DtypeName(), f"{_UPSTREAM_TABLE}: the value offset's dtype"), ()),
}
"""Every non-constant key of the activation types: its kind and doc, and the methods that read it (none: no method,
the doc says so)."""

_ACTIVATION_CONSTANTS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "lut": ("the output table over the input's integer range, written when quantized", _TABLE_METHODS),
    "scale": ("per-channel requantization multipliers, in place of scale_value", _REQUANT),
    "shift": ("per-channel requantization shifts, in place of shift_value", _REQUANT),
}

_KEYS = ("alpha beta gamma clip_min clip_max approximate lambd bias axis negative_slope negative_slope_value "
         "negative_slope_shift negative_slope_type lut scale shift with_activation")
"""The keys of every activation type (the standalone ones also have `method`, not read)."""
_INDEX_KEYS = _KEYS + " index_scale_value index_offset_value value_offset_value"
_MODE_KEYS = _INDEX_KEYS + " lut_mode"
_STANDALONE_METHOD = {"method": Param(Value(), "not read: the type is the method")}


def _params(keys: str, methods: Tuple[str, ...], required: Tuple[str, ...] = ()) -> Dict[str, Param]:
    """The declared params among `keys` of types computing `methods`: a key none of them reads is documented as not
    read (an axis then takes any axis value); `required` ones are required."""
    out: Dict[str, Param] = {}
    for key in keys.split():
        if key not in _ACTIVATION_KEYS:
            continue
        param, readers = _ACTIVATION_KEYS[key]
        if readers and not set(readers) & set(methods):
            param = replace(param, kind=Axis() if key == "axis" else param.kind, doc="not read", default=None)
        out[key] = replace(param, required=True) if key in required else param
    return out


def _constants(keys: str, methods: Tuple[str, ...]) -> Dict[str, str]:
    """The declared constants among `keys` of types computing `methods`."""
    return {key: doc if set(readers) & set(methods) else "not read"
            for key, (doc, readers) in _ACTIVATION_CONSTANTS.items() if key in keys.split()}


_ACT_DOC = "docs/integer-semantics.md"
_LUT_INTEGER = "LUT over the input range"

ACTIVATION = declare_op(
    "Activation",
    params={"method": Param(Text(choices=METHOD_NAMES), "the function computed", required=True),
            **_params(_MODE_KEYS + " index_scale_type index_offset_type value_offset_type", METHOD_NAMES)},
    constants=_constants(_KEYS, METHOD_NAMES), summary="Absent params take the ONNX defaults",
    integer="per method: requantization (RELU/RELU6/CLIP/CRELU), quantized slope (LEAKYRELU/PRELU), LUT",
    semantics=f"{_ACT_DOC}#activations-and-softmax-quantization-and-integer-semantics")
RELU_RELU6 = declare_op(
    ["RELU", "RELU6"], params={**_STANDALONE_METHOD, **_params(_KEYS, ("RELU", "RELU6"))},
    constants=_constants(_KEYS, ("RELU", "RELU6")), integer="requantization s_out/s_in, clamp to the quantized bounds",
    semantics=f"{_ACT_DOC}#relu-relu6-clip-linear-requantization")
CLIP = declare_op(
    "Clip", params={**_STANDALONE_METHOD, **_params(_KEYS, ("CLIP",), required=("clip_min", "clip_max"))},
    constants=_constants(_KEYS, ("CLIP",)), integer="requantization s_out/s_in, clamp to the quantized bounds",
    semantics=f"{_ACT_DOC}#relu-relu6-clip-linear-requantization")
LEAKYRELU_PRELU = declare_op(
    ["LeakyRELU", "PRELU"], params={**_STANDALONE_METHOD, **_params(_KEYS, _SLOPE)},
    constants=_constants(_KEYS, _SLOPE), summary="PRELU: a constant negative_slope, or a scalar one",
    integer="quantized negative slope, then requantization s_out/s_in",
    semantics=f"{_ACT_DOC}#leakyrelu-and-prelu-quantized-negative-slope")
_LUT_SEMANTICS = f"{_ACT_DOC}#lookup-table-methods"
_HARD_LUT_METHODS = ("HARDSIGMOID", "HARDSWISH")
HARD_LUT = declare_op(
    ["HardSigmoid", "Hardswish"], params={**_STANDALONE_METHOD, **_params(_KEYS, _HARD_LUT_METHODS)},
    constants=_constants(_KEYS, _HARD_LUT_METHODS), summary="Absent params take the ONNX defaults",
    integer=_LUT_INTEGER, semantics=_LUT_SEMANTICS)
_INDEX_LUT_METHODS = ("SIGMOID", "ELU", "SELU", "CELU", "SWISH", "MISH", "SOFTPLUS")
INDEX_LUT = declare_op(
    ["Sigmoid", "ELU", "SELU", "CELU", "Swish", "MISH", "Softplus"],
    params={**_STANDALONE_METHOD, **_params(_INDEX_KEYS, _INDEX_LUT_METHODS)},
    constants=_constants(_KEYS, _INDEX_LUT_METHODS), summary="Absent params take the ONNX defaults",
    integer=_LUT_INTEGER, semantics=_LUT_SEMANTICS)
_MODE_LUT_METHODS = ("TANH", "GELU", "SILU", "SOFTSIGN")
MODE_LUT = declare_op(
    ["Tanh", "GELU", "Silu", "Softsign"], params={**_STANDALONE_METHOD, **_params(_MODE_KEYS, _MODE_LUT_METHODS)},
    constants=_constants(_KEYS, _MODE_LUT_METHODS), summary="Absent params take the ONNX defaults",
    integer=_LUT_INTEGER, semantics=_LUT_SEMANTICS)
SHRINK = declare_op(
    "SHRINK", params={**_STANDALONE_METHOD, **_params(_MODE_KEYS, ("SHRINK",))},
    constants=_constants(_KEYS, ("SHRINK",)), integer=_LUT_INTEGER, semantics="docs/semantics/unary.md#shrink")
THRESHOLDEDRELU = declare_op(
    "THRESHOLDEDRELU", params={**_STANDALONE_METHOD, **_params(_KEYS, ("THRESHOLDEDRELU",))},
    constants=_constants(_KEYS, ("THRESHOLDEDRELU",)),
    integer="LUT over the input range (signed output iff alpha < 0)",
    semantics="docs/semantics/unary.md#thresholdedrelu")
BNLL = declare_op(
    "BNLL", params={**_STANDALONE_METHOD, **_params(_KEYS, ("BNLL",))}, constants=_constants(_KEYS, ("BNLL",)),
    integer=_LUT_INTEGER, semantics="docs/semantics/unary.md#bnll")
CRELU = declare_op(
    "CRELU", params={**_STANDALONE_METHOD, **_params(_KEYS, ("CRELU",))}, constants=_constants(_KEYS, ("CRELU",)),
    integer="concat(max(x+zp_in,0), max(-(x+zp_in),0)), one requantization s_out/s_in, unsigned",
    semantics="docs/semantics/unary.md#crelu")


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
        shape = broadcast_shape((tuple(slope.betensor.shape), tuple(x.shape)))
    except ValueError:
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
    if "alpha" not in node.params and "beta" not in node.params:
        return F.hardswish(x)  # x * relu6(x + 3) / 6: the float32 rounding upstream's calibration sees
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
    if approx == "none":
        return F.gelu(x)
    # the tanh form in upstream's float order: Φ(x) = 0.5 · (1 + tanh(c · (x + 0.044715 · x³))) with
    # c = sqrt(2/π) rounded to float32, then x · Φ(x); torch's fused tanh GELU rounds differently in the last bit
    c = torch.sqrt(torch.tensor(2 / math.pi, dtype=torch.float32))
    return x * (0.5 * (1 + torch.tanh(c * (x + GELU_TANH_CUBIC * torch.pow(x, 3)))))


def _swish(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(_number(node, "alpha", 1.0) * x)


def _shrink(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """ONNX Shrink: x + bias below -lambd, x - bias above lambd, 0 in between."""
    lambd, bias = _number(node, "lambd", SHRINK_LAMBD), _number(node, "bias", SHRINK_BIAS)
    zero = torch.zeros_like(x)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero))


def _thresholdedrelu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """ONNX ThresholdedRelu: x where x > alpha, else 0."""
    alpha = _number(node, "alpha", THRESHOLDEDRELU_ALPHA)
    return torch.where(x > alpha, x, torch.zeros_like(x))


def _bnll(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), as x + log1p(exp(-x)) for x > 0 so that large inputs do not overflow."""
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))


def _crelu_axis(node: PyNode, rank: int) -> int:
    return axis_param(node, node.get_param("axis", optional=True, default_value=CRELU_AXIS), rank)


def _crelu(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """concat(relu(x), relu(-x)) along `axis`: the output has twice the input's size along it."""
    return torch.cat([F.relu(x), F.relu(-x)], dim=_crelu_axis(node, x.dim()))


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
    "SHRINK": _shrink,
    "THRESHOLDEDRELU": _thresholdedrelu,
    "BNLL": _bnll,
    "CRELU": _crelu,
}

# Standalone op types → the Activation method they compute (same parameters as that method).
STANDALONE_METHODS: Dict[str, str] = {
    "RELU": "RELU", "RELU6": "RELU6", "LeakyRELU": "LEAKYRELU", "PRELU": "PRELU", "Clip": "CLIP",
    "Sigmoid": "SIGMOID", "Tanh": "TANH", "HardSigmoid": "HARDSIGMOID", "Hardswish": "HARDSWISH",
    "ELU": "ELU", "SELU": "SELU", "CELU": "CELU", "GELU": "GELU", "Silu": "SILU", "Swish": "SWISH",
    "MISH": "MISH", "Softplus": "SOFTPLUS", "Softsign": "SOFTSIGN",
    "SHRINK": "SHRINK", "THRESHOLDEDRELU": "THRESHOLDEDRELU", "CRELU": "CRELU", "BNLL": "BNLL",
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


# --------------------------------------------------------------------------------------------- quantization
LINEAR_METHODS = ("RELU", "RELU6", "CLIP")
"""Piecewise-linear methods realised by a requantization and a clamp."""
SLOPE_METHODS = ("LEAKYRELU", "PRELU")
"""Methods with a quantized negative slope."""

OUTPUT_SIGNED: Dict[str, Optional[bool]] = {
    "RELU": False, "RELU6": False, "CLIP": None, "LEAKYRELU": True, "PRELU": True,
    "SIGMOID": False, "TANH": True, "HARDSWISH": True, "HARDSIGMOID": None, "ELU": True, "SELU": True,
    "CELU": True, "GELU": True, "SILU": True, "SWISH": True, "MISH": True, "SOFTPLUS": False, "SOFTSIGN": True,
    "SHRINK": True, "THRESHOLDEDRELU": None, "CRELU": False, "BNLL": False,
}
"""Output signedness per method, upstream's fixed table; None: signed iff clip_min < 0 (CLIP, HARDSIGMOID), iff
alpha < 0 (THRESHOLDEDRELU)."""


def output_signed(node: PyNode, method: str) -> bool:
    """Whether the quantized output is signed (force_dtype_int is applied later by quantize_activation)."""
    signed = OUTPUT_SIGNED[method]
    if signed is None and method == "THRESHOLDEDRELU":
        return _number(node, "alpha", THRESHOLDEDRELU_ALPHA) < 0
    if signed is None:
        return _number(node, "clip_min", None if method == "CLIP" else 0.0) < 0
    return signed


def _f32_ratio(num: float, den: float) -> torch.Tensor:
    """num / den in float32, the precision upstream forms requantization ratios in."""
    return torch.tensor(num, dtype=torch.float32) / torch.tensor(den, dtype=torch.float32)


def _store_rescale(node: PyNode) -> None:
    """scale_value/shift_value approximating s_out / s_in with the layer's multiplier bits."""
    ratio = _f32_ratio(tensor_scale(node, node.outputs[0]), tensor_scale(node, node.inputs[0]))
    store_requant(node, *requant_scale_shift(node, ratio))


def _quantize_linear(node: PyNode, method: str) -> None:
    if method == "CLIP":
        _clip(node, torch.zeros(1))  # validates clip_min <= clip_max
    q_in = params(node, node.inputs[0])
    if q_in.qinvariant and _integer_bounds(node, method):
        # integers (a Cast to an integer type, an index) clamped by integer bounds stay integers, as upstream's Clip
        # keeps them: the output is the input's integer type, the rescale 1, and an index read from it stays exact
        set_qinvariant(node, node.outputs[0], int(q_in.qbits), bool(q_in.qmin is not None and q_in.qmin < 0))
    else:
        quantize_activation(node, node.outputs[0], output_signed(node, method))
    _store_rescale(node)


def _integer_bounds(node: PyNode, method: str) -> bool:
    """Whether the method clamps to whole numbers (or to nothing: an infinite or float32-extreme CLIP bound), so
    that integer inputs give integer outputs."""
    if method != "CLIP":
        return True
    bounds = (_number(node, "clip_min"), _number(node, "clip_max"))
    return all(math.isinf(b) or abs(b) >= 2.0 ** 63 or float(b).is_integer() for b in bounds)


def _check_crelu_shapes(node: PyNode) -> None:
    """The IR output shape must be the input shape with the concatenation axis doubled."""
    inp, out = node.inputs[0], node.outputs[0]
    in_shape, out_shape = list(inp.ir_shape), list(out.ir_shape)
    if not in_shape or not out_shape:
        return
    axis = _crelu_axis(node, len(in_shape))
    want = in_shape[:axis] + [2 * in_shape[axis]] + in_shape[axis + 1:]
    if out_shape != want:
        raise node._error(f"CRELU along axis {axis} of an input of shape {in_shape} gives {want}, but the output "
                          f"shape is {out_shape}")


def _quantize_crelu(node: PyNode) -> None:
    """Unsigned output params from the calibrated range; scale_value/shift_value for s_out / s_in."""
    _check_crelu_shapes(node)
    quantize_activation(node, node.outputs[0], output_signed(node, "CRELU"))
    _store_rescale(node)


def _quantize_leakyrelu(node: PyNode) -> None:
    """negative_slope_value = round(slope * 2^out_bits) (int param, dtype from its range), shift = out_bits."""
    slope = _slope_param(node)
    out = node.outputs[0]
    quantize_activation(node, out, output_signed(node, "LEAKYRELU"))
    bits = int(params(node, out).qbits)
    try:
        q, q_dtype = leaky_slope_code(slope, bits)
    except ValueError as e:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {e}") from None
    node.params.pop("negative_slope", None)
    node.params["negative_slope_value"] = q
    node.params["negative_slope_type"] = q_dtype
    node.params["negative_slope_shift"] = bits
    _store_rescale(node)


def _quantize_prelu(node: PyNode) -> None:
    """`negative_slope` constant → int16 clip(round(slope * 2^12)); slices along dim 0 that are all equal (e.g. the
    Parser's [1,H,W,C]) collapse to one, dim 0 squeezed, as upstream."""
    inp, out = node.inputs[0], node.outputs[0]
    const = node.get_constant("negative_slope", optional=True)
    if const is None:
        values = torch.tensor([_slope_param(node)], dtype=torch.float32)
        node.params.pop("negative_slope", None)
        node.params.pop("negative_slope_value", None)
    else:
        values = const.betensor.to(torch.float32)
    quantize_activation(node, out, output_signed(node, "PRELU"))
    q = prelu_slope_codes(values, len(inp.ir_shape))
    if not broadcasts_to(q.shape, inp.ir_shape):
        raise node._error(f"negative_slope of shape {list(q.shape)} does not broadcast to the input shape "
                          f"{list(inp.ir_shape)}")
    set_constant(node, "negative_slope", q, Dtype.INT16)
    constants_first(node, ["negative_slope"])
    node.params["negative_slope_shift"] = PRELU_SLOPE_SHIFT
    _store_rescale(node)


def _lut_function(node: PyNode, method: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float32 function tabulated. HARDSWISH without parameters uses torch's x*relu6(x+3)/6, whose float32
    rounding is what upstream's tables (all golden HARDSWISH LUTs, 16-bit included) were built with."""
    if method == "HARDSWISH" and "alpha" not in node.params and "beta" not in node.params:
        return F.hardswish
    fn = ACTIVATION_METHODS[method]
    return lambda x: fn(node, x)


def _quantize_lut(node: PyNode, method: str) -> None:
    """Output params from the calibrated range, then lut[i] = quantize_out(f(dequantize_in(sample_i)))."""
    inp, out = node.inputs[0], node.outputs[0]
    fn = _lut_function(node, method)
    fn(torch.zeros(1))  # parameter errors surface as IR errors before anything is changed
    quantize_activation(node, out, output_signed(node, method), per_channel_ok=True)
    in_qmin, in_qmax = out_range(node, inp)
    out_qmin, out_qmax = out_range(node, out)
    items = int(layer_settings(node).lut_items_in_bits)
    q_in, q_out = params(node, inp), params(node, out)
    if not (q_in.per_channel or q_out.per_channel):
        table = build_lut(fn, tensor_scale(node, inp), tensor_zp(node, inp), in_qmin, in_qmax, range_bits(node, inp),
                          tensor_scale(node, out), tensor_zp(node, out), out_qmin, out_qmax, lut_items_in_bits=items)
    else:  # one table per channel of the last axis, from that channel's input and output scales
        channels = int(inp.ir_shape[-1])
        s_in, s_out = (q.scale.reshape(-1).tolist() if q.per_channel else [tensor_scale(node, t)] * channels
                       for t, q in ((inp, q_in), (out, q_out)))
        table = torch.stack([build_lut(fn, float(a), tensor_zp(node, inp), in_qmin, in_qmax, range_bits(node, inp),
                                       float(b), tensor_zp(node, out), out_qmin, out_qmax, lut_items_in_bits=items)
                             for a, b in zip(s_in, s_out)])
    set_constant(node, "lut", table, out.dtype)
    constants_first(node, ["lut"])


@ACTIVATION.quantize
@RELU_RELU6.quantize
@CLIP.quantize
@LEAKYRELU_PRELU.quantize
@HARD_LUT.quantize
@INDEX_LUT.quantize
@MODE_LUT.quantize
@SHRINK.quantize
@THRESHOLDEDRELU.quantize
@BNLL.quantize
@CRELU.quantize
def activation_quantize(self: PyNode) -> None:
    """Quantize one activation layer; what the integer forward reads is all stored in the layer (see module doc)."""
    method = activation_method(self)
    inp = self.inputs[0]
    q_in = params(self, inp)
    if q_in.qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    table = method not in ("NONE", "CRELU") + LINEAR_METHODS + SLOPE_METHODS
    if not table and (q_in.per_channel or layer_settings(self).q_mode_activation.startswith("per_channel")):
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): method {method} takes per-tensor activations "
                               "only (the table methods take per-channel ones, with one table per channel)")
    if method == "NONE":
        copy_params(self, self.outputs[0], inp)
    elif method in LINEAR_METHODS:
        _quantize_linear(self, method)
    elif method == "CRELU":
        _quantize_crelu(self)
    elif method == "LEAKYRELU":
        _quantize_leakyrelu(self)
    elif method == "PRELU":
        _quantize_prelu(self)
    else:
        _quantize_lut(self, method)


# --------------------------------------------------------------------------------------------- integer forward
def _quantized_bound(node: PyNode, value: float) -> int:
    """The output code of the float `value`: clamp(round_half_even(value * s_out - zp_out), qmin, qmax), float64."""
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    return int(quantize(torch.tensor(value, dtype=torch.float64), tensor_scale(node, out), tensor_zp(node, out), qmin,
                        qmax, compute_dtype=torch.float64))


def _int_linear(node: PyNode, method: str, x: torch.Tensor, zp_in: int) -> torch.Tensor:
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    mult, shift = requant_of(node)
    xs = x + zp_in
    if method != "CLIP":
        xs = torch.clamp(xs, min=0)
    y = requantize_int(xs, mult, shift, tensor_zp(node, out), qmin, qmax)
    if method == "RELU6":
        y = torch.clamp(y, max=_quantized_bound(node, 6.0))
    elif method == "CLIP":
        y = torch.clamp(y, _quantized_bound(node, _number(node, "clip_min")),
                        _quantized_bound(node, _number(node, "clip_max")))
    return y


def _int_crelu(node: PyNode, x: torch.Tensor, zp_in: int) -> torch.Tensor:
    """requant(concat(max(x + zp_in, 0), max(-(x + zp_in), 0))) along `axis`."""
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    mult, shift = requant_of(node)
    xs = x + zp_in
    both = torch.cat([torch.clamp(xs, min=0), torch.clamp(-xs, min=0)], dim=_crelu_axis(node, x.dim()))
    return requantize_int(both, mult, shift, tensor_zp(node, out), qmin, qmax)


def _int_slope(node: PyNode, method: str, x: torch.Tensor, zp_in: int,
               slope: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`slope`: PRELU's slopes when given (`_code_table` passes the one row of slopes a constant holds repeated)."""
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    if method == "PRELU":
        if slope is None:
            slope = node.get_constant("negative_slope").betensor
        slope = slope.to(torch.int64)
        shift_slope = int(node.get_param("negative_slope_shift"))
    else:
        value = node.get_param("negative_slope_value")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or abs(value) >= 2 ** 31:
            raise node._error(f"a quantized LEAKYRELU needs an integer negative_slope_value below 2^31 in magnitude, "
                              f"got {value!r}")
        slope = torch.tensor(int(value), dtype=torch.int64)
        shift_slope = int(node.get_param("negative_slope_shift", optional=True, default_value=out.dtype.bits))
    if not broadcasts_to(slope.shape, x.shape):
        raise node._error(f"negative_slope of shape {list(slope.shape)} does not broadcast to the input shape "
                          f"{list(x.shape)}")
    y = apply_int_slope(x + zp_in, slope, shift_slope)
    mult, shift = requant_of(node)
    return requantize_int(y, mult, shift, tensor_zp(node, out), qmin, qmax)


def _int_lut(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    inp, out = node.inputs[0], node.outputs[0]
    lut = node.get_constant("lut")
    in_qmin, _ = out_range(node, inp)
    y = lookup_lut(x, lut.betensor, in_qmin, range_bits(node, inp), lut.dtype.bits, lut.dtype.is_signed,
                   in_restricted=is_restricted(node, inp))
    qmin, qmax = out_range(node, out)
    return torch.clamp(y, qmin, qmax)


TABLE_MAX_CODES = 1 << 16
"""Input ranges of at most this many codes get their integer forward tabulated (`_code_table`)."""
TABLE_MAX_ENTRIES = 1 << 22
"""Most entries (codes times channels) of a table whose channels map differently (`_code_table`)."""


def _channels_alike(node: PyNode) -> bool:
    """Whether nothing an element-wise activation's integer forward reads varies along the channels: per-tensor
    input and output params, constants of one value (a table over the codes, `lut`, aside) and params of one
    value. Its table then needs one column of codes, not one per channel."""
    table = quant_of(node)
    for t in (node.inputs[0], node.outputs[0]):
        q = table.get(t)
        if q.per_channel or any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in (q.scale, q.zerop)):
            return False
    for key, c in node.constants.items():
        if c.betensor.numel() > 1 and not (key == "lut" and c.betensor.dim() == 1):
            return False
    return not any(isinstance(v, (list, tuple)) and len(v) > 1 for v in node.params.values())


def _code_table(node: PyNode, method: str, x: torch.Tensor, zp_in: int) -> Optional[Tuple[int, int, torch.Tensor]]:
    """(qmin, qmax, table) of an element-wise integer activation: table[(x - qmin) * C + c] (C = 1 when every
    channel maps alike) is the output of input code x in channel c of the last axis, computed once by the method's
    own integer forward on every code (docs/performance.md, "Small models"); None where the method is not
    element-wise per channel (CRELU, slopes varying along other axes) or the input range is too wide."""
    q_in = quant_of(node).get(node.inputs[0])
    if method == "CRELU" or x.dim() < 2 or q_in.qmin is None or q_in.qmax is None:
        return None
    qmin, qmax = int(q_in.qmin), int(q_in.qmax)
    channels = int(x.shape[-1])
    if not 0 < qmax - qmin + 1 <= TABLE_MAX_CODES or channels < 1:
        return None
    if method == "PRELU":  # slopes that do not broadcast to this input take the general path (and its error)
        shape = tuple(node.get_constant("negative_slope").betensor.shape)
        if len(shape) > x.dim() or any(s not in (1, d) for s, d in zip(reversed(shape), reversed(x.shape))):
            return None

    alike = _channels_alike(node)
    if not alike and (qmax - qmin + 1) * channels > TABLE_MAX_ENTRIES:
        return None

    def build() -> Optional[Tuple[int, int, torch.Tensor]]:
        if alike:  # one column of codes: every channel maps alike (16-bit codes times hundreds of channels took
            # seconds per layer and forward to tabulate)
            codes = torch.arange(qmin, qmax + 1, dtype=torch.int64, device=x.device)
            probe = codes.reshape([-1] + [1] * (x.dim() - 1))
            y = _integer_forward(node, method, probe, zp_in)
            if tuple(y.shape) != tuple(probe.shape) or y.dtype != torch.int64:
                return None
            return qmin, qmax, y.reshape(-1).contiguous()
        slope = None
        if method == "PRELU":  # the Parser repeats per-channel slopes over the spatial axes: one row serves all
            slope = node.get_constant("negative_slope").betensor
            if slope.dim() > x.dim() or (slope.dim() and int(slope.shape[-1]) not in (1, channels)):
                return None
            rows = slope.reshape(-1, int(slope.shape[-1]) if slope.dim() else 1)
            if not bool((rows == rows[:1]).all()):
                return None
            slope = rows[0]
        codes = torch.arange(qmin, qmax + 1, dtype=torch.int64, device=x.device)
        probe = codes.reshape([-1] + [1] * (x.dim() - 1)).expand([-1] + [1] * (x.dim() - 2) + [channels])
        if slope is not None:
            y = _int_slope(node, method, probe.contiguous(), zp_in, slope)
        else:
            y = _integer_forward(node, method, probe.contiguous(), zp_in)
        if tuple(y.shape) != tuple(probe.shape) or y.dtype != torch.int64:
            return None
        y = y.reshape(-1, channels)
        if bool((y == y[:, :1]).all()):
            return qmin, qmax, y[:, 0].contiguous()
        return qmin, qmax, y.reshape(-1).contiguous()

    return memo(node, "activation_table", (layer_key(node), x.dim(), channels, x.device), build)


def activation_integer_forward(node: PyNode) -> torch.Tensor:
    """Integer forward of a quantized activation layer (int64 in [qmin, qmax]); element-wise methods on inputs of
    at most `TABLE_MAX_CODES` codes read a table of their own results (`_code_table`), exactly the same values."""
    method = activation_method(node)
    x, zp_in = int_input(node)
    table = _code_table(node, method, x, zp_in)
    if table is not None:
        qmin, qmax, values = table
        channels = 1 if values.numel() == qmax - qmin + 1 else int(x.shape[-1])  # else one table per channel
        y = take_codes(values, x, qmin, channels)
        if y is not None:
            return y
    return _integer_forward(node, method, x, zp_in)


def _integer_forward(node: PyNode, method: str, x: torch.Tensor, zp_in: int) -> torch.Tensor:
    if method == "NONE":
        qmin, qmax = out_range(node, node.outputs[0])
        return torch.clamp(x, qmin, qmax)
    if method in LINEAR_METHODS:
        return _int_linear(node, method, x, zp_in)
    if method == "CRELU":
        return _int_crelu(node, x, zp_in)
    if method in SLOPE_METHODS:
        return _int_slope(node, method, x, zp_in)
    return _int_lut(node, x)


WIDE_METHODS = ("CLIP", "RELU6", "LEAKYRELU", "PRELU")
"""Methods whose float forward keeps a float64 input's type (see `activation_forward`)."""


@ACTIVATION.forward
@RELU_RELU6.forward
@CLIP.forward
@LEAKYRELU_PRELU.forward
@HARD_LUT.forward
@INDEX_LUT.forward
@MODE_LUT.forward
@SHRINK.forward
@THRESHOLDEDRELU.forward
@BNLL.forward
@CRELU.forward
@keeps_float64(when=lambda node: activation_method(node) in WIDE_METHODS)
def activation_forward(self: PyNode) -> None:
    """Integer or float forward of every method. CLIP, RELU6, LEAKYRELU and PRELU compute in their input's float
    type, as upstream's do: on the float64 result of a convolution they read it unrounded and keep theirs
    (`keeps_float64`); every other method reads the rounded value."""
    if self.quantized:
        self.outputs[0].betensor = activation_integer_forward(self)
        return
    method = activation_method(self)
    self.outputs[0].betensor = ACTIVATION_METHODS[method](self, self.inputs[0].betensor)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def integer_clamp_bounds(node: PyNode, method: str) -> Tuple[int, int]:
    """[lo, hi] the integer forward clamps an integer (qinvariant) input to, for RELU, RELU6 and CLIP: the output
    type's range (the rescale is 1), cut by the method's bounds as codes of scale 1."""
    lo, hi = out_range(node, node.outputs[0])
    if method in ("RELU", "RELU6"):
        lo = max(lo, 0)
    if method == "RELU6":
        hi = min(hi, _quantized_bound(node, 6.0))
    if method == "CLIP":
        lo = max(lo, _quantized_bound(node, _number(node, "clip_min")))
        hi = min(hi, _quantized_bound(node, _number(node, "clip_max")))
    return int(lo), int(hi)


def _export_integer_clamp(g: QDQGraph, node: PyNode, method: str, perm: Any) -> None:
    """RELU/RELU6/CLIP of integers (input and output qinvariant): one integer Clip of the input's values."""
    x, y = node.inputs[0], node.outputs[0]
    if x.dtype not in ONNX_INT_TYPES or y.dtype != x.dtype:
        raise node_error(node, f"integer {method} from {x.dtype} to {y.dtype} has no QDQ mapping")
    lo, hi = integer_clamp_bounds(node, method)
    np_type = ONNX_INT_TYPES[x.dtype][1]
    bounds = [g.const(f"{node.name}/{k}", np.array(v, dtype=np_type)) for k, v in (("min", lo), ("max", hi))]
    g.set_int(y, g.add("Clip", [g.int_value(x, perm), *bounds]), perm)


@ACTIVATION.export
@RELU_RELU6.export
@CLIP.export
@LEAKYRELU_PRELU.export
@HARD_LUT.export
@INDEX_LUT.export
@MODE_LUT.export
@SHRINK.export
@THRESHOLDEDRELU.export
@BNLL.export
@CRELU.export
def convert_activation(g: QDQGraph, node: PyNode) -> None:
    """The float op; requantizing methods are scaled by the multiplier's rounding first (RELU/RELU6/CLIP clamp
    on the output grid) or afterwards (the slope methods)."""
    method = activation_method(node)
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if method == "NONE":
        if not same_qparams(node, x, y):
            raise node_error(node, "method NONE with different input and output quantization")
        g.set_int(y, g.int_value(x, perm), perm)
        return
    if method not in ACTIVATIONS:
        raise node_error(node, f"activation method {method} has no QDQ mapping")
    if method in LINEAR_METHODS and params(node, x).qinvariant and params(node, y).qinvariant:
        _export_integer_clamp(g, node, method, perm)
        return
    if onnx_exact.try_table(g, node, perm):
        return
    if method == "PRELU" and exact_prelu(g, node, perm):
        return
    if method == "CRELU" and onnx_exact.crelu(g, node, perm, crelu_axis(node, perm)):
        return
    value = g.float_value(x, perm)
    factor = requant_factor(node, tensor_scale(node, x)) if method in REQUANT_METHODS else 1.0
    if method in ("RELU", "RELU6", "CLIP"):
        value = g.rescale(value, factor)
    value = ACTIVATIONS[method](g, node, value, perm)
    if method in ("LEAKYRELU", "PRELU"):
        slopes = prelu_slope(node) if method == "PRELU" else np.array([leakyrelu_slope(node)])
        value = slope_rounding(g, node, value, slopes)
    if method in ("LEAKYRELU", "PRELU", "CRELU"):
        value = g.rescale(value, factor)
    g.quantize(y, value, perm, exact=method not in REQUANT_METHODS)
