"""Index, gather, scatter and sort ops: Gather, GatherElements, GatherND, ScatterND, ScatterElements, OneHot, TopK,
Sort and ArgMinMax.

Index tensors (inputs, or a constant `indices`) must be exact integers: quantized, they are qinvariant tensors
(scale 1, zero point 0) or integer constants; anything else is refused. Gathered values and the values outputs of
TopK/Sort carry their data input's params and move exactly; index outputs are exact integers. Scatter ops with a
reduction requantize data and updates to the output's scale with integer multipliers and shifts. The integer
semantics are in docs/semantics/indexing.md.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.params import QuantParams, integer_range
from ..quant.rounding import round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Floats, Int, Param, Text, Value
from ._eltwise_int import offset_absmax
from ._quant import (
    copy_params,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_scale_shift,
    set_constant,
    set_params,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param
from .onnx_build.exact import DOUBLE, INT32, INT64, codes, double, emit_integers, fits_double
from .onnx_build.qdq_graph import QDQGraph, node_error, require_same

SEMANTICS = "docs/semantics/indexing.md"

INDEX_MIN_BITS = 16
"""Index outputs (TopK/Sort indices) are at least 16-bit integers, whatever the activation bits (as upstream)."""


SCATTER_MUL_ACC_BITS = 32
"""ScatterND/ScatterElements MUL: the running product (in output-scale units) is clamped to a signed 32-bit
accumulator after every multiplication."""

SCATTER_REDUCTIONS = ("NONE", "ADD", "MUL", "MAX", "MIN")

_PASS = "data: any, quantized output keeps the data's dtype, scale and zero point; indices: integer"
_UNREAD_SCALE = Param(Value(), "written by some Parser versions; not read")
_INDICES = {"indices": "integer; used when there is no index input"}


# ------------------------------------------------------------------------------------------------ index inputs
def _check_index_tensor(node: PyNode, t: PyTensor) -> None:
    """Quantized, an index input must hold exact integers (qinvariant)."""
    q = params(node, t)
    if not q.qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): index input '{t.name}' is a quantized tensor "
                               f"(scale {q.scale}, zero point {q.zerop}); indices must be exact integers (an integer "
                               "model input, an integer constant or the index output of another layer)")


def _indices(node: PyNode, position: int) -> torch.Tensor:
    """The int64 indices: input `position`, or else the layer constant `indices`."""
    if len(node.inputs) > position:
        t = node.inputs[position]
        if node.quantized:
            _check_index_tensor(node, t)
            return int_value(t)
        x = t.betensor
        return x.to(torch.int64) if x.is_floating_point() else x.long()
    c = node.get_constant("indices", optional=True)
    if c is None:
        raise node._error(f"needs its indices as input {position} or as a constant 'indices'")
    x = c.betensor
    if node.quantized and (x.is_floating_point() or c.dtype.is_float):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): constant 'indices' is {c.dtype.value}; a "
                               "quantized layer needs integer indices")
    return x.to(torch.int64)


def _quantize_indices(node: PyNode, position: int) -> None:
    """Index input → must be qinvariant; index constant → stored as int32 (all values must be integers)."""
    if len(node.inputs) > position:
        _check_index_tensor(node, node.inputs[position])
        return
    c = node.get_constant("indices", optional=True)
    if c is None:
        raise node._error(f"needs its indices as input {position} or as a constant 'indices'")
    x = c.betensor
    if x.is_floating_point():
        if not bool(torch.isfinite(x).all()) or not bool((x == torch.round(x)).all()):
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): constant 'indices' holds non-integer "
                                   "values; indices must be integers")
    lo, hi = integer_range(32, True)
    if x.numel() and (float(x.min()) < lo or float(x.max()) > hi):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): constant 'indices' does not fit int32")
    if x.is_floating_point() or c.dtype != Dtype.INT32:
        set_constant(node, "indices", x.to(torch.int64), Dtype.INT32)


def _fill_value(node: PyNode, data: PyTensor, like: torch.Tensor) -> torch.Tensor:
    """The value of an out-of-range gather: float 0, i.e. the integer -zp clamped to the range when quantized."""
    if node.quantized:
        qmin, qmax = out_range(node, data)
        return torch.tensor(min(max(-tensor_zp(node, data), qmin), qmax), dtype=like.dtype)
    return torch.zeros((), dtype=like.dtype)


def _prod(values: Sequence[int]) -> int:
    n = 1
    for v in values:
        n *= int(v)
    return n


def _wrap(idx: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(index with negatives wrapped, valid mask): valid iff -size <= idx < size."""
    valid = (idx >= -size) & (idx < size)
    return torch.where(idx < 0, idx + size, idx), valid


# ------------------------------------------------------------------------------------------------ Gather
GATHER = declare_op(
    "Gather",
    params={"axis": Param(Int(), "the gathered axis (default 0)", default=0),
            "batch_dims": Param(Int(), "leading dims shared by data and indices (default 0; negative: from the "
                                       "index rank)", default=0),
            "method": Param(Text(), "upstream's lut form (idx_lut); not read"),
            "scale": _UNREAD_SCALE},
    constants={**_INDICES, "lut": "upstream's table form of a one-input Gather; not read"},
    dtypes=_PASS, integer="passthrough; out-of-range index → -zp", semantics=f"{SEMANTICS}#gather",
    summary="Indices: input 1, else the constant indices.")

GATHER_ELEMENTS = declare_op(
    "GatherElements",
    params={"axis": Param(Int(), "the gathered axis (default 0)", default=0),
            "scale": _UNREAD_SCALE},
    constants=_INDICES,
    dtypes=_PASS, integer="passthrough (indices clamped)", semantics=f"{SEMANTICS}#gatherelements",
    summary="Indices: input 1, else the constant indices.")

