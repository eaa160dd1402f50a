"""Per-op converters: one function per ONNX operator (or family), writing IR layers with the Parser's layer types
and param names (see docs/operators.md). A converter raises `ConvertError` for a variant it does not support;
the importer collects those and reports them all at once.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...quant.dtype import Dtype
from .context import Context, ConvertError, Perm, inverse, ir_dtype, is_identity, nhwc
from .pattern import FUSED_DOMAIN, new_const
from .simplify import ONode

Converter = Callable[[Context, ONode], None]
CONVERTERS: Dict[str, Converter] = {}

FLOAT_MAX = float(np.finfo(np.float32).max)


def converter(*ops: str) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for op in ops:
            CONVERTERS[op] = fn
        return fn
    return deco


def _fused(node: ONode) -> Dict[str, Any]:
    act = node.fused.get("with_activation", "NONE")
    out: Dict[str, Any] = {"with_activation": act}
    if act == "CLIP":
        out["clip_min"] = float(node.fused["clip_min"])
        out["clip_max"] = float(node.fused["clip_max"])
    return out


def _inputs(node: ONode, pos: int) -> Optional[str]:
    return node.inputs[pos] if len(node.inputs) > pos and node.inputs[pos] else None


def _axis(axis: int, rank: int) -> int:
    a = int(axis)
    if not -rank <= a < max(rank, 1):
        raise ConvertError(f"axis {axis} is out of range for rank {rank}")
    return a + rank if a < 0 else a


def _ir_axis(axis: int, perm: Perm) -> int:
    return axis if perm is None else list(perm).index(axis)


def _no_attr(node: ONode, key: str, default: Any) -> None:
    v = node.attrs.get(key, default)
    if v != default:
        raise ConvertError(f"attribute {key}={v} is not supported")


# ================================================================================================ spatial helpers
def _spatial_pads(node: ONode, in_sp: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                  dilations: Sequence[int]) -> Tuple[List[int], List[int]]:
    nd = len(in_sp)
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(node.attrs.get("pads", [0] * 2 * nd))
        return pads[:nd], pads[nd:]
    if auto == "VALID":
        return [0] * nd, [0] * nd
    begin, end = [], []
    for i in range(nd):
        out = -(-in_sp[i] // strides[i])
        total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sp[i], 0)
        small = total // 2
        b = small if auto == "SAME_UPPER" else total - small
        begin.append(b)
        end.append(total - b)
    return begin, end


def _geom_params(kernel: Sequence[int], strides: Sequence[int], begin: Sequence[int], end: Sequence[int],
                 dilations: Sequence[int]) -> Dict[str, Any]:
    """2-D geometry in the Parser's key order (y = axis H, x = axis W)."""
    return {"kernel_x": int(kernel[1]), "kernel_y": int(kernel[0]), "stride_x": int(strides[1]),
            "stride_y": int(strides[0]), "pad_left": int(begin[1]), "pad_right": int(end[1]),
            "pad_top": int(begin[0]), "pad_bottom": int(end[0]), "dilation_x": int(dilations[1]),
            "dilation_y": int(dilations[0])}


def _geom3d_params(kernel: Sequence[int], strides: Sequence[int], begin: Sequence[int], end: Sequence[int],
                   dilations: Sequence[int]) -> Dict[str, Any]:
    """3-D geometry in the Parser's keys (z = axis D, y = H, x = W; begin/end pads)."""
    params: Dict[str, Any] = {}
    for i, a in enumerate("zyx"):
        params.update({f"kernel_{a}": int(kernel[i]), f"stride_{a}": int(strides[i]),
                       f"dilation_{a}": int(dilations[i]), f"pad_{a}_begin": int(begin[i]),
                       f"pad_{a}_end": int(end[i])})
    return params


def _spatial_input(ctx: Context, node: ONode, x: str) -> Tuple[str, int]:
    """Channels-last 4-D IR input of a 1-D or 2-D spatial op (1-D: [N, 1, W, C]); returns (tensor, spatial dims)."""
    rank = ctx.rank(x)
    if rank == 4:
        return ctx.value(x, nhwc(4)), 2
    if rank == 3:
        src = ctx.value(x, nhwc(3))
        n, c, w = ctx.shape(x)
        return ctx.reshape(src, (n, 1, w, c), f"{node.name}_to_2d"), 1
    raise ConvertError(f"{rank}-D input is not supported (1-D and 2-D spatial inputs are)")


def _spatial_output(ctx: Context, node: ONode, optype: str, src: str, nd: int, params: Dict[str, Any],
                    constants: Optional[Dict[str, np.ndarray]] = None) -> None:
    out = node.outputs[0]
    if nd == 2:
        ctx.emit(node, optype, [src], nhwc(4), params, constants)
        return
    n, c, w = ctx.shape(out)
    mid = ctx.add(optype, [src], [(n, 1, w, c)], node.name, params, constants)[0]
    ctx.bind(out, ctx.reshape(mid, (n, w, c), f"{node.name}_to_1d"), nhwc(3))


def _lift(values: Sequence[int], nd: int, fill: int) -> List[int]:
    """1-D spatial attributes as 2-D (H = 1 first)."""
    return [fill] + list(values) if nd == 1 else list(values)


# ================================================================================================ Conv family
@converter("Conv")
def conv(ctx: Context, node: ONode) -> None:
    x, wname = node.inputs[0], node.inputs[1]
    if not ctx.is_const(wname):
        raise ConvertError("weights that are not constant are not supported")
    w = ctx.const(wname).astype(np.float32)
    if w.ndim < 3:
        raise ConvertError(f"weights '{wname}' of shape {list(w.shape)}: a convolution needs [out, in, k...]")
    if w.ndim == 5:
        _conv3d(ctx, node, w)
        return
    if w.ndim != 4 and w.ndim != 3:
        raise ConvertError(f"{w.ndim - 2}-D convolution is not supported (1-D, 2-D and 3-D are)")
    src, nd = _spatial_input(ctx, node, x)
    out_c, cin_g = int(w.shape[0]), int(w.shape[1])
    in_c = ctx.shape(x)[1]
    group = int(node.attrs.get("group", 1))
    k = list(w.shape[2:])
    strides = list(node.attrs.get("strides", [1] * len(k)))
    dil = list(node.attrs.get("dilations", [1] * len(k)))
    begin, end = _spatial_pads(node, ctx.shape(x)[2:], k, strides, dil)
    if w.ndim == 3:
        w = w[:, :, None, :]
    b = ctx.const(node.inputs[2]).astype(np.float32) if _inputs(node, 2) else np.zeros(out_c, np.float32)
    weights = np.ascontiguousarray(np.transpose(w, (0, 2, 3, 1)))  # OIHW → OHWI
    params: Dict[str, Any] = {"num_output": out_c}
    params.update(_geom_params(_lift(k, nd, 1), _lift(strides, nd, 1), _lift(begin, nd, 0), _lift(end, nd, 0),
                               _lift(dil, nd, 1)))
    params["group"] = group
    params.update(_fused(node))
    depthwise = group > 1 and group == in_c and cin_g == 1
    if depthwise:
        params["multiplier"] = out_c // in_c
    _spatial_output(ctx, node, "DepthwiseConv" if depthwise else "Convolution", src, nd, params,
                    {"weights": weights, "biases": b})


