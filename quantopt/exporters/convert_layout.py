"""QDQ export of graph inputs, constants, data movement (Reshape, Transpose, Squeeze, Split, Concat, Pad) and the
windowed/resampling/reducing layers (Pooling, GlobalPool, Resize, Reduce).

Data movement keeps the quantization of its input, so the integers move unchanged: the ONNX op runs on the
integer value directly (exact, no DequantizeLinear/QuantizeLinear). A Concat or Pooling whose output params differ
from its inputs', and every op that computes new values, goes through DequantizeLinear → float op → QuantizeLinear.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..ops._quant import tensor_scale
from ..ops._shared import axis_param, bool_param
from ..ops.batchnorm_pad import pad_pairs
from ..ops.pooling import AVG_SUM_LIMIT, avg_requant
from ..quant.rounding import FLOAT32_EXACT
from . import convert_exact
from .convert_exact import DOUBLE
from .qdq_graph import (
    FLOAT,
    ONNX_INT_TYPES,
    Perm,
    QDQGraph,
    QParams,
    channels_first,
    converter,
    inverse,
    node_error,
    requant_ratio,
    same_qparams,
)


def _int(node: PyNode, key: str, default: int) -> int:
    return int(node.get_param(key, optional=True, default_value=default))


def _ints(values: Sequence[int]) -> List[int]:
    return [int(v) for v in values]


# ------------------------------------------------------------------------------------------------ inputs, constants
def takes_float(t: PyTensor) -> bool:
    """Whether a graph input is fed floats: a float IR input, or the quantized input of an IR quantopt wrote (its
    dtype is the integer one, its scale the real one). Integer inputs used as they are (scale 1) take integers."""
    return t.ir_dtype.is_float or not t.qinvariant


@converter("Input")
def convert_input(g: QDQGraph, node: PyNode) -> None:
    """A float graph input quantized by QuantizeLinear; an integer input (scale 1, zero point 0) is used as is."""
    t = node.outputs[0]
    shape = g.io_shape(t)
    if takes_float(t):
        g.inputs.append(g.value_info(t.name, "FLOAT", shape))
        g.quantize(t, t.name, exact=True)
        return
    if t.ir_dtype not in ONNX_INT_TYPES or t.ir_dtype != t.dtype:
        raise node_error(node, f"integer input of dtype {t.ir_dtype} (quantized as {t.dtype}) has no QDQ mapping")
    g.inputs.append(g.value_info(t.name, ONNX_INT_TYPES[t.ir_dtype][0], shape))
    g.set_int(t, t.name)


@converter("Constant")
def convert_constant(g: QDQGraph, node: PyNode) -> None:
    """The stored integers become an initializer of the output dtype."""
    t = node.outputs[0]
    p = g.qparams(t)
    values = node.get_constant("weights").betensor.to(torch.int64) + p.offset
    if values.numel() == t.ir_numel:
        values = values.reshape(t.ir_shape)
    g.set_int(t, g.const(f"{t.name}_q", values.numpy().astype(ONNX_INT_TYPES[p.dtype][1])))


# ------------------------------------------------------------------------------------------------ data movement
def _require_same(node: PyNode, a: PyTensor, b: PyTensor) -> None:
    if not same_qparams(a, b):
        raise node_error(node, f"output '{b.name}' is quantized differently from input '{a.name}'; a data-movement "
                               "layer must keep its input's params")


def _batch_shape(x: PyTensor, shape: Sequence[int]) -> List[int]:
    """The IR shape with its batch dim (equal to the input's IR batch) written as 0: ONNX copies the input's."""
    shape = _ints(shape)
    if shape and x.ir_shape and shape[0] == int(x.ir_shape[0]):
        shape[0] = 0
    return shape


@converter("Reshape", "Squeeze")
def convert_reshape(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
    shape = node.get_param("shape") if str(node.type) == "Reshape" else y.ir_shape
    shape = _batch_shape(x, shape) if g.dynamic_batch else [int(v) for v in y.ir_shape]
    out = g.add("Reshape", [g.int_value(x), g.ints(f"{node.name}/shape", shape)])
    g.set_int(y, out)


@converter("Transpose", "Permute")
def convert_transpose(g: QDQGraph, node: PyNode) -> None:
    """No ONNX node: every layout of the input is a layout of the output (y = x.transpose(P), so the value
    x.transpose(have) equals y.transpose(inverse(P)[have]))."""
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
    rank = g.rank(x)
    raw = node.get_param("perm", optional=True)
    perm = tuple(int(p) for p in raw) if isinstance(raw, (list, tuple)) else tuple(reversed(range(rank)))
    if sorted(perm) != list(range(rank)):
        raise node_error(node, f"perm {list(perm)} is not a permutation of {rank} axes")
    inv = inverse(perm)
    for have in g.perms(x):
        g.set_int(y, g.int_value(x, have), tuple(inv[a] for a in have))


@converter("Split")
def convert_split(g: QDQGraph, node: PyNode) -> None:
    x = node.inputs[0]
    for y in node.outputs:
        _require_same(node, x, y)
    rank = g.rank(x)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    axis = axis_param(node, node.get_param("axis", optional=True, default_value=0), rank)
    sizes = [int(y.ir_shape[axis]) for y in node.outputs]
    outs = g.add_multi("Split", [g.int_value(x, perm), g.ints(f"{node.name}/split", sizes)],
                       [f"{y.name}_q" for y in node.outputs], axis=perm.index(axis))
    for y, name in zip(node.outputs, outs):
        g.set_int(y, name, perm)


@converter("Concat")
def convert_concat(g: QDQGraph, node: PyNode) -> None:
    """Integer Concat when every branch has the output's params (no requantization stored), else float."""
    y = node.outputs[0]
    rank = g.rank(y)
    if any(g.rank(t) != rank for t in node.inputs):
        raise node_error(node, "inputs of different ranks")
    perm = g.common_perm(node.inputs, rank, prefer=channels_first(rank))
    axis = perm.index(axis_param(node, node.get_param("axis"), rank))
    if all(same_qparams(t, y) for t in node.inputs):
        g.set_int(y, g.add("Concat", [g.int_value(t, perm) for t in node.inputs], axis=axis), perm)
        return
    if convert_exact.concat(g, node, perm, axis):
        return
    branches = [g.float_value(t, perm) for t in node.inputs]
    if "scale_value" in node.params:  # per-branch multipliers M_i 2^-N_i for s_out / s_i
        branches = [g.rescale(v, float(m) * 2.0 ** -float(n) * tensor_scale(t) / tensor_scale(y), f"requant{i}")
                    for i, (v, m, n, t) in enumerate(zip(branches, node.params["scale_value"],
                                                         node.params["shift_value"], node.inputs))]
    g.quantize(y, g.add("Concat", branches, axis=axis), perm)


@converter("Pad")
def convert_pad(g: QDQGraph, node: PyNode) -> None:
    """Pad of the codes (8-bit; 16-bit through DequantizeLinear/QuantizeLinear, which is exact for unchanged
    params); CONSTANT pads with the stored (quantized) constant_value."""
    x, y = node.inputs[0], node.outputs[0]
    _require_same(node, x, y)
    mode = str(node.get_param("mode", optional=True, default_value="CONSTANT")).upper()
    modes = {"CONSTANT": "constant", "REFLECT": "reflect", "EDGE": "edge"}
    if mode not in modes:
        raise node_error(node, f"pad mode {mode} has no ONNX equivalent (CONSTANT, REFLECT and EDGE do)")
    rank = g.rank(x)
    pairs = pad_pairs(node, node.get_param("pads"), rank)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    pads = [pairs[a][0] for a in perm] + [pairs[a][1] for a in perm]
    value = int(node.get_param("constant_value", optional=True, default_value=0)) if mode == "CONSTANT" else 0
    if y.dtype.bits == 8:  # onnxruntime pads 8-bit integers but not 16-bit ones
        inputs = [g.int_value(x, perm), g.ints(f"{node.name}/pads", pads)]
        if mode == "CONSTANT":
            p = g.qparams(y)
            inputs.append(g.const(f"{node.name}/value", np.array(value + p.offset, dtype=ONNX_INT_TYPES[p.dtype][1])))
        g.set_int(y, g.add("Pad", inputs, mode=modes[mode]), perm)
        return
    inputs = [g.float_value(x, perm), g.ints(f"{node.name}/pads", pads)]
    if mode == "CONSTANT":  # the dequantized pad integer: QuantizeLinear gives the integer back
        p = g.qparams(y)
        inputs.append(g.const(f"{node.name}/value", np.array((value - p.zero_point) * np.float32(p.scale),
                                                              dtype=np.float32)))
    g.quantize(y, g.add("Pad", inputs, mode=modes[mode]), perm, lossless=True)


# ------------------------------------------------------------------------------------------------ pooling
def pool_axis(size: int, k: int, s: int, d: int, before: int, after: int, ceil_mode: bool) -> Tuple[int, int]:
    """(output size, cells to add after the padding so that the last window fits), as quantopt's pooling plans
    them: in ceil mode a last window starting beyond the input and its leading padding is dropped."""
    k_ext = d * (k - 1) + 1
    span = size + before + after - k_ext
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + before:
        out -= 1
    return out, max(0, (out - 1) * s + k_ext - (size + before + after))


def _pool_float(g: QDQGraph, node: PyNode, method: str, x: str, rank: int, spatial: List[int],
                params: dict) -> str:
    kernel, strides, dil, pads_b, pads_e = (params[k] for k in ("k", "s", "d", "before", "after"))
    extra = [pool_axis(int(params["sizes"][i]), kernel[i], strides[i], dil[i], pads_b[i], pads_e[i],
                       params["ceil"])[1] for i in range(len(spatial))]
    dil = dil if any(d != 1 for d in dil) else None  # left out when trivial (onnxruntime's QLinear pools lack it)
    if method == "MAX":
        return g.add("MaxPool", [x], kernel_shape=kernel, strides=strides, dilations=dil,
                     pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)])
    if params["count_pad"] and any(extra) and any(pads_b + pads_e):
        # pads count, the ceil-mode cells do not: pad with float 0 explicitly, then count only real cells
        zero_pads = [0, 0] + pads_b + [0, 0] + pads_e
        x = g.add("Pad", [x, g.ints(f"{node.name}/pads", zero_pads)], mode="constant")
        pads_b, pads_e = [0] * len(spatial), [0] * len(spatial)
        count_pad = 0
    else:
        count_pad = int(params["count_pad"])
    return g.add("AveragePool", [x], kernel_shape=kernel, strides=strides, dilations=dil,
                 pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)], count_include_pad=count_pad)


