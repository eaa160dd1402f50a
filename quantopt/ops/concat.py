"""Concat along `axis` (negative counts from the end): float forward, quantization and integer forward."""
from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.hardware import FLT_EPSILON
from ..quant.requant import (
    MAGIC_SCALED_BOUND,
    biased_scaled_into,
    exact_int64_,
    finish_biased_,
    requantize_int,
    scale_shift,
)
from ..quant.rounding import FLOAT64_EXACT
from ..registry import declare_op
from ..registry.schema import Int, Param, Value
from ._eltwise_int import check_int64_bound, offset_absmax, offset_value
from ._lut_int import CODE_TABLE_MAX_CODES, take_codes
from ._per_channel import is_per_channel
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    quantize_activation,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, keeps_float64
from .onnx_build import exact as onnx_exact
from .onnx_build.perms import channels_first
from .onnx_build.qdq_graph import QDQGraph, node_error, same_qparams

REQUANT_KEYS = ("scale_value", "shift_value", "scale_type", "shift_type")

CONCAT = declare_op(
    "Concat",
    params={"axis": Param(Int(), "the axis the inputs are joined on (negative counts from the end)", required=True),
            "scale": Param(Value(), "written by some Parser versions; not read")},
    constants={"weights": "written by some Parser versions; not read"},
    integer="passthrough within unify_scales_for_concat_threshold, else per-branch multiplier and shift",
    semantics="integer-semantics.md#concat")


def _batch_broadcast(xs: List[torch.Tensor], axis: int) -> List[torch.Tensor]:
    """Inputs stored with batch 1 (constants) follow the actual batch of the others when not joining on dim 0."""
    if axis == 0 or len({x.shape[0] for x in xs}) <= 1:
        return xs
    batch = max(x.shape[0] for x in xs)
    return [x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 else x for x in xs]


def _concat(node: PyNode, xs: List[torch.Tensor]) -> torch.Tensor:
    if not xs:
        raise node._error("Concat needs at least one input")
    ranks = {x.dim() for x in xs}
    if len(ranks) != 1:
        raise node._error(f"inputs have different ranks: {[list(x.shape) for x in xs]}")
    axis = axis_param(node, node.get_param("axis"), ranks.pop())
    xs = _batch_broadcast(xs, axis)
    try:
        return torch.cat(xs, dim=axis)
    except RuntimeError:
        raise node._error(f"input shapes {[list(x.shape) for x in xs]} cannot be concatenated on axis {axis}") \
            from None


@CONCAT.forward
@keeps_float64()
def concat_forward(self: PyNode) -> None:
    if self.quantized:
        self.outputs[0].betensor = concat_int_forward(self)
        return
    self.outputs[0].betensor = _concat(self, [t.betensor for t in self.inputs])


def concat_int_forward(node: PyNode) -> torch.Tensor:
    """Integer forward from the IR only (docs/integer-semantics.md), exact in int64.

    With `scale_value`/`shift_value` lists: y_i = clamp(round_half_even((x_i + zp_i) * M_i * 2^-shift_i) - zp_out,
    qmin, qmax) per branch. Without them every branch passes through unchanged (clamped to the output range,
    which only matters for a branch wider than the output).
    """
    out = node.outputs[0]
    qmin, qmax = out_range(node, out)
    if "scale_value" not in node.params:
        return torch.clamp(_concat(node, [int_value(t) for t in node.inputs]), qmin, qmax)
    mults, shifts = node.params.get("scale_value"), node.params.get("shift_value")
    count = len(node.inputs)
    if not isinstance(mults, (list, tuple)) or not isinstance(shifts, (list, tuple)) or \
            len(mults) != count or len(shifts) != count:
        raise node._error(f"quantized Concat needs scale_value and shift_value lists of {count} integers (one per "
                          f"input), got {mults!r} and {shifts!r}")
    zp_out = tensor_zp(node, out)
    tabled = _concat_tabled(node, mults, shifts, zp_out, qmin, qmax)
    if tabled is not None:
        return tabled
    fast = _concat_float64(node, mults, shifts, zp_out, qmin, qmax)
    if fast is not None:
        return fast
    ys = []
    for t, m, sh in zip(node.inputs, mults, shifts):
        check_int64_bound(node, offset_absmax(node, t) * abs(int(m)), f"branch '{t.name}' times its multiplier")
        ys.append(requantize_int(int_value(t) + tensor_zp(node, t), int(m), int(sh), zp_out, qmin, qmax))
    return _concat(node, ys)


CONCAT_TABLE_MIN_ELEMENTS = 1 << 12
"""Concats of fewer output elements than this requantize by arithmetic: the tables' lookups cost more there."""


