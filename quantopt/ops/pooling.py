"""Pooling MAX / AVG on NHWC (or [N, W, C] 1-D) activations: float forward, quantization, integer forward.

Output sizes follow ONNX/PyTorch: floor or ceil of (in + pads - dilated kernel) / stride + 1, where in ceil mode a
window that would start in the right/bottom padding is dropped. Pads may be asymmetric, so they are applied
explicitly (plus any extra cells a ceil-mode window runs past the padded edge) and the pool runs with padding 0.
AVG divides each window sum by the number of real input cells it covers (count_include_pad=false) or by the number of
input-plus-pad cells it covers (count_include_pad=true); cells beyond the padded input are never counted.

Quantized, both methods pass the input's scale/zero point/dtype through (as upstream; no IR params are added) and
the integer forward follows the same window geometry: MAX takes the integer maximum (padding never wins), AVG sums
(x_q + zp) exactly, multiplies by upstream's 8-bit approximation of 1/count (M / 2^N), rounds half to even and
subtracts zp again (docs/integer-semantics.md).

The rest of the family lives here too (docs/semantics/pooling.md): Pooling L1/L2 (integer window sums, a 16-bit
multiplier/shift and, for L2, a sqrt table), GlobalPool, AdaptivePool, Pooling3D (NDHWC), MaxPoolingWithArgMax
(values plus exact int32 indices) and MaxUnpool.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.memo import freeze, layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..quant.hardware import POOLING_SHIFT_MAX
from ..quant.int_matmul import exact_int_matmul
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import ScaleLike, linear_quant_params
from ..quant.requant import broadcasts_into, exact_int64_, int64_to_float64, requantize_int, scale_shift, shift_factor
from ..quant.rounding import FLOAT32_EXACT, FLOAT64_EXACT, MAGIC_EXACT, div_round_half_even, round_shift
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Bool, Int, Ints, Param, Text, Value
from ..threads import one_thread
from ._conv_nhwc import output_size
from ._lut_int import range_bits
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    copy_params,
    int_value,
    layer_settings,
    out_range,
    quant_of,
    quantize_activation,
    requant_of,
    scale_of,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param
from .onnx_build.exact import DOUBLE, INT64, codes, emit_integers, round_div_int64
from .onnx_build.mac import window_sums
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import FLOAT, QDQGraph, QParams, int_or, node_error, same_qparams

# The Parser always writes count_include_pad for AVG pooling; when a hand-made IR omits it we follow the Parser's
# own attribute default (false, as ONNX). Note: the original OPT forward defaults it to true.
COUNT_INCLUDE_PAD_DEFAULT = False
_MISSING = object()
METHODS = ("MAX", "AVG", "L1", "L2")
_PAD_KEYS = ("pad_left", "pad_right", "pad_top", "pad_bottom")
_SEM = "docs/semantics/pooling.md"
_UNREAD_SCALE = Param(Value(), "written by some Parser versions; not read")
_REQUANT_CONSTANTS = {"scale": "per-channel L1/L2 multipliers, read when present",
                      "shift": "per-channel L1/L2 shifts, read when present"}
_PADS_2D = {key: Param(Int(lo=0), f"{key[4:]} padding (input cells)", default=0) for key in _PAD_KEYS}
_POOL_DTYPES = "float32 → MAX/AVG: input's dtype; L1/L2: uint8/uint16"
_LP_SUMMARY = ("Quantized L1/L2 layers carry scale_value/shift_value (16-bit multiplier and shift) and L2 also the "
               "constant sqrt_lut.")

# ------------------------------------------------------------------------------------------------ Pooling, GlobalPool
POOLING = declare_op(
    "Pooling",
    params={"method": Param(Text(choices=METHODS), "pooling method", required=True),
            "kernel_x": Param(Int(lo=1), "window width", required=True),
            "kernel_y": Param(Int(lo=1), "window height (required for a 4-D input; 1 or absent for a 3-D [N, W, C] "
                                         "one)"),
            "stride_x": Param(Int(lo=1), "horizontal stride", default=1),
            "stride_y": Param(Int(lo=1), "vertical stride", default=1),
            "dilation_x": Param(Int(lo=1), "horizontal dilation", default=1),
            "dilation_y": Param(Int(lo=1), "vertical dilation", default=1),
            **_PADS_2D,
            "ceil_mode": Param(Bool(), "ceil instead of floor for the output size (a window starting in the "
                                       "right/bottom padding is dropped)", default=False),
            "count_include_pad": Param(Bool(), "AVG: divide by the real + padding cells a window covers instead of "
                                               "the real ones", default=False)},
    constants={**_REQUANT_CONSTANTS, "sqrt_lut": "quantized L2: the square-root table"},
    dtypes=_POOL_DTYPES,
    integer="MAX/AVG: window max / window sum times an 8-bit M/2^N of 1/count; L1: sum |x+zp| then M/shift; "
            "L2: sum of squares → 16-bit code (M/shift) → sqrt LUT", semantics=f"{_SEM}#pooling", summary=_LP_SUMMARY)

GLOBALPOOL = declare_op(
    "GlobalPool",
    params={"method": Param(Text(choices=METHODS), "pooling method", required=True),
            **_PADS_2D,
            "count_include_pad": Param(Bool(), "AVG: divide by the real + padding cells instead of the real ones",
                                       default=False),
            **{key: Param(Int(lo=0), "not read: the window covers the whole padded input")
               for key in ("kernel_x", "kernel_y", "stride_x", "stride_y", "dilation_x", "dilation_y")},
            "ceil_mode": Param(Bool(), "not read (one window)")},
    constants={**_REQUANT_CONSTANTS, "sqrt_lut": "quantized L2: the square-root table"},
    dtypes=_POOL_DTYPES,
    integer="Pooling with one window covering the whole padded input", semantics=f"{_SEM}#globalpool",
    summary=_LP_SUMMARY)


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
    with one_thread(n * c * oh * ow == 1):  # a float sum to one value: the same at any thread count
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


MAX_POOL_TAPS = 16
"""Integer windows of at most this many cells are max-pooled tap by tap on the channels-last data
(`_max_pool_taps`); larger ones (a global max pool) by torch's kernel."""


def _max_pool_taps(xp: torch.Tensor, k: Sequence[int], s: Sequence[int], d: Sequence[int]) -> Any:
    """MAX pool of the padded NCHW view `xp` (channels-last data underneath) as the running maximum of its kernel
    taps, each a strided view of the data: torch's max_pool2d on such a view runs a slow channels-last path (5-20x
    slower on a 2x2 stride-1 pool of a 320x320 map). For the integer forward only, whose values (integers in
    float64, -inf padding) hold no NaN and no signed zero: there any tie rule gives the same value, while on float
    data `torch.maximum` keeps the first or the second zero of a tie depending on whether a vector or a scalar
    loop ran, and max_pool2d keeps the first. Returned as an NCHW view of channels-last data; None for a large
    window or a differentiable forward, for torch's kernel."""
    kh, kw = int(k[0]), int(k[1])
    if kh * kw > MAX_POOL_TAPS or (torch.is_grad_enabled() and xp.requires_grad):
        return None
    x = xp.permute(0, 2, 3, 1)  # [N, Hp, Wp, C]
    (sy, sx), (dy, dx) = (int(s[0]), int(s[1])), (int(d[0]), int(d[1]))
    ho, wo = output_size(int(x.shape[1]), kh, sy, dy), output_size(int(x.shape[2]), kw, sx, dx)
    if ho <= 0 or wo <= 0:
        return None
    out = None
    for ky in range(kh):
        for kx in range(kw):
            view = x[:, ky * dy:ky * dy + sy * (ho - 1) + 1:sy, kx * dx:kx * dx + sx * (wo - 1) + 1:sx]
            out = view.contiguous() if out is None else torch.maximum(out, view, out=out)
    return out.permute(0, 3, 1, 2)


