"""Colour conversion between packed RGB images and planar I420 YUV: RgbToYuv and YuvToRgb.

Both apply a 3x3 matrix with input and output offsets (the `coefficient` param: 3 input offsets, 3 output offsets, 9
matrix entries row by row) to pixel values. The float forward is the real-valued conversion; quantized, the matrix
becomes integers with a fixed shift (10 bits for RgbToYuv, 8 for YuvToRgb, as upstream), the pixels must be integer
tensors (scale 1) and every step is exact integer arithmetic with one rounding (half up, the `+ 2^(S-1) >> S` of the
hardware). The semantics, and where upstream's forward differs, are in docs/semantics/colorspace.md.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..quant.dtype import Dtype
from ..quant.params import integer_range
from ..quant.rounding import div_round_half_even
from ..registry import declare_op
from ..registry.schema import Floats, Int, Param, Text, Value
from ._quant import check_quantized_inputs, layer_settings, out_range, quant_of, tensor_zp
from ._shared import int_param

SEMANTICS = "docs/semantics/colorspace.md"

RGB_TO_YUV_SHIFT = 10
"""Fraction bits of RgbToYuv's integer matrix (upstream's fixed choice)."""

YUV_TO_RGB_SHIFT = 8
"""Fraction bits of YuvToRgb's integer matrix (upstream's fixed choice)."""

COEFFICIENT_DTYPE = Dtype.INT16
"""Written as the quantized layer's `coefficient_dtype`."""


def _params(extra: str) -> dict:
    return {
        "coefficient": Param(Floats(), "15 numbers: input offsets (3), output offsets (3), the 3x3 matrix row by row; "
                                       "quantized: the matrix entries are integers scaled by 2^coefficient_shift",
                             required=True),
        "coefficient_shift": Param(Int(lo=0, hi=30), "the matrix is coefficient[6:] / 2^coefficient_shift (float "
                                                     "IRs: 0)", default=0),
        "coefficient_dtype": Param(Value("dtype name"), "float32 in float IRs, int16 quantized (not read)"),
        "format": Param(Text(choices=("I420",)), "the YUV layout: I420 (planar Y, then U and V at half resolution)",
                        default="I420"),
        "conversion": Param(Text(), "BT709, BT601 or SELF: where the coefficients came from (not read)"),
        "bits": Param(Int(lo=1, hi=16), f"bits of the {extra} values: outputs are clamped to [0, 2^bits - 1]",
                      default=8),
        "scale": Param(Value(), "written by some Parser versions; not read"),
    }


def _coefficients(node: PyNode) -> Tuple[List[float], List[float], List[List[float]], int]:
    coe = node.get_param("coefficient")
    if not isinstance(coe, (list, tuple)) or len(coe) != 15 or \
            not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coe):
        raise node._error(f"coefficient must hold 15 numbers (3 input offsets, 3 output offsets, a 3x3 matrix), "
                          f"got {coe!r}")
    shift = int_param(node, "coefficient_shift", 0, minimum=0)
    coe = [float(c) for c in coe]
    return coe[0:3], coe[3:6], [coe[6:9], coe[9:12], coe[12:15]], shift


def _check_format(node: PyNode) -> int:
    fmt = str(node.get_param("format", optional=True, default_value="I420")).upper()
    if fmt != "I420":
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): YUV format {fmt} is not supported (I420 is)")
    return int_param(node, "bits", 8)


def _integers(node: PyNode, values: List[float], what: str) -> List[int]:
    if any(v != round(v) for v in values):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the {what} {values} must be integers to be "
                               "quantized")
    return [int(v) for v in values]


def _float_matrix(matrix: List[List[float]], shift: int, device: Optional[torch.device] = None) -> torch.Tensor:
    return torch.tensor(matrix, dtype=torch.float64, device=device) / float(2 ** shift)


