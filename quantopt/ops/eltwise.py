"""Element-wise binary ops: `Eltwise` (ADD/SUB/MUL/MAX/MIN) and the standalone Add, Sub, Mul, all with numpy
broadcasting (e.g. squeeze-excite [N,H,W,C] * [N,1,1,C]) and an optional fused `with_activation`."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

import torch

from ..config.layer_settings import LayerSettings
from ..config.upstream_defects import EQUAL_SCALE_PASSTHROUGH
from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_INFO, OPT_WARN
from ..quant.dtype import Dtype
from ..quant.hardware import ELTWISE_INPUT_MULTIPLIER_MAX
from ..quant.requant import (
    broadcasts_into,
    eltwise_multipliers,
    eltwise_multipliers_n,
    int64_to_float64,
    requantize_float64_,
    requantize_int,
    scale_shift,
)
from ..quant.rounding import FLOAT64_EXACT, INT64_SAFE, MAGIC_EXACT
from ..registry import declare_op
from ..registry.schema import Float, Param, Text, Value
from ._eltwise_int import (
    INT64_PRODUCT_LIMIT,
    activation_clamp,
    check_int64_bound,
    offset_absmax,
    offset_value,
    set_integer_output,
)
from ._quant import (
    check_fused_activation_quantizable,
    check_quantized_inputs,
    fused_activation,
    fused_output_signed,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    params,
    quant_of,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import FUSED_ACTIVATIONS, apply_fused_activation, broadcast_shape
from .onnx_build import exact as onnx_exact
from .onnx_build.float_forms import requant_factor
from .onnx_build.mac import qdq_fused_activation
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import QDQGraph, node_error

ELTWISE_METHODS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ADD": torch.add,
    "SUB": torch.sub,
    "MUL": torch.mul,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
}
# Methods whose result does not depend on how more than two inputs are grouped.
NARY_METHODS = ("ADD", "MAX", "MIN")
STANDALONE_METHODS: Dict[str, str] = {"Add": "ADD", "Sub": "SUB", "Mul": "MUL"}

_FUSED_PARAMS = {
    "with_activation": Param(Text(choices=FUSED_ACTIVATIONS), "the fused activation", default="NONE"),
    "clip_min": Param(Float(infinite=True), "lower bound of a fused CLIP"),
    "clip_max": Param(Float(infinite=True), "upper bound of a fused CLIP"),
    "negative_slope": Param(Float(), "slope of a fused LEAKYRELU (a PRELU's slopes are a constant of this name)"),
    "negative_slope_value": Param(Float(), "slope of a fused LEAKYRELU when `negative_slope` is absent "
                                           "(default 0.01)"),
}
_PER_CHANNEL_CONSTANTS = {
    "input_scale": "per-channel input multipliers, uint16 [inputs, C], written when quantized per channel",
    "scale": "per-channel output multipliers, uint16 [C], written when quantized per channel",
    "shift": "per-channel output shifts, int8 [C], written when quantized per channel",
}
_ELTWISE_INTEGER = "inputs aligned with 15-bit multipliers, exact int64 op, output multiplier and shift"
_ELTWISE_SEMANTICS = "integer-semantics.md#eltwise-addsubmaxmin-add-sub"

ELTWISE = declare_op(
    "Eltwise",
    params={"method": Param(Text(choices=tuple(ELTWISE_METHODS)), "the element-wise operation", required=True),
            **_FUSED_PARAMS},
    constants=_PER_CHANNEL_CONSTANTS, summary="Numpy broadcasting", integer=_ELTWISE_INTEGER,
    semantics=_ELTWISE_SEMANTICS)
ADD_SUB = declare_op(
    ["Add", "Sub"],
    params={"method": Param(Value(), "not read: the type is the method"), **_FUSED_PARAMS},
    constants=_PER_CHANNEL_CONSTANTS, summary="Numpy broadcasting", integer=_ELTWISE_INTEGER,
    semantics=_ELTWISE_SEMANTICS)
MUL = declare_op(
    "Mul",
    params={"method": Param(Value(), "not read: the type is the method"), **_FUSED_PARAMS},
    constants=_PER_CHANNEL_CONSTANTS, summary="Numpy broadcasting",
    integer="(a + zp_a)(b + zp_b) exact, one multiplier and shift", semantics="integer-semantics.md#eltwise-mul-mul")


def eltwise_method(node: PyNode) -> str:
    """`method` of an Eltwise layer, or the one fixed by a standalone Add/Sub/Mul."""
    if str(node.type) in STANDALONE_METHODS:
        return STANDALONE_METHODS[str(node.type)]
    method = str(node.get_param("method")).upper()
    if method not in ELTWISE_METHODS:
        raise node._error(f"unsupported Eltwise method '{method}' (supported: {', '.join(ELTWISE_METHODS)})")
    return method


def _check_inputs(node: PyNode, method: str, xs: List[torch.Tensor]) -> None:
    """Input count and broadcast compatibility, reported with the layer name instead of a torch error."""
    if len(xs) < 2 or (len(xs) > 2 and method not in NARY_METHODS):
        wanted = "at least 2" if method in NARY_METHODS else "exactly 2"
        raise node._error(f"{method} needs {wanted} inputs, got {len(xs)}")
    try:
        broadcast_shape([tuple(x.shape) for x in xs])
    except ValueError:
        raise node._error(f"input shapes {[list(x.shape) for x in xs]} do not broadcast") from None
    if method == "SUB" and any(x.dtype == torch.bool for x in xs):  # torch has no bool subtraction
        bools = [t.name for t, x in zip(node.inputs, xs) if x.dtype == torch.bool]
        raise node._error(f"SUB of bool input(s) {bools}: subtraction takes numbers (a Cast to a number type "
                          "first)")


@ELTWISE.forward
@ADD_SUB.forward
@MUL.forward
def eltwise_forward(self: PyNode) -> None:
    method = eltwise_method(self)
    if self.quantized:
        self.outputs[0].betensor = eltwise_int_forward(self, method)
        return
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, method, xs)
    y = functools.reduce(ELTWISE_METHODS[method], xs)
    self.outputs[0].betensor = apply_fused_activation(self, y)


# ------------------------------------------------------------------------------------------------ quantization
EQUAL_SCALE_THRESHOLD = 1.0
"""Input scales count as equal (the `[M, 1, 1]` form) only when max/min <= this and the zero points match:
upstream's default `unify_scales_for_multi_inputs_operator_threshold`."""


