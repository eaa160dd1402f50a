"""Geometry, resampling and layout ops on channels-last (NHWC) activations.

Resampling: Resize/Interp (nearest with the ONNX nearest modes, linear, cubic; half_pixel, align_corners,
asymmetric, pytorch_half_pixel, tf_half_pixel_for_nn coordinates) and GridSample (bilinear/nearest; zeros, border,
reflection padding). Layout: DepthToSpace, SpaceToDepth, SpaceToBatch, BatchToSpace, ChannelShuffle, Crop, Tile,
Repeat, ReverseSequence.

Quantized, every op keeps its input's scale/zero point/dtype (upstream does the same). Layout ops move the integers
exactly; padded cells hold the quantized float 0. Resize computes its source coordinates exactly (rational
arithmetic, once per axis) and interpolates with `interp_shift_value`-bit fixed-point weights that sum to exactly
2^interp_shift_value per axis, so the result is one exact int64 sum and one round-half-even shift and needs no
zero point. GridSample turns the quantized grid into fixed-point pixel coordinates with an integer multiplier/shift
of the grid's scale. docs/semantics/geometry.md gives the bit-exact integer semantics.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS, INTERP_FRACTION_BITS
from ..quant.requant import scale_shift
from ..quant.rounding import FLOAT64_EXACT, round_shift
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Bool, DtypeName, Float, Int, Ints, Param, Text, Value, quantized
from ._eltwise_int import check_int64_bound, offset_absmax
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    layer_settings,
    out_range,
    params,
    requant_of,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param, keep_unrounded, keeps_float64
from .onnx_build.exact import (
    DOUBLE,
    INT32,
    INT64,
    codes,
    double,
    emit_integers,
    fits_double,
    int64,
    round_div_int64,
)
from .onnx_build.perms import channels_first, inverse
from .onnx_build.qdq_graph import FLOAT, ONNX_INT_TYPES, QDQGraph, node_error, require_same, same_qparams

_MISSING = object()
SEMANTICS = "docs/semantics/geometry.md"

GRID_MULTIPLIER_BITS: int = AIFF_MULTIPLIER_BITS
"""Bits of the integer multiplier that approximates 1 / grid_scale (GridSample): the widest multiplier the hardware
takes, because a coordinate error of W * 2^-bits pixels must stay small for wide feature maps."""

INTERP_SHIFT_TYPE: Dtype = Dtype.INT8
"""IR dtype written as `interp_shift_type` (upstream's SHIFT_DTYPE)."""

_UNREAD_SCALE = Param(Value(), "written by some Parser versions; not read")
_PASSTHROUGH = "passthrough (data movement only)"


# ------------------------------------------------------------------------------------------------ param helpers
def _int_param(node: PyNode, key: str, default: Any = _MISSING, minimum: Optional[int] = 1) -> int:
    value = node.get_param(key, optional=default is not _MISSING,
                           default_value=None if default is _MISSING else default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    if minimum is not None and int(value) < minimum:
        raise node._error(f"parameter '{key}' must be >= {minimum}, got {value}")
    return int(value)


def _int_list(node: PyNode, key: str, value: Any) -> List[int]:
    if not isinstance(value, (list, tuple)):
        raise node._error(f"parameter '{key}' must be a list of integers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise node._error(f"parameter '{key}' must be a list of integers, got {value!r}")
        out.append(int(v))
    return out


def _rank(node: PyNode, x: torch.Tensor, ranks: Sequence[int]) -> None:
    if x.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise node._error(f"input must be {want} (channels last), got shape {list(x.shape)}")


def _quantized_zero(node: PyNode, t: PyTensor) -> int:
    """The integer that stands for float 0 in `t`: clamp(-zp, qmin, qmax)."""
    qmin, qmax = out_range(node, t)
    return min(max(-tensor_zp(node, t), qmin), qmax)


def _check_per_tensor(node: PyNode, t: PyTensor) -> None:
    q = params(node, t)
    for what in ("scale", "zerop"):
        v = getattr(q, what)
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' has per-channel "
                                   "quantization; this op needs per-tensor scale and zero point")


def _check_integer_input(node: PyNode, t: PyTensor, what: str) -> None:
    if not params(node, t).qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the {what} input '{t.name}' must be an integer "
                               "tensor (scale 1, zero point 0); a quantized float tensor is not supported")


def _passthrough_quantize(node: PyNode) -> None:
    """Data movement: every output carries the first input's params unchanged."""
    check_quantized_inputs(node, node.inputs[:1])
    _check_per_tensor(node, node.inputs[0])
    for out in node.outputs:
        copy_params(node, out, node.inputs[0])


# ================================================================================================ Resize / Interp
RESIZE_METHODS = {"nearest": "nearest", "bilinear": "linear", "linear": "linear", "trilinear": "linear",
                  "bicubic": "cubic", "cubic": "cubic"}
RESIZE_MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nn")
UNSUPPORTED_RESIZE_MODES = ("half_pixel_symmetric", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple")
CUBIC_COEFF_A_DEFAULT = -0.75
RATIO_KEYS = ("ratio_x", "ratio_y", "ratio_z")  # last spatial axis first
HALF = Fraction(1, 2)
_RATIO_AXES = {"ratio_x": "last", "ratio_y": "second-last", "ratio_z": "third-last"}

_RESIZE_PARAMS = {
    "method": Param(Text(choices=tuple(m.upper() for m in RESIZE_METHODS) + ("AREA",)),
                    "interpolation (AREA is not supported)", required=True),
    "mode": Param(Text(choices=tuple(m.upper() for m in RESIZE_MODES + UNSUPPORTED_RESIZE_MODES)),
                  "coordinate transformation (HALF_PIXEL_SYMMETRIC and TF_CROP_AND_RESIZE are not supported)",
                  default="HALF_PIXEL"),
    "nearest_mode": Param(Text(choices=tuple(m.upper() for m in NEAREST_MODES)),
                          "nearest: how a source coordinate rounds to a pixel", default="ROUND_PREFER_FLOOR"),
    "size": Param(Ints(lo=1, scalar_ok=False), "output shape [N, (D,) (H,) W, C], or only its spatial sizes (absent: "
                                               "the output's IR shape)"),
    **{key: Param(Float(), f"scale factor out / in of the {_RATIO_AXES[key]} spatial axis (absent or 0: in / out "
                           "sizes)") for key in RATIO_KEYS},
    "cubic_coeff_a": Param(Float(), "the a of the cubic kernel", default=CUBIC_COEFF_A_DEFAULT),
    "exclude_outside": Param(Bool(), "cubic: only false is supported", default=False),
    "antialias": Param(Bool(), "only false is supported", default=False),
    "align_corners": Param(Bool(), "not read (mode ALIGN_CORNERS selects those coordinates)"),
    "interp_shift_value": quantized(Int(lo=0), "fraction bits of the integer weights (13 linear/cubic, 0 nearest)"),
    "interp_shift_type": quantized(DtypeName(), "dtype of interp_shift_value (int8)"),
    "scale": _UNREAD_SCALE,
}
_RESIZE_DOC = dict(
    integer="gather (nearest); exact separable sum with interp_shift_value-bit weights, one rounding shift",
    dtypes=PASSTHROUGH_DTYPES, semantics=f"{SEMANTICS}#resize-and-interp")

RESIZE = declare_op("Resize", params=_RESIZE_PARAMS, **_RESIZE_DOC)

INTERP = declare_op(
    "Interp",
    params={**_RESIZE_PARAMS,
            **{f"bound_{a}_{e}": Param(Value(), "upstream's; not read") for a in "xy" for e in ("min", "max")},
            **{f"weight_coefficients_{a}": Param(Value(), "upstream's; not read") for a in "xy"}},
    summary="Interp is Resize under another name.", **_RESIZE_DOC)


def _resize_method(node: PyNode) -> str:
    raw = str(node.get_param("method")).strip().lower()
    if raw == "area":
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): method AREA is not supported (NEAREST, "
                               "BILINEAR/LINEAR and BICUBIC are)")
    if raw not in RESIZE_METHODS:
        raise node._error(f"unknown resize method '{raw.upper()}' (expected NEAREST, BILINEAR, LINEAR or BICUBIC)")
    return RESIZE_METHODS[raw]


def _resize_mode(node: PyNode) -> str:
    mode = str(node.get_param("mode", optional=True, default_value="half_pixel")).strip().lower()
    if mode in UNSUPPORTED_RESIZE_MODES:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): coordinate mode {mode.upper()} is not "
                               f"supported (supported: {', '.join(m.upper() for m in RESIZE_MODES)})")
    if mode not in RESIZE_MODES:
        raise node._error(f"unknown coordinate mode '{mode.upper()}' "
                          f"(expected one of {', '.join(m.upper() for m in RESIZE_MODES)})")
    return mode


def _nearest_mode(node: PyNode) -> str:
    mode = str(node.get_param("nearest_mode", optional=True, default_value="round_prefer_floor")).strip().lower()
    if mode not in NEAREST_MODES:
        raise node._error(f"unknown nearest_mode '{mode.upper()}' "
                          f"(expected one of {', '.join(m.upper() for m in NEAREST_MODES)})")
    return mode


def _cubic_params(node: PyNode) -> Fraction:
    if bool_param(node, "exclude_outside", False):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): cubic resize with exclude_outside=true is not "
                               "supported")
    a = node.get_param("cubic_coeff_a", optional=True, default_value=CUBIC_COEFF_A_DEFAULT)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(float(a)):
        raise node._error(f"parameter 'cubic_coeff_a' must be a number, got {a!r}")
    return Fraction(float(a))


