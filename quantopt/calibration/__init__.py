"""Calibration: streaming tensor statistics and local (per-tensor) calibration strategies.

`update_statistics` folds calibration batches into a tensor's `TensorStatistics`; `apply_strategy` turns those
statistics into the tensor's calibrated range with an upstream strategy (`mean`, `extrema`, `3std`, `kld`, ...).
"""
from .statistics import (
    STAT_INT_MAX,
    STAT_INT_MIN,
    StatisticsConfig,
    Trim,
    apply_trim,
    histogram_range,
    parse_trim,
    rebin_histogram,
    update_statistics,
)
from .strategies import (
    ACIQ_GAUSS_ALPHA,
    ACIQ_LAPLACE_ALPHA,
    STRATEGY_FORMS,
    WEIGHTED_SCALE_PARAM_DEFAULTS,
    Strategy,
    apply_strategy,
    kld_threshold,
    parse_strategy,
    statistics_needs,
)

__all__ = [
    "ACIQ_GAUSS_ALPHA", "ACIQ_LAPLACE_ALPHA", "STAT_INT_MAX", "STAT_INT_MIN", "STRATEGY_FORMS",
    "WEIGHTED_SCALE_PARAM_DEFAULTS", "StatisticsConfig", "Strategy", "Trim", "apply_strategy", "apply_trim",
    "histogram_range", "kld_threshold", "parse_strategy", "parse_trim", "rebin_histogram", "statistics_needs",
    "update_statistics",
]
