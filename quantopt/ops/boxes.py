"""Box post-processing: GetValidCount (score/id filtering of box rows), FilterBoxes (per-class score and minimum-size
filtering of grouped boxes), BoundingBox (refinement of proposal boxes by deltas, clipped to [0, 1]),
MultiboxTransformLoc (best-class selection and anchor decoding), Region (YOLOv2 region decoding) and RegionFuse (the
merge of two Region results).

Selections keep upstream's fixed IR shapes: the kept entries first, padding after them, and count outputs. Kept values
move unchanged (passthrough params); every comparison is made exactly on integers with thresholds derived by exact
rational arithmetic. Box decodes use fixed-point sigmoid/exp/delta tables and exact int64 arithmetic with one
rounding (half to even) per output value, to upstream's output params. The integer semantics are in
docs/semantics/boxes.md.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Dict, List, Sequence, Tuple

import torch

from ..config.upstream_defects import REGION_INPUT_ZP
from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.requant import scale_shift
from ..quant.rounding import div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, DtypeName, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._lut_int import range_bits
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    integer_index_input,
    layer_settings,
    out_range,
    refuse_per_channel,
    set_constant,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param

SEMANTICS = "docs/semantics/boxes.md"

INDEX_BITS = 16
"""GetValidCount's count and index outputs are int16 (as upstream; int32 when an index may exceed 32767)."""

BOX_OUT_SCALE = 32767.0
"""BoundingBox's output: int16 with scale 32767 and zero point 0 (boxes clipped to [0, 1]), as upstream."""

BOX_OUT_MAX = 32767

DEFAULT_STD_DIV = [10.0, 10.0, 5.0, 5.0]
"""BoundingBox's default divisors of the deltas (dy, dx, dh, dw)."""

LUT_VALUE_BITS = 24
"""Decode tables hold |value| <= 2^24."""

LUT_MAX_FRAC_BITS = 20

MULT_BITS = 15
SHIFT_MAX = 62


# ------------------------------------------------------------------------------------------------ helpers
def _floor_code(node: PyNode, threshold: float, t: PyTensor) -> int:
    """T with (q + zp) / s > threshold <=> q > T for every integer q: floor(threshold * s - zp), exact rationals;
    -inf gives qmin - 1 (everything passes), +inf qmax (nothing passes)."""
    if math.isinf(threshold):
        return (out_range(node, t)[0] - 1) if threshold < 0 else out_range(node, t)[1]
    return math.floor(Fraction(threshold) * Fraction(tensor_scale(node, t)) - tensor_zp(node, t))


def _index_bits(limit: int) -> int:
    return INDEX_BITS if limit < 2 ** (INDEX_BITS - 1) else 32


def _fill_code(node: PyNode, t: PyTensor, value: float) -> int:
    """The code of the float `value` in `t`'s params: round half to even of value * s - zp, clamped."""
    qmin, qmax = out_range(node, t)
    code = Fraction(value) * Fraction(tensor_scale(node, t)) - tensor_zp(node, t)
    return min(max(round(code), qmin), qmax)


_UPSTREAM_BOX_KEYS: Dict[str, Param] = {
    "box_scale_value": quantized(Ints(), "upstream's multipliers; not read"),
    "box_shift_value": quantized(Ints(), "upstream's shifts; not read"),
    "box_scale_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
    "box_shift_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
    "delta_shift": quantized(Int(), "upstream's pre-shift; not read"),
}
"""The box requantization keys of upstream's decoders (BoundingBox, MultiboxTransformLoc): read, never used."""

_UPSTREAM_BOX_TABLES = {"th_lut": "upstream's decode table; not read", "tw_lut": "upstream's decode table; not read"}


# ------------------------------------------------------------------------------------------------ GetValidCount
GET_VALID_COUNT = declare_op(
    "GetValidCount",
    params={
        "score_threshold": Param(Float(infinite=True), "a row is kept when its score is above it (needed by the float "
                                 "forward and quantization; upstream drops it from quantized IRs)"),
        "score_index": Param(Int(lo=0), "the column holding the score", required=True),
        "id_index": Param(Int(), "the column holding the class id (a row with a negative id is dropped); -1: none",
                          default=-1),
        "score_threshold_value": quantized(Int(), "score_threshold as an exact integer code of the input"),
        "score_threshold_type": quantized(DtypeName(), "the dtype of score_threshold_value (the input's)"),
    },
    integer="exact integer score threshold, id test q + zp >= 0; kept rows passthrough; int16 count and indices",
    dtypes="data any → count int16, rows as input, indices int16 (int32 past 32767 rows)",
    semantics=f"{SEMANTICS}#getvalidcount",
    summary="Input [N, A, L] box rows. Outputs: the number of valid rows [N], the valid rows packed first then -1 "
            "[N, A, L], their row indices then -1 [N, A].")


def _gvc_params(node: PyNode, length: int) -> Tuple[int, int]:
    if len(node.inputs) != 1 or len(node.outputs) != 3:
        raise node._error("expects 1 input (box rows [N, A, L]) and 3 outputs (count, rows, indices)")
    score_index = int(node.get_param("score_index"))
    id_index = int(node.get_param("id_index", optional=True, default_value=-1))
    if score_index >= length or id_index >= length:
        raise node._error(f"score_index {score_index} and id_index {id_index} must be below the row length {length}")
    return score_index, id_index


@GET_VALID_COUNT.forward
def get_valid_count_forward(self: PyNode) -> None:
    """Rows whose score is above score_threshold and (with id_index >= 0) whose id is >= 0, in row order."""
    t = self.inputs[0]
    x = t.betensor
    if x.dim() != 3:
        raise self._error(f"the input must be [N, A, L], got {list(x.shape)}")
    score_index, id_index = _gvc_params(self, int(x.shape[2]))
    if self.quantized:
        v = int_value(t)
        passed = v[:, :, score_index] > int(self.get_param("score_threshold_value"))
        if id_index >= 0:
            passed &= v[:, :, id_index] + tensor_zp(self, t) >= 0
        fill = _fill_code(self, t, -1.0)
        dtype = torch.int64
    else:
        v = x
        passed = v[:, :, score_index] > float(self.get_param("score_threshold"))
        if id_index >= 0:
            passed &= v[:, :, id_index] >= 0
        fill, dtype = -1, x.dtype
    batch, rows = int(x.shape[0]), int(x.shape[1])
    count = torch.zeros(batch, dtype=dtype, device=x.device)
    data = torch.full(tuple(x.shape), fill, dtype=dtype, device=x.device)
    index = torch.full((batch, rows), -1, dtype=dtype, device=x.device)
    for b in range(batch):
        keep = passed[b].nonzero(as_tuple=True)[0]
        n = keep.numel()
        count[b] = n
        data[b, :n] = v[b, keep].to(dtype)
        index[b, :n] = keep.to(dtype)
    for o, val in zip(self.outputs, (count, data, index)):
        o.betensor = val


