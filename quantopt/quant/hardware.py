"""Every hardware-flavoured limit of the Zhouyi NPU that the quantization math depends on, in one place.

Upstream OPT scatters these through its operator files; each constant below names the rule it encodes and, where
the repository documents that rule, the page that does (docs/integer-semantics.md, docs/semantics/*). Nothing here is
configurable at run time: cfg fields (multiplier_bits, lut_items_in_bits, bias_effective_bits...) choose values
*within* these limits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

# --- float tolerances -------------------------------------------------------------------------------------------

FLT_EPSILON: float = float(torch.finfo(torch.float32).eps)
"""float32 machine epsilon (2^-23). Upstream's `OPT_EPSILON` and `QUANTIZE_ZERO_BAND`: a float range narrower
than this is degenerate (scale 1) and a multiplier within it of 2^shift is "exactly one" (a power-of-two ratio gives
M = 1, N = 0: docs/integer-semantics.md, Requantization)."""

# --- requantization multiplier / shift (AIFF = the MAC engine) ---------------------------------------------------

AIFF_MULTIPLIER_BITS: int = 15
"""Requant multipliers are capped at 15 bits because the AIFF multiplier is a signed 16-bit value
(`mb = min(multiplier_bits, 15)`, docs/integer-semantics.md, Requantization)."""

AIFF_MULTIPLIER_MAX: int = 2 ** AIFF_MULTIPLIER_BITS - 1
"""32767: largest multiplier the AIFF accepts; `unify_shifts_for_aiff` shrinks per-channel multipliers below it."""

AIFF_SHIFT_MAX: int = 31
"""Largest right shift of the AIFF requant stage (`shift_bits_ceil`; docs/integer-semantics.md, Requantization)."""

WIDE_SHIFT_MAX: int = 62
"""Largest right shift of the exact int64 requantizations whose ratios carry many fraction bits (SquaredDifference,
Mod, Reduce L2/VARIANCE/PROD): `round_shift` is exact up to 62 and gives 0 beyond."""

POOLING_SHIFT_MAX: int = 63
"""Shift ceiling used instead of 31 by the L1/L2 pooling requant paths (docs/semantics/pooling.md)."""

DEFAULT_SHIFT_BITS: int = 8
"""Shifts are stored as int8 (`SHIFT_DTYPE`); they may be negative (e.g. Softmax `shift_value=-1`)."""

# --- Eltwise ADD/SUB/MAX/MIN ------------------------------------------------------------------------------------

ELTWISE_INPUT_MULTIPLIER_MAX: int = 32767
"""Eltwise input multipliers are clipped to int16 max: AIFF does not take uint16 65535
(docs/integer-semantics.md, Eltwise)."""

ELTWISE_INPUT_MULTIPLIER_BITS: int = 15
"""Bits of each Eltwise input multiplier: upstream asks for the 16 bits that hold 32767, then the 15-bit cap
applies (docs/integer-semantics.md, Eltwise)."""

# --- biases -----------------------------------------------------------------------------------------------------

DEFAULT_BIAS_BITS: int = 32
"""`bias_bits` default: biases are int32 for 8-bit activations (docs/user-guide.md)."""

WIDE_BIAS_BITS: int = 48
"""Bias bits of the 16-bit quant types (w16a16...): a 48-bit accumulator, stored as int64."""

MAC_ACCUMULATOR_BITS: int = 48
"""The AIFF MAC accumulates in 48 bits; `remain_shift` models the pre-shift into the 32-bit ITP stage
(docs/integer-semantics.md, Convolution)."""

ITP_INPUT_BITS: int = 32
"""Width of the stage after the MAC: the pre-shifted accumulator and bias are clipped to int32
(docs/integer-semantics.md, Convolution)."""

REMAIN_SHIFT_RANGE = (0, 32)
"""Allowed values of the `remain_shift` cfg field (docs/user-guide.md)."""

# --- LUTs -------------------------------------------------------------------------------------------------------

DEFAULT_LUT_ITEMS_IN_BITS: int = 8
"""Default `lut_items_in_bits`: LUTs hold at most 2^8 entries; 10+ is recommended for 16-bit inputs."""

LUT_ITEMS_IN_BITS_RANGE = (8, 16)
"""Allowed values of the `lut_items_in_bits` cfg field (docs/user-guide.md)."""

# --- Softmax ----------------------------------------------------------------------------------------------------

SOFTMAX_FAST_EXP_MULTIPLIER_BITS: int = 13
"""FAST_EXP Softmax approximates log2(e)/s_in with a 13-bit multiplier (docs/semantics/softmax.md)."""

SOFTMAX_LUT_AUTO_VALUE_BITS: int = 20
"""LUT value bits used when the pass auto-selects the LUT Softmax method (`[2, 20]`)."""

SOFTMAX_LUT_MIN_VALUE_BITS: int = 16
"""Lower bound of the Softmax LUT value bits."""


def softmax_lut_value_bits(axis_len: int) -> int:
    """Bits of the exp-LUT values so that the sum over `axis_len` items fits 32 bits: max(16, 32 - ceil(log2 n))."""
    return max(SOFTMAX_LUT_MIN_VALUE_BITS, 32 - math.ceil(math.log2(max(int(axis_len), 1))))


def softmax_pow2_out_q(axis_len: int) -> int:
    """Fraction bits of the FAST_EXP power-of-two output: 31 - floor(log2 n) (docs/semantics/softmax.md)."""
    return 31 - math.floor(math.log2(max(int(axis_len), 1)))


SOFTMAX_SMALL_AXIS: int = 8
"""Upstream's short-row Softmax division variant applies below this axis length (with SOFTMAX_ROW_BLOCK rows and
<= 8-bit outputs)."""

SOFTMAX_ROW_BLOCK: int = 128
"""... and when the number of rows (elements / axis length) is a multiple of this."""

SOFTMAX_DIVIDEND_BITS: int = 31
"""The Softmax division works on 31-bit dividends (30 when the table's largest value is 1)."""

LOGSOFTMAX_UPSTREAM_RANGE = (-16.0, 0.0)
"""The output range of a LogSoftmax in upstream's integer form, fixed rather than calibrated: log-probabilities below
-16 saturate (docs/semantics/softmax.md)."""

# --- activations with a quantized slope ---------------------------------------------------------------------------

PRELU_SLOPE_SHIFT: int = 12
"""Fraction bits of the int16 PRELU slope (upstream's `negative_slope_shift=12`, seen in every golden IR)."""

SLOPE_ACC_BITS: int = 48
"""Width of the LeakyReLU/PReLU slope stage before the requantization (clipped to a signed 48-bit value)."""

# --- MAC-like layers and inputs -------------------------------------------------------------------------------------

BN_WEIGHT_BITS: int = 16
"""BatchNorm weights are quantized with at least this many bits (upstream's BatchNorm default)."""

INT_INPUT_MAX_BITS: int = 32
"""Integer model inputs wider than this are clamped to 32 bits when used as quantized values
(docs/integer-semantics.md, Input)."""

# --- resize / interpolation -------------------------------------------------------------------------------------

INTERP_FRACTION_BITS: int = 13
"""Fraction bits of bilinear interpolation coefficients (`interp_shift_value`, docs/semantics/geometry.md)."""

ANTIALIAS_FRACTION_BITS: int = 8
"""Fraction bits of the antialias resize coefficient tables."""

# --- misc -------------------------------------------------------------------------------------------------------

STATISTICS_CLIP_RANGE = (-(2 ** 31), 2 ** 31 - 1)
"""Observed statistics (extrema) are clipped to the int32 range (as upstream's OPT_INT_MIN/OPT_INT_MAX)."""

DECOMPOSE_ACTIVATION_MIN_ELEMENTS: int = 2 * 1024 * 1024
"""`enable_pass_decompose_nonmonotonic_activations` only splits activations with at least 2M output elements."""

NORM_8BIT_MAX_SQRT_N: int = 127
"""8-bit LayerNorm/GroupNorm: the normalised tensor range ±sqrt(N) is shrunk when sqrt(N) exceeds 127."""


# --- targets ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One `min_compatible_zhouyi_target`: optimisation level, AIFF LUT size and bias effective bits."""

    name: str
    level: int
    lut_items_in_bits: int
    bias_effective_bits: int


TARGETS: Dict[str, Target] = {t.name: t for t in (
    Target("Z1", 0, 8, 16),
    Target("Z2", 0, 8, 16),
    Target("Z3", 0, 8, 16),
    Target("X1", 0, 8, 16),
    Target("X2", 1, 8, 32),
    Target("X3", 2, 9, 32),
    Target("X3P", 2, 9, 32),
    Target("X3S", 2, 9, 32),
)}
DEFAULT_TARGET: str = "X2"
UNKNOWN_TARGET = Target("?", 1, 9, 32)
"""What upstream answers for a target name it does not know (level 1, 2^9 LUT, 32 bias bits)."""


def target_info(name: str) -> Target:
    """The target record for a cfg value like `X2` or `X3_1204` (the suffix after `_` is ignored)."""
    key = str(name).strip().upper().split("_", 1)[0]
    return TARGETS.get(key, UNKNOWN_TARGET)