def _output_signed(node: PyNode, method: str) -> bool:
    """Signed if any input is signed or the method is SUB; a fused activation decides instead when present."""
    if fused_activation(node) != "NONE":
        return fused_output_signed(node)
    return any(is_signed(node, t) for t in node.inputs) or method == "SUB"


def _check_quantizable(node: PyNode, method: str) -> None:
    if len(node.inputs) < 2 or (len(node.inputs) > 2 and method not in NARY_METHODS):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): quantized {method} with {len(node.inputs)} "
                               f"inputs is not supported ({method} takes exactly two; ADD, MAX and MIN take two or "
                               "more); split it into a chain of two-input layers")
    check_fused_activation_quantizable(node)
    check_quantized_inputs(node, node.inputs)


@ELTWISE.quantize
@ADD_SUB.quantize
@MUL.quantize
def eltwise_quantize(self: PyNode) -> None:
    """Output params from the calibrated output range, then the integer multipliers (docs/integer-semantics.md).

    ADD/SUB/MAX/MIN: both inputs are aligned to a common scale by cross-multiplying with 15-bit approximations
    of the other input's scale, and the output ratio s_out / (s0 * s1 * 2^N) becomes M_out / 2^shift
    (`scale_value=[M_out, M_in0, M_in1]`). MUL: one ratio s_out / (s0 * s1) as `scale_value`/`shift_value`.
    Two integer (qinvariant) inputs give an integer output of scale 1 and multipliers that are all 1.
    """
    method = eltwise_method(self)
    _check_quantizable(self, method)
    out = self.outputs[0]
    s = layer_settings(self)
    signed = _output_signed(self, method)
    table = quant_of(self)
    q_in = [table.get(t) for t in self.inputs]
    if all(q.qinvariant for q in q_in):
        set_integer_output(self, out, signed, [q.qbits or 8 for q in q_in])
    else:
        if any(q.qinvariant for q in q_in):
            OPT_WARN(f"layer '{self.name}' ({self.type}): one input is an integer (scale 1) and another is "
                     "quantized; the integer input is treated as a tensor of scale 1, which may cost accuracy")
        quantize_activation(self, out, signed, per_channel_ok=True)
    for key in ("scale_value", "shift_value", "scale_type", "shift_type"):
        self.params.pop(key, None)
    for key in PER_CHANNEL_CONSTANTS:
        self.constants.pop(key, None)
    if any(table.get(t).per_channel for t in list(self.inputs) + [out]):
        _store_per_channel(self, method, s)
        return
    if len(self.inputs) > 2:
        _store_n_ary(self, s)
        return
    a, b = self.inputs
    s0, s1, s_out = tensor_scale(self, a), tensor_scale(self, b), tensor_scale(self, out)
    if method == "MUL":
        ratio = torch.tensor(s_out, dtype=torch.float32) / (torch.tensor(s0, dtype=torch.float32) *
                                                            torch.tensor(s1, dtype=torch.float32))
        store_requant(self, *requant_scale_shift(self, ratio))
        return
    # SUB/MAX/MIN use ADD's multipliers: the op runs on the aligned integers, so the output ratio is the same
    # (upstream writes M=1, shift=0 for them in the equal-scale form, which ignores the output scale; only
    # `upstream_defects = eltwise_equal_scale_passthrough` writes that).
    form = method if EQUAL_SCALE_PASSTHROUGH in s.upstream_defects else "ADD"
    r = eltwise_multipliers(s0, s1, s_out, int(table.get(out).qbits), zp0=tensor_zp(self, a), zp1=tensor_zp(self, b),
                            method=form, unify_threshold=EQUAL_SCALE_THRESHOLD,
                            force_shift_positive=s.force_shift_positive)
    self.params["scale_value"] = [int(v) for v in r.scale_value]
    self.params["shift_value"] = int(r.shift_value)
    self.params["scale_type"] = list(r.scale_type)
    self.params["shift_type"] = r.shift_type


