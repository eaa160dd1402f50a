"""`enable_pass_deeply_set_unquantifiable` (on by default: upstream runs it whatever its cfg says): layers that only
move values (Reshape, Transpose, Permute, Squeeze, Tile, Repeat, Pad, Slice, StridedSlice, Split, Crop, SpaceToDepth,
DepthToSpace, SpaceToBatch, BatchToSpace, BatchToDepth) reading a float layer of `trigger_float_op` run in float too,
with the float type of that layer, so no Quantize/DeQuantize pair sits between a float layer and the shape changes
after it (docs/mixed-precision.md, docs/user-guide.md "Graph passes").

It runs after the layer settings, in graph order, so a chain of such layers becomes float as a whole; a layer whose
own setting already runs it in float keeps that setting, and one set to `disable` for itself (opt_config, a
per-layer rule) is made float with a warning naming it. The float islands (passes/float_islands.py) then insert
the boundary layers for the new borders. Weight-only formats do not carry over (these layers have no weights).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from ..config.kinds_accuracy import FloatChoice, parse_trigger_float
from ..graph.graph import PyGraph
from ..log import OPT_INFO, OPT_WARN
from .merge_matmul_mul import SHAPE_ONLY

FIELD = "enable_pass_deeply_set_unquantifiable"


def deeply_set_unquantifiable(graph: PyGraph) -> List[str]:
    """Make the shape-only readers of float layers float (module doc); returns the layers changed."""
    choice: Dict[str, FloatChoice] = {}
    for n in graph.nodes:
        c = parse_trigger_float(getattr(n.settings, "trigger_float_op", "disable")) if n.settings else None
        if c is not None:
            choice[n.name] = c
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    changed: List[str] = []
    for n in graph.nodes:
        if n.name in choice or str(n.type) not in SHAPE_ONLY or n.settings is None:
            continue
        parents = sorted({order[t.pnode.name] for t in n.inputs if t.pnode is not None and t.pnode.name in choice})
        if not parents:
            continue
        source = graph.nodes[parents[0]].name  # the earliest float producer in graph order, as upstream
        first = choice[source]
        c = FloatChoice(first.act_type, None, first.forced)
        if "trigger_float_op" in n.settings.explicit:  # set for this layer (opt_config, a per-layer rule)
            OPT_WARN(f"{FIELD}: layer '{n.name}' ({n.type}) runs in float after float layer '{source}', though "
                     f"trigger_float_op = {n.settings.trigger_float_op} is set for it ({FIELD} = false keeps it)")
        n.settings = dataclasses.replace(n.settings, trigger_float_op=str(c))
        choice[n.name] = c
        changed.append(n.name)
    if changed:
        OPT_INFO(f"{FIELD}: {len(changed)} shape-only layer(s) run in float after float layers: "
                 f"{', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''}")
    return changed
