"""adaquant_zy: learn weight/bias offsets, the weight scale and the input scale of each MAC layer (AdaQuant-style).

Per MAC layer in scope, in topological order (each after re-quantizing the graph with what earlier layers
learned): the layer's float input and float output (fused activation included) come from the reference float
model on the first `batches` calibration batches; samples are concatenated, repeated up to a multiple of
`batch_size` and shuffled each epoch with a fixed seed. The layer is simulated as

    y = layer(fq(x; S_x), fq(W + ΔW; S_w), b + Δb)

with fq a quantize-dequantize whose rounding passes gradients straight through (LSQ-style), the weight grid (zero
point, integer range, per tensor or per channel) and the input grid of the quantized graph, and
S_w = S_w0·exp(ρ_w), S_x = S_x0·exp(ρ_x). Four Adam optimizers minimise the MSE between y and the float output:
ΔW (lr_weight) and Δb (lr_bias) in the units of the float weights and biases, ρ_w (lr_quant_param_weight) and ρ_x
(lr_quant_param_activation, cosine-annealed to 0) as log factors, so their learning rates are relative and the same
for every layer. A learning rate of 0 freezes its group; Δb is learned only for layers with biases, and ρ_x only
when the input's producer takes its quantization params from its calibrated range (the input range is then
shared by every reader of that tensor; the last layer's choice stays, as upstream).

The result is the layer's float weights W + ΔW and biases b + Δb, the weight range giving S_w and the input range
giving S_x. It is measured on a copy of the graph and set on the layer only when the summed reconstruction MSE of
the layers in scope (quantized graph, errors of earlier layers included, against the float outputs) drops, since
an input range is also the output range of the layer before; otherwise the layer is left as it was.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import TensorQuant, TensorRange, quant_of
from ...log import OPT_INFO
from ...ops._quant import activation_mode
from ...progress import progress
from ...quant.params import QuantMode
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import (
    SEED,
    Batch,
    Range,
    capture,
    fake_quant,
    float_apply,
    pad_samples,
    range_for_scale,
    range_honoured,
    set_range,
    skip_reason,
    target_layers,
    weight_quant,
)
from .spec import GlobalMethodSpec


class _Grid:
    """A fixed quantization grid (zero point, integer range) with a learnable log factor on its scale."""

    def __init__(self, scale: torch.Tensor, zerop: torch.Tensor, qmin: int, qmax: int, learn: bool) -> None:
        self.scale0 = scale.to(torch.float32)
        self.zerop = zerop.to(torch.float32)
        self.qmin, self.qmax = qmin, qmax
        self.rho = torch.zeros_like(self.scale0, requires_grad=learn)

    def scale(self) -> torch.Tensor:
        return self.scale0 * torch.exp(self.rho)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.scale(), self.zerop, self.qmin, self.qmax)


def _input_grid(q: TensorQuant, learn: bool) -> Optional[_Grid]:
    """The grid of a quantized input's params `q` (None where it is not one per-tensor quantized grid)."""
    if q.qinvariant or q.qmin is None or isinstance(q.scale, torch.Tensor):
        return None
    return _Grid(torch.tensor(float(q.scale)), torch.tensor(float(q.zerop)), int(q.qmin), int(q.qmax), learn)


def _optimizers(groups: Sequence[Tuple[Optional[torch.Tensor], float]]) -> List[torch.optim.Optimizer]:
    return [torch.optim.Adam([p], lr=lr) for p, lr in groups if p is not None and p.requires_grad and lr > 0]


def _total_mse(qgraph: PyGraph, data: Sequence[Batch], targets: Dict[str, List[torch.Tensor]]) -> float:
    """Summed reconstruction MSE of the layers in scope (quantized graph, errors of earlier layers included)."""
    q = capture(qgraph, data, set(targets), quantized=True)
    with one_thread():  # full float sums: the same at any thread count (threads.py)
        return sum(sum(float(((yq[0].to(torch.float64) - y.to(torch.float64)) ** 2).mean())
                       for (_, yq), y in zip(q[name], ys)) / max(len(ys), 1) for name, ys in targets.items())


