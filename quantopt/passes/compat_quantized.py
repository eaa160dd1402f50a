"""compat_quantized_model: quantization of a pre-quantized model that keeps the model's own quantization
(docs/compat-quantized.md).

Tensors carrying given params (`quant/given.py`, from the QDQ import) get their range from them and no statistics
are needed for them; the quantize helpers then use the given scales, zero points and integer weights. The cfg's
compat fields adjust the given params before quantization (int8_to_uint8, the weight strategy), and the layers'
settings are set to the weight mode and bits the given weights have.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from ..calibration.collect import calibrate_layer, weight_constants
from ..errors import ConfigError, UnsupportedError
from ..graph.graph import PyGraph, QuantizeGraph
from ..graph.tables import RangeTable, quant_of
from ..log import OPT_INFO
from ..quant.dtype import Dtype
from ..quant.given import GIVEN_PARAMS, GIVEN_VALUES
from ..quant.params import QuantParams

COMPAT_MULTIPLIER_BITS = 13
"""Upstream's compat flow requantizes with 13-bit multipliers unless the cfg sets multiplier_bits."""


@dataclass
class CompatOptions:
    """The compat fields with their defaults, for the Python API (a read cfg has the same attributes)."""

    compat_quantized_model: bool = True
    compat_quantized_model_strategy: str = "8bSymWeightUnchange"
    compat_quantized_model_int8_to_uint8: bool = False
    compat_quantized_model_force_weight_asym: bool = False
    compat_quantized_model_unify_shifts_mode: str = "auto"

    def is_set(self, name: str) -> bool:
        return getattr(self, name) != getattr(CompatOptions, name)

    def error(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"field '{name}': {message}")


def given(t: Any) -> Optional[QuantParams]:
    """A tensor's given params, or None."""
    return t.extra.get(GIVEN_PARAMS)


def has_given_quantization(graph: PyGraph) -> bool:
    """Whether any tensor of the graph carries a pre-quantized model's params."""
    return any(given(t) is not None for n in graph.nodes for t in list(n.outputs) + list(n.constants.values()))


def is_prequantized_ir(graph: PyGraph) -> bool:
    """A quantized IR: at least one layer runs its integer forward (read from layer_top_scale etc.)."""
    return any(n.quantized for n in graph.nodes)


def check_compat_graph(graph: PyGraph, cfg: Any) -> None:
    """The graph side of the compat fields: Cast layers (eliminate_cast) and IR-only inputs."""
    casts = [n.name for n in graph.nodes if str(n.type) == "Cast"]
    if casts:
        raise cfg.error("compat_quantized_model_eliminate_cast",
                        f"the pre-quantized model has Cast layer(s) ({', '.join(casts[:3])}), which quantopt's compat "
                        "flow neither eliminates nor keeps")
    if is_prequantized_ir(graph):
        for name in ("compat_quantized_model_int8_to_uint8", "compat_quantized_model_force_weight_asym",
                     "compat_quantized_model_strategy", "compat_quantized_model_unify_shifts_mode"):
            if cfg.is_set(name):
                raise cfg.error(name, "applies to an ONNX QDQ model; a quantized IR is kept as it is")
    elif not has_given_quantization(graph):
        raise cfg.error("compat_quantized_model", "the model carries no quantization (an ONNX QDQ model or a "
                                                  "quantized IR is expected)")


def _int8_to_uint8(p: QuantParams) -> QuantParams:
    # OPT convention q = round(x * scale - zerop): ONNX zero point -128 is zerop 128; q + 128 has zerop 0
    if p.dtype is Dtype.INT8 and not p.per_channel and int(p.zerop) == 128:
        return QuantParams(p.scale, 0, 0, 255, Dtype.UINT8)
    return p


def _weight_mode(p: QuantParams) -> str:
    symmetric = bool((torch.as_tensor(p.zerop) == 0).all())
    if p.per_channel:
        return "per_channel_symmetric_restricted_range" if symmetric else "per_channel_asymmetric"
    return "per_tensor_symmetric_restricted_range" if symmetric else "per_tensor_asymmetric"


def prepare_given(graph: PyGraph, cfg: Any) -> None:
    """Apply the compat fields to the given params and set each layer's settings to what its given weights are
    (after `assign_settings`, before statistics)."""
    strategy = str(cfg.compat_quantized_model_strategy).lower()
    for n in graph.nodes:
        for t in n.outputs:
            p = given(t)
            if p is not None and cfg.compat_quantized_model_int8_to_uint8:
                t.extra[GIVEN_PARAMS] = _int8_to_uint8(p)
        changes = {}
        for key, w in n.constants.items():
            p = given(w)
            if p is None:
                continue
            asym = not bool((torch.as_tensor(p.zerop) == 0).all())
            if asym and not cfg.compat_quantized_model_force_weight_asym:
                if strategy != "8basymweightto16bsymweight" or p.dtype.bits != 8:
                    raise cfg.error("compat_quantized_model_strategy",
                                    f"layer '{n.name}' has asymmetric {p.dtype.value} weights, which "
                                    f"{cfg.compat_quantized_model_strategy} keeps unchanged only when symmetric; use "
                                    "8bAsymWeightTo16bSymWeight or compat_quantized_model_force_weight_asym = true")
                # x = (q + zerop) / scale: q + zerop is the same value as a symmetric 16-bit integer
                zerop = p.zerop.reshape([-1] + [1] * (w.extra[GIVEN_VALUES].dim() - 1)) if p.per_channel \
                    else p.zerop
                w.extra[GIVEN_VALUES] = w.extra[GIVEN_VALUES] + zerop
                zero = torch.zeros_like(p.zerop) if p.per_channel else 0
                p = QuantParams(p.scale, zero, -32768, 32767, Dtype.INT16)
                w.extra[GIVEN_PARAMS] = p
            if key == "weights":
                changes.update(q_mode_weight=_weight_mode(p), q_bits_weight=int(p.dtype.bits))
        outs = [given(t) for t in n.outputs if given(t) is not None]
        if outs:
            changes["q_bits_activation"] = int(outs[0].dtype.bits)
            changes["q_mode_activation"] = "per_tensor_asymmetric" if any(int(o.zerop) for o in outs) else \
                "per_tensor_symmetric_full_range"
        if n.settings is not None and n.settings.multiplier_bits is None:
            changes["multiplier_bits"] = COMPAT_MULTIPLIER_BITS
        if str(cfg.compat_quantized_model_unify_shifts_mode).lower() == "none":
            changes["unify_shifts_for_aiff"] = False
        if changes and n.settings is not None:
            n.settings = dataclasses.replace(n.settings, **changes)


