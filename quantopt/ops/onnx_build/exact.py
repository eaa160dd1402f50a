"""Integer paths of the "exact" export: layers whose QDQ float form cannot round as quantopt does (the full list,
with the MAC layers of mac.py and the recurrent cells of ops/recurrent.py: docs/onnx-export.md).

* **Code tables.** A one-input layer whose output integer depends on its input integer alone (every table
  activation, RELU/RELU6/CLIP/LEAKYRELU, the unary math tables, Abs/Negative, Pow) becomes a `Gather` on the table
  of its outputs for every input integer, computed by quantopt's own integer forward: `Cast(int32)` of the input
  integers (minus the dtype's lowest value) indexes a constant of the output type. 256 entries for 8-bit inputs,
  65536 for 16-bit ones. Position independence is checked, not assumed: the forward runs on the codes in two
  orders and must give the same table.
* **Double arithmetic.** Eltwise (also N-ary and per channel), MatMul, per-channel PRELU, CRELU, Concat, Reduce
  SUM/MEAN/L1 and linear/cubic Resize compute with integers that stay below 2^53, exact in float64: the inputs are
  read as integers plus zero point (`DequantizeLinear` with scale 1, `Cast` to double), multiplied by their integer
  multipliers, combined, scaled by `M · 2^-N` (exact), rounded by `Round` (half to even, as quantopt) and quantized
  with scale 1 after the Clip to the output range and fused-activation bounds.
* **int64 arithmetic** where float64 is not enough (rounding division, bit length, integer square root as ONNX
  ops): Softmax (LUT and FAST_EXP), LogSoftmax, LayerNorm (both integer forms), Reduce L2, Div.

The emitters several operators share live here; an emitter only one operator uses (Softmax, LogSoftmax,
LayerNorm, Resize) sits beside that operator's mapping, since it reads the operator's own constants.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ...errors import QuantOptError
from ...graph.node import PyNode
from ...graph.tensor import PyTensor
from ...quant.lut import lookup_lut
from ...quant.rounding import FLOAT64_EXACT, bit_length
from .._eltwise_int import INT64_PRODUCT_LIMIT, offset_absmax
from .._quant import fused_activation_bounds, quant_of, requant_of, tensor_zp
from .perms import Perm
from .qdq_graph import FLOAT, ONNX_INT_TYPES, QUANTIZABLE, QDQGraph, requant_ratio

DOUBLE = 11
"""onnx.TensorProto.DOUBLE."""
INT32 = 6
"""onnx.TensorProto.INT32."""
INT64 = 7
"""onnx.TensorProto.INT64."""
INT64_EXACT = 2 ** 62
"""The int64 forms' bound: what quantopt's own integer forward refuses beyond (ops/_eltwise_int.py)."""
MAX_TABLE_BITS = 16
MAX_EXACT_SHIFT = 36


def _run_on(node: PyNode, codes: torch.Tensor, channels: int = 0) -> Optional[torch.Tensor]:
    """quantopt's integer forward of `node` on `codes` (laid along dim 0; with `channels`, repeated along the last
    axis: [codes, C] out), or None when it is not element-wise."""
    x = node.inputs[0]
    rank = max(len(x.ir_shape), 1)
    if channels:
        x.betensor = codes.reshape((-1,) + (1,) * (rank - 2) + (1,)).expand(*((-1,) + (1,) * (rank - 2)), channels)
    else:
        x.betensor = codes.reshape((-1,) + (1,) * (rank - 1))
    node.forward()
    y = node.outputs[0].betensor
    if y.numel() != codes.numel() * max(channels, 1):
        return None
    return y.reshape(codes.numel(), -1).to(torch.int64) if channels else y.reshape(-1).to(torch.int64)


def code_table(node: PyNode, lo: int, hi: int, offset: int, first_input_only: bool = False) -> Optional[np.ndarray]:
    """IR output integer for every ONNX input integer in [lo, hi] (IR integer = ONNX integer - `offset`, clamped to
    the input range), from quantopt's forward; None when the layer is not a function of each integer alone.
    `first_input_only`: the caller knows the integer forward reads no other input (the Parser's Pow, whose second
    input is the constant exponent its table was built from), which then stays as it is."""
    x, y = node.inputs[0], node.outputs[0]
    qx = quant_of(node).get(x)
    if (len(node.inputs) != 1 and not first_input_only) or len(node.outputs) != 1 or qx.qmin is None \
            or hi - lo >= 1 << MAX_TABLE_BITS:
        return None
    if any(key != "lut" and c.betensor.numel() > 1 for key, c in node.constants.items()):
        return None  # per-channel constants (PRELU slopes): a function of the position too
    lut = node.constants.get("lut")
    channels = int(x.ir_shape[-1]) if lut is not None and lut.betensor.dim() == 2 else 0  # one table per channel
    saved = (x.betensor, y.betensor)
    codes = torch.clamp(torch.arange(lo, hi + 1, dtype=torch.int64) - offset, int(qx.qmin), int(qx.qmax))
    try:
        with torch.no_grad():
            forward = _run_on(node, codes, channels)
            backward = _run_on(node, codes.flip(0), channels)
    except (RuntimeError, ValueError, QuantOptError):  # a shape the layer refuses: not element-wise
        return None
    finally:
        x.betensor, y.betensor = saved
    if forward is None or backward is None or not torch.equal(forward, backward.flip(0)):
        return None
    return forward.t().contiguous().numpy() if channels else forward.numpy()  # [C, codes] per channel


def try_table(g: QDQGraph, node: PyNode, perm: Perm, first_input_only: bool = False) -> bool:
    """Export `node` as a Gather on its code table when it is one; False (nothing added) otherwise
    (`first_input_only`: as `code_table`)."""
    if not g.unit_domain:
        return False
    x, y = node.inputs[0], node.outputs[0]
    px, py = g.qparams(x), g.qparams(y)
    if py.dtype not in ONNX_INT_TYPES:
        return False
    lo, hi = px.dtype.int_range()
    table = code_table(node, lo, hi, px.offset, first_input_only)
    if table is None:
        return False
    values = np.clip(table + py.offset, py.qmin, py.qmax).astype(ONNX_INT_TYPES[py.dtype][1])
    index = g.add("Cast", [g.int_value(x, perm)], to=INT32)
    if lo:
        index = g.add("Sub", [index, g.const(f"{node.name}/table_start", np.array(lo, dtype=np.int32))])
    if table.ndim == 2:  # per channel: row c of the flattened [C, codes] table
        rank = len(x.ir_shape)
        shape = [1] * rank
        shape[(tuple(perm) if perm is not None else tuple(range(rank))).index(rank - 1)] = -1
        rows = (np.arange(table.shape[0], dtype=np.int32) * table.shape[1]).reshape(shape)
        index = g.add("Add", [index, g.const(f"{node.name}/table_rows", rows)])
        values = values.reshape(-1)
    g.set_int(y, g.add("Gather", [g.const(f"{node.name}/table", values), index], axis=0), perm)
    return True


def codes(g: QDQGraph, t: PyTensor, perm: Optional[Perm] = None) -> str:
    """`t`'s integers plus its IR zero point (the float value times the scale), as float64. int32 integers are
    cast directly: DequantizeLinear's float32 would round those above 2^24."""
    p = g.qparams(t)
    if p.dtype in QUANTIZABLE:
        return g.add("Cast", [g.float_value(t, perm, unit=True)], to=DOUBLE)
    value = g.add("Cast", [g.int_value(t, perm)], to=DOUBLE)
    return value if not p.zero_point else g.add("Sub", [value, g.const(f"{t.name}_zero_point_codes",
                                                                       np.array(p.zero_point, dtype=np.float64))])


