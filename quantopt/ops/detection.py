"""Detection post-processing: DecodeBox (SSD box decoding with constant anchors, score filtering, grouping by class),
NMS (per-class hard non-maximum suppression) and DetectionOutput (per-class box decoding of second-stage proposals).

Quantized (docs/semantics/detection.md): box deltas go through lookup tables (t / variance and exp(t / variance)) in
fixed point, anchors are stored as int32 fixed point, decoded boxes are requantized once from an exact int64
numerator to 16-bit output params from calibration; every comparison (score thresholds, IoU threshold, ordering) is
made exactly on integers; scores pass through with their input params and counts, labels and indices are exact
integer tensors.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.lut import build_lut, lookup_lut
from ..quant.requant import scale_shift
from ..quant.rounding import round_shift
from ..registry import declare_op
from ..registry.schema import Bool, DtypeName, Either, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._lut_int import is_restricted, range_bits
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    layer_settings,
    out_range,
    params,
    quant_of,
    quantize_activation,
    set_constant,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param

DEFAULT_VARIANCE = [10.0, 10.0, 5.0, 5.0]
"""DecodeBox's default `variance` (TF object-detection box coder scales): deltas are divided by these."""

BOX_BITS = 16
"""Decoded boxes are quantized with at least 16 bits (8-bit coordinates are too coarse for IoU decisions)."""

COUNT_BITS = 16
"""Counts, labels and box indices are unsigned 16-bit integer tensors (32-bit when an index may exceed 65535)."""

ANCHOR_INT_BITS = 15
"""Constant anchors are stored as int32 fixed point with |value| <= 2^15."""

DECODE_LUT_VALUE_BITS = 24
"""Decode tables hold |value| <= 2^24, so every decode numerator stays far below 2^62 after the requantization."""

DECODE_LUT_MAX_FRAC_BITS = 20
"""Upper limit of the decode tables' fraction bits."""

IOU_THRESHOLD_SHIFT = 16
"""The NMS IoU threshold is stored as round(t * 2^16); suppression is inter * 2^16 > t_q * union, exact in int64."""

DECODE_MULTIPLIER_BITS = AIFF_MULTIPLIER_BITS
"""Box requantization multipliers have 15 bits."""

DECODE_SHIFT_MAX = 62
"""Box requantization shifts are exact int64 round-half-even shifts up to 62."""


# ------------------------------------------------------------------------------------------------ shared helpers
def _number(node: PyNode, key: str, default: Any = None) -> float:
    value = node.get_param(key, optional=default is not None, default_value=default)
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}") from None
    if math.isnan(f):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}")
    return f


def _variance(node: PyNode, default: Optional[Sequence[float]]) -> List[float]:
    v = node.get_param("variance", optional=default is not None, default_value=default)
    if not isinstance(v, (list, tuple)) or len(v) != 4:
        raise node._error(f"parameter 'variance' must list 4 numbers, got {v!r}")
    try:
        vals = [float(x) for x in v]
    except (TypeError, ValueError):
        raise node._error(f"parameter 'variance' must list 4 numbers, got {v!r}") from None
    if any(not math.isfinite(x) or x == 0 for x in vals):
        raise node._error(f"parameter 'variance' must hold finite non-zero numbers, got {vals}")
    return vals


def _out_dim(node: PyNode, idx: int, dim: int, what: str) -> int:
    shape = node.outputs[idx].ir_shape
    if len(shape) <= dim or int(shape[dim]) < 1:
        raise node._error(f"output {idx} ({what}) needs an IR shape with dim {dim} >= 1, got {list(shape)}")
    return int(shape[dim])


def score_threshold_code(node: PyNode, threshold: float, t: PyTensor) -> int:
    """T with (q + zp) / s > threshold <=> q > T for every integer q: T = floor(threshold * s - zp), computed with
    exact rationals (s is the stored float)."""
    if math.isinf(threshold):
        return (out_range(node, t)[0] - 1) if threshold < 0 else out_range(node, t)[1]
    return math.floor(Fraction(threshold) * Fraction(tensor_scale(node, t)) - tensor_zp(node, t))


def _stable_desc(values: torch.Tensor) -> torch.Tensor:
    return torch.sort(values, descending=True, stable=True).indices


def _mult_shift(ratio: float) -> Tuple[int, int]:
    m, n, _, _ = scale_shift(torch.tensor(ratio, dtype=torch.float32), DECODE_MULTIPLIER_BITS,
                             shift_limit=DECODE_SHIFT_MAX)
    return int(m), int(n)


def _ip(node: PyNode, key: str) -> int:
    value = node.get_param(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    return value


def _index_bits(n: int) -> int:
    return COUNT_BITS if n < 2 ** COUNT_BITS else 32


def _require_16_bits(node: PyNode, t: PyTensor, what: str) -> None:
    """Box coordinates, proposals and deltas must be at most 16-bit codes (the int64 bounds of the docs rely on it)."""
    if range_bits(node, t) > 16:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {what} '{t.name}' has {range_bits(node, t)}-bit "
                               "codes; at most 16 bits are supported")


def _set_index(node: PyNode, t: PyTensor, limit: int) -> None:
    bits = _index_bits(limit)
    set_qinvariant(node, t, bits, bits > COUNT_BITS)