class _Learner:
    """The learnable copy of one layer and its training loop."""

    def __init__(self, node: PyNode, qnode: PyNode, spec: GlobalMethodSpec, learn_input: bool) -> None:
        self.node = node
        w = node.constants["weights"].betensor.to(torch.float32)
        b_t = node.constants.get("biases")
        self.w = w
        self.b = b_t.betensor.to(torch.float32).reshape(-1) if b_t is not None else None
        lr_w, lr_b = float(spec.param("lr_weight")), float(spec.param("lr_bias"))
        lr_qw, lr_qx = float(spec.param("lr_quant_param_weight")), float(spec.param("lr_quant_param_activation"))
        self.dw = torch.zeros_like(w, requires_grad=lr_w > 0)
        self.db = torch.zeros_like(self.b, requires_grad=lr_b > 0) if self.b is not None else None
        scale, zp, qmin, qmax = weight_quant(qnode)
        self.wgrid = _Grid(scale, zp, qmin, qmax, lr_qw > 0)
        q_input = quant_of(qnode).get(qnode.inputs[0])
        self.xgrid = _input_grid(q_input, learn_input and lr_qx > 0)
        self.x_bits = int(q_input.qbits or 8)
        self.opts = _optimizers([(self.dw, lr_w), (self.db, lr_b), (self.wgrid.rho, lr_qw)])
        self.x_opt = _optimizers([(self.xgrid.rho if self.xgrid is not None else None, lr_qx)])

    def weights(self) -> torch.Tensor:
        return self.w + self.dw

    def biases(self) -> Optional[torch.Tensor]:
        return None if self.b is None else self.b + self.db

    def output(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.xgrid(x) if self.xgrid is not None else x
        return float_apply(self.node, xq, self.wgrid(self.weights()), self.biases(), activation=True)

    def _params(self) -> List[torch.Tensor]:
        return [p for p in (self.dw, self.db, self.wgrid.rho, self.xgrid.rho if self.xgrid is not None else None)
                if p is not None]

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(self.output(x), y))

    def train(self, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, seed: int) -> Tuple[float, float]:
        """Adam steps over shuffled mini-batches; the parameters of the epoch end (or start) with the lowest loss
        on all samples are kept. Returns the loss on all samples before and after."""
        samples = int(x.shape[0])
        iterations = samples // batch_size
        total = max(1, iterations * epochs)
        sched = [torch.optim.lr_scheduler.CosineAnnealingLR(o, total) for o in self.x_opt]
        gen = torch.Generator().manual_seed(seed)
        first = best = self._loss(x, y)
        kept = [p.detach().clone() for p in self._params()]
        for _ in range(epochs):
            order = torch.randperm(samples, generator=gen)
            for i in range(iterations):
                idx = order[i * batch_size:(i + 1) * batch_size]
                for o in self.opts + self.x_opt:
                    o.zero_grad()
                loss = torch.nn.functional.mse_loss(self.output(x[idx]), y[idx])
                loss.backward()
                for o in self.opts + self.x_opt:
                    o.step()
                for s in sched:
                    s.step()
            now = self._loss(x, y)
            if now < best:
                best, kept = now, [p.detach().clone() for p in self._params()]
        with torch.no_grad():
            for p, v in zip(self._params(), kept):
                p.copy_(v)
        return first, best


def _weight_range(node: PyNode, grid: _Grid) -> Range:
    s = node.settings
    mode = QuantMode.from_name(s.q_mode_weight if s is not None else "per_tensor_symmetric_restricted_range")
    lo, hi = range_for_scale(grid.scale().detach(), grid.zerop, grid.qmin, grid.qmax, mode.is_symmetric, True)
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    if lo.numel() > 1:
        return TensorRange(float(lo.min()), float(hi.max())), TensorRange(lo.clone(), hi.clone(), 0)
    return (TensorRange(float(lo[0]), float(hi[0])),)