@GET_VALID_COUNT.quantize
def get_valid_count_quantize(self: PyNode) -> None:
    """Rows keep the input's params; count and indices are int16 (scale 1); the threshold becomes an exact code."""
    t = self.inputs[0]
    check_quantized_inputs(self, self.inputs)
    refuse_per_channel(self, t)
    _gvc_params(self, int(t.ir_shape[2]) if len(t.ir_shape) == 3 else 1 << 30)
    self.params["score_threshold_value"] = _floor_code(self, float(self.get_param("score_threshold")), t)
    self.params["score_threshold_type"] = t.dtype
    rows = int(t.ir_shape[1]) if len(t.ir_shape) > 1 else 1
    set_qinvariant(self, self.outputs[0], _index_bits(rows + 1), True)
    copy_params(self, self.outputs[1], t)
    set_qinvariant(self, self.outputs[2], _index_bits(rows), True)


# ------------------------------------------------------------------------------------------------ FilterBoxes
FILTER_BOXES = declare_op(
    "FilterBoxes",
    params={
        "min_size": Param(Floats(), "[min_h, min_w]: a box is kept when its height and width reach them (quantized: "
                          "integer codes of the box input's units, compared with the box's code differences)",
                          required=True),
        "maxnum": Param(Int(lo=1), "the most boxes kept (the IR size of the box output)", default=5000),
        "score_threshold": Param(Float(infinite=True), "a box is kept when its score is above it (quantized: the "
                                 "exact integer code of the score input)", default=float("-inf")),
    },
    integer="exact integer thresholds (score q > T, size q1 - q0 >= ceil(min * s)); values passthrough",
    dtypes="boxes, scores passthrough; counts/labels as their (integer) inputs",
    semantics=f"{SEMANTICS}#filterboxes",
    summary="Inputs: boxes [N, B, 4] (ymin, xmin, ymax, xmax) grouped by class, scores [N, B], box_num_perclass "
            "[N, C], label_perclass [N, C], total_class_num [N, 1]. Outputs: the kept boxes and scores packed first "
            "(0 after), kept boxes per class, their labels, the number of classes with kept boxes.")


def _fb_params(node: PyNode) -> Tuple[float, float, int, float]:
    if len(node.inputs) != 5 or len(node.outputs) != 5:
        raise node._error("expects 5 inputs (boxes, scores, box_num_perclass, label_perclass, total_class_num) and "
                          "5 outputs")
    ms = node.get_param("min_size")
    if not isinstance(ms, (list, tuple)) or len(ms) != 2:
        raise node._error(f"min_size must list 2 numbers [min_h, min_w], got {ms!r}")
    maxnum = int(node.get_param("maxnum", optional=True, default_value=5000))
    thr = float(node.get_param("score_threshold", optional=True, default_value=float("-inf")))
    return float(ms[0]), float(ms[1]), maxnum, thr


def _fb_select(node: PyNode, boxes: torch.Tensor, scores: torch.Tensor, per_class: torch.Tensor,
               labels: torch.Tensor, total: torch.Tensor, score_thr: float, min_h: float, min_w: float,
               fill: Tuple[float, float]) -> List[torch.Tensor]:
    """Class by class over the contiguous blocks: keep boxes with score > score_thr, height >= min_h and width >=
    min_w, packed into at most the box output's IR size (it stops when full)."""
    if boxes.dim() != 3 or boxes.shape[2] != 4 or scores.shape != boxes.shape[:2]:
        raise node._error(f"boxes must be [N, B, 4] and scores [N, B], got {list(boxes.shape)} and "
                          f"{list(scores.shape)}")
    batch, nbox = int(boxes.shape[0]), int(boxes.shape[1])
    cap = min(int(node.get_param("maxnum", optional=True, default_value=5000)),
              int(node.outputs[0].ir_shape[1]) if len(node.outputs[0].ir_shape) > 1 else nbox)
    per_class = per_class.reshape(per_class.shape[0], -1)
    labels = labels.reshape(labels.shape[0], -1)
    total = total.reshape(total.shape[0], -1)
    ncls = int(per_class.shape[1])
    dtype = boxes.dtype
    device = boxes.device
    out_boxes = torch.full((batch, cap, 4), fill[0], dtype=dtype, device=device)
    out_scores = torch.full((batch, cap), fill[1], dtype=scores.dtype, device=device)
    out_num = torch.zeros(batch, ncls, dtype=per_class.dtype, device=device)
    out_lab = torch.zeros(batch, ncls, dtype=labels.dtype, device=device)
    out_total = torch.zeros(batch, 1, dtype=total.dtype, device=device)
    for b in range(batch):
        start = filled = classes = 0
        for c in range(max(0, min(int(total[b % total.shape[0], 0]), ncls))):
            n = max(0, min(int(per_class[b % per_class.shape[0], c]), nbox - start))
            if n == 0:
                continue
            box, sc = boxes[b, start:start + n], scores[b, start:start + n]
            start += n
            ok = (sc > score_thr) & (box[:, 2] - box[:, 0] >= min_h) & (box[:, 3] - box[:, 1] >= min_w)
            keep = ok.nonzero(as_tuple=True)[0][:cap - filled]
            k = keep.numel()
            if k == 0:
                continue
            out_boxes[b, filled:filled + k] = box[keep]
            out_scores[b, filled:filled + k] = sc[keep]
            out_num[b, classes] = k
            out_lab[b, classes] = labels[b % labels.shape[0], c]
            filled += k
            classes += 1
            if filled >= cap:
                break
        out_total[b, 0] = classes
    return [out_boxes, out_scores, out_num, out_lab, out_total]


@FILTER_BOXES.forward
def filter_boxes_forward(self: PyNode) -> None:
    """Per-class score and minimum-size filter of grouped boxes; see the module docstring."""
    min_h, min_w, _, thr = _fb_params(self)
    b_t, s_t, n_t, l_t, t_t = self.inputs
    counts = [integer_index_input(self, t, w) for t, w in ((n_t, "box_num_perclass"), (l_t, "label_perclass"),
                                                 (t_t, "total_class_num"))]
    if self.quantized:
        fill = (_fill_code(self, b_t, 0.0), _fill_code(self, s_t, 0.0))
        outs = _fb_select(self, int_value(b_t), int_value(s_t), *counts, thr, min_h, min_w, fill)
    else:
        outs = _fb_select(self, b_t.betensor, s_t.betensor, *counts, thr, min_h, min_w, (0.0, 0.0))
        outs[2:] = [o.to(t.betensor.dtype) for o, t in zip(outs[2:], (n_t, l_t, t_t))]
    for o, v in zip(self.outputs, outs):
        o.betensor = v


@FILTER_BOXES.quantize
def filter_boxes_quantize(self: PyNode) -> None:
    """Outputs copy their inputs' params; min_size becomes [ceil(min_h * s), ceil(min_w * s)] (s the box scale) and
    score_threshold floor(t * s - zp) of the score input, written in place as upstream does."""
    min_h, min_w, _, thr = _fb_params(self)
    check_quantized_inputs(self, self.inputs)
    b_t, s_t = self.inputs[:2]
    for t in (b_t, s_t):
        refuse_per_channel(self, t)
    for t, w in zip(self.inputs[2:], ("box_num_perclass", "label_perclass", "total_class_num")):
        if not quant_of(self).get(t).qinvariant:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): the {w} input '{t.name}' must hold exact "
                                   "integers (an integer tensor), not quantized values")
    for o, t in zip(self.outputs, self.inputs):
        copy_params(self, o, t)
    s = Fraction(tensor_scale(self, b_t))
    self.params["min_size"] = [math.ceil(Fraction(min_h) * s), math.ceil(Fraction(min_w) * s)]
    self.params["score_threshold"] = _floor_code(self, thr, s_t)


