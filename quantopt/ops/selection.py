"""Data-dependent selection ops: NonZero, Unique, Compress, Filter, InTopK, SegmentReduce and AccidentalHits.

NonZero, Unique, Compress, SegmentReduce and AccidentalHits find a data-dependent number of entries; the IR declares
the most there can be, and quantopt keeps that fixed shape (the graph stays static for the layers below, the shape
checks and the writer): the entries come first, the rest is padding (0, i.e. -zp for quantized values), and a count
output, where the operator has one, says how many are real (upstream returns the shorter tensor instead, except for
AccidentalHits). Filter keeps its inputs' shapes the same way. Selected values move exactly (passthrough); index
and count outputs are exact integers. A quantized value is "nonzero" when its float value is, i.e. when
`q + zp != 0`. SegmentReduce SUM requantizes the integer sums. The integer semantics are in docs/semantics/selection.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.params import integer_range
from ..quant.requant import requantize_int
from ..registry import declare_op
from ..registry.schema import Axis, Bool, Either, Int, Param, Text
from ._quant import (
    copy_params,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    params,
    quant_of,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
    zero_code,
)
from ._shared import axis_param, bool_param

SEMANTICS = "docs/semantics/selection.md"

COUNT_MIN_BITS = 16
"""The count output of Filter is at least a 16-bit integer (as upstream)."""

SEGMENT_MULT_MIN_BITS = 16
"""SegmentReduce's multiplier has max(16, activation bits) bits (as upstream)."""

SEGMENT_METHODS = ("SUM",)


def _check_integer_tensor(node: PyNode, t: PyTensor, what: str) -> None:
    q = params(node, t)
    if not q.qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {what} input '{t.name}' is a quantized tensor "
                               f"(scale {q.scale}, zero point {q.zerop}); it must hold exact integers (an integer "
                               "model input, an integer constant or the index output of another layer)")


