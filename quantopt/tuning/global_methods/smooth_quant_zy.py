"""smooth_quant_zy: SmoothQuant-style per-channel smoothing of Norm -> FullyConnected pairs (Xiao et al. 2022).

A pair is a LayerNorm, RMSNorm, GroupNorm, InstanceNorm or BatchNorm whose per-channel affine parameters act on
the last axis (C channels), and the FullyConnected layers reading its output, directly or through shape-only
layers (Reshape, Squeeze, and Transpose/Permute keeping the last axis last) that keep the last axis at C. Every
reader of the norm's output must be such a path ending in a FullyConnected (otherwise dividing the norm's output
would change another layer's input), and a BatchNorm may fuse at most a RELU. The scope selects the norms.

With per-channel σ_c > 0 the norm's weights and biases are divided by σ (weights of ones are added if it has
none) and column c of every FullyConnected's weights is multiplied by σ_c: the float model computes the same
outputs, while the FullyConnected inputs lose their outlier channels to the weights. Here
σ_c = max|X_c|^α / max|W_c|^(1−α) over the calibration batches given (X the norm's output, W the columns of all
the pair's FullyConnected weights; a σ that is NaN, about 0 or beyond the int32 range becomes 1). α is
`default_alpha`, or with `auto_tune` the best of linspace(alpha_min, alpha_max, nsteps).

Ranges follow: the weights get fresh statistics and their calibrated ranges; the calibrated min (max) of the
norm's output and of the shape-only outputs on the path is multiplied by the ratio of the smallest (largest)
per-channel value of the batches after and before smoothing. A candidate is judged by the MSE of the pair's
FullyConnected outputs, quantized on their own (the norm fed the float input quantized with its input params),
against the float outputs; a pair keeps its weights when smoothing does not lower it. Candidates are measured on
copies of the pair's layers (`PairProbe.loss`); the chosen σ is applied once, to the pair's layers of the graph
(the calibrated copy) and to the reference float model of the later methods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...calibration.collect import recalibrate_weight, weight_constants
from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import quant_of, ranges_of
from ...graph.tensor import PyTensor
from ...graph.values import to_float, to_quantized
from ...log import OPT_INFO
from ...progress import progress
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import Batch, clone_nodes, consumers, quantize_copy, take_params
from .spec import GlobalMethodSpec

NORM_TYPES = ("LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm", "BatchNorm")
SHAPE_TYPES = ("Reshape", "Squeeze", "Transpose", "Permute")
SIGMA_LIMIT = float(2 ** 31 - 1)
EPS = float(torch.finfo(torch.float32).eps)


@dataclass
class Pair:
    """A norm, the shape-only layers after it (topological order) and the FullyConnected layers they feed."""

    norm: PyNode
    chain: List[PyNode]
    fcs: List[PyNode]
    channels: int
    stats: Dict[str, torch.Tensor] = field(default_factory=dict)

    def nodes(self, graph: PyGraph) -> List[PyNode]:
        names = {n.name for n in [self.norm] + self.chain + self.fcs}
        return [n for n in graph.nodes if n.name in names]


# ------------------------------------------------------------------------------------------------ finding pairs
def _axes(node: PyNode, key: str, default: object, rank: int) -> List[int]:
    value = node.params.get(key, default)
    values = value if isinstance(value, (list, tuple)) else [value]
    return sorted({int(a) % rank for a in values})


def _affine_on_last_axis(norm: PyNode) -> Optional[str]:
    """None when the norm's affine parameters act per channel of the last axis, else why not."""
    rank = len(norm.outputs[0].ir_shape)
    kind = str(norm.type)
    if rank < 1:
        return "its output has no axis"
    if kind in ("LayerNorm", "RMSNorm"):
        ok = rank - 1 in _axes(norm, "axis", [-1], rank)
    elif kind in ("GroupNorm", "BatchNorm"):
        ok = _axes(norm, "axis", -1, rank) == [rank - 1]
    else:
        ok = kind == "InstanceNorm"
    if not ok:
        return "its affine parameters do not act on the last axis"
    if kind == "BatchNorm" and str(norm.params.get("with_activation", "NONE")).upper() not in ("NONE", "RELU"):
        return "it fuses an activation that does not commute with a positive per-channel scale"
    return None