GATHER_ND = declare_op(
    "GatherND",
    params={"batch_dims": Param(Int(lo=0), "leading dims shared by data and indices (default 0)", default=0),
            "scale": _UNREAD_SCALE},
    constants=_INDICES,
    dtypes=_PASS, integer="passthrough; out-of-range tuple → -zp", semantics=f"{SEMANTICS}#gathernd",
    summary="Indices: input 1, else the constant indices.")


def _take(x: torch.Tensor, idx: torch.Tensor, axis: int, fill: torch.Tensor) -> torch.Tensor:
    """x.shape[:axis] + idx.shape + x.shape[axis+1:]: entries of `x` along `axis`, `fill` where out of range."""
    size = int(x.shape[axis])
    wrapped, valid = _wrap(idx, size)
    safe = torch.where(valid, wrapped, torch.zeros_like(wrapped))
    shape = list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:])
    if size == 0:
        return torch.full(shape, fill.item(), dtype=x.dtype, device=x.device)
    out = x.index_select(axis, safe.flatten()).reshape(shape)
    if not bool(valid.all()):
        mask = valid.reshape([1] * axis + list(idx.shape) + [1] * (x.dim() - axis - 1))
        out = torch.where(mask, out, fill)
    return out


@GATHER.forward
def gather_forward(self: PyNode) -> None:
    """ONNX/TF Gather along `axis` with `batch_dims`; negative indices count from the end, indices outside
    [-n, n) give 0 (the integer -zp)."""
    data = self.inputs[0]
    x = data.betensor
    idx = _indices(self, 1).to(x.device)
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), x.dim())
    b = int(self.get_param("batch_dims", optional=True, default_value=0))
    if b < 0:
        b += idx.dim()
    if not 0 <= b <= min(axis, idx.dim()):
        raise self._error(f"batch_dims {b} must be in [0, min(axis {axis}, index rank {idx.dim()})]")
    if list(x.shape[:b]) != list(idx.shape[:b]):
        raise self._error(f"the first {b} dims of data {list(x.shape)} and indices {list(idx.shape)} differ")
    fill = _fill_value(self, data, x)
    if b == 0:
        out = _take(x, idx, axis, fill)
    else:
        batch = _prod(x.shape[:b])
        xs = x.reshape([batch] + list(x.shape[b:]))
        ids = idx.reshape([batch] + list(idx.shape[b:]))
        parts = [_take(xs[i], ids[i], axis - b, fill) for i in range(batch)]
        shape = list(x.shape[:axis]) + list(idx.shape[b:]) + list(x.shape[axis + 1:])
        out = torch.stack(parts).reshape(shape) if parts else torch.zeros(shape, dtype=x.dtype, device=x.device)
    self.outputs[0].betensor = out


@GATHER_ELEMENTS.forward
def gather_elements_forward(self: PyNode) -> None:
    """torch.gather along `axis`; an index >= n becomes n-1, a negative one +n (still negative: n-1)."""
    x = self.inputs[0].betensor
    idx = _indices(self, 1).to(x.device)
    if idx.dim() != x.dim():
        raise self._error(f"data {list(x.shape)} and indices {list(idx.shape)} must have the same rank")
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), x.dim())
    for d in range(x.dim()):
        if d != axis and idx.shape[d] > x.shape[d]:
            raise self._error(f"indices {list(idx.shape)} are larger than data {list(x.shape)} on axis {d}")
    n = int(x.shape[axis])
    idx = torch.where(idx >= n, torch.full_like(idx, n - 1), idx)
    idx = torch.where(idx < 0, idx + n, idx)
    idx = torch.where(idx < 0, torch.full_like(idx, n - 1), idx)
    self.outputs[0].betensor = torch.gather(x, axis, idx)


