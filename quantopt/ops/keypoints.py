"""HeatmapMaxKeypoint: keypoint locations and scores from per-ROI heatmaps (the maximum refined by a quadratic fit
of its 3x3 neighbourhood), as the Android NN operation of that name.

Quantized: the fit is made on the integer heatmap values (zero point added): the sub-cell offsets are rounded to
1/256 of a cell by exact integer divisions, the refined score is an exact int64 value in units of 2^-19 heatmap
codes, and one multiplier/shift requantizes it, and the keypoint coordinates, to output params from calibration.
The integer semantics are in docs/semantics/keypoints.md.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..quant.requant import scale_shift
from ..quant.rounding import div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, DtypeName, Int, Param, quantized
from ._quant import (
    check_quantized_inputs,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    quant_of,
    quantize_activation,
    tensor_scale,
    tensor_zp,
)
from ._shared import bool_param

SEMANTICS = "docs/semantics/keypoints.md"

DELTA_BITS = 8
"""Sub-cell offsets are integers in units of 2^-8 cell."""

DELTA_LIMIT = 384
"""1.5 cells in those units: larger offsets are scaled back onto this bound."""

SCORE_BITS = 19
"""The refined score is computed in units of 2^-19 heatmap codes."""

MULT_BITS = 15
SHIFT_MAX = 62
FIT_TOL = 1e-5
"""The fit is degenerate (offsets 0, the maximum as score) when |det| < 1e-5 + 1e-5 * a00 * a11 (as upstream)."""

FIT_TOL_INV = 100000

HEATMAP = declare_op(
    "HeatmapMaxKeypoint",
    params={
        "isSoftmax": Param(Bool(), "whether the heatmaps are softmax outputs; only false is supported", default=False),
        "score_scale_value": quantized(Int(lo=0), "multiplier of the score requantization"),
        "score_shift_value": quantized(Int(), "shift of the score requantization (without the 2^-19 units)"),
        "score_scale_type": quantized(DtypeName(), "dtype of score_scale_value"),
        "score_shift_type": quantized(DtypeName(), "dtype of score_shift_value"),
        "box_scale_value": quantized(Int(lo=0), "multiplier of the keypoint requantization"),
        "box_shift_value": quantized(Int(), "shift of the keypoint requantization (without the 2^-16 units)"),
        "box_scale_type": quantized(DtypeName(), "dtype of box_scale_value"),
        "box_shift_type": quantized(DtypeName(), "dtype of box_shift_value"),
        "roi_min_size_value": quantized(Int(lo=0), "the smallest ROI size (1 in box units) in box codes * 2^8"),
    },
    integer="max and 3x3 quadratic fit on integers (offsets in 1/256 cell, rounded), exact int64 score and "
            "keypoints, one requantization each",
    dtypes="heatmaps, boxes int8/int16 → score and keypoints from calibration (bits of their input)",
    semantics=f"{SEMANTICS}#heatmapmaxkeypoint",
    summary="Inputs: heatmaps [R, S, S, K] (NHWC, one per ROI and keypoint), boxes [R, 4] (x1, y1, x2, y2). Outputs: "
            "scores [R, K, 1], keypoints [R, K, 2] (x, y), and (optionally) a third output of zeros [R, K, 1].")


def _check(node: PyNode, hm: torch.Tensor, boxes: torch.Tensor) -> Tuple[int, int, int]:
    if len(node.inputs) != 2 or len(node.outputs) not in (2, 3):
        raise node._error("expects 2 inputs (heatmaps, boxes) and 2 or 3 outputs (scores, keypoints[, zeros])")
    if bool_param(node, "isSoftmax", False):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): isSoftmax = true is not supported")
    if hm.dim() != 4 or hm.shape[1] != hm.shape[2] or hm.shape[1] < 2:
        raise node._error(f"heatmaps must be [R, S, S, K] with S >= 2, got {list(hm.shape)}")
    if boxes.dim() != 2 or boxes.shape[1] != 4 or boxes.shape[0] != hm.shape[0]:
        raise node._error(f"boxes must be [R, 4] with R = {hm.shape[0]}, got {list(boxes.shape)}")
    return int(hm.shape[0]), int(hm.shape[1]), int(hm.shape[3])


def _grid(hm: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (ROI, keypoint): the first maximum's column and row, and the 3x3 grid around it [R, K, 3, 3] (rows and
    columns outside the map are mirrored: -1 reads 1, S reads S - 2)."""
    r, _, _, k = hm.shape
    flat = hm.permute(0, 3, 1, 2).reshape(r, k, size * size)
    idx = torch.argmax(flat, dim=-1)
    col, row = idx % size, idx // size
    grid = torch.zeros(r, k, 3, 3, dtype=hm.dtype, device=hm.device)
    for dh in (-1, 0, 1):
        for dw in (-1, 0, 1):
            h, w = row + dh, col + dw
            h = torch.where(h >= size, size - 2, torch.where(h < 0, 1, h))
            w = torch.where(w >= size, size - 2, torch.where(w < 0, 1, w))
            grid[:, :, dh + 1, dw + 1] = torch.gather(flat, -1, (h * size + w).unsqueeze(-1))[..., 0]
    return col, row, grid