PER_CHANNEL_CONSTANTS = ("input_scale", "scale", "shift")
"""Constants of an Eltwise with per-channel scales: `input_scale` uint16 [K, C] (ADD/SUB/MAX/MIN), `scale` uint16
[C] and `shift` int8 [C], the output multiplier and shift of every channel."""


def _channel_scales(node: PyNode, t, channels: int) -> torch.Tensor:
    q = params(node, t)
    if q.per_channel:  # on the CPU, where the multipliers are derived (the same on every device)
        return q.scale.cpu().to(torch.float32).reshape(-1)
    return torch.full((channels,), tensor_scale(node, t), dtype=torch.float32)


def _store_per_channel(node: PyNode, method: str, s: LayerSettings) -> None:
    """Inputs or output quantized per channel (last axis): the N-input alignment of `eltwise_multipliers_n` made
    channel by channel (ADD/SUB/MAX/MIN: M_i[c] = round_half_even(2^P[c] · s_max[c] / s_i[c]), the output ratio
    s_out[c] / (s_max[c] · 2^P[c])); MUL: s_out[c] / (s_a[c] · s_b[c]). One multiplier and shift per channel."""
    out = node.outputs[0]
    channels = int(out.ir_shape[-1])
    if any(int(t.ir_shape[-1]) != channels for t in node.inputs):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel scales need every input to have the "
                               f"output's {channels} channels (no broadcasting along the channel axis)")
    scales = torch.stack([_channel_scales(node, t, channels) for t in node.inputs])  # [K, C]
    s_out = _channel_scales(node, out, channels)
    if method == "MUL":
        ratio = s_out / (scales[0] * scales[1])
    else:
        top = scales.max(dim=0).values
        # a channel whose input scales lie more than 32767 times apart (a nearly constant channel of one branch
        # beside a wide one) aligns to 32767 times the coarsest scale instead of the finest: the finer inputs'
        # whole range is then below 1/128 of the coarsest input's step, and their multiplier rounds (at least 1)
        cap = scales.min(dim=0).values * ELTWISE_INPUT_MULTIPLIER_MAX
        capped = top > cap
        if bool(capped.any()):
            OPT_INFO(f"layer '{node.name}' ({node.type}): in {int(capped.sum())} channel(s) the input scales lie "
                     f"more than {ELTWISE_INPUT_MULTIPLIER_MAX} times apart; the inputs align to "
                     f"{ELTWISE_INPUT_MULTIPLIER_MAX} times the coarsest scale there")
            top = torch.minimum(top, cap)
        ratios = top / scales
        # (at least 0: a capped channel's coarsest ratio may round a hair above 32767 in float32)
        power = torch.clamp(torch.floor(torch.log2(ELTWISE_INPUT_MULTIPLIER_MAX / ratios.max(dim=0).values)), min=0)
        muls = torch.clamp(torch.round(ratios * torch.pow(2.0, power)), 1, ELTWISE_INPUT_MULTIPLIER_MAX)
        set_constant(node, "input_scale", muls.to(torch.int64), Dtype.UINT16)
        ratio = s_out / (top * torch.pow(2.0, power))
    mult, shift, _, _ = scale_shift(ratio.to(torch.float32), 15, force_shift_positive=s.force_shift_positive)
    set_constant(node, "scale", torch.as_tensor(mult, dtype=torch.int64).reshape(-1), Dtype.UINT16)
    set_constant(node, "shift", torch.as_tensor(shift, dtype=torch.int64).reshape(-1), Dtype.INT8)


