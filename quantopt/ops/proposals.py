"""Region-proposal post-processing: PostNMS1 (the proposals kept by NMS, and the same normalized by the image size)
and PostNMS2 (the detections kept by NMS, class by class).

Kept boxes move unchanged (passthrough params); PostNMS1's normalized boxes are requantized once (15-bit multiplier,
round half to even) to upstream's 16-bit output params. Index and count inputs must be exact integers. The integer
semantics are in docs/semantics/proposals.md.
"""
from __future__ import annotations

from typing import List

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.params import linear_quant_params
from ..quant.requant import scale_shift
from ..quant.rounding import round_shift
from ..registry import declare_op
from ..registry.schema import Int, Param, quantized
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    copy_params,
    int_value,
    out_range,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/proposals.md"

NORM_BITS = 16
"""PostNMS1's normalized boxes are uint16 (as upstream)."""

MULT_BITS = 15
SHIFT_MAX = 62


def _integers(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    """An index/count input as int64: float values truncated toward zero; quantized it must hold exact integers."""
    if node.quantized:
        if not t.qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): the {what} input '{t.name}' must hold exact "
                                   "integers (an integer tensor), not quantized values")
        return int_value(t)
    x = t.betensor
    return (torch.trunc(x.to(torch.float64)) if x.is_floating_point() else x).to(torch.int64)


def _check_integer_inputs(node: PyNode, tensors: List[PyTensor]) -> None:
    for t in tensors:
        if not t.qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): the index/count input '{t.name}' must hold "
                                   "exact integers (an integer tensor), not quantized values")


def _zero_code(t: PyTensor) -> int:
    """The code of the float 0 in t's params: clamp(-zp)."""
    qmin, qmax = out_range(t)
    return min(max(-tensor_zp(t), qmin), qmax)


def _single_scale(node: PyNode, t: PyTensor) -> None:
    if isinstance(t.scale, torch.Tensor) and t.scale.numel() > 1:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel params of '{t.name}' are not "
                               "supported")


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
    out = torch.full((batch, cnt, 4), fill, dtype=boxes.dtype)
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
    keep, counts = _integers(self, k_t, "keep"), _integers(self, c_t, "nms_box_num_perclass")
    if self.quantized:
        boxes, written = _pn1_gather(self, int_value(p_t), keep, counts, cnt, _zero_code(p_t))
        o1 = self.outputs[1]
        qmin, qmax = out_range(o1)
        m, n = int(self.get_param("nor_box_scale_value")), int(self.get_param("nor_box_shift_value"))
        norm = torch.clamp(round_shift((boxes + tensor_zp(p_t)) * m, n) - tensor_zp(o1), qmin, qmax)
        for b, k in enumerate(written):
            norm[b, k:] = _zero_code(o1)
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
    _single_scale(self, p_t)
    _check_integer_inputs(self, self.inputs[1:])
    copy_params(self.outputs[0], p_t)
    bits = int(p_t.qbits or 8)
    s_p = tensor_scale(p_t)
    p = linear_quant_params(0.0, s_p * h, bits, activation_mode(self, bits), False)
    o1 = self.outputs[1]
    o1.scale = float(torch.tensor(float(p.scale) * max(h, w) * s_p, dtype=torch.float32))
    o1.zerop = int(p.zerop)
    o1.qbits, o1.dtype, o1.qinvariant, o1.ir_range = NORM_BITS, Dtype.UINT16, False, None
    o1.qmin, o1.qmax = 0, 2 ** NORM_BITS - 1
    ratio = tensor_scale(o1) / (s_p * max(h, w))
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
    out = torch.full((batch, cnt, 4), fill, dtype=boxes.dtype)
    offsets = torch.zeros(batch, dtype=torch.int64)
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
    per_class, total = _integers(self, n_t, "box_num_perclass"), _integers(self, t_t, "total_class_num")
    keep = _integers(self, k_t, "keep")
    boxes = int_value(d_t) if self.quantized else d_t.betensor
    fill = _zero_code(d_t) if self.quantized else 0.0
    out, offsets = _pn2_gather(self, boxes, per_class, total, keep, cnt, fill)
    batch = int(out.shape[0])
    self.outputs[0].betensor = out
    if self.quantized:
        self.outputs[1].betensor = torch.full((batch, cnt), _zero_code(self.outputs[1]), dtype=torch.int64)
    else:
        self.outputs[1].betensor = torch.zeros(batch, cnt, dtype=out.dtype)
    self.outputs[2].betensor = offsets[:1].to(torch.int64 if self.quantized else out.dtype)


@POST_NMS2.quantize
def post_nms2_quantize(self: PyNode) -> None:
    """Boxes and the (zero) scores keep the box input's params; the count is an int32 integer."""
    _pn2_check(self)
    check_quantized_inputs(self, self.inputs)
    _single_scale(self, self.inputs[0])
    _check_integer_inputs(self, [self.inputs[i] for i in (1, 3, 5)])
    copy_params(self.outputs[0], self.inputs[0])
    copy_params(self.outputs[1], self.inputs[0])
    set_qinvariant(self.outputs[2], 32, True)
