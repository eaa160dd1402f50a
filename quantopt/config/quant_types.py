"""`quant_type`: upstream's named precision recipes (w8a8, w4afp16, wfp4abfp16, fp16, wfp8e4m3afp8e4m3, ...) as the
per-layer settings they stand for. A layer whose quant_type is not `disable` takes these values over the cfg's bits
and `trigger_float_op` (as upstream: "the corresponding configuration overrides activation_bits, weight_bits and
bias_bits"). Torch-free, like the rest of the cfg reading.

Weight-only types keep float activations (float16, bfloat16 or float32) and quantize only the weights: integers of
4 or 8 bits (`*_act_int_wht`) or fp4 e2m1 values (`*_act_fp4e2m1fn_wht`); with a per-block weight mode
(`quantize_method_for_weight = per_block_*`) each block of `weight_block_size` weights gets its own scale.

Types with fp8 activations (w4afp8e5m2, w4afp8e4m3, wfp4afp8e5m2, wfp4afp8e4m3, wfp8afp8, wfp8e5m2afp8e5m2,
wfp8e4m3afp8e4m3) quantize the activations of some layer types to fp8 (docs/low-bit.md): upstream has fp8 kernels
for Convolution, FullyConnected, DepthwiseConv, MatMul and Input under the wfp8* types and for FullyConnected only
under w4afp8e4m3 and wfp4afp8e4m3; every other layer (and every layer under w4afp8e5m2 and wfp4afp8e5m2) is
quantized as with `quant_type = disable`, from the cfg's bits, as upstream does. The layer records the type in
`LayerSettings.quant_type`; shape-only layers pass an fp8 tensor on as it is.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

# name -> (activation bits, weight bits, bias bits, lut_items_in_bits, trigger_float_op)
QUANT_TYPES: Dict[str, Tuple[int, int, int, int, str]] = {
    "w8a8": (8, 8, 32, 8, "disable"),
    "w16a16": (16, 16, 48, 10, "disable"),
    "w4": (16, 4, 32, 10, "float16_act_int_wht"),
    "w8": (16, 8, 32, 10, "float16_act_int_wht"),
    "w4afp16": (16, 4, 32, 10, "float16_act_int_wht"),
    "w8afp16": (16, 8, 32, 10, "float16_act_int_wht"),
    "w4abfp16": (16, 4, 32, 10, "bfloat16_act_int_wht"),
    "w8abfp16": (16, 8, 32, 10, "bfloat16_act_int_wht"),
    "wfp4": (16, 4, 32, 10, "float16_act_fp4e2m1fn_wht"),
    "wfp4afp16": (16, 4, 32, 10, "float16_act_fp4e2m1fn_wht"),
    "wfp4abfp16": (16, 4, 32, 10, "bfloat16_act_fp4e2m1fn_wht"),
    "wfp4afp32": (32, 4, 32, 10, "float32_act_fp4e2m1fn_wht"),
    "fp16": (16, 16, 32, 8, "float16_preferred"),
    "bf16": (16, 16, 32, 8, "bfloat16_preferred"),
    "bfp16": (16, 16, 32, 8, "bfloat16_preferred"),
}

_FP8_LAYERS = ("Convolution", "FullyConnected", "DepthwiseConv", "MatMul", "Input")
_FC_ONLY = ("FullyConnected",)

# name -> (activation dtype, weight dtype, weight bits, layer types with fp8 activations)
FP8_ACTIVATION_TYPES: Dict[str, Tuple[str, str, int, Tuple[str, ...]]] = {
    "w4afp8e5m2": ("float8_e5m2", "aligned_int4", 4, ()),
    "w4afp8e4m3": ("float8_e4m3fn", "aligned_int4", 4, _FC_ONLY),
    "wfp4afp8e5m2": ("float8_e5m2", "float4_e2m1fn", 4, ()),
    "wfp4afp8e4m3": ("float8_e4m3fn", "float4_e2m1fn", 4, _FC_ONLY),
    "wfp8afp8": ("float8_e4m3fn", "float8_e4m3fn", 8, _FP8_LAYERS),
    "wfp8e5m2afp8e5m2": ("float8_e5m2", "float8_e5m2", 8, _FP8_LAYERS),
    "wfp8e4m3afp8e4m3": ("float8_e4m3fn", "float8_e4m3fn", 8, _FP8_LAYERS),
}
"""Upstream's types with fp8 activations. Upstream also lists Constant and the shape-only layers for the wfp8*
types; its Constant keeps its integer quantization and shape-only layers carry their input's dtype, so they need no
entry here."""

QUANT_TYPE_NAMES = ("disable", *QUANT_TYPES, *FP8_ACTIVATION_TYPES)


def quant_type_settings(name: str) -> Dict[str, object]:
    """The LayerSettings values of quant_type `name` ({} for disable). An fp8-activation type only records its name
    (`quant_type`): the bits and modes it implies apply to the layer types it has fp8 kernels for, when the layer
    is quantized (`fp8_layer_formats`)."""
    key = name.strip().lower()
    if key == "disable":
        return {}
    if key in FP8_ACTIVATION_TYPES:
        return {"quant_type": key}
    act, wht, bias, lut, trigger = QUANT_TYPES[key]
    return {"q_bits_activation": min(act, 16), "q_bits_weight": min(wht, 16), "q_bits_bias": bias,
            "lut_items_in_bits": lut, "trigger_float_op": trigger}


def fp8_layer_formats(name: str, layer_type: str) -> Optional[Tuple[str, str, int]]:
    """(activation dtype, weight dtype, weight bits) of a layer of `layer_type` under quant_type `name` when the
    type quantizes its activations to fp8, else None (the layer is an integer layer)."""
    entry = FP8_ACTIVATION_TYPES.get(str(name).strip().lower())
    if entry is None or layer_type not in entry[3]:
        return None
    return entry[0], entry[1], entry[2]
