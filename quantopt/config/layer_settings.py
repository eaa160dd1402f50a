"""Per-layer quantization settings: the cfg's per-layer fields resolved for one layer, then the opt_config JSON.

A `LayerSettings` is what a quantize function reads; its field names are the keys of the per-layer JSON template
(`<model>_opt_template.json`), so a user edits exactly what the operators see.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

from ..errors import ConfigError, QuantOptError, UnsupportedError
from ..quant.hardware import BN_WEIGHT_BITS
from .fields import FIELDS
from .quant_types import quant_type_settings
from .targets import target_level

# JSON/template key -> cfg field that gives its default and validates its value
SETTING_FIELDS: Dict[str, str] = {
    "q_mode_activation": "quantize_method_for_activation",
    "q_mode_weight": "quantize_method_for_weight",
    "q_bits_activation": "activation_bits",
    "q_bits_weight": "weight_bits",
    "q_bits_bias": "bias_bits",
    "q_strategy_activation": "calibration_strategy_for_activation",
    "q_strategy_weight": "calibration_strategy_for_weight",
    "running_statistic_momentum": "running_statistic_momentum",
    "histc_bins": "histc_bins",
    "trim_infinity_before_statistic": "trim_infinity_before_statistic",
    "lut_items_in_bits": "lut_items_in_bits",
    "multiplier_bits": "multiplier_bits",
    "bias_effective_bits": "bias_effective_bits",
    "unify_shifts_for_aiff": "unify_shifts_for_aiff",
    "force_dtype_int": "force_dtype_int",
    "force_shift_positive": "force_shift_positive",
    "remain_shift": "remain_shift",
    "trigger_float_op": "trigger_float_op",
    "min_activation_sqnr_db": "min_activation_sqnr_db",
    "layernorm_integer_form": "layernorm_integer_form",
    "div_integer_form": "div_integer_form",
    "reduce_l2_integer_form": "reduce_l2_integer_form",
    "lut_output_range": "lut_output_range",
    "logsoftmax_integer_form": "logsoftmax_integer_form",
    "lstm_integer_form": "lstm_integer_form",
    "gru_integer_form": "gru_integer_form",
    "perf_mode_for_lib": "perf_mode_for_lib",
    "resize_degrade_to_nearest": "resize_degrade_to_nearest",
    "unify_scales_for_kvc_concat": "unify_scales_for_kvc_concat",
    "bias_effective_bits_auto_adaption": "bias_effective_bits_auto_adaption",
    "weight_block_size": "weight_block_size",
}


@dataclass
class LayerSettings:
    """Everything that decides how one layer is calibrated and quantized."""

    q_mode_activation: str = "per_tensor_symmetric_full_range"
    q_mode_weight: str = "per_tensor_symmetric_restricted_range"
    q_bits_activation: int = 8
    q_bits_weight: int = 8
    q_bits_bias: int = 32
    q_strategy_activation: str = "mean"
    q_strategy_weight: str = "extrema"
    running_statistic_momentum: float = 0.9
    histc_bins: int = 2048
    trim_infinity_before_statistic: str = ""
    lut_items_in_bits: int = 8
    multiplier_bits: Optional[int] = None
    bias_effective_bits: Optional[int] = None
    unify_shifts_for_aiff: bool = True
    force_dtype_int: bool = False
    force_shift_positive: bool = False
    remain_shift: Optional[int] = None
    trigger_float_op: str = "disable"
    min_activation_sqnr_db: float = 0.0
    layernorm_integer_form: str = "upstream"
    div_integer_form: str = "upstream"
    reduce_l2_integer_form: str = "upstream"
    lut_output_range: str = "calibrated"
    logsoftmax_integer_form: str = "upstream"
    lstm_integer_form: str = "upstream"
    gru_integer_form: str = "upstream"
    perf_mode_for_lib: bool = True
    resize_degrade_to_nearest: bool = False
    unify_scales_for_kvc_concat: bool = False
    bias_effective_bits_auto_adaption: bool = False
    weight_block_size: int = 256
    qinvariant: bool = False  # set_qinvariant_for_start_nodes (not a JSON key: chosen by layer id in the cfg)
    concat_threshold: float = 1.05  # unify_scales_for_concat_threshold (global cfg field)
    fc_float_summation: str = "upstream"  # fc_float_summation (global cfg field; ops/linear.py)
    float_reference: str = "exact"  # float_reference (global cfg field; ops/conv.py, ops/linear.py)
    detect_inf_mask_nodes: bool = False  # enable_pass_detect_inf_mask_nodes (global cfg field; passes/inf_mask.py)
    detect_finite_masks: bool = False  # detect_finite_masks (global cfg field; calibration/finite_mask.py)
    upstream_defects: FrozenSet[str] = frozenset()  # upstream_defects (global cfg field; config/upstream_defects.py)
    perchannel_min_elements: int = 1  # activation_perchannel_min_elements (global; passes/per_channel_fallback.py)
    target_level: int = 1  # min_compatible_zhouyi_target's level (global; config/targets.py)
    quant_type: str = "disable"  # an fp8-activation quant_type (config/quant_types.py, ops/_fp8.py; not a JSON key)
    explicit: FrozenSet[str] = field(default=frozenset(), compare=False)
    """Keys set for this layer in particular (a per-layer cfg rule, opt_config, quantize_model's per_layer): they
    take precedence over an operator's own default (BatchNorm's 16-bit weights)."""
    origin: Tuple[Tuple[str, str], ...] = field(default=(), compare=False)
    """(key, file) of the keys a per-layer JSON set (`opt_config`, a QConfig plugin): an error about such a value
    names that file, not the cfg field the value would otherwise come from."""

    def origin_of(self, key: str) -> Optional[str]:
        """The per-layer JSON file that set `key` for this layer, if one did."""
        return dict(self.origin).get(key)

    @property
    def mult_bits(self) -> int:
        """Requant multiplier bits: `multiplier_bits`, else the activation bits, capped at 15 by `scale_shift`."""
        return self.multiplier_bits if self.multiplier_bits is not None else self.q_bits_activation

    @property
    def effective_bias_bits(self) -> int:
        return self.bias_effective_bits if self.bias_effective_bits is not None else self.q_bits_bias

    def to_json(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in SETTING_FIELDS}


def settings_from_cfg(cfg: Any, node: Any) -> LayerSettings:
    """Resolve every per-layer cfg field for `node` (layer-id range > op type/method > name regex > global)."""
    values: Dict[str, Any] = {}
    for key, field_name in SETTING_FIELDS.items():
        v = getattr(cfg, field_name)
        values[key] = v.get(node) if hasattr(v, "get") and not isinstance(v, dict) else v
    values["qinvariant"] = node.layer_id in (cfg.set_qinvariant_for_start_nodes or [])
    values["concat_threshold"] = float(cfg.unify_scales_for_concat_threshold)
    values["fc_float_summation"] = str(cfg.fc_float_summation)
    values["float_reference"] = str(cfg.float_reference)
    values["detect_inf_mask_nodes"] = bool(cfg.enable_pass_detect_inf_mask_nodes)
    values["detect_finite_masks"] = bool(cfg.detect_finite_masks)
    values["upstream_defects"] = frozenset(cfg.upstream_defects)
    values["perchannel_min_elements"] = int(cfg.activation_perchannel_min_elements)
    values["target_level"] = target_level(cfg.min_compatible_zhouyi_target)
    values["explicit"] = frozenset(key for key, field_name in SETTING_FIELDS.items()
                                   if hasattr(getattr(cfg, field_name), "overridden")
                                   and getattr(cfg, field_name).overridden(node))
    recipe = quant_type_settings(_for_layer(cfg.quant_type, node))  # quant_type overrides bits and float choice
    values.update(recipe)
    values["explicit"] = values["explicit"] | frozenset(recipe)
    settings = with_operator_defaults(LayerSettings(**values), node)
    check_settings(settings, node)
    return settings


def _for_layer(value: Any, node: Any) -> Any:
    return value.get(node) if hasattr(value, "get") and not isinstance(value, dict) else value


MUL_AS_BATCHNORM = "mul_as_batchnorm"
"""PyNode attr of a BatchNorm that passes/mul_to_batchnorm.py made from a Mul: its weights keep the Mul's bits."""