def _keeps_last_axis(node: PyNode, channels: int) -> bool:
    if str(node.type) not in SHAPE_TYPES or len(node.outputs) != 1 or not node.outputs[0].ir_shape:
        return False
    if int(node.outputs[0].ir_shape[-1]) != channels or int(node.inputs[0].ir_shape[-1]) != channels:
        return False
    if str(node.type) in ("Transpose", "Permute"):
        perm = node.params.get("perm")
        rank = len(node.inputs[0].ir_shape)
        return isinstance(perm, (list, tuple)) and int(perm[-1]) % rank == rank - 1
    return True


def find_pairs(graph: PyGraph, spec: GlobalMethodSpec, method: str) -> List[Pair]:
    """Every Norm -> FullyConnected pair whose norm is in scope; norms that cannot be smoothed are logged."""
    outputs = {id(t) for t in graph.output_tensors}
    order = {m.name: i for i, m in enumerate(graph.nodes)}
    pairs = []
    for n in graph.nodes:
        if str(n.type) not in NORM_TYPES or not spec.in_scope(n) or not n.outputs:
            continue
        why = _affine_on_last_axis(n)
        channels = int(n.outputs[0].ir_shape[-1]) if n.outputs[0].ir_shape else 0
        chain: List[PyNode] = []
        fcs: List[PyNode] = []
        todo = [n.outputs[0]]
        while todo and why is None:
            t = todo.pop()
            readers = consumers(graph, t)
            if id(t) in outputs or not readers:
                why = f"'{t.name}' is a model output" if id(t) in outputs else f"'{t.name}' has no reader"
            for r in readers:
                w = r.constants.get("weights")
                if str(r.type) == "FullyConnected" and r.inputs[0] is t and w is not None and \
                        w.betensor.is_floating_point() and int(w.betensor.shape[-1]) == channels:
                    fcs.append(r)
                elif _keeps_last_axis(r, channels) and r.inputs[0] is t:
                    chain.append(r)
                    todo.append(r.outputs[0])
                else:
                    why = f"its output reaches layer '{r.name}' ({r.type}), which is no FullyConnected"
        if why is None and not fcs:
            why = "no FullyConnected reads its output"
        if why is not None:
            OPT_INFO(f"{method}: norm '{n.name}' ({n.type}) skipped: {why}")
            continue
        chain.sort(key=lambda m: order[m.name])
        fcs.sort(key=lambda m: order[m.name])
        pairs.append(Pair(n, chain, fcs, channels))
    return pairs


# ------------------------------------------------------------------------------------------------ statistics
def channel_stats(graph: PyGraph, pairs: Sequence[Pair], data: Sequence[Batch]) -> None:
    """Per-channel min, max, max|x| and mean|x| of each norm's float output over the batches (`pair.stats`)."""
    by_name = {p.norm.name: p for p in pairs}
    acc: Dict[str, List[torch.Tensor]] = {}

    def hook(node: PyNode) -> None:
        p = by_name.get(node.name)
        if p is None:
            return
        x = node.outputs[0].betensor.to(torch.float64).reshape(-1, p.channels)
        cur = [x.min(dim=0).values, x.max(dim=0).values, x.abs().max(dim=0).values, x.abs().sum(dim=0),
               torch.tensor(float(x.shape[0]), dtype=torch.float64)]
        if node.name in acc:
            old = acc[node.name]
            cur = [torch.minimum(old[0], cur[0]), torch.maximum(old[1], cur[1]), torch.maximum(old[2], cur[2]),
                   old[3] + cur[3], old[4] + cur[4]]
        acc[node.name] = cur

    with torch.no_grad():
        for b in data:
            graph.forward(list(b), after_node=hook)
    for p in pairs:
        lo, hi, absmax, abssum, count = acc[p.norm.name]
        p.stats = {"min": lo, "max": hi, "absmax": absmax, "absmean": abssum / count}


def clean_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """NaN, (almost) zero and huge factors become 1: those channels are left alone."""
    bad = torch.isnan(sigma) | (sigma.abs() <= EPS) | (sigma.abs() >= SIGMA_LIMIT)
    return torch.where(bad, torch.ones_like(sigma), sigma)


def weight_absmax(pair: Pair) -> torch.Tensor:
    """max|W[:, c]| over every FullyConnected of the pair."""
    cols = [fc.constants["weights"].betensor.to(torch.float64).abs().amax(dim=0) for fc in pair.fcs]
    return torch.stack(cols).amax(dim=0)


