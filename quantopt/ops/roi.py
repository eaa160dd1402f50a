"""Region-of-interest ops on NHWC feature maps: RoiAlign, MaxRoiPool, ROIPooling and CropAndResize.

Each takes a feature map and boxes (a second activation, usually float); CropAndResize also takes integer box
indices. Quantized, the output keeps the feature map's scale/zero point (as upstream: every output value is a
maximum, an interpolation or an average of input values). Boxes are a quantized tensor with their own scale
`s_b` and zero point; their coordinates are turned into exact fixed-point numbers with ROI_FRACTION_BITS
fraction bits by an integer multiplier/shift that folds the box scale and the spatial scale together, and all
sampling positions, bilinear weights and averages are then exact integer arithmetic with round half to even
(docs/semantics/pooling.md). The float and integer forwards share the sampling geometry; neither needs
torchvision.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from ..errors import DataError, UnsupportedError
from ..graph.node import PyNode
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.requant import scale_shift
from ..quant.rounding import INT64_SAFE, round_shift
from ..registry import declare_op
from ..registry.schema import DtypeName, Either, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._quant import check_quantized_inputs, copy_params, int_value, out_range, quant_of, tensor_scale, tensor_zp

ROI_FRACTION_BITS = 16
"""Fraction bits of box coordinates, sampling positions and bilinear weights in the integer ROI forwards (a
weight product has 2 * ROI_FRACTION_BITS bits)."""
COORD_MULT_BITS = AIFF_MULTIPLIER_BITS
"""Box-coordinate multipliers are 15-bit, like every AIFF multiplier; a negative shift is an exact left shift."""
_SEM = "docs/semantics/pooling.md"

_MULTIPLIERS = Either(kinds=(Int(), Ints()))
"""A multiplier or shift: one integer, or one per axis."""
_UNREAD_SCALE = Param(Value(), "written by some Parser versions; not read")
_COORD_KEYS = {
    "coord_scale_value": quantized(_MULTIPLIERS, "box-coordinate multipliers (one per axis)"),
    "coord_shift_value": quantized(_MULTIPLIERS, "box-coordinate shifts (one per axis)"),
    "batch_scale_value": quantized(_MULTIPLIERS, "batch-index multiplier"),
    "batch_shift_value": quantized(_MULTIPLIERS, "batch-index shift"),
}
"""The fixed-point box requantization every ROI type may carry (`_coord_requant` writes f"{key}_scale_value")."""
_FRACTION_BITS = quantized(Int(), "fraction bits of the fixed-point coordinates (ROI_FRACTION_BITS)")


# ------------------------------------------------------------------------------------------------ helpers
def rhe_div(num: torch.Tensor, den: Any) -> torch.Tensor:
    """Exact round_half_even(num / den) of int64 tensors, den > 0."""
    den = torch.as_tensor(den, dtype=torch.int64)
    q = torch.div(num, den, rounding_mode="floor")
    twice = 2 * (num - q * den)
    return q + ((twice > den) | ((twice == den) & (q % 2 == 1))).to(torch.int64)


def _int_list(node: PyNode, key: str, n: int, minimum: int = 1, default: Any = None) -> List[int]:
    value = node.get_param(key, optional=default is not None, default_value=default)
    vals = value if isinstance(value, (list, tuple)) else [value] * n
    if len(vals) != n or any(isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or int(v) < minimum
                             for v in vals):
        raise node._error(f"parameter '{key}' must be {n} integers >= {minimum}, got {value!r}")
    return [int(v) for v in vals]


def _float_list(node: PyNode, key: str, n: int, default: Any = None) -> List[float]:
    value = node.get_param(key, optional=default is not None, default_value=default)
    vals = value if isinstance(value, (list, tuple)) else [value] * n
    if len(vals) != n or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v) > 0
                             for v in vals):
        raise node._error(f"parameter '{key}' must be {n} positive numbers, got {value!r}")
    return [float(v) for v in vals]


def _coord_requant(node: PyNode, key: str, ratios: Sequence[float]) -> None:
    """Store `<key>_scale_value` / `<key>_shift_value`: 15-bit multipliers and shifts with M / 2^N ~ ratio."""
    ms, ns = [], []
    for r in ratios:
        m, n, _, _ = scale_shift(float(r), COORD_MULT_BITS)
        ms.append(int(m))
        ns.append(int(n))
    node.params[f"{key}_scale_value"] = ms if len(ms) > 1 else ms[0]
    node.params[f"{key}_shift_value"] = ns if len(ns) > 1 else ns[0]


def _coord_pairs(node: PyNode, key: str, n: int) -> List[Tuple[int, int]]:
    ms = node.get_param(f"{key}_scale_value")
    ns = node.get_param(f"{key}_shift_value")
    ms, ns = (ms if isinstance(ms, (list, tuple)) else [ms]), (ns if isinstance(ns, (list, tuple)) else [ns])
    if len(ms) != n or len(ns) != n:
        raise node._error(f"'{key}_scale_value'/'{key}_shift_value' must hold {n} integers")
    return [(int(m), int(s)) for m, s in zip(ms, ns)]


def fixed_point(q: torch.Tensor, zp: int, mult: int, shift: int) -> torch.Tensor:
    """round_half_even((q + zp) * M / 2^N) as int64 (a negative N is an exact left shift)."""
    return round_shift((q.to(torch.int64) + zp) * mult, shift)


def _quantize_boxes(node: PyNode) -> float:
    """Common quantize steps: inputs quantized per tensor, output = feature map's params; returns s_b."""
    if len(node.inputs) < 2:
        raise node._error("needs a feature map and a boxes input")
    check_quantized_inputs(node, node.inputs)
    tensor_zp(node, node.inputs[0])
    tensor_zp(node, node.inputs[1])
    copy_params(node, node.outputs[0], node.inputs[0])
    return tensor_scale(node, node.inputs[1])


