"""Graph rewrites on the prepared ONNX graph, the ones the Compass Parser performs, in the Parser's order:

1. GELU, LayerNorm / MVN, SiLU / Swish, HardSwish / HardSigmoid written out in primitive ops → one node each
   (fuse_act.py, fuse_norm.py);
2. MatMul by a constant matrix plus a constant bias vector → one fully connected layer;
3. BatchNormalization, and Mul + Add/Sub by per-channel constants → ChannelAffine (a BatchNorm layer); then any
   other Add/Sub of zeros → no node (after: a Mul by a constant and an Add of zeros are a BatchNorm for the Parser);
4. a constant per-channel Add after a Conv → the Conv's bias; a ChannelAffine or a single Mul/Div/Sub by a constant
   right after a Conv, ConvTranspose or fully connected layer → folded into its weights and biases;
5. Relu / Clip(0, 6) after Conv, ConvTranspose, fully connected MatMul/Gemm, Add, Sub, Mul, Max, Min → their
   `with_activation`.

Each pass leaves the graph in topological order and every remaining tensor with its shape.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from .fuse_act import clip_bounds, fuse_gelu, fuse_hard_activations, fuse_swish
from .fuse_norm import batchnorm_to_affine, fold_into_linear, fuse_layernorm, fuse_mul_add, fuse_rmsnorm
from .pattern import Index, new_const, remove
from .simplify import OGraph, ONode

ELTWISE_HOSTS = ("Add", "Sub", "Mul", "Max", "Min", "Sum")
ACT_HOSTS = ("Conv", "ConvTranspose", "Gemm", "MatMul") + ELTWISE_HOSTS


def drop_neutral_arithmetic(g: OGraph) -> None:
    """Add/Sub of an all-zero constant that leaves the activation's shape and element type as they are → no node, as
    the Parser drops it (e.g. an attention bias of 0 in a model without padding). Run after `fuse_mul_add`: a Mul
    by a constant followed by an Add of zeros is a BatchNorm for the Parser. A Mul by 1 stays: the Parser reads
    `x·sigmoid(1·x)` as a SWISH, not a SILU."""
    alias: Dict[str, str] = {}
    dead: List[ONode] = []
    for n in g.nodes:
        if n.op not in ("Add", "Sub") or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2:
            continue
        x, c = n.inputs
        if n.op == "Add" and x in g.consts:
            x, c = c, x
        if x in g.consts or c not in g.consts or n.outputs[0] in g.outputs:
            continue
        v = g.consts[c]
        if v.size == 0 or not np.issubdtype(v.dtype, np.number) or np.any(v != 0):
            continue
        out = n.outputs[0]
        if g.shapes.get(out) != g.shapes.get(x) or g.dtypes.get(out) != g.dtypes.get(x):
            continue
        alias[out] = alias.get(x, x)
        dead.append(n)
    if not dead:
        return
    remove(g, dead)
    for n in g.nodes:
        n.inputs = [alias.get(t, t) for t in n.inputs]


def fuse_conv_bias(g: OGraph) -> None:
    """Conv (constant weights) followed by Add of a constant per-channel vector [1, C, 1, 1] → the Conv's bias."""
    idx = Index(g)
    dead: List[ONode] = []
    for conv in list(g.nodes):
        if conv.op not in ("Conv", "ConvTranspose") or conv.inputs[1] not in g.consts:
            continue
        add = idx.single(conv.outputs[0])
        if add is None or add.op != "Add" or len(add.inputs) != 2:
            continue
        other = add.inputs[1] if add.inputs[0] == conv.outputs[0] else add.inputs[0]
        v = g.consts.get(other)
        w = g.consts[conv.inputs[1]]
        rank = len(g.shapes.get(conv.outputs[0], ()))
        if w.ndim < 3 or rank < 3:  # not weights of a convolution: left to its converter, which names the fault
            continue
        group = int(conv.attrs.get("group", 1))
        out_c = w.shape[0] if conv.op == "Conv" else w.shape[1] * group
        if v is None or v.ndim > rank or v.size not in (1, out_c):
            continue
        full = v.reshape((1,) * (rank - v.ndim) + v.shape) if v.ndim < rank else v
        if v.size == out_c and out_c > 1 and full.shape[1] != out_c:
            continue
        b = g.consts[conv.inputs[2]] if len(conv.inputs) > 2 and conv.inputs[2] else np.zeros(out_c, np.float32)
        total = (b.astype(np.float64) + np.broadcast_to(full.reshape(-1), (out_c,))).astype(np.float32)
        conv.inputs = [conv.inputs[0], conv.inputs[1], new_const(g, f"{conv.name}_biases", total)]
        conv.outputs = list(add.outputs)
        dead.append(add)
    remove(g, dead)