# ------------------------------------------------------------------------------------------------ box decoding
def decode_float(t: torch.Tensor, variance: Sequence[float], cy: torch.Tensor, cx: torch.Tensor, ha: torch.Tensor,
                 wa: torch.Tensor) -> torch.Tensor:
    """Deltas t[..., (ty, tx, th, tw)] on anchors (centre, size) → boxes [..., (ymin, xmin, ymax, xmax)]."""
    ty, tx, th, tw = (t[..., k] / variance[k] for k in range(4))
    y, x = ty * ha + cy, tx * wa + cx
    h, w = torch.exp(th) * ha, torch.exp(tw) * wa
    return torch.stack([y - h / 2.0, x - w / 2.0, y + h / 2.0, x + w / 2.0], dim=-1)


def _clip_boxes(boxes: torch.Tensor, hmin: Any, hmax: Any, wmin: Any, wmax: Any) -> torch.Tensor:
    y0, x0, y1, x1 = boxes.unbind(-1)
    return torch.stack([torch.clamp(y0, hmin, hmax), torch.clamp(x0, wmin, wmax), torch.clamp(y1, hmin, hmax),
                        torch.clamp(x1, wmin, wmax)], dim=-1)


def _delta_range(node: PyNode, t: PyTensor) -> float:
    """Largest |delta| the quantized delta input can represent."""
    lo, hi = out_range(node, t)
    zp, s = tensor_zp(node, t), tensor_scale(node, t)
    return max(abs(lo + zp), abs(hi + zp)) / s


def _store_decode_tables(node: PyNode, deltas: PyTensor, variance: Sequence[float]) -> int:
    """lut_ty, lut_tx (t / v) and lut_th, lut_tw (exp(t / v)) over the delta input's integer range, int32 with
    Lf fraction bits; returns Lf."""
    tmax = _delta_range(node, deltas)
    biggest = max([tmax / abs(v) for v in variance[:2]] + [math.exp(min(tmax / abs(v), 80.0)) for v in variance[2:]])
    lf = min(DECODE_LUT_MAX_FRAC_BITS, DECODE_LUT_VALUE_BITS - max(0, math.ceil(math.log2(max(biggest, 1.0)))))
    if lf < 0:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): box deltas up to {tmax:g} make exp(delta / "
                               "variance) too large for the decode tables; calibrate the delta input narrower")
    lo, hi = out_range(node, deltas)
    bits = range_bits(node, deltas)
    vmax = 2 ** DECODE_LUT_VALUE_BITS
    lut_bits = int(layer_settings(node).lut_items_in_bits)
    for key, var, use_exp in (("lut_ty", variance[0], False), ("lut_tx", variance[1], False),
                              ("lut_th", variance[2], True), ("lut_tw", variance[3], True)):
        v = torch.tensor(var, dtype=torch.float32)
        fn = (lambda x, v=v: torch.exp(x / v)) if use_exp else (lambda x, v=v: x / v)
        table = build_lut(fn, tensor_scale(node, deltas), tensor_zp(node, deltas), lo, hi, bits, float(2 ** lf), 0,
                          -vmax, vmax, lut_items_in_bits=lut_bits)
        set_constant(node, key, table, Dtype.INT32)
    node.params["lut_frac_bits"] = lf
    return lf


def _lookup(node: PyNode, key: str, q: torch.Tensor, deltas: PyTensor) -> torch.Tensor:
    lo, _ = out_range(node, deltas)
    return lookup_lut(q, node.get_constant(key).betensor, lo, range_bits(node, deltas), 32, True,
                      in_restricted=is_restricted(node, deltas))


def decode_int(node: PyNode, tq: torch.Tensor, deltas: PyTensor, cy2: torch.Tensor, cx2: torch.Tensor,
               ha: torch.Tensor, wa: torch.Tensor) -> torch.Tensor:
    """Integer decode: V = 2 * lut_t * size + centre2 * 2^Lf -/+ lut_e * size per coordinate (exact int64), then
    one requantization to the box output and the clip; tq [..., 4] holds the delta codes."""
    lf = _ip(node, "lut_frac_bits")
    ly, lx, lh, lw = (_lookup(node, k, tq[..., i], deltas) for i, k in enumerate(("lut_ty", "lut_tx", "lut_th",
                                                                                  "lut_tw")))
    y2 = 2 * ly * ha + (cy2 << lf)
    x2 = 2 * lx * wa + (cx2 << lf)
    h, w = lh * ha, lw * wa
    v = torch.stack([y2 - h, x2 - w, y2 + h, x2 + w], dim=-1)
    out = node.outputs[_box_output_index(node)]
    qmin, qmax = out_range(node, out)
    zp = tensor_zp(node, out)
    y = torch.clamp(round_shift(v * _ip(node, "box_scale_value"), _ip(node, "box_shift_value")) - zp, qmin, qmax)
    if str(node.type) == "DecodeBox" and not bool_param(node, "clip", True):
        return y
    lo = min(max(-zp, qmin), qmax)
    return _clip_boxes(y, lo, _ip(node, "height"), lo, _ip(node, "width"))


def _box_output_index(node: PyNode) -> int:
    return 1 if str(node.type) == "DetectionOutput" else 0


