"""How a float layer of a mixed-precision graph executes (`unquantifiable=true` in a quantized IR).

Its weights may be weight-only quantized (integers with `weights_scale`/`weights_zp`, or fp8/fp4 values with a
per-channel `weights_scale`): the forward computes with the dequantized weights. Its outputs are rounded to their
float type (float16/bfloat16 values kept in float32 tensors), as a float16/bfloat16 kernel would store them.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..quant.dtype import Dtype

NARROW_FLOATS = {Dtype.FP16: torch.float16, Dtype.BFP16: torch.bfloat16}
WEIGHT_ONLY_FLOAT_FORMATS = (Dtype.FP8_E4M3FN, Dtype.FP4_E2M1FN)


def round_to_float_dtype(x: torch.Tensor, dtype: Dtype) -> torch.Tensor:
    """`x` rounded (to nearest even) to the values of float16/bfloat16, as float32; other dtypes unchanged."""
    narrow = NARROW_FLOATS.get(dtype)
    if narrow is None or not x.is_floating_point():
        return x
    return x.to(narrow).to(torch.float32)


def weight_only_dequantized(node: Any) -> Optional[torch.Tensor]:
    """The float weights a float layer with weight-only quantized weights computes with (cached), else None."""
    w = node.constants.get("weights")
    if w is None or not ("weights_scale" in node.constants or "weights_scale" in node.params):
        return None
    if w.betensor.is_floating_point() and w.dtype not in WEIGHT_ONLY_FLOAT_FORMATS:
        return None
    cached = node.attrs.get("_weight_only_float")
    if cached is not None and cached[0] is w.betensor:
        return cached[1]
    if "weight_block_size" in node.params:  # one scale (and zero point) per block of consecutive weights
        size = int(node.params["weight_block_size"])
        blocks = w.betensor.to(torch.float32).reshape(-1, size)
        scale = node.constants["weights_scale"].betensor.to(torch.float32).reshape(-1, 1)
        zp = node.constants["weights_zp"].betensor.to(torch.float32).reshape(-1, 1) \
            if "weights_zp" in node.constants else torch.zeros_like(scale)
        values = ((blocks + zp) * (1.0 / scale)).reshape(w.betensor.shape)
        node.attrs["_weight_only_float"] = (w.betensor, values)
        return values
    if "weights_scale" in node.constants:
        shape = [-1] + [1] * (w.betensor.dim() - 1)
        scale = node.constants["weights_scale"].betensor.to(torch.float32).reshape(shape)
        zp = node.constants["weights_zp"].betensor.to(torch.float32).reshape(shape) \
            if "weights_zp" in node.constants else torch.zeros_like(scale)
    else:
        scale = torch.tensor(float(node.params["weights_scale"]), dtype=torch.float32)
        zp = torch.tensor(float(node.params.get("weights_zp", 0)), dtype=torch.float32)
    values = (w.betensor.to(torch.float32) + zp) * (1.0 / scale)
    node.attrs["_weight_only_float"] = (w.betensor, values)
    return values


def run_float_layer(node: Any, fn: Callable[[Any], None]) -> None:
    """Run a float layer's forward `fn` with dequantized weight-only weights, then round outputs to their type."""
    w_float = weight_only_dequantized(node)
    if w_float is None:
        fn(node)
    else:
        w = node.constants["weights"]
        stored = w.betensor
        w.betensor = w_float
        try:
            fn(node)
        finally:
            w.betensor = stored
    for t in node.outputs:
        if t.dtype in NARROW_FLOATS:
            t.betensor = round_to_float_dtype(t.betensor, t.dtype)
