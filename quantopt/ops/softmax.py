"""The Softmax family along `axis` (default -1, negative counts from the end): Softmax, LogSoftmax, Hardmax.

Softmax has two integer methods, recorded in the quantized IR as `quantize_method` (docs/semantics/softmax.md):
LUT (upstream's, docs/integer-semantics.md): an exp table indexed by x - max(x) (uint32 constant `lut`), an int64
sum along the axis, an integer division, then the output requantization `scale_value/shift_value`; FAST_EXP: the
exponent in base 2 from an input multiplier (`input_scale_value/input_shift_value`), powers of two from a small
fraction table, an int64 sum, its log2 from a Q15 table and a second power of two (upstream's log-domain form).
LUT is chosen when the Softmax feeds NMS/Sort/ArgMinMax/TopK/InTopK or is a graph output, FAST_EXP otherwise; an
explicit `quantize_method` param wins.
LogSoftmax has two integer forms, chosen by the cfg field `logsoftmax_integer_form` and recognized in an IR by its
constants: upstream's (the default, `lut_exp`): a float32 exp table, a float32 sum and log, the output range fixed
to [-16, 0]; exact (`log2_lut`): the power-of-two sum of FAST_EXP minus its table log2, requantized. Hardmax
outputs exact 0/1 integers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from ..calibration.inf_mask import SOFTMAX_MASK_PARAM, has_low_mask
from ..errors import UnsupportedError
from ..graph.memo import Same, memo
from ..graph.node import PyNode
from ..graph.tables import ranges_of, statistics_of
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.hardware import (
    AIFF_MULTIPLIER_BITS,
    LOGSOFTMAX_UPSTREAM_RANGE,
    SOFTMAX_DIVIDEND_BITS,
    SOFTMAX_FAST_EXP_MULTIPLIER_BITS,
    SOFTMAX_LUT_AUTO_VALUE_BITS,
    SOFTMAX_ROW_BLOCK,
    SOFTMAX_SMALL_AXIS,
    softmax_pow2_out_q,
)
from ..quant.lut import lookup_float_lut, lookup_lut, lut_size
from ..quant.params import QuantMode, QuantParams, dequantize, integer_range, linear_quant_params
from ..quant.requant import range_dtype, requantize_int, scale_shift
from ..quant.rounding import bit_length
from ..registry import declare_op
from ..registry.schema import Bool, DtypeName, Floats, Int, Param, Text, quantized
from ._float_sum import axis_sum
from ._lut_int import ceil_log2, constants_first, int_input, range_bits
from ._quant import (
    activation_mode,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_params,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param
from .onnx_build.exact import DOUBLE, INT64, MAX_TABLE_BITS, bit_length_int64, codes, double, requantize
from .onnx_build.float_forms import requant_factor, unary_perm
from .onnx_build.perms import Perm
from .onnx_build.qdq_graph import FLOAT, QDQGraph, node_error

LUT_VALUE_BITS = SOFTMAX_LUT_AUTO_VALUE_BITS
"""Table values are e^(x - max) * (2^20 - 1): the value bits upstream uses when it selects the LUT method itself
(`[2, 20]`), the case of every golden Softmax."""

SOFTMAX_METHODS = ("LUT", "FAST_EXP")

FAST_EXP_ADJUST_Q = 8
"""Fraction bits of the base-2 exponent that quantopt writes for FAST_EXP and LogSoftmax (`adjust_q`). Upstream's
automatic choice is 1 (a power-of-two result, cosine about 0.97 on typical logits); 8 adds a 256-entry 2^f table
and keeps the result within about 0.3 % of e^x. IRs with adjust_q 0 or 1 still run upstream's power-of-two path."""

FAST_EXP_MAX_ADJUST_Q = 15

_PER_CHANNEL_REFUSED = "per-channel requantization: refused, the integer forward takes one scale_value/shift_value"


# --------------------------------------------------------------------------------------------- Softmax
SOFTMAX = declare_op(
    "Softmax",
    params={
        "axis": Param(Int(), "the axis normalized (negative counts from the end)", default=-1),
        "quantize_method": Param(Text(choices=SOFTMAX_METHODS), "the integer method, written when quantized; when "
                                 "absent, LUT for a graph output or a Softmax feeding NMS/Sort/ArgMinMax/TopK/InTopK, "
                                 "else FAST_EXP"),
        "adjust_q": Param(Int(lo=0, hi=FAST_EXP_MAX_ADJUST_Q), "FAST_EXP: fraction bits of the base-2 exponent, 0 or "
                          "1 (upstream's power-of-two path) or 8..15 (default 8, written when quantized)"),
        "input_scale_value": quantized(Int(lo=0), "FAST_EXP: the multiplier of log2(e)/s_in"),
        "input_shift_value": quantized(Int(), "FAST_EXP: the shift of log2(e)/s_in"),
        "input_scale_type": quantized(DtypeName(), "the dtype of input_scale_value"),
        "input_shift_type": quantized(DtypeName(), "the dtype of input_shift_value"),
        "pow2_out_q": quantized(Int(lo=0), "FAST_EXP: fraction bits of the exponential terms, 31 - floor(log2(axis "
                                           "length))"),
        "mask_saturated_input": quantized(Bool(), "true when the input is an attention mask: inputs at the input's "
                                                  "qmin contribute 0 to rows whose maximum is above it"),
        "lut_mode": quantized(Text(), "upstream's float-table approximation (EXP); not read"),
    },
    constants={"lut": "LUT: the exp table (uint32), written when quantized",
               "pow2_lut": "FAST_EXP with adjust_q >= 8: the 2^f table (uint16), written when quantized",
               "log2_lut": "not read", "float_lut": "upstream's float table; not read",
               "scale": _PER_CHANNEL_REFUSED, "shift": _PER_CHANNEL_REFUSED},
    integer="LUT: exp table, sum, division; FAST_EXP: base-2 exponent with a 2^f table, sum, table log2, 2^f of the "
            "difference",
    semantics="docs/semantics/softmax.md#softmax")


def _axis(node: PyNode, rank: int) -> int:
    return axis_param(node, node.get_param("axis", optional=True, default_value=-1), rank)


def softmax_exp_lut(in_scale: float, in_zp: int, in_bits: int, lut_items_in_bits: int,
                    value_bits: int = LUT_VALUE_BITS) -> torch.Tensor:
    """The exp table, int64 (stored as uint32): entry i = clamp(round(exp(d_i/s + ln(2^value_bits - 1))), 0,
    2^value_bits - 1) where d_i are 2^min(in_bits, lut_items_in_bits) float32 points spread evenly over
    [-(2^in_bits - 1), 0] (the possible values of x - max(x)).

    Evaluated in float32 exactly as upstream, which goes through the zero point and cancels it:
    ((d_i + zp) * (1/s)) + (ln(2^v - 1) - zp/s). This reproduces every golden Softmax table bit for bit.
    """
    steps = lut_size(in_bits, lut_items_in_bits)
    top = 2 ** int(in_bits) - 1
    max_val = 2 ** int(value_bits) - 1
    s32 = torch.tensor(in_scale, dtype=torch.float32)
    offset = torch.log(torch.tensor(float(max_val), dtype=torch.float32)) - torch.tensor(float(in_zp)) / s32
    points = torch.linspace(0.0, float(top), steps=steps) - top
    lut = torch.exp(dequantize(points, in_scale, in_zp) + offset)
    return torch.clamp(torch.round(lut), 0, max_val).to(torch.int64)