def _quantize_boxes(node: PyNode, anchor_unit: float, clip: Optional[Tuple[float, float]]) -> None:
    """16-bit box output params from calibration; box_scale_value/box_shift_value for s_box / (2 * anchor_unit *
    2^Lf); clip codes `height`/`width` (output codes of the clip bounds)."""
    out = node.outputs[_box_output_index(node)]
    lo = ranges_of(node).get(out).min
    signed = lo is not None and float(lo) < 0
    quantize_activation(node, out, signed, max(BOX_BITS, int(layer_settings(node).q_bits_activation)))
    lf = _ip(node, "lut_frac_bits")
    ratio = tensor_scale(node, out) / (2.0 * anchor_unit * 2.0 ** lf)
    node.params["box_scale_value"], node.params["box_shift_value"] = _mult_shift(ratio)
    qmin, qmax = out_range(node, out)
    zp, s = tensor_zp(node, out), tensor_scale(node, out)
    codes = [qmax, qmax] if clip is None else [min(qmax, max(qmin, round(float(b) * s - zp))) for b in clip]
    node.params["height"], node.params["width"] = int(codes[0]), int(codes[1])


# ------------------------------------------------------------------------------------------------ DecodeBox
DECODEBOX = declare_op(
    "DecodeBox",
    params={
        "class_num": Param(Int(lo=0), "number of classes: the last class_num score columns (earlier ones, such as a "
                           "background column, are dropped)", required=True),
        "score_threshold": Param(Float(infinite=True), "a candidate (anchor, class) is kept when its score is above "
                                 "it", required=True),
        "variance": Param(Floats(), "the 4 divisors of the deltas (ty, tx, th, tw), finite and non-zero",
                          default=DEFAULT_VARIANCE),
        "clip": Param(Bool(), "clip the decoded boxes to [0, height_max] x [0, width_max]", default=True),
        "height_max": Param(Float(), "upper clip bound of the y coordinates", default=1.0),
        "width_max": Param(Float(), "upper clip bound of the x coordinates", default=1.0),
        "image_height": Param(Float(), "upstream's image height (its clip bound without proposal_normalized); not "
                              "read: height_max gives the bound"),
        "image_width": Param(Float(), "upstream's image width; not read: width_max gives the bound"),
        "proposal_normalized": Param(Bool(), "upstream's flag for normalized anchors; not read"),
        "boxes": Param(Value(), "written by some Parser versions (named like an output); not read"),
        "box_num_perclass": Param(Value(), "written by some Parser versions (named like an output); not read"),
        "scale": Param(Value(), "written by some Parser versions; not read"),
        "anchor_frac_bits": quantized(Int(lo=0), "fraction bits of the int32 fixed-point anchors"),
        "lut_frac_bits": quantized(Int(lo=0), "fraction bits Lf of the decode tables"),
        "box_scale_value": quantized(Int(lo=0), "multiplier of the box requantization"),
        "box_shift_value": quantized(Int(), "shift of the box requantization"),
        "height": quantized(Int(), "upper clip bound of the y coordinates, as an output code"),
        "width": quantized(Int(), "upper clip bound of the x coordinates, as an output code"),
        "score_threshold_value": quantized(Int(), "score_threshold as an exact integer code of the score input"),
        "box_shift": quantized(Int(), "upstream's box shift; not read"),
        "score_threshold_uint8": quantized(Int(), "upstream's integer score threshold; not read"),
    },
    constants={"weights": "anchors [A, 4] (ya, xa, ha, wa); int32 fixed point when quantized",
               "lut_ty": "decode table t / variance[0] (quantized)",
               "lut_tx": "decode table t / variance[1] (quantized)",
               "lut_th": "decode table exp(t / variance[2]) (quantized)",
               "lut_tw": "decode table exp(t / variance[3]) (quantized)",
               "ha": "upstream's anchor heights; not read", "wa": "upstream's anchor widths; not read",
               "xcenter": "upstream's anchor x centres; not read", "ycenter": "upstream's anchor y centres; not read",
               "ty_lut": "upstream's decode table; not read", "tx_lut": "upstream's decode table; not read",
               "th_lut": "upstream's decode table; not read", "tw_lut": "upstream's decode table; not read"},
    integer="delta tables (t/v, exp(t/v)) in fixed point, int32 anchors, one exact requant per coordinate, "
            "integer score threshold; scores passthrough, counts/labels integers",
    dtypes="scores any, deltas int8/int16 → boxes int16/uint16, scores as input, counts uint16",
    semantics="docs/semantics/detection.md#decodebox")


def _decodebox_params(node: PyNode) -> Tuple[int, float, List[float], bool, float, float]:
    if len(node.inputs) != 2:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): anchors given as an input are not supported "
                               "(only the 'weights' constant of anchors)")
    if len(node.outputs) != 5:
        raise node._error(f"expects 5 outputs (boxes, box_num_perclass, total_class_num, scores, label_perclass), "
                          f"got {len(node.outputs)}")
    class_num = _ip(node, "class_num")
    thr = _number(node, "score_threshold")
    return (class_num, thr, _variance(node, DEFAULT_VARIANCE), bool_param(node, "clip", True),
            _number(node, "height_max", 1.0), _number(node, "width_max", 1.0))


def _anchors(node: PyNode, count: int) -> torch.Tensor:
    a = node.get_constant("weights").betensor
    if a.numel() != 4 * count:
        raise node._error(f"anchors ('weights') must hold {count} x 4 values (ya, xa, ha, wa), got {a.numel()}")
    return a.reshape(count, 4)