def _concat_tabled(node: PyNode, mults: Sequence[Any], shifts: Sequence[Any], zp_out: int, qmin: int,
                   qmax: int) -> Optional[torch.Tensor]:
    """The requantized concatenation with each branch read from a memoized table of its codes' results, where every
    branch has at most 2^16 codes (`requantize_int` of every code: the same integers, one gather per element
    instead of the requantization's passes); None (for the arithmetic) for a small output, a wider branch or a
    code outside its branch's range (`take_codes`)."""
    ranges = [out_range(node, t) for t in node.inputs]
    if sum(t.betensor.numel() for t in node.inputs) < CONCAT_TABLE_MIN_ELEMENTS or \
            any(not 0 < hi - lo + 1 <= CODE_TABLE_MAX_CODES for lo, hi in ranges):
        return None
    codes = [int_value(t) for t in node.inputs]  # converted only where the tables apply
    ys = []
    for i, (t, c, (lo, hi), m, sh) in enumerate(zip(node.inputs, codes, ranges, mults, shifts)):
        build = functools.partial(_branch_table, node, t, lo, hi, int(m), int(sh), zp_out, (qmin, qmax), c.device)
        table = memo(node, f"concat_branch_table_{i}", (layer_key(node), str(c.device)), build)
        y = take_codes(table, c, lo)
        if y is None:
            return None
        ys.append(y)
    return _concat(node, ys)


def _branch_table(node: PyNode, t: PyTensor, lo: int, hi: int, m: int, sh: int, zp_out: int,
                  out_range_: Tuple[int, int], device: torch.device) -> torch.Tensor:
    """`requantize_int` of every code lo..hi of branch `t` to the output: the branch's table (`_concat_tabled`)."""
    check_int64_bound(node, offset_absmax(node, t) * abs(m), f"branch '{t.name}' times its multiplier")
    every = torch.arange(lo, hi + 1, dtype=torch.int64, device=device) + tensor_zp(node, t)
    return requantize_int(every, m, sh, zp_out, *out_range_).to(torch.int64).contiguous()


def _concat_float64(node: PyNode, mults: Sequence[Any], shifts: Sequence[Any], zp_out: int, qmin: int,
                    qmax: int) -> Optional[torch.Tensor]:
    """`requantize_int` per branch and the concatenation, bit for bit, in float64 with one new map per branch and
    one for the result (instead of four per branch), when the stored ranges prove every product exact:
    max|x + zp| * |M| < 2^53 (the values are held within their ranges, as `offset_value` relies on) and |shift| < 900;
    None otherwise (and for float-held inputs), for the general path."""
    if any(t.betensor.is_floating_point() for t in node.inputs):
        return None
    for t, m, sh in zip(node.inputs, mults, shifts):
        check_int64_bound(node, offset_absmax(node, t) * abs(int(m)), f"branch '{t.name}' times its multiplier")
        if offset_absmax(node, t) * abs(int(m)) >= FLOAT64_EXACT or not -900 < int(sh) < 900:
            return None
    xs = [offset_value(node, t, torch.float64) for t in node.inputs]
    # the factor as requantize_float64 forms it: M * 2^-shift, exact in float64
    factors = [math.ldexp(float(int(m)), -int(sh)) for m, sh in zip(mults, shifts)]
    small = all(_scaled_below_2_50(offset_absmax(node, t) * abs(int(m)), int(sh))
                for t, m, sh in zip(node.inputs, mults, shifts))
    scaled = _concat_scaled(node, xs, factors, zp_out, qmin, qmax) if small else None
    if scaled is not None:
        return scaled
    ys = [x.mul_(f).round_().sub_(float(zp_out)).clamp_(float(qmin), float(qmax)) for x, f in zip(xs, factors)]
    return exact_int64_(_concat(node, ys).contiguous(), qmin, qmax)


def _scaled_below_2_50(bound: int, shift: int) -> bool:
    """Whether bound · 2^-shift < 2^50 (a branch's |(x + zp) · M| bound and its shift), in exact integers."""
    return bound < 1 << (50 + shift) if shift >= 0 else bound << -shift < 1 << 50


