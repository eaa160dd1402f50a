"""Rounding modes of the quantizer: ROUND_TO_EVEN everywhere by default, CEIL/FLOOR/TRUNC/NEAREST by name.

All functions accept a torch tensor, a numpy array or a python number and answer in the same kind. They are exact
for float64 (and float32) inputs of any magnitude and for integer tensors (returned unchanged): NEAREST is not
computed as `floor(|x| + 0.5)`, which double-rounds values just below one half (0.49999999999999994 + 0.5 == 1.0).
"""
from __future__ import annotations

import enum
import struct
from typing import Any, Tuple, Union

import numpy as np
import torch

Number = Union[int, float]
ArrayLike = Union[torch.Tensor, np.ndarray, Number]


class RoundMode(str, enum.Enum):
    """Names used by the IR (`round_mode=` of Quantize layers) and by upstream's `get_round_mode_func`."""

    ROUND_TO_EVEN = "ROUND_TO_EVEN"  # torch.round: half to even (upstream default)
    CEIL = "CEIL"  # torch.ceil (latest upstream; an older one meant floor(x + 0.5))
    FLOOR = "FLOOR"
    TRUNC = "TRUNC"  # toward zero
    NEAREST = "NEAREST"  # half away from zero

    @classmethod
    def from_name(cls, name: Union[str, RoundMode]) -> RoundMode:
        """Case-insensitive lookup; unknown names fall back to ROUND_TO_EVEN exactly as upstream does."""
        if isinstance(name, RoundMode):
            return name
        try:
            return cls(str(name).strip().upper())
        except ValueError:
            return cls.ROUND_TO_EVEN


def _to_tensor(x: ArrayLike) -> Tuple[torch.Tensor, str]:
    if isinstance(x, torch.Tensor):
        return x, "torch"
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)), "numpy"
    if isinstance(x, (bool, int)) or (isinstance(x, np.integer)):
        return torch.tensor(int(x), dtype=torch.int64), "int"
    return torch.tensor(float(x), dtype=torch.float64), "float"


def _from_tensor(t: torch.Tensor, kind: str) -> Any:
    if kind == "torch":
        return t
    if kind == "numpy":
        return t.numpy()
    return t.item()


def _round_tensor(t: torch.Tensor, mode: RoundMode) -> torch.Tensor:
    if not torch.is_floating_point(t):
        return t
    if mode is RoundMode.ROUND_TO_EVEN:
        return torch.round(t)
    if mode is RoundMode.CEIL:
        return torch.ceil(t)
    if mode is RoundMode.FLOOR:
        return torch.floor(t)
    if mode is RoundMode.TRUNC:
        return torch.trunc(t)
    # NEAREST, exact: |x| - floor(|x|) is exact in binary floating point, so the comparison with 0.5 is too.
    a = torch.abs(t)
    f = torch.floor(a)
    r = f + (a - f >= 0.5).to(t.dtype)
    return torch.where(t < 0, -r, r)


def round_by_mode(x: ArrayLike, mode: Union[str, RoundMode] = RoundMode.ROUND_TO_EVEN) -> Any:
    """Round `x` with the named mode; NaN and ±inf pass through (callers decide what NaN becomes)."""
    t, kind = _to_tensor(x)
    return _from_tensor(_round_tensor(t, RoundMode.from_name(mode)), kind)


def round_half_even(x: ArrayLike) -> Any:
    """torch.round semantics (banker's rounding): the rounding of every quantize/requantize step."""
    return round_by_mode(x, RoundMode.ROUND_TO_EVEN)


def round_half_away(x: ArrayLike) -> Any:
    """NEAREST: half away from zero, computed exactly."""
    return round_by_mode(x, RoundMode.NEAREST)


def round_tensor(t: torch.Tensor, mode: Union[str, RoundMode] = RoundMode.ROUND_TO_EVEN) -> torch.Tensor:
    """Tensor-only fast path used by the other quant modules."""
    return _round_tensor(t, RoundMode.from_name(mode))