def _integers(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    """An index/length input as int64 (float values truncated toward zero); quantized it must be qinvariant."""
    if node.quantized:
        _check_integer_tensor(node, t, what)
        return int_value(t)
    x = t.betensor
    return (torch.trunc(x.to(torch.float64)) if x.is_floating_point() else x).to(torch.int64)


def _nonzero_mask(node: PyNode, t: PyTensor) -> torch.Tensor:
    """Where the (float) value of `t` is not 0: `q + zp != 0` for a quantized tensor."""
    if node.quantized:
        return int_value(t) + tensor_zp(node, t) != 0
    return t.betensor != 0


def _zero_fill(node: PyNode, t: PyTensor, like: torch.Tensor) -> torch.Tensor:
    """Float 0 in `t`'s representation: 0, or the integer -zp clamped to the range when quantized."""
    if node.quantized:
        return torch.tensor(zero_code(node, t), dtype=like.dtype, device=like.device)
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _fit(node: PyNode, index: int, x: torch.Tensor, axis: int, fill: torch.Tensor) -> torch.Tensor:
    """`x` padded with `fill` (or cut, with a warning) along `axis` to output `index`'s IR size there."""
    ir_shape = node.outputs[index].ir_shape
    if len(ir_shape) != x.dim():
        raise node._error(f"output '{node.outputs[index].name}' has IR shape {list(ir_shape)}, rank {len(ir_shape)}, "
                          f"but the operator gives rank {x.dim()}")
    size, have = int(ir_shape[axis]), int(x.shape[axis])
    if have > size:
        OPT_WARN(f"layer '{node.name}' ({node.type}): {have} entries along axis {axis} of output "
                 f"'{node.outputs[index].name}', which the IR declares with {size}; the rest is cut")
        return x.narrow(axis, 0, size).contiguous()
    if have == size:
        return x
    shape = list(x.shape)
    shape[axis] = size - have
    return torch.cat([x, fill.to(device=x.device, dtype=x.dtype).expand(shape)], dim=axis)


_ZERO = torch.zeros((), dtype=torch.int64)


def _dtype_range(dtype: Dtype) -> Tuple[int, int]:
    return integer_range(dtype.bits, dtype.is_signed)


def _set_integer(node: PyNode, t: PyTensor, dtype: Dtype) -> None:
    """A qinvariant tensor of `dtype`: scale 1, zero point 0, the dtype's whole range."""
    set_qinvariant(node, t, dtype.bits, dtype.is_signed)


# ------------------------------------------------------------------------------------------------ NonZero
NONZERO = declare_op(
    "NonZero",
    dtypes="any → uint8/uint16/aligned_uint12/uint32 indices and count (scale 1)",
    integer="q + zp != 0; exact indices", semantics=f"{SEMANTICS}#nonzero",
    summary="Outputs: the coordinates of the nonzero elements in row-major order [rank, size] (the IR's size, "
            "at most the element count; padded with 0) and their number n as a [1] tensor.")


@NONZERO.forward
def nonzero_forward(self: PyNode) -> None:
    """torch.nonzero transposed to [rank, n], padded with 0 to the IR's size; output 1 (if any) holds n."""
    mask = _nonzero_mask(self, self.inputs[0])
    coords = torch.nonzero(mask).permute(1, 0).contiguous()
    n = int(coords.shape[1])
    self.outputs[0].betensor = _fit(self, 0, coords, 1, _ZERO)
    if len(self.outputs) > 1:
        self.outputs[1].betensor = torch.tensor([n], dtype=torch.int64, device=mask.device)


def _nonzero_index_bits(node: PyNode) -> int:
    """max(activation bits, ceil(log2(largest input dim))), as upstream."""
    dims = [int(d) for d in node.inputs[0].ir_shape] or [1]
    return max(int(layer_settings(node).q_bits_activation), int(math.ceil(math.log2(max(max(dims), 1)))))


@NONZERO.quantize
def nonzero_quantize(self: PyNode) -> None:
    """Coordinates: unsigned, max(activation bits, ceil(log2(largest input dim))) bits, the dtype that holds them
    (its whole range). The count: the same dtype when it holds the element count, else the smallest of
    uint16/uint32 that does (upstream always copies the coordinates' dtype, which can overflow)."""
    bits = _nonzero_index_bits(self)
    dtype = int_dtype_for_bits(bits, False)
    _set_integer(self, self.outputs[0], dtype)
    quant_of(self).of(self.outputs[0]).qbits = bits
    if len(self.outputs) > 1:
        numel = int(self.inputs[0].ir_numel)
        if numel <= _dtype_range(dtype)[1]:
            copy_params(self, self.outputs[1], self.outputs[0])
        else:
            _set_integer(self, self.outputs[1], Dtype.UINT16 if numel <= integer_range(16, False)[1] else Dtype.UINT32)


# ------------------------------------------------------------------------------------------------ Unique
UNIQUE = declare_op(
    "Unique",
    params={"sorted": Param(Bool(), "unique values in ascending order (else in order of first occurrence)",
                            default=True),
            "axis": Param(Either((Axis(), Text(choices=("NONE",)))),
                          "unique slices along this axis; None (or NONE): of the flattened input", default="NONE")},
    dtypes="values: passthrough; indices, inverse indices, counts: their IR integer dtype (scale 1)",
    integer="unique of the integers; exact indices and counts", semantics=f"{SEMANTICS}#unique",
    summary="Outputs: unique values, index of each one's first occurrence, inverse indices, counts; all but the "
            "inverse indices padded with 0 to their IR size.")


def _unique_axis(node: PyNode, rank: int) -> Optional[int]:
    axis = node.get_param("axis", optional=True, default_value=None)
    if axis is None or (isinstance(axis, str) and axis.upper() == "NONE"):
        return None
    if isinstance(axis, list):
        if len(axis) != 1:
            raise node._error(f"axis must be one integer or None, got {axis!r}")
        axis = axis[0]
    if isinstance(axis, str):
        raise node._error(f"axis must be an integer or NONE, got {axis!r}")
    return axis_param(node, axis, rank)


@UNIQUE.forward
def unique_forward(self: PyNode) -> None:
    """Unique elements (or slices along `axis`): `sorted` ascending (slices: lexicographically) or in order of first
    occurrence; indices of the first occurrences, the inverse map (one entry per element or slice), counts; values,
    indices and counts padded with 0 (quantized values: -zp) to their IR size."""
    if len(self.outputs) != 4:
        raise self._error(f"needs 4 outputs (values, indices, inverse indices, counts), got {len(self.outputs)}")
    x = self.inputs[0].betensor
    axis = _unique_axis(self, x.dim())
    values, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True, dim=axis)
    inverse = inverse.reshape(-1)
    n = int(counts.numel())
    positions = torch.arange(inverse.numel(), dtype=torch.int64, device=inverse.device)
    first = torch.full((n,), inverse.numel(), dtype=torch.int64, device=inverse.device).scatter_reduce(
        0, inverse, positions, "amin")
    if not bool_param(self, "sorted", True):
        order = torch.argsort(first)  # first occurrences are distinct: a plain sort is stable enough
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, dtype=torch.int64, device=order.device)
        values = values.index_select(0 if axis is None else axis, order)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    along = 0 if axis is None else axis
    self.outputs[0].betensor = _fit(self, 0, values, along, _zero_fill(self, self.inputs[0], values))
    self.outputs[1].betensor = _fit(self, 1, first, 0, _ZERO)
    self.outputs[2].betensor = inverse
    self.outputs[3].betensor = _fit(self, 3, counts.to(torch.int64), 0, _ZERO)


