"""easy_quant: per layer, grid-search the weight scale and then the input scale maximising output cosine.

For each MAC layer in scope (topological order, `epochs` passes), on the first `batches` calibration batches:
1. weights: with the input params fixed, the weight range is divided by each factor f of
   linspace(alpha, beta, nsteps) (scale f·S); the layer is quantized on its own and fed the reference float
   input quantized with its input params; the factor whose dequantized output has the highest cosine with the
   float output wins. Per-channel weights are searched per channel group (`ngroups` consecutive groups of
   output channels, 0 = every channel alone), each group judged on its own output channels.
2. input: with the weights fixed, the same search on the range of the layer's input tensor (the producer's
   output range), when the producer's quantization honours that range. A tensor read by several layers keeps the
   choice of the last one (upstream's rule).
Factor 1 (the current range) is always a candidate, so a layer's cosine never decreases. Results are the
tensors' calibrated ranges (`min`/`max`, `min_key_axis`/`max_key_axis`).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tensor import PyTensor
from ...log import OPT_INFO
from ...ops._quant import activation_mode, is_signed, set_params
from ...progress import progress
from ...quant.params import linear_quant_params
from ...quantizer import quantize_graph
from ._common import (
    Batch,
    capture,
    concat_cos,
    quantize_alone,
    range_honoured,
    run_alone,
    scaled,
    search_factors,
    target_layers,
)
from .spec import GlobalMethodSpec


def _channel_groups(channels: int, ngroups: int) -> List[slice]:
    if ngroups <= 0 or ngroups >= channels:
        return [slice(c, c + 1) for c in range(channels)]
    per = math.ceil(channels / ngroups)
    return [slice(i, min(i + per, channels)) for i in range(0, channels, per)]


def _outputs(node: PyNode, qnode: PyNode, xs: Sequence[torch.Tensor], input_params: Optional[PyTensor] = None):
    probe = quantize_alone(node, qnode, input_params)
    return [run_alone(probe, [x]) for x in xs]


def _search_weights(node: PyNode, qnode: PyNode, xs, ys, factors: List[float], ngroups: int) -> str:
    w = node.constants["weights"]
    per_channel = isinstance(qnode.constants["weights"].scale, torch.Tensor) and \
        qnode.constants["weights"].scale.numel() > 1
    if not per_channel:
        lo, hi = w.min, w.max
        best_f, best = 1.0, -2.0
        for f in factors:
            w.min, w.max = scaled(lo, f), scaled(hi, f)
            c = concat_cos(ys, _outputs(node, qnode, xs))
            if c > best + 1e-12 or (f == 1.0 and c >= best):
                best_f, best = f, c
        w.min, w.max = scaled(lo, best_f), scaled(hi, best_f)
        return f"weight range / {best_f:.4g} (cosine {best:.6f})"
    lo, hi = w.min_key_axis.clone(), w.max_key_axis.clone()
    channels = int(lo.numel())
    groups = _channel_groups(channels, ngroups)
    scores = torch.full((len(factors), len(groups)), -2.0, dtype=torch.float64)
    for i, f in enumerate(factors):
        w.min_key_axis, w.max_key_axis = lo / f, hi / f
        outs = _outputs(node, qnode, xs)
        for j, g in enumerate(groups):
            scores[i, j] = concat_cos([y[..., g] for y in ys], [y[..., g] for y in outs])
    one = factors.index(1.0)
    choice = []
    for j in range(len(groups)):
        best = int(torch.argmax(scores[:, j]))
        choice.append(one if scores[one, j] >= scores[best, j] else best)
    scale = torch.ones(channels, dtype=lo.dtype)
    for j, g in enumerate(groups):
        scale[g] = factors[choice[j]]
    w.min_key_axis, w.max_key_axis = lo / scale, hi / scale
    final = concat_cos(ys, _outputs(node, qnode, xs))
    w.min_key_axis, w.max_key_axis = lo, hi
    base = concat_cos(ys, _outputs(node, qnode, xs))
    if final < base:
        return f"weight ranges kept (cosine {base:.6f})"
    w.min_key_axis, w.max_key_axis = lo / scale, hi / scale
    return (f"per-channel weight ranges / [{float(scale.min()):.4g}, {float(scale.max()):.4g}] over {len(groups)} "
            f"group(s) (cosine {final:.6f})")


def _search_input(qgraph: PyGraph, node: PyNode, qnode: PyNode, xs, ys, factors: List[float]) -> str:
    t, qt = node.inputs[0], qnode.inputs[0]
    producer = range_honoured(qgraph, t, qt)
    if producer is None:
        return "input range kept (its producer does not take it from the calibrated range)"
    lo, hi = t.min, t.max
    bits = int(qt.qbits)
    best_f, best = 1.0, -2.0
    for f in factors:
        cand = qt.clone()
        p = linear_quant_params(scaled(lo, f), scaled(hi, f), bits, activation_mode(producer, bits), is_signed(qt))
        set_params(cand, p, bits)
        c = concat_cos(ys, _outputs(node, qnode, xs, cand))
        if c > best + 1e-12 or (f == 1.0 and c >= best):
            best_f, best = f, c
    t.min, t.max = scaled(lo, best_f), scaled(hi, best_f)
    return f"input '{t.name}' range / {best_f:.4g} (cosine {best:.6f})"


def easy_quant(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Search weight and input ranges of every MAC layer in scope; returns the names of the layers visited."""
    data = list(batches[:spec.param("batches")])
    factors = search_factors(spec.param("alpha"), spec.param("beta"), spec.param("nsteps"))
    layers = target_layers(graph, spec)
    ref_io = capture(reference, data, {n.name for n in layers})
    for epoch in range(spec.param("epochs")):
        qgraph = quantize_graph(graph)
        for node in progress(layers, f"easy_quant epoch {epoch}"):
            xs = [io[0][0] for io in ref_io[node.name]]
            ys = [io[1][0] for io in ref_io[node.name]]
            qnode = qgraph.node(node.name)
            before = concat_cos(ys, _outputs(node, qnode, xs))
            w_msg = _search_weights(node, qnode, xs, ys, factors, spec.param("ngroups"))
            i_msg = _search_input(qgraph, node, qnode, xs, ys, factors)
            qgraph = quantize_graph(graph)
            after = concat_cos(ys, _outputs(node, qgraph.node(node.name), xs))
            OPT_INFO(f"easy_quant epoch {epoch}: layer '{node.name}': {w_msg}; {i_msg}; isolated cosine "
                     f"{before:.6f} -> {after:.6f}")
    return [n.name for n in layers]
