"""The single declarative table of cfg fields: name, default, accepted values, description, per-layer support.

Features add their fields here; `quantopt --field` prints this table, the reader validates against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from .kinds import (
    MAX_BATCH,
    BoolKind,
    ChoiceKind,
    DeviceKind,
    FloatKind,
    GlobalCalibrationKind,
    InputShapesKind,
    InputValuesKind,
    IntKind,
    IntListKind,
    KeywordArgsKind,
    MetricListKind,
    NameKind,
    OptionalIntKind,
    PathKind,
    PluginNameKind,
    QuantTypeKind,
    StrategyKind,
    TargetKind,
    TrimKind,
    UnifyScalesKind,
    ValueKind,
)
from .kinds_accuracy import AutoSearch, AutoSearchKind, LayerRangesKind, OpTypeListKind, TriggerFloatKind
from .kinds_compat import CompatOpsKind, FixedBoolKind, HonouredChoiceKind, LeftShiftBitsKind
from .kinds_compiler import DsShapeConstantKind, TilingParamKind
from .kinds_fp8 import ACTIVATION_BLOCK_SIZE_DEFAULT, ActivationBlockSizeKind
from .kinds_passes import TuneOpKind, TuneOpValue
from .presets import PRESET_NAMES
from .targets import DEFAULT_TARGET
from .upstream_defects import UpstreamDefectsKind


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
field("graph", "", PathKind(), "float IR graph file (.txt) or ONNX model (.onnx, imported on the fly); relative "
      "paths are resolved from the cfg's folder",
      group="model")
field("bin", "", PathKind(), "float IR weights file (.bin); default: the graph's model_bin or <graph>.bin",
      group="model")
field("input_shape", "", InputShapesKind(), "fixed input shapes for an ONNX graph with dynamic dims, e.g. "
      "x:1,3,224,224 (inputs separated by ';')", group="model")
field("input_value", "", InputValuesKind(), "inputs of an ONNX graph fixed to constants, e.g. sr:16000 (inputs "
      "separated by ';', values by ','); what depends on them folds away, like an If on a sample rate",
      group="model")
field("model_name", "", NameKind(), "model name used in output file names; default: the IR's model_name",
      group="model")
field("output_dir", "./opt_log", PathKind(must_exist=False, directory=True),
      "folder for outputs and the run log (created if missing)", group="model")
field("out_ir_name", "", NameKind(), "base name of the written IR; default: <model_name>_o", group="model")
field("quant_ir_name", "", NameKind(), "the older spelling of out_ir_name, kept for upstream cfgs: when set it wins "
      "over out_ir_name", group="model")
field("skip_optimization", False, BoolKind(), "check the float model (operators, data, zero-input forward) and "
      "evaluate its metric, but collect no statistics, quantize nothing and write no IR (the report holds the float "
      "metric only)", group="model")
field("allow_unknown_ir_keys", False, BoolKind(), "accept IR layer keys that the layer's operator type does not "
      "know (an IR of a newer Parser): each is warned about once and left unused; by default such a key is an IR "
      "error naming it (docs/ir-format.md)", group="model")
field("export_onnx_qdq", False, BoolKind(), "also write <model_name>_o.qdq.onnx next to the quantized IR (ONNX "
      "with QuantizeLinear/DequantizeLinear pairs; needs the onnx package, docs/onnx-export.md)", group="model")

# --- data and metrics -------------------------------------------------------------------------------------------
field("dataset", "", PluginNameKind(), "dataset plugin that reads data/label and calibration_data files",
      group="data")
field("dataset_args", {}, KeywordArgsKind(), "keyword arguments of the dataset plugin, e.g. "
      "resize=224x224; mean=0.485,0.456,0.406 (strings; docs/datasets.md lists each plugin's)", group="data")
field("data", "", PathKind(), "validation data file, read by the dataset plugin", group="data")
field("label", "", PathKind(), "validation label file, read by the dataset plugin", group="data")
field("metric", "", MetricListKind(), "metric plugins evaluated on the validation data, e.g. TopKMetric,TopKMetric(5)",
      group="data")
field("metric_batch_size", 1, IntKind(minimum=1, maximum=MAX_BATCH),
      "batch size for metric evaluation (left unset: the IR's batch where a layer needs whole IR batches)",
      group="data")
field("calibration_data", "", PathKind(), "calibration data file, read by the dataset plugin", group="data")
field("calibration_shuffe", False, BoolKind(),
      "calibrate on the calibration samples in a fixed pseudo-random order (seed 0: every pass and every run see "
      "the same order) instead of the file's; matters for the strategies that depend on sample order (mean, Nstd, "
      "aciq, weighted_scale_param). Upstream's spelling (sic)", group="data")
field("calibration_batch_size", 1, IntKind(minimum=1, maximum=MAX_BATCH),
      "batch size for calibration (left unset: the IR's batch where a layer needs whole IR batches)", group="data")
field("dataloader_workers", 0, IntKind(minimum=0, maximum=64), "worker processes of the data loaders (0 = main)",
      group="data")
field("modify_batch_dim", None, OptionalIntKind(1, MAX_BATCH, off_words=("false",)),
      "write the IR for this batch size instead of the float IR's: before any model work, dim 0 of every layer "
      "output is scaled to it (Reshape shapes and whole-batch slices follow; a layer whose params still hold the old "
      "batch is reported by the zero-input check); empty or false: off", group="data")
field("export_parallel_batch", None, OptionalIntKind(1, 64, off_words=("false",)),
      "the written quantized IR holds this many copies of the model, fed by one input N times as large along dim 0 "
      "(a Split per input, a Concat per output): N batches in one run; the in-memory model, the ONNX export and "
      "the report keep one copy; empty or false: off", group="data")
field("data_batch_dim", 0, IntKind(0, 8),
      "the axis of the model inputs that counts the samples: a batch stacks the data file's samples (its first axis) "
      "along this axis, e.g. 1 for a time-major [T, N, F] input; batches then hold the IR's size on that axis "
      "(usually 1 sample)", group="data")
field("label_batch_dim", 0, IntKind(0, 8),
      "the axis along which a batch's labels are stacked (a tensor label per sample)", group="data")
field("without_batch_dim", False, BoolKind(),
      "the model inputs have no batch dimension (batch sizes become 1 and the loader's batch dim is removed)",
      group="data")
field("eval_original_model", True, BoolKind(), "evaluate the metric on the float model", group="data")

# --- quantization (per-layer fields accept `global & <selector:value> ...`) ---------------------------------------
WEIGHT_MODES = ("per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range", "per_tensor_asymmetric",
                "per_channel_symmetric_restricted_range", "per_channel_symmetric_full_range", "per_channel_asymmetric",
                "per_block_symmetric_restricted_range", "per_block_symmetric_full_range", "per_block_asymmetric")
ACTIVATION_MODES = ("per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range",
                    "per_tensor_asymmetric", "per_channel_symmetric_restricted_range",
                    "per_channel_symmetric_full_range")

field("min_compatible_zhouyi_target", DEFAULT_TARGET, TargetKind(),
      "the oldest NPU generation the quantized model must run on (Z1, Z2, Z3, X1, X2; X3, X3P, X3S are refused: "
      "their integer forms are not simulated); it sets the defaults of fields the cfg leaves unset: "
      "bias_effective_bits 16 (Z1-X1) or 32 (X2), and for X2 RMSNorm in float16 (trigger_float_op); "
      "docs/user-guide.md", group="quantization")
field("preset", "none", ChoiceKind(PRESET_NAMES),
      "a recipe that sets the defaults of the fields this cfg does not set itself: none (upstream's defaults) or "
      "accurate (the recommended int8 recipe: per-channel weights, a shift per channel, activation ranges holding "
      "99.99% of the calibration values; measured in docs/accuracy.md)", group="quantization")
field("qconfig", "", PluginNameKind("qconfig"),
      "a QConfig plugin (an OptBaseQConfig class) whose configure(graph) returns per-layer settings, applied after "
      "the cfg's rules and the opt_config JSON (docs/plugins.md, \"QConfig plugins\")", group="quantization")
field("quantize_method_for_weight", "per_tensor_symmetric_restricted_range", ChoiceKind(WEIGHT_MODES),
      "how weights are quantized (scale/zero point granularity and symmetry)", per_layer=True, group="quantization")
field("quantize_method_for_activation", "per_tensor_symmetric_full_range", ChoiceKind(ACTIVATION_MODES),
      "how activations are quantized; 16-bit activations are always symmetric; per_channel_symmetric_* give "
      "Convolution/DepthwiseConv/FullyConnected/BatchNorm/Eltwise/table-activation outputs one scale per channel "
      "(read by the same layers, pooling and channel-axis Concat)", per_layer=True,
      group="quantization")
field("quant_type", "disable", QuantTypeKind(),
      "a named precision recipe of upstream that overrides the layer's bits, lut size and trigger_float_op: w8a8, "
      "w16a16, weight-only w4/w8/w4afp16/w8afp16/w4abfp16/w8abfp16/wfp4/wfp4afp16/wfp4abfp16/wfp4afp32 (float "
      "activations, int4/int8/fp4 weights), fp16/bf16/bfp16 (the layer in float), fp8 activations "
      "w4afp8e5m2/w4afp8e4m3/wfp4afp8e5m2/wfp4afp8e4m3/wfp8afp8/wfp8e5m2afp8e5m2/wfp8e4m3afp8e4m3 (the layer types "
      "upstream has fp8 kernels for; docs/low-bit.md); docs/mixed-precision.md", per_layer=True, group="quantization")
field("weight_block_size", 256, IntKind(1, 1 << 20),
      "weights per block with a per-block weight mode (quantize_method_for_weight = per_block_*), used by "
      "weight-only layers (trigger_float_op *_act_*_wht, quant_type w4afp16...): each run of this many weights "
      "along a row gets its own scale", per_layer=True, group="quantization")
field("weight_bits", 8, IntKind(4, 16), "bits of quantized weights (BatchNorm: at least 16 unless set for the layer "
      "by a per-layer rule or opt_config)", per_layer=True, group="quantization")
field("activation_bits", 8, IntKind(8, 16), "bits of quantized activations", per_layer=True, group="quantization")
field("bias_bits", 32, IntKind(16, 48), "bits of quantized biases (48 is stored as int64)", per_layer=True,
      group="quantization")
field("bias_effective_bits", None, OptionalIntKind(16, 48),
      "only the top N bits of quantized biases may be non-zero (default: bias_bits)", per_layer=True,
      group="quantization")
field("bias_effective_bits_auto_adaption", False, BoolKind(),
      "with bias_effective_bits below bias_bits: clamp the layer's biases to the width (19 bits up to bias_bits) "
      "whose compressed biases are nearest the exact ones, so a few large biases saturate instead of every bias "
      "losing low bits", per_layer=True, group="quantization")
field("lut_items_in_bits", 8, IntKind(8, 16), "lookup tables hold at most 2^N entries (10+ advised for 16 bits)",
      per_layer=True, group="quantization")
field("multiplier_bits", None, OptionalIntKind(2, 15),
      "bits of requantization multipliers (default: the layer's activation bits, at most 15)", per_layer=True,
      group="quantization")
field("unify_shifts_for_aiff", True, BoolKind(),
      "per-channel requantization shares one shift (hardware MAC engine requirement)", per_layer=True,
      group="quantization")
field("force_dtype_int", False, BoolKind(), "outputs are always signed integers", per_layer=True,
      group="quantization")
field("layernorm_integer_form", "upstream", ChoiceKind(("upstream", "exact")),
      "the integer form of LayerNorm, GroupNorm and InstanceNorm: upstream (the upstream optimizer's: rounded mean, "
      "inverse square root table, normalized tensor at the activation bits) or exact (8 fraction bits on the mean, "
      "integer square root, 16-bit normalized tensor; more accurate); docs/semantics/normalization.md",
      per_layer=True, group="quantization")
field("div_integer_form", "upstream", ChoiceKind(("upstream", "exact")),
      "the integer form of Div of two tensors: upstream (the upstream optimizer's: a uint16 table of 65535 / |divisor| "
      "over the divisor's codes and one multiplier/shift of the activation bits) or exact (a reciprocal table "
      "normalized to the divisor's leading bits with 15 more fraction bits; more accurate); docs/semantics/binary.md",
      per_layer=True, group="quantization")
field("reduce_l2_integer_form", "upstream", ChoiceKind(("upstream", "exact")),
      "the integer form of Reduce L2 (an L2 norm, as F.normalize exports): upstream (the upstream optimizer's: the "
      "sum of squares cut to its 16 high bits, requantized to a 16-bit placeholder and looked up in a square-root "
      "table) or exact (an exact integer square root with up to 15 fraction bits; more accurate); "
      "docs/semantics/reduce.md", per_layer=True, group="quantization")
field("lut_output_range", "calibrated", ChoiceKind(("calibrated", "table")),
      "the output range of the table ops that can give infinite values (Exp, Log, Reciprocal, Rsqrt, ...): calibrated "
      "(the calibrated range, as upstream; only infinite ends are cut to the table's values) or table (cut to the "
      "values the table can give: a finer scale, nothing lost); docs/semantics/unary.md", per_layer=True,
      group="quantization")
field("logsoftmax_integer_form", "upstream", ChoiceKind(("upstream", "exact")),
      "LogSoftmax's integer form: upstream (the upstream optimizer's: output range fixed to [-16, 0], a float32 exp "
      "table, float32 sum and log) or exact (calibrated output range, base-2 exponent, power-of-two sum, table log2, "
      "integer arithmetic only); docs/semantics/softmax.md", per_layer=True, group="quantization")
field("lstm_integer_form", "upstream", ChoiceKind(("upstream", "q15")),
      "BasicLSTM's integer form: upstream (the upstream optimizer's: 256-entry tables and per-step requantization from "
      "the calibrated ranges of the cell's inner tensors) or q15 (fixed-range Q15 tables, int32 cell state; more "
      "accurate at 16 bits with per-channel weights); docs/semantics/recurrent.md", per_layer=True,
      group="quantization")
field("gru_integer_form", "upstream", ChoiceKind(("upstream", "q15")),
      "GRUv1/GRUv3's integer form: upstream (the upstream optimizer's: four weight blocks, 256-entry tables and "
      "requantization from the calibrated ranges of the cell's inner tensors) or q15 (fixed-range Q15 tables, "
      "fixed-point hidden state; more accurate); docs/semantics/recurrent.md", per_layer=True, group="quantization")
field("force_shift_positive", False, BoolKind(),
      "negative requantization shifts become 0 (the multiplier saturates: accuracy loss)", per_layer=True,
      group="quantization")
field("remain_shift", None, OptionalIntKind(0, 32),
      "MAC ops with >8-bit inputs or weights: pre-shift the 48-bit accumulator into int32, keeping this many bits "
      "of shift for the last stage (empty: off)", per_layer=True, group="quantization")
field("set_qinvariant_for_start_nodes", [], IntListKind(),
      "layer ids of Input/Constant layers whose values are used as integers (scale 1, zero point 0)",
      group="quantization")
field("device", "cpu", DeviceKind(),
      "where the float and integer forwards run: cpu, cuda, cuda:N, or auto (CUDA when torch sees a device, else "
      "the CPU); the integer forward gives the same integers on every device, while calibration on CUDA follows the "
      "GPU's float sums (ranges may move by float32 ulps), so cpu, which reproduces upstream's CPU goldens, is the "
      "default (docs/performance.md, \"CUDA\")",
      group="model")
field("fc_float_summation", "upstream", ChoiceKind(("upstream", "float64")),
      "how the float forward sums FullyConnected layers: upstream, in float32 in the upstream optimizer's fixed "
      "order (calibrated ranges identical to its; 20-30x slower than a BLAS kernel), for samples of one row and "
      "samples of several rows up to 2^20 multiply-adds, larger ones with torch's float32 GEMM one sample at a time "
      "on one thread (upstream's own call, following the machine's BLAS); or float64 everywhere, exactly rounded "
      "(fast, the same on every machine, ranges may differ from upstream's by an ulp)",
      group="quantization")
field("float_reference", "exact", ChoiceKind(("exact", "native")),
      "how the float forward computes Convolution, DepthwiseConv and FullyConnected layers: exact, upstream's float "
      "reference (convolutions summed in float64 and rounded once, FullyConnected as fc_float_summation says: "
      "calibrated ranges identical to upstream's, at 2-5x onnxruntime's float32 time on convolutional models); or "
      "native, torch's float32 kernels in the input's float type (oneDNN convolutions, the BLAS GEMM: about "
      "onnxruntime's speed), summed in the kernel library's order, so ranges may move by float32 ulps from "
      "upstream's and from machine to machine (docs/performance.md, \"Native float reference\")",
      group="quantization")
field("unify_scales_for_concat_threshold", 1.05, FloatKind(minimum=1.0),
      "Concat inputs whose scales differ by at most this ratio (and share the zero point) are not requantized; "
      "also the threshold of unify_scales_for_concat", group="quantization")
field("unify_scales_for_concat", False, BoolKind(),
      "before quantization, rewrite the calibrated ranges of the nearest scale-deciding layers above each Concat so "
      "all branches share the Concat's output scale and need no requantization (docs/user-guide.md)",
      group="quantization")
field("unify_scales_for_concat_max_depth", 20, IntKind(minimum=1),
      "how many layers unify_scales_for_concat walks upstream from a Concat input", group="quantization")
field("unify_scales_for_multi_inputs_operators", "", UnifyScalesKind(),
      "[(OpType, depth, threshold, method), ...]: like unify_scales_for_concat for the listed operator types; depth "
      "0 = no limit; branch scales within threshold (max/min) are left alone; method max|min|avg picks the common "
      "scale from the branches, out uses the layer's output scale, skip leaves the layer alone",
      per_layer=True, group="quantization")

# --- calibration ------------------------------------------------------------------------------------------------
field("calibration_strategy_for_weight", "extrema", StrategyKind(), "local calibration strategy of weights",
      per_layer=True, group="calibration")
field("calibration_strategy_for_activation", "mean", StrategyKind(),
      "local calibration strategy of activations", per_layer=True, group="calibration")
field("running_statistic_momentum", 0.9, FloatKind(0.0, 1.0),
      "momentum of the running (EMA) statistics over calibration batches", per_layer=True, group="calibration")
field("min_activation_sqnr_db", 0.0, FloatKind(0.0, 100.0),
      "a layer whose outputs no range at its activation bits quantizes with an expected signal-to-quantization-"
      "noise ratio of this many dB (from the histogram; tensors a few channels dominate) gets 16-bit activations "
      "with the least-error (mse) range; 0 = off; docs/user-guide.md", per_layer=True,
      group="calibration")
field("global_calibration", "none", GlobalCalibrationKind(),
      "global calibration methods run after local calibration, in order: none, or methods joined by '&', each "
      "name[p1,p2,...] with an optional scope [OpType,...], [(i,j),...] or {regex} (e.g. bias_correction[4] & "
      "adaround[4,3,8]); see docs/global-calibration.md", group="calibration")
field("save_statistic_info", False, BoolKind(),
      "save the calibration statistics to <output_dir>/<model_name>_statistic_info.npz (npz + JSON header, no "
      "pickle; docs/statistics-and-dump.md) for reuse with statistic_file", group="calibration")
field("statistic_file", "", PathKind(),
      "statistic file written by save_statistic_info: its statistics replace the statistics pass; refused if made "
      "for a different graph or other weights", group="calibration")
field("dump", False, BoolKind(),
      "write the float and quantized values of every layer output and constant for one batch to dump_dir, with an "
      "index.json (docs/statistics-and-dump.md)", group="analysis")
field("dump_dir", "./opt_dump", PathKind(must_exist=False, directory=True),
      "folder for the dump files (created if missing)", group="analysis")
field("histc_bins", 2048, IntKind(16, 1 << 20), "histogram bins (kld strategy)", per_layer=True,
      group="calibration")
field("trim_infinity_before_statistic", "", TrimKind(),
      "clip(lo, hi) clamps values, second(lo, hi) replaces values beyond the bounds by the second min/max, before "
      "statistics", per_layer=True, group="calibration")
field("enable_pass_detect_inf_mask_nodes", False, BoolKind(),
      "also take Constant values <= -32767 (masks written as -1e9, -65504, -32768) as attention-mask values: they "
      "become -FLT_MAX before statistics; a BatchNorm made of a (1 - keep) * -1e9 mask gets weights 32767 and biases "
      "-32767, as upstream's pass writes it. Masks of ±inf or |x| >= 1e30 are always handled, without this field: left "
      "out of statistics, saturated to the integer minimum, probability 0 after Softmax "
      "(docs/statistics-and-dump.md, \"Masks with infinite values\")", group="calibration")
field("detect_finite_masks", False, BoolKind(),
      "take attention masks of finite values as masks: a Constant of 0 and values <= -64 (Swin's -100), Where(keep, "
      "0, fill), (1 - keep) * fill or its BatchNorm fold, added to scores that reach a Softmax; their mask values "
      "are left out of statistics, saturate to the integer minimum and get probability 0, as ±inf masks do, while "
      "the float graph keeps its values. Off (upstream's way: the values are data and set the scores' range; "
      "preset = accurate turns it on); the accuracy advice names the masks it finds (docs/statistics-and-dump.md, "
      "\"Masks with finite values\")", group="calibration")
field("upstream_defects", frozenset(), UpstreamDefectsKind(),
      "upstream behaviours quantopt does not copy because they are wrong, reproduced for IRs identical to the "
      "upstream optimizer's: mask_as_data (attention masks quantized as data: masked attention ignores its "
      "scores), where_integer_passthrough, count_input_zp, region_input_zp, convinteger_producer_zp, "
      "eltwise_equal_scale_passthrough, or all "
      "(docs/golden-differences.md, \"Reproducing upstream's defects\")", group="quantization")
field("enable_pass_merge_matmul_mul", True, BoolKind(),
      "rewrite each Mul by a non-integer scalar Constant as a BatchNorm over the last axis, then "
      "fold a positive constant factor multiplying a MatMul's only consumer (the attention scores' 1/sqrt(d), "
      "possibly behind Reshape/Transpose-like layers) into the MatMul before statistics, as upstream does by default: "
      "its output is calibrated after the factor, the Mul stays as an identity Crop and its Constant goes "
      "(docs/user-guide.md, \"Graph passes\"); false keeps MatMul, Constant and Mul as written", group="quantization")
field("enable_pass_tune_op_softmax", TuneOpValue(((0.0,), (0.0,))), TuneOpKind(),
      "[quant_method, p][approx_method]: a Softmax's integer method: 0 automatic (LUT for a graph output or a "
      "Softmax feeding NMS/Sort/ArgMinMax/TopK/InTopK, else FAST_EXP), [1, adjust_q] FAST_EXP with adjust_q 0, 1 "
      "(default) or 8..15, [2, 20] LUT (20-bit table values; other widths refused); approx_method 0, or 1 (changes "
      "float Softmax layers on X3 targets only: no effect here); docs/user-guide.md, \"Graph passes\"",
      per_layer=True, group="quantization")
field("enable_pass_tune_op_complicated_activations", TuneOpValue(((0.0,), (0.0,))), TuneOpKind(),
      "[quant_method][approx_method, use_dynamic_lut] for Sigmoid, Tanh, GELU, Silu, Swish, ELU, Exp, ... (BasicLSTM: "
      "one pair per gate): quant_method 0 (the one integer form); approx_method 0, or 1 (changes float activations "
      "on X3 targets only: no effect here); other numbers refused", per_layer=True, group="quantization")
field("enable_pass_decompose_nonmonotonic_activations", False, BoolKind(),
      "before statistics, an Activation SILU, SWISH (alpha 1) or HARDSWISH with at least 2^21 output elements "
      "becomes x * sigmoid(x) resp. x * hardsigmoid(x) (an Activation and a Mul: a monotonic gate quantizes with a "
      "small table); GELU, MISH and other SWISH gates are refused (upstream's gate is an arbitrary-function table "
      "quantopt lacks)", per_layer=True, group="quantization")
field("enable_pass_split_qkv_fc_in_transformer", False, BoolKind(),
      "before statistics, a FullyConnected read only by a Split of its feature axis (a fused query/key/value "
      "projection) becomes one FullyConnected per part, each calibrated and quantized on its own; the float "
      "outputs do not change", group="quantization")
field("enable_pass_deeply_set_unquantifiable", True, BoolKind(),
      "shape-only layers (Reshape, Transpose, Slice, Split, Pad, ...) reading a float layer of trigger_float_op run "
      "in float too, chains included, so no Quantize/DeQuantize pair sits between them (default true: upstream runs it "
      "even when its cfg says false)", group="quantization")
field("enable_pass_scaled_dot_product_attention", False, BoolKind(),
      "before statistics, each attention chain MatMul(Q, K) -> constant scale (Mul or scaling BatchNorm) -> "
      "[Add mask] -> Softmax -> MatMul(V) becomes one SDPAttention layer (trans_q/trans_k/trans_v from the MatMuls' "
      "trans_a/trans_b), and it and the layers producing Q, K and V get symmetric restricted-range activations, as "
      "upstream; chains without such a scale are left alone; the float outputs change only by float rounding",
      group="quantization")
field("enable_pass_convert_resize_to_convolution", False, BoolKind(),
      "upstream rewrites bilinear Resize layers as convolutions only in its compat_quantized_model flow (whatever "
      "this field says) and ignores the field otherwise; quantopt's compat flow (docs/compat-quantized.md) keeps "
      "Resize layers as they are, so true is an error",
      group="quantization")
field("calibrate_with_zero_inputs", False, BoolKind(),
      "allow calibration without calibration_data by feeding all-zero inputs (activation ranges will be "
      "meaningless; only for smoke tests)", group="calibration")

# --- outputs and analysis ---------------------------------------------------------------------------------------
field("opt_config", "", PathKind(),
      "per-layer JSON (the edited <model>_opt_template.json); its values override the cfg for the layers it names",
      group="model")
field("eval_optimized_model", True, BoolKind(), "evaluate the metric on the quantized model", group="data")
field("write_similarity_to_ir", False, BoolKind(),
      "write each quantized layer's precision-analysis results into the quantized IR as extra layer keys D_cos and "
      "D_mse (cumulative cosine and MSE of each output against the float model), D_dynamic_shape and D_layer_id, for "
      "IR viewers; quantopt and upstream's tools read such an IR back unchanged (docs/ir-format.md)",
      group="analysis")
field("record_debug_acc_info", False, BoolKind(),
      "append one record per run to <output_dir>/<model_name>_record_model_acc.txt: the time, the main quantization "
      "fields and the run's metrics and output similarities (a log across runs, for comparing settings)",
      group="analysis")
field("perf_mode_for_lib", True, BoolKind(),
      "the is_perf_mode key written on each quantized layer: a hint to the NPU library that it may use its fast "
      "hardware paths for the layer; the integer semantics quantopt simulates do not depend on it",
      per_layer=True, group="quantization")
field("resize_degrade_to_nearest", False, BoolKind(),
      "Resize layers are quantized as nearest-neighbour resizes (faster on the NPU, less accurate): the quantized "
      "IR and the integer forward use method nearest, the float model keeps its method", per_layer=True,
      group="quantization")
field("unify_scales_for_kvc_concat", False, BoolKind(),
      "a key/value-cache Concat (a computed tensor joined with graph Inputs fed back from the previous step, or "
      "Constants of zeros) gives its cache inputs and output the computed input's quantization, so the cache "
      "keeps one scale from step to step", per_layer=True, group="quantization")
field("activation_perchannel_min_elements", 1, IntKind(minimum=1),
      "per-channel activations only where each channel of the output holds at least this many elements per "
      "sample; outputs with fewer fall back to per-tensor activations (too few values make unstable channel ranges)",
      group="quantization")
field("ignore_missing_statistic", False, BoolKind(),
      "with statistic_file: accept a file made for a somewhat different graph; tensors it has no statistics for "
      "(or statistics of another shape or other weights) take them from the weights themselves (constants) or from "
      "the nearest producer or reader with statistics (activations), listed in one warning",
      group="calibration")
field("similarity_data_num", 1, IntKind(minimum=1),
      "calibration batches (of calibration_batch_size samples) the per-layer float-vs-quantized similarity and its "
      "histograms use; each costs one forward of the quantized graph plus one run of each quantized layer (the "
      "float graph's outputs of those batches are recorded by the statistics pass, up to 1 GiB)", group="analysis")


# --- accuracy tools (docs/mixed-precision.md) ------------------------------------------------------------------
field("trigger_float_op", "disable", TriggerFloatKind(),
      "layers that run in float inside the quantized model: float16/bfloat16/float32 _preferred (float weights) or "
      "_act_int_wht/_act_fp8e4m3fn_wht/_act_fp4e2m1fn_wht (weight-only quantization); Quantize/DeQuantize layers "
      "are inserted at the borders. The simulated backend has a float kernel for every operator, so a trailing '!' "
      "changes nothing", per_layer=True, group="quantization")
field("mixed_precision_auto_search", AutoSearch(0, 0.0, "L"), AutoSearchKind(),
      "batches,threshold,L|G: measure each layer's sensitivity on that many validation batches and promote the "
      "most sensitive layers to 16 bits (or float when 16 bits cannot reach it) until the first metric's drop "
      "(float - quantized) is <= threshold (L) or >= threshold (G); needs metric and data", group="quantization")
field("mixed_precision_ranking", "probe", ChoiceKind(("probe", "similarity")),
      "how mixed_precision_auto_search orders the layers: probe (quantize and score with each candidate promoted "
      "alone: one evaluation per candidate, then promote greedily and prune), or similarity (the layers' isolated "
      "cosines from one precision analysis on the search batches, then the shortest promoted prefix found by "
      "bisection: a few evaluations, for large models; docs/mixed-precision.md)", group="quantization")
field("fake_quant_scopes_for_debug", [], LayerRangesKind(),
      "[(i,j),...] layer-id ranges whose layers run their float forward on dequantized inputs in the quantized "
      "forward (similarity and metrics only; the written IR is unchanged)", group="analysis")
field("fake_quant_operators_for_debug", [], OpTypeListKind(),
      "operator types whose layers run in float like fake_quant_scopes_for_debug, e.g. [Softmax, LayerNorm]",
      group="analysis")

# --- pre-quantized models (compat_quantized_model, docs/compat-quantized.md) --------------------------------------
field("compat_quantized_model", False, BoolKind(),
      "the model is already quantized: an ONNX QDQ model (graph = .onnx; its Q/DQ scales, zero points and integer "
      "weights are kept, statistics and calibration only run for tensors without them) or a quantized IR (kept "
      "as it is and written again); upstream's flag for TFLite-quantized IRs", group="quantization")
field("compat_quantized_model_strategy", "8bSymWeightUnchange",
      HonouredChoiceKind(("8bSymWeightUnchange", "8bAsymWeightTo16bSymWeight"), ("sym", "asym", "fasymp", "fsym"),
                         "they re-quantize the model in upstream's closed library"),
      "compat_quantized_model: 8bSymWeightUnchange keeps symmetric weights as given (asymmetric ones are an error "
      "unless compat_quantized_model_force_weight_asym); 8bAsymWeightTo16bSymWeight turns 8-bit asymmetric weights "
      "into the exact 16-bit symmetric integers q - zp", group="quantization")
field("compat_quantized_model_eliminate_cast", True, BoolKind(),
      "compat_quantized_model: upstream removes Cast layers of the quantized model; quantopt's QDQ import and "
      "quantized IRs hold none to remove, and a compat graph with a Cast layer is an error whatever the value",
      group="quantization")
field("compat_quantized_model_int8_to_uint8", False, BoolKind(),
      "compat_quantized_model: int8 activations with zero point -128 become uint8 with zero point 0 (the same "
      "values, q + 128)", group="quantization")
field("compat_quantized_model_ops", "", CompatOpsKind(),
      "compat_quantized_model: operator types upstream re-quantizes with another method; quantopt keeps every "
      "layer's given quantization, so only the empty default is accepted", group="quantization")
field("compat_quantized_model_unify_shifts_mode", "auto",
      HonouredChoiceKind(("auto", "none"), ("max", "mean", "entropy"),
                         "quantopt either shares one shift per layer (auto) or keeps one per channel (none)"),
      "compat_quantized_model: auto shares one requantization shift over the channels of a per-channel layer as "
      "unify_shifts_for_aiff says; none keeps one shift per channel", group="quantization")
field("compat_quantized_model_left_shift_bits", 8, LeftShiftBitsKind(),
      "compat_quantized_model: upstream's Eltwise input left shift; quantopt's Eltwise has none, so setting it is "
      "an error", group="quantization")
field("compat_quantized_model_force_weight_asym", False, BoolKind(),
      "compat_quantized_model: keep asymmetric weights asymmetric (weights_zp), whatever the strategy",
      group="quantization")
field("compat_quantized_model_simplify_dequantize_quantize", True,
      FixedBoolKind(True, "quantopt always merges the Q/DQ pairs of a QDQ model into the quantized layers"),
      "compat_quantized_model: Q/DQ pairs merged into the quantized layers (the only form quantopt has)",
      group="quantization")

# --- compiler and library fields (passes/compiler_fields.py; docs/user-guide.md, "Compiler and library fields") --
field("enable_ds", False, BoolKind(),
      "dynamic shapes: Reshape layers write their output shape as the ds_output_shape key of the quantized IR (read "
      "by the NPU compiler for dynamic-shape models); the quantization does not change", per_layer=True,
      group="compiler")
field("ds_output_shape_constant", "disable", DsShapeConstantKind(),
      "dynamic shapes: all (or a 0/1 flag per output, all 1) writes the layer's output shapes as a constant "
      "ds_output_shape key of the quantized IR, e.g. disable & <[Reshape]:[1]>; a list mixing 0 and 1 only makes "
      "the flagged entries of a ds_output_shape the layer already has constant (else a warning, nothing written)",
      per_layer=True, group="compiler")
field("ds_parameter_constant", "disable", ChoiceKind(("disable", "default")),
      "dynamic shapes: default writes a Crop layer's crops as its constant ds_crops key of the quantized IR; other "
      "layers have no ds parameter", per_layer=True, group="compiler")
field("cast_dtypes_for_lib", False, BoolKind(),
      "upstream inserts Cast layers where the NPU library lacks a layer's input/output dtypes; that needs the "
      "library's dtype table, which quantopt does not have: true is an error", per_layer=True, group="compiler")
field("with_winograd", False, BoolKind(),
      "Convolution layers the NPU runs as Winograd F(2,3) (3x3, stride 1, dilation 1, group 1, more than 4 input "
      "channels, inputs larger than 7x7, faster on the V3 targets) get transformed 3x4 weights; quantopt does not "
      "implement that form: true is an error on a graph with such a layer (and changes nothing on one without)",
      per_layer=True, group="compiler")
field("optimize_wdc_for_x2", False, BoolKind(),
      "weight data compression (X2 NPUs): a per-tensor weight constant that would compress to 90% or more of its "
      "size gets its range doubled (up to 4 times, until it compresses below 90%), so its integer values need "
      "fewer bits; may cost accuracy. Per-channel weights do not change", per_layer=True, group="compiler")
field("regularize_activation_perchannel_scales", "disable", ChoiceKind(("disable", "enable")),
      "upstream's switch for merging per-channel activation scales; its optimizer reads it from a place its flow "
      "never sets, so enable changes nothing there, and nothing here (a warning says so)", per_layer=True,
      group="compiler")
field("featuremap_tiling_param", [], TilingParamKind(),
      "feature-map tiling of layer-id ranges for the NPU ([(i,j,h,w),...]); quantopt does not tile graphs: only the "
      "empty default is accepted", group="compiler")
field("featuremap_splits_item_x", 1, IntKind(1, 127),
      "feature-map data-parallel splits along x; quantopt does not tile graphs: values other than 1 are an error",
      group="compiler")
field("featuremap_splits_item_y", 1, IntKind(1, 127),
      "feature-map data-parallel splits along y; quantopt does not tile graphs: values other than 1 are an error",
      group="compiler")
field("featuremap_splits_sram_size", 0, IntKind(0, 8191),
      "SRAM size in KiB that feature-map tiling must fit; quantopt does not tile graphs: values other than 0 are an "
      "error", group="compiler")
field("featuremap_splits_concat_blk", 3, IntKind(1, 127),
      "inputs per sub-Concat when feature-map tiling splits a large Concat; read only by tiling (which the "
      "featuremap_splits_* / featuremap_tiling_param fields refuse), so any valid value changes nothing",
      group="compiler")
field("featuremap_splits_overlap_rate", 50, IntKind(0, 99),
      "largest overlap (percent) between feature-map tiles; read only by tiling (which the featuremap_splits_* / "
      "featuremap_tiling_param fields refuse), so any valid value changes nothing", group="compiler")

# fp8 activations (quant_type w*afp8*, docs/low-bit.md)
field("activation_block_size", ACTIVATION_BLOCK_SIZE_DEFAULT, ActivationBlockSizeKind(),
      "upstream's block size for per-block activations, which upstream reads and never uses (its activations, fp8 "
      "ones included, take one scale per tensor): only the default 256 is accepted; others are an error",
      per_layer=True, group="quantization")

# Fields of the upstream Compass Optimizer that quantopt does not implement yet: a cfg using one gets a clear
# "not implemented yet" error instead of "unknown key" (and never a silent no-op).
UPSTREAM_FIELDS = frozenset("""
""".split())