def double(g: QDQGraph, node: PyNode, what: str, value: float) -> str:
    return g.const(f"{node.name}/{what}", np.array(value, dtype=np.float64))


def int64(g: QDQGraph, node: PyNode, what: str, value: Any) -> str:
    """An int64 constant (a scalar or an array) named after the layer: the integer twin of `double`."""
    return g.const(f"{node.name}/{what}", np.asarray(value, dtype=np.int64))


def requantize(g: QDQGraph, node: PyNode, value: str, ratio: Union[float, np.ndarray], perm: Optional[Perm],
               bounds: Optional[Tuple[int, int]] = None, channel_shape: Optional[Sequence[int]] = None) -> None:
    """round_half_even(value · ratio) with ratio = M · 2^-N (one, or one per channel: along the last axis, or shaped
    `channel_shape`), minus the output zero point and clamped: the output's integers. Exact while the rounded result
    has at most 53 significant bits (`exact_ratio`), for the product is then the exact value itself."""
    ratio = np.asarray(ratio, dtype=np.float64)
    if ratio.size > 1:
        shaped = ratio.reshape(tuple(channel_shape) if channel_shape is not None else (-1,))
        value = g.add("Mul", [value, g.const(f"{node.name}/multiplier", shaped)])
    elif float(ratio.reshape(-1)[0]) != 1.0:
        value = g.add("Mul", [value, double(g, node, "multiplier", float(ratio.reshape(-1)[0]))])
    y = node.outputs[0]
    if g.qparams(y).dtype not in QUANTIZABLE and not any(isinstance(b, torch.Tensor) for b in bounds or ()):
        # an int32 integer tensor (integer inputs): no QuantizeLinear makes it, and float32 would round it
        zp = tensor_zp(node, y)
        rounded = g.add("Round", [value])
        rounded = rounded if not zp else g.add("Sub", [rounded, double(g, node, "output_zero_point", float(zp))])
        emit_integers(g, node, y, rounded, perm, bounds=bounds)
        return
    rounded = g.add("Cast", [g.add("Round", [value])], to=FLOAT)
    g.quantize(y, rounded, perm, unit=True, bounds=bounds)


