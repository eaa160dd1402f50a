"""Window ops with a fixed footprint: grey-scale morphology on NHWC activations, Dilation (max of input plus
structuring element over each window) and Erosion (min of input minus the mirrored element), as TensorFlow's
dilation2d / erosion2d; and Col2Im (ONNX: overlapping blocks summed back into an image).

Quantized, the input integers and the element's integers (quantized with the activation bits) are brought to one
scale by two integer factors, the window maximum (minimum) is taken exactly in int64 and requantized once to the
output, as upstream. Col2Im sums the overlapping input integers (plus zero point) exactly and requantizes once. The
semantics are in docs/semantics/morphology.md.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..quant.dtype import Dtype
from ..quant.params import QuantMode, linear_quant_params, quantize
from ..quant.requant import requantize_int
from ..registry import declare_op
from ..registry.schema import Float, Int, Ints, Param, Value, quantized
from ._quant import (
    check_quantized_inputs,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_scale_shift,
    set_params,
    tensor_scale,
    tensor_zp,
)
from ._shared import int_param

SEMANTICS = "docs/semantics/morphology.md"

ALIGN_BITS = 8
"""Initial fraction bits of the two alignment factors (upstream's g_eltwise_scale_bits)."""

ALIGN_CLIP = 32767
"""The alignment factors stay at most int16's maximum (upstream: the hardware has no uint16 of 65535 here)."""

_WINDOW_PARAMS = {
    "kernel_x": Param(Int(lo=1), "element width", required=True),
    "kernel_y": Param(Int(lo=1), "element height", default=1),
    "stride_x": Param(Int(lo=1), "horizontal step", required=True),
    "stride_y": Param(Int(lo=1), "vertical step", default=1),
    "dilation_x": Param(Int(lo=1), "horizontal spacing of the element's taps", required=True),
    "dilation_y": Param(Int(lo=1), "vertical spacing of the element's taps", default=1),
    **{f"pad_{side}": Param(Int(lo=0), f"{side} padding (never chosen by the max/min)", required=True)
       for side in ("left", "right", "top", "bottom")},
    "scale_value": quantized(Ints(lo=0), "[M, A_in, A_w]: output multiplier and the two alignment factors"),
    "scale_type": quantized(Value("list of dtypes"), "their dtypes"),
    "shift_value": quantized(Int(), "output shift N"),
    "shift_type": quantized(Value("dtype"), "its dtype"),
    "weights_scale": quantized(Float(), "scale of the quantized element"),
    "weights_zp": quantized(Int(), "zero point of the quantized element"),
}

_DOC = dict(dtypes="float32 → int8/uint8 (8 bits) or int16/uint16; the element quantized with the activation bits",
            integer="aligned int64 sums, exact window max/min, one requantization")

DILATION = declare_op("Dilation", params=dict(_WINDOW_PARAMS), constants={"weights": "the element [C, kh, kw, 1]"},
                      semantics=f"{SEMANTICS}#dilation", **_DOC,
                      summary="out = max over the window of x + w (TensorFlow dilation2d).")

EROSION = declare_op("Erosion", params=dict(_WINDOW_PARAMS), constants={"weights": "the element [C, kh, kw, 1]"},
                     semantics=f"{SEMANTICS}#erosion", **_DOC,
                     summary="out = min over the window of x - w mirrored (TensorFlow erosion2d).")


def _window(node: PyNode) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int], Tuple[int, int, int, int]]:
    k = (int_param(node, "kernel_y", 1), int_param(node, "kernel_x"))
    s = (int_param(node, "stride_y", 1), int_param(node, "stride_x"))
    d = (int_param(node, "dilation_y", 1), int_param(node, "dilation_x"))
    pads = tuple(int_param(node, f"pad_{side}", minimum=0) for side in ("left", "right", "top", "bottom"))
    return k, s, d, pads  # type: ignore[return-value]


def _element(node: PyNode, channels: int, kernel: Tuple[int, int], values: torch.Tensor) -> torch.Tensor:
    """The element as [C, kh, kw] (Erosion: negated and mirrored in both spatial axes)."""
    if values.dim() != 4 or tuple(values.shape) != (channels, kernel[0], kernel[1], 1):
        raise node._error(f"weights must have shape [{channels}, {kernel[0]}, {kernel[1]}, 1] (channels, kernel_y, "
                          f"kernel_x, 1), got {list(values.shape)}")
    w = values[..., 0]
    return -torch.flip(w, [1, 2]) if node.type == "Erosion" else w


