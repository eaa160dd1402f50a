"""PyramidROIAlign: ROI align over a four-level feature pyramid (FPN), each box pooled from the level its area picks.

Inputs: boxes [1, R, 4] (ymin, xmin, ymax, xmax in image pixels) and four NHWC feature maps (batch 1, the same
channels). Output [R, resize_height, resize_width, C]. Quantized, the output has its own calibrated params; box
coordinates become fixed-point numbers with `spatial_shift` fraction bits through one 16-bit multiplier per level,
and the sampling grid, bilinear weights and averaging follow upstream's integer algorithm exactly (truncating step
and bin sizes, floor-shifted weights, one requantization per level). docs/semantics/pyramid_roi.md.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..quant.requant import scale_shift
from ..quant.rounding import INT64_SAFE, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._quant import (
    check_quantized_inputs,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    quantize_activation,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/pyramid_roi.md"
LEVELS = 4
"""Feature maps of the pyramid (upstream supports exactly four: P2..P5)."""
LEVEL_SIDES = (112.0, 224.0, 448.0)
"""Box sides (pixels) where the level changes: sqrt(area) < 112 → level 0, < 224 → 1, < 448 → 2, else 3."""
COORD_MULT_BITS = 16
COORD_MAX = 65535
"""Box coordinates are unsigned 16-bit fixed-point numbers."""
MODES = ("half_pixel", "output_half_pixel")

PYRAMID_ROI_ALIGN = declare_op(
    "PyramidROIAlign",
    params={
        "resize_height": Param(Int(lo=1), "output rows per box", required=True),
        "resize_width": Param(Int(lo=1), "output columns per box", required=True),
        "sample": Param(Ints(lo=0), "[sh, sw] samples per bin and axis (<= 0: adaptive, ceil(bin size))",
                        default=[0, 0]),
        "spatial_scale_value": Param(Floats(), "one box → feature-map scale per level (4 positive numbers)",
                                     required=True),
        "coordinate_transformation_mode": Param(Text(), "half_pixel or output_half_pixel (case-insensitive)",
                                                default="half_pixel"),
        "image_height": Param(Int(lo=1), "image height (pixels); sizes the fixed-point coordinates",
                              required=True),
        "image_width": Param(Int(lo=1), "image width (pixels); sizes the fixed-point coordinates", required=True),
        "proposal_normalized": Param(Bool(), "normalized boxes (upstream's second algorithm; refused)",
                                     default=False),
        "scale_value": quantized(Ints(), "output multiplier per level"),
        "shift_value": quantized(Ints(), "output shift per level"),
        "scale_type": quantized(Value("dtype list"), "dtypes of scale_value"),
        "shift_type": quantized(Value("dtype list"), "dtypes of shift_value"),
        "input_scale": quantized(Ints(), "box-coordinate multiplier per level"),
        "input_shift": quantized(Ints(), "box-coordinate shift per level"),
        "input_scale_type": quantized(Value("dtype list"), "dtypes of input_scale"),
        "input_shift_type": quantized(Value("dtype list"), "dtypes of input_shift"),
        "spatial_shift": quantized(Int(lo=1), "fraction bits of the fixed-point coordinates"),
        "levels": quantized(Value("3 integers (may exceed int32)"),
                            "box-area thresholds (box codes) of levels 1, 2, 3"),
        "box_input_qvalue": quantized(Int(), "upstream's normalized-box algorithm; not read"),
        "spatial_scale": Param(Float(), "written by some Parser versions; not read"),
    },
    dtypes="float32 boxes [1,R,4] + 4 float32 NHWC maps → float32 [R,H,W,C]",
    integer="fixed-point coordinates per level (16-bit multiplier), truncating grid, floor-shifted bilinear "
            "weights, one requantization per level (round half to even)",
    semantics=SEMANTICS,
    summary="Boxes (ymin, xmin, ymax, xmax in pixels) [1, R, 4] and four NHWC feature maps P2..P5; each box is "
            "ROI-aligned from level clamp(floor(4 + log2(sqrt(area) / 224)), 2, 5) - 2.")


def _params(node: PyNode) -> dict:
    if len(node.inputs) != 1 + LEVELS or len(node.outputs) != 1:
        raise node._error(f"expects {1 + LEVELS} inputs (boxes and {LEVELS} feature maps) and 1 output")
    if bool(node.get_param("proposal_normalized", optional=True, default_value=False)):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): proposal_normalized=true (upstream's "
                               "normalized-box algorithm) is not supported")
    mode = str(node.get_param("coordinate_transformation_mode", optional=True, default_value="half_pixel")).lower()
    if mode not in MODES:
        raise node._error(f"unsupported coordinate_transformation_mode '{mode}' (supported: {', '.join(MODES)})")
    sample = node.get_param("sample", optional=True, default_value=[0, 0])
    spatial = node.get_param("spatial_scale_value")
    if not isinstance(sample, (list, tuple)) or len(sample) != 2:
        raise node._error(f"parameter 'sample' must be 2 integers, got {sample!r}")
    if (not isinstance(spatial, (list, tuple)) or len(spatial) != LEVELS
            or any(not float(s) > 0 for s in spatial)):
        raise node._error(f"parameter 'spatial_scale_value' must be {LEVELS} positive numbers, got {spatial!r}")
    return {"half_pixel": mode == "half_pixel", "sample": [int(s) for s in sample],
            "out": (int(node.get_param("resize_height")), int(node.get_param("resize_width"))),
            "spatial": [float(s) for s in spatial],
            "image": (int(node.get_param("image_height")), int(node.get_param("image_width")))}


def _inputs(node: PyNode) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    boxes = node.inputs[0].betensor
    if boxes.dim() != 3 or boxes.shape[0] != 1 or boxes.shape[2] != 4:
        raise node._error(f"boxes must be [1, R, 4], got {list(boxes.shape)}")
    maps = [t.betensor for t in node.inputs[1:]]
    for m in maps:
        if m.dim() != 4 or m.shape[0] != 1 or m.shape[3] != maps[0].shape[3]:
            raise node._error("feature maps must be NHWC with batch 1 and the same channels, got "
                              f"{[list(x.shape) for x in maps]}")
    return boxes[0], maps


# ------------------------------------------------------------------------------------------------ float
def _float_levels(boxes: torch.Tensor) -> torch.Tensor:
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    lv = torch.floor(LEVELS + torch.log2(torch.sqrt(area) / LEVEL_SIDES[1]) + 1e-6)
    lv = torch.nan_to_num(lv, nan=2.0, neginf=2.0)  # a reversed box (negative area) goes to the first level
    return torch.clamp(lv, 2, 5).to(torch.int64) - 2


def _float_axis(start: float, end: float, pooled: int, ratio: int, size: int, half_pixel: bool,
                device: torch.device) -> Optional[list]:
    """(low, high, w_low, w_high), each [pooled, n] on `device` (the feature map's), of one box axis; None when the
    box is empty on that axis."""
    roi = end - start
    if not half_pixel:
        roi = max(roi, 1.0)
    if roi <= 0:
        return None
    step = roi / pooled
    n = ratio if ratio > 0 else int(math.ceil(step))
    binsz = step / n
    i = torch.arange(pooled, dtype=torch.float64, device=device)[:, None]
    k = torch.arange(n, dtype=torch.float64, device=device)[None, :]
    pos = start + step * i + binsz / 2 + binsz * k
    valid = ((pos >= -1.0) & (pos <= size)).to(torch.float64)
    pos = torch.clamp(pos, 0.0, size - 1.0)
    low = torch.floor(pos).to(torch.int64)
    frac = pos - low.to(torch.float64)
    return [low, torch.clamp(low + 1, max=size - 1), (1.0 - frac) * valid, frac * valid]


def _float_forward(node: PyNode, p: dict, boxes: torch.Tensor, maps: List[torch.Tensor]) -> torch.Tensor:
    ph, pw = p["out"]
    out = torch.zeros((boxes.shape[0], ph, pw, maps[0].shape[3]), dtype=torch.float64, device=maps[0].device)
    levels = _float_levels(boxes)
    off = 0.5 if p["half_pixel"] else 0.0
    for r in range(boxes.shape[0]):
        lv = int(levels[r])
        fm = maps[lv][0].to(torch.float64)
        s = p["spatial"][lv]
        y0, x0, y1, x1 = (float(v) * s - off for v in boxes[r])
        ys = _float_axis(y0, y1, ph, p["sample"][0], fm.shape[0], p["half_pixel"], fm.device)
        xs = _float_axis(x0, x1, pw, p["sample"][1], fm.shape[1], p["half_pixel"], fm.device)
        if ys is None or xs is None:
            continue
        acc = 0
        for yi, wy in ((ys[0], ys[2]), (ys[1], ys[3])):
            for xi, wx in ((xs[0], xs[2]), (xs[1], xs[3])):
                v = fm[yi[:, :, None, None], xi[None, None, :, :]]
                acc = acc + v * (wy[:, :, None, None] * wx[None, None, :, :])[..., None]
        out[r] = acc.sum(dim=(1, 3)) / (ys[0].shape[1] * xs[0].shape[1])
    return out


# ------------------------------------------------------------------------------------------------ integer
def _int_axis(start: int, end: int, pooled: int, ratio: int, size: int, half_pixel: bool,
              ss: int, device: torch.device) -> Optional[list]:
    """Upstream's fixed-point grid of one box axis: (low, high, w_low, w_high) each [pooled, n] on `device` (the
    feature map's), weights in units of 2^-ss before the floor shift; None when the box is empty on that axis."""
    one = 1 << ss
    roi = end - start
    if not half_pixel:
        roi = max(roi, one)
    if roi <= 0:
        return None
    n = ratio if ratio > 0 else -((-roi) // (pooled * one))
    step = roi // pooled
    binsz = step // (2 * n)
    i = torch.arange(pooled, dtype=torch.int64, device=device)[:, None]
    k = torch.arange(n, dtype=torch.int64, device=device)[None, :]
    pos = start + step * i + binsz * (2 * k + 1)
    low = pos >> ss
    frac = pos - (low << ss)
    valid = ((low >= -1) & (low <= size)).to(torch.int64)
    high = torch.clamp(low + 1, 0, size - 1)
    low = torch.clamp(low, 0, size - 1)
    return [low, high, (one - frac) * valid, frac * valid]


def _int_levels(node: PyNode, boxes: torch.Tensor) -> torch.Tensor:
    th = node.get_param("levels")
    if (not isinstance(th, (list, tuple)) or len(th) != LEVELS - 1
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in th)):
        raise node._error(f"parameter 'levels' must hold {LEVELS - 1} non-negative integers, got {th!r}")
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return sum((area >= t).to(torch.int64) for t in th)


def _per_level(node: PyNode, key: str) -> List[int]:
    v = node.get_param(key)
    if not isinstance(v, (list, tuple)) or len(v) != LEVELS:
        raise node._error(f"parameter '{key}' must hold {LEVELS} integers, got {v!r}")
    return [int(x) for x in v]


def _int_forward(node: PyNode, p: dict, boxes: torch.Tensor, maps: List[torch.Tensor]) -> torch.Tensor:
    ph, pw = p["out"]
    ss = int(node.get_param("spatial_shift"))
    ms, ns = _per_level(node, "input_scale"), _per_level(node, "input_shift")
    dm, dn = _per_level(node, "scale_value"), _per_level(node, "shift_value")
    zp_out = tensor_zp(node, node.outputs[0])
    qmin, qmax = out_range(node, node.outputs[0])
    zero = min(max(-zp_out, qmin), qmax)
    out = torch.full((boxes.shape[0], ph, pw, maps[0].shape[3]), zero, dtype=torch.int64, device=maps[0].device)
    levels = _int_levels(node, boxes)
    off = (1 << (ss - 1)) if p["half_pixel"] else 0
    fixed = p["sample"][0] > 0 and p["sample"][1] > 0
    for r in range(boxes.shape[0]):
        lv = int(levels[r])
        fm = maps[lv][0]
        c = torch.clamp(round_shift(boxes[r] * ms[lv], ns[lv]), 0, COORD_MAX) - off
        y0, x0, y1, x1 = (int(v) for v in c)
        ys = _int_axis(y0, y1, ph, p["sample"][0], fm.shape[0], p["half_pixel"], ss, fm.device)
        xs = _int_axis(x0, x1, pw, p["sample"][1], fm.shape[1], p["half_pixel"], ss, fm.device)
        if ys is None or xs is None:
            continue
        count = ys[0].shape[1] * xs[0].shape[1]
        if int(fm.abs().max()) * count * (1 << ss) * max(dm[lv], 1) >= INT64_SAFE:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): an accumulator does not fit the exact "
                                   "int64 integer forward (too many samples per bin)")
        acc = 0
        for yi, wy in ((ys[0], ys[2]), (ys[1], ys[3])):
            for xi, wx in ((xs[0], xs[2]), (xs[1], xs[3])):
                w = (wy[:, :, None, None] * wx[None, None, :, :]) >> ss
                acc = acc + fm[yi[:, :, None, None], xi[None, None, :, :]] * w[..., None]
        acc = acc.sum(dim=(1, 3))
        if fixed:
            y = round_shift(acc * dm[lv], dn[lv] + ss)
        else:
            y = round_shift(torch.div(acc * dm[lv], count, rounding_mode="floor"), dn[lv] + ss)
        out[r] = torch.clamp(y - zp_out, qmin, qmax)
    return out