def _resize_axes(node: PyNode, x: torch.Tensor) -> List[Tuple[int, int, int, Optional[Fraction]]]:
    """(axis, input size, output size, exact ratio or None) for every spatial axis of a channels-last input."""
    if x.dim() < 3 or x.dim() > 5:
        raise node._error(f"input must be 3-D [N,W,C], 4-D [N,H,W,C] or 5-D [N,D,H,W,C], got {list(x.shape)}")
    rank = x.dim()
    spatial = list(range(1, rank - 1))
    if bool_param(node, "antialias", False):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): antialias resize is not supported")
    size = node.get_param("size", optional=True, default_value=None)
    if size is not None:
        size = _int_list(node, "size", size)
        if len(size) == rank:
            sizes = [size[a] for a in spatial]
        elif len(size) == len(spatial):
            sizes = list(size)
        else:
            raise node._error(f"parameter 'size' {size} does not match a {rank}-D input")
    else:
        ir = list(node.outputs[0].ir_shape or ())
        if len(ir) != rank:
            raise node._error(f"output shape {ir} does not match the {rank}-D input and no 'size' is given")
        sizes = [int(ir[a]) for a in spatial]
    axes = []
    for pos, a in enumerate(spatial):
        key = RATIO_KEYS[len(spatial) - 1 - pos]
        ratio = node.get_param(key, optional=True, default_value=None)
        r: Optional[Fraction] = None
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(float(ratio)) \
                    or float(ratio) < 0:
                raise node._error(f"parameter '{key}' must be a positive number, got {ratio!r}")
            r = Fraction(float(ratio)) if float(ratio) > 0 else None
        if sizes[pos] < 1:
            raise node._error(f"output size {sizes[pos]} along axis {a} must be >= 1")
        if x.shape[a] < 1:
            raise node._error(f"input size along axis {a} must be >= 1")
        axes.append((a, int(x.shape[a]), int(sizes[pos]), r))
    return axes


def resize_source_coordinate(mode: str, i: int, in_size: int, out_size: int, ratio: Optional[Fraction]) -> Fraction:
    """Exact source coordinate of output index `i` (docs: Resize coordinate table). `ratio` = out/in scale factor;
    when absent the sizes give it."""
    step = (1 / ratio) if ratio else Fraction(in_size, out_size)
    if mode == "align_corners":
        return Fraction(i * (in_size - 1), out_size - 1) if out_size > 1 else Fraction(0)
    if mode == "asymmetric":
        return i * step
    if mode == "tf_half_pixel_for_nn":
        return (i + HALF) * step
    if mode == "pytorch_half_pixel" and out_size <= 1:
        return Fraction(0)
    return (i + HALF) * step - HALF  # half_pixel, pytorch_half_pixel


def _nearest_index(src: Fraction, nearest_mode: str, downsample: bool) -> int:
    if nearest_mode == "round_prefer_floor":
        return math.ceil(src - HALF)
    if nearest_mode == "round_prefer_ceil":
        return math.floor(src + HALF)
    if nearest_mode == "floor":
        return math.floor(src)
    if nearest_mode == "ceil":
        return math.ceil(src)
    return math.ceil(src) if downsample else int(src)  # simple: truncation toward zero when upsampling


def _cubic_kernel(d: Fraction, a: Fraction) -> Fraction:
    d = abs(d)
    if d <= 1:
        return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    if d < 2:
        return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return Fraction(0)


def resize_axis_taps(method: str, mode: str, nearest_mode: str, in_size: int, out_size: int,
                     ratio: Optional[Fraction], cubic_a: Fraction) -> Tuple[List[List[int]], List[List[Fraction]]]:
    """Per output index: the input indices it reads and their exact weights (1, 2 or 4 taps)."""
    idx: List[List[int]] = []
    wts: List[List[Fraction]] = []
    last = in_size - 1
    for i in range(out_size):
        src = resize_source_coordinate(mode, i, in_size, out_size, ratio)
        if method == "nearest":
            idx.append([min(max(_nearest_index(src, nearest_mode, out_size < in_size), 0), last)])
            wts.append([Fraction(1)])
        elif method == "linear":
            c = min(max(src, Fraction(0)), Fraction(last))
            i0 = math.floor(c)
            lam = c - i0
            idx.append([i0, min(i0 + 1, last)])
            wts.append([1 - lam, lam])
        else:
            i0 = math.floor(src)
            t = src - i0
            idx.append([min(max(i0 + k, 0), last) for k in (-1, 0, 1, 2)])
            wts.append([_cubic_kernel(t + 1, cubic_a), _cubic_kernel(t, cubic_a), _cubic_kernel(1 - t, cubic_a),
                        _cubic_kernel(2 - t, cubic_a)])
    return idx, wts


def resize_int_weights(method: str, weights: List[List[Fraction]], shift: int) -> List[List[int]]:
    """Fixed-point weights with `shift` fraction bits summing to exactly 2^shift per output index.

    linear: l = round_half_even(lambda * 2^shift), weights (2^shift - l, l). cubic: each weight rounded half to even,
    the remainder 2^shift - sum added to the larger of the two central taps (tap 1 on a tie)."""
    one = 1 << shift
    out = []
    for w in weights:
        if method == "linear":
            b = round(w[1] * one)
            out.append([one - b, b])
        elif method == "cubic":
            q = [round(v * one) for v in w]
            q[1 if w[1] >= w[2] else 2] += one - sum(q)
            out.append(q)
        else:
            out.append([one])
    return out


def _resize_plan(node: PyNode, x: torch.Tensor, shift: Optional[int]) -> Tuple[str, List[Tuple[int, torch.Tensor,
                                                                                              torch.Tensor]]]:
    """(method, [(axis, index [out, T] int64, weights [out, T])]) with float64 weights (shift None) or int64
    fixed-point weights; cached on the layer per geometry."""
    method = _resize_method(node)
    mode = _resize_mode(node)
    nearest_mode = _nearest_mode(node) if method == "nearest" else ""
    cubic_a = _cubic_params(node) if method == "cubic" else Fraction(0)
    plan = []
    cache: Dict[Any, Any] = node.attrs.setdefault("_resize_taps", {})
    for axis, n_in, n_out, ratio in _resize_axes(node, x):
        key = (method, mode, nearest_mode, n_in, n_out, ratio, cubic_a, shift)
        if key not in cache:
            idx, wts = resize_axis_taps(method, mode, nearest_mode, n_in, n_out, ratio, cubic_a)
            if shift is None:
                w = torch.tensor([[float(v) for v in row] for row in wts], dtype=torch.float64)
            else:
                w = torch.tensor(resize_int_weights(method, wts, shift), dtype=torch.int64)
            cache[key] = (torch.tensor(idx, dtype=torch.int64), w)
        idx_t, w_t = cache[key]
        plan.append((axis, idx_t.to(x.device), w_t.to(x.device)))
    return method, plan


