"""Quantization parameters from a float range, and (de)quantization, in OPT's convention
(docs/integer-semantics.md, Conventions).

OPT stores `scale` as "quantized units per float unit" and subtracts the zero point:
    quantize:   q = clamp(round(scale * x - zerop), qmin, qmax)
    dequantize: x = (q + zerop) / scale
Precision follows upstream bit for bit (checked against the golden IRs in tests/quant/test_golden_vectors.py):
ranges, scales and zero points are float32 tensor arithmetic; `quantize` multiplies in float32 and `dequantize`
multiplies by the float32 reciprocal of the scale. Both take `compute_dtype=torch.float64` for exact arithmetic.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .dtype import Dtype, int_dtype_for_bits
from .hardware import FLT_EPSILON
from .requant import broadcasts_into
from .rounding import FLOAT32_EXACT, FLOAT32_STRUCT, RoundMode, round_tensor

Number = Union[int, float]
ScaleLike = Union[float, torch.Tensor]
ZeropLike = Union[int, float, torch.Tensor]


class QuantMode(str, enum.Enum):
    """The nine quantization method names (cfg `quantize_method_for_weight/activation`)."""

    PER_TENSOR_SYMMETRIC_RESTRICTED_RANGE = "per_tensor_symmetric_restricted_range"
    PER_TENSOR_SYMMETRIC_FULL_RANGE = "per_tensor_symmetric_full_range"
    PER_TENSOR_ASYMMETRIC = "per_tensor_asymmetric"
    PER_CHANNEL_SYMMETRIC_RESTRICTED_RANGE = "per_channel_symmetric_restricted_range"
    PER_CHANNEL_SYMMETRIC_FULL_RANGE = "per_channel_symmetric_full_range"
    PER_CHANNEL_ASYMMETRIC = "per_channel_asymmetric"
    PER_BLOCK_SYMMETRIC_RESTRICTED_RANGE = "per_block_symmetric_restricted_range"
    PER_BLOCK_SYMMETRIC_FULL_RANGE = "per_block_symmetric_full_range"
    PER_BLOCK_ASYMMETRIC = "per_block_asymmetric"

    @classmethod
    def from_name(cls, name: Union[str, QuantMode]) -> QuantMode:
        """Case-insensitive lookup; unknown names raise ValueError listing the valid ones."""
        if isinstance(name, QuantMode):
            return name
        key = str(name).strip().lower()
        for m in cls:
            if m.value == key:
                return m
        raise ValueError(f"unknown quantization mode '{name}' (expected one of: {', '.join(m.value for m in cls)})")

    @classmethod
    def make(cls, granularity: str, asymmetric: bool, full_range: bool) -> QuantMode:
        """Build a mode from its parts; asymmetric modes are always full range (as upstream's `make_mode`)."""
        if asymmetric:
            return cls(f"{granularity}_asymmetric")
        return cls(f"{granularity}_symmetric_{'full' if full_range else 'restricted'}_range")

    @property
    def granularity(self) -> str:
        return self.value.split("_", 2)[0] + "_" + self.value.split("_", 2)[1]

    @property
    def is_per_tensor(self) -> bool:
        return self.value.startswith("per_tensor")

    @property
    def is_per_channel(self) -> bool:
        return self.value.startswith("per_channel")

    @property
    def is_per_block(self) -> bool:
        return self.value.startswith("per_block")

    @property
    def is_asymmetric(self) -> bool:
        return self.value.endswith("asymmetric")

    @property
    def is_symmetric(self) -> bool:
        return not self.is_asymmetric

    @property
    def is_full_range(self) -> bool:
        """Asymmetric modes count as full range (signed asymmetric uses [-2^(b-1), 2^(b-1)-1])."""
        return not self.value.endswith("restricted_range")

    @property
    def is_restricted(self) -> bool:
        return not self.is_full_range

    def to_per_channel(self) -> QuantMode:
        return QuantMode.make("per_channel", self.is_asymmetric, self.is_full_range)

    def to_per_tensor(self) -> QuantMode:
        return QuantMode.make("per_tensor", self.is_asymmetric, self.is_full_range)

    def to_symmetric(self) -> QuantMode:
        """Symmetric counterpart; restricted range, as upstream's `to_symmetric` does."""
        return QuantMode.make(self.granularity, False, False)

    def to_asymmetric(self) -> QuantMode:
        return QuantMode.make(self.granularity, True, True)


ACTIVATION_MODES = (QuantMode.PER_TENSOR_SYMMETRIC_RESTRICTED_RANGE, QuantMode.PER_TENSOR_SYMMETRIC_FULL_RANGE,
                    QuantMode.PER_TENSOR_ASYMMETRIC, QuantMode.PER_CHANNEL_SYMMETRIC_RESTRICTED_RANGE,
                    QuantMode.PER_CHANNEL_SYMMETRIC_FULL_RANGE)
"""Modes accepted for activations (docs/user-guide.md, `quantize_method_for_activation`)."""


def integer_range(bits: int, signed: bool, restricted: bool = False) -> Tuple[int, int]:
    """Clamp range: unsigned [0, 2^b-1]; signed [-2^(b-1), 2^(b-1)-1]; signed restricted drops -2^(b-1)."""
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    if not signed:
        return 0, 2 ** bits - 1
    qmax = 2 ** (bits - 1) - 1
    return (-qmax if restricted else -qmax - 1), qmax


@dataclass
class QuantParams:
    """Result of `linear_quant_params`: python numbers per tensor, or float32/int64 tensors per channel."""

    scale: ScaleLike
    zerop: ZeropLike
    qmin: int
    qmax: int
    dtype: Dtype

    @property
    def per_channel(self) -> bool:
        return isinstance(self.scale, torch.Tensor)


def _is_channel_tensor(v: object) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray)) and np.ndim(v) >= 1


