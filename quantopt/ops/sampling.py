"""Index-driven resampling, sampling grids and frame reassembly: UpsampleByIndex (max-unpooling with stored argmax
positions), AffineGrid (the sampling grid of an affine transform), FractionalPool (pooling over seeded pseudo-random
windows) and OverlapAdd (signal frames summed back with a hop).

UpsampleByIndex moves values exactly (passthrough); OverlapAdd sums integers `q + zp` exactly and requantizes them
once with an integer multiplier and shift; AffineGrid multiplies the integer transform by fixed-point grid tables
and requantizes. The integer semantics are in docs/semantics/sampling.md.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of, statistics_of
from ..quant.dtype import Dtype
from ..quant.int_matmul import exact_int_matmul
from ..quant.params import integer_range
from ..quant.requant import requantize_int, scale_shift
from ..quant.rounding import round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Int, Param, Text, quantized
from ._quant import (
    copy_params,
    int_value,
    integer_output_bits,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_constant,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
    zero_code,
)
from ._shared import bool_param

SEMANTICS = "docs/semantics/sampling.md"

FLATTEN_DIMS = ("HW", "HWC", "NHWC", "NCHW")


# ------------------------------------------------------------------------------------------------ UpsampleByIndex
UPSAMPLE_BY_INDEX = declare_op(
    "UpsampleByIndex",
    params={"flatten_dim": Param(Text(choices=FLATTEN_DIMS), "how the argmax positions are flattened",
                                 required=True),
            "storage_order": Param(Int(), "not read (no framework uses it)")},
    dtypes="values: passthrough; argmax: integer",
    integer="passthrough; positions without a value get -zp", semantics=f"{SEMANTICS}#upsamplebyindex",
    summary="Inputs: values [N, H, W, C], argmax positions [N, H, W, C]; output [N, H', W', C] (the IR's): each "
            "value written at its position, 0 elsewhere.")


def _upsample_offsets(mode: str, shape: Tuple[int, ...], top: Tuple[int, int, int],
                      device: torch.device) -> torch.Tensor:
    """What each flattening adds to an argmax entry (per position of the values in their scan order), on
    `device` (the argmax's)."""
    n, h, w, c = shape
    th, tw, tc = top
    if mode == "HW":  # per (batch, channel) plane of the NCHW output
        b = torch.arange(n, device=device).reshape(n, 1, 1, 1) * (th * tw * tc)
        ch = torch.arange(c, device=device).reshape(1, c, 1, 1) * (th * tw)
        return (b + ch).expand(n, c, h, w)
    if mode == "HWC":  # per batch of the NHWC output
        return (torch.arange(n, device=device).reshape(n, 1, 1, 1) * (th * tw * tc)).expand(n, h, w, c)
    return torch.zeros((), dtype=torch.int64, device=device)


@UPSAMPLE_BY_INDEX.forward
def upsample_by_index_forward(self: PyNode) -> None:
    """Flat position of each value by `flatten_dim` (docs); positions outside [0, size of the output) are
    dropped; a position hit twice keeps the value later in scan order (NHWC order, NCHW order for HW and NCHW)."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (values, argmax), got {len(self.inputs)}")
    data, arg_t = self.inputs
    x = data.betensor
    if self.quantized and not params(self, arg_t).qinvariant:
        raise UnsupportedError(f"layer '{self.name}' (UpsampleByIndex): argmax input '{arg_t.name}' is a quantized "
                               "tensor; positions must be exact integers")
    if self.quantized:
        arg = int_value(arg_t)
    else:
        a = arg_t.betensor
        arg = (torch.trunc(a.to(torch.float64)) if a.is_floating_point() else a).to(torch.int64)
    if x.dim() != 4 or list(arg.shape) != list(x.shape):
        raise self._error(f"values {list(x.shape)} and argmax {list(arg.shape)} must both be [N, H, W, C]")
    top = [int(d) for d in self.outputs[0].ir_shape]
    if len(top) != 4 or top[3] != x.shape[3]:
        raise self._error(f"output IR shape {top} must be [N, H', W', C] with the {x.shape[3]} channels of the "
                          "values")
    mode = str(self.get_param("flatten_dim")).upper()
    if mode not in FLATTEN_DIMS:
        raise self._error(f"flatten_dim '{mode}' is not one of {', '.join(FLATTEN_DIMS)}")
    n = int(x.shape[0])
    th, tw, tc = top[1:]
    nchw = mode in ("HW", "NCHW")
    if nchw:
        x, arg = x.permute(0, 3, 1, 2), arg.permute(0, 3, 1, 2)
    pos = (arg + _upsample_offsets(mode, tuple(data.betensor.shape), (th, tw, tc), arg.device)).reshape(-1)
    vals = x.reshape(-1)
    size = n * th * tw * tc
    keep = (pos >= 0) & (pos < size)
    pos, vals = pos[keep], vals[keep]
    order = torch.arange(pos.numel(), dtype=torch.int64, device=pos.device)
    last = torch.full((size,), -1, dtype=torch.int64, device=pos.device).scatter_reduce(0, pos, order, "amax")
    win = last[pos] == order
    if self.quantized:
        fill = torch.tensor(zero_code(self, data), dtype=vals.dtype, device=vals.device)
    else:
        fill = torch.zeros((), dtype=vals.dtype, device=vals.device)
    flat = fill.expand(size).clone()
    flat[pos[win]] = vals[win]
    out = flat.reshape(n, tc, th, tw).permute(0, 2, 3, 1) if nchw else flat.reshape(n, th, tw, tc)
    self.outputs[0].betensor = out.contiguous()


@UPSAMPLE_BY_INDEX.quantize
def upsample_by_index_quantize(self: PyNode) -> None:
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (values, argmax), got {len(self.inputs)}")
    if not params(self, self.inputs[1]).qinvariant:
        raise UnsupportedError(f"layer '{self.name}' (UpsampleByIndex): argmax input '{self.inputs[1].name}' is a "
                               "quantized tensor; positions must be exact integers")
    copy_params(self, self.outputs[0], self.inputs[0])


# ------------------------------------------------------------------------------------------------ OverlapAdd
OVERLAP_ADD = declare_op(
    "OverlapAdd",
    params={"frame_step": Param(Int(lo=1), "the hop between frames (at most the frame length)", default=1)},
    dtypes="float32 → int8/uint8/int16/uint16 (signed like the input); integer input → integer output",
    integer="exact integer sums (q + zp), requantized with scale_value/shift_value",
    semantics=f"{SEMANTICS}#overlapadd",
    summary="Input [..., frames, frame_length]; output [..., (frames - 1) * frame_step + frame_length]: frame f "
            "added at offset f * frame_step.")


def _overlap_geometry(node: PyNode, shape: Tuple[int, ...]) -> Tuple[int, int, int, int]:
    if len(shape) < 2:
        raise node._error(f"input must be at least 2-D [..., frames, frame_length], got shape {list(shape)}")
    step = int(node.get_param("frame_step", optional=True, default_value=1))
    frames, length = int(shape[-2]), int(shape[-1])
    if step < 1 or step > length:
        raise node._error(f"frame_step {step} must be in [1, frame_length {length}]")
    return step, frames, length, (frames - 1) * step + length if frames else 0


@OVERLAP_ADD.forward
def overlap_add_forward(self: PyNode) -> None:
    """out[..., f * step + j] += in[..., f, j]; float32 sums in ascending j (the float reference's order).
    Quantized: the exact sums of q + zp_in, requantized (docs)."""
    inp = self.inputs[0]
    x = inp.betensor
    step, frames, length, size = _overlap_geometry(self, tuple(x.shape))
    if self.quantized:
        v = x.to(torch.int64) + tensor_zp(self, inp)
    else:
        v = x if x.is_floating_point() else x.to(torch.float32)
    acc = torch.zeros(list(x.shape[:-2]) + [size], dtype=v.dtype, device=x.device)
    span = (frames - 1) * step + 1 if frames else 0
    for j in range(length):
        acc[..., j:j + span:step] += v[..., :, j]
    if self.quantized:
        out = self.outputs[0]
        m, n = requant_of(self)
        qmin, qmax = out_range(self, out)
        acc = requantize_int(acc, m, n, tensor_zp(self, out), qmin, qmax)
    self.outputs[0].betensor = acc


@OVERLAP_ADD.quantize
def overlap_add_quantize(self: PyNode) -> None:
    """Integer input: integer output (scale 1, the smallest of 8/16/32 bits holding the calibrated extrema, signed
    iff they go below 0 or force_dtype_int), M = 1, N = 0. Otherwise the output from its calibrated range, signed
    like the input, and M/N ≈ s_out / s_in with activation-bits multipliers."""
    inp, out = self.inputs[0], self.outputs[0]
    _overlap_geometry(self, tuple(inp.ir_shape))
    s = layer_settings(self)
    bits = int(s.q_bits_activation)
    if params(self, inp).qinvariant:
        emin = statistics_of(self).get(out).extrema_min
        lo = emin if emin is not None else ranges_of(self).get(out).min
        signed = bool(lo is not None and float(lo) < 0) or bool(s.force_dtype_int)
        set_qinvariant(self, out, integer_output_bits(self, signed), signed)
        store_requant(self, 1, 0, *requant_scale_shift(self, 1.0, mult_bits=bits)[2:])
        return
    quantize_activation(self, out, is_signed(self, inp), bits=bits)
    store_requant(self, *requant_scale_shift(self, tensor_scale(self, out) / tensor_scale(self, inp), mult_bits=bits))


# ------------------------------------------------------------------------------------------------ AffineGrid
AFFINE_GRID = declare_op(
    "AffineGrid",
    params={"align_corners": Param(Bool(), "grid ends at the corner pixels' centres (else their outer edges)",
                                   required=True),
            "multiplier_bits": quantized(Int(lo=1), "fraction bits of the grid tables")},
    constants={"w_lut": "quantized: the x coordinates of the grid (int16, multiplier_bits fraction bits)",
               "h_lut": "quantized: the y coordinates", "d_lut": "quantized 3-D grids: the z coordinates"},
    dtypes="theta: float32 → int8/int16 (signed)",
    integer="integer theta times the int16 grid tables, requantized with scale_value/shift_value",
    semantics=f"{SEMANTICS}#affinegrid",
    summary="Inputs: theta [N, 2, 3] (or [N, 3, 4]), the size (not read: the output's IR shape gives it). Output "
            "[N, H, W, 2] (or [N, D, H, W, 3]): torch.nn.functional.affine_grid, channels last.")

AFFINE_GRID_MIN_BITS = 8
AFFINE_GRID_MAX_BITS = 14
"""The fraction bits of AffineGrid's tables: ceil(log2(largest spatial size)) + 1, within [8, 14] (as upstream)."""

AFFINE_GRID_ACC_BITS = 32
"""The AffineGrid accumulator is clamped to a signed 32-bit range before requantization (as upstream)."""


def _grid_dims(node: PyNode) -> Tuple[int, ...]:
    """The spatial sizes (H, W) or (D, H, W) from the output's IR shape [N, ..., 2 or 3]."""
    shape = [int(d) for d in node.outputs[0].ir_shape]
    if len(shape) not in (4, 5) or shape[-1] != len(shape) - 2:
        raise node._error(f"output IR shape {shape} must be [N, H, W, 2] or [N, D, H, W, 3]")
    return tuple(shape[1:-1])


def _grid_vector(length: int, align_corners: bool) -> torch.Tensor:
    """The normalized coordinates of `length` pixel centres, float32 as the float reference computes them."""
    v = torch.linspace(-1.0, 1.0, length)
    return v if align_corners else v * ((length - 1) / length)


@AFFINE_GRID.forward
def affine_grid_forward(self: PyNode) -> None:
    """Float: torch.nn.functional.affine_grid of theta for the output's spatial size. Quantized: the grid tables
    times the integer theta, requantized (docs)."""
    theta = self.inputs[0].betensor
    dims = _grid_dims(self)
    k = len(dims)
    if theta.dim() != 3 or list(theta.shape[1:]) != [k, k + 1]:
        raise self._error(f"theta must be [N, {k}, {k + 1}] for a {k}-D grid, got shape {list(theta.shape)}")
    n = int(theta.shape[0])
    if not self.quantized:
        size = torch.Size([n, 1, *dims])
        x = theta if theta.is_floating_point() else theta.to(torch.float32)
        out = F.affine_grid(x, size, align_corners=bool_param(self, "align_corners", False))
        self.outputs[0].betensor = out
        return
    inp, out_t = self.inputs[0], self.outputs[0]
    frac = int(self.get_param("multiplier_bits"))
    names = ("w_lut", "h_lut", "d_lut")[:k]
    luts = [self.get_constant(name).betensor.to(device=theta.device, dtype=torch.int64).reshape(-1) for name in names]
    for lut, size, name in zip(luts, reversed(dims), names):
        if lut.numel() != size:
            raise self._error(f"constant '{name}' has {lut.numel()} entries for a grid size of {size}")
    # base[c] at each output position: the c-th coordinate (x, y, z) of the grid, channels last
    mesh = torch.meshgrid(*[lut for lut in reversed(luts)], indexing="ij")  # (z,) y, x grids of shape dims
    base = torch.stack(list(reversed(mesh)), dim=-1).reshape(-1, k)  # [P, k]: (x, y[, z])
    t = int_value(inp) + tensor_zp(self, inp)  # [n, k, k + 1]
    # acc[b, p, i] = sum_j base[p, j] * t[b, i, j]: an exact integer product (CUDA has no int64 einsum/GEMM)
    acc = exact_int_matmul(base.unsqueeze(0), t[:, :, :k].transpose(1, 2)) + (t[:, :, k] << frac).unsqueeze(1)
    lo, hi = integer_range(AFFINE_GRID_ACC_BITS, True)
    acc = torch.clamp(acc, lo, hi)
    m, sh = requant_of(self)
    qmin, qmax = out_range(self, out_t)
    y = requantize_int(acc, m, sh, tensor_zp(self, out_t), qmin, qmax)
    self.outputs[0].betensor = y.reshape(n, *dims, k)



@AFFINE_GRID.quantize
def affine_grid_quantize(self: PyNode) -> None:
    """Output signed from its calibrated range; tables round(grid * 2^f) as int16 with f = clamp(ceil(log2(largest
    spatial size)) + 1, 8, 14); M/N ≈ s_out / (s_theta * 2^f) with activation-bits multipliers."""
    inp, out = self.inputs[0], self.outputs[0]
    dims = _grid_dims(self)
    quantize_activation(self, out, True)
    largest = max(dims)
    frac = max(AFFINE_GRID_MIN_BITS, min(AFFINE_GRID_MAX_BITS, int(math.ceil(math.log2(max(largest, 1)))) + 1))
    align = bool_param(self, "align_corners", False)
    lo, hi = integer_range(16, True)
    for name, size in zip(("w_lut", "h_lut", "d_lut"), reversed(dims)):
        lut = torch.clamp(torch.round(_grid_vector(size, align) * float(2 ** frac)), lo, hi)
        set_constant(self, name, lut.to(torch.int64), Dtype.INT16)
    bits = int(layer_settings(self).q_bits_activation)
    ratio = tensor_scale(self, out) / (tensor_scale(self, inp) * float(2 ** frac))
    store_requant(self, *requant_scale_shift(self, ratio, mult_bits=bits))
    self.params["multiplier_bits"] = frac


# ------------------------------------------------------------------------------------------------ FractionalPool
FRACTIONAL_POOL = declare_op(
    "FractionalPool",
    params={"method": Param(Text(choices=("MAX", "AVG")), "window maximum or average", required=True),
            "seed": Param(Int(lo=0), "seed of the window sequence (0: the fixed sequence of seed 0)", required=True),
            "pseudo": Param(Bool(), "pseudo-random window sequence (else a shuffled random one)", required=True),
            "overlap": Param(Bool(), "windows share their boundary row/column with the next", required=True)},
    dtypes="values: passthrough; sequences: int16/int32 (scale 1)",
    integer="MAX: integer maximum; AVG: window sum times an 8-bit multiplier of 1/area",
    semantics=f"{SEMANTICS}#fractionalpool",
    summary="Input [N, H, W, C]; outputs: the pooled [N, H', W', C] (the IR's H', W'), the row and column window "
            "boundaries [H' + 1], [W' + 1].")

FRACTIONAL_AVG_MULT_BITS = 8
"""FractionalPool AVG divides each window sum by its area with an 8-bit multiplier (as upstream)."""

_MT_N, _MT_M = 624, 397
_U32 = 0xFFFFFFFF


class _MT19937:
    """The 32-bit Mersenne Twister of Matsumoto and Nishimura, seeded as C++ `std::mt19937(seed)`: the window
    sequences of FractionalPool are those of the C++ standard library's generator and distributions."""

    def __init__(self, seed: int) -> None:
        mt = [seed & _U32]
        for i in range(1, _MT_N):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & _U32)
        self.mt, self.index = mt, _MT_N

    def __call__(self) -> int:
        mt = self.mt
        if self.index >= _MT_N:
            for i in range(_MT_N):
                y = (mt[i] & 0x80000000) | (mt[(i + 1) % _MT_N] & 0x7FFFFFFF)
                mt[i] = mt[(i + _MT_M) % _MT_N] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return (y ^ (y >> 18)) & _U32


def _uniform_real(g: _MT19937) -> float:
    """`std::uniform_real_distribution(0, 1)` of libstdc++: two 32-bit draws, (a + b * 2^32) / 2^64."""
    a = float(g())
    return (a + float(g()) * 4294967296.0) / 18446744073709551616.0


def _uniform_int(g: _MT19937, high: int) -> int:
    """`std::uniform_int_distribution(0, high)` of libstdc++ (down-scaling with rejection)."""
    scaling = int(_U32 / (high + 1))
    past = (high + 1) * scaling
    r = g()
    while r >= past:
        r = g()
    return int(r / scaling)


def _shuffle(values: list, g: _MT19937) -> list:
    """`std::shuffle` of libstdc++ (two positions per draw while the range allows it)."""
    out = list(values)
    n = len(out)
    if n < 2 or _U32 / n < n:
        return out
    i = 1
    if n % 2 == 0:
        j = _uniform_int(g, 1)
        out[i], out[j] = out[j], out[i]
        i += 1
    while i != n:
        span = i + 1
        x = _uniform_int(g, span * (span + 1) - 1)
        first, second = x // (span + 1), x % (span + 1)
        out[i], out[first] = out[first], out[i]
        i += 1
        out[i], out[second] = out[second], out[i]
        i += 1
    return out


def fractional_sequence(in_length: int, out_length: int, pseudo: bool, seed: int) -> List[int]:
    """The window boundaries 0 = b_0 < ... < b_out = in_length of one axis (docs: FractionalPool)."""
    g = _MT19937(seed)
    if pseudo:
        alpha = float(in_length) / out_length
        k = in_length // out_length
        max_u = min((k + 2) / alpha - 1, (in_length + 1 - k) / alpha - (out_length - 1))
        u = _uniform_real(g) * max_u
        inner = torch.ceil(torch.tensor([alpha * (i + u) for i in range(1, out_length)], dtype=torch.float32))
        cum = [1] + [int(v) for v in inner.tolist()] + [in_length + 1]
        steps = [cum[i + 1] - cum[i] for i in range(out_length)]
    else:
        k, extra = divmod(in_length, out_length)
        steps = _shuffle([k + 1] * extra + [k] * (out_length - extra), g)
    bounds = [0]
    for s in steps:
        bounds.append(bounds[-1] + s)
    return bounds


@FRACTIONAL_POOL.forward
def fractional_pool_forward(self: PyNode) -> None:
    """Window (i, j) covers rows [r_i, min(r_{i+1} + overlap, H)) and columns likewise; MAX or AVG over it.
    Quantized AVG: sum of the integers times M·2^-N ≈ 1/area (docs)."""
    inp = self.inputs[0]
    x = inp.betensor
    if x.dim() != 4:
        raise self._error(f"input must be [N, H, W, C], got shape {list(x.shape)}")
    if len(self.outputs[0].ir_shape) != 4:
        raise self._error(f"output 0 IR shape {list(self.outputs[0].ir_shape)} must be [N, H', W', C]")
    method = str(self.get_param("method")).upper()
    if method not in ("MAX", "AVG"):
        raise self._error(f"method '{method}' is not MAX or AVG")
    seed = int(self.get_param("seed"))
    pseudo, overlap = bool_param(self, "pseudo", False), bool_param(self, "overlap", False)
    h, w = int(x.shape[1]), int(x.shape[2])
    oh, ow = (int(d) for d in self.outputs[0].ir_shape[1:3])
    if not (0 < oh <= h and 0 < ow <= w):
        raise self._error(f"output size {oh}x{ow} must be within [1, {h}]x[1, {w}] (the input's)")
    rows = fractional_sequence(h, oh, pseudo, seed)
    cols = fractional_sequence(w, ow, pseudo, seed)
    extra = 1 if overlap else 0
    out = torch.empty(int(x.shape[0]), oh, ow, int(x.shape[3]), dtype=x.dtype if self.quantized else torch.float32,
                      device=x.device)
    if self.quantized and method == "AVG":
        qmin, qmax = out_range(self, self.outputs[0])
    for i in range(oh):
        r0, r1 = rows[i], min(rows[i + 1] + extra, h)
        for j in range(ow):
            c0, c1 = cols[j], min(cols[j + 1] + extra, w)
            win = x[:, r0:r1, c0:c1, :]
            if method == "MAX":
                out[:, i, j, :] = torch.amax(win, dim=(1, 2))
            elif self.quantized:
                area = (r1 - r0) * (c1 - c0)
                m, n, _, _ = scale_shift(1.0 / area, FRACTIONAL_AVG_MULT_BITS)
                # int64 throughout (window sum, product, round half to even by shift): the same integers on every
                # device, with no float kernel involved (requantize_int's float64 path builds M * 2^-N with torch.pow
                # on the device); a power-of-two area gives a power-of-two M and many exact ties (k + 0.5)
                acc = win.to(torch.int64).sum(dim=(1, 2))
                out[:, i, j, :] = torch.clamp(round_shift(acc * m, n), qmin, qmax)
            else:
                out[:, i, j, :] = win.to(torch.float32).sum(dim=(1, 2)) / float((r1 - r0) * (c1 - c0))
    self.outputs[0].betensor = out
    for t, seq in zip(self.outputs[1:3], (rows, cols)):
        t.betensor = torch.tensor(seq, dtype=torch.int64, device=x.device)


@FRACTIONAL_POOL.quantize
def fractional_pool_quantize(self: PyNode) -> None:
    """Output 0: passthrough. The boundary outputs: signed integers, 16 bits (32 when their IR length does not fit
    int16)."""
    copy_params(self, self.outputs[0], self.inputs[0])
    for out in self.outputs[1:]:
        n = int(out.ir_shape[0]) if out.ir_shape else 1
        set_qinvariant(self, out, 16 if n <= integer_range(16, True)[1] else 32, True)