@PYRAMID_ROI_ALIGN.forward
def pyramid_roi_align_forward(self: PyNode) -> None:
    p = _params(self)
    boxes, maps = _inputs(self)
    if not self.quantized:
        y = _float_forward(self, p, boxes.to(torch.float64), maps)
        self.outputs[0].betensor = y.to(torch.float32)
        return
    bq = int_value(self.inputs[0])[0] + tensor_zp(self, self.inputs[0])
    fq = [int_value(t) + tensor_zp(self, t) for t in self.inputs[1:]]
    self.outputs[0].betensor = _int_forward(self, p, bq, fq)


@PYRAMID_ROI_ALIGN.quantize
def pyramid_roi_align_quantize(self: PyNode) -> None:
    """Output params from its calibrated range (signed when a feature map is); per level a 16-bit coordinate
    multiplier of spatial_scale * 2^spatial_shift / s_box and an output multiplier of s_out / (s_map * sh * sw)
    (without sh * sw when sampling is adaptive); area thresholds (112 s_box)^2, (224 s_box)^2, (448 s_box)^2."""
    p = _params(self)
    check_quantized_inputs(self, self.inputs)
    for t in self.inputs:
        tensor_zp(self, t)
        tensor_scale(self, t)
    out = self.outputs[0]
    bits = int(layer_settings(self).q_bits_activation)
    quantize_activation(self, out, signed=any(is_signed(self, t) for t in self.inputs[1:]), bits=bits)
    s_b = tensor_scale(self, self.inputs[0])
    s_out = tensor_scale(self, out)
    ss = math.floor(math.log2(COORD_MAX / (max(p["image"]) * max(p["spatial"]))))
    if ss < 1:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): image size {p['image']} times spatial scale "
                               f"{max(p['spatial'])} leaves no fraction bits in 16-bit coordinates")
    sh, sw = p["sample"]
    coords = [scale_shift(s * 2.0 ** ss / s_b, COORD_MULT_BITS) for s in p["spatial"]]
    ratios = [s_out / (tensor_scale(self, t) * (sh * sw if sh > 0 and sw > 0 else 1)) for t in self.inputs[1:]]
    outs = [scale_shift(r, bits) for r in ratios]
    self.params["shift_value"] = [int(o[1]) for o in outs]
    self.params["shift_type"] = [o[3] for o in outs]
    self.params["scale_value"] = [int(o[0]) for o in outs]
    self.params["scale_type"] = [o[2] for o in outs]
    self.params["input_scale"] = [int(c[0]) for c in coords]
    self.params["input_scale_type"] = [c[2] for c in coords]
    self.params["input_shift"] = [int(c[1]) for c in coords]
    self.params["input_shift_type"] = [c[3] for c in coords]
    self.params["spatial_shift"] = int(ss)
    self.params["levels"] = [int(side * side * s_b * s_b + 0.5) for side in LEVEL_SIDES]