@UNIQUE.quantize
def unique_quantize(self: PyNode) -> None:
    """Values: passthrough. Indices, inverse indices and counts: integers of their IR dtype (scale 1)."""
    if len(self.outputs) != 4:
        raise self._error(f"needs 4 outputs (values, indices, inverse indices, counts), got {len(self.outputs)}")
    copy_params(self, self.outputs[0], self.inputs[0])
    for out in self.outputs[1:]:
        if out.ir_dtype.is_float:
            raise self._error(f"output '{out.name}' must have an integer IR dtype, got {out.ir_dtype.value}")
        _set_integer(self, out, out.ir_dtype)


# ------------------------------------------------------------------------------------------------ Compress
COMPRESS = declare_op(
    "Compress",
    params={"axis": Param(Int(), "the axis along which slices are selected", required=True)},
    dtypes="data: passthrough; condition: any",
    integer="passthrough of the slices whose condition is nonzero (q + zp != 0)", semantics=f"{SEMANTICS}#compress",
    summary="Inputs: data, a 1-D condition. Output: the slices of data along axis whose condition is nonzero, "
            "padded with 0 to the IR's size along axis.")


@COMPRESS.forward
def compress_forward(self: PyNode) -> None:
    """Slice i of `axis` is kept iff i < len(condition) and condition[i] is nonzero (conditions beyond the axis are
    ignored); the kept slices come first, then 0 (quantized: -zp) up to the IR's size along `axis`."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (data, condition), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    cond = self.inputs[1]
    if cond.betensor.dim() != 1:
        raise self._error(f"condition must be 1-D, got shape {list(cond.betensor.shape)}")
    axis = axis_param(self, self.get_param("axis"), x.dim())
    keep = _nonzero_mask(self, cond)[: x.shape[axis]]
    y = x.index_select(axis, torch.nonzero(keep).reshape(-1)).contiguous()
    self.outputs[0].betensor = _fit(self, 0, y, axis, _zero_fill(self, self.inputs[0], x))


@COMPRESS.quantize
def compress_quantize(self: PyNode) -> None:
    copy_params(self, self.outputs[0], self.inputs[0])


# ------------------------------------------------------------------------------------------------ Filter
FILTER = declare_op(
    "Filter",
    params={"num": Param(Int(lo=1), "how many data inputs (all inputs but the selector)", required=True),
            "axis": Param(Int(), "the axis along which slices are selected", required=True)},
    dtypes="data: passthrough; selector: any; count: uint16 (int16 with force_dtype_int; 32 bits for 32-bit "
           "activations), scale 1",
    integer="selected slices packed first, the rest -zp; exact count", semantics=f"{SEMANTICS}#filter",
    summary="Inputs: num data tensors, then a 1-D selector. Outputs: each data tensor with its selected slices "
            "packed first and the rest 0, then the number of selected slices (a scalar).")


def _filter_check(node: PyNode) -> int:
    num = int(node.get_param("num"))
    if num != len(node.inputs) - 1 or len(node.outputs) != num + 1:
        raise node._error(f"num {num} must equal the number of data inputs ({len(node.inputs) - 1}), with num + 1 "
                          f"outputs ({len(node.outputs)})")
    return num


@FILTER.forward
def filter_forward(self: PyNode) -> None:
    """Selected: the slices i along `axis` whose selector[i] is nonzero (a selector longer than the axis is an
    error); each output keeps its input's shape, the selected slices first in order, then 0."""
    num = _filter_check(self)
    sel = self.inputs[num]
    if sel.betensor.dim() != 1:
        raise self._error(f"the selector must be 1-D, got shape {list(sel.betensor.shape)}")
    picked = torch.nonzero(_nonzero_mask(self, sel)).reshape(-1)
    for t, out in zip(self.inputs[:num], self.outputs[:num]):
        x = t.betensor
        axis = axis_param(self, self.get_param("axis"), x.dim())
        if sel.betensor.numel() > x.shape[axis]:
            raise self._error(f"the selector has {sel.betensor.numel()} entries, input '{t.name}' only "
                              f"{x.shape[axis]} slices along axis {axis}")
        y = _zero_fill(self, t, x).expand(x.shape).clone()
        y.narrow(axis, 0, picked.numel()).copy_(x.index_select(axis, picked))
        out.betensor = y
    self.outputs[num].betensor = torch.tensor(picked.numel(), dtype=torch.int64, device=picked.device)


