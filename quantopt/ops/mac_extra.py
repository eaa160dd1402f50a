"""Convolution3D, ConvTranspose, ConvTranspose3D, Gemm and BiasAdd: float forward, quantization, integer forward.

Layouts are the Compass Parser's: activations channels-last (NHWC, NDHWC); Convolution3D weights
`[out_c, kh, kw, kd, in_c/group]`; ConvTranspose weights `[out_c/group, kh, kw, in_c]` and ConvTranspose3D weights
`[out_c/group, kh, kw, kd, in_c]` (the ONNX `[in_c, out_c/group, k...]` tensors permuted). The convolutions and
BiasAdd go through the shared MAC quantization (`quantize_mac`): symmetric per-tensor/per-channel/per-group
weights, biases with the input zero point folded in, per-channel multipliers with one shared shift. Gemm is a
two-activation product with an optional requantized `C` branch. docs/semantics/mac.md states every integer step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS, AIFF_SHIFT_MAX, ITP_INPUT_BITS
from ..quant.params import integer_range
from ..quant.requant import scale_shift
from ..quant.rounding import FLOAT64_EXACT, round_shift
from ..registry import declare_op
from ..registry.optype import OpType
from ..registry.schema import Bool, Float, Int, Param, Value, quantized
from ._conv_nhwc import native_conv
from ._eltwise_int import offset_absmax
from ._quant import (
    FLOAT32_EXACT,
    check_fused_activation_quantizable,
    check_quantized_inputs,
    effective_weights,
    fused_activation_bounds,
    fused_activation_clamp,
    fused_int_slope,
    fused_output_signed,
    int_value,
    integer_output_bits,
    is_signed,
    layer_settings,
    mac_finish,
    mac_input,
    out_range,
    params,
    quant_of,
    quantize_activation,
    quantize_mac,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import (
    FUSED_ACTIVATION_CONSTANTS,
    FUSED_ACTIVATION_PARAMS,
    MAC_QUANTIZED_PARAMS,
    apply_fused_activation,
    bool_param,
    broadcast_shape,
    int_param,
)
from .onnx_build import exact as onnx_exact
from .onnx_build.mac import (
    bias_value,
    dq_constant,
    input_folded_bias,
    mac_weight_value,
    param_vector,
    qdq_fused_activation,
    quantize_mac_output,
    weight_dtypes,
    weight_onnx_scale,
    wide_double_mac,
    window_sums,
)
from .onnx_build.perms import channels_first, operand_perm
from .onnx_build.qdq_graph import QDQGraph, int_or, node_error

"""Integers and partial sums below this magnitude are exact in float64: the bound for float64 accumulation and for
the float64 requantization of `mac_finish` (|(acc + bias) * M| must stay below it)."""

INT64_ACCUMULATOR_LIMIT = 2 ** 62
"""Largest accumulator bound the int64 paths accept (headroom for the bias / C branch additions)."""

SATURATED = 2 ** 40
"""Any requantized |value| at or beyond this saturates every output range (qmin/qmax/zp hold at most 33 bits), so the
int64 requantization may cap intermediate values there."""

MULTIPLIER_LIMIT = 2 ** 16
"""Requant multipliers are at most 15 bits (`AIFF_MULTIPLIER_BITS`); the int64 requantization needs M < 2^16."""

SHIFT_LIMIT = 46
"""Largest right shift the int64 requantization handles exactly (remainder times M below 2^62); AIFF shifts are
at most `AIFF_SHIFT_MAX` = 31."""

BIAS_ADD_WEIGHT_BITS = (8, 16)
"""BiasAdd's implicit unit weight is quantized with the layer's weight bits clamped to this range."""


# ================================================================================================ params / geometry
_SEM = "docs/semantics/mac.md"
_CONV_INT = ("exact MAC (x_q padded with -zp_in) · (w_q + zp_w) + folded bias; per-tensor/per-channel "
             "multiplier, shared shift")
_CONVT_INT = "exact transposed MAC of (x_q + zp_in) minus zp_in·Σw + folded bias; per-output-channel requant"

_REQUANT_CONSTANTS = {"scale": "per-channel requantization multipliers (quantized)",
                      "shift": "per-channel requantization shifts (quantized)"}


def _float_param(node: PyNode, key: str, default: float) -> float:
    value = node.get_param(key, optional=True, default_value=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise node._error(f"parameter '{key}' must be finite, got {value!r}")
    return float(value)


_AXES = {2: ("y", "x"), 3: ("z", "y", "x")}
_PADS = {2: (("pad_top", "pad_bottom"), ("pad_left", "pad_right")),
         3: (("pad_z_begin", "pad_z_end"), ("pad_y_begin", "pad_y_end"), ("pad_x_begin", "pad_x_end"))}


def _conv_nd_params(nd: int, transposed: bool) -> Dict[str, Param]:
    """The layer keys of Convolution3D, ConvTranspose and ConvTranspose3D (one key set): the geometry of the `nd`
    spatial axes the type reads, the keys of the other layouts (not read), the fused activation and the MAC
    quantization keys."""
    read = _AXES[nd]
    unread = Param(Int(lo=0), "not read by this type")
    pad = "crop of the output" if transposed else "zero padding"
    params: Dict[str, Param] = {}
    for a in "xyz":
        on = a in read
        params[f"kernel_{a}"] = Param(Int(lo=1), f"kernel size along {a}; must match the weights") if on else unread
        params[f"stride_{a}"] = Param(Int(lo=1), f"stride along {a}", default=1) if on else unread
        params[f"dilation_{a}"] = Param(Int(lo=1), f"dilation along {a}", default=1) if on else unread
        params[f"output_padding_{a}"] = (Param(Int(lo=0), f"extension of the output at the end of {a}", default=0)
                                         if on and transposed else unread)
        for end in ("begin", "end"):
            params[f"pad_{a}_{end}"] = Param(Int(lo=0), f"{pad} at the {end} of {a}", default=0) if nd == 3 \
                else unread
    for key in ("pad_left", "pad_right", "pad_top", "pad_bottom"):
        params[key] = Param(Int(lo=0), f"{pad}, {key[len('pad_'):]}", default=0) if nd == 2 else unread
    params["group"] = Param(Int(lo=1), "channel groups", default=1)
    params["num_output"] = Param(Int(lo=1), "output channels; must match the weights and group")
    return {**params, **FUSED_ACTIVATION_PARAMS, **MAC_QUANTIZED_PARAMS}


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Spatial params in torch order ((y, x) or (z, y, x))."""

    kernel: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilation: Tuple[int, ...]
    pad_begin: Tuple[int, ...]
    pad_end: Tuple[int, ...]
    out_pad: Tuple[int, ...]

    def torch_pads(self, values_begin: Sequence[int], values_end: Sequence[int]) -> List[int]:
        """F.pad's argument (last axis first) for per-axis begin/end amounts in torch order."""
        out: List[int] = []
        for b, e in zip(reversed(values_begin), reversed(values_end)):
            out += [int(b), int(e)]
        return out


def _geometry(node: PyNode, kernel: Tuple[int, ...], transposed: bool) -> _Geometry:
    nd = len(kernel)
    axes = _AXES[nd]
    for a, k in zip(axes, kernel):
        value = int_param(node, f"kernel_{a}", None)
        if value is not None and value != k:
            raise node._error(f"parameter kernel_{a}={value} does not match the weights' kernel size {k}")
    stride = tuple(int_param(node, f"stride_{a}", 1) for a in axes)
    dilation = tuple(int_param(node, f"dilation_{a}", 1) for a in axes)
    begin = tuple(int_param(node, b, 0, minimum=0) for b, _ in _PADS[nd])
    end = tuple(int_param(node, e, 0, minimum=0) for _, e in _PADS[nd])
    out_pad = tuple(int_param(node, f"output_padding_{a}", 0, minimum=0) for a in axes) if transposed \
        else (0,) * nd
    return _Geometry(kernel, stride, dilation, begin, end, out_pad)  # type: ignore[arg-type]


