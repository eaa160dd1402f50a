"""Building blocks of the QDQ export of the layers with integer weights: Convolution, DepthwiseConv,
FullyConnected, BatchNorm, LayerNorm, and MatMul of two activations.

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

Shared by the mappings of ops/conv.py, ops/linear.py, ops/batchnorm_pad.py and ops/mac_extra.py.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ...errors import UnsupportedError
from ...graph.node import PyNode
from ...graph.tensor import PyTensor
from ...quant.dtype import Dtype
from ...quant.rounding import FLOAT64_EXACT
from .._quant import effective_weights, fused_activation_bounds, quant_of, row_abs_sums, tensor_zp
from . import exact
from .perms import channels_first
from .qdq_graph import QDQGraph, int_or, node_error, requant_ratio

EXACT_SCALE_ULPS = 4
"""How many float32 neighbours on each side `exact_weight_scale` tries."""
KERNEL_WEIGHT_OFFSET = 128
"""The zero point of 8-bit weights carried as uint8 for onnxruntime's integer kernels: int8 weights + 128."""


def param_vector(node: PyNode, key: str, default: float) -> np.ndarray:
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
    s_w = param_vector(node, "weights_scale", 1.0)
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
    bits = quant_of(node).get(node.inputs[0]).qbits or 8
    return g.unsigned_kernels and bits <= 8 and node.get_constant("weights").dtype.bits <= 8


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


def _first_zero_point(node: PyNode, x: PyTensor) -> int:
    """`x`'s zero point as an int (the first one of a per-channel tensor, whose zero points are all 0)."""
    zerop = quant_of(node).get(x).zerop
    return int(round(float(zerop if not isinstance(zerop, torch.Tensor) else zerop.reshape(-1)[0])))


def input_folded_bias(node: PyNode, x: PyTensor) -> np.ndarray:
    """b_q = biases - zp_in · Σ_window (w_q + zp_w) per output channel: the bias without the input zero point."""
    b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1)
    w = effective_weights(node)
    per_out = w.reshape(w.shape[0], -1).sum(dim=1) if w.dim() > 1 else w.reshape(-1)
    zp_in = _first_zero_point(node, x)
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
    zp = param_vector(node, "weights_zp", 0.0)
    return dq_constant(g, f"{node.name}/weights", w_q, np.round(zp).astype(np.int64), scale, axis=axis,
                       dtypes=weight_dtypes(g))


def qdq_fused_activation(g: QDQGraph, node: PyNode, value: str) -> str:
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
        g.quantize(y, qdq_fused_activation(g, node, value), perm)


def wide_double_mac(g: QDQGraph, node: PyNode, inner: int, force: bool = False) -> Optional[np.ndarray]:
    """The requant ratios when a MAC layer with wider than 8-bit inputs or weights (which onnxruntime has no
    integer kernel for; or any, with `force`) can be computed exactly in float64 (exact.py): no
    remain_shift, sums of `inner` products below 2^53, shifts small enough; None otherwise."""
    x = node.inputs[0]
    qx = quant_of(node).get(x)
    w = effective_weights(node)
    wide = force or (qx.qbits or 8) > 8 or node.get_constant("weights").dtype.bits > 8
    if not g.unit_domain or not wide or node.params.get("remain_shift") is not None:
        return None
    zp = tensor_zp(node, x)
    lo, hi = qx.qmin + zp, qx.qmax + zp
    bias = np.abs(input_folded_bias(node, x)).max(initial=0)
    if inner * max(abs(lo), abs(hi)) * int(w.abs().max()) + bias >= FLOAT64_EXACT:
        return None
    return exact.exact_ratio(node)


