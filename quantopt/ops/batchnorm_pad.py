"""BatchNorm (per-channel affine) and Pad: float forward, quantization and exact integer forward.

Quantized BatchNorm is a per-channel multiply-accumulate (one weight per channel, like a 1x1 DepthwiseConv), with
16-bit weights by default as upstream; Pad keeps its input's quantization and pads with integers
(docs/integer-semantics.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..config.layer_settings import default_bn_weight_bits
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..quant.hardware import BN_WEIGHT_BITS
from ..quant.params import quantize
from ..quant.requant import int64_to_float64
from ..registry import declare_op
from ..registry.schema import Float, Int, Param, Text, Value
from ._quant import (
    check_quantized_inputs,
    copy_params,
    effective_weights,
    fused_activation_bounds,
    int_value,
    layer_settings,
    mac_finish,
    out_range,
    quantize_mac,
    scaled_product_finish,
    set_constant,
    tensor_scale,
    tensor_zp,
)
from ._shared import FUSED_ACTIVATION_PARAMS, MAC_QUANTIZED_PARAMS, apply_fused_activation, axis_param, keeps_float64
from .onnx_build import exact as onnx_exact
from .onnx_build.mac import bias_value, input_folded_bias, qdq_fused_activation, weight_onnx_scale, weight_value
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import ONNX_INT_TYPES, QDQGraph, node_error, require_same


def _int_value(node: PyNode, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must hold integers, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------- BatchNorm
BATCHNORM = declare_op(
    "BatchNorm",
    params={"axis": Param(Int(), "the channel axis", default=-1),
            "epsilon": Param(Float(), "added to var when the mean and var constants are present (informative in the "
                                      "folded form the Parser writes)"),
            **FUSED_ACTIVATION_PARAMS,
            **MAC_QUANTIZED_PARAMS},
    constants={"weights": "gamma/sqrt(var+eps), [C]", "biases": "[C], absent means zero",
               "mean": "optional, with var: applied first as (x - mean) / sqrt(var + epsilon)", "var": "with mean",
               "scale": "per-channel requantization multipliers (quantized)",
               "shift": "per-channel requantization shifts (quantized)"},
    integer="per-channel quantized weight times (x + zp) plus bias, multiplier and shift",
    semantics="integer-semantics.md#batchnorm")


def _channel_vector(node: PyNode, key: str, channels: int, like: torch.Tensor, required: bool):
    t = node.get_constant(key, optional=not required)
    if t is None:
        return None
    v = t.betensor.to(device=like.device, dtype=like.dtype)
    if v.numel() != channels:
        raise node._error(f"constant '{key}' must have {channels} elements (one per channel of the BatchNorm axis), "
                          f"got shape {list(v.shape)}")
    return v.reshape(channels)


def _bn_axis(node: PyNode, rank: int) -> int:
    axis = _int_value(node, "axis", node.get_param("axis", optional=True, default_value=-1))
    if not -rank <= axis < rank:
        raise node._error(f"axis={axis} is out of range for a rank-{rank} input")
    return axis % rank


@BATCHNORM.forward
@keeps_float64()
def batchnorm_forward(self: PyNode) -> None:
    """y = x * weights + biases along `axis` (default last), the folded form the Parser writes; its `epsilon`
    is informative there. If `mean` and `var` constants are present they are applied first:
    (x - mean) / sqrt(var + epsilon)."""
    if self.quantized:
        self.outputs[0].betensor = _batchnorm_int(self)
        return
    x = self.inputs[0].betensor
    x = x.to(x.dtype if x.is_floating_point() else torch.float32)
    if x.dim() < 1:
        raise self._error("BatchNorm needs an input of rank >= 1")
    axis = _bn_axis(self, x.dim())
    channels = int(x.shape[axis])
    view = [channels] + [1] * (x.dim() - 1 - axis)
    w = _channel_vector(self, "weights", channels, x, True).reshape(view)
    b = _channel_vector(self, "biases", channels, x, False)
    mean = _channel_vector(self, "mean", channels, x, False)
    var = _channel_vector(self, "var", channels, x, False)
    if (mean is None) != (var is None):
        raise self._error("constants 'mean' and 'var' must be given together")
    if mean is not None:
        eps = float(self.get_param("epsilon"))
        x = (x - mean.reshape(view)) / torch.sqrt(var.reshape(view) + eps)
    y = x * w
    if b is not None:  # y is a new tensor of this function's: the same rounded sum, written into it
        y = y.add_(b.reshape(view)) if not y.requires_grad and y.dtype == torch.promote_types(y.dtype, b.dtype) \
            else y + b.reshape(view)
    self.outputs[0].betensor = apply_fused_activation(self, y)


def _batchnorm_int(node: PyNode) -> torch.Tensor:
    """acc[..., c] = x_q[..., c] * (w_q[c] + zp_w[c]) exactly (input zero point folded into the biases), then the
    MAC requantization (bias, per-channel multiplier/shift, clamp) with the channel axis moved last."""
    x = int_value(node.inputs[0])
    if x.dim() < 1:
        raise node._error("BatchNorm needs an input of rank >= 1")
    axis = _bn_axis(node, x.dim())
    channels = int(x.shape[axis])
    w = effective_weights(node).reshape(-1)
    if w.numel() != channels:
        raise node._error(f"constant 'weights' must have {channels} elements (one per channel of the BatchNorm "
                          f"axis), got {w.numel()}")
    fast = scaled_product_finish(node, x.movedim(axis, -1))
    if fast is not None:  # the product, bias and scaling in one multiply-add (the same integers)
        return fast.movedim(-1, axis).contiguous()
    # |x| <= 2^31 and |w| <= 2^16 (weights of at most 16 bits plus zero point): the product is below 2^47, exact in
    # float64 (faster than int64 arithmetic and its conversion)
    # one new float64 map, multiplied and requantized in place (mac_finish, its plan memoized)
    acc = int64_to_float64(x.movedim(axis, -1)).mul_(w.to(torch.float64))
    return mac_finish(node, acc, owned=True).movedim(-1, axis).contiguous()


def _set_extrema_ranges(node: PyNode, w) -> None:
    """Per-tensor and per-channel ranges of a 1-D weight vector from its values (each containing 0)."""
    values = w.betensor.reshape(-1)
    table = ranges_of(node)
    table.set(w, min(float(values.min()), 0.0), max(float(values.max()), 0.0))
    table.set_channels(w, torch.clamp(values, max=0.0), torch.clamp(values, min=0.0))


def _prepare_affine(node: PyNode) -> None:
    """Bring the constants to the plain per-channel affine form the MAC quantization expects: optional
    `mean`/`var` folded in (w' = w / sqrt(var + eps), b' = b - mean * w'), weights as a 1-D [C] vector. Weights
    changed here get extrema ranges (the calibrated ones described other values or another layout)."""
    w = node.get_constant("weights")
    mean, var = node.get_constant("mean", optional=True), node.get_constant("var", optional=True)
    if (mean is None) != (var is None):
        raise node._error("constants 'mean' and 'var' must be given together")
    if mean is not None:
        eps = float(node.get_param("epsilon"))
        folded = w.betensor.to(torch.float64).reshape(-1) / torch.sqrt(var.betensor.to(torch.float64).reshape(-1)
                                                                         + eps)
        b = node.get_constant("biases", optional=True)
        b64 = b.betensor.to(torch.float64).reshape(-1) if b is not None else torch.zeros_like(folded)
        bias = (b64 - mean.betensor.to(torch.float64).reshape(-1) * folded).to(torch.float32)
        if b is None:
            set_constant(node, "biases", bias, w.dtype)
        else:
            b.betensor = bias.reshape(b.betensor.shape)
        w.betensor = folded.to(torch.float32)
        del node.constants["mean"], node.constants["var"]
    if w.betensor.dim() != 1 or mean is not None:
        w.betensor = w.betensor.reshape(-1)
        w.ir_shape = (w.betensor.numel(),)  # written 1-D, so a re-loaded IR sees the same layout
        _set_extrema_ranges(node, w)


def bn_weight_bits(node: PyNode) -> int:
    """The layer's q_bits_weight when set for the layer itself or when the layer was a Mul (passes/mul_to_batchnorm.py),
    else max(16, q_bits_weight): upstream's 16-bit BatchNorm default (a graph quantized with settings resolved from a
    cfg already carries it)."""
    s = layer_settings(node)
    if "q_bits_weight" in s.explicit or not default_bn_weight_bits(node):
        return int(s.q_bits_weight)
    return max(BN_WEIGHT_BITS, int(s.q_bits_weight))


@BATCHNORM.quantize
def batchnorm_quantize(self: PyNode) -> None:
    """MAC quantization with one weight per channel (16-bit by default, biases with scale s_in * s_w and the input
    zero point folded): weights per channel with per-channel multipliers under one shared shift when `q_mode_weight`
    is per channel, else one weight scale and one multiplier/shift pair, as upstream's `linear_op_quantize`.
    BatchNorm is not an upstream `remain_shift` op, so that setting is ignored here."""
    check_quantized_inputs(self, self.inputs[:1])
    _prepare_affine(self)
    original = layer_settings(self)
    self.settings = dataclasses.replace(original, q_bits_weight=bn_weight_bits(self), remain_shift=None)
    try:
        quantize_mac(self, per_channel=original.q_mode_weight.startswith("per_channel"))
    finally:
        self.settings = original


# --------------------------------------------------------------------------------------------- Pad
PAD_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC", "EDGE")

PAD = declare_op(
    "Pad",
    params={"pads": Param(Value("[[before, after]] per axis or the flat ONNX list"),
                          "the Parser's pairs per axis (NHWC order), or ONNX's [b0, b1, ..., e0, e1, ...]; not "
                          "negative", required=True),
            "mode": Param(Text(choices=PAD_MODES), "how the border is filled", default="CONSTANT"),
            "constant_value": Param(Float(infinite=True), "the CONSTANT fill value (quantized: its integer)",
                                    default=0),
            "scale": Param(Value(), "written by some Parser versions; not read")},
    dtypes="any; quantized output keeps the input's params",
    integer="passthrough; constant pad value quantized with the input params",
    semantics="integer-semantics.md#pad")


def pad_pairs(node: PyNode, pads: Any, rank: int) -> List[Tuple[int, int]]:
    """`pads` as one (before, after) pair per input axis.

    Accepts the Parser's nested layout [[b0, e0], [b1, e1], ...] (NHWC axis order) and the flat ONNX layout
    [b0, b1, ..., e0, e1, ...]; either must cover every axis of the input."""
    if not isinstance(pads, (list, tuple)):
        raise node._error(f"parameter 'pads' must be a list, got {pads!r}")
    if pads and all(isinstance(p, (list, tuple)) for p in pads):
        if len(pads) != rank or any(len(p) != 2 for p in pads):
            raise node._error(f"pads {pads} must hold {rank} [before, after] pairs for a rank-{rank} input")
        pairs = [(_int_value(node, "pads", p[0]), _int_value(node, "pads", p[1])) for p in pads]
    elif len(pads) == 2 * rank:
        flat = [_int_value(node, "pads", p) for p in pads]
        pairs = list(zip(flat[:rank], flat[rank:]))
    else:
        raise node._error(f"pads {pads} fit neither [[before, after]] * {rank} nor the flat ONNX layout of "
                          f"{2 * rank} values for a rank-{rank} input")
    if any(b < 0 or e < 0 for b, e in pairs):
        raise node._error(f"negative pads (cropping) are not supported: {pads}")
    return pairs


def _source_index(mode: str, size: int, before: int, after: int, device: torch.device) -> torch.Tensor:
    """Index into the unpadded axis for every position of the padded axis (numpy.pad semantics)."""
    i = torch.arange(-before, size + after, device=device)
    if mode == "EDGE" or size == 1:
        return i.clamp(0, size - 1)
    if mode == "REFLECT":
        period = 2 * (size - 1)
        i = i.remainder(period)
        return torch.where(i >= size, period - i, i)
    period = 2 * size  # SYMMETRIC
    i = i.remainder(period)
    return torch.where(i >= size, period - 1 - i, i)


def pad_tensor(x: torch.Tensor, pairs: Sequence[Tuple[int, int]], mode: str, value: float) -> torch.Tensor:
    if mode == "CONSTANT":
        flat: List[int] = []
        for b, e in reversed(pairs):
            flat += [b, e]
        return F.pad(x, flat, mode="constant", value=value)
    padded = _pad_by_slices(x, pairs, mode)
    if padded is not None:
        return padded
    for axis, (b, e) in enumerate(pairs):
        if b or e:
            x = x.index_select(axis, _source_index(mode, int(x.shape[axis]), b, e, x.device))
    return x


def _pad_by_slices(x: torch.Tensor, pairs: Sequence[Tuple[int, int]], mode: str) -> Optional[torch.Tensor]:
    """EDGE/REFLECT/SYMMETRIC padding written into one new tensor: the input copied into its interior, then each
    padded axis' borders copied from the (flipped) rows next to them, the axes before it over their padded
    extent (so corners come out as numpy.pad makes them) and the axes after it over their interior. The same
    values as gathering every axis with `_source_index`, without an index pass per axis (a tenth of its time on a
    [1, 80, 80, 64] map). None where a pad is negative or longer than the axis can mirror (the gather does those)."""
    sizes = [int(d) for d in x.shape]
    for size, (b, e) in zip(sizes, pairs):
        limit = size - 1 if mode == "REFLECT" else size
        if b < 0 or e < 0 or (mode != "EDGE" and max(b, e) > limit):
            return None
    out = x.new_empty([size + b + e for size, (b, e) in zip(sizes, pairs)])
    interior = out
    for axis, (size, (b, _)) in enumerate(zip(sizes, pairs)):
        interior = interior.narrow(axis, b, size)
    interior.copy_(x)
    for axis, (size, (b, e)) in enumerate(zip(sizes, pairs)):
        if not (b or e):
            continue
        v = out
        for later in range(axis + 1, len(sizes)):
            v = v.narrow(later, pairs[later][0], sizes[later])
        if mode == "EDGE":
            before, after = v.narrow(axis, b, 1), v.narrow(axis, b + size - 1, 1)
        elif mode == "REFLECT":
            before, after = v.narrow(axis, b + 1, b).flip(axis), v.narrow(axis, b + size - 1 - e, e).flip(axis)
        else:  # SYMMETRIC
            before, after = v.narrow(axis, b, b).flip(axis), v.narrow(axis, b + size - e, e).flip(axis)
        if b:
            v.narrow(axis, 0, b).copy_(before)
        if e:
            v.narrow(axis, b + size, e).copy_(after)
    return out


@PAD.forward
@keeps_float64()
def pad_forward(self: PyNode) -> None:
    """Pad keeps the input dtype; `constant_value` only matters in CONSTANT mode (the Parser writes it always)."""
    x = self.inputs[0].betensor
    mode = str(self.get_param("mode", optional=True, default_value="CONSTANT")).upper()
    if mode not in PAD_MODES:
        raise self._error(f"unsupported pad mode '{mode}' (supported: {', '.join(PAD_MODES)})")
    pairs = pad_pairs(self, self.get_param("pads"), x.dim())
    value = self.get_param("constant_value", optional=True, default_value=0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise self._error(f"parameter 'constant_value' must be a number, got {value!r}")
    if mode != "CONSTANT" and any(int(x.shape[a]) == 0 for a, (b, e) in enumerate(pairs) if b or e):
        raise self._error(f"mode {mode} cannot pad an empty axis")
    if self.quantized:
        # constant_value already holds the quantized integer (pad_quantize); other modes only move integers
        if mode == "CONSTANT" and int(value) != value:
            raise self._error(f"quantized Pad needs an integer constant_value, got {value!r}")
        qmin, qmax = out_range(self, self.outputs[0])
        y = pad_tensor(int_value(self.inputs[0]), pairs, mode, int(value))
        self.outputs[0].betensor = torch.clamp(y, qmin, qmax)
        return
    self.outputs[0].betensor = pad_tensor(x, pairs, mode, float(value))


@PAD.quantize
def pad_quantize(self: PyNode) -> None:
    """Output params pass through; `constant_value` is replaced by its quantized integer
    clamp(round_half_even(v * scale - zp), qmin, qmax) (upstream), which the integer forward pads with."""
    check_quantized_inputs(self, self.inputs[:1])
    inp, out = self.inputs[0], self.outputs[0]
    copy_params(self, out, inp)
    value = self.get_param("constant_value", optional=True, default_value=0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise self._error(f"parameter 'constant_value' must be a number, got {value!r}")
    qmin, qmax = out_range(self, out)
    q = quantize(torch.tensor(float(value)), tensor_scale(self, inp), tensor_zp(self, inp), qmin, qmax)
    self.params["constant_value"] = int(q)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@PAD.export
def convert_pad(g: QDQGraph, node: PyNode) -> None:
    """Pad of the codes (8-bit; 16-bit through DequantizeLinear/QuantizeLinear, which is exact for unchanged
    params); CONSTANT pads with the stored (quantized) constant_value."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    mode = str(node.get_param("mode", optional=True, default_value="CONSTANT")).upper()
    modes = {"CONSTANT": "constant", "REFLECT": "reflect", "EDGE": "edge"}
    if mode not in modes:
        raise node_error(node, f"pad mode {mode} has no ONNX equivalent (CONSTANT, REFLECT and EDGE do)")
    rank = g.rank(x)
    pairs = pad_pairs(node, node.get_param("pads"), rank)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    pads = [pairs[a][0] for a in perm] + [pairs[a][1] for a in perm]
    value = int(node.get_param("constant_value", optional=True, default_value=0)) if mode == "CONSTANT" else 0
    if y.dtype.bits == 8:  # onnxruntime pads 8-bit integers but not 16-bit ones
        inputs = [g.int_value(x, perm), g.ints(f"{node.name}/pads", pads)]
        if mode == "CONSTANT":
            p = g.qparams(y)
            inputs.append(g.const(f"{node.name}/value", np.array(value + p.offset, dtype=ONNX_INT_TYPES[p.dtype][1])))
        g.set_int(y, g.add("Pad", inputs, mode=modes[mode]), perm)
        return
    inputs = [g.float_value(x, perm), g.ints(f"{node.name}/pads", pads)]
    if mode == "CONSTANT":  # the dequantized pad integer: QuantizeLinear gives the integer back
        p = g.qparams(y)
        inputs.append(g.const(f"{node.name}/value", np.array((value - p.zero_point) * np.float32(p.scale),
                                                              dtype=np.float32)))
    g.quantize(y, g.add("Pad", inputs, mode=modes[mode]), perm, lossless=True)