def _learned(node: PyNode, learner: _Learner, producer: Optional[PyNode]) -> Tuple[Dict[str, object], str]:
    """The values the learner found for `node`, as the graph stores them (float weights and biases, the weight
    range, the input range when its scale was learned), and their log text."""
    wt = node.constants["weights"]
    values: Dict[str, object] = {
        "weights": learner.weights().detach().reshape(wt.betensor.shape).to(wt.betensor.dtype),
        "weight_range": _weight_range(node, learner.wgrid)}
    if learner.b is not None:
        bt = node.constants["biases"]
        values["biases"] = learner.biases().detach().reshape(bt.betensor.shape).to(bt.betensor.dtype)
    f_w = torch.exp(learner.wgrid.rho.detach())
    text = f"weight scale x [{float(f_w.min()):.4g}, {float(f_w.max()):.4g}]"
    g = learner.xgrid
    if producer is not None and g is not None and g.rho.requires_grad:
        symmetric = activation_mode(producer, learner.x_bits).is_symmetric
        lo, hi = range_for_scale(g.scale().detach(), g.zerop, g.qmin, g.qmax, symmetric, g.qmin < 0)
        values["input_range"] = (TensorRange(float(lo), float(hi)),)
        text += f", input '{node.inputs[0].name}' scale x {math.exp(float(g.rho.detach())):.4g}"
    return values, text


def _apply(node: PyNode, values: Dict[str, object]) -> None:
    """Give `node` (of the graph, or of a copy that measures the candidate) the learned `values`."""
    node.constants["weights"].betensor = values["weights"]
    if "biases" in values:
        node.constants["biases"].betensor = values["biases"]
    set_range(node, node.constants["weights"], values["weight_range"])
    if "input_range" in values:
        set_range(node, node.inputs[0], values["input_range"])


def adaquant_zy(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """Learn offsets and scales of every MAC layer in scope; returns the names of the layers changed."""
    data = list(batches[:spec.param("batches")])
    epochs, batch_size = spec.param("epochs"), spec.param("batch_size")
    layers = target_layers(graph, spec)
    ref_io = capture(reference, data, {n.name for n in layers})
    targets = {name: [io[1][0] for io in v] for name, v in ref_io.items() if v}
    qgraph = quantize_graph(graph)
    current = _total_mse(qgraph, data, targets)
    changed = []
    for index, node in enumerate(progress(layers, "adaquant_zy")):
        qnode = qgraph.node(node.name)
        reason = skip_reason(qnode)
        if reason is not None or node.name not in targets:
            OPT_INFO(f"adaquant_zy: layer '{node.name}' skipped: {reason or 'no calibration data reached it'}")
            continue
        x = pad_samples(torch.cat([io[0][0] for io in ref_io[node.name]], dim=0), batch_size)
        y = pad_samples(torch.cat(targets[node.name], dim=0), batch_size)
        producer = range_honoured(qgraph, node.inputs[0], qnode.inputs[0])
        learner = _Learner(node, qnode, spec, producer is not None)
        with one_thread():  # the losses and the gradients of scalar scales are full sums (threads.py)
            first, last = learner.train(x, y, epochs, batch_size, SEED + index)
        values, text = _learned(node, learner, producer)
        trial = graph.clone()  # the candidate is measured on a copy: a rejected one leaves the graph as it was
        _apply(trial.node(node.name), values)
        candidate = quantize_graph(trial)
        after = _total_mse(candidate, data, targets)
        if not after < current:
            OPT_INFO(f"adaquant_zy: layer '{node.name}' unchanged: the learned values ({text}; simulated loss "
                     f"{first:.6g} -> {last:.6g}) would not lower the summed reconstruction mse {current:.6g} "
                     f"(got {after:.6g})")
            continue
        OPT_INFO(f"adaquant_zy: layer '{node.name}': {text}; simulated loss {first:.6g} -> {last:.6g}; summed "
                 f"reconstruction mse {current:.6g} -> {after:.6g}")
        _apply(node, values)
        qgraph, current = candidate, after
        changed.append(node.name)
    return changed