BYTE_SPLIT_CELLS = 1 << 16
"""Windows below this many cells sum bytes (values below 2^8) exactly in float32."""


def _window_counts(params: dict) -> np.ndarray:
    """The divisor of every output cell (docs/integer-semantics.md, Pooling AVG): per axis the real cells of the
    window (plus its padding cells with count_include_pad), multiplied over the axes."""
    total = np.ones([1], dtype=np.float64)
    for i, n in enumerate(params["sizes"]):
        k, s, d, before, after = (params[key][i] for key in ("k", "s", "d", "before", "after"))
        out, _ = pool_axis(n, k, s, d, before, after, params["ceil"])
        pos = np.arange(out)[:, None] * s - before + np.arange(k)[None, :] * d
        counted = (pos >= -before) & (pos < n + after) if params["count_pad"] else (pos >= 0) & (pos < n)
        total = np.multiply.outer(total, counted.sum(axis=1).astype(np.float64))
    return total.reshape((1,) + total.shape)  # [1, 1, out_h, out_w]: batch and channel broadcast


def _avg_factors(node: PyNode, params: dict) -> np.ndarray:
    """M · 2^-shift per output cell (float64, exact): the integer forward's 8-bit approximation of 1 / count for a
    pool that keeps its input's params (docs/integer-semantics.md, Pooling AVG; quantopt/ops/pooling.py)."""
    scale = tensor_scale(node.inputs[0])
    mult, shift = avg_requant(scale, scale, torch.from_numpy(_window_counts(params)))
    return mult.numpy().astype(np.float64) * np.power(2.0, -shift.numpy().astype(np.float64))


