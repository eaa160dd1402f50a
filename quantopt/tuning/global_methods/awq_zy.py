"""awq_zy: activation-aware per-channel scaling of Norm -> FullyConnected pairs (AWQ, Lin et al. 2023).

Same pairs and folding as smooth_quant_zy (docs/global-calibration.md): the norm's affine parameters are divided
by σ_c and column c of every FullyConnected's weights multiplied by it, which keeps the float model's outputs. AWQ
searches σ = s / sqrt(max(s)·min(s)) with s_c = max(mean|X_c|, 1e-4)^α for α = r/n_grid, r = 0..n_grid (α = 0 is
no scaling), X the norm's output on the calibration batches given, keeping the σ whose pair's FullyConnected
outputs (quantized on their own, the norm fed its float input quantized with its input params) have the lowest
MSE against the float outputs. Then, when max_shrink > 0, the weight ranges of the pair's FullyConnected layers
are multiplied by 1 − r/n_grid for r = 0..⌊max_shrink·n_grid⌋ − 1 (clipping), keeping the ratio with the lowest
MSE. Ranges, the reference model and the single final assignment work as in smooth_quant_zy.

Weight-only FullyConnected layers (float layers of the quantized graph, e.g. per-block w4afp16/wfp4afp16 weights) are
measured as the quantized graph runs them: quantized weight-only (the block scales derived from the smoothed
weights, so the block-quantized weights are in the loss), fed the norm's output dequantized and rounded to their
float type. Clipping a layer with per-block weights clips each block's weights to the ratio times the block's range
(its scale comes from its weights): the same as shrinking the range for the extrema weight strategy.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ...graph.float_layer import round_to_float_dtype
from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import quant_of, ranges_of
from ...graph.tensor import PyTensor
from ...graph.values import to_float, to_quantized
from ...log import OPT_INFO
from ...passes.float_islands import FLOAT_DTYPES, float_choices, make_float_layer
from ...progress import progress
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import Batch, clone_nodes, quantize_copy, take_params
from .gptq_zy import block_bounds, is_block_layer
from .smooth_quant_zy import Pair, PairProbe, apply_pair, channel_stats, clean_sigma, describe, find_pairs, smooth
from .spec import GlobalMethodSpec

MIN_MEAN = 1e-4
"""Floor of the per-channel mean |x| before the power (AWQ's)."""


def _sigma(pair: Pair, alpha: float) -> torch.Tensor:
    s = torch.clamp(pair.stats["absmean"], min=MIN_MEAN) ** alpha
    return clean_sigma(s / torch.sqrt(s.max() * s.min()))


def _shrink(nodes: Sequence[PyNode], pair: Pair, ratio: float, block_fcs: Optional[Set[str]] = None) -> None:
    """Multiply the weight ranges of the pair's FullyConnected layers by `ratio`; a layer with per-block weights
    (its block ranges come from its weights when it is quantized) gets its weights clipped to `ratio` times each
    block's range instead, which is the same for the extrema weight strategy."""
    names = {fc.name for fc in pair.fcs}
    for n in nodes:
        if n.name not in names:
            continue
        w = n.constants["weights"]
        if block_fcs and n.name in block_fcs:
            if ratio != 1.0:
                blocks = w.betensor.to(torch.float32).reshape(-1, int(n.settings.weight_block_size))
                lo, hi, _ = block_bounds(n, blocks)
                clipped = torch.maximum(torch.minimum(blocks, hi * ratio), lo * ratio)
                w.betensor = clipped.reshape(w.betensor.shape).to(w.betensor.dtype)
            continue
        table = ranges_of(n)
        r, rc = table.get(w), table.channels(w)
        table.set(w, float(r.min) * ratio, float(r.max) * ratio)
        if rc.min is not None:
            table.set_channels(w, rc.min * ratio, rc.max * ratio, rc.axis)


def _mixed(qgraph: PyGraph, pair: Pair) -> bool:
    """Whether a layer of the pair stays float in the quantized graph (weight-only FullyConnected layers)."""
    return any(not qgraph.node(n.name).quantized for n in [pair.norm] + pair.chain + pair.fcs)


class MixedPairProbe(PairProbe):
    """PairProbe for pairs with float layers (weight-only FullyConnected layers, per-channel or per-block): each
    copy is quantized as the quantized graph treats it (float layers get their weight-only weights), and a float
    layer reading an integer layer's output gets it dequantized and rounded to its float type, as the DeQuantize
    layer of the quantized graph does."""

    def __init__(self, graph: PyGraph, qgraph: PyGraph, pair: Pair, data: Sequence[Batch]) -> None:
        super().__init__(graph, qgraph, pair, data)
        self.choices = float_choices(graph)
        self.floats = {n.name for n in self.nodes if not qgraph.node(n.name).quantized}

    def unusable(self) -> Optional[str]:
        if not self.inputs:
            return "no calibration data reached it"
        if self.pair.norm.name not in self.floats and self.q_quant.get(self.q_input).qmin is None:
            return "its input is not quantized"
        for n in self.nodes:
            if n.name not in self.floats and any(t.pnode is not None and t.pnode.name in self.floats
                                                 for t in n.inputs):
                return f"integer layer '{n.name}' reads a float layer of the pair"
        return None

    def loss(self, change: Optional[Callable[[List[PyNode]], None]]) -> float:
        copies = clone_nodes(self.nodes)
        if change is not None:
            change(copies)
        first = copies[0]
        if first.name not in self.floats:
            take_params(first, first.inputs[0], self.q_quant, self.q_input)
        for n in copies:
            if n.name in self.floats:
                make_float_layer(n, self.choices[n.name])
            else:
                quantize_copy(n)
        table = quant_of(first)  # the copies' table (clone_nodes)
        feeds = self._float_feeds(copies)
        total, count = 0.0, 0
        by_name = {n.name: n for n in copies}
        with torch.no_grad():
            for i, x in enumerate(self.inputs):
                if first.name in self.floats:
                    first.inputs[0].betensor = round_to_float_dtype(x.to(torch.float32),
                                                                    FLOAT_DTYPES[self.choices[first.name].act_type])
                else:
                    first.inputs[0].betensor = to_quantized(x, self.q_input, self.q_quant)
                for n in copies:
                    for own, src, dtype in feeds.get(n.name, ()):
                        own.betensor = round_to_float_dtype(to_float(src, table), dtype)
                    n.forward()
                for fc in self.pair.fcs:
                    y = to_float(by_name[fc.name].outputs[0], table).to(torch.float64)
                    with one_thread():  # a full float sum: the same at any thread count (threads.py)
                        total += float(((y - self.targets[fc.name][i].to(torch.float64)) ** 2).sum())
                    count += y.numel()
        return total / max(count, 1)

    def _float_feeds(self, copies: Sequence[PyNode]) -> Dict[str, List[Tuple[PyTensor, PyTensor, torch.dtype]]]:
        """Per float copy, its inputs produced by an integer copy: each gets a tensor of its own (a clone of the
        quantized output under its name, so it has the output's params in the copies' table), which `loss` fills
        with that output dequantized and rounded to the float layer's type before the layer runs, so the integer
        layer's output is never swapped and restored."""
        inside = {id(t) for n in copies for t in n.outputs}
        table = quant_of(copies[0]) if copies else None
        feeds: Dict[str, List[Tuple[PyTensor, PyTensor, torch.dtype]]] = {}
        for n in copies:
            if n.name not in self.floats:
                continue
            dtype = FLOAT_DTYPES[self.choices[n.name].act_type]
            for k, t in enumerate(n.inputs):
                if id(t) in inside and table.get(t).qmin is not None:
                    own = t.clone()
                    n.inputs[k] = own
                    feeds.setdefault(n.name, []).append((own, t, dtype))
        return feeds


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
        blocks = {fc.name for fc in pair.fcs if is_block_layer(qgraph.node(fc.name))}
        probe = (MixedPairProbe if _mixed(qgraph, pair) else PairProbe)(graph, qgraph, pair, data)
        if probe.unusable():
            OPT_INFO(f"awq_zy: {describe(pair)} skipped: {probe.unusable()}")
            continue
        alphas = [r / n_grid for r in range(n_grid + 1)]
        sigmas = [_sigma(pair, a) for a in alphas]
        losses = [probe.loss(lambda nodes, p=pair, s=s: smooth(nodes, p, s)) for s in sigmas]
        best = min(range(len(alphas)), key=lambda i: (losses[i], i))
        sigma = sigmas[best]
        ratios = [1.0 - r / n_grid for r in range(int(float(spec.param("max_shrink")) * n_grid))] or [1.0]

        def candidate(nodes, p=pair, s=sigma, a=alphas[best], ratio=1.0, b=blocks):
            if a > 0:
                smooth(nodes, p, s)
            _shrink(nodes, p, ratio, b)

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
        _shrink(pair.nodes(graph), pair, ratio, blocks)
        changed += ([pair.norm.name] if alphas[best] > 0 else []) + [fc.name for fc in pair.fcs]
        OPT_INFO(f"awq_zy: {describe(pair)}: alpha={alphas[best]:.4g}, sigma in [{float(sigma.min()):.4g}, "
                 f"{float(sigma.max()):.4g}], weight range x {ratio:.4g}; FullyConnected output mse {base:.6g} -> "
                 f"{final:.6g}")
    return changed
