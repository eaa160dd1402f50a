"""ONNX operators rewritten as other ONNX operators before conversion, where the IR has no layer of their own but
a short chain of layers computes them exactly as ONNX defines them.

- Einsum → per operand a ReduceSum over the letters no one else needs, a Transpose and a Reshape to [batch..., M, K]
  or [batch..., K, N], one MatMul per pair of operands (left to right), and a Reshape and Transpose to the output's
  letters. A constant operand is transposed and reshaped here, so a product by a weight matrix ends as a
  FullyConnected layer like any MatMul by a constant. Ellipses and implicit outputs follow the ONNX rules;
  a letter repeated within one operand (a diagonal or trace) is refused.
- LpNormalization with p = 1 → ReduceL1 over the axis (kept), a Clip to the least positive value (a zero norm
  gives 0, as ONNX's does) and a Div (p = 2 is one Normalization layer: converters_more.py).
- Mean → Sum and a Mul by 1/n; ReduceSumSquare → Mul(x, x) and ReduceSum; ReduceLogSum → ReduceSum and Log;
  ReduceLogSumExp → Exp, ReduceSum and Log (ONNX's definition, with no shift by the maximum).
- Trilu of an activation (one of a constant is folded before) → Where(a constant mask of the kept triangle, x, 0):
  a selection, which a quantized graph computes exactly.
- Col2Im of blocks that tile the image without overlap (torch's `fold` after an `unfold` of the same patches:
  MobileViT v2) → Reshape, Transpose and Reshape, a rearrangement; overlapping, dilated or padded blocks (whose
  values are summed) are refused.

The new nodes are named after the rewritten node (its last node keeps its name and output), so the layers stay
traceable to the ONNX file; every new tensor gets its shape and type, as the converters expect.
"""
from __future__ import annotations

import string
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .context import ConvertError
from .pattern import new_const
from .simplify import OGraph, ONode

Rewrite = Callable[["_Emitter", ONode], Optional[bool]]
"""Writes a node's replacement into the emitter; returns False to keep the node as it is (a converter takes it)."""
REWRITES: Dict[str, Rewrite] = {}


def rewrite(*ops: str) -> Callable[[Rewrite], Rewrite]:
    def deco(fn: Rewrite) -> Rewrite:
        for op in ops:
            REWRITES[op] = fn
        return fn
    return deco


class DecomposeError(ConvertError):
    """A node of a rewritten operator that cannot be rewritten (kept, and reported by the importer)."""


class _Emitter:
    """The nodes that replace one ONNX node: each new tensor registered with its shape and type."""

    def __init__(self, g: OGraph, node: ONode) -> None:
        self.g = g
        self.node = node
        self.nodes: List[ONode] = []
        self._names = {n.name for n in g.nodes} - {node.name}  # the last new node takes the node's name

    def tensor(self, suffix: str, shape: Sequence[int], dtype: np.dtype) -> str:
        base = name = f"{self.node.outputs[0]}@{suffix}"
        k = 1
        while name in self.g.shapes or name in self.g.consts:
            name = f"{base}_{k}"
            k += 1
        self.g.shapes[name] = tuple(int(d) for d in shape)
        self.g.dtypes[name] = np.dtype(dtype)
        return name

    def add(self, op: str, inputs: Sequence[str], shape: Sequence[int], dtype: np.dtype, suffix: str,
            attrs: Optional[Dict[str, object]] = None, output: Optional[str] = None) -> str:
        """One node; its output is `output` (the rewritten node's own) or a new tensor."""
        out = output if output is not None else self.tensor(suffix, shape, dtype)
        name = self.node.name if output is not None else f"{self.node.name}_{suffix}"
        base, k = name, 1
        while name in self._names:
            name = f"{base}_{k}"
            k += 1
        self._names.add(name)
        self.nodes.append(ONode(name, op, list(inputs), [out], dict(attrs or {})))
        return out

    def const(self, suffix: str, value: np.ndarray) -> str:
        return new_const(self.g, f"{self.node.outputs[0]}@{suffix}", np.asarray(value))

    def shape(self, t: str) -> Tuple[int, ...]:
        if t not in self.g.shapes:
            raise DecomposeError(f"tensor '{t}' has no static shape")
        return tuple(int(d) for d in self.g.shapes[t])

    def dtype(self, t: str) -> np.dtype:
        if t in self.g.consts:
            return np.asarray(self.g.consts[t]).dtype
        return np.dtype(self.g.dtypes.get(t, np.float32))