def emit_integers(g: QDQGraph, node: PyNode, t: PyTensor, value: str, perm: Optional[Perm],
                  clip_mode: str = "SATURATION", bounds: Optional[Tuple[int, int]] = None) -> None:
    """`value` (float64 integers, the IR integers of `t`) clamped (SATURATION, also to `bounds`) or wrapped
    (TRUNCATION: two's complement modulo the range) into t's integer range, moved by the ONNX offset and cast to
    t's ONNX type: integer outputs without a QuantizeLinear (int32 included, which float32 would round)."""
    p, q = g.qparams(t), quant_of(node).get(t)
    lo, hi = int(q.qmin), int(q.qmax)
    if clip_mode == "TRUNCATION":
        as_int = g.add("Cast", [value], to=INT64)
        start = g.const(f"{node.name}/wrap_start", np.array(lo, dtype=np.int64))
        wrapped = g.add("Mod", [g.add("Sub", [as_int, start]),
                                g.const(f"{node.name}/wrap_span", np.array(hi - lo + 1, dtype=np.int64))])
        shifted = g.add("Add", [wrapped, g.const(f"{node.name}/wrap_end", np.array(lo + p.offset, dtype=np.int64))])
    else:
        if bounds is not None:
            lo, hi = max(lo, int(bounds[0])), min(hi, int(bounds[1]))
        clipped = g.add("Clip", [value, double(g, node, "qmin", float(lo)), double(g, node, "qmax", float(hi))])
        shifted = clipped if not p.offset else g.add("Add", [clipped, double(g, node, "offset", float(p.offset))])
    g.set_int(t, g.add("Cast", [shifted], to=g.elem_type(p.dtype)), perm)


def exact_ratio(node: PyNode) -> Optional[np.ndarray]:
    """M · 2^-N per tensor ([1]) or channel, when every shift is at most MAX_EXACT_SHIFT: results below 2^17 in
    magnitude are then multiples of 2^-N with at most 53 significant bits (larger ones saturate the output)."""
    mult, shift = requant_of(node)
    shifts = shift.reshape(-1) if isinstance(shift, torch.Tensor) else torch.tensor([int(shift)])
    if int(shifts.max()) > MAX_EXACT_SHIFT:
        return None
    return requant_ratio(node)


def requant_fraction_bits(node: PyNode) -> Optional[int]:
    """The largest N - trailing_zeros(M) over the layer's (per-channel) multipliers: how many fraction bits
    acc · M · 2^-N can have; None without stored multipliers."""
    try:
        mult, shift = requant_of(node)
    except QuantOptError:
        return None
    m = np.asarray(mult.numpy() if isinstance(mult, torch.Tensor) else [mult], dtype=np.int64).reshape(-1)
    n = np.asarray(shift.numpy() if isinstance(shift, torch.Tensor) else [shift], dtype=np.int64).reshape(-1)
    n = np.broadcast_to(n, m.shape)
    zeros = np.array([(int(v) & -int(v)).bit_length() - 1 if v else 0 for v in m], dtype=np.int64)
    return int(np.max(n - zeros)) if m.size else 0


