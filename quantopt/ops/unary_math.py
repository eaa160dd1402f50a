"""Element-wise unary math: Abs, Negative, Sign, IsInf, IsNaN and the table ops (Exp, Log, Sqrt, trigonometric and
hyperbolic functions, Floor/Ceil/Round/Trunc, ...). Each is a standalone layer type without a `method` param.

Quantized (docs/semantics/unary.md):
* Abs / Negative: |x + zp_in| resp. -(x + zp_in), exact in int64, then one requantization s_out / s_in.
* Sign: sign(x + zp_in) as an int8 integer tensor (scale 1, zero point 0).
* IsInf / IsNaN: a quantized tensor holds no inf or NaN, so the integer output is always 0 (uint8 integer tensor).
* every other op: a lookup table `lut` over the input integer range (quant/lut.py). Functions with a restricted
  domain are evaluated on samples clamped into it (see `domain_clamp`), so no table entry comes from inf or NaN,
  and the output range is the calibrated one, limited to the finite tabulated values for the functions that can
  give ±inf (`FINITE_VALUED` lists the others).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.lut import build_lut, lookup_lut, lut_sample_points, lut_size
from ..quant.params import dequantize, integer_range
from ..quant.requant import requantize_int
from ..registry import declare_op
from ..registry.schema import Bool, Float, Param, Text, Value, quantized
from ._lut_int import CODE_TABLE_MAX_CODES, constants_first, int_input, is_restricted, range_bits, take_codes
from ._quant import (
    copy_params,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param, keeps_float64
from .onnx_build import exact as onnx_exact
from .onnx_build.exact import DOUBLE, emit_integers
from .onnx_build.float_forms import float_const, requant_factor, unary_perm
from .onnx_build.qdq_graph import QDQGraph

SEMANTICS = "docs/semantics/unary.md"

# --------------------------------------------------------------------------------------------- float functions
LUT_FUNCTIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Exp": torch.exp, "Log": torch.log, "Erf": torch.erf, "Sqrt": torch.sqrt, "Rsqrt": torch.rsqrt,
    "Reciprocal": torch.reciprocal, "Square": torch.square,
    "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Trunc": torch.trunc,
    "Acos": torch.acos, "Acosh": torch.acosh, "Asin": torch.asin, "Asinh": torch.asinh, "Atan": torch.atan,
    "Atanh": torch.atanh, "Cosine": torch.cos, "Cosh": torch.cosh, "Sine": torch.sin, "Sinh": torch.sinh,
    "Tan": torch.tan,
}
"""Table ops and their float function (torch's; `torch.round` rounds half to even like ONNX Round)."""

ROUNDING_OPS = ("Floor", "Ceil", "Round", "Trunc")
"""Table ops that are the identity on integers: an integer (scale 1, zero point 0) input passes through."""

LUT_OUTPUT_SIGNED: Dict[str, Optional[bool]] = {
    "Exp": False, "Sqrt": False, "Rsqrt": False, "Square": False, "Acos": False, "Acosh": False, "Cosh": False,
    "Log": True, "Cosine": True, "Sine": True, "Tan": True,
    "Erf": None, "Asin": None, "Asinh": None, "Atan": None, "Atanh": None, "Sinh": None, "Reciprocal": None,
    "Floor": None, "Ceil": None, "Round": None, "Trunc": None,
}
"""Output signedness of the table ops: fixed by the function's range, or None: signed iff the input is signed
(functions that keep the sign of their argument)."""

FINITE_VALUED = ("Square", "Erf", "Atan", "Asinh", "Sine", "Cosine", "Acos", "Asin", "Floor", "Ceil", "Round",
                 "Trunc")
"""Table ops whose float value is finite wherever the input is (a NaN outside the domain is left out of the
statistics): their output params come from the calibrated range as it is, as upstream's. The others (Exp, Log,
Reciprocal, ...) can give ±inf, which calibration clips to ±2^31, so their calibrated range is first limited to the
finite tabulated values (`_limit_output_range`)."""

ATANH_MAX_MARGIN = 0.5
"""Atanh samples are clamped to ±(1 - min(step/2, ATANH_MAX_MARGIN)): half an input step inside the open domain
(-1, 1), but never closer to 0 than ±0.5 when the input step is coarser than 1."""

_F32_BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))


