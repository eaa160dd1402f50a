"""The single declarative table of cfg fields: name, default, accepted values, description, per-layer support.

Features add their fields here; `quantopt --field` prints this table, the reader validates against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from .kinds import BoolKind, IntKind, MetricListKind, NameKind, PathKind, PluginNameKind, ValueKind


@dataclass(frozen=True)
class Field:
    name: str
    default: Any
    kind: ValueKind
    description: str
    per_layer: bool = False
    group: str = "general"
    is_path: bool = False

    def allowed(self) -> str:
        return self.kind.allowed()


FIELDS: Dict[str, Field] = {}


def field(name: str, default: Any, kind: ValueKind, description: str, per_layer: bool = False,
          group: str = "general") -> Field:
    """Register one field (names are lower case; the reader matches keys case-insensitively)."""
    if name in FIELDS:
        raise ValueError(f"cfg field '{name}' registered twice")
    f = Field(name, default, kind, description, per_layer, group, isinstance(kind, PathKind))
    FIELDS[name] = f
    return f


def all_fields() -> List[Field]:
    return list(FIELDS.values())


# --- model and output -------------------------------------------------------------------------------------------
field("graph", "", PathKind(), "float IR graph file (.txt); relative paths are resolved from the cfg's folder",
      group="model")
field("bin", "", PathKind(), "float IR weights file (.bin); default: the graph's model_bin or <graph>.bin",
      group="model")
field("model_name", "", NameKind(), "model name used in output file names; default: the IR's model_name",
      group="model")
field("output_dir", "./opt_log", PathKind(must_exist=False, directory=True),
      "folder for outputs and the run log (created if missing)", group="model")
field("out_ir_name", "", NameKind(), "base name of the written IR; default: <model_name>_o", group="model")

# --- data and metrics -------------------------------------------------------------------------------------------
field("dataset", "", PluginNameKind(), "dataset plugin that reads data/label and calibration_data files",
      group="data")
field("data", "", PathKind(), "validation data file, read by the dataset plugin", group="data")
field("label", "", PathKind(), "validation label file, read by the dataset plugin", group="data")
field("metric", "", MetricListKind(), "metric plugins evaluated on the validation data, e.g. TopKMetric,TopKMetric(5)",
      group="data")
field("metric_batch_size", 1, IntKind(minimum=1), "batch size for metric evaluation", group="data")
field("calibration_data", "", PathKind(), "calibration data file, read by the dataset plugin", group="data")
field("calibration_batch_size", 1, IntKind(minimum=1), "batch size for calibration", group="data")
field("dataloader_workers", 0, IntKind(minimum=0, maximum=64), "worker processes of the data loaders (0 = main)",
      group="data")
field("without_batch_dim", False, BoolKind(),
      "the model inputs have no batch dimension (batch sizes become 1 and the loader's batch dim is removed)",
      group="data")
field("eval_original_model", True, BoolKind(), "evaluate the metric on the float model", group="data")


# Fields of the upstream Compass Optimizer that quantopt does not implement yet: a cfg using one gets a clear
# "not implemented yet" error instead of "unknown key" (and never a silent no-op).
UPSTREAM_FIELDS = frozenset("""
qconfig eval_optimized_model skip_optimization data_batch_dim label_batch_dim dump dump_dir opt_config statistic_file
calibration_strategy_for_weight calibration_strategy_for_activation global_calibration calibration_shuffe
quantize_method_for_weight quantize_method_for_activation weight_block_size weight_bits activation_bits quant_type
lut_items_in_bits bias_bits bias_effective_bits bias_effective_bits_auto_adaption unify_shifts_for_aiff
cast_dtypes_for_lib perf_mode_for_lib min_compatible_zhouyi_target force_dtype_int force_shift_positive
running_statistic_momentum histc_bins set_qinvariant_for_start_nodes fake_quant_scopes_for_debug
fake_quant_operators_for_debug resize_degrade_to_nearest unify_scales_for_kvc_concat unify_scales_for_concat
unify_scales_for_concat_threshold unify_scales_for_concat_max_depth unify_scales_for_multi_inputs_operators
with_winograd mixed_precision_auto_search trigger_float_op save_statistic_info trim_infinity_before_statistic
remain_shift compat_quantized_model_simplify_dequantize_quantize enable_pass_merge_matmul_mul
enable_pass_convert_resize_to_convolution enable_pass_decompose_nonmonotonic_activations
enable_pass_tune_op_complicated_activations enable_pass_tune_op_softmax enable_pass_deeply_set_unquantifiable
enable_pass_split_qkv_fc_in_transformer enable_pass_detect_inf_mask_nodes optimize_wdc_for_x2
ignore_missing_statistic modify_batch_dim export_parallel_batch ds_output_shape_constant enable_ds quant_ir_name
activation_block_size featuremap_tiling_param featuremap_splits_item_x featuremap_splits_item_y
featuremap_splits_concat_blk featuremap_splits_overlap_rate featuremap_splits_sram_size similarity_data_num
write_similarity_to_ir record_debug_acc_info compat_quantized_model compat_quantized_model_strategy
compat_quantized_model_eliminate_cast compat_quantized_model_int8_to_uint8 compat_quantized_model_ops
compat_quantized_model_unify_shifts_mode compat_quantized_model_left_shift_bits
compat_quantized_model_force_weight_asym multiplier_bits activation_perchannel_min_elements
regularize_activation_perchannel_scales enable_pass_scaled_dot_product_attention ds_parameter_constant
""".split())