def linear_quant_params(fmin: Union[Number, torch.Tensor], fmax: Union[Number, torch.Tensor], bits: int,
                        mode: Union[str, QuantMode], signed: bool) -> QuantParams:
    """Scale/zero point for the float range [fmin, fmax] (upstream `get_linear_quant_params_from_tensor`).

    The range is first forced to contain 0. Symmetric: f_range = max(|min|, |max|), doubled if signed, zerop 0.
    Asymmetric: f_range = max - min, zerop = round(scale * min) - qmin clamped to ±(2^(b-1)-1).
    scale = q_range / f_range; an f_range below FLT_EPSILON (or NaN) is replaced by q_range, i.e. scale 1.
    Per tensor (python numbers or 0-d tensors in, python float/int out) `max - min` is formed in float64 and
    rounded once to float32, as upstream does with python statistics; per channel (1-d tensors along the key axis)
    everything is float32 tensor arithmetic. The scale is q_range / f_range divided in float32, so e.g. int8
    symmetric full range gives float32(127.5 / absmax).
    """
    mode = QuantMode.from_name(mode)
    if mode.is_per_block:
        raise ValueError(f"'{mode.value}': per-block quantization is not supported by the linear path")
    qmin, qmax = integer_range(bits, signed, restricted=signed and mode.is_restricted)
    q_range = float(qmax - qmin)
    zp_lim = 2 ** (bits - 1) - 1
    per_channel = _is_channel_tensor(fmin) or _is_channel_tensor(fmax)

    if per_channel:
        mn = torch.as_tensor(np.asarray(fmin) if isinstance(fmin, np.ndarray) else fmin).to(torch.float32)
        mx = torch.as_tensor(np.asarray(fmax) if isinstance(fmax, np.ndarray) else fmax).to(torch.float32)
        mn, mx = torch.broadcast_tensors(torch.clamp(mn, max=0.0), torch.clamp(mx, min=0.0))
        if mode.is_asymmetric:
            f_range = mx - mn
            zfactor = mn
        else:
            f_range = torch.maximum(mx.abs(), mn.abs())
            zfactor = torch.zeros_like(mn)
    else:
        mn_f = min(float(fmin), 0.0) if not np.isnan(float(fmin)) else float("nan")
        mx_f = max(float(fmax), 0.0) if not np.isnan(float(fmax)) else float("nan")
        fast = _per_tensor_params(mn_f, mx_f, mode, signed, qmin, q_range, zp_lim)
        if fast is not None:
            return QuantParams(fast[0], fast[1], qmin, qmax, int_dtype_for_bits(bits, signed))
        if mode.is_asymmetric:
            f_range = torch.tensor(mx_f - mn_f, dtype=torch.float32)
            zfactor = torch.tensor(mn_f, dtype=torch.float32)
        else:
            f_range = torch.tensor(max(abs(mx_f), abs(mn_f)), dtype=torch.float32)
            zfactor = torch.tensor(0.0, dtype=torch.float32)
    if mode.is_symmetric and signed:
        f_range = f_range * 2.0
    q_ranges = torch.full_like(f_range, q_range)
    f_range = torch.where((f_range < FLT_EPSILON) | torch.isnan(f_range), q_ranges, f_range)
    scale = q_ranges / f_range
    zoffset = float(qmin) if mode.is_asymmetric else 0.0
    zfactor = torch.nan_to_num(zfactor, nan=0.0)  # a NaN range behaves like [0, 0] (upstream: NaN zero point)
    zerop = torch.clamp(torch.round(scale * zfactor) - zoffset, -zp_lim, zp_lim).to(torch.int64)
    dtype = int_dtype_for_bits(bits, signed)
    if per_channel:
        return QuantParams(scale, zerop, qmin, qmax, dtype)
    return QuantParams(float(scale.item()), int(zerop.item()), qmin, qmax, dtype)