def _float_fit(grid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = grid.to(torch.float32)
    b0 = -(g[..., 1, 2] - g[..., 1, 0]) / 2.0
    b1 = -(g[..., 2, 1] - g[..., 0, 1]) / 2.0
    a00 = g[..., 1, 0] - 2.0 * g[..., 1, 1] + g[..., 1, 2]
    a01 = (g[..., 2, 2] - g[..., 2, 0] - g[..., 0, 2] + g[..., 0, 0]) / 4.0
    a11 = g[..., 0, 1] - 2.0 * g[..., 1, 1] + g[..., 2, 1]
    cross = a00 * a11
    det = cross - a01 * a01
    valid = torch.abs(det) >= FIT_TOL + FIT_TOL * cross
    safe = torch.where(valid, det, torch.ones_like(det))
    d0 = torch.where(valid, (a11 * b0 - a01 * b1) / safe, torch.zeros_like(det))
    d1 = torch.where(valid, (a00 * b1 - a01 * b0) / safe, torch.zeros_like(det))
    big = torch.maximum(torch.abs(d0), torch.abs(d1))
    factor = torch.where(big > 1.5, 1.5 / torch.where(big > 0, big, torch.ones_like(big)), torch.ones_like(big))
    d0, d1 = d0 * factor, d1 * factor
    score = g[..., 1, 1] - b0 * d0 - b1 * d1 + ((a00 * d0 + a01 * d1) * d0 + (a01 * d0 + a11 * d1) * d1) / 2.0
    return d0, d1, torch.where(valid, score, g[..., 1, 1])


def _heatmap_float(node: PyNode) -> None:
    hm = node.inputs[0].betensor.to(torch.float32)
    boxes = node.inputs[1].betensor.to(torch.float32)
    r, size, k = _check(node, hm, boxes)
    col, row, grid = _grid(hm, size)
    d0, d1, score = _float_fit(grid)
    x1, y1 = boxes[:, 0:1], boxes[:, 1:2]
    w = torch.clamp(boxes[:, 2:3] - x1, min=1.0)
    h = torch.clamp(boxes[:, 3:4] - y1, min=1.0)
    x = (col + d0 + 0.5) / size * w + x1
    y = (row + d1 + 0.5) / size * h + y1
    node.outputs[0].betensor = score.unsqueeze(-1)
    node.outputs[1].betensor = torch.stack([x, y], dim=-1)
    if len(node.outputs) == 3:
        node.outputs[2].betensor = torch.zeros(r, k, 1, device=hm.device)


def _int_fit(grid: torch.Tensor, valid_tol) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Offsets in 1/256 cell and the score in 2^-19 code units from an integer grid (X = q + zp values)."""
    g = grid
    b0 = -(g[..., 1, 2] - g[..., 1, 0])  # 2 * b0
    b1 = -(g[..., 2, 1] - g[..., 0, 1])
    a00 = g[..., 1, 0] - 2 * g[..., 1, 1] + g[..., 1, 2]
    a01 = g[..., 2, 2] - g[..., 2, 0] - g[..., 0, 2] + g[..., 0, 0]  # 4 * a01
    a11 = g[..., 0, 1] - 2 * g[..., 1, 1] + g[..., 2, 1]
    det16 = 16 * a00 * a11 - a01 * a01  # 16 * det
    valid = valid_tol(det16, a00 * a11)
    safe = torch.where(valid, det16, torch.ones_like(det16))
    one = 1 << DELTA_BITS
    d0 = torch.where(valid, div_round_half_even((8 * a11 * b0 - 2 * a01 * b1) * one, safe), 0)
    d1 = torch.where(valid, div_round_half_even((8 * a00 * b1 - 2 * a01 * b0) * one, safe), 0)
    big = torch.maximum(torch.abs(d0), torch.abs(d1))
    over = big > DELTA_LIMIT
    safe_big = torch.where(over, big, torch.ones_like(big))
    d0 = torch.where(over, div_round_half_even(d0 * DELTA_LIMIT, safe_big), d0)
    d1 = torch.where(over, div_round_half_even(d1 * DELTA_LIMIT, safe_big), d1)
    # score * 2^19 = g11 * 2^19 - b0' d0 2^10 - b1' d1 2^10 + 4 a00 d0^2 + 2 a01' d0 d1 + 4 a11 d1^2
    s19 = (g[..., 1, 1] << SCORE_BITS) - ((b0 * d0 + b1 * d1) << 10) + 4 * a00 * d0 * d0 + 2 * a01 * d0 * d1 + \
        4 * a11 * d1 * d1
    return d0, d1, torch.where(valid, s19, g[..., 1, 1] << SCORE_BITS)


def _heatmap_int(node: PyNode) -> None:
    h_t, b_t = node.inputs
    hm = int_value(h_t) + tensor_zp(node, h_t)
    boxes = int_value(b_t) + tensor_zp(node, b_t)
    r, size, k = _check(node, hm, boxes)
    col, row, grid = _grid(hm, size)
    s = tensor_scale(node, h_t)

    def valid_tol(det16: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
        """|det| >= 1e-5 + 1e-5 * cross in float units (det = det16 / (16 s^2), cross = a00 a11 / s^2), decided
        exactly with python integers: |det16| * 10^5 >= 16 s^2 + 16 a00 a11."""
        s2 = Fraction(s) ** 2
        flags = [abs(d) * FIT_TOL_INV >= 16 * s2 + 16 * c for d, c in zip(det16.reshape(-1).tolist(),
                                                                         cross.reshape(-1).tolist())]
        return torch.tensor(flags, dtype=torch.bool, device=det16.device).reshape(det16.shape)

    d0, d1, s19 = _int_fit(grid, valid_tol)
    o0, o1 = node.outputs[0], node.outputs[1]
    q0min, q0max = out_range(node, o0)
    m, n = int(node.get_param("score_scale_value")), int(node.get_param("score_shift_value"))
    score = torch.clamp(round_shift(s19 * m, n + SCORE_BITS) - tensor_zp(node, o0), q0min, q0max)
    min_size = int(node.get_param("roi_min_size_value"))
    x1, y1 = boxes[:, 0:1], boxes[:, 1:2]
    w = torch.clamp((boxes[:, 2:3] - x1) << 8, min=min_size)
    h = torch.clamp((boxes[:, 3:4] - y1) << 8, min=min_size)
    one = 1 << DELTA_BITS
    vx = (col * one + d0 + one // 2) * w + (x1 << 16) * size
    vy = (row * one + d1 + one // 2) * h + (y1 << 16) * size
    m, n = int(node.get_param("box_scale_value")), int(node.get_param("box_shift_value"))
    q1min, q1max = out_range(node, o1)
    kp = torch.stack([vx, vy], dim=-1)
    o0.betensor = score.unsqueeze(-1)
    o1.betensor = torch.clamp(round_shift(kp * m, n + 16) - tensor_zp(node, o1), q1min, q1max)
    if len(node.outputs) == 3:
        node.outputs[2].betensor = torch.full((r, k, 1), min(max(-tensor_zp(node, node.outputs[2]),
                                                                 out_range(node, node.outputs[2])[0]),
                                                             out_range(node, node.outputs[2])[1]), dtype=torch.int64,
                                                 device=hm.device)


@HEATMAP.forward
def heatmap_forward(self: PyNode) -> None:
    """Per ROI and keypoint: the first maximum of the heatmap, refined by the quadratic through its 3x3
    neighbourhood (offsets at most 1.5 cells), mapped into the ROI."""
    if self.quantized:
        _heatmap_int(self)
    else:
        _heatmap_float(self)


def _ratio(ratio: float) -> Tuple[int, int, object, object]:
    m, n, mt, nt = scale_shift(torch.tensor(ratio, dtype=torch.float32), MULT_BITS, shift_limit=SHIFT_MAX - 19)
    return int(m), int(n), mt, nt


@HEATMAP.quantize
def heatmap_quantize(self: PyNode) -> None:
    """Outputs from calibration (scores and zeros with the heatmap's bits, keypoints with the boxes' bits); the
    multipliers of s_score / s_heatmap and s_keypoint / (s_box * S); the smallest ROI size in box codes * 2^8."""
    check_quantized_inputs(self, self.inputs)
    h_t, b_t = self.inputs
    table = quant_of(self)
    for t in (h_t, b_t):
        if table.get(t).per_channel:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel params of '{t.name}' are not "
                                   "supported")
        if (table.get(t).qbits or 8) > 16:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): '{t.name}' has more than 16 bits")
    if bool_param(self, "isSoftmax", False):
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): isSoftmax = true is not supported")
    size = int(h_t.ir_shape[1]) if len(h_t.ir_shape) == 4 else 0
    if size < 2:
        raise self._error(f"heatmaps must be [R, S, S, K] with S >= 2, got {list(h_t.ir_shape)}")
    force = bool(layer_settings(self).force_dtype_int)
    hb, bb = int(table.get(h_t).qbits or 8), int(table.get(b_t).qbits or 8)
    quantize_activation(self, self.outputs[0], is_signed(self, h_t) or force, hb)
    quantize_activation(self, self.outputs[1], is_signed(self, b_t) or force, bb)
    if len(self.outputs) == 3:
        quantize_activation(self, self.outputs[2], force, hb)
    m, n, mt, nt = _ratio(tensor_scale(self, self.outputs[0]) / tensor_scale(self, h_t))
    self.params.update(score_scale_value=m, score_shift_value=n, score_scale_type=mt, score_shift_type=nt)
    m, n, mt, nt = _ratio(tensor_scale(self, self.outputs[1]) / (tensor_scale(self, b_t) * size))
    self.params.update(box_scale_value=m, box_shift_value=n, box_scale_type=mt, box_shift_type=nt)
    self.params["roi_min_size_value"] = int(round(tensor_scale(self, b_t) * 256.0))