# ------------------------------------------------------------------------------------------------ BoundingBox
BOUNDING_BOX = declare_op(
    "BoundingBox",
    params={
        "std_div": Param(Floats(), "the 4 divisors of the deltas (dy, dx, dh, dw), finite and non-zero",
                         default=DEFAULT_STD_DIV),
        "coordinate_order": Param(Text(choices=("YX", "XY")), "the Parser's coordinate order; only YX (ymin, xmin, "
                                  "ymax, xmax boxes, (dy, dx, dh, dw) deltas) is supported", default="YX"),
        "lut_frac_bits": quantized(Int(lo=0), "fraction bits Lf of the decode tables"),
        "box_out_scale_value": quantized(Int(lo=0), "multiplier of the box requantization"),
        "box_out_shift_value": quantized(Int(), "shift of the box requantization"),
        **_UPSTREAM_BOX_KEYS,
    },
    constants={"lut_ty": "decode table dy / std_div[0] (quantized)",
               "lut_tx": "decode table dx / std_div[1] (quantized)",
               "lut_th": "decode table exp(dh / std_div[2]) (quantized)",
               "lut_tw": "decode table exp(dw / std_div[3]) (quantized)",
               **_UPSTREAM_BOX_TABLES},
    integer="delta tables (d/v, exp(d/v)) in fixed point on integer proposals, one exact requant per coordinate "
            "to int16 scale 32767, clip to [0, 32767]",
    dtypes="proposals, deltas int8/int16 → boxes int16 (scale 32767)",
    semantics=f"{SEMANTICS}#boundingbox",
    summary="Inputs: proposals [N, R, 4] (ymin, xmin, ymax, xmax) and deltas [N, R, 4] (dy, dx, dh, dw). Output: "
            "the refined boxes, clipped to [0, 1].")


def _bb_params(node: PyNode) -> List[float]:
    if len(node.inputs) != 2 or len(node.outputs) != 1:
        raise node._error("expects 2 inputs (proposals, deltas) and 1 output (boxes)")
    order = str(node.get_param("coordinate_order", optional=True, default_value="YX")).upper()
    if order != "YX":
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): coordinate_order {order} is not supported (only "
                               "YX: boxes (ymin, xmin, ymax, xmax), deltas (dy, dx, dh, dw))")
    v = node.get_param("std_div", optional=True, default_value=DEFAULT_STD_DIV)
    if not isinstance(v, (list, tuple)) or len(v) != 4:
        raise node._error(f"std_div must list 4 numbers, got {v!r}")
    vals = [float(x) for x in v]
    if any(not math.isfinite(x) or x == 0 for x in vals):
        raise node._error(f"std_div must hold finite non-zero numbers, got {vals}")
    return vals


def _bb_check(node: PyNode, p: torch.Tensor, d: torch.Tensor) -> None:
    if p.dim() < 2 or p.shape[-1] != 4 or d.shape != p.shape:
        raise node._error(f"proposals and deltas must have the same shape [..., 4], got {list(p.shape)} and "
                          f"{list(d.shape)}")


def bounding_box_float(p: torch.Tensor, d: torch.Tensor, std_div: Sequence[float]) -> torch.Tensor:
    """Proposals (ymin, xmin, ymax, xmax) refined by deltas (dy, dx, dh, dw) / std_div, clipped to [0, 1]."""
    cy, cx = (p[..., 0] + p[..., 2]) / 2.0, (p[..., 1] + p[..., 3]) / 2.0
    h, w = p[..., 2] - p[..., 0], p[..., 3] - p[..., 1]
    y, x = d[..., 0] / std_div[0] * h + cy, d[..., 1] / std_div[1] * w + cx
    hh, ww = torch.exp(d[..., 2] / std_div[2]) * h, torch.exp(d[..., 3] / std_div[3]) * w
    box = torch.stack([y - hh / 2.0, x - ww / 2.0, y + hh / 2.0, x + ww / 2.0], dim=-1)
    return torch.clamp(box, 0.0, 1.0)


def _delta_range(node: PyNode, t: PyTensor) -> float:
    lo, hi = out_range(node, t)
    zp, s = tensor_zp(node, t), tensor_scale(node, t)
    return max(abs(lo + zp), abs(hi + zp)) / s


def _table(fn, lo: int, bits: int, scale: float, zp: int, lf: int, table_bits: int) -> torch.Tensor:
    """2^T + 1 entries (T = table_bits <= bits, b = bits - T) over the codes from lo: entry i is
    round_half_even(fn(x) * 2^Lf) at the code lo + i * 2^b, x = (code + zp) / scale in float64, clamped to +/-2^24."""
    step = 2 ** (bits - table_bits)
    codes = lo + torch.arange(2 ** table_bits + 1, dtype=torch.float64) * step
    x = (codes + zp) / scale
    vmax = 2 ** LUT_VALUE_BITS
    return torch.clamp(torch.round(fn(x) * 2.0 ** lf), -vmax, vmax).to(torch.int64)


def _decode_table(node: PyNode, fn, t: PyTensor, lf: int, table_bits: int) -> torch.Tensor:
    """_table over the codes of tensor t."""
    return _table(fn, out_range(node, t)[0], range_bits(node, t), tensor_scale(node, t), tensor_zp(node, t), lf,
                  table_bits)


def _lookup_table(node: PyNode, key: str, q: torch.Tensor, lo: int, hi_code: int, bits: int) -> torch.Tensor:
    """index = clamp(q, lo, hi) - lo, hi = index >> b, r = index - (hi << b): table[hi] + floor((table[hi + 1] -
    table[hi]) * r / 2^b) (table[index] when b = 0)."""
    table = node.get_constant(key).betensor.to(device=q.device, dtype=torch.int64).reshape(-1)  # indexed by q's
    table_bits = int(round(math.log2(max(table.numel() - 1, 1))))
    if table.numel() != 2 ** table_bits + 1 or table_bits > bits:
        raise node._error(f"table '{key}' must hold 2^T + 1 entries (T <= {bits}), got {table.numel()}")
    b = bits - table_bits
    index = torch.clamp(q, lo, hi_code) - lo
    hi = index >> b
    r = index - (hi << b)
    return table[hi] + (((table[hi + 1] - table[hi]) * r) >> b)


def _lookup(node: PyNode, key: str, q: torch.Tensor, t: PyTensor) -> torch.Tensor:
    lo, hi_code = out_range(node, t)
    return _lookup_table(node, key, q, lo, hi_code, range_bits(node, t))


