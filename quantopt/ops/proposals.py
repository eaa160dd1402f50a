"""Region-proposal post-processing: PostNMS1 (the proposals kept by NMS, and the same normalized by the image size)
and PostNMS2 (the detections kept by NMS, class by class).

Kept boxes move unchanged (passthrough params); PostNMS1's normalized boxes are requantized once (15-bit multiplier,
round half to even) to upstream's 16-bit output params. Index and count inputs must be exact integers. The integer
semantics are in docs/semantics/proposals.md.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype, int_dtype_for_bits
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import integer_range, linear_quant_params, quantize
from ..quant.requant import scale_shift
from ..quant.rounding import round_shift
from ..registry import declare_op
from ..registry.schema import DtypeName, Float, Floats, Int, Param, quantized
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    copy_params,
    int_value,
    integer_index_input,
    layer_settings,
    out_range,
    refuse_per_channel,
    require_integer_input,
    set_constant,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
    zero_code,
)

SEMANTICS = "docs/semantics/proposals.md"

NORM_BITS = 16
"""PostNMS1's normalized boxes are uint16 (as upstream)."""

MULT_BITS = 15
SHIFT_MAX = 62


def _check_integer_inputs(node: PyNode, tensors: List[PyTensor]) -> None:
    for t in tensors:
        require_integer_input(node, t, "index/count")


# ------------------------------------------------------------------------------------------------ PostNMS1
POST_NMS1 = declare_op(
    "PostNMS1",
    params={
        "image_height": Param(Int(lo=1), "the image height", default=600),
        "image_width": Param(Int(lo=1), "the image width", default=600),
        "proposal_cnt": Param(Int(lo=1), "the number of proposals written (the outputs' IR dim 1)", default=100),
        "nor_box_scale_value": quantized(Int(lo=0), "multiplier of the normalized boxes' requantization"),
        "nor_box_shift_value": quantized(Int(), "shift of the normalized boxes' requantization"),
        "nor_box_scale_h": quantized(Int(), "upstream's multiplier; not read"),
        "nor_box_scale_w": quantized(Int(), "upstream's multiplier; not read"),
        "nor_box_shift_h": quantized(Int(), "upstream's shift; not read"),
        "nor_box_shift_w": quantized(Int(), "upstream's shift; not read"),
    },
    integer="kept boxes passthrough; normalized boxes requantized once (round half to even) to uint16",
    dtypes="boxes passthrough, normalized boxes uint16; keep/counts integers",
    semantics=f"{SEMANTICS}#postnms1",
    summary="Inputs: proposals [N, P, 4], keep [N, K] (indices within each class block), nms_box_num_perclass "
            "[N, C]. Outputs: the kept proposals [N, proposal_cnt, 4] and the same divided by max(image_height, "
            "image_width).")


def _pn1_params(node: PyNode) -> tuple:
    if len(node.inputs) != 3 or len(node.outputs) != 2:
        raise node._error("expects 3 inputs (proposals, keep, nms_box_num_perclass) and 2 outputs")
    h = int(node.get_param("image_height", optional=True, default_value=600))
    w = int(node.get_param("image_width", optional=True, default_value=600))
    cnt = int(node.get_param("proposal_cnt", optional=True, default_value=100))
    return h, w, cnt


def _pn1_gather(node: PyNode, boxes: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor,
                cnt: int, fill: float = 0.0) -> tuple:
    """For each class c: its counts[c] kept entries, the i-th overall at offset(c) + keep[i] (offset(c) the sum of
    the earlier counts); at most cnt boxes, an index beyond the proposals ends the class. `fill` after; also returns
    the number of boxes written per batch item."""
    if boxes.dim() != 3 or boxes.shape[2] != 4:
        raise node._error(f"proposals must be [N, P, 4], got {list(boxes.shape)}")
    batch, nbox = int(boxes.shape[0]), int(boxes.shape[1])
    keep = keep.reshape(keep.shape[0], -1)
    counts = counts.reshape(counts.shape[0], -1)
    out = torch.full((batch, cnt, 4), fill, dtype=boxes.dtype, device=boxes.device)
    written = []
    for b in range(batch):
        kb, cb = keep[b % keep.shape[0]], counts[b % counts.shape[0]]
        filled = offset = 0
        for c in range(int(cb.numel())):
            for _ in range(max(0, int(cb[c]))):
                if filled >= cnt or filled >= kb.numel():
                    break
                idx = offset + int(kb[filled])
                if idx >= nbox or idx < 0:
                    break
                out[b, filled] = boxes[b, idx]
                filled += 1
            offset += int(cb[c])
        written.append(filled)
    return out, written


