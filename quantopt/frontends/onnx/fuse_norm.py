"""Normalization and per-channel affine fusions the Compass Parser performs, on the prepared ONNX graph:

- LayerNorm written out (ReduceMean, Sub, Pow 2 (or d*d), ReduceMean, Add eps, Sqrt, Div, then Mul gamma and Add
  beta) → one LayerNorm; without gamma and beta → MVN;
- RMSNorm written out (Pow 2 (or x*x), ReduceMean, Add eps, Sqrt, then Div(x, s), or Reciprocal / Div(1, s) and a
  Mul by x; a Cast to the same float type; then an optional Mul by gamma) → one RMSNorm, as LLaMA's and T5's
  exports write it;
- BatchNormalization (inference) and Mul by a constant followed by Add/Sub of a constant, each constant a scalar or
  one value per channel → ChannelAffine (written as a BatchNorm: `weights` the scale, `biases` the shift);
- a ChannelAffine, or a single Mul/Div/Sub by such a constant, right after a Conv, ConvTranspose or fully connected
  MatMul/Gemm whose output feeds nothing else → folded into that layer's weights and biases.

Which axis a Mul/Add pair scales follows the Parser: one scalar pair scales the channel axis (1) of a tensor of rank
3 or more and the last axis otherwise; a constant shaped [C, 1, ...] the channel axis; anything else the last axis;
the constants must broadcast along that axis only (checked here, so the fusion is exact).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .fuse_act import clip_bounds
from .pattern import FUSED_DOMAIN, Index, close, const_and_var, f32, new_const, remove, replace, scalar
from .simplify import OGraph, ONode

LINEAR_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


Finder = Callable[[OGraph, Index, ONode], Optional[Tuple[ONode, ONode, List[ONode]]]]


def _fuse_patterns(g: OGraph, first_ops: Sequence[str], find: Finder) -> None:
    """Replace every pattern `find` recognizes from a node of `first_ops` by its fused node."""
    idx = Index(g)
    dead: List[ONode] = []
    for first in list(g.nodes):
        if first.op not in first_ops or any(n is first for n in dead):
            continue
        found = find(g, idx, first)
        if found is None:
            continue
        last, node, interior = found
        replace(g, last, node)
        dead += [n for n in interior if n is not last]
    remove(g, dead)


# ================================================================================================ LayerNorm
def fuse_layernorm(g: OGraph) -> None:
    _fuse_patterns(g, ("ReduceMean",), _layernorm)


# ================================================================================================ RMSNorm
def fuse_rmsnorm(g: OGraph) -> None:
    _fuse_patterns(g, ("Pow", "Mul"), _rmsnorm)


def _rmsnorm(g: OGraph, idx: Index, sq: ONode) -> Optional[Tuple[ONode, ONode, List[ONode]]]:
    """(node whose place the fused node takes, the fused RMSNorm, every node of the pattern) or None."""
    x = sq.inputs[0]
    if sq.op == "Pow" and (len(sq.inputs) != 2 or not close(scalar(g, sq.inputs[1]), 2.0)):
        return None
    if sq.op == "Mul" and list(sq.inputs) != [x, x]:
        return None
    if x in g.consts or not _is_float(g, x):
        return None
    mean = idx.single(sq.outputs[0])
    axes = _reduce_axes(g, mean) if mean is not None and mean.op == "ReduceMean" else None
    add = idx.single(mean.outputs[0]) if axes is not None else None
    pair = const_and_var(g, add) if add is not None and add.op == "Add" else None
    eps = scalar(g, pair[0]) if pair is not None else None
    sqrt = idx.single(add.outputs[0]) if eps is not None else None
    if sqrt is None or sqrt.op != "Sqrt":
        return None
    nodes = [sq, mean, add, sqrt]
    nxt = idx.single(sqrt.outputs[0])
    if nxt is None:
        return None
    if nxt.op == "Div" and list(nxt.inputs) == [x, sqrt.outputs[0]]:
        normed = nxt
    else:
        if nxt.op == "Reciprocal" or (nxt.op == "Div" and nxt.inputs[1] == sqrt.outputs[0]
                                      and close(scalar(g, nxt.inputs[0]), 1.0)):
            normed = idx.single(nxt.outputs[0])
        else:
            return None
        if normed is None or normed.op != "Mul" or sorted(normed.inputs) != sorted([x, nxt.outputs[0]]):
            return None
        nodes.append(nxt)
    nodes.append(normed)
    last = normed
    cast = idx.single(last.outputs[0])
    if cast is not None and cast.op == "Cast" and g.dtypes.get(cast.outputs[0]) == g.dtypes.get(last.outputs[0]):
        nodes.append(cast)
        last = cast
    shape = g.shapes.get(x)
    if shape is None:  # shape inference could not give it (the converters report such tensors)
        return None
    gamma = None
    mul = idx.single(last.outputs[0])
    mpair = const_and_var(g, mul) if mul is not None and mul.op == "Mul" else None
    if mpair is not None:
        gamma = _over_axes(g.consts[mpair[0]], axes, shape)
        if gamma is not None:
            nodes.append(mul)
            last = mul
    if gamma is None:
        gamma = np.ones([shape[a] for a in axes], np.float32)
    wname = new_const(g, f"{last.name}_scale", gamma)
    fused = ONode(last.name, "RMSNorm", [x, wname], list(last.outputs), {"axes": list(axes), "epsilon": f32(eps)},
                  FUSED_DOMAIN)
    return last, fused, nodes


def _reduce_axes(g: OGraph, node: ONode) -> Optional[Tuple[int, ...]]:
    rank = len(g.shapes.get(node.inputs[0], ()))
    if not int(node.attrs.get("keepdims", 1)) or not rank:
        return None
    if len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in g.consts:
            return None
        axes = np.asarray(g.consts[node.inputs[1]]).reshape(-1).tolist()
    else:
        axes = node.attrs.get("axes", [])
        if not isinstance(axes, list) or not all(isinstance(a, int) for a in axes):
            return None  # an attribute of another type: not a pattern (the converter reports the node)
    if not axes:
        return None
    return tuple(sorted({int(a) % rank for a in axes}))


def _layernorm(g: OGraph, idx: Index, mean1: ONode) -> Optional[Tuple[ONode, ONode, List[ONode]]]:
    """(node whose place the fused node takes, the fused node, every node of the pattern) or None."""
    x = mean1.inputs[0]
    axes = _reduce_axes(g, mean1)
    sub = idx.single(mean1.outputs[0])
    if axes is None or sub is None or sub.op != "Sub" or list(sub.inputs) != [x, mean1.outputs[0]]:
        return None
    d = sub.outputs[0]
    users = list({id(u): u for u in idx.consumers.get(d, [])}.values())  # Mul(d, d) reads d twice
    sq = next((u for u in users if u.op == "Pow" or (u.op == "Mul" and list(u.inputs) == [d, d])), None)
    div = next((u for u in users if u.op == "Div" and list(u.inputs[:1]) == [d]), None)
    if sq is None or div is None or len(users) != 2 or d in g.outputs:
        return None
    if sq.op == "Pow" and (sq.inputs[0] != d or not close(scalar(g, sq.inputs[1]), 2.0)):
        return None
    mean2 = idx.single(sq.outputs[0])
    if mean2 is None or mean2.op != "ReduceMean" or _reduce_axes(g, mean2) != axes:
        return None
    add = idx.single(mean2.outputs[0])
    pair = const_and_var(g, add) if add is not None and add.op == "Add" else None
    eps = scalar(g, pair[0]) if pair is not None else None
    eps = f32(eps) if eps is not None else None
    sqrt = idx.single(add.outputs[0]) if eps is not None else None
    if sqrt is None or sqrt.op != "Sqrt" or idx.single(sqrt.outputs[0]) is not div or div.inputs[1] != sqrt.outputs[0]:
        return None
    nodes = [mean1, sub, sq, mean2, add, sqrt, div]
    shape = g.shapes.get(x)
    if shape is None:  # shape inference could not give it (the converters report such tensors)
        return None
    affine = _gamma_beta(g, idx, div, axes, shape)
    if affine is None:
        return div, ONode(div.name, "MVN", [x], list(div.outputs), {"axes": list(axes), "epsilon": eps},
                          FUSED_DOMAIN), nodes
    mul, add2, gamma, beta = affine
    wname = new_const(g, f"{add2.name}_scale", gamma)
    bname = new_const(g, f"{add2.name}_bias", beta)
    fused = ONode(add2.name, "LayerNorm", [x, wname, bname], list(add2.outputs),
                  {"axes": list(axes), "epsilon": eps}, FUSED_DOMAIN)
    return add2, fused, nodes + [mul, add2]


def _gamma_beta(g: OGraph, idx: Index, div: ONode, axes: Sequence[int],
                shape: Sequence[int]) -> Optional[Tuple[ONode, ONode, np.ndarray, np.ndarray]]:
    """The Mul by gamma and Add of beta after the normalization, with gamma and beta over the normalized axes."""
    mul = idx.single(div.outputs[0])
    mpair = const_and_var(g, mul) if mul is not None and mul.op == "Mul" else None
    add = idx.single(mul.outputs[0]) if mpair is not None else None
    apair = const_and_var(g, add) if add is not None and add.op == "Add" else None
    if apair is None:
        return None
    gamma, beta = (_over_axes(g.consts[c], axes, shape) for c in (mpair[0], apair[0]))
    if gamma is None or beta is None:
        return None
    return mul, add, gamma, beta


def _over_axes(value: np.ndarray, axes: Sequence[int], shape: Sequence[int]) -> Optional[np.ndarray]:
    """A constant broadcast over `shape` that varies only along `axes`, as an array of shape[axes]; else None."""
    v = np.asarray(value, dtype=np.float32)
    rank = len(shape)
    if v.ndim > rank:
        return None
    v = v.reshape((1,) * (rank - v.ndim) + v.shape)
    if any(v.shape[a] != 1 for a in range(rank) if a not in axes):
        return None
    if any(v.shape[a] not in (1, shape[a]) for a in axes):
        return None
    target = [shape[a] if a in axes else 1 for a in range(rank)]
    return np.array(np.broadcast_to(v, target).reshape([shape[a] for a in axes]), dtype=np.float32)


# ================================================================================================ ChannelAffine
def affine_node(name: str, x: str, outputs: List[str], g: OGraph, scale: np.ndarray, shift: np.ndarray, axis: int,
                epsilon: float) -> ONode:
    s = new_const(g, f"{name}_weights", np.asarray(scale, np.float32).reshape(-1))
    b = new_const(g, f"{name}_biases", np.asarray(shift, np.float32).reshape(-1))
    return ONode(name, "ChannelAffine", [x, s, b], outputs, {"axis": axis, "epsilon": float(epsilon)}, FUSED_DOMAIN)


def batchnorm_to_affine(g: OGraph) -> None:
    """Inference BatchNormalization with constant statistics → ChannelAffine over axis 1 (its epsilon kept as the
    informative `epsilon` the Parser writes)."""
    for i, bn in enumerate(list(g.nodes)):
        if bn.op != "BatchNormalization" or len([o for o in bn.outputs if o]) != 1 \
                or int(bn.attrs.get("training_mode", 0)) or not all(t in g.consts for t in bn.inputs[1:5]):
            continue
        if len(g.shapes.get(bn.inputs[0], ())) < 2:
            continue
        gamma, beta, mean, var = (g.consts[t].astype(np.float64) for t in bn.inputs[1:5])
        eps = float(bn.attrs.get("epsilon", 1e-5))
        s = gamma / np.sqrt(var + eps)
        g.nodes[i] = affine_node(bn.name, bn.inputs[0], bn.outputs[:1], g, s, beta - mean * s, 1, eps)


def _affine_axis(shape: Sequence[int], c1: np.ndarray, c2: np.ndarray) -> Optional[int]:
    """The axis a Mul/Add pair scales, as the Parser picks it, if both constants vary along it alone."""
    rank = len(shape)
    if rank == 0:
        return None
    if c1.size == 1 and c2.size == 1:
        axis = 1 if rank > 2 else rank - 1
    elif rank > 2 and shape[1] == c1.size and c1.ndim > 1 and c1.shape[-1] == 1:
        axis = 1
    else:
        axis = rank - 1
    for c in (c1, c2):
        if c.ndim > rank or c.size not in (1, shape[axis]):
            return None
        full = c.shape if c.ndim == rank else (1,) * (rank - c.ndim) + c.shape
        if any(d != 1 for a, d in enumerate(full) if a != axis):
            return None
    return axis


def fuse_mul_add(g: OGraph) -> None:
    """Mul(x, c1) → Add/Sub(·, c2) (c2 the second operand, as the Parser requires) → ChannelAffine named after
    the Mul."""
    idx = Index(g)
    dead: List[ONode] = []
    for mul in list(g.nodes):
        if mul.op != "Mul" or mul.domain not in ("", "ai.onnx") or any(n is mul for n in dead):
            continue
        pair = const_and_var(g, mul)
        nxt = idx.single(mul.outputs[0])
        if pair is None or nxt is None or nxt.op not in ("Add", "Sub") or len(nxt.inputs) != 2 \
                or nxt.inputs[0] != mul.outputs[0] or nxt.inputs[1] not in g.consts:
            continue
        c1, x = g.consts[pair[0]], pair[1]
        c2 = g.consts[nxt.inputs[1]]
        shape = g.shapes.get(x)
        if shape is None or not _is_float(g, x) or not _is_float_array(c1) or not _is_float_array(c2):
            continue
        axis = _affine_axis(shape, c1, c2)
        if axis is None:
            continue
        n = shape[axis]
        scale = np.broadcast_to(c1.astype(np.float64).reshape(-1), (n,))
        shift = np.broadcast_to(c2.astype(np.float64).reshape(-1), (n,)) * (-1.0 if nxt.op == "Sub" else 1.0)
        replace(g, mul, affine_node(mul.name, x, list(nxt.outputs), g, scale, shift, axis, 0.0))
        dead.append(nxt)
    remove(g, dead)


def _is_float(g: OGraph, t: str) -> bool:
    dt = g.dtypes.get(t)
    return dt is None or np.issubdtype(np.dtype(dt), np.floating)


def _is_float_array(v: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(v).dtype, np.floating)


# ================================================================================================ folding
def fold_into_linear(g: OGraph) -> None:
    """A ChannelAffine, or a Mul/Div/Sub by a per-channel or scalar constant, on the only output use of a Conv,
    ConvTranspose or fully connected layer → folded into that layer. A single Mul/Div/Sub followed by Relu,
    LeakyRelu or Clip(0, 6) is left alone (the Parser keeps it, so that the activation fuses into it)."""
    changed = True
    while changed:
        changed = False
        idx = Index(g)
        for node in list(g.nodes):
            lin = _linear_before(g, idx, node)
            if lin is None:
                continue
            axis = 1 if lin.op in ("Conv", "ConvTranspose") else len(g.shapes[lin.outputs[0]]) - 1
            affine = _as_affine(g, idx, node, lin.outputs[0], axis)
            if affine is None or not _apply(g, lin, *affine):
                continue
            lin.outputs = list(node.outputs)
            remove(g, [node])
            changed = True
            break


def _linear_before(g: OGraph, idx: Index, node: ONode) -> Optional[ONode]:
    for t in node.inputs:
        lin = idx.producer.get(t) if t and t not in g.consts else None
        if lin is not None and lin.op in LINEAR_OPS and idx.single(t) is node and lin.outputs[0] in g.shapes and \
                _linear_consts(g, lin):
            return lin
    return None


def _linear_consts(g: OGraph, lin: ONode) -> bool:
    """The layer's weights (and bias) are constants, and a MatMul/Gemm is one the converters make an FC of."""
    if len(lin.inputs) < 2 or lin.inputs[1] not in g.consts or "with_activation" in lin.fused:
        return False
    if lin.op in ("Conv", "ConvTranspose"):
        return len(lin.inputs) < 3 or not lin.inputs[2] or lin.inputs[2] in g.consts
    if lin.op == "MatMul":
        return g.consts[lin.inputs[1]].ndim == 2 and len(g.shapes.get(lin.inputs[0], ())) >= 2
    c = lin.inputs[2] if len(lin.inputs) > 2 and lin.inputs[2] else None
    n_out = g.shapes[lin.outputs[0]][-1]
    return not int(lin.attrs.get("transA", 0)) and (c is None or (c in g.consts and g.consts[c].size in (1, n_out)))