def _nd_offsets(node: PyNode, idx: torch.Tensor, dims: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-major offsets of index tuples (last dim of `idx`) into `dims`, and which tuples are in range."""
    k = int(idx.shape[-1])
    if k != len(dims):
        raise node._error(f"index tuples of length {k} do not match {len(dims)} data dims")
    lin = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
    valid = torch.ones(idx.shape[:-1], dtype=torch.bool, device=idx.device)
    for j, size in enumerate(dims):
        w, v = _wrap(idx[..., j], int(size))
        lin = lin * int(size) + torch.where(v, w, torch.zeros_like(w))
        valid &= v
    return lin, valid


@GATHER_ND.forward
def gather_nd_forward(self: PyNode) -> None:
    """ONNX GatherND with `batch_dims`; each index tuple wraps negatives per dim, a tuple out of range gives 0."""
    data = self.inputs[0]
    x = data.betensor
    idx = _indices(self, 1).to(x.device)
    b = int(self.get_param("batch_dims", optional=True, default_value=0))
    if idx.dim() < 1 or b < 0 or b >= idx.dim() or list(x.shape[:b]) != list(idx.shape[:b]):
        raise self._error(f"batch_dims {b} does not fit data {list(x.shape)} and indices {list(idx.shape)}")
    k = int(idx.shape[-1])
    if b + k > x.dim():
        raise self._error(f"index tuples of length {k} plus batch_dims {b} exceed the data rank {x.dim()}")
    batch = _prod(x.shape[:b])
    rest = list(x.shape[b + k:])
    xs = x.reshape([batch, _prod(x.shape[b:b + k])] + rest)
    lin, valid = _nd_offsets(self, idx.reshape(batch, -1, k), x.shape[b:b + k])
    if xs.shape[1] == 0:
        out = torch.full([batch, lin.shape[1]] + rest, _fill_value(self, data, x).item(), dtype=x.dtype,
                         device=x.device)
    else:
        out = xs[torch.arange(batch, device=lin.device).reshape(-1, 1), lin]
        if not bool(valid.all()):
            out = torch.where(valid.reshape(list(valid.shape) + [1] * len(rest)), out, _fill_value(self, data, x))
    self.outputs[0].betensor = out.reshape(list(idx.shape[:-1]) + rest)


@GATHER.quantize
@GATHER_ELEMENTS.quantize
@GATHER_ND.quantize
def gather_quantize(self: PyNode) -> None:
    _quantize_indices(self, 1)
    copy_params(self, self.outputs[0], self.inputs[0])


# ------------------------------------------------------------------------------------------------ scatter
_SCATTER_PARAMS = {
    "reduction": Param(Text(choices=SCATTER_REDUCTIONS), "how updates combine with the data (default NONE)",
                       default="NONE"),
    "method": Param(Text(), "written by some Parser versions; not read"),
    "scale": _UNREAD_SCALE,
}
_SCATTER_DOC = dict(
    constants=_INDICES,
    dtypes="data/updates → data's dtype (NONE) or int8/uint8/int16/uint16; indices: integer",
    integer="updates requantized to the output scale, integer combine",
    semantics=f"{SEMANTICS}#scatternd-scatterelements",
    summary="Inputs: data, indices (else the constant indices), updates. Quantized: scale_value and shift_value "
            "hold [data, updates].")

SCATTER_ND = declare_op("ScatterND", params=_SCATTER_PARAMS, **_SCATTER_DOC)

SCATTER_ELEMENTS = declare_op(
    "ScatterElements",
    params={"axis": Param(Int(), "the scattered axis (default 0)", default=0), **_SCATTER_PARAMS}, **_SCATTER_DOC)


def _reduction(node: PyNode) -> str:
    r = str(node.get_param("reduction", optional=True, default_value="NONE")).upper()
    if r not in SCATTER_REDUCTIONS:
        raise node._error(f"reduction '{r}' is not supported (supported: {', '.join(SCATTER_REDUCTIONS)})")
    return r


def _scatter(base: torch.Tensor, lin: torch.Tensor, upd: torch.Tensor, reduction: str) -> torch.Tensor:
    """base [P, *inner] with rows lin[j] combined with upd[j] ([M, *inner]): NONE keeps the last update of each row
    (row-major order of the updates), ADD sums, MUL multiplies, MAX/MIN take the extreme, base included."""
    out = base.clone()
    if lin.numel() == 0:
        return out
    index = lin.reshape([-1] + [1] * (upd.dim() - 1)).expand_as(upd)
    if reduction == "NONE":
        order = torch.arange(lin.numel(), dtype=torch.int64, device=lin.device)
        last = torch.full((base.shape[0],), -1, dtype=torch.int64, device=lin.device).scatter_reduce(0, lin, order,
                                                                                                     "amax")
        keep = last[lin] == order
        return out.scatter_(0, index[keep], upd[keep])
    reduce = {"ADD": "sum", "MUL": "prod", "MAX": "amax", "MIN": "amin"}[reduction]
    return out.scatter_reduce_(0, index, upd.to(out.dtype), reduce, include_self=True)


def _scatter_int(node: PyNode, base_q: torch.Tensor, lin: torch.Tensor, upd_q: torch.Tensor,
                 reduction: str) -> torch.Tensor:
    """Integer scatter (docs: ScatterND): data and updates to output-scale integers with their multiplier/shift,
    combine, subtract zp_out, clamp."""
    data, upd_t, out = node.inputs[0], node.inputs[2], node.outputs[0]
    mults = _int_list(node, "scale_value")
    shifts = _int_list(node, "shift_value")
    t = round_shift((base_q + tensor_zp(node, data)) * mults[0], shifts[0])
    u = upd_q + tensor_zp(node, upd_t)
    if reduction == "MUL":
        lo, hi = integer_range(SCATTER_MUL_ACC_BITS, True)
        for j in range(lin.numel()):
            row = int(lin[j])
            t[row] = torch.clamp(round_shift(t[row] * u[j] * mults[1], shifts[1]), lo, hi)
    else:
        t = _scatter(t, lin, round_shift(u * mults[1], shifts[1]), reduction)
    qmin, qmax = out_range(node, out)
    return torch.clamp(t - tensor_zp(node, out), qmin, qmax)


def _int_list(node: PyNode, key: str) -> List[int]:
    v = node.get_param(key)
    values = v if isinstance(v, (list, tuple)) else [v]
    if len(values) != 2:
        raise node._error(f"'{key}' must hold two integers [data, updates], got {v!r}")
    return [int(a) for a in values]


def _run_scatter(node: PyNode, base: torch.Tensor, lin: torch.Tensor, upd: torch.Tensor) -> torch.Tensor:
    reduction = _reduction(node)
    if node.quantized:
        return _scatter_int(node, base, lin, upd, reduction)
    return _scatter(base, lin, upd, reduction)


@SCATTER_ND.forward
def scatter_nd_forward(self: PyNode) -> None:
    """ONNX ScatterND (inputs data, indices, updates; `reduction`): index tuples wrap negatives per dim; a tuple
    out of range is dropped; duplicates: see `_scatter`."""
    if len(self.inputs) < 3:
        raise self._error(f"needs 3 inputs (data, indices, updates), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    idx = _indices(self, 1).to(x.device)
    u = self.inputs[2].betensor
    k = int(idx.shape[-1]) if idx.dim() else 0
    if idx.dim() < 1 or k > x.dim() or list(u.shape) != list(idx.shape[:-1]) + list(x.shape[k:]):
        raise self._error(f"updates {list(u.shape)} must have shape indices[:-1] + data[k:] for data "
                          f"{list(x.shape)} and indices {list(idx.shape)}")
    inner = list(x.shape[k:])
    lin, valid = _nd_offsets(self, idx.reshape(-1, k), x.shape[:k])
    upd = u.reshape([-1] + inner)
    out = _run_scatter(self, x.reshape([_prod(x.shape[:k])] + inner), lin[valid], upd[valid])
    self.outputs[0].betensor = out.reshape(x.shape)


@SCATTER_ELEMENTS.forward
def scatter_elements_forward(self: PyNode) -> None:
    """ONNX ScatterElements (inputs data, indices, updates; `axis`, `reduction`): an index is wrapped once if
    negative and then clamped to [0, n-1]; duplicates: see `_scatter`."""
    if len(self.inputs) < 3:
        raise self._error(f"needs 3 inputs (data, indices, updates), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    idx = _indices(self, 1).to(x.device)
    u = self.inputs[2].betensor
    if idx.dim() != x.dim() or list(u.shape) != list(idx.shape):
        raise self._error(f"indices {list(idx.shape)} and updates {list(u.shape)} must have the same shape and "
                          f"the rank of data {list(x.shape)}")
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), x.dim())
    for d in range(x.dim()):
        if d != axis and idx.shape[d] > x.shape[d]:
            raise self._error(f"indices {list(idx.shape)} are larger than data {list(x.shape)} on axis {d}")
    n = int(x.shape[axis])
    idx = torch.clamp(torch.where(idx < 0, idx + n, idx), 0, max(n - 1, 0))
    lin = torch.zeros(idx.shape, dtype=torch.int64, device=idx.device)
    for d in range(x.dim()):
        coord = idx if d == axis else torch.arange(idx.shape[d], device=idx.device).reshape(
            [-1 if j == d else 1 for j in range(x.dim())])
        lin = lin * int(x.shape[d]) + coord
    out = _run_scatter(self, x.reshape(-1), lin.reshape(-1), u.reshape(-1))
    self.outputs[0].betensor = out.reshape(x.shape)


@SCATTER_ND.quantize
@SCATTER_ELEMENTS.quantize
def scatter_quantize(self: PyNode) -> None:
    """NONE: the output copies the data's params, except where the data is an integer tensor (qinvariant: a
    buffer of zeros made with `new_zeros`, as Longformer's sliding-window scores export) and the updates are not:
    its scale of 1 would round the updates to whole numbers, so the output takes its calibrated range. ADD/MUL/MAX/
    MIN: output params from the calibrated output range (qinvariant when data and updates are). Data and updates
    get (multiplier, shift) pairs to the output scale (MUL: the updates' pair approximates 1 / s_updates)."""
    if len(self.inputs) < 3:
        raise self._error(f"needs 3 inputs (data, indices, updates), got {len(self.inputs)}")
    _quantize_indices(self, 1)
    data, upd, out = self.inputs[0], self.inputs[2], self.outputs[0]
    reduction = _reduction(self)
    integers = params(self, data).qinvariant, params(self, upd).qinvariant
    if reduction == "NONE" and integers != (True, False):
        copy_params(self, out, data)
    elif reduction != "NONE" and all(integers):
        signed = is_signed(self, data) or is_signed(self, upd)
        r = ranges_of(self).get(out)
        lo, hi = float(r.min or 0.0), float(r.max or 0.0)
        fits = [b for b in (8, 16, 32) if integer_range(b, signed)[0] <= lo and hi <= integer_range(b, signed)[1]]
        bits = max(int(params(self, data).qbits or 8), int(params(self, upd).qbits or 8), fits[0] if fits else 32)
        set_qinvariant(self, out, bits, signed)
    else:
        quantize_activation(self, out, float(ranges_of(self).get(out).min) < 0)
    s_out = tensor_scale(self, out)
    ratios = [s_out / tensor_scale(self, data), (1.0 if reduction == "MUL" else s_out) / tensor_scale(self, upd)]
    pairs = [requant_scale_shift(self, r) for r in ratios]
    self.params["scale_value"] = [int(p[0]) for p in pairs]
    self.params["scale_type"] = [p[2] for p in pairs]
    self.params["shift_value"] = [int(p[1]) for p in pairs]
    self.params["shift_type"] = [p[3] for p in pairs]
    self.params["reduction"] = reduction


# ------------------------------------------------------------------------------------------------ OneHot
ONEHOT = declare_op(
    "OneHot",
    params={"depth": Param(Int(lo=0), "the number of classes", required=True),
            "values": Param(Floats(), "[off_value, on_value] (default [0, 1]; quantized: their integers)",
                            default=[0, 1]),
            "axis": Param(Int(), "the new axis, counted in the output (default -1)", default=-1)},
    constants=_INDICES,
    dtypes="integer indices → int8/uint8/int16/uint16", integer="select quantized on/off values",
    semantics=f"{SEMANTICS}#onehot", summary="Input: the integer indices, else the constant indices.")


@ONEHOT.forward
def onehot_forward(self: PyNode) -> None:
    """values=[off, on], depth, axis (default -1, counted in the output): index i in [-depth, depth) sets
    position i (negatives + depth); other indices give an all-off line."""
    idx = _indices(self, 0)
    depth = int(self.get_param("depth"))
    values = self.get_param("values", optional=True, default_value=[0, 1])
    if not isinstance(values, (list, tuple)) or len(values) != 2:
        raise self._error(f"values must be [off_value, on_value], got {values!r}")
    if depth < 0:
        raise self._error(f"depth {depth} must not be negative")
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=-1), idx.dim() + 1)
    wrapped, valid = _wrap(idx, depth)
    classes = torch.arange(depth, dtype=torch.int64, device=idx.device).reshape([-1] + [1] * (idx.dim() - axis))
    hot = (wrapped.unsqueeze(axis) == classes) & valid.unsqueeze(axis)
    if self.quantized:
        off, on = torch.tensor(int(values[0])), torch.tensor(int(values[1]))
    else:
        off, on = torch.tensor(float(values[0])), torch.tensor(float(values[1]))
    self.outputs[0].betensor = torch.where(hot, on, off)


