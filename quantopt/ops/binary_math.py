"""Element-wise binary and logic operators with numpy broadcasting: Div, Pow, Mod, DivMod, SquaredDifference,
Where, Logical, Bitwise, BitShift.

Quantized (docs/semantics/binary.md): comparisons align both inputs on a common scale with the integer multipliers
of Eltwise ADD and compare exactly, giving a 0/1 integer tensor; Where requantizes both value branches to the
output; Div multiplies the dividend by a reciprocal table of the divisor; Pow with a constant exponent is a lookup
table; SquaredDifference squares the aligned difference; Mod takes the remainder of the aligned integers;
Bitwise, BitShift and DivMod run on integer (scale 1) tensors only.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config.upstream_defects import WHERE_INTEGER_PASSTHROUGH
from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS, INT_INPUT_MAX_BITS, WIDE_SHIFT_MAX
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import dequantize
from ..quant.requant import eltwise_multipliers, range_dtype, requantize_int, scale_shift
from ..quant.rounding import FLOAT64_EXACT, bit_length, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Float, Int, Param, Text, Value, quantized
from ._eltwise_int import check_int64_bound, offset_absmax, set_integer_output
from ._lut_int import CODE_TABLE_MAX_CODES, constants_first, is_restricted, range_bits, take_codes
from ._quant import (
    check_quantized_inputs,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param, broadcast_shape, keeps_float64
from .onnx_build import exact as onnx_exact
from .onnx_build.exact import DOUBLE, codes, double, emit_integers, fits_double, shared_perm
from .onnx_build.float_forms import requant_factor, unary_perm
from .onnx_build.perms import Perm, channels_first
from .onnx_build.qdq_graph import QDQGraph, node_error

_BINARY = "docs/semantics/binary.md"

DIV_RECIPROCAL_EXTRA_BITS = 15
"""Div: the reciprocal table holds round(2^P / i) with P = log2(table length) + 15, so even its smallest entries
(i near the table length) keep 15 significant bits."""

SQD_DIFF_BITS = 23
"""SquaredDifference: the aligned difference is rounded to at most 23 magnitude bits before squaring, so that the
square (<= 2^46) times a 15-bit multiplier stays below 2^62."""

LOGICAL_COMPARISONS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "EQUAL": torch.eq, "NOT_EQUAL": torch.ne, "GREATER": torch.gt, "GREATER_EQUAL": torch.ge,
    "LESS": torch.lt, "LESS_EQUAL": torch.le,
}
LOGICAL_BOOLEAN: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "AND": torch.logical_and, "OR": torch.logical_or, "XOR": torch.logical_xor,
}
LOGICAL_METHODS = tuple(LOGICAL_COMPARISONS) + tuple(LOGICAL_BOOLEAN) + ("NOT",)
BITWISE_METHODS: Dict[str, Callable[..., torch.Tensor]] = {
    "AND": torch.bitwise_and, "OR": torch.bitwise_or, "XOR": torch.bitwise_xor, "NOT": torch.bitwise_not,
}
BITSHIFT_DIRECTIONS = ("LEFT", "RIGHT")
DIVMOD_MODES = ("FLOOR", "TRUNC")


# ------------------------------------------------------------------------------------------------ shared helpers
def _method(node: PyNode, key: str, allowed: Sequence[str]) -> str:
    value = str(node.get_param(key)).upper()
    if value not in allowed:
        raise node._error(f"unsupported {key} '{value}' (supported: {', '.join(allowed)})")
    return value


def _check_inputs(node: PyNode, count: int, xs: Sequence[torch.Tensor]) -> None:
    """Input count and broadcast compatibility, reported with the layer name instead of a torch error."""
    if len(xs) != count:
        raise node._error(f"expects {count} input(s), got {len(xs)}")
    try:
        broadcast_shape([tuple(x.shape) for x in xs])
    except ValueError:
        raise node._error(f"input shapes {[list(x.shape) for x in xs]} do not broadcast") from None


def _offset_int(node: PyNode, t: PyTensor) -> torch.Tensor:
    """q + zp as int64: the integer proportional to the float value (x = (q + zp) / scale)."""
    return int_value(t) + tensor_zp(node, t)


def _as_int(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x.to(torch.float64)).to(torch.int64) if x.is_floating_point() else x.to(torch.int64)


def _int_dtype(d: Dtype) -> bool:
    return not d.is_float and d is not Dtype.BOOL


def _wrap(v: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Two's-complement wrap into [qmin, qmax] (a 2^b-wide range): ((v - qmin) mod 2^b) + qmin."""
    return torch.remainder(v - qmin, qmax - qmin + 1) + qmin


def _f32_ratio(num: float, den: float) -> torch.Tensor:
    return torch.tensor(num, dtype=torch.float32) / torch.tensor(den, dtype=torch.float32)


def _pop_requant(node: PyNode) -> None:
    for key in ("scale_value", "shift_value", "scale_type", "shift_type"):
        node.params.pop(key, None)


def _int_list(node: PyNode, key: str, count: int) -> List[int]:
    value = node.params.get(key)
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise node._error(f"quantized layer needs '{key}' as a list of {count} integers, got {value!r}")
    return [int(v) for v in value]


def _align_multipliers(node: PyNode, a: PyTensor, b: PyTensor) -> Tuple[int, int]:
    """Integer multipliers (M_a, M_b) with (a + zp_a)·M_a and (b + zp_b)·M_b on one common scale: Eltwise ADD's
    cross-multiplied 15-bit input multipliers, or (1, 1) when the scales and zero points are equal."""
    int_a, int_b = quant_of(node).get(a).qinvariant, quant_of(node).get(b).qinvariant
    if int_a and int_b:
        return 1, 1
    if int_a != int_b:
        OPT_WARN(f"layer '{node.name}' ({node.type}): one input is an integer (scale 1) and the other is quantized; "
                 "the integer input is aligned as a tensor of scale 1")
    r = eltwise_multipliers(tensor_scale(node, a), tensor_scale(node, b), 1.0, AIFF_MULTIPLIER_BITS,
                            zp0=tensor_zp(node, a), zp1=tensor_zp(node, b), method="ADD", unify_threshold=1.0)
    m_a, m_b = int(r.scale_value[1]), int(r.scale_value[2])
    if m_a <= 0 or m_b <= 0:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the input scales {tensor_scale(node, a)} and "
                               f"{tensor_scale(node, b)} are too far apart to be aligned with 15-bit multipliers")
    return m_a, m_b


def _integer_output_dtype(node: PyNode) -> Dtype:
    """Dtype of an integer-only op's output: the float IR's top type when it is an integer type, else the first
    input's (quantized) dtype."""
    out = node.outputs[0]
    if _int_dtype(out.ir_dtype):
        return out.ir_dtype
    inp = node.inputs[0]
    return inp.dtype if _int_dtype(inp.dtype) else inp.ir_dtype


def _require_integer_inputs(node: PyNode) -> None:
    check_quantized_inputs(node, node.inputs)
    for t in node.inputs:
        if not quant_of(node).get(t).qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' is a quantized float tensor; "
                                   "this operator is only defined on integer tensors (scale 1, zero point 0)")


def _set_integer_dtype_output(node: PyNode, out: PyTensor, dtype: Dtype) -> None:
    if not _int_dtype(dtype):
        raise node._error(f"output dtype {dtype.value} is not an integer type")
    signed = dtype.is_signed or layer_settings(node).force_dtype_int
    set_qinvariant(node, out, min(dtype.bits, INT_INPUT_MAX_BITS), signed)