def pool2d_nchw(node: PyNode, x: torch.Tensor, p: dict, method: str) -> torch.Tensor:
    """MAX/AVG pool of an NCHW float tensor with explicit asymmetric pads and exact ceil-mode windows."""
    size, full, extra = _plan(node, x, p)
    key = (freeze(p), extra, tuple(x.shape), x.dtype, str(x.device), method,
           freeze(node.params.get("count_include_pad")))
    divisor = memo(node, "pool_divisors", key, lambda: _divisors(node, x, p, extra, method))
    if method == "MAX":
        xp = F.pad(x, full, value=float("-inf")) if any(full) else x
        y = F.max_pool2d(xp, p["k"], p["s"], padding=0, dilation=p["d"], ceil_mode=False)
    else:
        xp = F.pad(x, full, value=0.0) if any(full) else x
        y = _window_sum(xp, p["k"], p["s"], p["d"]) / divisor
    _check_size(node, y, size)
    return y


def pool2d_nchw_int(node: PyNode, x: torch.Tensor, zp: int, p: dict, method: str) -> torch.Tensor:
    """Integer MAX/AVG pool of an NCHW int64 tensor (values in [qmin, qmax]); int64 result before the caller's
    clamping to the output range (a MAX of hand-fed codes beyond ±2^24 may come out rounded there, the same after it).

    MAX: window maximum, padding acts as -inf. AVG: S = sum of (x + zp) over the window's real cells (padding is
    float 0, i.e. contributes 0 to S), clamped to [-2^31, 2^31]; y = round_half_even(S * M / 2^shift) - zp_out with
    (M, shift) the 8-bit approximation of s_out / s_in / count (float32, as upstream's integer forward; `avg_requant`).
    Sums are formed in float64, exact while |x + zp| * window size < 2^53 (checked).
    """
    size, full, _, divisor, requant, kept = _int_plan(node, x, p, method)
    if method == "MAX":
        # float32 where the output range lies within ±2^24: codes there are exact in float32, and a code beyond it
        # (a hand-fed input) rounds to a value that the caller's clamp to [qmin, qmax] maps as the code itself;
        # the taps' passes then move half of float64's bytes (about 2x faster)
        qmin, qmax = out_range(node, node.outputs[0])
        xf = x.to(torch.float32 if max(-qmin, qmax) < FLOAT32_EXACT else torch.float64)
        xp = F.pad(xf, full, value=float("-inf")) if any(full) else xf
        y = _max_pool_taps(xp, p["k"], p["s"], p["d"])
        if y is None:
            y = F.max_pool2d(xp, p["k"], p["s"], padding=0, dilation=p["d"], ceil_mode=False)
        _check_size(node, y, size)
        return y.to(torch.int64)
    if "avg_float64" not in kept:  # what the float64 form derives from the layer alone, once per plan
        kept["avg_float64"] = _avg_float64_plan(node, zp, p, requant)
    fast = _avg_int_float64(node, x, kept["avg_float64"], p, full, size)
    if fast is not None:
        return fast
    shifted = x + zp
    window = p["k"][0] * p["k"][1]
    bound = (int(shifted.abs().max()) if shifted.numel() else 0) * window
    if bound >= FLOAT64_EXACT:
        raise UnsupportedError(f"layer '{node.name}': AVG window sums up to {bound} are too wide for the exact "
                               "integer forward (limit 2^53)")
    xp = F.pad(shifted.to(torch.float64), full, value=0.0) if any(full) else shifted.to(torch.float64)
    total = _window_sum(xp, p["k"], p["s"], p["d"]).to(torch.int64)
    _check_size(node, total, size)
    total = torch.clamp(total, -AVG_SUM_LIMIT, AVG_SUM_LIMIT)
    mult, shift = requant
    return requantize_int(total, mult, shift, 0, -2 ** 62, 2 ** 62) - tensor_zp(node, node.outputs[0])


def _avg_float64_plan(node: PyNode, zp: Any, p: dict, requant: Tuple[torch.Tensor, torch.Tensor]
                      ) -> Optional[Tuple[torch.Tensor, bool, Any, int]]:
    """(factor M·2^-shift, whether float32 is exact, the input's zero point, the output's) of `_avg_int_float64`
    when the input's stored range proves every step exact: window sums of |x + zp| below 2^53 (so the general
    path's check cannot fail), |S·M| < 2^53 after the ±2^31 clamp, and results (zero point subtracted) below 2^51
    with |shift| < 900; float32 (half the bytes per pass) where the range proves |S·M| + |zp_out| < 2^24 and the
    factor is a float32 value, so that every step is exact there too. None otherwise, for the general path. From
    the layer alone (its params, quantization and plan), so made once per plan: forming it cost a small pool as
    much as its arithmetic."""
    lo, hi = out_range(node, node.inputs[0])
    window = p["k"][0] * p["k"][1]
    in_bound = max(abs(lo + zp), abs(hi + zp))
    if max(abs(lo), abs(hi)) >= MAGIC_EXACT or in_bound * window >= FLOAT64_EXACT:
        return None
    mult, shift = requant
    m = torch.as_tensor(mult, dtype=torch.float64).cpu()
    sh = torch.as_tensor(shift, dtype=torch.float64).cpu()
    s_lo, s_hi = float(sh.min()), float(sh.max())
    m_max = float(m.abs().max())
    zp_out = tensor_zp(node, node.outputs[0])
    if not -900 < s_lo <= s_hi < 900 or AVG_SUM_LIMIT * m_max >= FLOAT64_EXACT or \
            math.ldexp(AVG_SUM_LIMIT * m_max, int(-s_lo)) + abs(zp_out) + 1 >= MAGIC_EXACT:
        return None
    factor = shift_factor(m, sh, torch.device("cpu"))  # as requantize_float64 forms it (on the CPU)
    narrow = (in_bound * window * m_max + abs(zp_out) < FLOAT32_EXACT and isinstance(zp, (int, float))
              and bool((factor.to(torch.float32).to(torch.float64) == factor).all()))
    return (factor.to(torch.float32) if narrow else factor), narrow, zp, zp_out


def _avg_int_float64(node: PyNode, x: torch.Tensor, plan: Optional[Tuple[torch.Tensor, bool, Any, int]], p: dict,
                     full: Any, size: Any) -> Any:
    """The AVG branch of `pool2d_nchw_int`, bit for bit, in float64 from end to end (one conversion each way instead
    of four, no int64 temporaries), or float32, as `plan` (`_avg_float64_plan`) proves exact; None where it has no
    plan, for the general path."""
    if plan is None or not x.numel():
        return None
    factor, narrow, zp, zp_out = plan
    if factor.device != x.device:
        factor = factor.to(x.device)
    if narrow:
        xf = x.to(torch.float32).add_(zp)
    else:
        xf = int64_to_float64(x, zp) if isinstance(zp, (int, float)) else int64_to_float64(x).add_(zp)
    xp = F.pad(xf, full, value=0.0) if any(full) else xf
    total = _window_sum(xp, p["k"], p["s"], p["d"])
    _check_size(node, total, size)
    if not broadcasts_into(factor.shape, total.shape):
        return None
    y = total.clamp_(-AVG_SUM_LIMIT, AVG_SUM_LIMIT).mul_(factor).round_().sub_(float(zp_out))
    return y.to(torch.int64) if narrow else exact_int64_(y, -MAGIC_EXACT + 1, MAGIC_EXACT - 1)