def _check_bound(node: PyNode, absmax: int, factor: int) -> None:
    if absmax * factor >= INT64_SAFE:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): an accumulator of up to {absmax * factor} does "
                               "not fit the exact int64 integer forward (too many samples per bin)")


def _feature_zp_range(node: PyNode) -> Tuple[int, int, int]:
    qmin, qmax = out_range(node, node.outputs[0])
    return tensor_zp(node, node.inputs[0]), qmin, qmax


def _rois(node: PyNode, boxes: torch.Tensor, width: int) -> torch.Tensor:
    """Boxes as [R, width] (a leading batch dim of 1 is dropped)."""
    if boxes.dim() == 3 and boxes.shape[0] == 1:
        boxes = boxes[0]
    if boxes.dim() != 2 or boxes.shape[1] != width:
        raise node._error(f"boxes must be [R, {width}] (or [1, R, {width}]), got {list(boxes.shape)}")
    return boxes


def _batch_ok(node: PyNode, b: int, n: int, r: int) -> bool:
    """Negative batch index: an empty box (output 0); an index past the batch: a data error."""
    if b >= n:
        raise DataError(f"layer '{node.name}' ({node.type}): box {r} has batch index {b} but the feature map holds "
                        f"{n} images")
    return b >= 0


def _feature(node: PyNode) -> torch.Tensor:
    x = node.inputs[0].betensor
    if x.dim() != 4:
        raise node._error(f"feature map must be 4-D NHWC, got shape {list(x.shape)}")
    return x


# ------------------------------------------------------------------------------------------------ RoiAlign
ROIALIGN_METHODS = ("AVG", "MAX")
COORD_MODES = ("HALF_PIXEL", "OUTPUT_HALF_PIXEL")

_UPSTREAM = "upstream's quantized RoiAlign; not read"
ROIALIGN = declare_op(
    "RoiAlign",
    params={"method": Param(Text(choices=ROIALIGN_METHODS), "average or maximum of the samples (default AVG)",
                            default="AVG"),
            "pooled_shape": Param(Ints(lo=1), "[PH, PW] output bins", required=True),
            "sample": Param(Ints(lo=0), "[sh, sw] samples per bin and axis (0: adaptive; default [0, 0])",
                            default=[0, 0]),
            "spatial_scale_value": Param(Floats(), "[sy, sx] box → feature-map scale, positive (default [1, 1]; "
                                                   "upstream's quantized IR: integers)", default=[1.0, 1.0]),
            "coordinate_transformation_mode": Param(Text(choices=COORD_MODES), "default HALF_PIXEL",
                                                    default="HALF_PIXEL"),
            **_COORD_KEYS,
            "coord_fraction_bits": _FRACTION_BITS,
            **{f"{k}_value": quantized(Ints(), _UPSTREAM)
               for k in ("bin_scale", "bin_shift", "grid_scale", "grid_shift")},
            **{f"{k}_type": quantized(Value("dtype list"), _UPSTREAM)
               for k in ("bin_scale", "bin_shift", "grid_scale", "grid_shift", "spatial_scale")},
            "spatial_shift_value": quantized(_MULTIPLIERS, _UPSTREAM),
            "spatial_shift_type": quantized(Either(kinds=(DtypeName(), Value("dtype list"))), _UPSTREAM),
            "scale": _UNREAD_SCALE},
    dtypes="float32 feature + float32 boxes [R,5] → feature's dtype",
    integer="fixed-point box coordinates (M/shift), exact bilinear sampling with 16-bit fraction weights, "
            "average by exact rounded division", semantics=f"{_SEM}#roialign")