INT64_SAFE = 2 ** 62
"""Saturation magnitude of `round_shift`'s left shifts: far outside every output range, with headroom in int64."""
FLOAT32_EXACT = 2 ** 24
"""Integers of magnitude below this are exact in float32, and so is every sum or product that stays below it."""
FLOAT64_EXACT = 2 ** 53
"""The same bound for float64."""
_MAGIC_BITS = 0x4338000000000000
_MAGIC = 6755399441055744.0
"""1.5 * 2^52 and its float64 bit pattern: between 2^52 and 2^53 float64 steps by exactly 1, so adding an integer k
with |k| < 2^51 to the bit pattern adds k to the value (and back)."""
MAGIC_EXACT = 2 ** 51
"""Magnitude below which `int_to_float64` and `float64_to_int` are exact."""
FLOAT32_STRUCT = struct.Struct("f")
"""A float32 rounding of a Python float, `FLOAT32_STRUCT.unpack(FLOAT32_STRUCT.pack(v))[0]` (round to nearest
even): the scalar float32 arithmetic of the statistics' EMA and of per-tensor quantization parameters carries each
float64 result through it, far cheaper than a torch or numpy scalar."""


SMALL_CONVERSION = 2048
"""Elements up to which the int64 <-> float64 conversions take torch's own conversion: one kernel call instead of
two, which decides below this size (measured: 1.7 against 3.3 us for 384 elements)."""