def _int_plan(node: PyNode, x: torch.Tensor, p: dict, method: str) -> Tuple[Any, ...]:
    """(size, pads, extra cells, divisors, AVG's (M, shift) or None, a dict for what the forward derives from these
    once) of the integer MAX/AVG pool: memoized per layer and input shape (graph/memo.py), they cost more than the
    pooling of a small input."""
    def build() -> Tuple[Any, ...]:
        size, full, extra = _plan(node, x, p)
        divisor = _divisors(node, x, p, extra, method)
        requant = avg_requant_of(node, divisor) if method == "AVG" else None
        return size, full, extra, divisor, requant, {}

    # `p` follows from the layer's params and type and the input's shape, all in the key already
    return memo(node, "pool_int", (layer_key(node), tuple(x.shape), method), build)


AVG_SUM_LIMIT = 2 ** 31
"""Integer AVG pooling clamps each window sum to [-2^31, 2^31] before the requantization (as upstream)."""

AVG_MULT_BITS = 8
"""Multiplier bits of the integer AVG requantization s_out / s_in / count (upstream's value)."""


def avg_requant(in_scale: ScaleLike, out_scale: ScaleLike, count: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(M, shift) per output cell for integer AVG pooling: `scale_shift` of the float32 ratio
    float32(float32(s_out) / float32(s_in)) / float32(count) with 8 multiplier bits (shift at most 31, may be
    negative). Scales are floats, or float32 vectors [C] of per-channel activations (then (M, shift) per channel and
    cell, [1, C, OH, OW] against the counts' [1, 1, OH, OW]). Not stored in the IR: a backend derives it from the
    scales and the window geometry. Derived on the CPU (then moved to the counts' device): the same multipliers on
    every device."""
    ratio = torch.as_tensor(out_scale, dtype=torch.float32).cpu() / torch.as_tensor(in_scale, dtype=torch.float32).cpu()
    if ratio.dim():  # per channel: along the channel axis of the NCHW counts
        ratio = ratio.reshape(1, -1, 1, 1)
    ratio = ratio / count.cpu().to(torch.float32)
    mult, shift, _, _ = scale_shift(ratio, AVG_MULT_BITS)
    return (torch.as_tensor(mult, dtype=torch.int64).to(count.device),
            torch.as_tensor(shift, dtype=torch.int64).to(count.device))


def avg_requant_of(node: PyNode, count: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`avg_requant` of the layer's input and output scales, per tensor or per channel (a per-channel activation
    passed on by the pool, docs/integer-semantics.md, "Per-channel activations")."""
    return avg_requant(scale_of(node, node.inputs[0]), scale_of(node, node.outputs[0]), count)


def _method(node: PyNode, quantizing: bool = False, allowed: Sequence[str] = METHODS) -> str:
    """The pooling method; others are an IR error for the forward and 'unsupported' for quantization."""
    method = str(node.get_param("method")).upper()
    if method not in allowed:
        message = f"unsupported pooling method '{method}' (supported: {', '.join(allowed)})"
        if quantizing:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): quantizing {message}")
        raise node._error(message)
    return method


# ------------------------------------------------------------------------------------------------ L1 / L2
LP_SUM_MAX = 2 ** 32 - 1
"""L1/L2 window sums saturate at this unsigned 32-bit accumulator bound before the requantization (as upstream)."""
LP_MULT_BITS = 16
"""Multiplier bits asked for the L1/L2 requantization (upstream's value; the 15-bit AIFF cap still applies)."""
L2_PLACEHOLDER_BITS = 16
"""L2: the sum of squares is requantized to an unsigned code of this many bits, which indexes the sqrt table."""


def lp_pool_nchw(node: PyNode, x: torch.Tensor, p: dict, power: int) -> torch.Tensor:
    """Float L1/L2 pool (ONNX LpPool, p = 1 or 2): (sum of |x|^p over the window)^(1/p); padding counts as 0."""
    size, full, extra = _plan(node, x, p)
    _divisors(node, x, p, extra, "MAX")  # rejects windows that cover only padding
    a = x.abs() if power == 1 else x * x
    ap = F.pad(a, full, value=0.0) if any(full) else a
    y = _window_sum(ap, p["k"], p["s"], p["d"])
    _check_size(node, y, size)
    return y if power == 1 else torch.sqrt(y)


def lp_window_sums_int(node: PyNode, x: torch.Tensor, zp: int, p: dict, power: int) -> torch.Tensor:
    """S = sum of |x + zp| (L1) or (x + zp)^2 (L2) over the real cells of each window, saturated to
    [0, LP_SUM_MAX]; exact (float64 sums of integers, bounded below 2^53 before summing)."""
    size, full, extra = _plan(node, x, p)
    _divisors(node, x, p, extra, "MAX")
    shifted = x + zp
    a = shifted.abs() if power == 1 else shifted * shifted
    bound = (int(a.max()) if a.numel() else 0) * p["k"][0] * p["k"][1]
    if bound >= FLOAT64_EXACT:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): window sums up to {bound} are too wide for the "
                               "exact integer forward (limit 2^53)")
    af = a.to(torch.float64)
    total = _window_sum(F.pad(af, full, value=0.0) if any(full) else af, p["k"], p["s"], p["d"]).to(torch.int64)
    _check_size(node, total, size)
    return torch.clamp(total, 0, LP_SUM_MAX)


def _lp_int(node: PyNode, x: torch.Tensor, p: dict, method: str) -> torch.Tensor:
    """Integer L1/L2 pool of an NCHW int64 tensor (docs/semantics/pooling.md#pooling-l1-and-l2)."""
    s = lp_window_sums_int(node, x, tensor_zp(node, node.inputs[0]), p, 1 if method == "L1" else 2)
    mult, shift = requant_of(node)
    if method == "L1":
        qmin, qmax = out_range(node, node.outputs[0])
        return requantize_int(s, mult, shift, tensor_zp(node, node.outputs[0]), qmin, qmax)
    code = torch.clamp(round_shift(s * int(mult), shift), 0, 2 ** L2_PLACEHOLDER_BITS - 1)
    lut = node.get_constant("sqrt_lut")
    return lookup_lut(code, lut.betensor, 0, L2_PLACEHOLDER_BITS, lut.dtype.bits, lut.dtype.is_signed)


def _global_params(node: PyNode, x: torch.Tensor, one_d: bool) -> dict:
    """GlobalPool: one window covering the whole padded input (upstream sets kernel = padded size)."""
    pads = tuple(_int_param(node, key, 0, minimum=0) for key in _PAD_KEYS)
    if one_d and (pads[2] or pads[3]):
        raise node._error("a 3-D [N, W, C] input cannot have pad_top/pad_bottom")
    h, w = (1, x.shape[1]) if one_d else (x.shape[1], x.shape[2])
    return {"k": (h + pads[2] + pads[3], w + pads[0] + pads[1]), "s": (1, 1), "d": (1, 1), "pads": pads,
            "ceil": False}


def _run_pool(node: PyNode, global_pool: bool) -> None:
    method = _method(node)
    x = node.inputs[0].betensor
    if x.dim() not in (3, 4):
        raise node._error(f"input must be 4-D NHWC (or 3-D [N, W, C]), got shape {list(x.shape)}")
    one_d = x.dim() == 3
    p = memo(node, "pool_params", (freeze(node.params), tuple(x.shape), global_pool),
             lambda: _global_params(node, x, one_d) if global_pool else _params(node, one_d))
    if node.quantized:
        xi = int_value(node.inputs[0])
        xc = (xi.unsqueeze(1) if one_d else xi).permute(0, 3, 1, 2)
        if method in ("MAX", "AVG"):
            y = pool2d_nchw_int(node, xc, tensor_zp(node, node.inputs[0]), p, method)
        else:
            y = _lp_int(node, xc, p, method)
        qmin, qmax = out_range(node, node.outputs[0])
        y = torch.clamp(y, qmin, qmax).permute(0, 2, 3, 1)
    else:
        x = x.to(x.dtype if x.is_floating_point() else torch.float32)
        xc = (x.unsqueeze(1) if one_d else x).permute(0, 3, 1, 2)
        if method in ("MAX", "AVG"):
            y = pool2d_nchw(node, xc, p, method)
        else:
            y = lp_pool_nchw(node, xc, p, 1 if method == "L1" else 2)
        y = y.permute(0, 2, 3, 1)
    node.outputs[0].betensor = (y.squeeze(1) if one_d else y).contiguous()


