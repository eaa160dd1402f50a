"""Layout, shape and dtype ops: Transpose, Permute, Reshape, Squeeze, Split, Slice, StridedSlice, Shape,
ConstantOfShape and Cast.

The data-movement ops carry their input's quantization params unchanged and move the integers exactly as they
move floats (one code path for both). Shape outputs exact integers; ConstantOfShape quantizes its fill value;
Cast changes the dtype (integer casts of integer tensors are exact, float → integer casts requantize to scale 1).
The integer semantics are in docs/semantics/indexing.md.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.batch import batch_error, batch_rows
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype, dtype_from_name
from ..quant.params import integer_range, linear_quant_params
from ..quant.rounding import FLOAT64_EXACT, round_shift
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Axis, Bool, DtypeName, Float, Int, Ints, Param, Text, Value, quantized
from ._permute import permuted_copy
from ._quant import (
    activation_mode,
    copy_params,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    params,
    requant_scale_shift,
    set_params,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param, keeps_float64
from .onnx_build.exact import codes, double, emit_integers, shared_perm
from .onnx_build.perms import channels_first, inverse, reduced_perm
from .onnx_build.qdq_graph import QDQGraph, node_error, require_same

SEMANTICS = "docs/semantics/indexing.md"

SHAPE_OUTPUT_BITS = 32
"""Shape outputs are int32 integers (scale 1), like the IR the Parser writes."""

CAST_MAX_INT_BITS = 32
"""Integer Cast outputs are at most 32 bits wide: a 64-bit `to_dtype` is written and computed as int32/uint32."""

CAST_MULTIPLIER_BITS = 16
"""Multiplier bits of the float → integer Cast requantization (ratio 1 / scale_in), as upstream."""

_UNREAD_SCALE = Param(Value(), "written by some Parser versions; not read")
_DS = "dynamic-shape value written by the Parser; not read"


# ------------------------------------------------------------------------------------------------ helpers
def _ints(node: PyNode, key: str, value: Any) -> List[int]:
    """A list-of-integers param (a scalar is a one-element list)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise node._error(f"parameter '{key}' must be a list of integers, got {value!r}") from None
    if any(float(v) != i for v, i in zip(values, out)):
        raise node._error(f"parameter '{key}' must be a list of integers, got {value!r}")
    return out


def _ir_batch(t: PyTensor) -> int:
    return int(t.ir_shape[0]) if t.ir_shape else 1


def _require_inputs(node: PyNode, count: int) -> None:
    if len(node.inputs) < count:
        raise node._error(f"needs {count} input(s), got {len(node.inputs)}")


def _check_integer_input(node: PyNode, t: PyTensor, what: str) -> None:
    """Quantized, a shape/index input must hold exact integers: a qinvariant tensor (scale 1, zero point 0)."""
    q = params(node, t)
    if not q.qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {what} input '{t.name}' is a quantized "
                               f"tensor (scale {q.scale}, zero point {q.zerop}); it must hold exact integers (an "
                               "integer model input, an integer constant or an integer output such as Shape)")


