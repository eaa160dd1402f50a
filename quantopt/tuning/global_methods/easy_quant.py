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
Factor 1 (the current range) is always a candidate, so a layer's cosine never decreases. Candidates are measured
on copies of the layer (`quantize_alone`); the searches return the chosen ranges, which are set once per layer on
the tensors' calibrated ranges (`min`/`max`, `min_key_axis`/`max_key_axis`).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import TensorRange, quant_of, ranges_of
from ...log import OPT_INFO
from ...ops._quant import activation_mode, is_signed, set_params
from ...progress import progress
from ...quant.params import QuantParams, linear_quant_params
from ...quantizer import quantize_graph
from ._common import (
    Batch,
    Range,
    capture,
    concat_cos,
    quantize_alone,
    range_honoured,
    run_alone,
    scaled,
    search_factors,
    set_range,
    skip_reason,
    target_layers,
)
from .spec import GlobalMethodSpec


def _channel_groups(channels: int, ngroups: int) -> List[slice]:
    if ngroups <= 0 or ngroups >= channels:
        return [slice(c, c + 1) for c in range(channels)]
    per = math.ceil(channels / ngroups)
    return [slice(i, min(i + per, channels)) for i in range(0, channels, per)]


def _outputs(node: PyNode, qnode: PyNode, xs: Sequence[torch.Tensor],
             input_params: Optional[Tuple[QuantParams, int]] = None,
             weight_range: Optional[Range] = None) -> List[torch.Tensor]:
    """Dequantized outputs of a copy of the layer quantized on its own (with the candidate input params and bits
    `input_params` and weight range `weight_range` when given), fed the float inputs `xs`."""
    def change(m: PyNode) -> None:
        if input_params is not None:  # the candidate's input params go in the copy's own table (graph/tables.py)
            set_params(m, m.inputs[0], *input_params)
        if weight_range is not None:
            set_range(m, m.constants["weights"], weight_range)

    probe = quantize_alone(node, qnode, change)
    return [run_alone(probe, [x]) for x in xs]


def _search_weights(node: PyNode, qnode: PyNode, xs, ys, factors: List[float], ngroups: int
                    ) -> Tuple[Optional[Range], str]:
    """The weight range chosen (None: keep the current one) and the log text; candidates are measured on copies."""
    w = node.constants["weights"]
    per_channel = quant_of(qnode).get(qnode.constants["weights"]).per_channel
    if not per_channel:
        r = ranges_of(node).get(w)
        lo, hi = r.min, r.max
        best_f, best = 1.0, -2.0
        for f in factors:
            c = concat_cos(ys, _outputs(node, qnode, xs, weight_range=(TensorRange(scaled(lo, f), scaled(hi, f)),)))
            if c > best + 1e-12 or (f == 1.0 and c >= best):
                best_f, best = f, c
        return (TensorRange(scaled(lo, best_f), scaled(hi, best_f)),), \
            f"weight range / {best_f:.4g} (cosine {best:.6f})"
    rc = ranges_of(node).channels(w)
    lo, hi, axis = rc.min.clone(), rc.max.clone(), rc.axis
    channels = int(lo.numel())
    groups = _channel_groups(channels, ngroups)
    scores = torch.full((len(factors), len(groups)), -2.0, dtype=torch.float64)
    for i, f in enumerate(factors):
        outs = _outputs(node, qnode, xs, weight_range=(TensorRange(lo / f, hi / f, axis),))
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
    chosen = (TensorRange(lo / scale, hi / scale, axis),)
    final = concat_cos(ys, _outputs(node, qnode, xs, weight_range=chosen))
    base = concat_cos(ys, _outputs(node, qnode, xs, weight_range=(TensorRange(lo, hi, axis),)))
    if final < base:
        return (TensorRange(lo, hi, axis),), f"weight ranges kept (cosine {base:.6f})"
    return chosen, (f"per-channel weight ranges / [{float(scale.min()):.4g}, {float(scale.max()):.4g}] over "
                    f"{len(groups)} group(s) (cosine {final:.6f})")


def _search_input(qgraph: PyGraph, node: PyNode, qnode: PyNode, xs, ys, factors: List[float],
                  weight_range: Optional[Range]) -> Tuple[Optional[Range], str]:
    """The input range chosen (None: keep the current one) with the layer's weights at `weight_range`, and the log
    text; candidates are measured on copies (the input params of a candidate range on the copy's clone of the
    quantized input, in the copy's own table)."""
    t, qt = node.inputs[0], qnode.inputs[0]
    producer = range_honoured(qgraph, t, qt)
    if producer is None:
        return None, "input range kept (its producer does not take it from the calibrated range)"
    r = ranges_of(node).get(t)
    lo, hi = r.min, r.max
    bits = int(quant_of(qnode).get(qt).qbits)
    signed = is_signed(qnode, qt)
    best_f, best = 1.0, -2.0
    for f in factors:
        p = linear_quant_params(scaled(lo, f), scaled(hi, f), bits, activation_mode(producer, bits), signed)
        c = concat_cos(ys, _outputs(node, qnode, xs, (p, bits), weight_range))
        if c > best + 1e-12 or (f == 1.0 and c >= best):
            best_f, best = f, c
    return (TensorRange(scaled(lo, best_f), scaled(hi, best_f)),), \
        f"input '{t.name}' range / {best_f:.4g} (cosine {best:.6f})"


def easy_quant(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Search weight and input ranges of every MAC layer in scope; returns the names of the layers visited."""
    data = list(batches[:spec.param("batches")])
    factors = search_factors(spec.param("alpha"), spec.param("beta"), spec.param("nsteps"))
    layers = target_layers(graph, spec)
    qgraph = quantize_graph(graph)
    kept = []
    for node in layers:
        reason = skip_reason(qgraph.node(node.name))
        if reason is None:
            kept.append(node)
        else:
            OPT_INFO(f"easy_quant: layer '{node.name}' skipped: {reason}")
    layers = kept
    ref_io = capture(reference, data, {n.name for n in layers})
    for epoch in range(spec.param("epochs")):  # qgraph is re-quantized after every layer
        for node in progress(layers, f"easy_quant epoch {epoch}"):
            xs = [io[0][0] for io in ref_io[node.name]]
            ys = [io[1][0] for io in ref_io[node.name]]
            qnode = qgraph.node(node.name)
            before = concat_cos(ys, _outputs(node, qnode, xs))
            w_range, w_msg = _search_weights(node, qnode, xs, ys, factors, spec.param("ngroups"))
            x_range, i_msg = _search_input(qgraph, node, qnode, xs, ys, factors, w_range)
            set_range(node, node.constants["weights"], w_range)
            if x_range is not None:
                set_range(node, node.inputs[0], x_range)
            qgraph = quantize_graph(graph)
            after = concat_cos(ys, _outputs(node, qgraph.node(node.name), xs))
            OPT_INFO(f"easy_quant epoch {epoch}: layer '{node.name}': {w_msg}; {i_msg}; isolated cosine "
                     f"{before:.6f} -> {after:.6f}")
    return [n.name for n in layers]