def default_bn_weight_bits(node: Any) -> bool:
    """Whether a layer's weights take the BatchNorm default of max(16, q_bits_weight) bits: a BatchNorm of the
    model, not one the graph passes made from a Mul (upstream sets the default by the type the layer had before)."""
    return str(node.type) == "BatchNorm" and not node.attrs.get(MUL_AS_BATCHNORM, False)


def with_operator_defaults(settings: LayerSettings, node: Any) -> LayerSettings:
    """Operator defaults that differ from the global values, unless set for the layer itself: BatchNorm weights get
    max(16, q_bits_weight) bits (`default_bn_weight_bits`). Written into the settings, so the JSON template shows
    what the layer used."""
    if default_bn_weight_bits(node) and "q_bits_weight" not in settings.explicit:
        return dataclasses.replace(settings, q_bits_weight=max(BN_WEIGHT_BITS, int(settings.q_bits_weight)))
    return settings


def check_settings(settings: LayerSettings, node: Any) -> None:
    """Combinations quantopt rejects for a layer (the error names the field, or the per-layer JSON that set it)."""
    if settings.q_mode_activation == "per_channel_asymmetric":
        error = UnsupportedError(f"layer '{node.name}': quantize_method_for_activation=per_channel_asymmetric: "
                                 "activations take per_tensor modes or per_channel_symmetric_restricted_range/"
                                 "per_channel_symmetric_full_range", field="quantize_method_for_activation",
                                 layer=node.name)
        raise _located(error, settings, None)


