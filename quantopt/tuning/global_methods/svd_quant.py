"""svd_quant: "denoising" calibration of activation ranges (modes 0-2) or of FullyConnected weight ranges (mode 3+).

Modes 0-2 visit the first output of every layer in scope whose quantized params follow its calibrated range
(shape-only layers that copy their input's params are left alone), on the float outputs of the calibration
batches given:
- mode 0: the range [min, max] is multiplied by each factor f of linspace(alpha, beta, nsteps) (and 1, the current
  range); the factor kept minimises, summed over the batches, the MSE between the magnitude spectra |FFT| (last
  axis, normalised by its length) of the float output and of the output quantized and dequantized with the range.
- mode 1: per batch, the output viewed as a matrix [rows, last axis] is rebuilt from its SVD without the singular
  values at or below the `thresh` quantile of that batch's singular values; its min/max (min 0 for a
  non-negative output) is the batch's range, then refined on that batch by the mode-0 factor search. The
  per-batch ranges are smoothed in batch order by a 3-tap recursive filter with the layer's
  running_statistic_momentum m: y_k = 0.51m·y_(k-1) + 0.48m·y_(k-2) + 0.01m·y_(k-3) + (1 − m)·x_k, started at
  the first batch's range; the last y is the new range, kept when its spectrum MSE (as in mode 0, summed over the
  batches) is below the current range's.
- mode 2: as mode 1 without the factor search.
Mode 3 and above: for every FullyConnected layer in scope with at most 8-bit activations, the weight range
(per tensor or per channel) is multiplied by each factor f as above; the factor kept minimises the MSE between the
float output and the output of the layer quantized on its own, fed the float input quantized with its input
params.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import TensorQuant, TensorRange
from ...graph.tensor import PyTensor
from ...log import OPT_DEBUG, OPT_INFO
from ...progress import progress
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import (
    Batch,
    Range,
    capture,
    fake_quant_range,
    quantize_alone,
    range_honoured,
    run_alone,
    search_factors,
    set_range,
    skip_reason,
    target_layers,
    tensor_range,
)
from .spec import GlobalMethodSpec

FILTER_TAPS = (0.51, 0.48, 0.01)
"""Weights (times the momentum) of the last three filtered ranges in modes 1 and 2."""


def _spectrum(x: torch.Tensor) -> torch.Tensor:
    x = torch.nan_to_num(x.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.fft.fft(x, dim=-1, norm="forward").abs()


class _Target:
    """One activation tensor whose range is searched: the graph's tensor, its quantized twin's params and its
    producer."""

    def __init__(self, node: PyNode, t: PyTensor, qt: TensorQuant, producer: PyNode, factors: List[float]) -> None:
        self.node, self.t, self.qt, self.producer = node, t, qt, producer
        self.factors = factors
        self.losses = torch.zeros(len(factors), dtype=torch.float64)
        self.batch_ranges: List[Tuple[float, float]] = []

    def spectrum_losses(self, x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        out = torch.zeros(len(self.factors), dtype=torch.float64)
        with one_thread():  # batched FFTs and full float sums: the same at any thread count (threads.py)
            ref = _spectrum(x)
            for i, f in enumerate(self.factors):
                q = fake_quant_range(x, lo * f, hi * f, self.qt, self.producer)
                out[i] = ((ref - _spectrum(q)) ** 2).mean()
        return out

    def best(self, losses: torch.Tensor) -> float:
        one = self.factors.index(1.0)
        i = int(torch.argmin(losses))
        return self.factors[one] if losses[one] <= losses[i] else self.factors[i]


def _denoised_range(x: torch.Tensor, thresh: float) -> Tuple[float, float]:
    """Range of the output matrix M [rows, last axis] rebuilt without its small singular values. M = U·S·Vᵀ is
    rebuilt as M·V_k·V_kᵀ (V_k: right singular vectors kept), from the eigenvectors of MᵀM: no [rows, rows] or
    U factor is formed, whatever the number of rows."""
    m = torch.nan_to_num(x.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    m = m.reshape(-1, x.shape[-1]) if x.dim() > 1 else m.reshape(1, -1)
    with one_thread():  # LAPACK: the same at any thread count (threads.py)
        evals, v = torch.linalg.eigh(m.T @ m)
    s = torch.sqrt(torch.clamp(evals, min=0.0))
    cut = s.sort().values[min(int(s.numel() * thresh), s.numel() - 1)]
    keep = v[:, s > cut]
    if keep.shape[1] == 0:
        lo, hi = float(m.min()), float(m.max())
    else:
        d = (m @ keep) @ keep.T
        lo, hi = float(d.min()), float(d.max())
    if float(m.min()) >= 0:
        lo = 0.0
    return min(lo, 0.0), max(hi, 0.0)


def _smooth(values: Sequence[float], momentum: float) -> float:
    hist = [values[0]] * len(FILTER_TAPS)
    y = values[0]
    for v in values:
        y = sum(momentum * a * h for a, h in zip(FILTER_TAPS, hist)) + (1.0 - momentum) * v
        hist = [y] + hist[:-1]
    return y


def _targets(graph: PyGraph, qgraph: PyGraph, spec: GlobalMethodSpec, factors: List[float]) -> Dict[str, _Target]:
    found: Dict[str, _Target] = {}
    for n in graph.nodes:
        if not spec.in_scope(n) or not n.outputs:
            continue
        t = n.outputs[0]
        qt = qgraph.node(n.name).outputs[0]
        producer = range_honoured(qgraph, t, qt)
        if producer is None or graph.ranges.get(t).min is None:
            OPT_DEBUG(f"svd_quant: layer '{n.name}' skipped: its quantized output does not follow its range")
            continue
        found[n.name] = _Target(n, t, qgraph.quant.get(qt), producer, factors)
    return found


def _each_output(reference: PyGraph, data: Sequence[Batch], targets: Dict[str, _Target], desc: str,
                 visit: Callable[[_Target, torch.Tensor], None]) -> None:
    """Call visit(target, float output) for every target layer on every batch of the reference float model."""
    def hook(rnode: PyNode) -> None:
        tg = targets.get(rnode.name)
        x = rnode.outputs[0].betensor if tg is not None else None
        if x is not None and x.is_floating_point() and x.dim() > 0 and x.numel() > 0:
            visit(tg, x)

    with torch.no_grad():
        for b in progress(data, desc):
            reference.forward(list(b), after_node=hook)


def _denoised_candidates(reference: PyGraph, data: Sequence[Batch], targets: Dict[str, _Target], mode: int,
                         thresh: float) -> Dict[str, Tuple[float, float]]:
    """Modes 1 and 2: the filtered per-batch denoised (and, mode 1, searched) ranges."""
    def visit(tg: _Target, x: torch.Tensor) -> None:
        b_lo, b_hi = _denoised_range(x, thresh)
        if mode == 1:
            f = tg.best(tg.spectrum_losses(x, b_lo, b_hi))
            b_lo, b_hi = b_lo * f, b_hi * f
        tg.batch_ranges.append((b_lo, b_hi))

    _each_output(reference, data, targets, f"svd_quant mode {mode}: denoise", visit)
    found = {}
    for name, tg in targets.items():
        if tg.batch_ranges:
            m = float(tg.node.settings.running_statistic_momentum) if tg.node.settings is not None else 0.9
            found[name] = (min(_smooth([r[0] for r in tg.batch_ranges], m), 0.0),
                           max(_smooth([r[1] for r in tg.batch_ranges], m), 0.0))
    return found


def _activation_ranges(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, data: Sequence[Batch]
                       ) -> List[str]:
    mode, thresh = spec.param("mode"), float(spec.param("thresh"))
    factors = search_factors(float(spec.param("alpha")), float(spec.param("beta")), spec.param("nsteps"))
    qgraph = quantize_graph(graph)
    targets = _targets(graph, qgraph, spec, factors)
    rng = graph.ranges

    def bounds(tg: _Target) -> Tuple[float, float]:
        r = rng.get(tg.t)
        return float(r.min), float(r.max)

    one = factors.index(1.0)
    if mode == 0:
        def visit(tg: _Target, x: torch.Tensor) -> None:
            tg.losses += tg.spectrum_losses(x, *bounds(tg))

        _each_output(reference, data, targets, "svd_quant mode 0", visit)
        found = {name: (bounds(tg)[0] * f, bounds(tg)[1] * f) for name, tg in targets.items()
                 if (f := tg.best(tg.losses)) != 1.0}
        losses = {name: (float(tg.losses[one]), float(tg.losses.min())) for name, tg in targets.items()}
    else:
        found = _denoised_candidates(reference, data, targets, mode, thresh)
        found = {k: v for k, v in found.items() if v != bounds(targets[k])}
        losses = {name: (0.0, 0.0) for name in found}

        def check(tg: _Target, x: torch.Tensor) -> None:
            if tg.node.name in found:
                lo, hi = found[tg.node.name]
                old, new = losses[tg.node.name]
                with one_thread():  # batched FFTs and full float sums: the same at any thread count (threads.py)
                    losses[tg.node.name] = (old + float(((_spectrum(x) - _spectrum(fake_quant_range(
                        x, *bounds(tg), tg.qt, tg.producer))) ** 2).mean()),
                        new + float(((_spectrum(x) - _spectrum(fake_quant_range(x, lo, hi, tg.qt, tg.producer)))
                                     ** 2).mean()))

        _each_output(reference, data, targets, f"svd_quant mode {mode}: check", check)
    changed = []
    for name, (lo, hi) in found.items():
        tg = targets[name]
        old, new = losses[name]
        text = (f"range [{bounds(tg)[0]:.6g}, {bounds(tg)[1]:.6g}] -> [{lo:.6g}, {hi:.6g}] (spectrum mse "
                f"{old:.6g} -> {new:.6g})")
        if not new < old:
            OPT_DEBUG(f"svd_quant: layer '{name}': {text} not kept")
            continue
        rng.set(tg.t, lo, hi)
        changed.append(name)
        OPT_INFO(f"svd_quant: layer '{name}': {text}")
    OPT_INFO(f"svd_quant mode {mode}: {len(changed)} of {len(targets)} searchable output range(s) changed")
    return changed


def _fc_weight_ranges(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, data: Sequence[Batch]
                      ) -> List[str]:
    factors = search_factors(float(spec.param("alpha")), float(spec.param("beta")), spec.param("nsteps"))
    layers = [n for n in target_layers(graph, spec) if str(n.type) == "FullyConnected" and
              (n.settings is None or int(n.settings.q_bits_activation) <= 8)]
    if not layers:
        OPT_INFO("svd_quant: no FullyConnected layer with at most 8-bit activations in scope")
        return []
    qgraph = quantize_graph(graph)
    ref_io = capture(reference, data, {n.name for n in layers})
    changed = []
    for node in progress(layers, "svd_quant weights"):
        qnode = qgraph.node(node.name)
        reason = skip_reason(qnode)
        if reason is not None or not ref_io[node.name]:
            OPT_INFO(f"svd_quant: layer '{node.name}' skipped: {reason or 'no calibration data reached it'}")
            continue
        xs = [io[0][0] for io in ref_io[node.name]]
        ys = [io[1][0] for io in ref_io[node.name]]
        current = tensor_range(node, node.constants["weights"])
        losses = torch.tensor([_isolated_mse(node, qnode, xs, ys, _scaled_range(current, f)) for f in factors],
                              dtype=torch.float64)
        one = factors.index(1.0)
        best = int(torch.argmin(losses))
        f = factors[best] if losses[best] < losses[one] else 1.0
        set_range(node, node.constants["weights"], _scaled_range(current, f))
        if f != 1.0:
            changed.append(node.name)
        OPT_INFO(f"svd_quant: layer '{node.name}': weight range x {f:.4g} (isolated output mse "
                 f"{float(losses[one]):.6g} -> {float(losses[factors.index(f)]):.6g})")
    return changed


def _scaled_range(current: Range, f: float) -> Range:
    """The weight range `current` multiplied by `f` (per tensor and per channel)."""
    def times(v: object) -> object:
        return v * f if isinstance(v, torch.Tensor) else v

    tensor, channels = current
    return (TensorRange(float(tensor.min) * f, float(tensor.max) * f),
            TensorRange(times(channels.min), times(channels.max), channels.axis))


def _isolated_mse(node: PyNode, qnode: PyNode, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
                  weight_range: Range) -> float:
    """MSE against the float outputs `ys` of a copy of the layer with the weight range `weight_range`, quantized on
    its own and fed the float inputs `xs` quantized with its input params (the layer itself is not touched)."""
    probe = quantize_alone(node, qnode, change=lambda m: set_range(m, m.constants["weights"], weight_range))
    with one_thread():  # full float sums: the same at any thread count (threads.py)
        return sum(float(((run_alone(probe, [x]).to(torch.float64) - y.to(torch.float64)) ** 2).mean())
                   for x, y in zip(xs, ys)) / len(xs)


def svd_quant(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Search activation ranges (modes 0-2) or FullyConnected weight ranges (mode >= 3) on all given batches;
    returns the layers whose ranges changed."""
    if spec.param("mode") >= 3:
        return _fc_weight_ranges(graph, reference, spec, batches)
    return _activation_ranges(graph, reference, spec, batches)