@POST_NMS1.forward
def post_nms1_forward(self: PyNode) -> None:
    """Kept proposals (see _pn1_gather) and the same divided by max(image_height, image_width)."""
    h, w, cnt = _pn1_params(self)
    p_t, k_t, c_t = self.inputs
    keep, counts = integer_index_input(self, k_t, "keep"), integer_index_input(self, c_t, "nms_box_num_perclass")
    if self.quantized:
        boxes, written = _pn1_gather(self, int_value(p_t), keep, counts, cnt, zero_code(self, p_t))
        o1 = self.outputs[1]
        qmin, qmax = out_range(self, o1)
        m, n = int(self.get_param("nor_box_scale_value")), int(self.get_param("nor_box_shift_value"))
        norm = torch.clamp(round_shift((boxes + tensor_zp(self, p_t)) * m, n) - tensor_zp(self, o1), qmin, qmax)
        for b, k in enumerate(written):
            norm[b, k:] = zero_code(self, o1)
        self.outputs[0].betensor = boxes
        self.outputs[1].betensor = norm
    else:
        boxes, _ = _pn1_gather(self, p_t.betensor, keep, counts, cnt)
        self.outputs[0].betensor = boxes
        self.outputs[1].betensor = boxes / float(max(h, w))


@POST_NMS1.quantize
def post_nms1_quantize(self: PyNode) -> None:
    """Boxes keep the proposals' params; normalized boxes uint16 with upstream's scale (the scale of the range
    [0, s_p * image_height] at the proposals' bits, times s_p * max(h, w)) and its zero point."""
    h, w, _ = _pn1_params(self)
    check_quantized_inputs(self, self.inputs)
    p_t = self.inputs[0]
    refuse_per_channel(self, p_t)
    _check_integer_inputs(self, self.inputs[1:])
    copy_params(self, self.outputs[0], p_t)
    bits = int(quant_of(self).get(p_t).qbits or 8)
    s_p = tensor_scale(self, p_t)
    p = linear_quant_params(0.0, s_p * h, bits, activation_mode(self, bits), False)
    o1 = self.outputs[1]
    q1 = quant_of(self).of(o1)
    q1.scale = float(torch.tensor(float(p.scale) * max(h, w) * s_p, dtype=torch.float32))
    q1.zerop = int(p.zerop)
    q1.qbits, q1.qinvariant = NORM_BITS, False
    o1.dtype, o1.ir_range = Dtype.UINT16, None
    q1.qmin, q1.qmax = 0, 2 ** NORM_BITS - 1
    ratio = tensor_scale(self, o1) / (s_p * max(h, w))
    m, n, _, _ = scale_shift(torch.tensor(ratio, dtype=torch.float32), MULT_BITS, shift_limit=SHIFT_MAX)
    self.params["nor_box_scale_value"], self.params["nor_box_shift_value"] = int(m), int(n)


# ------------------------------------------------------------------------------------------------ PostNMS2
POST_NMS2 = declare_op(
    "PostNMS2",
    params={
        "image_height": Param(Int(lo=1), "the image height; not read", default=600),
        "image_width": Param(Int(lo=1), "the image width; not read", default=600),
        "proposal_cnt": Param(Int(lo=1), "the number of boxes written (output 0's IR dim 1)", default=100),
    },
    integer="kept boxes passthrough; counts exact",
    dtypes="boxes passthrough, scores as boxes (zeros), count int32",
    semantics=f"{SEMANTICS}#postnms2",
    summary="Inputs: detection boxes [N, D, 4], box_num_perclass [N, C], nms_box_num_perclass [N, C'], "
            "total_class_num [N, 1], class_label [N, C], keep [N, K]. Outputs: the kept boxes [N, proposal_cnt, 4], "
            "class scores (zeros) [N, proposal_cnt] and the number of input boxes of the classes read [1].")


