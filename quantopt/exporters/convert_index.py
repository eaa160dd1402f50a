"""QDQ export of the indexing layers that move integers without changing them: Slice, StridedSlice, Crop and Gather.

Each runs on the integers in any layout the input already has (Gather: the IR layout); the output keeps the
input's quantization (docs/semantics/indexing.md: passthrough).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..graph.node import PyNode
from ..ops._shared import axis_param
from ..ops.shape import slice_indices
from .convert_layout import _require_same, reduced_perm
from .qdq_graph import QDQGraph, converter, node_error

INT64 = 7
"""onnx.TensorProto.INT64."""


def _int_list(node: PyNode, key: str, default: Optional[List[int]] = None) -> List[int]:
    raw = node.get_param(key, optional=default is not None, default_value=default)
    values = raw if isinstance(raw, (list, tuple)) else [raw]
    return [int(v) for v in values]


@converter("Slice", "StridedSlice")
def convert_slice(g: QDQGraph, node: PyNode) -> None:
    """ONNX Slice with explicit starts/ends/steps per sliced axis (the Parser's begin/end encoding resolved on the
    IR shape), then Squeeze for StridedSlice's shrink_axis_mask."""
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
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


@converter("Gather")
def convert_gather(g: QDQGraph, node: PyNode) -> None:
    """ONNX Gather on the integers in the IR layout; indices from the `indices` constant (checked to be in range:
    ONNX has no fill value for the others) or from an integer input."""
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
    rank = g.rank(x)
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), rank)
    if int(node.get_param("batch_dims", optional=True, default_value=0)):
        raise node_error(node, "batch_dims has no ONNX Gather equivalent")
    if axis == 0 and g.dynamic_batch:
        raise node_error(node, "gathering along the batch axis needs a static batch (--static-batch)")
    size = int(x.ir_shape[axis])
    const = node.get_constant("indices", optional=True)
    if const is not None:
        idx = const.betensor.to(torch.int64).numpy()
        if idx.size and (idx.min() < -size or idx.max() >= size):
            raise node_error(node, f"indices outside [-{size}, {size}) (quantopt reads 0 there, ONNX Gather fails)")
        indices = g.const(f"{node.name}/indices", idx.astype(np.int64))
    elif len(node.inputs) == 2 and node.inputs[1].qinvariant:
        indices = g.add("Cast", [g.int_value(node.inputs[1])], to=INT64)
    else:
        raise node_error(node, "indices must be a constant or an integer tensor")
    g.set_int(y, g.add("Gather", [g.int_value(x), indices], axis=axis))


@converter("Crop")
def convert_crop(g: QDQGraph, node: PyNode) -> None:
    """`crops=[[begin, end], ...]`: an integer Slice of the cropped axes in any layout the input has (none for a
    whole-tensor Crop, which the merge_matmul_mul pass leaves where it folded a factor); [0, IR batch] on axis 0
    keeps the whole batch, as in quantopt."""
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
    rank = g.rank(x)
    crops = node.get_param("crops")
    if not isinstance(crops, (list, tuple)) or len(crops) != rank:
        raise node_error(node, f"crops {crops!r} must hold one [begin, end] pair per axis of the {rank}-D input")
    perm = g.common_perm([x], rank)
    starts, ends, axes = [], [], []
    for axis, pair in enumerate(crops):
        begin, end = (int(v) for v in pair)
        size = int(x.ir_shape[axis])
        if (begin, end) == (0, size):
            continue
        if axis == 0 and g.dynamic_batch:
            raise node_error(node, "cropping the batch axis needs a static batch (--static-batch)")
        starts.append(begin)
        ends.append(end)
        axes.append(perm.index(axis))
    value = g.int_value(x, perm)
    if axes:
        value = g.add("Slice", [value, g.ints(f"{node.name}/starts", starts), g.ints(f"{node.name}/ends", ends),
                                g.ints(f"{node.name}/axes", axes)])
    g.set_int(y, value, perm)