@ONEHOT.quantize
def onehot_quantize(self: PyNode) -> None:
    """Symmetric output: scale = (2^(b-1) - 1) / max|v| signed (any negative value, or force_dtype_int) or
    (2^b - 1) / max|v| unsigned, zp 0; `values` become their integers."""
    _quantize_indices(self, 0)
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    values = [float(v) for v in self.get_param("values", optional=True, default_value=[0, 1])]
    signed = min(values) < 0 or bool(s.force_dtype_int)
    qmin, qmax = integer_range(bits, signed)
    absmax = max(abs(v) for v in values)
    scale = qmax / absmax if absmax > 0 else 1.0
    set_params(self, self.outputs[0], QuantParams(scale, 0, qmin, qmax, int_dtype_for_bits(bits, signed)), bits)
    self.params["values"] = [int(min(max(round(v * scale), qmin), qmax)) for v in values]
    self.params["depth"] = int(self.get_param("depth"))


# ------------------------------------------------------------------------------------------------ TopK, Sort
TOPK = declare_op(
    "TopK",
    params={"k": Param(Int(lo=0), "how many values", required=True),
            "axis": Param(Int(), "the sorted axis (default -1)", default=-1),
            "largest": Param(Bool(), "the largest values (else the smallest)", default=True),
            "sorted": Param(Bool(), "not read: the output is always sorted"),
            "select_index": Param(Text(choices=("first", "last", "random")),
                                  "ties: lower index first (first, random) or higher (last)", default="first"),
            "scale": _UNREAD_SCALE},
    dtypes="values: passthrough; indices: uint16/uint32 (scale 1)",
    integer="stable integer sort, exact indices", semantics=f"{SEMANTICS}#topk-sort")