def _pn2_check(node: PyNode) -> int:
    if len(node.inputs) != 6 or len(node.outputs) != 3:
        raise node._error("expects 6 inputs (boxes, box_num_perclass, nms_box_num_perclass, total_class_num, "
                          "class_label, keep) and 3 outputs")
    return int(node.get_param("proposal_cnt", optional=True, default_value=100))


def _pn2_gather(node: PyNode, boxes: torch.Tensor, per_class: torch.Tensor, total: torch.Tensor,
                keep: torch.Tensor, cnt: int, fill: float = 0.0) -> tuple:
    """For each class c < total_class_num: its per_class[c] entries j, box offset(c) + keep[offset(c) + j] (offset
    the sum of the earlier counts; an entry past keep ends the class), at most cnt boxes. Returns the boxes and the
    last offset (the number of input boxes of the classes read), for every batch item."""
    if boxes.dim() != 3 or boxes.shape[2] != 4:
        raise node._error(f"detection boxes must be [N, D, 4], got {list(boxes.shape)}")
    batch, nbox = int(boxes.shape[0]), int(boxes.shape[1])
    per_class = per_class.reshape(per_class.shape[0], -1)
    total = total.reshape(total.shape[0], -1)
    keep = keep.reshape(keep.shape[0], -1)
    out = torch.full((batch, cnt, 4), fill, dtype=boxes.dtype, device=boxes.device)
    offsets = torch.zeros(batch, dtype=torch.int64, device=boxes.device)
    for b in range(batch):
        pb, kb = per_class[b % per_class.shape[0]], keep[b % keep.shape[0]]
        filled = offset = 0
        for c in range(max(0, min(int(total[b % total.shape[0], 0]), int(pb.numel())))):
            for j in range(max(0, int(pb[c]))):
                if offset + j >= kb.numel() or filled >= cnt:
                    break
                idx = offset + int(kb[offset + j])
                if 0 <= idx < nbox:
                    out[b, filled] = boxes[b, idx]
                    filled += 1
            offset += int(pb[c])
        offsets[b] = offset
    return out, offsets


@POST_NMS2.forward
def post_nms2_forward(self: PyNode) -> None:
    """Kept detection boxes class by class (see _pn2_gather); scores are zeros; the count output holds the number
    of input boxes of the classes read (first batch item, as upstream)."""
    cnt = _pn2_check(self)
    d_t, n_t, _, t_t, _, k_t = self.inputs
    per_class = integer_index_input(self, n_t, "box_num_perclass")
    total = integer_index_input(self, t_t, "total_class_num")
    keep = integer_index_input(self, k_t, "keep")
    boxes = int_value(d_t) if self.quantized else d_t.betensor
    fill = zero_code(self, d_t) if self.quantized else 0.0
    out, offsets = _pn2_gather(self, boxes, per_class, total, keep, cnt, fill)
    batch = int(out.shape[0])
    self.outputs[0].betensor = out
    if self.quantized:
        self.outputs[1].betensor = torch.full((batch, cnt), zero_code(self, self.outputs[1]), dtype=torch.int64,
                                              device=out.device)
    else:
        self.outputs[1].betensor = torch.zeros(batch, cnt, dtype=out.dtype, device=out.device)
    self.outputs[2].betensor = offsets[:1].to(torch.int64 if self.quantized else out.dtype)


@POST_NMS2.quantize
def post_nms2_quantize(self: PyNode) -> None:
    """Boxes and the (zero) scores keep the box input's params; the count is an int32 integer."""
    _pn2_check(self)
    check_quantized_inputs(self, self.inputs)
    refuse_per_channel(self, self.inputs[0])
    _check_integer_inputs(self, [self.inputs[i] for i in (1, 3, 5)])
    copy_params(self, self.outputs[0], self.inputs[0])
    copy_params(self, self.outputs[1], self.inputs[0])
    set_qinvariant(self, self.outputs[2], 32, True)


