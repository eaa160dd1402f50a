"""The layer keys each built-in operator type reads or writes, as data: the IR reader refuses any other key.

Why: a misspelt or foreign key (`with_activaton`, `stride_x` on a layer that reads `stride`, `pad_left` on a layer
without pads) used to be kept as an unused parameter, so a fused ReLU or a stride silently disappeared. Each type's
set is what its forward and quantize functions read or write (quantopt/ops/*.py: `get_param`, `params.get`,
`get_constant`, and the helpers they call), what the Compass Parser and Optimizer write for it (the shared models'
float and quantized IRs, upstream's operator sources) and what the ONNX importer emits. tests/test_ir_known_keys.py
fails when an op reads a parameter that is missing here.

Keys every layer may carry (`COMMON_KEYS`, the upstream debug prefix `D_`, and the quantization keys `X_scale`,
`X_zp`, `X_range` of any known key or constant `X`) are always accepted. Types without an entry (plugin types that
declare nothing, types quantopt does not implement) are not checked. Plugins declare their keys with
`quantopt.registry.register_op_keys`. This module imports nothing heavy (no torch): it is data plus lookups.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Dict, FrozenSet, Iterable, Optional, Set, Tuple

from .schema import ParamSchema

STRUCTURAL_KEYS = ("layer_id", "layer_name", "layer_type", "layer_bottom", "layer_bottom_shape", "layer_bottom_type",
                   "layer_top", "layer_top_shape", "layer_top_type")
TOP_INFO_KEYS = ("layer_top_range", "layer_top_scale", "layer_top_zp")
COMMON_KEYS: FrozenSet[str] = frozenset(STRUCTURAL_KEYS + TOP_INFO_KEYS + (
    # written on every layer of a quantized IR (quantopt's and upstream's)
    "is_perf_mode", "unquantifiable", "activation_quantization_axis",
    # per-tensor requantization of any quantized layer (a multiplier and a shift, or one per input)
    "scale_value", "shift_value", "scale_type", "shift_type",
))
COMMON_PREFIXES = ("D_",)
"""Upstream's debug keys (`write_similarity_to_ir`: D_cos, D_mse, D_layer_id...)."""
DERIVED_SUFFIXES = ("_scale", "_zp", "_range")
"""`weights_scale`, `biases_zp`, `weights_range`...: quantization info of a known key or constant."""

INT_LIMIT = 2 ** 31
"""Bound of integer geometry values: larger ones cannot be real (and overflow torch's int32 arguments)."""
SIZE_KEYS: FrozenSet[str] = frozenset(
    [f"{k}_{a}" for k in ("kernel", "stride", "dilation", "output_padding") for a in "xyz"]
    + ["pad_left", "pad_right", "pad_top", "pad_bottom"]
    + [f"pad_{a}_{e}" for a in "xyz" for e in ("begin", "end")]
    + ["group", "num_output", "multiplier", "block_size", "block_size_x", "block_size_y"])
"""Keys of built-in types whose value must be an integer in [0, INT_LIMIT)."""
INT_LIST_KEYS: FrozenSet[str] = frozenset(("shape", "perm"))
"""Keys of built-in types whose value must be a list of integers in (-INT_LIMIT, INT_LIMIT)."""
AXIS_KEYS: FrozenSet[str] = frozenset(("axis",))
"""Keys of built-in types whose value is None, an integer or a list of integers in (-INT_LIMIT, INT_LIMIT)."""