def scaled_codes(g: QDQGraph, node: PyNode, tensors: Sequence[PyTensor], multipliers: Sequence[float],
                 perm: Optional[Perm]) -> list:
    values = []
    for i, (t, m) in enumerate(zip(tensors, multipliers)):
        v = codes(g, t, perm)
        values.append(v if m == 1.0 else g.add("Mul", [v, double(g, node, f"input{i}_multiplier", m)]))
    return values


def fits_double(bound: float) -> bool:
    return bound < FLOAT64_EXACT


def eltwise(g: QDQGraph, node: PyNode, method: str, perm: Optional[Perm]) -> bool:
    """Eltwise ADD/SUB/MAX/MIN/MUL (and Add/Sub/Mul; ADD/MAX/MIN with any number of inputs) in double: False when
    not applicable. Every mode takes this form for a layer of integer tensors only (scale 1: an attention mask's
    `(1 - mask) · -10000`), which has no float QDQ form for its int32 output."""
    inputs = list(node.inputs)
    table = quant_of(node)
    if len(inputs) < 2 or any(table.get(t).qmin is None for t in inputs):
        return False
    if not g.unit_domain and not all(table.get(t).qinvariant for t in inputs + list(node.outputs)):
        return False
    if "scale" in node.constants:
        return _eltwise_per_channel(g, node, method, inputs, perm)
    if method == "MUL":
        if len(inputs) != 2 or isinstance(node.params.get("scale_value"), (list, tuple)):
            return False
        m_out, shift, muls = int(node.params["scale_value"]), int(node.params["shift_value"]), [1, 1]
        bound = offset_absmax(node, inputs[0]) * offset_absmax(node, inputs[1]) * abs(m_out)
    else:
        m_out, *muls = (int(v) for v in node.params["scale_value"])
        shift = int(node.params["shift_value"])
        if len(muls) != len(inputs):
            return False
        bound = sum(offset_absmax(node, t) * abs(m) for t, m in zip(inputs, muls)) * abs(m_out)
    if not fits_double(bound):
        # a product passed through (M = 1, N = 0) adds no rounding term: two int32 codes (2^62) fit int64
        limit = INT64_PRODUCT_LIMIT if method == "MUL" and abs(m_out) == 1 and shift == 0 else INT64_EXACT
        return bound < limit and _eltwise_int64(g, node, method, inputs, muls, m_out, shift, perm)
    ops = {"ADD": "Add", "SUB": "Sub", "MAX": "Max", "MIN": "Min", "MUL": "Mul"}
    values = scaled_codes(g, node, inputs, [float(m) for m in muls], perm)
    acc = values[0]
    for v in values[1:]:
        acc = g.add(ops[method], [acc, v])
    requantize(g, node, acc, m_out * 2.0 ** -shift, perm, fused_activation_bounds(node))
    return True


def _eltwise_int64(g: QDQGraph, node: PyNode, method: str, inputs: Sequence[PyTensor], muls: Sequence[int],
                   m_out: int, shift: int, perm: Optional[Perm]) -> bool:
    """The same Eltwise in int64 where float64's 53 bits do not hold the accumulator (an int32 attention mask added
    to the scores): op over i of X_i · M_i, times M_out, `round_half_even(· / 2^shift)` as a rounding division."""
    bounds = fused_activation_bounds(node)
    if not 0 <= shift <= 61 or any(isinstance(b, torch.Tensor) for b in bounds):
        return False
    ops = {"ADD": "Add", "SUB": "Sub", "MAX": "Max", "MIN": "Min", "MUL": "Mul"}

    values = []
    for i, (t, m) in enumerate(zip(inputs, muls)):
        v = g.add("Cast", [codes(g, t, perm)], to=INT64)
        values.append(v if int(m) == 1 else g.add("Mul", [v, int64(g, node, f"input{i}_multiplier", int(m))]))
    acc = values[0]
    for v in values[1:]:
        acc = g.add(ops[method], [acc, v])
    acc = acc if m_out == 1 else g.add("Mul", [acc, int64(g, node, "multiplier", m_out)])
    result = acc if shift == 0 else round_div_int64(g, node, acc, int64(g, node, "divisor", 1 << shift))
    zp = tensor_zp(node, node.outputs[0])
    result = g.add("Cast", [result], to=DOUBLE)
    result = result if not zp else g.add("Sub", [result, double(g, node, "output_zero_point", float(zp))])
    emit_integers(g, node, node.outputs[0], result, perm, bounds=bounds)
    return True