def _check_ssd_inputs(node: PyNode, scores: torch.Tensor, deltas: torch.Tensor, class_num: int) -> None:
    if scores.dim() != 3 or deltas.dim() != 3 or deltas.shape[2] != 4 or deltas.shape[:2] != scores.shape[:2]:
        raise node._error(f"inputs must be scores [N, A, K] and deltas [N, A, 4], got {list(scores.shape)} and "
                          f"{list(deltas.shape)}")
    if scores.shape[2] < class_num:
        raise node._error(f"class_num {class_num} exceeds the {scores.shape[2]} score columns")


def ssd_select(scores: torch.Tensor, passed: torch.Tensor, max_box: int,
               max_class: int) -> Tuple[torch.Tensor, torch.Tensor, List[int], List[int]]:
    """Candidates (anchor a, class k) with `passed`, in anchor-major order; more than `max_box` keep the highest
    scores (stable: ties keep candidate order) in candidate order; then grouped by class ascending (at most
    `max_class` classes). Returns (anchor ids, class ids, counts per present class, present classes)."""
    a_idx, k_idx = passed.nonzero(as_tuple=True)
    if a_idx.numel() > max_box:
        top = _stable_desc(scores[a_idx, k_idx])[:max_box]
        top = torch.sort(top).values
        a_idx, k_idx = a_idx[top], k_idx[top]
    order = torch.sort(k_idx, stable=True).indices
    a_idx, k_idx = a_idx[order], k_idx[order]
    labels, counts = torch.unique_consecutive(k_idx, return_counts=True)
    labels, counts = labels.tolist()[:max_class], counts.tolist()[:max_class]
    n = sum(counts)
    return a_idx[:n], k_idx[:n], counts, labels


def _ssd_outputs(node: PyNode, boxes: torch.Tensor, scores: torch.Tensor, passed: torch.Tensor,
                 dtype: torch.dtype) -> List[torch.Tensor]:
    """Fill the five DecodeBox outputs for each batch item (zeros beyond the selections)."""
    batch = boxes.shape[0]
    max_box = _out_dim(node, 0, 1, "boxes")
    max_class = _out_dim(node, 1, 1, "box_num_perclass")
    out_boxes = torch.zeros(batch, max_box, 4, dtype=dtype)
    out_scores = torch.zeros(batch, max_box, dtype=dtype)
    counts_t = torch.zeros(batch, max_class, dtype=dtype)
    labels_t = torch.zeros(batch, max_class, dtype=dtype)
    total_t = torch.zeros(batch, 1, dtype=dtype)
    for b in range(batch):
        a_idx, k_idx, counts, labels = ssd_select(scores[b], passed[b], max_box, max_class)
        n = a_idx.numel()
        out_boxes[b, :n] = boxes[b, a_idx].to(dtype)
        out_scores[b, :n] = scores[b, a_idx, k_idx].to(dtype)
        counts_t[b, :len(counts)] = torch.tensor(counts, dtype=dtype)
        labels_t[b, :len(labels)] = torch.tensor(labels, dtype=dtype)
        total_t[b, 0] = len(labels)
    return [out_boxes, counts_t, total_t, out_scores, labels_t]


@DECODEBOX.forward
def decodebox_forward(self: PyNode) -> None:
    """Inputs: scores [N, A, K] (the last class_num columns are classes), deltas [N, A, 4] (ty, tx, th, tw);
    constant anchors `weights` [A, 4] (ya, xa, ha, wa). Outputs: boxes, box_num_perclass, total_class_num, scores,
    label_perclass."""
    class_num, thr, variance, clip, hmax, wmax = _decodebox_params(self)
    scores_t, deltas_t = self.inputs[0], self.inputs[1]
    device = scores_t.betensor.device  # computed on the CPU (a selection loop per batch item), returned here
    if self.quantized:
        sq, tq = int_value(scores_t).cpu(), int_value(deltas_t).cpu()
        _check_ssd_inputs(self, sq, tq, class_num)
        a = _anchors(self, sq.shape[1]).cpu().to(torch.int64)
        boxes = decode_int(self, tq, deltas_t, 2 * a[:, 0], 2 * a[:, 1], a[:, 2], a[:, 3])
        cls = sq[:, :, sq.shape[2] - class_num:]
        passed = cls > _ip(self, "score_threshold_value")
        outs = _ssd_outputs(self, boxes, cls, passed, torch.int64)
    else:
        s, t = scores_t.betensor.cpu().to(torch.float32), deltas_t.betensor.cpu().to(torch.float32)
        _check_ssd_inputs(self, s, t, class_num)
        a = _anchors(self, s.shape[1]).cpu().to(torch.float32)
        boxes = decode_float(t, variance, a[:, 0], a[:, 1], a[:, 2], a[:, 3])
        if clip:
            boxes = _clip_boxes(boxes, 0.0, hmax, 0.0, wmax)
        cls = s[:, :, s.shape[2] - class_num:]
        outs = _ssd_outputs(self, boxes, cls, cls > thr, torch.float32)
    for o, v in zip(self.outputs, outs):
        o.betensor = v.to(device)