def _per_channel_int_forward(node: PyNode, method: str, qmin: int, qmax: int) -> torch.Tensor:
    """acc = op over i of (x_i + zp_i) · input_scale[i] (MUL: the product), y = requant(acc, scale, shift) per
    channel of the last axis, fused bounds."""
    xs = [int_value(t) + tensor_zp(node, t) for t in node.inputs]
    _check_inputs(node, method, xs)
    mult = node.get_constant("scale").betensor.to(torch.int64).reshape(-1)
    shift = node.get_constant("shift").betensor.to(torch.int64).reshape(-1)
    if method == "MUL":
        check_int64_bound(node, offset_absmax(node, node.inputs[0]) * offset_absmax(node, node.inputs[1]) *
                          int(mult.max()), "product (a + zp_a)(b + zp_b) * M")
        acc = xs[0] * xs[1]
    else:
        muls = node.get_constant("input_scale").betensor.to(torch.int64).reshape(len(xs), -1)
        check_int64_bound(node, sum(offset_absmax(node, t) * int(m.max()) for t, m in zip(node.inputs, muls)) *
                          int(mult.max()), "aligned sum times M_out")
        acc = xs[0] * muls[0]
        for x, m in zip(xs[1:], muls[1:]):
            acc = INT_METHODS[method](acc, x * m)
    y = requantize_int(acc, mult, shift, tensor_zp(node, node.outputs[0]), qmin, qmax)
    return activation_clamp(node, y)


def _store_n_ary(node: PyNode, s: LayerSettings) -> None:
    """ADD/MAX/MIN of three or more inputs: `eltwise_multipliers_n` (every input aligned to the finest grid)."""
    out = node.outputs[0]
    try:
        r = eltwise_multipliers_n([tensor_scale(node, t) for t in node.inputs], tensor_scale(node, out),
                                  int(params(node, out).qbits), [tensor_zp(node, t) for t in node.inputs],
                                  unify_threshold=EQUAL_SCALE_THRESHOLD, force_shift_positive=s.force_shift_positive)
    except ValueError as e:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {e}; quantize the inputs more alike") from None
    node.params["scale_value"] = [int(v) for v in r.scale_value]
    node.params["shift_value"] = int(r.shift_value)
    node.params["scale_type"] = list(r.scale_type)
    node.params["shift_type"] = r.shift_type


# ------------------------------------------------------------------------------------------------ integer forward
INT_METHODS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ADD": torch.add, "SUB": torch.sub, "MAX": torch.maximum, "MIN": torch.minimum}


def _int_list(node: PyNode, key: str, count: int) -> List[int]:
    value = node.params.get(key)
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise node._error(f"quantized layer needs '{key}' as a list of {count} integers, got {value!r}")
    return [int(v) for v in value]