def _conv3d(ctx: Context, node: ONode, w: np.ndarray) -> None:
    """A 3-D Conv as the Parser writes it: a Convolution3D on the channels-last NDHWC input, weights
    [out, kh, kw, kd, in/group], the geometry in z (D), y (H), x (W) keys with begin/end pads."""
    x = node.inputs[0]
    if ctx.rank(x) != 5:
        raise ConvertError(f"3-D weights need a 5-D input, got rank {ctx.rank(x)}")
    out_c = int(w.shape[0])
    k = [int(v) for v in w.shape[2:]]
    strides = [int(v) for v in node.attrs.get("strides", [1] * 3)]
    dil = [int(v) for v in node.attrs.get("dilations", [1] * 3)]
    begin, end = _spatial_pads(node, ctx.shape(x)[2:], k, strides, dil)
    b = ctx.const(node.inputs[2]).astype(np.float32) if _inputs(node, 2) else np.zeros(out_c, np.float32)
    weights = np.ascontiguousarray(np.transpose(w, (0, 3, 4, 2, 1)))  # [O, I, kd, kh, kw] -> [O, kh, kw, kd, I]
    params: Dict[str, Any] = {"num_output": out_c, "group": int(node.attrs.get("group", 1))}
    params.update(_geom3d_params(k, strides, begin, end, dil))
    params.update(_fused(node))
    ctx.emit(node, "Convolution3D", [ctx.value(x, nhwc(5))], nhwc(5), params, {"weights": weights, "biases": b})


@converter("ConvTranspose")
def conv_transpose(ctx: Context, node: ONode) -> None:
    x, wname = node.inputs[0], node.inputs[1]
    if not ctx.is_const(wname):
        raise ConvertError("weights that are not constant are not supported")
    w = ctx.const(wname).astype(np.float32)
    if w.ndim < 3:
        raise ConvertError(f"weights '{wname}' of shape {list(w.shape)}: a transposed convolution needs "
                           "[in, out, k...]")
    if w.ndim not in (3, 4, 5):
        raise ConvertError(f"{w.ndim - 2}-D transposed convolution is not supported (1-D, 2-D and 3-D are)")
    group = int(node.attrs.get("group", 1))
    out_c = int(w.shape[1]) * group
    k = list(w.shape[2:])
    nd0 = len(k)
    strides = list(node.attrs.get("strides", [1] * nd0))
    dil = list(node.attrs.get("dilations", [1] * nd0))
    opad = list(node.attrs.get("output_padding", [0] * nd0))
    in_sp = ctx.shape(x)[2:]
    out_sp = ctx.shape(node.outputs[0])[2:]
    auto = node.attrs.get("auto_pad", "NOTSET")
    if "output_shape" in node.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(nd0):
            total = strides[i] * (in_sp[i] - 1) + opad[i] + (k[i] - 1) * dil[i] + 1 - out_sp[i]
            if total < 0:
                raise ConvertError("output_shape larger than the full transposed convolution is not supported")
            b = total // 2 if auto == "SAME_UPPER" else total - total // 2
            begin.append(b)
            end.append(total - b)
    elif auto == "VALID":
        begin, end = [0] * nd0, [0] * nd0
    else:
        pads = list(node.attrs.get("pads", [0] * 2 * nd0))
        begin, end = pads[:nd0], pads[nd0:]
    if w.ndim == 5:  # the Parser's ConvTranspose3D on the NDHWC input: weights [Cout/g, kh, kw, kd, Cin]
        if ctx.rank(x) != 5:
            raise ConvertError(f"3-D weights need a 5-D input, got rank {ctx.rank(x)}")
        params3d: Dict[str, Any] = {"num_output": out_c, "group": group}
        params3d.update(_geom3d_params(k, strides, begin, end, dil))
        params3d.update({f"output_padding_{a}": int(v) for a, v in zip("zyx", opad)})
        params3d.update(_fused(node))
        b3 = ctx.const(node.inputs[2]).astype(np.float32) if _inputs(node, 2) else np.zeros(out_c, np.float32)
        ctx.emit(node, "ConvTranspose3D", [ctx.value(x, nhwc(5))], nhwc(5), params3d,
                 {"weights": np.ascontiguousarray(np.transpose(w, (1, 3, 4, 2, 0))), "biases": b3})
        return
    src, nd = _spatial_input(ctx, node, x)
    if w.ndim == 3:
        w = w[:, :, None, :]
    weights = np.ascontiguousarray(np.transpose(w, (1, 2, 3, 0)))  # [Cin, Cout/g, kh, kw] → [Cout/g, kh, kw, Cin]
    b = ctx.const(node.inputs[2]).astype(np.float32) if _inputs(node, 2) else np.zeros(out_c, np.float32)
    params: Dict[str, Any] = {"num_output": out_c}
    params.update(_geom_params(_lift(k, nd, 1), _lift(strides, nd, 1), _lift(begin, nd, 0), _lift(end, nd, 0),
                               _lift(dil, nd, 1)))
    op = _lift(opad, nd, 0)
    params.update(output_padding_x=int(op[1]), output_padding_y=int(op[0]), group=group)
    params.update(_fused(node))
    _spatial_output(ctx, node, "ConvTranspose", src, nd, params, {"weights": weights, "biases": b})


# ================================================================================================ pooling
@converter("MaxPool", "AveragePool")
def pool(ctx: Context, node: ONode) -> None:
    if len([o for o in node.outputs if o]) > 1:
        raise ConvertError("the Indices output is not supported")
    x = node.inputs[0]
    k = list(node.attrs["kernel_shape"])
    if len(k) not in (1, 2, 3):
        raise ConvertError(f"{len(k)}-D pooling is not supported (1-D, 2-D and 3-D are)")
    strides = list(node.attrs.get("strides", [1] * len(k)))
    dil = list(node.attrs.get("dilations", [1] * len(k)))
    if node.op == "AveragePool" and any(d != 1 for d in dil):
        raise ConvertError("dilated average pooling is not supported")
    begin, end = _spatial_pads(node, ctx.shape(x)[2:], k, strides, dil)
    if len(k) == 3:  # the Parser's Pooling3D on the channels-last NDHWC input, z/y/x keys with begin/end pads
        params3d: Dict[str, Any] = {"method": "MAX" if node.op == "MaxPool" else "AVG",
                                    "ceil_mode": bool(node.attrs.get("ceil_mode", 0))}
        params3d.update(_geom3d_params(k, strides, begin, end, dil))
        if node.op == "AveragePool":
            params3d["count_include_pad"] = bool(node.attrs.get("count_include_pad", 0))
        ctx.emit(node, "Pooling3D", [ctx.value(x, nhwc(5))], nhwc(5), params3d)
        return
    src, nd = _spatial_input(ctx, node, x)
    params = _geom_params(_lift(k, nd, 1), _lift(strides, nd, 1), _lift(begin, nd, 0), _lift(end, nd, 0),
                          _lift(dil, nd, 1))
    params["method"] = "MAX" if node.op == "MaxPool" else "AVG"
    params["ceil_mode"] = bool(node.attrs.get("ceil_mode", 0))
    if node.op == "AveragePool":
        params["count_include_pad"] = bool(node.attrs.get("count_include_pad", 0))
    _spatial_output(ctx, node, "Pooling", src, nd, params)