def _pool_quantize(node: PyNode) -> None:
    """MAX and AVG keep the input's quantization (upstream writes no extra params for either): a maximum or an
    average of values lies in the input's range, and the integer AVG handles padding exactly itself.
    L1/L2 get unsigned output params from their calibrated range and a 16-bit multiplier/shift (shift ceiling
    63); L2 also a sqrt table over an unsigned 16-bit code of the sum of squares (upstream's scheme)."""
    method = _method(node, quantizing=True)
    check_quantized_inputs(node, node.inputs[:1])
    tensor_zp(node, node.inputs[0])  # per-channel zero points are not supported by the integer forwards
    inp, out = node.inputs[0], node.outputs[0]
    if method in ("MAX", "AVG"):
        copy_params(node, out, inp)
        return
    s = layer_settings(node)
    quantize_activation(node, out, signed=False)
    s_in, s_out = tensor_scale(node, inp), tensor_scale(node, out)
    if method == "L1":
        ratio = s_out / s_in
    else:
        r = ranges_of(node).get(out)
        absmax = max(abs(float(r.min)), abs(float(r.max)))
        ph = linear_quant_params(0.0, absmax * absmax, L2_PLACEHOLDER_BITS,
                                 activation_mode(node, L2_PLACEHOLDER_BITS), False)
        ratio = float(ph.scale) / (s_in * s_in)
        q_out = quant_of(node).get(out)
        lut = build_lut(torch.sqrt, float(ph.scale), 0, ph.qmin, ph.qmax, range_bits(node, inp), s_out,
                        tensor_zp(node, out), int(q_out.qmin), int(q_out.qmax),
                        lut_items_in_bits=int(s.lut_items_in_bits))
        set_constant(node, "sqrt_lut", lut, out.dtype)
    mult, shift, mdt, sdt = scale_shift(ratio, LP_MULT_BITS, force_shift_positive=s.force_shift_positive,
                                        shift_limit=POOLING_SHIFT_MAX)
    store_requant(node, mult, shift, mdt, sdt)


@POOLING.forward
def pooling_forward(self: PyNode) -> None:
    _run_pool(self, global_pool=False)


@POOLING.quantize
def pooling_quantize(self: PyNode) -> None:
    _pool_quantize(self)


@GLOBALPOOL.forward
def globalpool_forward(self: PyNode) -> None:
    _run_pool(self, global_pool=True)


@GLOBALPOOL.quantize
def globalpool_quantize(self: PyNode) -> None:
    _pool_quantize(self)


# ------------------------------------------------------------------------------------------------ AdaptivePool
ADAPTIVE_METHODS = ("MAX", "AVG")