@FILTER.quantize
def filter_quantize(self: PyNode) -> None:
    """Data outputs: passthrough. Count: max(16, activation bits) bits, unsigned unless force_dtype_int."""
    num = _filter_check(self)
    for t, out in zip(self.inputs[:num], self.outputs[:num]):
        copy_params(self, out, t)
    s = layer_settings(self)
    set_qinvariant(self, self.outputs[num], max(COUNT_MIN_BITS, int(s.q_bits_activation)), bool(s.force_dtype_int))


# ------------------------------------------------------------------------------------------------ InTopK
IN_TOP_K = declare_op(
    "InTopK",
    params={"k": Param(Int(lo=0), "how many top values", required=True),
            "largest": Param(Bool(), "the k largest values (else the k smallest)", default=True),
            "sorted": Param(Bool(), "not read")},
    dtypes="predictions: any; targets: integer → uint8 (int8 with force_dtype_int), scale 1",
    integer="compare integers; 0/1", semantics=f"{SEMANTICS}#intopk",
    summary="Inputs: predictions [batch, classes], targets [batch]. Output [batch]: 1 where the target's "
            "prediction is among the k largest (smallest) values, ties included.")


@IN_TOP_K.forward
def in_top_k_forward(self: PyNode) -> None:
    """1 iff predictions[b, t] is one of the values of the top-k (k capped at the class count): at least the k-th
    largest (largest) or at most the k-th smallest; a target outside [-classes, classes) gives 0, a negative one
    counts from the end."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (predictions, targets), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    if x.dim() != 2:
        raise self._error(f"predictions must be [batch, classes], got shape {list(x.shape)}")
    target = _integers(self, self.inputs[1], "target").reshape(-1)
    batch, classes = (int(d) for d in x.shape)
    if target.numel() != batch:
        raise self._error(f"targets hold {target.numel()} values for a batch of {batch}")
    k = min(int(self.get_param("k")), classes)
    largest = bool_param(self, "largest", True)
    valid = (target >= -classes) & (target < classes)
    safe = torch.where(valid, torch.remainder(target, max(classes, 1)), torch.zeros_like(target))
    if k == 0 or classes == 0:
        hit = torch.zeros(batch, dtype=torch.bool, device=x.device)
    else:
        value = x.gather(1, safe.reshape(-1, 1))
        top = torch.topk(x, k, dim=-1, largest=largest, sorted=True).values
        hit = (top == value).any(dim=-1)
    self.outputs[0].betensor = (hit & valid).to(torch.int64)


@IN_TOP_K.quantize
def in_top_k_quantize(self: PyNode) -> None:
    _check_integer_tensor(self, self.inputs[1], "target")
    set_qinvariant(self, self.outputs[0], 8, bool(layer_settings(self).force_dtype_int))


# ------------------------------------------------------------------------------------------------ SegmentReduce
SEGMENT_REDUCE = declare_op(
    "SegmentReduce",
    params={"method": Param(Text(), "the reduction; SUM only (as upstream)", required=True)},
    dtypes="float32 → int8/uint8/int16/uint16 (signed like the input); segment ids: integer",
    integer="exact integer sums (q + zp), requantized with scale_value/shift_value",
    semantics=f"{SEMANTICS}#segmentreduce",
    summary="Inputs: data, segment ids along dim 0 (sorted). Output: row j = the sum of the rows of segment j "
            "(0 for a segment without rows) for j up to ids[-1], then 0 up to the IR's row count.")


def _segment_method(node: PyNode) -> str:
    method = str(node.get_param("method")).upper()
    if method not in SEGMENT_METHODS:
        raise UnsupportedError(f"layer '{node.name}' (SegmentReduce): method {method} is not supported (supported: "
                               f"{', '.join(SEGMENT_METHODS)})")
    return method


def _segment_ids(node: PyNode, rows: int) -> torch.Tensor:
    """Ids cut to `rows`, or padded with the last id, as upstream."""
    ids = _integers(node, node.inputs[1], "segment id").reshape(-1)
    if ids.numel() == 0:
        raise node._error("segment ids are empty")
    if ids.numel() > rows:
        return ids[:rows]
    return torch.cat([ids, ids[-1:].expand(rows - ids.numel())])


@SEGMENT_REDUCE.forward
def segment_reduce_forward(self: PyNode) -> None:
    """Output row j (0 <= j <= ids[-1]) = sum of the data rows whose id is j; ids outside [0, ids[-1]] are not
    summed; rows up to the IR's row count are 0. Quantized: sums of q + zp_in, requantized (docs)."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (data, segment ids), got {len(self.inputs)}")
    _segment_method(self)
    data = self.inputs[0]
    x = data.betensor
    if x.dim() < 1:
        raise self._error("data must have at least one dim")
    ids = _segment_ids(self, int(x.shape[0]))
    segments = max(int(ids[-1]) + 1, 0)
    valid = (ids >= 0) & (ids < segments)
    rows = x[valid]
    if self.quantized:
        acc = torch.zeros([segments] + list(x.shape[1:]), dtype=torch.int64, device=x.device)
        acc.index_add_(0, ids[valid], rows.to(torch.int64) + tensor_zp(self, data))
        out = self.outputs[0]
        m, n = requant_of(self)
        qmin, qmax = out_range(self, out)
        y = requantize_int(acc, m, n, tensor_zp(self, out), qmin, qmax)
        self.outputs[0].betensor = _fit(self, 0, y, 0, torch.tensor(zero_code(self, out)))
        return
    v = x if x.is_floating_point() else x.to(torch.float32)
    acc = torch.zeros([segments] + list(x.shape[1:]), dtype=v.dtype, device=x.device)
    for j in range(segments):  # each segment summed in row order, as the float reference does
        part = rows[ids[valid] == j]
        if part.shape[0]:
            acc[j] = part.to(v.dtype).sum(dim=0)
    self.outputs[0].betensor = _fit(self, 0, acc, 0, torch.zeros((), dtype=acc.dtype))


