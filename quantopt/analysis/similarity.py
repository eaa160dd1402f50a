"""Per-layer precision of the quantized graph: cosine similarity and MSE against the float graph.

Two views per layer output, averaged over the given batches:
* cumulative: the float graph and the integer graph each run on their own upstream results, so a layer's error
  includes everything accumulated before it (what the final output sees);
* isolated: each quantized layer is fed the float graph's inputs quantized with its own input params, so the
  error is the layer's own (what tells a user which layer is to blame).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

import torch

from ..graph.float_layer import round_to_float_dtype
from ..graph.graph import PyGraph
from ..graph.tensor import PyTensor
from ..quant.params import dequantize, quantize


@dataclass
class LayerSimilarity:
    layer_id: int
    name: str
    type: str
    tensor: str
    cumulative_cos: float
    cumulative_mse: float
    isolated_cos: float
    isolated_mse: float

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors as flat float64 vectors; two all-zero tensors count as identical."""
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 and ny == 0.0:
        return 1.0
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return float(torch.dot(x, y) / (nx * ny))


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    return float(((x - y) ** 2).mean()) if x.numel() else 0.0


def to_float(t: PyTensor) -> torch.Tensor:
    """Dequantized values of a quantized tensor (integer tensors used as is)."""
    if t.qinvariant or t.qmin is None:
        return t.betensor.to(torch.float32)
    return dequantize(t.betensor, t.scale, t.zerop)


def to_quantized(x: torch.Tensor, like: PyTensor) -> torch.Tensor:
    """Float values quantized with the params of the quantized tensor `like` (a float tensor of a float island:
    the values rounded to its float type)."""
    if like.qmin is None:
        return round_to_float_dtype(x.to(torch.float32), like.dtype)
    if like.qinvariant:
        return torch.clamp(torch.round(x.to(torch.float64)), like.qmin, like.qmax).to(torch.int64)
    return quantize(x, like.scale, like.zerop, like.qmin, like.qmax)


def layer_similarity(float_graph: PyGraph, quant_graph: PyGraph,
                     batches: Sequence[Sequence[torch.Tensor]]) -> List[LayerSimilarity]:
    """Cumulative and isolated similarity of every layer output, averaged over `batches`."""
    sums: Dict[tuple, List[float]] = {}
    qnodes = {n.name: n for n in quant_graph.nodes}
    with torch.no_grad():
        for inputs in batches:
            float_graph.forward(inputs, keep_tensors=True)
            quant_graph.forward(inputs, keep_tensors=True)
            for fnode in float_graph.nodes:
                qnode = qnodes.get(fnode.name)
                if qnode is None:
                    continue
                cumulative = [(cosine(f.betensor, to_float(q)), mse(f.betensor, to_float(q)))
                              for f, q in zip(fnode.outputs, qnode.outputs)]
                isolated = _isolated(fnode, qnode)
                for f, c, i in zip(fnode.outputs, cumulative, isolated):
                    acc = sums.setdefault((fnode.name, f.name), [0.0, 0.0, 0.0, 0.0])
                    for k, v in enumerate(c + i):
                        acc[k] += v
            _release(float_graph)
            _release(quant_graph)
    n = max(len(batches), 1)
    results = []
    for fnode in float_graph.nodes:
        for f in fnode.outputs:
            acc = sums.get((fnode.name, f.name))
            if acc is None:
                continue
            cum_cos, cum_mse, iso_cos, iso_mse = (v / n for v in acc)
            qt = qnodes[fnode.name].outputs[fnode.outputs.index(f)]
            qt.similarity, qt.mse = cum_cos, cum_mse
            results.append(LayerSimilarity(fnode.layer_id, fnode.name, str(fnode.type), f.name, cum_cos, cum_mse,
                                           iso_cos, iso_mse))
    return results


def _isolated(fnode, qnode) -> List[tuple]:
    """Run the quantized layer alone on the float graph's inputs quantized with its input params."""
    if not qnode.inputs:
        return [(cosine(f.betensor, to_float(q)), mse(f.betensor, to_float(q)))
                for f, q in zip(fnode.outputs, qnode.outputs)]
    saved_in = [t.betensor for t in qnode.inputs]
    saved_out = [t.betensor for t in qnode.outputs]
    try:
        for qt, ft in zip(qnode.inputs, fnode.inputs):
            qt.betensor = to_quantized(ft.betensor, qt)
        qnode.forward()
        return [(cosine(f.betensor, to_float(q)), mse(f.betensor, to_float(q)))
                for f, q in zip(fnode.outputs, qnode.outputs)]
    finally:
        for t, v in zip(qnode.inputs, saved_in):
            t.betensor = v
        for t, v in zip(qnode.outputs, saved_out):
            t.betensor = v


def _release(graph: PyGraph) -> None:
    keep = {id(t) for t in graph.input_tensors}
    for n in graph.nodes:
        for t in n.outputs:
            if id(t) not in keep:
                t.release()


def worst_layers_table(results: Sequence[LayerSimilarity], count: int = 10) -> str:
    """A text table of the layers with the lowest isolated cosine (ties: lowest cumulative cosine)."""
    if not results:
        return "per-layer similarity: no layers"
    rows = sorted(results, key=lambda r: (r.isolated_cos, r.cumulative_cos))[:count]
    width = max(len(r.name) for r in rows)
    lines = [f"worst {len(rows)} of {len(results)} layer outputs by isolated cosine (the layer's own error):",
             f"{'id':>4}  {'layer':<{width}}  {'type':<16} {'isolated cos':>12} {'isolated mse':>12} "
             f"{'cumul. cos':>11} {'cumul. mse':>11}"]
    for r in rows:
        lines.append(f"{r.layer_id:>4}  {r.name:<{width}}  {r.type:<16} {r.isolated_cos:>12.6f} "
                     f"{r.isolated_mse:>12.4g} {r.cumulative_cos:>11.6f} {r.cumulative_mse:>11.4g}")
    return "\n".join(lines)
