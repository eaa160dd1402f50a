"""Requantization: float ratio → integer multiplier/shift, shift unification, Eltwise multipliers and biases.

Pure functions on python numbers and torch tensors. Ratios are approximated in float32 exactly like upstream's
`get_scale_approximation_params` (every per-tensor Conv/FC/Eltwise `scale_value/shift_value` and every per-channel
`scale/shift` of the golden IRs is reproduced, see tests/quant/test_golden_vectors.py); integer forward helpers work
in float64/int64 and state when they are exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .dtype import Dtype
from .hardware import (
    AIFF_MULTIPLIER_BITS,
    AIFF_MULTIPLIER_MAX,
    AIFF_SHIFT_MAX,
    ELTWISE_INPUT_MULTIPLIER_MAX,
    FLT_EPSILON,
    ITP_INPUT_BITS,
)
from .rounding import (
    _MAGIC,
    _MAGIC_BITS,
    FLOAT64_EXACT,
    MAGIC_EXACT,
    SMALL_CONVERSION,
    RoundMode,
    float64_to_int,
    int_to_float64,
    round_shift,
    round_tensor,
)

Number = Union[int, float]
IntLike = Union[int, torch.Tensor]
RatioLike = Union[Number, torch.Tensor, np.ndarray]

INT32_MIN, INT32_MAX = -(2 ** (ITP_INPUT_BITS - 1)), 2 ** (ITP_INPUT_BITS - 1) - 1


def range_dtype(vmin: float, vmax: float, force_signed: bool = False) -> Dtype:
    """Smallest of int8/16/32 (uint if vmin >= 0 and not forced signed) holding [vmin, vmax] (upstream
    `range2dtype`): the dtype written for multipliers and shifts."""
    signed = vmin < 0 or force_signed
    candidates = (Dtype.INT8, Dtype.INT16, Dtype.INT32) if signed else (Dtype.UINT8, Dtype.UINT16, Dtype.UINT32)
    for dtype in candidates:
        lo, hi = dtype.int_range()
        if lo <= vmin and vmax <= hi:
            return dtype
    return candidates[-1]


def scale_shift(ratio: RatioLike, mult_bits: int, force_shift_positive: bool = False,
                shift_limit: Optional[int] = None, limit_to_mult_bits: bool = False,
                mult_bits_ceil: int = AIFF_MULTIPLIER_BITS) -> Tuple[IntLike, IntLike, Dtype, Dtype]:
    """Approximate `ratio` by multiplier * 2^-shift (upstream `get_scale_approximation_params`; the rule of
    docs/integer-semantics.md, Requantization).

    1. mb = min(mult_bits, 15)   2. shift = floor(log2((2^mb - 1) / r)), optionally <= mb, always <= shift_limit
    (31; 63 for pooling)   3. M = floor(r * 2^shift + 0.5)   4. force_shift_positive: negative shifts become 0 and
    their multiplier saturates to min(2^mult_bits - 1, 32767)   5. if every M equals 2^shift (ratio exactly a power
    of two, e.g. 1) → (1, 0)   6. dtypes: uint8 multiplier if mult_bits <= 8 else uint16; shift int8 normally.
    The ratio is rounded to float32 first and every step is float32 arithmetic, as upstream. A scalar ratio gives
    python ints, a tensor ratio (per channel) int64 tensors on the ratio's device. The shift can be negative.
    Computed on the CPU whatever the ratio's device: CUDA's log2 and pow are not correctly rounded (log2(8) can be
    2.9999999999999996 there), and the floor of log2 must give every device the same multipliers.
    """
    r = torch.as_tensor(np.asarray(ratio) if isinstance(ratio, np.ndarray) else ratio)
    device = r.device
    r = r.cpu().to(torch.float32)
    if bool(torch.isnan(r).any()) or bool((r < 0).any()):
        raise ValueError(f"requantization ratio must be a non-negative number, got {ratio}")
    ceil = AIFF_SHIFT_MAX if shift_limit is None else int(shift_limit)
    mb = min(int(mult_bits), int(mult_bits_ceil))
    qmax = torch.tensor(2.0 ** mb - 1.0, dtype=torch.float32)
    shift = torch.floor(torch.log2(qmax / r))
    if limit_to_mult_bits:
        shift = torch.clamp(shift, max=float(mb))
    shift = torch.clamp(shift, max=float(ceil))
    mult = torch.floor(r * torch.pow(2.0, shift) + 0.5)
    if force_shift_positive:
        neg = shift < 0
        mult = torch.where(neg, torch.tensor(min(2.0 ** mult_bits - 1.0, 2.0 ** mult_bits_ceil - 1.0)), mult)
        shift = torch.where(neg, torch.zeros_like(shift), shift)
    mult_dtype = Dtype.UINT8 if mult_bits <= 8 else Dtype.UINT16
    shift_dtype = range_dtype(float(shift.min()), float(shift.max()), force_signed=True)
    if float((mult - torch.pow(2.0, shift)).abs().max()) < FLT_EPSILON:
        mult = torch.ones_like(mult)
        shift = torch.zeros_like(shift)
    if r.dim() == 0:
        return int(mult.item()), int(shift.item()), mult_dtype, shift_dtype
    return mult.to(torch.int64).to(device), shift.to(torch.int64).to(device), mult_dtype, shift_dtype


def shift_factor(multiplier: IntLike, shift: IntLike, device: torch.device) -> torch.Tensor:
    """M · 2^-shift as float64 on `device`, formed on the CPU and then moved. Why: CUDA's pow is not correctly
    rounded, so 2^-shift formed there may miss the power of two by an ulp, and an integer forward that multiplies
    by it would round its ties differently from the CPU's."""
    m = torch.as_tensor(multiplier).cpu().to(torch.float64)
    s = torch.as_tensor(shift).cpu().to(torch.float64)
    return (m * torch.pow(2.0, -s)).to(device)


def unify_shifts(multipliers: Union[torch.Tensor, Sequence[int]], shifts: Union[torch.Tensor, Sequence[int]],
                 max_multiplier: int = AIFF_MULTIPLIER_MAX) -> Tuple[torch.Tensor, int]:
    """One shift for all channels (core step of `unify_shifts_for_aiff`).

    N = max(0, max_c N_c); M_c <<= N - N_c; if max M_c > max_multiplier, N -= a and M_c >>= a with
    a = ceil(log2(max M_c / max_multiplier)) (arithmetic shift, i.e. floor). Small channels may become 0, which is
    what triggers the per-group fallback of `unify_shifts_for_aiff`. Exact (python integers inside).
    """
    ms = [int(v) for v in torch.as_tensor(multipliers).flatten().tolist()]
    ss = [int(v) for v in torch.as_tensor(shifts).flatten().tolist()]
    n = max(0, max(ss)) if ss else 0
    out = [m << (n - s) for m, s in zip(ms, ss)]
    mul = (max(out) if out else 0) / max_multiplier
    if mul > 1.0:
        a = math.ceil(math.log2(mul))
        n -= a
        out = [v >> a for v in out]
    return torch.tensor(out, dtype=torch.int64), n


