"""QDQ export of the layers with integer weights: Convolution, DepthwiseConv, FullyConnected, BatchNorm, LayerNorm,
and MatMul of two activations.

Each becomes DequantizeLinear(activation) → float op with DequantizeLinear(integer weights) and
DequantizeLinear(int32 bias) → QuantizeLinear(output). The stored biases contain the input zero point
(`biases = b_q + zp_in * Σw`); ONNX dequantizes the input itself, so the exported bias is `b_q` again.

Weight scales (`QDQGraph.scales`):
* "ir": the IR's `weights_scale` (ONNX scale 1 / weights_scale, per tensor or per channel);
* "effective": the scale the integer requantization really applies, M · 2^-N · y_scale / x_scale per tensor or
  channel, which folds the multiplier's rounding into the weights (see `exact_weight_scale`).

Weight integers ("exact" and "effective"): where an integer kernel of onnxruntime reads them (QLinearConv,
ConvInteger, MatMulInteger, the QGemm/MatMul fusions), 8-bit weights are uint8 `w_q + zp_w + c` with zero point c
(128 for int8 weights, `kernel_weight_offset`): the same real values, computed exactly on every CPU.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..ops._quant import effective_weights, fused_activation_bounds, tensor_scale
from ..ops._shared import axis_param, bool_param
from ..quant.dtype import Dtype
from ..quant.rounding import FLOAT32_EXACT, FLOAT64_EXACT
from . import convert_exact
from .qdq_graph import QDQGraph, channels_first, converter, identity, node_error, requant_ratio

EXACT_SCALE_ULPS = 4
"""How many float32 neighbours on each side `exact_weight_scale` tries."""
KERNEL_WEIGHT_OFFSET = 128
"""The zero point of 8-bit weights carried as uint8 for onnxruntime's integer kernels: int8 weights + 128."""


# ------------------------------------------------------------------------------------------------ constants
def _vector(node: PyNode, key: str, default: float) -> np.ndarray:
    """A per-tensor param or per-channel constant (`weights_scale`, `weights_zp`) as float64 numpy."""
    if key in node.constants:
        return node.constants[key].betensor.to(torch.float64).reshape(-1).numpy()
    return np.asarray([float(node.params.get(key, default))], dtype=np.float64)


def exact_weight_scale(ratio: np.ndarray, x_scale: float, y_scale: Any) -> np.ndarray:
    """float32 weight scales W ≈ M · 2^-N · y_scale / x_scale, moved by a few ulps where that makes
    float32(x_scale · W) / y_scale equal M · 2^-N exactly: the output multiplier a QLinear kernel derives from the
    three scales is then the IR's integer multiplier itself, so its requantization rounds as quantopt's does."""
    x, y = np.float32(x_scale), np.asarray(y_scale, dtype=np.float32)
    target = ratio.astype(np.float32)
    w = (ratio * y.astype(np.float64) / float(x)).astype(np.float32)
    best = w.copy()
    found = (x * w) / y == target
    up, down = w.copy(), w.copy()
    for _ in range(EXACT_SCALE_ULPS):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
        for cand in (up, down):
            hit = ~found & ((x * cand) / y == target)
            best[hit] = cand[hit]
            found |= hit
    return best


def weight_onnx_scale(g: QDQGraph, node: PyNode, x: PyTensor, y: PyTensor, unit: bool = False) -> np.ndarray:
    """float32 ONNX weight scales, [1] or [C]; with `unit` (input and output in integer units) the multiplier
    M · 2^-N itself, exact in float32."""
    if unit:
        return requant_ratio(node).astype(np.float32)
    if g.qparams(x).per_channel:
        raise node_error(node, "a per-channel quantized input is exported in the exact mode only (its scales are "
                               "folded into the integer weights)")
    if g.folds_multipliers:
        return exact_weight_scale(requant_ratio(node), g.qparams(x).scale, g.qparams(y).scale)
    s_w = _vector(node, "weights_scale", 1.0)
    if np.any(s_w <= 0):
        raise node_error(node, f"non-positive weights_scale {s_w.tolist()}")
    return (np.float32(1.0) / s_w.astype(np.float32)).astype(np.float32)


def weight_dtypes(g: QDQGraph) -> Tuple[Any, ...]:
    """Integer dtypes DequantizeLinear takes for weights, narrowest first (16-bit from opset 21)."""
    return (np.int8, np.uint8, np.int16, np.uint16) if g.opset >= 21 else (np.int8, np.uint8)


