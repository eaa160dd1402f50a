"""Recipes behind one cfg field, `preset`: a named set of field values that replace the defaults of the fields the
cfg does not set itself (a field written in the cfg always wins, so a preset is a starting point, not a lock).

`none` (the default) changes nothing: upstream's defaults stay the defaults. `accurate` is the recommended int8
recipe, measured on real models in docs/accuracy.md: it keeps 8 bits wherever 8 bits hold the signal and changes
what upstream's defaults lose most on: per-channel weights (convolutions whose output channels differ in range by
tens of times), one requantization shift per channel (a shared shift zeroes the multipliers of narrow channels),
activation ranges that hold 99.99% of the calibration values (a true percentile) instead of the mean of per-batch
extrema, and 16 bits for the layers whose outputs no 8-bit range quantizes with an expected SQNR of 30 dB (the
outlier features of transformer residual streams; convolutional networks keep 8 bits nearly everywhere),
LayerNorm's and LogSoftmax's exact integer forms instead of upstream's table-based ones, and attention masks of
finite values (Swin's -100, `(1 - keep) * -1e4`) taken as masks.

Torch-free, like the rest of the cfg reading.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping

PRESETS: Dict[str, Dict[str, str]] = {
    "none": {},
    "accurate": {
        "quantize_method_for_weight": "per_channel_symmetric_restricted_range",
        "calibration_strategy_for_activation": "quantile[99.99]",
        "unify_shifts_for_aiff": "false",
        "min_activation_sqnr_db": "30",
        "layernorm_integer_form": "exact",
        "div_integer_form": "exact",
        "reduce_l2_integer_form": "exact",
        "lut_output_range": "table",
        "logsoftmax_integer_form": "exact",
        "lstm_integer_form": "q15",
        "gru_integer_form": "q15",
        "detect_finite_masks": "true",
    },
}
"""preset name -> {cfg field: value as written in a cfg}."""

PRESET_NAMES = tuple(PRESETS)

GLOBAL_SETTING_FIELDS: Dict[str, str] = {"detect_finite_masks": "detect_finite_masks"}
"""Global cfg fields a preset sets that every layer's LayerSettings carries (cfg field -> LayerSettings name)."""


def preset_values(name: str) -> Mapping[str, str]:
    """The cfg values of preset `name` (a ValueError names the valid presets)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESET_NAMES)}") from None


def preset_settings(name: str) -> Dict[str, Any]:
    """The preset as LayerSettings keyword arguments (the per-layer JSON names), for the Python API:
    `quantize_model(graph, calibration, settings=preset_settings("accurate"))`."""
    from .layer_settings import SETTING_FIELDS

    by_field = {cfg_field: key for key, cfg_field in SETTING_FIELDS.items()}
    by_field.update(GLOBAL_SETTING_FIELDS)
    values = preset_values(name)
    missing: List[str] = [f for f in values if f not in by_field]
    if missing:
        raise ValueError(f"preset {name!r} sets non-layer fields {missing}: use it through a cfg")
    return {by_field[f]: _layer_value(f, text) for f, text in values.items()}


def _layer_value(cfg_field: str, text: str) -> Any:
    from .fields import FIELDS

    return FIELDS[cfg_field].kind.parse(text)