def eltwise_int_forward(node: PyNode, method: str) -> torch.Tensor:
    """Integer forward from the IR only (docs/integer-semantics.md), exact in int64.

    ADD/SUB/MAX/MIN: acc = op((a + zp_a) * M_in0, (b + zp_b) * M_in1); MUL: acc = (a + zp_a) * (b + zp_b);
    y = clamp(round_half_even(acc * M_out * 2^-shift) - zp_out, qmin, qmax), then the fused activation bound.
    """
    _check_quantizable(node, method)
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    if "scale" in node.constants:
        return _per_channel_int_forward(node, method, qmin, qmax)
    if len(node.inputs) > 2:
        return _n_ary_int_forward(node, method, qmin, qmax)
    a_t, b_t = node.inputs
    ea, eb = offset_absmax(node, a_t), offset_absmax(node, b_t)
    if method == "MUL":
        m_out, shift = requant_of(node)
        if not isinstance(m_out, int):
            raise node._error("quantized Mul needs a per-tensor scale_value/shift_value")
        m0 = m1 = 1
        bound = ea * eb * max(1, abs(m_out))
        plain = abs(m_out) == 1 and shift == 0  # an integer product passed through: two int32 values fit int64
        check_int64_bound(node, bound, "product (a + zp_a)(b + zp_b) * M",
                          INT64_PRODUCT_LIMIT if plain else INT64_SAFE)
    else:
        m_out, m0, m1 = _int_list(node, "scale_value", 3)
        if "shift_value" not in node.params:
            raise node._error("quantized layer lacks 'shift_value'")
        shift = int(node.params["shift_value"])
        bound = (ea * abs(m0) + eb * abs(m1)) * max(1, abs(m_out))
        check_int64_bound(node, bound, "aligned sum times M_out")
    # every intermediate is an integer below `bound`: float64 holds them exactly below 2^53 (the usual case, and
    # much faster than int64 arithmetic), int64 otherwise; the results are the same integers
    exact_float = bound < FLOAT64_EXACT and abs(shift) < 900
    zp_out = tensor_zp(node, out)
    if exact_float and _bandable(node, a_t, b_t):
        return _eltwise_in_bands(node, method, a_t, b_t, (m0, m1, m_out, shift, zp_out, qmin, qmax))
    dtype = torch.float64 if exact_float else torch.int64
    a = offset_value(node, a_t, dtype)
    b = offset_value(node, b_t, dtype)
    _check_inputs(node, method, [a, b])
    return _combine_requantize(node, method, a, b, (m0, m1, m_out, shift, zp_out, qmin, qmax))


def _combine_requantize(node: PyNode, method: str, a: torch.Tensor, b: torch.Tensor, q: tuple) -> torch.Tensor:
    """The combined, requantized and clamped integers of the offset inputs `a` and `b` (new tensors of the caller's,
    float64 where every intermediate is proven exact, else int64; `q` = (m0, m1, m_out, shift, zp_out, qmin, qmax))."""
    m0, m1, m_out, shift, zp_out, qmin, qmax = q
    if method == "MUL":  # a and b are new tensors (offset_value): the product goes into the one of the result's shape
        if broadcasts_into(b.shape, a.shape):
            acc = a.mul_(b)
        elif broadcasts_into(a.shape, b.shape):
            acc = b.mul_(a)
        else:
            acc = a * b
    elif method in ("ADD", "SUB"):  # exact integers (bounded above): a·m0 ± b·m1 in two passes, a being a new tensor
        a = a.mul_(m0) if m0 != 1 else a
        if broadcasts_into(b.shape, a.shape):  # the same kernel, written into a
            acc = a.add_(b, alpha=m1) if method == "ADD" else a.sub_(b, alpha=m1)
        else:
            acc = INT_METHODS[method](a, b, alpha=m1)
    else:  # MAX/MIN of the aligned inputs, both new tensors (offset_value): scaled and compared in place
        a = a.mul_(m0) if m0 != 1 else a
        b = b.mul_(m1) if m1 != 1 else b
        if broadcasts_into(b.shape, a.shape):
            acc = INT_METHODS[method](a, b, out=a)
        elif broadcasts_into(a.shape, b.shape):
            acc = INT_METHODS[method](a, b, out=b)
        else:
            acc = INT_METHODS[method](a, b)
    if acc.is_floating_point():  # acc is a new tensor of this function's: requantized in place
        y = requantize_float64_(acc, m_out, shift, zp_out, qmin, qmax)
    else:
        y = requantize_int(acc, m_out, shift, zp_out, qmin, qmax)
    return activation_clamp(node, y)


ELTWISE_BAND_ELEMENTS = 1 << 16
"""Output elements a two-input integer Eltwise of same-shaped large inputs computes at once (`_eltwise_in_bands`)."""