def _decode_int(node: PyNode, p: torch.Tensor, p_zp: int, d: torch.Tensor, d_t: PyTensor) -> torch.Tensor:
    """Integer decode of delta codes d on proposal codes p (both [..., 4] in y, x order): V = 2 * Ly * h + (y0 + y1 +
    2 zp) * 2^Lf -/+ Le * h (exact int64, Ly/Le the table values), then round_shift(V * M, N) clamped to
    [0, 32767]."""
    lf = int(node.get_param("lut_frac_bits"))
    ly, lx, lh, lw = (_lookup(node, k, d[..., i], d_t) for i, k in enumerate(("lut_ty", "lut_tx", "lut_th",
                                                                               "lut_tw")))
    h, w = p[..., 2] - p[..., 0], p[..., 3] - p[..., 1]
    y2 = 2 * ly * h + ((p[..., 0] + p[..., 2] + 2 * p_zp) << lf)
    x2 = 2 * lx * w + ((p[..., 1] + p[..., 3] + 2 * p_zp) << lf)
    hh, ww = lh * h, lw * w
    v = torch.stack([y2 - hh, x2 - ww, y2 + hh, x2 + ww], dim=-1)
    m, n = int(node.get_param("box_out_scale_value")), int(node.get_param("box_out_shift_value"))
    return torch.clamp(round_shift(v * m, n), 0, BOX_OUT_MAX)


def _quantize_decode(node: PyNode, p_t: PyTensor, d_t: PyTensor, std_div: Sequence[float]) -> None:
    """Decode tables over the delta input's codes with Lf fraction bits and the multiplier/shift of 32767 / (2 * s_p
    * 2^Lf) (s_p the proposal scale)."""
    for t, what in ((p_t, "the proposal/anchor input"), (d_t, "the delta input")):
        refuse_per_channel(node, t)
        if range_bits(node, t) > 16:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): {what} '{t.name}' has {range_bits(node, t)}-"
                                   "bit codes; at most 16 bits are supported")
    tmax = _delta_range(node, d_t)
    biggest = max([tmax / abs(v) for v in std_div[:2]] + [math.exp(min(tmax / abs(v), 80.0)) for v in std_div[2:]])
    lf = min(LUT_MAX_FRAC_BITS, LUT_VALUE_BITS - max(0, math.ceil(math.log2(max(biggest, 1.0)))))
    if lf < 0:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): deltas up to {tmax:g} make exp(delta / divisor) "
                               "too large for the decode tables; calibrate the delta input narrower")
    table_bits = min(range_bits(node, d_t), int(layer_settings(node).lut_items_in_bits))
    for key, div, use_exp in (("lut_ty", std_div[0], False), ("lut_tx", std_div[1], False),
                              ("lut_th", std_div[2], True), ("lut_tw", std_div[3], True)):
        fn = (lambda x, v=div: torch.exp(x / v)) if use_exp else (lambda x, v=div: x / v)
        set_constant(node, key, _decode_table(node, fn, d_t, lf, table_bits), Dtype.INT32)
    node.params["lut_frac_bits"] = lf
    ratio = BOX_OUT_SCALE / (2.0 * tensor_scale(node, p_t) * 2.0 ** lf)
    m, n, _, _ = scale_shift(torch.tensor(ratio, dtype=torch.float32), MULT_BITS, shift_limit=SHIFT_MAX)
    node.params["box_out_scale_value"], node.params["box_out_shift_value"] = int(m), int(n)


def _set_output(node: PyNode, out: PyTensor, scale: float, qmin: int, qmax: int, dtype: Dtype, bits: int) -> None:
    """Fixed output params: `scale`, zero point 0, [qmin, qmax] of `bits` bits, stored as `dtype`."""
    q = quant_of(node).of(out)
    q.scale, q.zerop, q.qmin, q.qmax, q.qbits, q.qinvariant = scale, 0, qmin, qmax, bits, False
    out.dtype, out.ir_range = dtype, None


def _set_box_output(node: PyNode, out: PyTensor) -> None:
    _set_output(node, out, BOX_OUT_SCALE, -32768, 32767, Dtype.INT16, 16)


@BOUNDING_BOX.forward
def bounding_box_forward(self: PyNode) -> None:
    """Float: bounding_box_float. Integer: _decode_int."""
    std_div = _bb_params(self)
    p_t, d_t = self.inputs
    if not self.quantized:
        p, d = p_t.betensor.to(torch.float32), d_t.betensor.to(torch.float32)
        _bb_check(self, p, d)
        self.outputs[0].betensor = bounding_box_float(p, d, std_div)
        return
    p, d = int_value(p_t), int_value(d_t)
    _bb_check(self, p, d)
    self.outputs[0].betensor = _decode_int(self, p, tensor_zp(self, p_t), d, d_t)


@BOUNDING_BOX.quantize
def bounding_box_quantize(self: PyNode) -> None:
    """Decode tables and multiplier (_quantize_decode); the box output int16 with scale 32767."""
    std_div = _bb_params(self)
    check_quantized_inputs(self, self.inputs)
    _quantize_decode(self, self.inputs[0], self.inputs[1], std_div)
    _set_box_output(self, self.outputs[0])


# ------------------------------------------------------------------------------------------------ MultiboxTransformLoc
MULTIBOX = declare_op(
    "MultiboxTransformLoc",
    params={
        "variance": Param(Floats(), "the 4 factors of the deltas (x, y, w, h), finite and non-zero", required=True),
        "score_threshold": Param(Float(infinite=True), "an anchor is kept when its best non-background score is "
                                 "above it (needed by the float forward and quantization; upstream drops it from "
                                 "quantized IRs)"),
        "score_threshold_value": quantized(Int(), "score_threshold as an exact integer code of the score input"),
        "score_threshold_type": quantized(DtypeName(), "the dtype of score_threshold_value (the score input's)"),
        "score_out_scale_value": quantized(Int(lo=0), "multiplier of the score requantization to scale 32767"),
        "score_out_shift_value": quantized(Int(), "shift of the score requantization"),
        "lut_frac_bits": quantized(Int(lo=0), "fraction bits Lf of the decode tables"),
        "box_out_scale_value": quantized(Int(lo=0), "multiplier of the box requantization"),
        "box_out_shift_value": quantized(Int(), "shift of the box requantization"),
        "score_scale_value": quantized(Int(), "upstream's score multiplier; not read"),
        "score_shift_value": quantized(Int(), "upstream's score shift; not read"),
        "score_scale_type": quantized(DtypeName(), "upstream's dtype; not read"),
        "score_shift_type": quantized(DtypeName(), "upstream's dtype; not read"),
        **_UPSTREAM_BOX_KEYS,
    },
    constants={"lut_ty": "decode table dy * variance[1] (quantized)",
               "lut_tx": "decode table dx * variance[0] (quantized)",
               "lut_th": "decode table exp(dh * variance[3]) (quantized)",
               "lut_tw": "decode table exp(dw * variance[2]) (quantized)",
               **_UPSTREAM_BOX_TABLES},
    integer="max score code, exact integer threshold, score requantized to scale 32767, boxes decoded as "
            "BoundingBox; class id column an exact integer",
    dtypes="scores, deltas, anchors int8/int16 → rows int16 (scale 32767; column 0 raw class ids), count uint16",
    semantics=f"{SEMANTICS}#multiboxtransformloc",
    summary="Inputs: class scores [N, C, A] (class 0 background), deltas [N, A * 4] (dx, dy, dw, dh), anchors "
            "[1, A, 4] (xmin, ymin, xmax, ymax). Outputs: rows [N, A, 6] (class id, score, xmin, ymin, xmax, ymax) of "
            "the anchors whose best score passes, first, then -1; their number [N].")


