"""Shared pieces of the global calibration methods: which layers they touch, capturing layer inputs/outputs of a
float or quantized graph, quantizing one layer on its own, and the layer reconstruction error."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ...analysis.similarity import cosine, to_float, to_quantized
from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tensor import PyTensor
from ...quant.params import dequantize, quantize
from ...quantizer import quantize_graph
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
    """Inputs and outputs of the named layers for every batch (dequantized for a quantized graph)."""
    found: LayerIO = {name: [] for name in names}

    def value(t: PyTensor) -> torch.Tensor:
        return to_float(t).clone() if quantized else t.betensor.detach().clone()

    def hook(node: PyNode) -> None:
        if node.name in found:
            found[node.name].append(([value(t) for t in node.inputs], [value(t) for t in node.outputs]))

    with torch.no_grad():
        for b in batches:
            graph.forward(list(b), after_node=hook)
    return found


def quantize_alone(fnode: PyNode, qnode: PyNode, input_params: Optional[PyTensor] = None) -> PyNode:
    """A copy of the float layer quantized on its own, its input carrying the params of the quantized graph's
    input (or of `input_params`). The float layer and the graphs are left untouched."""
    m = PyNode(fnode.name, fnode.type, fnode.layer_id)
    m.params = OrderedDict(fnode.params)
    m.attrs = {k: v for k, v in fnode.attrs.items() if not k.startswith("_")}
    m.settings = fnode.settings
    m.inputs = [t.clone() for t in qnode.inputs]
    if input_params is not None:
        m.inputs[0] = input_params.clone()
    m.outputs = [t.clone() for t in fnode.outputs]
    m.constants = OrderedDict((k, v.clone()) for k, v in fnode.constants.items())
    m.quantize()
    return m


def run_alone(node: PyNode, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Dequantized output of a layer quantized by `quantize_alone`, fed float inputs quantized with its input
    params."""
    for t, x in zip(node.inputs, inputs):
        t.betensor = to_quantized(x, t)
    with torch.no_grad():
        node.forward()
    return to_float(node.outputs[0])


def weight_quant(qnode: PyNode) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """(scale, zero point, qmin, qmax) of a quantized layer's weights, scale/zp shaped to broadcast over axis 0."""
    w = qnode.constants["weights"]
    nd = w.betensor.dim()
    shape = [-1] + [1] * (nd - 1)
    scale = torch.as_tensor(w.scale, dtype=torch.float32).reshape(shape) if isinstance(w.scale, torch.Tensor) \
        else torch.tensor(float(w.scale), dtype=torch.float32)
    zp = torch.as_tensor(w.zerop, dtype=torch.float32).reshape(shape) if isinstance(w.zerop, torch.Tensor) \
        else torch.tensor(float(w.zerop), dtype=torch.float32)
    return scale, zp, int(w.qmin), int(w.qmax)


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
            acc += float(((yf[0].to(torch.float64) - yq[0].to(torch.float64)) ** 2).mean())
        errors[name] = acc / len(batches)
    return errors


def concat_cos(ys: Sequence[torch.Tensor], yq: Sequence[torch.Tensor]) -> float:
    return cosine(torch.cat([y.reshape(-1) for y in ys]), torch.cat([y.reshape(-1) for y in yq]))


def quantized_weights_like(qnode: PyNode, w: torch.Tensor) -> torch.Tensor:
    """Float weights `w` quantized with the quantized layer's weight params (as its quantize function rounds)."""
    scale, zp, qmin, qmax = weight_quant(qnode)
    return quantize(w, scale, zp, qmin, qmax)