# ------------------------------------------------------------------------------------------------ Proposal
PROPOSAL_STD_DIV = [10.0, 10.0, 5.0, 5.0]
"""Upstream's fixed divisors of the deltas (dy, dx, dh, dw); its `scale_anchor` param is not read."""
COORD_BITS = 16
"""Anchors, boxes and the decode tables are int16 (upstream: max(16, activation bits) with an int16 dtype)."""
_ANCHORS = ("ycenter", "xcenter", "ha", "wa")
_TABLES = ("ty_lut", "tx_lut", "th_lut", "tw_lut")

PROPOSAL = declare_op(
    "Proposal",
    params={
        "height": Param(Int(), "image height in pixels (quantized IR: in box codes, as upstream writes it)",
                        required=True),
        "width": Param(Int(), "image width in pixels (quantized IR: in box codes)", required=True),
        "score_threshold": Param(Float(), "an anchor is kept when its foreground score is above this",
                                 required=True),
        "scale_anchor": Param(Floats(), "upstream's divisors of the deltas; not read (always [10, 10, 5, 5])"),
        "score_threshold_value": quantized(Int(), "the threshold in score codes"),
        "score_threshold_type": quantized(DtypeName(), "dtype of score_threshold_value"),
        "box_shift_value": quantized(Int(), "shift F of the decode: table value * anchor size >> F"),
        "box_shift_type": quantized(DtypeName(), "dtype of box_shift_value"),
    },
    constants={"ycenter": "anchor centre y (pixels; quantized: int16 box codes)",
               "xcenter": "anchor centre x", "ha": "anchor height", "wa": "anchor width",
               "ty_lut": "decode table dy / 10 (quantized)", "tx_lut": "decode table dx / 10 (quantized)",
               "th_lut": "decode table exp(dh / 5) (quantized)", "tw_lut": "decode table exp(dw / 5) (quantized)"},
    integer="delta tables (int16, 2^F fixed point), (table * anchor) >> F, box edges rounded half to even, "
            "clipped to the image; scores compared as codes",
    dtypes="scores [N,A,2], deltas [N,A,4] → scores (scores' dtype), boxes int16, count uint16, ones uint16",
    semantics=f"{SEMANTICS}#proposal",
    summary="Region proposals of an RPN: anchors decoded by deltas (dy, dx, dh, dw) / [10, 10, 5, 5], clipped to "
            "the image; the first M anchors whose foreground score (scores[..., 1]) is above score_threshold, in "
            "anchor order (M the outputs' IR dim 1). Outputs: scores [N, M], boxes [N, M, 4], count [N, 1], "
            "and a constant [1, 1] of ones.")


def _proposal_check(node: PyNode) -> Tuple[int, int]:
    """(A, M): anchors per image and boxes written per image."""
    if len(node.inputs) != 2 or len(node.outputs) != 4:
        raise node._error("expects 2 inputs (scores [N, A, 2], deltas [N, A, 4]) and 4 outputs")
    s, d = node.inputs[0].betensor, node.inputs[1].betensor
    if s.dim() != 3 or s.shape[2] != 2 or d.dim() != 3 or d.shape[2] != 4 or d.shape[:2] != s.shape[:2]:
        raise node._error(f"scores must be [N, A, 2] and deltas [N, A, 4], got {list(s.shape)} and "
                          f"{list(d.shape)}")
    a = int(s.shape[1])
    for k in _ANCHORS:
        c = node.get_constant(k, optional=True)
        if c is None or c.betensor.numel() != a:
            raise node._error(f"constant '{k}' must hold {a} anchor values")
    shape = node.outputs[0].ir_shape
    if not shape or len(shape) < 2 or int(shape[1]) < 1:
        raise node._error("output 0 needs an IR shape [N, M] (M: the boxes written per image)")
    return a, int(shape[1])


def _anchor(node: PyNode, key: str) -> torch.Tensor:
    return node.constants[key].betensor.reshape(-1)


def _proposal_select(score: torch.Tensor, boxes: torch.Tensor, thresh, m: int, fill) -> tuple:
    """Per image the first m anchors with score > thresh: (scores [N, m], boxes [N, m, 4], counts [N, 1])."""
    n = score.shape[0]
    out_s = torch.full((n, m), fill[0], dtype=score.dtype, device=score.device)
    out_b = torch.full((n, m, 4), fill[1], dtype=boxes.dtype, device=score.device)
    counts = torch.zeros((n, 1), dtype=torch.int64, device=score.device)
    for i in range(n):
        idx = torch.nonzero(score[i] > thresh).reshape(-1)[:m]
        out_s[i, :idx.numel()] = score[i, idx]
        out_b[i, :idx.numel()] = boxes[i, idx]
        counts[i, 0] = idx.numel()
    return out_s, out_b, counts