def _mb_params(node: PyNode) -> List[float]:
    """The BoundingBox divisors (y, x, h, w) equivalent to variance (x, y, w, h): 1 / variance."""
    if len(node.inputs) != 3 or len(node.outputs) != 2:
        raise node._error("expects 3 inputs (class scores, deltas, anchors) and 2 outputs (rows, count)")
    v = node.get_param("variance")
    if not isinstance(v, (list, tuple)) or len(v) != 4:
        raise node._error(f"variance must list 4 numbers, got {v!r}")
    vals = [float(x) for x in v]
    if any(not math.isfinite(x) or x == 0 for x in vals):
        raise node._error(f"variance must hold finite non-zero numbers, got {vals}")
    return [1.0 / vals[1], 1.0 / vals[0], 1.0 / vals[3], 1.0 / vals[2]]


def _mb_inputs(node: PyNode, cls: torch.Tensor, loc: torch.Tensor,
               anchors: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Deltas [N, A, 4] and anchors [A, 4], both reordered to (y, x) order."""
    if cls.dim() != 3 or cls.shape[1] < 2:
        raise node._error(f"class scores must be [N, C, A] with C >= 2 (class 0 background), got {list(cls.shape)}")
    batch, _, count = (int(v) for v in cls.shape)
    if loc.numel() != batch * count * 4 or anchors.numel() != count * 4:
        raise node._error(f"deltas must hold N x A x 4 = {batch * count * 4} values and anchors A x 4 = {count * 4}, "
                          f"got {loc.numel()} and {anchors.numel()}")
    order = [1, 0, 3, 2]
    return loc.reshape(batch, count, 4)[..., order], anchors.reshape(count, 4)[:, order]


def _mb_rows(node: PyNode, best: torch.Tensor, label: torch.Tensor, passed: torch.Tensor, boxes_yx: torch.Tensor,
             fill: Tuple[float, float], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows (class id, score, xmin, ymin, xmax, ymax) of the passing anchors in anchor order, then fill[0] in column
    0 and fill[1] elsewhere; and the counts."""
    batch, count = (int(v) for v in best.shape)
    rows = torch.full((batch, count, 6), fill[1], dtype=dtype, device=best.device)
    rows[..., 0] = fill[0]
    counts = torch.zeros(batch, dtype=dtype, device=best.device)
    boxes_xy = boxes_yx[..., [1, 0, 3, 2]]
    for b in range(batch):
        keep = passed[b].nonzero(as_tuple=True)[0]
        n = keep.numel()
        counts[b] = n
        rows[b, :n, 0] = label[b, keep].to(dtype)
        rows[b, :n, 1] = best[b, keep].to(dtype)
        rows[b, :n, 2:] = boxes_xy[b, keep].to(dtype)
    return rows, counts


@MULTIBOX.forward
def multibox_forward(self: PyNode) -> None:
    """Per anchor: the best non-background class (first on ties) and its score; anchors whose score is above
    score_threshold get their box decoded (BoundingBox with divisors 1 / variance, clipped to [0, 1])."""
    std_div = _mb_params(self)
    c_t, l_t, a_t = self.inputs
    if self.quantized:
        cls = int_value(c_t)
        deltas, anchors = _mb_inputs(self, cls, int_value(l_t), int_value(a_t))
        best = torch.max(cls[:, 1:, :], dim=1).values
        label = torch.argmax(cls[:, 1:, :], dim=1)
        passed = best > int(self.get_param("score_threshold_value"))
        m, n = int(self.get_param("score_out_scale_value")), int(self.get_param("score_out_shift_value"))
        score = torch.clamp(round_shift((best + tensor_zp(self, c_t)) * m, n), -BOX_OUT_MAX - 1, BOX_OUT_MAX)
        boxes = _decode_int(self, anchors.unsqueeze(0).expand_as(deltas), tensor_zp(self, a_t), deltas, l_t)
        rows, counts = _mb_rows(self, score, label, passed, boxes, (-1, -BOX_OUT_MAX), torch.int64)
    else:
        cls = c_t.betensor.to(torch.float32)
        deltas, anchors = _mb_inputs(self, cls, l_t.betensor.to(torch.float32), a_t.betensor.to(torch.float32))
        best = torch.max(cls[:, 1:, :], dim=1).values
        label = torch.argmax(cls[:, 1:, :], dim=1)
        passed = best > float(self.get_param("score_threshold"))
        boxes = bounding_box_float(anchors.unsqueeze(0).expand_as(deltas), deltas, std_div)
        rows, counts = _mb_rows(self, best, label, passed, boxes, (-1.0, -1.0), torch.float32)
    self.outputs[0].betensor = rows
    self.outputs[1].betensor = counts


@MULTIBOX.quantize
def multibox_quantize(self: PyNode) -> None:
    """Rows int16 with scale 32767 (as upstream), count uint16; the exact threshold code, the score requantization
    32767 / s_c and the decode tables on the delta input with the anchors as proposals."""
    std_div = _mb_params(self)
    check_quantized_inputs(self, self.inputs)
    c_t, l_t, a_t = self.inputs
    refuse_per_channel(self, c_t)
    thr = self.get_param("score_threshold")
    self.params["score_threshold_value"] = _floor_code(self, float(thr), c_t)
    self.params["score_threshold_type"] = c_t.dtype
    m, n, _, _ = scale_shift(torch.tensor(BOX_OUT_SCALE / tensor_scale(self, c_t), dtype=torch.float32), MULT_BITS,
                             shift_limit=SHIFT_MAX)
    self.params["score_out_scale_value"], self.params["score_out_shift_value"] = int(m), int(n)
    _quantize_decode(self, a_t, l_t, std_div)
    _set_box_output(self, self.outputs[0])
    count = int(c_t.ir_shape[2]) if len(c_t.ir_shape) == 3 else 0
    set_qinvariant(self, self.outputs[1], 16 if count < 2 ** 16 else 32, False)


# ------------------------------------------------------------------------------------------------ Region
REGION_SIGMOID_BITS = 15
"""Fraction bits of Region's sigmoid table (confidence, box centre offsets)."""

REGION_SOFTMAX_BITS = 20
"""Fraction bits of Region's softmax exp table (values in (0, 1])."""

REGION_ANCHOR_BITS = 10
"""Fraction bits of Region's fixed-point anchors."""

REGION_GRID_MAX = 1024
REGION_ANCHOR_MAX = 4096

REGION = declare_op(
    "Region",
    params={
        "anchors": Param(Floats(), "box_per_grid (width, height) pairs in grid cells (needed by the float forward "
                         "and quantization; upstream drops it from quantized IRs, quantopt keeps it)"),
        "obj_thresh": Param(Float(), "a (cell, box, class) is kept when sigmoid(confidence) * softmax(class) is "
                            "above it (quantized: the integer code T of threshold T / (2^b - 1))", required=True),
        "grid_height": Param(Int(lo=1), "grid rows (default: the input's dim 1)"),
        "grid_width": Param(Int(lo=1), "grid columns (default: the input's dim 2)"),
        "box_per_grid": Param(Int(lo=1), "boxes per cell (default: the input's dim 3)"),
        "max_box_num": Param(Int(lo=1), "the most boxes kept (default: the box output's IR dim 1)"),
        "class_num": Param(Int(lo=1), "the Parser's class count; the input's last dim minus 5 is used"),
        "grid_compensate": Param(Bool(), "with even grid sizes, centres are shifted half a cell back", default=True),
        "region_table_bits": quantized(Int(lo=0), "fraction bits Fe of the exp table of the box sizes"),
        "col_shift": quantized(Int(lo=0), "log2 of the box output scale (as upstream)"),
        "row_shift": quantized(Int(lo=0), "log2 of the box output scale (as upstream)"),
        "anchors_exp_h_shift": quantized(Int(), "upstream's anchor shift; not read"),
        "anchors_exp_w_shift": quantized(Int(), "upstream's anchor shift; not read"),
        "grid_h_scale": quantized(Int(), "upstream's grid multiplier; not read"),
        "grid_w_scale": quantized(Int(), "upstream's grid multiplier; not read"),
        "grid_h_shift": quantized(Int(), "upstream's grid shift; not read"),
        "grid_w_shift": quantized(Int(), "upstream's grid shift; not read"),
        "conf_sigmoid_shift": quantized(Int(), "upstream's table shift; not read"),
        "wh_exp_scale": quantized(Int(), "upstream's multiplier; not read"),
        "wh_exp_shift": quantized(Int(), "upstream's shift; not read"),
    },
    constants={"sigmoid_table": "sigmoid of the input codes, 2^15 fixed point (quantized)",
               "softmax_table": "exp of code differences to the row maximum, 2^20 fixed point (quantized)",
               "exp_table": "exp of the input codes, 2^Fe fixed point (quantized)",
               "anchor_table": "anchors, 2^10 fixed point (quantized)",
               "qanchors_lut": "upstream's anchors; not read", "score_softmax_lut": "upstream's table; not read",
               "conf_sigmoid_lut": "upstream's table; not read", "xy_sigmoid_lut": "upstream's table; not read",
               "wh_exp_lut": "upstream's table; not read"},
    integer="sigmoid/exp tables in fixed point, exact integer score test and divisions (round half to even)",
    dtypes="int8/int16 → scores uint8/uint16 (scale 2^b - 1), boxes int16 (scale 2^col_shift), counts uint16, "
           "labels int16",
    semantics=f"{SEMANTICS}#region",
    summary="YOLOv2 region decoding. Input [N, H, W, B, 5 + C] (tx, ty, tw, th, confidence, class logits). Outputs: "
            "scores [N, M], boxes [N, M, 4] (ymin, xmin, ymax, xmax) grouped by class, box_num_perclass [N, C], "
            "label_perclass [N, C], total_class_num [N, 1].")


def _region_params(node: PyNode, shape: Sequence[int]) -> Tuple[int, int, int, int, List[float], bool]:
    """(grid_h, grid_w, boxes per cell, max boxes, anchors, compensate) checked against the input shape."""
    if len(node.inputs) != 1 or len(node.outputs) != 5:
        raise node._error("expects 1 input and 5 outputs (scores, boxes, box_num_perclass, label_perclass, "
                          "total_class_num)")
    if len(shape) != 5 or shape[4] < 6:
        raise node._error(f"the input must be [N, H, W, B, 5 + C] with C >= 1, got {list(shape)}")
    gh = int(node.get_param("grid_height", optional=True, default_value=shape[1]))
    gw = int(node.get_param("grid_width", optional=True, default_value=shape[2]))
    nb = int(node.get_param("box_per_grid", optional=True, default_value=shape[3]))
    if (gh, gw, nb) != tuple(int(v) for v in shape[1:4]):
        raise node._error(f"grid_height, grid_width, box_per_grid ({gh}, {gw}, {nb}) must match the input's dims 1-3 "
                          f"{list(shape[1:4])}")
    box_shape = node.outputs[1].ir_shape
    default_max = int(box_shape[1]) if len(box_shape) > 1 else gh * gw * nb * (int(shape[4]) - 5)
    max_box = int(node.get_param("max_box_num", optional=True, default_value=default_max))
    anchors = node.get_param("anchors", optional=node.quantized, default_value=None)
    if anchors is None:  # quantized: the anchor table is read
        anchors = [0.0] * (2 * nb)
    if not isinstance(anchors, (list, tuple)) or len(anchors) != 2 * nb:
        raise node._error(f"anchors must list {2 * nb} numbers (a width and a height per box), got {anchors!r}")
    vals = [float(a) for a in anchors]
    if any(not math.isfinite(a) or a < 0 for a in vals):
        raise node._error(f"anchors must be finite and non-negative, got {vals}")
    compensate = bool_param(node, "grid_compensate", True) and gh % 2 == 0 and gw % 2 == 0
    return gh, gw, nb, max_box, vals, compensate


def _region_pick(keys: list, max_box: int, device: torch.device) -> torch.Tensor:
    """Candidate positions kept (on `device`): all (in scan order) up to max_box, else the max_box highest scores
    (`keys`: the scores; stable), in descending score order."""
    if len(keys) <= max_box:
        return torch.arange(len(keys), device=device)
    return torch.tensor(sorted(range(len(keys)), key=lambda i: (-keys[i], i))[:max_box], dtype=torch.int64,
                        device=device)


def _region_group(cls_idx: torch.Tensor, classes: int, max_box: int, batch_out: List[torch.Tensor], b: int,
                  scores: torch.Tensor, boxes: torch.Tensor) -> None:
    """Group the kept candidates by class (ascending, stable) into the five outputs of item b."""
    order = torch.sort(cls_idx, stable=True).indices
    labels, counts = torch.unique_consecutive(cls_idx[order], return_counts=True)
    n = order.numel()
    batch_out[0][b, :n] = scores[order].to(batch_out[0].dtype)
    batch_out[1][b, :n] = boxes[order].to(batch_out[1].dtype)
    batch_out[2][b, :labels.numel()] = counts.to(batch_out[2].dtype)
    batch_out[3][b, :labels.numel()] = labels.to(batch_out[3].dtype)
    batch_out[4][b, 0] = labels.numel()


def _region_outputs(batch: int, max_box: int, classes: int, dtype: torch.dtype,
                    device: torch.device) -> List[torch.Tensor]:
    return [torch.zeros(batch, max_box, dtype=dtype, device=device),
            torch.zeros(batch, max_box, 4, dtype=dtype, device=device),
            torch.zeros(batch, classes, dtype=dtype, device=device),
            torch.zeros(batch, classes, dtype=dtype, device=device),
            torch.zeros(batch, 1, dtype=dtype, device=device)]


def _region_float(node: PyNode, x: torch.Tensor) -> List[torch.Tensor]:
    gh, gw, nb, max_box, anchors, comp = _region_params(node, list(x.shape))
    thr = float(node.get_param("obj_thresh"))
    batch, classes = int(x.shape[0]), int(x.shape[4]) - 5
    conf = torch.sigmoid(x[..., 4:5])
    score = conf * torch.softmax(x[..., 5:], dim=-1)
    outs = _region_outputs(batch, max_box, classes, torch.float32, x.device)
    aw = torch.tensor(anchors[0::2], dtype=torch.float32, device=x.device)
    ah = torch.tensor(anchors[1::2], dtype=torch.float32, device=x.device)
    for b in range(batch):
        r, c, k, cls = torch.nonzero(score[b] > thr, as_tuple=True)
        sc = score[b, r, c, k, cls]
        keep = _region_pick(sc.tolist(), max_box, x.device)
        r, c, k, cls, sc = r[keep], c[keep], k[keep], cls[keep], sc[keep]
        t = x[b, r, c, k]
        half = 0.5 if comp else 0.0
        cx = (c.to(torch.float32) - half + torch.sigmoid(t[:, 0])) / gw
        cy = (r.to(torch.float32) - half + torch.sigmoid(t[:, 1])) / gh
        w = aw[k] * torch.exp(t[:, 2]) / gw
        h = ah[k] * torch.exp(t[:, 3]) / gh
        box = torch.clamp(torch.stack([cy - h / 2.0, cx - w / 2.0, cy + h / 2.0, cx + w / 2.0], dim=-1), 0.0, 1.0)
        _region_group(cls, classes, max_box, outs, b, sc, box)
    return outs


def _region_int(node: PyNode, t: PyTensor) -> List[torch.Tensor]:
    q = int_value(t)
    gh, gw, nb, max_box, _, comp = _region_params(node, list(q.shape))
    lo, hi = out_range(node, t)
    bits = range_bits(node, t)
    levels = 2 ** bits - 1
    thr = int(node.get_param("obj_thresh"))
    fe = int(node.get_param("region_table_bits"))
    cs = int(node.get_param("col_shift"))
    fs, fa = REGION_SIGMOID_BITS, REGION_ANCHOR_BITS
    batch, classes = int(q.shape[0]), int(q.shape[4]) - 5
    conf = _lookup_table(node, "sigmoid_table", q[..., 4:5], lo, hi, bits)
    logits = q[..., 5:]
    d = logits - logits.max(dim=-1, keepdim=True).values
    e = _lookup_table(node, "softmax_table", d, -levels, 0, bits)
    total = e.sum(dim=-1, keepdim=True)
    num = conf * e * levels  # score * (2^b - 1) = num / (total * 2^fs)
    den = total << fs
    passed = num > thr * den
    anchors = node.get_constant("anchor_table").betensor.to(device=q.device, dtype=torch.int64).reshape(-1)
    outs = _region_outputs(batch, max_box, classes, torch.int64, q.device)
    for b in range(batch):
        r, c, k, cls = torch.nonzero(passed[b], as_tuple=True)
        nb_ = num[b, r, c, k, cls]
        db = den[b, r, c, k, 0]
        keep = _region_pick([Fraction(u, v) for u, v in zip(nb_.tolist(), db.tolist())], max_box, q.device)
        r, c, k, cls, nb_, db = r[keep], c[keep], k[keep], cls[keep], nb_[keep], db[keep]
        code = div_round_half_even(nb_, db)
        tq = q[b, r, c, k]
        sx = _lookup_table(node, "sigmoid_table", tq[:, 0], lo, hi, bits)
        sy = _lookup_table(node, "sigmoid_table", tq[:, 1], lo, hi, bits)
        ew = _lookup_table(node, "exp_table", tq[:, 2], lo, hi, bits)
        eh = _lookup_table(node, "exp_table", tq[:, 3], lo, hi, bits)
        half = (1 << (fs - 1)) if comp else 0
        cx = (c << fs) + sx - half  # cells * 2^fs
        cy = (r << fs) + sy - half
        up = fa + fe + 1
        w = anchors[2 * k] * ew << fs  # cells * 2^(fs + fa + fe)
        h = anchors[2 * k + 1] * eh << fs
        box = torch.stack([(cy << up) - h, (cx << up) - w, (cy << up) + h, (cx << up) + w], dim=-1)
        scale_den = torch.tensor([gh, gw, gh, gw], dtype=torch.int64, device=q.device) << (fs + up - cs)
        box = torch.clamp(div_round_half_even(box, scale_den), 0, 1 << cs)
        _region_group(cls, classes, max_box, outs, b, code, box)
    return outs


@REGION.forward
def region_forward(self: PyNode) -> None:
    """Scores sigmoid(conf) * softmax(classes) above obj_thresh in scan order (cell row, column, box, class); past
    max_box_num the highest (stable); grouped by class ascending; boxes decoded from the cell, the anchors and
    sigmoid/exp of the offsets, clipped to [0, 1]."""
    outs = _region_int(self, self.inputs[0]) if self.quantized else \
        _region_float(self, self.inputs[0].betensor.to(torch.float32))
    for o, v in zip(self.outputs, outs):
        o.betensor = v


@REGION.quantize
def region_quantize(self: PyNode) -> None:
    """Tables (sigmoid 2^15, softmax exp 2^20, exp 2^Fe, anchors 2^10), obj_thresh := floor(t * (2^b - 1)) and the
    output params of upstream: scores uint scale 2^b - 1, boxes int16 scale 2^col_shift, counts/labels integers."""
    t = self.inputs[0]
    check_quantized_inputs(self, self.inputs)
    refuse_per_channel(self, t)
    shape = [int(v) for v in t.ir_shape]
    gh, gw, nb, _, anchors, _ = _region_params(self, shape)
    bits = range_bits(self, t)
    if bits > 16:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): {bits}-bit input codes; at most 16 bits are "
                               "supported")
    if max(gh, gw) > REGION_GRID_MAX or max(anchors) >= REGION_ANCHOR_MAX:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): grids above {REGION_GRID_MAX} cells or anchors "
                               f"of {REGION_ANCHOR_MAX} cells and more are not supported")
    lo, hi = out_range(self, t)
    s, zp = tensor_scale(self, t), tensor_zp(self, t)
    xmax = max(abs(lo + zp), abs(hi + zp)) / s
    fe = min(LUT_MAX_FRAC_BITS, LUT_VALUE_BITS - max(0, math.ceil(xmax / math.log(2.0))))
    if fe < 0:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): inputs up to {xmax:g} make exp(x) too large for "
                               "the size table; calibrate the input narrower")
    table_bits = min(bits, int(layer_settings(self).lut_items_in_bits))
    levels = 2 ** bits - 1
    set_constant(self, "sigmoid_table", _table(torch.sigmoid, lo, bits, s, zp, REGION_SIGMOID_BITS, table_bits),
                 Dtype.INT32)
    set_constant(self, "softmax_table", _table(torch.exp, -levels, bits, s, 0, REGION_SOFTMAX_BITS, table_bits),
                 Dtype.INT32)
    set_constant(self, "exp_table", _table(torch.exp, lo, bits, s, zp, fe, table_bits), Dtype.INT32)
    anchor_q = torch.round(torch.tensor(anchors, dtype=torch.float64) * 2 ** REGION_ANCHOR_BITS).to(torch.int64)
    set_constant(self, "anchor_table", anchor_q, Dtype.INT32)
    self.params["region_table_bits"] = fe
    self.params["obj_thresh"] = math.floor(Fraction(float(self.get_param("obj_thresh"))) * levels)
    cs = 0
    while cs < 14 and (gw << (cs + 1)) <= 65535:
        cs += 1
    self.params["col_shift"] = self.params["row_shift"] = cs
    o = self.outputs
    _set_output(self, o[0], float(levels), 0, levels, Dtype.UINT16 if bits > 8 else Dtype.UINT8, bits)
    if REGION_INPUT_ZP in layer_settings(self).upstream_defects:  # the integer scores carry no zero point
        quant_of(self).of(o[0]).zerop = zp
    _set_output(self, o[1], float(2 ** cs), -32768, 32767, Dtype.INT16, 16)
    set_qinvariant(self, o[2], 16, False)
    set_qinvariant(self, o[3], 16, True)
    set_qinvariant(self, o[4], 16, False)


