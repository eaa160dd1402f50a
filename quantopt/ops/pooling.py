"""Pooling MAX / AVG on NHWC (or [N, W, C] 1-D) activations: float forward, quantization, exact integer forward.

Output sizes follow ONNX/PyTorch: floor or ceil of (in + pads - dilated kernel) / stride + 1, where in ceil mode a
window that would start in the right/bottom padding is dropped. Pads may be asymmetric, so they are applied
explicitly (plus any extra cells a ceil-mode window runs past the padded edge) and the pool runs with padding 0.
AVG divides each window sum by the number of real input cells it covers (count_include_pad=false) or by the number of
input-plus-pad cells it covers (count_include_pad=true); cells beyond the padded input are never counted.

Quantized, both methods pass the input's scale/zero point/dtype through (as upstream; no IR params are added) and
the integer forward follows the same window geometry: MAX takes the integer maximum (padding never wins), AVG sums
(x_q + zp) exactly, divides by the same count with round-half-to-even and subtracts zp again
(docs/integer-semantics.md).
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register, quant_register
from ._quant import check_quantized_inputs, copy_params, int_value, out_range, tensor_zp
from ._shared import bool_param

# The Parser always writes count_include_pad for AVG pooling; when a hand-made IR omits it we follow the Parser's
# own attribute default (false, as ONNX). Note: the original OPT forward defaults it to true.
COUNT_INCLUDE_PAD_DEFAULT = False
_MISSING = object()
METHODS = ("MAX", "AVG")
EXACT_FLOAT64 = 2 ** 53
"""Window sums of integers below this magnitude are exact in float64."""
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
    dtype = x.dtype if x.is_floating_point() else torch.float64  # counts are small integers: exact either way
    if padded_counts:
        m = torch.ones(1, 1, h + top + bottom, w + left + right, dtype=dtype, device=x.device)
        return F.pad(m, (0, extra[1], 0, extra[0]))
    m = torch.ones(1, 1, h, w, dtype=dtype, device=x.device)
    return F.pad(m, (left, right + extra[1], top, bottom + extra[0]))


def _plan(node: PyNode, x: torch.Tensor, p: dict) -> Tuple[Tuple[int, int], Tuple[int, int, int, int],
                                                          Tuple[int, int]]:
    """((out_h, out_w), pads incl. ceil-mode extra cells as F.pad wants them, (extra_h, extra_w))."""
    k, s, d, (left, right, top, bottom) = p["k"], p["s"], p["d"], p["pads"]
    oh, eh = _axis_plan(node, "height", x.shape[2], k[0], s[0], d[0], top, bottom, p["ceil"])
    ow, ew = _axis_plan(node, "width", x.shape[3], k[1], s[1], d[1], left, right, p["ceil"])
    return (oh, ow), (left, right + ew, top, bottom + eh), (eh, ew)


def _check_size(node: PyNode, y: torch.Tensor, size: Tuple[int, int]) -> None:
    if tuple(y.shape[2:]) != tuple(size):
        raise node._error(f"internal: pooled size {list(y.shape[2:])} differs from the planned {list(size)}")


def _divisors(node: PyNode, x: torch.Tensor, p: dict, extra: Tuple[int, int], method: str) -> torch.Tensor:
    """[1,1,OH,OW] cell counts each window divides by (AVG), after checking no window covers only padding."""
    k, s, d = p["k"], p["s"], p["d"]
    real = _window_sum(_real_mask(x, p["pads"], extra, False), k, s, d)
    if bool((real <= 0).any()):
        raise node._error("a pooling window covers only padding (pads too large for kernel/stride)")
    if method == "AVG" and bool_param(node, "count_include_pad", COUNT_INCLUDE_PAD_DEFAULT):
        return _window_sum(_real_mask(x, p["pads"], extra, True), k, s, d)
    return real


def pool2d_nchw(node: PyNode, x: torch.Tensor, p: dict, method: str) -> torch.Tensor:
    """MAX/AVG pool of an NCHW float tensor with explicit asymmetric pads and exact ceil-mode windows."""
    size, full, extra = _plan(node, x, p)
    divisor = _divisors(node, x, p, extra, method)
    if method == "MAX":
        xp = F.pad(x, full, value=float("-inf")) if any(full) else x
        y = F.max_pool2d(xp, p["k"], p["s"], padding=0, dilation=p["d"], ceil_mode=False)
    else:
        xp = F.pad(x, full, value=0.0) if any(full) else x
        y = _window_sum(xp, p["k"], p["s"], p["d"]) / divisor
    _check_size(node, y, size)
    return y


def round_half_even_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """Exact round-half-to-even of num / den for int64 tensors with den > 0."""
    q = torch.div(num, den, rounding_mode="floor")
    twice_rem = 2 * (num - q * den)
    up = (twice_rem > den) | ((twice_rem == den) & (q % 2 == 1))
    return q + up.to(torch.int64)


def pool2d_nchw_int(node: PyNode, x: torch.Tensor, zp: int, p: dict, method: str) -> torch.Tensor:
    """Integer MAX/AVG pool of an NCHW int64 tensor (values in [qmin, qmax]); int64 result before clamping.

    MAX: window maximum, padding acts as -inf. AVG: S = sum of (x + zp) over the window's real cells (padding is
    float 0, i.e. contributes 0 to S), y = round_half_even(S / count) - zp with the float forward's count.
    Sums are formed in float64, exact while |x + zp| * window size < 2^53 (checked).
    """
    size, full, extra = _plan(node, x, p)
    divisor = _divisors(node, x, p, extra, method)
    if method == "MAX":
        xf = x.to(torch.float64)
        xp = F.pad(xf, full, value=float("-inf")) if any(full) else xf
        y = F.max_pool2d(xp, p["k"], p["s"], padding=0, dilation=p["d"], ceil_mode=False)
        _check_size(node, y, size)
        return y.to(torch.int64)
    shifted = x + zp
    window = p["k"][0] * p["k"][1]
    bound = (int(shifted.abs().max()) if shifted.numel() else 0) * window
    if bound >= EXACT_FLOAT64:
        raise UnsupportedError(f"layer '{node.name}': AVG window sums up to {bound} are too wide for the exact "
                               "integer forward (limit 2^53)")
    xp = F.pad(shifted.to(torch.float64), full, value=0.0) if any(full) else shifted.to(torch.float64)
    total = _window_sum(xp, p["k"], p["s"], p["d"]).to(torch.int64)
    _check_size(node, total, size)
    return round_half_even_div(total, divisor.to(torch.int64)) - zp


def _method(node: PyNode, quantizing: bool = False) -> str:
    """The pooling method; others are an IR error for the forward and 'unsupported' for quantization."""
    method = str(node.get_param("method")).upper()
    if method not in METHODS:
        message = f"unsupported pooling method '{method}' (supported: {', '.join(METHODS)})"
        if quantizing:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): quantizing {message}")
        raise node._error(message)
    return method


@op_register(OpType.Pooling)
def pooling_forward(self: PyNode) -> None:
    method = _method(self)
    x = self.inputs[0].betensor
    if x.dim() not in (3, 4):
        raise self._error(f"input must be 4-D NHWC (or 3-D [N, W, C]), got shape {list(x.shape)}")
    one_d = x.dim() == 3
    p = _params(self, one_d)
    if self.quantized:
        xi = int_value(self.inputs[0])
        xc = (xi.unsqueeze(1) if one_d else xi).permute(0, 3, 1, 2)
        y = pool2d_nchw_int(self, xc, tensor_zp(self.inputs[0]), p, method)
        qmin, qmax = out_range(self.outputs[0])
        y = torch.clamp(y, qmin, qmax).permute(0, 2, 3, 1)
    else:
        x = x.to(x.dtype if x.is_floating_point() else torch.float32)
        xc = (x.unsqueeze(1) if one_d else x).permute(0, 3, 1, 2)
        y = pool2d_nchw(self, xc, p, method).permute(0, 2, 3, 1)
    self.outputs[0].betensor = (y.squeeze(1) if one_d else y).contiguous()


@quant_register(OpType.Pooling)
def pooling_quantize(self: PyNode) -> None:
    """MAX and AVG keep the input's quantization (upstream writes no extra params for either): a maximum or an
    average of values lies in the input's range, and the integer AVG handles padding exactly itself."""
    _method(self, quantizing=True)
    check_quantized_inputs(self, self.inputs[:1])
    tensor_zp(self.inputs[0])  # per-channel zero points are not supported by the integer AVG/MAX
    copy_params(self.outputs[0], self.inputs[0])
