"""Converters of ONNX operators that newer exporters write and that map onto one IR layer each, as the Parser
writes them: GatherND, ScatterND, ScatterElements, OneHot, TopK, GroupNormalization (opsets 18 and 21),
LpNormalization with p = 2 (Normalization), MeanVarianceNormalization, RMSNormalization, Swish (the ONNX
operators; the patterns that spell them out are fused in fusion.py) and GridSample."""
from __future__ import annotations

import numpy as np

from ...quant.dtype import Dtype
from .context import Context, ConvertError, nhwc
from .converters import _activation, _axis, _inputs, _ir_axis, _keep_layout, _no_attr, converter
from .simplify import ONode

LEAST_POSITIVE_FLOAT32 = float(np.nextafter(np.float32(0), np.float32(1)))
"""The smallest positive float32 (a subnormal, 2^-149)."""


@converter("GatherND")
def gather_nd(ctx: Context, node: ONode) -> None:
    """IR GatherND (`batch_dims`) in the ONNX layout; constant indices as a Constant layer (negatives wrap per
    dim, as ONNX's do)."""
    data, idx = node.inputs[0], node.inputs[1]
    batch_dims = int(node.attrs.get("batch_dims", 0))
    if not 0 <= batch_dims < ctx.rank(idx):
        raise ConvertError(f"batch_dims {batch_dims} is outside [0, {ctx.rank(idx)})")
    ctx.emit(node, "GatherND", [ctx.value(data), ctx.value(idx)], None, {"batch_dims": batch_dims})


@converter("TopK")
def topk(ctx: Context, node: ONode) -> None:
    """IR TopK of a constant k along the axis, in the layout the input is held in; ties give the lower index first
    (ONNX's rule), the output is sorted (which `sorted = 0` allows)."""
    x = node.inputs[0]
    if not _inputs(node, 1) or not ctx.is_const(node.inputs[1]):
        raise ConvertError("a k computed at run time is not supported")
    k = np.asarray(ctx.const(node.inputs[1])).reshape(-1)
    if k.size != 1:
        raise ConvertError(f"k must be one value, got {k.size}")
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", -1), rank)
    if not 0 <= int(k[0]) <= ctx.shape(x)[axis]:
        raise ConvertError(f"k {int(k[0])} is outside [0, {ctx.shape(x)[axis]}]")
    outputs = list(node.outputs)
    if len(outputs) != 2 or not all(outputs):
        raise ConvertError("TopK needs both outputs named")
    perm = _keep_layout(ctx, x)
    params = {"k": int(k[0]), "axis": _ir_axis(axis, perm), "largest": bool(node.attrs.get("largest", 1)),
              "sorted": True, "select_index": "first"}
    ctx.emit(node, "TopK", [ctx.value(x, perm)], perm, params, outputs=outputs,
             out_dtypes=[ctx.dtype(x), Dtype.INT32])


@converter("GroupNormalization")
def group_norm(ctx: Context, node: ONode) -> None:
    """IR GroupNorm over channels-last groups; opset 18's per-group scale and bias repeated for every channel of
    the group (opset 21 gives one per channel)."""
    _no_attr(node, "stash_type", 1)
    x = node.inputs[0]
    rank = ctx.rank(x)
    if rank < 3:
        raise ConvertError(f"{rank}-D input is not supported")
    channels, groups = ctx.shape(x)[1], int(node.attrs["num_groups"])
    if groups < 1 or channels % groups:
        raise ConvertError(f"num_groups {groups} does not divide {channels} channels")
    consts = {}
    for key, t in (("weights", node.inputs[1]), ("biases", node.inputs[2])):
        v = ctx.const(t).astype(np.float32).reshape(-1)
        if v.size == groups and groups != channels:
            v = np.repeat(v, channels // groups)
        if v.size != channels:
            raise ConvertError(f"{key} of {v.size} values for {channels} channels in {groups} groups")
        consts[key] = v
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "GroupNorm", [ctx.value(x, perm)], perm,
             {"axis": _ir_axis(1, perm), "group": groups, "epsilon": float(node.attrs.get("epsilon", 1e-5))}, consts)


@converter("LpNormalization")
def lp_normalization(ctx: Context, node: ONode) -> None:
    """p = 2: IR Normalization (L2) over the axis, in the layout the input is held in, with epsilon the least
    positive float32 (the sum of squares' lower bound): an all-zero slice then gives 0 as ONNX's does, any other
    the same quotient as with none. (p = 1 is rewritten as other operators: decompose.py.)"""
    if int(node.attrs.get("p", 2)) != 2:
        raise ConvertError(f"p={node.attrs.get('p')} (ONNX allows 1 and 2)")
    x = node.inputs[0]
    axis = _axis(node.attrs.get("axis", -1), ctx.rank(x))
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "Normalization", [ctx.value(x, perm)], perm,
             {"method": "L2", "axis": [_ir_axis(axis, perm)], "epsilon": LEAST_POSITIVE_FLOAT32})


