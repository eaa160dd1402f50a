"""Graph rewrites on the prepared ONNX graph, the ones the Compass Parser performs:

- BatchNormalization folded into the preceding Conv (when the Conv output feeds only the BatchNorm);
- x * clip(x + 3, 0, 6) / 6 (and x * HardSigmoid(x) with alpha 1/6) recognised as one HardSwish;
- MatMul by a constant matrix plus a constant bias vector merged into one fully connected layer;
- Relu / Clip after Conv, ConvTranspose, Gemm, MatMul (constant B), Add, Sub, Mul fused into `with_activation`.

A fused layer keeps the name of its first ONNX node and takes over the output tensor of the last one.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from .simplify import OGraph, ONode

ACT_HOSTS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul"}
HARDSWISH_TOL = 1e-6


def _single_consumer(g: OGraph, tensor: str, index: Dict[str, List[ONode]]) -> Optional[ONode]:
    users = index.get(tensor, [])
    if len(users) != 1 or tensor in g.outputs:
        return None
    return users[0]


def _index(g: OGraph) -> Dict[str, List[ONode]]:
    out: Dict[str, List[ONode]] = {}
    for n in g.nodes:
        for t in n.inputs:
            if t:
                out.setdefault(t, []).append(n)
    return out


def _scalar(g: OGraph, name: str) -> Optional[float]:
    v = g.consts.get(name)
    if v is None or v.size != 1 or not np.issubdtype(v.dtype, np.number):
        return None
    return float(v.reshape(-1)[0])


def _remove(g: OGraph, dead: List[ONode]) -> None:
    ids = {id(n) for n in dead}
    g.nodes = [n for n in g.nodes if id(n) not in ids]


def fold_batchnorm(g: OGraph) -> None:
    index = _index(g)
    dead = []
    for bn in list(g.nodes):
        if bn.op != "BatchNormalization" or len([o for o in bn.outputs if o]) != 1:
            continue
        if not all(t in g.consts for t in bn.inputs[1:5]):
            continue
        conv = next((n for n in g.nodes if bn.inputs[0] in n.outputs), None)
        if conv is None or conv.op != "Conv" or _single_consumer(g, bn.inputs[0], index) is not bn:
            continue
        if conv.inputs[1] not in g.consts or (len(conv.inputs) > 2 and conv.inputs[2]
                                              and conv.inputs[2] not in g.consts):
            continue
        gamma, beta, mean, var = (g.consts[t].astype(np.float64) for t in bn.inputs[1:5])
        eps = float(bn.attrs.get("epsilon", 1e-5))
        s = gamma / np.sqrt(var + eps)
        w = g.consts[conv.inputs[1]].astype(np.float64)
        b = g.consts[conv.inputs[2]].astype(np.float64) if len(conv.inputs) > 2 and conv.inputs[2] \
            else np.zeros(w.shape[0])
        wname, bname = f"{conv.name}::weights_bn", f"{conv.name}::biases_bn"
        g.consts[wname] = (w * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float32)
        g.consts[bname] = ((b - mean) * s + beta).astype(np.float32)
        conv.inputs = [conv.inputs[0], wname, bname]
        conv.outputs = [bn.outputs[0]]
        dead.append(bn)
    _remove(g, dead)


def fuse_conv_bias(g: OGraph) -> None:
    """Conv (constant weights) followed by Add of a constant per-channel vector [1, C, 1, 1] → the Conv's bias."""
    index = _index(g)
    dead = []
    for conv in list(g.nodes):
        if conv.op not in ("Conv", "ConvTranspose") or conv.inputs[1] not in g.consts:
            continue
        add = _single_consumer(g, conv.outputs[0], index)
        if add is None or add.op != "Add":
            continue
        other = add.inputs[1] if add.inputs[0] == conv.outputs[0] else add.inputs[0]
        v = g.consts.get(other)
        w = g.consts[conv.inputs[1]]
        group = int(conv.attrs.get("group", 1))
        out_c = w.shape[0] if conv.op == "Conv" else w.shape[1] * group
        rank = len(g.shapes.get(conv.outputs[0], ()))
        if v is None or v.ndim > rank or v.size not in (1, out_c):
            continue
        full = v.reshape((1,) * (rank - v.ndim) + v.shape) if v.ndim < rank else v
        if v.size == out_c and out_c > 1 and full.shape[1] != out_c:
            continue
        b = g.consts[conv.inputs[2]] if len(conv.inputs) > 2 and conv.inputs[2] else np.zeros(out_c, np.float32)
        bname = f"{conv.name}::biases_add"
        g.consts[bname] = (b.astype(np.float64) + np.broadcast_to(full.reshape(-1), (out_c,))).astype(np.float32)
        conv.inputs = [conv.inputs[0], conv.inputs[1], bname]
        conv.outputs = list(add.outputs)
        dead.append(add)
    _remove(g, dead)