# ------------------------------------------------------------------------------------------------ folding
def fold_constants(norm: PyNode, fcs: Sequence[PyNode], sigma: torch.Tensor) -> None:
    """Divide the norm's per-channel affine parameters by σ and multiply the FullyConnected columns by it."""
    rank = len(norm.outputs[0].ir_shape)
    w = norm.constants.get("weights")
    if w is None:
        numel = math.prod(_affine_dims(norm, rank))
        w = PyTensor(f"{norm.name}/weights", torch.ones(numel, dtype=torch.float32), shape=[numel])
        norm.constants["weights"] = w
        norm.constants.move_to_end("weights", last=False)
    for key in ("weights", "biases"):
        t = norm.constants.get(key)
        if t is None:
            continue
        v = t.betensor.to(torch.float64).reshape(_affine_dims(norm, rank))
        t.betensor = (v / sigma).reshape(t.betensor.shape).to(t.betensor.dtype)
    for fc in fcs:
        t = fc.constants["weights"]
        t.betensor = (t.betensor.to(torch.float64) * sigma[None, :]).to(t.betensor.dtype)


def _affine_dims(norm: PyNode, rank: int) -> List[int]:
    """Full-rank shape the norm's affine parameters broadcast to (the last axis always among the kept ones)."""
    shape = [int(d) for d in norm.outputs[0].ir_shape]
    if str(norm.type) in ("LayerNorm", "RMSNorm"):
        keep = _axes(norm, "axis", [-1], rank)
        return [shape[d] if d in keep else 1 for d in range(rank)]
    return [1] * (rank - 1) + [shape[-1]]


def fold_ranges(nodes: Sequence[PyNode], pair: Pair, sigma: torch.Tensor) -> Tuple[float, float]:
    """Scale the calibrated ranges of the norm's output and of the shape-only outputs after it by the ratio of the
    smoothed to the original per-channel extremes; returns the (min, max) ratios."""
    lo, hi = pair.stats["min"], pair.stats["max"]
    r_lo = float((lo / sigma).min() / lo.min()) if float(lo.min()) < 0 else 1.0
    r_hi = float((hi / sigma).max() / hi.max()) if float(hi.max()) > 0 else 1.0
    fc_names = {fc.name for fc in pair.fcs}
    for n in nodes:
        if n.name in fc_names:
            continue
        t = n.outputs[0]
        table = ranges_of(n)
        r = table.get(t)
        table.set(t, float(r.min) * r_lo, float(r.max) * r_hi)
    return r_lo, r_hi


def smooth(nodes: Sequence[PyNode], pair: Pair, sigma: torch.Tensor) -> None:
    """Smooth the pair's layers `nodes` (the graph's own or copies): constants, weight ranges, activation ranges."""
    by_name = {n.name: n for n in nodes}
    norm = by_name[pair.norm.name]
    fcs = [by_name[fc.name] for fc in pair.fcs]
    fold_constants(norm, fcs, sigma)
    for n in [norm] + fcs:
        for t in weight_constants(n):
            recalibrate_weight(n, t)
    fold_ranges(nodes, pair, sigma)


# ------------------------------------------------------------------------------------------------ evaluation
class PairProbe:
    """Measures a candidate on copies of the pair's layers: the FullyConnected outputs quantized on their own
    (the norm fed its float input quantized with the quantized graph's input params) against the float outputs."""

    def __init__(self, graph: PyGraph, qgraph: PyGraph, pair: Pair, data: Sequence[Batch]) -> None:
        self.graph, self.pair = graph, pair
        self.nodes = pair.nodes(graph)
        self.q_input = qgraph.node(pair.norm.name).inputs[0]
        self.q_quant = qgraph.quant  # the table of `q_input`'s params
        names = {pair.norm.name} | {fc.name for fc in pair.fcs}
        found: Dict[str, List[torch.Tensor]] = {name: [] for name in names}
        inputs: List[torch.Tensor] = []

        def hook(node: PyNode) -> None:
            if node.name == pair.norm.name:
                inputs.append(node.inputs[0].betensor.clone())
            if node.name in found and node.name != pair.norm.name:
                found[node.name].append(node.outputs[0].betensor.clone())

        with torch.no_grad():
            for b in data:
                graph.forward(list(b), after_node=hook)
        self.inputs = inputs
        self.targets = {fc.name: found[fc.name] for fc in pair.fcs}

    def unusable(self) -> Optional[str]:
        """Why the pair cannot be measured (None when it can)."""
        quantized = self.q_quant.get(self.q_input).qmin is not None
        if not quantized or not self.inputs:
            return "its input is not quantized" if not quantized else "no calibration data reached it"
        return None

    def loss(self, change: Optional[Callable[[List[PyNode]], None]]) -> float:
        """MSE of the FullyConnected outputs after `change` is applied to copies of the pair's layers."""
        copies = clone_nodes(self.nodes)
        if change is not None:
            change(copies)
        take_params(copies[0], copies[0].inputs[0], self.q_quant, self.q_input)
        for n in copies:
            quantize_copy(n)
        table = quant_of(copies[0])  # the copies' table (clone_nodes)
        total, count = 0.0, 0
        by_name = {n.name: n for n in copies}
        with torch.no_grad():
            for i, x in enumerate(self.inputs):
                copies[0].inputs[0].betensor = to_quantized(x, self.q_input, self.q_quant)
                for n in copies:
                    n.forward()
                for fc in self.pair.fcs:
                    y = to_float(by_name[fc.name].outputs[0], table).to(torch.float64)
                    with one_thread():  # a full float sum: the same at any thread count (threads.py)
                        total += float(((y - self.targets[fc.name][i].to(torch.float64)) ** 2).sum())
                    count += y.numel()
        return total / max(count, 1)