def _wrap_float_result(node: PyNode, y: torch.Tensor, index: int = 0) -> torch.Tensor:
    """Float forward of integer ops: wrap into the integer top type of the float IR when it has one."""
    d = node.outputs[index].ir_dtype
    if not _int_dtype(d):
        d = node.inputs[0].ir_dtype
    if not _int_dtype(d):
        return y
    lo, hi = d.int_range()
    return _wrap(y, lo, hi)


# ------------------------------------------------------------------------------------------------ Logical
LOGICAL = declare_op(
    "Logical",
    params={"method": Param(Text(choices=LOGICAL_METHODS), "the comparison or boolean operation (NOT: one input)",
                            required=True)},
    integer="exact comparison on Eltwise-aligned integers / nonzero tests → 0/1",
    dtypes="any → uint8 0/1 (scale 1)", semantics=f"{_BINARY}#logical")


@LOGICAL.forward
def logical_forward(self: PyNode) -> None:
    method = _method(self, "method", LOGICAL_METHODS)
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 1 if method == "NOT" else 2, xs)
    if self.quantized:
        self.outputs[0].betensor = _logical_int(self, method)
        return
    if method == "NOT":
        y = xs[0] == 0
    elif method in LOGICAL_BOOLEAN:
        y = LOGICAL_BOOLEAN[method](xs[0] != 0, xs[1] != 0)
    else:
        y = LOGICAL_COMPARISONS[method](xs[0], xs[1])
    self.outputs[0].betensor = y.to(torch.int64)