_HALF_FLOAT32_MAX = 1.7e38
"""Below half the largest float32 every value `_per_tensor_params` forms stays finite; larger ones take the tensor
path."""


def _per_tensor_params(mn_f: float, mx_f: float, mode: QuantMode, signed: bool, qmin: int, q_range: float,
                       zp_lim: int) -> Optional[Tuple[float, int]]:
    """`linear_quant_params`' per-tensor (scale, zero point) on Python floats: the same float32 operations, in the
    same order, as its tensor path, each the float64 result rounded to float32 (exact: a product of two float32
    values is exact in float64, and rounding a sum or quotient first to float64 and then to float32 gives the float32
    result, 53 >= 2 * 24 + 2 bits), without a dozen torch calls (a whole graph's quantization makes hundreds;
    tests/quant/test_params_steps.py compares the two). None where a value is NaN or huge: the tensor path
    decides those."""
    pack, unpack = FLOAT32_STRUCT.pack, FLOAT32_STRUCT.unpack  # a float32 rounding: unpack(pack(v))[0]
    if mode.is_asymmetric:
        f_range, zfactor = mx_f - mn_f, mn_f
    else:
        f_range, zfactor = max(abs(mx_f), abs(mn_f)), 0.0
    if not (abs(f_range) < _HALF_FLOAT32_MAX and abs(zfactor) < _HALF_FLOAT32_MAX):  # NaN fails too
        return None
    f_range, zfactor = unpack(pack(f_range))[0], unpack(pack(zfactor))[0]
    if mode.is_symmetric and signed:
        f_range *= 2.0  # exact below the float32 maximum
    q = unpack(pack(q_range))[0]
    if not f_range >= FLT_EPSILON:
        f_range = q
    if f_range == 0.0:  # an empty integer range (one bit, signed and restricted)
        return None
    scale = unpack(pack(q / f_range))[0]
    product = scale * zfactor
    if not abs(product) < _HALF_FLOAT32_MAX:
        return None
    z = float(round(unpack(pack(product))[0]))  # round half to even, as torch.round
    z = unpack(pack(z - (float(qmin) if mode.is_asymmetric else 0.0)))[0]
    z = min(max(z, unpack(pack(float(-zp_lim)))[0]), unpack(pack(float(zp_lim)))[0])
    return scale, int(z)


