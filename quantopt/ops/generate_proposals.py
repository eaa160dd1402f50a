"""GenerateProposals: the region proposals of a Faster R-CNN RPN (anchor grid decode, clip, score sort, min-size
filter, greedy NMS).

Float forward: anchors (base anchors on a stride-16 grid, or one anchor per position) decoded by the deltas
(tx, ty, tw, th), clipped to the image, sorted by score, filtered and suppressed. Quantized (docs/semantics/
proposals.md#generateproposals): anchors int16 in a power-of-two scale 2^Fa, the deltas through two int16 tables in
2^F (t and exp(t)), `(table * anchor) >> F`, scores compared as codes, an exact int64 NMS.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import integer_range, linear_quant_params, quantize
from ..registry import declare_op
from ..registry.schema import Float, Int, Param, quantized
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    copy_params,
    int_value,
    layer_settings,
    quant_of,
    refuse_per_channel,
    set_constant,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
    zero_code,
)

SEMANTICS = "docs/semantics/proposals.md#generateproposals"

FEAT_STRIDE = 16
"""Pixels between two anchor positions of the grid (upstream's fixed value)."""
COORD_BITS = 16
"""Anchors and decode tables hold int16 values (upstream: max(16, activation bits), int16 range)."""
IOU_SCALE = 2048
"""The quantized iou_threshold is round-toward-zero(iou * 2048) (upstream's `iou_scale`)."""
_ANCHOR_KEYS = ("ycenter_a_q", "xcenter_a_q", "ha_q", "wa_q")

GENERATE_PROPOSALS = declare_op(
    "GenerateProposals",
    params={
        "pre_nms_topn": Param(Int(lo=1), "boxes kept after the score sort, before the filter and NMS", required=True),
        "post_nms_topn": Param(Int(lo=1), "boxes kept by NMS (the outputs' IR dim 1)", required=True),
        "image_height": Param(Int(lo=1), "image height in pixels", required=True),
        "image_width": Param(Int(lo=1), "image width in pixels", required=True),
        "min_size": Param(Float(), "a box is kept when both sides (pixels, x2 - x1 + 1) exceed this (quantized IR: "
                          "(min_size - 1) in box codes, truncated, as upstream writes it)", required=True),
        "iou_threshold": Param(Float(), "NMS suppresses a box whose IoU with a kept one is above this (quantized "
                               "IR: iou * iou_scale, truncated)", required=True),
        "anchor_scale": quantized(Int(lo=1), "2^Fa: box codes per pixel"),
        "iou_scale": quantized(Int(lo=1), "the denominator of the quantized iou_threshold (2048)"),
        "height_stride": quantized(Int(), "ceil(image_height / feature height) * anchor_scale; not read"),
        "width_stride": quantized(Int(), "ceil(image_width / feature width) * anchor_scale; not read"),
        "delta_shift": quantized(Int(), "shift F of the decode: table value * anchor >> F"),
        "roi_last_shift": quantized(Int(), "upstream's copy of delta_shift; not read"),
    },
    constants={"weights": "float anchors: base anchors [A, 4] (x1, y1, x2, y2) on a stride-16 grid, or [H*W*A, 4] "
                          "(w, h, x centre, y centre)",
               "ycenter_a_q": "quantized anchor centres y [H*W*A] (int16 box codes)", "xcenter_a_q": "centres x",
               "ha_q": "anchor heights", "wa_q": "anchor widths",
               "xy_lut": "decode table t (quantized, int16 values in an int32 tensor)",
               "wh_lut": "decode table exp(t) (quantized)",
               "anchors": "upstream's quantized base anchors (x2, y2 plus one), int16; not read"},
    integer="delta tables (int16, 2^F fixed point), (table * anchor) >> F, edges centre -/+ trunc(size / 2) clipped "
            "to the image, scores sorted as codes, exact int64 NMS",
    dtypes="scores [N,H,W,A], deltas [N,H,W,4A], image info → scores (scores' dtype), boxes uint16, batch index "
           "uint16, count uint16",
    semantics=SEMANTICS,
    summary="Region proposals: anchors decoded by deltas (tx, ty, tw, th), clipped to the image, the pre_nms_topn "
            "best scores, boxes with both sides above min_size, greedy NMS, at most post_nms_topn. Outputs: scores "
            "[N, P], boxes (x1, y1, x2, y2) [N, P, 4], batch index [N, P, 1], count [N, 1].")


def _check(node: PyNode) -> Tuple[int, int, int, int]:
    """(N, K, A, P): batch, grid positions, anchors per position and boxes written."""
    if len(node.inputs) != 3 or len(node.outputs) != 4:
        raise node._error("expects 3 inputs (scores [N, H, W, A], deltas [N, H, W, 4A], image info) and 4 outputs")
    s, d = node.inputs[0].betensor, node.inputs[1].betensor
    if s.dim() != 4 or d.dim() != 4 or d.shape[:3] != s.shape[:3] or int(d.shape[3]) != 4 * int(s.shape[3]):
        raise node._error(f"scores must be [N, H, W, A] and deltas [N, H, W, 4A], got {list(s.shape)} and "
                          f"{list(d.shape)}")
    for key in ("pre_nms_topn", "post_nms_topn", "image_height", "image_width"):
        if int(node.get_param(key)) < 1:
            raise node._error(f"'{key}' must be positive, got {node.get_param(key)}")
    post = int(node.get_param("post_nms_topn"))
    return int(s.shape[0]), int(s.shape[1]) * int(s.shape[2]), int(s.shape[3]), post


def grid_anchors(node: PyNode, height: int, width: int, a: int) -> torch.Tensor:
    """[H*W*A, 4] float32 anchors (w, h, x centre, y centre), position-major (h, w, then anchor)."""
    w_t = node.get_constant("weights", optional=True)
    if w_t is None:
        raise node._error("needs the constant 'weights' (the anchors)")
    anchors = w_t.betensor.to(torch.float32).reshape(-1, 4) if w_t.betensor.numel() % 4 == 0 else None
    k = height * width
    if anchors is not None and anchors.shape[0] == k * a:
        return anchors
    if anchors is None or anchors.shape[0] != a:
        raise node._error(f"constant 'weights' must be [A, 4] base anchors or [H*W*A, 4] anchors (A = {a}, "
                          f"H*W = {k}), got {list(w_t.betensor.shape)}")
    sy, sx = torch.meshgrid(torch.arange(height, dtype=torch.float32, device=anchors.device) * FEAT_STRIDE,
                            torch.arange(width, dtype=torch.float32, device=anchors.device) * FEAT_STRIDE,
                            indexing="ij")
    shifts = torch.stack([sx.reshape(-1), sy.reshape(-1), sx.reshape(-1), sy.reshape(-1)], dim=-1)
    boxes = (shifts[:, None, :] + anchors[None, :, :]).reshape(k * a, 4)
    wa = boxes[:, 2] - boxes[:, 0] + 1.0
    ha = boxes[:, 3] - boxes[:, 1] + 1.0
    return torch.stack([wa, ha, boxes[:, 0] + 0.5 * wa, boxes[:, 1] + 0.5 * ha], dim=-1)


def _select(boxes: torch.Tensor, scores: torch.Tensor, pre: int, post: int, min_side, keep_fn) -> torch.Tensor:
    """Indices kept: stable descending score sort, first `pre`, both sides (x2 - x1 + min_side[1]) > min_side[0],
    then greedy NMS (`keep_fn(box, others)` says which others survive the kept box), first `post`."""
    order = torch.sort(scores, descending=True, stable=True).indices[:pre]
    b = boxes[order]
    ok = ((b[:, 2] - b[:, 0] + min_side[1]) > min_side[0]) & ((b[:, 3] - b[:, 1] + min_side[1]) > min_side[0])
    order = order[ok]
    kept: List[int] = []
    while order.numel() > 0 and len(kept) < post:
        i = int(order[0])
        kept.append(i)
        rest = order[1:]
        order = rest[keep_fn(boxes[i], boxes[rest])]
    return torch.tensor(kept, dtype=torch.int64, device=boxes.device)


def _overlap(box: torch.Tensor, others: torch.Tensor, one) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(intersection, area of box, areas of others), sides counted as x2 - x1 + one."""
    w = torch.clamp(torch.minimum(box[2], others[:, 2]) - torch.maximum(box[0], others[:, 0]) + one, min=0)
    h = torch.clamp(torch.minimum(box[3], others[:, 3]) - torch.maximum(box[1], others[:, 1]) + one, min=0)
    area = (box[2] - box[0] + one) * (box[3] - box[1] + one)
    areas = (others[:, 2] - others[:, 0] + one) * (others[:, 3] - others[:, 1] + one)
    return w * h, area, areas


def _write(node: PyNode, boxes: List[torch.Tensor], scores: List[torch.Tensor], kept: List[torch.Tensor],
           post: int, fills: Tuple, out_dtype: torch.dtype) -> None:
    n = len(boxes)
    device = boxes[0].device if boxes else None
    out_s = torch.full((n, post), fills[0], dtype=out_dtype, device=device)
    out_b = torch.full((n, post, 4), fills[1], dtype=out_dtype, device=device)
    index = torch.zeros((n, post, 1), dtype=out_dtype, device=device)
    count = torch.zeros((n, 1), dtype=out_dtype, device=device)
    for b in range(n):
        k = kept[b]
        out_s[b, :k.numel()] = scores[b][k].to(out_dtype)
        out_b[b, :k.numel()] = boxes[b][k].to(out_dtype)
        index[b, :k.numel()] = b
        count[b, 0] = k.numel()
    for t, v in zip(node.outputs, (out_s, out_b, index, count)):
        t.betensor = v


def _placeholders(node: PyNode, values: List[torch.Tensor]) -> None:
    """Upstream's two inner statistics: `<layer>/coords` (anchor-space values) and `<layer>/box` (the deltas and
    their exponentials), each the concatenation of its tensors."""
    names = [f"{node.name}/coords", f"{node.name}/box"]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(nm, v.detach().to(torch.float32)) for nm, v in zip(names, values)]
        return
    for t, v in zip(node.placeholders, values):
        t.betensor = v.detach().to(torch.float32)


def _float_forward(node: PyNode, n: int, k: int, a: int, post: int) -> None:
    s_in = node.inputs[0].betensor
    anchors = grid_anchors(node, int(s_in.shape[1]), int(s_in.shape[2]), a).to(s_in.device)
    wa, ha, xa, ya = anchors.unbind(-1)
    img_h, img_w = int(node.get_param("image_height")), int(node.get_param("image_width"))
    pre = int(node.get_param("pre_nms_topn"))
    min_size, iou = float(node.get_param("min_size")), float(node.get_param("iou_threshold"))
    d = node.inputs[1].betensor.to(torch.float32).reshape(n, k * a, 4)
    coords, stats, boxes, scores, kept = [], [], [], [], []
    for b in range(n):
        tx, ty, tw, th = d[b].unbind(-1)
        w, h = torch.exp(tw) * wa, torch.exp(th) * ha
        cy, cx = ty * ha + ya, tx * wa + xa
        ymin, xmin = torch.clamp(cy - h / 2, 0, img_h - 1), torch.clamp(cx - w / 2, 0, img_w - 1)
        ymax, xmax = torch.clamp(cy + h / 2, 0, img_h - 1), torch.clamp(cx + w / 2, 0, img_w - 1)
        coords += [ya, xa, ha, wa, ymin, ymax, xmin, xmax, cy, cx, h, w, ty * ha, tx * wa]
        stats += [ty, tx, th, tw, torch.exp(th), torch.exp(tw)]
        bx = torch.stack([xmin, ymin, xmax, ymax], dim=-1)
        sc = s_in[b].reshape(-1).to(torch.float32)

        def keep_fn(box, others):
            inter, area, areas = _overlap(box.double(), others.double(), 1.0)
            return inter / (area + areas - inter) <= iou

        boxes.append(bx)
        scores.append(sc)
        kept.append(_select(bx, sc, pre, post, (min_size, 1.0), keep_fn))
    _placeholders(node, [torch.cat(coords), torch.cat(stats)])
    _write(node, boxes, scores, kept, post, (0.0, 0.0), torch.float32)


def _int_forward(node: PyNode, n: int, k: int, a: int, post: int) -> None:
    s_t, d_t = node.inputs[0], node.inputs[1]
    d = int_value(d_t).reshape(n, k * a, 4)
    q_d = quant_of(node).get(d_t)
    in_bits = int(q_d.qbits)
    in_qmin = -(1 << (in_bits - 1)) if q_d.qmin is not None and int(q_d.qmin) < 0 else 0
    f = int(node.get_param("delta_shift"))
    sa = int(node.get_param("anchor_scale"))
    ya, xa, ha, wa = (int_value(node.constants[key]).to(d.device).reshape(-1) for key in _ANCHOR_KEYS)
    if ya.numel() != k * a:
        raise node._error(f"quantized anchors hold {ya.numel()} values, the inputs need {k * a}")
    xy, wh = node.constants["xy_lut"].betensor.to(d.device), node.constants["wh_lut"].betensor.to(d.device)
    y_lim = int(node.get_param("image_height")) * sa - sa
    x_lim = int(node.get_param("image_width")) * sa - sa
    pre = int(node.get_param("pre_nms_topn"))
    min_q, iou_q = int(node.get_param("min_size")), int(node.get_param("iou_threshold"))
    iou_scale = int(node.get_param("iou_scale", optional=True, default_value=IOU_SCALE))
    boxes, scores, kept = [], [], []
    for b in range(n):
        lx, ly = (lookup_lut(d[b, :, i], xy, in_qmin, in_bits, COORD_BITS, True) for i in (0, 1))
        lw, lh = (lookup_lut(d[b, :, i], wh, in_qmin, in_bits, COORD_BITS, True) for i in (2, 3))
        h, w = (lh * ha) >> f, (lw * wa) >> f
        cy, cx = ((ly * ha) >> f) + ya, ((lx * wa) >> f) + xa
        hh, hw = torch.div(h, 2, rounding_mode="trunc"), torch.div(w, 2, rounding_mode="trunc")
        bx = torch.stack([torch.clamp(cx - hw, 0, x_lim), torch.clamp(cy - hh, 0, y_lim),
                          torch.clamp(cx + hw, 0, x_lim), torch.clamp(cy + hh, 0, y_lim)], dim=-1)
        sc = int_value(s_t)[b].reshape(-1)

        def keep_fn(box, others):
            inter, area, areas = _overlap(box, others, 0)
            return inter * iou_scale <= iou_q * (area + areas - inter)

        boxes.append(bx)
        scores.append(sc)
        kept.append(_select(bx, sc, pre, post, (min_q, 0), keep_fn))
    _write(node, boxes, scores, kept, post, (zero_code(node, node.outputs[0]), 0), torch.int64)


@GENERATE_PROPOSALS.forward
def generate_proposals_forward(self: PyNode) -> None:
    """Float: decode, clip, sort, filter, NMS (and the placeholders' values). Integer: the same on codes."""
    n, k, a, post = _check(self)
    if self.quantized:
        _int_forward(self, n, k, a, post)
    else:
        _float_forward(self, n, k, a, post)


def _pow2_scale(node: PyNode, index: int, name: str, bits: int) -> int:
    """floor(log2(scale)) of placeholder `index`'s symmetric signed params at `bits`."""
    t = node.placeholders[index] if index < len(node.placeholders) else None
    r = ranges_of(node).get(t) if t is not None else None
    if t is None or t.name != f"{node.name}/{name}" or r.min is None or r.max is None:
        raise node._error(f"placeholder '{node.name}/{name}' has no calibrated range: the layer's float forward "
                          "must run during calibration")
    mode = activation_mode(node, bits).to_symmetric()
    return math.floor(math.log2(float(linear_quant_params(r.min, r.max, bits, mode, True).scale)))


@GENERATE_PROPOSALS.quantize
def generate_proposals_quantize(self: PyNode) -> None:
    """Anchors int16 in 2^Fa of the coords placeholder, tables in 2^F of the box placeholder (F = delta_shift);
    min_size and iou_threshold become codes as upstream writes them; outputs as upstream."""
    n, k, a, post = _check(self)
    check_quantized_inputs(self, self.inputs[:2])
    s_t, d_t = self.inputs[0], self.inputs[1]
    refuse_per_channel(self, s_t)
    refuse_per_channel(self, d_t)
    settings = layer_settings(self)
    bits = max(COORD_BITS, int(settings.q_bits_activation))
    fa = _pow2_scale(self, 0, "coords", bits)
    f = _pow2_scale(self, 1, "box", bits)
    if fa < 0:
        raise self._error(f"the anchor scale 2^{fa} is below one code per pixel: the image is too large for "
                         "int16 box codes")
    sa = 2 ** fa
    lo, hi = integer_range(COORD_BITS, True)
    s_in = s_t.betensor
    anchors = grid_anchors(self, int(s_in.shape[1]), int(s_in.shape[2]), a)
    for key, col in zip(_ANCHOR_KEYS, (3, 2, 1, 0)):
        set_constant(self, key, quantize(anchors[:, col], float(sa), 0, lo, hi).to(torch.float32), Dtype.INT16)
    w_t = self.constants["weights"]
    base = w_t.betensor.to(torch.float32).reshape(-1, 4).clone()
    if base.shape[0] == a:
        base[:, 2:] += 1
        set_constant(self, "anchors", quantize(base.reshape(-1), float(sa), 0, lo, hi).to(torch.float32), Dtype.INT16)
    del self.constants["weights"]
    table = quant_of(self)
    q_d = table.get(d_t)
    in_bits = int(q_d.qbits)
    in_lo, in_hi = integer_range(in_bits, bool(q_d.qmin is not None and q_d.qmin < 0))
    lut_bits = min(in_bits, int(settings.lut_items_in_bits))
    for key, fn in (("xy_lut", lambda x: x), ("wh_lut", torch.exp)):
        lut = build_lut(fn, tensor_scale(self, d_t), tensor_zp(self, d_t), in_lo, in_hi, in_bits, float(2 ** f), 0, lo,
                        hi, lut_bits)
        set_constant(self, key, lut.to(torch.float32), Dtype.INT32)
    img_h, img_w = int(self.get_param("image_height")), int(self.get_param("image_width"))
    fh, fw = int(d_t.betensor.shape[1]), int(d_t.betensor.shape[2])
    self.params["anchor_scale"] = int(sa)
    self.params["min_size"] = int((float(self.get_param("min_size")) - 1) * sa)
    self.params["iou_scale"] = IOU_SCALE
    self.params["iou_threshold"] = int(float(self.get_param("iou_threshold")) * IOU_SCALE)
    self.params["height_stride"] = int(math.ceil(img_h / fh) * sa)
    self.params["width_stride"] = int(math.ceil(img_w / fw) * sa)
    self.params["delta_shift"] = int(f)
    self.params["roi_last_shift"] = int(f)
    copy_params(self, self.outputs[0], s_t)
    for t, scale, inv in ((self.outputs[1], float(sa), False), (self.outputs[2], float(sa), False),
                          (self.outputs[3], 1.0, True)):
        set_qinvariant(self, t, 16, False)
        q = table.of(t)
        q.scale, q.zerop, q.qinvariant = scale, 0, inv