SORT = declare_op(
    "Sort",
    params={"axis": Param(Int(), "the sorted axis (default -1)", default=-1),
            "descending": Param(Bool(), "largest first", default=True),
            "scale": _UNREAD_SCALE},
    dtypes="values: passthrough; indices: uint16/uint32 (scale 1)",
    integer="stable integer sort, exact indices", semantics=f"{SEMANTICS}#topk-sort")


def _sort_along(x: torch.Tensor, axis: int, descending: bool, last_first: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stable sort along `axis`: equal values keep index order (or reverse index order with `last_first`)."""
    if not last_first:
        return torch.sort(x, dim=axis, descending=descending, stable=True)
    n = x.shape[axis]
    values, idx = torch.sort(torch.flip(x, dims=[axis]), dim=axis, descending=descending, stable=True)
    return values, (n - 1) - idx


TOPK_SELECT_MAX_SHARE = 4
"""TopK selects before it sorts where k is at most 1/TOPK_SELECT_MAX_SHARE of the axis (`_top_k`)."""


def _top_k(x: torch.Tensor, axis: int, k: int, largest: bool, last_first: bool
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first k of `_sort_along(x, axis, largest, last_first)`: the same values and indices.

    Why: a stable sort of a whole axis to keep k of it (a detector's 100 best of 8400 boxes) cost 15x onnxruntime's
    TopK. For small k the k-th value comes from torch's topk (its values are exact; only its order among equal
    values is unspecified); every value beyond it is taken, and of the values equal to it the first ones in index
    order (the last ones with `last_first`) until k are taken, then those k are stable-sorted. NaN (which torch
    orders as the largest) takes the whole sort."""
    n = int(x.shape[axis])
    if k == 0 or TOPK_SELECT_MAX_SHARE * k > n or (x.is_floating_point() and bool(torch.isnan(x).any())):
        values, idx = _sort_along(x, axis, largest, last_first)
        return values.narrow(axis, 0, k), idx.narrow(axis, 0, k)
    if last_first:  # ties by the higher index: the lower index of the flipped axis
        values, idx = _top_k(torch.flip(x, dims=[axis]), axis, k, largest, False)
        return values, (n - 1) - idx
    rows = x.movedim(axis, -1)
    kth = torch.topk(rows, k, dim=-1, largest=largest, sorted=True).values[..., -1:]
    beyond = rows > kth if largest else rows < kth
    tied = rows == kth
    take = beyond | (tied & (torch.cumsum(tied, dim=-1) <= k - beyond.sum(dim=-1, keepdim=True)))
    picked = take.nonzero()[:, -1].reshape(*rows.shape[:-1], k)  # k per row, in index order
    order = torch.sort(torch.gather(rows, -1, picked), dim=-1, descending=largest, stable=True).indices
    idx = torch.gather(picked, -1, order)
    return torch.gather(rows, -1, idx).movedim(-1, axis), idx.movedim(-1, axis)


def _index_output_quantize(node: PyNode, out: PyTensor, length: int) -> None:
    """Indices in [0, length): unsigned (signed with force_dtype_int), at least 16 bits, 32 when needed."""
    signed = bool(layer_settings(node).force_dtype_int)
    bits = INDEX_MIN_BITS if length - 1 <= integer_range(INDEX_MIN_BITS, signed)[1] else 32
    set_qinvariant(node, out, bits, signed)


@TOPK.forward
def topk_forward(self: PyNode) -> None:
    """The k largest (`largest`, default true) or smallest values along `axis` (default -1), in sorted order
    (also when `sorted` is false), with their indices; ties: lower index first (`select_index=last`: higher)."""
    x = self.inputs[0].betensor
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=-1), x.dim())
    k = int(self.get_param("k"))
    if not 0 <= k <= x.shape[axis]:
        raise self._error(f"k {k} is outside [0, {x.shape[axis]}] (the size of axis {axis})")
    largest = bool_param(self, "largest", True)
    select = str(self.get_param("select_index", optional=True, default_value="first")).lower()
    if select not in ("first", "last", "random"):
        raise self._error(f"select_index '{select}' is not first, last or random")
    values, idx = _top_k(x, axis, k, largest, select == "last")
    self.outputs[0].betensor = values.contiguous()
    if len(self.outputs) > 1:
        self.outputs[1].betensor = idx.contiguous()


@SORT.forward
def sort_forward(self: PyNode) -> None:
    """Stable sort along `axis` (default -1), `descending` (default true); second output: the indices."""
    x = self.inputs[0].betensor
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=-1), x.dim())
    values, idx = _sort_along(x, axis, bool_param(self, "descending", True), False)
    self.outputs[0].betensor = values
    if len(self.outputs) > 1:
        self.outputs[1].betensor = idx


@TOPK.quantize
@SORT.quantize
def topk_sort_quantize(self: PyNode) -> None:
    inp = self.inputs[0]
    copy_params(self, self.outputs[0], inp)
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=-1), len(inp.ir_shape))
    for out in self.outputs[1:]:
        _index_output_quantize(self, out, int(inp.ir_shape[axis]))


