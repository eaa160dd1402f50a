"""adaround: learn, for every weight of a MAC layer, whether it rounds down or up (AdaRound, Nagel et al. 2020).

Per layer in scope, in topological order (each after re-quantizing the graph with the roundings chosen so far):
the weight scale S, zero point zp and integer range come from the quantized graph; every weight gets a
continuous variable α (initialised so that the soft rounding h(α) equals the fractional part of w·S) with the
rectified sigmoid h(α) = clamp(σ(α)(ζ − γ) + γ, 0, 1), γ = −0.1, ζ = 1.1. Adam (learning rate `lr`) minimises
the reconstruction loss — squared error summed over the last axis, averaged — between the layer's float output
(reference graph, fused activation included) and its output with the soft-quantized weights
(clamp(⌊w·S⌋ + h(α) − zp, qmin, qmax) + zp) / S fed the dequantized input the quantized graph really gives the
layer, plus after the first `warm_start` fraction of iterations reg_param · Σ(1 − |2h − 1|^β) with β annealed
(cosine) from beta_start to beta_end. Samples of `batches` calibration batches are concatenated, padded by
repetition to a multiple of `batch_size`, shuffled per epoch with a fixed seed.

The final integer weights are ⌊w·S⌋ + [α ≥ 0] (clamped). If their loss is not below that of rounding to
nearest, the layer keeps rounding to nearest. The choice is folded into the layer's float weights: a weight
whose rounding changes moves just inside its chosen rounding cell (by less than one quantization step), so the
unchanged calibrated ranges and the regular quantize function produce exactly the chosen integers.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

from ...graph.graph import PyGraph
from ...log import OPT_INFO
from ...progress import progress
from ...quant.params import quantize
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import SEED, Batch, capture, float_apply, pad_samples, skip_reason, target_layers, weight_quant
from .spec import GlobalMethodSpec

GAMMA, ZETA = -0.1, 1.1
"""Stretch of the rectified sigmoid (AdaRound's defaults, as upstream)."""
CELL_MARGIN = 0.49
"""A moved weight lands at most this far (in quantization steps) from its chosen integer: safely inside the cell."""


def _h(alpha: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(alpha) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def _recon(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    with one_thread():  # a full float sum: the same at any thread count (threads.py)
        return (pred - target).pow(2).sum(-1).mean()


class _Grid:
    """The weight quantization grid of one layer: rounding offsets r in [0, 1] -> dequantized weights."""

    def __init__(self, floor: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> None:
        self.floor, self.scale, self.zp, self.qmin, self.qmax = floor, scale, zp, qmin, qmax

    def weights(self, r: torch.Tensor) -> torch.Tensor:
        return (torch.clamp(self.floor + r - self.zp, self.qmin, self.qmax) + self.zp) / self.scale


def adaround(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Learn the rounding of every MAC layer in scope; returns the names of the layers whose weights changed."""
    data = list(batches[:spec.param("batches")])
    epochs, batch_size = spec.param("epochs"), spec.param("batch_size")
    lr, reg = float(spec.param("lr")), float(spec.param("reg_param"))
    beta_start, beta_end, warm = float(spec.param("beta_start")), float(spec.param("beta_end")), \
        float(spec.param("warm_start"))
    layers = target_layers(graph, spec)
    ref_io = capture(reference, data, {n.name for n in layers})
    changed = []
    for index, node in enumerate(progress(layers, "adaround")):
        qgraph = quantize_graph(graph)
        qnode = qgraph.node(node.name)
        reason = skip_reason(qnode)
        if reason is not None:
            OPT_INFO(f"adaround: layer '{node.name}' skipped: {reason}")
            continue
        q_io = capture(qgraph, data, {node.name}, quantized=True)
        x = pad_samples(torch.cat([io[0][0] for io in q_io[node.name]], dim=0), batch_size)
        y = pad_samples(torch.cat([io[1][0] for io in ref_io[node.name]], dim=0), batch_size)
        scale, zp, qmin, qmax = weight_quant(qnode)
        wt = node.constants["weights"]
        w = wt.betensor.to(torch.float32)
        b_t = node.constants.get("biases")
        b = b_t.betensor.to(torch.float32) if b_t is not None else None
        ws = w * scale
        floor = torch.floor(ws)
        rest = torch.clamp(ws - floor, 0.0, 1.0)
        alpha = torch.nn.Parameter(-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0))

        grid = _Grid(floor, scale, zp, qmin, qmax)
        nearest = torch.clamp(torch.round(ws) - floor, 0.0, 1.0)
        with torch.no_grad():
            loss_nearest = float(_recon(float_apply(node, x, grid.weights(nearest), b, activation=True), y))
        opt = torch.optim.Adam([alpha], lr=lr)
        gen = torch.Generator().manual_seed(SEED + index)
        samples = int(x.shape[0])
        iterations = samples // batch_size
        total = max(1, iterations * epochs)
        warm_end = warm * total
        step = 0
        for _ in range(epochs):
            order = torch.randperm(samples, generator=gen)
            for i in range(iterations):
                idx = order[i * batch_size:(i + 1) * batch_size]
                opt.zero_grad()
                h = _h(alpha)
                loss = _recon(float_apply(node, x[idx], grid.weights(h), b, activation=True), y[idx])
                if step >= warm_end and reg > 0:
                    ratio = (step - warm_end) / max(total - warm_end, 1e-12)
                    beta = beta_end + 0.5 * (beta_start - beta_end) * (1 + math.cos(ratio * math.pi))
                    loss = loss + reg * (1.0 - (2 * h - 1).abs().pow(beta)).sum()
                loss.backward()
                opt.step()
                step += 1
        learned = (alpha.detach() >= 0).to(torch.float32)
        with torch.no_grad():
            loss_learned = float(_recon(float_apply(node, x, grid.weights(learned), b, activation=True), y))
        chosen = learned if loss_learned < loss_nearest else nearest
        target = torch.clamp(floor + chosen - zp, qmin, qmax)
        current = quantize(w, scale, zp, qmin, qmax)
        flips = int((current != target.to(torch.int64)).sum())
        if chosen is nearest or flips == 0:
            OPT_INFO(f"adaround: layer '{node.name}': rounding to nearest kept (loss {loss_nearest:.6g}, learned "
                     f"{loss_learned:.6g})")
            continue
        v = torch.clamp(ws - zp, target - CELL_MARGIN, target + CELL_MARGIN)
        new_w = (v + zp) / scale
        bad = quantize(new_w, scale, zp, qmin, qmax) != target.to(torch.int64)
        if bool(bad.any()):
            new_w = torch.where(bad, (target + zp) / scale, new_w)
        if bool((quantize(new_w, scale, zp, qmin, qmax) != target.to(torch.int64)).any()):
            OPT_INFO(f"adaround: layer '{node.name}': the learned rounding cannot be expressed in float weights; "
                     "rounding to nearest kept")
            continue
        wt.betensor = new_w.to(wt.betensor.dtype)
        changed.append(node.name)
        OPT_INFO(f"adaround: layer '{node.name}': {flips} of {w.numel()} weights round the other way; "
                 f"reconstruction loss {loss_nearest:.6g} (nearest) -> {loss_learned:.6g}")
    return changed