def _proposal_placeholders(node: PyNode, values: List[torch.Tensor]) -> None:
    """Upstream's two inner statistics: `<layer>/coords` (anchor-space values: centres, sizes, edges) and
    `<layer>/box` (the scaled deltas and their exponentials), each the concatenation of its tensors."""
    names = [f"{node.name}/coords", f"{node.name}/box"]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(nm, v.detach().to(torch.float32)) for nm, v in zip(names, values)]
        return
    for t, v in zip(node.placeholders, values):
        t.betensor = v.detach().to(torch.float32)


def _proposal_float(node: PyNode, a: int, m: int) -> None:
    h_img, w_img = float(node.get_param("height")), float(node.get_param("width"))
    s = node.inputs[0].betensor.to(torch.float32)
    d = node.inputs[1].betensor.to(torch.float32)
    ya, xa, ha, wa = (_anchor(node, k).to(device=d.device, dtype=torch.float32) for k in _ANCHORS)
    dy, dx, dh, dw = (d[..., i] / PROPOSAL_STD_DIV[i] for i in range(4))
    cy, cx = dy * ha + ya, dx * wa + xa
    eh, ew = torch.exp(dh), torch.exp(dw)
    h, w = eh * ha, ew * wa
    ymin, xmin, ymax, xmax = cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2
    _proposal_placeholders(node, [
        torch.cat([t.reshape(-1) for t in (cy, cx, h, w, ymin, ymax, xmin, xmax, cy, cx, h, w, dy * h, dx * w)]),
        torch.cat([t.reshape(-1) for t in (dy, dx, dh, dw, eh, ew)])])
    boxes = torch.stack([torch.clamp(ymin, 0, h_img), torch.clamp(xmin, 0, w_img), torch.clamp(ymax, 0, h_img),
                         torch.clamp(xmax, 0, w_img)], dim=-1)
    thresh = float(node.get_param("score_threshold"))
    out_s, out_b, counts = _proposal_select(s[..., 1], boxes, thresh, m, (0.0, 0.0))
    node.outputs[0].betensor = out_s
    node.outputs[1].betensor = out_b
    node.outputs[2].betensor = counts.to(torch.float32)
    node.outputs[3].betensor = torch.ones((1, 1), device=s.device)


def _proposal_int(node: PyNode, a: int, m: int) -> None:
    s_t, d_t = node.inputs
    d = int_value(d_t)
    q_d = quant_of(node).get(d_t)
    in_bits = int(q_d.qbits)
    in_qmin = int(q_d.qmin) if q_d.qmin is not None else 0
    in_qmin = -(1 << (in_bits - 1)) if in_qmin < 0 else 0  # the table spans the dtype's full range
    f = int(node.get_param("box_shift_value"))
    ly, lx, lh, lw = (lookup_lut(d[..., i], node.constants[k].betensor.to(d.device), in_qmin, in_bits, COORD_BITS,
                                 True) for i, k in enumerate(_TABLES))
    ya, xa, ha, wa = (int_value(node.constants[k]).to(d.device).reshape(-1) for k in _ANCHORS)
    h, w = (lh * ha) >> f, (lw * wa) >> f
    cy, cx = ((ly * ha) >> f) + ya, ((lx * wa) >> f) + xa
    hq, wq = int(node.get_param("height")), int(node.get_param("width"))
    edges = [(2 * cy - h, hq), (2 * cx - w, wq), (2 * cy + h, hq), (2 * cx + w, wq)]
    boxes = torch.stack([torch.clamp(round_shift(v, 1), 0, lim) for v, lim in edges], dim=-1)
    thresh = int(node.get_param("score_threshold_value"))
    o_s, o_b = node.outputs[0], node.outputs[1]
    out_s, out_b, counts = _proposal_select(int_value(s_t)[..., 1], boxes, thresh, m,
                                            (zero_code(node, o_s), zero_code(node, o_b)))
    node.outputs[0].betensor = out_s
    node.outputs[1].betensor = torch.clamp(out_b, *out_range(node, o_b))
    node.outputs[2].betensor = counts
    node.outputs[3].betensor = torch.ones((1, 1), dtype=torch.int64, device=d.device)