def decompose(g: OGraph) -> None:
    """Rewrite every node of an operator in REWRITES in place; a node that cannot be rewritten stays as it is (no
    converter takes it, so the importer reports it with the reason kept in `attrs['decompose_error']`)."""
    out: List[ONode] = []
    for node in g.nodes:
        fn = REWRITES.get(node.op) if node.domain in ("", "ai.onnx") else None
        if fn is None:
            out.append(node)
            continue
        emitter = _Emitter(g, node)
        try:
            if fn(emitter, node) is False:
                out.append(node)
                continue
        except ConvertError as e:
            node.attrs["decompose_error"] = str(e)
            out.append(node)
            continue
        out.extend(emitter.nodes)
    g.nodes = out


# ================================================================================================ Einsum
def _einsum_terms(equation: str, ranks: Sequence[int]) -> Tuple[List[str], str]:
    """The operands' and the output's letters, ellipses replaced by letters of their own (right-aligned, as ONNX
    broadcasts them); the implicit output is the ellipsis' letters then the letters used once, alphabetically."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise DecomposeError(f"equation '{equation}' names {len(terms)} operand(s), the node has {len(ranks)}")
    for term in terms + ([rhs] if arrow else []):
        letters = term.replace("...", "")
        if "." in letters or not all(c in string.ascii_letters for c in letters):
            raise DecomposeError(f"equation '{equation}': subscripts must be letters and '...'")
    spare = [c for c in string.ascii_letters if c not in eq]
    ellipsis_rank = max([r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t] or [0])
    if ellipsis_rank < 0 or ellipsis_rank > len(spare):
        raise DecomposeError(f"equation '{equation}': an ellipsis of {ellipsis_rank} dims")
    ell = "".join(spare[:ellipsis_rank])
    expanded = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            n = r - len(t.replace("...", ""))
            t = t.replace("...", ell[ellipsis_rank - n:] if n else "")
        if len(t) != r:
            raise DecomposeError(f"equation '{equation}': subscripts '{t}' for an operand of rank {r}")
        repeated = [c for c, k in Counter(t).items() if k > 1]
        if repeated:
            raise DecomposeError(f"equation '{equation}': subscript '{repeated[0]}' repeated within one operand "
                                 f"(a diagonal or trace) is not supported")
        expanded.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        counts = Counter("".join(t.replace("...", "") for t in terms))
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1))
    if len(set(out)) != len(out) or any(c not in "".join(expanded) for c in out):
        raise DecomposeError(f"equation '{equation}': output subscripts '{out}' are repeated or unknown")
    return expanded, out


class _Operand:
    """An operand of the contraction: its tensor and letters."""

    def __init__(self, tensor: str, letters: str) -> None:
        self.tensor = tensor
        self.letters = letters


@rewrite("Einsum")
def einsum(e: _Emitter, node: ONode) -> None:
    inputs = [t for t in node.inputs if t]
    if not inputs:
        raise DecomposeError("Einsum without operands")
    shapes = [e.shape(t) for t in inputs]
    terms, out = _einsum_terms(str(node.attrs.get("equation", "")), [len(s) for s in shapes])
    sizes: Dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for c, d in zip(term, shape):
            if sizes.get(c, 1) != 1 and d != 1 and sizes[c] != d:
                raise DecomposeError(f"subscript '{c}' has sizes {sizes[c]} and {d}")
            sizes[c] = max(sizes.get(c, 1), d)
    dtype = e.dtype(inputs[0])
    ops = [_Operand(t, term) for t, term in zip(inputs, terms)]
    acc = _sum_out(e, ops[0], set(out) | set("".join(terms[1:])), dtype, "a0")
    for i, other in enumerate(ops[1:], start=1):
        later = set(out) | set("".join(terms[i + 1:]))
        other = _sum_out(e, other, later | set(acc.letters), dtype, f"a{i}")
        acc = _sum_out(e, acc, later | set(other.letters), dtype, f"acc{i}")
        acc = _contract(e, acc, other, later, sizes, dtype, f"p{i}")
    acc = _sum_out(e, acc, set(out), dtype, "out")
    _finish(e, acc, out, dtype)


def _sum_out(e: _Emitter, op: _Operand, needed: set, dtype: np.dtype, tag: str) -> _Operand:
    """The operand summed over its letters nobody needs any more (ReduceSum, or numpy for a constant)."""
    axes = [i for i, c in enumerate(op.letters) if c not in needed]
    if not axes:
        return op
    letters = "".join(c for c in op.letters if c in needed)
    if op.tensor in e.g.consts:
        value = np.asarray(e.g.consts[op.tensor]).sum(axis=tuple(axes)).astype(e.dtype(op.tensor))
        return _Operand(e.const(f"{tag}_sum", value), letters)
    shape = [d for i, d in enumerate(e.shape(op.tensor)) if i not in axes]
    out = e.add("ReduceSum", [op.tensor, e.const(f"{tag}_axes", np.array(axes, np.int64))], shape, dtype,
                f"{tag}_sum", {"keepdims": 0})
    return _Operand(out, letters)


def _arranged(e: _Emitter, op: _Operand, order: str, shape: Sequence[int], dtype: np.dtype, tag: str) -> str:
    """The operand's tensor with its letters in `order`, reshaped to `shape` (no node where nothing changes)."""
    perm = [op.letters.index(c) for c in order]
    t = op.tensor
    if t in e.g.consts:
        value = np.ascontiguousarray(np.transpose(np.asarray(e.g.consts[t]), perm)).reshape(shape)
        return t if perm == sorted(perm) and tuple(value.shape) == e.shape(t) else e.const(f"{tag}_arranged", value)
    if perm != sorted(perm):
        t = e.add("Transpose", [t], [e.shape(t)[p] for p in perm], dtype, f"{tag}_transpose", {"perm": perm})
    if tuple(shape) != e.shape(t):
        t = e.add("Reshape", [t, e.const(f"{tag}_shape", np.array(shape, np.int64))], shape, dtype, f"{tag}_reshape")
    return t