def _kernel_perm(nd: int) -> Tuple[int, ...]:
    """Positions of the IR weight's kernel axes in torch order: (h, w) stays, (h, w, d) becomes (d, h, w)."""
    return (1, 2) if nd == 2 else (3, 1, 2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def _check_output_shape(node: PyNode, y: torch.Tensor) -> None:
    """The computed output must have the IR's layer_top_shape (batch aside): wrong params must not pass silently."""
    ir = tuple(int(d) for d in node.outputs[0].ir_shape)
    if len(ir) == y.dim() and tuple(y.shape[1:]) != ir[1:]:
        raise node._error(f"computed output shape {list(y.shape[1:])} (batch aside) does not match the IR output "
                          f"shape {list(ir[1:])}; check kernel/stride/dilation/pads/output_padding")


# ================================================================================================ exact integer MAC
def _exact_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, x_absmax: int,
                 w_sum_max: int) -> torch.Tensor:
    """fn(x) exactly as int64 for an integer-valued input `x` and a linear `fn` (a convolution with integer
    weights whose per-output sum of |w| is at most `w_sum_max`).

    float32 when every partial sum is provably below 2^24 (CPU only: GPU convolutions may use TF32), float64
    below 2^53; otherwise x = x_hi * 2^s + x_lo is split so that each part is exact in float64 and the two results
    are combined in int64. On a GPU the convolution runs torch's own kernels, not cuDNN's (`native_conv`: cuDNN's
    FFT algorithms round, which the bound does not cover).
    """
    bound = int(x_absmax) * int(w_sum_max)
    if bound >= INT64_ACCUMULATOR_LIMIT:
        raise UnsupportedError(f"integer accumulator bound {bound} exceeds 2^62; the layer cannot be computed exactly")
    if bound < FLOAT32_EXACT and x.device.type == "cpu":
        return torch.round(fn(x.to(torch.float32))).to(torch.int64)
    if bound < FLOAT64_EXACT:
        with native_conv(x.device):
            return torch.round(fn(x.to(torch.float64))).to(torch.int64)
    if w_sum_max >= FLOAT64_EXACT // 2:
        raise UnsupportedError(f"weight magnitude sum {w_sum_max} is too large for an exact integer convolution")
    s = (FLOAT64_EXACT // (2 * int(w_sum_max))).bit_length() - 1  # 2^s * w_sum_max < 2^53
    x = x.to(torch.int64)
    hi = x >> s
    lo = x - (hi << s)
    return (_exact_apply(fn, hi, (int(x_absmax) >> s) + 1, w_sum_max) << s) + \
        _exact_apply(fn, lo, (1 << s) - 1, w_sum_max)


def _requantize(node: PyNode, acc: torch.Tensor, mult: Union[int, torch.Tensor],
                shift: Union[int, torch.Tensor]) -> torch.Tensor:
    """Exact round_half_even(acc * M / 2^shift) of an int64 accumulator, int64; M/shift scalars or int64 tensors
    broadcasting to `acc` (per channel on the last axis).

    shift > 0: acc = hi * 2^s + lo with 0 <= lo < 2^s; acc*M/2^s = hi*M + lo*M/2^s, so only lo*M (< 2^(s+16)) is
    divided; ties go to the even total. |hi| is capped at 2^40 (the result then saturates every output range).
    shift <= 0: (acc * M) << -shift, saturating at ±2^40.
    """
    m = torch.as_tensor(mult, dtype=torch.int64, device=acc.device)
    s = torch.as_tensor(shift, dtype=torch.int64, device=acc.device)
    if bool((m < 0).any()) or bool((m >= MULTIPLIER_LIMIT).any()) or bool((s > SHIFT_LIMIT).any()):
        raise node._error(f"requantization needs multipliers 0 <= M < 2^16 and shifts <= {SHIFT_LIMIT}, got "
                          f"M={mult}, shift={shift}")
    acc = acc.to(torch.int64)
    sp = torch.clamp(s, min=0)
    hi = acc >> sp
    lo = acc - (hi << sp)
    hi = torch.clamp(hi, -SATURATED, SATURATED)
    r = lo * m
    q2 = r >> sp
    rem = r - (q2 << sp)
    base = hi * m + q2
    half = torch.where(sp > 0, torch.ones_like(sp) << torch.clamp(sp - 1, min=0), torch.zeros_like(sp))
    up = (sp > 0) & ((rem > half) | ((rem == half) & ((base & 1) == 1)))
    right = base + up.to(torch.int64)
    if not bool((s < 0).any()):
        return right
    left = torch.clamp(torch.clamp(acc, -SATURATED, SATURATED) * m, -SATURATED, SATURATED)
    k = torch.clamp(-s, min=0)
    while bool((k > 0).any()):
        step = torch.clamp(k, max=20)
        left = torch.clamp(left << step, -SATURATED, SATURATED)
        k = k - step
    return torch.where(s < 0, left, right)


def _wide_mac(node: PyNode) -> bool:
    w = node.get_constant("weights")
    table = quant_of(node)
    return (table.get(node.inputs[0]).qbits or 8) > 8 or (table.get(w).qbits or w.dtype.bits) > 8


def _finish_int64(node: PyNode, acc: torch.Tensor) -> torch.Tensor:
    """The MAC requantization of `mac_finish` (bias, optional remain_shift hand-over, multiplier/shift, zero point,
    clamp, fused bounds) on an int64 accumulator, exact for any |acc| < 2^62."""
    out = node.outputs[0]
    mult, shift = requant_of(node)
    b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1).to(acc.device)
    remain = node.params.get("remain_shift")
    common = shift if isinstance(shift, int) else (int(shift[0]) if bool((shift == shift[0]).all()) else None)
    if remain is not None and common is not None and _wide_mac(node):
        lo32, hi32 = integer_range(ITP_INPUT_BITS, True)
        d = common - int(remain)
        if d > 0:
            acc = torch.clamp(round_shift(acc, d), lo32, hi32) + torch.clamp(b >> d, lo32, hi32)
            shift = int(remain) if isinstance(shift, int) else torch.full_like(shift, int(remain))
        else:
            acc = torch.clamp(acc, lo32, hi32) + b
    else:
        acc = acc + b
    acc = fused_int_slope(node, acc)
    qmin, qmax = out_range(node, out)
    y = torch.clamp(_requantize(node, acc, mult, shift) - tensor_zp(node, out), qmin, qmax)
    return fused_activation_clamp(node, y)


def _mac_output(node: PyNode, acc: torch.Tensor, acc_bound: int) -> torch.Tensor:
    """Requantize an exact int64 accumulator (bias not added, channels last): `mac_finish` (float64) when
    (bound + max|bias|) * max M < 2^53 proves it exact, else the int64 path with the same semantics."""
    mult, _ = requant_of(node)
    b = node.get_constant("biases").betensor
    m_max = int(mult.max()) if isinstance(mult, torch.Tensor) else int(mult)
    b_max = int(b.abs().max()) if b.numel() else 0
    if (int(acc_bound) + b_max) * max(m_max, 1) < FLOAT64_EXACT:
        return mac_finish(node, acc.to(torch.float64))
    return _finish_int64(node, acc)


def _input_absmax(node: PyNode, t: PyTensor, zp_shift: int = 0) -> int:
    """max |q + zp_shift| over the input's integer range (and |zp_shift| itself, the value of float 0 padding)."""
    lo, hi = out_range(node, t)
    return max(abs(lo + zp_shift), abs(hi + zp_shift), abs(tensor_zp(node, t)))


