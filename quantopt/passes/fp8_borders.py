"""Borders of fp8 layers (quant_type w*afp8*, docs/low-bit.md): DeQuantize + Quantize pairs where a tensor changes
between fp8 and integer (or between the two fp8 types), inserted in the quantized copy before quantization.

Which tensors are fp8 follows from the layers: the output of a layer with fp8 activations (ops/_fp8.py), and the
outputs of a shape-only layer whose data input is fp8 (it passes the values on with the input's params). Every other
layer is an integer layer. On each edge where the tensor's kind differs from what its consumer reads, a DeQuantize
(to float16) then a Quantize (to the consumer's kind) convert it, one pair per tensor and target, as upstream does
before an fp8 layer that reads an integer tensor (its lib has no direct fp8 ↔ integer cast). Upstream inserts
nothing on an fp8 → integer edge and fails there (its integer layer reads the fp8 values as integers); quantopt
inserts the same pair (docs/low-bit.md).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..config.kinds_accuracy import parse_trigger_float
from ..config.quant_types import FP8_ACTIVATION_TYPES
from ..errors import UnsupportedError
from ..graph.graph import PyGraph
from ..graph.names import unique_name as _unique
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_INFO, OPT_WARN
from ..ops._fp8 import layer_formats
from ..quant.dtype import Dtype
from ..registry.optype import OpType
from .float_islands import new_border_layer

SHAPE_ONLY = frozenset(("Reshape", "Permute", "Transpose", "Squeeze", "Tile", "Repeat", "StridedSlice", "Slice",
                        "Split", "Crop", "SpaceToDepth", "DepthToSpace", "SpaceToBatch", "BatchToSpace",
                        "BatchToDepth"))
"""Layers that carry an fp8 data input (input 0) on to their outputs unchanged (upstream's shape-only list, less Pad,
whose pad value quantopt's integer Pad computes as an integer)."""
BORDER_FLOAT = Dtype.FP16
"""The float type between the DeQuantize and the Quantize of a border (upstream's)."""


def _new(graph: PyGraph, optype: OpType, name: str, src: PyTensor, out_name: str, consumer: PyNode) -> PyNode:
    return new_border_layer(graph, optype, name, src, out_name, consumer.layer_id, consumer.settings)



def _check_no_float_layers(graph: PyGraph, fp8: Dict[str, Dtype]) -> None:
    for n in graph.nodes:
        value = getattr(n.settings, "trigger_float_op", "disable") if n.settings is not None else "disable"
        if parse_trigger_float(value) is not None:
            first = next(iter(fp8))
            raise UnsupportedError(f"layer '{n.name}' runs in float (trigger_float_op = {value}) in a graph with fp8 "
                                   f"layers ('{first}', ...): quantopt does not combine float layers with fp8 "
                                   "activations yet; use one or the other", field="quant_type")


def insert_fp8_borders(graph: PyGraph) -> List[str]:
    """Insert the DeQuantize/Quantize pairs at the fp8 borders of `graph` (the quantized copy, before
    quantization); returns the inserted layer names ([] when no layer has fp8 activations)."""
    fp8 = {}
    for n in graph.nodes:
        f = layer_formats(n)
        if f is not None and not (str(n.type) == "Input" and not n.outputs[0].ir_dtype.is_float):
            fp8[n.name] = f[0]
    if not fp8:
        asked = sorted({n.settings.quant_type for n in graph.nodes
                        if n.settings is not None and n.settings.quant_type in FP8_ACTIVATION_TYPES})
        if asked:
            OPT_WARN(f"quant_type {', '.join(asked)}: no layer of this graph gets fp8 activations (upstream has fp8 "
                     "kernels only for the layer types of docs/low-bit.md); every layer is an integer layer")
        return []
    _check_no_float_layers(graph, fp8)
    taken = {n.name for n in graph.nodes} | set(graph.tensors())
    kind: Dict[int, Optional[Dtype]] = {}  # id(tensor) -> its fp8 dtype, None for an integer tensor
    converted: Dict[Tuple[int, Optional[Dtype]], PyTensor] = {}
    inserted: List[str] = []
    for n in list(graph.nodes):
        want = fp8.get(n.name)
        data_inputs = range(len(n.inputs)) if want is not None or str(n.type) not in SHAPE_ONLY else range(1)
        passes_fp8 = str(n.type) in SHAPE_ONLY and n.inputs and kind.get(id(n.inputs[0])) is not None
        for i in data_inputs:
            t = n.inputs[i]
            have = kind.get(id(t))
            target = want if want is not None else (have if passes_fp8 else None)
            if have == target:
                continue
            key = (id(t), target)
            if key not in converted:
                base = f"{t.name}_{target.value}" if target is not None else f"{t.name}_int"
                d = _new(graph, OpType.DeQuantize, _unique(f"{base}_dequantize", taken), t,
                         _unique(f"{base}_dq", taken), n)
                d.outputs[0].dtype = d.outputs[0].ir_dtype = BORDER_FLOAT
                d.params["unquantifiable"] = True
                q = _new(graph, OpType.Quantize, _unique(f"{base}_quantize", taken), d.outputs[0],
                         _unique(f"{base}_q", taken), n)
                if target is not None:
                    q.attrs["fp8_output"] = target
                kind[id(q.outputs[0])] = target
                converted[key] = q.outputs[0]
                inserted += [d.name, q.name]
            n.inputs[i] = converted[key]
        out_kind = want if want is not None else (kind.get(id(n.inputs[0])) if passes_fp8 else None)
        for t in n.outputs:
            kind[id(t)] = out_kind
    graph.finalize(graph.source_file)
    graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    OPT_INFO(f"fp8 activations: {len(fp8)} fp8 layer(s); inserted {len(inserted)} DeQuantize/Quantize layer(s)")
    return inserted


__all__ = ["BORDER_FLOAT", "SHAPE_ONLY", "insert_fp8_borders"]
