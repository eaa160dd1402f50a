"""Checks of the cfg against the graph it is applied to, made right after the graph is read and before any data is
loaded or any layer runs: a layer id that names no layer, or a model name too long for the output file names,
is a cfg mistake that must not surface as a silently ignored setting or an OS error at the end of a long run.

Torch-free (only the graph's layer ids, types and names are read).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Tuple

from ..errors import ConfigError
from .fields import FIELDS
from .kinds import MAX_NAME_BYTES as MAX_MODEL_NAME
from .perlayer import IdRangeSelector, PerLayerValue

START_TYPES = ("Input", "Constant")


def check_cfg_against_graph(cfg: Any, graph: Any) -> None:
    """Raise a ConfigError naming the cfg field (and its line) for the first cfg value that cannot apply to
    `graph`."""
    _check_model_name(cfg, graph)
    layers = {n.layer_id: n for n in graph.nodes}
    _check_start_nodes(cfg, layers)
    for name, ranges in _id_ranges(cfg):
        for lo, hi in ranges:
            if not any(lo <= i <= hi for i in layers):
                span = f"layer id {lo}" if lo == hi else f"layer-id range ({lo},{hi})"
                raise cfg.error(name, f"{span} names no layer of the graph (its layer ids are "
                                      f"{_id_span(layers)})")


def _check_model_name(cfg: Any, graph: Any) -> None:
    name = cfg.model_name or graph.name
    if len(name.encode("utf-8")) <= MAX_MODEL_NAME:
        return
    raise ConfigError(f"the IR's model_name is {len(name)} characters long (at most {MAX_MODEL_NAME} make valid "
                      f"output file names); set a shorter 'model_name' in the cfg", file=cfg.path)


def _check_start_nodes(cfg: Any, layers: dict) -> None:
    for layer_id in cfg.set_qinvariant_for_start_nodes or []:
        node = layers.get(layer_id)
        if node is None:
            raise cfg.error("set_qinvariant_for_start_nodes",
                            f"layer id {layer_id} names no layer of the graph (its layer ids are {_id_span(layers)})")
        if str(node.type) not in START_TYPES:
            raise cfg.error("set_qinvariant_for_start_nodes",
                            f"layer {layer_id} ('{node.name}') is a {node.type} layer; only Input and Constant "
                            "layers can be set integer-valued")


def _id_ranges(cfg: Any) -> Iterable[Tuple[str, List[Tuple[int, int]]]]:
    """Every layer-id range the cfg writes: per-layer rules, global calibration scopes, fake-quant scopes."""
    for name in FIELDS:
        value = cfg.values.get(name)
        if isinstance(value, PerLayerValue):
            for selector, _ in value.rules:
                if isinstance(selector, IdRangeSelector):
                    yield name, selector.ranges
    for spec in cfg.values.get("global_calibration") or []:
        scope = getattr(spec, "scope", None)
        if isinstance(scope, IdRangeSelector):
            yield "global_calibration", scope.ranges
    ranges = cfg.values.get("fake_quant_scopes_for_debug") or []
    if ranges:
        yield "fake_quant_scopes_for_debug", list(ranges)


def _id_span(layers: dict) -> str:
    ids = sorted(layers)
    return f"{ids[0]} to {ids[-1]}" if ids else "none"
