"""The layer keys each operator type may carry and the kinds of their values: the lookups the IR reader uses.

Why: a misspelt or foreign key (`with_activaton`, `stride_x` on a layer that reads `stride`, `pad_left` on a layer
without pads) used to be kept as an unused parameter, so a fused ReLU or a stride silently disappeared. Each operator
declares its keys with their kinds (`quantopt.registry.declare_op`, in its own module); the reader refuses any other
key, and any value of another kind, naming the line. tests/test_ir_known_keys.py fails when an op reads a parameter
its declaration lacks.

Keys every layer may carry (`COMMON_KEYS`, the upstream debug prefix `D_`, and the quantization keys `X_scale`,
`X_zp`, `X_range` of any known key or constant `X`) are always accepted. Types without a declaration (plugin types
that declare nothing) are not checked. A plugin that overrides a built-in type and reads more adds its keys with
`quantopt.registry.register_op_keys`. This module imports nothing heavy (no torch).
"""
from __future__ import annotations

import difflib
from typing import Any, Dict, FrozenSet, Iterable, Optional, Set

from .schema import INT_LIMIT, ParamSchema

__all__ = ["COMMON_KEYS", "INT_LIMIT", "STRUCTURAL_KEYS", "TOP_INFO_KEYS", "declare_keys", "declare_schema",
           "declared_types", "is_builtin", "is_known", "known_keys", "param_problem", "schema_of", "suggestion"]

STRUCTURAL_KEYS = ("layer_id", "layer_name", "layer_type", "layer_bottom", "layer_bottom_shape", "layer_bottom_type",
                   "layer_top", "layer_top_shape", "layer_top_type")
TOP_INFO_KEYS = ("layer_top_range", "layer_top_scale", "layer_top_zp")
COMMON_KEYS: FrozenSet[str] = frozenset(STRUCTURAL_KEYS + TOP_INFO_KEYS + (
    # written on every layer of a quantized IR (quantopt's and upstream's)
    "is_perf_mode", "unquantifiable", "activation_quantization_axis",
    # a weight-only layer with one weight scale per block (trigger_float_op *_act_*_wht, quantize_method_for_weight
    # = per_block_*)
    "weight_block_size",
    # per-tensor requantization of any quantized layer (a multiplier and a shift, or one per input)
    "scale_value", "shift_value", "scale_type", "shift_type",
    # upstream's dynamic-shape output shapes, on any layer (ds_output_shape_constant, passes/compiler_fields.py)
    "ds_output_shape",
))
COMMON_PREFIXES = ("D_",)
"""Upstream's debug keys (`write_similarity_to_ir`: D_cos, D_mse, D_layer_id...)."""
DERIVED_SUFFIXES = ("_scale", "_zp", "_range")
"""`weights_scale`, `biases_zp`, `weights_range`...: quantization info of a known key or constant."""

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


def declared_types() -> Dict[str, ParamSchema]:
    """Every declared type and its schema (built-in and plugin), for tests and documentation."""
    return dict(_SCHEMAS)


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
    if schema is None and name not in _DECLARED:
        return None
    return (schema.keys() if schema is not None else frozenset()) | frozenset(_DECLARED.get(name, ()))


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


def param_problem(optype: str, key: str, value: Any) -> Optional[str]:
    """Why `value` cannot be the value of `key` on a layer of `optype` (None when it can): the declared kind of a
    declared type (types without a declaration are not checked). Upstream's debug keys (`D_cos`...) are
    information for IR viewers, never read by a forward: `nan` there says a layer has no analysis result."""
    if key.startswith(COMMON_PREFIXES):
        return None
    schema = _SCHEMAS.get(str(optype))
    return None if schema is None else schema.problem(key, value)


def is_builtin(optype: str) -> bool:
    """Whether `optype` is declared by quantopt itself (rather than by a plugin)."""
    return str(optype) in _BUILTIN_SCHEMAS


def suggestion(key: str, known: FrozenSet[str]) -> str:
    """The did-you-mean hint for an unknown key (the closest known keys), or an empty string."""
    close = difflib.get_close_matches(key, sorted(known | COMMON_KEYS), n=2, cutoff=0.7)
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