def fuse_hardswish(g: OGraph) -> None:
    """Add(x,3) → Clip(0,6) → Mul(x,·) → Div(6) | Mul(1/6), and Mul(x, HardSigmoid(x; 1/6, 0.5)), → HardSwish."""
    index = _index(g)
    dead = []
    for add in list(g.nodes):
        if add.op == "HardSigmoid":
            a, b = float(add.attrs.get("alpha", 0.2)), float(add.attrs.get("beta", 0.5))
            mul = _single_consumer(g, add.outputs[0], index)
            x = add.inputs[0]
            if abs(a - 1 / 6) > HARDSWISH_TOL or abs(b - 0.5) > HARDSWISH_TOL or mul is None or mul.op != "Mul" \
                    or set(mul.inputs) != {x, add.outputs[0]}:
                continue
            g.nodes[g.nodes.index(mul)] = ONode(mul.name, "HardSwish", [x], mul.outputs, {})
            dead.append(add)
            continue
        if add.op != "Add":
            continue
        x = next((t for t in add.inputs if t not in g.consts), None)
        three = next((t for t in add.inputs if t in g.consts), None)
        if x is None or three is None or _scalar(g, three) != 3.0:
            continue
        clip = _single_consumer(g, add.outputs[0], index)
        if clip is None or clip.op != "Clip" or _clip_bounds(g, clip) != (0.0, 6.0):
            continue
        mul = _single_consumer(g, clip.outputs[0], index)
        if mul is None or mul.op != "Mul" or set(mul.inputs) != {x, clip.outputs[0]}:
            continue
        div = _single_consumer(g, mul.outputs[0], index)
        if div is None or div.op not in ("Div", "Mul") or div.inputs[0] != mul.outputs[0]:
            continue
        k = _scalar(g, div.inputs[1])
        if k is None or (div.op == "Div" and k != 6.0) or (div.op == "Mul" and abs(k - 1 / 6) > HARDSWISH_TOL):
            continue
        g.nodes[g.nodes.index(div)] = ONode(div.name, "HardSwish", [x], div.outputs, {})
        dead += [add, clip, mul]
    _remove(g, dead)


def _clip_bounds(g: OGraph, clip: ONode) -> Optional[tuple]:
    """(min, max) of a Clip with constant bounds (attributes before opset 11, inputs after); None otherwise."""
    lo, hi = clip.attrs.get("min", -np.inf), clip.attrs.get("max", np.inf)
    for pos in (1, 2):
        if len(clip.inputs) > pos and clip.inputs[pos]:
            v = _scalar(g, clip.inputs[pos])
            if v is None:
                return None
            if pos == 1:
                lo = v
            else:
                hi = v
    return float(lo), float(hi)


def fuse_matmul_bias(g: OGraph) -> None:
    index = _index(g)
    dead = []
    for mm in list(g.nodes):
        if mm.op != "MatMul" or mm.inputs[1] not in g.consts or g.consts[mm.inputs[1]].ndim != 2:
            continue
        add = _single_consumer(g, mm.outputs[0], index)
        if add is None or add.op != "Add":
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
    _remove(g, dead)


def fuse_activations(g: OGraph) -> None:
    index = _index(g)
    producers = {t: n for n in g.nodes for t in n.outputs}
    dead = []
    for act in list(g.nodes):
        if act.op not in ("Relu", "Clip"):
            continue
        host = producers.get(act.inputs[0])
        if host is None or host.op not in ACT_HOSTS or host.fused.get("with_activation"):
            continue
        if _single_consumer(g, act.inputs[0], index) is not act:
            continue
        if host.op == "MatMul" and host.inputs[1] not in g.consts:
            continue
        if host.op in ("Add", "Sub", "Mul") and any(t in g.consts for t in host.inputs):
            continue  # a constant operand becomes a Constant layer; keep the ONNX structure readable
        if act.op == "Relu":
            host.fused["with_activation"] = "RELU"
        else:
            bounds = _clip_bounds(g, act)
            if bounds is None or not all(np.isfinite(bounds)):
                continue
            if bounds == (0.0, 6.0):
                host.fused["with_activation"] = "RELU6"
            else:
                host.fused.update(with_activation="CLIP", clip_min=bounds[0], clip_max=bounds[1])
        host.outputs = list(act.outputs)
        dead.append(act)
    _remove(g, dead)


def run_fusions(g: OGraph) -> None:
    fold_batchnorm(g)
    fuse_conv_bias(g)
    fuse_hardswish(g)
    fuse_matmul_bias(g)
    fuse_activations(g)
