"""`min_compatible_zhouyi_target`: the oldest NPU generation the quantized model must run on, and the defaults it
gives the fields a cfg does not set (as upstream: its hardware limits become quantization settings).

* Z1, Z2, Z3, X1 (level 0): `bias_effective_bits = 16` (the MAC engine keeps 16 significant bias bits);
* X2 (level 1, the default): `bias_effective_bits = 32`, and RMSNorm runs in float16
  (`trigger_float_op = disable & <[RMSNorm]:float16_preferred!>`);
* X3, X3P, X3S (level 2): not implemented; these targets change the Softmax and activation integer forms (fp24
  tables, tuned approximations) that quantopt does not simulate.

Level-0 targets also have another LogSoftmax integer form, which quantopt does not simulate: such a layer is refused
when it is quantized (ops/softmax.py). A field written in the cfg always wins; the preset's values win over the
target's. Torch-free, like the rest of the cfg reading.
"""
from __future__ import annotations

from typing import Dict, Mapping

TARGET_LEVELS: Dict[str, int] = {"Z1": 0, "Z2": 0, "Z3": 0, "X1": 0, "X2": 1, "X3": 2, "X3P": 2, "X3S": 2}
"""Upstream's target names and optimization levels."""

DEFAULT_TARGET = "X2"

SIMULATED_LEVELS = (0, 1)
"""The levels whose integer forms quantopt simulates."""

TARGET_DEFAULTS: Dict[int, Dict[str, str]] = {
    0: {"bias_effective_bits": "16"},
    1: {"bias_effective_bits": "32", "trigger_float_op": "disable & <[RMSNorm]:float16_preferred!>"},
}
"""level -> {cfg field: value as written in a cfg}."""


def target_name(text: str) -> str:
    """The target named by a cfg value (`X2`, `x2_1204`: the part before '_', any case); ValueError if unknown."""
    name = text.strip().split("_")[0].upper()
    if name not in TARGET_LEVELS:
        raise ValueError(f"unknown target {text.strip()!r}")
    return name


def target_level(name: str) -> int:
    return TARGET_LEVELS[target_name(name)]


def target_defaults(name: str) -> Mapping[str, str]:
    """The field values target `name` gives the fields the cfg leaves unset; ValueError for a target whose integer
    forms quantopt does not simulate."""
    level = target_level(name)
    if level not in SIMULATED_LEVELS:
        raise ValueError(f"target {target_name(name)} (level {level}) changes the Softmax and activation integer "
                         "forms (fp24 tables, tuned approximations), which quantopt does not simulate yet; use X2 or "
                         "an older target")
    return TARGET_DEFAULTS[level]
