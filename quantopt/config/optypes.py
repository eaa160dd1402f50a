"""Operator type names that cfg values may mention: per-layer selectors `[OpType,...]`, global_calibration scopes,
unify_scales rules and the fake-quant operator list.

The built-in names come from `registry/optype.py`, which imports nothing heavy, so a cfg is checked without torch.
Plugins may register more types, and they exist only once plugins are loaded, which imports the operators (and
torch): that is done only for a name not known otherwise, so a correct cfg naming a plugin's type is accepted as
before while every other cfg error is reported at once.
"""
from __future__ import annotations

from typing import List

from ..registry.optype import OpType, OpTypeName

ACTIVATION_METHODS = frozenset({
    "RELU", "RELU6", "LEAKYRELU", "PRELU", "CLIP", "SIGMOID", "TANH", "HARDSWISH", "HARDSIGMOID", "ELU", "SELU",
    "CELU", "GELU", "SILU", "SWISH", "MISH", "SOFTPLUS", "SOFTSIGN", "SHRINK", "THRESHOLDEDRELU", "CRELU"})
"""Activation `method` values a selector may name (an Activation layer matches its method too)."""


def _load_plugins() -> None:
    from ..registry import discover_plugins

    discover_plugins()


def _registered(name: str) -> bool:
    return name in OpType or any(t.lower() == name.lower() for t in OpType.names()) or \
        name.upper() in ACTIVATION_METHODS


def known_optype(name: str) -> bool:
    """Whether a selector may name `name`: an operator type (any case) or an Activation method."""
    if _registered(name):
        return True
    _load_plugins()
    return _registered(name)


def lookup_optype(name: str) -> OpTypeName:
    """The registered operator type `name` (exact, else the unique case-insensitive match); KeyError if none."""
    try:
        return OpType.lookup(name)
    except KeyError:
        _load_plugins()
    return OpType.lookup(name)


def optype_names(include_plugins: bool) -> List[str]:
    """Every registered operator type name; with `include_plugins`, after loading the plugins."""
    if include_plugins:
        _load_plugins()
    return [str(t) for t in OpType]