@DECODEBOX.quantize
def decodebox_quantize(self: PyNode) -> None:
    """Anchors to int32 fixed point (`anchor_frac_bits`), decode tables, 16-bit box params from calibration, the
    exact integer score threshold; scores copy the score input's params; counts and labels are integers."""
    class_num, thr, variance, clip, hmax, wmax = _decodebox_params(self)
    check_quantized_inputs(self, self.inputs)
    scores_t, deltas_t = self.inputs[0], self.inputs[1]
    _require_16_bits(self, deltas_t, "the delta input")
    w = self.get_constant("weights")
    anchors = w.betensor.to(torch.float64)
    amax = float(anchors.abs().max()) if anchors.numel() else 0.0
    af = ANCHOR_INT_BITS - max(0, math.ceil(math.log2(amax))) if amax > 0 else ANCHOR_INT_BITS
    if af < 0:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): anchors up to {amax:g} do not fit the "
                               f"{ANCHOR_INT_BITS}-bit fixed-point anchor format")
    w.betensor = torch.round(anchors * 2.0 ** af).to(torch.int64)
    w.dtype = Dtype.INT32
    qw = quant_of(self).of(w)
    qw.scale, qw.zerop, qw.qbits, qw.qinvariant = float(2 ** af), 0, 32, False
    self.params["anchor_frac_bits"] = af
    _store_decode_tables(self, deltas_t, variance)
    _quantize_boxes(self, float(2 ** af), (hmax, wmax) if clip else None)
    self.params["score_threshold_value"] = score_threshold_code(self, thr, scores_t)
    copy_params(self, self.outputs[3], scores_t)
    max_box = _out_dim(self, 0, 1, "boxes")
    for idx in (1, 2, 4):
        _set_index(self, self.outputs[idx], max(max_box, class_num))


# ------------------------------------------------------------------------------------------------ NMS
NMS = declare_op(
    "NMS",
    params={
        "iou_threshold": Param(Float(), "a box is suppressed when its IoU with a kept box of its class exceeds it, "
                               "in [0, 1] (upstream's quantized IR holds an integer)", required=True),
        "score_threshold": Param(Float(infinite=True), "only boxes with a score above it are candidates",
                                 default=float("-inf")),
        "method": Param(Text(choices=("HARD", "GAUSSIAN")), "HARD (GAUSSIAN, soft NMS, is not supported)",
                        default="HARD"),
        "max_output_size": Param(Int(lo=0), "boxes kept per class at most (default: the output capacity)"),
        "center_point_box": Param(Bool(), "0: corner boxes (1, centre boxes, is not supported)", default=0),
        "soft_nms_sigma": Param(Float(), "upstream's GAUSSIAN sigma; not read"),
        "image_height": Param(Float(), "upstream's image height; not read"),
        "image_width": Param(Float(), "upstream's image width; not read"),
        "boxes": Param(Value(), "written by some Parser versions (named like an input); not read"),
        "box_num_perclass": Param(Value(), "written by some Parser versions (named like an input); not read"),
        "scale": Param(Value(), "written by some Parser versions; not read"),
        "iou_threshold_value": quantized(Int(lo=0), "round(iou_threshold * 2^iou_threshold_shift)"),
        "iou_threshold_shift": quantized(Int(lo=0), "fraction bits of iou_threshold_value (16)"),
        "score_threshold_value": quantized(Int(), "score_threshold as an exact integer code of the score input"),
        "areas_shift": quantized(Int(), "upstream's area shift; not read"),
        "iou_thresh_shift": quantized(Int(), "upstream's IoU threshold shift; not read"),
        "soft_nms_sigma_in_shift": quantized(Int(), "upstream's GAUSSIAN table input shift; not read"),
    },
    constants={"gaussian_scale_lut": "upstream's GAUSSIAN table; not read",
               "gaussian_shift_lut": "upstream's GAUSSIAN table; not read"},
    integer="exact integer IoU test inter * 2^16 > round(t * 2^16) * union; boxes and scores "
            "passthrough, counts/indices integers",
    dtypes="boxes/scores keep their params; counts and keep uint16",
    semantics="docs/semantics/detection.md#nms")


def _nms_params(node: PyNode) -> Tuple[float, float, int]:
    if len(node.inputs) != 4 or len(node.outputs) != 4:
        raise node._error("expects 4 inputs (boxes, box_num_perclass, total_class_num, scores) and 4 outputs "
                          "(boxes, box_num_perclass, scores, keep)")
    method = str(node.get_param("method", optional=True, default_value="HARD")).upper()
    if method != "HARD":
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): method={method} is not supported (HARD only)")
    if int(node.get_param("center_point_box", optional=True, default_value=0)) != 0:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): center_point_box=1 is not supported (corner "
                               "boxes only)")
    iou = _number(node, "iou_threshold")
    if not 0.0 <= iou <= 1.0:
        raise node._error(f"iou_threshold must lie in [0, 1], got {iou}")
    score = _number(node, "score_threshold", float("-inf"))
    max_box = _out_dim(node, 0, 1, "boxes")
    per_class = node.get_param("max_output_size", optional=True, default_value=max_box)
    if isinstance(per_class, bool) or not isinstance(per_class, int) or per_class < 0:
        raise node._error(f"max_output_size must be a non-negative integer, got {per_class!r}")
    return iou, score, per_class


def _corners(b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.minimum(b[:, 0], b[:, 2]), torch.minimum(b[:, 1], b[:, 3]), torch.maximum(b[:, 0], b[:, 2]),
            torch.maximum(b[:, 1], b[:, 3]))