# ------------------------------------------------------------------------------------------------ RegionFuse
REGION_FUSE = declare_op(
    "RegionFuse",
    params={
        "score_out_scale_value": quantized(Ints(), "multipliers of the two score inputs' requantization"),
        "score_out_shift_value": quantized(Ints(), "shifts of the two score inputs' requantization"),
        "box_out_scale_value": quantized(Ints(), "multipliers of the two box inputs' requantization"),
        "box_out_shift_value": quantized(Ints(), "shifts of the two box inputs' requantization"),
        "score_scale_value": quantized(Ints(), "upstream's multipliers; not read"),
        "score_shift_value": quantized(Ints(), "upstream's shifts; not read"),
        "box_scale_value": quantized(Ints(), "upstream's multipliers; not read"),
        "box_shift_value": quantized(Ints(), "upstream's shifts; not read"),
        "score_scale_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
        "score_shift_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
        "box_scale_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
        "box_shift_type": quantized(Value("dtype list"), "upstream's dtypes; not read"),
    },
    integer="each input's scores and boxes requantized (15-bit multiplier, round half to even) to the outputs; "
            "counts and labels exact",
    dtypes="scores uint (scale 2^b - 1), boxes int16 (scale 32767), counts/labels as the inputs",
    semantics=f"{SEMANTICS}#regionfuse",
    summary="Merges two Region results. Inputs: scores0, scores1, boxes0, boxes1, box_num_perclass0/1, "
            "label_perclass0/1, total_class_num0/1. Outputs: the five Region outputs, classes ascending, each "
            "class's boxes of input 0 then input 1.")