def _eltwise_per_channel(g: QDQGraph, node: PyNode, method: str, inputs: Sequence[PyTensor],
                         perm: Optional[Perm]) -> bool:
    """Per-channel Eltwise (ops/eltwise.py): every multiplier a vector along the channel axis of the layout."""
    rank = len(node.outputs[0].ir_shape)
    shape = [1] * rank
    shape[(tuple(perm) if perm is not None else tuple(range(rank))).index(rank - 1)] = -1
    mult = node.get_constant("scale").betensor.to(torch.int64).reshape(-1).numpy()
    shift = node.get_constant("shift").betensor.to(torch.int64).reshape(-1).numpy()
    if method == "MUL":
        muls = np.ones((2, mult.size), dtype=np.int64)
        bound = offset_absmax(node, inputs[0]) * offset_absmax(node, inputs[1]) * int(mult.max())
    else:
        muls = node.get_constant("input_scale").betensor.to(torch.int64).reshape(len(inputs), -1).numpy()
        bound = sum(offset_absmax(node, t) * int(m.max()) for t, m in zip(inputs, muls)) * int(mult.max())
    if not fits_double(bound) or int(shift.max()) > MAX_EXACT_SHIFT:
        return False
    ops = {"ADD": "Add", "SUB": "Sub", "MAX": "Max", "MIN": "Min", "MUL": "Mul"}
    values = []
    for i, (t, m) in enumerate(zip(inputs, muls)):
        v = codes(g, t, perm)
        values.append(v if method == "MUL" else g.add("Mul", [v, g.const(f"{node.name}/input{i}_multipliers",
                                                                         m.astype(np.float64).reshape(shape))]))
    acc = values[0]
    for v in values[1:]:
        acc = g.add(ops[method], [acc, v])
    ratio = mult.astype(np.float64) * np.power(2.0, -shift.astype(np.float64))
    requantize(g, node, acc, ratio, perm, fused_activation_bounds(node), channel_shape=shape)
    return True


def matmul(g: QDQGraph, node: PyNode, perms: Sequence[Perm]) -> bool:
    """MatMul of two activations in double: False when not applicable (remain_shift, or too wide for float64)."""
    if not g.unit_domain or node.params.get("remain_shift") is not None:
        return False
    a, b = node.inputs
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor):
        return False
    inner = int(a.ir_shape[perms[0][-1]]) if a.ir_shape else 1
    if not fits_double(inner * offset_absmax(node, a) * offset_absmax(node, b) * abs(int(mult))):
        return False
    product = g.add("MatMul", [codes(g, a, perms[0]), codes(g, b, perms[1])])
    requantize(g, node, product, int(mult) * 2.0 ** -int(shift), None, fused_activation_bounds(node))
    return True


def prelu(g: QDQGraph, node: PyNode, slope: np.ndarray, shift: int, perm: Perm) -> bool:
    """PRELU with a per-channel int16 slope in double: rhe(min(x', 0) · slope, shift) + max(x', 0), requantized."""
    ratio = requant_ratio(node)
    if not g.unit_domain or ratio.size != 1:
        return False
    x = codes(g, node.inputs[0], perm)
    zero = double(g, node, "zero", 0.0)
    weights = g.const(f"{node.name}/slope_step", (slope.astype(np.float64) * 2.0 ** -shift))
    negative = g.add("Round", [g.add("Mul", [g.add("Min", [x, zero]), weights])])
    requantize(g, node, g.add("Add", [negative, g.add("Max", [x, zero])]), float(ratio[0]), perm)
    return True