def needs_statistics(graph: PyGraph) -> List[str]:
    """Graph inputs and layer outputs without given params whose range would come from statistics; shape-only
    layers that pass their input's params on are not told apart here, so the list is what calibration would
    read, not necessarily what quantization needs."""
    return [t.name for n in graph.nodes for t in n.outputs if given(t) is None]


def _given_range(ranges: RangeTable, t: Any, p: QuantParams) -> None:
    lo = (p.qmin + p.zerop) / p.scale
    hi = (p.qmax + p.zerop) / p.scale
    if p.per_channel:
        lo_c, hi_c = torch.clamp(lo, max=0.0), torch.clamp(hi, min=0.0)
        ranges.set_channels(t, lo_c, hi_c, axis=0)
        ranges.set(t, float(lo_c.min()), float(hi_c.max()))
    else:
        ranges.set(t, min(float(lo), 0.0), max(float(hi), 0.0))


def compat_calibrate(graph: PyGraph) -> None:
    """Ranges of given tensors from their params; other tensors from their statistics where there are some (no
    statistics: no range, and a layer whose quantization needs one says so)."""
    table = graph.statistics
    for n in graph.nodes:
        if any(given(t) is None and table.get(t).extrema_min is not None for t in n.outputs):
            calibrate_layer(n)
        elif any(given(w) is None for w in weight_constants(n)):
            s = n.settings
            from ..calibration.strategies import apply_strategy

            for w in weight_constants(n):
                st = table.get(w)
                if given(w) is None and st.extrema_min is not None:
                    graph.ranges.set(w, *apply_strategy(st, s.q_strategy_weight, s.q_bits_weight, symmetric=True,
                                                        ir_range=w.ir_range, per_channel=False))
                    if st.extrema_min_key_axis is not None:
                        graph.ranges.set_channels(w, *apply_strategy(st, s.q_strategy_weight, s.q_bits_weight,
                                                                     symmetric=True, ir_range=w.ir_range,
                                                                     per_channel=True), axis=0)
        for t in list(n.outputs) + list(n.constants.values()):
            p = given(t)
            if p is not None:
                _given_range(graph.ranges, t, p)


def check_given_kept(qgraph: QuantizeGraph) -> int:
    """Every given tensor of the quantized graph has exactly its given params (a layer that passed its input's
    params on where the model requantizes is refused); returns the number checked."""
    count = 0
    for n in qgraph.nodes:
        table = quant_of(n)
        for t in list(n.outputs) + list(n.constants.values()):
            p = given(t)
            if p is None:
                continue
            q = table.get(t)
            same = torch.equal(torch.as_tensor(q.scale, dtype=torch.float32),
                               torch.as_tensor(p.scale, dtype=torch.float32)) and \
                torch.equal(torch.as_tensor(q.zerop, dtype=torch.int64), torch.as_tensor(p.zerop, dtype=torch.int64))
            if not same:
                raise UnsupportedError(f"layer '{n.name}' ({n.type}): its quantization does not keep the given params "
                                       f"of tensor '{t.name}' (scale {p.scale}, zero point {p.zerop}); the "
                                       "pre-quantized model requantizes where quantopt's layer cannot")
            if GIVEN_VALUES in t.extra and not torch.equal(t.betensor.to(device="cpu", dtype=torch.int64),
                                                             t.extra[GIVEN_VALUES].cpu()):
                raise UnsupportedError(f"layer '{n.name}' ({n.type}): constant '{t.name}' lost its given integers")
            count += 1
    OPT_INFO(f"compat_quantized_model: {count} tensor(s) keep the model's own quantization")
    return count


def require_statistics_source(graph: PyGraph, has_data: bool) -> None:
    """Without calibration data, every layer output must carry given params or come from a layer that passes
    its input's params on; checked by quantization itself, this only tells the user up front."""
    missing = needs_statistics(graph)
    if missing and not has_data:
        OPT_INFO(f"compat_quantized_model: {len(missing)} tensor(s) without given quantization (e.g. "
                 f"'{missing[0]}'); without calibration_data only layers that pass their input's params on can "
                 "quantize them")