def _contract(e: _Emitter, a: _Operand, b: _Operand, keep: set, sizes: Dict[str, int], dtype: np.dtype,
              tag: str) -> _Operand:
    """a and b multiplied and summed over their common letters not in `keep`: one MatMul of [batch..., M, K] by
    [batch..., K, N] (size-1 batch dims broadcast as MatMul broadcasts them)."""
    batch = [c for c in a.letters if c in b.letters and c in keep]
    inner = [c for c in a.letters if c in b.letters and c not in keep]
    rows = [c for c in a.letters if c not in b.letters]
    cols = [c for c in b.letters if c not in a.letters]
    a_dims = dict(zip(a.letters, e.shape(a.tensor)))
    b_dims = dict(zip(b.letters, e.shape(b.tensor)))
    m = int(np.prod([sizes[c] for c in rows], dtype=np.int64))
    k = int(np.prod([sizes[c] for c in inner], dtype=np.int64))
    n = int(np.prod([sizes[c] for c in cols], dtype=np.int64))
    for c in inner:
        if a_dims[c] != b_dims[c]:
            raise DecomposeError(f"summed subscript '{c}' has sizes {a_dims[c]} and {b_dims[c]}")
    lhs = _arranged(e, a, "".join(batch + rows + inner), [a_dims[c] for c in batch] + [m, k], dtype, f"{tag}_a")
    rhs = _arranged(e, b, "".join(batch + inner + cols), [b_dims[c] for c in batch] + [k, n], dtype, f"{tag}_b")
    product_shape = [sizes[c] for c in batch] + [m, n]
    y = e.add("MatMul", [lhs, rhs], product_shape, dtype, f"{tag}_matmul")
    letters = "".join(batch + rows + cols)
    full = [sizes[c] for c in letters]
    if full != product_shape:
        y = e.add("Reshape", [y, e.const(f"{tag}_shape", np.array(full, np.int64))], full, dtype, f"{tag}_reshape")
    return _Operand(y, letters)


