"""Quantization of a calibrated float graph: per-layer settings, then each layer's registered quantize function
in topological order on a copy of the graph (producers are always quantized before their consumers)."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from .config.layer_settings import LayerSettings, OptConfig, settings_from_cfg
from .errors import ConfigError, PluginError, UnsupportedError
from .graph.graph import PyGraph, QuantizeGraph
from .graph.tables import quant_of
from .log import OPT_INFO
from .ops._per_channel import check_per_channel_inputs
from .passes.absorb_scales import absorb_input_scales
from .passes.concat_signs import sign_concat_branches
from .passes.float_islands import float_choices, insert_boundary_layers, make_float_layer
from .passes.fp8_borders import insert_fp8_borders
from .passes.recurrent_casts import insert_recurrent_state_casts
from .registry import OP_QUANTIZE, QCONFIGS, PluginType, get_plugin

FLOAT_IR_HEADER_KEYS = ("precision", "compat_quantized_model")
"""Header keys of the Parser's float IR that the quantized copy drops (upstream's quantized IRs have neither)."""


def assign_settings(graph: PyGraph, cfg: Any, opt_config: Optional[OptConfig] = None) -> None:
    """Resolve every layer's LayerSettings from the cfg, then the opt_config JSON (highest priority); the workflow
    then finishes them (`pipeline.finish_settings`)."""
    for n in graph.nodes:
        n.settings = settings_from_cfg(cfg, n)
        if opt_config is not None:
            n.settings = opt_config.apply(n.settings, n)


def assign_float_settings(graph: PyGraph, cfg: Any) -> None:
    """Before the layer settings are resolved (after the graph passes), every layer gets the cfg's fields that
    decide how the float forward computes (`float_reference`, `fc_float_summation`), so the zero-input check and
    a float-only run compute as the statistics pass will. Layers that have settings already keep them."""
    for n in graph.nodes:
        if n.settings is None:
            n.settings = LayerSettings(float_reference=str(cfg.float_reference),
                                       fc_float_summation=str(cfg.fc_float_summation))


def check_quantizable(graph: PyGraph) -> None:
    """Every layer type must have a quantize implementation; list all offenders at once."""
    missing: Dict[str, List[str]] = {}
    for n in graph.nodes:
        if OP_QUANTIZE.get(str(n.type)) is None:
            missing.setdefault(str(n.type), []).append(n.name)
    if missing:
        parts = [f"{t} ({', '.join(repr(x) for x in v[:3])}{', ...' if len(v) > 3 else ''})"
                 for t, v in missing.items()]
        raise UnsupportedError("no quantize implementation for layer type(s) " + "; ".join(parts) +
                               ". Add one with quant_register in an operator plugin (see docs/plugins.md)",
                               file=graph.source_file)


def quantize_graph(graph: QuantizeGraph) -> QuantizeGraph:
    """A quantized copy of `graph` (which keeps its float values); also stored as `graph.quantgraph`.

    Layers whose settings ask for `trigger_float_op` stay float in the copy, with Quantize/DeQuantize/Cast
    layers inserted at their borders (passes/float_islands.py). A MAC layer reading a per-channel activation gets
    the producer's scales absorbed into its float weights on the copy before it is quantized
    (passes/absorb_scales.py)."""
    check_quantizable(graph)
    q = graph.clone()
    for key in FLOAT_IR_HEADER_KEYS:  # a quantized IR with these lines is read as a float IR by upstream's tools
        q.header.pop(key, None)
    sign_concat_branches(q)  # one integer type for a per-channel Concat's branches (passes/concat_signs.py)
    choices = float_choices(q)
    insert_boundary_layers(q, choices)
    insert_fp8_borders(q)  # fp8 activations (quant_type w*afp8*, passes/fp8_borders.py)
    for n in q.nodes:
        if n.name in choices:
            make_float_layer(n, choices[n.name])
            continue
        n.params["is_perf_mode"] = bool(n.settings.perf_mode_for_lib) if n.settings is not None else True
        n.params["unquantifiable"] = False
        check_per_channel_inputs(n)
        absorb_input_scales(n)  # a MAC layer's per-channel input scales into its float weights, on this copy
        try:
            n.quantize()
        except (ValueError, RuntimeError) as e:
            raise n._error(f"quantization failed: {e}") from e
        if n.params.get("unquantifiable") is True:  # a DeQuantize layer: integer in, float out
            n.quantized = False
            continue
        table = quant_of(n)
        for t in n.outputs:
            if table.get(t).qmin is None:
                raise RuntimeError(f"quantize function of {n.type} left output '{t.name}' of layer '{n.name}' "
                                   "without quantization parameters")
        n.params.pop("activation_quantization_axis", None)
        n.params["activation_quantization_axis"] = [len(t.ir_shape) - 1 if table.get(t).per_channel else None
                                                    for t in n.outputs]
    insert_recurrent_state_casts(q)  # upstream's signed initial states (passes/recurrent_casts.py)
    if q.device.type != "cpu":  # quantize functions build their constants (integer weights, tables) on the CPU
        q.to(q.device)
    graph.quantgraph = q
    return q


def apply_qconfig(graph: PyGraph, name: str) -> int:
    """The cfg field `qconfig`: the QConfig plugin `name` sees the float graph (every layer's settings assigned)
    and returns per-layer settings, checked like the opt_config JSON and applied over the layers' settings.
    Returns the number of layers it changed. A wrong layer name, key or value is a PluginError naming the plugin's
    file (docs/plugins.md, "QConfig plugins")."""
    cls = get_plugin(PluginType.QConfig, name)
    source = QCONFIGS.get(name.strip().lower()).source
    wanted = cls().configure(graph)
    if not isinstance(wanted, Mapping):
        raise PluginError(f"qconfig plugin {cls.__name__}: configure returned {type(wanted).__name__}, not a mapping "
                          "of layer name -> {setting: value}", file=source)
    try:
        config = OptConfig.from_mapping(source, dict(wanted), [n.name for n in graph.nodes],
                                        what=f"qconfig plugin {cls.__name__}")
    except ConfigError as e:
        raise PluginError(e.message, file=source) from None
    for n in graph.nodes:
        n.settings = config.apply(n.settings, n)
    OPT_INFO(f"qconfig plugin {cls.__name__}: settings of {len(config.layers)} layer(s) set")
    return len(config.layers)