def _along(values: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return values.reshape(shape)


def dq_constant(g: QDQGraph, hint: str, q: np.ndarray, zp_ir: np.ndarray, scale: np.ndarray, axis: int = 0,
                dtypes: Sequence[Any] = ()) -> str:
    """DequantizeLinear of an integer constant with IR zero point `zp_ir` (ONNX: -zp_ir) and ONNX `scale`
    ([1] per tensor or one per index of `axis`). The first of `dtypes` holding values and zero point is used; if
    none does, the values are stored as int32 with the zero point folded in (exact)."""
    q = np.asarray(q, dtype=np.int64)
    per_axis = scale.size > 1
    zp_ir = np.asarray(zp_ir, dtype=np.int64).reshape(-1)
    if per_axis and zp_ir.size == 1:
        zp_ir = np.full(scale.size, int(zp_ir[0]), dtype=np.int64)
    onnx_zp = -zp_ir
    lo, hi = (int(q.min()), int(q.max())) if q.size else (0, 0)
    lo, hi = min(lo, int(onnx_zp.min())), max(hi, int(onnx_zp.max()))
    chosen = next((dt for dt in dtypes if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max), None)
    if chosen is None:
        values = q + (_along(zp_ir, q.ndim, axis) if per_axis else int(zp_ir[0]))
        if values.size and (values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max):
            raise UnsupportedError(f"constant '{hint}': its integers do not fit int32")
        chosen, q, onnx_zp = np.int32, values, np.zeros_like(onnx_zp)
    zp_values = onnx_zp.astype(chosen) if per_axis else np.array(onnx_zp[0], dtype=chosen)
    scale_values = scale.astype(np.float32) if per_axis else np.array(scale.reshape(-1)[0], dtype=np.float32)
    inputs = [g.const(hint, q.astype(chosen)), g.const(hint + "_scale", scale_values),
              g.const(hint + "_zero_point", zp_values)]
    return g.add("DequantizeLinear", inputs, hint=hint + "_dq", axis=axis if per_axis else None)


def kernel_weight_offset(e: np.ndarray) -> Optional[int]:
    """The offset c in [0, 255] (128 where it fits) that carries the integer weights `e` (w_q + zp_w) as uint8
    e + c with the one zero point c; None when they span more than 256 values.

    Why uint8: onnxruntime's u8·s8 integer GEMM (QLinearConv, MatMulInteger, QGemm, MatMulIntegerToFloat) runs on
    AVX2 CPUs without VNNI with vpmaddubsw, which adds each pair of u8·s8 products into int16 *with saturation*
    (255 · 127 · 2 > 32767), so its int32 sums depend on the CPU. Its u8·u8 GEMM widens both operands to 16 bits
    and adds pairs of products in int32 (at most 2 · 255², no saturation) on every x86 CPU; the zero-point
    corrections are int32 sums that wrap consistently, so a true accumulator that fits int32 comes out exact."""
    if e.size == 0:
        return KERNEL_WEIGHT_OFFSET
    lo, hi = max(0, -int(e.min())), min(255, 255 - int(e.max()))
    if lo > hi:
        return None
    return min(max(KERNEL_WEIGHT_OFFSET, lo), hi)


def _kernel_reads(g: QDQGraph, node: PyNode) -> bool:
    """Whether an integer kernel of onnxruntime may read the layer's weights in a mode that carries them as uint8
    (`QDQGraph.unsigned_kernels`): 8-bit input and weights (onnxruntime has no wider integer kernel)."""
    x = node.inputs[0]
    return g.unsigned_kernels and (x.qbits or 8) <= 8 and node.get_constant("weights").dtype.bits <= 8


def kernel_weights(g: QDQGraph, node: PyNode) -> Optional[Tuple[np.ndarray, int]]:
    """(w_q + zp_w as int64 in the IR layout, offset c) when a MAC layer's weights are carried as uint8 e + c for
    onnxruntime's integer kernels (`_kernel_reads`) and every weight lies within 256 values of the others
    (`kernel_weight_offset`); None otherwise."""
    if not _kernel_reads(g, node):
        return None
    e = effective_weights(node).numpy()
    c = kernel_weight_offset(e)
    return None if c is None else (e, c)


def mac_weight_value(g: QDQGraph, node: PyNode, scale: np.ndarray, axis: int,
                     perm: Optional[Tuple[int, ...]] = None) -> str:
    """DequantizeLinear of a Convolution's or FullyConnected's weights in layout `perm` (of the IR weights), the
    same real values in every form: uint8 e + c with zero point c where onnxruntime's integer kernels read them
    (`kernel_weights`); where they would but e spans more than 256 values, the dequantized float32 values
    e · scale (what DequantizeLinear computes): one uint8 zero point cannot hold them, several are refused by
    older onnxruntime QLinearConv kernels, an int8 form would run as u8·s8, and an int32 one is fused into an
    invalid QLinearConv, while float weights keep the layer a float convolution; the IR's integers and zero points
    otherwise (`weight_value`)."""
    if not _kernel_reads(g, node):
        w_q = node.get_constant("weights").betensor.to(torch.int64).numpy()
        return weight_value(g, node, w_q if perm is None else w_q.transpose(perm), scale, axis)
    kernel = kernel_weights(g, node)
    e, c = kernel if kernel is not None else (effective_weights(node).numpy(), None)
    e = e if perm is None else e.transpose(perm)
    if c is None:
        step = _along(scale.astype(np.float32), e.ndim, axis) if scale.size > 1 else np.float32(scale.reshape(-1)[0])
        return g.const(f"{node.name}/weights", (e.astype(np.float32) * step).astype(np.float32))
    return dq_constant(g, f"{node.name}/weights", e + c, np.array([-c]), scale, axis=axis, dtypes=(np.uint8,))


def input_folded_bias(node: PyNode, x: PyTensor) -> np.ndarray:
    """b_q = biases - zp_in · Σ_window (w_q + zp_w) per output channel: the bias without the input zero point."""
    b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1)
    w = effective_weights(node)
    per_out = w.reshape(w.shape[0], -1).sum(dim=1) if w.dim() > 1 else w.reshape(-1)
    zp_in = int(round(float(x.zerop if not isinstance(x.zerop, torch.Tensor) else x.zerop.reshape(-1)[0])))
    return (b - zp_in * per_out).numpy()