def _softmax_lut_quantize(self: PyNode) -> None:
    """LUT method (upstream `quantize_method=LUT`): output unsigned from its calibrated range; exp table over the
    input codes; `scale_value/shift_value` approximate s_out with as many multiplier bits as the output has."""
    inp, out = self.inputs[0], self.outputs[0]
    s = layer_settings(self)
    quantize_activation(self, out, False)
    lut = softmax_exp_lut(tensor_scale(self, inp), tensor_zp(self, inp), range_bits(self, inp),
                          int(s.lut_items_in_bits))
    set_constant(self, "lut", lut, range_dtype(0, 2 ** LUT_VALUE_BITS - 1))
    constants_first(self, ["lut"])
    self.params["quantize_method"] = "LUT"
    store_requant(self, *scale_shift(tensor_scale(self, out), int(params(self, out).qbits),
                                     force_shift_positive=s.force_shift_positive))


def _table_and_max(lut: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The exp table as int64 and max(1, its largest entry): what every LUT Softmax forward reads from it."""
    table = lut.to(torch.int64)
    return table, max(1, int(table.max())) if table.numel() else 1


def _softmax_lut_forward(node: PyNode, x: torch.Tensor, axis: int, rows: int) -> torch.Tensor:
    """e = lut[x - max + 2^b - 1] (interpolated for wide inputs), S = Σe (int64), then either
    z = floor((e·2^k + floor(S/2)) / S) requantized with (M, shift + k), k = 31 - ceil(log2(max lut)) (short rows)
    or r = floor(M·2^k / S) and e·r requantized with (1, shift + k), k = 31 - ceil(log2 M) (otherwise). `x`: the
    input's codes, or some of its rows; `rows`: the whole input's row count (which decides the form)."""
    inp, out = node.inputs[0], node.outputs[0]
    lut = node.get_constant("lut")
    table, lut_max = memo(node, "softmax_lut", Same(lut.betensor),
                          lambda: _table_and_max(lut.betensor))
    bits = range_bits(node, inp)
    if x.numel() == 0:
        return x.clone()
    top = x.amax(dim=axis, keepdim=True)
    shifted = x - top + (2 ** bits - 1)
    e = masked_terms(node, x, top, lookup_lut(shifted, table, 0, bits, lut.dtype.bits, lut.dtype.is_signed))
    total = e.sum(dim=axis, keepdim=True)
    den = torch.clamp(total, min=1)
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node._error("Softmax needs one scale_value/shift_value, not per-channel constants")
    base = SOFTMAX_DIVIDEND_BITS - 1 if lut_max == 1 else SOFTMAX_DIVIDEND_BITS
    qmin, qmax = out_range(node, out)
    zp = tensor_zp(node, out)
    axis_len = int(x.shape[axis])
    if axis_len < SOFTMAX_SMALL_AXIS and rows % SOFTMAX_ROW_BLOCK == 0 and bits <= 8:
        k = base - ceil_log2(lut_max)
        z = torch.div((e << k) + (total >> 1), den, rounding_mode="floor")
        return requantize_int(z, mult, shift + k, zp, qmin, qmax)
    k = base - ceil_log2(mult)
    recip = torch.div(torch.tensor(mult << k, dtype=torch.int64), den, rounding_mode="floor")
    return requantize_int(e * recip, 1, shift + k, zp, qmin, qmax)


# --------------------------------------------------------------------------------------------- method choice
LUT_METHOD_CONSUMERS = ("NMS", "Sort", "ArgMinMax", "TopK", "InTopK")
"""Layer types whose Softmax producer keeps the LUT method: they compare probabilities, and the LUT method keeps
more distinct output codes near the top (upstream pass `tune_op_softmax`)."""

POW2_TABLE_BITS = 8
"""The 2^f table (`pow2_lut`) and the log2 table (`log2_lut`) have 2^8 entries, indexed by the top 8 fraction bits."""

POW2_VALUE_BITS = 15
"""pow2_lut[j] = round(2^(j/256) * 2^15): values in [2^15, 2^16), uint16; the entry past the end is 2^16."""

LOG2_VALUE_BITS = 16
"""log2_lut[j] = round(log2(1 + j/256) * 2^16): values in [0, 2^16), uint16; the entry past the end is 2^16."""

LOG2_MANTISSA_BITS = 16
"""The sum's mantissa keeps 16 fraction bits before the log2 table lookup."""

LOG2E = 1.4426950408889634

SIMPLE_LOG2_HALF = 1518500250
"""floor(sqrt(2)/2 * 2^31): a normalized sum above it rounds its Q1 log2 up by one half (upstream `simple_log2`)."""


def softmax_method(node: PyNode) -> str:
    """`quantize_method` of a Softmax: the param when the IR gives one, else LUT when the output is a graph output
    or feeds NMS/Sort/ArgMinMax/TopK/InTopK, else FAST_EXP. Every golden Softmax is a graph output (LUT)."""
    given = node.params.get("quantize_method")
    if given is not None:
        method = str(given).upper()
        if method not in SOFTMAX_METHODS:
            raise node._error(f"quantize_method must be one of {', '.join(SOFTMAX_METHODS)}, got {given!r}")
        return method
    out = node.outputs[0]
    graph = node.graph
    if graph is None or any(t.name == out.name for t in graph.output_tensors):
        return "LUT"
    for consumer in graph.nodes:
        if str(consumer.type) in LUT_METHOD_CONSUMERS and any(t.name == out.name for t in consumer.inputs):
            return "LUT"
    return "FAST_EXP"


@SOFTMAX.quantize
def softmax_quantize(self: PyNode) -> None:
    """Chooses the method (`softmax_method`) and quantizes with it; both write `quantize_method`."""
    inp = self.inputs[0]
    if params(self, inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    if layer_settings(self).q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' (Softmax): per-channel activation quantization is not "
                               "supported (upstream neither)")
    _axis(self, len(inp.ir_shape))
    self.params.pop(SOFTMAX_MASK_PARAM, None)
    if softmax_method(self) == "LUT":
        _softmax_lut_quantize(self)
    else:
        _softmax_fast_exp_quantize(self)
    if has_low_mask(statistics_of(self).get(inp)):
        self.params[SOFTMAX_MASK_PARAM] = True


# --------------------------------------------------------------------------------------------- FAST_EXP helpers
def pow2_table() -> torch.Tensor:
    """pow2_lut (int64, stored uint16): round(2^(j/256) * 2^15), j = 0..255, computed in float64."""
    j = torch.arange(2 ** POW2_TABLE_BITS, dtype=torch.float64)
    return torch.round(torch.pow(2.0, j / 2 ** POW2_TABLE_BITS) * 2 ** POW2_VALUE_BITS).to(torch.int64)


def log2_table() -> torch.Tensor:
    """log2_lut (int64, stored uint16): round(log2(1 + j/256) * 2^16), j = 0..255, computed in float64."""
    j = torch.arange(2 ** POW2_TABLE_BITS, dtype=torch.float64)
    return torch.round(torch.log2(1.0 + j / 2 ** POW2_TABLE_BITS) * 2 ** LOG2_VALUE_BITS).to(torch.int64)


def _table_interp(table: torch.Tensor, index: torch.Tensor, index_bits: int, end_value: int) -> torch.Tensor:
    """Table over a 2^index_bits domain with 2^T entries (T <= index_bits): hi = index >> b, lo = index - (hi << b),
    table[hi] + (((table[hi + 1] - table[hi]) * lo) >> b), b = index_bits - T; the entry past the end is
    `end_value`. int64, floor interpolation."""
    t = table.to(device=index.device, dtype=torch.int64).flatten()
    tbits = t.numel().bit_length() - 1
    if t.numel() != 2 ** tbits or tbits > index_bits:
        raise ValueError(f"table of {t.numel()} entries does not fit a {index_bits}-bit index")
    padded = torch.cat([t, torch.tensor([end_value], dtype=torch.int64, device=t.device)])
    b = index_bits - tbits
    hi = index >> b
    lo = index - (hi << b)
    return padded[hi] + (((padded[hi + 1] - padded[hi]) * lo) >> b)


def _shift_floor(v: torch.Tensor, shift: int) -> torch.Tensor:
    """v >> shift (floor) for shift >= 0, v << -shift otherwise."""
    return v >> shift if shift >= 0 else v << (-shift)


def _log2_domain(node: PyNode, x: torch.Tensor, axis: int, frac_bits: int) -> torch.Tensor:
    """u = floor((x - max(x)) * M / 2^(N - F)) with (M, N) = (input_scale_value, input_shift_value), F = frac_bits:
    log2(e) * (x - max) / s_in in units of 2^-F, always <= 0."""
    return _log2_of_difference(node, x - x.amax(dim=axis, keepdim=True), frac_bits)


def _log2_of_difference(node: PyNode, d: torch.Tensor, frac_bits: int) -> torch.Tensor:
    mult = _int_param(node, "input_scale_value")
    shift = _int_param(node, "input_shift_value")
    return _shift_floor(d * mult, shift - frac_bits)


def _pow2_terms(node: PyNode, u: torch.Tensor, frac_bits: int, out_q: int) -> torch.Tensor:
    """e = floor(p * 2^(out_q + i - 15)) with i = u >> F, p = pow2_lut interpolated at u - (i << F); e <= 2^out_q."""
    table = node.get_constant("pow2_lut").betensor.to(torch.int64)
    i = u >> frac_bits
    f = u - (i << frac_bits)
    p = _table_interp(table, f, frac_bits, 2 ** (POW2_VALUE_BITS + 1))
    right = torch.clamp(POW2_VALUE_BITS - i, max=62)
    return (p << out_q) >> right


def _int_param(node: PyNode, key: str) -> int:
    value = node.get_param(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    return int(value)


def _adjust_q(node: PyNode, allow_simple: bool) -> int:
    q = _int_param(node, "adjust_q")
    ok = (allow_simple and q in (0, 1)) or POW2_TABLE_BITS <= q <= FAST_EXP_MAX_ADJUST_Q
    if not ok:
        allowed = "0, 1 or 8..15" if allow_simple else "8..15"
        raise node._error(f"adjust_q must be {allowed}, got {q}")
    return q


def _input_log2e_requant(node: PyNode, mult_bits: int) -> None:
    """input_scale_value/input_shift_value: log2(e)/s_in as a multiplier of `mult_bits` bits and a shift."""
    inp = node.inputs[0]
    s = layer_settings(node)
    m, sh, _, sh_dtype = scale_shift(LOG2E / tensor_scale(node, inp), mult_bits,
                                     force_shift_positive=s.force_shift_positive)
    node.params["input_scale_value"] = int(m)
    node.params["input_scale_type"] = Dtype.UINT16
    node.params["input_shift_value"] = int(sh)
    node.params["input_shift_type"] = sh_dtype


def _axis_len_ir(node: PyNode) -> int:
    shape = list(node.inputs[0].ir_shape)
    return int(shape[_axis(node, len(shape))])


# --------------------------------------------------------------------------------------------- FAST_EXP
def _softmax_fast_exp_quantize(self: PyNode) -> None:
    """FAST_EXP: output unsigned with the fixed range [0, 1] (symmetric, its scale is 2^b - 1 for b bits);
    log2(e)/s_in with a 13-bit multiplier; pow2_out_q = 31 - floor(log2(axis length)); adjust_q fraction bits
    (default 8, with the 2^f table `pow2_lut` and the output requantization scale_value/shift_value)."""
    out = self.outputs[0]
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    signed = bool(s.force_dtype_int)
    mode = activation_mode(self, bits).to_symmetric()
    if activation_mode(self, bits).is_full_range:
        mode = QuantMode.make("per_tensor", False, True)
    set_params(self, out, linear_quant_params(0.0, 1.0, bits, mode, signed), bits)
    self.params["quantize_method"] = "FAST_EXP"
    self.params.setdefault("adjust_q", FAST_EXP_ADJUST_Q)
    adjust_q = _adjust_q(self, allow_simple=True)
    _input_log2e_requant(self, SOFTMAX_FAST_EXP_MULTIPLIER_BITS)
    self.params["pow2_out_q"] = softmax_pow2_out_q(_axis_len_ir(self))
    if adjust_q >= POW2_TABLE_BITS:
        set_constant(self, "pow2_lut", pow2_table(), Dtype.UINT16)
        constants_first(self, ["pow2_lut"])
        store_requant(self, *scale_shift(tensor_scale(self, out), bits, force_shift_positive=s.force_shift_positive))


def _softmax_fast_exp_forward(node: PyNode, x: torch.Tensor, axis: int) -> torch.Tensor:
    """Table path (adjust_q >= 8, upstream's log-domain form): e = 2^(u) terms from pow2_lut, S = clamp(Σe),
    L = log2(S / 2^P) from the Q15 log2 table, y = 2^(b_out + u - L) from pow2_lut again.
    Power-of-two path (adjust_q 0 or 1, upstream's): see docs/semantics/softmax.md#fast_exp. `x`: the input's
    codes, or some of its rows."""
    out = node.outputs[0]
    if x.numel() == 0:
        return x.clone()
    adjust_q = _adjust_q(node, allow_simple=True)
    out_q = _int_param(node, "pow2_out_q")
    qmin, qmax = out_range(node, out)
    zp = tensor_zp(node, out)
    if adjust_q < POW2_TABLE_BITS:
        return _softmax_pow2_path(node, x, axis, adjust_q, out_q, zp, qmin, qmax)
    top = x.amax(dim=axis, keepdim=True)
    tables = fast_exp_tables(node, x.device)
    if tables is not None:
        return _fast_exp_by_tables(node, x, axis, top, tables, adjust_q, out_q, (zp, qmin, qmax))
    u = _log2_of_difference(node, x - top, adjust_q)
    e = _pow2_lookup(_pow2_lut(node), u, adjust_q, out_q)
    mask, lead, mantissa = _term_sum(node, x, top, e, axis)
    log2_sum = ((log2_q15_table().to(mantissa.device)[mantissa] << 15) >> (30 - adjust_q)) \
        - ((lead - (30 - out_q)) << adjust_q)
    y = _pow2_lookup(_pow2_lut(node), u - log2_sum, adjust_q, range_bits(node, out))
    if mask is not None:
        y.masked_fill_(mask, 0)
    return y.sub_(zp).clamp_(qmin, qmax)


def _term_sum(node: PyNode, x: torch.Tensor, top: torch.Tensor, e: torch.Tensor,
              axis: int) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The FAST_EXP sum S = clamp(sum of the terms e, 1, 2^31 - 1) of each row, the masked terms (`saturated_mask`)
    zeroed in `e` first: (the mask or None, the left shifts that bring S into [2^30, 2^31), the 8-bit mantissa index
    of S so shifted), what log2_sum is made of."""
    mask = saturated_mask(node, x, top)
    if mask is not None:
        e.masked_fill_(mask, 0)
    total = torch.clamp(e.sum(dim=axis, keepdim=True), 1, 2 ** 31 - 1)
    lead = 31 - bit_length(total)
    mantissa = ((total << lead) >> (30 - POW2_TABLE_BITS)) & (2 ** POW2_TABLE_BITS - 1)
    return mask, lead, mantissa


def _fast_exp_by_tables(node: PyNode, x: torch.Tensor, axis: int, top: torch.Tensor, tables: FastExpTables,
                        adjust_q: int, out_q: int, output: Tuple[int, int, int]) -> torch.Tensor:
    """The FAST_EXP table path of `_softmax_fast_exp_forward` by its tables (`fast_exp_tables`): u and e looked up
    by x - max(x), log2_sum by S's mantissa, the output by u - log2_sum from a table that already holds
    clamp(2^v - zp, qmin, qmax) (`output` = (zp, qmin, qmax)), so that the zero point and the clamp cost no pass
    over the output; a masked input (`saturated_mask`) gives the output clamp(-zp, qmin, qmax), as 0 - zp clamped.
    The same integers as the arithmetic form, in eleven passes over the input instead of sixteen."""
    zp, qmin, qmax = output
    index = torch.sub(x, top - tables.top_index).reshape(-1)  # x - max(x) + top_index; index_select beats take
    u = tables.u.index_select(0, index).reshape(x.shape)
    e = tables.e.index_select(0, index).reshape(x.shape)
    mask, lead, mantissa = _term_sum(node, x, top, e, axis)
    log2_sum = tables.log2_first[mantissa] - ((lead - (30 - out_q)) << adjust_q)
    # u - log2_sum <= 0 (the tables' condition); 2^v is 0 below tables.lo, the table's first entry
    outputs = memo(node, "softmax_output_table", (Same(tables.y), zp, qmin, qmax),
                   lambda: torch.clamp(tables.y - zp, qmin, qmax))
    # u and e are this function's own: v overwrites u, the output overwrites e (fewer new maps to write)
    v = u.sub_(log2_sum + tables.lo).clamp_(min=0).reshape(-1)
    y = torch.index_select(outputs, 0, v, out=e.reshape(-1)).reshape(x.shape)
    if mask is not None:
        y.masked_fill_(mask, min(max(-zp, qmin), qmax))
    return y


def _pow2_lut(node: PyNode) -> torch.Tensor:
    table = node.get_constant("pow2_lut").betensor.to(torch.int64).flatten()
    if table.numel() != 2 ** POW2_TABLE_BITS:
        raise node._error(f"pow2_lut must have {2 ** POW2_TABLE_BITS} entries, got {table.numel()}")
    return table


def _pow2_lookup(table: torch.Tensor, v: torch.Tensor, frac_bits: int, out_bits: int) -> torch.Tensor:
    """Upstream's Pow2 for v <= 0 in units of 2^-F: i = v >> F, j = (v - (i << F)) >> (F - 8),
    floor(table[j] * 2^15 / 2^(30 - out_bits - i)), no interpolation (a negative shift multiplies)."""
    i = v >> frac_bits
    j = (v - (i << frac_bits)) >> (frac_bits - POW2_TABLE_BITS)
    shift = 30 - out_bits - i
    t = table.to(j.device)[j] << 15
    return torch.where(shift >= 0, t >> torch.clamp(shift, 0, 62), t << torch.clamp(-shift, 0, 30))


def log2_q15_table() -> torch.Tensor:
    """round(log2(1 + j/256) * 2^15), j = 0..255 (int64, float64 evaluation): the log2 table of the FAST_EXP
    Softmax table path (upstream's Q15 table, equal entry by entry)."""
    j = torch.arange(2 ** POW2_TABLE_BITS, dtype=torch.float64)
    return torch.round(torch.log2(1.0 + j / 2 ** POW2_TABLE_BITS) * 2 ** 15).to(torch.int64)


def fast_exp_terms(node: PyNode, d: torch.Tensor) -> torch.Tensor:
    """The FAST_EXP table path's exponential terms e for differences d = x - max(x) (int64, <= 0): a function of
    each difference alone, so an exporter can tabulate it."""
    adjust_q = _adjust_q(node, allow_simple=False)
    u = _log2_of_difference(node, d, adjust_q)
    return _pow2_lookup(_pow2_lut(node), u, adjust_q, _int_param(node, "pow2_out_q"))


FAST_EXP_TABLE_MAX_ADJUST_Q = 12
"""Largest adjust_q whose output table (2^v for v in [lo, 0]: (output bits + 17) << adjust_q entries) is made."""


@dataclass(frozen=True)
class FastExpTables:
    """What `_softmax_fast_exp_forward` reads of the FAST_EXP table path, tabulated (int64): u and e for every
    difference d = x - max(x) in [-top_index, 0] (index d + top_index), the first term of log2_sum for every 8-bit
    mantissa index, and the output 2^v for every v in [lo, 0] (index v - lo; below lo it is 0)."""

    u: torch.Tensor
    e: torch.Tensor
    log2_first: torch.Tensor
    y: torch.Tensor
    lo: int
    top_index: int


def fast_exp_tables(node: PyNode, device: torch.device) -> Optional[FastExpTables]:
    """The FAST_EXP table path of a Softmax as tables on `device` (memoized per layer on what they depend on: four
    params, pow2_lut and the input and output ranges' bits), for its forward and its export; None where the
    arithmetic stays: the power-of-two path, an input range beyond 2^16 codes, adjust_q beyond
    FAST_EXP_TABLE_MAX_ADJUST_Q, pow2_out_q outside 0..30, or a row maximum whose term is not 2^pow2_out_q (only
    with it is u - log2_sum <= 0, the output table's domain). Why: the arithmetic of u and e is a dozen int64 passes
    over the input; the lookups are two."""
    def build() -> Optional[FastExpTables]:
        adjust_q = _adjust_q(node, allow_simple=True)
        out_q = _int_param(node, "pow2_out_q")
        bits = range_bits(node, node.inputs[0])
        if adjust_q < POW2_TABLE_BITS or adjust_q > FAST_EXP_TABLE_MAX_ADJUST_Q or bits > MAX_TABLE_BITS \
                or not 0 <= out_q <= 30:
            return None
        table = _pow2_lut(node)
        d = torch.arange(-(2 ** bits - 1), 1, dtype=torch.int64)
        u = _log2_of_difference(node, d, adjust_q)
        e = _pow2_lookup(table, u, adjust_q, out_q)
        if int(e[-1]) != 1 << out_q:
            return None
        log2_first = (log2_q15_table() << 15) >> (30 - adjust_q)
        out_bits = range_bits(node, node.outputs[0])
        lo = -((out_bits + 17) << adjust_q)  # 2^15 * 2^16 >> (30 - out_bits + out_bits + 17) = 0
        y = _pow2_lookup(table, torch.arange(lo, 1, dtype=torch.int64), adjust_q, out_bits)
        return FastExpTables(u.to(device), e.to(device), log2_first.to(device), y.to(device), lo, 2 ** bits - 1)

    lut = node.get_constant("pow2_lut", optional=True)
    key = (None if lut is None else Same(lut.betensor),
           tuple(node.params.get(k) for k in ("adjust_q", "pow2_out_q", "input_scale_value", "input_shift_value")),
           range_bits(node, node.inputs[0]), range_bits(node, node.outputs[0]), str(device))
    return memo(node, "softmax_fast_exp_tables", key, build)


def _softmax_pow2_path(node: PyNode, x: torch.Tensor, axis: int, adjust_q: int, out_q: int, zp: int, qmin: int,
                       qmax: int) -> torch.Tensor:
    """Upstream's adjust_q 0/1 path: l = floor((x - max) * M / 2^N), y = 2^(P + l) (0 if negative),
    S = clamp(Σy, 1, 2^31 - 1), L = Q-adjust_q log2 of S / 2^P by leading zeros, out = 2^(((l + b) << q) - L) >> q)."""
    l_ = _log2_domain(node, x, axis, 0)
    p = out_q + l_
    y = torch.where(p >= 0, torch.ones_like(p) << torch.clamp(p, 0, 62), torch.zeros_like(p))
    y = masked_terms(node, x, x.amax(dim=axis, keepdim=True), y)
    total = torch.clamp(y.sum(dim=axis, keepdim=True), 1, 2 ** 31 - 1)
    lead = 31 - bit_length(total)
    norm = total << lead
    half = (norm > SIMPLE_LOG2_HALF).to(torch.int64) if adjust_q else torch.zeros_like(norm)
    log2_sum = half - ((lead - (30 - out_q)) << adjust_q)
    bits = range_bits(node, node.outputs[0])
    z = (((l_ + bits) << adjust_q) - log2_sum) >> adjust_q
    v = torch.where(z >= 0, torch.ones_like(z) << torch.clamp(z, 0, 62), torch.zeros_like(z))
    v = masked_terms(node, x, x.amax(dim=axis, keepdim=True), v)
    return torch.clamp(v - zp, qmin, qmax)


def masks_saturated_input(node: PyNode) -> bool:
    """`mask_saturated_input` (written for a Softmax whose input is an attention mask, calibration/inf_mask.py):
    true, or 1 as the declared `Bool` kind reads it."""
    value = node.params.get(SOFTMAX_MASK_PARAM, False)
    return value is True or (isinstance(value, int) and value == 1) or str(value).lower() == "true"


def masked_terms(node: PyNode, x: torch.Tensor, top: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """With `mask_saturated_input`, the exponential terms of inputs equal to the input's qmin are 0 in rows whose
    maximum `top` is above qmin (a fully masked row keeps its equal terms: uniform, as float gives); else `e`."""
    mask = saturated_mask(node, x, top)
    return e if mask is None else torch.where(mask, torch.zeros_like(e), e)


def saturated_mask(node: PyNode, x: torch.Tensor, top: torch.Tensor) -> Optional[torch.Tensor]:
    """Where `masked_terms` zeroes a term (None without `mask_saturated_input`): for a caller that masks several
    terms of the same input."""
    if not masks_saturated_input(node):
        return None
    qmin = int(params(node, node.inputs[0]).qmin)
    mask = x == qmin
    # a row whose maximum is qmin is wholly masked and keeps its terms; without one the row test is no pass at all
    return mask if x.device.type == "cpu" and bool((top > qmin).all()) else mask.logical_and_(top > qmin)


SOFTMAX_BAND_ELEMENTS = 1 << 16
"""Input elements (512 KiB of int64) a Softmax over the last axis normalizes at once (`by_row_bands`)."""


def by_row_bands(fn: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, axis: int,
                 band: int = SOFTMAX_BAND_ELEMENTS) -> torch.Tensor:
    """fn(x, axis) computed on bands of whole rows where `axis` is the last of a contiguous CPU tensor larger than
    two bands: every row is normalized alone, so the bands give the same integers, and each band's dozen int64
    passes stay in the cache (a 12x512x512 attention map is 25 MiB per pass). Other tensors: fn(x, axis)."""
    n = int(x.shape[axis]) if x.dim() else 0
    if (x.dim() == 0 or axis != x.dim() - 1 or x.numel() <= 2 * band or n > band or not x.is_contiguous()
            or x.device.type != "cpu"):
        return fn(x, axis)
    rows = x.reshape(-1, n)
    step = max(1, band // n)
    out: Optional[torch.Tensor] = None
    for r0 in range(0, int(rows.shape[0]), step):
        part = fn(rows[r0:r0 + step], 1)
        if out is None:
            out = torch.empty((int(rows.shape[0]), n), dtype=part.dtype, device=part.device)
        out[r0:r0 + step] = part
    assert out is not None
    return out.reshape(x.shape)


def softmax_integer_forward(node: PyNode) -> torch.Tensor:
    """Integer forward of a quantized Softmax, by its `quantize_method` (LUT when absent, as older IRs), in bands
    of rows (`by_row_bands`)."""
    method = str(node.get_param("quantize_method", optional=True, default_value="LUT")).upper()
    x, _ = int_input(node)
    axis = _axis(node, x.dim())
    if method == "LUT":
        rows = x.numel() // max(1, int(x.shape[axis])) if x.dim() else 1
        return by_row_bands(lambda part, ax: _softmax_lut_forward(node, part, ax, rows), x, axis)
    if method == "FAST_EXP":
        return by_row_bands(lambda part, ax: _softmax_fast_exp_forward(node, part, ax), x, axis)
    raise UnsupportedError(f"layer '{node.name}' (Softmax): quantize_method={method} is not supported "
                           f"(LUT and FAST_EXP are)")


@SOFTMAX.forward
def softmax_forward(self: PyNode) -> None:
    if self.quantized:
        self.outputs[0].betensor = softmax_integer_forward(self)
        return
    x = self.inputs[0].betensor
    axis = _axis(self, x.dim())
    self.outputs[0].betensor = torch.softmax(x, dim=axis)


# --------------------------------------------------------------------------------------------- LogSoftmax
LOGSOFTMAX_FORMS = ("upstream", "exact")
"""Values of `logsoftmax_integer_form`: upstream's float-table form (the default) or quantopt's log-domain one."""

_LOGSOFTMAX_INTEGER = ("upstream form (default): float32 exp table, float32 sum and log, output range fixed to "
                        "[-16, 0]; exact form (logsoftmax_integer_form = exact): base-2 exponent, power-of-two sum, "
                        "table log2, requantization of the difference")

LOGSOFTMAX = declare_op(
    "LogSoftmax",
    params={
        "axis": Param(Int(), "the axis normalized (negative counts from the end)", default=-1),
        "adjust_q": Param(Int(lo=POW2_TABLE_BITS, hi=FAST_EXP_MAX_ADJUST_Q), "exact form: fraction bits of the "
                          "base-2 exponent (default 8, written when quantized)"),
        "input_scale_value": quantized(Int(lo=0), "exact form: the multiplier of log2(e)/s_in"),
        "input_shift_value": quantized(Int(), "exact form: the shift of log2(e)/s_in"),
        "input_scale_type": quantized(DtypeName(), "the dtype of input_scale_value"),
        "input_shift_type": quantized(DtypeName(), "the dtype of input_shift_value"),
        "pow2_out_q": quantized(Int(lo=0), "exact form: fraction bits of the power-of-two terms, 31 - floor(log2(axis "
                                           "length))"),
        "quantize_scale": quantized(Floats(), "upstream form: [s_out/s_in, s_out] (float32 values), the factors of "
                                              "x - max(x) and of the log of the sum"),
    },
    constants={"lut_exp": "upstream form: the exp table (float32), written when quantized",
               "lut_log": "older targets' log table; not read",
               "pow2_lut": "exact form: the 2^f table (uint16), written when quantized",
               "log2_lut": "exact form: the log2 table (uint16), written when quantized",
               "scale": _PER_CHANNEL_REFUSED, "shift": _PER_CHANNEL_REFUSED},
    integer=_LOGSOFTMAX_INTEGER,
    semantics="docs/semantics/softmax.md#logsoftmax")


@LOGSOFTMAX.quantize
def logsoftmax_quantize(self: PyNode) -> None:
    """Checks the layer, then quantizes it in the form its `logsoftmax_integer_form` names (upstream by default)."""
    inp = self.inputs[0]
    if params(self, inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    s = layer_settings(self)
    if s.q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' (LogSoftmax): per-channel activation quantization is not "
                               "supported")
    if s.target_level < 1:
        raise UnsupportedError(f"layer '{self.name}' (LogSoftmax): targets older than X2 have another LogSoftmax "
                               "integer form, which quantopt does not simulate; set min_compatible_zhouyi_target = X2",
                               field="min_compatible_zhouyi_target")
    _axis(self, len(inp.ir_shape))
    if str(s.logsoftmax_integer_form) == "upstream":
        _logsoftmax_upstream_quantize(self)
    else:
        _logsoftmax_exact_quantize(self)


def logsoftmax_exp_table(in_scale: float, in_bits: int, lut_items_in_bits: int) -> torch.Tensor:
    """Upstream form's `lut_exp` (float32): n = 2^min(in_bits, lut_items_in_bits) float32 points p_k spread evenly
    over [0, 2^in_bits - 1] (torch.linspace), e_k = exp(p_k * (1 / -s_in)) in float32, in reverse order, so that the
    last entry is exp(0) = 1 and entry j answers the difference x - max(x) = j - (2^in_bits - 1) when n = 2^in_bits."""
    steps = lut_size(in_bits, lut_items_in_bits)
    points = torch.linspace(0.0, float(2 ** int(in_bits) - 1), steps=steps)
    return torch.exp(dequantize(points, -float(in_scale), 0)).flip(0)


def _logsoftmax_upstream_quantize(node: PyNode) -> None:
    """Upstream's form: the output gets the input's bits and the fixed range [-16, 0] (signed, the layer's mode,
    then the full signed integer range), `quantize_scale` = [s_out/s_in, s_out] in float32, the exp table
    `lut_exp`, and a neutral scale_value 1 / shift_value 0 that the forward does not read."""
    inp, out = node.inputs[0], node.outputs[0]
    s = layer_settings(node)
    bits = range_bits(node, inp)
    lo, hi = LOGSOFTMAX_UPSTREAM_RANGE
    ranges_of(node).set(out, lo, hi)
    p = linear_quant_params(lo, hi, bits, activation_mode(node, bits), True)
    qmin, qmax = integer_range(bits, True)
    set_params(node, out, QuantParams(p.scale, p.zerop, qmin, qmax, int_dtype_for_bits(bits, True)), bits)
    s_in = np.float32(tensor_scale(node, inp))
    s_out = np.float32(tensor_scale(node, out))
    set_constant(node, "lut_exp", logsoftmax_exp_table(float(s_in), bits, int(s.lut_items_in_bits)), Dtype.FP32)
    constants_first(node, ["lut_exp"])
    node.params["quantize_scale"] = [float(s_out / s_in), float(s_out)]
    store_requant(node, 1, 0, int_dtype_for_bits(int(s.q_bits_activation), False), Dtype.INT8)


def _logsoftmax_exact_quantize(node: PyNode) -> None:
    """quantopt's exact form: output signed from its calibrated range; log2(e)/s_in with a 15-bit multiplier;
    adjust_q = 8 fraction bits; pow2_lut and log2_lut (uint16); scale_value/shift_value approximate s_out * ln(2)."""
    out = node.outputs[0]
    quantize_activation(node, out, True)
    node.params.setdefault("adjust_q", FAST_EXP_ADJUST_Q)
    _adjust_q(node, allow_simple=False)
    _input_log2e_requant(node, AIFF_MULTIPLIER_BITS)
    node.params["pow2_out_q"] = softmax_pow2_out_q(_axis_len_ir(node))
    set_constant(node, "pow2_lut", pow2_table(), Dtype.UINT16)
    set_constant(node, "log2_lut", log2_table(), Dtype.UINT16)
    constants_first(node, ["pow2_lut", "log2_lut"])
    store_requant(node, *requant_scale_shift(node, tensor_scale(node, out) * math.log(2.0)))


def _quantize_scale(node: PyNode) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two factors of `quantize_scale` as float32 scalars (the forward multiplies float32 tensors by them)."""
    value = node.get_param("quantize_scale")
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise node._error(f"quantize_scale must hold two floats [s_out/s_in, s_out], got {value!r}")
    return torch.tensor(float(value[0]), dtype=torch.float32), torch.tensor(float(value[1]), dtype=torch.float32)


def _logsoftmax_upstream_forward(node: PyNode) -> torch.Tensor:
    """Upstream's form, on the CPU: d = x - max(x) (int64), e = lut_exp read at d + 2^b - 1 (`lookup_float_lut`),
    S = Σe in float32 in torch's single-threaded CPU order (`axis_sum`), L = ln S (torch float32 log),
    y = float32(d) * q0 - L * q1 with [q0, q1] = quantize_scale, out = clamp(round_half_even(y) - zp, qmin, qmax)."""
    inp, out = node.inputs[0], node.outputs[0]
    lut = node.get_constant("lut_exp")
    if not lut.dtype.is_float:
        raise UnsupportedError(f"layer '{node.name}' (LogSoftmax): an integer lut_exp belongs to the form of targets "
                               "older than X2, which quantopt does not simulate")
    x, _ = int_input(node)
    if x.numel() == 0:
        return x.clone()
    device = x.device
    x = x.cpu()
    axis = _axis(node, x.dim())
    bits = range_bits(node, inp)
    d = x - x.amax(dim=axis, keepdim=True)
    terms = lookup_float_lut(d + (2 ** bits - 1), lut.betensor.cpu(), bits)
    log_sum = torch.log(axis_sum(terms, axis))
    q0, q1 = _quantize_scale(node)
    y = d.to(torch.float32) * q0 - log_sum * q1
    qmin, qmax = out_range(node, out)
    return torch.clamp(torch.round(y).to(torch.int64) - tensor_zp(node, out), qmin, qmax).to(device)


def _logsoftmax_exact_forward(node: PyNode) -> torch.Tensor:
    """u (log2 domain, F bits), S = Σ pow2 terms, L = log2(S / 2^P) in F bits from log2_lut, out = requant(u - L)."""
    out = node.outputs[0]
    x, _ = int_input(node)
    if x.numel() == 0:
        return x.clone()
    axis = _axis(node, x.dim())
    frac = _adjust_q(node, allow_simple=False)
    out_q = _int_param(node, "pow2_out_q")
    u = _log2_domain(node, x, axis, frac)
    total = _pow2_terms(node, u, frac, out_q).sum(dim=axis, keepdim=True)
    k = bit_length(total) - 1
    mant = ((total << LOG2_MANTISSA_BITS) >> k) - 2 ** LOG2_MANTISSA_BITS
    table = node.get_constant("log2_lut").betensor.to(torch.int64)
    lg = _table_interp(table, mant, LOG2_MANTISSA_BITS, 2 ** LOG2_VALUE_BITS)
    log_sum = ((k - out_q) << frac) + (lg >> (LOG2_VALUE_BITS - frac))
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node._error("LogSoftmax needs one scale_value/shift_value, not per-channel constants")
    qmin, qmax = out_range(node, out)
    return requantize_int(u - log_sum, mult, shift + frac, tensor_zp(node, out), qmin, qmax)


def logsoftmax_tables(node: PyNode, bits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a backend or exporter: (u, e) for every difference d = x - max(x) in [-(2^bits - 1), 0] (index
    d + 2^bits - 1), and lg >> (16 - F) for every 16-bit mantissa of the sum: what the integer forward reads."""
    frac = _adjust_q(node, allow_simple=False)
    d = torch.arange(-(2 ** bits - 1), 1, dtype=torch.int64)
    u = _log2_of_difference(node, d, frac)
    e = _pow2_terms(node, u, frac, _int_param(node, "pow2_out_q"))
    table = node.get_constant("log2_lut").betensor.to(torch.int64)
    mant = torch.arange(2 ** LOG2_MANTISSA_BITS, dtype=torch.int64)
    lg = _table_interp(table, mant, LOG2_MANTISSA_BITS, 2 ** LOG2_VALUE_BITS) >> (LOG2_VALUE_BITS - frac)
    return u, e, lg


def logsoftmax_integer_forward(node: PyNode) -> torch.Tensor:
    """Integer forward of a quantized LogSoftmax in the form its IR holds: upstream's with `lut_exp`, else exact."""
    if "lut_exp" in node.constants:
        return _logsoftmax_upstream_forward(node)
    return _logsoftmax_exact_forward(node)


@LOGSOFTMAX.forward
def logsoftmax_forward(self: PyNode) -> None:
    if self.quantized:
        self.outputs[0].betensor = logsoftmax_integer_forward(self)
        return
    x = self.inputs[0].betensor
    self.outputs[0].betensor = torch.log_softmax(x, dim=_axis(self, x.dim()))


# --------------------------------------------------------------------------------------------- Hardmax
HARDMAX = declare_op(
    "Hardmax", params={"axis": Param(Int(), "the axis of the maximum (negative counts from the end)", default=-1)},
    dtypes="float32 → uint8 0/1 (qinvariant)", integer="one-hot of the first maximum of the integer codes",
    semantics="docs/semantics/softmax.md#hardmax")


def _one_hot_argmax(x: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """1 at the first maximum along `axis` (ONNX Hardmax ties), 0 elsewhere."""
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=dtype, device=x.device)
    idx = torch.argmax(x, dim=axis, keepdim=True)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    return out.scatter(axis, idx, torch.ones(idx.shape, dtype=dtype, device=x.device))


@HARDMAX.quantize
def hardmax_quantize(self: PyNode) -> None:
    """The output is an exact 0/1 integer tensor: qinvariant uint8 (scale 1, zero point 0)."""
    inp = self.inputs[0]
    if params(self, inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    _axis(self, len(inp.ir_shape))
    set_qinvariant(self, self.outputs[0], 8, False)


@HARDMAX.forward
def hardmax_forward(self: PyNode) -> None:
    """One-hot of the first maximum along `axis`; quantized, the maximum of the integer codes (the input scale is
    positive, so the float order is kept; values equal after quantization tie to the first)."""
    if self.quantized:
        x, _ = int_input(self)
        self.outputs[0].betensor = _one_hot_argmax(x, _axis(self, x.dim()), torch.int64)
        return
    x = self.inputs[0].betensor
    self.outputs[0].betensor = _one_hot_argmax(x, _axis(self, x.dim()), torch.float32)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def masked_softmax_terms(g: QDQGraph, node: PyNode, v: str, row_max: str, e: str) -> str:
    """`mask_saturated_input` (docs/integer-semantics.md): terms of the input's minimum code are 0 in rows holding
    another code. `v` and `row_max` are codes plus the zero point (float64), `e` int64 terms."""
    if not masks_saturated_input(node):
        return e
    qx = params(node, node.inputs[0])
    low = double(g, node, "mask_code", float(int(qx.qmin) + int(round(float(qx.zerop)))))
    masked = g.add("And", [g.add("Equal", [v, low]), g.add("Greater", [row_max, low])])
    return g.add("Where", [masked, g.const(f"{node.name}/masked_term", np.array(0, dtype=np.int64)), e])


def exact_softmax_lut(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """Softmax with quantopt's LUT method (docs/integer-semantics.md) in int64/float64: t = x - max + 2^b - 1,
    e = the exp table read at t (interpolated entries precomputed for every t), S = Σe, then upstream's two division
    variants; the short-row one applies when the row count at run time is a multiple of 128, as in quantopt."""
    if not g.unit_domain or str(node.get_param("quantize_method", optional=True, default_value="LUT")).upper() \
            != "LUT" or "lut" not in node.constants:
        return False
    x = node.inputs[0]
    mult, shift = requant_of(node)
    bits = range_bits(node, x)
    if isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor) or bits > MAX_TABLE_BITS:
        return False
    mult, shift = int(mult), int(shift)
    lut = node.get_constant("lut")
    table = lut.betensor.cpu().to(torch.int64)
    exps = lookup_lut(torch.arange(2 ** bits), table, 0, bits, lut.dtype.bits, lut.dtype.is_signed).numpy()
    lut_max = max(1, int(table.max()))
    base = SOFTMAX_DIVIDEND_BITS - 1 if lut_max == 1 else SOFTMAX_DIVIDEND_BITS
    axes = g.ints(f"{node.name}/axes", [axis])
    v = codes(g, x, perm)
    top = g.add("ReduceMax", [v, axes], keepdims=1)
    shifted = g.add("Add", [g.add("Sub", [v, top]), double(g, node, "top_index", 2.0 ** bits - 1)])
    e = g.add("Gather", [g.const(f"{node.name}/exp_table", exps.astype(np.int64)),
                         g.add("Cast", [shifted], to=INT64)], axis=0)
    e = masked_softmax_terms(g, node, v, top, e)
    total = g.add("ReduceSum", [e, axes], keepdims=1)
    den = g.add("Max", [total, g.const(f"{node.name}/one", np.array(1, dtype=np.int64))])

    def int64(what: str, value: int) -> str:
        return g.const(f"{node.name}/{what}", np.array(value, dtype=np.int64))

    k = base - ceil_log2(mult)
    recip = g.add("Div", [int64("dividend", mult << k), den])
    general = g.add("Mul", [g.add("Cast", [g.add("Mul", [e, recip])], to=DOUBLE),
                            double(g, node, "general_step", 2.0 ** -(shift + k))])
    axis_len = int(x.ir_shape[perm[axis]])
    if axis_len < SOFTMAX_SMALL_AXIS and bits <= 8:
        k_short = base - ceil_log2(lut_max)
        numerator = g.add("Add", [g.add("Mul", [e, int64("short_scale", 1 << k_short)]),
                                  g.add("Div", [total, int64("two", 2)])])
        short = g.add("Mul", [g.add("Cast", [g.add("Div", [numerator, den])], to=DOUBLE),
                              double(g, node, "short_step", mult * 2.0 ** -(shift + k_short))])
        rows = g.add("Div", [g.add("Size", [v]), int64("axis_len", axis_len)])
        blocks = g.add("Equal", [g.add("Mod", [rows, int64("row_block", SOFTMAX_ROW_BLOCK)]), int64("zero", 0)])
        general = g.add("Where", [blocks, short, general])
    requantize(g, node, general, 1.0, perm)
    return True


def exact_softmax_single(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """Softmax over an axis of one element (MobileViT's attention over one patch): x - max(x) is 0 in every row, so
    every output is one code, which the layer's own integer forward gives for any input code (the FAST_EXP tables
    do not exist there: pow2_out_q is 31); the LUT method only where its short-row variant gives the same code.
    Exported as that code over the input's shape."""
    x, out = node.inputs[0], node.outputs[0]
    if not g.unit_domain or int(x.ir_shape[perm[axis]]) != 1:
        return False
    method = str(node.get_param("quantize_method", optional=True, default_value="LUT")).upper()
    one = torch.full([1], out_range(node, x)[1], dtype=torch.int64)  # the top code: never a masked one
    if method == "FAST_EXP":
        found = {int(_softmax_fast_exp_forward(node, one, 0)[0])}
    elif method == "LUT" and "lut" in node.constants:
        found = {int(_softmax_lut_forward(node, one, 0, rows)[0]) for rows in (1, SOFTMAX_ROW_BLOCK)}
    else:
        return False
    if len(found) != 1:
        return False
    unit = float(found.pop() + tensor_zp(node, out))
    value = g.add("Add", [g.add("Mul", [codes(g, x, perm), double(g, node, "zero", 0.0)]),
                          double(g, node, "code", unit)])
    g.quantize(out, g.add("Cast", [value], to=FLOAT), perm, unit=True)
    return True


def exact_softmax_fast_exp(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """Softmax FAST_EXP with the 2^f table (adjust_q >= 8), upstream's log-domain form (docs/semantics/softmax.md):
    u and e are functions of x - max(x) alone, S = clamp(Σe, 1, 2^31 - 1), its bit length by comparisons, the Q15
    log2 of its normalized mantissa and the output 2^(u - log2_sum) by table lookups (`fast_exp_tables`)."""
    if not g.unit_domain or str(node.get_param("quantize_method", optional=True, default_value="LUT")).upper() \
            != "FAST_EXP" or int(node.get_param("adjust_q", optional=True, default_value=0)) < POW2_TABLE_BITS:
        return False
    adjust_q = int(node.get_param("adjust_q"))
    out_q = int(node.get_param("pow2_out_q"))
    tables = fast_exp_tables(node, torch.device("cpu"))
    if tables is None:
        return False
    u_table, e_table, log2_first, y_table, lo = tables.u, tables.e, tables.log2_first, tables.y, tables.lo

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.array(v, dtype=np.int64))

    top = tables.top_index
    axes = g.ints(f"{node.name}/axes", [axis])
    v = codes(g, node.inputs[0], perm)
    row_max = g.add("ReduceMax", [v, axes], keepdims=1)
    index = g.add("Cast", [g.add("Add", [g.add("Sub", [v, row_max]), double(g, node, "top_index", float(top))])],
                  to=INT64)
    u = g.add("Gather", [int64("log2_terms", u_table.numpy()), index], axis=0)
    e = g.add("Gather", [int64("exp_terms", e_table.numpy()), index], axis=0)
    e = masked_softmax_terms(g, node, v, row_max, e)
    total = g.add("Min", [g.add("Max", [g.add("ReduceSum", [e, axes], keepdims=1), int64("one", 1)]),
                          int64("sum_max", 2 ** 31 - 1)])
    rank = len(node.inputs[0].ir_shape)
    powers = [1 << k for k in range(31)]
    above = g.add("GreaterOrEqual", [g.add("Unsqueeze", [total, g.ints(f"{node.name}/last_axis", [rank])]),
                                     int64("powers", powers)])
    bit_length = g.add("ReduceSum", [g.add("Cast", [above], to=INT64), g.ints(f"{node.name}/bit_axis", [rank])],
                       keepdims=0)
    lead = g.add("Sub", [int64("thirty_one", 31), bit_length])
    norm = g.add("Mul", [total, g.add("Gather", [int64("shifts", powers), lead], axis=0)])
    mantissa = g.add("Mod", [g.add("Div", [norm, int64("mantissa_div", 1 << 22)]), int64("mantissa_mod", 256)])
    log2_sum = g.add("Sub", [g.add("Gather", [int64("log2_table", log2_first.numpy()), mantissa], axis=0),
                             g.add("Mul", [g.add("Sub", [lead, int64("lead_ref", 30 - out_q)]),
                                           int64("frac_unit", 1 << adjust_q)])])
    diff = g.add("Max", [g.add("Sub", [u, log2_sum]), int64("diff_lo", lo)])
    y = g.add("Gather", [int64("pow2_terms", y_table.numpy()), g.add("Sub", [diff, int64("diff_index", lo)])],
              axis=0)
    y = masked_softmax_terms(g, node, v, row_max, y)
    g.quantize(node.outputs[0], g.add("Cast", [y], to=FLOAT), perm, unit=True)
    return True


def exact_logsoftmax(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """LogSoftmax (docs/semantics/softmax.md) in int64: u and the 2^u terms tabulated per x - max(x), S = Σ terms,
    k = bit_length(S) - 1, the 16-bit mantissa of S indexes log2 (tabulated), out = requant(u - log2(S / 2^P))."""
    if not g.unit_domain or "log2_lut" not in node.constants:
        return False
    mult, shift = requant_of(node)
    bits = range_bits(node, node.inputs[0])
    if isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor) or bits > MAX_TABLE_BITS:
        return False
    frac = int(node.get_param("adjust_q"))
    out_q = int(node.get_param("pow2_out_q"))
    u_table, e_table, lg_table = logsoftmax_tables(node, bits)

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    axes = g.ints(f"{node.name}/axes", [axis])
    v = codes(g, node.inputs[0], perm)
    index = g.add("Cast", [g.add("Add", [g.add("Sub", [v, g.add("ReduceMax", [v, axes], keepdims=1)]),
                                         double(g, node, "top_index", 2.0 ** bits - 1)])], to=INT64)
    u = g.add("Gather", [int64("log2_terms", u_table.numpy()), index], axis=0)
    total = g.add("ReduceSum", [g.add("Gather", [int64("exp_terms", e_table.numpy()), index], axis=0), axes],
                  keepdims=1)
    k = g.add("Sub", [bit_length_int64(g, node, total, "sum"), int64("one", 1)])
    pow2 = int64("pow2", [1 << j for j in range(63)])
    mantissa = g.add("Sub", [g.add("Div", [g.add("Mul", [total, int64("mantissa_scale", 1 << LOG2_MANTISSA_BITS)]),
                                           g.add("Gather", [pow2, k], axis=0)]),
                             int64("mantissa_one", 1 << LOG2_MANTISSA_BITS)])
    log_sum = g.add("Add", [g.add("Mul", [g.add("Sub", [k, int64("out_q", out_q)]), int64("frac_scale", 1 << frac)]),
                            g.add("Gather", [int64("log2_table", lg_table.numpy()), mantissa], axis=0)])
    difference = g.add("Cast", [g.add("Sub", [u, log_sum])], to=DOUBLE)
    requantize(g, node, difference, int(mult) * 2.0 ** -(int(shift) + frac), perm)
    return True


@SOFTMAX.export
@LOGSOFTMAX.export
@HARDMAX.export
def convert_softmax(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    perm = unary_perm(g, node)
    axis = perm.index(axis_param(node, node.get_param("axis", optional=True, default_value=-1), len(perm)))
    if str(node.type) == "Softmax" and (exact_softmax_single(g, node, perm, axis)
                                        or exact_softmax_lut(g, node, perm, axis)
                                        or exact_softmax_fast_exp(g, node, perm, axis)):
        return
    if str(node.type) == "LogSoftmax" and "lut_exp" in node.constants:
        raise node_error(node, "a LogSoftmax in upstream's integer form is not exported (its float32 log and sum "
                               "have no exact ONNX counterpart); quantize it with logsoftmax_integer_form = exact "
                               "(docs/semantics/softmax.md)")
    if str(node.type) == "LogSoftmax" and exact_logsoftmax(g, node, perm, axis):
        return
    out = g.add(str(node.type), [g.float_value(x, perm)], axis=axis)
    if str(node.type) == "Softmax" and str(node.params.get("quantize_method", "LUT")).upper() == "LUT":
        out = g.rescale(out, requant_factor(node, 1.0))  # the table's e/S times M · 2^-N stands for softmax · s_out
    elif str(node.type) == "Softmax" and str(node.params.get("quantize_method")).upper() == "FAST_EXP" \
            and int(node.params.get("adjust_q", 0)) >= 8:
        # FAST_EXP table path: the integers are 2^(b_out + log2 softmax), i.e. softmax · 2^b_out, not softmax · s_out
        out = g.rescale(out, 2.0 ** range_bits(node, y) / tensor_scale(node, y))
    g.quantize(y, out, perm, lossless=str(node.type) == "Hardmax")
