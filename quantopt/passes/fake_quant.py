"""Fake-quant debugging (`fake_quant_scopes_for_debug`, `fake_quant_operators_for_debug`, docs/mixed-precision.md).

Chosen layers of the quantized graph run their float forward, with the original float params and constants, on
their dequantized inputs; their outputs are quantized again with the layer's own output params, so downstream
integer layers see what they expect. It answers "how good would the model be if this layer were exact?". Only the
in-memory forward changes (similarity, metrics, dump): the written IR is the real quantized model.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.values import to_float, to_quantized
from ..graph.wide_values import wide_values_of
from ..log import OPT_INFO

OVERRIDE_KEY = "forward_override"


def _override(float_node: PyNode) -> Callable[[PyNode, Callable], None]:
    def run(qnode: PyNode, _fn: Callable) -> None:
        table = quant_of(qnode)  # the quantized graph's params
        for ft, qt in zip(float_node.inputs, qnode.inputs):
            ft.betensor = to_float(qt, table)
        with torch.no_grad():
            float_node.forward()
        for qt, ft in zip(qnode.outputs, float_node.outputs):
            y = ft.betensor
            qt.betensor = to_quantized(y, qt, table) if qnode.quantized else y
        wide = wide_values_of(float_node)
        for t in float_node.inputs + float_node.outputs:
            t.release()
            if wide is not None:
                wide.drop(t)
    return run


def select_layers(qgraph: PyGraph, scopes: Sequence[Tuple[int, int]], optypes: Sequence[str]) -> List[PyNode]:
    """Layers of the quantized graph (not the inserted ones) inside a layer-id range or of a listed type."""
    folded = {t.lower() for t in optypes}
    return [n for n in qgraph.nodes if not n.additional and
            (any(lo <= n.layer_id <= hi for lo, hi in scopes) or str(n.type).lower() in folded)]


def apply_fake_quant(float_graph: PyGraph, qgraph: PyGraph, scopes: Sequence[Tuple[int, int]],
                     optypes: Sequence[str]) -> List[str]:
    """Make the selected layers of `qgraph` run in float (see the module doc); returns their names."""
    float_nodes = {n.name: n for n in float_graph.nodes}
    chosen = [n for n in select_layers(qgraph, scopes, optypes) if n.name in float_nodes]
    for n in chosen:
        n.attrs[OVERRIDE_KEY] = _override(float_nodes[n.name].detached_copy())
    if chosen:
        OPT_INFO(f"fake-quant debugging: {len(chosen)} layer(s) run in float in the quantized forward: "
                 f"{', '.join(n.name for n in chosen[:8])}{', ...' if len(chosen) > 8 else ''}")
    return [n.name for n in chosen]


def remove_fake_quant(qgraph: PyGraph) -> None:
    for n in qgraph.nodes:
        n.attrs.pop(OVERRIDE_KEY, None)


__all__ = ["apply_fake_quant", "remove_fake_quant", "select_layers"]
