"""Upstream's stage-1 pass `control_op_preprocess`: If and Loop layers and their subgraphs run in float.

Run after the layer settings (`pipeline.finish_settings`), on the float graph:

- a `Dummy` layer is inserted on every edge from an If/Loop output to a consumer (one per consumer input, named
  `<If/Loop layer>_dummy_<i>`), with the If/Loop layer's settings;
- an If/Loop layer whose `trigger_float_op` is `disable` gets `float16_preferred!`, and so do its Dummy layers; the
  float islands then put DeQuantize layers before them and Quantize layers after the Dummy layers;
- every layer of their subgraphs (nested ones included) becomes a float layer of the If/Loop layer's float type:
  the float-typed copies are prepared here as `attrs["float_subgraphs"]`, which the quantized copy of the layer
  runs and the IR writer writes (graph/subgraphs.py). The float graph keeps its float32 subgraphs.

docs/semantics/control-flow.md ("If and Loop") lists where this differs from upstream.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import List

from ..config.kinds_accuracy import FloatChoice, parse_trigger_float
from ..graph.graph import PyGraph
from ..graph.names import unique_name as _unique
from ..graph.node import PyNode
from ..graph.tables import TensorStatistics
from ..log import OPT_INFO
from ..registry.optype import OpType
from .float_islands import make_float_layer

CONTROL_TYPES = ("If", "Loop")
DEFAULT_CHOICE = "float16_preferred!"
"""What a `disable` If/Loop layer gets (upstream: the global trigger_float_op with `!`, float16_preferred! when it
is disable; per layer quantopt only knows the layer's own value, so a layer set to disable gets this one)."""
FLOAT_IR_HEADER_KEYS = ("precision", "compat_quantized_model")


def _choice(node: PyNode) -> FloatChoice:
    value = getattr(node.settings, "trigger_float_op", "disable") if node.settings is not None else "disable"
    choice = parse_trigger_float(value)
    if choice is None:
        choice = parse_trigger_float(DEFAULT_CHOICE)
        if node.settings is not None:
            node.settings = dataclasses.replace(node.settings, trigger_float_op=DEFAULT_CHOICE)
    return choice


def control_op_preprocess(graph: PyGraph) -> List[str]:
    """Apply the pass (module doc) to `graph`; returns the names of the inserted Dummy layers."""
    controls = [n for n in graph.nodes if str(n.type) in CONTROL_TYPES]
    if not controls:
        return []
    taken = {n.name for n in graph.nodes} | set(graph.tensors())
    inserted: List[PyNode] = []
    for n in list(graph.nodes):
        for i, t in enumerate(list(n.inputs)):
            parent = t.pnode
            if parent is None or str(parent.type) not in CONTROL_TYPES:
                continue
            name = _unique(f"{parent.name}_dummy_{len(inserted)}", taken)
            dummy = PyNode(name, OpType.lookup("Dummy"), parent.layer_id)
            dummy.additional = True
            dummy.settings = parent.settings
            dummy.inputs = [t]
            out = t.clone(_unique(f"{t.name}_dummy_{len(inserted)}", taken))
            graph.statistics.set(out, TensorStatistics())  # its own entry, which the calibration fills
            out.pnode = dummy
            dummy.outputs = [out]
            n.inputs[i] = out
            graph.add_node(dummy)
            inserted.append(dummy)
    for n in controls:
        choice = _choice(n)
        for d in inserted:
            if d.inputs[0].pnode is n:
                d.settings = n.settings
        n.attrs["float_subgraphs"] = OrderedDict((k, _float_copy(sub, choice))
                                                 for k, sub in n.attrs.get("subgraphs", {}).items())
    if inserted:
        graph.finalize(graph.source_file)
        graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    OPT_INFO(f"control_op_preprocess: {len(controls)} If/Loop layer(s) run in float; inserted {len(inserted)} "
             f"Dummy layer(s)")
    return [d.name for d in inserted]


def _float_copy(sub: PyGraph, choice: FloatChoice) -> PyGraph:
    """A copy of subgraph `sub` whose every layer is a float layer of `choice`'s type (nested If/Loop too)."""
    copy = sub.clone()
    for key in FLOAT_IR_HEADER_KEYS:  # as the quantized root header, and upstream's quantized subgraphs
        copy.header.pop(key, None)
    if hasattr(sub, "ir_line"):
        copy.ir_line = sub.ir_line  # type: ignore[attr-defined]
    plain = FloatChoice(choice.act_type, None, True)  # upstream's subgraph layers get trigger_float_op only
    for n in copy.nodes:
        make_float_layer(n, plain)
        if str(n.type) in CONTROL_TYPES:
            n.attrs["float_subgraphs"] = OrderedDict((k, _float_copy(s, plain))
                                                     for k, s in n.attrs.get("subgraphs", {}).items())
    return copy



__all__ = ["control_op_preprocess", "CONTROL_TYPES"]