def _fuse_check(node: PyNode) -> None:
    if len(node.inputs) != 10 or len(node.outputs) != 5:
        raise node._error("expects 10 inputs (scores, boxes, box_num_perclass, label_perclass, total_class_num of two "
                          "Region layers, interleaved) and 5 outputs")


def _fuse(node: PyNode, scores: Sequence[torch.Tensor], boxes: Sequence[torch.Tensor],
          counts: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], totals: Sequence[torch.Tensor],
          dtype: torch.dtype) -> List[torch.Tensor]:
    batch = int(scores[0].shape[0])
    cap = int(node.outputs[0].ir_shape[1]) if len(node.outputs[0].ir_shape) > 1 else \
        sum(int(s.shape[1]) for s in scores)
    ncls = int(node.outputs[2].ir_shape[1]) if len(node.outputs[2].ir_shape) > 1 else int(counts[0].shape[1])
    out = _region_outputs(batch, cap, ncls, dtype, scores[0].device)
    for b in range(batch):
        blocks = {}  # label -> list of (input, start, count)
        for i in range(2):
            start = 0
            used = max(0, min(int(totals[i].reshape(batch, -1)[b, 0]), int(counts[i].shape[1])))
            for c in range(used):
                n = max(0, int(counts[i][b, c]))
                blocks.setdefault(int(labels[i][b, c]), []).append((i, start, n))
                start += n
        filled = 0
        present = sorted(blocks)[:ncls]
        for j, lab in enumerate(present):
            total_n = 0
            for i, start, n in blocks[lab]:
                n = max(0, min(n, int(scores[i].shape[1]) - start, cap - filled))
                out[0][b, filled:filled + n] = scores[i][b, start:start + n].to(dtype)
                out[1][b, filled:filled + n] = boxes[i][b, start:start + n].to(dtype)
                filled += n
                total_n += n
            out[2][b, j] = total_n
            out[3][b, j] = lab
        out[4][b, 0] = len(present)
    return out