ADAPTIVEPOOL = declare_op(
    "AdaptivePool",
    params={"method": Param(Text(choices=ADAPTIVE_METHODS), "pooling method", required=True),
            "output_size": Param(Ints(lo=1), "output [h, w] (one integer serves both)", required=True),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES,
    integer="adaptive windows: max, or exact sum of (x+zp) divided by the cell count (round half even)",
    semantics=f"{_SEM}#adaptivepool")


def adaptive_bounds(n: int, o: int) -> Tuple[List[int], List[int]]:
    """Window i of an adaptive pool covers [floor(i*n/o), ceil((i+1)*n/o)) (PyTorch AdaptiveAvgPool)."""
    return [(i * n) // o for i in range(o)], [-((-(i + 1) * n) // o) for i in range(o)]


def _output_size(node: PyNode) -> Tuple[int, int]:
    value = node.get_param("output_size")
    vals = [value, value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(vals, (list, tuple)) or len(vals) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or int(v) < 1 for v in vals):
        raise node._error(f"parameter 'output_size' must be two integers >= 1, got {value!r}")
    return int(vals[0]), int(vals[1])


def _membership(starts: Sequence[int], ends: Sequence[int], n: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """[o, n] matrix with 1 where position j lies in window i."""
    pos = torch.arange(n, device=device)
    st = torch.tensor(list(starts), device=device)[:, None]
    en = torch.tensor(list(ends), device=device)[:, None]
    return ((pos >= st) & (pos < en)).to(dtype)


def _gather_max(x: torch.Tensor, dim: int, starts: Sequence[int], ends: Sequence[int]) -> torch.Tensor:
    """Max over variable windows along `dim`: short windows repeat their last cell (a repeat never changes a max)."""
    length = max(e - s for s, e in zip(starts, ends))
    idx = torch.tensor([[min(s + j, e - 1) for j in range(length)] for s, e in zip(starts, ends)], device=x.device)
    g = x.index_select(dim, idx.flatten())
    shape = list(x.shape)
    shape[dim:dim + 1] = [len(starts), length]
    return g.reshape(shape).amax(dim + 1)


def adaptive_pool_nhwc(x: torch.Tensor, size: Tuple[int, int], method: str, zp: int = 0,
                       integer: bool = False) -> torch.Tensor:
    """Adaptive MAX/AVG of an NHWC tensor. Integer AVG: round_half_even(sum(x + zp) / count) - zp, exact int64."""
    n_h, n_w = x.shape[1], x.shape[2]
    sh, eh = adaptive_bounds(n_h, size[0])
    sw, ew = adaptive_bounds(n_w, size[1])
    if method == "MAX":
        return _gather_max(_gather_max(x, 1, sh, eh), 2, sw, ew)
    dtype = torch.int64 if integer else x.dtype
    ah, aw = _membership(sh, eh, n_h, dtype, x.device), _membership(sw, ew, n_w, dtype, x.device)
    if integer:  # the same window sums as the einsum below, by exact integer products on any device
        n, c = int(x.shape[0]), int(x.shape[3])
        rows = exact_int_matmul(ah, (x + zp).reshape(n, n_h, n_w * c)).reshape(n, -1, n_w, c)  # [n, i, w, c]
        total = exact_int_matmul(rows.permute(0, 1, 3, 2), aw.t()).permute(0, 1, 3, 2)  # [n, i, j, c]
    else:
        total = torch.einsum("ih,nhwc,jw->nijc", ah, x, aw)
    count = (torch.tensor(eh) - torch.tensor(sh))[:, None] * (torch.tensor(ew) - torch.tensor(sw))[None, :]
    count = count[None, :, :, None].to(x.device)
    if integer:
        return div_round_half_even(total, count) - zp
    return total / count.to(x.dtype)


def _adaptive_method(node: PyNode, quantizing: bool = False) -> str:
    return _method(node, quantizing, ADAPTIVE_METHODS)


@ADAPTIVEPOOL.forward
def adaptivepool_forward(self: PyNode) -> None:
    method = _adaptive_method(self)
    size = _output_size(self)
    x = self.inputs[0].betensor
    if x.dim() not in (3, 4):
        raise self._error(f"input must be 4-D NHWC (or 3-D [H, W, C]), got shape {list(x.shape)}")
    xb = x.unsqueeze(0) if x.dim() == 3 else x
    if self.quantized:
        qmin, qmax = out_range(self, self.outputs[0])
        y = adaptive_pool_nhwc(int_value(self.inputs[0]).reshape(xb.shape), size, method,
                               tensor_zp(self, self.inputs[0]), integer=True)
        y = torch.clamp(y, qmin, qmax)
    else:
        y = adaptive_pool_nhwc(xb.to(xb.dtype if xb.is_floating_point() else torch.float32), size, method)
    self.outputs[0].betensor = (y[0] if x.dim() == 3 else y).contiguous()


@ADAPTIVEPOOL.quantize
def adaptivepool_quantize(self: PyNode) -> None:
    """Output keeps the input's quantization (as upstream): a maximum or an average stays in the input's range."""
    _adaptive_method(self, quantizing=True)
    check_quantized_inputs(self, self.inputs[:1])
    tensor_zp(self, self.inputs[0])
    copy_params(self, self.outputs[0], self.inputs[0])


# ------------------------------------------------------------------------------------------------ Pooling3D
_PAD3D_KEYS = (("pad_z_begin", "pad_z_end"), ("pad_y_begin", "pad_y_end"), ("pad_x_begin", "pad_x_end"))
_INT_PAD_SENTINEL = -(2 ** 62)
"""Padding value of the integer MAX windows: below every quantized value (windows always hold a real cell)."""
_AXIS_NAMES = {"z": "depth", "y": "height", "x": "width"}

POOLING3D = declare_op(
    "Pooling3D",
    params={"method": Param(Text(choices=("MAX", "AVG")), "pooling method", required=True),
            **{f"kernel_{a}": Param(Int(lo=1), f"window {_AXIS_NAMES[a]}", required=True) for a in "zyx"},
            **{f"stride_{a}": Param(Int(lo=1), f"{_AXIS_NAMES[a]} stride", default=1) for a in "zyx"},
            **{f"dilation_{a}": Param(Int(lo=1), f"{_AXIS_NAMES[a]} dilation", default=1) for a in "zyx"},
            **{key: Param(Int(lo=0), f"{_AXIS_NAMES[key[4]]} padding at the {'start' if side == 0 else 'end'}",
                          default=0) for pair in _PAD3D_KEYS for side, key in enumerate(pair)},
            "ceil_mode": Param(Bool(), "ceil instead of floor for the output size", default=False),
            "count_include_pad": Param(Bool(), "AVG: divide by the real + padding cells a window covers instead of "
                                               "the real ones", default=False),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="NDHWC window max / exact rounded average", semantics=f"{_SEM}#pooling3d")


def _params3d(node: PyNode) -> dict:
    return {
        "k": tuple(_int_param(node, f"kernel_{a}") for a in "zyx"),
        "s": tuple(_int_param(node, f"stride_{a}", 1) for a in "zyx"),
        "d": tuple(_int_param(node, f"dilation_{a}", 1) for a in "zyx"),
        "pads": tuple((_int_param(node, b, 0, minimum=0), _int_param(node, e, 0, minimum=0)) for b, e in _PAD3D_KEYS),
        "ceil": bool_param(node, "ceil_mode", False),
    }


def _axis_windows(x: torch.Tensor, dim: int, out: int, k: int, s: int, d: int) -> torch.Tensor:
    """Insert a window axis: dim `dim` of size n becomes [out, k] holding x[o*s + j*d] (no padding)."""
    idx = (torch.arange(out) * s)[:, None] + (torch.arange(k) * d)[None, :]
    g = x.index_select(dim, idx.flatten().to(x.device))
    shape = list(x.shape)
    shape[dim:dim + 1] = [out, k]
    return g.reshape(shape)


def _axis_counts(n: int, before: int, after: int, extra: int, out: int, k: int, s: int, d: int,
                 with_pad: bool) -> torch.Tensor:
    """Per output cell of one axis: how many real (or real + padding) cells its window covers."""
    mask = torch.tensor([0] * before + [1] * n + [0] * (after + extra), dtype=torch.int64)
    if with_pad:
        mask = torch.tensor([1] * (before + n + after) + [0] * extra, dtype=torch.int64)
    return _axis_windows(mask, 0, out, k, s, d).sum(1)


def pool3d_ncdhw(node: PyNode, x: torch.Tensor, p: dict, method: str, integer: bool = False,
                 zp: int = 0) -> torch.Tensor:
    """MAX/AVG pool over the last three axes of an NCDHW tensor, window sums/maxima taken axis by axis.

    Float: MAX ignores padding, AVG = window sum / count. Integer (int64): MAX as float; AVG =
    round_half_even(sum(x + zp) / count) - zp, exact. count = real cells, or real + padding cells with
    count_include_pad; cells a ceil-mode window reaches beyond the padded input never count.
    """
    names = ("depth", "height", "width")
    plans = []
    for a in range(3):
        before, after = p["pads"][a]
        out, extra = _axis_plan(node, names[a], x.shape[2 + a], p["k"][a], p["s"][a], p["d"][a], before, after,
                                p["ceil"])
        plans.append((out, extra))
    include = method == "AVG" and bool_param(node, "count_include_pad", COUNT_INCLUDE_PAD_DEFAULT)
    counts = []
    for a in range(3):
        before, after = p["pads"][a]
        real = _axis_counts(x.shape[2 + a], before, after, plans[a][1], plans[a][0], p["k"][a], p["s"][a],
                            p["d"][a], False)
        if bool((real <= 0).any()):
            raise node._error("a pooling window covers only padding (pads too large for kernel/stride)")
        counts.append(_axis_counts(x.shape[2 + a], before, after, plans[a][1], plans[a][0], p["k"][a], p["s"][a],
                                   p["d"][a], True) if include else real)
    pad = []
    for a in (2, 1, 0):
        pad += [p["pads"][a][0], p["pads"][a][1] + plans[a][1]]
    if method == "MAX":
        fill = _INT_PAD_SENTINEL if integer else float("-inf")
        v = F.pad(x, pad, value=fill) if any(pad) else x
    else:
        v = x + zp if integer else x
        v = F.pad(v, pad, value=0) if any(pad) else v
    for a in range(3):
        w = _axis_windows(v, 2 + a, plans[a][0], p["k"][a], p["s"][a], p["d"][a])
        v = w.amax(3 + a) if method == "MAX" else w.sum(3 + a)
    if method == "MAX":
        return v
    count = (counts[0][:, None, None] * counts[1][None, :, None] * counts[2][None, None, :])[None, None].to(v.device)
    if integer:
        return div_round_half_even(v, count) - zp
    return v / count.to(v.dtype)


def _method3d(node: PyNode, quantizing: bool = False) -> str:
    return _method(node, quantizing, ("MAX", "AVG"))


@POOLING3D.forward
def pooling3d_forward(self: PyNode) -> None:
    method = _method3d(self)
    x = self.inputs[0].betensor
    if x.dim() != 5:
        raise self._error(f"input must be 5-D NDHWC, got shape {list(x.shape)}")
    p = _params3d(self)
    if self.quantized:
        xc = int_value(self.inputs[0]).permute(0, 4, 1, 2, 3)
        y = pool3d_ncdhw(self, xc, p, method, integer=True, zp=tensor_zp(self, self.inputs[0]))
        y = torch.clamp(y, *out_range(self, self.outputs[0]))
    else:
        xc = x.to(x.dtype if x.is_floating_point() else torch.float32).permute(0, 4, 1, 2, 3)
        y = pool3d_ncdhw(self, xc, p, method)
    self.outputs[0].betensor = y.permute(0, 2, 3, 4, 1).contiguous()


@POOLING3D.quantize
def pooling3d_quantize(self: PyNode) -> None:
    """Output keeps the input's quantization, as for 2-D MAX/AVG pooling."""
    _method3d(self, quantizing=True)
    check_quantized_inputs(self, self.inputs[:1])
    tensor_zp(self, self.inputs[0])
    copy_params(self, self.outputs[0], self.inputs[0])


@POOLING3D.export
def convert_pooling3d(g: QDQGraph, node: PyNode) -> None:
    """MAX: MaxPool (3-D) channels-first, on the int8/uint8 codes where the output keeps the input's params (else
    on the dequantized values, lossless); AVG, every mode: quantopt's exact rounded average (`_exact_average3d`)."""
    method = _method3d(node)
    x, y = node.inputs[0], node.outputs[0]
    if g.rank(x) != 5:
        raise node_error(node, f"only 5-D NDHWC inputs are exported, got rank {g.rank(x)}")
    p = _params3d(node)
    params = {"k": list(p["k"]), "s": list(p["s"]), "d": list(p["d"]), "before": [b for b, _ in p["pads"]],
              "after": [e for _, e in p["pads"]], "sizes": [int(v) for v in x.ir_shape[1:4]], "ceil": p["ceil"],
              "count_pad": bool_param(node, "count_include_pad", COUNT_INCLUDE_PAD_DEFAULT)}
    if method == "AVG":
        _exact_average3d(g, node, params)
        return
    cf = channels_first(5)
    if same_qparams(node, x, y) and x.dtype.bits == 8:
        g.set_int(y, _pool_float(g, node, "MAX", g.int_value(x, cf), 5, [2, 3, 4], params), cf)  # exact
        return
    g.quantize(y, _pool_float(g, node, "MAX", g.float_value(x, cf), 5, [2, 3, 4], params), cf,
               lossless=same_qparams(node, x, y))


def _exact_average3d(g: QDQGraph, node: PyNode, params: dict) -> None:
    """`pool3d_ncdhw`'s integer AVG: the window sums of q + zp (the zero-padded NDHWC integers in float64, cells a
    ceil-mode window reaches beyond the padded input padded too), divided by each window's count (real cells, or
    real and padding ones) rounded half to even in int64, less the zero point."""
    x, y = node.inputs[0], node.outputs[0]
    c = int(x.ir_shape[4])
    extras, outs = [], []
    for i in range(3):
        out, extra = pool_axis(params["sizes"][i], params["k"][i], params["s"][i], params["d"][i],
                               params["before"][i], params["after"][i], params["ceil"])
        outs.append(out)
        extras.append(extra)
    value = codes(g, x)
    pads = [0, *params["before"], 0, 0, *[e + x_ for e, x_ in zip(params["after"], extras)], 0]
    if any(pads):
        value = g.add("Pad", [value, g.ints(f"{node.name}/pads", pads)])
    ones = np.ones((c, *params["k"], 1), dtype=np.float64)
    sums = window_sums(g, node, value, ones, c, c, outs, params["s"], params["d"])
    counts = [_axis_counts(params["sizes"][i], params["before"][i], params["after"][i], extras[i], outs[i],
                           params["k"][i], params["s"][i], params["d"][i], params["count_pad"]).numpy()
              for i in range(3)]
    count = (counts[0][:, None, None] * counts[1][None, :, None] * counts[2][None, None, :])[None, ..., None]
    quotient = round_div_int64(g, node, g.add("Cast", [sums], to=INT64),
                               g.const(f"{node.name}/counts", count.astype(np.int64)))
    zp = tensor_zp(node, x)
    if zp:
        quotient = g.add("Sub", [quotient, g.const(f"{node.name}/zero_point", np.array(zp, dtype=np.int64))])
    emit_integers(g, node, y, g.add("Cast", [quotient], to=DOUBLE), None)


# ------------------------------------------------------------------------------------------------ arg max / unpool
FLATTEN_DIMS = ("HW", "HWC", "NHWC", "NCHW")
INDEX_BITS = 32
"""MaxPoolingWithArgMax indices are exact signed 32-bit integers (upstream: max(32, activation bits))."""
_FLATTEN_DIM = Param(Text(choices=FLATTEN_DIMS), "layout of the flat indices: within each (n, c) plane (HW), each "
                                                 "image (HWC) or the whole tensor (NHWC, NCHW)", required=True)

MAXPOOLINGWITHARGMAX = declare_op(
    "MaxPoolingWithArgMax",
    params={"kernel_x": Param(Int(lo=1), "window width", required=True),
            "kernel_y": Param(Int(lo=1), "window height", required=True),
            "stride_x": Param(Int(lo=1), "horizontal stride", default=1),
            "stride_y": Param(Int(lo=1), "vertical stride", default=1),
            "dilation_x": Param(Int(lo=1), "horizontal dilation", default=1),
            "dilation_y": Param(Int(lo=1), "vertical dilation", default=1),
            **_PADS_2D,
            "ceil_mode": Param(Bool(), "ceil instead of floor for the output size", default=False),
            "count_include_pad": Param(Bool(), "not read (a max)"),
            "flatten_dim": _FLATTEN_DIM,
            "storage_order": Param(Int(lo=0, hi=1), "0: row-major (h * W + w) positions, 1: column-major "
                                                    "(w * H + h)", default=0),
            "scale": _UNREAD_SCALE},
    dtypes="float32 → values: input's dtype; indices: int32 (exact integers)",
    integer="window max (first maximal cell wins) and its flat index", semantics=f"{_SEM}#maxpoolingwithargmax")

MAXUNPOOL = declare_op(
    "MaxUnpool",
    params={"flatten_dim": _FLATTEN_DIM, "scale": _UNREAD_SCALE},
    dtypes="values float32 + indices int → values' dtype",
    integer="scatter values to their indices, other cells float 0 (-zp)", semantics=f"{_SEM}#maxunpool",
    summary="Inputs: values and indices (integer); the output shape is layer_top_shape.")


def _flatten_dim(node: PyNode) -> str:
    value = str(node.get_param("flatten_dim")).upper()
    if value not in FLATTEN_DIMS:
        raise node._error(f"unsupported flatten_dim '{value}' (supported: {', '.join(FLATTEN_DIMS)})")
    return value


def _storage_order(node: PyNode) -> int:
    value = node.get_param("storage_order", optional=True, default_value=0)
    if isinstance(value, bool) or value not in (0, 1):
        raise node._error(f"parameter 'storage_order' must be 0 or 1, got {value!r}")
    return int(value)


def max_pool_with_argmax(node: PyNode, x: torch.Tensor, p: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """(window maxima, (row, col) of the first maximal real cell in row-major window order) of an NCHW tensor.

    `x` is float32 (float forward) or float64 holding integers (integer forward, exact). Padding never wins.
    """
    size, full, extra = _plan(node, x, p)
    _divisors(node, x, p, extra, "MAX")
    xp = F.pad(x, full, value=float("-inf")) if any(full) else x
    n, c, hp, wp = xp.shape
    cols = F.unfold(xp.reshape(n * c, 1, hp, wp), p["k"], dilation=p["d"], stride=p["s"])
    k = torch.argmax(cols, dim=1, keepdim=True)  # first maximal entry
    values = torch.gather(cols, 1, k)[:, 0].reshape(n, c, size[0], size[1])
    k = k[:, 0].reshape(n, c, size[0], size[1])
    oh = torch.arange(size[0], device=x.device).reshape(1, 1, -1, 1)
    ow = torch.arange(size[1], device=x.device).reshape(1, 1, 1, -1)
    left, _, top, _ = p["pads"]
    rows = oh * p["s"][0] - top + (k // p["k"][1]) * p["d"][0]
    cols_ = ow * p["s"][1] - left + (k % p["k"][1]) * p["d"][1]
    return values, torch.stack([rows, cols_])


def argmax_indices(pos: torch.Tensor, shape_nchw: Sequence[int], flatten_dim: str, storage_order: int) -> torch.Tensor:
    """Flat indices (NCHW int64) of the (row, col) positions in the unpadded input, upstream's conventions."""
    n, c, h, w = shape_nchw
    rows, cols = pos[0], pos[1]
    base = cols * h + rows if storage_order else rows * w + cols
    nn = torch.arange(n, device=pos.device).reshape(-1, 1, 1, 1)
    cc = torch.arange(c, device=pos.device).reshape(1, -1, 1, 1)
    if flatten_dim == "HW":
        return base
    if flatten_dim == "HWC":
        return base * c + cc
    if flatten_dim == "NHWC":
        return nn * (h * w * c) + base * c + cc
    return nn * (c * h * w) + cc * (h * w) + base


@MAXPOOLINGWITHARGMAX.forward
def maxpoolingwithargmax_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    if x.dim() != 4:
        raise self._error(f"input must be 4-D NHWC, got shape {list(x.shape)}")
    if len(self.outputs) != 2:
        raise self._error(f"needs two outputs (values, indices), got {len(self.outputs)}")
    p = _params(self, False)
    flatten_dim, order = _flatten_dim(self), _storage_order(self)
    if self.quantized:
        xc = int_value(self.inputs[0]).permute(0, 3, 1, 2).to(torch.float64)
    else:
        xc = x.to(x.dtype if x.is_floating_point() else torch.float32).permute(0, 3, 1, 2)
    values, pos = max_pool_with_argmax(self, xc, p)
    idx = argmax_indices(pos, xc.shape, flatten_dim, order)
    if idx.numel() and int(idx.max()) >= 2 ** (INDEX_BITS - 1):
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): indices do not fit int{INDEX_BITS}")
    if self.quantized:
        values = torch.clamp(values.to(torch.int64), *out_range(self, self.outputs[0]))
    self.outputs[0].betensor = values.permute(0, 2, 3, 1).contiguous()
    self.outputs[1].betensor = idx.permute(0, 2, 3, 1).contiguous()


@MAXPOOLINGWITHARGMAX.quantize
def maxpoolingwithargmax_quantize(self: PyNode) -> None:
    """Values keep the input's quantization; indices are exact int32 integers (qinvariant)."""
    check_quantized_inputs(self, self.inputs[:1])
    tensor_zp(self, self.inputs[0])
    copy_params(self, self.outputs[0], self.inputs[0])
    set_qinvariant(self, self.outputs[1], INDEX_BITS, True)


def max_unpool(values: torch.Tensor, idx: torch.Tensor, out_hwc: Sequence[int], flatten_dim: str,
               fill: Any) -> torch.Tensor:
    """Scatter NHWC `values` to the flat positions `idx` of an [N, H, W, C] output filled with `fill`.

    The index is read in the layout of `flatten_dim` (HW: within the (n, c) plane; HWC: within image n; NHWC /
    NCHW: global). Positions outside the output are ignored; when several values land on one cell, the last one
    in the NHWC order of `values` wins.
    """
    n, h0, w0, c = values.shape
    oh, ow, oc = (int(v) for v in out_hwc)
    total = n * oh * ow * oc
    nn = torch.arange(n, device=idx.device).reshape(-1, 1, 1, 1)
    cc = torch.arange(c, device=idx.device).reshape(1, 1, 1, -1)
    if flatten_dim == "HW":
        t = (nn * oc + cc) * (oh * ow) + idx
    elif flatten_dim == "HWC":
        t = nn * (oh * ow * oc) + idx
    else:
        t = idx
    t = t.reshape(-1)
    src = torch.arange(t.numel(), device=t.device)
    valid = (t >= 0) & (t < total)
    winner = torch.full((total,), -1, dtype=torch.int64, device=t.device)
    winner.scatter_reduce_(0, t[valid], src[valid], reduce="amax")
    flat = torch.full((total,), fill, dtype=values.dtype, device=values.device)
    hit = winner >= 0
    flat[hit] = values.reshape(-1)[winner[hit]]
    if flatten_dim in ("HW", "NCHW"):
        return flat.reshape(n, oc, oh, ow).permute(0, 2, 3, 1).contiguous()
    return flat.reshape(n, oh, ow, oc)


@MAXUNPOOL.forward
def maxunpool_forward(self: PyNode) -> None:
    values = self.inputs[0].betensor
    if values.dim() != 4 or len(self.inputs) < 2:
        raise self._error("needs a 4-D NHWC values input and an indices input")
    if tuple(self.inputs[1].betensor.shape) != tuple(values.shape):
        raise self._error(f"indices shape {list(self.inputs[1].betensor.shape)} differs from values shape "
                          f"{list(values.shape)}")
    shape = self.outputs[0].ir_shape
    if len(shape) != 4 or int(shape[3]) != int(values.shape[3]):
        raise self._error(f"output shape {list(shape)} must be 4-D NHWC with the input's {values.shape[3]} channels")
    flatten_dim = _flatten_dim(self)
    idx = int_value(self.inputs[1])
    if self.quantized:
        qmin, qmax = out_range(self, self.outputs[0])
        fill = min(max(-tensor_zp(self, self.outputs[0]), qmin), qmax)
        y = max_unpool(int_value(self.inputs[0]), idx, shape[1:], flatten_dim, fill)
    else:
        v = values.to(values.dtype if values.is_floating_point() else torch.float32)
        y = max_unpool(v, idx, shape[1:], flatten_dim, 0.0)
    self.outputs[0].betensor = y


@MAXUNPOOL.quantize
def maxunpool_quantize(self: PyNode) -> None:
    """Output keeps the values' quantization; the indices must be exact integers (qinvariant)."""
    check_quantized_inputs(self, self.inputs[:2])
    tensor_zp(self, self.inputs[0])
    if not quant_of(self).get(self.inputs[1]).qinvariant:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the indices input '{self.inputs[1].name}' must be "
                               "an integer tensor (qinvariant), not a quantized float")
    copy_params(self, self.outputs[0], self.inputs[0])


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def pool_axis(size: int, k: int, s: int, d: int, before: int, after: int, ceil_mode: bool) -> Tuple[int, int]:
    """(output size, cells to add after the padding so that the last window fits), as quantopt's pooling plans
    them: in ceil mode a last window starting beyond the input and its leading padding is dropped."""
    k_ext = d * (k - 1) + 1
    span = size + before + after - k_ext
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + before:
        out -= 1
    return out, max(0, (out - 1) * s + k_ext - (size + before + after))


def _pool_float(g: QDQGraph, node: PyNode, method: str, x: str, rank: int, spatial: List[int],
                params: dict) -> str:
    kernel, strides, dil, pads_b, pads_e = (params[k] for k in ("k", "s", "d", "before", "after"))
    extra = [pool_axis(int(params["sizes"][i]), kernel[i], strides[i], dil[i], pads_b[i], pads_e[i],
                       params["ceil"])[1] for i in range(len(spatial))]
    dil = dil if any(d != 1 for d in dil) else None  # left out when trivial (onnxruntime's QLinear pools lack it)
    if method == "MAX":
        return g.add("MaxPool", [x], kernel_shape=kernel, strides=strides, dilations=dil,
                     pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)])
    if params["count_pad"] and any(extra) and any(pads_b + pads_e):
        # pads count, the ceil-mode cells do not: pad with float 0 explicitly, then count only real cells
        zero_pads = [0, 0] + pads_b + [0, 0] + pads_e
        x = g.add("Pad", [x, g.ints(f"{node.name}/pads", zero_pads)], mode="constant")
        pads_b, pads_e = [0] * len(spatial), [0] * len(spatial)
        count_pad = 0
    else:
        count_pad = int(params["count_pad"])
    return g.add("AveragePool", [x], kernel_shape=kernel, strides=strides, dilations=dil,
                 pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)], count_include_pad=count_pad)


