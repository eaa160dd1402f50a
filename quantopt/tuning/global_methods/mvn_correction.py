"""mvn_correction: range correction, and optionally higher precision, in front of normalization layers.

For every MVN, LayerNorm, InstanceNorm, GroupNorm or RMSNorm in scope, the nearest scale-deciding ancestor is
found by walking up first inputs until a layer whose output scale is its own choice (a norm, Convolution,
ConvTranspose(3D), Convolution3D, DepthwiseConv, FullyConnected, RNN, BasicLSTM, GRUv1, GRUv3, BatchNorm, MatMul,
Eltwise, Input or Constant) or a layer without producer. With s_in the scale of that ancestor's output and s_out
the scale of the norm's output in the quantized graph, the ancestor's output gets the scale

    s = sqrt(s_in · s_out) · max(alpha, sqrt(s_in / s_out))

(s >= s_in: a finer step, clipping the ancestor's outliers, which matter little to a normalization), i.e. the
range ±(qmax − qmin)/s/2 (signed) or [0, (qmax − qmin)/s]. The range is kept only when it lowers the MSE of the
norm's quantized output (errors of earlier layers included) against the float output on the calibration batches
given (measured on a copy of the graph with the new range), and only when the ancestor's quantized params follow
its range; it is then set once. alpha = 0 leaves ranges alone.

mode > 0 first promotes the ancestor, the layers on the paths from it to the norm, the norm, plus `beta`
generations of the ancestor's producers and `gamma` generations of the norm's consumers, to act_bits activations
(symmetric), wgt_bits weights, bias_bits biases, lut_bits lookup tables and multiplier_bits multipliers (default:
the activation bits): the layers' settings change, so quantization and the written per-layer template follow. The
range rule then uses the promoted integer range. Default alpha: 0.5 for mode 0, 1.0 otherwise.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Set, Tuple

import networkx as nx
import torch

from ...config.layer_settings import LayerSettings
from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...graph.tables import TensorRange
from ...log import OPT_INFO
from ...progress import progress
from ...quant.params import QuantMode
from ...quantizer import quantize_graph
from ._common import Batch, layer_errors, range_for_scale, range_honoured, set_range
from .spec import GlobalMethodSpec

MVN_TYPES = ("MVN", "LayerNorm", "InstanceNorm", "GroupNorm", "RMSNorm")
ANCESTOR_TYPES = MVN_TYPES + ("Convolution", "ConvTranspose", "Convolution3D", "ConvTranspose3D", "DepthwiseConv",
                              "FullyConnected", "RNN", "BasicLSTM", "GRUv1", "GRUv3", "BatchNorm", "MatMul",
                              "Eltwise", "Input", "Constant")
"""Layers whose output scale is decided by their own range (upstream's list)."""


def _ancestor(graph: PyGraph, norm: PyNode) -> Optional[PyNode]:
    node = norm
    while node.inputs and node.inputs[0].pnode is not None:
        node = graph.node(node.inputs[0].pnode.name)
        if str(node.type) in ANCESTOR_TYPES:
            return node
    return node if node is not norm else None


def _within(g: nx.DiGraph, start: str, hops: int) -> Set[str]:
    return set(nx.single_source_shortest_path_length(g, start, cutoff=hops)) if hops > 0 else set()


def promoted_layers(graph: PyGraph, ancestor: PyNode, norm: PyNode, beta: int, gamma: int) -> List[PyNode]:
    """The ancestor, every layer on a path from it to the norm, the norm, `beta` generations of producers of the
    ancestor and `gamma` generations of consumers of the norm, in topological order."""
    g = graph.nx
    names = {ancestor.name, norm.name} | (nx.descendants(g, ancestor.name) & nx.ancestors(g, norm.name))
    names |= _within(g.reverse(copy=False), ancestor.name, beta) | _within(g, norm.name, gamma)
    return [n for n in graph.nodes if n.name in names]


def _promote(nodes: Sequence[PyNode], spec: GlobalMethodSpec) -> None:
    act = spec.param("act_bits")
    for n in nodes:
        s = n.settings if n.settings is not None else LayerSettings()
        mode = QuantMode.from_name(s.q_mode_activation).to_symmetric().value
        n.settings = dataclasses.replace(s, q_bits_activation=act, q_bits_weight=spec.param("wgt_bits"),
                                         q_bits_bias=spec.param("bias_bits"), lut_items_in_bits=spec.param("lut_bits"),
                                         q_mode_activation=mode, multiplier_bits=spec.param("multiplier_bits"))


def _scales(qgraph: PyGraph, ancestor: PyNode, norm: PyNode) -> Optional[Tuple[float, float]]:
    table = qgraph.quant  # the quantized graph's params
    qi, qo = table.get(qgraph.node(ancestor.name).outputs[0]), table.get(qgraph.node(norm.name).outputs[0])
    if qi.qinvariant or qo.qinvariant or isinstance(qi.scale, torch.Tensor) or isinstance(qo.scale, torch.Tensor):
        return None
    return float(qi.scale), float(qo.scale)


def _correct_range(graph: PyGraph, reference: PyGraph, norm: PyNode, ancestor: PyNode, alpha: float,
                   data: Sequence[Batch]) -> Tuple[bool, str]:
    qgraph = quantize_graph(graph)
    scales = _scales(qgraph, ancestor, norm)
    t = ancestor.outputs[0]
    qt = qgraph.node(ancestor.name).outputs[0]
    if scales is None or range_honoured(qgraph, t, qt) is None:
        return False, f"range of '{t.name}' kept: its quantized params do not follow a per-tensor range"
    s_in, s_out = scales
    s = math.sqrt(s_in * s_out) * max(alpha, math.sqrt(s_in / s_out))
    q = qgraph.quant.get(qt)
    lo, hi = range_for_scale(torch.tensor(s, dtype=torch.float64), torch.tensor(0.0), int(q.qmin), int(q.qmax),
                             True, int(q.qmin) < 0)
    new = (TensorRange(float(lo), float(hi)),)
    before = layer_errors(graph, reference, data, [norm.name])[norm.name]
    candidate = graph.clone()
    c_node = candidate.node(ancestor.name)
    set_range(c_node, c_node.outputs[0], new)
    after = layer_errors(candidate, reference, data, [norm.name])[norm.name]
    r = graph.ranges.get(t)
    text = (f"'{t.name}' range [{float(r.min):.6g}, {float(r.max):.6g}] -> [{float(lo):.6g}, {float(hi):.6g}] "
            f"(scale {s_in:.6g} -> {s:.6g}, norm output scale {s_out:.6g})")
    if not after < before:
        return False, f"{text} not kept: norm output mse {before:.6g} -> {after:.6g}"
    set_range(ancestor, t, new)
    return True, f"{text}; norm output mse {before:.6g} -> {after:.6g}"


def mvn_correction(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]
                   ) -> List[str]:
    """Correct (and in mode > 0 promote) the layers feeding every normalization in scope; returns the layers
    whose range or settings changed."""
    mode = spec.param("mode")
    alpha = spec.param("alpha")
    alpha = float(alpha) if alpha is not None else (0.5 if mode <= 0 else 1.0)
    norms = [n for n in graph.nodes if str(n.type) in MVN_TYPES and spec.in_scope(n)]
    if not norms:
        OPT_INFO("mvn_correction: no normalization layer in scope")
        return []
    data = list(batches)
    changed: List[str] = []
    for norm in progress(norms, "mvn_correction"):
        ancestor = _ancestor(graph, norm)
        if ancestor is None:
            OPT_INFO(f"mvn_correction: norm '{norm.name}' skipped: its input has no producer")
            continue
        if mode > 0:
            layers = promoted_layers(graph, ancestor, norm, spec.param("beta"), spec.param("gamma"))
            _promote(layers, spec)
            changed += [n.name for n in layers if n.name not in changed]
            OPT_INFO(f"mvn_correction: norm '{norm.name}': {len(layers)} layer(s) promoted to "
                     f"{spec.param('act_bits')}-bit activations, {spec.param('wgt_bits')}-bit weights, "
                     f"{spec.param('bias_bits')}-bit biases: {', '.join(n.name for n in layers)}")
        if alpha <= 0:
            continue
        kept, message = _correct_range(graph, reference, norm, ancestor, alpha, data)
        if kept and ancestor.name not in changed:
            changed.append(ancestor.name)
        OPT_INFO(f"mvn_correction: norm '{norm.name}', ancestor '{ancestor.name}' ({ancestor.type}): {message}")
    return changed