def _window_sums(g: QDQGraph, node: PyNode, x: str, params: dict, channels: int) -> str:
    """Σ over every pooling window (padding and ceil-mode cells 0) by a depthwise Conv with ones, float32."""
    kernel, strides, dil, pads_b, pads_e = (params[k] for k in ("k", "s", "d", "before", "after"))
    extra = [pool_axis(int(n), kernel[i], strides[i], dil[i], pads_b[i], pads_e[i], params["ceil"])[1]
             for i, n in enumerate(params["sizes"])]
    ones = g.const(f"{node.name}/window", np.ones([channels, 1, *kernel], dtype=np.float32))
    return g.add("Conv", [x, ones], kernel_shape=kernel, strides=strides, dilations=dil, group=channels,
                 pads=pads_b + [e + x_ for e, x_ in zip(pads_e, extra)])


def _average_codes(g: QDQGraph, node: PyNode, codes: str, p: QParams, rank: int, spatial: List[int],
                   params: dict) -> str:
    """AVG pooling that keeps its input's params, on the codes: round_half_even(mean(q + zp)) - zp with float32
    sums of integers (exact), so ties round as the integer forward rounds them. In "exact" mode the window sums
    are divided by the cell counts in float64: float32's quotient of 16-bit sums can miss a rounding boundary."""
    zp = g.const(f"{node.name}/zero_point", np.array(p.zero_point, dtype=np.float32))
    shifted = g.add("Sub", [g.add("Cast", [codes], to=FLOAT), zp])  # ONNX zero point = -zp_ir
    cells = int(np.prod(params["k"]))
    if g.unit_domain and cells < BYTE_SPLIT_CELLS:
        channels = int(node.inputs[0].ir_shape[-1])
        if cells * max(abs(p.qmin - p.zero_point), abs(p.qmax - p.zero_point)) < FLOAT32_EXACT:
            sums = g.add("Cast", [_window_sums(g, node, shifted, params, channels)], to=DOUBLE)
        else:  # float32 sums of the high and low bytes (each below 2^24), combined in float64
            byte = g.const(f"{node.name}/byte", np.array(256.0, dtype=np.float32))
            high = g.add("Floor", [g.add("Div", [shifted, byte])])
            low = g.add("Sub", [shifted, g.add("Mul", [high, byte])])
            high_sums = g.add("Cast", [_window_sums(g, node, high, params, channels)], to=DOUBLE)
            sums = g.add("Add", [g.add("Mul", [high_sums, g.const(f"{node.name}/byte_d", np.array(256.0))]),
                                 g.add("Cast", [_window_sums(g, node, low, params, channels)], to=DOUBLE)])
        limit = float(AVG_SUM_LIMIT)
        sums = g.add("Clip", [sums, g.const(f"{node.name}/sum_lo", np.array(-limit)),
                              g.const(f"{node.name}/sum_hi", np.array(limit))])
        mean = g.add("Mul", [sums, g.const(f"{node.name}/reciprocals", _avg_factors(node, params))])
        mean = g.add("Cast", [g.add("Round", [mean])], to=FLOAT)
    else:
        mean = g.add("Round", [_pool_float(g, node, "AVG", shifted, rank, spatial, params)])
    return g.add("Cast", [g.add("Add", [mean, zp])], to=g.elem_type(p.dtype))


