"""Conversion context: ONNX tensors → IR tensors with a tracked layout.

Every ONNX activation tensor is held in the IR either in its ONNX layout or permuted (`perm`: IR tensor =
ONNX tensor.transpose(perm)); channels-first tensors that feed convolutions, pooling and the like are held
channels-last (NHWC: perm [0, 2, ..., r-1, 1]) as the Compass Parser lays them out. A consumer asks for the
layout it needs and gets a Transpose inserted once (or a Reshape when only size-1 dims move).

Reshape and Transpose layers go through `reshape`/`transpose`, which remember how each such tensor was made from
the last non-view tensor before it and emit the shortest equivalent chain (views.py). Layers are buffered and
written by `flush`, which leaves out the Reshape, Transpose and Constant layers that nothing reads any more.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...graph.builder import GraphBuilder
from ...quant.dtype import Dtype
from ...registry.known_keys import param_problem
from . import views
from .simplify import OGraph, ONode

Perm = Optional[Tuple[int, ...]]
PRUNABLE = ("Reshape", "Transpose", "Constant")
"""Layers dropped by `flush` when nothing reads them (views superseded by a shorter chain, unused constants)."""
DEDUP_MAX_ELEMENTS = 1 << 16
"""Constant layers up to this size with equal values are shared, as the Parser shares them."""

_NP_DTYPES = {"float32": Dtype.FP32, "float64": Dtype.FP32, "float16": Dtype.FP16, "int8": Dtype.INT8,
              "uint8": Dtype.UINT8, "int16": Dtype.INT16, "int32": Dtype.INT32, "int64": Dtype.INT32,
              "bool": Dtype.BOOL}
"""ONNX element types as IR dtypes; 64-bit integers become 32-bit as the Parser writes them. Unsigned 16/32/64-bit
tensors are not supported (the float forward has no arithmetic for them)."""


class ConvertError(Exception):
    """One node the importer cannot convert (collected, then reported together)."""


def ir_dtype(dt: Any) -> Dtype:
    key = np.dtype(dt).name if dt is not None else "float32"
    if key not in _NP_DTYPES:
        raise ConvertError(f"element type {key} is not supported")
    return _NP_DTYPES[key]


def ir_array(value: np.ndarray) -> np.ndarray:
    """A constant as the IR stores it: float32 for floats, int32 for 64-bit integers."""
    v = np.asarray(value)
    if v.dtype == np.float64:
        return v.astype(np.float32)
    if v.dtype == np.int64:
        return v.astype(np.int32)
    return v


def nhwc(rank: int) -> Tuple[int, ...]:
    return (0,) + tuple(range(2, rank)) + (1,) if rank >= 3 else tuple(range(rank))


def inverse(perm: Sequence[int]) -> List[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def is_identity(perm: Perm) -> bool:
    return perm is None or list(perm) == list(range(len(perm)))


class Context:
    def __init__(self, g: OGraph, builder: GraphBuilder) -> None:
        self.g = g
        self.b = builder
        self.tmap: Dict[str, Tuple[str, Perm]] = {}
        self.ir_shapes: Dict[str, Tuple[int, ...]] = {}
        self.ir_dtypes: Dict[str, Dtype] = {}
        self._cache: Dict[Any, str] = {}
        self._layers: set = set()
        self._tensors: set = set()
        self.pending: List[Dict[str, Any]] = []
        self.views: Dict[str, Tuple[str, List[views.ViewOp], int]] = {}
        """IR tensor made by Reshape/Transpose layers → (source tensor, ops from it, layers on the way)."""
        self.made_by: Dict[str, str] = {}
        """IR tensor → type of the layer that computes it."""
        self.view_layer: Dict[str, Tuple[str, views.ViewOp]] = {}
        """IR tensor made by one Reshape/Transpose layer → (its input, the op)."""

    # ------------------------------------------------------------------------------------------- queries
    def shape(self, t: str) -> Tuple[int, ...]:
        if t not in self.g.shapes:
            raise ConvertError(f"tensor '{t}' has no known shape")
        return tuple(self.g.shapes[t])

    def rank(self, t: str) -> int:
        return len(self.shape(t))

    def is_const(self, t: str) -> bool:
        return t in self.g.consts

    def const(self, t: str) -> np.ndarray:
        if t not in self.g.consts:
            raise ConvertError(f"input '{t}' must be a constant (initializer or folded)")
        return np.asarray(self.g.consts[t])

    def perm(self, t: str) -> Perm:
        if t in self.tmap:
            p = self.tmap[t][1]
            return None if is_identity(p) else p
        return None

    def dtype(self, t: str) -> Dtype:
        if t in self.g.consts:
            return ir_dtype(ir_array(self.g.consts[t]).dtype)
        if t in self.tmap:
            return self.ir_dtypes[self.tmap[t][0]]
        return ir_dtype(self.g.dtypes.get(t, np.float32))

    # ------------------------------------------------------------------------------------------- names
    def unique_layer(self, name: str) -> str:
        base, k = name, 1
        while name in self._layers or name in self._tensors:
            name = f"{base}_{k}"
            k += 1
        self._layers.add(name)
        return name

    def _unique_tensor(self, name: str) -> str:
        base, k = name, 1
        while name in self._tensors:
            name = f"{base}_{k}"
            k += 1
        self._tensors.add(name)
        return name

    # ------------------------------------------------------------------------------------------- emission
    def add(self, optype: str, inputs: Sequence[str], out_shapes: Sequence[Sequence[int]], name: str,
            params: Optional[Mapping[str, Any]] = None, constants: Optional[Mapping[str, np.ndarray]] = None,
            out_dtypes: Optional[Sequence[Dtype]] = None) -> List[str]:
        """Add one IR layer; output tensors are named `<layer>_<i>` as the Parser names them. A param the layer
        type's declaration refuses (a stride of 10^12, a NaN slope: what the IR reader would refuse in a file) is a
        ConvertError naming it, reported with the node."""
        for key, value in (params or {}).items():
            problem = param_problem(optype, key, value)
            if problem is not None:
                raise ConvertError(f"{optype} parameter '{key}' {problem}")
        layer = self.unique_layer(name)
        outs = [self._unique_tensor(f"{layer}_{i}") for i in range(len(out_shapes))]
        dts = list(out_dtypes) if out_dtypes else [Dtype.FP32] * len(outs)
        consts = {k: ir_array(v) for k, v in (constants or {}).items()}
        cdt = {k: ir_dtype(v.dtype) for k, v in consts.items()}
        self.pending.append(dict(optype=optype, inputs=list(inputs), output_shapes=[list(s) for s in out_shapes],
                                 name=layer, params=dict(params or {}), constants=consts, outputs=outs,
                                 output_dtypes=dts, constant_dtypes=cdt))
        for o, s, d in zip(outs, out_shapes, dts):
            self.ir_shapes[o] = tuple(int(x) for x in s)
            self.ir_dtypes[o] = d
            self.made_by[o] = optype
        return outs

    def flush(self, outputs: Sequence[str]) -> None:
        """Write the buffered layers to the builder in order, leaving out Reshape/Transpose/Constant layers whose
        outputs nothing reads."""
        used = set(outputs)
        keep = []
        for layer in reversed(self.pending):
            if layer["optype"] in PRUNABLE and not any(o in used for o in layer["outputs"]):
                continue
            keep.append(layer)
            used.update(layer["inputs"])
        for layer in reversed(keep):
            self.b.layer(layer.pop("optype"), layer.pop("inputs"), layer.pop("output_shapes"), **layer)
        self.pending = []

    # ------------------------------------------------------------------------------------------- views
    def reshape(self, src: str, shape: Sequence[int], name: str) -> str:
        """IR tensor `src` reshaped to `shape` (nothing when it has that shape already)."""
        return self._view(src, ("reshape", tuple(int(d) for d in shape)), name)

    def transpose(self, src: str, perm: Sequence[int], name: str) -> str:
        """IR tensor `src` transposed by `perm` (a Reshape when only size-1 dims move)."""
        perm = tuple(int(p) for p in perm)
        shape = self.ir_shapes[src]
        if self._trivial(shape, perm):
            return self.reshape(src, [shape[p] for p in perm], name)
        return self._view(src, ("transpose", perm), name)

    def _view(self, src: str, op: views.ViewOp, name: str) -> str:
        key = ("view", src) + op
        if key in self._cache:
            return self._cache[key]
        if views.out_shape(self.ir_shapes[src], [op]) == self.ir_shapes[src] and \
                (op[0] == "reshape" or op[1] == tuple(range(len(op[1])))):
            return src
        root, ops, count = self.views.get(src, (src, [], 0))
        chain = ops + [op]
        plan = views.shortest(self.ir_shapes[root], chain) if count else None
        if plan is not None and len(plan) < count + 1:
            out = root
            for k, step in enumerate(plan):  # a step the chain already made (a layout Transpose) is reused
                known = self._cache.get(("view", out) + step)
                out = known or self._emit_view(out, step[0], step[1], name if k == len(plan) - 1 else f"{name}_pre")
            count = len(plan)
        else:
            out = self._emit_view(src, op[0], op[1], name)
            count += 1
        if out != root:
            self.views[out] = (root, chain, count)
        self._cache[key] = out
        return out

    def _emit_view(self, src: str, kind: str, arg: Tuple[int, ...], name: str) -> str:
        shape = views.out_shape(self.ir_shapes[src], [(kind, arg)])
        params = {"shape": list(shape)} if kind == "reshape" else {"perm": list(arg)}
        out = self.add("Reshape" if kind == "reshape" else "Transpose", [src], [shape], name, params,
                       out_dtypes=[self.ir_dtypes[src]])[0]
        self.view_layer[out] = (src, (kind, tuple(arg)))
        self._cache[("view", src, kind, tuple(arg))] = out
        return out

    def reshaped_from(self, ir: str) -> Optional[str]:
        """The tensor `ir` is a pure Reshape of (through any chain of views), or None."""
        if ir not in self.views:
            return None
        root, ops, _ = self.views[ir]
        plan = views.shortest(self.ir_shapes[root], ops)
        return root if plan is not None and all(kind == "reshape" for kind, _ in plan) else None

    def bind(self, onnx_name: str, ir_name: str, perm: Perm) -> None:
        self.tmap[onnx_name] = (ir_name, None if is_identity(perm) else tuple(perm))  # type: ignore[arg-type]

    def out_shape(self, t: str, perm: Perm) -> Tuple[int, ...]:
        s = self.shape(t)
        return tuple(s[p] for p in perm) if perm is not None else s

    def emit(self, node: ONode, optype: str, inputs: Sequence[str], perm: Perm = None,
             params: Optional[Mapping[str, Any]] = None, constants: Optional[Mapping[str, np.ndarray]] = None,
             outputs: Optional[Sequence[str]] = None, out_dtypes: Optional[Sequence[Dtype]] = None,
             name: Optional[str] = None) -> List[str]:
        """One layer computing ONNX outputs `outputs` (default: the node's first output) held in layout `perm`."""
        outs = [o for o in (outputs if outputs is not None else node.outputs[:1])]
        if not outs or any(not o for o in outs):
            raise ConvertError("optional outputs are not supported")
        shapes = [self.out_shape(o, perm if perm is not None and len(perm) == self.rank(o) else None)
                  for o in outs]
        if out_dtypes is None:
            out_dtypes = [ir_dtype(self.g.dtypes.get(o, np.float32)) for o in outs]
        irs = self.add(optype, inputs, shapes, name or node.name, params, constants, out_dtypes)
        for o, ir in zip(outs, irs):
            self.bind(o, ir, perm if perm is not None and len(perm) == self.rank(o) else None)
        return irs

    def value(self, t: str, perm: Perm = None) -> str:
        """IR tensor holding ONNX tensor `t` in layout `perm` (None: ONNX layout)."""
        perm = None if is_identity(perm) else tuple(perm)  # type: ignore[arg-type]
        if t in self.g.consts and t not in self.tmap:
            return self.constant_layer(t, perm)
        if t not in self.tmap:
            raise ConvertError(f"input '{t}' is produced by no converted node")
        ir, have = self.tmap[t]
        if have == perm:
            return ir
        key = (t, perm)
        if key in self._cache:
            return self._cache[key]
        rank = self.rank(t)
        pinv = inverse(have) if have is not None else list(range(rank))
        want = perm if perm is not None else tuple(range(rank))
        q = [pinv[w] for w in want]
        target = self.out_shape(t, perm)
        src_layer = self.producer_layer(ir)
        if self._trivial(self.ir_shapes[ir], q):
            out = self.reshape(ir, target, f"{src_layer}_reshape")
        else:
            out = self.transpose(ir, q, f"{src_layer}_post_transpose")
        self._cache[key] = out
        return out

    def source_for_reshape(self, t: str) -> str:
        """IR tensor with the ONNX memory order of `t`: the held tensor itself when its permutation only moves
        size-1 dims (no data movement needed before a Reshape)."""
        if t in self.tmap and t not in self.g.consts:
            ir, have = self.tmap[t]
            if have is not None and self._trivial(self.ir_shapes[ir], inverse(have)):
                return ir
        return self.value(t, None)

    @staticmethod
    def _trivial(shape: Sequence[int], q: Sequence[int]) -> bool:
        moved = [a for a in q if shape[a] != 1]
        return moved == sorted(moved)

    def producer_layer(self, ir: str) -> str:
        """Name of the layer computing IR tensor `ir` (tensors are named `<layer>_0`)."""
        return ir[:-2] if ir.endswith("_0") else ir

    def constant_layer(self, t: str, perm: Perm = None, rank: Optional[int] = None) -> str:
        """A Constant layer for a constant used as a layer input, in layout `perm` (after left-padding its shape
        with 1s to `rank` for broadcasting)."""
        key = (t + f"@{rank}", perm)
        if key in self._cache:
            return self._cache[key]
        v = ir_array(self.g.consts[t])
        if rank is not None and v.ndim < rank:
            v = v.reshape((1,) * (rank - v.ndim) + v.shape)
        if perm is not None and v.ndim == len(perm):
            v = np.ascontiguousarray(np.transpose(v, perm))
        v = np.require(v if v.ndim else v.reshape(1), requirements=["C", "W"])  # initializers are read-only views
        same = ("value", v.dtype.str, v.shape, v.tobytes()) if v.size <= DEDUP_MAX_ELEMENTS else None
        if same is not None and same in self._cache:
            out = self._cache[same]
        else:
            name = self.g.const_sources.get(t, t)
            out = self.add("Constant", [], [v.shape], name, {}, {"weights": v}, [ir_dtype(v.dtype)])[0]
        self._cache[key] = out
        if same is not None:
            self._cache[same] = out
        return out

    def broadcast_value(self, t: str, rank: int, perm: Perm) -> str:
        """Operand of an element-wise op of output rank `rank` computed in layout `perm`."""
        if perm is None:
            return self.value(t)
        if t in self.g.consts and t not in self.tmap:
            if self.g.consts[t].size == 1:
                return self.constant_layer(t)
            return self.constant_layer(t, perm, rank)
        r = self.rank(t)
        if r == rank:
            return self.value(t, perm)
        # lower-rank activation: reshape to the full rank in ONNX layout, then permute
        src = self.value(t)
        full = (1,) * (rank - r) + self.shape(t)
        reshaped = self.reshape(src, full, f"{self.producer_layer(src)}_expand_rank")
        tmp = f"{t}@rank{rank}"
        self.g.shapes[tmp] = full
        self.bind(tmp, reshaped, None)
        return self.value(tmp, perm)