def _finish(e: _Emitter, acc: _Operand, out: str, dtype: np.dtype) -> None:
    """The result in the output's letter order, written to the node's own output by the last node."""
    result = e.node.outputs[0]
    if acc.tensor in e.g.consts:
        raise DecomposeError("every operand is a constant (the node should have been folded)")
    perm = [acc.letters.index(c) for c in out]
    shape = [e.shape(acc.tensor)[p] for p in perm]
    if perm != sorted(perm):
        e.add("Transpose", [acc.tensor], shape, dtype, "transpose", {"perm": perm}, output=result)
        return
    if e.nodes and e.nodes[-1].outputs[0] == acc.tensor:  # the last node writes the output itself
        last = e.nodes[-1]
        del e.g.shapes[acc.tensor], e.g.dtypes[acc.tensor]
        last.outputs = [result]
        last.name = e.node.name
        return
    e.add("Reshape", [acc.tensor, e.const("shape", np.array(shape, np.int64))], shape, dtype, "reshape",
          output=result)


# ================================================================================================ norms and sums
@rewrite("LpNormalization")
def lp_normalization(e: _Emitter, node: ONode) -> Optional[bool]:
    """p = 1 only: p = 2 is the IR's Normalization layer (converters_more.py)."""
    p = int(node.attrs.get("p", 2))
    if p == 2:
        return False
    if p != 1:
        raise DecomposeError(f"p={p} (ONNX allows 1 and 2)")
    x = node.inputs[0]
    shape, dtype = e.shape(x), e.dtype(x)
    rank = len(shape)
    axis = int(node.attrs.get("axis", -1))
    if not -rank <= axis < rank:
        raise DecomposeError(f"axis {axis} is out of range for rank {rank}")
    axis %= rank
    kept = [1 if i == axis else d for i, d in enumerate(shape)]
    norm = e.add("ReduceL1", [x, e.const("axes", np.array([axis], np.int64))], kept, dtype, "norm",
                 {"keepdims": 1})
    # a zero norm (every value of the slice zero) divides by the least positive value instead: 0, as ONNX gives
    tiny = e.const("least_positive", np.array(np.nextafter(0, 1, dtype=dtype), dtype))
    positive = e.add("Clip", [norm, tiny], kept, dtype, "positive")
    e.add("Div", [x, positive], shape, dtype, "div", output=node.outputs[0])
    return True


@rewrite("Mean")
def mean(e: _Emitter, node: ONode) -> None:
    inputs = [t for t in node.inputs if t]
    out = node.outputs[0]
    shape, dtype = e.shape(out), e.dtype(inputs[0])
    if len(inputs) == 1:
        raise DecomposeError("Mean of one input")
    total = e.add("Sum", inputs, shape, dtype, "sum")
    e.add("Mul", [total, e.const("inverse_count", np.array(1.0 / len(inputs), dtype))], shape, dtype, "mul",
          output=out)


def _reduce_attrs(e: _Emitter, node: ONode) -> Tuple[List[str], Dict[str, object]]:
    """The axes input (a constant, as ReduceSum reads it from opset 13 on) and keepdims of a Reduce* node."""
    extra: List[str] = []
    if len(node.inputs) > 1 and node.inputs[1]:
        extra.append(node.inputs[1])
    elif "axes" in node.attrs:
        extra.append(e.const("axes", np.array(node.attrs["axes"], np.int64)))
    attrs: Dict[str, object] = {"keepdims": int(node.attrs.get("keepdims", 1))}
    if "noop_with_empty_axes" in node.attrs:
        attrs["noop_with_empty_axes"] = int(node.attrs["noop_with_empty_axes"])
    return extra, attrs


@rewrite("ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")
def reduce_composite(e: _Emitter, node: ONode) -> None:
    x, out = node.inputs[0], node.outputs[0]
    shape, dtype = e.shape(x), e.dtype(x)
    if not np.issubdtype(dtype, np.floating):
        raise DecomposeError(f"{dtype} input (float inputs are rewritten)")
    axes, attrs = _reduce_attrs(e, node)
    out_shape = e.shape(out)
    if node.op == "ReduceSumSquare":
        sq = e.add("Mul", [x, x], shape, dtype, "square")
        e.add("ReduceSum", [sq] + axes, out_shape, dtype, "sum", attrs, output=out)
        return
    src = e.add("Exp", [x], shape, dtype, "exp") if node.op == "ReduceLogSumExp" else x
    total = e.add("ReduceSum", [src] + axes, out_shape, dtype, "sum", attrs)
    e.add("Log", [total], out_shape, dtype, "log", output=out)