def bias_value(g: QDQGraph, node: PyNode, x: PyTensor, w_scale: np.ndarray, shape: Optional[Tuple[int, ...]] = None,
               unit: bool = False) -> str:
    """The float bias: DequantizeLinear of int32 b_q with scale x_scale · w_scale (what a QLinear kernel expects;
    x_scale 1 with `unit`), or a float initializer when b_q does not fit int32 (48-bit biases)."""
    b = input_folded_bias(node, x)
    x_scale = np.float32(1.0) if unit else np.float32(g.qparams(x).scale)
    scale = (x_scale * w_scale.reshape(-1)).astype(np.float32)
    b = b.reshape(shape) if shape is not None else b
    info = np.iinfo(np.int32)
    if b.size and (b.min() < info.min or b.max() > info.max):
        full = _along(scale.astype(np.float64), b.ndim, 0) if scale.size > 1 else float(scale[0])
        return g.const(f"{node.name}/bias", (b.astype(np.float64) * full).astype(np.float32))
    return dq_constant(g, f"{node.name}/bias", b, np.zeros(1, dtype=np.int64), scale, axis=0)  # int32


def weight_value(g: QDQGraph, node: PyNode, w_q: np.ndarray, scale: np.ndarray, axis: int) -> str:
    zp = _vector(node, "weights_zp", 0.0)
    return dq_constant(g, f"{node.name}/weights", w_q, np.round(zp).astype(np.int64), scale, axis=axis,
                       dtypes=weight_dtypes(g))


def fused_activation(g: QDQGraph, node: PyNode, value: str) -> str:
    """The float op of a fused RELU/RELU6/CLIP; other fused activations are not quantizable anyway."""
    act = str(node.params.get("with_activation", "NONE")).upper()
    if act == "NONE":
        return value
    if act == "RELU":
        return g.add("Relu", [value])
    if act in ("RELU6", "CLIP"):
        lo, hi = (0.0, 6.0) if act == "RELU6" else (float(node.get_param("clip_min")),
                                                      float(node.get_param("clip_max")))
        return g.add("Clip", [value, g.const(f"{node.name}/clip_min", np.array(lo, dtype=np.float32)),
                              g.const(f"{node.name}/clip_max", np.array(hi, dtype=np.float32))])
    raise node_error(node, f"fused activation {act} has no QDQ mapping")


def quantize_mac_output(g: QDQGraph, node: PyNode, value: str, perm: Optional[Tuple[int, ...]], unit: bool) -> None:
    """QuantizeLinear of a MAC result: in integer units, the fused RELU/RELU6/CLIP is the Clip to its integer
    bounds (left out when they are the dtype's range, so onnxruntime fuses the group into one integer kernel);
    with the IR's scales, the float activation op."""
    y = node.outputs[0]
    if unit:
        g.quantize(y, value, perm, unit=True, bounds=fused_activation_bounds(node))
    else:
        g.quantize(y, fused_activation(g, node, value), perm)


def _int(node: PyNode, key: str, default: int) -> int:
    return int(node.get_param(key, optional=True, default_value=default))