@REGION_FUSE.forward
def region_fuse_forward(self: PyNode) -> None:
    """Classes present in either input, ascending; per class the block of input 0 then that of input 1 (as
    upstream); capacity the outputs' IR sizes (the rest is cut)."""
    _fuse_check(self)
    t = self.inputs
    ints = [integer_index_input(self, x, "count/label") for x in t[4:]]
    counts, labels, totals = ints[0:2], ints[2:4], ints[4:6]
    if self.quantized:
        scores, boxes = [], []
        for key, idx, out, dst in (("score", (0, 1), self.outputs[0], scores),
                                   ("box", (2, 3), self.outputs[1], boxes)):
            mults = self.get_param(f"{key}_out_scale_value")
            shifts = self.get_param(f"{key}_out_shift_value")
            qmin, qmax = out_range(self, out)
            for j, i in enumerate(idx):
                v = round_shift((int_value(t[i]) + tensor_zp(self, t[i])) * int(mults[j]), int(shifts[j])) - \
                    tensor_zp(self, out)
                dst.append(torch.clamp(v, qmin, qmax))
        outs = _fuse(self, scores, boxes, counts, labels, totals, torch.int64)
    else:
        outs = _fuse(self, [t[0].betensor, t[1].betensor], [t[2].betensor, t[3].betensor], counts, labels, totals,
                     torch.float32)
    for o, v in zip(self.outputs, outs):
        o.betensor = v


@REGION_FUSE.quantize
def region_fuse_quantize(self: PyNode) -> None:
    """Output params as upstream: scores of input 0's bits with scale 2^b - 1, boxes of the finer box input's dtype
    with scale its qmax, counts and labels copy the inputs'; each score/box input requantized to them."""
    _fuse_check(self)
    check_quantized_inputs(self, self.inputs)
    t = self.inputs
    for x in t[:4]:
        refuse_per_channel(self, x)
    table = quant_of(self)
    for x in t[4:]:
        if not table.get(x).qinvariant:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): the count/label input '{x.name}' must hold "
                                   "exact integers (an integer tensor), not quantized values")
    for o, pair in zip(self.outputs, ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))):
        src = min(pair, key=lambda i: tensor_scale(self, t[i]))
        copy_params(self, o, t[src])
        table.of(o).zerop = 0
    in_bits = table.get(t[0]).qbits
    bits = int(in_bits) if in_bits else range_bits(self, t[0])
    levels = 2 ** bits - 1
    o0, o1 = self.outputs[0], self.outputs[1]
    q0 = table.of(o0)
    q0.scale, q0.qbits, q0.qinvariant = float(levels), bits, False
    q0.qmin, q0.qmax = 0, levels
    o0.dtype = Dtype.UINT16 if bits > 8 else Dtype.UINT8
    q1 = table.of(o1)
    q1.scale, q1.qinvariant = float(out_range(self, o1)[1]), False
    for key, pair, out in (("score", (0, 1), o0), ("box", (2, 3), o1)):
        ms, ns = [], []
        for i in pair:
            ratio = torch.tensor(tensor_scale(self, out) / tensor_scale(self, t[i]), dtype=torch.float32)
            m, n, _, _ = scale_shift(ratio, MULT_BITS, shift_limit=SHIFT_MAX)
            ms.append(int(m))
            ns.append(int(n))
        self.params[f"{key}_out_scale_value"], self.params[f"{key}_out_shift_value"] = ms, ns
