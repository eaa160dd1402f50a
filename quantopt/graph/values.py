"""A tensor's values in the other domain: dequantized floats of a quantized tensor, or floats quantized with a
quantized tensor's params.

Why here: every stage that compares a float graph with its quantized copy (similarity analysis, global calibration,
fake-quant debug layers, `quantopt run`, the exporter's agreement check) converts between the two the same way.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..quant.params import dequantize, quantize
from .float_layer import round_to_float_dtype
from .tables import QuantTable, TensorQuant, quant_of
from .tensor import PyTensor


def _params(t: PyTensor, table: Optional[QuantTable]) -> TensorQuant:
    """The parameters of `t` in `table`; by default in the table of the graph of its producing layer (every
    activation of a graph has one: graph inputs are an Input layer's outputs)."""
    if table is None:
        if t.pnode is None:
            raise ValueError(f"tensor '{t.name}' has no producing layer: pass the table its parameters are in")
        table = quant_of(t.pnode)
    return table.get(t)


def per_tensor_dequantization(t: PyTensor, table: Optional[QuantTable] = None) -> Optional[Tuple[float, int]]:
    """(scale, zero point) where `to_float` dequantizes `t` with per-tensor params; None where it converts the
    values as they are (integers used as is, float tensors) or the params are per channel."""
    q = _params(t, table)
    if q.qinvariant or q.qmin is None or isinstance(q.scale, torch.Tensor) or isinstance(q.zerop, torch.Tensor):
        return None
    return q.scale, q.zerop


def to_float(t: PyTensor, table: Optional[QuantTable] = None, values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantized values of a quantized tensor (integer tensors used as is); its parameters are looked up in
    `table` (default: its producer's graph's table). `values`: other values of `t` to convert (default: the ones it
    holds), e.g. those of another run of its layer."""
    q = _params(t, table)
    x = t.betensor if values is None else values
    if q.qinvariant or q.qmin is None:
        return x.to(torch.float32)
    return dequantize(x, q.scale, q.zerop)


def to_quantized(x: torch.Tensor, like: PyTensor, table: Optional[QuantTable] = None) -> torch.Tensor:
    """Float values quantized with the params of the quantized tensor `like` (a float tensor of a float island:
    the values rounded to its float type); its parameters are looked up in `table` (default: its producer's graph's
    table)."""
    q = _params(like, table)
    if q.qmin is None:
        return round_to_float_dtype(x.to(torch.float32), like.dtype)
    if q.qinvariant:
        return torch.clamp(torch.round(x.to(torch.float64)), q.qmin, q.qmax).to(torch.int64)
    return quantize(x, q.scale, q.zerop, q.qmin, q.qmax)