@converter("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    method = "AVG" if node.op == "GlobalAveragePool" else "MAX"
    if rank == 4:
        h, w = ctx.shape(x)[2:]
        params = _geom_params([h, w], [1, 1], [0, 0], [0, 0], [1, 1])
        params.update(method=method, ceil_mode=False)
        if method == "AVG":
            params["count_include_pad"] = False
        ctx.emit(node, "Pooling", [ctx.value(x, nhwc(4))], nhwc(4), params)
        return
    if rank < 3:
        raise ConvertError(f"{rank}-D input is not supported")
    perm = nhwc(rank)
    ctx.emit(node, "Reduce", [ctx.value(x, perm)], perm,
             {"method": "MEAN" if method == "AVG" else "MAX", "axis": list(range(1, rank - 1)), "keepdims": True})


# ================================================================================================ normalization
@converter("BatchNormalization")
def batchnorm(ctx: Context, node: ONode) -> None:
    if len([o for o in node.outputs if o]) > 1 or int(node.attrs.get("training_mode", 0)):
        raise ConvertError("training mode is not supported")
    x = node.inputs[0]
    gamma, beta, mean, var = (ctx.const(t).astype(np.float64) for t in node.inputs[1:5])
    s = gamma / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    rank = ctx.rank(x)
    perm = nhwc(rank) if rank >= 3 else None
    ctx.emit(node, "BatchNorm", [ctx.value(x, perm)], perm, {"axis": rank - 1},
             {"weights": s.astype(np.float32), "biases": (beta - mean * s).astype(np.float32)})


@converter("InstanceNormalization")
def instance_norm(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    if rank < 3:
        raise ConvertError(f"{rank}-D input is not supported")
    perm = nhwc(rank)
    ctx.emit(node, "InstanceNorm", [ctx.value(x, perm)], perm,
             {"axis": list(range(1, rank - 1)), "epsilon": float(node.attrs.get("epsilon", 1e-5))},
             {"weights": ctx.const(node.inputs[1]).astype(np.float32),
              "biases": ctx.const(node.inputs[2]).astype(np.float32)})


@converter("LayerNormalization")
def layer_norm(ctx: Context, node: ONode) -> None:
    if len([o for o in node.outputs if o]) > 1:
        raise ConvertError("the Mean/InvStdDev outputs are not supported")
    _no_attr(node, "stash_type", 1)
    x = node.inputs[0]
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", -1), rank)
    norm_shape = ctx.shape(x)[axis:]
    consts = {"weights": np.broadcast_to(ctx.const(node.inputs[1]), norm_shape).astype(np.float32)}
    if _inputs(node, 2):
        consts["biases"] = np.broadcast_to(ctx.const(node.inputs[2]), norm_shape).astype(np.float32)
    ctx.emit(node, "LayerNorm", [ctx.value(x)], None,
             {"axis": list(range(axis, rank)), "epsilon": float(node.attrs.get("epsilon", 1e-5))}, consts)


@converter("LRN")
def lrn(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    if ctx.rank(x) != 4:
        raise ConvertError("only 4-D inputs are supported")
    size = int(node.attrs["size"])
    if size % 2 == 0:  # ONNX centres an even window one channel higher than the IR (and PyTorch) do
        raise ConvertError(f"even size {size}: ONNX's window [c-{size // 2 - 1}, c+{size // 2}] is not the IR LRN's "
                           f"[c-{size // 2}, c+{size // 2 - 1}]; odd sizes are imported")
    ctx.emit(node, "LRN", [ctx.value(x, nhwc(4))], nhwc(4),
             {"method": "ACROSS_CHANNELS", "size": size,
              "alpha": float(node.attrs.get("alpha", 1e-4)), "beta": float(node.attrs.get("beta", 0.75)),
              "bias": float(node.attrs.get("bias", 1.0))})


# ================================================================================================ activations
_ACT_SIMPLE = {"Relu": "RELU", "Sigmoid": "SIGMOID", "Tanh": "TANH", "HardSwish": "HARDSWISH",
               "Softplus": "SOFTPLUS", "Softsign": "SOFTSIGN", "Mish": "MISH"}


def _keep_layout(ctx: Context, x: str) -> Perm:
    return ctx.perm(x) if x in ctx.tmap else None


def _activation(ctx: Context, node: ONode, method: str, params: Optional[Dict[str, Any]] = None,
                constants: Optional[Dict[str, np.ndarray]] = None) -> None:
    """An Activation in the layout its input is held in; on the 2-D output of a fully connected layer when the
    input is only that output reshaped back (so that FC → activation → FC needs no reshapes, as in the Parser)."""
    x = node.inputs[0]
    p = {"method": method}
    p.update(params or {})
    flat = _fc_output_behind(ctx, x) if constants is None else None
    if flat is not None:
        y = ctx.add("Activation", [flat], [ctx.ir_shapes[flat]], node.name, p, out_dtypes=[ctx.ir_dtypes[flat]])[0]
        ctx.bind(node.outputs[0], ctx.reshape(y, ctx.shape(node.outputs[0]), f"{ctx.producer_layer(y)}_post_reshape"),
                 None)
        return
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "Activation", [ctx.value(x, perm)], perm, p, constants)


def _fc_output_behind(ctx: Context, x: str) -> Optional[str]:
    """The 2-D FullyConnected output that ONNX tensor `x` is a reshape of, if it is one."""
    if x not in ctx.tmap or ctx.perm(x) is not None:
        return None
    root = ctx.reshaped_from(ctx.tmap[x][0])
    return root if root is not None and ctx.made_by.get(root) == "FullyConnected" else None


@converter(*_ACT_SIMPLE)
def simple_activation(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, _ACT_SIMPLE[node.op])


@converter("LeakyRelu")
def leaky_relu(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "LEAKYRELU", {"negative_slope_value": float(node.attrs.get("alpha", 0.01))})


@converter("PRelu")
def prelu(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    slope = ctx.const(node.inputs[1]).astype(np.float32)
    perm = _keep_layout(ctx, x)
    rank = ctx.rank(x)
    if slope.ndim < rank:
        slope = slope.reshape((1,) * (rank - slope.ndim) + slope.shape)
    if slope.ndim > rank or any(s not in (1, d) for s, d in zip(slope.shape, ctx.shape(x))):
        raise ConvertError(f"slope of shape {list(ctx.const(node.inputs[1]).shape)} does not broadcast to the "
                           f"input shape {list(ctx.shape(x))}")
    if perm is not None:
        slope = np.transpose(slope, perm)
    while slope.ndim > 1 and slope.shape[0] == 1:  # broadcast from the left: [1, 1, 1, C] → [C]
        slope = slope[0]
    ctx.emit(node, "Activation", [ctx.value(x, perm)], perm, {"method": "PRELU"},
             {"negative_slope": np.ascontiguousarray(slope)})


@converter("HardSigmoid")
def hard_sigmoid(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "HARDSIGMOID", {"alpha": float(node.attrs.get("alpha", 0.2)),
                                           "beta": float(node.attrs.get("beta", 0.5)),
                                           "clip_min": 0.0, "clip_max": 1.0})


@converter("Elu", "Celu", "ThresholdedRelu")
def alpha_activation(ctx: Context, node: ONode) -> None:
    default = {"Elu": 1.0, "Celu": 1.0, "ThresholdedRelu": 1.0}[node.op]
    method = {"Elu": "ELU", "Celu": "CELU", "ThresholdedRelu": "THRESHOLDEDRELU"}[node.op]
    _activation(ctx, node, method, {"alpha": float(node.attrs.get("alpha", default))})


@converter("Selu")
def selu(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "SELU", {"alpha": float(node.attrs.get("alpha", 1.67326319217681884765625)),
                                    "gamma": float(node.attrs.get("gamma", 1.05070102214813232421875))})


@converter("Gelu")
def gelu(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "GELU", {"approximate": str(node.attrs.get("approximate", "none")).upper()})


@converter("Shrink")
def shrink(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "SHRINK", {"lambd": float(node.attrs.get("lambd", 0.5)),
                                      "bias": float(node.attrs.get("bias", 0.0))})


@converter("Clip")
def clip(ctx: Context, node: ONode) -> None:
    lo, hi = node.attrs.get("min", -FLOAT_MAX), node.attrs.get("max", FLOAT_MAX)
    if _inputs(node, 1):
        lo = float(ctx.const(node.inputs[1]).reshape(-1)[0])
    if _inputs(node, 2):
        hi = float(ctx.const(node.inputs[2]).reshape(-1)[0])
    lo, hi = max(float(lo), -FLOAT_MAX), min(float(hi), FLOAT_MAX)
    lo = min(lo, hi)  # ONNX: min > max sets every value to max
    if (lo, hi) == (0.0, 6.0):
        _activation(ctx, node, "RELU6")
    elif lo == 0.0 and hi == FLOAT_MAX:
        _activation(ctx, node, "RELU")
    else:
        _activation(ctx, node, "CLIP", {"clip_min": lo, "clip_max": hi})


# ================================================================================================ element-wise
_UNARY = {"Exp": "Exp", "Log": "Log", "Sqrt": "Sqrt", "Reciprocal": "Reciprocal", "Floor": "Floor",
          "Ceil": "Ceil", "Round": "Round", "Erf": "Erf", "Sin": "Sine", "Cos": "Cosine", "Tan": "Tan",
          "Asin": "Asin", "Acos": "Acos", "Atan": "Atan", "Sinh": "Sinh", "Cosh": "Cosh", "Asinh": "Asinh",
          "Acosh": "Acosh", "Atanh": "Atanh", "Abs": "Abs", "Neg": "Negative", "Sign": "Sign", "IsNaN": "IsNaN"}


@converter(*_UNARY)
def unary(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    perm = _keep_layout(ctx, x)
    ctx.emit(node, _UNARY[node.op], [ctx.value(x, perm)], perm)


@converter("IsInf")
def isinf(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "IsInf", [ctx.value(x, perm)], perm,
             {"detect_negative": bool(node.attrs.get("detect_negative", 1)),
              "detect_positive": bool(node.attrs.get("detect_positive", 1))})


def _common_layout(ctx: Context, node: ONode, inputs: Sequence[str]) -> Perm:
    rank = ctx.rank(node.outputs[0])
    perms = {ctx.perm(t) for t in inputs if t in ctx.tmap and ctx.rank(t) == rank}
    return perms.pop() if len(perms) == 1 else None


def _elementwise(ctx: Context, node: ONode, optype: str, params: Optional[Dict[str, Any]] = None,
                 inputs: Optional[Sequence[str]] = None) -> None:
    ins = list(inputs if inputs is not None else node.inputs)
    rank = ctx.rank(node.outputs[0])
    perm = _common_layout(ctx, node, ins)
    irs = [ctx.broadcast_value(t, rank, perm) for t in ins]
    _emit_elementwise(ctx, node, optype, irs, perm, params)


def _emit_elementwise(ctx: Context, node: ONode, optype: str, irs: Sequence[str], perm: Perm,
                      params: Optional[Dict[str, Any]]) -> None:
    """The element-wise layer of `node` on IR operands `irs`. A 0-d ONNX output of an operand the IR holds as [1]
    (a constant: IR constants have at least one dim) is computed as [1] and reshaped to 0-d, so that the layer's
    forward gives the shape its IR declares."""
    out = node.outputs[0]
    if ctx.rank(out) == 0 and any(ctx.ir_shapes[t] for t in irs):
        dtype = ir_dtype(ctx.g.dtypes.get(out, np.float32))
        one = ctx.add(optype, irs, [(1,)], node.name, params, None, [dtype])[0]
        ctx.bind(out, ctx.reshape(one, (), f"{node.name}_post_reshape"), None)
        return
    ctx.emit(node, optype, irs, perm, params)


@converter("Add", "Sub", "Max", "Min", "Sum")
def eltwise(ctx: Context, node: ONode) -> None:
    if node.op in ("Sum", "Max", "Min") and len(node.inputs) != 2:
        _variadic(ctx, node)
        return
    if len(node.inputs) != 2:
        raise ConvertError(f"{len(node.inputs)} inputs are not supported (2 are)")
    _arith(ctx, node, {"Add": "ADD", "Sum": "ADD", "Sub": "SUB", "Max": "MAX", "Min": "MIN"}[node.op])


def _arith(ctx: Context, node: ONode, method: str, inputs: Optional[Sequence[str]] = None) -> None:
    """Eltwise `method` when the operands have one shape; the standalone Add / Sub / Mul when one broadcasts
    (MAX/MIN stay Eltwise), as the Parser names them."""
    ins = list(inputs if inputs is not None else node.inputs)
    rank = ctx.rank(node.outputs[0])
    perm = _common_layout(ctx, node, ins)
    irs = [ctx.broadcast_value(t, rank, perm) for t in ins]
    p = _fused(node)
    if method in ("MAX", "MIN") or len({ctx.ir_shapes[t] for t in irs}) == 1:
        _emit_elementwise(ctx, node, "Eltwise", irs, perm,
                          {"with_activation": p.pop("with_activation"), "method": method, **p})
    else:
        _emit_elementwise(ctx, node, method.capitalize(), irs, perm, p)


def _variadic(ctx: Context, node: ONode) -> None:
    """Sum / Max / Min of one input (a copy) or of 3+ inputs (a chain of 2-input layers, left to right)."""
    ins, out = [t for t in node.inputs if t], node.outputs[0]
    if len(ins) == 1:
        if ctx.shape(ins[0]) != ctx.shape(out):
            raise ConvertError("a single input whose shape differs from the output is not supported")
        perm = _keep_layout(ctx, ins[0])
        ctx.bind(out, ctx.value(ins[0], perm), perm)
        return
    acc = ins[0]
    for k, t in enumerate(ins[1:], 1):
        last = k == len(ins) - 1
        step = out if last else f"{out}@part{k}"
        if not last:
            ctx.g.shapes[step] = tuple(np.broadcast_shapes(ctx.shape(acc), ctx.shape(t)))
            ctx.g.dtypes[step] = ctx.g.dtypes.get(out, np.dtype(np.float32))
        eltwise(ctx, ONode(node.name if last else f"{node.name}_part{k}", node.op, [acc, t], [step], node.attrs,
                           node.domain, node.fused if last else {}))
        acc = step


@converter("Mul")
def mul(ctx: Context, node: ONode) -> None:
    _arith(ctx, node, "MUL")


@converter("Div")
def div(ctx: Context, node: ONode) -> None:
    out = node.outputs[0]
    if ctx.dtype(out).is_float:
        d = node.inputs[1]
        if ctx.is_const(d) and np.issubdtype(ctx.const(d).dtype, np.floating) and np.all(ctx.const(d) != 0):
            # by a constant: a Mul by its reciprocal, as the Parser writes it
            inv = new_const(ctx.g, f"{node.name}_new_const", np.reciprocal(ctx.const(d)))
            _arith(ctx, node, "MUL", [node.inputs[0], inv])
            return
        _elementwise(ctx, node, "Div")
        return
    # integer Div truncates toward zero (ONNX): the quotient of a DivMod in TRUNC mode
    rank = ctx.rank(out)
    perm = _common_layout(ctx, node, node.inputs)
    irs = [ctx.broadcast_value(t, rank, perm) for t in node.inputs]
    shape = ctx.out_shape(out, perm)
    q, _ = ctx.add("DivMod", irs, [shape, shape], node.name, {"mode": "TRUNC"}, out_dtypes=[ctx.dtype(out)] * 2)
    ctx.bind(out, q, perm)


@converter("Pow")
def power(ctx: Context, node: ONode) -> None:
    """A constant exponent as the Parser writes it: x^2 a Square, x^0.5 a Sqrt, any other a Pow reading the
    exponent as its second input, a Constant of the input's shape."""
    x, e = node.inputs
    if ctx.is_const(e) and ctx.const(e).size == 1 and ctx.dtype(node.outputs[0]).is_float:
        p = float(ctx.const(e).reshape(-1)[0])
        perm = _keep_layout(ctx, x)
        if p in (2.0, 0.5):
            ctx.emit(node, "Square" if p == 2.0 else "Sqrt", [ctx.value(x, perm)], perm)
            return
        tiled = new_const(ctx.g, f"{node.name}_pre_tile", np.full(ctx.shape(x), p, np.float32))
        ctx.emit(node, "Pow", [ctx.value(x, perm), ctx.constant_layer(tiled, perm)], perm)
        return
    _elementwise(ctx, node, "Pow")


_LOGICAL = {"Equal": "EQUAL", "Greater": "GREATER", "Less": "LESS", "GreaterOrEqual": "GREATER_EQUAL",
            "LessOrEqual": "LESS_EQUAL", "And": "AND", "Or": "OR", "Xor": "XOR"}


@converter(*_LOGICAL)
def logical(ctx: Context, node: ONode) -> None:
    _elementwise(ctx, node, "Logical", {"method": _LOGICAL[node.op]})


@converter("Not")
def logical_not(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "Logical", [ctx.value(x, perm)], perm, {"method": "NOT"})


@converter("Where")
def where(ctx: Context, node: ONode) -> None:
    _elementwise(ctx, node, "Where")


@converter("Mod")
def mod(ctx: Context, node: ONode) -> None:
    b = node.inputs[1]
    if ctx.dtype(node.outputs[0]).is_float and ctx.is_const(b) and not np.all(ctx.const(b)):
        raise ConvertError("a float divisor with zeros is not supported (ONNX gives NaN there, the IR's Mod 0)")
    _elementwise(ctx, node, "Mod", {"fmod": bool(node.attrs.get("fmod", 0))})


# ================================================================================================ axis ops
@converter("Softmax", "LogSoftmax", "Hardmax")
def softmax(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", -1 if ctx.g.opset >= 13 else 1), rank)
    if ctx.g.opset < 13 and axis != rank - 1 and any(d != 1 for d in ctx.shape(x)[axis + 1:]):
        raise ConvertError(f"opset-{ctx.g.opset} {node.op} over the flattened dims from axis {axis} is not "
                           "supported (only the last axis)")
    perm = _keep_layout(ctx, x)
    ctx.emit(node, node.op, [ctx.value(x, perm)], perm, {"axis": _ir_axis(axis, perm)})


@converter("Concat")
def concat(ctx: Context, node: ONode) -> None:
    rank = ctx.rank(node.outputs[0])
    axis = _axis(node.attrs["axis"], rank)
    ins = [t for t in node.inputs if t and (ctx.is_const(t) or t in ctx.tmap)]
    ins = [t for t in ins if ctx.shape(t)[axis] > 0] or ins[:1]
    perms = {ctx.perm(t) for t in ins if t in ctx.tmap}
    perm = perms.pop() if len(perms) == 1 else None
    irs = [ctx.value(t, perm) if t in ctx.tmap else ctx.constant_layer(t, perm) for t in ins]
    ctx.emit(node, "Concat", irs, perm, {"axis": _ir_axis(axis, perm)})


@converter("Split")
def split(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", 0), rank)
    outs = node.outputs
    if any(not o for o in outs):
        raise ConvertError("unnamed outputs are not supported")
    splits = [ctx.shape(o)[axis] for o in outs]
    perm = _keep_layout(ctx, x)
    ctx.emit(node, "Split", [ctx.value(x, perm)], perm, {"axis": _ir_axis(axis, perm), "splits": splits},
             outputs=outs)


def _only_concatenated_along(ctx: Context, tensor: str, axis: int, rank: int) -> bool:
    """Whether every reader of `tensor` is a Concat along `axis` (of a rank-`rank` tensor) and the graph does not
    output it: an empty part of such Concats adds nothing, so it need not exist."""
    readers = ctx.g.consumers(tensor)
    return bool(readers) and tensor not in ctx.g.outputs and all(
        r.op == "Concat" and _axis(r.attrs.get("axis", 0), rank) == axis for r in readers)


@converter("Slice")
def slice_op(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    shape = ctx.shape(x)
    rank = len(shape)
    starts = ctx.const(node.inputs[1]).astype(np.int64).tolist()
    ends = ctx.const(node.inputs[2]).astype(np.int64).tolist()
    axes = ctx.const(node.inputs[3]).astype(np.int64).tolist() if _inputs(node, 3) else list(range(len(starts)))
    steps = ctx.const(node.inputs[4]).astype(np.int64).tolist() if _inputs(node, 4) else [1] * len(starts)
    begin, end, stride = [0] * rank, list(shape), [1] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        n = shape[a]
        if st == 0:
            raise ConvertError("step 0")
        idx = range(n)[slice(max(min(s, 2 ** 62), -2 ** 62), max(min(e, 2 ** 62), -2 ** 62), st)]
        if len(idx) == 0:
            if _only_concatenated_along(ctx, node.outputs[0], a, rank):
                return  # torch.roll by 0 exports Concat(x[0:0], x): the Concat leaves the unbound empty part out
            raise ConvertError("an empty slice is not supported (except as a part of a Concat along its axis)")
        begin[a] = idx[0]
        stride[a] = st
        last = idx[-1] + (1 if st > 0 else -1)
        end[a] = last if last >= 0 else -1
    perm = _keep_layout(ctx, x)
    if begin == [0] * rank and end == list(shape) and stride == [1] * rank:
        ctx.bind(node.outputs[0], ctx.value(x, perm), perm)  # selects everything: no layer (as the Parser)
        return
    order = list(perm) if perm is not None else list(range(rank))
    ctx.emit(node, "Slice", [ctx.value(x, perm)], perm,
             {"begin": [begin[a] for a in order], "end": [end[a] for a in order],
              "strides": [stride[a] for a in order]})


@converter("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2")
def reduce(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    if _inputs(node, 1):
        axes = ctx.const(node.inputs[1]).astype(np.int64).reshape(-1).tolist()
    else:
        axes = list(node.attrs.get("axes", []))
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            perm = _keep_layout(ctx, x)
            ctx.emit(node, "Reshape", [ctx.value(x, perm)], perm,
                     {"shape": list(ctx.out_shape(node.outputs[0], perm))})
            return
        axes = list(range(rank))
    axes = sorted({_axis(a, rank) for a in axes})
    keep = bool(node.attrs.get("keepdims", 1))
    if node.op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd") and \
            all(ctx.shape(x)[a] == 1 for a in axes):  # over size-1 axes: the input itself (the Parser drops it)
        out = node.outputs[0]
        perm = _keep_layout(ctx, x)
        if keep:
            ctx.bind(out, ctx.value(x, perm), perm)
        else:
            ctx.bind(out, ctx.reshape(ctx.source_for_reshape(x), ctx.shape(out), node.name), None)
        return
    if node.op == "ReduceMean" and rank == 4 and axes == [2, 3] and ctx.dtype(x).is_float:
        _mean_as_pooling(ctx, node, keep)
        return
    perm = _keep_layout(ctx, x) if keep else None
    method = node.op[len("Reduce"):].upper()
    ctx.emit(node, "Reduce", [ctx.value(x, perm)], perm,
             {"method": method, "axis": sorted(_ir_axis(a, perm) for a in axes), "keepdims": keep})


def _mean_as_pooling(ctx: Context, node: ONode, keep: bool) -> None:
    """A mean over H and W of an NCHW tensor is a global average Pooling, as the Parser writes it (an SE block's
    squeeze): channels-last, and a Reshape after it when the reduced axes are dropped."""
    x, out = node.inputs[0], node.outputs[0]
    n, c, h, w = ctx.shape(x)
    params = _geom_params([h, w], [1, 1], [0, 0], [0, 0], [1, 1])
    params.update(method="AVG", ceil_mode=False, count_include_pad=False)
    if keep:
        ctx.emit(node, "Pooling", [ctx.value(x, nhwc(4))], nhwc(4), params)
        return
    pooled = ctx.add("Pooling", [ctx.value(x, nhwc(4))], [(n, 1, 1, c)], node.name, params, None,
                     [ctx.dtype(x)])[0]
    ctx.bind(out, ctx.reshape(pooled, ctx.shape(out), f"{node.name}_post_reshape"), None)


@converter("ArgMax", "ArgMin")
def argminmax(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    axis = _axis(node.attrs.get("axis", 0), rank)
    keep = bool(node.attrs.get("keepdims", 1))
    perm = _keep_layout(ctx, x)
    params = {"method": node.op[3:].upper(), "axis": _ir_axis(axis, perm),
              "select_last_index": bool(node.attrs.get("select_last_index", 0))}
    if keep:
        ctx.emit(node, "ArgMinMax", [ctx.value(x, perm)], perm, params, out_dtypes=[Dtype.INT32])
        return
    # the layer keeps the reduced axis (upstream's ArgMinMax); a Reshape after it drops it. The input's layout is
    # kept where the other axes stay in the ONNX order (argmax over the channels of an NHWC map), else ONNX's
    if perm is not None and [p for p in perm if p != axis] != sorted(p for p in perm if p != axis):
        perm = None
        params["axis"] = axis
    shape = list(ctx.out_shape(x, perm))
    shape[params["axis"]] = 1
    kept = ctx.add("ArgMinMax", [ctx.value(x, perm)], [shape], node.name, params, None, [Dtype.INT32])[0]
    ctx.bind(node.outputs[0], ctx.reshape(kept, ctx.shape(node.outputs[0]), f"{node.name}_post_reshape"), None)


@converter("Gather")
def gather(ctx: Context, node: ONode) -> None:
    data, idx = node.inputs[0], node.inputs[1]
    rank = ctx.rank(data)
    axis = _axis(node.attrs.get("axis", 0), rank)
    if ctx.is_const(idx) and not ctx.is_const(data):
        ind = ctx.const(idx).astype(np.int64)
        ind = np.where(ind < 0, ind + ctx.shape(data)[axis], ind).astype(np.int32)
        if ind.size == 1 and ind.ndim <= 1:
            _gather_one(ctx, node, data, axis, int(ind.reshape(-1)[0]), keep_axis=ind.ndim == 1)
            return
        perm = _keep_layout(ctx, data) if ind.ndim == 1 else None
        # the indices as a Constant layer (int32, negatives wrapped), the Parser's form: upstream reads a Gather of
        # one input as its table-lookup variant
        if (ind == ctx.const(idx)).all():
            indices = ctx.constant_layer(idx)
        else:
            indices = ctx.add("Constant", [], [ind.shape], ctx.g.const_sources.get(idx, idx), {}, {"weights": ind},
                              [Dtype.INT32])[0]
        ctx.emit(node, "Gather", [ctx.value(data, perm), indices], perm,
                 {"axis": _ir_axis(axis, perm), "batch_dims": 0})
        return
    ctx.emit(node, "Gather", [ctx.value(data), ctx.value(idx)], None, {"axis": axis, "batch_dims": 0})


def _gather_one(ctx: Context, node: ONode, data: str, axis: int, index: int, keep_axis: bool) -> None:
    """Gather of one constant index: a Slice of that index (and a Reshape dropping the axis for a scalar index),
    as the Parser writes it."""
    shape = list(ctx.shape(data))
    perm = _keep_layout(ctx, data)
    order = list(perm) if perm is not None else list(range(len(shape)))
    begin, end = [0] * len(shape), list(shape)
    begin[axis], end[axis] = index, index + 1
    params = {"begin": [begin[a] for a in order], "end": [end[a] for a in order], "strides": [1] * len(shape)}
    out = node.outputs[0]
    if keep_axis:
        ctx.emit(node, "Slice", [ctx.value(data, perm)], perm, params)
        return
    sliced = f"{out}@slice"
    ctx.g.shapes[sliced] = tuple(shape[:axis] + [1] + shape[axis + 1:])
    ctx.g.dtypes[sliced] = ctx.g.dtypes.get(out, np.dtype(np.float32))
    ctx.emit(node, "Slice", [ctx.value(data, perm)], perm, params, outputs=[sliced])
    src = ctx.source_for_reshape(sliced)
    ctx.bind(out, ctx.reshape(src, ctx.shape(out), f"{ctx.producer_layer(src)}_post_reshape"), None)


@converter("GatherElements")
def gather_elements(ctx: Context, node: ONode) -> None:
    """IR GatherElements along the same axis (negative indices wrap as ONNX's do), in the ONNX layout."""
    data, idx = node.inputs[0], node.inputs[1]
    axis = _axis(node.attrs.get("axis", 0), ctx.rank(data))
    ctx.emit(node, "GatherElements", [ctx.value(data), ctx.value(idx)], None, {"axis": axis})


@converter("CumSum")
def cumsum(ctx: Context, node: ONode) -> None:
    """IR Cumulate SUM along the constant axis, with ONNX's exclusive and reverse (RoBERTa's position ids)."""
    x = node.inputs[0]
    if len(node.inputs) < 2 or not ctx.is_const(node.inputs[1]):
        raise ConvertError("an axis computed at run time is not supported")
    axis = _axis(int(np.asarray(ctx.const(node.inputs[1])).reshape(-1)[0]), ctx.rank(x))
    ctx.emit(node, "Cumulate", [ctx.value(x)], None,
             {"method": "SUM", "axis": axis, "exclusive": bool(node.attrs.get("exclusive", 0)),
              "reverse": bool(node.attrs.get("reverse", 0))})


@converter("Tile")
def tile(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    reps = ctx.const(node.inputs[1]).astype(np.int64).tolist()
    perm = _keep_layout(ctx, x)
    if all(r == 1 for r in reps):
        ctx.bind(node.outputs[0], ctx.value(x, perm), perm)  # repeats nothing: no layer
        return
    order = list(perm) if perm is not None else list(range(len(reps)))
    ctx.emit(node, "Tile", [ctx.value(x, perm)], perm, {"repeats": [int(reps[a]) for a in order]})


@converter("Expand")
def expand(ctx: Context, node: ONode) -> None:
    """Numpy broadcast to a constant shape (a non-constant input; a constant one was folded): nothing when the
    input has the output's shape already, else a Reshape to the output's rank (if lower) and a Tile."""
    x, out = node.inputs[0], node.outputs[0]
    if not ctx.is_const(node.inputs[1]):
        raise ConvertError("a target shape computed at run time is not supported")
    in_shape, out_shape = tuple(ctx.shape(x)), tuple(ctx.shape(out))
    rank = len(out_shape)
    full = (1,) * (rank - len(in_shape)) + in_shape
    if any(i not in (1, o) for i, o in zip(full, out_shape)):
        raise ConvertError(f"input shape {list(in_shape)} does not broadcast to {list(out_shape)}")
    if full != in_shape:
        src = ctx.source_for_reshape(x)
        tmp = f"{out}@rank{rank}"
        ctx.g.shapes[tmp] = full
        ctx.g.dtypes[tmp] = ctx.g.dtypes.get(x, np.dtype(np.float32))
        ctx.bind(tmp, ctx.reshape(src, full, f"{node.name}_pre_reshape"), None)
        x = tmp
    perm = _keep_layout(ctx, x)
    if full == out_shape:
        ctx.bind(out, ctx.value(x, perm), perm)  # a no-op broadcast: no Tile
        return
    reps = [o // i for i, o in zip(full, out_shape)]
    order = list(perm) if perm is not None else list(range(rank))
    ctx.emit(node, "Tile", [ctx.value(x, perm)], perm, {"repeats": [int(reps[a]) for a in order]})


@converter("Pad")
def pad(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    mode = str(node.attrs.get("mode", "constant")).upper()
    if mode not in ("CONSTANT", "REFLECT", "EDGE"):
        raise ConvertError(f"mode {mode.lower()} is not supported")
    pads = ctx.const(node.inputs[1]).astype(np.int64).tolist() if _inputs(node, 1) else list(node.attrs["pads"])
    value = float(ctx.const(node.inputs[2]).reshape(-1)[0]) if _inputs(node, 2) else 0.0
    axes = ctx.const(node.inputs[3]).astype(np.int64).tolist() if _inputs(node, 3) else list(range(rank))
    pairs = [[0, 0] for _ in range(rank)]
    n = len(axes)
    for i, a in enumerate(axes):
        pairs[_axis(a, rank)] = [int(pads[i]), int(pads[i + n])]
    if any(p < 0 for pr in pairs for p in pr):
        raise ConvertError("negative pads are not supported")
    perm = _keep_layout(ctx, x)
    if not any(p for pr in pairs for p in pr):
        ctx.bind(node.outputs[0], ctx.value(x, perm), perm)  # pads nothing: no layer
        return
    order = list(perm) if perm is not None else list(range(rank))
    ctx.emit(node, "Pad", [ctx.value(x, perm)], perm,
             {"pads": [pairs[a] for a in order], "mode": mode, "constant_value": value})


# ================================================================================================ shape ops
@converter("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(ctx: Context, node: ONode) -> None:
    out = node.outputs[0]
    ctx.bind(out, ctx.reshape(ctx.source_for_reshape(node.inputs[0]), ctx.shape(out), node.name), None)


@converter("Transpose")
def transpose(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    t = [int(p) for p in node.attrs.get("perm", list(reversed(range(rank))))]
    ir, have = ctx.tmap[x] if x in ctx.tmap else (ctx.value(x), None)
    pinv = inverse(have) if have is not None else list(range(rank))
    q = [pinv[a] for a in t]
    if rank == 4 and not is_identity(q) and is_identity([pinv[t[p]] for p in nhwc(rank)]):
        # the held tensor already is the output's channels-last layout (a channels-last → channels-first Transpose
        # of a tensor held in its ONNX layout): no layer, as the Parser cancels it against its own layout Transpose
        ctx.bind(node.outputs[0], ir, nhwc(rank))
        return
    ctx.bind(node.outputs[0], ctx.transpose(ir, q, node.name), None)


@converter("Cast", "CastLike")
def cast(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    out = node.outputs[0]
    src, dst = ctx.dtype(x), ir_dtype(ctx.g.dtypes.get(out, np.float32))
    perm = _keep_layout(ctx, x)
    if src == dst or (src.is_float and dst.is_float):
        ctx.bind(out, ctx.value(x, perm), perm)
        return
    if dst is Dtype.BOOL:
        # as the Parser writes it (convert_special_cast): x != 0, a Logical NOT_EQUAL against zeros
        zeros = new_const(ctx.g, f"{node.name}_equal_zeros",
                          np.zeros((1,) * ctx.rank(x), np.dtype(ctx.g.dtypes.get(x, np.float32))))
        rank = ctx.rank(out)
        ctx.emit(node, "Logical", [ctx.value(x, perm), ctx.broadcast_value(zeros, rank, perm)], perm,
                 {"method": "NOT_EQUAL"}, name=f"{node.name}_equal")
        return
    # the Parser's params: out-of-range integers wrap (as onnxruntime's casts do), no scale/zero-point change
    ctx.emit(node, "Cast", [ctx.value(x, perm)], perm,
             {"to_dtype": dst.value, "clip_mode": "TRUNCATION", "ignore_scale_zp": True}, out_dtypes=[dst])


@converter("DepthToSpace", "SpaceToDepth")
def depth_space(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    bs = int(node.attrs["blocksize"])
    params: Dict[str, Any] = {"block_size_x": bs, "block_size_y": bs}
    mode = str(node.attrs.get("mode", "DCR")).upper()
    if node.op == "DepthToSpace":
        params["mode"] = mode
    elif mode == "CRD":  # the IR's SpaceToDepth is DCR: permute its channels to CRD order with a Gather
        n, c, h, w = ctx.shape(x)
        mid = ctx.add("SpaceToDepth", [ctx.value(x, nhwc(4))], [(n, h // bs, w // bs, c * bs * bs)], node.name,
                      params, out_dtypes=[ctx.dtype(x)])[0]
        order = np.array([j * c + k for k in range(c) for j in range(bs * bs)], dtype=np.int32)
        ctx.emit(node, "Gather", [mid], nhwc(4), {"axis": 3, "batch_dims": 0}, {"indices": order},
                 name=f"{node.name}_crd")
        return
    ctx.emit(node, node.op, [ctx.value(x, nhwc(4))], nhwc(4), params)


@converter("Resize")
def resize(ctx: Context, node: ONode) -> None:
    x = node.inputs[0]
    rank = ctx.rank(x)
    ins, outs = ctx.shape(x), ctx.shape(node.outputs[0])
    if rank not in (3, 4, 5) or ins[:2] != outs[:2]:
        raise ConvertError("resizing the batch or channel axis is not supported")
    if int(node.attrs.get("antialias", 0)):
        raise ConvertError("antialias=1 is not supported")
    if node.attrs.get("axes") is not None or str(node.attrs.get("keep_aspect_ratio_policy", "stretch")) != "stretch":
        raise ConvertError("axes / keep_aspect_ratio_policy are not supported")
    mode = str(node.attrs.get("mode", "nearest")).lower()
    method = {"nearest": "NEAREST", "linear": "BILINEAR" if rank == 4 else "LINEAR", "cubic": "BICUBIC"}[mode]
    coord = str(node.attrs.get("coordinate_transformation_mode", "half_pixel")).upper()
    if coord in ("TF_CROP_AND_RESIZE", "HALF_PIXEL_SYMMETRIC"):
        raise ConvertError(f"coordinate_transformation_mode {coord.lower()} is not supported")
    if mode == "cubic" and int(node.attrs.get("exclude_outside", 0)):
        raise ConvertError("cubic resize with exclude_outside=1 is not supported")
    params: Dict[str, Any] = {"method": method, "mode": coord}
    if mode == "nearest":
        params["nearest_mode"] = str(node.attrs.get("nearest_mode", "round_prefer_floor")).upper()
    if mode == "cubic":
        params["cubic_coeff_a"] = float(node.attrs.get("cubic_coeff_a", -0.75))
        params["exclude_outside"] = bool(node.attrs.get("exclude_outside", 0))
    params["size"] = list(outs[2:])
    scales = _inputs(node, 2)
    if scales and not _inputs(node, 3) and ctx.const(scales).size:
        sc = ctx.const(scales).astype(np.float64).tolist()[2:]
        if coord == "ALIGN_CORNERS" and any(i * f != o for i, f, o in zip(ins[2:], sc, outs[2:])):
            # ONNX maps align_corners through the unrounded size input * scale, the IR through the output size
            raise ConvertError("align_corners with scales whose input size * scale is not an integer is not "
                               "supported (give sizes instead)")
        for key, v in zip(("ratio_x", "ratio_y", "ratio_z"), reversed(sc)):
            params[key] = float(v)
    perm = nhwc(rank)
    ctx.emit(node, "Resize", [ctx.value(x, perm)], perm, params)


# ================================================================================================ MAC
def _fc(ctx: Context, node: ONode, a: str, w: np.ndarray, b: np.ndarray) -> None:
    """y = a @ w^T + b over the last axis; w [out, in]. As the Parser writes it, the layer is 2-D: an input of
    higher rank is reshaped to [rows, in] before it and the output back after it (views.py drops the pairs that
    cancel, e.g. between two fully connected layers with an activation between them)."""
    params = {"num_output": int(w.shape[0])}
    params.update(_fused(node))
    # one copy of the weights, laid out [out, in] (a VGG-size layer went through two float64 copies before)
    consts = {"weights": np.array(w, dtype=np.float32, order="C"),
              "biases": np.ascontiguousarray(b.astype(np.float32).reshape(-1))}
    src = ctx.source_for_reshape(a)
    if ctx.rank(a) <= 2:
        ctx.emit(node, "FullyConnected", [src], None, params, consts)
        return
    shape = ctx.shape(a)
    rows = int(np.prod(shape[:-1]))
    flat = ctx.reshape(src, (rows, shape[-1]), f"{ctx.producer_layer(src)}_post_reshape")
    out = node.outputs[0]
    y = ctx.add("FullyConnected", [flat], [(rows, int(w.shape[0]))], node.name, params, consts,
                [ir_dtype(ctx.g.dtypes.get(out, np.float32))])[0]
    ctx.bind(out, ctx.reshape(y, ctx.shape(out), f"{ctx.producer_layer(y)}_post_reshape"), None)


@converter("Gemm")
def gemm(ctx: Context, node: ONode) -> None:
    a, bname = node.inputs[0], node.inputs[1]
    c = _inputs(node, 2)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    ta, tb = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    n_out = ctx.shape(node.outputs[0])[1]
    if not ta and ctx.is_const(bname) and (c is None or (ctx.is_const(c) and ctx.const(c).size in (1, n_out)
                                                          and ctx.const(c).shape[-1:] in ((n_out,), (1,), ()))):
        bm = ctx.const(bname)
        w = bm if tb else bm.T
        if alpha != 1.0:  # the product in float64, rounded once to float32 by _fc (a float32 weight is then as is)
            w = w.astype(np.float64) * alpha
        bias = np.broadcast_to(ctx.const(c).astype(np.float64).reshape(-1), (n_out,)) * beta if c is not None \
            else np.zeros(n_out)
        _fc(ctx, node, a, w, bias)
        return
    ins = [ctx.value(t) for t in node.inputs if t]
    params = {"alpha": alpha, "beta": beta, "trans_a": bool(ta), "trans_b": bool(tb)}
    params.update(_fused(node))
    ctx.emit(node, "Gemm", ins, None, params)


@converter("MatMul")
def matmul(ctx: Context, node: ONode) -> None:
    a, bname = node.inputs
    if ctx.is_const(bname) and ctx.const(bname).ndim == 2 and ctx.rank(a) >= 2:
        w = ctx.const(bname).T
        bias = ctx.const(node.fused["bias"]).reshape(-1) if "bias" in node.fused else np.zeros(w.shape[0])
        _fc(ctx, node, a, w, bias)
        return
    if ctx.rank(a) < 2 or ctx.rank(bname) < 2:
        raise ConvertError("1-D operands are not supported")
    ins, params = [], {}
    for t, key in ((a, "trans_a"), (bname, "trans_b")):
        ir, swapped = _untransposed(ctx, ctx.value(t))
        ins.append(ir)
        params[key] = swapped
    ctx.emit(node, "MatMul", ins, None, params)


def _untransposed(ctx: Context, ir: str) -> Tuple[str, bool]:
    """An operand made by a Transpose that swaps the last two axes is read before it, with trans_a/trans_b set
    (the Parser merges such Transposes into the MatMul)."""
    made = ctx.view_layer.get(ir)
    rank = len(ctx.ir_shapes[ir])
    if made is not None and made[1] == ("transpose", tuple(range(rank - 2)) + (rank - 1, rank - 2)):
        return made[0], True
    return ir, False


def supported_ops() -> List[str]:
    return sorted(CONVERTERS)


def unsupported_attr(node: ONode) -> Optional[str]:
    """Attributes no converter handles (checked up front so that the report lists them with the node)."""
    for key in ("activations", "clip"):
        if key in node.attrs and node.op not in ("Clip", "LSTM", "GRU"):  # the RNN converters check their own
            return f"attribute '{key}'"
    if node.domain not in ("", "ai.onnx", FUSED_DOMAIN):
        return f"domain '{node.domain}'"
    if "decompose_error" in node.attrs:  # an operator rewritten as others (decompose.py) that could not be
        return str(node.attrs["decompose_error"])
    if node.op in ("Range", "NonZero"):  # reached only when an input is not constant: the output size is data-bound
        return ("inputs computed at run time are not supported (it is folded when its inputs are constants or "
                "come from fixed input shapes)")
    if node.op == "Dropout":  # the inference-mode ones were removed while simplifying
        return "training-mode Dropout (random, or a training_mode input that is not constant) is not supported"
    return None