@LOGICAL.quantize
def logical_quantize(self: PyNode) -> None:
    """Output: a 0/1 integer tensor (uint8, int8 with force_dtype_int). Comparisons store the alignment
    multipliers `scale_value=[M_a, M_b]`; AND/OR/XOR/NOT need none (they test q + zp != 0)."""
    method = _method(self, "method", LOGICAL_METHODS)
    if len(self.inputs) != (1 if method == "NOT" else 2):
        raise self._error(f"{method} expects {1 if method == 'NOT' else 2} input(s), got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    _pop_requant(self)
    if method in LOGICAL_COMPARISONS:
        m_a, m_b = _comparison_multipliers(self, self.inputs[0], self.inputs[1])
        self.params["scale_value"] = [m_a, m_b]
        self.params["scale_type"] = [Dtype.UINT16, Dtype.UINT16]
    set_qinvariant(self, self.outputs[0], 8, layer_settings(self).force_dtype_int)


def _comparison_multipliers(node: PyNode, a: PyTensor, b: PyTensor) -> Tuple[int, int]:
    """Upstream's comparison multipliers: with r = s_big / s_small (the integer input's scale 1 counts as the big
    one when only one input is an integer), f = min(32767, min(r·8192, 32767) / r) (32767 / r as 32767 · (1 / r))
    and M_i = max(1, trunc(s_big / s_i · f)) in float32; (q + zp)·M_i then compare on one scale, to within the
    truncation of M_i."""
    int_a, int_b = quant_of(node).get(a).qinvariant, quant_of(node).get(b).qinvariant
    if int_a and int_b:
        return 1, 1
    sa, sb = (torch.tensor(float(tensor_scale(node, t)), dtype=torch.float32) for t in (a, b))
    if int_a != int_b:
        OPT_WARN(f"layer '{node.name}' ({node.type}): one input is an integer (scale 1) and the other is quantized; "
                 "the integer input is compared as a tensor of scale 1")
        big, small = (sa, sb) if int_a else (sb, sa)
    else:
        big, small = torch.maximum(sa, sb), torch.minimum(sa, sb)
    r = big / small
    wide = r * 8192
    # 32767 / r is taken as 32767 · (1 / r), two float32 roundings, as torch divides a number by a tensor upstream
    f = wide / r if float(wide) < 32767 else torch.reciprocal(r) * 32767
    f = torch.clamp(f, max=32767)
    return tuple(max(1, int(big / s * f)) for s in (sa, sb))


def _logical_int(node: PyNode, method: str) -> torch.Tensor:
    xs = [_offset_int(node, t) for t in node.inputs]
    if method == "NOT":
        y = xs[0] == 0
    elif method in LOGICAL_BOOLEAN:
        y = LOGICAL_BOOLEAN[method](xs[0] != 0, xs[1] != 0)
    else:
        m_a, m_b = _int_list(node, "scale_value", 2)
        y = LOGICAL_COMPARISONS[method](xs[0] * m_a, xs[1] * m_b)
    return y.to(torch.int64)


# ------------------------------------------------------------------------------------------------ Bitwise / BitShift
_INTEGER_DTYPES = "int8/uint8/int16/uint16/int32 → same (scale 1)"
BITWISE = declare_op(
    "Bitwise",
    params={"method": Param(Text(choices=tuple(BITWISE_METHODS)), "the bit operation (NOT: one input)",
                            required=True),
            "direction": Param(Value(), "not read (a BitShift key)")},
    integer="two's-complement bit operations (integer inputs only)", dtypes=_INTEGER_DTYPES,
    semantics=f"{_BINARY}#bitwise")
BITSHIFT = declare_op(
    "BitShift",
    params={"direction": Param(Text(choices=BITSHIFT_DIRECTIONS), "the shift direction; the second input holds "
                               "the shift amounts", required=True),
            "method": Param(Value(), "not read (a Bitwise key)")},
    integer="shift, wrapped to the output type (integer inputs only)", dtypes=_INTEGER_DTYPES,
    semantics=f"{_BINARY}#bitshift")


def _bitwise_compute(method: str, xs: List[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    xs = [_wrap(x, lo, hi) for x in xs]
    return _wrap(BITWISE_METHODS[method](*xs), lo, hi)


def _bitshift_compute(direction: str, x: torch.Tensor, s: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    bits = (hi - lo).bit_length()
    s = torch.clamp(s, 0, bits)
    x = _wrap(x, lo, hi)
    return _wrap(x << s if direction == "LEFT" else x >> s, lo, hi)


def _float_int_range(node: PyNode) -> Tuple[int, int]:
    """Integer range the float forward of Bitwise/BitShift works in: the output's (else the input's) int type."""
    for d in (node.outputs[0].ir_dtype, node.inputs[0].ir_dtype):
        if _int_dtype(d):
            return d.int_range()
    return Dtype.INT32.int_range()


@BITWISE.forward
def bitwise_forward(self: PyNode) -> None:
    method = _method(self, "method", tuple(BITWISE_METHODS))
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 1 if method == "NOT" else 2, xs)
    lo, hi = out_range(self, self.outputs[0]) if self.quantized else _float_int_range(self)
    self.outputs[0].betensor = _bitwise_compute(method, [_as_int(x) for x in xs], lo, hi)


@BITSHIFT.forward
def bitshift_forward(self: PyNode) -> None:
    direction = _method(self, "direction", BITSHIFT_DIRECTIONS)
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 2, xs)
    lo, hi = out_range(self, self.outputs[0]) if self.quantized else _float_int_range(self)
    self.outputs[0].betensor = _bitshift_compute(direction, _as_int(xs[0]), _as_int(xs[1]), lo, hi)


@BITWISE.quantize
@BITSHIFT.quantize
def integer_only_quantize(self: PyNode) -> None:
    """Integer inputs only; the output is an integer tensor of the float IR's top type (else the input's)."""
    if str(self.type) == "Bitwise":
        method = _method(self, "method", tuple(BITWISE_METHODS))
        count = 1 if method == "NOT" else 2
    else:
        _method(self, "direction", BITSHIFT_DIRECTIONS)
        count = 2
    if len(self.inputs) != count:
        raise self._error(f"expects {count} input(s), got {len(self.inputs)}")
    _require_integer_inputs(self)
    _set_integer_dtype_output(self, self.outputs[0], _integer_output_dtype(self))


# ------------------------------------------------------------------------------------------------ Mod / DivMod
MOD = declare_op(
    "Mod",
    params={"fmod": Param(Bool(), "false: the remainder has the divisor's sign; true: the dividend's (C fmod)",
                          default=False)},
    integer="exact remainder of the Eltwise-aligned integers, one multiplier/shift", semantics=f"{_BINARY}#mod")
DIVMOD = declare_op(
    "DivMod",
    params={"mode": Param(Text(choices=DIVMOD_MODES), "how the quotient is rounded", default="FLOOR")},
    summary="Two outputs: quotient, remainder", integer="exact integer quotient/remainder (integer inputs only)",
    dtypes=_INTEGER_DTYPES, semantics=f"{_BINARY}#divmod")


def _mod(a: torch.Tensor, b: torch.Tensor, fmod: bool) -> torch.Tensor:
    """a mod b (sign of b; C fmod: sign of a); 0 where b == 0. Exact for integers."""
    zero = b == 0
    safe = torch.where(zero, torch.ones_like(b), b)
    r = torch.fmod(a, safe) if fmod else torch.remainder(a, safe)
    return torch.where(zero, torch.zeros_like(r), r)


@MOD.forward
def mod_forward(self: PyNode) -> None:
    fmod = bool_param(self, "fmod", False)
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 2, xs)
    if self.quantized:
        self.outputs[0].betensor = _mod_int(self, fmod)
        return
    a, b = xs
    if a.is_floating_point() or b.is_floating_point():
        a, b = a.to(torch.float32), b.to(torch.float32)
    self.outputs[0].betensor = _mod(a, b, fmod)


@MOD.quantize
def mod_quantize(self: PyNode) -> None:
    """Both inputs are aligned on a common scale with Eltwise ADD's multipliers (`scale_value=[M, M_a, M_b]`), the
    remainder is taken exactly on the aligned integers and requantized with (M, `shift_value`) for s_out / K,
    K = sqrt(s_a·M_a·s_b·M_b). Integer inputs give an integer output."""
    bool_param(self, "fmod", False)
    if len(self.inputs) != 2:
        raise self._error(f"expects 2 inputs, got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    a, b = self.inputs
    out = self.outputs[0]
    s = layer_settings(self)
    signed = is_signed(self, a) or is_signed(self, b)
    _pop_requant(self)
    qa, qb = quant_of(self).get(a), quant_of(self).get(b)
    if qa.qinvariant and qb.qinvariant:
        set_integer_output(self, out, signed, [qa.qbits or 8, qb.qbits or 8])
    else:
        quantize_activation(self, out, signed)
    m_a, m_b = _align_multipliers(self, a, b)
    common = math.sqrt(tensor_scale(self, a) * m_a * tensor_scale(self, b) * m_b)
    m, n, mt, nt = scale_shift(tensor_scale(self, out) / common, s.mult_bits,
                               force_shift_positive=s.force_shift_positive, shift_limit=WIDE_SHIFT_MAX)
    self.params["scale_value"] = [int(m), m_a, m_b]
    self.params["shift_value"] = int(n)
    self.params["scale_type"] = [mt, Dtype.UINT16, Dtype.UINT16]
    self.params["shift_type"] = range_dtype(min(int(n), 0), max(int(n), 0), force_signed=True)
    check_int64_bound(self, offset_absmax(self, b) * m_b * int(m), "remainder times M")


def _mod_int(node: PyNode, fmod: bool) -> torch.Tensor:
    a, b = node.inputs
    out = node.outputs[0]
    m, m_a, m_b = _int_list(node, "scale_value", 3)
    n = int(node.get_param("shift_value"))
    check_int64_bound(node, max(offset_absmax(node, a) * m_a, offset_absmax(node, b) * m_b * abs(m)),
                      "remainder times M")
    r = _mod(_offset_int(node, a) * m_a, _offset_int(node, b) * m_b, fmod)
    qmin, qmax = out_range(node, out)
    return torch.clamp(round_shift(r * m, n) - tensor_zp(node, out), qmin, qmax)


def _divmod(a: torch.Tensor, b: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    zero = b == 0
    safe = torch.where(zero, torch.ones_like(b), b)
    q = torch.div(a, safe, rounding_mode=mode.lower())
    r = a - safe * q
    return torch.where(zero, torch.zeros_like(q), q), torch.where(zero, torch.zeros_like(r), r)


@DIVMOD.forward
def divmod_forward(self: PyNode) -> None:
    mode = str(self.get_param("mode", optional=True, default_value="FLOOR")).upper()
    if mode not in DIVMOD_MODES:
        raise self._error(f"unsupported mode '{mode}' (supported: {', '.join(DIVMOD_MODES)})")
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 2, xs)
    if len(self.outputs) != 2:
        raise self._error(f"DivMod has 2 outputs (quotient, remainder), got {len(self.outputs)}")
    if self.quantized:
        q, r = _divmod(_as_int(xs[0]), _as_int(xs[1]), mode)
        for i, v in enumerate((q, r)):
            lo, hi = out_range(self, self.outputs[i])
            self.outputs[i].betensor = _wrap(v, lo, hi)
        return
    a, b = xs
    if not (a.is_floating_point() or b.is_floating_point()):
        q, r = _divmod(a.to(torch.int64), b.to(torch.int64), mode)
        self.outputs[0].betensor = _wrap_float_result(self, q, 0)
        self.outputs[1].betensor = _wrap_float_result(self, r, 1)
        return
    q, r = _divmod(a.to(torch.float32), b.to(torch.float32), mode)
    self.outputs[0].betensor, self.outputs[1].betensor = q, r


@DIVMOD.quantize
def divmod_quantize(self: PyNode) -> None:
    """Integer inputs only; quotient and remainder are integer tensors of the float IR's top type (else the
    dividend's dtype)."""
    mode = str(self.get_param("mode", optional=True, default_value="FLOOR")).upper()
    if mode not in DIVMOD_MODES:
        raise self._error(f"unsupported mode '{mode}' (supported: {', '.join(DIVMOD_MODES)})")
    if len(self.inputs) != 2 or len(self.outputs) != 2:
        raise self._error("DivMod expects 2 inputs and 2 outputs")
    _require_integer_inputs(self)
    dtype = _integer_output_dtype(self)
    for out in self.outputs:
        _set_integer_dtype_output(self, out, dtype)


# ------------------------------------------------------------------------------------------------ Where
WHERE = declare_op(
    "Where", summary="Inputs condition, x, y; numpy broadcasting",
    integer="both value branches requantized to the output; select on condition + zp != 0",
    semantics=f"{_BINARY}#where")


@WHERE.forward
def where_forward(self: PyNode) -> None:
    xs = [t.betensor for t in self.inputs]
    if len(xs) != 3:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): only the three-input form "
                               f"(condition, x, y) is supported, got {len(xs)} input(s)")
    _check_inputs(self, 3, xs)
    if self.quantized:
        self.outputs[0].betensor = _where_int(self)
        return
    x, y = xs[1], xs[2]
    if x.is_floating_point() != y.is_floating_point():
        x, y = x.to(torch.float32), y.to(torch.float32)
    self.outputs[0].betensor = torch.where(xs[0] != 0, x, y)