def _roialign_params(node: PyNode) -> dict:
    method = str(node.get_param("method", optional=True, default_value="AVG")).upper()
    if method not in ROIALIGN_METHODS:
        raise node._error(f"unsupported RoiAlign method '{method}' (supported: {', '.join(ROIALIGN_METHODS)})")
    mode = str(node.get_param("coordinate_transformation_mode", optional=True, default_value="HALF_PIXEL")).upper()
    if mode not in COORD_MODES:
        raise node._error(f"unsupported coordinate_transformation_mode '{mode}' (supported: {', '.join(COORD_MODES)})")
    return {"method": method, "half_pixel": mode == "HALF_PIXEL",
            "pooled": _int_list(node, "pooled_shape", 2),
            "sample": _int_list(node, "sample", 2, minimum=0, default=[0, 0]),
            "spatial": _float_list(node, "spatial_scale_value", 2, default=[1.0, 1.0])}


def _axis_samples_float(start: float, end: float, pooled: int, ratio: int, size: int,
                        half_pixel: bool) -> Any:
    """Per-axis sampling of one box in float: (low, high, w_low, w_high) each [pooled, n], or None (no samples)."""
    roi = end - start
    if not half_pixel:
        roi = max(roi, 1.0)
    n = ratio if ratio > 0 else max(int(torch.ceil(torch.tensor(roi / pooled, dtype=torch.float64))), 0)
    if n == 0:
        return None
    k = torch.arange(pooled * n, dtype=torch.float64)
    pos = start + roi * (2 * k + 1) / (2 * pooled * n)
    valid = ((pos >= -1.0) & (pos <= size)).to(torch.float64)
    pos = torch.clamp(pos, 0.0, size - 1.0)
    low = torch.floor(pos).to(torch.int64)
    frac = pos - low.to(torch.float64)
    high = torch.clamp(low + 1, max=size - 1)
    return [t.reshape(pooled, n) for t in (low, high, (1.0 - frac) * valid, frac * valid)]


