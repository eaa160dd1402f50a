"""`enable_pass_tune_op_softmax` and `enable_pass_tune_op_complicated_activations` (upstream's default `[0][0]`):
per-layer choices of a Softmax's integer method and of the approximation of complicated activations, read before
statistics (docs/user-guide.md, "Graph passes").

A value is `[quant_method, params...][approx_method, params...]` (config/kinds_passes.py), per layer with the usual
`global & <selector:value>` rules. For a Softmax:

* quant_method 0: the automatic choice of ops/softmax.py (an explicit `quantize_method` in the IR stays);
* quant_method 1 [, adjust_q]: FAST_EXP with `adjust_q` fraction bits (0, 1 or 8..15; upstream's default 1): the
  layer gets the params `quantize_method = FAST_EXP` and `adjust_q`, which its quantize function reads;
* quant_method 2 [, value_bits]: LUT. quantopt's exp table has 20 value bits (upstream's automatic `[2, 20]`);
  other widths, including upstream's default without the parameter (max(16, 32 - ceil(log2(axis length)))) when it
  is not 20, are refused naming the field.

For the complicated activations (upstream's list: Sigmoid, Tanh, GELU, Silu, Swish, ELU, Exp, Log, Erf, the
trigonometric and hyperbolic functions, ... as layer types or Activation methods; BasicLSTM takes up to three
pairs, one per gate activation) upstream has one quantized form, quant_method 0; another number is refused.

approx_method (0, or 1 with an optional use_dynamic_lut) only changes layers that run in float on X3 targets
(fp24 tables); for the targets quantopt simulates (X2 and older, `min_compatible_zhouyi_target`) upstream leaves
such layers as they are too, so 1 is accepted and logged as having no effect; another number is refused.
"""
from __future__ import annotations

import math
from typing import Any, List, Tuple

from ..config.kinds_passes import TuneOpValue, parse_tune_op
from ..errors import ConfigError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..log import OPT_INFO

SOFTMAX_FIELD = "enable_pass_tune_op_softmax"
ACTIVATIONS_FIELD = "enable_pass_tune_op_complicated_activations"

FAST_EXP_ADJUST_Q_VALUES = (0, 1) + tuple(range(8, 16))
"""adjust_q values the FAST_EXP forms accept: 0/1 (power-of-two path) or 8..15 (2^f table)."""
UPSTREAM_FAST_EXP_ADJUST_Q = 1
"""adjust_q of `[1]` without a parameter (upstream's)."""
LUT_VALUE_BITS = 20
"""Value bits of quantopt's Softmax exp table (ops/softmax.py)."""

COMPLICATED_ACTIVATIONS = ("cosine", "sine", "atanh", "asinh", "atan", "asin", "acos", "acosh", "sinh", "tanh",
                           "erf", "log", "shrink", "softsign", "exp", "softplus", "cosh", "mish", "celu", "selu",
                           "elu", "gelu", "silu", "swish", "sigmoid")
"""Upstream's complicated activations (lower case): layer types, or Activation methods."""
LSTM_PAIRS = 3


def _resolve(value: Any, node: PyNode) -> TuneOpValue:
    """The layer's value: a per-layer cfg value (`.get(node)`), a TuneOpValue, or its text."""
    if hasattr(value, "get") and not isinstance(value, (str, dict)):
        value = value.get(node)
    return value if isinstance(value, TuneOpValue) else parse_tune_op(str(value))


def _error(field: str, node: PyNode, value: TuneOpValue, why: str) -> ConfigError:
    return ConfigError(f"{field} = {value} for layer '{node.name}' ({node.type}): {why}", field=field, layer=node.name)


def _approx_method(field: str, node: PyNode, value: TuneOpValue, approx: Tuple[float, ...]) -> int:
    method = int(approx[0]) if approx else 0
    if method not in (0, 1):
        raise _error(field, node, value, f"approx_method must be 0 or 1, got {method}")
    return method


def _axis_len(node: PyNode) -> int:
    shape = list(node.inputs[0].ir_shape)
    axis = int(node.params.get("axis", -1))
    return int(shape[axis]) if shape else 1