# ------------------------------------------------------------------------------------------------ wide MACs
def _wide_double_mac(g: QDQGraph, node: PyNode, inner: int, force: bool = False) -> Optional[np.ndarray]:
    """The requant ratios when a MAC layer with wider than 8-bit inputs or weights (which onnxruntime has no
    integer kernel for; or any, with `force`) can be computed exactly in float64 (`convert_exact`): no
    remain_shift, sums of `inner` products below 2^53, shifts small enough; None otherwise."""
    x = node.inputs[0]
    w = effective_weights(node)
    wide = force or (x.qbits or 8) > 8 or node.get_constant("weights").dtype.bits > 8
    if not g.unit_domain or not wide or node.params.get("remain_shift") is not None:
        return None
    lo, hi = x.qmin + int(round(float(x.zerop))), x.qmax + int(round(float(x.zerop)))
    bias = np.abs(input_folded_bias(node, x)).max(initial=0)
    if inner * max(abs(lo), abs(hi)) * int(w.abs().max()) + bias >= FLOAT64_EXACT:
        return None
    return convert_exact.exact_ratio(node)


def _window_sums(g: QDQGraph, node: PyNode, codes: str, w: np.ndarray, in_c: int, group: int, out_hw: Tuple[int, int],
                 stride: Tuple[int, int], dilation: Tuple[int, int]) -> str:
    """Σ over kernel positions (i, j) of the strided window of `codes` (NHWC float64, already padded) times the
    weights `w` [O, kh, kw, C/group] of that position: a MatMul with the block-diagonal [C, O] matrix, or for one
    input channel per group (depthwise) a Gather of each output's channel and a Mul."""
    out_c, kh, kw, per_group = w.shape
    (oh, ow), (sy, sx), (dy, dx) = out_hw, stride, dilation
    out_per_group = out_c // group
    source = np.arange(out_c) // out_per_group  # the input channel of each output when per_group == 1
    total = None
    for i in range(kh):
        for j in range(kw):
            window = g.add("Slice", [codes, g.ints(f"{node.name}/starts", [i * dy, j * dx]),
                                     g.ints(f"{node.name}/ends", [i * dy + (oh - 1) * sy + 1,
                                                                  j * dx + (ow - 1) * sx + 1]),
                                     g.ints(f"{node.name}/axes", [1, 2]), g.ints(f"{node.name}/steps", [sy, sx])])
            if per_group == 1:
                if out_c != in_c or not np.array_equal(source, np.arange(in_c)):
                    window = g.add("Gather", [window, g.ints(f"{node.name}/channels", source)], axis=3)
                term = g.add("Mul", [window, g.const(f"{node.name}/w{i}_{j}", w[:, i, j, 0].astype(np.float64))])
            else:
                matrix = np.zeros((in_c, out_c), dtype=np.float64)
                for o in range(out_c):
                    first = (o // out_per_group) * per_group
                    matrix[first:first + per_group, o] = w[o, i, j, :]
                term = g.add("MatMul", [window, g.const(f"{node.name}/w{i}_{j}", matrix)])
            total = term if total is None else g.add("Add", [total, term])
    return total


FLOAT32_BITS = 24


def qlinear_requant_is_exact(node: PyNode) -> bool:
    """Whether a QLinearConv/QGemm's float32 requantization, float(acc) · (M · 2^-N) rounded half to even, is
    quantopt's exact one for every accumulator the stored ranges allow: the accumulator (bias included) below 2^24
    (exact in float32), and every result that does not saturate (|v| below 2^(bits + 1)) a multiple of 2^-N' with
    at most 24 significant bits, N' the shift less the multiplier's trailing zero bits."""
    x, y = node.inputs[0], node.outputs[0]
    w = effective_weights(node)
    per_out = w.abs().reshape(w.shape[0], -1).sum(dim=1)
    bias = node.get_constant("biases").betensor.to(torch.int64).reshape(-1).abs()
    zp = int(round(float(x.zerop if not isinstance(x.zerop, torch.Tensor) else x.zerop.reshape(-1)[0])))
    xmax = max(abs(int(x.qmin) + zp), abs(int(x.qmax) + zp))
    if int((per_out * xmax).max()) + int(bias.max()) >= 2 ** FLOAT32_BITS:
        return False
    ratio_bits = convert_exact.requant_fraction_bits(node)
    return ratio_bits is not None and (y.qbits or 8) + 1 + ratio_bits <= FLOAT32_BITS


def qlinear_fusable(g: QDQGraph, node: PyNode) -> bool:
    """Whether onnxruntime turns the unit-domain QDQ convolution into a QLinearConv that computes quantopt's integers:
    its float32 requantization is exact (`qlinear_requant_is_exact`), the weights are uint8 with one zero point
    (`kernel_weights`: QLinearConv refuses several, and its u8·u8 accumulation is exact on every CPU), and no Clip
    sits between the Conv and its QuantizeLinear (which would stop the fusion and leave a float32 convolution)."""
    x, y = node.inputs[0], node.outputs[0]
    if kernel_weights(g, node) is None or (y.qbits or 8) > 8 or not qlinear_requant_is_exact(node):
        return False
    p = g.qparams(y)
    if g.qparams(x).dtype != p.dtype:  # QLinearConv takes one activation type for input and output
        return False
    lo, hi = fused_activation_bounds(node)
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return False
    full = p.dtype.int_range()
    return (p.qmin, p.qmax) == full and lo + p.offset <= full[0] and hi + p.offset >= full[1]


def _integer_kernel(g: QDQGraph, node: PyNode, group: int) -> bool:
    """ConvInteger / MatMulInteger (int32 accumulation of the input and weight integers, onnxruntime's integer
    GEMM), then the bias and M · 2^-N in float64 and Round: exact where QLinearConv's float32 requantization is not
    (`qlinear_requant_is_exact`). Needs uint8 inputs and weights that fit uint8 with one zero point
    (`kernel_weights`, u8·u8: exact on every CPU); False otherwise."""
    x = node.inputs[0]
    kernel = kernel_weights(g, node)
    ratio = convert_exact.exact_ratio(node)
    if ratio is None or kernel is None or g.qparams(x).dtype != Dtype.UINT8 \
            or node.params.get("remain_shift") is not None:
        return False
    e, c = kernel
    w_zp = g.const(f"{node.name}/weights_zero_point", np.array(c, dtype=np.uint8))
    x_zp = g.zero_point(x)
    bias = g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64))
    if str(node.type) == "FullyConnected":
        weights = g.const(f"{node.name}/weights", np.ascontiguousarray(e.T + c).astype(np.uint8))
        acc = g.add("MatMulInteger", [g.int_value(x), weights, x_zp, w_zp])
        perm, channel_shape = None, None
    else:
        cf = channels_first(4)
        weights = g.const(f"{node.name}/weights", np.ascontiguousarray(e.transpose(0, 3, 1, 2) + c).astype(np.uint8))
        pads = [_int(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right")]
        acc = g.add("ConvInteger", [g.int_value(x, cf), weights, x_zp, w_zp],
                    kernel_shape=[int(e.shape[1]), int(e.shape[2])],
                    strides=[_int(node, "stride_y", 1), _int(node, "stride_x", 1)],
                    dilations=[_int(node, "dilation_y", 1), _int(node, "dilation_x", 1)], pads=pads, group=group)
        perm, channel_shape = cf, (-1, 1, 1)
        bias = g.add("Reshape", [bias, g.ints(f"{node.name}/bias_shape", [-1, 1, 1])])
    total = g.add("Add", [g.add("Cast", [acc], to=convert_exact.DOUBLE), bias])
    convert_exact.requantize(g, node, total, ratio, perm, fused_activation_bounds(node),
                             channel_shape=channel_shape if ratio.size > 1 else None)
    return True


def _conv_double(g: QDQGraph, node: PyNode, group: int, force: bool = False) -> bool:
    """Σ over kernel positions of (strided slice of the padded codes) · weights, in NHWC float64: a MatMul with
    the block-diagonal [C, O] matrix of the position, or for one input channel per group (depthwise) a Gather of
    each output's channel times its weights; then bias and requantization (exact, see `_wide_double_mac`)."""
    x, y = node.inputs[0], node.outputs[0]
    w = effective_weights(node).numpy()  # [O, kh, kw, C/group]
    out_c, kh, kw, per_group = w.shape
    ratio = _wide_double_mac(g, node, kh * kw * per_group, force)
    if ratio is None:
        return False
    in_c, oh, ow = int(x.ir_shape[3]), int(y.ir_shape[1]), int(y.ir_shape[2])
    sy, sx = _int(node, "stride_y", 1), _int(node, "stride_x", 1)
    dy, dx = _int(node, "dilation_y", 1), _int(node, "dilation_x", 1)
    top, left, bottom, right = (_int(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right"))
    codes = convert_exact.codes(g, x)
    if top or left or bottom or right:
        codes = g.add("Pad", [codes, g.ints(f"{node.name}/pads", [0, top, left, 0, 0, bottom, right, 0])])
    total = _window_sums(g, node, codes, w, in_c, group, (oh, ow), (sy, sx), (dy, dx))
    bias = input_folded_bias(node, x).astype(np.float64)
    total = g.add("Add", [total, g.const(f"{node.name}/bias", bias)])
    convert_exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
    return True


def _fully_connected_double(g: QDQGraph, node: PyNode, force: bool = False) -> bool:
    x = node.inputs[0]
    w = effective_weights(node).numpy()  # [O, K]
    ratio = _wide_double_mac(g, node, int(w.shape[1]), force)
    if ratio is None:
        return False
    product = g.add("MatMul", [convert_exact.codes(g, x), g.const(f"{node.name}/weights", w.T.astype(np.float64))])
    total = g.add("Add", [product, g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64))])
    convert_exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
    return True


# ------------------------------------------------------------------------------------------------ converters
@converter("Convolution", "DepthwiseConv")
def convert_conv(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if g.rank(x) != 4:
        raise node_error(node, f"only 4-D NHWC inputs are exported, got rank {g.rank(x)}")
    cf = channels_first(4)
    w_q = node.get_constant("weights").betensor.to(torch.int64).numpy()
    if w_q.ndim != 4:
        raise node_error(node, f"weights must be OHWI, got shape {list(w_q.shape)}")
    in_c = int(x.ir_shape[3])
    group = _int(node, "group", in_c if str(node.type) == "DepthwiseConv" else 1)
    if _conv_double(g, node, group):
        return
    unit = g.unit_domain
    if unit and not qlinear_fusable(g, node):
        if _integer_kernel(g, node, group) or _conv_double(g, node, group, force=True):
            return
        g.float_layers.setdefault(node.name, None)  # the float32 convolution below is not bit-exact
    scale = weight_onnx_scale(g, node, x, y, unit)
    w = mac_weight_value(g, node, scale, axis=0, perm=(0, 3, 1, 2))
    b = bias_value(g, node, x, scale, unit=unit)
    pads = [_int(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right")]
    conv = g.add("Conv", [g.float_value(x, cf, unit), w, b], kernel_shape=[int(w_q.shape[1]), int(w_q.shape[2])],
                 strides=[_int(node, "stride_y", 1), _int(node, "stride_x", 1)],
                 dilations=[_int(node, "dilation_y", 1), _int(node, "dilation_x", 1)], pads=pads, group=group)
    quantize_mac_output(g, node, conv, cf, unit)


@converter("FullyConnected")
def convert_fully_connected(g: QDQGraph, node: PyNode) -> None:
    """Gemm (transB) for 2-D inputs, MatMul + Add over the last axis otherwise."""
    x, y = node.inputs[0], node.outputs[0]
    if _fully_connected_double(g, node):
        return
    unit = g.unit_domain
    if unit:  # MatMulInteger (or float64): onnxruntime's QGemm fusion is not certain for every FC
        if _integer_kernel(g, node, 1) or _fully_connected_double(g, node, force=True):
            return
        g.float_layers.setdefault(node.name, None)
    scale = weight_onnx_scale(g, node, x, y, unit)
    b = bias_value(g, node, x, scale, unit=unit)
    xf = g.float_value(x, unit=unit)
    if g.rank(x) == 2:
        out = g.add("Gemm", [xf, mac_weight_value(g, node, scale, axis=0), b], transB=1)
    else:
        mm = g.add("MatMul", [xf, mac_weight_value(g, node, scale, axis=1, perm=(1, 0))])
        out = g.add("Add", [mm, b])
    quantize_mac_output(g, node, out, None, unit)


@converter("MatMul")
def convert_matmul(g: QDQGraph, node: PyNode) -> None:
    """Two activations; trans_a/trans_b become layouts of the inputs (integer Transposes, shared)."""
    if len(node.inputs) != 2:
        raise node_error(node, f"needs 2 inputs, got {len(node.inputs)}")
    perms = []
    for t, key in zip(node.inputs, ("trans_a", "trans_b")):
        perm = list(identity(g.rank(t)))
        if bool_param(node, key, False):
            perm[-2], perm[-1] = perm[-1], perm[-2]
        perms.append(tuple(perm))
    if convert_exact.matmul(g, node, perms):
        return
    values = [g.float_value(t, perm) for t, perm in zip(node.inputs, perms)]
    a, b = node.inputs
    factor = float(requant_ratio(node)[0]) * tensor_scale(a) * tensor_scale(b) / tensor_scale(node.outputs[0])
    out = g.rescale(g.add("MatMul", values), factor)
    g.quantize(node.outputs[0], fused_activation(g, node, out))


@converter("BatchNorm")
def convert_batchnorm(g: QDQGraph, node: PyNode) -> None:
    """x · w + b along `axis`, in whichever layout the input already has."""
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=-1), rank)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    pos = perm.index(axis)
    shape = (-1,) + (1,) * (rank - 1 - pos)
    ratio = convert_exact.exact_ratio(node) if g.unit_domain else None
    if ratio is not None:  # x' · (w + zp_w) + b per channel, requantized per channel, in float64
        w_eff = effective_weights(node).reshape(-1).numpy().astype(np.float64)
        acc = g.add("Add", [g.add("Mul", [convert_exact.codes(g, x, perm), g.const(f"{node.name}/weights",
                                                                                  w_eff.reshape(shape))]),
                            g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64).reshape(shape))])
        convert_exact.requantize(g, node, acc, ratio, perm, fused_activation_bounds(node),
                                 channel_shape=shape if ratio.size > 1 else None)
        return
    w_q = node.get_constant("weights").betensor.to(torch.int64).reshape(-1).numpy()
    scale = weight_onnx_scale(g, node, x, y)
    w = weight_value(g, node, w_q.reshape(shape), scale, axis=0)
    b = bias_value(g, node, x, scale, shape=shape)
    out = g.add("Add", [g.add("Mul", [g.float_value(x, perm), w]), b])
    g.quantize(y, fused_activation(g, node, out), perm)


@converter("LayerNorm")
def convert_layernorm(g: QDQGraph, node: PyNode) -> None:
    """LayerNormalization over trailing axes with the IR epsilon; gamma/beta are the integer weights and biases
    dequantized with the scales the integer forward applies (normalized value · M_n 2^-N_n / sqrt(N), then the
    output multiplier), stored as float initializers."""
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    raw = node.get_param("axis", optional=True, default_value=[-1])
    axes = sorted({axis_param(node, a, rank) for a in (raw if isinstance(raw, (list, tuple)) else [raw])})
    if axes != list(range(axes[0], rank)):
        raise node_error(node, f"normalized axes {axes} are not the trailing axes of a rank-{rank} input")
    if "norm_scale_value" not in node.params:
        raise node_error(node, "a quantized LayerNorm needs norm_scale_value/norm_shift_value")
    upstream = "norm_frac_bits" not in node.params  # upstream's integer form (docs/semantics/normalization.md)
    if upstream and "lut" not in node.constants:
        raise node_error(node, "a quantized LayerNorm needs norm_frac_bits (exact form) or its 'lut' (upstream form)")
    if convert_exact.layer_norm(g, node, axes) or (upstream and convert_exact.layer_norm_upstream(g, node, axes)):
        return
    if upstream and g.scales != "ir":
        raise node_error(node, "the integer LayerNorm's multiplier shifts are too large for an exact float64 "
                               "requantization; export with --scales ir")
    count = math.prod(int(x.ir_shape[a]) for a in axes)
    if upstream:
        from ..ops.normalization import upstream_norm_gain

        norm_scale = upstream_norm_gain(node)
    else:
        norm_scale = float(node.params["norm_scale_value"]) * 2.0 ** -float(node.params["norm_shift_value"]) \
            / math.sqrt(count)
    affine = tuple(int(x.ir_shape[a]) for a in axes)
    ratio = requant_ratio(node) / tensor_scale(y)
    ratio = ratio.reshape(affine) if ratio.size > 1 else float(ratio[0])
    w_t = node.get_constant("weights", optional=True)
    b_t = node.get_constant("biases", optional=True)
    w = effective_weights(node).to(torch.float64).reshape(affine).numpy() if w_t is not None else np.ones(affine)
    b = b_t.betensor.to(torch.float64).reshape(affine).numpy() if b_t is not None else np.zeros(affine)
    gamma = (w * norm_scale * ratio).astype(np.float32)
    beta = (b * ratio * np.ones(affine)).astype(np.float32)
    eps = float(node.get_param("epsilon"))
    out = g.add("LayerNormalization", [g.float_value(x), g.const(f"{node.name}/gamma", gamma),
                                       g.const(f"{node.name}/beta", beta)], axis=axes[0], epsilon=eps)
    g.quantize(y, out)


@converter("ConvTranspose")
def convert_conv_transpose(g: QDQGraph, node: PyNode) -> None:
    """ONNX ConvTranspose channels-first (pads, output_padding, strides, dilations, group).

    "exact": on the integers (input plus zero point, weights plus zero point as float32 integers, the bias without
    the input zero point), exact in float32 while every sum stays below 2^24, then the multiplier in float64 and
    Round. Otherwise weights behind a per-output-channel DequantizeLinear (group 1 only: ONNX's axis 1 is the
    output channel within a group)."""
    from ..ops.mac_extra import _oc_effective_weights, _oc_to_torch

    x, y = node.inputs[0], node.outputs[0]
    if g.rank(x) != 4:
        raise node_error(node, f"only 4-D NHWC inputs are exported, got rank {g.rank(x)}")
    cf = channels_first(4)
    group = _int(node, "group", 1)
    w_oc = _oc_effective_weights(node, group)                      # [out_c, kh, kw, in_c/g], w + zp_w
    torch_w = _oc_to_torch(w_oc, group).numpy()                   # [in_c, out_c/g, kh, kw]
    out_c = int(w_oc.shape[0])
    sums = w_oc.reshape(out_c, -1).sum(dim=1).numpy()
    zp_in = int(round(float(x.zerop if not isinstance(x.zerop, torch.Tensor) else x.zerop.reshape(-1)[0])))
    bias = node.get_constant("biases").betensor.to(torch.int64).reshape(-1).numpy() - zp_in * sums
    attrs = dict(kernel_shape=[int(torch_w.shape[2]), int(torch_w.shape[3])],
                 strides=[_int(node, "stride_y", 1), _int(node, "stride_x", 1)],
                 dilations=[_int(node, "dilation_y", 1), _int(node, "dilation_x", 1)],
                 pads=[_int(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right")],
                 output_padding=[_int(node, "output_padding_y", 0), _int(node, "output_padding_x", 0)], group=group)
    lo, hi = x.qmin + zp_in, x.qmax + zp_in
    bound = max(abs(lo), abs(hi)) * int(np.abs(w_oc.reshape(out_c, -1).numpy()).sum(axis=1).max()) \
        + int(np.abs(bias).max(initial=0))
    ratio = convert_exact.exact_ratio(node) if g.unit_domain and node.params.get("remain_shift") is None else None
    if ratio is not None and FLOAT32_EXACT <= bound < FLOAT64_EXACT:  # wide: the same sums in float64
        _conv_transpose_double(g, node, w_oc.numpy(), bias, group, ratio, attrs)
        return
    if ratio is not None and bound < FLOAT32_EXACT:
        acc = g.add("ConvTranspose", [g.float_value(x, cf, unit=True), g.const(f"{node.name}/weights",
                                                                               torch_w.astype(np.float32)),
                                      g.const(f"{node.name}/bias", bias.astype(np.float32))], **attrs)
        convert_exact.requantize(g, node, g.add("Cast", [acc], to=convert_exact.DOUBLE), ratio, cf,
                                 fused_activation_bounds(node), channel_shape=(-1, 1, 1) if ratio.size > 1 else None)
        return
    if group != 1:
        raise node_error(node, "grouped ConvTranspose is exported in the exact mode only (within float32 sums)")
    scale = weight_onnx_scale(g, node, x, y)
    w_q = _oc_to_torch(_ir_weights(node), 1).numpy()
    weights = dq_constant(g, f"{node.name}/weights", w_q, np.round(_vector(node, "weights_zp", 0.0)).astype(np.int64),
                          scale, axis=1 if scale.size > 1 else 0, dtypes=weight_dtypes(g))
    x_scale = np.float32(g.qparams(x).scale)
    b = g.const(f"{node.name}/bias", (bias.astype(np.float64) * (x_scale * scale.astype(np.float64))).astype(
        np.float32))
    out = g.add("ConvTranspose", [g.float_value(x, cf), weights, b], **attrs)
    g.quantize(y, fused_activation(g, node, out), cf)


def _ir_weights(node: PyNode) -> torch.Tensor:
    return node.get_constant("weights").betensor.to(torch.int64)


def _conv_transpose_double(g: QDQGraph, node: PyNode, w_oc: np.ndarray, bias: np.ndarray, group: int,
                           ratio: np.ndarray, attrs: dict) -> None:
    """ConvTranspose in float64 as docs/semantics/mac.md states it: the integers plus zero point spread `stride` apart
    (0 between them, the integer of float 0), padded by (k - 1)·d - pad_begin and (k - 1)·d + output_padding - pad_end,
    then a stride-1 convolution with the kernel flipped (`_window_sums`), the bias and the multiplier."""
    x, y = node.inputs[0], node.outputs[0]
    shape = [int(v) for v in x.ir_shape]
    codes = convert_exact.codes(g, x)
    for axis in (1, 2):
        k = int(attrs["kernel_shape"][axis - 1])
        s, d = int(attrs["strides"][axis - 1]), int(attrs["dilations"][axis - 1])
        begin, end = int(attrs["pads"][axis - 1]), int(attrs["pads"][axis + 1])
        extra = int(attrs["output_padding"][axis - 1])
        n = shape[axis]
        if s > 1 and n > 1:  # n, 1 → n, s → n·s, then the trailing s - 1 zeros dropped
            spread = g.add("Unsqueeze", [codes, g.ints(f"{node.name}/spread_axis", [axis + 1])])
            pads = [0] * 10
            pads[5 + axis + 1] = s - 1
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
            pads = [0] * 8
            pads[axis], pads[4 + axis] = max(0, before), max(0, after)
            codes = g.add("Pad", [codes, g.ints(f"{node.name}/pads", pads)])
            shape[axis] += max(0, before) + max(0, after)
    flipped = np.ascontiguousarray(w_oc[:, ::-1, ::-1, :])
    out_hw = (int(y.ir_shape[1]), int(y.ir_shape[2]))
    dilation = (int(attrs["dilations"][0]), int(attrs["dilations"][1]))
    total = _window_sums(g, node, codes, flipped, int(x.ir_shape[3]), group, out_hw, (1, 1), dilation)
    total = g.add("Add", [total, g.const(f"{node.name}/bias", bias.astype(np.float64))])
    convert_exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
