"""Signed initial states for the recurrent layers (docs/semantics/recurrent.md, "Cast of an unsigned initial state").

Upstream's backend takes a BasicLSTM's initial states (inputs 1 and 2) and a GRU's (input 1) as signed integers of
the layer's activation width only, so its optimizer inserts a `Cast` (to int8/int16, `ignore_scale_zp`, saturating)
on every such edge whose tensor is unsigned: the usual zero initial state is a Constant quantized as uint8 of scale
1. `quantize_graph` calls `insert_recurrent_state_casts` on the quantized copy after every layer is quantized, so
quantopt's IR has the same layers.

A Cast is inserted only where it is exact: the state holds integers of a quantized Constant, read directly or
through data-movement layers that keep its dtype, scale and zero point (a bidirectional or stacked layer's zero
states are Reshapes of a Split of one Constant), and all that Constant's stored integers lie in the signed range
(then saturation never changes a value, and the Cast keeps the scale and zero point). Upstream casts
any unsigned state and saturates codes above 2^(B-1) - 1; quantopt leaves such a state unsigned (its recurrent
layers read either signedness exactly). One Cast per edge, as upstream (a BasicLSTM reading the same constant as
both states gets two). Names are deterministic: the layer `<producer>_Cast_<k>`, the output tensor
`<tensor>_Cast_tensor_` then `<tensor>_Cast_tensor__<k>` (upstream's tensor names; its layer names carry run-dependent
numbers, which the golden comparison pairs by position: tests/golden_helpers.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.params import integer_range
from ..registry.optype import OpType

STATE_INPUTS: Dict[str, Tuple[int, ...]] = {"BasicLSTM": (1, 2), "GRUv1": (1,), "GRUv3": (1,)}
"""The initial-state inputs of each recurrent type, which upstream's backend takes signed."""

SIGNED = {8: Dtype.INT8, 16: Dtype.INT16}


MOVES = frozenset({"Reshape", "Squeeze", "Transpose", "Permute", "Split", "Slice", "StridedSlice"})
"""Data-movement layers: each output integer is one of the input's integers (docs/semantics: passthrough)."""


def _same_codes(graph: PyGraph, a: PyTensor, b: PyTensor) -> bool:
    """`a` and `b` hold integers of one dtype, scale and zero point (a passthrough layer's input and output)."""
    qa, qb = graph.quant.get(a), graph.quant.get(b)
    if a.dtype != b.dtype or qa.per_channel or qb.per_channel:
        return False
    return float(qa.scale) == float(qb.scale) and int(qa.zerop) == int(qb.zerop)


def _constant_source(graph: PyGraph, t: PyTensor) -> Optional[PyNode]:
    """The quantized Constant whose integers `t` holds a selection of: `t` itself or `t` reached from it through
    data-movement layers that keep dtype, scale and zero point (a bidirectional layer's zero state is a Split and
    Reshapes of one Constant); None for any other producer."""
    while t.pnode is not None and str(t.pnode.type) in MOVES and t.pnode.inputs and t.pnode.quantized:
        src = t.pnode.inputs[0]
        if not _same_codes(graph, src, t):
            return None
        t = src
    return t.pnode


def _exact_constant(graph: PyGraph, t: PyTensor, lo: int, hi: int) -> bool:
    """`t` holds integers of a quantized Constant (`_constant_source`) whose stored integers all lie in [lo, hi]."""
    p = _constant_source(graph, t)
    if p is None or str(p.type) != "Constant" or not p.quantized or "weights" not in p.constants:
        return False
    w = p.constants["weights"].betensor
    if w.is_floating_point() and not bool((w == torch.round(w)).all()):
        return False
    return w.numel() == 0 or (int(w.min()) >= lo and int(w.max()) <= hi)


def _unique(base: str, taken: set, sep: str) -> str:
    """`base` itself, else `base<sep>0`, `base<sep>1`, ... (the first name not taken)."""
    name, k = base, 0
    while name in taken:
        name, k = f"{base}{sep}{k}", k + 1
    taken.add(name)
    return name


def _cast_layer(graph: PyGraph, consumer: PyNode, src: PyTensor, dtype: Dtype, taken: set) -> PyNode:
    """A quantized Cast of `src` to `dtype` keeping its scale and zero point (its output range the full dtype)."""
    name = _unique(f"{src.pnode.name}_Cast", taken, "_")
    node = PyNode(name, OpType.Cast, consumer.layer_id)
    node.additional = True
    node.settings = consumer.settings
    node.inputs = [src]
    out = src.clone(_unique(f"{src.name}_Cast_tensor_", taken, "_"))
    graph.ranges.copy_from(graph.ranges, src, out)  # its source's calibrated range (graph/tables.py)
    out.dtype = dtype
    q = graph.quant.get(src).copy()  # its source's scale and zero point, the full range of `dtype`
    q.qbits = dtype.bits
    q.qmin, q.qmax = integer_range(dtype.bits, True)
    graph.quant.set(out, q)
    out.pnode = node
    node.outputs = [out]
    node.params["to_dtype"] = dtype
    node.params["ignore_scale_zp"] = True
    node.params["clip_mode"] = "SATURATION"
    node.params["is_perf_mode"] = True
    node.params["unquantifiable"] = False
    node.params["activation_quantization_axis"] = [None]
    node.quantized = True
    graph.add_node(node)
    return node


def insert_recurrent_state_casts(graph: PyGraph) -> List[str]:
    """Insert the exact Casts of unsigned initial states of quantized recurrent layers (see the module doc); returns
    the inserted layer names in graph order."""
    taken = {n.name for n in graph.nodes} | set(graph.tensors())
    inserted: List[str] = []
    for n in list(graph.nodes):
        indices = STATE_INPUTS.get(str(n.type))
        if indices is None or not n.quantized or not n.outputs:
            continue
        dtype = SIGNED.get(n.outputs[0].dtype.bits) if n.outputs[0].dtype.is_signed else None
        if dtype is None:
            continue
        lo, hi = integer_range(dtype.bits, True)
        for i in indices:
            if i >= len(n.inputs):
                continue
            t = n.inputs[i]
            if t.dtype.is_float or t.dtype.is_signed or not _exact_constant(graph, t, lo, hi):
                continue
            cast = _cast_layer(graph, n, t, dtype, taken)
            n.inputs[i] = cast.outputs[0]
            inserted.append(cast.name)
    if inserted:
        graph.finalize(graph.source_file)
        graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    return inserted