# ------------------------------------------------------------------------------------------------ ArgMinMax
ARGMINMAX = declare_op(
    "ArgMinMax",
    params={"method": Param(Text(choices=("MAX", "MIN")), "index of the maximum or the minimum", required=True),
            "axis": Param(Int(), "the reduced axis, kept with size 1 (default 0)", default=0),
            "select_last_index": Param(Bool(), "ties: the last occurrence (else the first)", default=False)},
    dtypes="any → uint16 (int16 with force_dtype_int; 32 bits past 65535 indices or with wider activations; scale 1)",
    integer="exact index of the integer extreme", semantics=f"{SEMANTICS}#argminmax")


@ARGMINMAX.forward
def argminmax_forward(self: PyNode) -> None:
    """Index of the max (`method=MAX`) or min along `axis`, keeping the dim; ties: the first occurrence, or the
    last with `select_last_index`."""
    x = self.inputs[0].betensor
    method = str(self.get_param("method")).upper()
    if method not in ("MAX", "MIN"):
        raise self._error(f"method '{method}' is not MAX or MIN")
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), x.dim())
    last = bool_param(self, "select_last_index", False)
    found = _outer_extreme_index(x, axis, method == "MAX", last)
    if found is not None:
        self.outputs[0].betensor = found
        return
    src = torch.flip(x, dims=[axis]) if last else x
    fn = torch.argmax if method == "MAX" else torch.argmin
    idx = fn(src, dim=axis, keepdim=True)
    self.outputs[0].betensor = (x.shape[axis] - 1 - idx) if last else idx


OUTER_EXTREME_MIN_COLUMNS = 1 << 10
"""An ArgMinMax over an axis that is not the innermost, with at least this many elements after that axis, finds
its indices by vectorized reductions (`_outer_extreme_index`); torch's argmax there is a strided loop per element."""


def _outer_extreme_index(x: torch.Tensor, axis: int, largest: bool, last: bool) -> Optional[torch.Tensor]:
    """torch's argmax/argmin (keepdim; the first index of a tie, or the last with `last`) over a non-innermost
    `axis` of many columns, from vectorized reductions: the extreme m by amax/amin, then the largest of a weight
    per position where x == m (K - k for the first, k + 1 for the last occurrence), about 4x faster on a [1, 21,
    160, 160] map. None (torch's own, which takes NaN as the extreme) where it does not apply: the innermost axis,
    few columns, bool values, more than 2^15 - 1 positions, or a NaN among the extremes."""
    k = int(x.shape[axis]) if x.dim() else 0
    if (axis == x.dim() - 1 or not 0 < k < 1 << 15 or x.dtype == torch.bool or x.is_complex()
            or math.prod(int(d) for d in x.shape[axis + 1:]) < OUTER_EXTREME_MIN_COLUMNS):
        return None
    m = torch.amax(x, dim=axis, keepdim=True) if largest else torch.amin(x, dim=axis, keepdim=True)
    if x.is_floating_point() and bool(torch.isnan(m).any()):
        return None
    shape = [1] * x.dim()
    shape[axis] = k
    position = torch.arange(k, dtype=torch.int16, device=x.device).reshape(shape)
    weight = position + 1 if last else k - position
    score = torch.where(x == m, weight, torch.zeros((), dtype=torch.int16, device=x.device))
    best = torch.amax(score, dim=axis, keepdim=True).to(torch.int64)
    return best - 1 if last else k - best


@ARGMINMAX.quantize
def argminmax_quantize(self: PyNode) -> None:
    """Indices as upstream types them: max(16, activation bits) bits, unsigned unless `force_dtype_int`; 32 bits
    when the reduced axis has more positions than the type holds (upstream's type would wrap)."""
    s = layer_settings(self)
    signed = bool(s.force_dtype_int)
    bits = max(INDEX_MIN_BITS, int(s.q_bits_activation))
    shape = self.inputs[0].ir_shape
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), len(shape)) if shape else 0
    if shape and int(shape[axis]) - 1 > integer_range(bits, signed)[1]:
        bits = 32
    set_qinvariant(self, self.outputs[0], bits, signed)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@GATHER.export