def _cached(node: PyNode, key: str, build: Callable[[], Any]) -> Any:
    """Per-layer cache of prepared integer weights, valid while the weight tensor and input range are unchanged."""
    w_q = node.get_constant("weights").betensor
    in_range = out_range(node, node.inputs[0])
    hit = node.attrs.get(key)
    if hit is not None and hit[0] is w_q and hit[1] == in_range:
        return hit[2]
    value = build()
    node.attrs[key] = (w_q, in_range, value)
    return value


# ================================================================================================ Convolution3D
CONVOLUTION3D = declare_op(
    "Convolution3D", params=_conv_nd_params(3, transposed=False),
    constants={"weights": "[out_c,kh,kw,kd,in_c/group]", "biases": "[out_c], absent means zero", **_REQUANT_CONSTANTS,
               **FUSED_ACTIVATION_CONSTANTS},
    integer=_CONV_INT, semantics=_SEM + "#convolution3d")


def _conv3d_weights(node: PyNode, w: torch.Tensor, in_c: int) -> int:
    """Validate `[out_c, kh, kw, kd, in_c/group]` weights against the input and params; returns the group."""
    if w.dim() != 5:
        raise node._error(f"weights must be 5-D [out_c, kh, kw, kd, in_c/group], got shape {list(w.shape)}")
    out_c, cin_g = int(w.shape[0]), int(w.shape[4])
    num_output = int_param(node, "num_output", None)
    if num_output is not None and num_output != out_c:
        raise node._error(f"parameter num_output={num_output} does not match weights shape {list(w.shape)}")
    group = int_param(node, "group", 1)
    if cin_g * group != in_c or out_c % group != 0:
        raise node._error(f"group={group} with weights {list(w.shape)} does not fit {in_c} input channels "
                          "(needs in_c == weights[4] * group and out_c % group == 0)")
    return int(group)  # type: ignore[arg-type]


def _conv3d_setup(node: PyNode, x: torch.Tensor, w: torch.Tensor) -> Tuple[int, _Geometry, torch.Tensor]:
    if x.dim() != 5:
        raise node._error(f"input must be 5-D NDHWC, got shape {list(x.shape)}")
    group = _conv3d_weights(node, w, int(x.shape[-1]))
    wt = w.permute(0, 4, 3, 1, 2)  # [out_c, in_c/g, kd, kh, kw]
    geo = _geometry(node, tuple(int(k) for k in wt.shape[2:]), transposed=False)
    return group, geo, wt


def _conv3d(node: PyNode, x: torch.Tensor, wt: torch.Tensor, group: int, geo: _Geometry,
            pad_value: float) -> torch.Tensor:
    xt = x.movedim(-1, 1)
    if any(geo.pad_begin) or any(geo.pad_end):
        xt = F.pad(xt, geo.torch_pads(geo.pad_begin, geo.pad_end), value=pad_value)
    need = [(k - 1) * d + 1 for k, d in zip(geo.kernel, geo.dilation)]
    if any(s < n for s, n in zip(xt.shape[2:], need)):
        raise node._error(f"padded input {list(xt.shape[2:])} (DHW) is smaller than the dilated kernel {need}")
    # contiguous weights: torch's float32 grouped 3-D convolution of a channels-last input by a permuted weight view
    # computes wrong sums (torch 2.13, CPU: tests/ops/test_conv3d_groups.py)
    y = F.conv3d(xt, wt.to(xt.dtype).contiguous(), None, stride=geo.stride, dilation=geo.dilation, groups=group)
    return y.movedim(1, -1).contiguous()