def _along(v: Union[Number, torch.Tensor], axis: Optional[int], ndim: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel vectors reshaped to broadcast along `axis` of an `ndim`-d tensor; scalars as 0-d tensors."""
    t = torch.as_tensor(v).to(dtype)
    if axis is None or t.dim() == 0:
        return t
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return t.reshape(shape)


CHUNK_ELEMENTS = 1 << 18
"""Elements per step of `quantize` and `dequantize` on large tensors: their float32 temporaries (1 MiB) stay in the
caches, so each step's passes after the first cost no memory traffic and no page faults of fresh allocations (a
word-embedding table of 11.7M values: quantize 62 -> 40 ms, dequantize 36 -> 24 ms on one core; the int64 or float32
result itself is the rest)."""


def _rows(x: torch.Tensor, params: Sequence[torch.Tensor]) -> Optional[Tuple[torch.Tensor, List[torch.Tensor]]]:
    """A large contiguous `x` as rows (flat when every param is a scalar, else [-1, last axis]) with the params as
    scalars or last-axis vectors, for the stepped paths; None where that layout does not apply (small or strided
    tensors, params along another axis)."""
    if x.dim() == 0 or x.numel() < 2 * CHUNK_ELEMENTS or not x.is_contiguous():
        return None
    columns = x.shape[-1]
    flat: List[torch.Tensor] = []
    for p in params:
        if p.numel() == 1:
            flat.append(p.reshape(()))
        elif p.dim() <= x.dim() and p.shape[-1] == columns and all(d == 1 for d in p.shape[:-1]):
            flat.append(p.reshape(columns))
        else:
            return None
    if all(p.dim() == 0 for p in flat):
        return x.view(-1), flat
    return x.view(-1, columns), flat


def _steps(rows: torch.Tensor) -> Iterator[slice]:
    """Slices of `rows`' first axis of about CHUNK_ELEMENTS elements each."""
    per_row = rows[0].numel() if rows.dim() > 1 else 1
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    for start in range(0, rows.shape[0], step):
        yield slice(start, start + step)