@SEGMENT_REDUCE.quantize
def segment_reduce_quantize(self: PyNode) -> None:
    """Output from its calibrated range, signed like the input; M/N ≈ s_out / s_in with max(16, activation bits)
    bits."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (data, segment ids), got {len(self.inputs)}")
    _segment_method(self)
    _check_integer_tensor(self, self.inputs[1], "segment id")
    inp, out = self.inputs[0], self.outputs[0]
    quantize_activation(self, out, is_signed(self, inp))
    bits = max(SEGMENT_MULT_MIN_BITS, int(layer_settings(self).q_bits_activation))
    store_requant(self, *requant_scale_shift(self, tensor_scale(self, out) / tensor_scale(self, inp), mult_bits=bits))



# ------------------------------------------------------------------------------------------------ AccidentalHits
ACCIDENTAL_HITS = declare_op(
    "AccidentalHits",
    dtypes="integer inputs → uint16/uint32 positions (int16/int32 with force_dtype_int), uint16 count (scale 1)",
    integer="integer comparisons; exact positions", semantics=f"{SEMANTICS}#accidentalhits",
    summary="Inputs: true classes [batch, num_true], sampled candidates [num_sampled]. Outputs [max_hits] (the "
            "IR's): the batch row and the candidate position of each hit, padded with 0; then the hit count [1].")


@ACCIDENTAL_HITS.forward
def accidental_hits_forward(self: PyNode) -> None:
    """A hit: true_classes[b, j] == candidates[k]; hits in order of (b, j, k); output 0 holds b, output 1 holds k,
    both padded with 0 to the IR length (more hits are cut); output 2 the number written."""
    if len(self.inputs) != 2 or len(self.outputs) != 3:
        raise self._error(f"needs 2 inputs (true classes, sampled candidates) and 3 outputs, got "
                          f"{len(self.inputs)} and {len(self.outputs)}")
    true = _integers(self, self.inputs[0], "true class")
    cand = _integers(self, self.inputs[1], "sampled candidate").reshape(-1)
    if true.dim() != 2:
        raise self._error(f"true classes must be [batch, num_true], got shape {list(true.shape)}")
    size = int(self.outputs[0].ir_shape[0]) if self.outputs[0].ir_shape else 0
    hits = torch.nonzero(true.unsqueeze(-1) == cand.reshape(1, 1, -1))  # rows (b, j, k), row-major
    n = min(int(hits.shape[0]), size)
    rows = torch.zeros(size, dtype=torch.int64, device=true.device)
    cols = torch.zeros(size, dtype=torch.int64, device=true.device)
    rows[:n] = hits[:n, 0]
    cols[:n] = hits[:n, 2]
    self.outputs[0].betensor = rows
    self.outputs[1].betensor = cols
    self.outputs[2].betensor = torch.tensor([n], dtype=torch.int64, device=true.device)


@ACCIDENTAL_HITS.quantize
def accidental_hits_quantize(self: PyNode) -> None:
    """Output i (0, 1): positions below input i's IR dim 0, 16 bits (32 when they do not fit), unsigned unless
    force_dtype_int. Count: max(16, activation bits) bits."""
    if len(self.inputs) != 2 or len(self.outputs) != 3:
        raise self._error(f"needs 2 inputs (true classes, sampled candidates) and 3 outputs, got "
                          f"{len(self.inputs)} and {len(self.outputs)}")
    s = layer_settings(self)
    signed = bool(s.force_dtype_int)
    for inp, out, what in zip(self.inputs, self.outputs[:2], ("true class", "sampled candidate")):
        _check_integer_tensor(self, inp, what)
        n = int(inp.ir_shape[0]) if inp.ir_shape else 1
        set_qinvariant(self, out, COUNT_MIN_BITS if n <= integer_range(COUNT_MIN_BITS, signed)[1] else 32, signed)
    set_qinvariant(self, self.outputs[2], max(COUNT_MIN_BITS, int(s.q_bits_activation)), signed)
