"""EmbeddingLookupSparse (TensorFlow's `embedding_lookup_sparse`): rows of an embedding table picked by ids, scaled by
per-id weights and combined per segment (SUM, MEAN or SQRTN). Its float forward records the per-segment sums of the
weighted rows and of the weights as placeholders (their calibrated ranges are part of upstream's quantization).

The output keeps the IR's row count: segment j is row j for j up to the last segment id, later rows are 0 (upstream
returns only the rows up to the last id). The integer forward is upstream's (docs/semantics/embedding.md).
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype
from ..quant.params import integer_range, linear_quant_params
from ..quant.requant import requantize_int
from ..quant.rounding import bit_length
from ..registry import declare_op
from ..registry.schema import DtypeName, Either, Float, Int, Ints, Param, Text, Value, quantized
from ._quant import (
    activation_mode,
    int_value,
    layer_settings,
    out_range,
    quantize_activation,
    requant_scale_shift,
    set_constant,
    set_params,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/embedding.md"

COMBINERS = ("SUM", "MEAN", "SQRTN")
ISQRT_STEPS = 64
"""The inverse square root table samples 2^15 / sqrt(1 + j/64), j = 0 .. 192 (upstream's table)."""

ISQRT_LIMIT_BITS = 15
"""SQRTN: the inverse square root is cut to 15 bits."""

SQRTN_MID_BITS = 16
"""SQRTN: the scaled sums are shifted right by `reciprocal_shift_value` into 16 bits before the inverse square root."""

MEAN_MULT_BITS = 16
"""MEAN's multiplier has 16 bits (upstream's fixed choice); SUM's has the activation bits."""

MEAN_SUM_BITS = 32
"""MEAN: the scaled sums are shifted right until they fit 32 bits, the weight sums until they fit 16 (upstream)."""
MEAN_WEIGHT_BITS = 16

PLACEHOLDERS = ("params_sum", "weights_sum")

EMBEDDING_LOOKUP_SPARSE = declare_op(
    "EmbeddingLookupSparse",
    params={"combiner": Param(Text(choices=COMBINERS), "how the weighted rows of a segment combine", default="MEAN"),
            "max_norm": Param(Either(kinds=(Float(), Text())), "row norm clip; only NONE is supported (as upstream)",
                              default="NONE"),
            "scale_value": quantized(Either(kinds=(Int(lo=0), Ints(lo=0))), "output multiplier M (SQRTN: [M_0, M_1])"),
            "scale_type": quantized(Value("dtype or list of dtypes"), "its dtype(s)"),
            "shift_value": quantized(Either(kinds=(Int(), Ints())), "output shift N (SQRTN: [N_0, N_1])"),
            "shift_type": quantized(Value("dtype or list of dtypes"), "its dtype(s)"),
            "reciprocal_shift_value": quantized(Int(lo=0), "SQRTN: right shift before the inverse square root"),
            "reciprocal_shift_type": quantized(DtypeName(), "its dtype")},
    constants={"lut": "SQRTN: the 193-entry int16 inverse square root table"},
    dtypes="float32 params and weights, integer segment ids and ids → activation bits, signed when the params or "
           "the weights are (or with force_dtype_int)",
    integer="exact integer sums of (p + zp_p)(w + zp_w); SUM requantized, MEAN divided by the weight sum with "
            "truncation, SQRTN times a table inverse square root (as upstream)",
    semantics=f"{SEMANTICS}#embeddinglookupsparse",
    summary="Inputs: params [V, ...], segment ids [N] (sorted), ids [N] into params, weights [N]. Output row j: "
            "the weighted sum of the rows of segment j (SUM), divided by the weights' sum (MEAN) or by the square "
            "root of their squares' sum (SQRTN); 0 for an empty segment.")


def _combiner(node: PyNode) -> str:
    return str(node.get_param("combiner", optional=True, default_value="MEAN")).upper()


def _check_max_norm(node: PyNode) -> None:
    value = node.get_param("max_norm", optional=True, default_value="NONE")
    if str(value).upper() != "NONE":
        raise UnsupportedError(f"layer '{node.name}' (EmbeddingLookupSparse): max_norm {value} is not supported "
                               "(only NONE, as upstream)")


def _index_input(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    if node.quantized:
        if not quant_of(node).get(t).qinvariant:
            raise UnsupportedError(f"layer '{node.name}' (EmbeddingLookupSparse): the {what} input '{t.name}' is a "
                                   "quantized tensor; it must hold exact integers")
        return int_value(t)
    x = t.betensor
    return (torch.trunc(x.to(torch.float64)) if x.is_floating_point() else x).to(torch.int64)


def _lookup(node: PyNode) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(segment id of each entry, the gathered rows, the weights shaped to broadcast over a row, output rows)."""
    if len(node.inputs) != 4 or len(node.outputs) != 1:
        raise node._error(f"needs 4 inputs (params, segment ids, ids, weights) and one output, got "
                          f"{len(node.inputs)} and {len(node.outputs)}")
    if _combiner(node) not in COMBINERS:
        raise node._error(f"combiner must be one of {', '.join(COMBINERS)}")
    _check_max_norm(node)
    table = node.inputs[0].betensor
    if table.dim() < 1:
        raise node._error("params must have at least one dim")
    seg = _index_input(node, node.inputs[1], "segment ids")
    seg = seg[..., 0] if seg.dim() > 1 else seg.reshape(-1)
    ids = _index_input(node, node.inputs[2], "ids").reshape(-1)
    weights = node.inputs[3].betensor.reshape(-1)
    if not seg.numel() == ids.numel() == weights.numel() or seg.numel() == 0:
        raise node._error(f"segment ids, ids and weights must hold the same number (> 0) of entries, got "
                          f"{seg.numel()}, {ids.numel()} and {weights.numel()}")
    if bool(((ids < 0) | (ids >= table.shape[0])).any()):
        raise node._error(f"ids must lie in [0, {int(table.shape[0])}), got {ids.tolist()}")
    if bool((seg < 0).any()) or bool((seg[1:] < seg[:-1]).any()):
        raise node._error(f"segment ids must be non-negative and sorted, got {seg.tolist()}")
    ir_shape = list(node.outputs[0].ir_shape or [])
    rows = int(ir_shape[0]) if ir_shape else int(seg[-1]) + 1
    if int(seg[-1]) >= rows:
        raise node._error(f"segment id {int(seg[-1])} is beyond the output's {rows} rows")
    return seg, table.index_select(0, ids), weights.reshape([-1] + [1] * (table.dim() - 1)), rows


def _segment_sum(values: torch.Tensor, seg: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros([rows] + list(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, seg.to(values.device), values)


def _set_placeholders(node: PyNode, values: List[torch.Tensor]) -> None:
    names = [f"{node.name}/{n}" for n in PLACEHOLDERS]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(n, v.detach().to(torch.float32)) for n, v in zip(names, values)]
        return
    for t, v in zip(node.placeholders, values):
        t.betensor = v.detach().to(torch.float32)


@EMBEDDING_LOOKUP_SPARSE.forward
def embedding_lookup_sparse_forward(self: PyNode) -> None:
    seg, rows_data, w, rows = _lookup(self)
    combiner = _combiner(self)
    out = self.outputs[0]
    if not self.quantized:
        p = rows_data.to(torch.float32)
        wf = w.to(torch.float32)
        sums = _segment_sum(p * wf, seg, rows)
        if combiner == "SUM":
            w_sum = torch.zeros_like(wf)
            y = sums
        else:
            w_sum = _segment_sum(wf if combiner == "MEAN" else wf * wf, seg, rows)
            y = sums / (w_sum if combiner == "MEAN" else torch.sqrt(w_sum))
            y = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
        _set_placeholders(self, [sums, w_sum])
        out.betensor = y
        return
    p_t, w_t = self.inputs[0], self.inputs[3]
    p = rows_data.to(torch.int64) + tensor_zp(self, p_t)
    wq = w.to(torch.int64) + tensor_zp(self, w_t)
    acc = _segment_sum(p * wq, seg, rows)
    qmin, qmax = out_range(self, out)
    if combiner == "SQRTN":
        out.betensor = _sqrtn_int(self, acc, _segment_sum(wq * wq, seg, rows), qmin, qmax)
        return
    m, n = _scalar(self, "scale_value"), _scalar(self, "shift_value")
    if combiner == "SUM":
        out.betensor = requantize_int(acc, m, n, tensor_zp(self, out), qmin, qmax)
        return
    p_signed = out_range(self, p_t)[0] + tensor_zp(self, p_t) < 0
    w_signed = out_range(self, w_t)[0] + tensor_zp(self, w_t) < 0
    scaled = acc * m
    w_sum = _segment_sum(wq, seg, rows)
    pre0 = max(_range_bits(scaled, p_signed) - MEAN_SUM_BITS, 0)
    pre1 = max(_range_bits(w_sum, w_signed) - MEAN_WEIGHT_BITS, 0)
    scaled = torch.clamp(scaled >> pre0, *integer_range(MEAN_SUM_BITS, p_signed))
    w_sum = torch.clamp(w_sum >> pre1, *integer_range(MEAN_WEIGHT_BITS, w_signed))
    w_sum = w_sum.expand_as(scaled)
    safe = torch.where(w_sum != 0, w_sum, torch.ones_like(w_sum))
    quotient = torch.where(w_sum != 0, torch.div(scaled, safe, rounding_mode="trunc"), torch.zeros_like(scaled))
    out.betensor = requantize_int(quotient, 1, n - pre0 + pre1, tensor_zp(self, out), qmin, qmax)


def _scalar(node: PyNode, key: str) -> int:
    value = node.get_param(key)
    if isinstance(value, (list, tuple)):
        raise node._error(f"'{key}' must be one integer for combiner {_combiner(node)}, got {value!r}")
    return int(value)


def _pair(node: PyNode, key: str) -> List[int]:
    value = node.get_param(key)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise node._error(f"'{key}' must be a list of 2 integers for combiner SQRTN, got {value!r}")
    return [int(v) for v in value]


def isqrt_table() -> torch.Tensor:
    """Entry j = min(32767, round(2^15 / sqrt(1 + j/64))), j = 0 .. 192 (int64)."""
    m = 1.0 + torch.arange(3 * ISQRT_STEPS + 1, dtype=torch.float64) / ISQRT_STEPS
    return torch.clamp(torch.round(2.0 ** 15 / torch.sqrt(m)), max=2 ** 15 - 1).to(torch.int64)


def inverse_sqrt(v: torch.Tensor, table: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(R, E) with R · 2^(E - 31) ≈ 1 / sqrt(v) for int64 v >= 0, R < 2^15 (docs/semantics/embedding.md, SQRTN)."""
    if int(table.numel()) != 3 * ISQRT_STEPS + 1:
        raise ValueError(f"the inverse square root table has {int(table.numel())} entries, {3 * ISQRT_STEPS + 1} "
                         "expected")
    t = table.to(device=v.device, dtype=torch.int64).reshape(-1)  # the table is indexed by `v`'s device indices
    over = torch.clamp(bit_length(v) - 31, min=0)
    over = over + (over & 1)
    u0 = v >> over
    k = torch.clamp(31 - bit_length(u0), 0, 30)
    e = 31 - k
    u = u0 << k
    f = torch.where(e % 2 == 1, u >> 1, u)
    i = torch.clamp((f >> 23) - ISQRT_STEPS, min=0)
    a = (f >> 8) & (2 ** 15 - 1)
    g = ((t[i] << 16) - ((t[i] - t[i + 1]) * a << 1)) >> ((e - 1) >> 1)
    # upstream's ceil(log2 g) in float32: g rounded to float32, its logarithm rounded to float32 (a g just above a
    # power of two can count as that power, and then saturates the 15-bit cut below: documented)
    log = torch.log2(g.to(torch.float32).to(torch.float64)).to(torch.float32)
    cut = torch.clamp(torch.ceil(log).to(torch.int64) - ISQRT_LIMIT_BITS, min=0)
    return torch.clamp(g >> cut, 0, 2 ** ISQRT_LIMIT_BITS - 1), cut - over // 2


def _sqrtn_int(node: PyNode, acc: torch.Tensor, squares: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """SQRTN's integer forward (docs/semantics/embedding.md)."""
    (m0, m1), (n0, n1) = _pair(node, "scale_value"), _pair(node, "shift_value")
    pre = int(node.get_param("reciprocal_shift_value"))
    if "lut" not in node.constants:
        raise node._error("quantized layer lacks its 'lut' constant")
    p_t, out = node.inputs[0], node.outputs[0]
    p_signed = out_range(node, p_t)[0] + tensor_zp(node, p_t) < 0
    x = requantize_int(acc, m0, n0, 0, *integer_range(int(quant_of(node).get(p_t).qbits), p_signed))
    try:
        r, e = inverse_sqrt(squares, node.constants["lut"].betensor)
    except ValueError as err:
        raise node._error(f"lut: {err}") from None
    i32 = integer_range(32, True)
    x = torch.clamp(torch.clamp(x * m1, *i32) >> pre, *integer_range(SQRTN_MID_BITS, True))
    x = torch.clamp(x * r, *i32)
    return requantize_int(x, 1, n1 + 31 - pre - e, tensor_zp(node, out), qmin, qmax)


def _range_bits(x: torch.Tensor, force_signed: bool) -> int:
    """The fewest bits holding [min(x), max(x)]: signed when min(x) < 0 or forced (upstream `range2bits`)."""
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or force_signed:
        bits = 1
        while lo < -(1 << (bits - 1)) or hi > (1 << (bits - 1)) - 1:
            bits += 1
        return bits
    return hi.bit_length()


@EMBEDDING_LOOKUP_SPARSE.quantize
def embedding_lookup_sparse_quantize(self: PyNode) -> None:
    """Output from its calibrated range (activation bits and mode; signed when the params or the weights are);
    the placeholders symmetric (params_sum signed like the output, weights_sum like the weights); SUM:
    (M, N) ≈ s_out / (s_params · s_weights) with the activation bits; MEAN: ≈ s_out / s_params with 16 bits;
    SQRTN: two multipliers through the params_sum placeholder's scale and the table."""
    combiner = _combiner(self)
    _check_max_norm(self)
    p_t, seg_t, ids_t, w_t = self.inputs
    table = quant_of(self)
    for t, what in ((seg_t, "segment ids"), (ids_t, "ids")):
        if not table.get(t).qinvariant:
            raise UnsupportedError(f"layer '{self.name}' (EmbeddingLookupSparse): the {what} input '{t.name}' is a "
                                   "quantized tensor; it must hold exact integers")
    for t in (p_t, w_t):
        if table.get(t).qmin is None:
            raise self._error(f"input '{t.name}' is not quantized; quantize the producer first")
        if table.get(t).per_channel:
            raise UnsupportedError(f"layer '{self.name}' (EmbeddingLookupSparse): input '{t.name}' has per-channel "
                                   "quantization; this op needs per-tensor scales")
    if table.get(p_t).qinvariant or table.get(w_t).qinvariant:
        OPT_WARN(f"layer '{self.name}' (EmbeddingLookupSparse): an integer params or weights input is treated as a "
                 "tensor of scale 1")
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    p_signed = out_range(self, p_t)[0] + tensor_zp(self, p_t) < 0
    w_signed = out_range(self, w_t)[0] + tensor_zp(self, w_t) < 0
    mode = activation_mode(self, bits).to_symmetric()
    names = [f"{self.name}/{n}" for n in PLACEHOLDERS]
    if [t.name for t in self.placeholders] != names:
        raise self._error(f"placeholders {names} are missing: the layer's float forward must run before quantization "
                          "(statistic files written before quantopt collected placeholders lack them: collect again)")
    for t, signed in zip(self.placeholders, (p_signed or w_signed, w_signed)):
        r = ranges_of(self).get(t)
        if r.min is None or r.max is None:
            raise self._error(f"placeholder '{t.name}' has no calibrated range (collect the statistics again)")
        set_params(self, t, linear_quant_params(r.min, r.max, bits, mode, signed), bits)
    out = self.outputs[0]
    quantize_activation(self, out, p_signed or w_signed, bits)
    s_p, s_w, s_o = (torch.tensor(tensor_scale(self, t), dtype=torch.float32) for t in (p_t, w_t, out))
    for key in ("reciprocal_shift_value", "reciprocal_shift_type"):
        self.params.pop(key, None)
    self.constants.pop("lut", None)
    if combiner == "SQRTN":
        _sqrtn_quantize(self, s_p, s_w, s_o, bits)
        return
    if combiner == "SUM":
        m, n, m_type, n_type = requant_scale_shift(self, s_o / (s_p * s_w), mult_bits=bits)
    else:
        m, n, m_type, n_type = requant_scale_shift(self, s_o / s_p, mult_bits=MEAN_MULT_BITS)
    self.params["shift_value"] = int(n)
    self.params["shift_type"] = n_type
    self.params["scale_value"] = int(m)
    self.params["scale_type"] = m_type



def _sqrtn_quantize(node: PyNode, s_p: torch.Tensor, s_w: torch.Tensor, s_o: torch.Tensor, bits: int) -> None:
    """SQRTN: (M_0, N_0) ≈ s_ps / (s_params · s_weights), (M_1, N_1) ≈ s_out · s_weights / s_ps (s_ps the params_sum
    placeholder's scale, activation bits), the pre-shift that keeps the scaled sums in 16 bits, the table."""
    plh = node.placeholders[0]
    s_ps = torch.tensor(tensor_scale(node, plh), dtype=torch.float32)
    m0, n0, t_m0, t_n0 = requant_scale_shift(node, s_ps / (s_p * s_w), mult_bits=bits)
    m1, n1, t_m1, t_n1 = requant_scale_shift(node, s_o * s_w / s_ps, mult_bits=bits)
    scale_bits = (int(m1) - 1).bit_length() if int(m1) >= 1 else 0  # ceil(log2 M_1)
    q_plh = quant_of(node).get(plh)
    in_bits = int(q_plh.qbits) + (0 if int(q_plh.qmin) < 0 else 1)
    node.params["reciprocal_shift_value"] = max(in_bits + scale_bits - SQRTN_MID_BITS, 0)
    node.params["reciprocal_shift_type"] = Dtype.INT8
    node.params["shift_value"] = [int(n0), int(n1)]
    node.params["shift_type"] = [t_n0, t_n1]
    node.params["scale_value"] = [int(m0), int(m1)]
    node.params["scale_type"] = [t_m0, t_m1]
    set_constant(node, "lut", isqrt_table(), Dtype.INT16)