def quantize(x: Union[torch.Tensor, np.ndarray, Number], scale: ScaleLike, zerop: ZeropLike, qmin: int, qmax: int,
             round_mode: Union[str, RoundMode] = RoundMode.ROUND_TO_EVEN, axis: Optional[int] = None,
             compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q = clamp(round(scale * x - zerop), qmin, qmax) as int64 (upstream `linear_quantize_clip`).

    Per-channel `scale`/`zerop` broadcast along `axis`. NaN inputs give 0. Computed in float32 by default like
    upstream (`scale * x.float()`), which decides ties differently from float64 for large |scale * x|.
    """
    given = torch.as_tensor(np.asarray(x) if isinstance(x, np.ndarray) else x)
    s = _along(scale, axis, given.dim(), compute_dtype).to(given.device)
    z = _along(zerop, axis, given.dim(), compute_dtype).to(given.device)
    mode = RoundMode.from_name(round_mode)
    # a zero point of 0 (symmetric params) subtracts nothing: y - 0 is y, bit for bit (-0.0 and NaN included)
    no_zero_point = isinstance(zerop, (int, float, np.integer, np.floating)) and not isinstance(zerop, bool) \
        and zerop == 0

    def step(xs: torch.Tensor, sv: torch.Tensor, zv: torch.Tensor) -> torch.Tensor:
        y = sv * xs.to(compute_dtype)  # a new tensor: the steps below work on it in place (the same values)
        if not no_zero_point:
            y = y.sub_(zv) if broadcasts_into(zv.shape, y.shape) else y - zv
        y = y.round_() if mode is RoundMode.ROUND_TO_EVEN else round_tensor(y, mode)
        return y.clamp_(qmin, qmax).nan_to_num_(nan=0.0)

    # float32 codes within ±2^24 (exact there, within int32) go to int64 by way of int32: two vectorized conversions
    # cost less than torch's float32 -> int64 one on a CPU without AVX-512 (62 against 87 us for 2^17 elements)
    narrow = compute_dtype == torch.float32 and max(abs(qmin), abs(qmax)) <= NARROW_CODES

    def codes(y: torch.Tensor) -> torch.Tensor:
        return y.to(torch.int32) if narrow else y

    layout = _rows(given, (s, z))
    if layout is None:
        return codes(step(given, s, z)).to(torch.int64)
    rows, (sv, zv) = layout
    out = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    for part in _steps(rows):
        out[part].copy_(codes(step(rows[part], sv, zv)))
    return out.view(given.shape)


NARROW_CODES = FLOAT32_EXACT
"""Largest |qmin|, |qmax| for which `quantize` converts its float32 codes to int64 by way of int32: float32 holds
those integers exactly, and int32 too."""


def dequantize_factors(scale: Number, zerop: Number, device: torch.device,
                       compute_dtype: torch.dtype = torch.float32) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(zero point, 1 / scale) of per-tensor params as `dequantize` forms them, for `dequantize_into`; the zero point
    is None where it is 0 (integers plus 0 are themselves: one pass fewer)."""
    s = _along(scale, None, 0, compute_dtype).to(device)
    z = None if float(zerop) == 0.0 else _along(zerop, None, 0, compute_dtype).to(device)
    return z, 1.0 / s


def dequantize_into(out: torch.Tensor, q: torch.Tensor, zerop: Optional[torch.Tensor],
                    inverse: torch.Tensor) -> torch.Tensor:
    """`dequantize`'s arithmetic, (q + zerop) * (1 / scale), written into `out` (of the compute dtype): for callers
    that step through a large tensor with a buffer of their own (the same values as dequantizing it whole). A zero
    point of None is 0: integer `q` converted exactly, nothing to add (a float `q` gets the addition, which turns a
    -0.0 into 0.0 as `dequantize` does)."""
    out.copy_(q)
    if zerop is not None:
        out.add_(zerop)
    elif q.is_floating_point():
        out.add_(0.0)
    return out.mul_(inverse)


def dequantize(q: Union[torch.Tensor, np.ndarray, Number], scale: ScaleLike, zerop: ZeropLike,
               axis: Optional[int] = None, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x = (q + zerop) / scale, evaluated as upstream does: (q + zerop) * (1 / scale) in float32 by default.

    The reciprocal form matters: building the 16-bit LUTs of the golden IRs with a true division differs in
    a few entries (see tests/quant/test_golden_vectors.py).
    """
    given = torch.as_tensor(np.asarray(q) if isinstance(q, np.ndarray) else q)
    s = _along(scale, axis, given.dim(), compute_dtype).to(given.device)
    z = _along(zerop, axis, given.dim(), compute_dtype).to(given.device)
    layout = _rows(given, (s, z)) if given.dtype != compute_dtype else None
    if layout is not None:
        rows, (sv, zv) = layout
        inverse = 1.0 / sv
        out = torch.empty(rows.shape, dtype=compute_dtype, device=rows.device)
        for part in _steps(rows):
            dequantize_into(out[part], rows[part], zv, inverse)
        return out.view(given.shape)
    qt = given.to(compute_dtype)
    if qt is not given and broadcasts_into(s.shape, qt.shape) and broadcasts_into(z.shape, qt.shape):
        return qt.add_(z).mul_(1.0 / s)  # the converted copy is ours: the same values without two more temporaries
    return (qt + z) * (1.0 / s)