def _half_step(s_in: float) -> float:
    """Half the input quantization step, 1 / (2 s_in), as a positive float32 value."""
    half = float(torch.tensor(0.5 / s_in, dtype=torch.float32))
    return half if half > 0.0 else float(torch.finfo(torch.float32).tiny)


def domain_clamp(optype: str, s_in: float) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The clamp applied to table samples of a function with a restricted domain (None for the others).

    With h = 1 / (2 s_in), half an input step (the inputs that quantize to a boundary code lie within h of it):
    Sqrt [0, inf); Acosh [1, inf); Acos, Asin [-1, 1]; Log, Rsqrt [h, inf); Reciprocal |x| >= h keeping the sign
    (0 → +h, as 1/+0 = +inf); Atanh [-b, b] with b = 1 - min(h, 0.5) in float32 (the float32 below 1 if that rounds
    to 1). Every clamped sample gives a finite value.
    """
    h = _half_step(s_in)
    if optype == "Sqrt":
        return lambda x: torch.clamp(x, min=0.0)
    if optype == "Acosh":
        return lambda x: torch.clamp(x, min=1.0)
    if optype in ("Acos", "Asin"):
        return lambda x: torch.clamp(x, -1.0, 1.0)
    if optype in ("Log", "Rsqrt"):
        return lambda x: torch.clamp(x, min=h)
    if optype == "Reciprocal":
        return lambda x: torch.where(x.abs() < h, torch.where(x < 0, -h, h).to(x.dtype), x)
    if optype == "Atanh":
        b = float(torch.tensor(1.0 - min(h, ATANH_MAX_MARGIN), dtype=torch.float32))
        b = min(b, _F32_BELOW_ONE)
        return lambda x: torch.clamp(x, -b, b)
    return None


def _is_integer_tensor(node: PyNode, t) -> bool:
    """Scale 1 and zero point 0: the integers are the values (what the stored IR says, not an in-memory flag)."""
    return tensor_scale(node, t) == 1.0 and tensor_zp(node, t) == 0


def _check_per_tensor_mode(node: PyNode) -> None:
    if layer_settings(node).q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel activation quantization is not "
                               "supported for unary math ops")


def _check_input_quantized(node: PyNode) -> None:
    inp = node.inputs[0]
    if params(node, inp).qmin is None:
        raise node._error(f"input '{inp.name}' is not quantized; quantize the producer first")


def _check_one_in_one_out(node: PyNode) -> None:
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        raise node._error(f"expects one input and one output, got {len(node.inputs)} and {len(node.outputs)}")


def _isinf_flags(node: PyNode) -> Tuple[bool, bool]:
    """(detect_negative, detect_positive), both true by default (ONNX IsInf)."""
    return bool_param(node, "detect_negative", True), bool_param(node, "detect_positive", True)


# --------------------------------------------------------------------------------------------- table ops
_TABLE_INTEGER = "LUT over the input range (domain-clamped samples for restricted domains)"
_TABLE_SEMANTICS = f"{SEMANTICS}#table-ops"
_LUT = {"lut": "the output table over the input's integer range, written when quantized"}
_UNREAD_SCALE = {"scale": Param(Value(), "written by some Parser versions; not read")}
_UPSTREAM_TABLE = "upstream's float-table approximation; not read"
_UPSTREAM_INDEX = {
    "index_scale_value": quantized(Float(), f"{_UPSTREAM_TABLE}: the index scale"),
    "index_offset_value": quantized(Float(), f"{_UPSTREAM_TABLE}: the index offset"),
    "value_offset_value": quantized(Float(), f"{_UPSTREAM_TABLE}: the value offset"),
}
TABLE_OPS = declare_op(
    ["Exp", "Sqrt", "Rsqrt", "Reciprocal", "Square", "Tan"], params=_UNREAD_SCALE, constants=_LUT,
    integer=_TABLE_INTEGER, semantics=_TABLE_SEMANTICS)
INDEX_TABLE_OPS = declare_op(
    ["Log", "Acosh", "Sine"], params={**_UNREAD_SCALE, **_UPSTREAM_INDEX}, constants=_LUT, integer=_TABLE_INTEGER,
    semantics=_TABLE_SEMANTICS)
MODE_TABLE_OPS = declare_op(
    ["Erf", "Acos", "Asin", "Asinh", "Atan", "Atanh", "Cosine", "Cosh", "Sinh"],
    params={**_UNREAD_SCALE, **_UPSTREAM_INDEX,
            "lut_mode": quantized(Text(), f"{_UPSTREAM_TABLE} (NORMAL, MIRROR, ...)")},
    constants=_LUT, integer=_TABLE_INTEGER, semantics=_TABLE_SEMANTICS)
ROUNDING_TABLE_OPS = declare_op(
    list(ROUNDING_OPS), params=_UNREAD_SCALE, constants=_LUT,
    integer="LUT over the input range; identity on integer inputs", semantics=_TABLE_SEMANTICS)


def _lut_sample_values(node: PyNode, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """f at the table's sample points (float32, exactly the values `build_lut` quantizes)."""
    inp = node.inputs[0]
    qmin, qmax = out_range(node, inp)
    steps = lut_size(range_bits(node, inp), int(layer_settings(node).lut_items_in_bits))
    x = dequantize(lut_sample_points(qmin, qmax, steps), tensor_scale(node, inp), tensor_zp(node, inp))
    return fn(x).to(torch.float32)