def _as_affine(g: OGraph, idx: Index, node: ONode, src: str, axis: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(scale, shift) per channel of `axis` that `node` applies to `src`, or None."""
    n = g.shapes[src][axis]
    if node.domain == FUSED_DOMAIN and node.op == "ChannelAffine":
        if node.attrs["axis"] != axis or node.inputs[0] != src:
            return None
        return g.consts[node.inputs[1]].astype(np.float64), g.consts[node.inputs[2]].astype(np.float64)
    if node.op not in ("Mul", "Div", "Sub") or node.domain not in ("", "ai.onnx"):
        return None
    pair = const_and_var(g, node)
    if pair is None or pair[1] != src or (node.op != "Mul" and pair[2] != 1) or _before_activation(g, idx, node):
        return None
    c = g.consts[pair[0]]
    if not _is_float_array(c):
        return None
    rank = len(g.shapes[src])
    full = c.reshape((1,) * (rank - c.ndim) + c.shape) if c.ndim <= rank else None
    if full is None or any(d != 1 for a, d in enumerate(full.shape) if a != axis) or c.size not in (1, n):
        return None
    v = np.broadcast_to(c.astype(np.float64).reshape(-1), (n,))
    if node.op == "Mul":
        return v, np.zeros(n)
    if node.op == "Div":
        return (1.0 / v, np.zeros(n)) if np.all(v != 0) else None
    return np.ones(n), -v


def _before_activation(g: OGraph, idx: Index, node: ONode) -> bool:
    nxt = idx.single(node.outputs[0])
    if nxt is None:
        return False
    if nxt.op in ("Relu", "LeakyRelu"):
        return True
    return nxt.op == "Clip" and clip_bounds(g, nxt) == (0.0, 6.0)


def _apply(g: OGraph, lin: ONode, scale: np.ndarray, shift: np.ndarray) -> bool:
    """Scale the layer's output channels by `scale` and add `shift` (new constants; the originals may be shared)."""
    w = g.consts[lin.inputs[1]].astype(np.float64)
    if lin.op == "Conv":
        out_c = w.shape[0]
        b = _const_or_zeros(g, lin.inputs[2] if len(lin.inputs) > 2 else "", out_c)
        w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    elif lin.op == "ConvTranspose":
        group = int(lin.attrs.get("group", 1))
        cin, cout_g = w.shape[0], w.shape[1]
        b = _const_or_zeros(g, lin.inputs[2] if len(lin.inputs) > 2 else "", cout_g * group)
        per = np.array([[scale[(ci // (cin // group)) * cout_g + j] for j in range(cout_g)] for ci in range(cin)])
        w = w * per.reshape(per.shape + (1,) * (w.ndim - 2))
    else:
        w, b = _fc_weights(g, lin)
        w = w * scale.reshape(1, -1)
        lin.op, lin.attrs = "MatMul", {}
    wname = new_const(g, f"{lin.name}_weights", w.astype(np.float32))
    bname = new_const(g, f"{lin.name}_biases", (b * scale + shift).astype(np.float32))
    if lin.op == "MatMul":
        lin.inputs = [lin.inputs[0], wname]
        lin.fused["bias"] = bname
    else:
        lin.inputs = [lin.inputs[0], wname, bname]
    return True


def _const_or_zeros(g: OGraph, name: str, n: int) -> np.ndarray:
    return g.consts[name].astype(np.float64).reshape(-1) if name else np.zeros(n)


def _fc_weights(g: OGraph, lin: ONode) -> Tuple[np.ndarray, np.ndarray]:
    """[in, out] weights and [out] bias of a fully connected MatMul (bias fused or none) or Gemm."""
    w = g.consts[lin.inputs[1]].astype(np.float64)
    if lin.op == "MatMul":
        bias = lin.fused.get("bias")
        return w, (g.consts[bias].astype(np.float64).reshape(-1) if bias else np.zeros(w.shape[1]))
    alpha, beta = float(lin.attrs.get("alpha", 1.0)), float(lin.attrs.get("beta", 1.0))
    w = (w.T if int(lin.attrs.get("transB", 0)) else w) * alpha
    c = lin.inputs[2] if len(lin.inputs) > 2 and lin.inputs[2] else None
    n = w.shape[1]
    b = np.broadcast_to(g.consts[c].astype(np.float64).reshape(-1), (n,)) * beta if c else np.zeros(n)
    return w, b
