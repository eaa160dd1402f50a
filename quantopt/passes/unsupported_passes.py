"""Upstream graph passes that need what quantopt does not have: `enable_pass_scaled_dot_product_attention` and
`enable_pass_convert_resize_to_convolution` (both off by default). Set true, they are a clear error where they
would change the model, never a silent no-op (docs/user-guide.md, "Graph passes").
"""
from __future__ import annotations

from typing import List

import networkx as nx

from ..errors import ConfigError
from ..graph.graph import PyGraph
from ..log import OPT_INFO

SDPA_FIELD = "enable_pass_scaled_dot_product_attention"
RESIZE_FIELD = "enable_pass_convert_resize_to_convolution"


def attention_candidates(graph: PyGraph) -> List[str]:
    """Softmax layers along their last axis whose only reader is a MatMul and that have a MatMul above them: the
    `softmax(Q K^T * s [+ mask]) V` chains upstream's pass fuses into one SDPAttention layer."""
    readers = {}
    for n in graph.nodes:
        for t in n.inputs:
            readers.setdefault(id(t), []).append(n)
    found = []
    for n in graph.nodes:
        if str(n.type) != "Softmax" or not n.inputs or len(n.outputs) != 1:
            continue
        rank = len(n.inputs[0].ir_shape)
        if rank == 0 or int(n.params.get("axis", -1)) % rank != rank - 1:
            continue
        slots = readers.get(id(n.outputs[0]), [])
        if len(slots) != 1 or str(slots[0].type) != "MatMul":
            continue
        above = nx.ancestors(graph.nx, n.name)
        if any(str(graph.node(a).type) == "MatMul" for a in above):
            found.append(n.name)
    return found


def check_scaled_dot_product_attention(graph: PyGraph) -> None:
    """`enable_pass_scaled_dot_product_attention = true`: an error when the graph has an attention chain to fuse
    (quantopt has no SDPAttention operator); without one, upstream's pass changes nothing, and neither does this."""
    found = attention_candidates(graph)
    if found:
        raise ConfigError(f"{SDPA_FIELD}: the attention around Softmax layer(s) {', '.join(found[:4])}"
                          f"{', ...' if len(found) > 4 else ''} would be fused into one SDPAttention layer, an "
                          "operator quantopt does not implement; set the field false", field=SDPA_FIELD)
    OPT_INFO(f"{SDPA_FIELD}: no Softmax-MatMul attention chain to fuse")


def refuse_convert_resize_to_convolution() -> None:
    """`enable_pass_convert_resize_to_convolution = true`: always an error (see the message)."""
    raise ConfigError(f"{RESIZE_FIELD}: upstream applies this rewrite (bilinear Resize as Convolution, DepthToSpace "
                      "and friends) only in its compat_quantized_model flow, where it is always on whatever this "
                      "field says, and ignores the field otherwise; quantopt's compat flow keeps Resize layers as they "
                      "are (docs/compat-quantized.md). Remove the field or set it false", field=RESIZE_FIELD)