def convert_gather(g: QDQGraph, node: PyNode) -> None:
    """ONNX Gather on the integers in the IR layout; indices from the `indices` constant (checked to be in range:
    ONNX has no fill value for the others) or from an integer input."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    rank = g.rank(x)
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), rank)
    if int(node.get_param("batch_dims", optional=True, default_value=0)):
        raise node_error(node, "batch_dims has no ONNX Gather equivalent")
    if axis == 0 and g.dynamic_batch:
        raise node_error(node, "gathering along the batch axis needs a static batch (--static-batch)")
    size = int(x.ir_shape[axis])

    def in_range(idx: np.ndarray) -> None:
        if idx.size and (idx.min() < -size or idx.max() >= size):
            raise node_error(node, f"indices outside [-{size}, {size}) (quantopt reads 0 there, ONNX Gather fails)")

    g.set_int(y, g.add("Gather", [g.int_value(x), _export_indices(g, node, in_range)], axis=axis))


def _export_indices(g: QDQGraph, node: PyNode, check: Callable[[np.ndarray], None]) -> str:
    """A gather's ONNX int64 indices: the `indices` constant (after `check` refuses what ONNX cannot read), or the
    integer second input."""
    const = node.get_constant("indices", optional=True) if len(node.inputs) < 2 else None
    if const is not None:
        idx = const.betensor.cpu().to(torch.int64).numpy()
        check(idx)
        return g.const(f"{node.name}/indices", idx.astype(np.int64))
    if len(node.inputs) == 2 and params(node, node.inputs[1]).qinvariant:
        return g.add("Cast", [g.int_value(node.inputs[1])], to=INT64)
    raise node_error(node, "indices must be a constant or an integer tensor")


def _sort_axis(g: QDQGraph, node: PyNode, x: PyTensor, default: int) -> int:
    """The layer's `axis` on the IR layout, refused on the batch axis of a graph with a dynamic batch (the sort or
    reduction would then run across samples)."""
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=default), g.rank(x))
    if axis == 0 and g.dynamic_batch:
        raise node_error(node, "sorting or reducing along the batch axis needs a static batch (--static-batch)")
    return axis


def _emit_indices(g: QDQGraph, node: PyNode, t: PyTensor, indices: str) -> None:
    """int64 ONNX indices as the integer output `t` (its IR type: uint16, int16 or int32; exact)."""
    emit_integers(g, node, t, g.add("Cast", [indices], to=DOUBLE), None)


@ARGMINMAX.export
def convert_argminmax(g: QDQGraph, node: PyNode) -> None:
    """Every mode: ONNX ArgMax/ArgMin (keepdims, select_last_index) on the codes as int32 in the IR layout (the
    codes' order is the values' order, a uint8-carried int8 tensor included), the index cast to the IR type."""
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    if method not in ("MAX", "MIN"):
        raise node_error(node, f"method '{method}' is not MAX or MIN")
    axis = _sort_axis(g, node, x, 0)
    codes32 = g.add("Cast", [g.int_value(x)], to=INT32)
    index = g.add("ArgMax" if method == "MAX" else "ArgMin", [codes32], axis=axis, keepdims=1,
                  select_last_index=int(bool_param(node, "select_last_index", False)))
    _emit_indices(g, node, y, index)


@TOPK.export
@SORT.export
def convert_topk_sort(g: QDQGraph, node: PyNode) -> None:
    """Every mode: ONNX TopK on the codes as int32 in the IR layout (Sort: all of them), whose ties put the lower
    index first, as the integer forward's stable sort (`select_index=last`: on the axis reversed, the indices
    mirrored back); the values cast back to the input's type, the indices to theirs."""
    x, values = node.inputs[0], node.outputs[0]
    require_same(node, x, values)
    axis = _sort_axis(g, node, x, -1)
    n = int(x.ir_shape[axis])
    if str(node.type) == "TopK":
        k, largest = int(node.get_param("k")), bool_param(node, "largest", True)
        last = str(node.get_param("select_index", optional=True, default_value="first")).lower() == "last"
    else:
        k, largest, last = n, bool_param(node, "descending", True), False
    if not 0 < k <= n:
        raise node_error(node, f"k {k} is outside [1, {n}]")
    codes32 = g.add("Cast", [g.int_value(x)], to=INT32)
    if last:
        codes32 = g.add("Slice", [codes32, g.ints(f"{node.name}/rev_start", [-1]),
                                  g.ints(f"{node.name}/rev_end", [-(1 << 62)]), g.ints(f"{node.name}/rev_axis", [axis]),
                                  g.ints(f"{node.name}/rev_step", [-1])])
    top, index = g.add_multi("TopK", [codes32, g.ints(f"{node.name}/k", [k])],
                             [f"{values.name}_top", f"{node.name}/indices"], axis=axis, largest=int(largest), sorted=1)
    g.set_int(values, g.add("Cast", [top], to=g.elem_type(g.qparams(values).dtype)))
    if last:
        index = g.add("Sub", [g.const(f"{node.name}/last_index", np.array(n - 1, dtype=np.int64)), index])
    if len(node.outputs) > 1:
        _emit_indices(g, node, node.outputs[1], index)


@GATHER_ND.export
def convert_gather_nd(g: QDQGraph, node: PyNode) -> None:
    """ONNX GatherND (`batch_dims`) on the integers in the IR layout; index tuples from the `indices` constant
    (checked to lie in range per dim: ONNX has no fill value for the others) or from an integer input. Its tuples
    address dim 0, or share it with the constant, so the export keeps the IR batch (`batch_is_leading`)."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    b = int(node.get_param("batch_dims", optional=True, default_value=0))

    def in_range(idx: np.ndarray) -> None:
        dims = [int(d) for d in x.ir_shape[b:b + int(idx.shape[-1])]] if idx.ndim else []
        if not idx.ndim or len(dims) != int(idx.shape[-1]):
            raise node_error(node, f"index tuples of shape {list(idx.shape)} do not fit data {list(x.ir_shape)}")
        for j, size in enumerate(dims):
            if idx.size and (idx[..., j].min() < -size or idx[..., j].max() >= size):
                raise node_error(node, f"index tuples outside the data (dim {b + j} of size {size}): quantopt reads "
                                       "0 there, ONNX GatherND fails")

    g.set_int(y, g.add("GatherND", [g.int_value(x), _export_indices(g, node, in_range)], batch_dims=b))


@GATHER_ELEMENTS.export
def convert_gather_elements(g: QDQGraph, node: PyNode) -> None:
    """ONNX GatherElements on the integers in the IR layout, the indices clamped as the integer forward clamps them
    (an index >= n reads n - 1, a negative one n more, and n - 1 if still negative): from the constant in numpy, from
    an integer input with Where layers."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    rank = g.rank(x)
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), rank)
    if axis == 0 and g.dynamic_batch:
        raise node_error(node, "gathering along the batch axis needs a static batch (--static-batch)")
    n = int(x.ir_shape[axis])
    data = g.int_value(x)
    const = node.get_constant("indices", optional=True) if len(node.inputs) < 2 else None
    if const is not None:
        idx = const.betensor.cpu().to(torch.int64).numpy()
        idx = np.where(idx >= n, n - 1, idx)
        idx = np.where(idx < 0, idx + n, idx)
        indices = g.const(f"{node.name}/indices", np.where(idx < 0, n - 1, idx).astype(np.int64))
        if axis != 0 and idx.ndim == rank and idx.shape[0] == 1:  # one sample's indices serve every sample
            batch = g.add("Shape", [data], start=0, end=1)
            shape = g.add("Concat", [batch, g.ints(f"{node.name}/sample_shape", idx.shape[1:])], axis=0)
            indices = g.add("Expand", [indices, shape])
    elif len(node.inputs) == 2 and params(node, node.inputs[1]).qinvariant:
        raw = g.add("Cast", [g.int_value(node.inputs[1])], to=INT64)
        last = g.const(f"{node.name}/last", np.array(n - 1, np.int64))
        zero = g.const(f"{node.name}/zero", np.array(0, np.int64))
        size = g.const(f"{node.name}/size", np.array(n, np.int64))
        capped = g.add("Where", [g.add("Greater", [raw, last]), last, raw])
        wrapped = g.add("Where", [g.add("Less", [capped, zero]), g.add("Add", [capped, size]), capped])
        indices = g.add("Where", [g.add("Less", [wrapped, zero]), last, wrapped])
    else:
        raise node_error(node, "indices must be a constant or an integer tensor")
    g.set_int(y, g.add("GatherElements", [data, indices], axis=axis))