INFINITE_RANGE_END = 2.0 ** 30
"""A calibrated range end at least this large in magnitude stands for infinite values (upstream clips inf to
±2^31), not data."""


def _limit_output_range(node: PyNode, values: torch.Tensor) -> None:
    """Clamp each end of the calibrated output range that stands for infinite values (|end| >= 2^30: a run whose
    statistics took ±inf in as ±2^31) to [min(lo, 0), max(hi, 0)], lo and hi the extremes of the finite tabulated
    values, which would otherwise swamp the output scale. A finite calibrated end stays as it is, as upstream's does
    (a Log of data near 0 keeps its calibrated minimum below the table's log of half an input step), unless
    `lut_output_range = table`: the table cannot give a value beyond [lo, hi], so that range loses nothing and
    gives a finer scale."""
    out = node.outputs[0]
    finite = values[torch.isfinite(values)]
    if finite.numel() == 0:
        raise node._error("the function has no finite value over the input range; it cannot be tabulated")
    lo, hi = min(float(finite.min()), 0.0), max(float(finite.max()), 0.0)
    table = ranges_of(node)
    r = table.get(out)
    if r.min is None or r.max is None:
        raise node._error(f"tensor '{out.name}' has no calibrated range; run calibration before quantization")
    r_min, r_max = float(r.min), float(r.max)
    to_table = layer_settings(node).lut_output_range == "table"

    def limited(end: float) -> float:
        return min(max(end, lo), hi) if to_table or abs(end) >= INFINITE_RANGE_END else end

    table.set(out, limited(r_min), limited(r_max))


def _lut_output_signed(node: PyNode) -> bool:
    signed = LUT_OUTPUT_SIGNED[str(node.type)]
    if signed is None:
        return out_range(node, node.inputs[0])[0] < 0
    return signed