def _bandable(node: PyNode, a_t: PyTensor, b_t: PyTensor) -> bool:
    """Whether both inputs are contiguous int64 CPU tensors of the output's shape, larger than two bands, with
    scalar zero points: then `_eltwise_in_bands` gives the whole tensor's integers."""
    a, b = a_t.betensor, b_t.betensor
    return (a.shape == b.shape and a.numel() > 2 * ELTWISE_BAND_ELEMENTS and a.dtype == b.dtype == torch.int64
            and a.device.type == b.device.type == "cpu" and a.is_contiguous() and b.is_contiguous()
            and all(isinstance(tensor_zp(node, t), int) for t in (a_t, b_t))
            and all(offset_absmax(node, t) < MAGIC_EXACT for t in (a_t, b_t)))


def _eltwise_in_bands(node: PyNode, method: str, a_t: PyTensor, b_t: PyTensor, q: tuple) -> torch.Tensor:
    """`_combine_requantize` of the float64 offset inputs, a band of elements at a time into one int64 output:
    every step is element-wise, so the integers are the whole tensor's; the bands' float64 copies stay in the
    cache instead of two map-sized ones page-faulting on every forward (a detector's 1x160x160x96 residual Add)."""
    xa, xb = a_t.betensor.reshape(-1), b_t.betensor.reshape(-1)
    zp_a, zp_b = tensor_zp(node, a_t), tensor_zp(node, b_t)
    n = int(xa.numel())
    out = torch.empty(n, dtype=torch.int64)
    for s0 in range(0, n, ELTWISE_BAND_ELEMENTS):
        s1 = min(n, s0 + ELTWISE_BAND_ELEMENTS)
        out[s0:s1] = _combine_requantize(node, method, int64_to_float64(xa[s0:s1], zp_a),
                                         int64_to_float64(xb[s0:s1], zp_b), q)
    return out.reshape(a_t.betensor.shape)


def _n_ary_int_forward(node: PyNode, method: str, qmin: int, qmax: int) -> torch.Tensor:
    """acc = op over i of (x_i + zp_i) * M_i (sum, max or min), y = requant(acc, M_out, shift), fused bounds."""
    count = len(node.inputs)
    m_out, *muls = _int_list(node, "scale_value", count + 1)
    if "shift_value" not in node.params:
        raise node._error("quantized layer lacks 'shift_value'")
    shift = int(node.params["shift_value"])
    xs = [int_value(t) + tensor_zp(node, t) for t in node.inputs]
    _check_inputs(node, method, xs)
    check_int64_bound(node, sum(offset_absmax(node, t) * abs(m) for t, m in zip(node.inputs, muls)) * abs(m_out),
                      "aligned sum times M_out")
    acc = xs[0] * muls[0]
    for x, m in zip(xs[1:], muls[1:]):
        acc = INT_METHODS[method](acc, x * m)
    y = requantize_int(acc, m_out, shift, tensor_zp(node, node.outputs[0]), qmin, qmax)
    return activation_clamp(node, y)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
ELTWISE_OPS = {"ADD": "Add", "SUB": "Sub", "MUL": "Mul", "MAX": "Max", "MIN": "Min"}


@ELTWISE.export
@ADD_SUB.export
@MUL.export
def convert_eltwise(g: QDQGraph, node: PyNode) -> None:
    """Both inputs in one layout (numpy broadcasting is preserved when ranks are equal), then the fused
    activation."""
    method = eltwise_method(node)
    if method not in ELTWISE_OPS:
        raise node_error(node, f"Eltwise method {method} has no QDQ mapping")
    ranks = {g.rank(t) for t in node.inputs}
    rank = g.rank(node.outputs[0])
    perm = g.common_perm(node.inputs, rank, prefer=channels_first(rank)) if ranks == {rank} else tuple(range(rank))
    if onnx_exact.eltwise(g, node, method, perm if ranks == {rank} else None):
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
            s_in = tensor_scale(node, node.inputs[0]) * tensor_scale(node, node.inputs[1])
            out = g.rescale(out, requant_factor(node, s_in))
    else:
        # y = ((a + zp_a) M_a + (b + zp_b) M_b) M_out 2^-N: each input carries its own multiplier
        m_out, m_a, m_b = (float(v) for v in node.get_param("scale_value"))
        common = m_out * 2.0 ** -float(node.get_param("shift_value")) / tensor_scale(node, y)
        a, b = (g.rescale(v, m * common * tensor_scale(node, t), f"requant{i}")
                for i, (v, m, t) in enumerate(zip(values, (m_a, m_b), node.inputs)))
        out = g.add(ELTWISE_OPS[method], [a, b])
    g.quantize(y, qdq_fused_activation(g, node, out), perm)