def _concat_scaled(node: PyNode, xs: List[torch.Tensor], factors: Sequence[float], zp_out: int, qmin: int,
                   qmax: int) -> Optional[torch.Tensor]:
    """`_concat_float64`'s result where the rounding by addition applies (`requantize_scaled_`: the caller proved
    every |x·f| < 2^50; the output range small): each branch's 1.5·2^52 + x·f written straight into its slice of
    one float64 output, then one clamp and the bit-pattern conversion for the whole: five passes per element
    instead of nine, and no concatenation of its own. None (for the caller's path) where the output range is too
    wide or the shapes do not line up."""
    if not xs or max(abs(qmin), abs(qmax)) + abs(zp_out) >= MAGIC_SCALED_BOUND:
        return None
    rank = xs[0].dim()
    if any(x.dim() != rank for x in xs) or rank == 0:
        return None
    axis = axis_param(node, node.get_param("axis"), rank)
    xs = _batch_broadcast(xs, axis)
    rest = {tuple(d for i, d in enumerate(x.shape) if i != axis) for x in xs}
    if len(rest) != 1:
        return None
    shape = list(xs[0].shape)
    shape[axis] = sum(int(x.shape[axis]) for x in xs)
    out = torch.empty(shape, dtype=torch.float64, device=xs[0].device)
    start = 0
    for x, f in zip(xs, factors):
        biased_scaled_into(out.narrow(axis, start, int(x.shape[axis])), x, f)
        start += int(x.shape[axis])
    return finish_biased_(out, zp_out, qmin, qmax)


def _same_quantization(node: PyNode, inputs: List, signed: bool) -> bool:
    first = inputs[0]
    table = quant_of(node)
    q0 = table.get(first)

    def alike(t: PyTensor) -> bool:
        q = table.get(t)
        return (tensor_scale(node, t) == tensor_scale(node, first) and tensor_zp(node, t) == tensor_zp(node, first) and
                (q.qmin, q.qmax, q.qbits) == (q0.qmin, q0.qmax, q0.qbits) and is_signed(node, t) == signed)
    return all(alike(t) for t in inputs)


@CONCAT.quantize
def concat_quantize(self: PyNode) -> None:
    """Output params and per-branch requantization (docs/integer-semantics.md, Concat).

    Output bits = the widest branch, signed if any branch is (or `force_dtype_int`). Identically quantized
    branches: the output copies their params. All-integer branches: integer output (scale 1). Otherwise output
    params from the calibrated output range. If all branch and output scales are within `concat_threshold`
    (max/min) and all zero points are equal, nothing is written and values pass through; else one multiplier
    and shift per branch for s_out / s_i, computed with the output bits.
    """
    ins = list(self.inputs)
    out = self.outputs[0]
    s = layer_settings(self)
    check_quantized_inputs(self, ins)
    for key in REQUANT_KEYS:
        self.params.pop(key, None)
    if s.unify_scales_for_kvc_concat and _kv_cache_concat(self):
        return
    if any(is_per_channel(self, t) for t in ins):
        _concat_channels(self, ins, out)
        return
    table = quant_of(self)
    bits = max(int(table.get(t).qbits or 8) for t in ins)
    signed = any(is_signed(self, t) for t in ins) or bool(s.force_dtype_int)
    if all(table.get(t).qinvariant for t in ins):
        set_qinvariant(self, out, bits, signed)
        return
    if any(table.get(t).qinvariant for t in ins):
        OPT_WARN(f"layer '{self.name}' (Concat): some inputs are integers (scale 1) and others are quantized; the "
                 "integer inputs are requantized like tensors of scale 1")
    if _same_quantization(self, ins, signed):
        copy_params(self, out, ins[0])
    else:
        quantize_activation(self, out, signed, bits)
    s_out = tensor_scale(self, out)
    scales = [tensor_scale(self, t) for t in ins] + [s_out]
    zps = [tensor_zp(self, t) for t in ins] + [tensor_zp(self, out)]
    if max(scales) / (min(scales) + FLT_EPSILON) <= float(s.concat_threshold) and len(set(zps)) == 1:
        return
    mults, shifts, mtypes, stypes = [], [], [], []
    for t in ins:
        ratio = torch.tensor(s_out, dtype=torch.float32) / torch.tensor(tensor_scale(self, t), dtype=torch.float32)
        m, sh, mdt, sdt = scale_shift(ratio, int(table.get(out).qbits), force_shift_positive=s.force_shift_positive)
        mults.append(int(m))
        shifts.append(int(sh))
        mtypes.append(mdt)
        stypes.append(sdt)
    self.params["scale_value"] = mults
    self.params["shift_value"] = shifts
    self.params["scale_type"] = mtypes
    self.params["shift_type"] = stypes

