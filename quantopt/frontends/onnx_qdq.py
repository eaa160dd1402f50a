"""Import of a pre-quantized ONNX QDQ model (compat_quantized_model, docs/compat-quantized.md).

A QDQ model (what onnxruntime's `quantize_static` writes) holds float operators between QuantizeLinear /
DequantizeLinear pairs, with integer weights behind a DequantizeLinear. The pairs are taken out: each activation
tensor keeps the scale/zero point of its pair, each weight its integers and scales; the float model left over is
imported by the ONNX importer, and the given quantization is attached to the graph's tensors
(`quant/given.py`), which quantization then keeps instead of calibrating.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import UnsupportedError
from ..graph.graph import PyGraph, QuantizeGraph
from ..log import OPT_INFO, OPT_WARN
from ..quant.given import GIVEN_PARAMS, GIVEN_VALUES, dtype_of, from_onnx


@dataclass
class GivenQuant:
    """One ONNX tensor's quantization as the model gives it: x = (q - zero_point) * scale, per tensor or along
    `axis`; `values` holds a constant's integers."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: Optional[int]
    values: Optional[np.ndarray] = None

    def same(self, other: GivenQuant) -> bool:
        return (self.axis == other.axis and self.zero_point.dtype == other.zero_point.dtype and
                np.array_equal(self.scale, other.scale) and np.array_equal(self.zero_point, other.zero_point))


def _attr(node, name: str, default):  # noqa: ANN001 - an onnx NodeProto
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _broadcast(v: np.ndarray, rank: int, axis: Optional[int]) -> np.ndarray:
    if v.ndim == 0 or axis is None:
        return v
    shape = [1] * rank
    shape[axis % rank] = v.size
    return v.reshape(shape)


