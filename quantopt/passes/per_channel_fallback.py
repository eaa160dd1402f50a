"""Per-tensor fallback for per-channel activations, decided from the graph before any statistics are collected.

With `quantize_method_for_activation = per_channel_symmetric_*`, a layer's output can carry one scale per channel
only where every reader can take such an input (ops/_per_channel.py; docs/integer-semantics.md, "Per-channel
activations"). Rather than stopping at the first layer that cannot, after the whole statistics pass, this pass finds
every such layer at once and gives it the per-tensor mode of the same kind (symmetric, full or restricted range),
with one warning listing them and why. The rest of the graph keeps its per-channel activations.

Layers of the other types (Input, Reshape, Softmax...) cannot produce per-channel activations: under a global
per-channel mode they keep per-tensor activations (one info line counts them); set for such a layer itself, the mode
is refused when it is quantized.

A per-channel output stays per channel when the layer produces per-channel activations (PER_CHANNEL_PRODUCERS) and:
* each channel holds at least `activation_perchannel_min_elements` values per sample (all axes but the batch and
  the channel axis);
* it is no element-wise layer that broadcasts along the channel axis (inputs and output all have the same number
  of channels in their last axis);
* every reader reads per-channel inputs (`reads_per_channel`) and is no broadcasting element-wise layer;
* readers that pass the scales on (Pooling, GlobalPool, and Concat on the channel axis) satisfy the same rules for
  their own readers.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..log import OPT_DEBUG, OPT_INFO, OPT_WARN
from ..ops._per_channel import PER_CHANNEL_PRODUCERS, reads_per_channel

ELEMENTWISE = ("Eltwise", "Add", "Sub", "Mul")
PASS_ON = ("Pooling", "GlobalPool", "Concat")
PER_TENSOR_OF = {"per_channel_symmetric_full_range": "per_tensor_symmetric_full_range",
                 "per_channel_symmetric_restricted_range": "per_tensor_symmetric_restricted_range"}


def fall_back_to_per_tensor(graph: PyGraph) -> List[Tuple[str, str]]:
    """Give per-tensor activations to the per-channel layers whose output cannot stay per channel; returns
    (layer, reason) for each, in graph order, after logging them in one warning."""
    readers = _readers(graph)
    changed: List[Tuple[str, str]] = []
    other_types: Dict[str, int] = {}
    for node in graph.nodes:
        mode = str(node.settings.q_mode_activation)
        if mode not in PER_TENSOR_OF:
            continue
        if not _produces_per_channel(node):
            if "q_mode_activation" not in node.settings.explicit:  # a global mode; set for the layer: refused later
                node.settings = dataclasses.replace(node.settings, q_mode_activation=PER_TENSOR_OF[mode])
                other_types[str(node.type)] = other_types.get(str(node.type), 0) + 1
            continue
        reason = _too_few_elements(node) or _broadcast_reason(node) or _reader_reason(node, readers, set())
        if reason:
            node.settings = dataclasses.replace(node.settings, q_mode_activation=PER_TENSOR_OF[mode])
            changed.append((node.name, reason))
    if other_types:
        counts = ", ".join(f"{count} {kind}" for kind, count in sorted(other_types.items()))
        OPT_INFO(f"per-channel activations: layers of other types keep per-tensor activations ({counts})")
    if changed:
        reasons = [f"'{name}' ({why})" for name, why in changed]
        more = len(reasons) - WARNED_FALLBACKS
        shown = "; ".join(reasons[:WARNED_FALLBACKS]) + (f"; and {more} more (the debug log lists them)" if more > 0
                                                          else "")
        OPT_WARN(f"per-channel activations: {len(changed)} layer(s) fall back to per-tensor activations because "
                 f"their output cannot carry per-channel scales: {shown}")
        if more > 0:
            OPT_DEBUG("per-channel activations: every layer falling back to per-tensor activations: "
                      + "; ".join(reasons))
    return changed


WARNED_FALLBACKS = 8
"""Fallbacks named in the warning line; a transformer has dozens (every projection read by a Reshape), which made
that one line thousands of characters long. The debug log names them all."""


def _produces_per_channel(node: PyNode) -> bool:
    if str(node.type) not in PER_CHANNEL_PRODUCERS:
        return False
    return str(node.type) != "Activation" or reads_per_channel(node)  # Activation: table methods only


def _readers(graph: PyGraph) -> Dict[str, List[PyNode]]:
    found: Dict[str, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            found.setdefault(t.name, []).append(n)
    return found


def _channels(shape: Optional[tuple]) -> Optional[int]:
    return int(shape[-1]) if shape else None


def _too_few_elements(node: PyNode) -> str:
    """`activation_perchannel_min_elements`: an output whose channels hold fewer values per sample than asked
    (the elements of all other axes but the batch) keeps per-tensor activations."""
    minimum = int(getattr(node.settings, "perchannel_min_elements", 1))
    for t in node.outputs:
        shape = tuple(int(d) for d in t.ir_shape or ())
        if len(shape) < 2 or minimum <= 1:
            continue
        per_channel = 1
        for d in shape[1:-1]:
            per_channel *= d
        if per_channel < minimum:
            return f"its channels hold {per_channel} element(s) per sample, fewer than " \
                   f"activation_perchannel_min_elements = {minimum}"
    return ""


def _broadcast_reason(node: PyNode) -> str:
    """Why an element-wise layer cannot align per-channel scales: its inputs broadcast along the channel axis."""
    if str(node.type) not in ELEMENTWISE:
        return ""
    channels = {_channels(t.ir_shape) for t in list(node.inputs) + list(node.outputs)}
    if len(channels) > 1:  # a scalar (no channel axis: None) broadcasts too
        counts = ", ".join(str(c) for c in sorted(c for c in channels if c is not None))
        scalar = " and a scalar" if None in channels else ""
        return f"'{node.name}' broadcasts along the channel axis ({counts} channels{scalar})"
    return ""


def _reader_reason(node: PyNode, readers: Dict[str, List[PyNode]], seen: Set[str]) -> str:
    for t in node.outputs:
        for r in readers.get(t.name, []):
            if r.name in seen:
                continue
            seen.add(r.name)
            kind = str(r.type)
            if not reads_per_channel(r):
                return f"read by '{r.name}' ({kind}), which takes per-tensor inputs only"
            why = _broadcast_reason(r)
            if why:
                return f"read by {why}"
            if kind == "Concat" and not concat_on_channels(r):
                return f"read by '{r.name}' (Concat), which joins on another axis than the channels"
            if kind in PASS_ON:
                why = _reader_reason(r, readers, seen)
                if why:
                    return f"passed on by '{r.name}' ({kind}), {why}"
    return ""


def concat_on_channels(node: PyNode) -> bool:
    """Whether a Concat joins its inputs on the last (channel) axis of its output."""
    shape = node.outputs[0].ir_shape if node.outputs else None
    if not shape:
        return False
    try:
        axis = int(node.params.get("axis", -1))
    except (TypeError, ValueError):
        return False
    return axis % len(shape) == len(shape) - 1
