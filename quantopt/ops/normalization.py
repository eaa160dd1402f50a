"""Normalization layers: LayerNorm, GroupNorm, InstanceNorm, RMSNorm, MVN, LRN and Normalization (L2).

Float forwards follow the ONNX/PyTorch definitions in the IR's channels-last layout, summed in upstream's float32
order. Quantized (docs/semantics/normalization.md), LayerNorm, GroupNorm and InstanceNorm take upstream's integer
form by default (rounded integer mean, an int16 inverse square root table, the normalized tensor at the activation
bits, gamma/beta quantized as a linear layer's weights/biases). Their exact form, and RMSNorm and MVN always: the mean
and sum of squares of the zero-point-corrected input are exact int64 values, the inverse square root is an integer
routine (normalize the sum of squares by an even shift, one integer division and one integer square root), the
normalized tensor is a 16-bit symmetric intermediate, and gamma/beta are quantized as per-element weights/biases with
one multiplier/shift each. LRN reads (bias + alpha/size * Σx²)^-beta from a 16-bit-indexed table.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..calibration.collect import weight_statistics
from ..calibration.strategies import apply_strategy
from ..errors import UnsupportedError
from ..graph.memo import Same, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.given import GIVEN_PARAMS
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.lut import lookup_lut
from ..quant.params import QuantMode, integer_range, linear_quant_params, quantize
from ..quant.requant import bias_quantize, range_dtype, requantize_float64_, requantize_int, scale_shift
from ..quant.rounding import FLOAT64_EXACT, bit_length, div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Axis, Bool, DtypeName, Float, Int, Ints, Param, Text, quantized
from ..threads import one_thread
from ._eltwise_int import offset_absmax
from ._float_sum import block_row_sum, channel_row_sum
from ._lut_int import ceil_log2, int_input, range_bits
from ._quant import (
    activation_mode,
    effective_weights,
    insert_keys_after,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    quantize_activation,
    quantize_mac,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_params,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param
from .onnx_build.exact import (
    DOUBLE,
    INT64,
    MAX_EXACT_SHIFT,
    bit_length_int64,
    codes,
    exact_ratio,
    fits_double,
    isqrt_int64,
    requantize,
    round_div_int64,
)
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import QDQGraph, node_error, requant_ratio

NORM_BITS = 16
"""Bits of the internal normalized tensor (symmetric, restricted range [-32767, 32767]) whatever the activation
bits: it carries (x - mean)/std into the gamma/beta stage without an 8-bit bottleneck."""

NORM_MEAN_FRAC_BITS = 8
"""Fraction bits kept on the integer mean (fewer when the sum of squares would not fit 62 bits)."""

SUM_SQUARES_BITS = 62
"""Bound on every sum of squares (plus the epsilon term) of the integer forward: int64 with one bit of headroom."""

RSQRT_NORM_BITS = 30
"""The inverse square root normalizes its argument by an even shift into [2^28, 2^30)."""

RSQRT_NUMERATOR_BITS = 62
"""... then R = isqrt(floor(2^62 / Qn)), so R lies in [2^16, 2^17] and 1/sqrt(Q) = R * 2^-(31 + t/2)."""

RSQRT_FRAC_BITS = RSQRT_NUMERATOR_BITS // 2

LRN_INDEX_BITS = 16
"""LRN requantizes alpha/size * Σx² to an unsigned 16-bit table index (upstream's LRN LUT input)."""

LRN_VALUE_BITS = 16
"""LRN table values (bias + A)^-beta are unsigned 16-bit."""

NORMALIZATION_EPSILON = 1e-12
"""Default `epsilon` of Normalization: the squared norm is clamped from below by it (upstream)."""

LRN_METHODS = ("ACROSS_CHANNELS", "WITHIN_CHANNEL")


# ===================================================================== LayerNorm, GroupNorm, InstanceNorm, RMSNorm, MVN
_NORM_INT = ("exact int64 mean and sum of squares, integer inverse square root, 16-bit normalized tensor, "
             "gamma/beta as per-element weights/biases with per-element multiplier/shift")
_NORM_SEM = "docs/semantics/normalization.md"
_UPSTREAM = "written by the Parser or upstream's Optimizer; not read"


def _norm_params(axis: Param, **extra: Param) -> Dict[str, Param]:
    """The layer keys of a normalization type: its `axis`, `epsilon`, the integer keys its quantization writes, and
    the type's `extra` keys."""
    return {
        "axis": axis,
        "epsilon": Param(Float(), "added to the variance (RMSNorm: to the mean square)"),
        **extra,
        "norm_frac_bits": quantized(Int(lo=0), "fraction bits kept on the integer mean"),
        "eps_value": quantized(Float(), "integer epsilon term of the sum of squares (an int64 integer: may exceed "
                                        "2^31)"),
        "norm_scale_value": quantized(Int(), "multiplier of the 16-bit normalized tensor"),
        "norm_scale_type": quantized(DtypeName(), "dtype of norm_scale_value"),
        "norm_shift_value": quantized(Int(), "shift of the 16-bit normalized tensor"),
        "norm_shift_type": quantized(DtypeName(), "dtype of norm_shift_value"),
    }


_NORM_CONSTANTS = {"weights": "gamma, optional", "biases": "beta, optional",
                   "scale": "per-element requantization multipliers (quantized, with weights)",
                   "shift": "per-element requantization shifts (quantized, with weights)"}
_UPSTREAM_LUT = {"lut": "upstream's inverse square root table; not read"}
_LAYOUT_KEYS = {"axis_shape": Param(Ints(), _UPSTREAM), "scale_shift_shape": Param(Ints(), _UPSTREAM)}
_NOT_MVN_KEYS = {"group": Param(Int(lo=0), _UPSTREAM), "normalize_variance": Param(Bool(), _UPSTREAM)}

_LN_UPSTREAM_KEYS = {
    "var_shift_value": quantized(Int(), "upstream form, 8 bits: right shift of the sum of squares"),
    "var_shift_type": quantized(DtypeName(), "dtype of var_shift_value"),
}
_UPSTREAM_FORM_LUT = {"lut": "upstream form: the int16 inverse square root table (193 entries)"}
_UPSTREAM_FORM_INT = ("upstream form (default): rounded mean, inverse square root table, normalized tensor at the "
                      "activation bits, gamma/beta as weights/biases with one multiplier/shift (per channel with "
                      "per-channel weights); exact form (layernorm_integer_form = exact): " + _NORM_INT)
LAYERNORM = declare_op(
    "LayerNorm",
    params=_norm_params(Param(Axis(), "the normalized axes", default=[-1]), **_LAYOUT_KEYS, **_NOT_MVN_KEYS,
                        **_LN_UPSTREAM_KEYS),
    constants={**_NORM_CONSTANTS, **_UPSTREAM_FORM_LUT}, integer=_UPSTREAM_FORM_INT,
    semantics=f"{_NORM_SEM}#layernorm")

GROUPNORM = declare_op(
    "GroupNorm",
    params=_norm_params(Param(Int(), "the channel axis", default=-1),
                        group=Param(Int(lo=1), "channel groups; divides the channels", required=True),
                        normalize_variance=Param(Bool(), _UPSTREAM), **_LAYOUT_KEYS, **_LN_UPSTREAM_KEYS),
    constants={**_NORM_CONSTANTS, **_UPSTREAM_FORM_LUT}, integer=_UPSTREAM_FORM_INT,
    semantics=f"{_NORM_SEM}#groupnorm")

INSTANCENORM = declare_op(
    "InstanceNorm",
    params=_norm_params(Param(Axis(), "the normalized axes", default="the spatial axes"), **_LAYOUT_KEYS,
                        **_NOT_MVN_KEYS, **_LN_UPSTREAM_KEYS),
    constants={**_NORM_CONSTANTS, **_UPSTREAM_FORM_LUT}, integer=_UPSTREAM_FORM_INT,
    semantics=f"{_NORM_SEM}#instancenorm")

UPSTREAM_FORM_TYPES = ("LayerNorm", "GroupNorm", "InstanceNorm")
"""The types whose integer form is upstream's by default (cfg field `layernorm_integer_form`)."""

RMSNORM = declare_op(
    "RMSNorm",
    params=_norm_params(Param(Axis(), "the normalized axes", default=[-1]), **_LAYOUT_KEYS, **_NOT_MVN_KEYS),
    constants={**_NORM_CONSTANTS, **_UPSTREAM_LUT}, integer="as LayerNorm without the mean",
    semantics=f"{_NORM_SEM}#rmsnorm")

MVN = declare_op(
    "MVN",
    params=_norm_params(Param(Axis(), "the normalized axes", required=True),
                        normalize_variance=Param(Bool(), "divide by the standard deviation (false: only subtract "
                                                         "the mean)", default=True),
                        group=Param(Int(lo=0), _UPSTREAM), ngamma_scale_value=quantized(Int(), _UPSTREAM)),
    constants=_NORM_CONSTANTS, integer="as LayerNorm; without variance an exact mean subtraction and one "
                                       "requantization", semantics=f"{_NORM_SEM}#mvn")


# =============================================================================================== layout helpers
def _int_list(node: PyNode, key: str, value, rank: int) -> List[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise node._error(f"parameter '{key}' must name at least one axis")
    axes = sorted({axis_param(node, a, rank) for a in values})
    if len(axes) != len(values):
        raise node._error(f"parameter '{key}' repeats an axis: {value!r}")
    return axes


def _float_param(node: PyNode, key: str, default: Optional[float] = None) -> float:
    value = node.get_param(key, optional=default is not None, default_value=default)
    if isinstance(value, bool):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise node._error(f"parameter '{key}' must be finite, got {value!r}")
    return out


def _int_param(node: PyNode, key: str, default: Optional[int] = None) -> int:
    value = node.get_param(key, optional=default is not None, default_value=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    return int(value)


def _epsilon(node: PyNode) -> float:
    eps = _float_param(node, "epsilon")
    if eps < 0:
        raise node._error(f"epsilon must be >= 0, got {eps}")
    return eps


def _reduce_axes(node: PyNode, rank: int) -> List[int]:
    """Axes normalized together by LayerNorm/RMSNorm/MVN/InstanceNorm."""
    kind = str(node.type)
    if kind == "InstanceNorm":
        if rank < 3:
            raise node._error(f"InstanceNorm needs an input of rank >= 3 (batch, spatial..., channels), got {rank}")
        default = list(range(1, rank - 1))
        return _int_list(node, "axis", node.get_param("axis", optional=True, default_value=default), rank)
    if kind == "MVN":
        return _int_list(node, "axis", node.get_param("axis"), rank)
    return _int_list(node, "axis", node.get_param("axis", optional=True, default_value=[-1]), rank)


def _group_channel_axis(node: PyNode, rank: int) -> Tuple[int, int]:
    """(channel axis, groups) of a GroupNorm."""
    if rank < 2:
        raise node._error(f"GroupNorm needs an input of rank >= 2, got {rank}")
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=-1), rank)
    if axis == 0:
        raise node._error("GroupNorm channel axis cannot be the batch axis 0")
    return axis, _int_param(node, "group")


class _Rows:
    """A [R, N] view of the input: each row is one normalization group of N elements, plus the way back.

    GroupNorm's rows keep upstream's element order: a channel-axis input [B, A..., C, Z...] is viewed as
    [B, A, group, C/group, Z], so one row is (a, channel of the group, z) in row-major order. `blocks` is the
    number of strided blocks upstream's float mean reads per row (A when group > 1, else 1: one contiguous block).
    `channels` is C for an InstanceNorm over its default spatial axes (rows ordered batch, then channel), the layout
    whose float sums take torch's outer-reduction order; None otherwise."""

    def __init__(self, node: PyNode, shape: Sequence[int]) -> None:
        rank = len(shape)
        self.shape = list(shape)
        self.blocks = 1
        self.channels: Optional[int] = None
        if str(node.type) == "GroupNorm":
            axis, groups = _group_channel_axis(node, rank)
            channels = int(shape[axis])
            if groups < 1 or channels % groups:
                raise node._error(f"group={groups} must be >= 1 and divide the {channels} channels of axis {axis}")
            outer = math.prod(int(d) for d in shape[1:axis])
            inner = math.prod(int(d) for d in shape[axis + 1:])
            self.group: Optional[Tuple[int, int, int, int]] = (groups, outer, channels // groups, inner)
            self.perm = None
            self.count = outer * inner * (channels // groups)
            self.blocks = outer if groups > 1 else 1
        else:
            self.group = None
            axes = _reduce_axes(node, rank)
            keep = [d for d in range(rank) if d not in axes]
            self.perm = keep + axes
            self.count = math.prod(int(shape[d]) for d in axes)
            if str(node.type) == "InstanceNorm" and axes == list(range(1, rank - 1)):
                self.channels = int(shape[-1])

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            groups, outer, width, inner = self.group
            g = x.reshape(int(x.shape[0]), outer, groups, width, inner).permute(0, 2, 1, 3, 4)
            return g.reshape(int(x.shape[0]) * groups, -1)
        return x.permute(self.perm).reshape(-1, self.count)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            groups, outer, width, inner = self.group
            g = rows.reshape(self.shape[0], groups, outer, width, inner).permute(0, 2, 1, 3, 4)
            return g.reshape(self.shape)
        permuted = [self.shape[d] for d in self.perm]
        inverse = [self.perm.index(d) for d in range(len(self.shape))]
        return rows.reshape(permuted).permute(inverse)


def _affine_axes(node: PyNode, rank: int) -> List[int]:
    """The axes gamma/beta run along, ascending: the reduced axes (LayerNorm, RMSNorm, MVN), the channel axis
    (GroupNorm) or the last axis (InstanceNorm)."""
    kind = str(node.type)
    if kind == "GroupNorm":
        return [_group_channel_axis(node, rank)[0]]
    if kind == "InstanceNorm":
        return [rank - 1]
    return _reduce_axes(node, rank)


def _affine_shape(node: PyNode, shape: Sequence[int]) -> List[int]:
    """Broadcast shape of gamma/beta and of per-element multipliers: the sizes of `_affine_axes`, 1 elsewhere.
    Gamma/beta of any shape holding that many elements are read in row-major order (upstream reshapes them so)."""
    keep = _affine_axes(node, len(shape))
    return [int(shape[d]) if d in keep else 1 for d in range(len(shape))]


def _channel_shape(node: PyNode, shape: Sequence[int]) -> List[int]:
    """Broadcast shape of the upstream form's per-channel constants (scale/shift, weights_scale/weights_zp,
    biases_scale): the last of `_affine_axes` only, as upstream quantizes gamma per channel along its last axis.
    The same as `_affine_shape` for one normalized axis."""
    last = _affine_axes(node, len(shape))[-1]
    return [int(shape[d]) if d == last else 1 for d in range(len(shape))]


def _affine_tensor(node: PyNode, key: str, shape: Sequence[int]) -> Optional[torch.Tensor]:
    t = node.get_constant(key, optional=True)
    if t is None:
        return None
    want = _affine_shape(node, shape)
    if t.betensor.numel() != math.prod(want):
        raise node._error(f"constant '{key}' has {t.betensor.numel()} elements; {math.prod(want)} expected "
                          f"(broadcast shape {want})")
    return t.betensor.reshape(want)


def norm_affine(node: PyNode, shape: Sequence[int]) -> Tuple[List[int], Optional[torch.Tensor],
                                                               Optional[torch.Tensor]]:
    """(broadcast shape, gamma, beta) of a normalization layer for an input of `shape`, as its forward reads them
    (None where absent)."""
    return _affine_shape(node, shape), _affine_tensor(node, "weights", shape), _affine_tensor(node, "biases", shape)


def _normalize_variance(node: PyNode) -> bool:
    return str(node.type) != "MVN" or bool_param(node, "normalize_variance", True)


# =============================================================================================== float forward
def _row_mean(rows: torch.Tensor, blocks: int = 1, channels: Optional[int] = None) -> torch.Tensor:
    """Mean of each row [R, N] -> [R, 1]: float32 as the row's sum / N, the sum in the order of upstream's float
    forward (`fixed_row_sum`; `block_row_sum` for `blocks` > 1, `channel_row_sum` for an InstanceNorm's `channels`);
    other float dtypes, and a forward that autograd must differentiate (global calibration), by torch's mean."""
    if rows.dtype != torch.float32 or (torch.is_grad_enabled() and rows.requires_grad):
        with one_thread(int(rows.shape[0]) == 1):  # a float sum to one value: the same at any thread count
            return rows.mean(dim=1, keepdim=True)
    cpu = rows.cpu()
    sums = channel_row_sum(cpu, channels) if channels is not None else block_row_sum(cpu, blocks)
    # divided on the CPU, where the sum is formed: a GPU divides by a scalar as a product with its reciprocal
    return (sums / rows.shape[1]).to(rows.device).unsqueeze(1)


@LAYERNORM.forward
@GROUPNORM.forward
@INSTANCENORM.forward
@RMSNORM.forward
@MVN.forward
def norm_forward(self: PyNode) -> None:
    """y = (x - mean) · (1 / sqrt(var + epsilon)) · weights + biases over the normalization group (biased variance);
    RMSNorm: y = x · (1 / sqrt(mean(x²) + epsilon)) · weights + biases; MVN with normalize_variance=false: x - mean.
    Float32 as upstream's float forward: each row's mean and variance summed in upstream's fixed order for the
    layer's layout (`_row_mean`), the reciprocal of the standard deviation taken first and multiplied in, each step
    rounded to float32."""
    if self.quantized:
        upstream = str(self.type) in UPSTREAM_FORM_TYPES and "norm_frac_bits" not in self.params
        self.outputs[0].betensor = _upstream_form_forward(self) if upstream else _norm_integer_forward(self)
        return
    x = self.inputs[0].betensor
    x = x.float() if not x.is_floating_point() else x
    rows_of = _Rows(self, x.shape)
    rows = rows_of.to_rows(x)
    eps = _epsilon(self) if _normalize_variance(self) else 0.0
    if rows.shape[1] == 0:
        raise self._error("the normalization group is empty")
    if str(self.type) == "RMSNorm":
        n = rows * (1.0 / torch.sqrt(_row_mean(rows * rows) + eps))
    else:
        # upstream's GroupNorm reads its mean from a strided channel chunk, its variance from a contiguous copy
        centered = rows - _row_mean(rows, rows_of.blocks, rows_of.channels)
        if _normalize_variance(self):
            var = _row_mean(centered * centered, channels=rows_of.channels)
            n = centered * (1.0 / torch.sqrt(var + eps))
        else:
            n = centered
    y = rows_of.from_rows(n)
    w = _affine_tensor(self, "weights", x.shape)
    b = _affine_tensor(self, "biases", x.shape)
    if w is not None:
        y = y * w.to(y.dtype)
    if b is not None:
        y = y + b.to(y.dtype)
    self.outputs[0].betensor = y


# =============================================================================================== integer helpers
def isqrt(n: torch.Tensor) -> torch.Tensor:
    """floor(sqrt(n)) of int64 values 0 <= n < 2^62, exactly (a float64 estimate corrected with integers)."""
    r = torch.floor(torch.sqrt(n.to(torch.float64))).to(torch.int64)
    for _ in range(2):
        r = torch.where(r * r > n, r - 1, r)
        r = torch.where((r + 1) * (r + 1) <= n, r + 1, r)
    return r


def inverse_sqrt(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(R, t) with 1/sqrt(q) ≈ R * 2^-(31 + t/2) for int64 q >= 1: e = bit length of q, t = 2*ceil((e - 30)/2),
    Qn = q >> t (q << -t when t < 0), R = isqrt(floor(2^62 / Qn)); Qn lies in [2^28, 2^30), R in [2^16, 2^17]."""
    e = bit_length(q)
    t = (e - RSQRT_NORM_BITS) + torch.remainder(e - RSQRT_NORM_BITS, 2)
    qn = torch.where(t >= 0, q >> torch.clamp(t, min=0), q << torch.clamp(-t, min=0))
    r = isqrt(torch.div(torch.full_like(qn, 2 ** RSQRT_NUMERATOR_BITS), qn, rounding_mode="floor"))
    return r, t


def _vmax(node: PyNode, t) -> int:
    """Largest |x_q + zp| of a quantized tensor."""
    qmin, qmax = out_range(node, t)
    zp = tensor_zp(node, t)
    return max(abs(qmin + zp), abs(qmax + zp))


def _mean_frac_bits(node: PyNode, count: int, vmax: int) -> int:
    """F = min(8, floor((62 - ceil(log2 N) - 2 * (bits(vmax) + 1)) / 2)): N * (2 * vmax * 2^F)^2 stays < 2^62."""
    spare = SUM_SQUARES_BITS - ceil_log2(max(count, 1)) - 2 * (int(vmax).bit_length() + 1)
    frac = min(NORM_MEAN_FRAC_BITS, spare // 2)
    if frac < 0:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): normalizing {count} elements of "
                               f"{int(vmax).bit_length()}-bit values overflows the 62-bit sum of squares")
    return frac


# =============================================================================================== quantize
@LAYERNORM.quantize
@GROUPNORM.quantize
@INSTANCENORM.quantize
@RMSNORM.quantize
@MVN.quantize
def norm_quantize(self: PyNode) -> None:
    """Integer mean/variance parameters (norm_frac_bits, eps_value), the normalized tensor's multiplier
    (norm_scale_value/norm_shift_value for sqrt(N) * s_n, s_n = 32767/sqrt(N)), then gamma/beta as per-element
    weights (symmetric, q_bits_weight) and biases (scale s_n * s_w, q_bits_bias) with per-element scale/shift
    (s_out / (s_n * s_w)), or one scale_value/shift_value (s_out / s_n) without them. Output signed.
    LayerNorm, GroupNorm and InstanceNorm take upstream's form unless their `layernorm_integer_form` is exact
    (`_upstream_form_quantize`)."""
    if str(self.type) in UPSTREAM_FORM_TYPES and layer_settings(self).layernorm_integer_form == "upstream":
        _upstream_form_quantize(self)
        return
    inp, out = self.inputs[0], self.outputs[0]
    if quant_of(self).get(inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    s = layer_settings(self)
    if s.q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel activation quantization is not "
                               "supported")
    shape = list(inp.ir_shape)
    count = _Rows(self, shape).count
    s_in = tensor_scale(self, inp)
    frac = _mean_frac_bits(self, count, _vmax(self, inp))
    quantize_activation(self, out, True)
    self.params["norm_frac_bits"] = frac
    if not _normalize_variance(self):
        if "weights" in self.constants or "biases" in self.constants:
            raise UnsupportedError(f"layer '{self.name}' (MVN): weights/biases with normalize_variance=false are "
                                   "not supported")
        store_requant(self, *requant_scale_shift(self, tensor_scale(self, out) / s_in))
        return
    eps_value = int(round(_epsilon(self) * s_in * s_in * 2.0 ** (2 * frac)))
    if count * eps_value >= 2 ** SUM_SQUARES_BITS:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): epsilon {_epsilon(self)} is too large for the "
                               "integer sum of squares at this input scale")
    self.params["eps_value"] = eps_value
    norm_scale = (2 ** (NORM_BITS - 1) - 1) / math.sqrt(count)
    m, sh, m_dtype, sh_dtype = scale_shift(math.sqrt(count) * norm_scale, AIFF_MULTIPLIER_BITS,
                                           force_shift_positive=s.force_shift_positive)
    self.params["norm_scale_value"] = int(m)
    self.params["norm_scale_type"] = m_dtype
    self.params["norm_shift_value"] = int(sh)
    self.params["norm_shift_type"] = sh_dtype
    _quantize_affine(self, norm_scale, shape)


def _quantize_affine(node: PyNode, norm_scale: float, shape: Sequence[int]) -> None:
    s = layer_settings(node)
    out = node.outputs[0]
    s_out = tensor_scale(node, out)
    w = node.get_constant("weights", optional=True)
    b = node.get_constant("biases", optional=True)
    if w is None and b is None:
        store_requant(node, *requant_scale_shift(node, s_out / norm_scale))
        return
    numel = math.prod(_affine_shape(node, shape))
    if w is None:
        w = set_constant(node, "weights", torch.ones(numel, dtype=torch.float32), Dtype.FP32)
        insert_keys_after(node, "biases", ["weights"])
    _affine_tensor(node, "weights", shape)
    wf = w.betensor.to(torch.float32).reshape(-1)
    wmode = QuantMode.from_name(s.q_mode_weight)
    mode = QuantMode.make("per_channel", False, wmode.is_symmetric and wmode.is_full_range)
    bits = int(s.q_bits_weight)
    p = linear_quant_params(torch.clamp(wf, max=0.0), torch.clamp(wf, min=0.0), bits, mode, True)
    w_shape = list(w.betensor.shape)
    w.betensor = quantize(wf, p.scale, p.zerop, p.qmin, p.qmax, axis=0).reshape(w_shape)
    set_params(node, w, p, bits, axis=0)
    bias_bits = int(s.q_bits_bias)
    bias_dtype = Dtype.INT32 if bias_bits <= 32 else Dtype.INT64
    if b is not None:
        _affine_tensor(node, "biases", shape)
        b_q, b_scale = bias_quantize(b.betensor.reshape(-1), norm_scale, p.scale, bias_bits)
        b.betensor = b_q.reshape(list(b.betensor.shape))
        b.dtype = bias_dtype
        qb = quant_of(node).of(b)
        qb.scale, qb.zerop, qb.qbits = b_scale, 0, bias_bits
        qb.qmin, qb.qmax = integer_range(bias_bits, True)
        qb.axis = 0 if qb.per_channel else None
    ratio = torch.tensor(s_out, dtype=torch.float32) / (torch.tensor(norm_scale, dtype=torch.float32) * p.scale)
    store_requant(node, *requant_scale_shift(node, ratio))


# =============================================================================================== integer forward
def _norm_integer_forward(node: PyNode) -> torch.Tensor:
    """v = x_q + zp_in; per row of N elements: m = round_half_even(Σv * 2^F / N), d = v * 2^F - m (RMSNorm: no m),
    Q = Σd² + N * eps_value, (R, t) = inverse_sqrt(max(Q, 1)),
    n = clamp(round_half_even(d * R * M_n / 2^(31 + t/2 + N_n)), -32767, 32767); then
    y = requant(n * w_q + b_q) per element, or requant(n); MVN without variance: y = requant(d) with shift + F."""
    out = node.outputs[0]
    x, zp = int_input(node)
    if x.numel() == 0:
        return x.clone()
    rows_of = _Rows(node, x.shape)
    v = rows_of.to_rows(x + zp)
    count = v.shape[1]
    frac = _int_param(node, "norm_frac_bits")
    if frac < 0:
        raise node._error(f"norm_frac_bits must be >= 0, got {frac}")
    if str(node.type) == "RMSNorm":
        d = v << frac
    else:
        m = div_round_half_even(v.sum(dim=1, keepdim=True) << frac, torch.tensor(count, dtype=torch.int64))
        d = (v << frac) - m
    qmin, qmax = out_range(node, out)
    zp_out = tensor_zp(node, out)
    if not _normalize_variance(node):
        mult, shift = requant_of(node)
        return rows_of.from_rows(requantize_int(d, mult, shift + frac, zp_out, qmin, qmax)).contiguous()
    dmax = int(d.abs().max())
    eps_value = _int_param(node, "eps_value")
    if count * dmax * dmax + count * eps_value >= 2 ** SUM_SQUARES_BITS:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the sum of squares of {count} elements "
                               "exceeds 62 bits (normalization axes larger than at quantization?)")
    q = torch.clamp((d * d).sum(dim=1, keepdim=True) + count * eps_value, min=1)
    r, t = inverse_sqrt(q)
    m_n = _int_param(node, "norm_scale_value")
    sh_n = _int_param(node, "norm_shift_value")
    nmax = 2 ** (NORM_BITS - 1) - 1
    n = torch.clamp(round_shift(d * r * m_n, RSQRT_FRAC_BITS + (t >> 1) + sh_n), -nmax, nmax)
    n = rows_of.from_rows(n).contiguous()
    mult, shift = requant_of(node)
    bshape = _affine_shape(node, x.shape)
    if isinstance(mult, torch.Tensor):
        mult, shift = mult.reshape(bshape), shift.reshape(bshape)
    w = _affine_tensor(node, "weights", x.shape)
    if w is None:
        return requantize_int(n, mult, shift, zp_out, qmin, qmax)
    acc = n * w.to(torch.int64)
    b = _affine_tensor(node, "biases", x.shape)
    if b is not None:
        acc = acc + b.to(torch.int64)
    return requantize_int(acc, mult, shift, zp_out, qmin, qmax)


# ================================================== LayerNorm, GroupNorm, InstanceNorm: upstream form
ISQRT_TABLE_STEPS = 64
"""The inverse square root table samples 1/sqrt(m) for m = 1 + j/64, j = 0 .. 192 (m in [1, 4])."""

ISQRT_TABLE_BITS = 15
"""Table entries are min(32767, round(2^15 / sqrt(m))): int16."""

ISQRT_NORM_BITS = 30
"""The inverse square root normalizes its argument into [2^30, 2^31) by a left shift of at most 30 bits."""

UPSTREAM_NORM_Q8 = 8
"""8-bit form: the normalized tensor is (x_q - mean) * g >> (8 + norm_shift_value)."""

UPSTREAM_NORM_Q16 = 7
"""16-bit form: the normalized tensor is ((x_q - mean) >> 1) * g >> 7."""


def isqrt_table() -> torch.Tensor:
    """The 193-entry int16 table `lut` of the upstream form: entry j = min(32767, round(2^15 / sqrt(1 + j/64)))."""
    m = 1.0 + torch.arange(3 * ISQRT_TABLE_STEPS + 1, dtype=torch.float64) / ISQRT_TABLE_STEPS
    return torch.clamp(torch.round(2.0 ** ISQRT_TABLE_BITS / torch.sqrt(m)), max=2 ** ISQRT_TABLE_BITS - 1) \
        .to(torch.int64)


def table_inverse_sqrt(v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """G ≈ 2^31 / sqrt(v) of int64 values 0 <= v < 2^32 from the 193-entry table (docs/semantics/normalization.md,
    "LayerNorm, GroupNorm and InstanceNorm, upstream form"): k = min(30, max(0, 31 - bit_length(v))), u = v << k,
    e = 31 - k; f = u >> 1 if e is odd, else u; i = max((f >> 23) - 64, 0), a = (f >> 8) mod 2^15;
    G = (T[i] * 2^16 - 2 * a * (T[i] - T[i+1])) >> ((e - 1) >> 1). v = 0 gives G = T[0] * 2^16."""
    if int(table.numel()) != 3 * ISQRT_TABLE_STEPS + 1:
        raise ValueError(f"the inverse square root table has {int(table.numel())} entries, "
                         f"{3 * ISQRT_TABLE_STEPS + 1} expected")
    k = torch.clamp(ISQRT_NORM_BITS + 1 - bit_length(v), 0, ISQRT_NORM_BITS)
    u = v << k
    e = ISQRT_NORM_BITS + 1 - k
    f = torch.where(e % 2 == 1, u >> 1, u)
    i = torch.clamp((f >> 23) - ISQRT_TABLE_STEPS, min=0)
    if bool((i >= 3 * ISQRT_TABLE_STEPS).any()):
        raise ValueError("inverse square root argument beyond 2^32")
    a = (f >> 8) & (2 ** ISQRT_TABLE_BITS - 1)
    t = table.to(device=v.device, dtype=torch.int64).reshape(-1)
    lo, hi = t[i], t[i + 1]
    return ((lo << 16) - ((lo - hi) * a << 1)) >> ((e - 1) >> 1)


def _upstream_var_shift(count: int) -> int:
    """8-bit form: the sum of squares is shifted right by ceil(log2 N) - 4, rounded up to even."""
    shift = ceil_log2(count) - 4
    return shift + (shift & 1)


def _shift_dtype(v: int) -> Dtype:
    """uint8 as upstream writes these shifts; int8 for a negative one (small N), which uint8 cannot hold."""
    return Dtype.UINT8 if v >= 0 else Dtype.INT8


def _upstream_form_quantize(node: PyNode) -> None:
    """Upstream's LayerNorm, GroupNorm and InstanceNorm (docs/semantics/normalization.md, "LayerNorm, GroupNorm and
    InstanceNorm, upstream form"): the normalized tensor gets
    the range ±sqrt(N)·2^adj at the activation bits and mode; 8 bits: var_shift_value, norm_shift_value; 16 bits:
    norm_scale_value/norm_shift_value for s_norm/127; gamma/beta quantized as a MAC layer's weights/biases on the
    normalized tensor (per channel with per-channel weights; shifts unified as `unify_shifts_for_aiff` says for
    GroupNorm only, as upstream); the inverse square root table."""
    inp, out = node.inputs[0], node.outputs[0]
    if quant_of(node).get(inp).qmin is None:
        raise node._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    s = layer_settings(node)
    if s.q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel activation quantization is not "
                               "supported")
    bits = int(s.q_bits_activation)
    in_bits = range_bits(node, inp)
    if (in_bits <= 8) != (bits <= 8):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): upstream's integer form needs the input and the "
                               f"output on the same side of 8 bits (input {in_bits} bits, activation_bits {bits}); "
                               "set layernorm_integer_form = exact for this layer", field="layernorm_integer_form",
                               layer=node.name)
    count = _Rows(node, list(inp.ir_shape)).count
    sqrt_n = math.sqrt(count)
    adj = math.ceil(math.log2(127.5 / sqrt_n / 4)) if bits <= 8 and sqrt_n > 127 else 0
    limit = sqrt_n * 2.0 ** adj
    norm = PyTensor(f"{node.name}/normalized")  # a stand-in input for quantize_mac, with an entry in the table
    set_params(node, norm, linear_quant_params(-limit, limit, bits, activation_mode(node, bits), True), bits).zerop = 0
    # (only its scale is used: the forward keeps n symmetric, and no zero point goes into the biases)
    if bits <= 8:
        var_shift = _upstream_var_shift(count)
        norm_shift = (var_shift >> 1) + adj
        node.params["var_shift_value"] = var_shift
        node.params["var_shift_type"] = _shift_dtype(var_shift)
        node.params["norm_scale_value"] = 1
        node.params["norm_scale_type"] = Dtype.UINT8
        node.params["norm_shift_value"] = norm_shift
        node.params["norm_shift_type"] = _shift_dtype(norm_shift)
    else:
        local = torch.tensor(tensor_scale(node, norm), dtype=torch.float32) / 127
        m, sh, m_dtype, sh_dtype = scale_shift(local, bits, force_shift_positive=s.force_shift_positive)
        node.params["var_shift_value"] = 0
        node.params["var_shift_type"] = Dtype.UINT8
        node.params["norm_scale_value"] = int(m)
        node.params["norm_scale_type"] = m_dtype
        node.params["norm_shift_value"] = int(sh)
        node.params["norm_shift_type"] = sh_dtype
    shape = list(inp.ir_shape)
    if "weights" not in node.constants and "biases" not in node.constants:
        quantize_activation(node, out, True)
        ratio = torch.tensor(tensor_scale(node, out), dtype=torch.float32) / torch.tensor(tensor_scale(node, norm),
                                                                                    dtype=torch.float32)
        store_requant(node, *requant_scale_shift(node, ratio, mult_bits=bits))
    else:
        _complete_affine(node, shape)
        node.inputs[0] = norm
        if str(node.type) != "GroupNorm":  # upstream unifies only GroupNorm's shifts
            node.settings = dataclasses.replace(s, unify_shifts_for_aiff=False)
        try:
            _quantize_gamma_beta(node, QuantMode.from_name(s.q_mode_weight).is_per_channel, shape)
        finally:
            node.inputs[0] = inp
            node.settings = s
        node.params.pop("remain_shift", None)
    quant_of(node).drop(norm)  # not a tensor of the graph
    set_constant(node, "lut", isqrt_table(), Dtype.INT16)
    insert_keys_after(node, "shift" if "shift" in node.constants else "biases", ["lut"])


def _complete_affine(node: PyNode, shape: Sequence[int]) -> None:
    """Check gamma/beta against the input and add the one missing: beta alone gets a gamma of ones (so that beta
    gets the weights' scale); gamma of more elements than channels (several normalized axes) without beta gets zero
    biases of its shape, where `quantize_mac` would make one per channel."""
    if "weights" not in node.constants:
        b = node.constants["biases"]
        ones = set_constant(node, "weights", torch.ones(b.betensor.shape, dtype=torch.float32), Dtype.FP32)
        channels = int(ones.betensor.shape[-1]) if ones.betensor.dim() else 1
        ranges_of(node).set(ones, 1.0, 1.0)
        ranges_of(node).set_channels(ones, torch.ones(channels), torch.ones(channels))
        insert_keys_after(node, "biases", ["weights"])
    gamma = node.constants["weights"]
    _affine_tensor(node, "weights", shape)
    if "biases" in node.constants:
        _affine_tensor(node, "biases", shape)
    elif gamma.betensor.numel() != math.prod(_channel_shape(node, shape)):
        set_constant(node, "biases", torch.zeros(gamma.betensor.shape, dtype=torch.float32), Dtype.FP32)
        insert_keys_after(node, "weights", ["biases"])


def _quantize_gamma_beta(node: PyNode, per_channel: bool, shape: Sequence[int]) -> None:
    """Gamma/beta quantized as a MAC layer's weights/biases on the normalized tensor (`quantize_mac`). Per channel,
    a gamma of more elements than channels (several normalized axes) is quantized along its last axis, as upstream:
    gamma and beta are viewed channels first, [C, R], for `quantize_mac` (which takes its channels on axis 0), with
    gamma's per-channel range calibrated along that axis, then laid back."""
    w, b = node.constants["weights"], node.constants.get("biases")
    channels = math.prod(_channel_shape(node, shape))
    if not per_channel or w.betensor.numel() == channels:
        quantize_mac(node, per_channel)
        return
    if GIVEN_PARAMS in w.extra:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the given per-channel quantization of a "
                               f"pre-quantized gamma of shape {list(w.betensor.shape)} is not supported (one "
                               "normalized axis is)", field="quantize_method_for_weight", layer=node.name)
    laid = [t for t in (w, b) if t is not None]
    shapes = [list(t.betensor.shape) for t in laid]
    for t in laid:
        t.betensor = t.betensor.reshape(-1, channels).t().contiguous()
    lo, hi = _calibrate_gamma_channels(node, w)
    try:
        quantize_mac(node, True)
    finally:
        for t, stored in zip(laid, shapes):
            t.betensor = t.betensor.t().reshape(stored).contiguous()
    for t in laid:
        entry = quant_of(node).of(t)
        entry.axis = t.betensor.dim() - 1 if entry.axis is not None else None
    ranges_of(node).set_channels(w, lo, hi, axis=w.betensor.dim() - 1)


def _calibrate_gamma_channels(node: PyNode, w: PyTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-channel range of a channels-first float gamma (axis 0), set in the range table and returned, from its
    values with the layer's weight strategy: the calibration's per-channel weight ranges ran along the axis 0 of
    gamma as stored, not along its channels."""
    s = layer_settings(node)
    symmetric = not QuantMode.from_name(s.q_mode_weight).is_asymmetric
    lo, hi = apply_strategy(weight_statistics(node, w), s.q_strategy_weight, s.q_bits_weight,
                            symmetric=symmetric, ir_range=w.ir_range, per_channel=True)
    ranges_of(node).set_channels(w, lo, hi, axis=0)
    return lo, hi


def upstream_norm_gain(node: PyNode) -> float:
    """What the normalized tensor n of a LayerNorm in upstream's form holds per unit of (x - mean)/std, from the
    stored params: 8 bits M_n · 2^(7 + var_shift/2 - N_n) / sqrt(N); 16 bits M_n · 2^(7 - N_n) (G rounds 2^15/std in
    integer units, n = (d/2) · G · M_n 2^-N_n / 2^7). For the exporters' float forms."""
    x = node.inputs[0]
    count = _Rows(node, list(x.ir_shape)).count
    m_n, sh_n = _int_param(node, "norm_scale_value"), _int_param(node, "norm_shift_value")
    if range_bits(node, x) <= 8:
        vs = _int_param(node, "var_shift_value")
        return m_n * 2.0 ** (UPSTREAM_NORM_Q8 - 1 + vs / 2 - sh_n) / math.sqrt(count)
    return m_n * 2.0 ** (UPSTREAM_NORM_Q16 - sh_n)


def gamma_codes(node: PyNode, shape: Sequence[int]) -> torch.Tensor:
    """w_q + zp_w of an upstream-form gamma in its broadcast shape (`_affine_shape`), int64: per-channel zero points
    run along the channel axis (`_channel_shape`), not along the axis 0 of gamma as stored."""
    w = _affine_tensor(node, "weights", shape).to(torch.int64)
    zp_t = node.constants.get("weights_zp")
    if zp_t is not None:
        return w + zp_t.betensor.to(device=w.device, dtype=torch.int64).reshape(_channel_shape(node, shape))
    zp = int(node.params.get("weights_zp", 0))
    return w + zp if zp else w


def _upstream_form_forward(node: PyNode) -> torch.Tensor:
    """Per row of N input integers q (no zero point: the mean removes it): m = rhe_div(Σq, N), d = q - m;
    8 bits: V = Σd² >> var_shift, G = (table_inverse_sqrt(V) + 2^15) >> 16, n = clamp(rhe(d·G·M_n, 8 + N_n));
    16 bits: V = floor(Σd² / N), G = clamp(rhe(((table_inverse_sqrt(V) + 2^15) >> 16)·M_n, N_n), 0, 65535),
    n = clamp(rhe((d >> 1)·G, 7)); n clamped to the output dtype's full range; then
    y = requant((w_q + zp_w)·n + b_q) (per element with per-channel constants) or requant(n)."""
    inp, out = node.inputs[0], node.outputs[0]
    x = int_value(inp)
    if x.numel() == 0:
        return x.clone()
    for key in ("var_shift_value", "norm_scale_value", "norm_shift_value"):
        if key not in node.params:
            raise node._error(f"a quantized {node.type} needs '{key}' (upstream form) or 'norm_frac_bits' (exact "
                              "form)")
    lut = node.get_constant("lut", optional=True)
    if lut is None:
        raise node._error(f"a quantized {node.type} of upstream's form needs its constant 'lut'")
    rows_of = _Rows(node, x.shape)
    v = rows_of.to_rows(x)
    count = int(v.shape[1])
    m_n = _int_param(node, "norm_scale_value")
    sh_n = _int_param(node, "norm_shift_value")
    lo, hi = integer_range(int(quant_of(node).get(out).qbits or range_bits(node, out)), is_signed(node, out))
    fast = _upstream_form_float64(node, rows_of, v, m_n, sh_n, lo, hi, lut.betensor)
    if fast is not None:
        return fast
    m = div_round_half_even(v.sum(dim=1, keepdim=True), count)
    d = v - m
    factor, shift = _upstream_inverse_root(node, (d * d).sum(dim=1, keepdim=True), count, m_n, sh_n, lut.betensor)
    n = torch.clamp(round_shift((d if range_bits(node, inp) <= 8 else d >> 1) * factor, shift), lo, hi)
    n = rows_of.from_rows(n).contiguous()
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        cshape = _channel_shape(node, x.shape)
        mult, shift = mult.reshape(cshape), shift.reshape(cshape)
    qmin, qmax = out_range(node, out)
    zp_out = tensor_zp(node, out)
    if _affine_tensor(node, "weights", x.shape) is None:
        return requantize_int(n, mult, shift, zp_out, qmin, qmax)
    acc = n * gamma_codes(node, x.shape)
    b = _affine_tensor(node, "biases", x.shape)
    if b is not None:
        acc = acc + b.to(torch.int64)
    return requantize_int(acc, mult, shift, zp_out, qmin, qmax)


def _upstream_inverse_root(node: PyNode, sq: torch.Tensor, count: int, m_n: int, sh_n: int,
                           lut: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(per-row factor, shift) of `_upstream_form_forward`'s n = rhe(d_part · factor, shift), from the rows' sums
    of squared differences `sq` (int64 [R, 1]): G·M_n with shift 8 + N_n (8-bit input, d_part = d), or
    clamp(rhe(G·M_n, N_n), 0, 65535) with shift 7 (16-bit input, d_part = d >> 1)."""
    try:
        if range_bits(node, node.inputs[0]) <= 8:
            vs = _int_param(node, "var_shift_value")
            var = sq >> vs if vs >= 0 else sq << -vs
            if bool((var >= 2 ** 32).any()):
                raise UnsupportedError(f"layer '{node.name}' ({node.type}): the shifted sum of squares reaches 2^32 "
                                       "(normalization axes larger than at quantization?)")
            return ((table_inverse_sqrt(var, lut) + 2 ** 15) >> 16) * m_n, UPSTREAM_NORM_Q8 + sh_n
        var = torch.div(sq, count, rounding_mode="floor")
        g = (table_inverse_sqrt(var, lut) + 2 ** 15) >> 16
        return torch.clamp(round_shift(g * m_n, sh_n), 0, 2 ** 16 - 1), UPSTREAM_NORM_Q16
    except ValueError as e:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {e}") from None


def _upstream_form_float64(node: PyNode, rows_of: _Rows, v: torch.Tensor, m_n: int, sh_n: int, lo: int, hi: int,
                           lut: torch.Tensor) -> Optional[torch.Tensor]:
    """`_upstream_form_forward` from the input rows `v` (int64 [R, N]) with the per-element passes in float64,
    where the ranges prove every value an integer below 2^53 (sums, squares, d·factor, the affine terms and their
    products with the output multipliers): each float64 operation then gives the int64 one's value, rounding half
    to even as round_shift does. None where a bound fails (the int64 passes then). Why: the int64 form took twice
    the passes and conversions; a BERT export's LayerNorms were a sixth of its integer forward."""
    inp, out = node.inputs[0], node.outputs[0]
    count = int(v.shape[1])
    in_lo, in_hi = out_range(node, inp)
    width = in_hi - in_lo  # |q - mean| <= width
    if count * max(abs(in_lo), abs(in_hi)) >= FLOAT64_EXACT or count * width * width >= FLOAT64_EXACT:
        return None
    vf = v.to(torch.float64)
    m = div_round_half_even(vf.sum(dim=1, keepdim=True).to(torch.int64), count)
    d = vf.sub_(m.to(torch.float64))
    factor, shift = _upstream_inverse_root(node, torch.mul(d, d).sum(dim=1, keepdim=True).to(torch.int64), count,
                                           m_n, sh_n, lut)
    eight_bit = range_bits(node, inp) <= 8
    if (width if eight_bit else width // 2 + 1) * int(factor.abs().max()) >= FLOAT64_EXACT or abs(shift) >= 900:
        return None
    scale = factor.to(torch.float64) * 2.0 ** -shift  # exact: a power-of-two scaling of integers below 2^53
    n = (d if eight_bit else d.mul_(0.5).floor_()).mul_(scale).round_().clamp_(lo, hi)
    n = rows_of.from_rows(n).contiguous()
    mult, shift_out = requant_of(node)
    shape = list(n.shape)
    if isinstance(mult, torch.Tensor):
        cshape = _channel_shape(node, shape)
        mult, shift_out = mult.reshape(cshape), shift_out.reshape(cshape)
    acc_absmax = max(abs(lo), abs(hi))
    if _affine_tensor(node, "weights", shape) is not None:
        gamma, beta, (gamma_absmax, beta_absmax) = _upstream_affine_float64(node, shape)
        acc_absmax = acc_absmax * gamma_absmax + beta_absmax
        n = n.mul_(gamma) if beta is None else n.mul_(gamma).add_(beta)
    shifts = torch.as_tensor(shift_out)
    if acc_absmax * int(torch.as_tensor(mult).abs().max()) >= FLOAT64_EXACT or int(shifts.min()) <= -900 \
            or int(shifts.max()) >= 900:
        return None
    qmin, qmax = out_range(node, out)
    return requantize_float64_(n, mult, shift_out, tensor_zp(node, out), qmin, qmax)


def _upstream_affine_float64(node: PyNode, shape: Sequence[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                                          Tuple[int, int]]:
    """(w_q + zp_w, b_q or None, as float64 in their broadcast shape, and (max |w_q + zp_w|, max |b_q|)) of an
    upstream-form gamma and beta, memoized per layer while its constants and the shape stay the same."""
    w = node.get_constant("weights").betensor
    b = node.get_constant("biases", optional=True)
    zp_t = node.constants.get("weights_zp")

    def build() -> Tuple[torch.Tensor, Optional[torch.Tensor], Tuple[int, int]]:
        gamma = gamma_codes(node, shape)
        beta = _affine_tensor(node, "biases", shape)
        b_absmax = int(beta.abs().max()) if beta is not None and beta.numel() else 0
        return (gamma.to(torch.float64), None if beta is None else beta.to(torch.float64),
                (int(gamma.abs().max()) if gamma.numel() else 0, b_absmax))

    key = (Same(w), None if b is None else Same(b.betensor), None if zp_t is None else Same(zp_t.betensor),
           node.params.get("weights_zp", 0), tuple(int(d) for d in shape))
    return memo(node, "norm_upstream_affine_float64", key, build)


# =============================================================================================== LRN
LRN = declare_op(
    "LRN",
    params={"method": Param(Text(choices=LRN_METHODS), "the window (WITHIN_CHANNEL is not supported)",
                            default="ACROSS_CHANNELS"),
            "size": Param(Int(lo=1), "channels in the window", required=True),
            "alpha": Param(Float(), "factor of the window's mean square", required=True),
            "beta": Param(Float(), "exponent", required=True),
            "bias": Param(Float(), "added to the scaled sum", required=True),
            "scale_sum_value": quantized(Int(), "multiplier of the sum of squares to the 16-bit table index"),
            "scale_sum_type": quantized(DtypeName(), "dtype of scale_sum_value"),
            "shift_sum_value": quantized(Int(), "shift of the sum of squares to the 16-bit table index"),
            "shift_sum_type": quantized(DtypeName(), "dtype of shift_sum_value")},
    constants={"lut": "(bias + A)^-beta, uint16 (quantized)",
               "scale": "per-channel requantization multipliers", "shift": "per-channel requantization shifts"},
    integer="window sum of squares, 16-bit index, (bias + A)^-beta table, requantization",
    semantics=f"{_NORM_SEM}#lrn")


def _lrn_params(node: PyNode) -> Tuple[int, float, float, float]:
    method = str(node.get_param("method", optional=True, default_value="ACROSS_CHANNELS")).upper()
    if method not in LRN_METHODS:
        raise node._error(f"method must be one of {', '.join(LRN_METHODS)}, got {method!r}")
    if method != "ACROSS_CHANNELS":
        raise UnsupportedError(f"layer '{node.name}' (LRN): method {method} is not supported (ACROSS_CHANNELS is)")
    size = _int_param(node, "size")
    if size < 1:
        raise node._error(f"size must be >= 1, got {size}")
    return size, _float_param(node, "alpha"), _float_param(node, "beta"), _float_param(node, "bias")


def _window_sum(sq: torch.Tensor, size: int) -> torch.Tensor:
    """Σ over the last-axis window [c - floor(size/2), c + floor((size-1)/2)] with zeros outside."""
    padded = F.pad(sq, (size // 2, (size - 1) // 2))
    return padded.unfold(-1, size, 1).sum(dim=-1)


@LRN.forward
def lrn_forward(self: PyNode) -> None:
    """ACROSS_CHANNELS on the last (channel) axis: y = x / (bias + alpha/size * Σ_window x²)^beta."""
    size, alpha, beta, bias = _lrn_params(self)
    if self.quantized:
        self.outputs[0].betensor = _lrn_integer_forward(self, size)
        return
    x = self.inputs[0].betensor
    x = x.float() if not x.is_floating_point() else x
    if x.dim() < 2:
        raise self._error(f"LRN needs an input of rank >= 2, got {x.dim()}")
    self.outputs[0].betensor = x / torch.pow(bias + alpha / size * _window_sum(x * x, size), beta)


def lrn_table(fn: Callable[[torch.Tensor], torch.Tensor], index_scale: float, value_scale: float,
              entries: int) -> torch.Tensor:
    """Entry j = clamp(round_half_even(f(j * 2^16/entries / s_u) * s_f), 0, 65535), float64, int64."""
    step = 2 ** LRN_INDEX_BITS // entries
    a = torch.arange(entries, dtype=torch.float64) * step / index_scale
    return torch.clamp(torch.round(fn(a) * value_scale), 0, 2 ** LRN_VALUE_BITS - 1).to(torch.int64)


@LRN.quantize
def lrn_quantize(self: PyNode) -> None:
    """Output signed iff the input is; A = alpha/size * Σ(x²) requantized to a 16-bit index (scale_sum_value/
    shift_sum_value for s_u * alpha/(size * s_in²), s_u = (2^16 - 2^16/entries)/A_max, A_max = alpha * vmax²/s_in²);
    table `lut` (uint16, 2^min(16, lut_items_in_bits) entries) of (bias + A)^-beta with scale s_f = 65535/max f;
    scale_value/shift_value for s_out/(s_in * s_f)."""
    size, alpha, beta, bias = _lrn_params(self)
    inp, out = self.inputs[0], self.outputs[0]
    if quant_of(self).get(inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    s = layer_settings(self)
    if s.q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' (LRN): per-channel activation quantization is not supported")
    if bias <= 0 or alpha < 0:
        raise UnsupportedError(f"layer '{self.name}' (LRN): quantization needs bias > 0 and alpha >= 0 "
                               f"(got bias={bias}, alpha={alpha})")
    s_in = tensor_scale(self, inp)
    entries = 2 ** min(LRN_INDEX_BITS, int(s.lut_items_in_bits))
    a_max = alpha * _vmax(self, inp) ** 2 / (s_in * s_in)
    top = float(2 ** LRN_INDEX_BITS - 2 ** LRN_INDEX_BITS // entries)
    s_u = top / a_max if a_max > 0 else 1.0
    quantize_activation(self, out, is_signed(self, inp))
    m, sh, m_dtype, sh_dtype = scale_shift(s_u * alpha / (size * s_in * s_in), AIFF_MULTIPLIER_BITS,
                                           force_shift_positive=s.force_shift_positive)
    self.params["scale_sum_value"] = int(m)
    self.params["scale_sum_type"] = m_dtype
    self.params["shift_sum_value"] = int(sh)
    self.params["shift_sum_type"] = sh_dtype

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.pow(bias + a, -beta)

    f_max = max(bias ** -beta, float(fn(torch.tensor(a_max, dtype=torch.float64))))
    s_f = (2 ** LRN_VALUE_BITS - 1) / f_max
    set_constant(self, "lut", lrn_table(fn, s_u, s_f, entries), range_dtype(0, 2 ** LRN_VALUE_BITS - 1))
    store_requant(self, *requant_scale_shift(self, tensor_scale(self, out) / (s_in * s_f)))


def _lrn_integer_forward(node: PyNode, size: int) -> torch.Tensor:
    """v = x_q + zp; u = clamp(round_half_even(Σ_window v² * M_sum / 2^N_sum), 0, 65535); L = lut at u
    (the table interpolation of docs/semantics/normalization.md over a 16-bit index); y = requant(v * L)."""
    out = node.outputs[0]
    x, zp = int_input(node)
    if x.dim() < 2:
        raise node._error(f"LRN needs an input of rank >= 2, got {x.dim()}")
    v = x + zp
    sq = _window_sum(v * v, size)
    u = requantize_int(sq, _int_param(node, "scale_sum_value"), _int_param(node, "shift_sum_value"), 0, 0,
                       2 ** LRN_INDEX_BITS - 1)
    lut = node.get_constant("lut")
    level = lookup_lut(u, lut.betensor, 0, LRN_INDEX_BITS, LRN_VALUE_BITS, False)
    mult, shift = requant_of(node)
    qmin, qmax = out_range(node, out)
    return requantize_int(v * level, mult, shift, tensor_zp(node, out), qmin, qmax)


@LRN.export
def convert_lrn(g: QDQGraph, node: PyNode) -> None:
    """"exact" mode: the integer forward in float64, exact under the bounds checked here: v = x + zp, the window's
    Σ v² by a zero Pad and `size` Slices of the channel axis, the 16-bit index requantized, the level looked up
    in the table interpolated at every one of the 2^16 indices (a Gather: the interpolation is quantopt's own),
    v · level requantized. Otherwise (other scale modes, bounds beyond float64) the float ONNX LRN between
    DequantizeLinear and QuantizeLinear, on 4-D inputs channels-first and odd sizes (ONNX centres an even window
    one channel higher)."""
    size, alpha, beta, bias = _lrn_params(node)
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    if g.unit_domain and _exact_lrn(g, node, size, rank):
        return
    if rank != 4:
        raise node_error(node, f"the float ONNX LRN takes 4-D inputs, got rank {rank}")
    if size % 2 == 0:
        raise node_error(node, f"the float ONNX LRN centres an even window ({size}) one channel higher than the "
                               "layer; export with the default scales")
    perm = channels_first(rank)
    out = g.add("LRN", [g.float_value(x, perm)], size=size, alpha=alpha, beta=beta, bias=bias)
    g.quantize(y, out, perm)


def _exact_lrn(g: QDQGraph, node: PyNode, size: int, rank: int) -> bool:
    """The exact form of `convert_lrn`; False (nothing added) where a bound leaves float64's exact integers."""
    x = node.inputs[0]
    vmax = offset_absmax(node, x)
    m_sum = abs(_int_param(node, "scale_sum_value"))
    ratio = exact_ratio(node)
    mult, _ = requant_of(node)
    m_out = int(mult.abs().max()) if isinstance(mult, torch.Tensor) else abs(int(mult))
    top = 2 ** LRN_VALUE_BITS - 1
    if ratio is None or not fits_double(size * vmax * vmax * max(m_sum, 1)) \
            or not fits_double(vmax * top * max(m_out, 1)) or _int_param(node, "shift_sum_value") > MAX_EXACT_SHIFT:
        return False
    perm = channels_first(rank)
    axis = perm.index(rank - 1)
    channels = int(x.ir_shape[-1])
    v = codes(g, x, perm)
    squares = g.add("Mul", [v, v])
    if size > 1:
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = size // 2, (size - 1) // 2
        padded = g.add("Pad", [squares, g.ints(f"{node.name}/pads", pads),
                               g.const(f"{node.name}/pad_zero", np.array(0.0, dtype=np.float64))])
        axes = g.ints(f"{node.name}/axis", [axis])
        total = None
        for k in range(size):
            part = g.add("Slice", [padded, g.ints(f"{node.name}/start{k}", [k]),
                                   g.ints(f"{node.name}/end{k}", [k + channels]), axes])
            total = part if total is None else g.add("Add", [total, part])
        squares = total
    sum_ratio = math.ldexp(float(_int_param(node, "scale_sum_value")), -_int_param(node, "shift_sum_value"))
    index = g.add("Round", [g.add("Mul", [squares, g.const(f"{node.name}/sum_ratio",
                                                             np.array(sum_ratio, dtype=np.float64))])])
    index = g.add("Clip", [index, g.const(f"{node.name}/index_min", np.array(0.0, dtype=np.float64)),
                           g.const(f"{node.name}/index_max", np.array(2.0 ** LRN_INDEX_BITS - 1, dtype=np.float64))])
    levels = lookup_lut(torch.arange(2 ** LRN_INDEX_BITS, dtype=torch.int64), node.get_constant("lut").betensor.cpu(),
                        0, LRN_INDEX_BITS, LRN_VALUE_BITS, False)
    level = g.add("Gather", [g.const(f"{node.name}/levels", levels.numpy().astype(np.float64)),
                             g.add("Cast", [index], to=INT64)], axis=0)
    shape = [1] * rank
    shape[axis] = -1
    requantize(g, node, g.add("Mul", [v, level]), ratio, perm, channel_shape=shape if ratio.size > 1 else None)
    return True


# =============================================================================================== Normalization
NORMALIZATION = declare_op(
    "Normalization",
    params={"method": Param(Text(choices=("L2", "L1")), "the norm (L1 is not supported)", default="L2"),
            "axis": Param(Axis(), "the normalized axes", default=-1),
            "epsilon": Param(Float(), "lower bound of the squared norm", default=NORMALIZATION_EPSILON),
            "eps_value": quantized(Float(), "integer epsilon of the sum of squares (an int64 integer: may exceed "
                                            "2^31)"),
            "reciprocal_shift_value": quantized(Int(), _UPSTREAM),
            "reciprocal_shift_type": quantized(DtypeName(), _UPSTREAM)},
    constants={"lut": "upstream's table; not read", "scale": "per-channel requantization multipliers (refused)",
               "shift": "per-channel requantization shifts (refused)"},
    integer="sum of squares, integer inverse square root, requantization",
    semantics=f"{_NORM_SEM}#normalization")


def _lp_params(node: PyNode, rank: int) -> Tuple[List[int], float]:
    method = str(node.get_param("method", optional=True, default_value="L2")).upper()
    if method == "L1":
        raise UnsupportedError(f"layer '{node.name}' (Normalization): method L1 is not supported (L2 is)")
    if method != "L2":
        raise node._error(f"method must be L2 (or L1), got {method!r}")
    axes = _int_list(node, "axis", node.get_param("axis", optional=True, default_value=-1), rank)
    eps = _float_param(node, "epsilon", NORMALIZATION_EPSILON)
    if eps < 0:
        raise node._error(f"epsilon must be >= 0, got {eps}")
    return axes, eps


@NORMALIZATION.forward
def l2_normalization_forward(self: PyNode) -> None:
    """y = x / sqrt(max(Σ_axis x², epsilon)) (method L2, default axis -1, default epsilon 1e-12)."""
    if self.quantized:
        self.outputs[0].betensor = _l2_integer_forward(self)
        return
    x = self.inputs[0].betensor
    x = x.float() if not x.is_floating_point() else x
    axes, eps = _lp_params(self, x.dim())
    with one_thread():  # summed over every axis, to one value, it would depend on the thread count
        ss = torch.sum(x * x, dim=axes, keepdim=True)
    self.outputs[0].betensor = x / torch.sqrt(torch.clamp(ss, min=eps))


@NORMALIZATION.quantize
def l2_normalization_quantize(self: PyNode) -> None:
    """Output signed iff the input can be negative; eps_value = round_half_even(epsilon * s_in²);
    scale_value/shift_value approximate s_out (the normalized value is scale free)."""
    inp, out = self.inputs[0], self.outputs[0]
    if quant_of(self).get(inp).qmin is None:
        raise self._error(f"input '{inp.name}' is not quantized; quantize the producer first")
    if layer_settings(self).q_mode_activation.startswith("per_channel"):
        raise UnsupportedError(f"layer '{self.name}' (Normalization): per-channel activation quantization is not "
                               "supported")
    axes, eps = _lp_params(self, len(inp.ir_shape))
    count = math.prod(int(inp.ir_shape[a]) for a in axes)
    if count * _vmax(self, inp) ** 2 >= 2 ** SUM_SQUARES_BITS:
        raise UnsupportedError(f"layer '{self.name}' (Normalization): the sum of squares overflows 62 bits")
    qmin, _ = out_range(self, inp)
    quantize_activation(self, out, qmin + tensor_zp(self, inp) < 0)
    s_in = tensor_scale(self, inp)
    self.params["eps_value"] = int(round(eps * s_in * s_in))
    store_requant(self, *requant_scale_shift(self, tensor_scale(self, out)))


def _l2_integer_forward(node: PyNode) -> torch.Tensor:
    """v = x_q + zp; Q = max(Σv², eps_value, 1); (R, t) = inverse_sqrt(Q);
    y = clamp(round_half_even(v * R * M / 2^(31 + t/2 + shift)) - zp_out, qmin, qmax)."""
    out = node.outputs[0]
    x, zp = int_input(node)
    if x.numel() == 0:
        return x.clone()
    axes, _ = _lp_params(node, x.dim())
    v = x + zp
    count = math.prod(int(x.shape[a]) for a in axes)
    if count * int(v.abs().max()) ** 2 >= 2 ** SUM_SQUARES_BITS:
        raise UnsupportedError(f"layer '{node.name}' (Normalization): the sum of squares overflows 62 bits")
    q = torch.clamp((v * v).sum(dim=axes, keepdim=True), min=max(1, _int_param(node, "eps_value")))
    r, t = inverse_sqrt(q)
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node._error("Normalization needs one scale_value/shift_value, not per-channel constants")
    qmin, qmax = out_range(node, out)
    return torch.clamp(round_shift(v * r * mult, RSQRT_FRAC_BITS + (t >> 1) + shift) - tensor_zp(node, out), qmin, qmax)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@NORMALIZATION.export
def convert_l2_normalization(g: QDQGraph, node: PyNode) -> None:
    """"exact" mode: the integer forward in int64 (Σv² clamped below by eps_value, its bit length, the normalizing
    shift t, isqrt(2^62 / Q') as in the LayerNorm form), then v · R · M in float64 (below 2^48: exact) scaled by
    the power of two 2^-(31 + t/2 + shift) of each row and rounded half to even. Other modes: the float form
    x / sqrt(max(Σx², epsilon)), scaled by the multiplier's rounding."""
    x, y = node.inputs[0], node.outputs[0]
    axes, eps = _lp_params(node, g.rank(x))
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node_error(node, "Normalization needs one scale_value/shift_value, not per-channel constants")
    if g.unit_domain:
        _exact_l2_normalization(g, node, axes, int(mult), int(shift))
        return
    value = g.float_value(x)
    squares = g.add("ReduceSumSquare", [value, g.ints(f"{node.name}/axes", axes)], keepdims=1)
    floor = g.const(f"{node.name}/epsilon", np.array(eps, dtype=np.float32))
    out = g.add("Div", [value, g.add("Sqrt", [g.add("Max", [squares, floor])])])
    g.quantize(y, g.rescale(out, float(requant_ratio(node)[0]) / float(tensor_scale(node, y))))


def _inverse_sqrt_int64(g: QDQGraph, node: PyNode, q: str) -> Tuple[str, str, str]:
    """`inverse_sqrt` of int64 `q` >= 1 as ONNX nodes: (R, t, the int64 table of 2^0 .. 2^62 it used), where
    t = (e - 30) rounded up to even for e = bit_length(q), Q' = q · 2^-t and R = isqrt(floor(2^62 / Q'))."""
    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    over = g.add("Sub", [bit_length_int64(g, node, q, "squares"), int64("norm_bits", RSQRT_NORM_BITS)])
    t = g.add("Add", [over, g.add("Mod", [over, int64("two", 2)])])
    table = int64("pow2", np.array([1 << k for k in range(63)], dtype=np.int64))
    right = g.add("Gather", [table, g.add("Max", [t, int64("zero", 0)])], axis=0)
    left = g.add("Gather", [table, g.add("Max", [g.add("Neg", [t]), int64("zero_left", 0)])], axis=0)
    qn = g.add("Mul", [g.add("Div", [q, right]), left])
    return isqrt_int64(g, node, g.add("Div", [int64("numerator", 1 << RSQRT_NUMERATOR_BITS), qn])), t, table


def _exact_l2_normalization(g: QDQGraph, node: PyNode, axes: Sequence[int], mult: int, shift: int) -> None:
    """The "exact" form of `convert_l2_normalization` (docs/semantics/normalization.md, "Normalization")."""
    x = node.inputs[0]

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    v = g.add("Cast", [codes(g, x)], to=INT64)
    squares = g.add("ReduceSum", [g.add("Mul", [v, v]), g.ints(f"{node.name}/axes", list(axes))], keepdims=1)
    q = g.add("Max", [squares, int64("eps", max(1, _int_param(node, "eps_value")))])
    r, t, _ = _inverse_sqrt_int64(g, node, q)
    product = g.add("Cast", [g.add("Mul", [g.add("Mul", [v, r]), int64("multiplier", mult)])], to=DOUBLE)
    # t is even and lies in [-28, 32] for 1 <= Q < 2^62: the row's shift 31 + t/2 + shift takes 31 values
    low = RSQRT_FRAC_BITS - 14 + shift
    steps = np.array([math.ldexp(1.0, -(low + k)) for k in range(31)], dtype=np.float64)
    index = g.add("Add", [g.add("Div", [t, int64("half", 2)]), int64("step_start", 14)])
    scaled = g.add("Mul", [product, g.add("Gather", [g.const(f"{node.name}/steps", steps), index], axis=0)])
    requantize(g, node, scaled, 1.0, None)


@dataclasses.dataclass(frozen=True)
class NormView:
    """How the exported normalization sees its input when its groups are not axes of the IR layout (GroupNorm):
    the shape of a Reshape of the integers (0: the batch, copied) and the normalized axes of that shape."""
    shape: Tuple[int, ...]
    axes: Tuple[int, ...]


def _viewed(g: QDQGraph, node: PyNode, value: str, view: Optional[NormView], ir_shape: Sequence[int],
            back: bool = False) -> str:
    """`value` reshaped into `view` (or, `back`, from it to the IR shape); itself without a view."""
    if view is None:
        return value
    shape = [0, *ir_shape[1:]] if back else list(view.shape)
    return g.add("Reshape", [value, g.ints(f"{node.name}/{'ir' if back else 'view'}_shape", shape)])


def exact_layer_norm(g: QDQGraph, node: PyNode, axes: Sequence[int], view: Optional[NormView] = None) -> bool:
    """LayerNorm, InstanceNorm, GroupNorm, MVN (or RMSNorm, without the mean) over `axes` (of `view` where given)
    with quantopt's integer normalization (docs/semantics/normalization.md), in int64: the mean with F fraction
    bits, the sum of squares, the inverse square root (bit length by comparison with every power of two, isqrt from
    a float64 square root corrected by ±1), the 16-bit normalized tensor, then gamma/beta and the per-element
    multipliers in float64. An MVN without variance requantizes v · 2^F - mean itself."""
    if not g.unit_domain or str(node.type) not in ("LayerNorm", "RMSNorm", "InstanceNorm", "GroupNorm", "MVN") or \
            "norm_frac_bits" not in node.params:
        return False
    x = node.inputs[0]
    shape = [int(v) for v in x.ir_shape]
    axes = list(view.axes) if view is not None else list(axes)
    count = int(np.prod([(view.shape if view is not None else shape)[a] for a in axes]))
    frac = int(node.params["norm_frac_bits"])
    ratio = exact_ratio(node)
    if ratio is None or frac < 0:
        return False
    affine, gamma, beta = norm_affine(node, shape)

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    axes_input = g.ints(f"{node.name}/axes", axes)
    v = _viewed(g, node, g.add("Cast", [codes(g, x)], to=INT64), view, shape)
    scaled = g.add("Mul", [v, int64("mean_scale", 1 << frac)])
    if str(node.type) == "RMSNorm":
        d = scaled
    else:
        mean = round_div_int64(g, node, g.add("ReduceSum", [scaled, axes_input], keepdims=1), int64("count", count))
        d = g.add("Sub", [scaled, mean])
    if not _normalize_variance(node):  # y = requant(d) with the shift and F: exact while shift + F stays in range
        _, shift = requant_of(node)
        if int(torch.as_tensor(shift).max()) + frac > MAX_EXACT_SHIFT:
            return False
        value = g.add("Cast", [_viewed(g, node, d, view, shape, back=True)], to=DOUBLE)
        requantize(g, node, value, ratio * 2.0 ** -frac, None,
                   channel_shape=_channel_shape(node, shape) if ratio.size > 1 else None)
        return True
    eps_value = int(node.params["eps_value"])
    m_n, sh_n = int(node.params["norm_scale_value"]), int(node.params["norm_shift_value"])
    squares = g.add("Add", [g.add("ReduceSum", [g.add("Mul", [d, d]), axes_input], keepdims=1),
                            int64("eps", count * eps_value)])
    q = g.add("Max", [squares, int64("one_min", 1)])
    r, t, table = _inverse_sqrt_int64(g, node, q)
    shift = g.add("Add", [g.add("Div", [t, int64("half", 2)]), int64("norm_shift", RSQRT_FRAC_BITS + sh_n)])
    product = g.add("Mul", [g.add("Mul", [d, r]), int64("norm_scale", m_n)])
    limit = 2 ** (NORM_BITS - 1) - 1
    normalized = g.add("Clip", [round_div_int64(g, node, product, g.add("Gather", [table, shift], axis=0)),
                                int64("norm_min", -limit), int64("norm_max", limit)])
    acc = g.add("Cast", [_viewed(g, node, normalized, view, shape, back=True)], to=DOUBLE)
    if gamma is not None:
        acc = g.add("Mul", [acc, g.const(f"{node.name}/gamma", gamma.to(torch.float64).cpu().numpy())])
    if beta is not None:
        acc = g.add("Add", [acc, g.const(f"{node.name}/beta", beta.to(torch.float64).cpu().numpy())])
    requantize(g, node, acc, ratio, None, channel_shape=affine if ratio.size > 1 else None)
    return True


def exact_layer_norm_upstream(g: QDQGraph, node: PyNode, axes: Sequence[int], view: Optional[NormView] = None) -> bool:
    """LayerNorm (or InstanceNorm) in upstream's form (docs/semantics/normalization.md, "LayerNorm, GroupNorm and
    InstanceNorm, upstream form") over `axes` of the IR layout, in int64: the rounded mean, the sum of squares
    shifted (8 bits) or divided by N (16 bits), the table inverse square root (bit length, normalizing shift, index
    and 15-bit fraction, interpolation), the normalized tensor, then gamma/beta and the multipliers in float64. Also
    in "effective" mode: the rounded mean and the table have no float form within a step (rows of small variance
    move by many). False in "ir" mode, or where the multipliers' shifts leave float64 (the caller then refuses the
    layer)."""
    if g.scales == "ir" or str(node.type) not in ("LayerNorm", "InstanceNorm", "GroupNorm") or \
            "lut" not in node.constants:
        return False
    x, y = node.inputs[0], node.outputs[0]
    table = node.constants["lut"].betensor.to(torch.int64).reshape(-1).cpu().numpy()
    ratio = exact_ratio(node)
    if ratio is None or table.size != 3 * ISQRT_TABLE_STEPS + 1:
        return False
    shape = [int(v) for v in x.ir_shape]
    axes = list(view.axes) if view is not None else list(axes)
    count = int(np.prod([(view.shape if view is not None else shape)[a] for a in axes]))
    m_n, sh_n = int(node.params["norm_scale_value"]), int(node.params["norm_shift_value"])
    q_y = quant_of(node).get(y)
    lo, hi = integer_range(int(q_y.qbits or range_bits(node, y)), int(q_y.qmin) < 0)
    affine, gamma, beta = norm_affine(node, shape)

    def int64(what: str, v: object) -> str:
        return g.const(f"{node.name}/{what}", np.asarray(v, dtype=np.int64))

    pow2 = int64("pow2", [1 << k for k in range(63)])

    def shifted(value: str, k: int, what: str) -> str:
        """round_half_even(value / 2^k), or value · 2^-k for k <= 0."""
        if k <= 0:
            return g.add("Mul", [value, int64(f"{what}_scale", 1 << -k)])
        return round_div_int64(g, node, value, int64(f"{what}_den", 1 << k))

    axes_input = g.ints(f"{node.name}/axes", axes)
    v = g.add("Cast", [codes(g, x)], to=INT64)
    zp_in = tensor_zp(node, x)
    if zp_in:  # the stored integers themselves: half-to-even ties of the mean move with an odd zero point
        v = g.add("Sub", [v, int64("input_zero_point", zp_in)])
    v = _viewed(g, node, v, view, shape)
    d = g.add("Sub", [v, round_div_int64(g, node, g.add("ReduceSum", [v, axes_input], keepdims=1),
                                         int64("count", count))])
    squares = g.add("ReduceSum", [g.add("Mul", [d, d]), axes_input], keepdims=1)
    in8 = range_bits(node, x) <= 8
    if in8:
        vs = int(node.params["var_shift_value"])
        var = g.add("Div", [squares, int64("var_shift", 1 << vs)]) if vs >= 0 else \
            g.add("Mul", [squares, int64("var_shift", 1 << -vs)])
    else:
        var = g.add("Div", [squares, int64("var_count", count)])  # non-negative: truncation is the floor
    top = int64("norm_top", ISQRT_NORM_BITS + 1)
    k = g.add("Min", [g.add("Max", [g.add("Sub", [top, bit_length_int64(g, node, var, "variance")]),
                                    int64("k_min", 0)]),
                      int64("k_max", ISQRT_NORM_BITS)])
    e = g.add("Sub", [top, k])
    u = g.add("Mul", [var, g.add("Gather", [pow2, k], axis=0)])
    f = g.add("Div", [u, g.add("Gather", [pow2, g.add("Mod", [e, int64("two", 2)])], axis=0)])
    index_shift = ISQRT_NORM_BITS - 7  # the top 8 bits of f index the table (64 .. 255, less 64)
    i = g.add("Max", [g.add("Sub", [g.add("Div", [f, int64("index_den", 1 << index_shift)]),
                                     int64("index_base", ISQRT_TABLE_STEPS)]), int64("index_min", 0)])
    a = g.add("Mod", [g.add("Div", [f, int64("fraction_den", 1 << (index_shift - ISQRT_TABLE_BITS))]),
                      int64("fraction_mod", 1 << ISQRT_TABLE_BITS)])
    lut = int64("isqrt_table", table)
    t_i = g.add("Gather", [lut, i], axis=0)
    t_next = g.add("Gather", [lut, g.add("Add", [i, int64("index_next", 1)])], axis=0)
    r = g.add("Sub", [g.add("Mul", [t_i, int64("table_scale", 1 << 16)]),
                      g.add("Mul", [g.add("Mul", [g.add("Sub", [t_i, t_next]), a]), int64("twice", 2)])])
    half_e = g.add("Div", [g.add("Sub", [e, int64("e_one", 1)]), int64("e_two", 2)])
    gain = g.add("Div", [g.add("Add", [g.add("Div", [r, g.add("Gather", [pow2, half_e], axis=0)]),
                                       int64("gain_half", 1 << 15)]), int64("gain_den", 1 << 16)])
    if in8:
        normalized = shifted(g.add("Mul", [g.add("Mul", [d, gain]), int64("norm_scale", m_n)]),
                             UPSTREAM_NORM_Q8 + sh_n, "norm")
    else:
        gain = g.add("Clip", [shifted(g.add("Mul", [gain, int64("norm_scale", m_n)]), sh_n, "gain"),
                              int64("gain_min", 0), int64("gain_max", (1 << 16) - 1)])
        half_d = g.add("Div", [g.add("Sub", [d, g.add("Mod", [d, int64("d_two", 2)])]), int64("d_half", 2)])
        normalized = shifted(g.add("Mul", [half_d, gain]), UPSTREAM_NORM_Q16, "norm")
    normalized = g.add("Clip", [normalized, int64("norm_min", lo), int64("norm_max", hi)])
    acc = g.add("Cast", [_viewed(g, node, normalized, view, shape, back=True)], to=DOUBLE)
    if gamma is not None:
        w = gamma_codes(node, shape).to(torch.float64).cpu().numpy()
        acc = g.add("Mul", [acc, g.const(f"{node.name}/gamma", w)])
    if beta is not None:
        acc = g.add("Add", [acc, g.const(f"{node.name}/beta", beta.to(torch.float64).cpu().numpy())])
    requantize(g, node, acc, ratio, None, channel_shape=_channel_shape(node, shape) if ratio.size > 1 else None)
    return True


@GROUPNORM.export
def convert_groupnorm(g: QDQGraph, node: PyNode) -> None:
    """As InstanceNorm's, on a view of the integers that makes each group one set of axes: [B, A, group,
    C/group, Z] for channels C on axis 1 + len(A), normalized over (A, C/group, Z), then back to the IR shape for
    gamma/beta (per channel) and the multipliers. Upstream's form (the default) in "exact" and "effective" modes,
    quantopt's in "exact" mode; refused otherwise."""
    x = node.inputs[0]
    rows = _Rows(node, [int(d) for d in x.ir_shape])
    assert rows.group is not None  # a GroupNorm's rows are its groups
    groups, outer, width, inner = rows.group
    view = NormView((0, outer, groups, width, inner), (1, 3, 4))
    if "norm_scale_value" not in node.params:
        raise node_error(node, "a quantized GroupNorm needs norm_scale_value/norm_shift_value")
    if "norm_frac_bits" in node.params:
        if exact_layer_norm(g, node, view.axes, view):
            return
        raise node_error(node, "quantopt's integer GroupNorm is exported in the exact mode only")
    if "lut" not in node.constants:
        raise node_error(node, "a quantized GroupNorm needs norm_frac_bits (exact form) or its 'lut' (upstream form)")
    if not exact_layer_norm_upstream(g, node, view.axes, view):
        raise node_error(node, "the integer GroupNorm has no ONNX form in 'ir' mode, or its multiplier shifts leave "
                               "float64; export with the default scales")


@MVN.export
def convert_mvn(g: QDQGraph, node: PyNode) -> None:
    """Exact in "exact" mode: quantopt's integer normalization over the normalized axes (as LayerNorm's), or without
    variance the mean subtraction and one requantization; refused in the other modes (its rounded mean has no
    float form within a step)."""
    axes = _reduce_axes(node, g.rank(node.inputs[0]))
    if exact_layer_norm(g, node, axes):
        return
    raise node_error(node, "MVN is exported in the exact mode only, with multiplier shifts that stay in float64")


@INSTANCENORM.export
def convert_instancenorm(g: QDQGraph, node: PyNode) -> None:
    """Exact in int64 over the normalized axes of the IR layout (the spatial axes by default), in either integer
    form: upstream's (its table inverse square root) in "exact" and "effective" modes, quantopt's in "exact" mode;
    refused otherwise (no float InstanceNorm follows the integers within a step)."""
    x = node.inputs[0]
    axes = _reduce_axes(node, g.rank(x))
    if "norm_scale_value" not in node.params:
        raise node_error(node, "a quantized InstanceNorm needs norm_scale_value/norm_shift_value")
    if "norm_frac_bits" in node.params:
        if exact_layer_norm(g, node, axes):
            return
        raise node_error(node, "quantopt's integer InstanceNorm is exported in the exact mode only")
    if "lut" not in node.constants:
        raise node_error(node, "a quantized InstanceNorm needs norm_frac_bits (exact form) or its 'lut' (upstream "
                               "form)")
    if not exact_layer_norm_upstream(g, node, axes):
        raise node_error(node, "the integer InstanceNorm has no ONNX form in 'ir' mode, or its multiplier shifts "
                               "leave float64; export with the default scales")


@RMSNORM.export
def convert_rmsnorm(g: QDQGraph, node: PyNode) -> None:
    """Exact in "exact" mode (the integer normalization in int64, as LayerNorm's without the mean); otherwise the
    float form x / sqrt(mean(x²) + epsilon) · gamma + beta with gamma/beta the integer weights and biases dequantized
    with the scales the integer forward applies."""
    x, y = node.inputs[0], node.outputs[0]
    axes = _trailing_axes(node, g.rank(x))
    if "norm_frac_bits" not in node.params or "norm_scale_value" not in node.params:
        raise node_error(node, "a quantized RMSNorm needs norm_frac_bits and norm_scale_value/norm_shift_value")
    if exact_layer_norm(g, node, axes):
        return
    count = math.prod(int(x.ir_shape[a]) for a in axes)
    norm_scale = float(node.params["norm_scale_value"]) * 2.0 ** -float(node.params["norm_shift_value"]) \
        / math.sqrt(count)
    affine = tuple(int(x.ir_shape[a]) for a in axes)
    ratio = requant_ratio(node) / tensor_scale(node, y)
    ratio = ratio.reshape(affine) if ratio.size > 1 else float(ratio[0])
    w_t = node.get_constant("weights", optional=True)
    b_t = node.get_constant("biases", optional=True)
    w = effective_weights(node).to(torch.float64).reshape(affine).cpu().numpy() if w_t is not None \
        else np.ones(affine)
    b = b_t.betensor.to(torch.float64).reshape(affine).cpu().numpy() if b_t is not None else np.zeros(affine)
    value = g.float_value(x)
    axes_input = g.ints(f"{node.name}/axes", list(axes))
    mean_square = g.add("ReduceMean", [g.add("Mul", [value, value]), axes_input], keepdims=1)
    eps = np.asarray(float(node.get_param("epsilon")), dtype=np.float32)
    rms = g.add("Sqrt", [g.add("Add", [mean_square, g.const(f"{node.name}/epsilon", eps)])])
    scaled = g.add("Mul", [g.add("Div", [value, rms]),
                           g.const(f"{node.name}/gamma", (w * norm_scale * ratio).astype(np.float32))])
    out = g.add("Add", [scaled, g.const(f"{node.name}/beta", (b * ratio * np.ones(affine)).astype(np.float32))])
    g.quantize(y, out)


def _trailing_axes(node: PyNode, rank: int) -> List[int]:
    """The normalized axes of a norm layer, which the ONNX forms need to be the trailing ones."""
    raw = node.get_param("axis", optional=True, default_value=[-1])
    axes = sorted({axis_param(node, a, rank) for a in (raw if isinstance(raw, (list, tuple)) else [raw])})
    if axes != list(range(axes[0], rank)):
        raise node_error(node, f"normalized axes {axes} are not the trailing axes of a rank-{rank} input")
    return axes


@LAYERNORM.export
def convert_layernorm(g: QDQGraph, node: PyNode) -> None:
    """LayerNormalization over trailing axes with the IR epsilon; gamma/beta are the integer weights and biases
    dequantized with the scales the integer forward applies (normalized value · M_n 2^-N_n / sqrt(N), then the
    output multiplier), stored as float initializers."""
    x, y = node.inputs[0], node.outputs[0]
    axes = _trailing_axes(node, g.rank(x))
    if "norm_scale_value" not in node.params:
        raise node_error(node, "a quantized LayerNorm needs norm_scale_value/norm_shift_value")
    upstream = "norm_frac_bits" not in node.params  # upstream's integer form (docs/semantics/normalization.md)
    if upstream and "lut" not in node.constants:
        raise node_error(node, "a quantized LayerNorm needs norm_frac_bits (exact form) or its 'lut' (upstream form)")
    if exact_layer_norm(g, node, axes) or (upstream and exact_layer_norm_upstream(g, node, axes)):
        return
    if upstream and g.scales != "ir":
        raise node_error(node, "the integer LayerNorm's multiplier shifts are too large for an exact float64 "
                               "requantization; export with --scales ir")
    count = math.prod(int(x.ir_shape[a]) for a in axes)
    if upstream:
        norm_scale = upstream_norm_gain(node)
    else:
        norm_scale = float(node.params["norm_scale_value"]) * 2.0 ** -float(node.params["norm_shift_value"]) \
            / math.sqrt(count)
    affine = tuple(int(x.ir_shape[a]) for a in axes)
    ratio = requant_ratio(node) / tensor_scale(node, y)
    if ratio.size > 1:  # per element (exact form) or per channel of the last axis (upstream form)
        ratio = ratio.reshape(affine if ratio.size == math.prod(affine) else (1,) * (len(axes) - 1) + affine[-1:])
    else:
        ratio = float(ratio[0])
    w_t = node.get_constant("weights", optional=True)
    b_t = node.get_constant("biases", optional=True)
    if w_t is None:
        w = np.ones(affine)
    elif upstream:
        w = gamma_codes(node, list(x.ir_shape)).to(torch.float64).reshape(affine).cpu().numpy()
    else:
        w = effective_weights(node).to(torch.float64).reshape(affine).cpu().numpy()
    b = b_t.betensor.to(torch.float64).reshape(affine).cpu().numpy() if b_t is not None else np.zeros(affine)
    gamma = (w * norm_scale * ratio).astype(np.float32)
    beta = (b * ratio * np.ones(affine)).astype(np.float32)
    eps = float(node.get_param("epsilon"))
    out = g.add("LayerNormalization", [g.float_value(x), g.const(f"{node.name}/gamma", gamma),
                                       g.const(f"{node.name}/beta", beta)], axis=axes[0], epsilon=eps)
    g.quantize(y, out)