def strip_qdq(model, path: str = "<model>") -> Tuple[object, Dict[str, GivenQuant]]:  # noqa: ANN001
    """The float model without its Q/DQ nodes, and the given quantization of each ONNX tensor (activations by the
    tensor a QuantizeLinear read, constants by the DequantizeLinear output they became)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:  # Constant nodes holding scales or zero points
        if n.op_type == "Constant" and len(n.output) == 1:
            value = _attr(n, "value", None)
            if value is not None:
                inits[n.output[0]] = numpy_helper.to_array(value)

    def const(node, i: int, what: str) -> Optional[np.ndarray]:  # noqa: ANN001
        if len(node.input) <= i or not node.input[i]:
            return None
        if node.input[i] not in inits:
            raise UnsupportedError(f"{node.op_type} '{node.name}': its {what} '{node.input[i]}' must be a constant",
                                   file=path)
        return inits[node.input[i]]

    def params(node) -> GivenQuant:  # noqa: ANN001
        scale = const(node, 1, "scale")
        zp = const(node, 2, "zero point")
        if zp is None:
            zp = np.zeros_like(scale, dtype=np.uint8)
        if np.asarray(scale).dtype != np.float32:
            raise UnsupportedError(f"{node.op_type} '{node.name}': scale of type {np.asarray(scale).dtype} (float32 "
                                   "only)", file=path)
        if _attr(node, "block_size", 0):
            raise UnsupportedError(f"{node.op_type} '{node.name}': blocked quantization is not supported", file=path)
        axis = None if np.asarray(scale).ndim == 0 else int(_attr(node, "axis", 1))
        try:
            dtype_of(zp.dtype)
        except ValueError as e:
            raise UnsupportedError(f"{node.op_type} '{node.name}': {e}", file=path) from None
        return GivenQuant(np.asarray(scale, dtype=np.float32), np.asarray(zp), axis)

    given: Dict[str, GivenQuant] = {}
    drop: List[object] = []
    new_inits: List[object] = []
    rename: Dict[str, str] = {}
    nodes = list(graph.node)
    readers: Dict[str, List[object]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    for n in nodes:
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            p = params(n)
            q = inits[n.input[0]]
            f = (q.astype(np.int64) - _broadcast(p.zero_point.astype(np.int64), q.ndim, p.axis)).astype(np.float32) \
                * _broadcast(p.scale, q.ndim, p.axis)
            p.values = q
            given[n.output[0]] = p
            new_inits.append(numpy_helper.from_array(f.astype(np.float32), n.output[0]))
            drop.append(n)
        elif n.op_type == "QuantizeLinear":
            p = params(n)
            if p.axis is not None:
                raise UnsupportedError(f"QuantizeLinear '{n.name}': per-axis activation quantization is not "
                                       "supported", file=path)
            src = n.input[0]
            if n.output[0] in outputs:
                raise UnsupportedError(f"QuantizeLinear '{n.name}': an integer graph output is not supported",
                                       file=path)
            for r in readers.get(n.output[0], []):
                if r.op_type != "DequantizeLinear" or not params(r).same(p):
                    raise UnsupportedError(f"QuantizeLinear '{n.name}' is read by {r.op_type} '{r.name}': only "
                                           "QuantizeLinear -> DequantizeLinear pairs of the same params are "
                                           "supported", file=path)
                rename[r.output[0]] = src
                drop.append(r)
            if src in given and not given[src].same(p):
                raise UnsupportedError(f"tensor '{src}' is quantized twice with different params", file=path)
            given[src] = p
            drop.append(n)
    left = [n for n in nodes if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n not in drop]
    if left:
        raise UnsupportedError(f"{left[0].op_type} '{left[0].name}' is not part of a Q/DQ pair or a dequantized "
                               "constant", file=path)

    def final(name: str) -> str:
        while name in rename:
            name = rename[name]
        return name

    # a graph output that was a DequantizeLinear's output: its producer's tensor takes the output's name
    out_alias: Dict[str, str] = {}
    for o in graph.output:
        if o.name in rename:
            out_alias[final(o.name)] = o.name
    keep = [n for n in nodes if n not in drop]
    for n in keep:
        for i, name in enumerate(n.input):
            n.input[i] = out_alias.get(final(name), final(name))
        for i, name in enumerate(n.output):
            n.output[i] = out_alias.get(name, name)
    for src, dst in out_alias.items():
        if src in given:
            given[dst] = given.pop(src)
    for o in graph.output:
        o.name = out_alias.get(final(o.name), final(o.name))
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in keep for i in n.input}
    old = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(old + [i for i in new_inits if i.name in used])
    del graph.value_info[:]
    return model, given


def _weight_integers(w: torch.Tensor, p: GivenQuant) -> Optional[torch.Tensor]:
    """The integers of IR weights `w` (output channels on axis 0) under `p`, when they reproduce `w` exactly."""
    scale = torch.from_numpy(p.scale.reshape(-1).astype(np.float32))
    zp = torch.from_numpy(p.zero_point.reshape(-1).astype(np.int64))
    if scale.numel() > 1 and scale.numel() != w.shape[0]:
        return None
    shape = [-1] + [1] * (w.dim() - 1)
    s = scale.reshape(shape) if scale.numel() > 1 else scale
    z = zp.reshape(shape) if zp.numel() > 1 else zp
    q = torch.round(w.to(torch.float64) / s.to(torch.float64)).to(torch.int64) + z
    back = (q - z).to(torch.float32) * s
    if not torch.equal(back, w.to(torch.float32)):
        return None
    return q


def attach_given(graph: PyGraph, given: Mapping[str, GivenQuant], tensor_map: Mapping[str, str],
                 path: str = "<model>") -> Tuple[int, int]:
    """Put each given quantization on the graph's tensors; returns (activations, weight constants) attached."""
    by_name = {}
    for n in graph.nodes:
        for t in list(n.inputs) + list(n.outputs):
            by_name[t.name] = t
    acts = 0
    lost = []
    for name, p in given.items():
        if p.values is not None:
            continue
        ir = tensor_map.get(name)
        if ir is None or ir not in by_name:
            lost.append(name)
            continue
        try:
            by_name[ir].extra[GIVEN_PARAMS] = from_onnx(p.scale, p.zero_point, dtype_of(p.zero_point.dtype))
        except ValueError as e:
            raise UnsupportedError(f"tensor '{name}': {e}", file=path) from None
        acts += 1
    if lost:
        OPT_WARN(f"the quantization of {len(lost)} ONNX tensor(s) has no tensor after import (fused away): "
                 + ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else ""))
    consts = [p for p in given.values() if p.values is not None and p.values.dtype != np.int32]
    weights = 0
    float_layers: List[str] = []
    for n in graph.nodes:
        w = n.constants.get("weights")
        if w is None:
            continue
        vals = np.sort(w.betensor.detach().to(torch.float32).reshape(-1).numpy())
        match = None
        same_values = False
        for p in consts:
            if p.values.size != vals.size:
                continue
            f = (p.values.astype(np.int64) - _broadcast(p.zero_point.astype(np.int64), p.values.ndim, p.axis)) \
                .astype(np.float32) * _broadcast(p.scale, p.values.ndim, p.axis)
            if np.array_equal(np.sort(f.reshape(-1)), vals):
                same_values = True
                q = _weight_integers(w.betensor, p)
                if q is not None:
                    match = (p, q)
                    break
        if match is None and not same_values:  # float weights in the model: quantopt quantizes them
            float_layers.append(n.name)
            continue
        if match is None:
            raise UnsupportedError(f"layer '{n.name}' ({n.type}): its weights are not the integers of a "
                                   "DequantizeLinear with one scale per output channel (or per tensor)", file=path)
        p, q = match
        w.extra[GIVEN_PARAMS] = from_onnx(p.scale.reshape(-1) if p.axis is not None else p.scale,
                                          p.zero_point.reshape(-1) if p.axis is not None else p.zero_point,
                                          dtype_of(p.zero_point.dtype))
        w.extra[GIVEN_VALUES] = q
        weights += 1
    if float_layers:
        OPT_INFO(f"{len(float_layers)} layer(s) with float weights in the QDQ model, quantized by quantopt: "
                 + ", ".join(float_layers[:5]) + (", ..." if len(float_layers) > 5 else ""))
    return acts, weights


def import_onnx_qdq(path: str, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                    name: Optional[str] = None, graph_cls: type = QuantizeGraph,
                    input_values: Optional[Mapping[str, Sequence[float]]] = None) -> PyGraph:
    """A QDQ ONNX file as a float graph whose tensors carry the model's own quantization."""
    import onnx

    from .onnx import import_onnx

    path = str(path)
    try:
        model = onnx.load(path)
    except Exception as e:  # noqa: BLE001 - any failure to read is the same user error
        raise UnsupportedError(f"cannot read the ONNX model: {e}", file=path) from None
    stripped, given = strip_qdq(model, path)
    tensor_map: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="quantopt_qdq_") as tmp:
        float_path = os.path.join(tmp, os.path.basename(path))
        onnx.save(stripped, float_path)
        graph = import_onnx(float_path, input_shapes, name or os.path.splitext(os.path.basename(path))[0],
                            graph_cls=graph_cls, input_values=input_values, tensor_map=tensor_map)
    graph.source_file = path
    acts, weights = attach_given(graph, given, tensor_map, path)
    OPT_INFO(f"QDQ model {os.path.basename(path)}: given quantization of {acts} activation tensor(s) and "
             f"{weights} weight constant(s)")
    return graph