BYTE_SPLIT_CELLS = 1 << 16
"""Windows below this many cells sum bytes (values below 2^8) exactly in float32."""


def _window_counts(params: dict) -> np.ndarray:
    """The divisor of every output cell (docs/integer-semantics.md, Pooling AVG): per axis the real cells of the
    window (plus its padding cells with count_include_pad), multiplied over the axes."""
    total = np.ones([1], dtype=np.float64)
    for i, n in enumerate(params["sizes"]):
        k, s, d, before, after = (params[key][i] for key in ("k", "s", "d", "before", "after"))
        out, _ = pool_axis(n, k, s, d, before, after, params["ceil"])
        pos = np.arange(out)[:, None] * s - before + np.arange(k)[None, :] * d
        counted = (pos >= -before) & (pos < n + after) if params["count_pad"] else (pos >= 0) & (pos < n)
        total = np.multiply.outer(total, counted.sum(axis=1).astype(np.float64))
    return total.reshape((1,) + total.shape)  # [1, 1, out_h, out_w]: batch and channel broadcast


def _avg_factors(node: PyNode, params: dict) -> np.ndarray:
    """M · 2^-shift per output cell (float64, exact): the integer forward's 8-bit approximation of 1 / count for a
    pool that keeps its input's params (docs/integer-semantics.md, Pooling AVG; quantopt/ops/pooling.py)."""
    mult, shift = avg_requant_of(node, torch.from_numpy(_window_counts(params)))
    return mult.numpy().astype(np.float64) * np.power(2.0, -shift.numpy().astype(np.float64))