def nms_keep(boxes: torch.Tensor, scores: torch.Tensor, passed: torch.Tensor, suppress, limit: int) -> List[int]:
    """Greedy hard NMS: candidates with `passed` by score descending (stable), a candidate is kept unless
    `suppress(inter, union)` holds against an already kept box; at most `limit` kept. Indices into `boxes`."""
    cand = passed.nonzero(as_tuple=True)[0]
    cand = cand[_stable_desc(scores[cand])]
    y0, x0, y1, x1 = _corners(boxes)
    area = (y1 - y0) * (x1 - x0)
    kept: List[int] = []
    alive = torch.ones(cand.numel(), dtype=torch.bool)
    for pos in range(cand.numel()):
        if len(kept) >= limit:
            break
        if not bool(alive[pos]):
            continue
        i = int(cand[pos])
        kept.append(i)
        rest = cand[pos + 1:]
        if rest.numel() == 0:
            break
        ih = torch.clamp(torch.minimum(y1[i], y1[rest]) - torch.maximum(y0[i], y0[rest]), min=0)
        iw = torch.clamp(torch.minimum(x1[i], x1[rest]) - torch.maximum(x0[i], x0[rest]), min=0)
        inter = ih * iw
        union = area[i] + area[rest] - inter
        alive[pos + 1:] &= ~suppress(inter, union)
    return kept


def _nms_run(node: PyNode, boxes: torch.Tensor, counts: torch.Tensor, total: torch.Tensor, scores: torch.Tensor,
             passed: torch.Tensor, suppress, per_class: int, dtype: torch.dtype) -> List[torch.Tensor]:
    batch = boxes.shape[0]
    max_box = _out_dim(node, 0, 1, "boxes")
    max_class = _out_dim(node, 1, 1, "box_num_perclass")
    boxes = boxes.reshape(batch, -1, 4)
    scores = scores.reshape(batch, -1)
    passed = passed.reshape(batch, -1)
    nbox = boxes.shape[1]
    if scores.shape[1] != nbox:
        raise node._error(f"scores hold {scores.shape[1]} values per batch item for {nbox} boxes")
    out_boxes = torch.zeros(batch, max_box, 4, dtype=dtype)
    out_counts = torch.zeros(batch, max_class, dtype=dtype)
    out_scores = torch.zeros(batch, max_box, dtype=dtype)
    out_keep = torch.zeros(batch, max_box, dtype=dtype)
    counts = counts.reshape(counts.shape[0], -1)
    total = total.reshape(total.shape[0], -1)
    for b in range(batch):
        cb, tb = counts[b % counts.shape[0]], total[b % total.shape[0]]
        start = filled = 0
        for c in range(min(int(tb[0]), cb.numel(), max_class)):
            n = max(0, min(int(cb[c]), nbox - start))
            if n == 0:
                continue
            rows = slice(start, start + n)
            kept = nms_keep(boxes[b, rows], scores[b, rows], passed[b, rows], suppress, per_class)
            kept = kept[:max_box - filled]
            idx = torch.tensor(kept, dtype=torch.int64) + start
            k = len(kept)
            out_boxes[b, filled:filled + k] = boxes[b, idx].to(dtype)
            out_scores[b, filled:filled + k] = scores[b, idx].to(dtype)
            out_keep[b, filled:filled + k] = idx.to(dtype)
            out_counts[b, c] = k
            filled += k
            start += n
    return [out_boxes, out_counts, out_scores, out_keep]


