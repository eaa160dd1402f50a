"""Shared pieces of the global calibration methods: which layers they touch, capturing layer inputs/outputs of a
float or quantized graph, quantizing one layer on its own, and the layer reconstruction error."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ...errors import QuantOptError
from ...graph.graph import PyGraph
from ...graph.grouped import layer_values
from ...graph.node import PyNode
from ...graph.tables import (
    QuantTable,
    RangeTable,
    TensorQuant,
    TensorRange,
    detached_statistics,
    node_tensors,
    quant_of,
    ranges_of,
)
from ...graph.tensor import PyTensor
from ...graph.values import to_float, to_quantized
from ...ops._quant import activation_mode, is_signed
from ...passes.absorb_scales import absorb_input_scales
from ...quant.compare import cosine
from ...quant.params import dequantize, linear_quant_params, quantize
from ...quantizer import quantize_graph
from ...threads import one_thread
from .spec import GlobalMethodSpec

MAC_TYPES = ("Convolution", "DepthwiseConv", "FullyConnected", "Convolution3D")
"""Layers whose weights are [out_channels, ...] and whose outputs carry the channels on the last axis."""

SEED = 20240
"""Base seed of the methods that draw random numbers (adaround's sample order); each layer adds its index."""

Batch = List[torch.Tensor]
LayerIO = Dict[str, List[Tuple[List[torch.Tensor], List[torch.Tensor]]]]


def target_layers(graph: PyGraph, spec: GlobalMethodSpec) -> List[PyNode]:
    """MAC layers with float weights inside the method's scope, in topological order."""
    out = []
    for n in graph.nodes:
        w = n.constants.get("weights")
        if str(n.type) in MAC_TYPES and w is not None and w.betensor.is_floating_point() and spec.in_scope(n):
            out.append(n)
    return out


def capture(graph: PyGraph, batches: Sequence[Batch], names: Set[str], quantized: bool = False) -> LayerIO:
    """Inputs and outputs of the named layers for every batch (dequantized for a quantized graph). Each forward
    stops after the last named layer and runs several batches where the graph can (graph/grouped.py): the values
    are those of a whole forward per batch."""
    table = quant_of(graph.nodes[0]) if quantized and graph.nodes else None  # the graph's parameters

    def read(t: PyTensor) -> torch.Tensor:
        return to_float(t, table) if quantized else t.betensor.detach()

    with torch.no_grad():
        per_batch = layer_values(graph, [list(b) for b in batches], set(names), read)
    return {name: [values[name] for values in per_batch if name in values] for name in names}


def quantize_alone(fnode: PyNode, qnode: PyNode, change: Optional[Callable[[PyNode], None]] = None) -> PyNode:
    """A copy of the float layer quantized on its own, its inputs carrying the params of the quantized graph's
    inputs (in the copy's own table); `change` (a candidate: ranges, constants, input params) is applied to the copy
    before it is quantized. The float layer and the graphs are left untouched, so a method measures a candidate
    without setting and restoring anything; a per-channel input's scales are absorbed into the copy's float weights
    first, as `quantize_graph` does (passes/absorb_scales.py)."""
    m = fnode.detached_copy(inputs=list(qnode.inputs), input_ranges=ranges_of(qnode), input_quant=quant_of(qnode))
    if change is not None:
        change(m)
    quantize_copy(m)
    return m


def take_params(node: PyNode, t: PyTensor, table: QuantTable, src: PyTensor) -> None:
    """Give `t`, a tensor of `node` (a copy outside the graph), the params and dtype `src` has in `table` (the
    quantized graph's), as `copy_params` does within one table (ops/_quant.py)."""
    quant_of(node).copy_from(table, src, t)
    t.dtype = src.dtype
    t.ir_range = None


def quantize_copy(node: PyNode) -> None:
    """Quantize a layer copied out of its graph (its inputs already carry their params) as `quantize_graph` would
    quantize it: a per-channel input's scales absorbed into its float weights first (passes/absorb_scales.py)."""
    absorb_input_scales(node)
    node.quantize()


def run_alone(node: PyNode, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Dequantized output of a layer quantized by `quantize_alone`, fed float inputs quantized with its input
    params."""
    table = quant_of(node)
    for t, x in zip(node.inputs, inputs):
        t.betensor = to_quantized(x, t, table)
    with torch.no_grad():
        node.forward()
    return to_float(node.outputs[0], table)


def weight_quant(qnode: PyNode) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """(scale, zero point, qmin, qmax) of a quantized layer's weights, scale/zp shaped to broadcast over axis 0."""
    w = qnode.constants["weights"]
    q = quant_of(qnode).get(w)
    nd = w.betensor.dim()
    shape = [-1] + [1] * (nd - 1)
    scale = torch.as_tensor(q.scale, dtype=torch.float32).reshape(shape) if isinstance(q.scale, torch.Tensor) \
        else torch.tensor(float(q.scale), dtype=torch.float32)
    zp = torch.as_tensor(q.zerop, dtype=torch.float32).reshape(shape) if isinstance(q.zerop, torch.Tensor) \
        else torch.tensor(float(q.zerop), dtype=torch.float32)
    return scale, zp, int(q.qmin), int(q.qmax)


def dequantized_weights(qnode: PyNode) -> torch.Tensor:
    """(w_q + zp) / scale of a quantized MAC layer: the weights its integer forward effectively uses."""
    scale, zp, _, _ = weight_quant(qnode)
    return dequantize(qnode.constants["weights"].betensor, scale, zp)


def float_apply(node: PyNode, x: torch.Tensor, weights: torch.Tensor, biases: Optional[torch.Tensor],
                activation: bool) -> torch.Tensor:
    """The layer's float forward on `x` with the given weights/biases (autograd flows through), optionally
    without its fused activation."""
    m = PyNode(node.name, node.type, node.layer_id)
    m.params = OrderedDict(node.params)
    if not activation:
        m.params["with_activation"] = "NONE"
    m.constants = OrderedDict([("weights", PyTensor("weights", weights))])
    if biases is not None:
        m.constants["biases"] = PyTensor("biases", biases)
    m.inputs = [PyTensor("x", x)]
    m.outputs = [PyTensor("y")]
    m.forward()
    return m.outputs[0].betensor


def channels_last(y: torch.Tensor, channels: int) -> torch.Tensor:
    """[samples, channels] view of a layer output whose last axis holds the channels."""
    return y.reshape(-1, channels)


def layer_errors(graph: PyGraph, reference: PyGraph, batches: Sequence[Batch],
                 names: Iterable[str]) -> Dict[str, float]:
    """Layer reconstruction error: MSE between each named layer's output in the quantized graph (dequantized,
    errors of earlier layers included) and the reference float graph's output, averaged over the batches."""
    names = set(names)
    if not names or not batches:
        return {}
    ref = capture(reference, batches, names)
    qio = capture(quantize_graph(graph), batches, names, quantized=True)
    errors = {}
    for name in names:
        acc = 0.0
        for (_, yf), (_, yq) in zip(ref[name], qio[name]):
            with one_thread():  # a full float sum: the same at any thread count (threads.py)
                acc += float(((yf[0].to(torch.float64) - yq[0].to(torch.float64)) ** 2).mean())
        errors[name] = acc / len(batches)
    return errors


def concat_cos(ys: Sequence[torch.Tensor], yq: Sequence[torch.Tensor]) -> float:
    return cosine(torch.cat([y.reshape(-1) for y in ys]), torch.cat([y.reshape(-1) for y in yq]))


def quantized_weights_like(qnode: PyNode, w: torch.Tensor) -> torch.Tensor:
    """Float weights `w` quantized with the quantized layer's weight params (as its quantize function rounds)."""
    scale, zp, qmin, qmax = weight_quant(qnode)
    return quantize(w, scale, zp, qmin, qmax)


# ------------------------------------------------------------------------------------------------ ranges and scales
def scaled(v: Union[float, torch.Tensor], f: float) -> Union[float, torch.Tensor]:
    """A calibrated bound divided by `f` (a range divided by f gives the scale f·S)."""
    return v / f if isinstance(v, torch.Tensor) else float(v) / f


Range = Tuple[TensorRange, ...]
"""Calibrated ranges of a tensor, per tensor (`axis` None) and/or per channel: a candidate or a method's result,
applied to a copy to measure it and to the graph's tensor once chosen (`set_range`)."""


def tensor_range(node: PyNode, t: PyTensor) -> Range:
    """The calibrated ranges of `t` (a tensor of `node`): per tensor, then per channel."""
    table = ranges_of(node)
    return table.get(t), table.channels(t)


def set_range(node: PyNode, t: PyTensor, values: Range) -> None:
    """Give tensor `t` of `node` (a copy's, or the graph's once a method has chosen) the calibrated ranges `values`
    (each per tensor or per channel by its axis)."""
    table = ranges_of(node)
    for r in values:
        if r.axis is None:
            table.set(t, r.min, r.max)
        else:
            table.set_channels(t, r.min, r.max, r.axis)


def search_factors(alpha: float, beta: float, nsteps: int) -> List[float]:
    """linspace(alpha, beta, nsteps) plus 1 (the current range), sorted, without repeats."""
    grid = torch.linspace(alpha, beta, nsteps, dtype=torch.float64).tolist() if nsteps > 1 else [alpha]
    return sorted(set([1.0] + [float(f) for f in grid]))


def range_for_scale(scale: torch.Tensor, zerop: torch.Tensor, qmin: int, qmax: int, symmetric: bool,
                    signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The calibrated range [min, max] from which `linear_quant_params` gives back `scale` (and `zerop`):
    symmetric ±(qmax − qmin)/S/2 (signed) or [0, (qmax − qmin)/S]; asymmetric [(qmin + zp)/S, (qmax + zp)/S]."""
    q_range = float(qmax - qmin)
    if symmetric:
        top = q_range / scale / (2.0 if signed else 1.0)
        return (-top if signed else torch.zeros_like(top)), top
    lo = (zerop + qmin) / scale
    return torch.clamp(lo, max=0.0), torch.clamp(lo + q_range / scale, min=0.0)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, zerop: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Quantize-dequantize with a straight-through rounding: gradients reach x and the scale (LSQ-style)."""
    v = x * scale - zerop
    q = torch.clamp(v + (torch.round(v) - v).detach(), qmin, qmax)
    return (q + zerop) / scale


def range_honoured(qgraph: PyGraph, t: PyTensor, qt: PyTensor) -> Optional[PyNode]:
    """The producer of `t` when its quantized output params follow its calibrated range (they are those of
    the range, and quantizing the producer again with a wider range changes them); shape-only producers that copy
    their input's params do not qualify."""
    producer = t.pnode
    r = ranges_of(producer).get(t) if producer is not None else None
    q = qgraph.quant.get(qt)  # the quantized graph's parameters of `qt`
    if producer is None or q.qinvariant or q.qbits is None or r.min is None or isinstance(q.scale, torch.Tensor):
        return None
    qproducer = qgraph.node(producer.name)
    bits = int(q.qbits)
    p = linear_quant_params(r.min, r.max, bits, activation_mode(producer, bits), is_signed(qproducer, qt))
    if float(p.scale) != float(q.scale) or int(p.zerop) != int(q.zerop) or (p.qmin, p.qmax) != (q.qmin, q.qmax):
        return None
    index = producer.outputs.index(t)
    wide = (TensorRange(scaled(r.min, 0.5), scaled(r.max, 0.5)),)
    try:
        probe = quantize_alone(producer, qproducer, change=lambda m: set_range(m, m.outputs[index], wide))
        wider = quant_of(probe).get(probe.outputs[index]).scale
    except (QuantOptError, ValueError, RuntimeError, KeyError):
        return None
    return producer if not isinstance(wider, torch.Tensor) and float(wider) != float(q.scale) else None


def fake_quant_range(x: torch.Tensor, lo: float, hi: float, q: TensorQuant, producer: PyNode) -> torch.Tensor:
    """`x` quantized and dequantized with the params the producer would derive from the range [lo, hi] (the bits
    and signedness of `q`, the quantized tensor's params)."""
    bits = int(q.qbits)
    signed = q.qmin is not None and q.qmin < 0  # ops/_quant.py is_signed
    p = linear_quant_params(lo, hi, bits, activation_mode(producer, bits), signed)
    return dequantize(quantize(x, p.scale, p.zerop, p.qmin, p.qmax), p.scale, p.zerop)


# ------------------------------------------------------------------------------------------------ graph helpers
def producer_of(graph: PyGraph, node: PyNode, index: int = 0) -> Optional[PyNode]:
    """The layer producing input `index` of `node` (None for a graph input without producer)."""
    if index >= len(node.inputs):
        return None
    p = node.inputs[index].pnode
    return graph.node(p.name) if p is not None else None


def consumers(graph: PyGraph, t: PyTensor) -> List[PyNode]:
    """Layers reading tensor `t`, in topological order."""
    return [n for n in graph.nodes if any(i is t for i in n.inputs)]


def clone_nodes(nodes: Sequence[PyNode]) -> List[PyNode]:
    """Copies of a connected run of layers (topological order) wired among themselves: an input produced inside
    the run is the copy of that output; every other tensor and constant is cloned. Quantizing or running the
    copies leaves the originals untouched; each copy looks its statistics up in its own table sharing the
    originals' entries, and all of them their ranges and quantization parameters up in one table each of copied
    entries."""
    tmap: Dict[int, PyTensor] = {}

    def ct(t: PyTensor) -> PyTensor:
        if id(t) not in tmap:
            tmap[id(t)] = t.clone()
        return tmap[id(t)]

    out = []
    for n in nodes:
        m = PyNode(n.name, n.type, n.layer_id)
        m.params = OrderedDict(n.params)
        m.attrs = {k: v for k, v in n.attrs.items() if not k.startswith("_")}
        m.settings = n.settings
        m.inputs = [ct(t) for t in n.inputs]
        m.outputs = [ct(t) for t in n.outputs]
        for t in m.outputs:
            t.pnode = m
        m.constants = OrderedDict((k, v.clone()) for k, v in n.constants.items())
        m.detached_statistics = detached_statistics(n, m)  # the originals' entries (graph/tables.py)
        out.append(m)
    # one range table and one parameter table for the run: a copy's quantization edits ranges and sets parameters
    # its readers' copies see (graph/tables.py)
    names = [t.name for m in out for t in node_tensors(m)]
    ranges = ranges_of(nodes[0]).copy(names) if nodes else RangeTable()
    quant = quant_of(nodes[0]).copy(names) if nodes else QuantTable()
    for m in out:
        m.detached_ranges = ranges
        m.detached_quant = quant
    return out


def skip_reason(qnode: PyNode) -> Optional[str]:
    """Why a layer of the quantized graph cannot be calibrated by a weight method (None when it can)."""
    if not qnode.quantized:
        return "it stays float in the quantized graph"
    w = qnode.constants.get("weights")
    if w is None or quant_of(qnode).get(w).qmin is None:
        return "its weights are not quantized"
    return None


def pad_samples(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Samples (axis 0) repeated up to a multiple of `batch_size` (at least one batch)."""
    n = int(x.shape[0])
    total = max(batch_size, int(math.ceil(n / batch_size)) * batch_size)
    reps = int(math.ceil(total / n))
    return torch.cat([x] * reps, dim=0)[:total]