def _window_sums(g: QDQGraph, node: PyNode, x: str, params: dict, channels: int) -> str:
    """Σ over every pooling window (padding and ceil-mode cells 0) by a depthwise Conv with ones, float32."""
    kernel, strides, dil, pads_b, pads_e = (params[k] for k in ("k", "s", "d", "before", "after"))
    extra = [pool_axis(int(n), kernel[i], strides[i], dil[i], pads_b[i], pads_e[i], params["ceil"])[1]
             for i, n in enumerate(params["sizes"])]
    ones = g.const(f"{node.name}/window", np.ones([channels, 1, *kernel], dtype=np.float32))
    return g.add("Conv", [x, ones], kernel_shape=kernel, strides=strides, dilations=dil, group=channels,
                 pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)])


def _average_codes(g: QDQGraph, node: PyNode, codes: str, p: QParams, rank: int, spatial: List[int],
                   params: dict) -> str:
    """AVG pooling that keeps its input's params, on the codes: round_half_even(mean(q + zp)) - zp with float32
    sums of integers (exact), so ties round as the integer forward rounds them. In "exact" mode the window sums
    are divided by the cell counts in float64: float32's quotient of 16-bit sums can miss a rounding boundary."""
    zp = g.const(f"{node.name}/zero_point", np.array(p.zero_point, dtype=np.float32))
    shifted = g.add("Sub", [g.add("Cast", [codes], to=FLOAT), zp])  # ONNX zero point = -zp_ir
    cells = int(np.prod(params["k"]))
    if g.unit_domain and cells < BYTE_SPLIT_CELLS:
        channels = int(node.inputs[0].ir_shape[-1])
        if cells * max(abs(p.qmin - p.zero_point), abs(p.qmax - p.zero_point)) < FLOAT32_EXACT:
            sums = g.add("Cast", [_window_sums(g, node, shifted, params, channels)], to=DOUBLE)
        else:  # float32 sums of the high and low bytes (each below 2^24), combined in float64
            byte = g.const(f"{node.name}/byte", np.array(256.0, dtype=np.float32))
            high = g.add("Floor", [g.add("Div", [shifted, byte])])
            low = g.add("Sub", [shifted, g.add("Mul", [high, byte])])
            high_sums = g.add("Cast", [_window_sums(g, node, high, params, channels)], to=DOUBLE)
            sums = g.add("Add", [g.add("Mul", [high_sums, g.const(f"{node.name}/byte_d", np.array(256.0))]),
                                 g.add("Cast", [_window_sums(g, node, low, params, channels)], to=DOUBLE)])
        limit = float(AVG_SUM_LIMIT)
        sums = g.add("Clip", [sums, g.const(f"{node.name}/sum_lo", np.array(-limit)),
                              g.const(f"{node.name}/sum_hi", np.array(limit))])
        mean = g.add("Mul", [sums, g.const(f"{node.name}/reciprocals", _avg_factors(node, params))])
        mean = g.add("Cast", [g.add("Round", [mean])], to=FLOAT)
    else:
        mean = g.add("Round", [_pool_float(g, node, "AVG", shifted, rank, spatial, params)])
    return g.add("Cast", [g.add("Add", [mean, zp])], to=g.elem_type(p.dtype))


