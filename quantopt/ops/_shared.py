"""Float helpers shared by several operator families (op modules import only this, never each other)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..graph.node import PyNode

FUSED_ACTIVATIONS = ("NONE", "RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU")


def apply_fused_activation(node: PyNode, x: torch.Tensor, method: Optional[str] = None) -> torch.Tensor:
    """Apply `with_activation` (or `method`) of a MAC/eltwise layer in float: NONE, RELU, RELU6, CLIP,
    LEAKYRELU (`negative_slope` param) and PRELU (`negative_slope` constant, broadcast over the last axis)."""
    act = str(method if method is not None else node.get_param("with_activation", optional=True,
                                                               default_value="NONE")).upper()
    if act == "NONE":
        return x
    if act == "RELU":
        return F.relu(x)
    if act == "RELU6":
        return torch.clamp(x, 0.0, 6.0)
    if act == "CLIP":
        lo = float(node.get_param("clip_min"))
        hi = float(node.get_param("clip_max"))
        return torch.clamp(x, lo, hi)
    if act == "LEAKYRELU":
        slope = float(node.get_param("negative_slope", optional=True,
                                     default_value=node.get_param("negative_slope_value", optional=True,
                                                                  default_value=0.01)))
        return F.leaky_relu(x, slope)
    if act == "PRELU":
        slope_t = node.get_constant("negative_slope", optional=True)
        if slope_t is None:
            slope = torch.tensor(float(node.get_param("negative_slope")), dtype=x.dtype)
        else:
            slope = slope_t.betensor.to(x.dtype)
            if slope.dim() == x.dim() and slope.shape[0] == 1 and x.shape[0] != 1:
                slope = slope.expand_as(x) if slope.shape[1:] == x.shape[1:] else slope
        return torch.where(x >= 0, x, x * slope)
    raise node._error(f"unsupported fused activation '{act}' (supported: {', '.join(FUSED_ACTIVATIONS)})")
