"""Float helpers shared by several operator families (op modules import only this, never each other)."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..graph.memo import Same, memo
from ..graph.node import PyNode
from ..graph.wide_values import wide_values_of
from ..registry.schema import DtypeName, Float, Int, IntValued, Param, Text, quantized
from ._permute import permuted_copy

FUSED_ACTIVATIONS = ("NONE", "RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU")

FUSED_ACTIVATION_PARAMS = {
    "with_activation": Param(Text(choices=FUSED_ACTIVATIONS), "fused activation of the output", default="NONE"),
    "clip_min": Param(Float(infinite=True), "lower bound of a fused CLIP"),
    "clip_max": Param(Float(infinite=True), "upper bound of a fused CLIP"),
    "negative_slope": Param(Float(), "slope of a fused LEAKYRELU (a fused PRELU reads a constant of this name)"),
    "negative_slope_value": Param(Float(), "slope of a fused LEAKYRELU without negative_slope (default 0.01); "
                                           "quantized: the integer slope over 2^negative_slope_shift"),
    "negative_slope_type": Param(DtypeName(), "dtype of negative_slope_value (the Parser writes float32; quantized: "
                                              "the smallest integer type holding it)"),
    "negative_slope_shift": quantized(Int(), "fraction bits of a fused LEAKYRELU's integer slope (default: the output "
                                             "bits) or of a fused PRELU's (12)"),
}
"""The declared keys of a fused activation (`apply_fused_activation`), for the declarations of the layers that
fuse one."""

FUSED_ACTIVATION_CONSTANTS = {"negative_slope": "a fused PRELU's slopes, broadcast to the output (quantized: int16 "
                                                "codes at negative_slope_shift)"}
"""The constant of a fused PRELU, for the same declarations."""

MAC_QUANTIZED_PARAMS = {
    "weights_scale": quantized(Float(), "per-tensor weight scale (per channel: a constant of this name)"),
    "weights_zp": quantized(IntValued(), "per-tensor weight zero point (per channel: a constant of this name; 0.0 "
                                         "in an fp8 layer)"),
    "biases_scale": quantized(Float(), "bias scale s_in * s_w (per channel: a constant of this name)"),
    "biases_zp": quantized(Int(), "bias zero point, 0 (per channel: a constant of this name)"),
    "remain_shift": quantized(Int(), "shift applied before the 32-bit hand-over of wide accumulators"),
}
"""The declared keys the shared MAC quantization (`_quant.quantize_mac`) writes."""

REQUANT_CONSTANTS = {"scale": "per-channel requantization multipliers (quantized)",
                     "shift": "per-channel requantization shifts (quantized)"}
"""The constants of a per-channel requantization."""


def unrounded_input(node: PyNode, index: int = 0) -> torch.Tensor:
    """Input `index` as the float forward's readers of unrounded values take it: the float64 value its producer
    kept before rounding (a Convolution/DepthwiseConv without fused activation), else its value.

    Upstream's float forward accumulates convolutions in float64 and hands that result on unrounded to the
    convolutions and PReLU that read it, while every other layer reads float32; calibrated ranges match upstream's
    only with the same flow (docs/architecture.md, "Float reference")."""
    t = node.inputs[index]
    if not node.quantized:
        table = wide_values_of(node)
        wide = table.get(t) if table is not None else None
        if wide is not None:
            return wide
    return t.betensor


def float_biases(node: PyNode, count: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The `biases` constant as a flat [count] tensor of `like`'s dtype and device (None when absent); a bias of
    another size is an IR error naming the layer."""
    t = node.get_constant("biases", optional=True)
    if t is None:
        return None
    b = t.betensor.to(device=like.device, dtype=like.dtype)
    if b.numel() != count:
        raise node._error(f"biases must have {count} elements (one per output channel), got shape {list(b.shape)}")
    return b.reshape(count)