@WHERE.quantize
def where_quantize(self: PyNode) -> None:
    """Output params from calibration (signed if a value input is signed); each value branch is requantized to
    them (`scale_value=[M_x, M_y]`, `shift_value=[N_x, N_y]`). Two integer branches give an integer output, each
    passed through (`[1, 1]`, `[0, 0]`)."""
    if len(self.inputs) != 3:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): only the three-input form "
                               f"(condition, x, y) is supported, got {len(self.inputs)} input(s)")
    check_quantized_inputs(self, self.inputs)
    _, x, y = self.inputs
    out = self.outputs[0]
    signed = is_signed(self, x) or is_signed(self, y)
    _pop_requant(self)
    qx, qy = quant_of(self).get(x), quant_of(self).get(y)
    if qx.qinvariant and qy.qinvariant:
        set_qinvariant(self, out, max(int(qx.qbits or 8), int(qy.qbits or 8)),
                       signed or layer_settings(self).force_dtype_int)
    else:
        if qx.qinvariant != qy.qinvariant:
            OPT_WARN(f"layer '{self.name}' ({self.type}): one value input is an integer (scale 1) and the other is "
                     "quantized; the integer branch is requantized as a tensor of scale 1")
        quantize_activation(self, out, signed)
    if qx.qinvariant and qy.qinvariant:  # integers pass through, written as upstream writes them
        self.params["scale_value"], self.params["shift_value"] = [1, 1], [0, 0]
        self.params["scale_type"], self.params["shift_type"] = [Dtype.UINT8] * 2, [Dtype.INT8] * 2
        return
    passthrough = WHERE_INTEGER_PASSTHROUGH in layer_settings(self).upstream_defects
    ms, ns, mts, nts = [], [], [], []
    for t, other in ((x, y), (y, x)):
        if quant_of(self).get(t).qinvariant and not quant_of(self).get(other).qinvariant and \
                (passthrough or _zero_constant(t)):
            # upstream passes an integer branch through (M = 1, N = 0, typed at the multiplier bits); for zeros, as
            # here, that is exact, otherwise only `upstream_defects = where_integer_passthrough` asks for it
            ms.append(1)
            ns.append(0)
            mts.append(Dtype.UINT8 if layer_settings(self).mult_bits <= 8 else Dtype.UINT16)
            nts.append(Dtype.INT8)
            continue
        m, n, mt, nt = requant_scale_shift(self, _f32_ratio(tensor_scale(self, out), tensor_scale(self, t)))
        ms.append(int(m))
        ns.append(int(n))
        mts.append(mt)
        nts.append(nt)
    self.params["scale_value"], self.params["shift_value"] = ms, ns
    self.params["scale_type"], self.params["shift_type"] = mts, nts


def _zero_constant(t: PyTensor) -> bool:
    """Whether `t` is the output of a Constant layer whose values are all zero (the `0.0` of a masked_fill)."""
    producer = t.pnode
    if producer is None or str(producer.type) != "Constant" or "weights" not in producer.constants:
        return False
    values = producer.constants["weights"].betensor
    return values.numel() > 0 and not bool(values.any())


def _where_int(node: PyNode) -> torch.Tensor:
    """Each value branch requantized to the output, clamp(round_shift((q + zp) · M, N) - zp_out, qmin, qmax), then
    chosen by the condition. A branch's result depends on its code alone: read from a memoized table of every
    code's result where the branch has at most 2^16 codes (one gather instead of the requantization's passes; the
    same integers), computed where a code lies outside the table (a hand-fed input)."""
    c, x, y = node.inputs
    (m_x, m_y), (n_x, n_y) = _int_list(node, "scale_value", 2), _int_list(node, "shift_value", 2)
    vx = _requantized_branch(node, x, m_x, n_x, "where_x")
    vy = _requantized_branch(node, y, m_y, n_y, "where_y")
    keep = _offset_int(node, c) != 0
    shape = torch.broadcast_shapes(keep.shape, vx.shape, vy.shape)
    for branch in (vx, vy):  # both are new tensors of this function's: the choice overwrites one of the output's shape
        if branch.shape == shape and branch.is_contiguous() and branch.dtype == torch.promote_types(vx.dtype, vy.dtype):
            return torch.where(keep, vx, vy, out=branch)
    return torch.where(keep, vx, vy)


def _requantized_branch(node: PyNode, t: PyTensor, m: int, n: int, name: str) -> torch.Tensor:
    """clamp(round_shift((q + zp_t) · m, n) - zp_out, qmin, qmax) of the codes q of input `t`, by a table over its
    codes where it has at most 2^16 (memoized under `name`), arithmetic otherwise or for codes outside it."""
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    zp_out = tensor_zp(node, out)

    def compute(codes: torch.Tensor) -> torch.Tensor:
        return torch.clamp(round_shift((codes + tensor_zp(node, t)) * m, n) - zp_out, qmin, qmax)

    codes = int_value(t)
    lo, hi = out_range(node, t)
    if not 0 < hi - lo + 1 <= CODE_TABLE_MAX_CODES:
        return compute(codes)
    table = memo(node, name, (layer_key(node), str(codes.device)),
                 lambda: compute(torch.arange(lo, hi + 1, dtype=torch.int64, device=codes.device)).contiguous())
    looked_up = take_codes(table, codes, lo)
    return looked_up if looked_up is not None else compute(codes)


# ------------------------------------------------------------------------------------------------ Div
DIV = declare_op(
    "Div",
    params={"reciprocal_shift": quantized(Int(lo=0), "exact form: fraction bits of the reciprocal table `lut` "
                                                     "(absent in upstream's form)"),
            "scale": Param(Value(), "written by some Parser versions; not read"),
            "shift": Param(Value(), "written by some Parser versions; not read")},
    constants={"lut": "reciprocals of |divisor|, written when quantized (upstream form: uint16 65535 / code; exact "
                      "form: uint32, normalized)"},
    summary="Two inputs, numpy broadcasting",
    integer="dividend × reciprocal LUT of |divisor| (upstream form: 65535 / code, interpolated; exact form: "
            "normalized), one multiplier/shift", semantics=f"{_BINARY}#div")


@DIV.forward
@keeps_float64()
def div_forward(self: PyNode) -> None:
    """Float: a / b in the inputs' float type (float32, or float64 on a convolution's unrounded result, as upstream's
    division keeps it); integer inputs divide as float32."""
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 2, xs)
    if self.quantized:
        self.outputs[0].betensor = _div_int(self)
        return
    a, b = (x if x.is_floating_point() else x.to(torch.float32) for x in xs)
    self.outputs[0].betensor = a / b


def reciprocal_table(index_bits: int, frac_bits: int) -> torch.Tensor:
    """recip[0] = 0, recip[i] = round_half_even(2^frac_bits / i) for 1 <= i < 2^index_bits, exact (python ints)."""
    values = [0]
    for i in range(1, 2 ** index_bits):
        q, r = divmod(1 << frac_bits, i)
        values.append(q + (1 if 2 * r > i or (2 * r == i and q % 2 == 1) else 0))
    return torch.tensor(values, dtype=torch.int64)


