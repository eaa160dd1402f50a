"""Quantization given by a pre-quantized model (compat_quantized_model, docs/compat-quantized.md).

A tensor whose quantization the model itself fixes carries it in `PyTensor.extra[GIVEN_PARAMS]` (a QuantParams);
a weight constant also carries its integers in `extra[GIVEN_VALUES]`. The quantize helpers (ops/_quant.py) use them
instead of a calibrated range, so the quantized graph keeps the model's own scales, zero points and weights.
"""
from __future__ import annotations

from typing import Tuple, Union

import numpy as np
import torch

from .dtype import Dtype
from .params import QuantParams

GIVEN_PARAMS = "compat_given_params"
GIVEN_VALUES = "compat_given_values"

_ONNX_INT_DTYPES = {np.dtype(np.int8): Dtype.INT8, np.dtype(np.uint8): Dtype.UINT8,
                    np.dtype(np.int16): Dtype.INT16, np.dtype(np.uint16): Dtype.UINT16,
                    np.dtype(np.int32): Dtype.INT32}


def dtype_of(np_dtype: np.dtype) -> Dtype:
    """The IR dtype of an ONNX integer storage type (int8/uint8/int16/uint16/int32)."""
    try:
        return _ONNX_INT_DTYPES[np.dtype(np_dtype)]
    except KeyError:
        raise ValueError(f"quantized type {np.dtype(np_dtype)} is not supported (int8, uint8, int16, uint16, "
                         "int32)") from None


def from_onnx(scale: np.ndarray, zero_point: np.ndarray, dtype: Dtype) -> QuantParams:
    """quantopt's params of ONNX's x = (q - zp) * s: scale = 1 / s (rounded once to float32), zerop = -zp; one
    value per tensor, or float32/int64 vectors per channel."""
    s = np.asarray(scale, dtype=np.float64)
    zp = np.asarray(zero_point, dtype=np.int64)
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError("scales must be finite and positive")
    qmin, qmax = dtype.int_range()
    if np.any(zp < qmin) or np.any(zp > qmax):
        raise ValueError(f"zero points must lie in [{qmin}, {qmax}] for {dtype.value}")
    inv = (1.0 / s).astype(np.float32)
    if s.ndim == 0:
        return QuantParams(float(inv.reshape(-1)[0]), -int(zp.reshape(-1)[0]), int(qmin), int(qmax), dtype)
    return QuantParams(torch.from_numpy(inv.reshape(-1).copy()),
                       torch.from_numpy((-zp).reshape(-1).copy()) if zp.size > 1 else
                       torch.full((s.size,), -int(zp.reshape(-1)[0]), dtype=torch.int64),
                       int(qmin), int(qmax), dtype)


def onnx_step(p: QuantParams) -> Tuple[Union[float, torch.Tensor], Union[int, torch.Tensor]]:
    """(ONNX scale, ONNX zero point) of params: the inverse of `from_onnx` up to its float32 rounding."""
    if p.per_channel:
        return 1.0 / p.scale.to(torch.float64), -p.zerop
    return 1.0 / float(p.scale), -int(p.zerop)