# (operator types, keys), both space-separated; a type listed twice gets the union.
_TABLE: Tuple[Tuple[str, str], ...] = (
    ("Abs Negative",
     "scale shift"),
    ("Acos Asin Asinh Atan Atanh Cosh Cosine Erf Sinh",
     "index_offset_value index_scale_value lut lut_mode scale value_offset_value"),
    ("Acosh Log Sine",
     "index_offset_value index_scale_value lut scale value_offset_value"),
    ("Activation",
     ("alpha approximate axis beta bias clip_max clip_min gamma index_offset_type index_offset_value "
         "index_scale_type index_scale_value lambd lut lut_mode method negative_slope negative_slope_shift "
         "negative_slope_type negative_slope_value scale shift value_offset_type value_offset_value "
         "with_activation")),
    ("AdaptivePool",
     "method output_size scale"),
    ("Add Eltwise Mul Sub",
     "clip_max clip_min input_scale method negative_slope negative_slope_value scale shift with_activation"),
    ("ArgMinMax",
     "axis method select_last_index"),
    ("BasicLSTM",
     ("activation_alpha activation_beta activations basiclstm_for_qat biases cell_clip cell_clip_value "
         "cell_frac_bits cell_scale_value cell_shift_value cell_size diff_shifts direction forget_bias "
         "gate_bits gate_clamp_value gate_scale gate_shift hidden_frac_bits hidden_scale_value "
         "hidden_shift_value init_c_scale_value init_c_shift_value init_h_scale_value init_h_shift_value "
         "input_size lut_cand lut_cell lut_ct lut_ft lut_gate lut_h lut_it lut_ot lut_shift_type "
         "lut_shift_value out_scale_value out_sequence out_shift_value scale shift threshold time_steps "
         "version weights weights_scale weights_zp zerop")),
    ("BatchNorm",
     ("axis biases biases_scale biases_zp clip_max clip_min epsilon mean negative_slope "
         "negative_slope_value remain_shift scale shift var weights weights_scale weights_zp with_activation")),
    ("BatchToSpace",
     "block_size block_size_x block_size_y crop_bottom crop_left crop_right crop_top scale"),
    ("BiasAdd",
     ("axis biases biases_scale biases_zp clip_max clip_min negative_slope negative_slope_value "
         "remain_shift scale scale1 scale2 shift weights weights_bk weights_scale weights_zp with_activation")),
    ("BitShift Bitwise",
     "direction method"),
    ("BNLL CRELU Clip HardSigmoid Hardswish LeakyRELU PRELU RELU RELU6 THRESHOLDEDRELU",
     ("alpha approximate axis beta bias clip_max clip_min gamma lambd lut method negative_slope "
         "negative_slope_shift negative_slope_type negative_slope_value scale shift with_activation")),
    ("Cast",
     "clip_mode ignore_scale_zp only_for_quantized round_mode scale to_dtype"),
    ("Ceil Exp Floor Reciprocal Round Rsqrt Sqrt Square Tan Trunc",
     "lut scale"),
    ("CELU ELU MISH SELU Sigmoid Softplus Swish",
     ("alpha approximate axis beta bias clip_max clip_min gamma index_offset_value index_scale_value lambd "
         "lut method negative_slope negative_slope_shift negative_slope_type negative_slope_value scale shift "
         "value_offset_value with_activation")),
    ("ChannelShuffle",
     "group scale splits"),
    ("Concat",
     "axis scale weights"),
    ("Constant",
     "weights"),
    ("ConstantOfShape",
     "shape value"),
    ("Convolution",
     ("WinogradWeights biases biases_scale biases_zp clip_max clip_min dilation_x dilation_y group kernel_x "
         "kernel_y multiplier negative_slope negative_slope_value num_output pad_bottom pad_left pad_right "
         "pad_top remain_shift scale shift stride_x stride_y weights weights_scale weights_zp with_activation "
         "with_winograd")),
    ("ConvTranspose ConvTranspose3D Convolution3D",
     ("biases biases_scale biases_zp clip_max clip_min dilation_x dilation_y dilation_z group kernel_x "
         "kernel_y kernel_z negative_slope negative_slope_value num_output output_padding_x output_padding_y "
         "output_padding_z pad_bottom pad_left pad_right pad_top pad_x_begin pad_x_end pad_y_begin pad_y_end "
         "pad_z_begin pad_z_end remain_shift scale shift stride_x stride_y stride_z weights weights_scale "
         "weights_zp with_activation")),
    ("Crop",
     "crops ds_crops scale"),
    ("CropAndResize",
     "coord_fraction_bits crop_size extrapolation_qvalue extrapolation_value method scale"),
    ("Cumulate",
     "axis exclusive method reverse scale shift"),
    ("DecodeBox",
     ("anchor_frac_bits box_num_perclass box_scale_value box_shift box_shift_value boxes class_num clip ha "
         "height height_max image_height image_width lut_frac_bits lut_th lut_tw lut_tx lut_ty "
         "proposal_normalized scale score_threshold score_threshold_uint8 score_threshold_value th_lut tw_lut "
         "tx_lut ty_lut variance wa weights width width_max xcenter ycenter")),
    ("DepthToSpace",
     "block_size block_size_x block_size_y mode scale"),
    ("DepthwiseConv",
     ("biases biases_scale biases_zp clip_max clip_min dilation_x dilation_y group kernel_x kernel_y "
         "multiplier negative_slope negative_slope_value num_output pad_bottom pad_left pad_right pad_top "
         "remain_shift scale shift stride_x stride_y weights weights_scale weights_zp with_activation")),
    ("DeQuantize",
     "quantize_scale quantize_zp"),
    ("DetectionOutput",
     ("anchor_mode bbox_xform_clip box_num_perclass box_scale_type box_scale_value box_shift_type "
         "box_shift_value clip delta_shift height image_height image_width lut_frac_bits lut_th lut_tw lut_tx "
         "lut_ty scale score_threshold score_threshold_value scores th_lut tw_lut tx_lut ty_lut variance width")),
    ("Div",
     "lut reciprocal_shift scale shift"),
    ("DivMod",
     "mode"),
    ("FullyConnected",
     ("biases biases_scale biases_zp clip_max clip_min negative_slope negative_slope_value num_output "
         "remain_shift scale scale1 scale2 scale3 shift weights weights_scale weights_zp with_activation")),
    ("Gather",
     "axis batch_dims indices lut method scale"),
    ("GatherElements",
     "axis indices scale"),
    ("GatherND",
     "batch_dims indices scale"),
    ("GELU SHRINK Silu Softsign Tanh",
     ("alpha approximate axis beta bias clip_max clip_min gamma index_offset_value index_scale_value lambd "
         "lut lut_mode method negative_slope negative_slope_shift negative_slope_type negative_slope_value "
         "scale shift value_offset_value with_activation")),
    ("Gemm",
     ("alpha beta clip_max clip_min negative_slope negative_slope_value scale shift trans_a trans_b "
         "with_activation")),
    ("GlobalPool Pooling",
     ("ceil_mode count_include_pad dilation_x dilation_y kernel_x kernel_y method pad_bottom pad_left "
         "pad_right pad_top scale shift sqrt_lut stride_x stride_y")),
    ("GridSample",
     ("align_corners coordinate_x_shift coordinate_y_shift coordinate_z_shift interp_shift_type "
         "interp_shift_value lutx luty method padding_mode scale shift x_terp y_terp")),
    ("GroupNorm",
     ("axis axis_shape biases eps_value epsilon group lut norm_frac_bits norm_scale_type norm_scale_value "
         "norm_shift_type norm_shift_value normalize_variance scale scale_shift_shape shift var_shift_type "
         "var_shift_value weights")),
    ("GRUv1 GRUv3",
     ("activation_alpha activation_beta activations biases cell_clip cell_clip_value cell_frac_bits "
         "cell_scale_value cell_shift_value cell_size direction forget_bias gate_bits gate_clamp_value "
         "gate_scale gate_shift hidden_frac_bits hidden_scale hidden_scale_type hidden_scale_value "
         "hidden_shift hidden_shift_type hidden_shift_value init_c_scale_value init_c_shift_value "
         "init_h_scale_value init_h_shift_value input_size lut_cand lut_cell lut_gate lut_ht lut_rt lut_zt "
         "out_scale_value out_sequence out_shift_value remain_shift scale shift threshold time_steps version "
         "weights weights_scale weights_zp")),
    ("Hardmax",
     "axis"),
    ("Input Sign Where",
     ""),
    ("InstanceNorm LayerNorm",
     ("axis axis_shape biases eps_value epsilon group norm_frac_bits norm_scale_type norm_scale_value "
         "norm_shift_type norm_shift_value normalize_variance scale scale_shift_shape shift weights")),
    ("Interp",
     ("align_corners antialias bound_x_max bound_x_min bound_y_max bound_y_min cubic_coeff_a "
         "exclude_outside interp_shift_type interp_shift_value method mode nearest_mode ratio_x ratio_y "
         "ratio_z scale size weight_coefficients_x weight_coefficients_y")),
    ("IsInf IsNaN",
     "detect_negative detect_positive"),
    ("Logical",
     "method"),
    ("LogSoftmax",
     ("adjust_q axis input_scale_type input_scale_value input_shift_type input_shift_value log2_lut lut_exp "
         "lut_log pow2_lut pow2_out_q quantize_scale scale shift")),
    ("LRN",
     ("alpha beta bias lut method scale scale_sum_type scale_sum_value shift shift_sum_type shift_sum_value "
         "size")),
    ("MatMul",
     ("clip_max clip_min fused_multiplier negative_slope negative_slope_value remain_shift scale scale1 "
         "scale2 scale3 shift trans_a trans_b with_activation")),
    ("MaxPoolingWithArgMax",
     ("ceil_mode count_include_pad dilation_x dilation_y flatten_dim kernel_x kernel_y pad_bottom pad_left "
         "pad_right pad_top scale storage_order stride_x stride_y")),
    ("MaxRoiPool",
     "scale spatial"),
    ("MaxUnpool",
     "flatten_dim scale"),
    ("Mod",
     "fmod"),
    ("MVN",
     ("axis biases eps_value epsilon group ngamma_scale_value norm_frac_bits norm_scale_type "
         "norm_scale_value norm_shift_type norm_shift_value normalize_variance scale shift weights")),
    ("NMS",
     ("areas_shift box_num_perclass boxes center_point_box gaussian_scale_lut gaussian_shift_lut "
         "image_height image_width iou_thresh_shift iou_threshold iou_threshold_shift iou_threshold_value "
         "max_output_size method scale score_threshold score_threshold_value soft_nms_sigma "
         "soft_nms_sigma_in_shift")),
    ("Normalization",
     "axis eps_value epsilon lut method reciprocal_shift_type reciprocal_shift_value scale shift"),
    ("OneHot",
     "axis depth indices values"),
    ("Pad",
     "constant_value mode pads scale"),
    ("Permute Transpose",
     "perm scale"),
    ("Pooling3D",
     ("ceil_mode count_include_pad dilation_x dilation_y dilation_z kernel_x kernel_y kernel_z method "
         "pad_x_begin pad_x_end pad_y_begin pad_y_end pad_z_begin pad_z_end scale stride_x stride_y stride_z")),
    ("Pow",
     "exponent lut lut_exp lut_log weights"),
    ("Quantize",
     "quantize_scale quantize_zp round_mode"),
    ("Reduce",
     "axis keepdims method scale shift sqrt_fraction_bits sqrt_lut"),
    ("Repeat",
     "axis repeats scale"),
    ("Reshape",
     "ds_output_shape scale shape"),
    ("Resize",
     ("align_corners antialias cubic_coeff_a exclude_outside interp_shift_type interp_shift_value method "
         "mode nearest_mode ratio_x ratio_y ratio_z scale size")),
    ("ReverseSequence",
     "batch_axis scale time_axis"),
    ("RMSNorm",
     ("axis axis_shape biases eps_value epsilon group lut norm_frac_bits norm_scale_type norm_scale_value "
         "norm_shift_type norm_shift_value normalize_variance scale scale_shift_shape shift weights")),
    ("RoiAlign",
     ("bin_scale_type bin_scale_value bin_shift_type bin_shift_value coord_fraction_bits "
         "coordinate_transformation_mode grid_scale_type grid_scale_value grid_shift_type grid_shift_value "
         "method pooled_shape sample scale spatial_scale_type spatial_scale_value spatial_shift_type "
         "spatial_shift_value")),
    ("ROIPooling",
     "coord_fraction_bits scale x_index_scale x_index_shift y_index_scale y_index_shift"),
    ("ScatterElements",
     "axis indices method reduction scale"),
    ("ScatterND",
     "indices method reduction scale"),
    ("Shape",
     "end start"),
    ("Slice",
     ("begin begin_mask ds_begin ds_end ds_output_shape ds_strides ellipsis_mask end end_mask new_axis_mask "
         "scale shrink_axis_mask strides upper_bound")),
    ("Softmax",
     ("adjust_q axis float_lut input_scale_type input_scale_value input_shift_type input_shift_value "
         "log2_lut lut lut_mode mask_saturated_input pow2_lut pow2_out_q quantize_method scale shift")),
    ("Sort",
     "axis descending scale"),
    ("SpaceToBatch",
     "block_size block_size_x block_size_y pad_bottom pad_left pad_right pad_top scale"),
    ("SpaceToDepth",
     "block_size block_size_x block_size_y scale"),
    ("Split",
     "axis scale splits"),
    ("SquaredDifference",
     "diff_shift"),
    ("Squeeze",
     "axis scale"),
    ("StridedSlice",
     "begin begin_mask ellipsis_mask end end_mask new_axis_mask scale shrink_axis_mask strides upper_bound"),
    ("Tile",
     "repeats scale"),
    ("TopK",
     "axis k largest scale select_index sorted"),
    # keys the ops build with f-strings (ops/roi.py `_coord_pairs`: f"{key}_scale_value")
    ("CropAndResize MaxRoiPool ROIPooling RoiAlign",
     "batch_scale_value batch_shift_value coord_scale_value coord_shift_value"),
)