def _axis_samples_int(start: int, end: int, pooled: int, ratio: int, size: int, half_pixel: bool) -> Any:
    """The same in fixed point (ROI_FRACTION_BITS): positions rounded half to even, integer weights."""
    one = 1 << ROI_FRACTION_BITS
    roi = end - start
    if not half_pixel:
        roi = max(roi, one)
    n = ratio if ratio > 0 else max(-((-roi) // (pooled * one)), 0)
    if n == 0:
        return None
    k = torch.arange(pooled * n, dtype=torch.int64)
    pos = start + rhe_div(roi * (2 * k + 1), 2 * pooled * n)
    valid = ((pos >= -one) & (pos <= size * one)).to(torch.int64)
    pos = torch.clamp(pos, 0, (size - 1) * one)
    low = pos >> ROI_FRACTION_BITS
    frac = pos - (low << ROI_FRACTION_BITS)
    high = torch.clamp(low + 1, max=size - 1)
    return [t.reshape(pooled, n) for t in (low, high, (one - frac) * valid, frac * valid)]


def _bilinear_terms(fm: torch.Tensor, ys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The four corner terms w_y * w_x * f[y, x] of every sample: each [Ph, nh, Pw, nw, C]."""
    terms = []
    for yi, wy in ((ys[0], ys[2]), (ys[1], ys[3])):
        for xi, wx in ((xs[0], xs[2]), (xs[1], xs[3])):
            v = fm[yi[:, :, None, None], xi[None, None, :, :]]
            terms.append(v * (wy[:, :, None, None] * wx[None, None, :, :])[..., None])
    return terms


def roi_align(node: PyNode, fm: torch.Tensor, rois: torch.Tensor, p: dict, integer: bool) -> torch.Tensor:
    """RoiAlign of an NHWC map. Float: `fm` float, `rois` [R, 5] float. Integer: `fm` = x_q + zp (int64), `rois` =
    [R, 5] int64 = (batch index, y1, x1, y2, x2) already in fixed point (ROI_FRACTION_BITS, spatial scale and
    half-pixel offset not yet applied to the coordinates); returns the un-offset integer result (before - zp)."""
    n, h, w, c = fm.shape
    ph, pw = p["pooled"]
    out = torch.zeros((rois.shape[0], ph, pw, c), dtype=fm.dtype)
    one = 1 << ROI_FRACTION_BITS
    off = (one >> 1 if integer else 0.5) if p["half_pixel"] else 0
    sample = _axis_samples_int if integer else _axis_samples_float
    absmax = int(fm.abs().max()) if integer and fm.numel() else 0
    for r in range(rois.shape[0]):
        b = int(rois[r, 0]) if integer else int(torch.round(rois[r, 0].to(torch.float64)))
        if not _batch_ok(node, b, n, r):
            continue
        if integer:
            y1, x1, y2, x2 = (int(v) for v in rois[r, 1:])
        else:
            sy, sx = p["spatial"]
            y1, x1, y2, x2 = (float(rois[r, 1]) * sy, float(rois[r, 2]) * sx, float(rois[r, 3]) * sy,
                              float(rois[r, 4]) * sx)
        ys = sample(y1 - off, y2 - off, ph, p["sample"][0], h, p["half_pixel"])
        xs = sample(x1 - off, x2 - off, pw, p["sample"][1], w, p["half_pixel"])
        if ys is None or xs is None:
            continue
        count = ys[0].shape[1] * xs[0].shape[1]
        if integer:
            _check_bound(node, absmax, count << (2 * ROI_FRACTION_BITS))
        terms = _bilinear_terms(fm[b], ys, xs)
        if p["method"] == "AVG":
            total = sum(terms[1:], terms[0]).sum(dim=(1, 3))
            out[r] = rhe_div(total, count << (2 * ROI_FRACTION_BITS)) if integer else total / count
        else:
            m = torch.stack(terms).amax(0).amax(dim=(1, 3))
            out[r] = rhe_div(m, 1 << (2 * ROI_FRACTION_BITS)) if integer else m
    return out


@ROIALIGN.forward
def roialign_forward(self: PyNode) -> None:
    p = _roialign_params(self)
    x = _feature(self)
    if len(self.inputs) < 2:
        raise self._error("needs two inputs: feature map and boxes [R, 5]")
    rois = _rois(self, self.inputs[1].betensor, 5).cpu()  # computed on the CPU (a loop over the boxes)
    if not self.quantized:
        y = roi_align(self, x.cpu().to(torch.float64), rois.to(torch.float64), p, integer=False)
        self.outputs[0].betensor = y.to(device=x.device, dtype=torch.float32)
        return
    zp, qmin, qmax = _feature_zp_range(self)
    bq, bzp = int_value(self.inputs[1]).cpu(), tensor_zp(self, self.inputs[1])
    bq = bq[0] if bq.dim() == 3 else bq
    (my, ny), (mx, nx) = _coord_pairs(self, "coord", 2)
    (mb, nb), = _coord_pairs(self, "batch", 1)
    fx = torch.stack([fixed_point(bq[:, 0], bzp, mb, nb),
                      fixed_point(bq[:, 1], bzp, my, ny), fixed_point(bq[:, 2], bzp, mx, nx),
                      fixed_point(bq[:, 3], bzp, my, ny), fixed_point(bq[:, 4], bzp, mx, nx)], dim=1)
    y = roi_align(self, int_value(self.inputs[0]).cpu() + zp, fx, p, integer=True) - zp
    self.outputs[0].betensor = torch.clamp(y, qmin, qmax).to(x.device)


@ROIALIGN.quantize
def roialign_quantize(self: PyNode) -> None:
    """Output = feature map's params; box coordinates: M/2^N ~ spatial_scale * 2^F / s_b per axis; batch index:
    M/2^N ~ 1 / s_b."""
    p = _roialign_params(self)
    s_b = _quantize_boxes(self)
    sy, sx = p["spatial"]
    _coord_requant(self, "coord", [sy * 2 ** ROI_FRACTION_BITS / s_b, sx * 2 ** ROI_FRACTION_BITS / s_b])
    _coord_requant(self, "batch", [1.0 / s_b])
    self.params["coord_fraction_bits"] = ROI_FRACTION_BITS


# ------------------------------------------------------------------------------------------------ MaxRoiPool
MAXROIPOOL = declare_op(
    "MaxRoiPool",
    params={"spatial": Param(Floats(), "[sy, sx] box → feature-map scale, positive (float forward and quantize)"),
            **_COORD_KEYS,
            "scale": _UNREAD_SCALE},
    dtypes="float32 feature + float32 boxes [R,5] → feature's dtype",
    integer="box corners rounded from fixed point (M/shift), bin maximum", semantics=f"{_SEM}#maxroipool",
    summary="The output shape comes from layer_top_shape.")


def _out_hw(node: PyNode) -> Tuple[int, int]:
    shape = node.outputs[0].ir_shape
    if len(shape) != 4:
        raise node._error(f"output shape must be [R, PH, PW, C], got {list(shape)}")
    return int(shape[1]), int(shape[2])


def max_roi_pool(node: PyNode, fm: torch.Tensor, batch: Sequence[int], coords: torch.Tensor, pooled: Tuple[int, int],
                 fill: Any) -> torch.Tensor:
    """Caffe ROI max pooling with integer box corners `coords` [R, 4] = (y1, x1, y2, x2) in feature cells.

    roi size = max(end - start + 1, 1); bin i covers [start + floor(i*size/P), start + ceil((i+1)*size/P)) clipped
    to the map; an empty bin (or a box with a negative batch index) is `fill`.
    """
    n, h, w, c = fm.shape
    ph, pw = pooled
    out = torch.full((coords.shape[0], ph, pw, c), fill, dtype=fm.dtype)
    for r in range(coords.shape[0]):
        if not _batch_ok(node, int(batch[r]), n, r):
            continue
        y1, x1, y2, x2 = (int(v) for v in coords[r])
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(ph):
            hs = min(max(y1 + (i * rh) // ph, 0), h)
            he = min(max(y1 - ((-(i + 1) * rh) // ph), 0), h)
            if hs >= he:
                continue
            for j in range(pw):
                ws = min(max(x1 + (j * rw) // pw, 0), w)
                we = min(max(x1 - ((-(j + 1) * rw) // pw), 0), w)
                if ws < we:
                    out[r, i, j] = fm[int(batch[r]), hs:he, ws:we].amax(dim=(0, 1))
    return out


@MAXROIPOOL.forward
def maxroipool_forward(self: PyNode) -> None:
    x = _feature(self)
    if len(self.inputs) < 2:
        raise self._error("needs two inputs: feature map and boxes [R, 5]")
    rois = _rois(self, self.inputs[1].betensor, 5).cpu()  # computed on the CPU (loops over boxes and bins)
    pooled = _out_hw(self)
    if self.quantized:
        zp, qmin, qmax = _feature_zp_range(self)
        bq, bzp = int_value(self.inputs[1]).cpu(), tensor_zp(self, self.inputs[1])
        bq = bq[0] if bq.dim() == 3 else bq
        (my, ny), (mx, nx) = _coord_pairs(self, "coord", 2)
        (mb, nb), = _coord_pairs(self, "batch", 1)
        batch = fixed_point(bq[:, 0], bzp, mb, nb)
        # round half up: floor(v / 2^N + 1/2) = floor((v*2 + 2^N) / 2^(N+1)), exact for every N
        coords = torch.stack([round_half_up(bq[:, k], bzp, m, s)
                              for k, (m, s) in zip((1, 2, 3, 4), ((my, ny), (mx, nx), (my, ny), (mx, nx)))], dim=1)
        y = max_roi_pool(self, int_value(self.inputs[0]).cpu(), batch.tolist(), coords, pooled,
                         min(max(-zp, qmin), qmax))
        self.outputs[0].betensor = torch.clamp(y, qmin, qmax).to(x.device)
        return
    sy, sx = _float_list(self, "spatial", 2)
    r64 = rois.to(torch.float64)
    scales = torch.tensor([sy, sx, sy, sx], dtype=torch.float64)
    coords = torch.floor(r64[:, 1:] * scales + 0.5).to(torch.int64)
    batch = torch.round(r64[:, 0]).to(torch.int64).tolist()
    xf = x.cpu().to(x.dtype if x.is_floating_point() else torch.float32)
    self.outputs[0].betensor = max_roi_pool(self, xf, batch, coords, pooled, 0.0).to(x.device)


def round_half_up(q: torch.Tensor, zp: int, mult: int, shift: int) -> torch.Tensor:
    """floor((q + zp) * M / 2^N + 1/2) as int64: Caffe's round() of a box corner (exact; N <= 0 is a left shift)."""
    v = (q.to(torch.int64) + zp) * mult
    if shift <= 0:
        return v << (-shift)
    return (v + (1 << (shift - 1))) >> shift


@MAXROIPOOL.quantize
def maxroipool_quantize(self: PyNode) -> None:
    """Output = feature map's params; box corners: M/2^N ~ spatial / s_b (rounded half up); batch: ~ 1 / s_b."""
    sy, sx = _float_list(self, "spatial", 2)
    s_b = _quantize_boxes(self)
    _coord_requant(self, "coord", [sy / s_b, sx / s_b])
    _coord_requant(self, "batch", [1.0 / s_b])


# ------------------------------------------------------------------------------------------------ ROIPooling
ROIPOOLING = declare_op(
    "ROIPooling",
    params={**_COORD_KEYS,
            "coord_fraction_bits": _FRACTION_BITS,
            **{f"{a}_index_scale": quantized(Float(), "upstream's quantized ROIPooling (written as a float); not "
                                                      "read") for a in "xy"},
            **{f"{a}_index_shift": quantized(Int(), "upstream's quantized ROIPooling; not read") for a in "xy"},
            "scale": _UNREAD_SCALE},
    dtypes="float32 feature + float32 normalized boxes [1,R,4] → feature's dtype",
    integer="fixed-point box edges, exact truncated sample indices, gather", semantics=f"{_SEM}#roipooling",
    summary="The output shape comes from layer_top_shape.")


def roi_pooling_indices(a: torch.Tensor, b: torch.Tensor, size: int, out: int, unit: Any) -> torch.Tensor:
    """Upstream ROIPooling sample index i of one axis: trunc(A + i * ((B - A) / out + 1)) clipped to [0, size-1],
    where A, B are the box edges times the feature size in units of `unit` (1 in float, 2^F in fixed point);
    computed as trunc((out*A + i*(B - A + out*unit)) / (out*unit)), exactly for integers."""
    i = torch.arange(out, dtype=a.dtype)
    num = out * a + i * (b - a + out * unit)
    den = out * unit
    if a.dtype == torch.int64:
        idx = torch.div(num, den, rounding_mode="trunc")
    else:
        idx = torch.trunc(num / den).to(torch.int64)
    return torch.clamp(idx, 0, size - 1)


@ROIPOOLING.forward
def roipooling_forward(self: PyNode) -> None:
    x = _feature(self)
    if len(self.inputs) < 2:
        raise self._error("needs two inputs: feature map and normalized boxes [1, R, 4]")
    boxes = _rois(self, self.inputs[1].betensor, 4).cpu()  # computed on the CPU (a loop over the boxes)
    rh, rw = _out_hw(self)
    fh, fw = x.shape[1], x.shape[2]
    if self.quantized:
        bq, bzp = int_value(self.inputs[1]).cpu(), tensor_zp(self, self.inputs[1])
        bq = bq[0] if bq.dim() == 3 else bq
        (my, ny), (mx, nx) = _coord_pairs(self, "coord", 2)
        fm = int_value(self.inputs[0]).cpu()
        edges = [fixed_point(bq[:, k], bzp, m, s) for k, (m, s) in
                 zip(range(4), ((my, ny), (mx, nx), (my, ny), (mx, nx)))]
        unit: Any = 1 << ROI_FRACTION_BITS
    else:
        b64 = boxes.to(torch.float64)
        edges = [b64[:, 0] * fh, b64[:, 1] * fw, b64[:, 2] * fh, b64[:, 3] * fw]
        fm = x.cpu().to(x.dtype if x.is_floating_point() else torch.float32)
        unit = 1.0
    out = torch.empty((boxes.shape[0], rh, rw, x.shape[3]), dtype=fm.dtype)
    for r in range(boxes.shape[0]):
        yi = roi_pooling_indices(edges[0][r], edges[2][r], fh, rh, unit)
        xi = roi_pooling_indices(edges[1][r], edges[3][r], fw, rw, unit)
        out[r] = fm[0][yi[:, None], xi[None, :]]
    if self.quantized:
        out = torch.clamp(out, *out_range(self, self.outputs[0]))
    self.outputs[0].betensor = out.to(x.device)


@ROIPOOLING.quantize
def roipooling_quantize(self: PyNode) -> None:
    """Output = feature map's params; normalized box edges times the feature size: M/2^N ~ size * 2^F / s_b."""
    s_b = _quantize_boxes(self)
    fh, fw = int(self.inputs[0].ir_shape[1]), int(self.inputs[0].ir_shape[2])
    _coord_requant(self, "coord", [fh * 2 ** ROI_FRACTION_BITS / s_b, fw * 2 ** ROI_FRACTION_BITS / s_b])
    self.params["coord_fraction_bits"] = ROI_FRACTION_BITS


# ------------------------------------------------------------------------------------------------ CropAndResize
CROP_METHODS = ("BILINEAR", "NEAREST")

CROP_AND_RESIZE = declare_op(
    "CropAndResize",
    params={"crop_size": Param(Ints(lo=1), "[CH, CW] output size of each crop", required=True),
            "method": Param(Text(choices=CROP_METHODS), "sampling (default BILINEAR)", default="BILINEAR"),
            "extrapolation_value": Param(Float(), "the value of positions outside the map (default 0)",
                                         default=0.0),
            "extrapolation_qvalue": quantized(Int(), "extrapolation_value quantized with the output's params"),
            **_COORD_KEYS,
            "coord_fraction_bits": _FRACTION_BITS,
            "scale": _UNREAD_SCALE},
    dtypes="float32 feature + float32 boxes [R,4] + int32 indices → feature's dtype",
    integer="fixed-point sampling positions, exact bilinear weights, rounded half to even",
    semantics=f"{_SEM}#cropandresize")


def _crop_params(node: PyNode) -> dict:
    method = str(node.get_param("method", optional=True, default_value="BILINEAR")).upper()
    if method not in CROP_METHODS:
        raise node._error(f"unsupported CropAndResize method '{method}' (supported: {', '.join(CROP_METHODS)})")
    extra = node.get_param("extrapolation_value", optional=True, default_value=0.0)
    if isinstance(extra, bool) or not isinstance(extra, (int, float)):
        raise node._error(f"parameter 'extrapolation_value' must be a number, got {extra!r}")
    return {"method": method, "crop": _int_list(node, "crop_size", 2), "extra": float(extra)}


def _crop_axis(c1: Any, c2: Any, size: int, crop: int, integer: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sampling positions of one axis (TF crop_and_resize) and their validity. Float: pixels. Integer: fixed point
    from the normalized fixed-point edges c1, c2, rounded half to even."""
    if integer:
        i = torch.arange(crop, dtype=torch.int64)
        if crop > 1:
            pos = rhe_div(((crop - 1 - i) * int(c1) + i * int(c2)) * (size - 1), crop - 1)
        else:
            pos = rhe_div(torch.full((1,), (int(c1) + int(c2)) * (size - 1), dtype=torch.int64), 2)
        return pos, (pos >= 0) & (pos <= (size - 1) << ROI_FRACTION_BITS)
    i = torch.arange(crop, dtype=torch.float64)
    if crop > 1:
        pos = c1 * (size - 1) + i * (c2 - c1) * (size - 1) / (crop - 1)
    else:
        pos = torch.full((1,), 0.5 * (c1 + c2) * (size - 1), dtype=torch.float64)
    return pos, (pos >= 0) & (pos <= size - 1)


def _crop_taps(pos: torch.Tensor, size: int, nearest: bool, integer: bool) -> List[torch.Tensor]:
    """(low, high, w_low, w_high) per output position; nearest: one tap of weight 1 (2^F)."""
    one = 1 << ROI_FRACTION_BITS if integer else 1.0
    if integer:
        p = torch.clamp(pos, 0, (size - 1) << ROI_FRACTION_BITS)
        if nearest:
            idx = torch.clamp((p + (1 << (ROI_FRACTION_BITS - 1))) >> ROI_FRACTION_BITS, max=size - 1)
            return [idx, idx, torch.full_like(idx, one), torch.zeros_like(idx)]
        low = p >> ROI_FRACTION_BITS
        frac = p - (low << ROI_FRACTION_BITS)
    else:
        p = torch.clamp(pos, 0.0, size - 1.0)
        if nearest:
            idx = torch.clamp(torch.floor(p + 0.5).to(torch.int64), max=size - 1)
            return [idx, idx, torch.ones_like(p), torch.zeros_like(p)]
        low = torch.floor(p).to(torch.int64)
        frac = p - low.to(p.dtype)
    return [low, torch.clamp(low + 1, max=size - 1), one - frac, frac]


def crop_and_resize(node: PyNode, fm: torch.Tensor, boxes: torch.Tensor, index: torch.Tensor, p: dict,
                    integer: bool, fill: Any) -> torch.Tensor:
    """TF CropAndResize on NHWC. Integer: `fm` = x_q + zp, `boxes` fixed-point normalized edges; the result is
    round_half_even(sum of w_y*w_x*(x_q+zp) / 2^(2F)) (without - zp). Positions outside the map give `fill`."""
    n, h, w, c = fm.shape
    ch, cw = p["crop"]
    nearest = p["method"] == "NEAREST"
    out = torch.empty((boxes.shape[0], ch, cw, c), dtype=fm.dtype)
    for r in range(boxes.shape[0]):
        b = int(index[r])
        if b < 0 or b >= n:
            raise DataError(f"layer '{node.name}' ({node.type}): box {r} has batch index {b} but the feature map "
                            f"holds {n} images")
        y1, x1, y2, x2 = (boxes[r, k] if not integer else int(boxes[r, k]) for k in range(4))
        py, vy = _crop_axis(y1, y2, h, ch, integer)
        px, vx = _crop_axis(x1, x2, w, cw, integer)
        ty, tx = _crop_taps(py, h, nearest, integer), _crop_taps(px, w, nearest, integer)
        acc = 0
        for yi, wy in ((ty[0], ty[2]), (ty[1], ty[3])):
            for xi, wx in ((tx[0], tx[2]), (tx[1], tx[3])):
                acc = acc + fm[b][yi[:, None], xi[None, :]] * (wy[:, None] * wx[None, :])[..., None]
        if integer:
            acc = rhe_div(acc, 1 << (2 * ROI_FRACTION_BITS))
        valid = (vy[:, None] & vx[None, :])[..., None]
        out[r] = torch.where(valid, acc, torch.as_tensor(fill, dtype=fm.dtype))
    return out


@CROP_AND_RESIZE.forward
def cropandresize_forward(self: PyNode) -> None:
    p = _crop_params(self)
    x = _feature(self)
    if len(self.inputs) < 3:
        raise self._error("needs three inputs: feature map, normalized boxes [R, 4] and box indices [R]")
    boxes = _rois(self, self.inputs[1].betensor, 4).cpu()  # computed on the CPU (a loop over the boxes)
    index = int_value(self.inputs[2]).cpu().reshape(-1)
    if index.numel() != boxes.shape[0]:
        raise self._error(f"{index.numel()} box indices for {boxes.shape[0]} boxes")
    if not self.quantized:
        y = crop_and_resize(self, x.cpu().to(torch.float64), boxes.to(torch.float64), index, p, False, p["extra"])
        self.outputs[0].betensor = y.to(device=x.device, dtype=torch.float32)
        return
    zp, qmin, qmax = _feature_zp_range(self)
    bq, bzp = int_value(self.inputs[1]).cpu(), tensor_zp(self, self.inputs[1])
    bq = bq[0] if bq.dim() == 3 else bq
    (m, s), = _coord_pairs(self, "coord", 1)
    fx = fixed_point(bq, bzp, m, s)
    fill = int(self.get_param("extrapolation_qvalue")) + zp
    y = crop_and_resize(self, int_value(self.inputs[0]).cpu() + zp, fx, index, p, True, fill) - zp
    self.outputs[0].betensor = torch.clamp(y, qmin, qmax).to(x.device)


@CROP_AND_RESIZE.quantize
def cropandresize_quantize(self: PyNode) -> None:
    """Output = feature map's params; normalized edges: M/2^N ~ 2^F / s_b; the extrapolation value quantized with
    the output params as `extrapolation_qvalue`."""
    p = _crop_params(self)
    s_b = _quantize_boxes(self)
    table = quant_of(self)
    if not table.get(self.inputs[2]).qinvariant:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the box index input '{self.inputs[2].name}' must "
                               "be an integer tensor (qinvariant)")
    _coord_requant(self, "coord", [2 ** ROI_FRACTION_BITS / s_b])
    self.params["coord_fraction_bits"] = ROI_FRACTION_BITS
    out = self.outputs[0]
    extra = torch.tensor(p["extra"], dtype=torch.float64) * float(tensor_scale(self, out))
    code = round(float(extra) - tensor_zp(self, out))
    q_out = table.get(out)
    self.params["extrapolation_qvalue"] = min(max(int(code), int(q_out.qmin)), int(q_out.qmax))