@converter("Pooling")
def convert_pooling(g: QDQGraph, node: PyNode) -> None:
    """MaxPool/AveragePool channels-first, with explicit asymmetric pads and quantopt's ceil-mode windows. Pools
    that keep their input's params run on the codes (MAX: int8/uint8 MaxPool; AVG: see _average_codes)."""
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    if method not in ("MAX", "AVG"):
        raise node_error(node, f"pooling method {method} has no QDQ mapping (MAX and AVG do)")
    rank = g.rank(x)
    if rank not in (3, 4):
        raise node_error(node, f"only 3-D [N,W,C] and 4-D NHWC inputs are exported, got rank {rank}")
    one_d = rank == 3
    keys = [("x", "left", "right")] if one_d else [("y", "top", "bottom"), ("x", "left", "right")]
    params = {
        "k": [_int(node, f"kernel_{a}", 1) for a, _, _ in keys],
        "s": [_int(node, f"stride_{a}", 1) for a, _, _ in keys],
        "d": [_int(node, f"dilation_{a}", 1) for a, _, _ in keys],
        "before": [_int(node, f"pad_{b}", 0) for _, b, _ in keys],
        "after": [_int(node, f"pad_{e}", 0) for _, _, e in keys],
        "sizes": [int(s) for s in x.ir_shape[1:-1]],
        "ceil": bool_param(node, "ceil_mode", False),
        "count_pad": bool_param(node, "count_include_pad", False),
    }
    cf = channels_first(rank)
    spatial = list(range(2, rank))
    if method == "MAX" and same_qparams(x, y) and x.dtype.bits == 8:
        out = _pool_float(g, node, method, g.int_value(x, cf), rank, spatial, params)  # int8/uint8 MaxPool: exact
        g.set_int(y, out, cf)
        return
    if method == "AVG" and same_qparams(x, y):
        g.set_int(y, _average_codes(g, node, g.int_value(x, cf), g.qparams(x), rank, spatial, params), cf)
        return
    g.quantize(y, _pool_float(g, node, method, g.float_value(x, cf), rank, spatial, params), cf,
               lossless=method == "MAX" and same_qparams(x, y))


