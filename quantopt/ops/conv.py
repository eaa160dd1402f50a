"""Convolution and DepthwiseConv (float forward).

Activations are NHWC, weights OHWI `[out_c, kh, kw, in_c/group]`, biases `[out_c]` (absent means zero). Pads may be
asymmetric, so they are applied explicitly before a padding-free torch convolution.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..graph.memo import Same, memo
from ..graph.node import PyNode
from ..quant.rounding import MAGIC_EXACT, int_to_float64
from ..registry import declare_op
from ..registry.schema import Bool, Int, Param
from ..threads import one_thread
from . import _fp8
from ._conv_nhwc import conv2d_nhwc as _conv2d_kernel
from ._conv_nhwc import conv2d_nhwc_int8, depthwise_taps
from ._int8_gemm import INT8_MAX_TERMS, int8_accumulate, int8_gemm_used, split_int8
from ._quant import (
    layer_settings,
    mac_bound,
    mac_finish,
    mac_input,
    mac_weights,
    mac_weights_int8,
    out_range,
    quantize_mac,
)
from ._shared import (
    FUSED_ACTIVATION_CONSTANTS,
    FUSED_ACTIVATION_PARAMS,
    MAC_QUANTIZED_PARAMS,
    ROUNDING_FUSED_ACTIVATIONS,
    apply_fused_activation,
    float_biases,
    int_param,
    keep_unrounded,
    unrounded_input,
)
from .onnx_build.mac import (
    bias_value,
    conv_double,
    integer_kernel,
    mac_weight_value,
    qlinear_fusable,
    quantize_mac_output,
    weight_onnx_scale,
)
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import QDQGraph, int_or, node_error

MAC_FLOAT_DTYPE = torch.float64
"""Accumulation type of the float forward of MAC layers (results are rounded back to the input's float type)."""


# ------------------------------------------------------------------------------------------ Convolution, DepthwiseConv
_INTEGER = "int32/int48 MAC accumulation + per-tensor/per-channel multiplier and shift"
_SEMANTICS = "integer-semantics.md#convolution-depthwiseconv-fullyconnected"


def _conv_params(depthwise: bool) -> Dict[str, Param]:
    """The layer keys Convolution and DepthwiseConv share."""
    return {
        "kernel_x": Param(Int(lo=1), "kernel width; must match the weights (taken from them when absent)"),
        "kernel_y": Param(Int(lo=1), "kernel height; must match the weights (taken from them when absent)"),
        "stride_x": Param(Int(lo=1), "horizontal stride", default=1),
        "stride_y": Param(Int(lo=1), "vertical stride", default=1),
        "pad_left": Param(Int(lo=0), "zero padding before the width axis", default=0),
        "pad_right": Param(Int(lo=0), "zero padding after the width axis", default=0),
        "pad_top": Param(Int(lo=0), "zero padding before the height axis", default=0),
        "pad_bottom": Param(Int(lo=0), "zero padding after the height axis", default=0),
        "dilation_x": Param(Int(lo=1), "horizontal dilation", default=1),
        "dilation_y": Param(Int(lo=1), "vertical dilation", default=1),
        "group": (Param(Int(lo=1), "channel groups, the input channels", default="in_c") if depthwise else
                  Param(Int(lo=1), "channel groups: in_c = weights[3] * group, out_c % group == 0", default=1)),
        "num_output": Param(Int(lo=1), "output channels; must match the weights"),
        "multiplier": (Param(Int(lo=1), "outputs per input channel: multiplier * in_c = out_c") if depthwise else
                       Param(Int(lo=0), "written by some Parser versions; not read")),
        **FUSED_ACTIVATION_PARAMS,
        **MAC_QUANTIZED_PARAMS,
    }


_CONV_CONSTANTS = {"weights": "[O,kh,kw,I/g]", "biases": "[O], absent means zero", **FUSED_ACTIVATION_CONSTANTS,
                   "scale": "per-channel requantization multipliers (quantized)",
                   "shift": "per-channel requantization shifts (quantized)"}

CONVOLUTION = declare_op(
    "Convolution",
    params={**_conv_params(depthwise=False),
            "with_winograd": Param(Bool(), "upstream's Winograd switch; not read")},
    constants={**_CONV_CONSTANTS, "WinogradWeights": "upstream's Winograd-transformed weights; not read"},
    integer=_INTEGER, semantics=_SEMANTICS)

DEPTHWISE_CONV = declare_op(
    "DepthwiseConv",
    params=_conv_params(depthwise=True),
    constants={**_CONV_CONSTANTS, "weights": "[in_c*multiplier,kh,kw,1]"},
    integer=_INTEGER, semantics=_SEMANTICS,
    summary="The Parser writes DepthwiseConv as a grouped conv with group = in_c.")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def _geometry(node: PyNode) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int, int, int]]:
    """(stride_yx, dilation_yx, pads as F.pad wants them: left, right, top, bottom)."""
    stride = (int_param(node, "stride_y", 1), int_param(node, "stride_x", 1))
    dilation = (int_param(node, "dilation_y", 1), int_param(node, "dilation_x", 1))
    pads = tuple(int_param(node, k, 0, minimum=0) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom"))
    return stride, dilation, pads  # type: ignore[return-value]


GEOMETRY_KEYS = ("stride_y", "stride_x", "dilation_y", "dilation_x", "pad_left", "pad_right", "pad_top", "pad_bottom",
                 "kernel_y", "kernel_x", "num_output", "group", "multiplier")


def _checked_geometry(node: PyNode, w: torch.Tensor, in_c: int, depthwise: bool) -> Tuple[int, Any, Any, Any]:
    """(group, stride, dilation, pads), validated once per layer and remembered while the weights' shape, the input
    channels and the geometry params stay the same (the per-forward checks cost more than a small convolution)."""
    key = (tuple(w.shape), in_c, depthwise, tuple(node.params.get(k) for k in GEOMETRY_KEYS))
    cached = node.attrs.get("_conv_geometry")
    if cached is not None and cached[0] == key:
        return cached[1]
    value = (_check_weights(node, w, in_c, depthwise), *_geometry(node))
    node.attrs["_conv_geometry"] = (key, value)
    return value


def _check_weights(node: PyNode, w: torch.Tensor, in_c: int, depthwise: bool) -> int:
    """Validate OHWI weights against the input and the IR params; returns the group count."""
    if w.dim() != 4:
        raise node._error(f"weights must be 4-D OHWI [out_c, kh, kw, in_c/group], got shape {list(w.shape)}")
    out_c, kh, kw, cin_g = (int(s) for s in w.shape)
    for key, size in (("kernel_y", kh), ("kernel_x", kw), ("num_output", out_c)):
        value = int_param(node, key, None)
        if value is not None and value != size:
            raise node._error(f"parameter {key}={value} does not match weights shape {list(w.shape)}")
    group = int_param(node, "group", in_c if depthwise else 1)
    if cin_g * group != in_c or out_c % group != 0:
        raise node._error(f"group={group} with weights {list(w.shape)} does not fit {in_c} input channels "
                          f"(needs in_c == weights[3] * group and out_c % group == 0)")
    if depthwise:
        if cin_g != 1:
            raise node._error(f"DepthwiseConv weights must be [out_c, kh, kw, 1] with group = in_c, "
                              f"got {list(w.shape)} with group={group}")
        multiplier = int_param(node, "multiplier", None)
        if multiplier is not None and multiplier * in_c != out_c:
            raise node._error(f"multiplier={multiplier} does not match {out_c} outputs for {in_c} input channels")
    return group


def conv2d_nhwc(node: PyNode, depthwise: bool) -> torch.Tensor:
    """Float NHWC convolution of the node's input with its constants, before the fused activation, in float64.

    Accumulated in float64 (docs/architecture.md, "Float reference"): the result no longer depends on the kernel
    library's float32 summation order, so calibrated ranges are the same on every machine. Reads its input
    unrounded where the producer kept it (`unrounded_input`)."""
    x = unrounded_input(node)
    w, bias, taps = _float_constants(node, x.device, depthwise)
    return _conv_nhwc(node, x, w, bias, depthwise, 0.0, MAC_FLOAT_DTYPE, taps)


def _memo_constants(node: PyNode, name: str, extra: Tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """build()'s conversion of the layer's weights and biases, memoized per layer while those tensors are the same
    objects at the same version (graph/memo.py; `extra`: the rest of the key): converting them on every forward
    costs more than a small convolution, and the values are those the conversions give, so no result changes."""
    wt = node.get_constant("weights").betensor
    bt = node.get_constant("biases", optional=True)
    if torch.is_grad_enabled() and (wt.requires_grad or (bt is not None and bt.betensor.requires_grad)):
        return build()  # a gradient-based method's tensors: a kept conversion would outlive its autograd graph
    return memo(node, name, (Same(wt), None if bt is None else Same(bt.betensor), *extra), build)


def _float_constants(node: PyNode, device: torch.device, depthwise: bool) -> Tuple[torch.Tensor, Any, Any]:
    """(weights as MAC_FLOAT_DTYPE, biases likewise or None, a depthwise layer's per-tap weight vectors or None),
    memoized (`_memo_constants`)."""
    def build() -> Tuple[torch.Tensor, Any, Any]:
        w = node.get_constant("weights").betensor.to(device=device, dtype=MAC_FLOAT_DTYPE)
        return w, float_biases(node, int(w.shape[0]), w), depthwise_taps(w) if depthwise and w.dim() == 4 else None

    return _memo_constants(node, "conv_float_constants", (str(device), depthwise), build)


def _conv_float_forward(node: PyNode, depthwise: bool) -> None:
    """Rounded once to the input's float type, with the float64 result kept for the layers that read it unrounded,
    as upstream's float forward does: a fused RELU6, CLIP, LEAKYRELU or PRELU works on the float64 sums and keeps
    its float64 result too; a fused RELU rounds (docs/architecture.md, "Float reference"). With `float_reference =
    native`, torch's own convolution in the input's float type instead (`native_conv2d_nhwc`)."""
    if layer_settings(node).float_reference == "native":
        node.outputs[0].betensor = apply_fused_activation(node, native_conv2d_nhwc(node, depthwise))
        return
    y = conv2d_nhwc(node, depthwise)
    dtype = _compute_dtype(node.inputs[0].betensor)
    act = str(node.get_param("with_activation", optional=True, default_value="NONE")).upper()
    if act in ROUNDING_FUSED_ACTIVATIONS:
        node.outputs[0].betensor = apply_fused_activation(node, y.to(dtype))
    else:
        keep_unrounded(node, apply_fused_activation(node, y), dtype)


def native_conv2d_nhwc(node: PyNode, depthwise: bool) -> torch.Tensor:
    """`float_reference = native`: the convolution as torch computes it in the input's float type (oneDNN's kernels
    on the CPU, cuDNN's on CUDA), on the NHWC input viewed as channels-last NCHW (no copy), the bias added by the
    kernel. About onnxruntime's speed; the sums follow the kernel library, so a result may differ from upstream's
    float64 sum in its last float32 bits (docs/performance.md, "Native float reference"). It runs on one thread
    and one IR batch at a time (graph/batch.py), so those bits do not depend on the thread count or batch size."""
    x = node.inputs[0].betensor
    x = x.to(_compute_dtype(x))
    group, stride, dilation, pads = _checked_call(node, x, node.get_constant("weights").betensor, depthwise)
    w, bias = _native_constants(node, x)
    left, right, top, bottom = pads
    xn = x.permute(0, 3, 1, 2)
    if left == right and top == bottom:
        padding = (top, left)
    else:  # asymmetric pads: applied before a padding-free convolution
        xn, padding = F.pad(xn, (left, right, top, bottom)), (0, 0)
    with one_thread():  # oneDNN splits some convolutions' sums by the thread count: one thread, the same bits
        y = F.conv2d(xn, w, bias, stride, padding, dilation, group)
    return y.permute(0, 2, 3, 1).contiguous()


def _native_constants(node: PyNode, x: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """(weights [out_c, in_c/group, kh, kw] in x's dtype and device, biases likewise or None) for
    `native_conv2d_nhwc`, memoized (`_memo_constants`)."""
    def build() -> Tuple[torch.Tensor, Any]:
        w = node.get_constant("weights").betensor.to(device=x.device, dtype=x.dtype)
        return w.permute(0, 3, 1, 2).contiguous(), float_biases(node, int(w.shape[0]), w)

    return _memo_constants(node, "conv_native_constants", (str(x.device), x.dtype), build)


def conv2d_nhwc_int(node: PyNode, depthwise: bool) -> torch.Tensor:
    """Exact integer accumulator conv(x_q padded with -zp_in, w_q + zp_w) as float64, bias not added: an int8
    GEMM where the operands fit int8 (`_conv_int8`), a depthwise one by oneDNN in float32 where its bound allows
    (`_conv_int_onednn`), else exact integers in float32 or float64 by this package's NHWC kernels."""
    return conv2d_nhwc_int_bounded(node, depthwise)[0]


def conv2d_nhwc_int_bounded(node: PyNode, depthwise: bool) -> Tuple[torch.Tensor, Optional[int]]:
    """(`conv2d_nhwc_int`'s accumulator, a bound on its magnitude: from the values the int8 GEMMs read, else from
    the input's stored range and the weights, `mac_bound`): `mac_finish` then skips its own look at the
    accumulator's extrema."""
    x, zp = mac_input(node)
    w, dtype = mac_weights(node)
    # oneDNN takes a grouped convolution in one call, where the int8 GEMMs take one call per group
    grouped = not depthwise and int_param(node, "group", 1) >= ONEDNN_MIN_GROUPS
    onednn = dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.is_available()
    if not depthwise and not (grouped and onednn):
        bounded = _conv_int8(node, x, zp)
        if bounded is not None:
            return bounded
    if onednn and (depthwise or grouped or math.prod(int(d) for d in x.shape[:3]) * w.numel() >= ONEDNN_MIN_MACS):
        return _conv_int_onednn(node, x, w, zp, depthwise), mac_bound(node)
    if x.dtype == torch.int64 and max(abs(v) for v in out_range(node, node.inputs[0])) < MAGIC_EXACT:
        x = int_to_float64(x)  # the fast exact conversion; the kernel then narrows it while padding
    acc = _conv_nhwc(node, x, w, None, depthwise, float(-zp), dtype)
    return acc.to(torch.float64), mac_bound(node)


ONEDNN_MIN_GROUPS = 4
"""Least groups of a grouped (not depthwise) convolution whose integer accumulator `_conv_int_onednn` computes
where its bound allows, instead of the int8 GEMMs, which take one call per group (about 40 µs each on small maps:
RegNet's 55 groups of 8 channels cost 2.2 ms against 0.24 ms for the float forward)."""

ONEDNN_MIN_MACS = 1 << 23
"""Least multiply-adds (input positions x weights) of a convolution whose integer accumulator `_conv_int_onednn`
computes (a depthwise one always): below it oneDNN's set-up per call (0.1-0.15 ms on the AVX2 machine,
docs/performance.md) costs more than this package's GEMM kernels; above it oneDNN was up to 2x faster (3x3
convolutions of PP-OCR det) and about as fast on 1x1 ones."""


def _conv_int_onednn(node: PyNode, x: torch.Tensor, w: torch.Tensor, zp: int, depthwise: bool) -> torch.Tensor:
    """The integer accumulator of a convolution (depthwise, grouped or not) whose bound put it in float32
    (`mac_weights`: every partial sum an integer below 2^24, so exact in any summation order), by oneDNN's direct
    float32 convolution on the channels-last view, as float64: several times the speed of this package's kernels
    (the per-tap depthwise kernel, the unfolded GEMMs), which the integer forward needs where the int8 GEMM is not
    used. The input is padded with -zp first, as those kernels pad it."""
    group, stride, dilation, pads = _checked_call(node, x, w, depthwise)
    left, right, top, bottom = pads
    xn = F.pad(x.to(torch.float32).permute(0, 3, 1, 2), (left, right, top, bottom), value=float(-zp))
    key = (Same(w), str(w.device))
    wn = memo(node, "conv_int_onednn", key, lambda: w.permute(0, 3, 1, 2).contiguous())
    y = torch.ops.aten.mkldnn_convolution(xn, wn, None, [0, 0], list(stride), list(dilation), group)
    return y.permute(0, 2, 3, 1).to(torch.float64)


def _conv_int8(node: PyNode, x: torch.Tensor, zp: int) -> Optional[Tuple[torch.Tensor, int]]:
    """The integer accumulator of a convolution (one group or several) on the CPU as int8 GEMMs with int32 sums
    (`_conv_nhwc.conv2d_nhwc_int8`), as float64, and a bound on its magnitude (max |x or padding| · max sum |w|
    over the output channels); None where it does not apply: on another device, a CPU whose int8 GEMM is not
    exact or not faster (`_int8_gemm.int8_gemm_used`), weights outside int8, inputs (padding included) beyond 16
    bits, or a reduction long enough to leave int32. Inputs are split into int8 parts (`_int8_gemm.split_int8`:
    one for 8-bit values, two for 16-bit ones), and the offset they were taken with comes back as offset · (the
    weights' sum) per channel, so the result is the same integer."""
    if x.device.type != "cpu" or x.dim() != 4 or not int8_gemm_used():
        return None
    w_q = node.get_constant("weights").betensor
    group, stride, dilation, pads = _checked_call(node, x, w_q, False)
    if int(w_q[0].numel()) > INT8_MAX_TERMS:
        return None
    weights = mac_weights_int8(node)
    operand = split_int8(x, -zp if any(pads) else 0) if weights is not None else None
    if weights is None or operand is None:
        return None
    w8, w_sums, w_abs_rows = weights
    acc = int8_accumulate(operand, w_sums,
                          lambda part, pad: conv2d_nhwc_int8(part, w8, stride, dilation, pads, pad, group))
    return acc, operand.absmax * w_abs_rows


def _check_output_size(node: PyNode, out_hw: List[int]) -> None:
    """The output height and width the params give must be the IR's (layer_top_shape): a wrong pad or stride is an
    IR error here, not a wrong-sized result or an allocation of hundreds of gigabytes."""
    ir_shape = node.outputs[0].ir_shape if node.outputs else None
    if ir_shape is None or len(ir_shape) != 4:
        return
    expected = [int(ir_shape[1]), int(ir_shape[2])]
    if out_hw != expected:
        raise node._error(f"kernel, stride, dilation and pads give an output of {out_hw} (HW) but layer_top_shape "
                          f"says {expected}")


def _checked_call(node: PyNode, x: torch.Tensor, w: torch.Tensor, depthwise: bool) -> Tuple[int, Any, Any, Any]:
    """(group, stride, dilation, pads) of a convolution of NHWC `x` with OHWI `w`, every shape checked against the
    params and the IR's output shape."""
    if x.dim() != 4:
        raise node._error(f"input must be 4-D NHWC, got shape {list(x.shape)}")
    group, stride, dilation, pads = _checked_geometry(node, w, int(x.shape[3]), depthwise)
    kh, kw = int(w.shape[1]), int(w.shape[2])
    need = ((kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1)
    padded = (int(x.shape[1]) + pads[2] + pads[3], int(x.shape[2]) + pads[0] + pads[1])
    if padded[0] < need[0] or padded[1] < need[1]:
        raise node._error(f"padded input {list(padded)} (HW) is smaller than the dilated kernel {list(need)}")
    _check_output_size(node, [(p - n) // s + 1 for p, n, s in zip(padded, need, stride)])
    return group, stride, dilation, pads


def _conv_nhwc(node: PyNode, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, depthwise: bool,
               pad_value: float, dtype: torch.dtype, taps: Any = None) -> torch.Tensor:
    """Checked convolution of NHWC `x` computed in `dtype` (the input is converted while it is padded)."""
    group, stride, dilation, pads = _checked_call(node, x, w, depthwise)
    return _conv2d_kernel(x, w, bias, stride, dilation, pads, group, pad_value, dtype, taps)


@CONVOLUTION.forward
def convolution_forward(self: PyNode) -> None:
    if _fp8.fp8_layer(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        _fp8.mac_forward(self, lambda x, w, b: _conv_nhwc(self, x, w, b, False, 0.0, torch.float64))
        return
    if self.quantized:
        acc, bound = conv2d_nhwc_int_bounded(self, depthwise=False)
        self.outputs[0].betensor = mac_finish(self, acc, owned=True, bound=bound)
        return
    _conv_float_forward(self, depthwise=False)


@DEPTHWISE_CONV.forward
def depthwise_conv_forward(self: PyNode) -> None:
    """The Parser writes DepthwiseConv as a grouped conv: weights [in_c*multiplier, kh, kw, 1], group = in_c."""
    if _fp8.fp8_layer(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        _fp8.mac_forward(self, lambda x, w, b: _conv_nhwc(self, x, w, b, True, 0.0, torch.float64))
        return
    if self.quantized:
        acc, bound = conv2d_nhwc_int_bounded(self, depthwise=True)
        self.outputs[0].betensor = mac_finish(self, acc, owned=True, bound=bound)
        return
    _conv_float_forward(self, depthwise=True)


@CONVOLUTION.quantize
def convolution_quantize(self: PyNode) -> None:
    """Per-channel weights when the weight mode says so; grouped convs are quantized per group otherwise."""
    per_channel = layer_settings(self).q_mode_weight.startswith("per_channel")
    group = int_param(self, "group", 1)
    if _fp8.quantize_mac(self, per_channel=per_channel, groups=1 if per_channel else int(group)):
        return
    quantize_mac(self, per_channel=per_channel, groups=1 if per_channel else int(group))


@DEPTHWISE_CONV.quantize
def depthwise_conv_quantize(self: PyNode) -> None:
    """DepthwiseConv weights are always per channel (each channel is its own filter), as upstream."""
    if not _fp8.quantize_mac(self, per_channel=True):
        quantize_mac(self, per_channel=True)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@CONVOLUTION.export
@DEPTHWISE_CONV.export
def convert_conv(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if g.rank(x) != 4:
        raise node_error(node, f"only 4-D NHWC inputs are exported, got rank {g.rank(x)}")
    cf = channels_first(4)
    w_q = node.get_constant("weights").betensor.cpu().to(torch.int64).numpy()
    if w_q.ndim != 4:
        raise node_error(node, f"weights must be OHWI, got shape {list(w_q.shape)}")
    in_c = int(x.ir_shape[3])
    group = int_or(node, "group", in_c if str(node.type) == "DepthwiseConv" else 1)
    if conv_double(g, node, group):
        return
    unit = g.unit_domain
    if unit and not qlinear_fusable(g, node):
        if integer_kernel(g, node, group) or conv_double(g, node, group, force=True):
            return
        g.float_layers.setdefault(node.name, None)  # the float32 convolution below is not bit-exact
    scale = weight_onnx_scale(g, node, x, y, unit)
    w = mac_weight_value(g, node, scale, axis=0, perm=(0, 3, 1, 2))
    b = bias_value(g, node, x, scale, unit=unit)
    pads = [int_or(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right")]
    conv = g.add("Conv", [g.float_value(x, cf, unit), w, b], kernel_shape=[int(w_q.shape[1]), int(w_q.shape[2])],
                 strides=[int_or(node, "stride_y", 1), int_or(node, "stride_x", 1)],
                 dilations=[int_or(node, "dilation_y", 1), int_or(node, "dilation_x", 1)], pads=pads, group=group)
    quantize_mac_output(g, node, conv, cf, unit)