def fuse_matmul_bias(g: OGraph) -> None:
    idx = Index(g)
    dead: List[ONode] = []
    for mm in list(g.nodes):
        if mm.op != "MatMul" or mm.inputs[1] not in g.consts or g.consts[mm.inputs[1]].ndim != 2:
            continue
        add = idx.single(mm.outputs[0])
        if add is None or add.op != "Add" or len(add.inputs) != 2:
            continue
        other = add.inputs[1] if add.inputs[0] == mm.outputs[0] else add.inputs[0]
        n_out = g.consts[mm.inputs[1]].shape[1]
        bias = g.consts.get(other)
        if bias is None or bias.size != n_out or (bias.ndim and bias.shape[-1] != n_out):
            continue
        if bias.ndim > len(g.shapes.get(mm.outputs[0], ())):
            continue
        mm.fused["bias"] = other
        mm.outputs = list(add.outputs)
        dead.append(add)
    remove(g, dead)


def fuse_activations(g: OGraph) -> None:
    """Relu after a Conv, ConvTranspose, fully connected MatMul/Gemm or element-wise Add/Sub/Mul/Max/Min, and Clip(0, 6)
    after those but an Add/Sub/Mul whose operands broadcast → their `with_activation` RELU / RELU6, as the Parser
    fuses them. It fuses no other Clip; LeakyRelu, which it fuses too, stays a layer here (quantopt does not quantize
    a fused LEAKYRELU)."""
    idx = Index(g)
    dead: List[ONode] = []
    for act in list(g.nodes):
        if act.op not in ("Relu", "Clip") or act.domain not in ("", "ai.onnx"):
            continue
        host = idx.producer.get(act.inputs[0])
        if host is None or host.op not in ACT_HOSTS or host.domain not in ("", "ai.onnx") \
                or host.fused.get("with_activation") or idx.single(act.inputs[0]) is not act:
            continue
        if host.op in ("MatMul", "Gemm") and host.inputs[1] not in g.consts:
            continue  # not a fully connected layer
        if host.op in ELTWISE_HOSTS and len([t for t in host.inputs if t]) != 2:
            continue
        if act.op == "Clip":
            if clip_bounds(g, act) != (0.0, 6.0) or (host.op in ("Add", "Sub", "Mul") and _broadcasts(g, host)):
                continue
            host.fused["with_activation"] = "RELU6"
        else:
            host.fused["with_activation"] = "RELU"
        host.outputs = list(act.outputs)
        dead.append(act)
    remove(g, dead)


def _broadcasts(g: OGraph, node: ONode) -> bool:
    """The operands' shapes differ: the layer is a standalone Add/Sub/Mul, not an Eltwise."""
    return len({tuple(g.shapes.get(t, ())) for t in node.inputs}) > 1


def run_fusions(g: OGraph) -> None:
    fuse_gelu(g)
    fuse_layernorm(g)
    fuse_rmsnorm(g)
    fuse_swish(g)
    fuse_hard_activations(g)
    fuse_matmul_bias(g)
    batchnorm_to_affine(g)
    fuse_mul_add(g)
    drop_neutral_arithmetic(g)
    fuse_conv_bias(g)
    fold_into_linear(g)
    fuse_activations(g)