_BUILTIN: Dict[str, FrozenSet[str]] = {}
for _types, _keys in _TABLE:
    for _t in _types.split():
        _BUILTIN[_t] = _BUILTIN.get(_t, frozenset()) | frozenset(_keys.split())
_DECLARED: Dict[str, Set[str]] = {}
_SCHEMAS: Dict[str, ParamSchema] = {}
_BUILTIN_SCHEMAS: Set[str] = set()


def declare_schema(optype: str, schema: ParamSchema, builtin: bool) -> None:
    """The typed keys of `optype` from its operator declaration (`quantopt.registry.declare_op`); they replace
    the table entry of a built-in type."""
    _SCHEMAS[str(optype)] = schema
    if builtin:
        _BUILTIN_SCHEMAS.add(str(optype))


def schema_of(optype: str) -> Optional[ParamSchema]:
    """The declared schema of `optype`, if any."""
    return _SCHEMAS.get(str(optype))


def builtin_table() -> Dict[str, FrozenSet[str]]:
    """The built-in table (type -> keys), for tests and documentation."""
    return dict(_BUILTIN)


def declare_keys(optype: str, keys: Iterable[str]) -> None:
    """Add `keys` to the known keys of `optype` (a plugin type gets checked from then on; a built-in type gains
    the keys a plugin implementation reads)."""
    names = [keys] if isinstance(keys, str) else list(keys)
    for k in names:
        if not isinstance(k, str) or not k:
            raise ValueError(f"known keys of '{optype}' must be non-empty strings, got {k!r}")
    _DECLARED.setdefault(str(optype), set()).update(names)


