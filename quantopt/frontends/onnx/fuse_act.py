"""Activation fusions the Compass Parser performs, on the prepared ONNX graph:

- GELU, Erf form `x * 0.5 * (1 + erf(x / sqrt(2)))` → Gelu(approximate=none), tanh form
  `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` → Gelu(approximate=tanh), in any association order of
  the products (x^3 as Pow(x, 3) or x * x * x);
- `x * sigmoid(x)` → Silu, `x * sigmoid(a * x)` (a a scalar constant) → Swish(alpha=a);
- `x * clip(x + 3, 0, 6) / 6` (also `* 1/6`, and `x * (clip(x + 3, 0, 6) / 6)`) → HardSwish;
- `clip(x + b, 0, c) / c` (also `* 1/c`) → HardSigmoid(alpha=1/c, beta=b/c): `relu6(x + 3) / 6` is torch's
  hardsigmoid.

`x * HardSigmoid(x)` (torch's hardswish below opset 14) stays HardSigmoid and Mul, as the Parser leaves it.
The fused node takes the name of the pattern's last node, as the Parser names it, and its output tensor.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from .pattern import (
    FUSED_DOMAIN,
    Index,
    Product,
    close,
    const_and_var,
    f32,
    other_input,
    product,
    remove,
    replace,
    scalar,
)
from .simplify import OGraph, ONode

SQRT_HALF = 1 / math.sqrt(2)
TANH_SCALE = math.sqrt(2 / math.pi)
TANH_CUBIC = 0.044715
GELU_TOL = 1e-5
"""The GELU constants as exporters write them in float32 (0.7978845834732056, 0.044714998453855515, 1.4142135...)."""


def fuse_gelu(g: OGraph) -> None:
    idx = Index(g)
    dead: List[ONode] = []
    for node in list(g.nodes):
        if node.op != "Mul" or any(n is node for n in dead):
            continue
        p = product(g, idx, node.outputs[0])
        if p is None or not close(p.scale, 0.5, GELU_TOL) or len(p.factors) != 2:
            continue
        for x, s in (p.factors, p.factors[::-1]):
            found = _gelu_tail(g, idx, x, s, p)
            if found is not None:
                approximate, interior = found
                replace(g, node, ONode(node.name, "Gelu", [x], list(node.outputs), {"approximate": approximate}))
                dead += interior + [n for n in p.nodes if n is not node]
                break
    remove(g, dead)


def _gelu_tail(g: OGraph, idx: Index, x: str, s: str, outer: Product) -> Optional[Tuple[str, List[ONode]]]:
    """`s` = 1 + erf(x / sqrt 2) or 1 + tanh(...) over the same x: (approximate, the nodes computing s)."""
    if x in g.consts or not _interior(idx, s, outer):
        return None
    add = idx.made_by(s, "Add")
    pair = const_and_var(g, add) if add is not None else None
    if pair is None or not close(scalar(g, pair[0]), 1.0):
        return None
    inner = pair[1]
    fn = idx.made_by(inner, "Erf", "Tanh")
    if fn is None or not idx.private(inner, add):
        return None
    arg = product(g, idx, fn.inputs[0], root=True)  # a scaling Mul/Div of x (or of the cubic) feeding fn alone
    if arg is None or not arg.nodes or not idx.private(fn.inputs[0], fn):
        return None
    nodes = [add, fn] + arg.nodes
    if fn.op == "Erf":
        if arg.factors == [x] and close(arg.scale, SQRT_HALF, GELU_TOL):
            return "none", nodes
        return None
    if not close(arg.scale, TANH_SCALE, GELU_TOL) or len(arg.factors) != 1:
        return None
    poly = idx.made_by(arg.factors[0], "Add")  # x + 0.044715 * x^3
    if poly is None or not _interior(idx, arg.factors[0], arg) or x not in poly.inputs:
        return None
    cube_t = other_input(poly, x)
    cube = product(g, idx, cube_t, root=True) if cube_t is not None else None
    if cube is None or not cube.nodes or not idx.private(cube_t, poly) or not close(cube.scale, TANH_CUBIC, GELU_TOL):
        return None
    pow_nodes = _cube_of(g, idx, cube.factors, x)
    if pow_nodes is None:
        return None
    return "tanh", nodes + [poly] + cube.nodes + pow_nodes


def _cube_of(g: OGraph, idx: Index, factors: List[str], x: str) -> Optional[List[ONode]]:
    """Nodes computing x^3 from `factors` (x, x, x or Pow(x, 3)); None if they do not."""
    if factors == [x, x, x]:
        return []
    if len(factors) == 1:
        pw = idx.made_by(factors[0], "Pow")
        if pw is not None and pw.inputs[0] == x and close(scalar(g, pw.inputs[1]), 3.0) \
                and idx.single(factors[0]) is not None:
            return [pw]
    return None


def _interior(idx: Index, tensor: str, p: Product) -> bool:
    """`tensor` is read only by nodes of the product tree `p`."""
    users = idx.consumers.get(tensor, [])
    return bool(users) and all(any(u is n for n in p.nodes) for u in users) and tensor not in idx.g.outputs


def fuse_swish(g: OGraph) -> None:
    """Mul(x, Sigmoid(x)) → Silu; Mul(x, Sigmoid(Mul(x, a))) → Swish(alpha=a). The Sigmoid (and the scaling Mul)
    must feed nothing else; x may (the Parser checks the same)."""
    idx = Index(g)
    dead: List[ONode] = []
    for mul in list(g.nodes):
        if mul.op != "Mul" or len(mul.inputs) != 2 or mul.domain not in ("", "ai.onnx"):
            continue
        for x, s in (mul.inputs, mul.inputs[::-1]):
            sig = idx.made_by(s, "Sigmoid")
            if sig is None or x in g.consts or idx.single(s) is not mul:
                continue
            if sig.inputs[0] == x:
                replace(g, mul, ONode(mul.name, "Silu", [x], list(mul.outputs), {}, FUSED_DOMAIN))
                dead.append(sig)
                break
            scaled = idx.made_by(sig.inputs[0], "Mul")
            pair = const_and_var(g, scaled) if scaled is not None else None
            alpha = scalar(g, pair[0]) if pair is not None else None
            if alpha is None or pair[1] != x or idx.single(sig.inputs[0]) is not sig:
                continue
            replace(g, mul, ONode(mul.name, "Swish", [x], list(mul.outputs), {"alpha": f32(alpha)}, FUSED_DOMAIN))
            dead += [sig, scaled]
            break
    remove(g, dead)


def fuse_hard_activations(g: OGraph) -> None:
    """HardSwish first (its inner clip(x + 3, 0, 6) / 6 would otherwise become a HardSigmoid), then HardSigmoid."""
    idx = Index(g)
    dead: List[ONode] = []
    for node in list(g.nodes):
        if node.op not in ("Mul", "Div") or any(n is node for n in dead):
            continue
        p = product(g, idx, node.outputs[0])
        if p is None or not close(p.scale, 1 / 6) or len(p.factors) != 2:
            continue
        for x, r in (p.factors, p.factors[::-1]):
            shifted = _clip_of_shift(g, idx, r) if _interior(idx, r, p) else None
            if shifted is None or shifted[0] != x or shifted[1] != 3.0 or shifted[2] != (0.0, 6.0):
                continue
            replace(g, node, ONode(node.name, "HardSwish", [x], list(node.outputs), {}))
            dead += shifted[3] + [n for n in p.nodes if n is not node]
            break
    remove(g, dead)
    _fuse_hard_sigmoid(g)


def _fuse_hard_sigmoid(g: OGraph) -> None:
    idx = Index(g)
    dead: List[ONode] = []
    for node in list(g.nodes):
        if node.op not in ("Mul", "Div") or len(node.inputs) != 2:
            continue
        pair = const_and_var(g, node)
        if pair is None or (node.op == "Div" and pair[2] != 1):
            continue
        c = scalar(g, pair[0])
        if c is None or c == 0:
            continue
        c = 1 / c if node.op == "Mul" else c
        shifted = _clip_of_shift(g, idx, pair[1]) if idx.single(pair[1]) is node else None
        if shifted is None or shifted[2][0] != 0.0 or not close(shifted[2][1], c):
            continue
        x, b, _, nodes = shifted
        attrs = {"alpha": f32(1 / c), "beta": f32(b / c)}
        replace(g, node, ONode(node.name, "HardSigmoid", [x], list(node.outputs), attrs))
        dead += nodes
    remove(g, dead)


def _clip_of_shift(g: OGraph, idx: Index, t: str) -> Optional[Tuple[str, float, Tuple[float, float], List[ONode]]]:
    """`t` = Clip(Add(x, b), lo, hi) with constant b, lo, hi and a private Add output: (x, b, (lo, hi), nodes)."""
    clip = idx.made_by(t, "Clip")
    if clip is None:
        return None
    bounds = clip_bounds(g, clip)
    add = idx.made_by(clip.inputs[0], "Add")
    pair = const_and_var(g, add) if add is not None else None
    if bounds is None or pair is None or idx.single(clip.inputs[0]) is not clip:
        return None
    b = scalar(g, pair[0])
    if b is None:
        return None
    return pair[1], b, bounds, [clip, add]


def clip_bounds(g: OGraph, clip: ONode) -> Optional[Tuple[float, float]]:
    """(min, max) of a Clip with constant bounds (attributes before opset 11, inputs after); None otherwise."""
    lo, hi = clip.attrs.get("min", -float("inf")), clip.attrs.get("max", float("inf"))
    for pos in (1, 2):
        if len(clip.inputs) > pos and clip.inputs[pos]:
            v = scalar(g, clip.inputs[pos])
            if v is None:
                return None
            if pos == 1:
                lo = v
            else:
                hi = v
    return float(lo), float(hi)