def concat(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """Concat with per-branch multipliers, y_i = round_half_even((x_i + zp_i) · M_i · 2^-N_i), or passing every
    branch's integers through unchanged, in float64."""
    table = quant_of(node)
    if not g.unit_domain or any(table.get(t).qmin is None for t in node.inputs):
        return False
    y = node.outputs[0]
    zp_out = tensor_zp(node, y)
    branches = []
    lists = "scale_value" in node.params
    for i, t in enumerate(node.inputs):
        v = codes(g, t, perm)
        if lists:
            ratio = int(node.params["scale_value"][i]) * 2.0 ** -int(node.params["shift_value"][i])
            v = g.add("Round", [g.add("Mul", [v, double(g, node, f"input{i}_multiplier", ratio)])])
        else:  # the integers themselves: x_i (IR) + zp_out
            shift = zp_out - tensor_zp(node, t)
            v = v if shift == 0 else g.add("Add", [v, double(g, node, f"input{i}_offset", float(shift))])
        branches.append(v)
    requantize(g, node, g.add("Concat", branches, axis=axis), 1.0, perm)
    return True


def crelu(g: QDQGraph, node: PyNode, perm: Perm, axis: int) -> bool:
    """requant(concat(max(x', 0), max(-x', 0))) along `axis`, x' = x + zp_in, in float64."""
    mult, shift = requant_of(node)
    if not g.unit_domain or isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor):
        return False
    v = codes(g, node.inputs[0], perm)
    zero = double(g, node, "zero", 0.0)
    both = g.add("Concat", [g.add("Max", [v, zero]), g.add("Max", [g.add("Neg", [v]), zero])], axis=axis)
    requantize(g, node, both, int(mult) * 2.0 ** -int(shift), perm)
    return True


def reduce_sum(g: QDQGraph, node: PyNode, method: str, perm: Perm, axes: Sequence[int], keepdims: bool,
               out_perm: Perm, count: int) -> bool:
    """Reduce SUM/MEAN/L1: requant(Σ X_j) (Σ |X_j| for L1) over the `count` reduced values, in float64; L2:
    requant(isqrt(Σ X_j² · 4^f), M, N + f) with the integer square root in int64."""
    if not g.unit_domain or method not in ("SUM", "MEAN", "L1", "L2"):
        return False
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor) \
            or not fits_double(count * offset_absmax(node, node.inputs[0]) * abs(int(mult))):
        return False
    if method == "L2":  # R = isqrt(Σ X² · 4^f), requant(R, M, N + f)
        frac = int(node.get_param("sqrt_fraction_bits"))
        x = g.add("Cast", [codes(g, node.inputs[0], perm)], to=INT64)
        squares = g.add("ReduceSum", [g.add("Mul", [x, x]), g.ints(f"{node.name}/axes", axes)], keepdims=int(keepdims))
        scaled = g.add("Mul", [squares, g.const(f"{node.name}/sqrt_scale", np.array(4 ** frac, dtype=np.int64))])
        root = g.add("Cast", [isqrt_int64(g, node, scaled)], to=DOUBLE)
        requantize(g, node, root, int(mult) * 2.0 ** -(int(shift) + frac), out_perm)
        return True
    v = codes(g, node.inputs[0], perm)
    v = g.add("Abs", [v]) if method == "L1" else v
    total = g.add("ReduceSum", [v, g.ints(f"{node.name}/axes", axes)], keepdims=int(keepdims))
    requantize(g, node, total, int(mult) * 2.0 ** -int(shift), out_perm)
    return True


def round_div_int64(g: QDQGraph, node: PyNode, value: str, den: str) -> str:
    """round_half_even(value / den) for int64 `value` and den > 0 (broadcast; 2·den below 2^63): floor division
    from ONNX's truncating Div, then the remainder decides (above half, or half with an odd quotient: up)."""
    truncated = g.add("Div", [value, den])
    rest = g.add("Sub", [value, g.add("Mul", [truncated, den])])
    negative = g.add("Less", [rest, int64(g, node, "zero", 0)])
    quotient = g.add("Where", [negative, g.add("Sub", [truncated, int64(g, node, "one", 1)]), truncated])
    twice_rest = g.add("Mul", [g.add("Where", [negative, g.add("Add", [rest, den]), rest]), int64(g, node, "two", 2)])
    odd = g.add("Equal", [g.add("Mod", [quotient, int64(g, node, "two_mod", 2)]), int64(g, node, "one_odd", 1)])
    up = g.add("Or", [g.add("Greater", [twice_rest, den]), g.add("And", [g.add("Equal", [twice_rest, den]), odd])])
    return g.add("Add", [quotient, g.add("Cast", [up], to=INT64)])


