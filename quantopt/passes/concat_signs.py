"""One integer type for the branches of a Concat that joins per-channel activations on the channel axis.

Such a Concat passes its branches' integers through and joins their scales (ops/concat.py), so every branch needs
the same integer type. A branch after a RELU calibrates to [0, max] and would be unsigned while a branch without
one is signed (a U-Net's skip connection beside its upsampled path): rather than refusing the Concat, the producers
of the unsigned branches get signed outputs (`force_dtype_int`: one bit of their range, the cost of a per-tensor
Concat's requantization to a signed output). Decided on the copy being quantized, from the calibrated ranges,
before any layer is quantized; producers are found through the layers that pass per-channel scales on (Pooling,
GlobalPool, and channel Concats, whose branches then all take the sign). Different bits or a per-tensor branch
with a zero point stay the Concat's error.
"""
from __future__ import annotations

import dataclasses
from typing import List

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..log import OPT_INFO
from ..ops._per_channel import PER_CHANNEL_PRODUCERS
from .per_channel_fallback import concat_on_channels

PASS_ON = ("Pooling", "GlobalPool")
PER_CHANNEL_MODES = ("per_channel_symmetric_full_range", "per_channel_symmetric_restricted_range")


def sign_concat_branches(graph: PyGraph) -> List[str]:
    """Give signed outputs to the unsigned branch producers of channel Concats that join per-channel activations
    with signed ones; returns the layers changed (also listed in one info line)."""
    changed: List[str] = []
    for node in graph.nodes:
        if not _channel_concat(node):
            continue
        producers = [p for t in node.inputs for p in _producers(t.pnode)]
        if not any(_per_channel(p) for p in producers):
            continue
        signs = {p.name: _signed(p) for p in producers}
        if len(set(signs.values())) < 2:
            continue
        for p in producers:
            if not signs[p.name] and p.name not in changed:
                p.settings = dataclasses.replace(p.settings, force_dtype_int=True)
                changed.append(p.name)
    if changed:
        OPT_INFO(f"per-channel Concat branches of one integer type: {len(changed)} layer(s) give signed outputs "
                 f"({', '.join(repr(n) for n in changed)})")
    return changed


def _channel_concat(node: PyNode) -> bool:
    return str(node.type) == "Concat" and concat_on_channels(node)


def _producers(node: PyNode) -> List[PyNode]:
    """The layers whose integers reach a channel Concat unchanged through `node` (itself, or through pooling and
    nested channel Concats)."""
    if str(node.type) in PASS_ON and node.inputs:
        return _producers(node.inputs[0].pnode)
    if _channel_concat(node):
        return [p for t in node.inputs for p in _producers(t.pnode)]
    return [node]


def _per_channel(node: PyNode) -> bool:
    return node.settings is not None and str(node.settings.q_mode_activation) in PER_CHANNEL_MODES \
        and str(node.type) in PER_CHANNEL_PRODUCERS


def _signed(node: PyNode) -> bool:
    """Whether the layer's output will be signed: forced, or a calibrated range below 0."""
    if node.settings is not None and node.settings.force_dtype_int:
        return True
    r = ranges_of(node).get(node.outputs[0]) if node.outputs else None
    return r is not None and r.min is not None and float(r.min) < 0