@NMS.forward
def nms_forward(self: PyNode) -> None:
    """Per class (contiguous blocks given by box_num_perclass / total_class_num), keep boxes by score unless their
    IoU with a kept box exceeds iou_threshold. Outputs: boxes, box_num_perclass, scores, keep (input box indices)."""
    iou, score_thr, per_class = _nms_params(self)
    b_t, n_t, t_t, s_t = self.inputs
    device = b_t.betensor.device  # computed on the CPU (greedy loops over the boxes), returned here
    if self.quantized:
        boxes, scores = int_value(b_t).cpu(), int_value(s_t).cpu()
        t_q, sh = _ip(self, "iou_threshold_value"), _ip(self, "iou_threshold_shift")

        def suppress(inter: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
            return (inter << sh) > t_q * union

        passed = scores > _ip(self, "score_threshold_value")
        outs = _nms_run(self, boxes, int_value(n_t).cpu(), int_value(t_t).cpu(), scores, passed, suppress, per_class,
                        torch.int64)
    else:
        boxes = b_t.betensor.cpu().to(torch.float64)
        scores = s_t.betensor.cpu().to(torch.float64)

        def suppress(inter: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
            return inter > iou * union

        counts = torch.round(n_t.betensor.cpu().to(torch.float64)).to(torch.int64)
        total = torch.round(t_t.betensor.cpu().to(torch.float64)).to(torch.int64)
        outs = _nms_run(self, boxes, counts, total, scores, scores > score_thr, suppress, per_class, torch.float64)
        outs = [o.to(torch.float32) for o in outs]
    for o, v in zip(self.outputs, outs):
        o.betensor = v.to(device)


@NMS.quantize
def nms_quantize(self: PyNode) -> None:
    """Boxes and scores keep their input params (values are selected, never changed); the IoU threshold becomes
    round(t * 2^16) and the score threshold an exact integer code; counts and indices are integers."""
    iou, score_thr, _ = _nms_params(self)
    check_quantized_inputs(self, self.inputs)
    b_t, _, _, s_t = self.inputs
    _require_16_bits(self, b_t, "the box input")
    for t in (b_t, s_t):
        if params(self, t).per_channel:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel params of '{t.name}' are not "
                                   "supported")
    self.params["iou_threshold_value"] = int(round(iou * 2 ** IOU_THRESHOLD_SHIFT))
    self.params["iou_threshold_shift"] = IOU_THRESHOLD_SHIFT
    self.params["score_threshold_value"] = score_threshold_code(self, score_thr, s_t)
    copy_params(self, self.outputs[0], b_t)
    copy_params(self, self.outputs[2], s_t)
    nbox = max(int(b_t.ir_shape[1]) if len(b_t.ir_shape) > 1 else 1, _out_dim(self, 0, 1, "boxes"))
    _set_index(self, self.outputs[1], nbox)
    _set_index(self, self.outputs[3], nbox)


# ------------------------------------------------------------------------------------------------ DetectionOutput
DETECTIONOUTPUT = declare_op(
    "DetectionOutput",
    params={
        "score_threshold": Param(Float(infinite=True), "a (proposal, class) is kept when its score is above it"),
        "image_height": Param(Float(), "upper clip bound of the y coordinates"),
        "image_width": Param(Float(), "upper clip bound of the x coordinates"),
        "variance": Param(Floats(), "the 4 divisors of the encodings (ty, tx, th, tw), finite and non-zero",
                          default=[1.0, 1.0, 1.0, 1.0]),
        "anchor_mode": Param(Text(choices=("default_detect", "caffe_detection")), "default_detect: (y, x) order; "
                             "caffe_detection: (x, y) order of encodings and proposals", default="default_detect"),
        "bbox_xform_clip": Param(Float(infinite=True), "upstream's clamp of th, tw; not read"),
        "clip": Param(Value(), "written by some Parser versions; not read (boxes are always clipped to the image)"),
        "box_num_perclass": Param(Value(), "written by some Parser versions (named like an output); not read"),
        "scores": Param(Value(), "written by some Parser versions (named like an output); not read"),
        "scale": Param(Value(), "written by some Parser versions; not read"),
        "lut_frac_bits": quantized(Int(lo=0), "fraction bits Lf of the decode tables"),
        "box_scale_value": quantized(Either(kinds=(Int(lo=0), Ints(lo=0))),
                                     "multiplier of the box requantization (upstream writes a list)"),
        "box_shift_value": quantized(Either(kinds=(Int(), Ints())),
                                     "shift of the box requantization (upstream writes a list)"),
        "box_scale_type": quantized(Either(kinds=(DtypeName(), Value("dtype list"))),
                                    "upstream's dtypes of box_scale_value; not read"),
        "box_shift_type": quantized(Either(kinds=(DtypeName(), Value("dtype list"))),
                                    "upstream's dtypes of box_shift_value; not read"),
        "delta_shift": quantized(Either(kinds=(Int(), Ints())), "upstream's pre-shifts; not read"),
        "height": quantized(Int(), "upper clip bound of the y coordinates, as an output code"),
        "width": quantized(Int(), "upper clip bound of the x coordinates, as an output code"),
        "score_threshold_value": quantized(Int(), "score_threshold as an exact integer code of the score input"),
    },
    constants={"lut_ty": "decode table t / variance[0] (quantized)",
               "lut_tx": "decode table t / variance[1] (quantized)",
               "lut_th": "decode table exp(t / variance[2]) (quantized)",
               "lut_tw": "decode table exp(t / variance[3]) (quantized)",
               "ty_lut": "upstream's decode table; not read", "tx_lut": "upstream's decode table; not read",
               "th_lut": "upstream's decode table; not read", "tw_lut": "upstream's decode table; not read"},
    integer="delta tables in fixed point on integer proposals, one exact requant per coordinate, integer "
            "score threshold; scores passthrough, counts/labels integers",
    dtypes="scores as input, boxes int16/uint16, counts/labels uint16",
    semantics="docs/semantics/detection.md#detectionoutput")


def _detout_params(node: PyNode) -> Tuple[bool, List[float], float, float, float]:
    if len(node.inputs) != 3 or len(node.outputs) != 5:
        raise node._error("expects 3 inputs (class scores, box encodings, proposals) and 5 outputs (scores, boxes, "
                          "box_num_perclass, class_label, total_class_num)")
    mode = str(node.get_param("anchor_mode", optional=True, default_value="default_detect"))
    if mode not in ("default_detect", "caffe_detection"):
        raise node._error(f"anchor_mode must be default_detect or caffe_detection, got {mode!r}")
    return (mode == "caffe_detection", _variance(node, [1.0, 1.0, 1.0, 1.0]), _number(node, "score_threshold"),
            _number(node, "image_height"), _number(node, "image_width"))


def _detout_split(node: PyNode, conf: torch.Tensor, enc: torch.Tensor, prop: torch.Tensor,
                  caffe: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Class scores without the background column and deltas (ty, tx, th, tw) [N, R, C, 4]; proposal corners as
    (y0, x0, y1, x1) [N, R]."""
    if conf.dim() != 3 or enc.dim() != 4 or enc.shape[3] != 4 or prop.dim() != 3 or prop.shape[2] != 4 or \
            enc.shape[:2] != conf.shape[:2] or prop.shape[:2] != conf.shape[:2] or conf.shape[2] != enc.shape[2] + 1:
        raise node._error(f"inputs must be scores [N, R, C+1], encodings [N, R, C, 4] and proposals [N, R, 4], got "
                          f"{list(conf.shape)}, {list(enc.shape)}, {list(prop.shape)}")
    if caffe:
        enc = enc[..., [1, 0, 3, 2]]
        prop = prop[..., [1, 0, 3, 2]]
    return enc, [prop[..., k] for k in range(4)]


def _detout_outputs(node: PyNode, scores: torch.Tensor, boxes: torch.Tensor, passed: torch.Tensor,
                    dtype: torch.dtype) -> List[torch.Tensor]:
    """Class-major selection: for each class, the proposals whose score passes, up to the output capacity."""
    batch = scores.shape[0]
    max_box = _out_dim(node, 0, 1, "scores")
    max_class = _out_dim(node, 2, 1, "box_num_perclass")
    out_scores = torch.zeros(batch, max_box, dtype=dtype)
    out_boxes = torch.zeros(batch, max_box, 4, dtype=dtype)
    counts_t = torch.zeros(batch, max_class, dtype=dtype)
    labels_t = torch.zeros(batch, max_class, dtype=dtype)
    total_t = torch.zeros(batch, 1, dtype=dtype)
    for b in range(batch):
        k_idx, r_idx = passed[b].t().nonzero(as_tuple=True)
        k_idx, r_idx = k_idx[:max_box], r_idx[:max_box]
        labels, counts = torch.unique_consecutive(k_idx, return_counts=True)
        labels, counts = labels[:max_class], counts[:max_class]
        n = int(counts.sum()) if counts.numel() else 0
        out_scores[b, :n] = scores[b, r_idx[:n], k_idx[:n]].to(dtype)
        out_boxes[b, :n] = boxes[b, r_idx[:n], k_idx[:n]].to(dtype)
        counts_t[b, :counts.numel()] = counts.to(dtype)
        labels_t[b, :labels.numel()] = labels.to(dtype)
        total_t[b, 0] = labels.numel()
    return [out_scores, out_boxes, counts_t, labels_t, total_t]


@DETECTIONOUTPUT.forward
def detectionoutput_forward(self: PyNode) -> None:
    """Decode per-class encodings [N, R, C, 4] on proposals [N, R, 4], clip to the image, keep scores above
    score_threshold class by class (background column 0 dropped). Outputs: scores, boxes, box_num_perclass,
    class_label, total_class_num."""
    caffe, variance, thr, height, width = _detout_params(self)
    c_t, e_t, p_t = self.inputs
    device = c_t.betensor.device  # computed on the CPU (a selection loop per batch item), returned here
    if self.quantized:
        conf, enc, prop = int_value(c_t).cpu(), int_value(e_t).cpu(), int_value(p_t).cpu()
        enc, (y0, x0, y1, x1) = _detout_split(self, conf, enc, prop, caffe)
        zp = tensor_zp(self, p_t)
        cy2, cx2 = (y0 + y1 + 2 * zp).unsqueeze(-1), (x0 + x1 + 2 * zp).unsqueeze(-1)
        boxes = decode_int(self, enc, e_t, cy2, cx2, (y1 - y0).unsqueeze(-1), (x1 - x0).unsqueeze(-1))
        scores = conf[:, :, 1:]
        outs = _detout_outputs(self, scores, boxes, scores > _ip(self, "score_threshold_value"), torch.int64)
    else:
        conf, enc, prop = (t.betensor.cpu().to(torch.float32) for t in (c_t, e_t, p_t))
        enc, (y0, x0, y1, x1) = _detout_split(self, conf, enc, prop, caffe)
        cy, cx = ((y0 + y1) / 2.0).unsqueeze(-1), ((x0 + x1) / 2.0).unsqueeze(-1)
        boxes = decode_float(enc, variance, cy, cx, (y1 - y0).unsqueeze(-1), (x1 - x0).unsqueeze(-1))
        boxes = _clip_boxes(boxes, 0.0, height, 0.0, width)
        scores = conf[:, :, 1:]
        outs = _detout_outputs(self, scores, boxes, scores > thr, torch.float32)
    for o, v in zip(self.outputs, outs):
        o.betensor = v.to(device)


@DETECTIONOUTPUT.quantize
def detectionoutput_quantize(self: PyNode) -> None:
    """Decode tables on the encoding input, 16-bit box params from calibration (proposals in their own integer
    units), clip codes, the exact integer score threshold; scores copy the class-score input's params."""
    caffe, variance, thr, height, width = _detout_params(self)
    check_quantized_inputs(self, self.inputs)
    c_t, e_t, p_t = self.inputs
    _require_16_bits(self, e_t, "the encoding input")
    _require_16_bits(self, p_t, "the proposal input")
    _store_decode_tables(self, e_t, variance)
    _quantize_boxes(self, tensor_scale(self, p_t), (height, width))
    self.params["score_threshold_value"] = score_threshold_code(self, thr, c_t)
    copy_params(self, self.outputs[0], c_t)
    max_box = _out_dim(self, 0, 1, "scores")
    for idx in (2, 3, 4):
        _set_index(self, self.outputs[idx], max_box)