def known_keys(optype: str) -> Optional[FrozenSet[str]]:
    """The keys a layer of `optype` may carry besides the common ones; None when the type declares none (then
    its layers are not checked)."""
    name = str(optype)
    schema = _SCHEMAS.get(name)
    if schema is not None:
        return schema.keys() | frozenset(_DECLARED.get(name, ()))
    if name not in _BUILTIN and name not in _DECLARED:
        return None
    return _BUILTIN.get(name, frozenset()) | frozenset(_DECLARED.get(name, ()))


def is_known(key: str, known: FrozenSet[str], constants: Iterable[str] = ()) -> bool:
    """Whether a layer with known keys `known` and constants `constants` may carry `key`."""
    if key in COMMON_KEYS or key in known or key.startswith(COMMON_PREFIXES):
        return True
    for suffix in DERIVED_SUFFIXES:
        if key.endswith(suffix):
            base = key[: -len(suffix)]
            if base in known or base in constants:
                return True
    return False


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return math.isnan(v)
    return isinstance(v, list) and any(_has_nan(x) for x in v)


def param_problem(optype: str, key: str, value: Any) -> Optional[str]:
    """Why `value` cannot be the value of `key` on a layer of `optype` (None when it can): the declared kind of a
    declared type, else the table's rules for built-in types (plugin types without a schema are not checked)."""
    schema = _SCHEMAS.get(str(optype))
    if schema is not None:
        return schema.problem(key, value)
    return value_problem(key, value) if str(optype) in _BUILTIN else None


