"""awq_zy: activation-aware per-channel scaling of Norm -> FullyConnected pairs (AWQ, Lin et al. 2023).

Same pairs and folding as smooth_quant_zy (docs/global-calibration.md): the norm's affine parameters are divided
by σ_c and column c of every FullyConnected's weights multiplied by it, which keeps the float model's outputs. AWQ
searches σ = s / sqrt(max(s)·min(s)) with s_c = max(mean|X_c|, 1e-4)^α for α = r/n_grid, r = 0..n_grid (α = 0 is
no scaling), X the norm's output on the calibration batches given, keeping the σ whose pair's FullyConnected
outputs (quantized on their own, the norm fed its float input quantized with its input params) have the lowest
MSE against the float outputs. Then, when max_shrink > 0, the weight ranges of the pair's FullyConnected layers
are multiplied by 1 − r/n_grid for r = 0..⌊max_shrink·n_grid⌋ − 1 (clipping), keeping the ratio with the lowest
MSE. Ranges, reference model and restoring work as in smooth_quant_zy.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...log import OPT_INFO
from ...progress import progress
from ...quantizer import quantize_graph
from ._common import Batch
from .smooth_quant_zy import Pair, PairProbe, apply_pair, channel_stats, clean_sigma, describe, find_pairs, smooth
from .spec import GlobalMethodSpec

MIN_MEAN = 1e-4
"""Floor of the per-channel mean |x| before the power (AWQ's)."""


def _sigma(pair: Pair, alpha: float) -> torch.Tensor:
    s = torch.clamp(pair.stats["absmean"], min=MIN_MEAN) ** alpha
    return clean_sigma(s / torch.sqrt(s.max() * s.min()))


def _shrink(nodes: Sequence[PyNode], pair: Pair, ratio: float) -> None:
    names = {fc.name for fc in pair.fcs}
    for n in nodes:
        if n.name not in names:
            continue
        w = n.constants["weights"]
        w.min, w.max = float(w.min) * ratio, float(w.max) * ratio
        if w.min_key_axis is not None:
            w.min_key_axis, w.max_key_axis = w.min_key_axis * ratio, w.max_key_axis * ratio


def awq_zy(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Scale (and optionally clip) every Norm -> FullyConnected pair whose norm is in scope; returns the layers
    changed."""
    pairs = find_pairs(graph, spec, "awq_zy")
    if not pairs:
        OPT_INFO("awq_zy: no Norm -> FullyConnected pair to scale")
        return []
    data = list(batches)
    channel_stats(graph, pairs, data)
    qgraph = quantize_graph(graph)
    n_grid = spec.param("n_grid")
    changed: List[str] = []
    for pair in progress(pairs, "awq_zy"):
        probe = PairProbe(graph, qgraph, pair, data)
        if probe.unusable():
            OPT_INFO(f"awq_zy: {describe(pair)} skipped: {probe.unusable()}")
            continue
        alphas = [r / n_grid for r in range(n_grid + 1)]
        sigmas = [_sigma(pair, a) for a in alphas]
        losses = [probe.loss(lambda nodes, p=pair, s=s: smooth(nodes, p, s)) for s in sigmas]
        best = min(range(len(alphas)), key=lambda i: (losses[i], i))
        sigma = sigmas[best]
        ratios = [1.0 - r / n_grid for r in range(int(float(spec.param("max_shrink")) * n_grid))] or [1.0]

        def candidate(nodes, p=pair, s=sigma, a=alphas[best], ratio=1.0):
            if a > 0:
                smooth(nodes, p, s)
            _shrink(nodes, p, ratio)

        clip = [probe.loss(lambda nodes, r=r: candidate(nodes, ratio=r)) for r in ratios]
        best_clip = min(range(len(ratios)), key=lambda i: (clip[i], i))
        ratio = ratios[best_clip]
        base = losses[0]
        final = clip[best_clip]
        if not final < base:
            OPT_INFO(f"awq_zy: {describe(pair)} unchanged (FullyConnected output mse {base:.6g})")
            continue
        if alphas[best] > 0:
            apply_pair(graph, reference, pair, sigma)
        _shrink(pair.nodes(graph), pair, ratio)
        changed += ([pair.norm.name] if alphas[best] > 0 else []) + [fc.name for fc in pair.fcs]
        OPT_INFO(f"awq_zy: {describe(pair)}: alpha={alphas[best]:.4g}, sigma in [{float(sigma.min()):.4g}, "
                 f"{float(sigma.max()):.4g}], weight range x {ratio:.4g}; FullyConnected output mse {base:.6g} -> "
                 f"{final:.6g}")
    return changed