def _quantize(node: PyNode, shift_bits: int) -> None:
    """Integer matrix round_half_even(c * 2^S / 2^shift) (S fixed per type), offsets kept (they must be integers),
    the input an integer tensor; the output integers of `bits` bits, scale 1 (force_dtype_int: int8 with zero point
    2^(bits-1), so the values keep their meaning)."""
    inp, out = node.inputs[0], node.outputs[0]
    check_quantized_inputs(node, [inp])
    table = quant_of(node)
    qi = table.get(inp)
    if not qi.qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{inp.name}' must be an integer pixel "
                               f"tensor (scale 1, zero point 0), not a quantized float tensor (scale {qi.scale}); "
                               "Cast the pixels to an integer type first")
    bits = _check_format(node)
    in_off, out_off, matrix, shift = _coefficients(node)
    _integers(node, in_off, "input offsets")
    _integers(node, out_off, "output offsets")
    qm = torch.round(_float_matrix(matrix, shift) * 2 ** shift_bits).to(torch.int64).reshape(-1).tolist()
    node.params["coefficient"] = [*in_off, *out_off, *[int(v) for v in qm]]
    node.params["coefficient_shift"] = shift_bits
    node.params["coefficient_dtype"] = COEFFICIENT_DTYPE
    signed = bool(layer_settings(node).force_dtype_int)
    qo = table.of(out)
    qo.qbits = bits
    qo.scale = 1.0
    out.dtype = Dtype.UINT8 if bits <= 8 else Dtype.UINT16
    qo.qmin, qo.qmax = integer_range(8 if bits <= 8 else 16, False)
    qo.zerop = 0
    qo.qinvariant = True
    if signed:
        out.dtype = Dtype.INT8 if bits <= 8 else Dtype.INT16
        qo.qmin, qo.qmax = integer_range(8 if bits <= 8 else 16, True)
        qo.zerop = -qo.qmin  # x = q + zp: q = pixel - 2^(bits-1)
        qo.qinvariant = False
    out.ir_range = None


def _finish(node: PyNode, values: torch.Tensor, bits: int) -> None:
    """Clamp to [0, 2^bits - 1]; quantized, subtract the output zero point."""
    out = node.outputs[0]
    top = 2 ** bits - 1
    if node.quantized:
        qmin, qmax = out_range(node, out)
        out.betensor = torch.clamp(torch.clamp(values, 0, top) - tensor_zp(node, out), qmin, qmax)
    else:
        out.betensor = torch.clamp(values, 0.0, float(top)).to(torch.float32)


def _half_up_shift(acc: torch.Tensor, shift: int) -> torch.Tensor:
    """floor((acc + 2^(shift-1)) / 2^shift): rounding half up (exact int64)."""
    return (acc + (1 << (shift - 1))) >> shift if shift > 0 else acc


# ------------------------------------------------------------------------------------------------ RgbToYuv
RGB_TO_YUV = declare_op(
    "RgbToYuv",
    params=_params("YUV"),
    dtypes="integer RGB pixels [n, h, w, 3] → uint8 I420 [n, h·w·3/2] (scale 1)",
    integer="exact integer matrix (10 fraction bits), rounding half up", semantics=f"{SEMANTICS}#rgbtoyuv",
    summary="Output: the Y plane, then U and V of the top-left pixel of each 2x2 block, flattened per image.")


@RGB_TO_YUV.forward
def rgbtoyuv_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    if x.dim() != 4 or x.shape[-1] != 3:
        raise self._error(f"input must be RGB images [n, h, w, 3], got shape {list(x.shape)}")
    n, h, w, _ = x.shape
    if h % 2 or w % 2:
        raise self._error(f"I420 needs an even height and width, got {h}x{w}")
    bits = _check_format(self)
    in_off, out_off, matrix, shift = _coefficients(self)
    if self.quantized:
        px = x.to(torch.int64) + tensor_zp(self, self.inputs[0])
        mat = torch.tensor(_integers(self, [v for row in matrix for v in row], "matrix"),
                           dtype=torch.int64, device=x.device).reshape(3, 3)
        d = px - torch.tensor(_integers(self, in_off, "input offsets"), dtype=torch.int64, device=x.device)
        acc = (d[..., None, :] * mat).sum(-1) + (torch.tensor(_integers(self, out_off, "output offsets"),
                                                              dtype=torch.int64, device=x.device) << shift)
        yuv = _half_up_shift(acc, shift)
    else:
        d = x.to(torch.float64) - torch.tensor(in_off, dtype=torch.float64, device=x.device)
        yuv = d @ _float_matrix(matrix, shift, x.device).T + torch.tensor(out_off, dtype=torch.float64,
                                                                          device=x.device)
    y = yuv[..., 0].reshape(n, -1)
    u = yuv[:, ::2, ::2, 1].reshape(n, -1)
    v = yuv[:, ::2, ::2, 2].reshape(n, -1)
    _finish(self, torch.cat([y, u, v], dim=1), bits)