def tune_op_softmax(graph: PyGraph, value: Any) -> List[Tuple[str, str]]:
    """Apply `enable_pass_tune_op_softmax` (module doc) to every Softmax; returns (layer, method set) per layer
    whose method it fixed."""
    fixed: List[Tuple[str, str]] = []
    approx_ignored: List[str] = []
    for n in graph.nodes:
        if str(n.type) != "Softmax":
            continue
        v = _resolve(value, n)
        if _approx_method(SOFTMAX_FIELD, n, v, v.approx) == 1:
            approx_ignored.append(n.name)
        method = int(v.extra[0])
        if method == 0:
            continue
        if method == 1:
            adjust_q = int(v.extra[1]) if len(v.extra) > 1 else UPSTREAM_FAST_EXP_ADJUST_Q
            if adjust_q not in FAST_EXP_ADJUST_Q_VALUES:
                raise _error(SOFTMAX_FIELD, n, v, f"adjust_q must be 0, 1 or 8..15, got {adjust_q}")
            n.params["quantize_method"] = "FAST_EXP"
            n.params["adjust_q"] = adjust_q
            fixed.append((n.name, f"FAST_EXP, adjust_q {adjust_q}"))
        elif method == 2:
            bits = int(v.extra[1]) if len(v.extra) > 1 else max(16, 32 - math.ceil(math.log2(max(1, _axis_len(n)))))
            if bits != LUT_VALUE_BITS:
                raise _error(SOFTMAX_FIELD, n, v, f"a LUT with {bits}-bit values: quantopt's Softmax exp table has "
                             f"{LUT_VALUE_BITS}-bit values; write [2,{LUT_VALUE_BITS}]")
            n.params["quantize_method"] = "LUT"
            n.params.pop("adjust_q", None)
            fixed.append((n.name, "LUT"))
        else:
            raise _error(SOFTMAX_FIELD, n, v, f"quant_method must be 0 (automatic), 1 (FAST_EXP) or 2 (LUT), "
                         f"got {method}")
    if fixed:
        OPT_INFO(f"{SOFTMAX_FIELD}: " + ", ".join(f"'{name}' {how}" for name, how in fixed))
    if approx_ignored:
        OPT_INFO(f"{SOFTMAX_FIELD}: approx_method 1 changes float Softmax layers on X3 targets only; no effect on "
                 f"{len(approx_ignored)} layer(s)")
    return fixed


def _is_complicated(node: PyNode) -> bool:
    kind = str(node.type)
    if kind == "Activation":
        return str(node.params.get("method", "")).lower() in COMPLICATED_ACTIVATIONS
    return kind.lower() in COMPLICATED_ACTIVATIONS


def tune_op_complicated_activations(graph: PyGraph, value: Any) -> List[str]:
    """Check `enable_pass_tune_op_complicated_activations` (module doc) for every complicated activation and
    BasicLSTM; returns the layers given approx_method 1 (which changes nothing on the simulated targets)."""
    noted: List[str] = []
    for n in graph.nodes:
        lstm = str(n.type) == "BasicLSTM"
        if not lstm and not _is_complicated(n):
            continue
        v = _resolve(value, n)
        pairs = [v.groups[i:i + 2] for i in range(0, len(v.groups), 2)][:LSTM_PAIRS] if lstm else \
            [(v.extra, v.approx)]
        for pair in pairs:
            extra, approx = pair[0], (pair[1] if len(pair) > 1 else ())
            if int(extra[0]) != 0:
                raise _error(ACTIVATIONS_FIELD, n, v, f"quant_method must be 0 (the one quantized form), got "
                             f"{int(extra[0])}")
            if _approx_method(ACTIVATIONS_FIELD, n, v, approx) == 1 and n.name not in noted:
                noted.append(n.name)
    if noted:
        OPT_INFO(f"{ACTIVATIONS_FIELD}: approx_method 1 changes float activations on X3 targets only; no effect on "
                 f"{len(noted)} layer(s): {', '.join(noted[:8])}{', ...' if len(noted) > 8 else ''}")
    return noted