@rewrite("Trilu")
def trilu(e: _Emitter, node: ONode) -> None:
    """The triangle of the last two axes kept (upper: column - row >= k; lower: column - row <= k), the rest 0."""
    x = node.inputs[0]
    shape, dtype = e.shape(x), e.dtype(x)
    if len(shape) < 2:
        raise DecomposeError(f"an input of rank {len(shape)} (2 or more needed)")
    k = 0
    if len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in e.g.consts:
            raise DecomposeError("a k computed at run time is not supported")
        given = np.asarray(e.g.consts[node.inputs[1]]).reshape(-1)
        if given.size != 1:
            raise DecomposeError(f"k must be one value, got {given.size}")
        if not np.issubdtype(given.dtype, np.integer):
            raise DecomposeError(f"k must be an integer (int64), got {given.dtype}")
        k = int(given[0])
    rows, cols = shape[-2:]
    offset = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    keep = offset >= k if int(node.attrs.get("upper", 1)) else offset <= k
    e.add("Where", [e.const("kept", keep), x, e.const("zero", np.zeros((), dtype))], shape, dtype, "select",
          output=node.outputs[0])


# ================================================================================================ Col2Im
def _constant_ints(e: _Emitter, t: str, what: str) -> List[int]:
    if t not in e.g.consts:
        raise DecomposeError(f"a {what} computed at run time is not supported")
    return [int(v) for v in np.asarray(e.g.consts[t]).reshape(-1)]


@rewrite("Col2Im")
def col2im(e: _Emitter, node: ONode) -> None:
    """Blocks that tile the image without overlap (`strides` = `block_shape`, no dilation, no pads: torch's `fold`
    of the patches an `unfold` of the same size made, as MobileViT v2 does) are a rearrangement: Reshape
    [N, C·∏block, L] to [N, C, block..., count...], a Transpose putting each block axis after its count axis, and a
    Reshape to [N, C, image...]. Overlapping, dilated or padded blocks sum or drop values: refused, named."""
    if len(node.inputs) < 3:
        raise DecomposeError("Col2Im needs its input, image_shape and block_shape")
    x, image_t, block_t = node.inputs[:3]
    image = _constant_ints(e, image_t, "image_shape")
    block = _constant_ints(e, block_t, "block_shape")
    k = len(image)
    if len(block) != k or k == 0:
        raise DecomposeError(f"image_shape {image} and block_shape {block} must have one entry per spatial axis")
    dilations = [int(v) for v in node.attrs.get("dilations", [1] * k)]
    pads = [int(v) for v in node.attrs.get("pads", [0] * 2 * k)]
    strides = [int(v) for v in node.attrs.get("strides", [1] * k)]
    if any(d != 1 for d in dilations) or any(p != 0 for p in pads) or strides != block:
        raise DecomposeError(f"only blocks that do not overlap are supported (strides {strides} equal to block_shape "
                             f"{block}, dilations 1, pads 0; got dilations {dilations}, pads {pads}): overlapping "
                             "blocks are summed")
    if any(b <= 0 or i % b for i, b in zip(image, block)):
        raise DecomposeError(f"the blocks {block} must tile image_shape {image} exactly")
    counts = [i // b for i, b in zip(image, block)]
    shape = e.shape(x)
    per_block = int(np.prod(block))
    if len(shape) != 3 or shape[1] % per_block or shape[2] != int(np.prod(counts)):
        raise DecomposeError(f"input of shape {list(shape)} is not [N, C * {per_block}, {int(np.prod(counts))}] for "
                             f"blocks {block} over image_shape {image}")
    n, c, dtype = shape[0], shape[1] // per_block, e.dtype(x)
    split = [n, c, *block, *counts]
    t = e.add("Reshape", [x, e.const("blocks_shape", np.array(split, np.int64))], split, dtype, "blocks")
    perm = [0, 1] + [axis for i in range(k) for axis in (2 + k + i, 2 + i)]
    t = e.add("Transpose", [t], [split[p] for p in perm], dtype, "interleave", {"perm": perm})
    out = [n, c, *image]
    e.add("Reshape", [t, e.const("image_shape", np.array(out, np.int64))], out, dtype, "image",
          output=node.outputs[0])