def keep_unrounded(node: PyNode, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Output 0 of a float forward: `value` rounded to `dtype`, with `value` itself kept for `unrounded_input`
    when it is wider (in the graph's wide values: a layer run outside a graph keeps none)."""
    out = node.outputs[0]
    out.betensor = value.to(dtype)
    table = wide_values_of(node)
    if table is not None:
        table.keep(out, value if value.dtype != dtype else None)


ROUNDING_FUSED_ACTIVATIONS = ("RELU",)
"""Fused activations whose float result upstream rounds to float32 whatever the layer computed in: its ReLU
converts to float32; RELU6, CLIP, LEAKYRELU and PRELU keep their input's float type."""


def keeps_float64(when: Optional[Callable[[PyNode], bool]] = None) -> Callable[[Callable[[PyNode], None]],
                                                                            Callable[[PyNode], None]]:
    """Decorator of a float forward that upstream computes in its input's float type (layout moves, Concat, Pad,
    BatchNorm, CLIP/RELU6/LEAKYRELU/PRELU, Negative; `when`: only for the layers it accepts). Where an input has
    a wide value (`unrounded_input`), the layer runs on the float64 inputs (float32 ones promoted, as torch does)
    and each float64 output is rounded to the inputs' float type with the float64 value kept for its readers, so
    a convolution two layout moves away still reads what upstream's does (docs/architecture.md, "Float
    reference"). A fused RELU rounds as upstream's does. Without wide inputs the forward runs as it is."""
    def wrap(fn: Callable[[PyNode], None]) -> Callable[[PyNode], None]:
        @functools.wraps(fn)
        def forward(node: PyNode) -> None:
            table = None if node.quantized or (when is not None and not when(node)) else wide_values_of(node)
            wides = [table.get(t) for t in node.inputs] if table is not None else []
            if not any(w is not None for w in wides):
                fn(node)
                return
            saved = [t.betensor for t in node.inputs]
            rounded, wide = next((v.dtype, w.dtype) for v, w in zip(saved, wides) if w is not None)
            try:
                for t, w in zip(node.inputs, wides):
                    if w is not None:
                        t.betensor = w
                    elif t.betensor.is_floating_point():
                        t.betensor = t.betensor.to(wide)
                fn(node)
            finally:
                for t, v in zip(node.inputs, saved):
                    t.betensor = v
            act = str(node.params.get("with_activation", "NONE")).upper()
            for out in node.outputs:
                value = out.betensor
                if value.dtype == rounded or not value.is_floating_point():
                    continue
                out.betensor = value.to(rounded)
                table.keep(out, None if act in ROUNDING_FUSED_ACTIVATIONS else value)
        return forward
    return wrap



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
            value = float(node.get_param("negative_slope"))
            slope = torch.tensor(value, dtype=x.dtype, device=x.device)
            kernel = PreluKernel(slope.reshape(1), math.copysign(1.0, value) < 0) \
                if math.isfinite(value) and _prelu_kernel_applies(x, slope) else None
        else:
            slope = _slope_as(node, slope_t.betensor, x)
            kernel = _prelu_kernel(node, slope, x)
        if kernel is not None:
            return kernel(x)
        if slope.dim() == x.dim() and slope.shape[0] == 1 and x.shape[0] != 1:
            slope = slope.expand_as(x) if slope.shape[1:] == x.shape[1:] else slope
        return torch.where(x >= 0, x, x * slope)
    raise node._error(f"unsupported fused activation '{act}' (supported: {', '.join(FUSED_ACTIVATIONS)})")


class PreluKernel:
    """`where(x >= 0, x, x · slope)` of a channels-last `x` by torch's vectorized `F.prelu` (`x > 0 ? x : slope ·
    x`), bit for bit: `weight` is one slope or a row of one per channel (last axis), all finite. The two forms
    differ only where x is ±0 and the slope has its sign bit set (`signed`): `F.prelu` then gives the zero of the
    other sign, so where the result holds a zero at all (`count_nonzero`, rare in a real activation) those positions
    take x's own zero. Why: torch's `where` costs about 4 ns an element on a CPU (a branch per element), `F.prelu`
    and `count_nonzero` one vectorized pass each; MTCNN's PReLU layers took 5-10x less time."""

    def __init__(self, weight: torch.Tensor, signed: bool) -> None:
        self.weight = weight
        self.signed = signed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.numel() == 1:
            y = F.prelu(x, self.weight)
        else:
            y = F.prelu(x.movedim(-1, 1), self.weight).movedim(1, -1)
        if self.signed and int(torch.count_nonzero(y)) != y.numel():
            y = torch.where(x == 0, x, y)
        return y


def _prelu_kernel(node: PyNode, slope: torch.Tensor, x: torch.Tensor) -> Optional[PreluKernel]:
    """A `PreluKernel` for the PRELU slopes `slope` (in `x`'s dtype and device) where it applies: one slope, or one
    row [C] that the constant repeats over its other axes (the Parser writes per-channel slopes as [1, H, W, C]);
    None where the `where` form stays: a gradient-based forward, an `x` of fewer than two axes, slopes that vary
    along another axis or that are not all finite (0 · inf is NaN in one form only). Memoized per layer while the
    slopes are the same tensor at the same version (graph/memo.py)."""
    if not _prelu_kernel_applies(x, slope):
        return None
    channels = int(x.shape[-1])

    def build() -> Optional[PreluKernel]:
        if not bool(torch.isfinite(slope).all()):
            return None
        signed = bool(torch.signbit(slope).any())
        if slope.numel() == 1:
            return PreluKernel(slope.reshape(1), signed)
        if slope.dim() == 0 or int(slope.shape[-1]) != channels:
            return None
        rows = slope.reshape(-1, channels)
        # == leaves 0.0 and -0.0 alike: the sign bits must agree too
        same = (rows == rows[0]) & (torch.signbit(rows) == torch.signbit(rows[0]))
        return PreluKernel(rows[0].contiguous(), signed) if bool(same.all()) else None
    return memo(node, "prelu_kernel", (Same(slope), channels), build)


def _prelu_kernel_applies(x: torch.Tensor, slope: torch.Tensor) -> bool:
    """Whether `F.prelu` may replace `where` for this input at all (`_prelu_kernel`): `x` has two axes or more, the
    slopes broadcast into its shape without growing it, and no gradient is wanted."""
    if x.dim() < 2 or slope.dim() > x.dim() or (torch.is_grad_enabled() and (x.requires_grad or slope.requires_grad)):
        return False
    return all(s == 1 or s == d for s, d in zip(reversed(slope.shape), reversed(x.shape)))


def _slope_as(node: PyNode, slope: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A PRELU slope constant in `x`'s dtype, memoized per layer while the constant is the same tensor at the same
    version (graph/memo.py): the float forward reads it in float64 on every run."""
    if torch.is_grad_enabled() and slope.requires_grad:
        return slope.to(x.dtype)
    return memo(node, "prelu_slope", (Same(slope), x.dtype), lambda: slope.to(x.dtype))


def broadcast_shape(shapes: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """numpy's broadcast of `shapes` (ValueError when they do not broadcast), in plain Python: the per-layer check
    runs every forward, and torch.broadcast_shapes costs far more than this for a few short shapes."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for i, d in enumerate(shape, start=rank - len(shape)):
            d = int(d)
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)


def axis_param(node: PyNode, axis: Any, rank: int) -> int:
    """`axis` as a non-negative dim of a rank-`rank` tensor; a bad value is an IR error naming the layer."""
    try:
        if isinstance(axis, bool) or (isinstance(axis, float) and not axis.is_integer()):
            raise ValueError(axis)
        value = int(axis)
    except (TypeError, ValueError):
        raise node._error(f"axis must be an integer, got {axis!r}") from None
    if not -rank <= value < rank:
        raise node._error(f"axis {value} is out of range for a {rank}-D input")
    return value % rank


MISSING: Any = object()
"""`int_param`'s default for a required param (None is a real default: an absent param reads as None)."""


def int_param(node: PyNode, key: str, default: Any = MISSING, minimum: int = 1) -> Optional[int]:
    """Integer param `key` (required unless a default is given), checked against `minimum`; a bad value is an IR
    error naming the layer. None when the value is None (an absent param whose default is None: the caller derives
    it, e.g. a kernel size from the weights)."""
    value = node.get_param(key, optional=default is not MISSING,
                           default_value=None if default is MISSING else default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    if int(value) < minimum:
        raise node._error(f"parameter '{key}' must be >= {minimum}, got {value}")
    return int(value)


def bool_param(node: PyNode, key: str, default: bool) -> bool:
    """Boolean param; the IR reader gives bools, hand-built graphs may use 0/1 or 'true'/'false'."""
    value: Any = node.get_param(key, optional=True, default_value=default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise node._error(f"parameter '{key}' must be true or false, got {value!r}")


def upstream_layout(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """`x` with the memory layout upstream's float forward hands this layer: a Transpose or Permute there returns
    a permuted view of its input, and a reduction walks a view in its memory order, so a float32 sum after one rounds
    as over the untransposed tensor. quantopt's Transpose writes a contiguous tensor; the same values are given here
    that view's strides again. Any other producer: `x` itself."""
    producer = node.inputs[0].pnode if node.inputs else None
    if producer is None or str(producer.type) not in ("Transpose", "Permute"):
        return x
    raw = producer.params.get("perm")
    perm = [int(p) for p in raw] if isinstance(raw, (list, tuple)) else list(reversed(range(x.dim())))
    if sorted(perm) != list(range(x.dim())):
        return x
    inverse = [perm.index(d) for d in range(len(perm))]
    return permuted_copy(x, inverse).permute(*perm)