@RGB_TO_YUV.quantize
def rgbtoyuv_quantize(self: PyNode) -> None:
    _quantize(self, RGB_TO_YUV_SHIFT)


# ------------------------------------------------------------------------------------------------ YuvToRgb
YUV_TO_RGB = declare_op(
    "YuvToRgb",
    params=_params("RGB"),
    dtypes="integer I420 [n, h·w·3/2] → uint8 RGB [n, h, w, 3] (scale 1); h, w from the output shape of the IR",
    integer="exact chroma upsampling (round half to even) and integer matrix (8 fraction bits), rounding half up",
    semantics=f"{SEMANTICS}#yuvtorgb")


def _upsample(c: torch.Tensor, h: int, w: int, exact: bool) -> torch.Tensor:
    """[n, h/2, w/2] chroma -> [n, h, w]: nearest, then odd rows 1..h-2 the mean of their neighbour rows, then columns
    1..w-2 (from the row result) 3/4 of the nearer and 1/4 of the farther neighbour column; integers round half to
    even, floats are kept unrounded."""
    up = c.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    rows = up.clone()
    odd = torch.arange(1, h - 1, 2, device=c.device)
    if exact:
        rows[:, odd] = div_round_half_even(up[:, odd - 1] + up[:, odd + 1], 2)
    else:
        rows[:, odd] = (up[:, odd - 1] + up[:, odd + 1]) / 2
    out = rows.clone()
    cols = torch.arange(1, w - 1, device=c.device)
    near_left = (cols % 2 == 1)[None, None, :]
    left, right = rows[:, :, cols - 1], rows[:, :, cols + 1]
    num = torch.where(near_left, 3 * left + right, left + 3 * right)
    out[:, :, cols] = div_round_half_even(num, 4) if exact else num / 4
    return out


@YUV_TO_RGB.forward
def yuvtorgb_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    shape = self.outputs[0].ir_shape
    if shape is None or len(shape) != 4 or int(shape[-1]) != 3:
        raise self._error(f"the output shape of the IR must be [n, h, w, 3], got {shape}")
    h, w = int(shape[1]), int(shape[2])
    if h % 2 or w % 2:
        raise self._error(f"I420 needs an even height and width, got {h}x{w}")
    if x.dim() != 2 or x.shape[1] != h * w * 3 // 2:
        raise self._error(f"input must be I420 data [n, {h * w * 3 // 2}] for {h}x{w} images, got shape "
                          f"{list(x.shape)}")
    n = x.shape[0]
    bits = _check_format(self)
    in_off, out_off, matrix, shift = _coefficients(self)
    q = self.quantized
    v = x.to(torch.int64) + tensor_zp(self, self.inputs[0]) if q else x.to(torch.float64)
    plane = h * w // 4
    yy = v[:, :h * w].reshape(n, h, w)
    uu = _upsample(v[:, h * w:h * w + plane].reshape(n, h // 2, w // 2), h, w, q)
    vv = _upsample(v[:, h * w + plane:].reshape(n, h // 2, w // 2), h, w, q)
    yuv = torch.stack([yy, uu, vv], dim=-1)
    if q:
        mat = torch.tensor(_integers(self, [c for row in matrix for c in row], "matrix"),
                           dtype=torch.int64, device=x.device).reshape(3, 3)
        d = yuv - torch.tensor(_integers(self, in_off, "input offsets"), dtype=torch.int64, device=x.device)
        rgb = _half_up_shift((d[..., None, :] * mat).sum(-1), shift) + \
            torch.tensor(_integers(self, out_off, "output offsets"), dtype=torch.int64, device=x.device)
    else:
        d = yuv - torch.tensor(in_off, dtype=torch.float64, device=x.device)
        rgb = d @ _float_matrix(matrix, shift, x.device).T + torch.tensor(out_off, dtype=torch.float64,
                                                                          device=x.device)
    _finish(self, rgb, bits)


@YUV_TO_RGB.quantize
def yuvtorgb_quantize(self: PyNode) -> None:
    _quantize(self, YUV_TO_RGB_SHIFT)
