"""Empirical bias correction: shift each MAC layer's biases by the mean per-channel error of its quantized output.

For a layer with float weights W and biases b, on calibration batches: y_f = W*x_f (the reference float graph's
input x_f) and y_q = W_q*x_q (the dequantized weights W_q and the dequantized input x_q the quantized graph
really feeds the layer, upstream errors included), both before the bias and the fused activation. The expected
error E[y_f - y_q] per output channel (mean over batches and every non-channel position) is added to the biases,
so the quantized layer's output has the float output's mean. Layers are corrected in topological order, each
after re-quantizing the graph, so a layer sees the corrected outputs of the layers before it.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from ...graph.graph import PyGraph
from ...graph.tensor import PyTensor
from ...log import OPT_INFO
from ...progress import progress
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import Batch, capture, channels_last, dequantized_weights, float_apply, skip_reason, target_layers
from .spec import GlobalMethodSpec


def bias_correction(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Correct the biases of every MAC layer in scope; returns the names of the layers changed."""
    data = list(batches[:spec.param("batches")])
    layers = target_layers(graph, spec)
    ref_io = capture(reference, data, {n.name for n in layers})
    changed = []
    for node in progress(layers, "bias_correction"):
        rnode = reference.node(node.name)
        qgraph = quantize_graph(graph)
        reason = skip_reason(qgraph.node(node.name))
        if reason is not None:
            OPT_INFO(f"bias_correction: layer '{node.name}' skipped: {reason}")
            continue
        q_io = capture(qgraph, data, {node.name}, quantized=True)
        w_q = dequantized_weights(qgraph.node(node.name))
        w_f = rnode.constants["weights"].betensor
        channels = int(w_f.shape[0])
        diffs = []
        with torch.no_grad():
            for (xf, _), (xq, _) in zip(ref_io[node.name], q_io[node.name]):
                y_f = float_apply(rnode, xf[0], w_f, None, activation=False).to(torch.float64)
                y_q = float_apply(node, xq[0], w_q.to(w_f.dtype), None, activation=False).to(torch.float64)
                diffs.append(channels_last(y_f - y_q, channels))
        d = torch.cat(diffs, dim=0)
        delta = d.mean(dim=0)
        with one_thread():  # full float sums: the same at any thread count (threads.py)
            before = float((d ** 2).mean())
            after = float(((d - delta) ** 2).mean())
        if not after < before:
            OPT_INFO(f"bias_correction: layer '{node.name}' unchanged (pre-activation mse {before:.6g})")
            continue
        ref_b = rnode.constants.get("biases")
        base = ref_b.betensor.reshape(-1).to(torch.float64) if ref_b is not None else torch.zeros(channels,
                                                                                                   dtype=torch.float64)
        b = node.constants.get("biases")
        if b is None:
            b = PyTensor(f"{node.name}/biases", torch.zeros(channels, dtype=torch.float32), shape=[channels])
            node.constants["biases"] = b
        b.betensor = (base + delta).to(b.betensor.dtype).reshape(b.betensor.shape)
        changed.append(node.name)
        OPT_INFO(f"bias_correction: layer '{node.name}': biases shifted by up to {float(delta.abs().max()):.6g} "
                 f"(mean |shift| {float(delta.abs().mean()):.6g}); pre-activation mse {before:.6g} -> {after:.6g}")
    return changed