def _kv_cache_concat(node: PyNode) -> bool:
    """`unify_scales_for_kvc_concat`: a key/value-cache Concat joins a computed tensor with the cache fed back from
    the previous step (graph Inputs) or an empty cache (Constants of zeros), and its output is fed back as the next
    step's cache. The cache inputs and the output then take the computed input's quantization, so the cache keeps
    one scale from step to step and the Concat moves integers only; a zero Constant is stored as the integer of 0
    under those params. Applies when the inputs come from exactly two kinds of layer, one of them Input or
    Constant, every Constant holds zeros, and the computed inputs share one quantization; returns whether it did."""
    cache = [t for t in node.inputs if t.pnode is not None and str(t.pnode.type) in ("Input", "Constant")]
    computed = [t for t in node.inputs if t not in cache]
    kinds = {str(t.pnode.type) if t.pnode is not None else "" for t in node.inputs}
    if not cache or not computed or len(kinds) != 2:
        return False
    real = computed[0]
    if is_per_channel(node, real) or \
            not all(_same_quantization(node, [t, real], is_signed(node, real)) for t in computed):
        OPT_WARN(f"layer '{node.name}' (Concat): unify_scales_for_kvc_concat needs its computed inputs quantized "
                 "alike (one per-tensor scale); quantized as a plain Concat")
        return False
    for t in cache:
        if str(t.pnode.type) == "Constant":
            w = t.pnode.get_constant("weights")
            if not bool(((w.betensor.to(torch.int64) + int(tensor_zp(node, t))) == 0).all()):  # dequantizes to 0
                return False
    for t in cache:
        copy_params(node, t, real)
        if str(t.pnode.type) == "Constant":
            constant = t.pnode
            w = constant.get_constant("weights")
            qmin, qmax = out_range(node, real)
            w.betensor = torch.full_like(w.betensor, min(max(-int(tensor_zp(node, real)), qmin), qmax),
                                         dtype=torch.int64)
            w.dtype = real.dtype
            q_real, q_w = quant_of(node).get(real), quant_of(constant).of(w)
            q_w.scale, q_w.zerop, q_w.qmin, q_w.qmax, q_w.qbits = q_real.scale, q_real.zerop, qmin, qmax, q_real.qbits
            constant.params["weights_scale"] = float(tensor_scale(node, real))
            constant.params["weights_zp"] = int(tensor_zp(node, real))
    copy_params(node, node.outputs[0], real)
    return True


def _concat_channels(node: PyNode, ins: List, out) -> None:
    """Branches quantized per channel (ops/_per_channel.py), joined on the channel axis: the integers pass through
    and the output's scales are the branches' scales one after the other (a per-tensor branch repeats its scale
    over its channels). The branches must share one integer type and range and have zero point 0."""
    rank = len(out.ir_shape)
    axis = axis_param(node, node.get_param("axis"), rank)
    if axis != rank - 1:
        raise UnsupportedError(f"layer '{node.name}' (Concat): per-channel quantized inputs are joined on their "
                               f"channel axis ({rank - 1}) only, not axis {axis}")
    first = ins[0]
    table = quant_of(node)
    q0 = table.get(first)
    for t in ins:
        q = table.get(t)
        if (t.dtype, q.qmin, q.qmax) != (first.dtype, q0.qmin, q0.qmax) or \
                (not q.per_channel and tensor_zp(node, t) != 0) or q.qinvariant:
            raise UnsupportedError(f"layer '{node.name}' (Concat): per-channel branches pass through unchanged, so "
                                   f"every branch needs the integer type and range of '{first.name}' and zero point "
                                   f"0; '{t.name}' differs")
    scales = [table.get(t).scale.to(torch.float32).reshape(-1) if table.get(t).per_channel
              else torch.full((int(t.ir_shape[-1]),), tensor_scale(node, t), dtype=torch.float32) for t in ins]
    copy_params(node, out, first)
    q_out = table.of(out)
    q_out.scale, q_out.zerop = torch.cat(scales), 0
    q_out.axis = -1 if q_out.per_channel else None  # the activations' channel axis (ops/_per_channel.py)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@CONCAT.export
def convert_concat(g: QDQGraph, node: PyNode) -> None:
    """Integer Concat when every branch has the output's params (no requantization stored), else float."""
    y = node.outputs[0]
    rank = g.rank(y)
    if any(g.rank(t) != rank for t in node.inputs):
        raise node_error(node, "inputs of different ranks")
    perm = g.common_perm(node.inputs, rank, prefer=channels_first(rank))
    axis = perm.index(axis_param(node, node.get_param("axis"), rank))
    if all(same_qparams(node, t, y) for t in node.inputs):
        g.set_int(y, g.add("Concat", [g.int_value(t, perm) for t in node.inputs], axis=axis), perm)
        return
    if onnx_exact.concat(g, node, perm, axis):
        return
    branches = [g.float_value(t, perm) for t in node.inputs]
    if "scale_value" in node.params:  # per-branch multipliers M_i 2^-N_i for s_out / s_i
        branches = [g.rescale(v, float(m) * 2.0 ** -float(n) * tensor_scale(node, t) / tensor_scale(node, y),
                              f"requant{i}")
                    for i, (v, m, n, t) in enumerate(zip(branches, node.params["scale_value"],
                                                         node.params["shift_value"], node.inputs))]
    g.quantize(y, g.add("Concat", branches, axis=axis), perm)