def div(g: QDQGraph, node: PyNode, perm: Optional[Perm]) -> bool:
    """Div by the reciprocal table (docs/semantics/binary.md, either form) in int64: for every possible divisor
    magnitude D the table entry and the total shift (exact form N + P + e, upstream's form N) are precomputed
    (Gather), so out = rs(sign(Y) · X · lut(D) · M, shift) exactly."""
    if not g.unit_domain or "lut" not in node.constants:
        return False
    a, b = node.inputs
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor) or isinstance(shift, torch.Tensor):
        return False
    table = node.get_constant("lut").betensor.to(torch.int64).flatten()
    size = table.numel()
    t = size.bit_length() - 1
    emax_b = offset_absmax(node, b)
    if size < 2 or 2 ** t != size or emax_b >= 1 << 20 or offset_absmax(node, a) * int(table.max()) * abs(int(mult)) \
            >= 2 ** 62:
        return False
    d = torch.arange(emax_b + 1, dtype=torch.int64)
    if "reciprocal_shift" not in node.params:  # upstream's form: the table over the divisor's codes, one shift
        qmin, qmax = quant_of(node).get(b).qmin, quant_of(node).get(b).qmax
        entries = lookup_lut(d, table, 0, max(1, (int(qmax) - int(qmin)).bit_length()), 16, False)
        total_shift = torch.full_like(d, int(shift))
    else:
        e = torch.clamp(bit_length(d) - t, min=0)
        half = torch.where(e > 0, torch.ones_like(e) << torch.clamp(e - 1, min=0), torch.zeros_like(e))
        idx = (d + half) >> e
        carry = idx >= size
        idx = torch.where(carry, torch.full_like(idx, size // 2), idx)
        total_shift = int(shift) + int(node.get_param("reciprocal_shift")) + e + carry.to(torch.int64)
        entries = table[idx]
    if int(total_shift.min()) < 0 or int(total_shift.max()) > 61:  # a shift of 0 divides by 1: exact too
        return False
    reciprocal = (entries * int(mult)).numpy()
    powers = (torch.ones_like(total_shift) << total_shift).numpy()

    def ints(t_: PyTensor) -> str:
        return g.add("Cast", [codes(g, t_, perm)], to=INT64)

    x, y = ints(a), ints(b)
    magnitude = g.add("Abs", [y])
    product = g.add("Mul", [g.add("Mul", [g.add("Sign", [y]), x]),
                            g.add("Gather", [g.const(f"{node.name}/reciprocals", reciprocal), magnitude], axis=0)])
    power = g.add("Gather", [g.const(f"{node.name}/powers", powers), magnitude], axis=0)
    result = round_div_int64(g, node, product, power)
    g.quantize(node.outputs[0], g.add("Cast", [result], to=FLOAT), perm, unit=True)
    return True


def bit_length_int64(g: QDQGraph, node: PyNode, value: str, what: str) -> str:
    """bit_length of non-negative int64 values (below 2^62): how many powers of two 2^0 .. 2^62 they reach."""
    powers = g.const(f"{node.name}/{what}_powers", np.array([1 << k for k in range(63)], dtype=np.int64))
    reached = g.add("GreaterOrEqual", [g.add("Unsqueeze", [value, g.ints(f"{node.name}/{what}_last", [-1])]),
                                       powers])
    return g.add("ReduceSum", [g.add("Cast", [reached], to=INT64), g.ints(f"{node.name}/{what}_axis", [-1])],
                 keepdims=0)


def isqrt_int64(g: QDQGraph, node: PyNode, n: str) -> str:
    """The largest r with r² <= n, for int64 0 <= n < 2^62: floor of the float64 square root, corrected twice."""
    one = g.const(f"{node.name}/isqrt_one", np.array(1, dtype=np.int64))
    r = g.add("Cast", [g.add("Floor", [g.add("Sqrt", [g.add("Cast", [n], to=DOUBLE)])])], to=INT64)
    for _ in range(2):
        r = g.add("Where", [g.add("Greater", [g.add("Mul", [r, r]), n]), g.add("Sub", [r, one]), r])
        up = g.add("Add", [r, one])
        r = g.add("Where", [g.add("LessOrEqual", [g.add("Mul", [up, up]), n]), up, r])
    return r


def shared_perm(g: QDQGraph, tensors: Sequence[PyTensor], rank: int) -> Optional[Perm]:
    """A layout every input has when all share the output's rank (numpy broadcasting survives one common
    transpose), else None: the IR layout, where inputs of lower rank broadcast from the right."""
    if any(g.rank(t) != rank for t in tensors):
        return None
    return g.common_perm(list(tensors), rank)