@PROPOSAL.forward
def proposal_forward(self: PyNode) -> None:
    """Float: decode, clip, select (and the placeholders' values). Integer: _proposal_int."""
    a, m = _proposal_check(self)
    if self.quantized:
        _proposal_int(self, a, m)
    else:
        _proposal_float(self, a, m)


def _coord_scale(node: PyNode, index: int, name: str, bits: int) -> Tuple[float, int]:
    """2^floor(log2(scale)) of placeholder `index`'s symmetric signed params at `bits`."""
    t = node.placeholders[index] if index < len(node.placeholders) else None
    r = ranges_of(node).get(t) if t is not None else None
    if t is None or t.name != f"{node.name}/{name}" or r.min is None or r.max is None:
        raise node._error(f"placeholder '{node.name}/{name}' has no calibrated range: the layer's float forward "
                          "must run during calibration")
    mode = activation_mode(node, bits).to_symmetric()
    scale = float(linear_quant_params(r.min, r.max, bits, mode, True).scale)
    return scale, math.floor(math.log2(scale))


@PROPOSAL.quantize
def proposal_quantize(self: PyNode) -> None:
    """Anchors (int16) in the power-of-two scale 2^Fa of the coords placeholder, decode tables in 2^F of the box
    placeholder (F = box_shift_value), threshold as a score code; height/width become box codes."""
    a, m = _proposal_check(self)
    check_quantized_inputs(self, self.inputs)
    s_t, d_t = self.inputs
    refuse_per_channel(self, s_t)
    refuse_per_channel(self, d_t)
    bits = max(COORD_BITS, int(layer_settings(self).q_bits_activation))
    _, fa = _coord_scale(self, 0, "coords", bits)
    _, f = _coord_scale(self, 1, "box", bits)
    sa = 2.0 ** fa
    self.params["height"] = int(float(self.get_param("height")) * sa)
    self.params["width"] = int(float(self.get_param("width")) * sa)
    lo, hi = integer_range(COORD_BITS, True)
    for k in _ANCHORS:
        q = quantize(_anchor(self, k).to(torch.float32), sa, 0, lo, hi)
        set_constant(self, k, q.to(torch.float32), Dtype.INT16)
    q_d = quant_of(self).get(d_t)
    in_bits = int(q_d.qbits)
    in_lo, in_hi = integer_range(in_bits, bool(q_d.qmin is not None and q_d.qmin < 0))
    lut_bits = min(in_bits, int(layer_settings(self).lut_items_in_bits))
    for k, div, use_exp in zip(_TABLES, PROPOSAL_STD_DIV, (False, False, True, True)):
        fn = (lambda x, v=div: torch.exp(x / v)) if use_exp else (lambda x, v=div: x / v)
        table = build_lut(fn, tensor_scale(self, d_t), tensor_zp(self, d_t), in_lo, in_hi, in_bits, 2.0 ** f, 0, lo,
                          hi, lut_bits)
        set_constant(self, k, table.to(torch.float32), Dtype.INT16)
    self.params["box_shift_value"] = int(f)
    self.params["box_shift_type"] = Dtype.INT8
    s_bits = int(quant_of(self).get(s_t).qbits)
    s_lo, s_hi = integer_range(s_bits, False)
    thresh = float(self.get_param("score_threshold"))
    self.params["score_threshold_value"] = int(quantize(torch.tensor(thresh), tensor_scale(self, s_t),
                                                        tensor_zp(self, s_t), s_lo, s_hi))
    self.params["score_threshold_type"] = int_dtype_for_bits(s_bits, False)
    copy_params(self, self.outputs[0], s_t)
    o = self.outputs[1]
    q = quant_of(self).of(o)
    q.scale, q.zerop, q.qbits, q.qinvariant, q.qmin, q.qmax = sa, 0, COORD_BITS, False, lo, hi
    o.dtype, o.ir_range = Dtype.INT16, None
    for t in self.outputs[2:]:
        set_qinvariant(self, t, 16, False)
