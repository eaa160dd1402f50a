"""`quant_type`: upstream's named precision recipes (w8a8, w4afp16, wfp4abfp16, fp16, ...) as the per-layer
settings they stand for. A layer whose quant_type is not `disable` takes these values over the cfg's bits and
`trigger_float_op` (as upstream: "the corresponding configuration overrides activation_bits, weight_bits and
bias_bits"). Torch-free, like the rest of the cfg reading.

Weight-only types keep float activations (float16, bfloat16 or float32) and quantize only the weights: integers of
4 or 8 bits (`*_act_int_wht`) or fp4 e2m1 values (`*_act_fp4e2m1fn_wht`); with a per-block weight mode
(`quantize_method_for_weight = per_block_*`) each block of `weight_block_size` weights gets its own scale. Types
with fp8 activations (w4afp8e5m2, w4afp8e4m3, wfp4afp8e5m2, wfp4afp8e4m3, wfp8afp8, wfp8e5m2afp8e5m2,
wfp8e4m3afp8e4m3) quantize activations to fp8 as well, which quantopt does not simulate: refused when the cfg is
read.
"""
from __future__ import annotations

from typing import Dict, Tuple

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

FP8_ACTIVATION_TYPES = ("w4afp8e5m2", "w4afp8e4m3", "wfp4afp8e5m2", "wfp4afp8e4m3", "wfp8afp8", "wfp8e5m2afp8e5m2",
                        "wfp8e4m3afp8e4m3")
"""Upstream's types with fp8 activations (not simulated)."""

QUANT_TYPE_NAMES = ("disable", *QUANT_TYPES, *FP8_ACTIVATION_TYPES)


def quant_type_settings(name: str) -> Dict[str, object]:
    """The LayerSettings values of quant_type `name` ({} for disable); ValueError for an fp8-activation type."""
    key = name.strip().lower()
    if key == "disable":
        return {}
    if key in FP8_ACTIVATION_TYPES:
        raise ValueError(f"quant_type {key} quantizes activations to fp8, which quantopt does not simulate yet "
                         "(weight-only types such as w4afp16 or wfp4afp16 are supported)")
    act, wht, bias, lut, trigger = QUANT_TYPES[key]
    return {"q_bits_activation": min(act, 16), "q_bits_weight": min(wht, 16), "q_bits_bias": bias,
            "lut_items_in_bits": lut, "trigger_float_op": trigger}