def window_sums(g: QDQGraph, node: PyNode, codes: str, w: np.ndarray, in_c: int, group: int,
                out_sizes: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> str:
    """Σ over kernel positions of the strided window of `codes` (channels-last float64 [N, spatial..., C], already
    padded) times the weights `w` [O, kernel..., C/group] of that position (as many spatial axes as `out_sizes`):
    a MatMul with the block-diagonal [C, O] matrix, or for one input channel per group (depthwise) a Gather of each
    output's channel and a Mul."""
    out_c, per_group = int(w.shape[0]), int(w.shape[-1])
    kernel = w.shape[1:-1]
    axes = list(range(1, len(kernel) + 1))
    out_per_group = out_c // group
    source = np.arange(out_c) // out_per_group  # the input channel of each output when per_group == 1
    total = None
    for pos in itertools.product(*(range(k) for k in kernel)):
        starts = [i * d for i, d in zip(pos, dilation)]
        ends = [b + (o - 1) * s + 1 for b, o, s in zip(starts, out_sizes, stride)]
        window = g.add("Slice", [codes, g.ints(f"{node.name}/starts", starts), g.ints(f"{node.name}/ends", ends),
                                 g.ints(f"{node.name}/axes", axes), g.ints(f"{node.name}/steps", list(stride))])
        tag = "_".join(map(str, pos))
        if per_group == 1:
            if out_c != in_c or not np.array_equal(source, np.arange(in_c)):
                window = g.add("Gather", [window, g.ints(f"{node.name}/channels", source)], axis=len(kernel) + 1)
            term = g.add("Mul", [window, g.const(f"{node.name}/w{tag}", w[(slice(None), *pos, 0)].astype(np.float64))])
        else:
            matrix = np.zeros((in_c, out_c), dtype=np.float64)
            for o in range(out_c):
                first = (o // out_per_group) * per_group
                matrix[first:first + per_group, o] = w[(o, *pos)]
            term = g.add("MatMul", [window, g.const(f"{node.name}/w{tag}", matrix)])
        total = term if total is None else g.add("Add", [total, term])
    assert total is not None
    return total


FLOAT32_BITS = 24


def qlinear_requant_is_exact(node: PyNode) -> bool:
    """Whether a QLinearConv/QGemm's float32 requantization, float(acc) · (M · 2^-N) rounded half to even, is
    quantopt's exact one for every accumulator the stored ranges allow: the accumulator (bias included) below 2^24
    (exact in float32), and every result that does not saturate (|v| below 2^(bits + 1)) a multiple of 2^-N' with
    at most 24 significant bits, N' the shift less the multiplier's trailing zero bits."""
    x, y = node.inputs[0], node.outputs[0]
    w = effective_weights(node)
    per_out = row_abs_sums(w.reshape(w.shape[0], -1))
    bias = node.get_constant("biases").betensor.to(torch.int64).reshape(-1).abs()
    table = quant_of(node)
    qx = table.get(x)
    zp = _first_zero_point(node, x)
    xmax = max(abs(int(qx.qmin) + zp), abs(int(qx.qmax) + zp))
    if int((per_out * xmax).max()) + int(bias.max()) >= 2 ** FLOAT32_BITS:
        return False
    ratio_bits = exact.requant_fraction_bits(node)
    return ratio_bits is not None and (table.get(y).qbits or 8) + 1 + ratio_bits <= FLOAT32_BITS


def qlinear_fusable(g: QDQGraph, node: PyNode) -> bool:
    """Whether onnxruntime turns the unit-domain QDQ convolution into a QLinearConv that computes quantopt's integers:
    its float32 requantization is exact (`qlinear_requant_is_exact`), the weights are uint8 with one zero point
    (`kernel_weights`: QLinearConv refuses several, and its u8·u8 accumulation is exact on every CPU), and no Clip
    sits between the Conv and its QuantizeLinear (which would stop the fusion and leave a float32 convolution)."""
    x, y = node.inputs[0], node.outputs[0]
    if kernel_weights(g, node) is None or (quant_of(node).get(y).qbits or 8) > 8 or not qlinear_requant_is_exact(node):
        return False
    p = g.qparams(y)
    if g.qparams(x).dtype != p.dtype:  # QLinearConv takes one activation type for input and output
        return False
    lo, hi = fused_activation_bounds(node)
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return False
    full = p.dtype.int_range()
    return (p.qmin, p.qmax) == full and lo + p.offset <= full[0] and hi + p.offset >= full[1]


def integer_kernel(g: QDQGraph, node: PyNode, group: int) -> bool:
    """ConvInteger / MatMulInteger (int32 accumulation of the input and weight integers, onnxruntime's integer
    GEMM), then the bias and M · 2^-N in float64 and Round: exact where QLinearConv's float32 requantization is not
    (`qlinear_requant_is_exact`). Needs uint8 inputs and weights that fit uint8 with one zero point
    (`kernel_weights`, u8·u8: exact on every CPU); False otherwise."""
    x = node.inputs[0]
    kernel = kernel_weights(g, node)
    ratio = exact.exact_ratio(node)
    if ratio is None or kernel is None or g.qparams(x).dtype != Dtype.UINT8 \
            or node.params.get("remain_shift") is not None:
        return False
    e, c = kernel
    w_zp = g.const(f"{node.name}/weights_zero_point", np.array(c, dtype=np.uint8))
    x_zp = g.zero_point(x)
    bias = g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64))
    if str(node.type) == "FullyConnected":
        weights = g.const(f"{node.name}/weights", _uint8_layout(e, c, (1, 0)))
        acc = g.add("MatMulInteger", [g.int_value(x), weights, x_zp, w_zp])
        perm, channel_shape = None, None
    else:
        cf = channels_first(4)
        weights = g.const(f"{node.name}/weights", _uint8_layout(e, c, (0, 3, 1, 2)))
        pads = [int_or(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right")]
        acc = g.add("ConvInteger", [g.int_value(x, cf), weights, x_zp, w_zp],
                    kernel_shape=[int(e.shape[1]), int(e.shape[2])],
                    strides=[int_or(node, "stride_y", 1), int_or(node, "stride_x", 1)],
                    dilations=[int_or(node, "dilation_y", 1), int_or(node, "dilation_x", 1)], pads=pads, group=group)
        perm, channel_shape = cf, (-1, 1, 1)
        bias = g.add("Reshape", [bias, g.ints(f"{node.name}/bias_shape", [-1, 1, 1])])
    total = g.add("Add", [g.add("Cast", [acc], to=exact.DOUBLE), bias])
    exact.requantize(g, node, total, ratio, perm, fused_activation_bounds(node),
                     channel_shape=channel_shape if ratio.size > 1 else None)
    return True


def _uint8_layout(e: np.ndarray, c: int, axes: Tuple[int, ...]) -> np.ndarray:
    """(e + c) as uint8 (`kernel_weights`: every value fits), transposed to `axes` and contiguous. Narrowed before
    the transposing copy, which then moves one byte per weight instead of eight (a VGG-size FullyConnected: 2 s
    less)."""
    narrow = e.astype(np.uint8)  # e mod 256; adding c mod 256 with uint8 wrap-around gives e + c, within [0, 255]
    narrow += np.uint8(c % 256)
    return np.ascontiguousarray(narrow.transpose(axes))


def conv_double(g: QDQGraph, node: PyNode, group: int, force: bool = False) -> bool:
    """Σ over kernel positions of (strided slice of the padded codes) · weights, in NHWC float64: a MatMul with
    the block-diagonal [C, O] matrix of the position, or for one input channel per group (depthwise) a Gather of
    each output's channel times its weights; then bias and requantization (exact, see `_wide_double_mac`)."""
    x, y = node.inputs[0], node.outputs[0]
    w = effective_weights(node).numpy()  # [O, kh, kw, C/group]
    out_c, kh, kw, per_group = w.shape
    ratio = wide_double_mac(g, node, kh * kw * per_group, force)
    if ratio is None:
        return False
    in_c, oh, ow = int(x.ir_shape[3]), int(y.ir_shape[1]), int(y.ir_shape[2])
    sy, sx = int_or(node, "stride_y", 1), int_or(node, "stride_x", 1)
    dy, dx = int_or(node, "dilation_y", 1), int_or(node, "dilation_x", 1)
    top, left, bottom, right = (int_or(node, k, 0) for k in ("pad_top", "pad_left", "pad_bottom", "pad_right"))
    codes = exact.codes(g, x)
    if top or left or bottom or right:
        codes = g.add("Pad", [codes, g.ints(f"{node.name}/pads", [0, top, left, 0, 0, bottom, right, 0])])
    total = window_sums(g, node, codes, w, in_c, group, (oh, ow), (sy, sx), (dy, dx))
    bias = input_folded_bias(node, x).astype(np.float64)
    total = g.add("Add", [total, g.const(f"{node.name}/bias", bias)])
    exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
    return True


def fully_connected_double(g: QDQGraph, node: PyNode, force: bool = False) -> bool:
    x = node.inputs[0]
    w = effective_weights(node).numpy()  # [O, K]
    ratio = wide_double_mac(g, node, int(w.shape[1]), force)
    if ratio is None:
        return False
    product = g.add("MatMul", [exact.codes(g, x), g.const(f"{node.name}/weights", w.T.astype(np.float64))])
    total = g.add("Add", [product, g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64))])
    exact.requantize(g, node, total, ratio, None, fused_activation_bounds(node))
    return True
