"""Counting ops: Count (a per-row histogram) and ZeroFraction (the share of exact zeros per row).

Both count elements of each dim-0 row, so quantized they compare integers only: Count bins the input's integers
against integer bounds derived from the float `min`/`max` (exact rational bin arithmetic, no float rounding), and
ZeroFraction counts the integers that stand for float 0 (`q + zp == 0`). Count's output is an exact integer tensor
(scale 1); ZeroFraction's is quantized with the fixed scale `2^bits - 1`. The semantics are in
docs/semantics/counting.md.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from ..config.upstream_defects import COUNT_INPUT_ZP
from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..quant.dtype import int_dtype_for_bits
from ..quant.params import integer_range
from ..registry import declare_op
from ..registry.schema import Bool, Float, Int, Param, Value, quantized
from ._quant import (
    check_quantized_inputs,
    layer_settings,
    out_range,
    params,
    quant_of,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param, int_param

SEMANTICS = "docs/semantics/counting.md"

COUNT_MIN_BITS = 16
"""Count's integer output has at least 16 bits (upstream: max(16, input bits)); 32 when a row can hold more
elements than 16 bits count."""


def _per_tensor(node: PyNode, t: PyTensor) -> None:
    q = params(node, t)
    for what in ("scale", "zerop"):
        v = getattr(q, what)
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' has per-channel "
                                   "quantization; this op needs per-tensor scale and zero point")


def _rows(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """The input as [rows, elements]: one row per dim-0 index."""
    if x.dim() == 0:
        raise node._error("input must have a batch dim (rank >= 1)")
    return x.reshape(x.shape[0], -1)


# ------------------------------------------------------------------------------------------------ Count
COUNT = declare_op(
    "Count",
    params={"nbins": Param(Int(lo=1), "number of bins", required=True),
            "min": Param(Float(), "float: the lower bound; quantized: the integer bound round(min * s_in)",
                         required=True),
            "max": Param(Float(), "float: the upper bound (min > max counts from the top: the bins are "
                                  "reversed); quantized: round(max * s_in)", required=True),
            "discrete": Param(Bool(), "true: bins [e_i, e_i+1) with max in the last bin (torch.histc); false: "
                                      "half-open bins, max excluded", default=True),
            "range": Param(Value(), "written by some Parser versions; not read")},
    dtypes="float32 or quantized → uint16 (int16 with force_dtype_int; 32 bits for rows over 65535 elements), "
           "scale 1",
    integer="exact integer binning against integer bounds", semantics=f"{SEMANTICS}#count",
    summary="Per dim-0 row, the number of elements in each of `nbins` equal bins between `min` and `max`.")


def _count_params(node: PyNode) -> Tuple[int, float, float, bool]:
    bins = int_param(node, "nbins")
    lo, hi = (node.get_param(k) for k in ("min", "max"))
    for key, v in (("min", lo), ("max", hi)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise node._error(f"parameter '{key}' must be a finite number, got {v!r}")
    discrete = bool_param(node, "discrete", True)
    if float(lo) == float(hi):
        raise node._error(f"min and max are both {lo}: the bins have no width")
    if not discrete and float(lo) > float(hi):
        raise node._error(f"discrete=false needs min < max, got min {lo} and max {hi}")
    return bins, float(lo), float(hi), discrete


@COUNT.forward
def count_forward(self: PyNode) -> None:
    bins, lo, hi, discrete = _count_params(self)
    rows = _rows(self, self.inputs[0].betensor)
    if self.quantized:
        self.outputs[0].betensor = _count_int(rows, bins, int(lo), int(hi), discrete, tensor_zp(self, self.inputs[0]))
    else:
        self.outputs[0].betensor = _count_float(rows.to(torch.float32), bins, lo, hi, discrete)


def _count_float(rows: torch.Tensor, bins: int, lo: float, hi: float, discrete: bool) -> torch.Tensor:
    """torch.histc per row in float32 (upstream's float reference); min > max: histc over [max, min], reversed.
    Not discrete: torch.linspace(min, max, nbins + 1) edges, e_i <= x < e_i+1."""
    out = torch.zeros(rows.shape[0], bins, dtype=torch.float32, device=rows.device)
    if discrete:
        a, b = min(lo, hi), max(lo, hi)
        for r in range(rows.shape[0]):
            out[r] = torch.histc(rows[r], bins, a, b)
        return torch.flip(out, [1]) if lo > hi else out
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float32).to(rows.device)  # the CPU's edges on any device
    inside = (rows[:, :, None] >= edges[None, None, :-1]) & (rows[:, :, None] < edges[None, None, 1:])
    return inside.sum(1).to(torch.float32)


def _count_int(rows: torch.Tensor, bins: int, lo: int, hi: int, discrete: bool, zp: int) -> torch.Tensor:
    """Exact: X = q + zp; a = min(lo, hi), b = max(lo, hi); X in [a, b] (not discrete: [a, b)) goes to bin
    floor((X - a) * nbins / (b - a)), X == b to the last; reversed when lo > hi."""
    x = rows.to(torch.int64) + zp
    a, b = min(lo, hi), max(lo, hi)
    inside = (x >= a) & ((x <= b) if discrete else (x < b))
    idx = torch.clamp(torch.div((x - a) * bins, b - a, rounding_mode="floor"), 0, bins - 1)
    out = torch.zeros(rows.shape[0], bins, dtype=torch.int64, device=x.device)
    out.scatter_add_(1, torch.where(inside, idx, torch.zeros_like(idx)), inside.to(torch.int64))
    return torch.flip(out, [1]) if lo > hi else out


@COUNT.quantize
def count_quantize(self: PyNode) -> None:
    """`min`/`max` become the integer bounds round_half_even(v * s_in) of the input's `X = q + zp` (upstream
    writes round(v * s_in) and bins `q`, which is the same for zero point 0); the output is an exact count."""
    bins, lo, hi, _ = _count_params(self)
    inp = self.inputs[0]
    check_quantized_inputs(self, [inp])
    _per_tensor(self, inp)
    s = tensor_scale(self, inp)
    lo_q, hi_q = (int(torch.round(torch.tensor(v * s, dtype=torch.float64)).item()) for v in (lo, hi))
    if lo_q == hi_q:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): min {lo} and max {hi} fall on the same input "
                               f"integer {lo_q} (input scale {s}); the bins would have no width")
    self.params["min"], self.params["max"] = float(lo_q), float(hi_q)  # integers written as upstream: -97.0
    shape = inp.ir_shape or tuple(inp.betensor.shape)
    per_row = math.prod(int(d) for d in shape[1:]) if len(shape) > 1 else 1
    signed = bool(layer_settings(self).force_dtype_int)
    bits = max(COUNT_MIN_BITS, int(params(self, inp).qbits or 8))
    if per_row > integer_range(bits, signed)[1]:
        bits = 32
    set_qinvariant(self, self.outputs[0], bits, signed)
    self.outputs[0].dtype = int_dtype_for_bits(bits, signed)
    if COUNT_INPUT_ZP in layer_settings(self).upstream_defects:  # the counts carry no zero point
        quant_of(self).of(self.outputs[0]).zerop = tensor_zp(self, inp)


# ------------------------------------------------------------------------------------------------ ZeroFraction
ZERO_FRACTION = declare_op(
    "ZeroFraction",
    params={"output_scale": quantized(Int(lo=1), "2^bits - 1: the output's scale (the fraction 1 is the top "
                                                 "integer)")},
    dtypes="float32 or quantized → uint8/uint16 (int8/int16 with force_dtype_int), scale 2^bits - 1",
    integer="exact count, round half up of zeros * output_scale / n", semantics=f"{SEMANTICS}#zerofraction",
    summary="Per dim-0 row, the fraction of elements equal to 0: output [rows].")


@ZERO_FRACTION.forward
def zerofraction_forward(self: PyNode) -> None:
    inp = self.inputs[0]
    rows = _rows(self, inp.betensor)
    n = rows.shape[1]
    if n == 0:
        raise self._error("input rows have no elements")
    if self.quantized:
        zeros = ((rows.to(torch.int64) + tensor_zp(self, inp)) == 0).sum(1)
        m = int(self.get_param("output_scale"))
        out = self.outputs[0]
        qmin, qmax = out_range(self, out)
        y = torch.div(zeros * m + n // 2, n, rounding_mode="floor") - tensor_zp(self, out)
        out.betensor = torch.clamp(y, qmin, qmax)
    else:
        zeros = (rows == 0).sum(1)
        self.outputs[0].betensor = zeros.to(torch.float32) / n


@ZERO_FRACTION.quantize
def zerofraction_quantize(self: PyNode) -> None:
    """Output scale 2^bits - 1 (bits: the layer's activation bits), zero point 0 (force_dtype_int: -qmin, so
    the fraction 0 is qmin); the calibrated range is not used: a fraction lies in [0, 1]."""
    inp = self.inputs[0]
    check_quantized_inputs(self, [inp])
    _per_tensor(self, inp)
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    signed = bool(s.force_dtype_int)
    m = 2 ** bits - 1
    self.params["output_scale"] = m
    out = self.outputs[0]
    q = quant_of(self).of(out)
    q.qinvariant = False
    q.qbits = bits
    out.dtype = int_dtype_for_bits(bits, signed)
    q.qmin, q.qmax = integer_range(bits, signed)
    q.scale = float(m)
    q.zerop = -q.qmin if signed else 0
    out.ir_range = None