@POOLING.export
def convert_pooling(g: QDQGraph, node: PyNode) -> None:
    """MaxPool/AveragePool channels-first, with explicit asymmetric pads and quantopt's ceil-mode windows. Pools
    that keep their input's params run on the codes (MAX: int8/uint8 MaxPool; AVG: see _average_codes)."""
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    if method not in ("MAX", "AVG"):
        raise node_error(node, f"pooling method {method} has no QDQ mapping (MAX and AVG do)")
    rank = g.rank(x)
    if rank not in (3, 4):
        raise node_error(node, f"only 3-D [N,W,C] and 4-D NHWC inputs are exported, got rank {rank}")
    one_d = rank == 3
    keys = [("x", "left", "right")] if one_d else [("y", "top", "bottom"), ("x", "left", "right")]
    params = {
        "k": [int_or(node, f"kernel_{a}", 1) for a, _, _ in keys],
        "s": [int_or(node, f"stride_{a}", 1) for a, _, _ in keys],
        "d": [int_or(node, f"dilation_{a}", 1) for a, _, _ in keys],
        "before": [int_or(node, f"pad_{b}", 0) for _, b, _ in keys],
        "after": [int_or(node, f"pad_{e}", 0) for _, _, e in keys],
        "sizes": [int(s) for s in x.ir_shape[1:-1]],
        "ceil": bool_param(node, "ceil_mode", False),
        "count_pad": bool_param(node, "count_include_pad", False),
    }
    cf = channels_first(rank)
    spatial = list(range(2, rank))
    if method == "MAX" and same_qparams(node, x, y) and x.dtype.bits == 8:
        out = _pool_float(g, node, method, g.int_value(x, cf), rank, spatial, params)  # int8/uint8 MaxPool: exact
        g.set_int(y, out, cf)
        return
    if method == "AVG" and same_qparams(node, x, y):
        g.set_int(y, _average_codes(g, node, g.int_value(x, cf), g.qparams(x), rank, spatial, params), cf)
        return
    g.quantize(y, _pool_float(g, node, method, g.float_value(x, cf), rank, spatial, params), cf,
               lossless=method == "MAX" and same_qparams(node, x, y))


@GLOBALPOOL.export
def convert_global_pool(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    ops = {"AVG": "GlobalAveragePool", "MAX": "GlobalMaxPool"}
    if method not in ops:
        raise node_error(node, f"global pooling method {method} has no QDQ mapping (MAX and AVG do)")
    if any(int_or(node, k, 0) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom")):
        raise node_error(node, "padded global pooling has no QDQ mapping")
    cf = channels_first(g.rank(x))
    if method == "AVG" and g.unit_domain and same_qparams(node, x, y):  # Pooling AVG with the whole input as window
        sizes = [int(v) for v in x.ir_shape[1:-1]]
        params = {"k": sizes, "s": [1] * len(sizes), "d": [1] * len(sizes), "before": [0] * len(sizes),
                  "after": [0] * len(sizes), "sizes": sizes, "ceil": False, "count_pad": False}
        g.set_int(y, _average_codes(g, node, g.int_value(x, cf), g.qparams(x), g.rank(x),
                                    list(range(2, g.rank(x))), params), cf)
        return
    g.quantize(y, g.add(ops[method], [g.float_value(x, cf)]), cf, lossless=method == "MAX" and same_qparams(node, x, y))