@DIV.quantize
def div_quantize(self: PyNode) -> None:
    """Output params from calibration (signed if an input is signed); `lut` (uint32, 2^t entries with
    t = min(bits of max|divisor + zp|, lut_items_in_bits)) holds reciprocals with `reciprocal_shift` P = t + 15
    fraction bits; `scale_value/shift_value` approximate s_out * s_divisor / s_dividend."""
    if len(self.inputs) != 2:
        raise self._error(f"expects 2 inputs, got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    a, b = self.inputs
    out = self.outputs[0]
    quantize_activation(self, out, is_signed(self, a) or is_signed(self, b))
    if layer_settings(self).div_integer_form == "upstream":
        _quantize_div_upstream(self, a, b, out)
        return
    t = max(1, min(offset_absmax(self, b).bit_length(), int(layer_settings(self).lut_items_in_bits)))
    frac = t + DIV_RECIPROCAL_EXTRA_BITS
    table = reciprocal_table(t, frac)
    set_constant(self, "lut", table, Dtype.UINT32)
    constants_first(self, ["lut"])
    self.params["reciprocal_shift"] = frac
    ratio = _f32_ratio(tensor_scale(self, out), 1.0) * _f32_ratio(tensor_scale(self, b), tensor_scale(self, a))
    _pop_requant(self)
    store_requant(self, *requant_scale_shift(self, ratio))
    m, _ = requant_of(self)
    check_int64_bound(self, offset_absmax(self, a) * int(table.max()) * int(m), "dividend x reciprocal x M")


UPSTREAM_DIV_ZOOM = 65535
"""Upstream's Div table holds round(65535 / code) of the divisor's unsigned codes, in uint16."""


def upstream_div_table(divisor_bits: int, items_bits: int) -> torch.Tensor:
    """Upstream's Div table: 2^min(divisor_bits, items_bits) float32 points spread evenly over [0, 2^divisor_bits
    - 1] (torch's float32 linspace), 65535 / point rounded half to even and clamped to [0, 65535], entry 0 set to 0
    (a zero divisor gives 0)."""
    steps = 2 ** min(int(divisor_bits), int(items_bits))
    points = torch.linspace(0, 2 ** int(divisor_bits) - 1, steps=steps, dtype=torch.float32)
    table = torch.clamp(torch.round(float(UPSTREAM_DIV_ZOOM) / points), 0, UPSTREAM_DIV_ZOOM)
    table[0] = 0
    return table.to(torch.int64)


def _quantize_div_upstream(node: PyNode, a: PyTensor, b: PyTensor, out: PyTensor) -> None:
    """Upstream's form (`div_integer_form = upstream`): the uint16 table of `upstream_div_table` over the divisor's
    bits, and (M, N) = scale_shift(s_out · s_b / (s_a · 65535)) with the activation bits as multiplier bits, the
    products taken in float32 as upstream's scales are."""
    f32 = torch.float32
    ratio = (torch.tensor(tensor_scale(node, out), dtype=f32) * torch.tensor(tensor_scale(node, b), dtype=f32)) / \
        (torch.tensor(tensor_scale(node, a), dtype=f32) * torch.tensor(float(UPSTREAM_DIV_ZOOM), dtype=f32))
    table = upstream_div_table(int(range_bits(node, b)), int(layer_settings(node).lut_items_in_bits))
    set_constant(node, "lut", table, Dtype.UINT16)
    constants_first(node, ["lut"])
    node.params.pop("reciprocal_shift", None)
    _pop_requant(node)
    store_requant(node, *requant_scale_shift(node, ratio, int(layer_settings(node).q_bits_activation)))


def _signed_reciprocal(node: PyNode, y: torch.Tensor) -> torch.Tensor:
    """sign(Y) · lut(|Y|) (sign(0) = +1) of the divisor's offset integers Y: the LUT op's lookup with its floor
    interpolation (docs/semantics/binary.md, "Div")."""
    table = node.get_constant("lut").betensor.to(torch.int64).flatten()
    lut_v = lookup_lut(y.abs(), table, 0, range_bits(node, node.inputs[1]), 16, False)
    return torch.where(y < 0, -lut_v, lut_v)


def _divisor_table(node: PyNode, device: torch.device) -> Optional[Tuple[int, torch.Tensor]]:
    """(qmin, sign(Y) · lut(|Y|) for every divisor code qmin..qmax) when the divisor has at most
    CODE_TABLE_MAX_CODES codes, else None; memoized on the layer (graph/memo.py)."""
    qmin, qmax = out_range(node, node.inputs[1])
    if not 0 < qmax - qmin + 1 <= CODE_TABLE_MAX_CODES:
        return None

    def build() -> Tuple[int, torch.Tensor]:
        codes = torch.arange(qmin, qmax + 1, dtype=torch.int64, device=device)
        return qmin, _signed_reciprocal(node, codes + tensor_zp(node, node.inputs[1])).contiguous()

    return memo(node, "div_divisor_table", (layer_key(node), str(device)), build)


def _div_int_upstream(node: PyNode) -> torch.Tensor:
    """Upstream's form: sign(Y) · X · lut(|Y|) requantized once, `lut` looked up over the divisor's unsigned
    codes with the floor interpolation of LUT ops (docs/semantics/binary.md, "Div"). sign(Y) · lut(|Y|) depends on
    the divisor's code alone: read from a table of every code's value where there are at most 2^16 codes (one
    gather instead of the lookup's passes; the same integers), computed where a code lies outside the table (a
    hand-fed input; `take_codes`)."""
    a, b = node.inputs
    out = node.outputs[0]
    m, n = requant_of(node)
    if not isinstance(m, int):
        raise node._error("quantized Div needs a per-tensor scale_value/shift_value")
    x, codes = _offset_int(node, a), int_value(b)
    table = _divisor_table(node, codes.device)
    reciprocal = take_codes(table[1], codes, table[0]) if table is not None else None
    if reciprocal is None:
        reciprocal = _signed_reciprocal(node, codes + tensor_zp(node, b))
    qmin, qmax = out_range(node, out)
    return requantize_int(x * reciprocal, m, n, tensor_zp(node, out), qmin, qmax)


def _div_int(node: PyNode) -> torch.Tensor:
    if "reciprocal_shift" not in node.params:
        return _div_int_upstream(node)
    a, b = node.inputs
    out = node.outputs[0]
    table = node.get_constant("lut").betensor.to(torch.int64).flatten()
    size = table.numel()
    t = size.bit_length() - 1
    if size < 2 or 2 ** t != size:
        raise node._error(f"Div needs a reciprocal 'lut' of 2^t entries (t >= 1), got {size}")
    frac = int(node.get_param("reciprocal_shift"))
    m, n = requant_of(node)
    if not isinstance(m, int):
        raise node._error("quantized Div needs a per-tensor scale_value/shift_value")
    check_int64_bound(node, offset_absmax(node, a) * int(table.max()) * abs(m), "dividend x reciprocal x M")
    x, y = _offset_int(node, a), _offset_int(node, b)
    d = y.abs()
    e = torch.clamp(bit_length(d) - t, min=0)
    half = torch.where(e > 0, torch.ones_like(e) << torch.clamp(e - 1, min=0), torch.zeros_like(e))
    idx = (d + half) >> e
    carry = idx >= size
    idx = torch.where(carry, torch.full_like(idx, size // 2), idx)
    e = e + carry.to(torch.int64)
    z = torch.sign(y) * x * table.to(idx.device)[idx]
    qmin, qmax = out_range(node, out)
    return torch.clamp(round_shift(z * m, n + frac + e) - tensor_zp(node, out), qmin, qmax)


# ------------------------------------------------------------------------------------------------ Pow
POW = declare_op(
    "Pow",
    params={"exponent": Param(Float(), "the constant exponent (a second input tensor instead is float only)"),
            **{k: quantized(Value(), "written as upstream writes it (1, 0, uint8, int8); not read")
               for k in ("scale_value", "shift_value", "scale_type", "shift_type")}},
    constants={"lut": "x^exponent over the input range, written when quantized",
               "lut_log": "upstream's log table; not read", "lut_exp": "upstream's exp table; not read",
               "weights": "written by some Parser versions; not read"},
    integer="LUT over the input range", semantics=f"{_BINARY}#pow")


def _exponent(node: PyNode) -> float:
    value = node.get_param("exponent")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise node._error(f"parameter 'exponent' must be a number, got {value!r}") from None


def _constant_exponent(node: PyNode) -> Optional[float]:
    """The exponent of the Parser's form: a second input that a Constant layer holds with one value throughout
    (dequantized when that layer was quantized before this one); None for any other second input."""
    if len(node.inputs) != 2 or node.graph is None:
        return None
    t = node.inputs[1]
    src = next((n for n in node.graph.nodes if any(o is t for o in n.outputs)), None)
    w = src.get_constant("weights", optional=True) if src is not None and str(src.type) == "Constant" else None
    if w is None or w.betensor.numel() == 0:
        return None
    if w.betensor.is_floating_point():
        v = w.betensor.to(torch.float32)
    else:
        qw = quant_of(src).get(w)
        v = dequantize(w.betensor, qw.scale, qw.zerop)
    first = float(v.reshape(-1)[0])
    if not bool((v == first).all()):
        return None
    return float(f"{first:.7g}")  # undo the float32 rounding of a quantized constant (1.5000001 → 1.5)


@POW.forward
def pow_forward(self: PyNode) -> None:
    xs = [t.betensor for t in self.inputs]
    if "exponent" in self.params:
        _check_inputs(self, 1, xs[:1])
        if self.quantized:
            self.outputs[0].betensor = _pow_int(self)
            return
        self.outputs[0].betensor = torch.pow(xs[0].to(torch.float32), _exponent(self))
        return
    _check_inputs(self, 2, xs)
    if self.quantized:
        if self.get_constant("lut", optional=True) is None:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): a quantized Pow needs a constant exponent")
        self.outputs[0].betensor = _pow_int(self)
        return
    self.outputs[0].betensor = torch.pow(xs[0].to(torch.float32), xs[1].to(torch.float32))


def _pow_function(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """x^p in float32; undefined values (negative base, non-integer exponent) become 0, infinities saturate."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(torch.pow(x, p), nan=0.0)
    return fn


@POW.quantize
def pow_quantize(self: PyNode) -> None:
    """Constant exponent (the `exponent` param, or the Parser's second input from a Constant layer holding one
    value): a `lut` over the input range, as the LUT activations. Signed output iff the input is signed and the
    exponent is an odd integer."""
    if "exponent" in self.params:
        p = _exponent(self)
        if len(self.inputs) != 1:
            raise self._error(f"Pow with an `exponent` param expects 1 input, got {len(self.inputs)}")
    else:
        exponent = _constant_exponent(self)
        if exponent is None:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): quantizing Pow needs a constant exponent "
                                   "(the `exponent` param, or a second input from a Constant layer of one value)")
        p = exponent
    check_quantized_inputs(self, self.inputs)
    inp, out = self.inputs[0], self.outputs[0]
    odd = float(p).is_integer() and int(p) % 2 == 1
    quantize_activation(self, out, is_signed(self, inp) and odd)
    in_qmin, in_qmax = out_range(self, inp)
    out_qmin, out_qmax = out_range(self, out)
    table = build_lut(_pow_function(p), tensor_scale(self, inp), tensor_zp(self, inp), in_qmin, in_qmax,
                      range_bits(self, inp), tensor_scale(self, out), tensor_zp(self, out), out_qmin, out_qmax,
                      lut_items_in_bits=int(layer_settings(self).lut_items_in_bits))
    set_constant(self, "lut", table, out.dtype)
    constants_first(self, ["lut"])
    store_requant(self, 1, 0, Dtype.UINT8, Dtype.INT8)  # upstream's keys; the table holds the whole function


def _pow_int(node: PyNode) -> torch.Tensor:
    inp, out = node.inputs[0], node.outputs[0]
    lut = node.get_constant("lut")
    in_qmin, _ = out_range(node, inp)
    y = lookup_lut(int_value(inp), lut.betensor, in_qmin, range_bits(node, inp), lut.dtype.bits, lut.dtype.is_signed,
                   in_restricted=is_restricted(node, inp))
    qmin, qmax = out_range(node, out)
    return torch.clamp(y, qmin, qmax)


# ------------------------------------------------------------------------------------------------ SquaredDifference
SQUARED_DIFFERENCE = declare_op(
    "SquaredDifference",
    params={"diff_shift": quantized(Int(lo=0), "right shift of the aligned difference before squaring")},
    summary="Two inputs, numpy broadcasting", integer="aligned exact difference, squared, one multiplier/shift",
    semantics=f"{_BINARY}#squareddifference")


@SQUARED_DIFFERENCE.forward
def squared_difference_forward(self: PyNode) -> None:
    xs = [t.betensor for t in self.inputs]
    _check_inputs(self, 2, xs)
    if self.quantized:
        self.outputs[0].betensor = _sqd_int(self)
        return
    d = xs[0].to(torch.float32) - xs[1].to(torch.float32)
    self.outputs[0].betensor = d * d


@SQUARED_DIFFERENCE.quantize
def squared_difference_quantize(self: PyNode) -> None:
    """Unsigned output from calibration. The aligned difference D = (a+zp_a)·M_a − (b+zp_b)·M_b is rounded right by
    `diff_shift` k, squared and requantized: `scale_value=[M, M_a, M_b]`, `shift_value=N` for
    s_out·4^k / K² with K = sqrt(s_a·M_a·s_b·M_b) (the common scale of D)."""
    if len(self.inputs) != 2:
        raise self._error(f"expects 2 inputs, got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    a, b = self.inputs
    out = self.outputs[0]
    s = layer_settings(self)
    _pop_requant(self)
    qa, qb = quant_of(self).get(a), quant_of(self).get(b)
    if qa.qinvariant and qb.qinvariant:
        set_integer_output(self, out, False, [qa.qbits or 8, qb.qbits or 8])
    else:
        quantize_activation(self, out, False)
    m_a, m_b = _align_multipliers(self, a, b)
    dmax = offset_absmax(self, a) * m_a + offset_absmax(self, b) * m_b
    k = max(0, dmax.bit_length() - SQD_DIFF_BITS)
    common = math.sqrt(tensor_scale(self, a) * m_a * tensor_scale(self, b) * m_b)
    ratio = tensor_scale(self, out) * 4.0 ** k / (common * common)
    m, n, mt, nt = scale_shift(ratio, s.mult_bits, force_shift_positive=s.force_shift_positive,
                               shift_limit=WIDE_SHIFT_MAX)
    self.params["scale_value"] = [int(m), m_a, m_b]
    self.params["shift_value"] = int(n)
    self.params["scale_type"] = [mt, Dtype.UINT16, Dtype.UINT16]
    self.params["shift_type"] = range_dtype(min(int(n), 0), max(int(n), 0), force_signed=True)
    self.params["diff_shift"] = k
    dq = ((dmax >> k) + 1) if k else dmax
    check_int64_bound(self, dq * dq * int(m), "squared difference times M")


def _sqd_int(node: PyNode) -> torch.Tensor:
    a, b = node.inputs
    out = node.outputs[0]
    m, m_a, m_b = _int_list(node, "scale_value", 3)
    n = int(node.get_param("shift_value"))
    k = int(node.get_param("diff_shift"))
    dmax = offset_absmax(node, a) * m_a + offset_absmax(node, b) * m_b
    dq = ((dmax >> k) + 1) if k else dmax
    check_int64_bound(node, dq * dq * m, "squared difference times M")
    d = round_shift(_offset_int(node, a) * m_a - _offset_int(node, b) * m_b, k)
    qmin, qmax = out_range(node, out)
    return torch.clamp(round_shift(d * d * m, n) - tensor_zp(node, out), qmin, qmax)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def _aligned_codes(g: QDQGraph, node: PyNode, m_a: int, m_b: int, perm: Optional[Perm]) -> Tuple[str, str]:
    """((a + zp_a)·M_a, (b + zp_b)·M_b) as float64 in layout `perm`: the aligned integers of a Mod's or a
    SquaredDifference's inputs."""
    first, second = onnx_exact.scaled_codes(g, node, list(node.inputs), [float(m_a), float(m_b)], perm)
    return first, second


def _requantize_int64(g: QDQGraph, node: PyNode, value: str, m: int, n: int, perm: Optional[Perm]) -> None:
    """clamp(round_half_even(value · M / 2^N) - zp_out) of int64 `value` in int64, where value · M (below 2^62,
    as quantization checked) leaves float64's exact integers: a rounding division by 2^N (0 <= N <= 61)."""
    if not 0 <= n <= 61:
        raise node_error(node, f"shift {n} leaves the int64 rounding division (0..61)")
    acc = value if m == 1 else g.add("Mul", [value, g.const(f"{node.name}/multiplier",
                                                            np.array(m, dtype=np.int64))])
    if n:
        acc = onnx_exact.round_div_int64(g, node, acc, g.const(f"{node.name}/divisor", np.array(1 << n, np.int64)))
    result = g.add("Cast", [acc], to=DOUBLE)
    zp = tensor_zp(node, node.outputs[0])
    result = result if not zp else g.add("Sub", [result, double(g, node, "output_zero_point", float(zp))])
    emit_integers(g, node, node.outputs[0], result, perm)


def _integers_only(node: PyNode) -> bool:
    table = quant_of(node)
    return all(table.get(t).qinvariant for t in list(node.inputs) + list(node.outputs))


@MOD.export
def convert_mod(g: QDQGraph, node: PyNode) -> None:
    """The exact remainder of the aligned integers in int64 (ONNX Mod, `fmod` as the layer's; 0 where the divisor is
    0), then M · 2^-N in float64 and Round (in int64 where r·M passes 2^53): in "exact" mode, and in every mode for
    integer tensors; refused otherwise (a float remainder of dequantized values moves by whole divisors at the
    boundaries)."""
    a, b = node.inputs
    y = node.outputs[0]
    if not (g.unit_domain or _integers_only(node)):
        raise node_error(node, "Mod is exported in the exact mode only")
    m, m_a, m_b = _int_list(node, "scale_value", 3)
    n = int(node.get_param("shift_value"))
    in_double = fits_double(offset_absmax(node, b) * m_b * abs(m))  # r·M exact, so r·M·2^-N for any N
    perm = shared_perm(g, [a, b], g.rank(y))
    dividend, divisor = _aligned_codes(g, node, m_a, m_b, perm)
    dividend, divisor = (g.add("Cast", [v], to=onnx_exact.INT64) for v in (dividend, divisor))
    zero = g.add("Equal", [divisor, g.const(f"{node.name}/zero", np.array(0, dtype=np.int64))])
    safe = g.add("Where", [zero, g.const(f"{node.name}/one", np.array(1, dtype=np.int64)), divisor])
    remainder = g.add("Mod", [dividend, safe], fmod=int(bool_param(node, "fmod", False)))
    remainder = g.add("Where", [zero, g.const(f"{node.name}/zero_remainder", np.array(0, dtype=np.int64)),
                                remainder])
    if in_double:
        onnx_exact.requantize(g, node, g.add("Cast", [remainder], to=DOUBLE), m * 2.0 ** -n, perm)
    else:
        _requantize_int64(g, node, remainder, m, n, perm)


@DIVMOD.export
def convert_divmod(g: QDQGraph, node: PyNode) -> None:
    """Every mode (integer tensors only): int64 Div (truncating; FLOOR moves a quotient down by one where the
    remainder's sign differs from the divisor's), the remainder a - b·q, both 0 for a zero divisor, wrapped into the
    outputs' ranges as the integer forward wraps them."""
    mode = str(node.get_param("mode", optional=True, default_value="FLOOR")).upper()
    if mode not in DIVMOD_MODES or len(node.inputs) != 2 or len(node.outputs) != 2:
        raise node_error(node, f"DivMod needs 2 inputs, 2 outputs and a mode of {', '.join(DIVMOD_MODES)}")
    perm = shared_perm(g, list(node.inputs), g.rank(node.outputs[0]))

    def int64(what: str, v: int) -> str:
        return g.const(f"{node.name}/{what}", np.array(v, dtype=np.int64))

    a, b = (g.add("Cast", [codes(g, t, perm)], to=onnx_exact.INT64) for t in node.inputs)
    zero = g.add("Equal", [b, int64("zero", 0)])
    safe = g.add("Where", [zero, int64("one", 1), b])
    quotient = g.add("Div", [a, safe])
    if mode == "FLOOR":
        rest = g.add("Sub", [a, g.add("Mul", [safe, quotient])])
        down = g.add("Less", [g.add("Mul", [rest, safe]), int64("no_sign", 0)])
        quotient = g.add("Where", [down, g.add("Sub", [quotient, int64("step", 1)]), quotient])
    remainder = g.add("Sub", [a, g.add("Mul", [safe, quotient])])
    for t, value in zip(node.outputs, (quotient, remainder)):
        value = g.add("Where", [zero, int64(f"{t.name}_zero", 0), value])
        emit_integers(g, node, t, g.add("Cast", [value], to=DOUBLE), perm, clip_mode="TRUNCATION")


@SQUARED_DIFFERENCE.export
def convert_squared_difference(g: QDQGraph, node: PyNode) -> None:
    """"exact" mode (and integer tensors in every mode): D = (a+zp_a)·M_a − (b+zp_b)·M_b in float64, rounded right
    by `diff_shift` (Round of D · 2^-k: half to even), squared, times M · 2^-N, Round: exact while d²·M < 2^53, for
    any N; beyond, d²·M in int64 and a rounding division by 2^N. Otherwise
    the float (a − b)² between DequantizeLinear and QuantizeLinear, scaled by the multiplier's rounding."""
    a, b = node.inputs
    y = node.outputs[0]
    m, m_a, m_b = _int_list(node, "scale_value", 3)
    n, k = int(node.get_param("shift_value")), int(node.get_param("diff_shift"))
    dmax = offset_absmax(node, a) * m_a + offset_absmax(node, b) * m_b
    dq = ((dmax >> k) + 1) if k else dmax
    perm = shared_perm(g, [a, b], g.rank(y))
    if g.unit_domain or _integers_only(node):
        first, second = _aligned_codes(g, node, m_a, m_b, perm)
        d = g.add("Sub", [first, second])  # below 2^35: exact, and so is its rounding by 2^k
        if k:
            d = g.add("Round", [g.add("Mul", [d, double(g, node, "diff_step", 2.0 ** -k)])])
        if fits_double(dq * dq * abs(m)):  # d²·M exact, so d²·M·2^-N for any N
            onnx_exact.requantize(g, node, g.add("Mul", [d, d]), m * 2.0 ** -n, perm)
        else:
            d = g.add("Cast", [d], to=onnx_exact.INT64)
            _requantize_int64(g, node, g.add("Mul", [d, d]), m, n, perm)
        return
    diff = g.add("Sub", [g.float_value(a, perm), g.float_value(b, perm)])
    common2 = tensor_scale(node, a) * m_a * tensor_scale(node, b) * m_b
    factor = m * 2.0 ** -n * common2 / (4.0 ** k * tensor_scale(node, y))
    g.quantize(y, g.rescale(g.add("Mul", [diff, diff]), factor), perm)


@POW.export
def convert_pow(g: QDQGraph, node: PyNode) -> None:
    """x ^ exponent (the constant param, or the Parser's second input from a Constant layer of one value):
    quantopt's table as a Gather ("exact"), else the float Pow."""
    if "exponent" in node.params and len(node.inputs) == 1:
        p: Optional[float] = float(node.get_param("exponent"))
    else:
        p = _constant_exponent(node)
    if p is None:
        raise node_error(node, "only Pow with a constant exponent is quantized and exported")
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if onnx_exact.try_table(g, node, perm, first_input_only=True):  # the integer forward reads the table only
        return
    exponent = g.const(f"{node.name}/exponent", np.array(p, dtype=np.float32))
    g.quantize(y, g.add("Pow", [g.float_value(x, perm), exponent]), perm, exact=True)


@DIV.export
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
    if onnx_exact.div(g, node, perm if same_rank else None):
        return
    values = [g.float_value(t, perm) if same_rank else g.float_value(t) for t in node.inputs]
    # the multiplier carries s_out·s_b/s_a, in upstream's form divided by the table's 65535 as well
    zoom = 1.0 if "reciprocal_shift" in node.params else float(UPSTREAM_DIV_ZOOM)
    out = g.rescale(g.add("Div", values), requant_factor(node, zoom * tensor_scale(node, a) / tensor_scale(node, b)))
    g.quantize(y, out, perm)


LOGICAL_ONNX = {"EQUAL": "Equal", "GREATER": "Greater", "GREATER_EQUAL": "GreaterOrEqual", "LESS": "Less",
                "LESS_EQUAL": "LessOrEqual"}
"""Comparison methods with an ONNX op of their own (NOT_EQUAL is Not(Equal))."""
BOOLEAN_ONNX = {"AND": "And", "OR": "Or", "XOR": "Xor"}


def _scaled(g: QDQGraph, node: PyNode, value: str, multiplier: int, what: str) -> str:
    return value if multiplier == 1 else g.add("Mul", [value, double(g, node, what, float(multiplier))])


@LOGICAL.export
def convert_logical(g: QDQGraph, node: PyNode) -> None:
    """0/1 from comparisons of `X · M_a` and `Y · M_b` (exact in float64), or from `X != 0` (AND/OR/XOR; NOT:
    `X == 0`), as the output's integer type."""
    method = str(node.get_param("method")).upper()
    count = 1 if method == "NOT" else 2
    if len(node.inputs) != count:
        raise node_error(node, f"{method} needs {count} input(s), got {len(node.inputs)}")
    y = node.outputs[0]
    perm = shared_perm(g, node.inputs, g.rank(y))
    values: List[str] = [codes(g, t, perm) for t in node.inputs]
    if method == "NOT":
        truth = g.add("Equal", [values[0], double(g, node, "zero", 0.0)])
    elif method in BOOLEAN_ONNX:
        zero = double(g, node, "zero", 0.0)
        a, b = (g.add("Not", [g.add("Equal", [v, zero])]) for v in values)
        truth = g.add(BOOLEAN_ONNX[method], [a, b])
    elif method in LOGICAL_ONNX or method == "NOT_EQUAL":
        m_a, m_b = (int(v) for v in node.get_param("scale_value"))
        bound = max(offset_absmax(node, t) * m for t, m in zip(node.inputs, (m_a, m_b)))
        if bound >= FLOAT64_EXACT:
            raise node_error(node, "X · M leaves float64's exact integers; no exact form")
        a, b = _scaled(g, node, values[0], m_a, "input0_multiplier"), _scaled(g, node, values[1], m_b,
                                                                               "input1_multiplier")
        truth = g.add("Not", [g.add("Equal", [a, b])]) if method == "NOT_EQUAL" else g.add(LOGICAL_ONNX[method],
                                                                                            [a, b])
    else:
        raise node_error(node, f"Logical method {method} has no QDQ mapping")
    emit_integers(g, node, y, g.add("Cast", [truth], to=DOUBLE), perm)


@WHERE.export
def convert_where(g: QDQGraph, node: PyNode) -> None:
    """`clamp(rs(X · M_x, N_x) - zp_out)` where `C != 0`, else the same of `Y`, in float64 (exact: every product
    is below 2^53 and scaling by 2^-N is exact)."""
    if len(node.inputs) != 3:
        raise node_error(node, f"only the three-input form (condition, x, y) is exported, got {len(node.inputs)}")
    c, x, y = node.inputs
    out = node.outputs[0]
    ms = [int(v) for v in node.get_param("scale_value")]
    ns = [int(v) for v in node.get_param("shift_value")]
    for t, m in zip((x, y), ms):
        if offset_absmax(node, t) * abs(m) >= FLOAT64_EXACT:
            raise node_error(node, f"(q + zp) · M of input '{t.name}' leaves float64's exact integers; no exact "
                                   "form")
    perm = shared_perm(g, node.inputs, g.rank(out))
    lo, hi = out_range(node, out)
    zp_out = tensor_zp(node, out)
    branches = []
    for i, (t, m, n) in enumerate(zip((x, y), ms, ns)):
        v = g.add("Round", [g.add("Mul", [codes(g, t, perm), double(g, node, f"input{i + 1}_multiplier",
                                                                      m * 2.0 ** -n)])])
        v = v if not zp_out else g.add("Sub", [v, double(g, node, f"input{i + 1}_zero_point", float(zp_out))])
        branches.append(g.add("Clip", [v, double(g, node, f"input{i + 1}_qmin", float(lo)),
                                       double(g, node, f"input{i + 1}_qmax", float(hi))]))
    condition = g.add("Not", [g.add("Equal", [codes(g, c, perm), double(g, node, "zero", 0.0)])])
    emit_integers(g, node, out, g.add("Where", [condition, *branches]), perm)