def int_to_float64(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor -> float64, exact for |x| < 2^51, in two vectorised passes (CPUs without AVX-512 have no
    vector int64 -> float64 conversion, and torch's scalar one costs about 5x an element-wise add); a small tensor
    by torch's conversion (the same values)."""
    if x.numel() <= SMALL_CONVERSION:
        return x.to(torch.float64)
    return (x + _MAGIC_BITS).view(torch.float64) - _MAGIC


def float64_to_int(x: torch.Tensor) -> torch.Tensor:
    """float64 tensor of integers -> int64, exact for |x| < 2^51 (the inverse of `int_to_float64`)."""
    if x.numel() <= SMALL_CONVERSION:
        return x.to(torch.int64)
    return (x + _MAGIC).view(torch.int64) - _MAGIC_BITS


def below_float64_exact(v: torch.Tensor, factor: int = 1) -> bool:
    """Whether every |v| · factor of an int64 tensor is below 2^53 (so float64 holds it, and its products by powers
    of two, exactly)."""
    if v.numel() == 0:
        return True
    lo, hi = torch.aminmax(v)
    return max(-int(lo), int(hi)) * abs(int(factor)) < FLOAT64_EXACT


def round_shift(v: torch.Tensor, shift: Union[int, torch.Tensor]) -> torch.Tensor:
    """Exact round_half_even(v / 2^shift) of an int64 tensor; a shift <= 0 is a left shift saturating at ±2^62.

    Right shift: q = v >> s (floor), r = v - (q << s) in [0, 2^s); q += 1 if r > 2^(s-1), or if r == 2^(s-1) and
    q is odd. `shift` is a python int or an int64 tensor broadcasting to `v` (per channel). Shifts of 63 or more
    give 0 for |v| < 2^62.

    Fast paths give the same integers (`round_shift_int64` is the general one): a shift of 0 is a copy; right
    shifts of values below 2^53 are one float64 product by 2^-s and torch.round (half to even), per-channel shifts
    included; a left shift that saturates nowhere is `v << k`. The general path costs about fifteen passes over
    the tensor (an integer Where, whose inputs' shifts are often 0, spent 70 % of its time there).
    """
    given = v
    v = v.to(torch.int64)
    if isinstance(shift, int):
        if shift == 0:  # a new tensor, as every other path gives
            return v.clone() if v is given else v
        if 0 < shift < 63 and below_float64_exact(v):
            # v · 2^-shift is exact in float64 below 2^53, and torch.round rounds half to even
            return torch.round(v.to(torch.float64) * 2.0 ** -shift).to(torch.int64)
        if -62 < shift < 0 and not _saturates(v, -shift):
            return v << -shift
    elif isinstance(shift, torch.Tensor) and shift.numel() and v.numel() and shift.dtype in _SHIFT_DTYPES:
        s_lo, s_hi = (int(x) for x in torch.aminmax(shift))
        if 0 <= s_lo and s_hi < 63 and below_float64_exact(v):  # per-channel shifts: the same in float64
            return torch.round(v.to(torch.float64) * _pow2_neg(shift.to(v.device))).to(torch.int64)
    return round_shift_int64(v, shift)


def round_shift_int64(v: torch.Tensor, shift: Union[int, torch.Tensor]) -> torch.Tensor:
    """`round_shift` in int64 arithmetic for every value and shift (the general path its fast paths must equal)."""
    v = v.to(torch.int64)
    s = torch.as_tensor(shift, dtype=torch.int64, device=v.device)
    pos = torch.clamp(s, min=0, max=62)
    q = v >> pos
    rem = v - (q << pos)
    half = torch.where(pos > 0, torch.ones_like(pos) << torch.clamp(pos - 1, min=0), torch.zeros_like(pos))
    up = (pos > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    rounded = torch.where(s >= 63, torch.zeros_like(v), q + up.to(torch.int64))
    k = torch.clamp(-s, min=0, max=62)
    big = (v.abs() >= (torch.ones_like(k) << (62 - k))) | (k >= 62)
    left = torch.where(big & (v != 0), torch.sign(v) * INT64_SAFE, v << k)
    return torch.where(s >= 0, rounded, left)


_SHIFT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Dtypes of a shift tensor the fast paths take (others go the general way, which converts them to int64)."""


def _saturates(v: torch.Tensor, k: int) -> bool:
    """Whether a left shift by k (0 < k < 62) of an int64 tensor reaches the saturation bound 2^62 anywhere."""
    if not v.numel():
        return False
    lo, hi = torch.aminmax(v)
    return max(-int(lo), int(hi)) >= 1 << (62 - k)


def _pow2_neg(shift: torch.Tensor) -> torch.Tensor:
    """2^-s as float64 for integer shifts s in [0, 62], from the exponent bits (exact on every device)."""
    return ((1023 - shift.to(torch.int64)) << 52).view(torch.float64)


def div_round_half_even(num: torch.Tensor, den: Union[int, torch.Tensor]) -> torch.Tensor:
    """Exact round_half_even(num / den) for int64 `num` (any sign) and a positive integer `den` (int or int64
    tensor broadcasting to `num`; a tensor is taken to `num`'s device)."""
    if isinstance(den, torch.Tensor):
        den = den.to(num.device)
    q = torch.div(num, den, rounding_mode="floor")
    twice_rem = 2 * (num - q * den)
    up = (twice_rem > den) | ((twice_rem == den) & (q % 2 == 1))
    return q + up.to(torch.int64)


def bit_length(v: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values (0 for 0; floor(log2 v) + 1 otherwise), exactly.

    Values below 2^53 are exact in float64, whose binary exponent (`torch.frexp`: v = m·2^e, m in [0.5, 1)) is the
    bit length: four calls instead of the shift-and-compare ladder's two dozen, which cost a small layer more than
    its arithmetic. Larger values take the ladder."""
    if v.numel():
        lo, hi = (int(x) for x in torch.aminmax(v))
        if lo >= 0 and hi < FLOAT64_EXACT:
            return torch.frexp(v.to(torch.float64))[1].to(torch.int64)
    n = torch.zeros_like(v)
    w = v.clone()
    for step in (32, 16, 8, 4, 2, 1):
        big = w >= (1 << step)
        n = n + big.to(torch.int64) * step
        w = torch.where(big, w >> step, w)
    return n + (w > 0).to(torch.int64)
