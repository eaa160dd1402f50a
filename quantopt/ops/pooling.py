"""Pooling MAX / AVG (float forward) on NHWC (or [N, W, C] 1-D) activations.

Output sizes follow ONNX/PyTorch: floor or ceil of (in + pads - dilated kernel) / stride + 1, where in ceil mode a
window that would start in the right/bottom padding is dropped. Pads may be asymmetric, so they are applied
explicitly (plus any extra cells a ceil-mode window runs past the padded edge) and the pool runs with padding 0.
AVG divides each window sum by the number of real input cells it covers (count_include_pad=false) or by the number of
input-plus-pad cells it covers (count_include_pad=true); cells beyond the padded input are never counted.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import bool_param

# The Parser always writes count_include_pad for AVG pooling; when a hand-made IR omits it we follow the Parser's
# own attribute default (false, as ONNX). Note: the original OPT forward defaults it to true.
COUNT_INCLUDE_PAD_DEFAULT = False
_MISSING = object()
_PAD_KEYS = ("pad_left", "pad_right", "pad_top", "pad_bottom")


def _int_param(node: PyNode, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = node.get_param(key, optional=default is not _MISSING,
                           default_value=None if default is _MISSING else default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    if int(value) < minimum:
        raise node._error(f"parameter '{key}' must be >= {minimum}, got {value}")
    return int(value)


def _axis_plan(node: PyNode, axis: str, size: int, k: int, s: int, d: int, before: int, after: int,
               ceil_mode: bool) -> Tuple[int, int]:
    """(output size, extra cells to append after the padding so the last window fits) along one spatial axis."""
    k_ext = d * (k - 1) + 1
    span = size + before + after - k_ext
    if span < 0:
        raise node._error(f"{axis}: dilated kernel {k_ext} is larger than the padded input {size + before + after}")
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + before:
        out -= 1
    extra = max(0, (out - 1) * s + k_ext - (size + before + after))
    return out, extra


def _window_sum(x: torch.Tensor, k: Tuple[int, int], s: Tuple[int, int], d: Tuple[int, int]) -> torch.Tensor:
    """Sum over each (dilated) window of an NCHW tensor, no padding."""
    if d == (1, 1):
        return F.avg_pool2d(x, k, s, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=1)
    n, c, h, w = x.shape
    cols = F.unfold(x.reshape(n * c, 1, h, w), k, dilation=d, stride=s)
    oh = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    return cols.sum(1).reshape(n, c, oh, ow)


def _params(node: PyNode, one_d: bool) -> dict:
    p = {
        "k": (1 if one_d else _int_param(node, "kernel_y"), _int_param(node, "kernel_x")),
        "s": (_int_param(node, "stride_y", 1), _int_param(node, "stride_x", 1)),
        "d": (_int_param(node, "dilation_y", 1), _int_param(node, "dilation_x", 1)),
        "pads": tuple(_int_param(node, key, 0, minimum=0) for key in _PAD_KEYS),
        "ceil": bool_param(node, "ceil_mode", False),
    }
    if one_d:
        for key in ("kernel_y", "stride_y", "dilation_y"):
            if _int_param(node, key, 1) != 1:
                raise node._error(f"a 3-D [N, W, C] input needs {key}=1")
        if p["pads"][2] or p["pads"][3]:
            raise node._error("a 3-D [N, W, C] input cannot have pad_top/pad_bottom")
    return p


def _real_mask(x: torch.Tensor, pads: Tuple[int, int, int, int], extra: Tuple[int, int],
               padded_counts: bool) -> torch.Tensor:
    """[1,1,H',W'] mask of the cells a window may count: real cells, or real + pad cells when `padded_counts`."""
    h, w = x.shape[2], x.shape[3]
    left, right, top, bottom = pads
    if padded_counts:
        m = torch.ones(1, 1, h + top + bottom, w + left + right, dtype=x.dtype, device=x.device)
        return F.pad(m, (0, extra[1], 0, extra[0]))
    m = torch.ones(1, 1, h, w, dtype=x.dtype, device=x.device)
    return F.pad(m, (left, right + extra[1], top, bottom + extra[0]))


def pool2d_nchw(node: PyNode, x: torch.Tensor, p: dict, method: str) -> torch.Tensor:
    """MAX/AVG pool of an NCHW float tensor with explicit asymmetric pads and exact ceil-mode windows."""
    k, s, d, pads = p["k"], p["s"], p["d"], p["pads"]
    left, right, top, bottom = pads
    oh, eh = _axis_plan(node, "height", x.shape[2], k[0], s[0], d[0], top, bottom, p["ceil"])
    ow, ew = _axis_plan(node, "width", x.shape[3], k[1], s[1], d[1], left, right, p["ceil"])
    full = (left, right + ew, top, bottom + eh)
    real = _window_sum(_real_mask(x, pads, (eh, ew), False), k, s, d)
    if bool((real <= 0).any()):
        raise node._error("a pooling window covers only padding (pads too large for kernel/stride)")
    if method == "MAX":
        xp = F.pad(x, full, value=float("-inf")) if any(full) else x
        y = F.max_pool2d(xp, k, s, padding=0, dilation=d, ceil_mode=False)
    else:
        xp = F.pad(x, full, value=0.0) if any(full) else x
        include = bool_param(node, "count_include_pad", COUNT_INCLUDE_PAD_DEFAULT)
        divisor = _window_sum(_real_mask(x, pads, (eh, ew), True), k, s, d) if include else real
        y = _window_sum(xp, k, s, d) / divisor
    if tuple(y.shape[2:]) != (oh, ow):
        raise node._error(f"internal: pooled size {list(y.shape[2:])} differs from the planned {[oh, ow]}")
    return y


@op_register(OpType.Pooling)
def pooling_forward(self: PyNode) -> None:
    if self.quantized:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the integer forward is not implemented yet")
    method = str(self.get_param("method")).upper()
    if method not in ("MAX", "AVG"):
        raise self._error(f"unsupported pooling method '{method}' (supported: MAX, AVG)")
    x = self.inputs[0].betensor
    if x.dim() not in (3, 4):
        raise self._error(f"input must be 4-D NHWC (or 3-D [N, W, C]), got shape {list(x.shape)}")
    one_d = x.dim() == 3
    p = _params(self, one_d)
    x = x.to(x.dtype if x.is_floating_point() else torch.float32)
    xc = (x.unsqueeze(1) if one_d else x).permute(0, 3, 1, 2)
    y = pool2d_nchw(self, xc, p, method).permute(0, 2, 3, 1)
    self.outputs[0].betensor = (y.squeeze(1) if one_d else y).contiguous()
