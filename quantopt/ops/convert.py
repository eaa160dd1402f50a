"""Quantize and DeQuantize: the layers at the borders of float islands (`trigger_float_op`, docs/semantics/convert.md).

quantopt inserts them itself (quantopt/passes/float_islands.py): a Quantize on each edge from a float layer to an
integer layer, a DeQuantize on each edge from an integer layer to a float layer. Both store their conversion in the
layer (`quantize_scale`, `quantize_zp`), so a re-loaded IR converts exactly as the quantized graph did. In a float
graph (before quantization) both pass their input through.
"""
from __future__ import annotations

import torch

from ..graph.float_layer import round_to_float_dtype
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..quant.params import dequantize, quantize
from ..registry import declare_op
from ..registry.schema import Float, Int, IntValued, Text, quantized
from . import _fp8
from ._quant import (
    integer_bits,
    integer_constant_range,
    integer_output_bits,
    out_range,
    params,
    quantize_activation,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/convert.md"

_SCALE_DOC = "q = x · quantize_scale − quantize_zp: the scale of the integer side (written by quantopt)"
_ZP_DOC = "the zero point of the integer side (written by quantopt)"

QUANTIZE = declare_op(
    "Quantize",
    params={"quantize_scale": quantized(Float(), _SCALE_DOC),
            "quantize_zp": quantized(IntValued(), _ZP_DOC + "; 0.0 before an fp8 layer"),
            "round_mode": quantized(Text(), "ROUND_TO_EVEN (written by quantopt; not read)")},
    dtypes="float32/float16/bfloat16 → int8/uint8/int16/uint16 (integer-valued inputs: exact, scale 1)",
    integer="q = clamp(round_half_even(x·scale − zp)) in float32, like Input",
    semantics=f"{SEMANTICS}#quantize")


@QUANTIZE.forward
def quantize_forward(self: PyNode) -> None:
    """Integer: q = clamp(round_half_even(x · quantize_scale − quantize_zp), qmin, qmax), computed in float32 like the
    Input layer; NaN gives 0. Float graph: the input as is."""
    inp, out = self.inputs[0], self.outputs[0]
    if not self.quantized:
        out.betensor = inp.betensor
        return
    x = inp.betensor
    if not x.is_floating_point():
        raise self._error(f"input '{inp.name}' must be float (a Quantize layer converts float to integer)")
    if _fp8.is_fp8(self, out):  # before an fp8 layer (ops/_fp8.py)
        out.betensor = _fp8.fp8_quantize_forward(self, x)
        return
    qmin, qmax = out_range(self, out)
    if params(self, out).qinvariant:
        out.betensor = torch.clamp(torch.round(x.to(torch.float64)), qmin, qmax).to(torch.int64)
        return
    scale = float(self.get_param("quantize_scale"))
    zp = int(self.get_param("quantize_zp"))
    out.betensor = quantize(x, scale, zp, qmin, qmax)


@QUANTIZE.quantize
def quantize_quantize(self: PyNode) -> None:
    """Output params from the calibrated range of the float tensor (copied onto the output when the layer was
    inserted) with the layer's activation bits and mode; an integer tensor of a float layer (an index output) and
    the output of a float Constant holding only integers become exact integer tensors (scale 1), as an integer
    Constant is quantized (`ops/io.py`), so the layers reading indices get them exact."""
    inp, out = self.inputs[0], self.outputs[0]
    fp8_dtype = self.attrs.get("fp8_output")
    if fp8_dtype is not None:  # inserted before an fp8 layer (passes/fp8_borders.py)
        _fp8.quantize_to_fp8(self, fp8_dtype)
        return
    constant = integer_constant_range(inp.pnode) if inp.pnode is not None else None
    if not inp.ir_dtype.is_float:
        lo = ranges_of(self).get(out).min
        set_qinvariant(self, out, integer_output_bits(self, bool(float(lo or 0.0) < 0)),
                       bool(float(lo or 0.0) < 0))
    elif constant is not None:  # a float-island Constant of integers (indices, counts): exact, as it is unquantized
        set_qinvariant(self, out, *integer_bits(*constant))
    else:
        lo = ranges_of(self).get(out).min
        signed = bool(lo is not None and float(lo) < 0)
        quantize_activation(self, out, signed)
    self.params["quantize_scale"] = tensor_scale(self, out)
    self.params["quantize_zp"] = tensor_zp(self, out)
    self.params["round_mode"] = "ROUND_TO_EVEN"


DEQUANTIZE = declare_op(
    "DeQuantize",
    params={"quantize_scale": quantized(Float(), _SCALE_DOC),
            "quantize_zp": quantized(Int(), _ZP_DOC)},
    dtypes="int8/uint8/int16/uint16/int32 → float32/float16/bfloat16",
    integer="x = (q + zp)·(1/scale) in float32, rounded to the output float dtype",
    semantics=f"{SEMANTICS}#dequantize")


@DEQUANTIZE.forward
def dequantize_forward(self: PyNode) -> None:
    """x = (q + quantize_zp) · (1 / quantize_scale) in float32, then rounded to the output dtype (float16/bfloat16).
    A float input (float graph) passes through."""
    inp, out = self.inputs[0], self.outputs[0]
    q = inp.betensor
    if q.is_floating_point() and not _fp8.is_fp8(self, inp):
        out.betensor = q
        return
    scale = float(self.get_param("quantize_scale"))
    zp = int(self.get_param("quantize_zp"))
    out.betensor = round_to_float_dtype(dequantize(q, scale, zp), out.dtype)


@DEQUANTIZE.quantize
def dequantize_quantize(self: PyNode) -> None:
    """Stores the input's scale and zero point; the output stays float (its dtype is the consuming island's)."""
    inp = self.inputs[0]
    if params(self, inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; a DeQuantize layer needs an integer input")
    self.params["quantize_scale"] = tensor_scale(self, inp)
    self.params["quantize_zp"] = tensor_zp(self, inp)
    self.params["unquantifiable"] = True
