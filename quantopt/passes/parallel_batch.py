"""`export_parallel_batch`: the written quantized IR holds N copies of the model side by side, so the NPU runs N
batches at once.

Each Input layer's tensor grows N times along dim 0 (the names stay: they are the model's interface) and a Split
layer hands one slice to each copy; each copy is the quantized model with its layers and inner tensors renamed
`<name>_clone_<k>` (copy 0 keeps the names); each model output becomes the Concat along dim 0 of the copies'
outputs, under the output's own name. Split and Concat move integers only: every copy's tensors have the same
quantization, so the Concat needs no requantization. Run on N batches joined along dim 0, the written IR gives
exactly the integers of N runs of the single model. The in-memory quantized model, the ONNX QDQ export and the
report keep one copy.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

from ..graph.graph import PyGraph
from ..graph.names import unique_name
from ..graph.node import PyNode
from ..graph.tables import QuantTable
from ..graph.tensor import PyTensor
from ..registry.optype import OpType


def _joined(t: PyTensor, copies: int, name: str, axis: int, table: QuantTable, out: PyGraph) -> PyTensor:
    """A copy of `t` holding `copies` of it along `axis`, with `t`'s params in `table` as its params in `out`."""
    j = t.clone(name)
    out.quant.set(j, table.get(t).copy())
    shape = list(t.ir_shape)
    shape[axis] = int(shape[axis]) * copies
    j.ir_shape = tuple(shape)
    return j


def _layer(name: str, optype: str, inputs: List[PyTensor], outputs: List[PyTensor], like: PyNode,
           params: Dict) -> PyNode:
    n = PyNode(name, getattr(OpType, optype), like.layer_id)
    n.params = OrderedDict(params)
    n.inputs, n.outputs = inputs, outputs
    n.quantized, n.settings = like.quantized, like.settings
    n.params["is_perf_mode"] = like.params.get("is_perf_mode", True)
    n.params["unquantifiable"] = False
    return n


def parallel_copies(qgraph: PyGraph, copies: int, axis: int = 0) -> PyGraph:
    """A new graph with `copies` copies of the quantized `qgraph` (see the module docstring), joined along `axis`
    (`data_batch_dim`); `qgraph` is unchanged. `copies` <= 1 returns a plain clone."""
    base = qgraph.clone()
    if copies <= 1:
        return base
    out = type(qgraph)(qgraph.name)
    out.header = OrderedDict(base.header)
    out.source_file, out._storage, out.device = base.source_file, base._storage, base.device
    input_names = [t.name for t in base.input_tensors]
    output_names = [t.name for t in base.output_tensors]
    # every new name is checked against the model's own (a layer 'y_concat' beside the output 'y', two outputs of
    # one layer): graph/names.py
    layers_taken = {n.name for n in base.nodes}
    tensors_taken = {t.name for n in base.nodes for t in n.outputs}
    inner: Dict[str, List[PyTensor]] = {}  # model input name -> the copies' input tensors
    for t in base.input_tensors:
        inner[t.name] = [t.clone(unique_name(f"{t.name}_part{k}", tensors_taken)) for k in range(copies)]
        for part in inner[t.name]:
            out.quant.set(part, base.quant.get(t).copy())
    pieces: Dict[str, List[PyTensor]] = {name: [] for name in output_names}  # model output -> the copies' outputs
    for k in range(copies):
        source = base if k == 0 else qgraph.clone()
        rename: Dict[str, PyTensor] = {name: inner[name][k] for name in input_names}
        suffix = "" if k == 0 else f"_clone_{k - 1}"
        for n in source.nodes:
            if str(n.type) == "Input":
                continue
            # the copy's params move to `out` under the new names (read before a tensor is renamed)
            params = [(t, source.quant.get(t).copy()) for t in n.outputs + list(n.constants.values()) + n.placeholders]
            if suffix:
                n.name = unique_name(n.name + suffix, layers_taken)
            for t in n.outputs:
                old_name = t.name
                if old_name in output_names:
                    t.name = unique_name(f"{old_name}_part{k}", tensors_taken)
                    pieces[old_name].append(t)
                elif suffix:
                    t.name = unique_name(old_name + suffix, tensors_taken)
                rename[old_name] = t
            n.inputs = [rename.get(t.name, t) for t in n.inputs]
            for key, c in n.constants.items():
                c.name = n.name + key
            out.add_node(n)
            for t, q in params:
                out.quant.set(t, q)
    for t in base.input_tensors:
        node = t.pnode
        joined = _joined(t, copies, t.name, axis, base.quant, out)
        layer = _layer(node.name, "Input", [], [joined], node, node.params)
        out.add_node(layer)
        split = _layer(unique_name(f"{node.name}_split", layers_taken), "Split", [joined], inner[t.name], node,
                       {"axis": axis, "splits": [int(t.ir_shape[axis])] * copies})
        split.params["activation_quantization_axis"] = [None] * copies
        out.add_node(split)
    for name, t in zip(output_names, base.output_tensors):
        parts = pieces[name]
        concat = _layer(unique_name(f"{t.pnode.name}_concat", layers_taken), "Concat", parts,
                        [_joined(parts[0], copies, name, axis, out.quant, out)], t.pnode, {"axis": axis})
        concat.params["activation_quantization_axis"] = [None]
        out.add_node(concat)
    out.finalize()
    out.set_io(input_names, output_names)
    return out