# ------------------------------------------------------------------------------------------------ Transpose, Permute
TRANSPOSE = declare_op(
    ["Transpose", "Permute"],
    params={"perm": Param(Ints(scalar_ok=False),
                          "output axis i is input axis perm[i] (Permute: reversed axes when absent)"),
            "scale": Param(Value(), "written by some Parser versions; not read")},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough (data movement only)", semantics=f"{SEMANTICS}#transpose-permute")


@TRANSPOSE.only("Transpose").forward
@keeps_float64()
def transpose_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    perm = self.get_param("perm")
    perm = _ints(self, "perm", perm) if isinstance(perm, (list, tuple)) else perm
    if not isinstance(perm, list) or sorted(perm) != list(range(x.dim())):
        raise self._error(f"perm {perm} is not a permutation of the {x.dim()} input axes")
    self.outputs[0].betensor = permuted_copy(x, perm)


@TRANSPOSE.only("Permute").forward
@keeps_float64()
def permute_forward(self: PyNode) -> None:
    """`perm` like Transpose; a missing or non-list `perm` reverses the axes (numpy's default)."""
    x = self.inputs[0].betensor
    perm = self.get_param("perm", optional=True)
    perm = list(reversed(range(x.dim()))) if not isinstance(perm, (list, tuple)) else _ints(self, "perm", perm)
    if sorted(perm) != list(range(x.dim())):
        raise self._error(f"perm {perm} is not a permutation of the {x.dim()} input axes")
    self.outputs[0].betensor = permuted_copy(x, perm)


# ------------------------------------------------------------------------------------------------ Reshape, Squeeze
RESHAPE = declare_op(
    "Reshape",
    params={"shape": Param(Ints(lo=-1, scalar_ok=False), "target shape (dims >= 0, at most one -1); dim 0 follows "
                       "the actual batch", required=True),
            "ds_output_shape": Param(Value(), _DS),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough (data movement only)", semantics=f"{SEMANTICS}#reshape-squeeze")

SQUEEZE = declare_op(
    "Squeeze",
    params={"axis": Param(Axis(), "dims to remove (int or list); default: the size-1 dims of the IR shape"),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough (data movement only)", semantics=f"{SEMANTICS}#reshape-squeeze")


def batched_shape(node: PyNode, inp: PyTensor, shape: List[int]) -> List[int]:
    """The IR `shape` of a reshape for the data's batch: the input is the dim-0 concatenation of groups of the IR
    batch (quantopt.graph.batch), so dim 0 of the result grows by the same factor (a dim 0 equal to the input's IR
    dim 0 simply takes the data's rows: the batch may then be any size). A value that is not such a concatenation
    (another dim changed) keeps `shape`, for the reshape itself to report."""
    rows = batch_rows(inp)
    if rows is None:
        return shape
    if not shape:
        raise batch_error(node, f"input '{inp.name}' has {rows} rows in dim 0 and the target shape is a scalar",
                          "it holds one IR batch only")
    ir0 = int(inp.ir_shape[0])
    if shape[0] == ir0:
        return [rows] + shape[1:]
    if rows % ir0:
        raise batch_error(node, f"input '{inp.name}' has {rows} rows in dim 0 where the IR has {ir0}, and the "
                                f"target shape {shape} does not keep dim 0")
    return [shape[0] * (rows // ir0)] + shape[1:]


@RESHAPE.forward
@keeps_float64()
def reshape_forward(self: PyNode) -> None:
    """IR `shape` fixes the IR batch; for another batch dim 0 grows with the data (`batched_shape`)."""
    inp = self.inputs[0]
    shape = self.get_param("shape")
    if not isinstance(shape, (list, tuple)):
        raise self._error(f"parameter 'shape' must be a list of integers, got {shape!r}")
    shape = _ints(self, "shape", shape)
    if any(d < -1 for d in shape) or shape.count(-1) > 1:
        raise self._error(f"shape {shape}: dims must be >= 0, with at most one -1 (inferred)")
    shape = batched_shape(self, inp, shape)
    _check_reshape(self, tuple(inp.betensor.shape), shape)
    self.outputs[0].betensor = inp.betensor.reshape(shape)


def _check_reshape(node: PyNode, src: Tuple[int, ...], shape: List[int]) -> None:
    """A target shape that cannot hold the input's elements is an IR error naming the layer."""
    count, known = math.prod(src), math.prod(d for d in shape if d != -1)
    if (-1 in shape and (known == 0 or count % known)) or (-1 not in shape and known != count):
        raise node._error(f"shape {shape} cannot hold the {count} elements of the input {list(src)}")


@SQUEEZE.forward
@keeps_float64()
def squeeze_forward(self: PyNode) -> None:
    """Removes the `axis` dims (int or list) that have size 1; without `axis`, the size-1 dims of the IR input
    shape. Like torch.squeeze, a listed dim whose actual size is not 1 (a batch > 1) stays."""
    x = self.inputs[0].betensor
    axis = self.get_param("axis", optional=True)
    if axis is None or (isinstance(axis, (list, tuple)) and not axis):
        shape = self.inputs[0].ir_shape or tuple(x.shape)
        axes = [i for i, d in enumerate(shape) if int(d) == 1]
    else:
        axes = [axis_param(self, a, x.dim()) for a in _ints(self, "axis", axis)]
    self.outputs[0].betensor = x.squeeze(tuple(axes)) if axes else x


# ------------------------------------------------------------------------------------------------ Split
SPLIT = declare_op(
    "Split",
    params={"axis": Param(Int(), "the split axis (default 0)", default=0),
            "splits": Param(Ints(lo=0), "one size per output; default: equal parts"),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough; every output carries the input's params",
    semantics=f"{SEMANTICS}#split")


@SPLIT.forward
@keeps_float64()
def split_forward(self: PyNode) -> None:
    """`splits` sizes along `axis` (default 0), one output each; without `splits`, equal parts."""
    x = self.inputs[0].betensor
    axis = axis_param(self, self.get_param("axis", optional=True, default_value=0), x.dim())
    n = len(self.outputs)
    raw = self.get_param("splits", optional=True)
    if raw is None:
        if x.shape[axis] % n:
            raise self._error(f"dim {x.shape[axis]} of axis {axis} does not split into {n} equal parts")
        splits = [x.shape[axis] // n] * n
    else:
        splits = _ints(self, "splits", raw)
    if len(splits) != n or any(s < 0 for s in splits):
        raise self._error(f"splits {splits} must give one non-negative size per output ({n} outputs)")
    if sum(splits) != x.shape[axis]:
        raise self._error(f"splits {splits} sum to {sum(splits)} but axis {axis} has size {x.shape[axis]}")
    for t, part in zip(self.outputs, torch.split(x, splits, dim=axis)):
        t.betensor = part.contiguous()


# ------------------------------------------------------------------------------------------------ Slice, StridedSlice
_SLICE_PARAMS = {
    "begin": Param(Ints(), "first index per sliced axis", required=True),
    "end": Param(Ints(), "end per sliced axis (exclusive; a negative end with a negative stride: through index 0)",
                 required=True),
    "strides": Param(Ints(), "step per sliced axis, not 0 (default 1)"),
    "upper_bound": Param(Bool(), "a negative end is inclusive", default=False),
}
_MASKS = ("begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask", "new_axis_mask")

SLICE = declare_op(
    "Slice",
    params={**_SLICE_PARAMS,
            **{k: Param(Int(lo=0), "a StridedSlice mask written by some Parser versions; not read by Slice")
               for k in _MASKS},
            **{k: Param(Value(), _DS) for k in ("ds_begin", "ds_end", "ds_strides", "ds_output_shape")},
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough (data movement only)",
    semantics=f"{SEMANTICS}#slice-stridedslice")

STRIDED_SLICE = declare_op(
    "StridedSlice",
    params={**_SLICE_PARAMS,
            "begin_mask": Param(Int(lo=0), "bit i set: axis i starts at its beginning", default=0),
            "end_mask": Param(Int(lo=0), "bit i set: axis i runs to its end", default=0),
            "shrink_axis_mask": Param(Int(lo=0), "bit i set: axis i (one element long) is removed", default=0),
            "ellipsis_mask": Param(Int(lo=0), "must be 0 (the Parser resolves it into begin/end/strides)",
                                   default=0),
            "new_axis_mask": Param(Int(lo=0), "must be 0 (the Parser resolves it into begin/end/strides)",
                                   default=0),
            "scale": _UNREAD_SCALE},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough (data movement only)",
    semantics=f"{SEMANTICS}#slice-stridedslice")


def slice_indices(size: int, begin: Optional[int], end: Optional[int], stride: int, upper_bound: bool) -> List[int]:
    """Indices one axis of `size` keeps, as the Parser writes begin/end/strides (docs: Slice).

    Python slicing with clamping, except that a negative `end` with a negative stride means "through index 0"
    (the Parser's encoding of an open end); with `upper_bound`, a negative `end` is one further (exclusive → inclusive).
    """
    if end is not None and end < 0:
        end = end + (size if stride > 0 else 0) + int(upper_bound)
        if end < 0:
            end = None
    return list(range(size))[slice(begin, end, stride)]


def _slice_forward(node: PyNode, masks: bool) -> None:
    inp = node.inputs[0]
    x = inp.betensor
    begin = _ints(node, "begin", node.get_param("begin"))
    end = _ints(node, "end", node.get_param("end"))
    strides = _ints(node, "strides", node.get_param("strides", optional=True, default_value=[1] * len(begin)))
    if not len(begin) == len(end) == len(strides) or len(begin) > x.dim():
        raise node._error(f"begin {begin}, end {end} and strides {strides} must have one entry per sliced axis "
                          f"(at most {x.dim()})")
    if any(s == 0 for s in strides):
        raise node._error(f"strides {strides} must not contain 0")
    upper = bool_param(node, "upper_bound", False)
    begin_mask = end_mask = shrink = 0
    if masks:
        for key in ("ellipsis_mask", "new_axis_mask"):
            if int(node.get_param(key, optional=True, default_value=0)):
                raise UnsupportedError(f"layer '{node.name}' ({node.type}): {key} is not supported (the Parser "
                                       "resolves it into begin/end/strides)")
        begin_mask = int(node.get_param("begin_mask", optional=True, default_value=0))
        end_mask = int(node.get_param("end_mask", optional=True, default_value=0))
        shrink = int(node.get_param("shrink_axis_mask", optional=True, default_value=0))
    ir_batch = _ir_batch(inp)
    for axis, (b, e, s) in enumerate(zip(begin, end, strides)):
        b_ = None if begin_mask >> axis & 1 else b
        e_ = None if end_mask >> axis & 1 else e
        size = int(x.shape[axis])
        if axis == 0 and size != ir_batch:
            # the IR slices its own batch; an actual batch of N * ir_batch repeats that selection per group
            if size % ir_batch:
                raise batch_error(node, f"input '{inp.name}' has {size} rows in dim 0 where the IR has {ir_batch}, "
                                        "not a whole number of IR batches")
            base = slice_indices(ir_batch, b_, e_, s, upper)
            idx = [g * ir_batch + i for g in range(size // ir_batch) for i in base]
        else:
            idx = slice_indices(size, b_, e_, s, upper)
        if idx != list(range(size)):
            x = x.index_select(axis, torch.tensor(idx, dtype=torch.int64, device=x.device))
    shrink_axes = tuple(a for a in range(len(begin)) if shrink >> a & 1)
    if shrink_axes:
        if any(x.shape[a] != 1 for a in shrink_axes):
            raise node._error(f"shrink_axis_mask {shrink} names axes whose slice is not one element long")
        x = x.squeeze(shrink_axes)
    node.outputs[0].betensor = x.contiguous()


@SLICE.forward
@keeps_float64()
def slice_forward(self: PyNode) -> None:
    _slice_forward(self, masks=False)


@STRIDED_SLICE.forward
def strided_slice_forward(self: PyNode) -> None:
    _slice_forward(self, masks=True)


@TRANSPOSE.quantize
@RESHAPE.quantize
@SQUEEZE.quantize
@SLICE.quantize
@STRIDED_SLICE.quantize
@SPLIT.quantize
def shape_only_quantize(self: PyNode) -> None:
    for out in self.outputs:
        copy_params(self, out, self.inputs[0])


# ------------------------------------------------------------------------------------------------ Shape
SHAPE = declare_op(
    "Shape",
    params={"start": Param(Int(), "first dim (default 0)", default=0),
            "end": Param(Int(), "end dim, exclusive (default: the rank)")},
    dtypes="any → int32 (scale 1)", integer="exact integer dims", semantics=f"{SEMANTICS}#shape")


@SHAPE.forward
def shape_forward(self: PyNode) -> None:
    """dims [start:end] of the input's actual shape as an integer vector (start 0, end = rank by default)."""
    x = self.inputs[0].betensor
    start = int(self.get_param("start", optional=True, default_value=0))
    end = self.get_param("end", optional=True)
    dims = list(x.shape)[start:None if end is None else int(end)]
    self.outputs[0].betensor = torch.tensor(dims, dtype=torch.int64, device=x.device)


@SHAPE.quantize
def shape_quantize(self: PyNode) -> None:
    set_qinvariant(self, self.outputs[0], SHAPE_OUTPUT_BITS, True)


# ------------------------------------------------------------------------------------------------ ConstantOfShape
CONSTANT_OF_SHAPE = declare_op(
    "ConstantOfShape",
    params={"value": Param(Float(infinite=True), "the fill value (default 0; quantized: its stored integer)",
                           default=0.0),
            "shape": Param(Ints(scalar_ok=False), "written by some Parser versions; not read (the shape is input 0)")},
    dtypes="int32 shape → int8/uint8/int16/uint16 (scale 1 for integer values)",
    integer="fill with the quantized value", semantics=f"{SEMANTICS}#constantofshape",
    summary="Input: the shape (integer).")


@CONSTANT_OF_SHAPE.forward
def constant_of_shape_forward(self: PyNode) -> None:
    """A tensor of shape `input` filled with `value` (quantized: the stored integer `value`)."""
    inp = self.inputs[0]
    if self.quantized:
        _check_integer_input(self, inp, "shape")
    shape = [int(v) for v in int_value(inp).flatten().tolist()]
    if any(d < 0 for d in shape):
        raise self._error(f"shape input {shape} has a negative dim")
    value = self.get_param("value", optional=True, default_value=0.0)
    out = self.outputs[0]
    if self.quantized:
        out.betensor = torch.full(shape, int(value), dtype=torch.int64, device=inp.betensor.device)
    else:
        out.betensor = torch.full(shape, float(value), dtype=torch.float32,
                                  device=inp.betensor.device).to(out.ir_dtype.torch_dtype)


@CONSTANT_OF_SHAPE.quantize
def constant_of_shape_quantize(self: PyNode) -> None:
    """An integer `value` gives a qinvariant output; any other value is quantized with a range [min(v,0),
    max(v,0)] and stored as its integer."""
    _check_integer_input(self, self.inputs[0], "shape")
    s = layer_settings(self)
    out = self.outputs[0]
    value = float(self.get_param("value", optional=True, default_value=0.0))
    if value != value or value in (float("inf"), float("-inf")):
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): a non-finite fill value {value} cannot be "
                               "quantized")
    signed = value < 0 or bool(s.force_dtype_int)
    bits = int(s.q_bits_activation)
    if value == round(value):
        fits = [b for b in (bits, 16, 32) if integer_range(b, signed)[0] <= value <= integer_range(b, signed)[1]]
        if not fits:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): integer fill value {value:g} does not fit "
                                   "32 bits")
        set_qinvariant(self, out, fits[0], signed)
        self.params["value"] = int(value)
        return
    mode = activation_mode(self, bits)
    if not mode.is_per_tensor:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel activation quantization is not "
                               "supported")
    p = linear_quant_params(min(value, 0.0), max(value, 0.0), bits, mode, signed)
    set_params(self, out, p, bits)
    q = round(value * float(p.scale) - float(p.zerop))
    self.params["value"] = int(min(max(q, p.qmin), p.qmax))


# ------------------------------------------------------------------------------------------------ Cast
CAST = declare_op(
    "Cast",
    params={"to_dtype": Param(DtypeName(), "the output dtype (integers at most 32 bits wide)", required=True),
            "clip_mode": Param(Text(choices=("SATURATION", "TRUNCATION")),
                               "out-of-range integers saturate or wrap around", default="SATURATION"),
            "ignore_scale_zp": Param(Bool(), "integer cast without the zero-point change", default=True),
            "only_for_quantized": Param(Value("flag"), "present: a bit-width change between quantized tensors "
                                                       "(the identity in float; removed when quantized)"),
            "round_mode": quantized(Text(), "TRUNC: the requantization rounds toward zero (else half to even)"),
            "scale": _UNREAD_SCALE},
    dtypes="any → to_dtype (integers at most 32 bits)",
    integer="exact integer cast, or requantize to scale 1 (truncating)", semantics=f"{SEMANTICS}#cast",
    summary="Quantized, a requantizing Cast carries scale_value and shift_value.")


def _to_dtype(node: PyNode) -> Dtype:
    raw = node.get_param("to_dtype")
    dt = raw if isinstance(raw, Dtype) else dtype_from_name(str(raw))
    if dt is None or dt is Dtype.BOOL:
        raise node._error(f"to_dtype '{raw}' is not a supported dtype")
    return dt


def _clip_mode(node: PyNode) -> str:
    mode = str(node.get_param("clip_mode", optional=True, default_value="SATURATION")).upper()
    if mode not in ("SATURATION", "TRUNCATION"):
        raise node._error(f"clip_mode '{mode}' is not SATURATION or TRUNCATION")
    return mode


_WRAPPING_DTYPES = {(8, True): torch.int8, (8, False): torch.uint8, (16, True): torch.int16,
                    (32, True): torch.int32}
"""torch integer types whose conversion from int64 keeps the low bits: the two's complement wrap of TRUNCATION."""


def cast_to_range(v: torch.Tensor, lo: int, hi: int, clip_mode: str) -> torch.Tensor:
    """Integers (int64) into [lo, hi]: SATURATION clamps; TRUNCATION keeps the low bits (two's complement wrap,
    modulo hi - lo + 1), for a range of a torch integer type by converting to it and back (the same integers as
    the remainder, in two cheap passes)."""
    if clip_mode == "SATURATION":
        return torch.clamp(v, lo, hi)
    span = hi - lo + 1
    bits = span.bit_length() - 1
    wrapping = _WRAPPING_DTYPES.get((bits, lo < 0)) if span == 1 << bits and lo in (0, -(span >> 1)) else None
    if wrapping is not None and v.dtype == torch.int64:
        return v.to(wrapping).to(torch.int64)
    return torch.remainder(v - lo, span) + lo


def _int_bits(dt: Dtype) -> Tuple[int, bool]:
    return min(dt.bits, CAST_MAX_INT_BITS), dt.is_signed


@CAST.forward
def cast_forward(self: PyNode) -> None:
    """Float: to a float dtype, the value; to an integer dtype, truncation toward zero, then saturation or
    wrap-around into the dtype's range (`clip_mode`). `only_for_quantized` casts are the identity in float."""
    inp, out = self.inputs[0], self.outputs[0]
    to = _to_dtype(self)
    clip_mode = _clip_mode(self)
    if self.quantized:
        out.betensor = cast_int_forward(self, inp, out, clip_mode)
        return
    x = inp.betensor
    if "only_for_quantized" in self.params:
        out.betensor = x
        return
    if to.is_float:
        out.betensor = x.to(torch.float32)
        return
    bits, signed = _int_bits(to)
    lo, hi = integer_range(bits, signed)
    if x.is_floating_point():  # NaN to 0, beyond ±2^62 to ±2^62 (exact in float32 too), then toward zero
        x = torch.nan_to_num(x, nan=0.0).clamp_(-2.0 ** 62, 2.0 ** 62)
    out.betensor = cast_to_range(x.to(torch.int64), lo, hi, clip_mode)


def cast_int_forward(node: PyNode, inp: PyTensor, out: PyTensor, clip_mode: str) -> torch.Tensor:
    """Integer Cast (docs: Cast). With `scale_value`/`shift_value`: t = (q + zp_in) * M, shifted right by N with
    round half to even (`round_mode` absent) or toward zero (`round_mode=TRUNC`), minus zp_out, then the clip
    mode into [qmin, qmax]. Without: q (+ zp_in - zp_out unless `ignore_scale_zp`), then the clip mode."""
    qmin, qmax = out_range(node, out)
    x = int_value(inp)
    zp_in, zp_out = tensor_zp(node, inp), tensor_zp(node, out)
    if "scale_value" in node.params:
        m, n = int(node.params["scale_value"]), int(node.get_param("shift_value"))
        prod = (x + zp_in) * m
        if str(node.params.get("round_mode", "ROUND_TO_EVEN")).upper() == "TRUNC":
            t = torch.sign(prod) * round_shift_floor(prod.abs(), n)
        else:
            t = round_shift(prod, n)
        return cast_to_range(t - zp_out, qmin, qmax, clip_mode)
    if not bool_param(node, "ignore_scale_zp", True):
        x = x + zp_in - zp_out
    return cast_to_range(x, qmin, qmax, clip_mode)


def round_shift_floor(v: torch.Tensor, shift: int) -> torch.Tensor:
    """floor(v / 2^shift) for int64 v >= 0 (a left shift for shift < 0)."""
    return v >> shift if shift >= 0 else v << -shift


@CAST.quantize
def cast_quantize(self: PyNode) -> None:
    """See docs: Cast. Integer → integer: exact (qinvariant); float → float: passthrough; quantized float →
    integer: requantize to scale 1 with truncation; `only_for_quantized` (a bit-width change between quantized
    tensors): new output params from the calibrated range and a multiplier/shift."""
    inp, out = self.inputs[0], self.outputs[0]
    to = _to_dtype(self)
    if "only_for_quantized" in self.params:
        self.params.pop("only_for_quantized")
        self.params["clip_mode"] = "SATURATION"
        if to.is_float:
            raise self._error("an only_for_quantized Cast needs an integer to_dtype")
        bits, signed = _int_bits(to)
        if params(self, inp).qinvariant:
            set_qinvariant(self, out, bits, signed)
            self.params["ignore_scale_zp"] = True
        elif inp.dtype == to:
            copy_params(self, out, inp)
            self.params["ignore_scale_zp"] = True
        else:
            mode = activation_mode(self, bits)
            if bits <= 8 and is_signed(self, inp) and not signed and not mode.is_asymmetric:
                mode = mode.make(mode.granularity, asymmetric=True, full_range=True)
            if not mode.is_per_tensor:
                raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel activation quantization "
                                       "is not supported")
            r = ranges_of(self).get(out)
            if r.min is None or r.max is None:
                raise self._error(f"tensor '{out.name}' has no calibrated range; run calibration first")
            set_params(self, out, linear_quant_params(r.min, r.max, bits, mode, signed), bits)
            ratio = tensor_scale(self, out) / tensor_scale(self, inp)
            m, n, mdt, sdt = requant_scale_shift(self, ratio, mult_bits=bits)
            _store_cast_requant(self, m, n, mdt, sdt)
            self.params["ignore_scale_zp"] = False
        self.params["to_dtype"] = out.dtype
        return
    self.params["clip_mode"] = _clip_mode(self)
    if to.is_float:
        copy_params(self, out, inp)
        self.params["ignore_scale_zp"] = True
    elif params(self, inp).qinvariant:
        bits, signed = _int_bits(to)
        q_in = params(self, inp)
        lo, hi = integer_range(bits, signed)
        if lo <= q_in.qmin and q_in.qmax <= hi:
            # every input integer fits: upstream keeps the input's integer type (the Cast writes it as to_dtype),
            # so a mask cast to int32 stays uint8 and the integer layers after it stay narrow
            copy_params(self, out, inp)
        else:
            set_qinvariant(self, out, bits, signed)
        self.params["ignore_scale_zp"] = True
    else:
        bits, signed = _int_bits(to)
        m, n, mdt, sdt = requant_scale_shift(self, 1.0 / tensor_scale(self, inp), mult_bits=CAST_MULTIPLIER_BITS)
        set_qinvariant(self, out, bits, signed)
        _store_cast_requant(self, m, n, mdt, sdt)
        self.params["round_mode"] = "TRUNC"
        self.params["ignore_scale_zp"] = False
    self.params["to_dtype"] = out.dtype


def _store_cast_requant(node: PyNode, m: int, n: int, mdt: Dtype, sdt: Dtype) -> None:
    node.params["scale_value"] = int(m)
    node.params["scale_type"] = mdt
    node.params["shift_value"] = int(n)
    node.params["shift_type"] = sdt


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def _int_values(values: Sequence[int]) -> List[int]:
    return [int(v) for v in values]


def _batch_shape(x: PyTensor, shape: Sequence[int]) -> List[int]:
    """The IR shape with its batch dim (equal to the input's IR batch) written as 0: ONNX copies the input's."""
    shape = _int_values(shape)
    if shape and x.ir_shape and shape[0] == int(x.ir_shape[0]):
        shape[0] = 0
    return shape


@RESHAPE.export
@SQUEEZE.export
def convert_reshape(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    shape = node.get_param("shape") if str(node.type) == "Reshape" else y.ir_shape
    shape = _batch_shape(x, shape) if g.dynamic_batch else [int(v) for v in y.ir_shape]
    out = g.add("Reshape", [g.int_value(x), g.ints(f"{node.name}/shape", shape)])
    g.set_int(y, out)


@TRANSPOSE.export
def convert_transpose(g: QDQGraph, node: PyNode) -> None:
    """No ONNX node: every layout of the input is a layout of the output (y = x.transpose(P), so the value
    x.transpose(have) equals y.transpose(inverse(P)[have]))."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    rank = g.rank(x)
    raw = node.get_param("perm", optional=True)
    perm = tuple(int(p) for p in raw) if isinstance(raw, (list, tuple)) else tuple(reversed(range(rank)))
    if sorted(perm) != list(range(rank)):
        raise node_error(node, f"perm {list(perm)} is not a permutation of {rank} axes")
    inv = inverse(perm)
    for have in g.perms(x):
        g.set_int(y, g.int_value(x, have), tuple(inv[a] for a in have))


@SPLIT.export
def convert_split(g: QDQGraph, node: PyNode) -> None:
    x = node.inputs[0]
    for y in node.outputs:
        require_same(node, x, y)
    rank = g.rank(x)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), rank)
    sizes = [int(y.ir_shape[axis]) for y in node.outputs]
    outs = g.add_multi("Split", [g.int_value(x, perm), g.ints(f"{node.name}/split", sizes)],
                       [f"{y.name}_q" for y in node.outputs], axis=perm.index(axis))
    for y, name in zip(node.outputs, outs):
        g.set_int(y, name, perm)


def _int_list(node: PyNode, key: str, default: Optional[List[int]] = None) -> List[int]:
    raw = node.get_param(key, optional=default is not None, default_value=default)
    values = raw if isinstance(raw, (list, tuple)) else [raw]
    return [int(v) for v in values]


@SLICE.export
@STRIDED_SLICE.export
def convert_slice(g: QDQGraph, node: PyNode) -> None:
    """ONNX Slice with explicit starts/ends/steps per sliced axis (the Parser's begin/end encoding resolved on the
    IR shape), then Squeeze for StridedSlice's shrink_axis_mask."""
    x, y = node.inputs[0], node.outputs[0]
    require_same(node, x, y)
    begin, end = _int_list(node, "begin"), _int_list(node, "end")
    strides = _int_list(node, "strides", [1] * len(begin))
    masks = str(node.type) == "StridedSlice"
    begin_mask = int(node.params.get("begin_mask", 0)) if masks else 0
    end_mask = int(node.params.get("end_mask", 0)) if masks else 0
    shrink = int(node.params.get("shrink_axis_mask", 0)) if masks else 0
    if masks and (int(node.params.get("ellipsis_mask", 0)) or int(node.params.get("new_axis_mask", 0))):
        raise node_error(node, "ellipsis_mask/new_axis_mask have no QDQ mapping")
    upper = str(node.params.get("upper_bound", False)).lower() in ("true", "1")
    rank = g.rank(x)
    perm = g.common_perm([x], rank)  # whichever layout the input has: slicing works in any
    starts, ends, axes, steps = [], [], [], []
    for axis, (b, e, s) in enumerate(zip(begin, end, strides)):
        if s == 0:
            raise node_error(node, f"strides {strides} must not contain 0")
        size = int(x.ir_shape[axis])
        kept = slice_indices(size, None if begin_mask >> axis & 1 else b, None if end_mask >> axis & 1 else e, s,
                             upper)
        if kept == list(range(size)):
            continue
        if axis == 0 and g.dynamic_batch:
            raise node_error(node, "slicing the batch axis needs a static batch (--static-batch)")
        if not kept:
            raise node_error(node, f"axis {axis} keeps no element")
        stop = kept[-1] + s
        starts.append(kept[0])
        ends.append(stop if stop >= 0 else -(size + 1))  # a negative step through index 0
        axes.append(perm.index(axis))
        steps.append(s)
    value = g.int_value(x, perm)
    if axes:
        value = g.add("Slice", [value, g.ints(f"{node.name}/starts", starts), g.ints(f"{node.name}/ends", ends),
                                g.ints(f"{node.name}/axes", axes), g.ints(f"{node.name}/steps", steps)])
    shrink_axes = [a for a in range(len(begin)) if shrink >> a & 1]
    out_perm = perm
    if shrink_axes:
        value = g.add("Squeeze", [value, g.ints(f"{node.name}/squeeze", sorted(perm.index(a) for a in shrink_axes))])
        out_perm = reduced_perm(perm, shrink_axes)
    g.set_int(y, value, out_perm)


@CAST.export
def convert_cast(g: QDQGraph, node: PyNode) -> None:
    """Integer Cast: `clip_mode(rs((q + zp_in) · M, N) - zp_out)` (TRUNC rounding: toward zero), or
    `clip_mode(q [+ zp_in - zp_out])` without a multiplier; the identity when the integers fit unchanged."""
    x, y = node.inputs[0], node.outputs[0]
    qx, qy = params(node, x), params(node, y)
    if y.dtype.is_float or qx.qmin is None or qy.qmin is None:
        raise node_error(node, "a Cast to a float type has no integer form (float layers have no QDQ form)")
    clip_mode = str(node.get_param("clip_mode", optional=True, default_value="SATURATION")).upper()
    rank = g.rank(x)
    perm = shared_perm(g, [x], rank)
    lo, hi = out_range(node, y)
    if "scale_value" in node.params:
        m, n = int(node.params["scale_value"]), int(node.get_param("shift_value"))
        zp_x = tensor_zp(node, x)
        if max(abs(int(qx.qmin) + zp_x), abs(int(qx.qmax) + zp_x)) * abs(m) >= FLOAT64_EXACT:
            raise node_error(node, "(q + zp) · M leaves float64's exact integers; no exact form")
        v = g.add("Mul", [codes(g, x, perm), double(g, node, "multiplier", m * 2.0 ** -n)])
        if str(node.params.get("round_mode", "ROUND_TO_EVEN")).upper() == "TRUNC":
            v = g.add("Mul", [g.add("Sign", [v]), g.add("Floor", [g.add("Abs", [v])])])
        else:
            v = g.add("Round", [v])
        zp_out = tensor_zp(node, y)
        v = v if not zp_out else g.add("Sub", [v, double(g, node, "output_zero_point", float(zp_out))])
        emit_integers(g, node, y, v, perm, clip_mode)
        return
    shift = 0 if bool_param(node, "ignore_scale_zp", True) else tensor_zp(node, x) - tensor_zp(node, y)
    px, py = g.qparams(x), g.qparams(y)
    if lo <= int(qx.qmin) + shift and int(qx.qmax) + shift <= hi and px.dtype == py.dtype \
            and px.offset == py.offset + shift:  # ONNX x = IR x + offset_x must be IR y + offset_y
        g.set_int(y, g.int_value(x, perm), perm)  # the same ONNX integers
        return
    v = codes(g, x, perm)  # q + zp_in
    v = g.add("Sub", [v, double(g, node, "input_zero_point", float(tensor_zp(node, x) - shift))]) \
        if tensor_zp(node, x) != shift else v
    emit_integers(g, node, y, v, perm, clip_mode)