@BATCHNORM.export
def convert_batchnorm(g: QDQGraph, node: PyNode) -> None:
    """x · w + b along `axis`, in whichever layout the input already has."""
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=-1), rank)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    pos = perm.index(axis)
    shape = (-1,) + (1,) * (rank - 1 - pos)
    ratio = onnx_exact.exact_ratio(node) if g.unit_domain else None
    if ratio is not None:  # x' · (w + zp_w) + b per channel, requantized per channel, in float64
        w_eff = effective_weights(node).reshape(-1).numpy().astype(np.float64)
        acc = g.add("Add", [g.add("Mul", [onnx_exact.codes(g, x, perm), g.const(f"{node.name}/weights",
                                                                                w_eff.reshape(shape))]),
                            g.const(f"{node.name}/bias", input_folded_bias(node, x).astype(np.float64).reshape(shape))])
        onnx_exact.requantize(g, node, acc, ratio, perm, fused_activation_bounds(node),
                              channel_shape=shape if ratio.size > 1 else None)
        return
    w_q = node.get_constant("weights").betensor.to(torch.int64).reshape(-1).numpy()
    scale = weight_onnx_scale(g, node, x, y)
    w = weight_value(g, node, w_q.reshape(shape), scale, axis=0)
    b = bias_value(g, node, x, scale, shape=shape)
    out = g.add("Add", [g.add("Mul", [g.float_value(x, perm), w]), b])
    g.quantize(y, qdq_fused_activation(g, node, out), perm)