FIELD_KEYS: Dict[str, str] = {field_name: key for key, field_name in SETTING_FIELDS.items()}
"""cfg field -> per-layer JSON key."""


def locate_setting_error(error: QuantOptError, graph: Any, cfg: Any = None) -> QuantOptError:
    """`error` located where its layer's refused value was set: the per-layer JSON that set it for that layer
    (`opt_config`, a QConfig plugin), else the cfg line of its field. An error without a field and a layer, or
    about a layer the graph does not have, is returned as it is."""
    if not error.field or not error.layer:
        return error
    node = next((n for n in graph.nodes if n.name == error.layer), None)
    settings = getattr(node, "settings", None)
    if not isinstance(settings, LayerSettings):
        return error
    return _located(error, settings, cfg)


def _located(error: QuantOptError, settings: LayerSettings, cfg: Any) -> QuantOptError:
    key = FIELD_KEYS.get(error.field or "")
    source = settings.origin_of(key) if key else None
    if source is not None:
        named = f"'{key}'" if f"layer '{error.layer}'" in error.message else f"layer '{error.layer}': '{key}'"
        return error.moved(f"{named} (per-layer value): {error.message}", file=source)
    line = getattr(cfg, "explicit", {}).get(error.field) if cfg is not None else None
    if line is not None:
        return error.moved(f"field '{error.field}': {error.message}", file=cfg.path, line=line)
    return error


class OptConfig:
    """The user's per-layer JSON (`opt_config`): layer name -> {setting: value}, validated on load."""

    def __init__(self, path: str, layers: Dict[str, Dict[str, Any]]) -> None:
        self.path = path
        self.layers = layers

    @classmethod
    def from_mapping(cls, source: str, data: Any, layer_names: Iterable[str], what: str = "opt_config") -> OptConfig:
        """The per-layer settings of `data` (layer name -> {key: value}), checked as a loaded JSON file is;
        errors name `source` (a file, or a QConfig plugin's file) and call the settings `what`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{what} must be a JSON object keyed by layer name", file=source)
        known = set(layer_names)
        layers: Dict[str, Dict[str, Any]] = {}
        for name, entry in data.items():
            if name not in known:
                raise ConfigError(f"{what} names layer '{name}' that the model does not have", file=source)
            if not isinstance(entry, dict):
                raise ConfigError(f"{what} layer '{name}': expected an object of settings", file=source)
            parsed: Dict[str, Any] = {}
            for key, value in entry.items():
                if key in READ_ONLY_KEYS:
                    continue
                if key not in SETTING_FIELDS:
                    raise ConfigError(f"{what} layer '{name}': unknown key '{key}' (editable keys: "
                                      f"{', '.join(SETTING_FIELDS)})", file=source)
                parsed[key] = _parse_json_value(source, name, key, value, what)
            layers[name] = parsed
        return cls(source, layers)

    @classmethod
    def load(cls, path: str, layer_names: Iterable[str]) -> OptConfig:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ConfigError("opt_config file not found", file=path) from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"opt_config is not valid JSON: {e.msg}", file=path, line=e.lineno) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"opt_config is not UTF-8 text (undecodable byte at offset {e.start})", file=path) \
                from None
        except RecursionError:
            raise ConfigError("opt_config is not valid JSON: arrays or objects nested too deeply", file=path) \
                from None
        return cls.from_mapping(path, data, layer_names)

    def apply(self, settings: LayerSettings, node: Any) -> LayerSettings:
        overrides = self.layers.get(node.name)
        if not overrides:
            return settings
        origin = dict(settings.origin)
        origin.update((key, self.path) for key in overrides)
        result = dataclasses.replace(settings, **overrides, explicit=settings.explicit | frozenset(overrides),
                                     origin=tuple(sorted(origin.items())))
        check_settings(result, node)
        return result


READ_ONLY_KEYS = ("layer_id", "layer_type", "just_for_display")


def _parse_json_value(path: str, layer: str, key: str, value: Any, what: str = "opt_config") -> Any:
    f = FIELDS[SETTING_FIELDS[key]]
    if value is None:
        if f.default is None:
            return None
        raise ConfigError(f"{what} layer '{layer}': '{key}' cannot be null; expected {f.allowed()}", file=path)
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    try:
        return f.kind.parse(text)
    except ValueError as e:
        raise ConfigError(f"{what} layer '{layer}': invalid value {value!r} for '{key}' ({e}); expected "
                          f"{f.allowed()}", file=path) from None