def value_problem(key: str, value: Any) -> Optional[str]:
    """Why `value` cannot be the value of parameter `key` of a built-in type (None when it can): NaN anywhere,
    a geometry size that is not a non-negative integer below 2^31, a shape, perm or axis that is not integers.
    Checked when the IR is read, so that an IR with `stride_x=nan` or `pad_left=1e308` is an IR error naming
    its line rather than a crash of the operator."""
    if _has_nan(value):
        return "NaN is not a valid value"
    if key in SIZE_KEYS and not (_int(value) and 0 <= value < INT_LIMIT):
        return f"must be a non-negative integer below 2^31, got {value!r}"
    if key in INT_LIST_KEYS and not (isinstance(value, list) and all(_int(x) and abs(x) < INT_LIMIT for x in value)):
        return f"must be a list of integers like [1,2,3], got {value!r}"
    if key in AXIS_KEYS and value is not None:
        items = value if isinstance(value, list) else [value]
        if not all(_int(x) and abs(x) < INT_LIMIT for x in items):
            return f"must be an integer or a list of integers, got {value!r}"
    return None


def is_builtin(optype: str) -> bool:
    """Whether quantopt's own table describes `optype` (value checks apply to built-in types only)."""
    return str(optype) in _BUILTIN or str(optype) in _BUILTIN_SCHEMAS


def suggestion(key: str, known: FrozenSet[str]) -> str:
    """The did-you-mean hint for an unknown key (the closest known keys), or an empty string."""
    close = difflib.get_close_matches(key, sorted(known | COMMON_KEYS), n=2, cutoff=0.7)
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