@SCATTER_ND.export
@SCATTER_ELEMENTS.export
def convert_scatter(g: QDQGraph, node: PyNode) -> None:
    """ONNX ScatterND / ScatterElements (NONE, ADD, MAX, MIN) on float64 integers in the IR layout: the data's and
    the updates' codes plus their zero points, each multiplied by M·2^-N and rounded half to even (exact below
    2^53), combined, less the output zero point, clamped. The indices must be the constant (ScatterElements' clamped
    as the integer forward clamps them), without a repeated position where updates replace (ONNX leaves the order
    of repeated writes open); MUL's per-step clamp has no ONNX form."""
    data, upd, out = node.inputs[0], node.inputs[-1], node.outputs[0]
    reduction = _reduction(node)
    if reduction == "MUL":
        raise node_error(node, "reduction MUL clamps each step; ONNX's ScatterND multiplies without")
    idx = _constant_input(node.inputs[1]) if len(node.inputs) == 3 else None
    if idx is None:
        raise node_error(node, "indices computed at run time: only the values of a Constant layer are exported")
    shape = [int(d) for d in data.ir_shape]
    if str(node.type) == "ScatterND":
        k = int(idx.shape[-1]) if idx.ndim else 0
        dims = np.array(shape[:k], dtype=np.int64)
        if not idx.ndim or k > len(shape) or (idx.size and np.any((idx < -dims) | (idx >= dims))):
            raise node_error(node, "index tuples outside the data: quantopt drops them, ONNX ScatterND fails")
        positions = np.ravel_multi_index(tuple(np.moveaxis(np.where(idx < 0, idx + dims, idx), -1, 0)),
                                         tuple(shape[:k])).reshape(-1) if k else np.zeros(1, np.int64)
        attrs = {}
    else:
        axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), len(shape))
        n = shape[axis]
        idx = np.clip(np.where(idx < 0, idx + n, idx), 0, max(n - 1, 0))
        grid = np.indices(idx.shape).astype(np.int64)
        grid[axis] = idx
        positions = np.ravel_multi_index(tuple(grid), tuple(shape)).reshape(-1)
        attrs = {"axis": axis}
    if reduction == "NONE" and len(np.unique(positions)) != positions.size:
        raise node_error(node, "repeated index positions with reduction NONE: ONNX leaves the write order open")
    mults, shifts = _int_list(node, "scale_value"), _int_list(node, "shift_value")
    if min(shifts) < -62:
        raise node_error(node, "a left shift beyond 62 bits")
    bound = max(offset_absmax(node, t) * abs(m) * 2 ** max(0, -s) for t, m, s in zip((data, upd), mults, shifts))
    if not fits_double(bound * (idx.size + 1)):  # every value and every sum of updates an exact float64 integer
        raise node_error(node, "integers beyond 2^53: no exact float64 form")
    values = []
    for i, t in enumerate((data, upd)):
        scaled = g.add("Mul", [codes(g, t), double(g, node, f"ratio{i}", mults[i] * 2.0 ** -shifts[i])])
        values.append(g.add("Round", [scaled]))
    reduce = {} if reduction == "NONE" else {"reduction": reduction.lower()}
    combined = g.add(str(node.type), [values[0], g.const(f"{node.name}/indices", idx.astype(np.int64)), values[1]],
                     **attrs, **reduce)
    zp = tensor_zp(node, out)
    emit_integers(g, node, out, combined if not zp else g.add("Sub", [combined, double(g, node, "zp_out", zp)]),
                  None)


def _constant_input(t: PyTensor) -> Optional[np.ndarray]:
    """The int64 values of a Constant layer's output, or None for any other producer."""
    producer = t.pnode  # another layer's constant (a Constant layer's values), not one of this layer's own
    weights = producer.constants.get("weights") if producer is not None and str(producer.type) == "Constant" else None
    return None if weights is None else weights.betensor.cpu().to(torch.int64).numpy()


@ONEHOT.export
def convert_onehot(g: QDQGraph, node: PyNode) -> None:
    """ONNX OneHot of the integer indices in the IR layout (out-of-range ones all off, negatives wrapped, as the
    integer forward), its on and off values the layer's integers."""
    idx_t, out = node.inputs[0] if node.inputs else None, node.outputs[0]
    if idx_t is None or not params(node, idx_t).qinvariant:
        raise node_error(node, "indices must be an integer tensor")
    depth = int(node.get_param("depth"))
    values = node.get_param("values", optional=True, default_value=[0, 1])
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=-1), g.rank(idx_t) + 1)
    indices = g.add("Cast", [g.int_value(idx_t)], to=INT64)
    hot = g.add("OneHot", [indices, g.const(f"{node.name}/depth", np.array(depth, np.int64)),
                           g.const(f"{node.name}/values", np.array([int(values[0]), int(values[1])], np.int64))],
                axis=axis)  # onnxruntime's OneHot takes int64 values, not float64
    emit_integers(g, node, out, g.add("Cast", [hot], to=DOUBLE), None)