def _bias_vector(node: PyNode, out_c: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    t = node.get_constant("biases", optional=True)
    if t is None:
        return None
    if t.betensor.numel() != out_c:
        raise node._error(f"biases must have {out_c} elements (one per output channel), got shape "
                          f"{list(t.betensor.shape)}")
    return t.betensor.to(device=like.device, dtype=like.dtype).reshape(out_c)


@CONVOLUTION3D.forward
def convolution3d_forward(self: PyNode) -> None:
    """NDHWC 3-D convolution with weights [out_c, kh, kw, kd, in_c/group], explicit begin/end pads per axis."""
    if self.quantized:
        self.outputs[0].betensor = _conv3d_int(self)
        return
    x = self.inputs[0].betensor
    dtype = _compute_dtype(x)
    w = self.get_constant("weights").betensor.to(device=x.device, dtype=dtype)
    group, geo, wt = _conv3d_setup(self, x, w)
    y = _conv3d(self, x.to(dtype), wt, group, geo, 0.0)
    b = _bias_vector(self, int(w.shape[0]), y)
    if b is not None:
        y = y + b
    _check_output_shape(self, y)
    self.outputs[0].betensor = apply_fused_activation(self, y)


def _conv3d_int(node: PyNode) -> torch.Tensor:
    """acc = conv3d(x_q padded with -zp_in, w_q + zp_w) exactly, then the MAC requantization."""
    x, zp = mac_input(node)

    def build() -> Tuple[torch.Tensor, int]:
        w = effective_weights(node)
        return w, int(w.abs().reshape(w.shape[0], -1).sum(dim=1).max()) if w.numel() else 0
    w, w_sum = _cached(node, "_conv3d_int_weights", build)
    group, geo, wt = _conv3d_setup(node, x, w.to(x.device))
    x_absmax = _input_absmax(node, node.inputs[0])
    acc = _exact_apply(lambda xf: _conv3d(node, xf, wt.to(xf.dtype), group, geo, float(-zp)), x, x_absmax, w_sum)
    return _mac_output(node, acc, x_absmax * w_sum)


@CONVOLUTION3D.quantize
def convolution3d_quantize(self: PyNode) -> None:
    """As Convolution: per-channel weights when the weight mode says so, else per group (per tensor if group=1)."""
    per_channel = layer_settings(self).q_mode_weight.startswith("per_channel")
    group = int_param(self, "group", 1)
    quantize_mac(self, per_channel=per_channel, groups=1 if per_channel else int(group))  # type: ignore[arg-type]


@CONVOLUTION3D.export
def convert_convolution3d(g: QDQGraph, node: PyNode) -> None:
    """"exact" mode: Σ over the kernel positions of the strided windows of the padded integers (NDHWC, float64)
    times the block-diagonal weight matrices (`window_sums`), the bias without the input zero point, M · 2^-N and
    Round: the integer forward's values while every sum stays below 2^53 (else a float layer, recorded). Other
    modes: ONNX Conv (3-D) on the dequantized channels-first input and weights, quantized again."""
    x, y = node.inputs[0], node.outputs[0]
    if g.rank(x) != 5:
        raise node_error(node, f"only 5-D NDHWC inputs are exported, got rank {g.rank(x)}")
    w_q = node.get_constant("weights").betensor
    if w_q.dim() != 5:
        raise node_error(node, f"weights must be [out_c, kh, kw, kd, in_c/group], got shape {list(w_q.shape)}")
    group = int_or(node, "group", 1)
    kernel = (int(w_q.shape[3]), int(w_q.shape[1]), int(w_q.shape[2]))  # (d, h, w)
    strides = [int_or(node, f"stride_{a}", 1) for a in "zyx"]
    dilations = [int_or(node, f"dilation_{a}", 1) for a in "zyx"]
    begin = [int_or(node, f"pad_{a}_begin", 0) for a in "zyx"]
    end = [int_or(node, f"pad_{a}_end", 0) for a in "zyx"]
    unit = g.unit_domain
    if unit:
        w = effective_weights(node).numpy().transpose(0, 3, 1, 2, 4)  # [O, kd, kh, kw, C/group], as NDHWC reads it
        ratio = wide_double_mac(g, node, int(np.prod(w.shape[1:])), force=True)
        if ratio is not None:
            codes = onnx_exact.codes(g, x)
            if any(begin) or any(end):
                codes = g.add("Pad", [codes, g.ints(f"{node.name}/pads", [0, *begin, 0, 0, *end, 0])])
            total = window_sums(g, node, codes, w, int(x.ir_shape[4]), group, [int(v) for v in y.ir_shape[1:4]],
                                strides, dilations)
            total = g.add("Add", [total, g.const(f"{node.name}/bias",
                                                 input_folded_bias(node, x).astype(np.float64))])
            onnx_exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
            return
        g.float_layers.setdefault(node.name, None)  # the float32 convolution below is not bit-exact
    cf = channels_first(5)
    scale = weight_onnx_scale(g, node, x, y, unit)
    conv = g.add("Conv", [g.float_value(x, cf, unit), mac_weight_value(g, node, scale, axis=0, perm=(0, 4, 3, 1, 2)),
                          bias_value(g, node, x, scale, unit=unit)],
                 kernel_shape=list(kernel), strides=strides, dilations=dilations, pads=begin + end, group=group)
    quantize_mac_output(g, node, conv, cf, unit)


# ================================================================================================ ConvTranspose(3D)
CONV_TRANSPOSE = declare_op(
    "ConvTranspose", params=_conv_nd_params(2, transposed=True),
    constants={"weights": "[out_c/group,kh,kw,in_c]", "biases": "[out_c], absent means zero", **_REQUANT_CONSTANTS,
               **FUSED_ACTIVATION_CONSTANTS},
    integer=_CONVT_INT, semantics=_SEM + "#convtranspose")

CONV_TRANSPOSE3D = declare_op(
    "ConvTranspose3D", params=_conv_nd_params(3, transposed=True),
    constants={"weights": "[out_c/group,kh,kw,kd,in_c]", "biases": "[out_c], absent means zero",
               **_REQUANT_CONSTANTS},
    integer=_CONVT_INT, semantics=_SEM + "#convtranspose3d")


def _convt_nd(node: PyNode) -> int:
    return 2 if node.type == OpType.ConvTranspose else 3


def _convt_check(node: PyNode, shape: Sequence[int], in_c: int, nd: int) -> int:
    """Validate the shape of `[out_c/group, k..., in_c]` weights; returns the group."""
    shape = [int(d) for d in shape]
    if len(shape) != nd + 2:
        layout = "[out_c/group, kh, kw, in_c]" if nd == 2 else "[out_c/group, kh, kw, kd, in_c]"
        raise node._error(f"weights must be {nd + 2}-D {layout}, got shape {shape}")
    if shape[-1] != in_c:
        raise node._error(f"weights {shape} must end in the {in_c} input channels")
    group = int(int_param(node, "group", 1))  # type: ignore[arg-type]
    if in_c % group != 0:
        raise node._error(f"group={group} does not divide the {in_c} input channels")
    num_output = int_param(node, "num_output", None)
    out_c = shape[0] * group
    if num_output is not None and num_output != out_c:
        raise node._error(f"parameter num_output={num_output} does not match weights {shape} with "
                          f"group={group} (out_c = weights[0] * group = {out_c})")
    return group


def _ir_to_oc(w: torch.Tensor, group: int) -> torch.Tensor:
    """IR `[out_c/g, k..., in_c]` → per-output-channel form `[out_c, k..., in_c/g]`: channel gi*(out_c/g)+j holds
    IR row j, input channels gi*(in_c/g) ... (gi+1)*(in_c/g)-1. The identity for group 1."""
    if group == 1:
        return w
    nd = w.dim() - 2
    cog, cin = int(w.shape[0]), int(w.shape[-1])
    v = w.reshape(cog, *w.shape[1:-1], group, cin // group)
    v = v.permute(nd + 1, 0, *range(1, nd + 1), nd + 2)
    return v.reshape(group * cog, *w.shape[1:-1], cin // group)


def _oc_to_ir(w: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `_ir_to_oc`."""
    if group == 1:
        return w
    nd = w.dim() - 2
    cout, cig = int(w.shape[0]), int(w.shape[-1])
    v = w.reshape(group, cout // group, *w.shape[1:-1], cig)
    v = v.permute(1, *range(2, nd + 2), 0, nd + 2)
    return v.reshape(cout // group, *w.shape[1:-1], group * cig)


def _oc_to_torch(w_oc: torch.Tensor, group: int) -> torch.Tensor:
    """Per-output-channel form → conv_transpose weight `[in_c, out_c/g, k...]` (kernel axes in torch order)."""
    nd = w_oc.dim() - 2
    cout, cig = int(w_oc.shape[0]), int(w_oc.shape[-1])
    v = w_oc.reshape(group, cout // group, *w_oc.shape[1:-1], cig)
    v = v.permute(0, nd + 2, 1, *[p + 1 for p in _kernel_perm(nd)])
    return v.reshape(group * cig, cout // group, *v.shape[3:])


def _convt_setup(node: PyNode, x: torch.Tensor, w_ir_shape: Sequence[int]) -> Tuple[int, _Geometry]:
    nd = _convt_nd(node)
    if x.dim() != nd + 2:
        raise node._error(f"input must be {nd + 2}-D {'NHWC' if nd == 2 else 'NDHWC'}, got shape {list(x.shape)}")
    group = _convt_check(node, w_ir_shape, int(x.shape[-1]), nd)
    kernel = tuple(int(w_ir_shape[p]) for p in _kernel_perm(nd))
    return group, _geometry(node, kernel, transposed=True)


def _conv_transpose(node: PyNode, x: torch.Tensor, wt: torch.Tensor, group: int, geo: _Geometry) -> torch.Tensor:
    """Full transposed convolution, extended by output_padding at the end of each axis, cropped by the pads;
    channels last. No bias."""
    fn = F.conv_transpose2d if len(geo.kernel) == 2 else F.conv_transpose3d
    y = fn(x.movedim(-1, 1), wt.to(x.dtype).contiguous(), None, stride=geo.stride, padding=0, output_padding=0,
           groups=group, dilation=geo.dilation)  # contiguous weights: as in `_conv3d`
    if any(geo.out_pad):
        y = F.pad(y, geo.torch_pads((0,) * len(geo.out_pad), geo.out_pad))
    sizes = y.shape[2:]
    if any(b + e >= s for b, e, s in zip(geo.pad_begin, geo.pad_end, sizes)):
        raise node._error(f"pads {list(geo.pad_begin)}/{list(geo.pad_end)} leave no output of the transposed "
                          f"convolution's {list(sizes)}")
    index = (slice(None), slice(None)) + tuple(slice(b, s - e) for b, e, s in zip(geo.pad_begin, geo.pad_end, sizes))
    return y[index].movedim(1, -1).contiguous()


def _convt_forward(node: PyNode) -> None:
    """ConvTranspose / ConvTranspose3D: y = crop(convT(x, W) padded by output_padding) + b, fused activation."""
    if node.quantized:
        node.outputs[0].betensor = _convt_int(node)
        return
    x = node.inputs[0].betensor
    dtype = _compute_dtype(x)
    w = node.get_constant("weights").betensor.to(device=x.device, dtype=dtype)
    group, geo = _convt_setup(node, x, w.shape)
    nd = w.dim() - 2
    wt = w.permute(nd + 1, 0, *_kernel_perm(nd))  # [in_c, out_c/g, k...]
    y = _conv_transpose(node, x.to(dtype), wt, group, geo)
    b = _bias_vector(node, int(w.shape[0]) * group, y)
    if b is not None:
        y = y + b
    _check_output_shape(node, y)
    node.outputs[0].betensor = apply_fused_activation(node, y)


def _oc_effective_weights(node: PyNode, group: int) -> torch.Tensor:
    """w_q + zp_w per output channel, int64, in the per-output-channel form `[out_c, k..., in_c/g]`."""
    w = _ir_to_oc(node.get_constant("weights").betensor.to(torch.int64), group)
    if "weights_zp" in node.constants:
        zp = node.constants["weights_zp"].betensor.to(torch.int64).reshape(-1)
        if zp.numel() != int(w.shape[0]):
            raise node._error(f"weights_zp has {zp.numel()} entries for {int(w.shape[0])} output channels")
        return w + zp.reshape([-1] + [1] * (w.dim() - 1))
    return w + int(node.params.get("weights_zp", 0))


def _convt_int(node: PyNode) -> torch.Tensor:
    """acc = convT(x_q + zp_in, w) - zp_in * Σ w[c] (the transposed convolution of the input with float 0 ↔ 0, i.e.
    holes and borders filled with -zp_in), exact; then the MAC requantization with the folded biases."""
    x, zp = mac_input(node)
    w_shape = node.get_constant("weights").betensor.shape
    group, geo = _convt_setup(node, x, w_shape)

    def build() -> Tuple[torch.Tensor, torch.Tensor, int]:
        w_oc = _oc_effective_weights(node, group)
        sums = w_oc.reshape(w_oc.shape[0], -1).sum(dim=1)
        abs_max = int(w_oc.abs().reshape(w_oc.shape[0], -1).sum(dim=1).max()) if w_oc.numel() else 0
        return _oc_to_torch(w_oc, group), sums, abs_max
    wt, sums, w_sum = _cached(node, "_convt_int_weights", build)
    wt = wt.to(x.device)
    x_absmax = _input_absmax(node, node.inputs[0], zp)
    fast = _convt_int_float(node, x + zp, wt, sums, group, geo, x_absmax, w_sum)
    if fast is not None:
        return fast
    acc = _exact_apply(lambda xf: _conv_transpose(node, xf, wt.to(xf.dtype), group, geo), x + zp, x_absmax, w_sum)
    acc = acc - zp * sums.to(acc.device)
    return _mac_output(node, acc, (x_absmax + abs(zp)) * w_sum)


def _convt_int_float(node: PyNode, x: torch.Tensor, wt: torch.Tensor, sums: torch.Tensor, group: int, geo: Any,
                     x_absmax: int, w_sum: int) -> Optional[torch.Tensor]:
    """`_convt_int`'s result when `_exact_apply` would take its float32 path and `_mac_output` `mac_finish`: the
    same values without the int64 round trip (float32 sums below 2^24 are exact integers, so rounding them in
    float64 gives the same integers; acc - zp·Σw stays below 2^53 since |zp| <= x_absmax), requantized in place by
    `mac_finish`. None otherwise."""
    zp = tensor_zp(node, node.inputs[0])
    if not (int(x_absmax) * int(w_sum) < FLOAT32_EXACT and x.device.type == "cpu"):
        return None
    mult, _ = requant_of(node)
    b = node.get_constant("biases").betensor
    m_max = int(mult.max()) if isinstance(mult, torch.Tensor) else int(mult)
    b_max = int(b.abs().max()) if b.numel() else 0
    if (int((x_absmax + abs(zp)) * w_sum) + b_max) * max(m_max, 1) >= FLOAT64_EXACT:
        return None
    xf = x.to(torch.float32)
    acc = _conv_transpose(node, xf, wt.to(xf.dtype), group, geo).to(torch.float64).round_()
    acc = acc.sub_(zp * sums.to(device=acc.device, dtype=torch.float64)) if zp else acc
    return mac_finish(node, acc.contiguous(), owned=True)


def _oc_ranges(node: PyNode, w: PyTensor, w_oc: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel calibrated ranges of grouped transposed-conv weights: the extrema of each channel's slice,
    limited to the calibrated range of its IR row (identical to the extrema for the default `extrema` strategy)."""
    flat = w_oc.reshape(w_oc.shape[0], -1).cpu().to(torch.float32)  # ranges live on the CPU
    lo = torch.clamp(flat.min(dim=1).values, max=0.0)
    hi = torch.clamp(flat.max(dim=1).values, min=0.0)
    rc = ranges_of(node).channels(w)
    if rc.min is not None and rc.max is not None and rc.min.numel() * group == w_oc.shape[0]:
        row_lo = torch.as_tensor(rc.min, dtype=torch.float32).reshape(-1).repeat(group)
        row_hi = torch.as_tensor(rc.max, dtype=torch.float32).reshape(-1).repeat(group)
        lo = torch.clamp(torch.maximum(lo, row_lo), max=0.0)
        hi = torch.clamp(torch.minimum(hi, row_hi), min=0.0)
    return lo, hi


def _convt_quantize(node: PyNode) -> None:
    """MAC quantization on the per-output-channel form of the weights (so per-channel scales, multipliers and the
    zero-point fold are per output channel, also for group > 1), stored back in the IR layout."""
    w = node.get_constant("weights")
    x = node.inputs[0]
    nd = _convt_nd(node)
    in_c = int(x.ir_shape[-1]) if len(x.ir_shape) == nd + 2 else int(w.betensor.shape[-1])
    group = _convt_check(node, w.betensor.shape, in_c, nd)
    per_channel = layer_settings(node).q_mode_weight.startswith("per_channel")
    if group > 1:
        w.betensor = _ir_to_oc(w.betensor, group)
        ranges_of(node).set_channels(w, *_oc_ranges(node, w, w.betensor, group))
    try:
        quantize_mac(node, per_channel=per_channel, groups=1 if per_channel else group)
    finally:
        w.betensor = _oc_to_ir(w.betensor, group)


@CONV_TRANSPOSE.forward
def conv_transpose_forward(self: PyNode) -> None:
    """NHWC transposed convolution, weights [out_c/group, kh, kw, in_c], pads crop, output_padding_y/x extend."""
    _convt_forward(self)


@CONV_TRANSPOSE3D.forward
def conv_transpose3d_forward(self: PyNode) -> None:
    """NDHWC transposed convolution, weights [out_c/group, kh, kw, kd, in_c], pad_{z,y,x}_{begin,end} crop."""
    _convt_forward(self)


@CONV_TRANSPOSE.quantize
def conv_transpose_quantize(self: PyNode) -> None:
    _convt_quantize(self)


@CONV_TRANSPOSE3D.quantize
def conv_transpose3d_quantize(self: PyNode) -> None:
    _convt_quantize(self)


# ================================================================================================ BiasAdd
BIAS_ADD = declare_op(
    "BiasAdd",
    params={"axis": Param(Int(), "the channel axis of the biases", default=-1),
            **FUSED_ACTIVATION_PARAMS, **MAC_QUANTIZED_PARAMS,
            **{k: quantized(Value(), "written by some upstream versions; not read") for k in ("scale1", "scale2")}},
    constants={"biases": "[C]", "weights": "the unit weight quantization adds (quantized)",
               "weights_bk": "upstream's saved unit weights; not read", **_REQUANT_CONSTANTS},
    integer="x_q · unit weight + folded bias, per-tensor multiplier/shift",
    semantics=_SEM + "#biasadd")


def _bias_add_axis(node: PyNode, rank: int) -> int:
    axis = int_param(node, "axis", -1, minimum=-rank)
    if not -rank <= axis < rank:  # type: ignore[operator]
        raise node._error(f"axis={axis} is out of range for a rank-{rank} input")
    return int(axis) % rank  # type: ignore[arg-type]


@BIAS_ADD.forward
def bias_add_forward(self: PyNode) -> None:
    """y = x + biases along `axis` (default the last, the channel axis), then the fused activation."""
    x = self.inputs[0].betensor
    if x.dim() < 1:
        raise self._error("BiasAdd needs an input of rank >= 1")
    axis = _bias_add_axis(self, x.dim())
    channels = int(x.shape[axis])
    b = self.get_constant("biases").betensor
    if b.numel() != channels:
        raise self._error(f"biases must have {channels} elements (one per channel of axis {axis}), got shape "
                          f"{list(b.shape)}")
    if self.quantized:
        self.outputs[0].betensor = _bias_add_int(self, axis)
        return
    dtype = _compute_dtype(x)
    view = [channels] + [1] * (x.dim() - 1 - axis)
    y = x.to(dtype) + b.to(device=x.device, dtype=dtype).reshape(view)
    self.outputs[0].betensor = apply_fused_activation(self, y)


def _bias_add_int(node: PyNode, axis: int) -> torch.Tensor:
    """acc = x_q * W (the stored unit weight, w_q + zp_w), then the MAC requantization with the channel axis last."""
    x = int_value(node.inputs[0])
    w = effective_weights(node).reshape(-1)
    if w.numel() != 1:
        raise node._error(f"a quantized BiasAdd stores one unit weight, got {w.numel()}")
    acc = x.movedim(axis, -1) * int(w[0])
    bound = _input_absmax(node, node.inputs[0]) * abs(int(w[0]))
    return _mac_output(node, acc, bound).movedim(-1, axis).contiguous()


def _bias_add_settings(node: PyNode) -> Any:
    """The layer's settings with the unit weight's mode and bits, and no remain_shift (as BatchNorm)."""
    s = layer_settings(node)
    bits = min(max(int(s.q_bits_weight), BIAS_ADD_WEIGHT_BITS[0]), BIAS_ADD_WEIGHT_BITS[1])
    return dataclasses.replace(s, q_mode_weight="per_tensor_symmetric_restricted_range", q_bits_weight=bits,
                               remain_shift=None)


@BIAS_ADD.quantize
def bias_add_quantize(self: PyNode) -> None:
    """A per-channel affine map with unit weight: a `weights` constant [1] holding float 1 is quantized per tensor,
    symmetric restricted range (exactly 2^(b-1)-1 with scale 2^(b-1)-1), then the MAC path quantizes the biases
    (scale s_in * s_w, input zero point folded) and the requant ratio s_out / (s_in * s_w)."""
    check_quantized_inputs(self, self.inputs[:1])
    if "weights" in self.constants:
        raise self._error("a float BiasAdd has only 'biases'; found a 'weights' constant")
    one = set_constant(self, "weights", torch.ones(1), Dtype.FP32)
    ranges_of(self).set(one, 0.0, 1.0)
    ranges_of(self).set_channels(one, torch.zeros(1), torch.ones(1))
    order: List[str] = self.attrs.setdefault("ir_key_order", [])
    if "weights" not in order:
        order.insert(order.index("biases") if "biases" in order else len(order), "weights")
    original = layer_settings(self)
    self.settings = _bias_add_settings(self)
    try:
        quantize_mac(self, per_channel=False)
    finally:
        self.settings = original


# ================================================================================================ Gemm
GEMM = declare_op(
    "Gemm",
    params={"alpha": Param(Float(), "factor of the product A' @ B'", default=1.0),
            "beta": Param(Float(), "factor of C", default=1.0),
            "trans_a": Param(Bool(), "A' = A^T", default=False),
            "trans_b": Param(Bool(), "B' = B^T", default=False),
            **FUSED_ACTIVATION_PARAMS},
    constants={"scale": "written by some upstream versions; not read",
               "shift": "written by some upstream versions; not read"},
    integer="(A+zp)·(B+zp) exact + C aligned by M_c/2^N_c, then M/2^N requant",
    dtypes="float32 → int8/uint8 or int16/uint16; all-integer inputs → integer output (8/16/32 bits)",
    semantics=_SEM + "#gemm",
    summary="Inputs A, B and an optional C.")


def _gemm_operand(node: PyNode, t: torch.Tensor, key: str) -> torch.Tensor:
    if not bool_param(node, key, False):
        return t
    if t.dim() < 2:
        raise node._error(f"{key}=true needs an operand of rank >= 2, got shape {list(t.shape)}")
    return t.transpose(-1, -2)


def _gemm_inputs(node: PyNode) -> None:
    if len(node.inputs) not in (2, 3):
        raise node._error(f"Gemm needs 2 or 3 inputs (A, B and optionally C), got {len(node.inputs)}")


def _matmul(node: PyNode, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        return torch.matmul(a, b)
    except RuntimeError as e:
        raise node._error(f"operand shapes {list(a.shape)} and {list(b.shape)} (after trans_a/trans_b) cannot be "
                          f"multiplied: {e}") from None


def _broadcast_add(node: PyNode, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    try:
        shape = broadcast_shape([y.shape, c.shape])
    except ValueError:
        shape = None
    if shape != y.shape:
        raise node._error(f"C of shape {list(c.shape)} does not broadcast to the product's shape {list(y.shape)}")
    return y + c


@GEMM.forward
def gemm_forward(self: PyNode) -> None:
    """y = alpha * A' @ B' + beta * C (A' = A^T if trans_a, B' = B^T if trans_b, C optional and broadcast)."""
    _gemm_inputs(self)
    if self.quantized:
        self.outputs[0].betensor = _gemm_int(self)
        return
    ts = [t.betensor for t in self.inputs]
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, _compute_dtype(t))
    a = _gemm_operand(self, ts[0].to(dtype), "trans_a")
    b = _gemm_operand(self, ts[1].to(dtype), "trans_b")
    y = _float_param(self, "alpha", 1.0) * _matmul(self, a, b)
    if len(ts) == 3:
        y = _broadcast_add(self, y, _float_param(self, "beta", 1.0) * ts[2].to(dtype))
    self.outputs[0].betensor = apply_fused_activation(self, y)


def _gemm_requant(node: PyNode) -> Tuple[int, int, int, int]:
    """(M, N, M_c, N_c) from scale_value/shift_value: scalars for two inputs, [M, M_c] / [N, N_c] for three."""
    sv, hv = node.get_param("scale_value"), node.get_param("shift_value")
    if len(node.inputs) == 3:
        if not (isinstance(sv, (list, tuple)) and isinstance(hv, (list, tuple)) and len(sv) == 2 and len(hv) == 2):
            raise node._error("a quantized Gemm with C stores scale_value=[M, M_c] and shift_value=[N, N_c], got "
                              f"{sv!r} / {hv!r}")
        return int(sv[0]), int(hv[0]), int(sv[1]), int(hv[1])
    if isinstance(sv, (list, tuple)) or isinstance(hv, (list, tuple)):
        raise node._error(f"a quantized two-input Gemm stores one scale_value/shift_value, got {sv!r} / {hv!r}")
    return int(sv), int(hv), 0, 0


def _gemm_bounds(node: PyNode, k: int, mc: int, nc: int) -> Tuple[int, int]:
    """(bound on |(A+zp)' @ (B+zp)'| over K = `k` products, bound on the rounded |C'| added to it; 0 without C)
    from the stored ranges."""
    ta, tb = node.inputs[0], node.inputs[1]
    bound = k * offset_absmax(node, ta) * offset_absmax(node, tb)
    if len(node.inputs) < 3:
        return bound, 0
    return bound, ((offset_absmax(node, node.inputs[2]) * abs(mc)) << max(0, -nc) >> max(0, nc)) + 1


def _gemm_int(node: PyNode) -> torch.Tensor:
    """acc = sgn(alpha) * (A+zp_A)' @ (B+zp_B)' exactly; c = sgn(beta) * round_half_even((C+zp_C) * M_c / 2^N_c);
    y = clamp(round_half_even((acc + c) * M / 2^N) - zp_out, qmin, qmax), then the fused bounds. The worst case of
    |acc + c| from the stored ranges must stay below 2^62 (checked)."""
    ta, tb = node.inputs[0], node.inputs[1]
    m, n, mc, nc = _gemm_requant(node)
    alpha = _float_param(node, "alpha", 1.0)
    a = _gemm_operand(node, int_value(ta) + tensor_zp(node, ta), "trans_a")
    b = _gemm_operand(node, int_value(tb) + tensor_zp(node, tb), "trans_b")
    k = int(a.shape[-1]) if a.dim() else 1
    bound, c_bound = _gemm_bounds(node, k, mc, nc)
    if bound + c_bound >= INT64_ACCUMULATOR_LIMIT:
        raise UnsupportedError(f"layer '{node.name}' (Gemm): accumulator bound {bound + c_bound} exceeds 2^62")
    if bound < FLOAT64_EXACT:
        acc = torch.round(_matmul(node, a.to(torch.float64), b.to(torch.float64))).to(torch.int64)
    else:
        acc = _matmul(node, a.cpu(), b.cpu()).to(a.device)
    if alpha < 0:
        acc = -acc
    if len(node.inputs) == 3:
        tc = node.inputs[2]
        cb = round_shift((int_value(tc) + tensor_zp(node, tc)) * mc, nc)
        if _float_param(node, "beta", 1.0) < 0:
            cb = -cb
        acc = _broadcast_add(node, acc, cb)
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    y = torch.clamp(_requantize(node, acc, m, n) - tensor_zp(node, out), qmin, qmax)
    return fused_activation_clamp(node, y)


@GEMM.export
def convert_gemm(g: QDQGraph, node: PyNode) -> None:
    """A Gemm of activations. "exact" mode: (A+zp)' @ (B+zp)' in float64 (trans_a/trans_b as input layouts), its
    sign from alpha, C + zp times M_c · 2^-N_c rounded (sign from beta) and added, then M · 2^-N, Round and the
    fused bounds: exact while (K·max|A|·max|B| + the rounded C's bound) · M stays below 2^53. Otherwise the float
    alpha · A' @ B' + beta · C between DequantizeLinear and QuantizeLinear, scaled by the multiplier's rounding."""
    _gemm_inputs(node)
    ta, tb = node.inputs[0], node.inputs[1]
    tc = node.inputs[2] if len(node.inputs) == 3 else None
    perms = []
    for t, key in ((ta, "trans_a"), (tb, "trans_b")):
        if bool_param(node, key, False) and g.rank(t) < 2:
            raise node_error(node, f"{key}=true needs an operand of rank >= 2")
        perms.append(operand_perm(g.rank(t), bool_param(node, key, False)))
    m, n, mc, nc = _gemm_requant(node)
    alpha, beta = _float_param(node, "alpha", 1.0), _float_param(node, "beta", 1.0)
    bound = sum(_gemm_bounds(node, int(ta.ir_shape[perms[0][-1]]) if ta.ir_shape else 1, mc, nc))
    if g.unit_domain and node.params.get("remain_shift") is None and onnx_exact.fits_double(bound * abs(m)) \
            and (tc is None or onnx_exact.fits_double(offset_absmax(node, tc) * abs(mc))):
        acc = g.add("MatMul", [onnx_exact.codes(g, ta, perms[0]), onnx_exact.codes(g, tb, perms[1])])
        if alpha < 0:
            acc = g.add("Neg", [acc])
        if tc is not None:
            c = g.add("Round", [g.add("Mul", [onnx_exact.codes(g, tc), onnx_exact.double(g, node, "c_multiplier",
                                                                                     mc * 2.0 ** -nc)])])
            acc = g.add("Sub" if beta < 0 else "Add", [acc, c])
        onnx_exact.requantize(g, node, acc, m * 2.0 ** -n, None, fused_activation_bounds(node))
        return
    product = g.add("MatMul", [g.float_value(ta, perms[0]), g.float_value(tb, perms[1])])
    out = g.add("Mul", [product, g.const(f"{node.name}/alpha", np.array(alpha, dtype=np.float32))])
    if tc is not None:
        out = g.add("Add", [out, g.add("Mul", [g.float_value(tc), g.const(f"{node.name}/beta",
                                                                         np.array(beta, dtype=np.float32))])])
    y = node.outputs[0]
    factor = m * 2.0 ** -n * tensor_scale(node, ta) * tensor_scale(node, tb) / (abs(alpha) * tensor_scale(node, y))
    g.quantize(y, qdq_fused_activation(g, node, g.rescale(out, factor)))


@GEMM.quantize
def gemm_quantize(self: PyNode) -> None:
    """Output params from the calibrated range, signed iff an input is signed, alpha < 0 or beta < 0 (with C), unless
    a RELU-like fused activation makes it non-negative; all-integer inputs give an integer output.
    (M, N) = scale_shift(|alpha| * s_out / (s_A * s_B), multiplier bits); with C, (M_c, N_c) = scale_shift(|beta| *
    s_A * s_B / (|alpha| * s_C), 15 bits) aligns C to the accumulator's scale (M_c = N_c = 0 when beta = 0)."""
    _gemm_inputs(self)
    check_fused_activation_quantizable(self)
    check_quantized_inputs(self, self.inputs)
    alpha = _float_param(self, "alpha", 1.0)
    beta = _float_param(self, "beta", 1.0)
    if alpha == 0.0:
        raise UnsupportedError(f"layer '{self.name}' (Gemm): quantizing alpha=0 (a scaled copy of C) is not "
                               "supported; replace the layer by a multiplication of C")
    ta, tb = self.inputs[0], self.inputs[1]
    tc = self.inputs[2] if len(self.inputs) == 3 else None
    signed = is_signed(self, ta) or is_signed(self, tb) or alpha < 0
    if tc is not None:
        signed = signed or is_signed(self, tc) or beta < 0
    signed = signed and fused_output_signed(self)
    s = layer_settings(self)
    out = self.outputs[0]
    if all(params(self, t).qinvariant for t in self.inputs):
        signed = signed or s.force_dtype_int
        set_qinvariant(self, out, integer_output_bits(self, signed), signed)
    else:
        quantize_activation(self, out, signed)
    f32 = torch.float32
    s_a, s_b, s_out = (torch.tensor(tensor_scale(self, t), dtype=f32) for t in (ta, tb, out))
    ratio = torch.tensor(abs(alpha), dtype=f32) * s_out / (s_a * s_b)
    m, n, m_dtype, n_dtype = requant_scale_shift(self, ratio)
    if tc is None:
        store_requant(self, m, n, m_dtype, n_dtype)
        return
    if beta == 0.0:
        mc, nc = 0, 0
    else:
        ratio_c = torch.tensor(abs(beta), dtype=f32) * s_a * s_b / (torch.tensor(abs(alpha), dtype=f32) *
                                                                     torch.tensor(tensor_scale(self, tc), dtype=f32))
        mc, nc, _, _ = scale_shift(ratio_c, AIFF_MULTIPLIER_BITS)
        if int(nc) < -AIFF_SHIFT_MAX:
            raise UnsupportedError(f"layer '{self.name}' (Gemm): C's scale differs from the product's by a factor "
                                   f"beyond the shift range (shift {nc})")
    self.params["scale_value"] = [int(m), int(mc)]
    self.params["shift_value"] = [int(n), int(nc)]
    self.params["scale_type"] = [m_dtype, Dtype.UINT16]
    self.params["shift_type"] = [n_dtype, Dtype.INT8]


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@CONV_TRANSPOSE.export
@CONV_TRANSPOSE3D.export
def convert_conv_transpose(g: QDQGraph, node: PyNode) -> None:
    """ONNX ConvTranspose (2-D, or 3-D for ConvTranspose3D) channels-first (pads, output_padding, strides,
    dilations, group).

    "exact": on the integers (input plus zero point, weights plus zero point as float32 integers, the bias without
    the input zero point), exact in float32 while every sum stays below 2^24, then the multiplier in float64 and
    Round; sums beyond that in float64 (`_conv_transpose_double`). Otherwise weights behind a
    per-output-channel DequantizeLinear (group 1 only: ONNX's axis 1 is the output channel within a group)."""
    x, y = node.inputs[0], node.outputs[0]
    three_d = str(node.type) == "ConvTranspose3D"
    rank = 5 if three_d else 4
    if g.rank(x) != rank:
        raise node_error(node, f"only {rank}-D channels-last inputs are exported, got rank {g.rank(x)}")
    cf = channels_first(rank)
    group = int_or(node, "group", 1)
    w_oc = _oc_effective_weights(node, group).cpu()                # [out_c, k..., in_c/g], w + zp_w
    torch_w = _oc_to_torch(w_oc, group).numpy()                   # [in_c, out_c/g, k...] (kernel in torch order)
    out_c = int(w_oc.shape[0])
    sums = w_oc.reshape(out_c, -1).sum(dim=1).numpy()
    qx = params(node, x)
    zp_in = int(round(float(qx.zerop if not isinstance(qx.zerop, torch.Tensor) else qx.zerop.reshape(-1)[0])))
    bias = node.get_constant("biases").betensor.cpu().to(torch.int64).reshape(-1).numpy() - zp_in * sums
    axes = "zyx" if three_d else "yx"
    begin_keys = [f"pad_{a}_begin" for a in axes] if three_d else ["pad_top", "pad_left"]
    end_keys = [f"pad_{a}_end" for a in axes] if three_d else ["pad_bottom", "pad_right"]
    attrs = dict(kernel_shape=[int(v) for v in torch_w.shape[2:]],
                 strides=[int_or(node, f"stride_{a}", 1) for a in axes],
                 dilations=[int_or(node, f"dilation_{a}", 1) for a in axes],
                 pads=[int_or(node, k, 0) for k in begin_keys + end_keys],
                 output_padding=[int_or(node, f"output_padding_{a}", 0) for a in axes], group=group)
    lo, hi = qx.qmin + zp_in, qx.qmax + zp_in
    bound = max(abs(lo), abs(hi)) * int(np.abs(w_oc.reshape(out_c, -1).numpy()).sum(axis=1).max()) \
        + int(np.abs(bias).max(initial=0))
    ratio = onnx_exact.exact_ratio(node) if g.unit_domain and node.params.get("remain_shift") is None else None
    if ratio is not None and FLOAT32_EXACT <= bound < FLOAT64_EXACT:  # wide: the same sums in float64
        _conv_transpose_double(g, node, w_oc.numpy(), bias, group, ratio, attrs)
        return
    if ratio is not None and bound < FLOAT32_EXACT:
        acc = g.add("ConvTranspose", [g.float_value(x, cf, unit=True), g.const(f"{node.name}/weights",
                                                                               torch_w.astype(np.float32)),
                                      g.const(f"{node.name}/bias", bias.astype(np.float32))], **attrs)
        onnx_exact.requantize(g, node, g.add("Cast", [acc], to=onnx_exact.DOUBLE), ratio, cf,
                              fused_activation_bounds(node),
                              channel_shape=(-1,) + (1,) * (rank - 2) if ratio.size > 1 else None)
        return
    if group != 1:
        raise node_error(node, "grouped ConvTranspose is exported in the exact mode only (within float32 sums)")
    scale = weight_onnx_scale(g, node, x, y)
    w_q = _oc_to_torch(_ir_weights(node), 1).cpu().numpy()
    weights = dq_constant(g, f"{node.name}/weights", w_q,
                          np.round(param_vector(node, "weights_zp", 0.0)).astype(np.int64),
                          scale, axis=1 if scale.size > 1 else 0, dtypes=weight_dtypes(g))
    x_scale = np.float32(g.qparams(x).scale)
    b = g.const(f"{node.name}/bias", (bias.astype(np.float64) * (x_scale * scale.astype(np.float64))).astype(
        np.float32))
    out = g.add("ConvTranspose", [g.float_value(x, cf), weights, b], **attrs)
    g.quantize(y, qdq_fused_activation(g, node, out), cf)


def _ir_weights(node: PyNode) -> torch.Tensor:
    return node.get_constant("weights").betensor.to(torch.int64)


def _conv_transpose_double(g: QDQGraph, node: PyNode, w_oc: np.ndarray, bias: np.ndarray, group: int,
                           ratio: np.ndarray, attrs: dict) -> None:
    """ConvTranspose in float64 as docs/semantics/mac.md states it: the integers plus zero point spread `stride` apart
    (0 between them, the integer of float 0), padded by (k - 1)·d - pad_begin and (k - 1)·d + output_padding - pad_end,
    then a stride-1 convolution with the kernel flipped (`window_sums`), the bias and the multiplier; along every
    spatial axis (2-D, or 3-D for ConvTranspose3D)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(v) for v in x.ir_shape]
    rank = len(shape)
    nd = rank - 2
    codes = onnx_exact.codes(g, x)
    for axis in range(1, rank - 1):
        i = axis - 1
        k = int(attrs["kernel_shape"][i])
        s, d = int(attrs["strides"][i]), int(attrs["dilations"][i])
        begin, end = int(attrs["pads"][i]), int(attrs["pads"][nd + i])
        extra = int(attrs["output_padding"][i])
        n = shape[axis]
        if s > 1 and n > 1:  # n, 1 → n, s → n·s, then the trailing s - 1 zeros dropped
            spread = g.add("Unsqueeze", [codes, g.ints(f"{node.name}/spread_axis", [axis + 1])])
            pads = [0] * (2 * (rank + 1))
            pads[rank + 1 + axis + 1] = s - 1
            spread = g.add("Pad", [spread, g.ints(f"{node.name}/spread_pads", pads)])
            merged = shape[:axis] + [n * s] + shape[axis + 1:]
            target = ([0] if g.dynamic_batch else [merged[0]]) + merged[1:]
            codes = g.add("Reshape", [spread, g.ints(f"{node.name}/spread_shape", target)])
            shape[axis] = (n - 1) * s + 1
            codes = g.add("Slice", [codes, g.ints(f"{node.name}/spread_start", [0]),
                                    g.ints(f"{node.name}/spread_end", [shape[axis]]),
                                    g.ints(f"{node.name}/spread_axes", [axis])])
        before, after = (k - 1) * d - begin, (k - 1) * d + extra - end
        if before < 0 or after < 0:
            start, stop = max(0, -before), shape[axis] - max(0, -after)
            codes = g.add("Slice", [codes, g.ints(f"{node.name}/crop_start", [start]),
                                    g.ints(f"{node.name}/crop_end", [stop]), g.ints(f"{node.name}/crop_axes", [axis])])
            shape[axis] = stop - start
        if before > 0 or after > 0:
            pads = [0] * (2 * rank)
            pads[axis], pads[rank + axis] = max(0, before), max(0, after)
            codes = g.add("Pad", [codes, g.ints(f"{node.name}/pads", pads)])
            shape[axis] += max(0, before) + max(0, after)
    if nd == 3:  # the IR kernel (h, w, d) in the data's (d, h, w) order
        w_oc = w_oc.transpose(0, 3, 1, 2, 4)
    flipped = np.ascontiguousarray(w_oc[(slice(None),) + (slice(None, None, -1),) * nd])
    out_sizes = [int(v) for v in y.ir_shape[1:rank - 1]]
    total = window_sums(g, node, codes, flipped, int(x.ir_shape[-1]), group, out_sizes, (1,) * nd,
                        [int(v) for v in attrs["dilations"]])
    total = g.add("Add", [total, g.const(f"{node.name}/bias", bias.astype(np.float64))])
    onnx_exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