@converter("MeanVarianceNormalization")
def mean_variance_norm(ctx: Context, node: ONode) -> None:
    """IR MVN over the axes (default N, H, W) with ONNX's epsilon of 1e-9, in the layout the input is held in."""
    x = node.inputs[0]
    rank = ctx.rank(x)
    axes = sorted({_axis(a, rank) for a in node.attrs.get("axes", [0, 2, 3])})
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "MVN", [ctx.value(x, perm)], perm,
             {"axis": sorted(_ir_axis(a, perm) for a in axes), "epsilon": 1e-9})


@converter("RMSNormalization")
def rms_norm(ctx: Context, node: ONode) -> None:
    """IR RMSNorm over the axes from `axis` to the last, gamma broadcast to them."""
    _no_attr(node, "stash_type", 1)
    x = node.inputs[0]
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", -1), rank)
    norm_shape = ctx.shape(x)[axis:]
    gamma = np.broadcast_to(ctx.const(node.inputs[1]).astype(np.float32), norm_shape)
    ctx.emit(node, "RMSNorm", [ctx.value(x)], None,
             {"axis": list(range(axis, rank)), "epsilon": float(node.attrs.get("epsilon", 1e-5))},
             {"weights": np.ascontiguousarray(gamma)})


@converter("Swish")
def swish(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "SWISH", {"alpha": float(node.attrs.get("alpha", 1.0))})


@converter("ScatterND", "ScatterElements")
def scatter(ctx: Context, node: ONode) -> None:
    """IR ScatterND / ScatterElements (inputs data, indices, updates; `reduction`, ScatterElements' `axis`) in the
    ONNX layout; constant indices as a Constant layer."""
    data, idx, updates = node.inputs[0], node.inputs[1], node.inputs[2]
    reduction = str(node.attrs.get("reduction", "none")).upper()
    if reduction not in ("NONE", "ADD", "MUL", "MAX", "MIN"):
        raise ConvertError(f"reduction '{reduction.lower()}' is not supported")
    params = {"reduction": reduction}
    if node.op == "ScatterElements":
        params = {"axis": _axis(node.attrs.get("axis", 0), ctx.rank(data)), **params}
    ctx.emit(node, node.op, [ctx.value(data), ctx.value(idx), ctx.value(updates)], None, params)


@converter("OneHot")
def one_hot(ctx: Context, node: ONode) -> None:
    """IR OneHot with a constant depth and constant [off, on] values; `axis` counted in the output, as ONNX's; float
    indices through a Cast to int32 first (toward zero, as ONNX casts them)."""
    idx, depth, values = node.inputs[0], node.inputs[1], node.inputs[2]
    if not ctx.is_const(depth) or not ctx.is_const(values):
        raise ConvertError("a depth or values computed at run time are not supported")
    d = np.asarray(ctx.const(depth)).reshape(-1)
    v = np.asarray(ctx.const(values)).reshape(-1)
    if d.size != 1 or v.size != 2:
        raise ConvertError(f"depth must be one value and values two, got {d.size} and {v.size}")
    axis = int(node.attrs.get("axis", -1))
    rank = ctx.rank(idx) + 1
    if not -rank <= axis < rank:
        raise ConvertError(f"axis {axis} is out of range for an output of rank {rank}")
    indices = ctx.value(idx)
    if ctx.dtype(idx).is_float:  # ONNX casts float indices to integers (toward zero) first
        indices = ctx.add("Cast", [indices], [ctx.shape(idx)], f"{node.name}_indices",
                          {"to_dtype": Dtype.INT32.value, "clip_mode": "TRUNCATION", "ignore_scale_zp": True},
                          out_dtypes=[Dtype.INT32])[0]
    ctx.emit(node, "OneHot", [indices], None,
             {"depth": int(d[0]), "values": [float(v[0]), float(v[1])], "axis": axis % rank})


GRID_SAMPLE_MODES = {"bilinear": "BILINEAR", "linear": "BILINEAR", "nearest": "NEAREST"}
"""ONNX GridSample modes (opset 16 names, then opset 20's) the IR layer computes."""


@converter("GridSample")
def grid_sample(ctx: Context, node: ONode) -> None:
    """IR GridSample of a 4-D feature map, held channels-last as the Parser holds images (the grid [N, H_out,
    W_out, 2] in its ONNX layout); the output channels-last too."""
    x, grid = node.inputs[0], node.inputs[1]
    if ctx.rank(x) != 4:
        raise ConvertError(f"only 2-D sampling (a 4-D input) is supported, got a {ctx.rank(x)}-D input")
    mode = str(node.attrs.get("mode", "bilinear")).lower()
    if mode not in GRID_SAMPLE_MODES:
        raise ConvertError(f"mode {mode} is not supported (bilinear/linear and nearest are)")
    padding = str(node.attrs.get("padding_mode", "zeros")).lower()
    if padding not in ("zeros", "border", "reflection"):
        raise ConvertError(f"padding_mode {padding} is not supported (zeros, border, reflection are)")
    params = {"method": GRID_SAMPLE_MODES[mode], "padding_mode": padding.upper(),
              "align_corners": bool(int(node.attrs.get("align_corners", 0)))}
    perm = nhwc(4)
    ctx.emit(node, "GridSample", [ctx.value(x, perm), ctx.value(grid)], perm, params)