def _windows(node: PyNode, x: torch.Tensor, fill: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(window values [n, oh, ow, c, kh, kw], validity mask of the same shape: False on padding)."""
    if x.dim() != 4:
        raise node._error(f"input must be 4-D (NHWC), got shape {list(x.shape)}")
    (kh, kw), (sh, sw), (dh, dw), (pl, pr, pt, pb) = _window(node)
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    n, h, w, c = x.shape
    if h + pt + pb < eh or w + pl + pr < ew:
        raise node._error(f"the {eh}x{ew} window (kernel and dilation) is larger than the padded {h + pt + pb}x"
                          f"{w + pl + pr} input")
    xp = F.pad(x, (0, 0, pl, pr, pt, pb), value=fill)
    valid = F.pad(torch.ones(1, h, w, 1, dtype=torch.bool, device=x.device), (0, 0, pl, pr, pt, pb), value=False)

    def unfold(t: torch.Tensor) -> torch.Tensor:
        return t.unfold(1, eh, sh).unfold(2, ew, sw)[..., ::dh, ::dw]

    win, ok = unfold(xp), unfold(valid)
    if not bool(ok.flatten(-2).any(-1).all()):
        raise node._error("a window lies entirely in the padding")
    return win, ok


def _forward(node: PyNode) -> None:
    erosion = node.type == "Erosion"
    inp = node.inputs[0]
    x = inp.betensor
    kernel = _window(node)[0]
    w_t = node.get_constant("weights")
    if not node.quantized:
        w = _element(node, int(x.shape[-1]), kernel, w_t.betensor.to(device=x.device, dtype=torch.float32))
        win, _ = _windows(node, x.to(torch.float32), float("inf") if erosion else float("-inf"))
        v = win + w[:, :, :]  # [.., c, kh, kw] + [c, kh, kw]
        node.outputs[0].betensor = v.amin((-2, -1)) if erosion else v.amax((-2, -1))
        return
    m, a_in, a_w = (int(v) for v in node.get_param("scale_value"))
    shift = int(node.get_param("shift_value"))
    zp_w = int(node.get_param("weights_zp", optional=True, default_value=0) or 0)
    wq = _element(node, int(x.shape[-1]), kernel, w_t.betensor.to(device=x.device, dtype=torch.int64) + zp_w)
    win, ok = _windows(node, x.to(torch.int64) + tensor_zp(node, inp), 0)
    acc = win * a_in + wq * a_w
    sentinel = torch.tensor(2 ** 62 if erosion else -2 ** 62, dtype=torch.int64, device=acc.device)
    acc = torch.where(ok, acc, sentinel)
    best = acc.flatten(-2).amin(-1) if erosion else acc.flatten(-2).amax(-1)
    qmin, qmax = out_range(node, node.outputs[0])
    node.outputs[0].betensor = requantize_int(best, m, shift, tensor_zp(node, node.outputs[0]), qmin, qmax)


@DILATION.forward
def dilation_forward(self: PyNode) -> None:
    _forward(self)


@EROSION.forward
def erosion_forward(self: PyNode) -> None:
    _forward(self)


def _align(s_in: float, s_w: float) -> Tuple[float, int, int, int]:
    """(s_max, A_in, A_w, g) as upstream: A_i = (s_max / s_i) · 2^8, halved (rounding half to even, at least 1) with
    g = g - 1 while either exceeds 32767; scales whose ratio is below 2^8 / 32767 are first clamped to
    [1/32767, 32767]."""
    g = ALIGN_BITS
    s0, s1 = s_in, s_w
    if s_in / s_w < 2 ** ALIGN_BITS / ALIGN_CLIP:
        s0 = min(max(s_in, 1.0 / ALIGN_CLIP), ALIGN_CLIP)
        s1 = min(max(s_w, 1.0 / ALIGN_CLIP), ALIGN_CLIP)
    s_max = max(s0, s1)
    a0, a1 = (s_max / s0) * 2 ** g, (s_max / s1) * 2 ** g
    while int(a0) > ALIGN_CLIP or int(a1) > ALIGN_CLIP:
        a0, a1 = max(round(a0 / 2), 1), max(round(a1 / 2), 1)
        g -= 1
    return s_max, int(a0), int(a1), g


@DILATION.quantize
@EROSION.quantize
def morphology_quantize(self: PyNode) -> None:
    """Element per tensor with the activation bits (signed; the weight mode's symmetry); output calibrated, signed
    when the input is, the element has a negative value, or for Erosion; then the alignment factors and
    (M, N) = scale_shift(s_out / s_max / 2^g, activation bits)."""
    inp, out = self.inputs[0], self.outputs[0]
    check_quantized_inputs(self, [inp])
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    w = self.get_constant("weights")
    r = ranges_of(self).get(w)
    if r.min is None or r.max is None:
        raise self._error("constant 'weights' has no calibrated range; run calibration before quantization")
    w_negative = float(w.betensor.min()) < 0
    mode = QuantMode.from_name(s.q_mode_weight).to_per_tensor()
    p = linear_quant_params(r.min, r.max, bits, mode, True)
    w.betensor = quantize(w.betensor, p.scale, p.zerop, p.qmin, p.qmax)
    set_params(self, w, p, bits)
    self.params["weights_scale"] = float(p.scale)
    self.params["weights_zp"] = int(p.zerop)
    in_qmin = params(self, inp).qmin
    in_signed = in_qmin is not None and int(in_qmin) < 0
    quantize_activation(self, out, in_signed or w_negative or self.type == "Erosion", bits)
    if params(self, out).per_channel:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): per-channel activations are not supported")
    s_max, a_in, a_w, g = _align(tensor_scale(self, inp), float(p.scale))
    m, shift, m_type, shift_type = requant_scale_shift(self, tensor_scale(self, out) / s_max / 2 ** g, mult_bits=bits)
    self.params["shift_value"] = int(shift)
    self.params["shift_type"] = shift_type
    self.params["scale_value"] = [int(m), a_in, a_w]
    self.params["scale_type"] = [m_type, Dtype.UINT16, Dtype.UINT16]


# ------------------------------------------------------------------------------------------------ Col2Im
_AXES = ("z", "y", "x")
_SIDES_2D = {"y": ("pad_top", "pad_bottom"), "x": ("pad_left", "pad_right")}

COL2IM = declare_op(
    "Col2Im",
    params={**{f"{k}_{a}": Param(Int(lo=1), f"{what} along {a} (default 1)", default=1)
               for k, what in (("stride", "step between blocks"), ("dilation", "spacing of a block's taps"))
               for a in _AXES},
            **{f"kernel_{a}": Param(Int(lo=1), "written by some Parser versions; the block shape input decides")
               for a in _AXES},
            **{p: Param(Int(lo=0), "2-D padding of the image", default=0)
               for pair in _SIDES_2D.values() for p in pair},
            **{f"pad_{a}_{e}": Param(Int(lo=0), "3-D padding of the image", default=0)
               for a in _AXES for e in ("begin", "end")},
            "scale_value": quantized(Int(lo=0), "requantization multiplier M"),
            "scale_type": quantized(Value("dtype"), "its dtype"),
            "shift_value": quantized(Int(), "requantization shift N"),
            "shift_type": quantized(Value("dtype"), "its dtype")},
    dtypes="float32 → int8/uint8 (8 bits) or int16/uint16; image and block shapes int32 (integer tensors)",
    integer="exact int64 sums of the overlapping blocks, one requantization", semantics=f"{SEMANTICS}#col2im",
    summary="ONNX Col2Im: inputs the columns [n, c·Πblock, L], the image shape and the block shape (2 or 3 "
            "spatial dims); output [n, c, *image] (channels first, as ONNX).")


def _shape_input(node: PyNode, index: int, what: str) -> list:
    t = node.inputs[index]
    v = t.betensor
    vals = torch.round(v.to(torch.float64)).to(torch.int64) if v.is_floating_point() else v.to(torch.int64)
    out = [int(d) for d in vals.flatten().tolist()]
    if len(out) not in (2, 3) or any(d < 1 for d in out):
        raise node._error(f"the {what} input must hold 2 or 3 positive sizes, got {out}")
    return out


def _col2im_geometry(node: PyNode, rank: int):
    axes = _AXES[3 - rank:]
    stride = [int_param(node, f"stride_{a}", 1) for a in axes]
    dilation = [int_param(node, f"dilation_{a}", 1) for a in axes]
    if rank == 2:
        pads = [tuple(int_param(node, p, 0, minimum=0) for p in _SIDES_2D[a]) for a in axes]
    else:
        pads = [tuple(int_param(node, f"pad_{a}_{e}", 0, minimum=0) for e in ("begin", "end")) for a in axes]
    return stride, dilation, pads


def _col2im_index(node: PyNode, image: list, block: list, length: int,
                  device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(image index [K·L] of every (tap, block position) pair, k major; validity mask [K·L]), built on the CPU and
    moved to `device` (the columns')."""
    rank = len(image)
    stride, dilation, pads = _col2im_geometry(node, rank)
    counts = []
    for d in range(rank):
        eff = (block[d] - 1) * dilation[d] + 1
        span = image[d] + pads[d][0] + pads[d][1] - eff
        if span < 0:
            raise node._error(f"block {block} (dilated) is larger than the padded image {image}")
        counts.append(span // stride[d] + 1)
    if math.prod(counts) != length:
        raise node._error(f"the input has {length} blocks but image {image}, block {block}, strides {stride}, "
                          f"dilations {dilation} and pads {pads} give {math.prod(counts)}")
    taps = torch.cartesian_prod(*[torch.arange(b) for b in block]).reshape(-1, rank)
    pos = torch.cartesian_prod(*[torch.arange(c) for c in counts]).reshape(-1, rank)
    coord = pos[None, :, :] * torch.tensor(stride) - torch.tensor([p[0] for p in pads]) + \
        taps[:, None, :] * torch.tensor(dilation)  # [K, L, rank]
    size = torch.tensor(image)
    valid = ((coord >= 0) & (coord < size)).all(-1)
    flat = torch.zeros(coord.shape[:2], dtype=torch.int64)
    for d in range(rank):
        flat = flat * image[d] + coord[..., d]
    return torch.where(valid, flat, torch.zeros_like(flat)).reshape(-1).to(device), valid.reshape(-1).to(device)


@COL2IM.forward
def col2im_forward(self: PyNode) -> None:
    if len(self.inputs) != 3:
        raise self._error(f"needs three inputs (columns, image shape, block shape), got {len(self.inputs)}")
    x_t = self.inputs[0]
    x = x_t.betensor
    image, block = _shape_input(self, 1, "image shape"), _shape_input(self, 2, "block shape")
    if len(image) != len(block):
        raise self._error(f"image shape {image} and block shape {block} must have the same rank")
    if x.dim() != 3:
        raise self._error(f"the columns input must be 3-D [n, c·Πblock, L], got shape {list(x.shape)}")
    n, ck, length = x.shape
    k = math.prod(block)
    if ck % k:
        raise self._error(f"dim 1 of the columns ({ck}) is not a multiple of the block size {k}")
    c = ck // k
    idx, valid = _col2im_index(self, image, block, int(length), x.device)
    if self.quantized:
        src = (x.to(torch.int64) + tensor_zp(self, x_t)).reshape(n, c, -1)
    else:
        src = x.to(torch.float32).reshape(n, c, -1)
    src = torch.where(valid, src, torch.zeros_like(src))
    out = torch.zeros(n, c, math.prod(image), dtype=src.dtype, device=src.device)
    out.scatter_add_(2, idx.expand(n, c, -1), src)  # contributions in (tap, block) order, as upstream sums them
    out = out.reshape(n, c, *image)
    if self.quantized:
        o = self.outputs[0]
        qmin, qmax = out_range(self, o)
        out = requantize_int(out, int(self.get_param("scale_value")), int(self.get_param("shift_value")),
                             tensor_zp(self, o), qmin, qmax)
    self.outputs[0].betensor = out


@COL2IM.quantize
def col2im_quantize(self: PyNode) -> None:
    """Output calibrated, signed like the input; (M, N) = scale_shift(s_out / s_in, activation bits) as upstream;
    the shape inputs must be integer tensors."""
    x_t = self.inputs[0]
    check_quantized_inputs(self, self.inputs[:3])
    for i, what in ((1, "image shape"), (2, "block shape")):
        if not params(self, self.inputs[i]).qinvariant:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): the {what} input must be an integer tensor "
                                   "(scale 1)")
    bits = int(layer_settings(self).q_bits_activation)
    out = self.outputs[0]
    x_qmin = params(self, x_t).qmin
    quantize_activation(self, out, x_qmin is not None and int(x_qmin) < 0, bits)
    ratio = tensor_scale(self, out) / tensor_scale(self, x_t)
    m, shift, m_type, shift_type = requant_scale_shift(self, ratio, mult_bits=bits)
    self.params["shift_value"] = int(shift)
    self.params["shift_type"] = shift_type
    self.params["scale_value"] = int(m)
    self.params["scale_type"] = m_type
