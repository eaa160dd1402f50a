"""Pure quantization math of OPT: hardware limits, rounding, range → params, requantization, LUTs
(docs/integer-semantics.md).

No graph objects here: torch/numpy/python numbers in and out, so every rule can be tested on its own.
"""
from .hardware import (
    AIFF_MULTIPLIER_BITS,
    AIFF_MULTIPLIER_MAX,
    AIFF_SHIFT_MAX,
    DEFAULT_LUT_ITEMS_IN_BITS,
    FLT_EPSILON,
    Target,
    target_info,
)
from .lut import build_lut, lookup_lut, lut_sample_points, lut_size
from .params import QuantMode, QuantParams, dequantize, integer_range, linear_quant_params, quantize
from .requant import (
    EltwiseRequant,
    UnifiedShifts,
    aiff_ahead_shift,
    bias_quantize,
    compress_bias,
    eltwise_multipliers,
    float32_grid,
    fold_input_zero_point,
    group_ranges,
    linear_requantize,
    linear_requantize_floor,
    range_dtype,
    scale_shift,
    unify_shifts,
    unify_shifts_for_aiff,
)
from .rounding import RoundMode, round_by_mode, round_half_away, round_half_even

__all__ = [
    "AIFF_MULTIPLIER_BITS", "AIFF_MULTIPLIER_MAX", "AIFF_SHIFT_MAX", "DEFAULT_LUT_ITEMS_IN_BITS", "FLT_EPSILON",
    "Target", "target_info",
    "build_lut", "lookup_lut", "lut_sample_points", "lut_size",
    "QuantMode", "QuantParams", "dequantize", "integer_range", "linear_quant_params", "quantize",
    "EltwiseRequant", "UnifiedShifts", "aiff_ahead_shift", "bias_quantize", "compress_bias", "eltwise_multipliers",
    "float32_grid", "fold_input_zero_point", "group_ranges", "linear_requantize", "linear_requantize_floor",
    "range_dtype", "scale_shift", "unify_shifts", "unify_shifts_for_aiff",
    "RoundMode", "round_by_mode", "round_half_away", "round_half_even",
]