def _poles_saturate(base: Callable[[torch.Tensor], torch.Tensor],
                    clamp: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tabulated function of `lut_output_range = calibrated`: a sample exactly at a pole keeps its infinite
    value, which saturates to the output's end as upstream's table does (log(0) -> qmin, 1/0 -> qmax); every other
    sample outside the domain takes the value at the clamped sample, never NaN."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        raw = base(x)
        return torch.where(torch.isinf(raw), raw, base(clamp(x)))
    return fn


def _quantize_lut(node: PyNode) -> None:
    """Output params from the calibrated range (limited to finite table values), then
    lut[i] = quantize_out(f(clamp_domain(dequantize_in(sample_i))))."""
    optype = str(node.type)
    inp, out = node.inputs[0], node.outputs[0]
    if optype in ROUNDING_OPS and _is_integer_tensor(node, inp):
        copy_params(node, out, inp)
        return
    base = LUT_FUNCTIONS[optype]
    clamp = domain_clamp(optype, tensor_scale(node, inp))
    fn = base if clamp is None else (lambda x: base(clamp(x)))
    if clamp is not None and layer_settings(node).lut_output_range == "calibrated":
        fn = _poles_saturate(base, clamp)
    if optype not in FINITE_VALUED:
        _limit_output_range(node, _lut_sample_values(node, fn))
    quantize_activation(node, out, _lut_output_signed(node))
    in_qmin, in_qmax = out_range(node, inp)
    out_qmin, out_qmax = out_range(node, out)
    table = build_lut(fn, tensor_scale(node, inp), tensor_zp(node, inp), in_qmin, in_qmax, range_bits(node, inp),
                      tensor_scale(node, out), tensor_zp(node, out), out_qmin, out_qmax,
                      lut_items_in_bits=int(layer_settings(node).lut_items_in_bits))
    set_constant(node, "lut", table, out.dtype)
    constants_first(node, ["lut"])


def _int_lut(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    inp, out = node.inputs[0], node.outputs[0]
    qmin, qmax = out_range(node, out)
    lut = node.get_constant("lut", optional=True)
    if lut is None:
        if str(node.type) in ROUNDING_OPS and _is_integer_tensor(node, inp) and _is_integer_tensor(node, out):
            return torch.clamp(x, qmin, qmax)
        raise node._error("missing required constant 'lut' (lut_type/_offset/_size/_shape)")
    in_qmin, _ = out_range(node, inp)
    y = lookup_lut(x, lut.betensor, in_qmin, range_bits(node, inp), lut.dtype.bits, lut.dtype.is_signed,
                   in_restricted=is_restricted(node, inp))
    return torch.clamp(y, qmin, qmax)


@TABLE_OPS.quantize
@INDEX_TABLE_OPS.quantize
@MODE_TABLE_OPS.quantize
@ROUNDING_TABLE_OPS.quantize
def unary_lut_quantize(self: PyNode) -> None:
    _check_one_in_one_out(self)
    _check_per_tensor_mode(self)
    _check_input_quantized(self)
    _quantize_lut(self)


def _lut_code_table(node: PyNode, x: torch.Tensor) -> Optional[Tuple[int, torch.Tensor]]:
    """(qmin, table) of a table op's integer results for every input code in [qmin, qmax] (at most
    CODE_TABLE_MAX_CODES of them), made once by `_int_lut` itself and memoized: the layer's forward is then one
    gather instead of the lookup's index arithmetic and clamps. None for a table of one table per channel (a 2-D
    `lut`) or an input without a range."""
    q_in = quant_of(node).get(node.inputs[0])
    lut = node.get_constant("lut", optional=True)
    if q_in.qmin is None or q_in.qmax is None or (lut is not None and lut.betensor.dim() != 1):
        return None
    qmin, qmax = int(q_in.qmin), int(q_in.qmax)
    if not 0 < qmax - qmin + 1 <= CODE_TABLE_MAX_CODES:
        return None
    table = memo(node, "lut_code_table", (layer_key(node), x.device),
                 lambda: _int_lut(node, torch.arange(qmin, qmax + 1, dtype=torch.int64, device=x.device)))
    return qmin, table


@TABLE_OPS.forward
@INDEX_TABLE_OPS.forward
@MODE_TABLE_OPS.forward
@ROUNDING_TABLE_OPS.forward
def unary_lut_forward(self: PyNode) -> None:
    """Float: the function itself. Integer: the table lookup (`_int_lut`), read from the memoized table of every
    input code's result where the input's range has one (`_lut_code_table`; a code outside it is looked up)."""
    _check_one_in_one_out(self)
    if self.quantized:
        x, _ = int_input(self)
        coded = _lut_code_table(self, x)
        y = take_codes(coded[1], x, coded[0]) if coded is not None else None
        self.outputs[0].betensor = y if y is not None else _int_lut(self, x)
        return
    self.outputs[0].betensor = LUT_FUNCTIONS[str(self.type)](self.inputs[0].betensor)


# --------------------------------------------------------------------------------------------- Abs, Negative
ABS_NEGATIVE = declare_op(
    ["Abs", "Negative"],
    constants={"scale": "per-channel requantization multipliers, in place of scale_value",
               "shift": "per-channel requantization shifts, in place of shift_value"},
    integer="|x+zp_in| or -(x+zp_in), one requantization s_out/s_in (Abs unsigned, Negative signed)",
    semantics=f"{SEMANTICS}#abs-negative")

INTEGER_NEGATIVE_BITS = (16, 32)
"""Bits of a signed integer Negative/Abs output: 16 for inputs of up to 8 bits (-(-128), -255 and |-128| as a signed
value need 9 bits), else 32 (32-bit inputs can saturate at the int32 bounds, e.g. -(-2^31) → 2^31 - 1)."""


@ABS_NEGATIVE.quantize
def abs_negative_quantize(self: PyNode) -> None:
    """Abs: unsigned output; Negative: signed. Quantized inputs: output params from the calibrated range and
    scale_value/shift_value for s_out / s_in. Integer inputs: integer outputs, multiplier 1, shift 0."""
    _check_one_in_one_out(self)
    _check_input_quantized(self)
    inp, out = self.inputs[0], self.outputs[0]
    in_qmin, in_qmax = out_range(self, inp)
    negative = str(self.type) == "Negative"
    if _is_integer_tensor(self, inp):
        bits = (in_qmax - in_qmin).bit_length()
        signed = negative or layer_settings(self).force_dtype_int
        if signed:
            bits = INTEGER_NEGATIVE_BITS[0] if bits <= 8 else INTEGER_NEGATIVE_BITS[1]
        set_qinvariant(self, out, bits, signed)
        store_requant(self, 1, 0, Dtype.UINT8, Dtype.INT8)
        return
    _check_per_tensor_mode(self)
    if negative:
        _quantize_negative(self, inp, out)
        return
    quantize_activation(self, out, negative)
    ratio = torch.tensor(tensor_scale(self, out), dtype=torch.float32) / torch.tensor(tensor_scale(self, inp),
                                                                               dtype=torch.float32)
    store_requant(self, *requant_scale_shift(self, ratio))


def _quantize_negative(node: PyNode, inp: PyTensor, out: PyTensor) -> None:
    """Negative of a quantized input, as upstream: the input's scale and bits, signed, and the zero point moved so
    that -(x + zp_in) - zp_out is the negated value on the same grid, exactly, without a requantization:
    zp_out = 1 - zp_in for a signed input (-(-128) lands on 127 instead of overflowing), -zp_in - qmax for an
    unsigned one."""
    q_in = params(node, inp)
    bits = int(q_in.qbits or inp.dtype.bits)
    qmin, qmax = integer_range(bits, True)
    zp_in = tensor_zp(node, inp)
    q = q_in.copy()
    q.zerop = 1 - zp_in if is_signed(node, inp) else -zp_in - qmax
    q.qbits, q.qmin, q.qmax = bits, qmin, qmax
    quant_of(node).set(out, q)
    out.dtype = int_dtype_for_bits(bits, True)
    out.ir_range = None


@ABS_NEGATIVE.forward
@keeps_float64(when=lambda node: str(node.type) == "Negative")
def abs_negative_forward(self: PyNode) -> None:
    _check_one_in_one_out(self)
    negative = str(self.type) == "Negative"
    if not self.quantized:
        x = self.inputs[0].betensor
        self.outputs[0].betensor = torch.neg(x) if negative else torch.abs(x)
        return
    x, zp_in = int_input(self)
    v = x + zp_in
    v = -v if negative else v.abs()
    out = self.outputs[0]
    qmin, qmax = out_range(self, out)
    if negative and "scale_value" not in self.params and "scale" not in self.constants:  # upstream's: no requant
        self.outputs[0].betensor = torch.clamp(v - tensor_zp(self, out), qmin, qmax)
        return
    mult, shift = requant_of(self)
    self.outputs[0].betensor = requantize_int(v, mult, shift, tensor_zp(self, out), qmin, qmax)


# --------------------------------------------------------------------------------------------- Sign, IsInf, IsNaN
SIGN_BITS = 8
"""Sign's output is an int8 integer tensor holding -1, 0 or 1."""

FLAG_BITS = 8
"""IsInf / IsNaN outputs are uint8 integer tensors holding 0 or 1."""

SIGN = declare_op("Sign", dtypes="float32 → int8 (integer tensor: -1, 0, 1)", integer="sign(x + zp_in), exact",
                  semantics=f"{SEMANTICS}#sign")
ISINF = declare_op(
    "IsInf", params={"detect_negative": Param(Bool(), "flag -inf", default=True),
                     "detect_positive": Param(Bool(), "flag +inf", default=True)},
    dtypes="float32 → uint8 (integer tensor: 0, 1)", integer="always 0 (a quantized tensor holds no inf)",
    semantics=f"{SEMANTICS}#isinf-isnan")
ISNAN = declare_op(
    "IsNaN", params={"detect_negative": Param(Bool(), "not read (IsInf's flag)"),
                     "detect_positive": Param(Bool(), "not read (IsInf's flag)")},
    dtypes="float32 → uint8 (integer tensor: 0, 1)", integer="always 0 (a quantized tensor holds no NaN)",
    semantics=f"{SEMANTICS}#isinf-isnan")


@SIGN.quantize
def sign_quantize(self: PyNode) -> None:
    _check_one_in_one_out(self)
    _check_input_quantized(self)
    set_qinvariant(self, self.outputs[0], SIGN_BITS, True)


@SIGN.forward
def sign_forward(self: PyNode) -> None:
    """Float: torch.sign. Quantized: sign(x + zp_in), exact because the input scale is positive."""
    _check_one_in_one_out(self)
    if not self.quantized:
        self.outputs[0].betensor = torch.sign(self.inputs[0].betensor)
        return
    x, zp_in = int_input(self)
    qmin, qmax = out_range(self, self.outputs[0])
    self.outputs[0].betensor = torch.clamp(torch.sign(x + zp_in), qmin, qmax)


@ISINF.quantize
@ISNAN.quantize
def isinf_isnan_quantize(self: PyNode) -> None:
    _check_one_in_one_out(self)
    if str(self.type) == "IsInf":
        _isinf_flags(self)
    set_qinvariant(self, self.outputs[0], FLAG_BITS, False)


@ISINF.forward
@ISNAN.forward
def isinf_isnan_forward(self: PyNode) -> None:
    """Float: 1 where the input is inf (of a detected sign) / NaN, else 0, as uint8. Quantized: always 0."""
    _check_one_in_one_out(self)
    x = self.inputs[0].betensor
    if str(self.type) == "IsInf":
        neg, pos = _isinf_flags(self)
        if self.quantized:
            flags = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        else:
            flags = ((x == -math.inf) & neg) | ((x == math.inf) & pos)
    else:
        flags = torch.zeros(x.shape, dtype=torch.bool, device=x.device) if self.quantized else torch.isnan(x)
    self.outputs[0].betensor = flags.to(torch.int64 if self.quantized else torch.uint8)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@ISINF.export
@ISNAN.export
def convert_isinf_isnan(g: QDQGraph, node: PyNode) -> None:
    """ONNX IsInf (with the layer's sign flags) / IsNaN of the dequantized input, as the uint8 flags: 0 everywhere,
    as the integer forward gives, since a dequantized integer is never inf or NaN."""
    _check_one_in_one_out(node)
    x, y = node.inputs[0], node.outputs[0]
    if str(node.type) == "IsInf":
        neg, pos = _isinf_flags(node)
        flags = g.add("IsInf", [g.float_value(x)], detect_negative=int(neg), detect_positive=int(pos))
    else:
        flags = g.add("IsNaN", [g.float_value(x)])
    emit_integers(g, node, y, g.add("Cast", [flags], to=DOUBLE), None)


UNARY_OPS: Dict[str, List[str]] = {
    "Abs": ["Abs"], "Negative": ["Neg"], "Exp": ["Exp"], "Log": ["Log"], "Erf": ["Erf"], "Sqrt": ["Sqrt"],
    "Rsqrt": ["Sqrt", "Reciprocal"], "Reciprocal": ["Reciprocal"], "Floor": ["Floor"], "Ceil": ["Ceil"],
    "Round": ["Round"], "Acos": ["Acos"], "Acosh": ["Acosh"], "Asin": ["Asin"], "Asinh": ["Asinh"],
    "Atan": ["Atan"], "Atanh": ["Atanh"], "Cosine": ["Cos"], "Cosh": ["Cosh"], "Sine": ["Sin"], "Sinh": ["Sinh"],
    "Tan": ["Tan"], "Sign": ["Sign"], "Square": ["Mul"],
}
"""Unary IR types → the chain of ONNX ops computing them (each applied to the previous result; Mul squares)."""


def _domain(g: QDQGraph, node: PyNode, value: str) -> str:
    """The clamp quantopt's table applies to a function with a restricted domain (ops.unary_math.domain_clamp):
    Reciprocal moves |x| < h to ±h, the others clip to their domain; the bounds are read off that clamp."""
    clamp = domain_clamp(str(node.type), tensor_scale(node, node.inputs[0]))
    if clamp is None:
        return value
    if str(node.type) == "Reciprocal":
        h = float(clamp(torch.tensor(0.0)))
        near_zero = g.add("Less", [g.add("Abs", [value]), float_const(g, node, "h", h)])
        signed_h = g.add("Where", [g.add("Less", [value, float_const(g, node, "zero", 0.0)]),
                                   float_const(g, node, "neg_h", -h), float_const(g, node, "pos_h", h)])
        return g.add("Where", [near_zero, signed_h, value])
    lo, hi = (float(clamp(torch.tensor(v))) for v in (-math.inf, math.inf))
    bounds = [float_const(g, node, "min", lo) if math.isfinite(lo) else "",
              float_const(g, node, "max", hi) if math.isfinite(hi) else ""]
    return g.add("Clip", [value, *bounds])


@TABLE_OPS.export
@INDEX_TABLE_OPS.export
@MODE_TABLE_OPS.export
@ROUNDING_TABLE_OPS.only("Floor", "Ceil", "Round").export
@ABS_NEGATIVE.export
@SIGN.export
def convert_unary(g: QDQGraph, node: PyNode) -> None:
    """The float function (after quantopt's domain clamp for Log, Sqrt, Reciprocal, ...)."""
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    if onnx_exact.try_table(g, node, perm):
        return
    value = g.float_value(x, perm)

    def function(v: str) -> str:
        for op in UNARY_OPS[str(node.type)]:
            v = g.add(op, [v, v] if op == "Mul" else [v])  # Square: x · x
        return v

    if "lut" in node.constants:
        clamped = _domain(g, node, value)
        if clamped != value and layer_settings(node).lut_output_range == "calibrated":
            # a sample at a pole keeps its infinite value and saturates, as the table's entry does (_poles_saturate)
            clamped = g.add("Where", [g.add("IsInf", [function(value)]), value, clamped])
        value = clamped
    value = function(value)
    if "lut" not in node.constants and "scale_value" in node.params:  # Abs, Negative: a multiplier s_out / s_in
        value = g.rescale(value, requant_factor(node, tensor_scale(node, x)))
    g.quantize(y, value, perm, exact="lut" in node.constants)