def apply_pair(graph: PyGraph, reference: PyGraph, pair: Pair, sigma: torch.Tensor) -> None:
    """Smooth the pair in the graph (constants and ranges) and the same constants in the reference float model."""
    smooth(pair.nodes(graph), pair, sigma)
    fold_constants(reference.node(pair.norm.name), [reference.node(fc.name) for fc in pair.fcs], sigma)


def describe(pair: Pair) -> str:
    return f"norm '{pair.norm.name}' -> {', '.join(repr(fc.name) for fc in pair.fcs)}"


# ------------------------------------------------------------------------------------------------ the method
def _sigma(pair: Pair, alpha: float) -> torch.Tensor:
    return clean_sigma(pair.stats["absmax"] ** alpha / weight_absmax(pair) ** (1.0 - alpha))


def smooth_quant_zy(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]
                    ) -> List[str]:
    """Smooth every Norm -> FullyConnected pair whose norm is in scope; returns the layers changed."""
    pairs = find_pairs(graph, spec, "smooth_quant_zy")
    if not pairs:
        OPT_INFO("smooth_quant_zy: no Norm -> FullyConnected pair to smooth")
        return []
    data = list(batches)
    channel_stats(graph, pairs, data)
    qgraph = quantize_graph(graph)
    if spec.param("auto_tune"):
        n = spec.param("nsteps")
        lo, hi = float(spec.param("alpha_min")), float(spec.param("alpha_max"))
        alphas = torch.linspace(lo, hi, n, dtype=torch.float64).tolist() if n > 1 else [lo]
    else:
        alphas = [float(spec.param("default_alpha"))]
    changed: List[str] = []
    for pair in progress(pairs, "smooth_quant_zy"):
        probe = PairProbe(graph, qgraph, pair, data[:1] if spec.param("auto_tune") else data)
        if probe.unusable():
            OPT_INFO(f"smooth_quant_zy: {describe(pair)} skipped: {probe.unusable()}")
            continue
        base = probe.loss(None)
        losses = []
        for a in alphas:
            sigma = _sigma(pair, a)
            losses.append(probe.loss(lambda nodes, p=pair, s=sigma: smooth(nodes, p, s)))
        best = min(range(len(alphas)), key=lambda i: (losses[i], i))
        if not losses[best] < base:
            OPT_INFO(f"smooth_quant_zy: {describe(pair)} unchanged: alpha={alphas[best]:.4g} would not lower the "
                     f"FullyConnected output mse {base:.6g} (got {losses[best]:.6g})")
            continue
        sigma = _sigma(pair, alphas[best])
        before = float(pair.stats["absmax"].max())
        apply_pair(graph, reference, pair, sigma)
        changed += [pair.norm.name] + [fc.name for fc in pair.fcs]
        OPT_INFO(f"smooth_quant_zy: {describe(pair)}: alpha={alphas[best]:.4g}, sigma in [{float(sigma.min()):.4g}, "
                 f"{float(sigma.max()):.4g}], max|input| {before:.6g} -> "
                 f"{float((pair.stats['absmax'] / sigma).max()):.6g}; FullyConnected output mse {base:.6g} -> "
                 f"{losses[best]:.6g}")
    return changed