def _gather_axis(x: torch.Tensor, axis: int, idx: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """y[..., o, ...] = sum_t w[o, t] * x[..., idx[o, t], ...] along `axis` (plain gather when w is None)."""
    n_out, taps = idx.shape
    g = x.index_select(axis, idx.reshape(-1))
    shape = list(x.shape)
    shape[axis:axis + 1] = [n_out, taps]
    g = g.reshape(shape)
    if w is None:
        return g.squeeze(axis + 1)
    wshape = [1] * len(shape)
    wshape[axis], wshape[axis + 1] = n_out, taps
    return (g * w.reshape(wshape).to(g.dtype)).sum(axis + 1)


def _interp_shift(node: PyNode) -> int:
    return _int_param(node, "interp_shift_value", minimum=0)


def _source_coordinates(mode: str, n_in: int, n_out: int, ratio: Optional[Fraction]) -> torch.Tensor:
    """The source coordinate of every output index as upstream's float forward computes it: float64 arithmetic in
    the order of the coordinate table (docs/semantics/geometry.md), `1 / ratio` when a ratio is given."""
    i = torch.arange(n_out, dtype=torch.float64)
    inv = None if ratio is None else 1.0 / float(ratio)
    if mode == "align_corners":
        return i * 0.0 if n_out == 1 else i * (n_in - 1) / (n_out - 1)
    if mode == "asymmetric":
        return i * inv if inv is not None else i * n_in / n_out
    if mode == "tf_half_pixel_for_nn":
        return (i + 0.5) * inv if inv is not None else (i + 0.5) * n_in / n_out
    if mode == "pytorch_half_pixel" and n_out <= 1:
        return i * 0.0
    return (i + 0.5) * inv - 0.5 if inv is not None else (i + 0.5) * n_in / n_out - 0.5


BILINEAR_BAND_ELEMENTS = 1 << 16
"""Output elements of a float BILINEAR resize formed at once: the band's gathered neighbours and products stay in
cache between the passes over them (each element's arithmetic is the same in any band)."""


def _bilinear_float64(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """BILINEAR float forward in upstream's form, for its float64 result: the float32 input at the four neighbours
    (top/left index floor(c) raised to 0, bottom/right ceil(c) lowered to the last row/column), each times a
    float64 weight (1 - dy)(1 - dx), (1 - dy)dx, dy(1 - dx), dy·dx with dy = c - top (negative at a half-pixel
    border, where top and bottom coincide), summed in that order. The separable form differs in the last bits.

    Computed in bands of output rows (BILINEAR_BAND_ELEMENTS) on the input converted to float64 once (exact): every
    product and sum is the one of the whole-tensor form, in the same order; a resize to a large map no longer
    streams eleven map-sized float64 temporaries through memory."""
    (_, h_in, h_out, ry), (_, w_in, w_out, rx) = _resize_axes(node, x)
    mode = _resize_mode(node)
    ys, xs = _source_coordinates(mode, h_in, h_out, ry), _source_coordinates(mode, w_in, w_out, rx)
    y0 = torch.clamp(torch.floor(ys), 0, h_in - 1)
    x0 = torch.clamp(torch.floor(xs), 0, w_in - 1)
    y1 = torch.clamp(torch.ceil(ys), max=h_in - 1)
    x1 = torch.clamp(torch.ceil(xs), max=w_in - 1)
    dy, dx = (ys - y0).to(x.device), (xs - x0).to(x.device)
    wy, wx = (1 - dy)[:, None, None], (1 - dx)[None, :, None]
    dy, dx = dy[:, None, None], dx[None, :, None]
    weights = (wy * wx, wy * dx, dy * wx, dy * dx)  # [h_out, w_out, 1] each, in the order of the sum
    y0, y1, x0, x1 = (v.to(device=x.device, dtype=torch.int64) for v in (y0, y1, x0, x1))
    x = x.to(torch.float32).to(torch.float64)
    n, c = int(x.shape[0]), int(x.shape[3])
    out = torch.empty(n, h_out, w_out, c, dtype=torch.float64, device=x.device)
    band = max(1, BILINEAR_BAND_ELEMENTS // max(1, n * w_out * c))
    term = torch.empty(n, min(band, h_out), w_out, c, dtype=torch.float64, device=x.device)
    for r0 in range(0, h_out, band):
        r1 = min(h_out, r0 + band)
        o, t = out[:, r0:r1], term[:, :r1 - r0]
        top, bottom = x.index_select(1, y0[r0:r1]), x.index_select(1, y1[r0:r1])
        w00, w01, w10, w11 = (w[r0:r1] for w in weights)
        torch.mul(top.index_select(2, x0), w00, out=o)
        for rows, cols, w in ((top, x1, w01), (bottom, x0, w10), (bottom, x1, w11)):
            o.add_(torch.index_select(rows, 2, cols, out=t).mul_(w))
    return out


@RESIZE.forward
@INTERP.forward
def resize_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    if self.quantized:
        self.outputs[0].betensor = resize_int_forward(self)
        return
    x = x if x.is_floating_point() else x.to(torch.float32)
    if x.dim() == 4 and str(self.get_param("method")).strip().lower() == "bilinear":
        keep_unrounded(self, _bilinear_float64(self, x), x.dtype)
        return
    method, plan = _resize_plan(self, x, None)
    y = x
    for axis, idx, w in plan:
        y = _gather_axis(y, axis, idx, None if method == "nearest" else w.to(x.dtype))
    self.outputs[0].betensor = y.contiguous()


def resize_integer_plan(node: PyNode, shape: List[int]) -> Tuple[str, int, List[Tuple[int, torch.Tensor,
                                                                                       torch.Tensor]]]:
    """(method, fraction bits S, [(axis, index [out, T], int64 weights [out, T])]) of the quantized layer for an
    input of `shape`: what the integer forward sums, for a backend or an exporter to compile."""
    method = _resize_method(node)
    shift = _interp_shift(node) if method != "nearest" else 0
    method, plan = _resize_plan(node, torch.zeros(shape, dtype=torch.int64), shift)
    return method, shift, plan


def resize_int_forward(node: PyNode) -> torch.Tensor:
    """Nearest: gather. Linear/cubic: exact int64 separable sum with S-bit weights per axis, then
    round_half_even(acc / 2^(S * axes)), clamp to [qmin, qmax] (docs/semantics/geometry.md#resize-and-interp)."""
    inp = node.inputs[0]
    x = int_value(inp)
    method = _resize_method(node)
    shift = _interp_shift(node) if method != "nearest" else 0
    method, plan = _resize_plan(node, x, shift)
    qmin, qmax = out_range(node, node.outputs[0])
    if method == "nearest":
        y = x
        for axis, idx, _ in plan:
            y = _gather_axis(y, axis, idx, None)
        if y is not x and y.is_contiguous():  # a new tensor of the gathers': clamped in place
            return y.clamp_(qmin, qmax)
        return torch.clamp(y, qmin, qmax).contiguous()
    lo, hi = out_range(node, inp)
    growth = 1
    for _, _, w in plan:
        growth *= int(w.abs().sum(dim=1).max())
    bound = max(abs(lo), abs(hi)) * growth
    check_int64_bound(node, bound, "interpolation sum")
    if bound < FLOAT64_EXACT:
        return _interpolate_float64(x, plan, shift * len(plan), qmin, qmax)
    acc = x
    for axis, idx, w in plan:
        acc = _gather_axis(acc, axis, idx, w)
    y = round_shift(acc, shift * len(plan))
    return torch.clamp(y, qmin, qmax).contiguous()


INTERP_BAND_ELEMENTS = 1 << 16
"""Output elements of an integer linear/cubic resize formed at once (`_interpolate_float64`): a band's gathers,
products and sums stay in cache; every element's arithmetic is the same in any band."""


def _interpolate_float64(x: torch.Tensor, plan: List[Tuple[int, torch.Tensor, torch.Tensor]], shift: int,
                         qmin: int, qmax: int) -> torch.Tensor:
    """The integer linear/cubic resize in float64 where every partial sum stays below 2^53 (the caller's bound on
    |x| times the weights' row sums): each tap's gather times its weight added in, axis after axis, every value an
    exact integer; then acc · 2^-shift (exact) rounded half to even and clamped, in bands of the first axis's
    output indices (INTERP_BAND_ELEMENTS). The integers of the int64 form, without its int64 products and its
    reduction over the taps."""
    x = x.to(torch.float64)
    out_shape = [int(s) for s in x.shape]
    for axis, idx, _ in plan:
        out_shape[axis] = int(idx.shape[0])
    out = torch.empty(out_shape, dtype=torch.int64, device=x.device)
    first, first_idx, first_w = plan[0]
    size = out_shape[first]
    band = max(1, INTERP_BAND_ELEMENTS * size // max(1, out.numel()))
    scale = math.ldexp(1.0, -shift)
    for r0 in range(0, size, band):
        r1 = min(size, r0 + band)
        acc = _weighted_taps(x, first, first_idx[r0:r1], first_w[r0:r1])
        for axis, idx, w in plan[1:]:
            acc = _weighted_taps(acc, axis, idx, w)
        out.narrow(first, r0, r1 - r0).copy_(torch.round(acc.mul_(scale)).clamp_(qmin, qmax))
    return out


def _weighted_taps(x: torch.Tensor, axis: int, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_t w[o, t] · x[..., idx[o, t], ...] along `axis`, in float64, one tap after another (exact integers)."""
    shape = [1] * x.dim()
    shape[axis] = int(idx.shape[0])
    wf = w.to(torch.float64)
    terms = (x.index_select(axis, idx[:, t].contiguous()).mul_(wf[:, t].reshape(shape))
             for t in range(int(idx.shape[1])))
    out = next(terms)
    for term in terms:
        out.add_(term)
    return out


@RESIZE.quantize
@INTERP.quantize
def resize_quantize(self: PyNode) -> None:
    """The output keeps the input's params (upstream). Linear and cubic store `interp_shift_value` = 13 fraction
    bits of the interpolation weights (0 for nearest, as upstream) and `interp_shift_type` int8. With
    `resize_degrade_to_nearest` the quantized layer becomes a nearest resize (its own nearest_mode, default
    ROUND_PREFER_FLOOR); the float model keeps its method."""
    if layer_settings(self).resize_degrade_to_nearest and _resize_method(self) != "nearest":
        self.params["method"] = "NEAREST"
    method = _resize_method(self)
    _resize_mode(self)
    if method == "nearest":
        _nearest_mode(self)
    if method == "cubic":
        _cubic_params(self)
    _passthrough_quantize(self)
    self.params["interp_shift_value"] = INTERP_FRACTION_BITS if method != "nearest" else 0
    self.params["interp_shift_type"] = INTERP_SHIFT_TYPE


# ================================================================================================ GridSample
GRID_METHODS = ("bilinear", "nearest")
GRID_PADDING = ("zeros", "border", "reflection")

GRIDSAMPLE = declare_op(
    "GridSample",
    params={"method": Param(Text(choices=("BILINEAR", "NEAREST", "BICUBIC", "CUBIC")),
                            "interpolation (BICUBIC is not supported)", default="BILINEAR"),
            "padding_mode": Param(Text(choices=tuple(m.upper() for m in GRID_PADDING)),
                                  "what a coordinate outside the image reads", default="ZEROS"),
            "align_corners": Param(Bool(), "grid -1/1 are the corner pixels' centres (else their outer edges)",
                                   default=False),
            "interp_shift_value": quantized(Int(lo=0), "fraction bits of the fixed-point pixel coordinates (13)"),
            "interp_shift_type": quantized(DtypeName(), "dtype of interp_shift_value (int8)"),
            **{key: Param(Value(), "upstream's quantized form; not read")
               for key in ("coordinate_x_shift", "coordinate_y_shift", "coordinate_z_shift", "x_terp", "y_terp")}},
    constants={"scale": "per-channel multipliers; refused (the integer forward needs scale_value)",
               "shift": "per-channel shifts; refused (the integer forward needs shift_value)",
               "lutx": "upstream's coordinate table; not read", "luty": "upstream's coordinate table; not read"},
    integer="grid to fixed-point pixel coordinates (multiplier/shift), bilinear with 13-bit weights",
    dtypes="feature: any quantized; grid: per-tensor quantized; output keeps the feature's params",
    semantics=f"{SEMANTICS}#gridsample",
    summary="Inputs: feature and grid. Quantized: scale_value/shift_value map the grid to pixel coordinates.")


def _grid_params(node: PyNode) -> Tuple[str, str, bool]:
    method = str(node.get_param("method", optional=True, default_value="bilinear")).strip().lower()
    if method in ("bicubic", "cubic"):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): method BICUBIC is not supported "
                               "(BILINEAR and NEAREST are)")
    if method not in GRID_METHODS:
        raise node._error(f"unknown GridSample method '{method.upper()}' (expected BILINEAR or NEAREST)")
    padding = str(node.get_param("padding_mode", optional=True, default_value="zeros")).strip().lower()
    if padding not in GRID_PADDING:
        raise node._error(f"unknown padding_mode '{padding.upper()}' (expected ZEROS, BORDER or REFLECTION)")
    return method, padding, bool_param(node, "align_corners", False)


def _grid_inputs(node: PyNode) -> Tuple[torch.Tensor, torch.Tensor]:
    if len(node.inputs) != 2:
        raise node._error(f"GridSample needs 2 inputs (feature, grid), got {len(node.inputs)}")
    x, g = node.inputs[0].betensor, node.inputs[1].betensor
    if x.dim() == 5:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): 5-D (volumetric) GridSample is not supported")
    _rank(node, x, (4,))
    if g.dim() != 4 or g.shape[-1] != 2 or g.shape[0] != x.shape[0]:
        raise node._error(f"grid must be [N, H_out, W_out, 2] with the feature's batch {x.shape[0]}, got "
                          f"{list(g.shape)}")
    return x, g


@GRIDSAMPLE.forward
def gridsample_forward(self: PyNode) -> None:
    method, padding, align = _grid_params(self)
    x, g = _grid_inputs(self)
    if self.quantized:
        self.outputs[0].betensor = gridsample_int_forward(self, method, padding, align)
        return
    x = x if x.is_floating_point() else x.to(torch.float32)
    y = F.grid_sample(x.permute(0, 3, 1, 2), g.to(x.dtype), mode=method, padding_mode=padding, align_corners=align)
    self.outputs[0].betensor = y.permute(0, 2, 3, 1).contiguous()


def grid_fixed_coordinate(g: torch.Tensor, size: int, multiplier: int, shift: int, frac: int,
                          align: bool) -> torch.Tensor:
    """Pixel coordinate * 2^frac, rounded half to even, from G = (g_q + zp_g) * multiplier, gx = G * 2^-shift:
    ix = (gx + 1) * A / 2 - B / 2 with (A, B) = (size - 1, 0) if align_corners else (size, 1)."""
    a, b = (size - 1, 0) if align else (size, 1)
    e = max(shift, 0)
    num = g * multiplier * a * (1 << (e - shift)) + (a - b) * (1 << e)
    return round_shift(num, e + 1 - frac)


def _reflection_frame(size: int, frac: int, align: bool) -> Optional[Tuple[int, int]]:
    """(low, span) of REFLECTION padding in fixed point with `frac` fraction bits: the reflecting edges are the
    pixel centres 0 and size-1 (align_corners) or the borders -1/2 and size-1/2; None where they coincide (one
    pixel, aligned: every coordinate is 0)."""
    twice_low, twice_high = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
    if twice_low == twice_high:
        return None
    return twice_low * (1 << (frac - 1)), (twice_high - twice_low) << (frac - 1)


def _grid_pad_coordinate(c: torch.Tensor, size: int, frac: int, padding: str, align: bool) -> torch.Tensor:
    """border: clip to [0, (size-1) * 2^frac]; reflection: reflect about the edges (align: pixel centres 0 and
    size-1; else the borders -1/2 and size-1/2), then clip; zeros: unchanged."""
    top = (size - 1) << frac
    if padding == "zeros":
        return c
    if padding == "reflection":
        frame = _reflection_frame(size, frac, align)
        if frame is None:
            return torch.zeros_like(c)
        low, span = frame
        v = (c - low).abs()
        flips = torch.div(v, span, rounding_mode="floor")
        extra = v - flips * span
        c = torch.where(flips % 2 == 0, extra + low, span - extra + low)
    return torch.clamp(c, 0, top)


def _gather_pixels(x: torch.Tensor, yi: torch.Tensor, xi: torch.Tensor, fill: int) -> torch.Tensor:
    """x [N,H,W,C] at integer pixel (yi, xi) [N,Ho,Wo]; `fill` outside the image."""
    n, h, w, c = x.shape
    valid = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
    lin = (torch.clamp(yi, 0, h - 1) * w + torch.clamp(xi, 0, w - 1)).reshape(n, -1, 1).expand(-1, -1, c)
    v = torch.gather(x.reshape(n, h * w, c), 1, lin).reshape(*yi.shape, c)
    return torch.where(valid.unsqueeze(-1), v, torch.full_like(v, fill))


def gridsample_int_forward(node: PyNode, method: str, padding: str, align: bool) -> torch.Tensor:
    """Grid → fixed-point coordinates (multiplier/shift of 1/grid_scale, `interp_shift_value` fraction bits F),
    then nearest (round half to even) or bilinear with F-bit weights: round_half_even(sum / 2^(2F)), clamp."""
    inp, grid = node.inputs[0], node.inputs[1]
    x = int_value(inp)
    gq = int_value(grid) + tensor_zp(node, grid)
    mult, shift = requant_of(node)
    if not isinstance(mult, int):
        raise node._error("quantized GridSample needs a per-tensor scale_value/shift_value")
    frac = _interp_shift(node)
    if frac < 1:
        raise node._error(f"interp_shift_value must be >= 1 for GridSample, got {frac}")
    n, h, w, _ = x.shape
    e = max(shift, 0)
    check_int64_bound(node, offset_absmax(node, grid) * abs(mult) * max(h, w) * (1 << (e - shift)) +
                      max(h, w) * (1 << e), "grid coordinate numerator")
    fill = _quantized_zero(node, inp)
    ix = _grid_pad_coordinate(grid_fixed_coordinate(gq[..., 0], w, mult, shift, frac, align), w, frac, padding, align)
    iy = _grid_pad_coordinate(grid_fixed_coordinate(gq[..., 1], h, mult, shift, frac, align), h, frac, padding, align)
    qmin, qmax = out_range(node, node.outputs[0])
    if method == "nearest":
        y = _gather_pixels(x, round_shift(iy, frac), round_shift(ix, frac), fill)
        return torch.clamp(y, qmin, qmax)
    lo, hi = out_range(node, inp)
    check_int64_bound(node, max(abs(lo), abs(hi), abs(fill)) << (2 * frac), "bilinear sum")
    x0, y0 = ix >> frac, iy >> frac
    lx, ly = ix - (x0 << frac), iy - (y0 << frac)
    one = 1 << frac
    acc = torch.zeros(*ix.shape, x.shape[-1], dtype=torch.int64, device=x.device)
    for dy, wy in ((0, one - ly), (1, ly)):
        for dx, wx in ((0, one - lx), (1, lx)):
            acc = acc + (wy * wx).unsqueeze(-1) * _gather_pixels(x, y0 + dy, x0 + dx, fill)
    return torch.clamp(round_shift(acc, 2 * frac), qmin, qmax)


@GRIDSAMPLE.quantize
def gridsample_quantize(self: PyNode) -> None:
    """Output params copied from the feature (a bilinear mix or a copy of feature values, or float 0, never leaves
    the feature's range). 1 / grid_scale as a 15-bit multiplier/shift (`scale_value`/`shift_value`), coordinates
    with `interp_shift_value` = 13 fraction bits."""
    _grid_params(self)
    if len(self.inputs) != 2:
        raise self._error(f"GridSample needs 2 inputs (feature, grid), got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    _check_per_tensor(self, self.inputs[1])
    _passthrough_quantize(self)
    s_grid = torch.tensor(tensor_scale(self, self.inputs[1]), dtype=torch.float32)
    ratio = torch.tensor(1.0, dtype=torch.float32) / s_grid
    store_requant(self, *scale_shift(ratio, GRID_MULTIPLIER_BITS))
    self.params["interp_shift_value"] = INTERP_FRACTION_BITS
    self.params["interp_shift_type"] = INTERP_SHIFT_TYPE


ONNX_GRID_MODES = {"nearest": ("nearest", "nearest"), "bilinear": ("bilinear", "linear")}
"""IR method -> the ONNX GridSample mode before opset 20 and from it."""


@GRIDSAMPLE.export
def convert_gridsample(g: QDQGraph, node: PyNode) -> None:
    """"exact" mode: the integer forward in int64 (`_exact_gridsample`). Other modes: ONNX GridSample (opset 16 or
    later) on the dequantized channels-first feature and grid, quantized again."""
    method, padding, align = _grid_params(node)
    x, grid, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if g.rank(x) != 4 or g.rank(grid) != 4:
        raise node_error(node, "only 4-D feature maps and grids are exported")
    if g.unit_domain:
        _exact_gridsample(g, node, method, padding, align)
        return
    if g.opset < 16:
        raise node_error(node, f"ONNX GridSample needs opset 16 or later (the export's is {g.opset})")
    perm = channels_first(4)
    mode = ONNX_GRID_MODES[method][1 if g.opset >= 20 else 0]
    out = g.add("GridSample", [g.float_value(x, perm), g.float_value(grid)], mode=mode, padding_mode=padding,
                align_corners=int(align))
    g.quantize(y, out, perm, lossless=method == "nearest")


def _exact_gridsample(g: QDQGraph, node: PyNode, method: str, padding: str, align: bool) -> None:
    """`gridsample_int_forward` in int64: the grid's integers to fixed-point pixel coordinates (multiplier, then
    round half to even by 2^(e + 1 - F)), the padding mode on them, then the nearest pixel or the four bilinear taps
    with F-bit weights, each tap read by GatherElements from the [N, H·W, C] feature (the fill value outside the
    image), rounded half to even by 2^(2F). The feature is read as its integers plus the zero point: the bilinear
    weights sum to 2^(2F), so the zero point leaves the rounding unchanged and is taken off at the end."""
    x, grid, y = node.inputs[0], node.inputs[1], node.outputs[0]
    n, h, w, c = (int(v) for v in x.ir_shape)
    ho, wo = int(grid.ir_shape[1]), int(grid.ir_shape[2])
    mult, shift = requant_of(node)
    if not isinstance(mult, int):
        raise node_error(node, "a per-tensor scale_value/shift_value is needed")
    frac, zp = _interp_shift(node), tensor_zp(node, x)
    e = max(int(shift), 0)

    def i64(what: str, v: Any) -> str:
        return int64(g, node, what, v)

    def shifted(v: str, k: int, what: str) -> str:  # round_half_even(v / 2^k); v · 2^-k for k <= 0
        return round_div_int64(g, node, v, i64(what, 1 << k)) if k > 0 else g.add("Mul", [v, i64(what, 1 << -k)])

    def floor_shift(v: str, k: int, what: str) -> str:  # floor(v / 2^k): ONNX's Div truncates towards zero
        den = i64(what, 1 << k)
        q = g.add("Div", [v, den])
        below = g.add("Less", [g.add("Sub", [v, g.add("Mul", [q, den])]), i64(f"{what}_zero", 0)])
        return g.add("Sub", [q, g.add("Cast", [below], to=INT64)])

    gq = g.add("Cast", [codes(g, grid)], to=INT64)  # q + zp of the grid, [N, H_out, W_out, 2]

    def coordinate(index: int, size: int, what: str) -> str:
        a, b = (size - 1, 0) if align else (size, 1)
        part = g.add("Gather", [gq, i64(f"{what}_index", index)], axis=3)
        num = g.add("Add", [g.add("Mul", [part, i64(f"{what}_factor", int(mult) * a * (1 << (e - int(shift))))]),
                            i64(f"{what}_offset", (a - b) * (1 << e))])
        return _exact_grid_padding(g, node, shifted(num, e + 1 - frac, f"{what}_step"), size, frac, padding, align,
                                   what)

    ix, iy = coordinate(0, w, "x"), coordinate(1, h, "y")
    feature = g.add("Reshape", [g.add("Cast", [codes(g, x)], to=INT64), i64("feature_shape", [0, h * w, c])])
    fill = i64("fill", _quantized_zero(node, x) + zp)

    def pixels(yi: str, xi: str, what: str) -> str:  # feature[yi, xi] (the fill outside), [N, H_out, W_out, C]
        def within(v: str, size: int, axis: str) -> str:
            return g.add("And", [g.add("GreaterOrEqual", [v, i64(f"{what}_{axis}_zero", 0)]),
                                 g.add("Less", [v, i64(f"{what}_{axis}_size", size)])])

        inside = g.add("And", [within(yi, h, "y"), within(xi, w, "x")])
        row = g.add("Clip", [yi, i64(f"{what}_row_min", 0), i64(f"{what}_row_max", h - 1)])
        col = g.add("Clip", [xi, i64(f"{what}_col_min", 0), i64(f"{what}_col_max", w - 1)])
        flat = g.add("Add", [g.add("Mul", [row, i64(f"{what}_width", w)]), col])
        index = g.add("Expand", [g.add("Reshape", [flat, i64(f"{what}_index_shape", [0, ho * wo, 1])]),
                                 i64(f"{what}_expand", [1, ho * wo, c])])
        taken = g.add("Reshape", [g.add("GatherElements", [feature, index], axis=1),
                                  i64(f"{what}_out_shape", [0, ho, wo, c])])
        return g.add("Where", [g.add("Unsqueeze", [inside, i64(f"{what}_last", [3])]), taken, fill])

    if method == "nearest":
        value = pixels(shifted(iy, frac, "near_y"), shifted(ix, frac, "near_x"), "near")
    else:
        one = 1 << frac
        x0, y0 = floor_shift(ix, frac, "x0"), floor_shift(iy, frac, "y0")
        lx = g.add("Sub", [ix, g.add("Mul", [x0, i64("one_x", one)])])
        ly = g.add("Sub", [iy, g.add("Mul", [y0, i64("one_y", one)])])
        weights_y = [(y0, g.add("Sub", [i64("one_wy", one), ly])), (g.add("Add", [y0, i64("next_y", 1)]), ly)]
        weights_x = [(x0, g.add("Sub", [i64("one_wx", one), lx])), (g.add("Add", [x0, i64("next_x", 1)]), lx)]
        value = None
        for dy, (yi, wy) in enumerate(weights_y):
            for dx, (xi, wx) in enumerate(weights_x):
                weight = g.add("Unsqueeze", [g.add("Mul", [wy, wx]), i64(f"tap{dy}{dx}_last", [3])])
                tap = g.add("Mul", [weight, pixels(yi, xi, f"tap{dy}{dx}")])
                value = tap if value is None else g.add("Add", [value, tap])
        assert value is not None
        value = shifted(value, 2 * frac, "bilinear_step")
    if zp:
        value = g.add("Sub", [value, i64("zero_point", zp)])
    emit_integers(g, node, y, g.add("Cast", [value], to=DOUBLE), None)


def _exact_grid_padding(g: QDQGraph, node: PyNode, c: str, size: int, frac: int, padding: str, align: bool,
                        what: str) -> str:
    """`_grid_pad_coordinate` on int64 fixed-point coordinates."""
    def i64(name: str, v: int) -> str:
        return int64(g, node, f"{what}_{name}", v)

    frame = _reflection_frame(size, frac, align) if padding == "reflection" else None
    if padding == "zeros":
        return c
    if padding == "reflection" and frame is None:  # one pixel, aligned: every coordinate is 0
        return g.add("Mul", [c, i64("none", 0)])
    if frame is not None:
        low, span = frame
        v = g.add("Abs", [g.add("Sub", [c, i64("low", low)])])
        flips = g.add("Div", [v, i64("span", span)])  # v >= 0: truncation is the floor
        extra = g.add("Sub", [v, g.add("Mul", [flips, i64("span_again", span)])])
        even = g.add("Equal", [g.add("Mod", [flips, i64("two", 2)]), i64("zero", 0)])
        c = g.add("Where", [even, g.add("Add", [extra, i64("low_even", low)]),
                            g.add("Add", [g.add("Sub", [i64("span_odd", span), extra]), i64("low_odd", low)])])
    return g.add("Clip", [c, i64("min", 0), i64("max", (size - 1) << frac)])


# ================================================================================================ layout ops
_BLOCK_PARAMS = {
    "block_size": Param(Int(lo=1), "block size of both axes, where block_size_y/block_size_x are absent"),
    "block_size_x": Param(Int(lo=1), "block width (default block_size)"),
    "block_size_y": Param(Int(lo=1), "block height (default block_size)"),
}


def _block_sizes(node: PyNode) -> Tuple[int, int]:
    """(block_size_y, block_size_x); a single `block_size` serves both."""
    common = node.get_param("block_size", optional=True, default_value=None)
    by = _int_param(node, "block_size_y", common if common is not None else _MISSING)
    bx = _int_param(node, "block_size_x", common if common is not None else _MISSING)
    return by, bx


# ------------------------------------------------------------------------------------------- DepthToSpace, SpaceToDepth
_DEPTH_SPACE_DOC = dict(integer=_PASSTHROUGH, dtypes=PASSTHROUGH_DTYPES,
                        semantics=f"{SEMANTICS}#depthtospace-and-spacetodepth")

DEPTH_TO_SPACE = declare_op(
    "DepthToSpace",
    params={**_BLOCK_PARAMS,
            "mode": Param(Text(choices=("DCR", "CRD")), "channel order of the blocks", default="DCR"),
            "scale": _UNREAD_SCALE},
    **_DEPTH_SPACE_DOC)

SPACE_TO_DEPTH = declare_op("SpaceToDepth", params={**_BLOCK_PARAMS, "scale": _UNREAD_SCALE}, **_DEPTH_SPACE_DOC)


@DEPTH_TO_SPACE.forward
@keeps_float64()
def depthtospace_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, (4,))
    by, bx = _block_sizes(self)
    mode = str(self.get_param("mode", optional=True, default_value="DCR")).strip().upper()
    n, h, w, c = x.shape
    if c % (by * bx):
        raise self._error(f"channels {c} are not a multiple of block_size_y * block_size_x = {by * bx}")
    co = c // (by * bx)
    if mode == "DCR":
        y = x.reshape(n, h, w, by, bx, co).permute(0, 1, 3, 2, 4, 5)
    elif mode == "CRD":
        y = x.reshape(n, h, w, co, by, bx).permute(0, 1, 4, 2, 5, 3)
    else:
        raise self._error(f"unknown DepthToSpace mode '{mode}' (expected DCR or CRD)")
    self.outputs[0].betensor = y.reshape(n, h * by, w * bx, co).contiguous()


@SPACE_TO_DEPTH.forward
def spacetodepth_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, (4,))
    by, bx = _block_sizes(self)
    n, h, w, c = x.shape
    if h % by or w % bx:
        raise self._error(f"spatial size {h}x{w} is not a multiple of the block {by}x{bx}")
    y = x.reshape(n, h // by, by, w // bx, bx, c).permute(0, 1, 3, 2, 4, 5)
    self.outputs[0].betensor = y.reshape(n, h // by, w // bx, by * bx * c).contiguous()


def _pad_value(node: PyNode) -> float:
    return float(_quantized_zero(node, node.inputs[0])) if node.quantized else 0.0


# ------------------------------------------------------------------------------------------- SpaceToBatch, BatchToSpace
_SPACE_BATCH_DOC = dict(integer="passthrough (data movement; padding is the quantized 0)", dtypes=PASSTHROUGH_DTYPES,
                        semantics=f"{SEMANTICS}#spacetobatch-and-batchtospace")

SPACE_TO_BATCH = declare_op(
    "SpaceToBatch",
    params={**_BLOCK_PARAMS,
            **{f"pad_{side}": Param(Int(lo=0), f"{side} padding before the blocks", default=0)
               for side in ("left", "right", "top", "bottom")},
            "scale": _UNREAD_SCALE},
    **_SPACE_BATCH_DOC)

BATCH_TO_SPACE = declare_op(
    "BatchToSpace",
    params={**_BLOCK_PARAMS,
            **{f"crop_{side}": Param(Int(lo=0), f"cells cropped at the {side} of the result", default=0)
               for side in ("left", "right", "top", "bottom")},
            "scale": _UNREAD_SCALE},
    **_SPACE_BATCH_DOC)


@SPACE_TO_BATCH.forward
def spacetobatch_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, (4,))
    by, bx = _block_sizes(self)
    pads = [_int_param(self, k, 0, minimum=0) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom")]
    if any(pads):
        y = F.pad(x, (0, 0, *pads), value=_pad_value(self))
    else:
        y = x
    n, h, w, c = y.shape
    if h % by or w % bx:
        raise self._error(f"padded spatial size {h}x{w} is not a multiple of the block {by}x{bx}")
    y = y.reshape(n, h // by, by, w // bx, bx, c).permute(2, 4, 0, 1, 3, 5)
    self.outputs[0].betensor = y.reshape(by * bx * n, h // by, w // bx, c).contiguous()


@BATCH_TO_SPACE.forward
def batchtospace_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, (4,))
    by, bx = _block_sizes(self)
    crop_l, crop_r, crop_t, crop_b = (_int_param(self, k, 0, minimum=0)
                                      for k in ("crop_left", "crop_right", "crop_top", "crop_bottom"))
    n, h, w, c = x.shape
    if n % (by * bx):
        raise self._error(f"batch {n} is not a multiple of block_size_y * block_size_x = {by * bx}")
    no = n // (by * bx)
    y = x.reshape(by, bx, no, h, w, c).permute(2, 3, 0, 4, 1, 5).reshape(no, h * by, w * bx, c)
    if crop_t + crop_b >= h * by or crop_l + crop_r >= w * bx:
        raise self._error(f"crops remove the whole {h * by}x{w * bx} output")
    self.outputs[0].betensor = y[:, crop_t:h * by - crop_b, crop_l:w * bx - crop_r, :].contiguous()


# ------------------------------------------------------------------------------------------------ ChannelShuffle
CHANNEL_SHUFFLE = declare_op(
    "ChannelShuffle",
    params={"group": Param(Int(lo=1), "channel groups interleaved", required=True),
            "splits": Param(Int(lo=1), "outputs the shuffled channels are split into", default=1),
            "scale": _UNREAD_SCALE},
    integer=_PASSTHROUGH, dtypes=PASSTHROUGH_DTYPES, semantics=f"{SEMANTICS}#channelshuffle")


@CHANNEL_SHUFFLE.forward
def channelshuffle_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    group = _int_param(self, "group")
    splits = _int_param(self, "splits", 1)
    c = x.shape[-1]
    if c % group or c % splits:
        raise self._error(f"channels {c} must be a multiple of group {group} and splits {splits}")
    if len(self.outputs) != splits:
        raise self._error(f"splits={splits} needs {splits} outputs, the layer has {len(self.outputs)}")
    y = x.reshape(*x.shape[:-1], group, c // group).transpose(-1, -2).reshape(x.shape)
    for out, part in zip(self.outputs, torch.split(y, c // splits, dim=-1)):
        out.betensor = part.contiguous()


# ------------------------------------------------------------------------------------------------ Crop
CROP = declare_op(
    "Crop",
    params={"crops": Param(Value("[[begin, end], ...]"), "one [begin, end) pair of integers per axis", required=True),
            "ds_crops": Param(Value(), "upstream's dynamic-shape crops; not read"),
            "scale": _UNREAD_SCALE},
    integer=_PASSTHROUGH, dtypes=PASSTHROUGH_DTYPES, semantics=f"{SEMANTICS}#crop")


@CROP.forward
def crop_forward(self: PyNode) -> None:
    """`crops=[[begin, end], ...]` per axis; [0, IR batch] on axis 0 keeps the whole actual batch."""
    x = self.inputs[0].betensor
    crops = self.get_param("crops")
    if not isinstance(crops, (list, tuple)) or len(crops) != x.dim():
        raise self._error(f"parameter 'crops' must hold one [begin, end] pair per axis of the {x.dim()}-D input")
    pairs = [_int_list(self, "crops", c) for c in crops]
    ir_batch = self.inputs[0].ir_shape[0] if self.inputs[0].ir_shape else None
    if pairs and pairs[0] == [0, ir_batch]:
        pairs[0] = [0, int(x.shape[0])]
    index = []
    for axis, pair in enumerate(pairs):
        if len(pair) != 2 or not 0 <= pair[0] < pair[1] <= x.shape[axis]:
            raise self._error(f"crop {pair} is out of range for axis {axis} of size {x.shape[axis]}")
        index.append(slice(pair[0], pair[1]))
    self.outputs[0].betensor = x[tuple(index)].contiguous()


# ------------------------------------------------------------------------------------------------ Tile
TILE = declare_op(
    "Tile",
    params={"repeats": Param(Ints(lo=1, scalar_ok=False), "copies along each axis", required=True),
            "scale": _UNREAD_SCALE},
    integer=_PASSTHROUGH, dtypes=PASSTHROUGH_DTYPES, semantics=f"{SEMANTICS}#tile")


@TILE.forward
@keeps_float64()
def tile_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    reps = _int_list(self, "repeats", self.get_param("repeats"))
    if len(reps) < x.dim() or any(r < 1 for r in reps):
        raise self._error(f"repeats {reps} must hold one positive count per axis of the {x.dim()}-D input")
    self.outputs[0].betensor = x.repeat(*reps).contiguous()


# ------------------------------------------------------------------------------------------------ Repeat
REPEAT = declare_op(
    "Repeat",
    params={"axis": Param(Int(), "the repeated axis (absent: the flattened input)"),
            "scale": _UNREAD_SCALE},
    constants={"repeats": "per-element repeat counts, when they are not the second input"},
    integer="passthrough (data movement; padding is the quantized 0)", dtypes=PASSTHROUGH_DTYPES,
    semantics=f"{SEMANTICS}#repeat",
    summary="Repeats: input 1 (integer) or the constant repeats.")


def _repeats(node: PyNode) -> torch.Tensor:
    if len(node.inputs) >= 2:
        t = node.inputs[1]
        r = int_value(t) if node.quantized else t.betensor
    else:
        c = node.get_constant("repeats", optional=True)
        if c is None:
            raise node._error("Repeat needs its repeats as a second input or a 'repeats' constant")
        r = c.betensor
    if r.is_floating_point():
        if not bool((r == torch.round(r)).all()):
            raise node._error("repeats must be integers")
    r = r.to(torch.int64).flatten()
    if bool((r < 0).any()):
        raise node._error("repeats must be non-negative")
    return r


@REPEAT.forward
def repeat_forward(self: PyNode) -> None:
    """repeat_interleave along `axis` (flattened input when absent), then cut or padded with float 0 to the output
    IR length along that axis (upstream's `max_dim`)."""
    x = self.inputs[0].betensor
    axis_p = self.get_param("axis", optional=True, default_value=None)
    if axis_p is None:
        x, axis = x.flatten(), 0
    else:
        axis = axis_param(self, axis_p, x.dim())
    reps = _repeats(self).to(x.device)
    if reps.numel() != x.shape[axis]:
        raise self._error(f"{reps.numel()} repeats for an axis of size {x.shape[axis]}")
    y = torch.repeat_interleave(x, reps, dim=axis)
    ir = list(self.outputs[0].ir_shape or ())
    if len(ir) == y.dim():
        target = int(ir[axis])
        if y.shape[axis] > target:
            y = y.narrow(axis, 0, target)
        elif y.shape[axis] < target:
            pad_shape = list(y.shape)
            pad_shape[axis] = target - y.shape[axis]
            y = torch.cat([y, torch.full(pad_shape, _pad_value(self), dtype=y.dtype, device=y.device)], dim=axis)
    self.outputs[0].betensor = y.contiguous()


# ------------------------------------------------------------------------------------------------ ReverseSequence
REVERSE_SEQUENCE = declare_op(
    "ReverseSequence",
    params={"batch_axis": Param(Int(), "the axis of the sequences", default=0),
            "time_axis": Param(Int(), "the reversed axis", default=1),
            "scale": _UNREAD_SCALE},
    integer=_PASSTHROUGH, dtypes=PASSTHROUGH_DTYPES, semantics=f"{SEMANTICS}#reversesequence",
    summary="Sequence lengths: input 1 (integer), else every sequence is reversed whole.")


@REVERSE_SEQUENCE.forward
@keeps_float64()
def reversesequence_forward(self: PyNode) -> None:
    """Reverse the first seq_len[b] entries along `time_axis` for every b along `batch_axis` (lengths clamped to
    [0, T]; one length serves every b; no lengths input reverses everything)."""
    x = self.inputs[0].betensor
    batch_axis = axis_param(self, self.get_param("batch_axis", optional=True, default_value=0), x.dim())
    time_axis = axis_param(self, self.get_param("time_axis", optional=True, default_value=1), x.dim())
    if batch_axis == time_axis:
        raise self._error("batch_axis and time_axis must differ")
    b, t = x.shape[batch_axis], x.shape[time_axis]
    if len(self.inputs) >= 2:
        lens_t = self.inputs[1]
        lens = (int_value(lens_t) if self.quantized else torch.round(lens_t.betensor.double())).to(torch.int64)
        lens = lens.flatten().to(x.device)
        if lens.numel() == 1:
            lens = lens.expand(b)
        elif lens.numel() != b:
            raise self._error(f"{lens.numel()} sequence lengths for a batch of {b}")
    else:
        lens = torch.full((b,), t, dtype=torch.int64, device=x.device)
    lens = torch.clamp(lens, 0, t)
    steps = torch.arange(t, device=x.device)
    idx = torch.where(steps[None, :] < lens[:, None], lens[:, None] - 1 - steps[None, :], steps[None, :])
    shape = [1] * x.dim()
    shape[batch_axis], shape[time_axis] = b, t
    if batch_axis > time_axis:
        idx = idx.t()
    idx = idx.reshape(shape).expand(x.shape)
    self.outputs[0].betensor = torch.gather(x, time_axis, idx).contiguous()


@DEPTH_TO_SPACE.quantize
@SPACE_TO_DEPTH.quantize
@SPACE_TO_BATCH.quantize
@BATCH_TO_SPACE.quantize
@CHANNEL_SHUFFLE.quantize
@CROP.quantize
@TILE.quantize
def layout_quantize(self: PyNode) -> None:
    """Pure data movement: the outputs carry the input's params; SpaceToBatch pads with the quantized float 0."""
    _passthrough_quantize(self)


@REPEAT.quantize
def repeat_quantize(self: PyNode) -> None:
    """Output params copied from the data input; the repeats input (if any) must be an integer tensor."""
    if len(self.inputs) >= 2:
        check_quantized_inputs(self, self.inputs[1:2])
        _check_integer_input(self, self.inputs[1], "repeats")
    _passthrough_quantize(self)


@REVERSE_SEQUENCE.quantize
def reversesequence_quantize(self: PyNode) -> None:
    """Output params copied from the data input; the lengths input (if any) must be an integer tensor."""
    if len(self.inputs) >= 2:
        check_quantized_inputs(self, self.inputs[1:2])
        _check_integer_input(self, self.inputs[1], "sequence lengths")
    _passthrough_quantize(self)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
ONNX_RESIZE_METHODS = {"nearest": "nearest", "bilinear": "linear", "linear": "linear", "trilinear": "linear",
                       "bicubic": "cubic", "cubic": "cubic"}
ONNX_COORDINATE_MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nn")
ONNX_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_scales(node: PyNode, x: PyTensor, y: PyTensor, spatial: List[int]) -> Optional[List[float]]:
    """Explicit ratios when the IR has them and they differ from out/in (they then define the coordinates)."""
    ratios: List[float] = []
    for pos, a in enumerate(spatial):
        r = node.params.get(RATIO_KEYS[len(spatial) - 1 - pos])
        n_in, n_out = int(x.ir_shape[a]), int(y.ir_shape[a])
        if r is None or float(r) <= 0 or float(r) == n_out / n_in:
            ratios.append(n_out / n_in)
            continue
        if int(np.floor(n_in * float(r))) != n_out:
            raise node_error(node, f"ratio {r} along axis {a} does not give the output size {n_out}")
        ratios.append(float(r))
    return None if all(r == int(y.ir_shape[a]) / int(x.ir_shape[a]) for r, a in zip(ratios, spatial)) else ratios


def exact_resize(g: QDQGraph, node: PyNode) -> bool:
    """Linear/cubic Resize with quantopt's S-bit integer weights: per axis a MatMul with the [in, out] weight
    matrix on the integers, in float64 (exact: the sums stay below 2^53), then round_half_even(acc / 2^(S · axes))
    (on the integers without their zero point: an odd zero point would move ties to the other even neighbour)."""
    if not g.unit_domain:
        return False
    x = node.inputs[0]
    method, shift, plan = resize_integer_plan(node, [int(v) for v in x.ir_shape])
    if method == "nearest":
        return False
    growth = 1
    for _, _, w in plan:
        growth *= int(w.abs().sum(dim=1).max())
    if not fits_double(offset_absmax(node, x) * growth):
        return False
    rank = len(x.ir_shape)
    zp_in, zp_out = tensor_zp(node, x), tensor_zp(node, node.outputs[0])
    value = codes(g, x)  # the integers themselves: quantopt rounds Σ w·q half to even, not Σ w·(q + zp)
    value = value if zp_in == 0 else g.add("Sub", [value, double(g, node, "zero_point", float(zp_in))])
    for axis, idx, w in plan:
        size = int(x.ir_shape[axis])
        matrix = np.zeros((size, int(idx.shape[0])), dtype=np.float64)
        for o in range(int(idx.shape[0])):
            for i, weight in zip(idx[o].tolist(), w[o].tolist()):
                matrix[i, o] += weight
        last = [a for a in range(rank) if a != axis] + [axis]
        moved = value if axis == rank - 1 else g.add("Transpose", [value], perm=last)
        value = g.add("MatMul", [moved, g.const(f"{node.name}/weights{axis}", matrix)])
        if axis != rank - 1:
            value = g.add("Transpose", [value], perm=list(inverse(last)))
    scaled = g.add("Round", [g.add("Mul", [value, double(g, node, "interp_step", 2.0 ** -(shift * len(plan)))])])
    if zp_out:
        scaled = g.add("Add", [scaled, double(g, node, "output_zero_point", float(zp_out))])
    g.quantize(node.outputs[0], g.add("Cast", [scaled], to=FLOAT), None, unit=True)
    return True


@RESIZE.export
@INTERP.export
def convert_resize(g: QDQGraph, node: PyNode) -> None:
    """ONNX Resize to the output sizes (scales when the IR gives other ratios), in the layout the input already
    has (channels-first preferred)."""
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    if rank not in (3, 4, 5):
        raise node_error(node, f"only 3-D to 5-D channels-last inputs are exported, got rank {rank}")
    method = str(node.get_param("method")).strip().lower()
    coord = str(node.get_param("mode", optional=True, default_value="half_pixel")).strip().lower()
    nearest = str(node.get_param("nearest_mode", optional=True, default_value="round_prefer_floor")).strip().lower()
    if method not in ONNX_RESIZE_METHODS:
        raise node_error(node, f"resize method {method.upper()} has no QDQ mapping")
    if coord not in ONNX_COORDINATE_MODES:
        raise node_error(node, f"coordinate mode {coord.upper()} has no QDQ mapping")
    if ONNX_RESIZE_METHODS[method] == "nearest" and nearest not in ONNX_NEAREST_MODES:
        raise node_error(node, f"nearest_mode {nearest.upper()} has no ONNX equivalent")
    if bool_param(node, "antialias", False) or bool_param(node, "exclude_outside", False):
        raise node_error(node, "antialias/exclude_outside resize has no QDQ mapping")
    if exact_resize(g, node):
        return
    spatial = list(range(1, rank - 1))
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    value = g.float_value(x, perm)
    scales = _resize_scales(node, x, y, spatial)
    if scales is None:  # sizes of every axis (no `axes` attribute: onnxruntime's layout optimizer mishandles it)
        sizes = [int(y.ir_shape[a]) for a in perm]
        if g.dynamic_batch:
            batch = g.add("Slice", [g.add("Shape", [value]), g.ints(f"{node.name}/batch_start", [0]),
                                    g.ints(f"{node.name}/batch_end", [1])])
            target = g.add("Concat", [batch, g.ints(f"{node.name}/sizes", sizes[1:])], axis=0)
        else:
            target = g.ints(f"{node.name}/sizes", sizes)
        inputs = [value, "", "", target]
    else:
        ratio = dict(zip(spatial, scales))
        full = np.asarray([ratio.get(a, 1.0) for a in perm], dtype=np.float32)
        inputs = [value, "", g.const(f"{node.name}/scales", full)]
    mode = ONNX_RESIZE_METHODS[method]
    out = g.add("Resize", inputs, mode=mode, coordinate_transformation_mode=coord,
                nearest_mode=nearest if mode == "nearest" else None,
                cubic_coeff_a=float(node.get_param("cubic_coeff_a", optional=True, default_value=-0.75))
                if mode == "cubic" else None)
    g.quantize(y, out, perm, lossless=mode == "nearest" and same_qparams(node, x, y))


# ------------------------------------------------------------------------------------------------ layout exports
def _moved_codes(g: QDQGraph, node: PyNode, value: str, steps: Sequence[Tuple[str, Sequence[int]]]) -> str:
    """`value` through integer Reshape ("reshape", shape: 0 copies the input's dim, -1 infers one) and Transpose
    ("transpose", perm) steps: the forward's own reshapes and permutes, on the codes in the IR layout."""
    for kind, arg in steps:
        if kind == "reshape":
            value = g.add("Reshape", [value, g.ints(f"{node.name}/shape", list(arg))])
        else:
            value = g.add("Transpose", [value], perm=list(arg))
    return value


def _padded_codes(g: QDQGraph, node: PyNode, x: PyTensor, pads: Sequence[int]) -> str:
    """The codes of `x` (IR layout) padded with the integer of float 0 (`pads` in ONNX order: begins, then ends).
    onnxruntime pads 8-bit integers but not 16-bit ones: those go through int32, both casts exact."""
    value = g.int_value(x)
    if not any(pads):
        return value
    p = g.qparams(x)
    fill = _quantized_zero(node, x) + p.offset
    pads_input = g.ints(f"{node.name}/pads", list(pads))
    if p.dtype.bits == 8:
        return g.add("Pad", [value, pads_input,
                             g.const(f"{node.name}/fill", np.array(fill, dtype=ONNX_INT_TYPES[p.dtype][1]))])
    wide = g.add("Cast", [value], to=INT32)
    padded = g.add("Pad", [wide, pads_input, g.const(f"{node.name}/fill", np.array(fill, dtype=np.int32))])
    return g.add("Cast", [padded], to=g.elem_type(p.dtype))


def _nhwc_move(g: QDQGraph, node: PyNode) -> Tuple[PyTensor, PyTensor, List[int]]:
    """(input, output, the input's [N, H, W, C]) of a 4-D layout layer, checked for the export: the output keeps
    the input's params (its codes move), the input is 4-D."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    if g.rank(x) != 4:
        raise node_error(node, f"only 4-D NHWC inputs are exported, got rank {g.rank(x)}")
    return x, y, [int(d) for d in x.ir_shape]


@DEPTH_TO_SPACE.export
def convert_depthtospace(g: QDQGraph, node: PyNode) -> None:
    """The forward's reshape and permute (DCR or CRD) on the codes in the IR's NHWC layout: integer Reshape and
    Transpose, which onnxruntime runs for every integer type (its DepthToSpace kernel does not)."""
    x, y, (_, h, w, c) = _nhwc_move(g, node)
    by, bx = _block_sizes(node)
    mode = str(node.get_param("mode", optional=True, default_value="DCR")).strip().upper()
    if c % (by * bx) or mode not in ("DCR", "CRD"):
        raise node_error(node, f"channels {c} and mode {mode} do not make a DepthToSpace of block {by}x{bx}")
    co = c // (by * bx)
    split, perm = (([0, h, w, by, bx, co], [0, 1, 3, 2, 4, 5]) if mode == "DCR"
                   else ([0, h, w, co, by, bx], [0, 1, 4, 2, 5, 3]))
    out = _moved_codes(g, node, g.int_value(x), [("reshape", split), ("transpose", perm),
                                                 ("reshape", [0, h * by, w * bx, co])])
    g.set_int(y, out)


@SPACE_TO_DEPTH.export
def convert_spacetodepth(g: QDQGraph, node: PyNode) -> None:
    """The forward's reshape and permute on the codes in the IR's NHWC layout (integer Reshape and Transpose)."""
    x, y, (_, h, w, c) = _nhwc_move(g, node)
    by, bx = _block_sizes(node)
    if h % by or w % bx:
        raise node_error(node, f"spatial size {h}x{w} is not a multiple of the block {by}x{bx}")
    out = _moved_codes(g, node, g.int_value(x), [("reshape", [0, h // by, by, w // bx, bx, c]),
                                                 ("transpose", [0, 1, 3, 2, 4, 5]),
                                                 ("reshape", [0, h // by, w // bx, by * bx * c])])
    g.set_int(y, out)


def _block_layer(g: QDQGraph, node: PyNode, sides: str) -> Tuple[PyTensor, PyTensor, int, int, List[int], List[int]]:
    """(input, output, block_size_y, block_size_x, the four `<sides>_left/right/top/bottom` params, the input's
    [N, H, W, C]) of a SpaceToBatch or BatchToSpace, checked for the export (same params, 4-D)."""
    x, y, shape = _nhwc_move(g, node)
    by, bx = _block_sizes(node)
    edges = [_int_param(node, f"{sides}_{k}", 0, minimum=0) for k in ("left", "right", "top", "bottom")]
    return x, y, by, bx, edges, shape


@SPACE_TO_BATCH.export
def convert_spacetobatch(g: QDQGraph, node: PyNode) -> None:
    """Padding with the integer of float 0, then the forward's reshape and permute into the batch (integer
    Pad, Reshape and Transpose in the IR's NHWC layout)."""
    x, y, by, bx, (left, right, top, bottom), (_, h, w, c) = _block_layer(g, node, "pad")
    h, w = h + top + bottom, w + left + right
    if h % by or w % bx:
        raise node_error(node, f"padded spatial size {h}x{w} is not a multiple of the block {by}x{bx}")
    value = _padded_codes(g, node, x, [0, top, left, 0, 0, bottom, right, 0])
    out = _moved_codes(g, node, value, [("reshape", [0, h // by, by, w // bx, bx, c]),
                                        ("transpose", [2, 4, 0, 1, 3, 5]),
                                        ("reshape", [-1, h // by, w // bx, c])])
    g.set_int(y, out)


@BATCH_TO_SPACE.export
def convert_batchtospace(g: QDQGraph, node: PyNode) -> None:
    """The forward's reshape and permute out of the batch, then the crops (integer Reshape, Transpose and Slice
    in the IR's NHWC layout)."""
    x, y, by, bx, (crop_l, crop_r, crop_t, crop_b), (_, h, w, c) = _block_layer(g, node, "crop")
    value = _moved_codes(g, node, g.int_value(x), [("reshape", [by, bx, -1, h, w, c]),
                                                   ("transpose", [2, 3, 0, 4, 1, 5]),
                                                   ("reshape", [-1, h * by, w * bx, c])])
    if crop_l or crop_r or crop_t or crop_b:
        value = g.add("Slice", [value, g.ints(f"{node.name}/starts", [crop_t, crop_l]),
                                g.ints(f"{node.name}/ends", [h * by - crop_b, w * bx - crop_r]),
                                g.ints(f"{node.name}/axes", [1, 2])])
    g.set_int(y, value)


@CHANNEL_SHUFFLE.export
def convert_channelshuffle(g: QDQGraph, node: PyNode) -> None:
    """The forward's interleaving of the channel groups (integer Reshape, Transpose, Reshape on the last IR axis),
    then a Split into `splits` equal parts."""
    x = node.inputs[0]
    for y in node.outputs:
        require_same(node, x, y)
    group, splits = _int_param(node, "group"), _int_param(node, "splits", 1)
    shape = [int(d) for d in x.ir_shape]
    rank, c = len(shape), shape[-1]
    if c % group or c % splits or len(node.outputs) != splits:
        raise node_error(node, f"channels {c}, group {group} and splits {splits} do not make a ChannelShuffle")
    lead = ([0] + shape[1:-1]) if rank > 1 else []
    swap = list(range(rank - 1)) + [rank, rank - 1]
    value = _moved_codes(g, node, g.int_value(x), [("reshape", lead + [group, c // group]), ("transpose", swap),
                                                   ("reshape", lead + [c])])
    if splits == 1:
        g.set_int(node.outputs[0], value)
        return
    parts = g.add_multi("Split", [value, g.ints(f"{node.name}/splits", [c // splits] * splits)],
                        [f"{y.name}_split" for y in node.outputs], axis=rank - 1)
    for y, part in zip(node.outputs, parts):
        g.set_int(y, part)


@TILE.export
def convert_tile(g: QDQGraph, node: PyNode) -> None:
    """An integer ONNX Tile in any layout the input has (the repeats permuted with it): the codes are copied."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    rank = g.rank(x)
    reps = _int_list(node, "repeats", node.get_param("repeats"))
    if len(reps) != rank:
        raise node_error(node, f"repeats {reps} must hold one count per axis of the {rank}-D input")
    perm = g.common_perm([x], rank)
    out = g.add("Tile", [g.int_value(x, perm), g.ints(f"{node.name}/repeats", [reps[a] for a in perm])])
    g.set_int(y, out, perm)


@CROP.export
def convert_crop(g: QDQGraph, node: PyNode) -> None:
    """`crops=[[begin, end], ...]`: an integer Slice of the cropped axes in any layout the input has (none for a
    whole-tensor Crop, which the merge_matmul_mul pass leaves where it folded a factor); [0, IR batch] on axis 0
    keeps the whole batch, as in quantopt."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    rank = g.rank(x)
    crops = node.get_param("crops")
    if not isinstance(crops, (list, tuple)) or len(crops) != rank:
        raise node_error(node, f"crops {crops!r} must hold one [begin, end] pair per axis of the {rank}-D input")
    perm = g.common_perm([x], rank)
    starts, ends, axes = [], [], []
    for axis, pair in enumerate(crops):
        begin, end = (int(v) for v in pair)
        size = int(x.ir_shape[axis])
        if (begin, end) == (0, size):
            continue
        if axis == 0 and g.dynamic_batch:
            raise node_error(node, "cropping the batch axis needs a static batch (--static-batch)")
        starts.append(begin)
        ends.append(end)
        axes.append(perm.index(axis))
    value = g.int_value(x, perm)
    if axes:
        value = g.add("Slice", [value, g.ints(f"{node.name}/starts", starts), g.ints(f"{node.name}/ends", ends),
                                g.ints(f"{node.name}/axes", axes)])
    g.set_int(y, value, perm)