def group_ranges(fmin: torch.Tensor, fmax: torch.Tensor, groups: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Merge per-channel ranges into `groups` consecutive channel groups and expand them back per channel.

    Channels are padded with [0, 0] up to groups * ceil(C / groups) (harmless: ranges already contain 0), each
    group takes the min of mins / max of maxes (upstream per-N-channel fallback). Returns (min_c, max_c,
    channels_per_group); quant params computed from the expanded ranges equal the per-group ones.
    """
    mn = torch.as_tensor(fmin).flatten()
    mx = torch.as_tensor(fmax).flatten()
    snum = mn.numel()
    groups = max(1, min(int(groups), snum))
    per = math.ceil(snum / groups)
    pad = groups * per - snum
    gmin = torch.nn.functional.pad(mn, (0, pad), value=0.0).reshape(-1, per).min(dim=1).values
    gmax = torch.nn.functional.pad(mx, (0, pad), value=0.0).reshape(-1, per).max(dim=1).values
    return gmin.repeat_interleave(per)[:snum], gmax.repeat_interleave(per)[:snum], per


@dataclass
class UnifiedShifts:
    """Per-channel multipliers with one shared shift, as written to the IR constants `scale`/`shift`."""

    multiplier: torch.Tensor  # int64 [C]
    shift: torch.Tensor  # int64 [C], all equal when unified
    groups: int  # channel groups finally used (C when no fallback happened)
    group_size: int  # channels per group (1 when no fallback happened)
    mult_dtype: Dtype = Dtype.UINT16
    shift_dtype: Dtype = Dtype.INT8

    @property
    def fell_back(self) -> bool:
        """True when hardware limits forced per-N-channel quantization (upstream warns)."""
        return self.group_size > 1


def unify_shifts_for_aiff(ratio_fn: Callable[[int], torch.Tensor], channels: int, mult_bits: int,
                          initial_groups: Optional[int] = None, force_shift_positive: bool = False,
                          max_multiplier: int = AIFF_MULTIPLIER_MAX, unify: bool = True) -> UnifiedShifts:
    """Per-channel requant with a shared shift and the per-N-channel fallback (`unify_shifts_for_aiff`).

    `ratio_fn(groups)` returns the C per-channel ratios s_out / (s_in * s_w[c]) computed with the weight ranges
    merged into `groups` channel groups (see `group_ranges`). Starting from `initial_groups` (default C, one group
    per channel; `group` for grouped per-tensor convs), the ratios are approximated with `scale_shift`, shifts are
    unified with `unify_shifts`; if any multiplier became 0 the group count is halved and it is retried, down to
    one group. The caller must quantize the weights with the same grouping (`groups`/`group_size` of the result).
    With `unify=False` the per-channel multipliers/shifts of the first attempt are returned unchanged.
    """
    snum = int(channels)
    groups = snum if initial_groups is None or initial_groups < 1 else min(int(initial_groups), snum)
    while True:
        per = math.ceil(snum / groups)
        ratios = torch.as_tensor(ratio_fn(groups)).flatten()
        m, s, mdt, sdt = scale_shift(ratios, mult_bits, force_shift_positive=force_shift_positive)
        m = torch.as_tensor(m, dtype=torch.int64).reshape(-1)
        s = torch.as_tensor(s, dtype=torch.int64).reshape(-1)
        if not unify:
            return UnifiedShifts(m, s, groups, per, mdt, sdt)
        um, n = unify_shifts(m, s, max_multiplier)
        if int(um.min()) > 0 or groups == 1:
            return UnifiedShifts(um, torch.full_like(um, n), groups, per, Dtype.UINT16, Dtype.INT8)
        groups >>= 1


def linear_requantize(x: Union[torch.Tensor, np.ndarray, Number], multiplier: IntLike, shift: IntLike,
                      zerop_out: Union[Number, torch.Tensor], qmin: int, qmax: int, axis: Optional[int] = None,
                      round_mode: Union[str, RoundMode] = RoundMode.ROUND_TO_EVEN) -> torch.Tensor:
    """y = clamp(round_half_even(x * M * 2^-shift) - zerop_out, qmin, qmax) as int64, computed in float64.

    Exact (identical to infinite-precision rounding) whenever |x * M| < 2^53: x*M is then an exact float64
    integer and scaling by 2^-shift is exact. For int32 accumulators and 15-bit multipliers that always holds.
    Per-channel M/shift/zerop broadcast along `axis`. NaN gives 0 (upstream).
    """
    xt = torch.as_tensor(np.asarray(x) if isinstance(x, np.ndarray) else x).to(torch.float64)
    m = _along(multiplier, axis, xt.dim()).cpu().to(torch.float64)
    s = _along(shift, axis, xt.dim()).cpu().to(torch.float64)
    z = _along(zerop_out, axis, xt.dim()).to(xt.device)
    if RoundMode.from_name(round_mode) is RoundMode.ROUND_TO_EVEN and xt.numel() and _needs_int64(xt, m):
        # |x * M| >= 2^53 (e.g. 48-bit accumulators of 16-bit layers): the same rounding, exactly, in int64
        y = round_shift(xt.to(torch.int64) * m.to(device=xt.device, dtype=torch.int64),
                        s.to(device=xt.device, dtype=torch.int64)).to(torch.float64)
    else:
        # M * 2^-shift is exact in float64, and so is x * (M * 2^-shift) while |x * M| < 2^53: one rounding step;
        # the factor is formed on the CPU (CUDA's pow is not correctly rounded, see shift_factor)
        y = round_tensor(xt * (m * torch.pow(0.5, s)).to(xt.device), round_mode)
    y = torch.clamp(y.sub_(z), qmin, qmax)
    if bool(torch.isnan(y).any()):
        y = torch.nan_to_num(y, nan=0.0)
    return exact_int64_(y, qmin, qmax)


def _needs_int64(x: torch.Tensor, m: torch.Tensor) -> bool:
    """True when float64 cannot hold x * M exactly but int64 can: x integer-valued, |x| * |M| in [2^53, 2^62)."""
    bound = float(x.abs().max()) * float(m.abs().max())
    if bound < FLOAT64_EXACT or not bool(torch.isfinite(x).all()) or not bool((x == torch.round(x)).all()):
        return False
    if bound >= 2.0 ** 62:
        raise ValueError(f"requantization product |x * M| reaches 2^{math.log2(bound):.1f}, beyond int64's exact range")
    return True


def requantize_int(acc: torch.Tensor, multiplier: IntLike, shift: IntLike, zerop_out: int, qmin: int,
                   qmax: int) -> torch.Tensor:
    """clamp(round_half_even(acc * M / 2^shift) - zp_out, qmin, qmax) of an integer accumulator, exact while
    |acc * M| < 2^62 (callers bound it). M/shift may be int64 tensors broadcasting to `acc` (per channel).

    Computed in float64 when max|acc| * max|M| < 2^53 (the usual case): acc * M is then an exact float64 integer,
    scaling it by 2^-shift is exact, and torch.round rounds half to even, so the result is the int64 one at a few
    element-wise passes instead of the ~20 of `round_shift`; otherwise in int64 with `round_shift`."""
    scalar = scalar_params(multiplier, shift, acc.dim())
    if scalar is not None and acc.numel() and not acc.is_floating_point() and -900 < scalar[1] < 900:
        lo, hi = torch.aminmax(acc)  # one multiplier and shift: the factor is a Python float, no tensors formed
        absmax = max(abs(int(lo)), abs(int(hi)))
        if absmax * abs(scalar[0]) < FLOAT64_EXACT:
            return _requantize_proven(acc, absmax, math.ldexp(scalar[0], -scalar[1]), scalar[1], zerop_out, qmin,
                                      qmax)
    m = torch.as_tensor(multiplier, dtype=torch.int64, device=acc.device)
    s = torch.as_tensor(shift, dtype=torch.int64, device=acc.device)
    if acc.numel() and not acc.is_floating_point() and -900 < int(s.min()) and int(s.max()) < 900:
        # shifts beyond ±900 keep the int64 path; within them acc·M·2^-s stays a normal float64, a right shift of
        # 63 or more rounds to 0 as round_shift does, and a large left shift is clamped to [qmin, qmax] either way
        lo, hi = torch.aminmax(acc)
        absmax = max(abs(int(lo)), abs(int(hi)))
        if absmax * int(m.abs().max()) < FLOAT64_EXACT:
            x = int64_to_float64(acc) if acc.dtype == torch.int64 and absmax < MAGIC_EXACT else acc.to(torch.float64)
            return requantize_float64_(x, m, s, zerop_out, qmin, qmax)
    prod = acc.to(torch.int64) * m
    return torch.clamp(round_shift(prod, shift) - int(zerop_out), int(qmin), int(qmax))


SMALL_CALLS_KEPT = 64
"""Kinds of call (shape, bound, ...) whose small-path decision a `Requantizer` keeps; past it, they are decided
again (a bound taken from the data may differ on every forward)."""


class Requantizer:
    """`requantize_int(acc, multiplier, shift, zerop_out, qmin, qmax)` with its params prepared once (the factor
    M·2^-shift, max |M|, the least shift): for a loop that requantizes many small tensors with the same params (a
    recurrent cell's steps), where forming the factor cost more than the arithmetic. The same values as
    `requantize_int`, which it falls back to wherever its float64 path does not apply."""

    def __init__(self, multiplier: IntLike, shift: IntLike, zerop_out: int, qmin: int, qmax: int,
                 device: torch.device) -> None:
        self.args = (multiplier, shift, zerop_out, qmin, qmax)
        m = torch.as_tensor(multiplier, dtype=torch.int64).cpu()
        s = torch.as_tensor(shift, dtype=torch.int64).cpu()
        self.m_shape, self.s_shape = tuple(m.shape), tuple(s.shape)
        self.usable = bool(m.numel()) and bool(s.numel()) and -900 < int(s.min()) and int(s.max()) < 900
        self.m_absmax = int(m.abs().max()) if m.numel() else 0
        self.least_shift = float(s.min()) if s.numel() else 0.0
        if not self.usable:
            self.factor: Union[float, torch.Tensor] = 0.0
        elif m.numel() == 1 and s.numel() == 1:
            self.factor = math.ldexp(int(m.reshape(-1)[0]), -int(s.reshape(-1)[0]))
        else:
            self.factor = shift_factor(m, s, device)
        # the one-call path of small CPU accumulators given a bound (`_requantize_small_int`), decided once: a
        # recurrent cell's step makes several such calls, and deciding per call cost half of each
        zp, lo, hi = int(zerop_out), int(qmin), int(qmax)
        # the rounding by addition needs |acc · factor| < 2^50, which a bound shows for any shift (the shift >= 3
        # of `_scaled_applies` is what |acc · M| < 2^53 alone allows)
        self._small = self.usable and _scaled_applies(3.0, zerop_out, lo, hi) and (
            isinstance(self.factor, float) or self.factor.device.type == "cpu")
        self._factor_absmax = math.ldexp(self.m_absmax, -int(self.least_shift)) if self.usable else 0.0
        self._room = min(hi + zp, -(lo + zp))  # |round(acc · factor)| up to this minus zp lies in [qmin, qmax]
        self._small_calls: Dict[tuple, Tuple[Any, Any]] = {}  # `_small_call` by kind of call
        # `minus` tensors with the bit pattern's offset folded in, by the identity of the caller's tensor
        self._subtrahends: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def output_bound(self, bound: int) -> int:
        """A bound on |output| for inputs of |acc| <= `bound`: |round(acc · factor) - zp|, within the clamp's (the
        clamp's alone where bound · max|M| is beyond float64's exact integers)."""
        _, _, zerop_out, qmin, qmax = self.args
        clamped = max(-int(qmin), int(qmax))
        if not self.usable or bound * self.m_absmax >= FLOAT64_EXACT:
            return clamped
        return min(math.ceil(bound * self._factor_absmax) + abs(int(zerop_out)), clamped)

    def __call__(self, acc: torch.Tensor, bound: Optional[int] = None, minus: Union[int, torch.Tensor] = 0,
                 as_float64: bool = False) -> torch.Tensor:
        """The requantized int64 values of integer `acc` (int64, or float64 holding integers); `bound`: a max |acc|
        the caller has proven (from the ranges its values were clamped to), which spares looking at the values,
        and where it proves every value in range, the clamp. `minus`: an integer, or an int64 tensor broadcasting
        into the result, subtracted from the requantized values (a table lookup's index offset: on the small path
        it costs nothing, being folded into the subtraction that forms the result); `as_float64`: the result as
        float64 holding those integers (what a float64 product reads next) rather than int64. A recurrent cell's
        steps make several such calls on a few hundred values each, where each kernel call, not the arithmetic,
        decides."""
        if bound is not None and self._small:
            tensor_minus = isinstance(minus, torch.Tensor)
            key = (acc.shape, acc.dtype, acc.is_cpu, bound, id(minus) if tensor_minus else minus, as_float64)
            call = self._small_calls.get(key)
            if call is None or (tensor_minus and call[0] is not minus):  # (a tensor by identity, kept alive)
                if len(self._small_calls) >= SMALL_CALLS_KEPT:  # data-dependent bounds: keep the cache small
                    self._small_calls.clear()
                call = self._small_calls[key] = (minus if tensor_minus else None,
                                                 self._small_call(acc, bound, minus, as_float64))
            if call[1] is not None:
                _, _, zerop_out, qmin, qmax = self.args
                clamp, subtrahend = call[1]
                return _requantize_small_int(acc, self.factor, zerop_out, qmin, qmax, clamp, subtrahend, as_float64)
        if acc.is_floating_point():  # integers held as float64: exactly the same values as int64
            acc = acc.to(torch.int64)
        y = self._requantize(acc, bound)
        if isinstance(minus, torch.Tensor) or minus:
            y = y - minus
        return y.to(torch.float64) if as_float64 else y

    def float64_form(self, bound: int, columns: int) -> Optional[Tuple[Union[float, np.ndarray], bool]]:
        """(the factor M·2^-shift, a float or a float64 array broadcasting over `columns` columns; whether the clamp
        can change a value) of this requantization's rounding by addition for accumulators of `columns` columns
        with |acc| <= `bound`, or None where that rounding does not apply (|acc · M| < 2^53 and |acc · factor| <
        2^50 must follow from the bound). For a caller that steps through small numpy arrays of float64 integers
        (ops/_recurrent_steps.py): the same arithmetic as `_requantize_small_int`, whose values it gives."""
        if not self._small or bound * self.m_absmax >= FLOAT64_EXACT \
                or bound * self._factor_absmax >= MAGIC_SCALED_BOUND:
            return None
        if isinstance(self.factor, float):
            return self.factor, math.ceil(bound * self._factor_absmax) > self._room
        factor = self.factor.detach().cpu().to(torch.float64).numpy()
        if factor.ndim > 2 or (factor.ndim == 2 and factor.shape[0] != 1) or \
                (factor.ndim and factor.shape[-1] not in (1, columns)):
            return None
        return factor.reshape(-1) if factor.ndim else float(factor), \
            math.ceil(bound * self._factor_absmax) > self._room

    def _small_call(self, acc: torch.Tensor, bound: int, minus: Union[int, torch.Tensor],
                    as_float64: bool) -> Optional[Tuple[bool, Union[int, float, torch.Tensor]]]:
        """(whether to clamp, the subtrahend) of `_requantize_small_int` for calls like this one (the same shape,
        dtype, device, bound, `minus` and result type), or None where that path does not apply: what `__call__`
        decides once per kind of call and keeps, its checks having cost a recurrent step as much as its kernels."""
        if acc.dtype not in (torch.int64, torch.float64) or not 0 < acc.numel() <= SMALL_CONVERSION \
                or not acc.is_cpu or bound * self.m_absmax >= FLOAT64_EXACT \
                or bound * self._factor_absmax >= MAGIC_SCALED_BOUND:
            return None
        if not (broadcasts_into(self.m_shape, acc.shape) and broadcasts_into(self.s_shape, acc.shape)) or (
                isinstance(minus, torch.Tensor) and not broadcasts_into(minus.shape, acc.shape)):
            return None
        return math.ceil(bound * self._factor_absmax) > self._room, self._subtrahend(minus, as_float64)

    def _subtrahend(self, minus: Union[int, torch.Tensor], as_float64: bool) -> Union[int, float, torch.Tensor]:
        """What `_requantize_small_int` subtracts from its biased sum to leave the result minus `minus`: the bit
        pattern's offset (int64 view) or the value's (float64), plus the zero point, plus `minus`; a tensor
        `minus` is combined once and kept (its kernel call would otherwise cost as much as the saving)."""
        zerop_out = int(self.args[2])
        if not isinstance(minus, torch.Tensor):
            return (_MAGIC + zerop_out + int(minus)) if as_float64 else (_MAGIC_BITS + zerop_out + int(minus))
        kept = self._subtrahends.get(id(minus))
        if kept is None or kept[0] is not minus or kept[1].dtype != (torch.float64 if as_float64 else torch.int64):
            base = (_MAGIC + zerop_out) if as_float64 else (_MAGIC_BITS + zerop_out)
            combined = minus.to(torch.float64 if as_float64 else torch.int64) + base
            kept = self._subtrahends[id(minus)] = (minus, combined)
        return kept[1]

    def _requantize(self, acc: torch.Tensor, bound: Optional[int]) -> torch.Tensor:
        """The general path of `__call__` (int64 `acc`)."""
        if not (self.usable and acc.numel() and not acc.is_floating_point()
                and broadcasts_into(self.m_shape, acc.shape) and broadcasts_into(self.s_shape, acc.shape)):
            return requantize_int(acc, *self.args)
        if bound is None:
            lo, hi = torch.aminmax(acc)
            absmax = max(abs(int(lo)), abs(int(hi)))
        else:
            absmax = int(bound)
        if absmax * self.m_absmax >= FLOAT64_EXACT:
            return requantize_int(acc, *self.args)
        _, _, zerop_out, qmin, qmax = self.args
        return _requantize_proven(acc, absmax, self.factor, self.least_shift, zerop_out, qmin, qmax)


def _requantize_proven(acc: torch.Tensor, absmax: int, factor: Union[float, torch.Tensor], least_shift: float,
                       zerop_out: int, qmin: int, qmax: int) -> torch.Tensor:
    """The float64 requantization of an integer `acc` whose max |acc| · max |M| < 2^53 is proven (`absmax`: a bound
    of max |acc|), given its factor M·2^-shift (a Python float or a tensor broadcasting into `acc`) and least shift:
    small CPU accumulators in one kernel call fewer, others converted to float64 first."""
    on_device = isinstance(factor, float) or factor.device == acc.device
    if on_device and _small_int_applies(acc, least_shift, zerop_out, qmin, qmax):
        return _requantize_small_int(acc, factor, zerop_out, qmin, qmax)
    x = int64_to_float64(acc) if acc.dtype == torch.int64 and absmax < MAGIC_EXACT else acc.to(torch.float64)
    return _requantize_by_factor_(x, factor, least_shift, zerop_out, qmin, qmax)


def requantize_float64(acc: torch.Tensor, multiplier: IntLike, shift: IntLike, zerop_out: int, qmin: int,
                       qmax: int) -> torch.Tensor:
    """`requantize_int` of a float64 tensor of integers for which the caller has proven |acc * M| < 2^53 and
    |shift| < 900: round(acc * (M * 2^-shift)) is then exact (round half to even), int64 result."""
    y = torch.round(acc * shift_factor(multiplier, shift, acc.device)).sub_(float(zerop_out))
    return exact_int64_(torch.clamp_(y, float(qmin), float(qmax)), qmin, qmax)


def requantize_float64_(acc: torch.Tensor, multiplier: IntLike, shift: IntLike, zerop_out: int, qmin: int,
                         qmax: int) -> torch.Tensor:
    """`requantize_float64` that overwrites `acc` (a temporary of the caller's) when the factor broadcasts to its
    shape: the same passes, no new allocation but the result's."""
    scalar = scalar_params(multiplier, shift, acc.dim())
    if scalar is not None and acc.dtype == torch.float64 and -900 < scalar[1] < 900:
        return _requantize_by_factor_(acc, math.ldexp(scalar[0], -scalar[1]), scalar[1], zerop_out, qmin, qmax)
    s = torch.as_tensor(shift)
    factor = shift_factor(multiplier, s, acc.device)
    if acc.dtype != torch.float64 or not broadcasts_into(factor.shape, acc.shape):
        return requantize_float64(acc, multiplier, shift, zerop_out, qmin, qmax)
    return _requantize_by_factor_(acc, factor, float(s.min()) if acc.numel() else 0.0, zerop_out, qmin, qmax)


REQUANT_BAND_ELEMENTS = 1 << 16
"""Accumulator elements `requantize_float_in_bands` converts and requantizes at once (512 KiB of float64)."""


def requantize_float_in_bands(acc: torch.Tensor, multiplier: int, shift: int, zerop_out: int, qmin: int,
                              qmax: int, band: int = REQUANT_BAND_ELEMENTS) -> torch.Tensor:
    """`requantize_float64_(acc.to(torch.float64), ...)` of a float accumulator of exact integers (the caller's
    bound; a temporary of the caller's, which a float64 one small enough for one band may be overwritten as), as
    int64, a band of elements at a time through one reused float64 buffer: the same element-wise
    arithmetic, without a float64 copy of the whole accumulator, and each band's passes stay in the cache. Why: an
    attention map's integer MatMul (12x512x512) spent more on its 25 MiB float64 copy and the passes over it than
    on the product itself."""
    flat = acc.reshape(-1)
    n = int(flat.numel())
    if n <= 2 * band or acc.device.type != "cpu":
        return requantize_float64_(acc.to(torch.float64), multiplier, shift, zerop_out, qmin, qmax)
    out = torch.empty(n, dtype=torch.int64)
    buf = torch.empty(band, dtype=torch.float64)
    for s0 in range(0, n, band):
        part = buf[:min(band, n - s0)].copy_(flat[s0:s0 + band])
        out[s0:s0 + int(part.numel())] = requantize_float64_(part, multiplier, shift, zerop_out, qmin, qmax)
    return out.reshape(acc.shape)


def _scaled_applies(least_shift: float, zerop_out: Union[int, float], qmin: int, qmax: int) -> bool:
    """Whether `requantize_scaled_`'s rounding by addition applies to an accumulator whose |acc * M| < 2^53 is
    proven: every shift >= 3 (so |acc * factor| < 2^50) and the output range and zero point below 2^50."""
    return least_shift >= 3 and max(abs(qmin), abs(qmax)) + abs(int(zerop_out)) < MAGIC_SCALED_BOUND \
        and int(zerop_out) == zerop_out


def _small_int_applies(acc: torch.Tensor, least_shift: float, zerop_out: Union[int, float], qmin: int,
                       qmax: int) -> bool:
    """Whether `_requantize_small_int` applies: a small int64 accumulator on the CPU (|acc * M| < 2^53 proven)."""
    return acc.dtype == torch.int64 and acc.device.type == "cpu" and 0 < acc.numel() <= SMALL_CONVERSION \
        and _scaled_applies(least_shift, zerop_out, qmin, qmax)


_MAGIC_TENSOR = torch.tensor(_MAGIC, dtype=torch.float64)
"""1.5 * 2^52 as a float64 tensor: the first operand of `_requantize_small_int`'s one-call product and sum."""


def _requantize_small_int(acc: torch.Tensor, factor: Union[float, torch.Tensor], zerop_out: int, qmin: int,
                          qmax: int, clamp: bool = True, subtrahend: Union[int, float, torch.Tensor, None] = None,
                          as_float64: bool = False) -> torch.Tensor:
    """`requantize_scaled_` of a small integer accumulator (int64, or float64 holding integers) without converting
    it first: 1.5·2^52 + acc·factor in one kernel call (each integer converted exactly, the product exact, the sum
    rounded once: the same float64 value), then the clamp and the bit pattern. On tensors this small the calls, not
    the arithmetic, decide (7.2 against 4.9 µs for 96 elements); on large ones this mixed-type kernel is ten times
    slower than converting first. `clamp=False`: the caller proved every value in [qmin, qmax] (the clamp would
    change nothing). `subtrahend` (`Requantizer._subtrahend`): what is subtracted from the biased sum, by default
    its offset and the zero point; `as_float64`: the result as float64 integers (the biased sum minus 1.5·2^52,
    exact) instead of int64 (its bit pattern minus that of 1.5·2^52)."""
    off = _MAGIC + int(zerop_out)
    y = torch.add(_MAGIC_TENSOR, acc, alpha=factor) if isinstance(factor, float) else \
        torch.addcmul(_MAGIC_TENSOR, acc, factor)
    if clamp:
        y.clamp_(qmin + off, qmax + off)
    if as_float64:
        return y.sub_(off if subtrahend is None else subtrahend)
    return y.view(torch.int64).sub_(_MAGIC_BITS + int(zerop_out) if subtrahend is None else subtrahend)


def _requantize_by_factor_(acc: torch.Tensor, factor: Union[float, torch.Tensor], least_shift: float,
                           zerop_out: int, qmin: int, qmax: int) -> torch.Tensor:
    """`requantize_float64_`'s arithmetic on the float64 `acc` (overwritten) given its factor M·2^-shift (a tensor
    that broadcasts into `acc`, or a Python float: the same float64 value) and its least shift."""
    if acc.numel() and _scaled_applies(least_shift, zerop_out, qmin, qmax):
        # |acc * M| < 2^53 (the caller's proof) and shift >= 3: below 2^50
        return requantize_scaled_(acc, factor, int(zerop_out), qmin, qmax)
    y = acc.mul_(factor).round_().sub_(float(zerop_out))
    return exact_int64_(y.clamp_(float(qmin), float(qmax)), qmin, qmax)


def scalar_params(multiplier: IntLike, shift: IntLike, ndim: int) -> Optional[Tuple[int, int]]:
    """(M, shift) as Python ints where each is one integer whose broadcasting leaves a tensor of `ndim` dimensions
    unchanged (a Python or numpy integer, or a one-element integer tensor of at most `ndim` dimensions), else None.
    Why: with one multiplier and shift the factor M·2^-shift is formed as a Python float (math.ldexp, exact), and
    forming it as a tensor on the CPU cost more than requantizing a small tensor."""
    values = []
    for v in (multiplier, shift):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            values.append(int(v))
        elif isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() <= ndim and not v.is_floating_point() \
                and v.dtype != torch.bool:
            values.append(int(v.item()))
        else:
            return None
    return values[0], values[1]


def exact_int64(y: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Integer-valued float64 within [lo, hi] -> int64, with the fast exact conversion whenever the bounds allow."""
    if -MAGIC_EXACT < lo and hi < MAGIC_EXACT:
        return float64_to_int(y)
    return y.to(torch.int64)


def exact_int64_(y: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """`exact_int64` that may overwrite `y` (a temporary of the caller's): the same int64 values with one
    allocation fewer. Why: on large maps the conversion's temporaries cost as much as the requantization."""
    if -MAGIC_EXACT < lo and hi < MAGIC_EXACT and y.dtype == torch.float64:  # a same-size view: any strides
        return y.add_(_MAGIC).view(torch.int64).sub_(_MAGIC_BITS)
    return exact_int64(y, lo, hi)


MAGIC_SCALED_BOUND = 2 ** 50
"""Below this, |y * factor| and |q| + |zp_out| suit `requantize_scaled_`'s rounding by addition of 1.5 * 2^52."""


def requantize_scaled_(y: torch.Tensor, factor: Union[float, torch.Tensor], zp_out: int, qmin: int,
                       qmax: int) -> torch.Tensor:
    """clamp(round_half_even(y * factor) - zp_out, qmin, qmax) as int64, overwriting the float64 `y`, in four passes
    instead of six. The caller proves y * factor exact with |y * factor| < 2^50 and max(|qmin|, |qmax|) + |zp_out|
    < 2^50: adding 1.5 * 2^52 then rounds to the nearest integer, ties to even (float64 steps by 1 between 2^52 and
    2^53 and 1.5 * 2^52 is even), the clamp to [qmin + zp_out, qmax + zp_out] is exact there, and the bit pattern
    minus that of 1.5 * 2^52 is the integer."""
    return round_scaled_(y.mul_(factor), zp_out, qmin, qmax)


def round_scaled_(y: torch.Tensor, zp_out: int, qmin: int, qmax: int) -> torch.Tensor:
    """clamp(round_half_even(y) - zp_out, qmin, qmax) as int64 of an exact float64 `y` with |y| < 2^50 (and the
    output range and zero point below 2^50), overwriting `y`: `requantize_scaled_` once the factor is applied."""
    return finish_biased_(y.add_(_MAGIC), zp_out, qmin, qmax)


def biased_scaled_into(out: torch.Tensor, x: torch.Tensor, factor: float) -> None:
    """out <- 1.5·2^52 + x·factor, rounded half to even to an integer offset (x·factor exact, |x·factor| < 2^50):
    `requantize_scaled_`'s first pass, written into `out` (a slice of a larger float64 tensor: a Concat's branch)
    and finished for the whole tensor by `finish_biased_`."""
    torch.add(_MAGIC_TENSOR.to(x.device), x, alpha=factor, out=out)


def finish_biased_(y: torch.Tensor, zp_out: int, qmin: int, qmax: int) -> torch.Tensor:
    """clamp(v - zp_out, qmin, qmax) as int64 of float64 values y = 1.5·2^52 + v (integers v, |v| < 2^50),
    overwriting `y`: the clamp in the biased range, then the bit pattern minus that of 1.5·2^52."""
    off = _MAGIC + int(zp_out)
    return y.clamp_(qmin + off, qmax + off).view(torch.int64).sub_(_MAGIC_BITS + int(zp_out))


def broadcasts_into(small: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether a tensor of shape `small` broadcasts to `shape` without enlarging it (an in-place operand); plain
    Python, as torch.broadcast_shapes costs more than a small layer's arithmetic."""
    return len(small) <= len(shape) and all(s == 1 or s == g for s, g in zip(reversed(small), reversed(shape)))


def int64_to_float64(x: torch.Tensor, plus: Union[int, float] = 0) -> torch.Tensor:
    """`int_to_float64` of an int64 tensor with |x| < 2^51 in one allocation instead of two (the same values), plus
    the integer `plus` (a zero point, |plus| < 2^51), which on a large tensor costs no pass of its own: x added to
    the bit pattern of 1.5·2^52 (0x4338000000000000) reads as the float64 1.5·2^52 + x, and subtracting
    1.5·2^52 - plus (both in [2^52, 2^53), so exact) leaves x + plus."""
    if x.dtype == torch.int64 and x.numel() > SMALL_CONVERSION and float(plus).is_integer() \
            and abs(plus) < MAGIC_EXACT:
        return x.add(_MAGIC_BITS).view(torch.float64).sub_(_MAGIC - float(plus))
    y = int_to_float64(x)
    return y.add_(plus) if plus else y


def linear_requantize_floor(x: Union[torch.Tensor, np.ndarray, Number], multiplier: IntLike, shift: IntLike,
                            zerop_out: Union[Number, torch.Tensor], qmin: int, qmax: int,
                            axis: Optional[int] = None) -> torch.Tensor:
    """Hardware-like variant used by a few ops: t = round(x * M) then arithmetic >> shift (<< for negative shift),
    y = clamp(t - zerop_out, qmin, qmax). Exact while |x * M| < 2^53."""
    xt = torch.as_tensor(np.asarray(x) if isinstance(x, np.ndarray) else x).to(torch.float64)
    m = _along(multiplier, axis, xt.dim()).to(xt.device)
    s = _along(shift, axis, xt.dim()).to(device=xt.device, dtype=torch.int64)
    z = _along(zerop_out, axis, xt.dim()).to(xt.device)
    t = torch.round(xt * m).to(torch.int64)
    t = torch.where(s >= 0, t >> s.clamp(min=0), t << (-s).clamp(min=0))
    return torch.clamp(t.to(torch.float64) - z, qmin, qmax).to(torch.int64)


def _along(v: Union[Number, torch.Tensor, np.ndarray], axis: Optional[int], ndim: int) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(v) if isinstance(v, np.ndarray) else v)
    t = t.to(torch.float64) if t.dtype != torch.int64 else t
    if axis is None or t.dim() == 0:
        return t
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return t.reshape(shape)


@dataclass
class EltwiseRequant:
    """IR fields of a quantized Eltwise ADD/SUB/MAX/MIN: `scale_value=[M_out, M_in0, M_in1]`, `shift_value`."""

    scale_value: List[int]
    shift_value: int
    scale_type: List[Dtype] = field(default_factory=lambda: [Dtype.UINT16] * 3)
    shift_type: Dtype = Dtype.INT8
    unified: bool = False  # True when the `[M, 1, 1]` shortcut for equal input scales was taken

    @property
    def output_multiplier(self) -> int:
        return self.scale_value[0]

    @property
    def input_multipliers(self) -> Tuple[int, int]:
        return self.scale_value[1], self.scale_value[2]


def eltwise_multipliers(s0: float, s1: float, s_out: float, out_bits: int, zp0: Number = 0, zp1: Number = 0,
                        method: str = "ADD", unify_threshold: float = 1.0,
                        force_shift_positive: bool = False) -> EltwiseRequant:
    """Multipliers of Eltwise ADD/SUB/MAX/MIN (docs/integer-semantics.md, Eltwise).

    Y = ((A+zpA)·M1·2^(N-N1) + (B+zpB)·M0·2^(N-N0)) · M·2^-shift with (Mi, Ni) = 15-bit approximations of the
    input scales and N = max(N0, N1): input 0 gets input 1's multiplier and vice versa. If the larger one exceeds
    32767 both are divided by the excess and the output ratio s_out / (s0·s1·2^N) is multiplied by it before being
    approximated with `out_bits` bits; a negative output shift is folded into M (M·2^-shift clipped to [1, 32767],
    shift 0). When max(s0,s1)/(min(s0,s1)+eps) <= unify_threshold and the zero points match (always the case for
    equal scales with the default threshold 1.0), upstream writes the `[M, 1, 1]` form instead: ADD requantizes
    s_out/s0; SUB/MAX/MIN keep M=1, shift=0 (upstream behaviour, kept as is); the three multipliers are declared
    uint16 in both forms. Float32 arithmetic like upstream.
    """
    f32 = torch.float32
    ts0, ts1, tso = (torch.tensor(float(v), dtype=f32) for v in (s0, s1, s_out))
    hi, lo = torch.maximum(ts0, ts1), torch.minimum(ts0, ts1)
    if float(hi / (lo + FLT_EPSILON)) <= unify_threshold and abs(float(zp0) - float(zp1)) <= FLT_EPSILON:
        if method.upper() == "ADD":
            m, s, _, sdt = scale_shift(tso / ts0, out_bits, force_shift_positive=force_shift_positive)
        else:
            m, s, sdt = 1, 0, Dtype.INT8
        # all three multipliers are declared uint16, as in the aligned form (upstream's types, whatever M's width)
        return EltwiseRequant([int(m), 1, 1], int(s), [Dtype.UINT16] * 3, sdt, unified=True)

    in_bits = AIFF_MULTIPLIER_BITS + 1  # the unsigned width holding 32767; scale_shift caps it to 15
    m0, n0, _, _ = scale_shift(ts0, in_bits)
    m1, n1, _, _ = scale_shift(ts1, in_bits)
    if n0 > n1:
        common, mul0, mul1 = n0, m1 * 2.0 ** (n0 - n1), float(m0)
    else:
        common, mul0, mul1 = n1, float(m1), m0 * 2.0 ** (n1 - n0)
    rscale = tso / (ts1 * ts0) / (2.0 ** common)
    shrink = max(mul0, mul1) / ELTWISE_INPUT_MULTIPLIER_MAX
    if shrink > 1.0:
        mul0 /= shrink
        mul1 /= shrink
        rscale = rscale * shrink
    mul0 = max(0, min(ELTWISE_INPUT_MULTIPLIER_MAX, round(mul0)))
    mul1 = max(0, min(ELTWISE_INPUT_MULTIPLIER_MAX, round(mul1)))
    m, s, _, _ = scale_shift(rscale, out_bits)
    if s < 0:
        m = max(1, min(ELTWISE_INPUT_MULTIPLIER_MAX, int(m * 2 ** (-s))))
        s = 0
    return EltwiseRequant([int(m), int(mul0), int(mul1)], int(s), [Dtype.UINT16] * 3,
                          range_dtype(-1, s, force_signed=True))


def eltwise_multipliers_n(scales: Sequence[float], s_out: float, out_bits: int, zps: Sequence[Number],
                          unify_threshold: float = 1.0, force_shift_positive: bool = False) -> EltwiseRequant:
    """Multipliers of an Eltwise ADD/MAX/MIN with any number K of inputs (quantopt's extension: upstream quantizes
    two). Every input is aligned to the finest input grid: with s_max the largest input scale and r_i = s_max / s_i,
    M_i = round_half_even(r_i · 2^P) for the largest P keeping every M_i <= 32767, so Σ (x_i + zp_i) · M_i is the
    float sum times s_max · 2^P; the output ratio s_out / (s_max · 2^P) becomes (M_out, shift) with `out_bits` (a
    negative shift folded into M_out, as for two inputs). Equal scales and zero points give [M, 1, ..., 1] with
    s_out / s. Float32 arithmetic. Raises ValueError when the scales differ by more than 32767 times."""
    f32 = torch.float32
    ts = [torch.tensor(float(v), dtype=f32) for v in scales]
    tso = torch.tensor(float(s_out), dtype=f32)
    hi, lo = max(ts, key=float), min(ts, key=float)
    if float(hi / (lo + FLT_EPSILON)) <= unify_threshold and max(zps) - min(zps) <= FLT_EPSILON:
        m, s, mdt, sdt = scale_shift(tso / ts[0], out_bits, force_shift_positive=force_shift_positive)
        return EltwiseRequant([int(m)] + [1] * len(ts), int(s), [mdt] + [Dtype.UINT16] * len(ts), sdt, unified=True)
    ratios = [float(hi / t) for t in ts]
    top = max(ratios)
    if top > ELTWISE_INPUT_MULTIPLIER_MAX:
        raise ValueError(f"input scales differ by {top:.4g} times, more than {ELTWISE_INPUT_MULTIPLIER_MAX}")
    power = math.floor(math.log2(ELTWISE_INPUT_MULTIPLIER_MAX / top))
    muls = [max(1, min(ELTWISE_INPUT_MULTIPLIER_MAX, round(r * 2.0 ** power))) for r in ratios]
    m, s, _, _ = scale_shift(tso / (hi * torch.tensor(2.0 ** power, dtype=f32)), out_bits,
                             force_shift_positive=force_shift_positive)
    if s < 0:
        m = max(1, min(ELTWISE_INPUT_MULTIPLIER_MAX, int(m * 2 ** (-s))))
        s = 0
    return EltwiseRequant([int(m)] + muls, int(s), [Dtype.UINT16] * (len(ts) + 1),
                          range_dtype(-1, s, force_signed=True))


def bias_quantize(bias: Union[torch.Tensor, np.ndarray], s_in: Union[float, torch.Tensor],
                  s_w: Union[float, torch.Tensor], bias_bits: int,
                  upstream_float32_clip: bool = False) -> Tuple[torch.Tensor, Union[float, torch.Tensor]]:
    """b_q = clip(round(b * s_in * s_w)) with zero point 0; returns (int64 b_q, bias scale).

    As upstream: bias scale = float32(s_in) * float32(s_w) in float32 (the IR `biases_scale`), product with the
    float32 bias and round-half-even in float32 (so |b_q| > 2^24 carries float32 spacing). The clip range is
    [-2^(bits-1), 2^(bits-1)-1], applied exactly. Upstream clamps in float32, where 2^31-1 becomes 2^31: a
    positive int32 overflow then yields 2^31 (stored as INT_MIN after the int32 wrap of the writer, and making
    `compress_bias` drop one bit). `upstream_float32_clip=True` reproduces that (the golden 16-bit IRs show it).
    Per-channel scales run along axis 0 of biases of several axes (channels first).
    """
    s = torch.as_tensor(s_in, dtype=torch.float32).cpu() * torch.as_tensor(s_w, dtype=torch.float32).cpu()
    b = torch.as_tensor(np.asarray(bias) if isinstance(bias, np.ndarray) else bias).to(torch.float32)
    s = s.to(b.device)  # the float32 product is formed on the CPU (IEEE, as on any device), then joins the biases
    q = torch.round(b * _along_axis0(s, b))
    lo, hi = -(2 ** (bias_bits - 1)), 2 ** (bias_bits - 1) - 1
    if upstream_float32_clip:
        q = torch.clamp(q, torch.tensor(lo, dtype=torch.float32).item(), torch.tensor(hi, dtype=torch.float32).item())
        q = q.to(torch.float64)
    else:
        q = torch.clamp(q.to(torch.float64), float(lo), float(hi))
    q = torch.nan_to_num(q, nan=0.0).to(torch.int64)
    scale = s if s.dim() > 0 else float(s.item())
    return q, scale


def _along_axis0(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-channel `scale` (one value per index of axis 0) shaped to broadcast against `like`; a scalar as it is."""
    if scale.dim() == 0 or scale.numel() == 1 or like.dim() <= 1:
        return scale
    return scale.reshape([-1] + [1] * (like.dim() - 1))


def fold_input_zero_point(bias_q: torch.Tensor, w_q: torch.Tensor, zp_in: Union[Number, torch.Tensor],
                          qmin: Optional[int] = None, qmax: Optional[int] = None) -> torch.Tensor:
    """b' = b + zp_in * Σ w_q over every axis but 0 (output channels first, any layout), exact in int64.

    Exact because x_f = (x_q + zp)/s: conv(x_q + zp, w) = conv(x_q, w) + zp·Σw. `zp_in` is the input zero point
    (a number, or a tensor broadcastable to the weights). Optionally clamped to the bias range as upstream does
    right after folding.
    """
    w = torch.as_tensor(w_q).to(torch.int64)
    zp = torch.round(torch.as_tensor(zp_in, dtype=torch.float64)).to(device=w.device, dtype=torch.int64)
    contrib = (w * zp).reshape(w.shape[0], -1).sum(dim=1)
    b = torch.as_tensor(bias_q)
    b = torch.round(b.to(torch.float64)).to(torch.int64) if torch.is_floating_point(b) else b.to(torch.int64)
    contrib = contrib.to(b.device)
    out = b + (contrib.reshape(b.shape) if b.numel() == contrib.numel() else contrib)
    if qmin is not None or qmax is not None:
        out = torch.clamp(out, qmin, qmax)
    return out


def float32_grid(values: torch.Tensor) -> torch.Tensor:
    """Integers rounded to the nearest float32 value (ties to even), as int64: what an integer sum held in a float32
    tensor keeps. Values below 2^24 in magnitude are unchanged."""
    v = torch.as_tensor(values).to(torch.int64)
    return v.to(torch.float32).to(torch.int64)


def compress_bias(bias_q: torch.Tensor, effective_bits: int) -> Tuple[torch.Tensor, int]:
    """Keep only the top `effective_bits` bits of the biases (`bias_effective_bits`); returns (b', k).

    k = ceil(max(log2(max(bmax, 1) / (2^(N-1)-1)), log2(min(bmin, -1) / -2^(N-1)))), computed in float64 as the
    latest upstream `clear_lower_bits_for_bias`; if k > 0, b' = (b >> k) << k with an arithmetic shift, i.e. each
    value is rounded toward -inf to a multiple of 2^k (no round-to-nearest). k is the number of low bits dropped.
    """
    b = torch.as_tensor(bias_q).to(torch.int64)
    if b.numel() == 0:
        return b, 0
    lmin, lmax = -(2 ** (effective_bits - 1)), 2 ** (effective_bits - 1) - 1
    bmin = min(int(b.min()), -1)
    bmax = max(int(b.max()), 1)
    k = math.ceil(max(math.log2(bmax / lmax), math.log2(bmin / lmin)))
    if k <= 0:
        return b.clone(), 0
    return (b >> k) << k, k


def _batchmean_kl(log_q: torch.Tensor, p: torch.Tensor) -> float:
    """torch's `kl_div(log_q, p, reduction="batchmean")` of one vector: sum(p * (log p - log_q)) / len."""
    return float(torch.nn.functional.kl_div(log_q, p, reduction="batchmean"))


def search_bias_clamp_bits(bias_float: torch.Tensor, bias_q: torch.Tensor, bias_scale: Union[float, torch.Tensor],
                           effective_bits: int, bias_bits: int) -> Optional[int]:
    """`bias_effective_bits_auto_adaption`, upstream's search: the width to clamp the quantized biases to before
    `compress_bias` keeps their top `effective_bits` bits, or None to leave them as they are.

    The search runs only when compressing the biases changes how they compare with the float biases: the KL
    divergences of softmax(quantized biases) and of softmax(compressed biases) from softmax(float biases) (each
    over the layer's bias vector, `batchmean`) differ by more than 0.05. Then each width c in
    [min(max(effective_bits, 19), bias_bits - 1), bias_bits) is tried: the biases clamped to c bits, and the same
    compressed (the dropped low bits counted on the clamped values); the c whose compressed biases diverge least
    (KL of their dequantized softmax from that of the clamped ones) wins, the first on a tie. quantopt drops no bits
    where a width needs none (upstream shifts by the negative count there) and computes the divergences in float64:
    they are often 1e-12 or less, below float32's resolution, where upstream's float32 choice is rounding noise.
    Computed on the CPU: a GPU's softmax sums and exponentials differ in the last bits, and the choice must not."""
    shaped = torch.as_tensor(bias_q).cpu().to(torch.int64)
    b = shaped.reshape(-1)
    if effective_bits >= bias_bits or b.numel() == 0:
        return None
    f = torch.as_tensor(bias_float).cpu().to(torch.float64).reshape(-1)
    scale = torch.as_tensor(bias_scale).cpu().to(torch.float64)
    scale = (_along_axis0(scale, shaped).expand(shaped.shape) if scale.numel() > 1 else scale).reshape(-1)
    float_softmax = f.softmax(dim=-1)
    compressed, _ = compress_bias(b, effective_bits)
    drift = _batchmean_kl(b.to(torch.float64).log_softmax(dim=-1), float_softmax) - \
        _batchmean_kl(compressed.to(torch.float64).log_softmax(dim=-1), float_softmax)
    if abs(drift) <= 0.05:
        return None
    best: Optional[Tuple[float, int]] = None
    for c in range(min(max(effective_bits, 19), bias_bits - 1), bias_bits):
        clamped = torch.clamp(b, -(2 ** (c - 1)), 2 ** (c - 1) - 1)
        packed, _ = compress_bias(clamped, effective_bits)
        kld = abs(_batchmean_kl((packed.to(torch.float64) / scale).log_softmax(dim=-1),
                                (clamped.to(torch.float64) / scale).softmax(dim=-1)))
        if best is None or kld < best[0]:
            best = (kld, c)
    return best[1] if best is not None else None


def aiff_ahead_shift(acc: torch.Tensor, shift: int, remain_shift: int,
                     bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int]:
    """Model the 48-bit MAC → 32-bit ITP hand-over (`remain_shift`); returns (data, shift still to apply).

    If shift > remain_shift: data = clip(round_half_even(acc · 2^-(shift-remain)), int32) and the bias is
    pre-shifted with an arithmetic right shift (floor) and clipped to int32; else data = clip(acc, int32) and
    the whole shift remains. The bias is added after the clip, as upstream (float64 result, exact for int inputs).
    """
    acc64 = torch.as_tensor(acc).to(torch.float64)
    if shift > remain_shift:
        d = shift - remain_shift
        data = torch.clamp(torch.round(acc64 * 0.5 ** d), INT32_MIN, INT32_MAX)
        if bias is not None:
            b = torch.round(torch.as_tensor(bias).to(torch.float64)).to(torch.int64) >> d
            data = data + torch.clamp(b, INT32_MIN, INT32_MAX).to(torch.float64)
        return data, remain_shift
    data = torch.clamp(acc64, INT32_MIN, INT32_MAX)
    if bias is not None:
        data = data + torch.as_tensor(bias).to(torch.float64)
    return data, shift