@converter("GlobalPool")
def convert_global_pool(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    ops = {"AVG": "GlobalAveragePool", "MAX": "GlobalMaxPool"}
    if method not in ops:
        raise node_error(node, f"global pooling method {method} has no QDQ mapping (MAX and AVG do)")
    if any(_int(node, k, 0) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom")):
        raise node_error(node, "padded global pooling has no QDQ mapping")
    cf = channels_first(g.rank(x))
    if method == "AVG" and g.unit_domain and same_qparams(x, y):  # Pooling AVG with the whole input as window
        sizes = [int(v) for v in x.ir_shape[1:-1]]
        params = {"k": sizes, "s": [1] * len(sizes), "d": [1] * len(sizes), "before": [0] * len(sizes),
                  "after": [0] * len(sizes), "sizes": sizes, "ceil": False, "count_pad": False}
        g.set_int(y, _average_codes(g, node, g.int_value(x, cf), g.qparams(x), g.rank(x),
                                    list(range(2, g.rank(x))), params), cf)
        return
    g.quantize(y, g.add(ops[method], [g.float_value(x, cf)]), cf, lossless=method == "MAX" and same_qparams(x, y))


# ------------------------------------------------------------------------------------------------ resize
RESIZE_MODES = {"nearest": "nearest", "bilinear": "linear", "linear": "linear", "trilinear": "linear",
                "bicubic": "cubic", "cubic": "cubic"}
COORDINATE_MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nn")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
RATIO_KEYS = ("ratio_x", "ratio_y", "ratio_z")  # last spatial axis first


def _resize_scales(node: PyNode, x: PyTensor, y: PyTensor, spatial: List[int]) -> Optional[List[float]]:
    """Explicit ratios when the IR has them and they differ from out/in (they then define the coordinates)."""
    ratios: List[float] = []
    for pos, a in enumerate(spatial):
        r = node.params.get(RATIO_KEYS[len(spatial) - 1 - pos])
        n_in, n_out = int(x.ir_shape[a]), int(y.ir_shape[a])
        if r is None or float(r) <= 0 or float(r) == n_out / n_in:
            ratios.append(n_out / n_in)
            continue
        if int(np.floor(n_in * float(r))) != n_out:
            raise node_error(node, f"ratio {r} along axis {a} does not give the output size {n_out}")
        ratios.append(float(r))
    return None if all(r == int(y.ir_shape[a]) / int(x.ir_shape[a]) for r, a in zip(ratios, spatial)) else ratios


@converter("Resize", "Interp")
def convert_resize(g: QDQGraph, node: PyNode) -> None:
    """ONNX Resize to the output sizes (scales when the IR gives other ratios), in the layout the input already
    has (channels-first preferred)."""
    x, y = node.inputs[0], node.outputs[0]
    rank = g.rank(x)
    if rank not in (3, 4, 5):
        raise node_error(node, f"only 3-D to 5-D channels-last inputs are exported, got rank {rank}")
    method = str(node.get_param("method")).strip().lower()
    coord = str(node.get_param("mode", optional=True, default_value="half_pixel")).strip().lower()
    nearest = str(node.get_param("nearest_mode", optional=True, default_value="round_prefer_floor")).strip().lower()
    if method not in RESIZE_MODES:
        raise node_error(node, f"resize method {method.upper()} has no QDQ mapping")
    if coord not in COORDINATE_MODES:
        raise node_error(node, f"coordinate mode {coord.upper()} has no QDQ mapping")
    if RESIZE_MODES[method] == "nearest" and nearest not in NEAREST_MODES:
        raise node_error(node, f"nearest_mode {nearest.upper()} has no ONNX equivalent")
    if bool_param(node, "antialias", False) or bool_param(node, "exclude_outside", False):
        raise node_error(node, "antialias/exclude_outside resize has no QDQ mapping")
    if convert_exact.resize(g, node):
        return
    spatial = list(range(1, rank - 1))
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    value = g.float_value(x, perm)
    scales = _resize_scales(node, x, y, spatial)
    if scales is None:  # sizes of every axis (no `axes` attribute: onnxruntime's layout optimizer mishandles it)
        sizes = [int(y.ir_shape[a]) for a in perm]
        if g.dynamic_batch:
            batch = g.add("Slice", [g.add("Shape", [value]), g.ints(f"{node.name}/batch_start", [0]),
                                    g.ints(f"{node.name}/batch_end", [1])])
            target = g.add("Concat", [batch, g.ints(f"{node.name}/sizes", sizes[1:])], axis=0)
        else:
            target = g.ints(f"{node.name}/sizes", sizes)
        inputs = [value, "", "", target]
    else:
        ratio = dict(zip(spatial, scales))
        full = np.asarray([ratio.get(a, 1.0) for a in perm], dtype=np.float32)
        inputs = [value, "", g.const(f"{node.name}/scales", full)]
    mode = RESIZE_MODES[method]
    out = g.add("Resize", inputs, mode=mode, coordinate_transformation_mode=coord,
                nearest_mode=nearest if mode == "nearest" else None,
                cubic_coeff_a=float(node.get_param("cubic_coeff_a", optional=True, default_value=-0.75))
                if mode == "cubic" else None)
    g.quantize(y, out, perm, lossless=mode == "nearest" and same_qparams(x, y))


# ------------------------------------------------------------------------------------------------ reduce
REDUCE_OPS = {"MEAN": "ReduceMean", "SUM": "ReduceSum", "MAX": "ReduceMax", "MIN": "ReduceMin", "PROD": "ReduceProd",
              "L1": "ReduceL1", "L2": "ReduceL2"}


def reduced_perm(perm: Perm, axes: Sequence[int]) -> Perm:
    """The layout of `ir.transpose(perm)` reduced over IR `axes` without keepdims, in terms of the output IR."""
    kept = [a for a in range(len(perm)) if a not in axes]
    new_index = {a: i for i, a in enumerate(kept)}
    return tuple(new_index[a] for a in perm if a not in axes)


@converter("Reduce")
def convert_reduce(g: QDQGraph, node: PyNode) -> None:
    x, y = node.inputs[0], node.outputs[0]
    method = str(node.get_param("method")).upper()
    if method not in REDUCE_OPS:
        raise node_error(node, f"reduce method {method} has no QDQ mapping ({', '.join(REDUCE_OPS)} do)")
    rank = g.rank(x)
    raw = node.get_param("axis")
    axes = sorted({axis_param(node, a, rank) for a in (raw if isinstance(raw, (list, tuple)) else [raw])})
    keepdims = bool_param(node, "keepdims", True)
    perm = g.common_perm([x], rank, prefer=channels_first(rank))
    onnx_axes = sorted(perm.index(a) for a in axes)
    out_perm = perm if keepdims else reduced_perm(perm, axes)
    count = int(np.prod([int(x.ir_shape[a]) for a in axes]))
    if convert_exact.reduce_sum(g, node, method, perm, onnx_axes, keepdims, out_perm, count):
        return
    out = g.add(REDUCE_OPS[method], [g.float_value(x, perm), g.ints(f"{node.name}/axes", onnx_axes)],
                keepdims=int(keepdims))
    if method in ("SUM", "MEAN"):  # one multiplier for s_out / s_in (/ count)
        ratio = float(requant_ratio(node)[0])
        out = g.rescale(out, ratio * tensor_scale(x) * (count if method == "MEAN" else 1) / tensor_scale(y))
    g.quantize(y, out, out_perm, lossless=method in ("MAX", "MIN") and same_qparams(x, y))
