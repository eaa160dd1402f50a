"""A tensor's values in the other domain: dequantized floats of a quantized tensor, or floats quantized with a
quantized tensor's params.

Why here: every stage that compares a float graph with its quantized copy (similarity analysis, global calibration,
fake-quant debug layers, `quantopt run`, the exporter's agreement check) converts between the two the same way.
"""
from __future__ import annotations

import torch

from ..quant.params import dequantize, quantize
from .float_layer import round_to_float_dtype
from .tensor import PyTensor


def to_float(t: PyTensor) -> torch.Tensor:
    """Dequantized values of a quantized tensor (integer tensors used as is)."""
    if t.qinvariant or t.qmin is None:
        return t.betensor.to(torch.float32)
    return dequantize(t.betensor, t.scale, t.zerop)


def to_quantized(x: torch.Tensor, like: PyTensor) -> torch.Tensor:
    """Float values quantized with the params of the quantized tensor `like` (a float tensor of a float island:
    the values rounded to its float type)."""
    if like.qmin is None:
        return round_to_float_dtype(x.to(torch.float32), like.dtype)
    if like.qinvariant:
        return torch.clamp(torch.round(x.to(torch.float64)), like.qmin, like.qmax).to(torch.int64)
    return quantize(x, like.scale, like.zerop, like.qmin, like.qmax)
