"""2-D convolution kernels on NHWC tensors, in the tensor's own dtype, without layout permutes.

The float forward accumulates convolutions in float64 (docs/architecture.md, "Float reference"), where torch's own
convolution is slow (no vectorised float64 kernel, and a channels-last view is permuted to NCHW first). These kernels
keep the data channels-last and contiguous:

- a depthwise convolution (one input channel per group) is a sum over the kernel taps of a shifted, strided view
  of the padded input times that tap's per-channel weights (`addcmul_`, vectorised over channels);
- any other convolution is one GEMM per group over the unfolded input (im2col on NHWC: patches
  [N·Ho·Wo, kh·kw·Cg] against weights [out_g, kh·kw·Cg]), a 1×1 unit-stride one needing no unfolding at all.

Products of float32 operands are exact in float64, so the float64 result differs from another summation order only
in its last bits, which decide a float32 rounding only at near-ties (the golden conformance test and
benchmarks/golden_ranges.py check the calibrated ranges). The integer forward calls the same kernels on exact
integers held in float32 or float64 (bounded below 2^24 or 2^53), where the order does not matter at all.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from ._int8_gemm import int8_gemm

MAX_PATCH_ELEMENTS = 1 << 19
"""Unfolded-input elements held at once (4 MiB of float64); larger inputs are convolved in bands of output rows. A
band small enough to stay in cache between its unfolding and the GEMM that reads it makes the large 3x3
convolutions of PP-OCRv4 det 3-4x faster than 128 MiB bands did; each output row is the same GEMM row either way."""

DEPTHWISE_BAND_ELEMENTS = 1 << 16
"""Output elements of a depthwise convolution accumulated at once on a CPU (512 KiB of float64): the band and the
input rows it reads stay in the second-level cache over all the kernel taps (2^17 let the 5x5 layers of 240-480
channels spill it: 15-20% slower, docs/performance.md); on a GPU the output is one band (fewer launches). Each
element still sums its taps in the same order, so the bands change no bit."""


PLAIN_BAND_ELEMENTS = 1 << 17
"""A 1x1 unit-stride convolution of a float32 input computed in float64 (a plain GEMM) whose input or output holds
more elements than this is done in bands of rows: each band converted to float64 into a reused buffer, multiplied
into its rows of the output, its bias added while the band is in cache. Converting and adding on the whole tensors
wrote and read a float64 copy of the input and the output once more; on PP-OCR det's large maps that was about a
third of such a layer's time."""

PLAIN_BAND_ROWS = 256
"""Band heights are multiples of this: bands then give every row the bits of one GEMM over all rows (checked on
the shapes of the PP-OCR models and odd map sizes, tests/ops/test_conv_bands.py)."""


SMALL_PAD_ELEMENTS = 1 << 15
"""Below this many input elements a padded copy is filled whole, then the interior copied (fewer calls, the per-call
cost dominating); larger inputs have only their border filled, each element being written once."""


@contextlib.contextmanager
def native_conv(device: torch.device) -> Iterator[None]:
    """Within the block, torch convolutions on a CUDA `device` run torch's own kernels (im2col or vol2col and a
    GEMM, col2im for the transposed ones, direct loops for depthwise ones) instead of cuDNN's, and the previous
    setting comes back afterwards; nothing changes on the CPU. Why: an integer forward that convolves exact integers
    in float64 relies on every partial sum being an exact integer, which holds for any summation order but not for
    cuDNN's FFT and Winograd algorithms (rounded transforms), which cuDNN may pick even with deterministic
    algorithms requested. The switch is torch's process-wide flag: CUDA work of other threads during the block
    runs without cuDNN too (slower, not wrong)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = saved


def pad_nhwc(x: torch.Tensor, pads: Tuple[int, int, int, int], value: float,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x [N, H, W, C] as `dtype`, padded by (left, right, top, bottom) with `value`: one pass over the data (the
    interior is copied and converted at once, only the border is filled)."""
    dtype = dtype or x.dtype
    if not any(pads):
        return x.to(dtype).contiguous()
    left, right, top, bottom = pads
    n, h, w, c = (int(s) for s in x.shape)
    if x.numel() < SMALL_PAD_ELEMENTS:  # two calls instead of a dozen slice-and-fill ones; the same values
        out = torch.full((n, h + top + bottom, w + left + right, c), value, dtype=dtype, device=x.device)
        out[:, top:top + h, left:left + w].copy_(x)
        return out
    out = torch.empty(n, h + top + bottom, w + left + right, c, dtype=dtype, device=x.device)
    out[:, top:top + h, left:left + w].copy_(x)
    for rows in (slice(0, top), slice(top + h, None)):
        out[:, rows].fill_(value)
    for cols in (slice(0, left), slice(left + w, None)):
        out[:, top:top + h, cols].fill_(value)
    return out


def output_size(size: int, kernel: int, stride: int, dilation: int) -> int:
    """Output length of a padding-free convolution along one axis."""
    return (size - (kernel - 1) * dilation - 1) // stride + 1


def is_depthwise(in_c: int, cin_per_group: int, group: int) -> bool:
    """Whether a convolution takes the per-tap depthwise kernel (one input channel per group) rather than a GEMM."""
    return cin_per_group == 1 and group == in_c and group > 1


def depthwise_taps(w: torch.Tensor) -> List[List[torch.Tensor]]:
    """w [C·m, kh, kw, 1] as kh rows of kw contiguous per-tap weight vectors [C·m] (views of one [kh, kw, C·m]
    tensor): what `_depthwise` multiplies each shifted view by. A caller may build them once per weight tensor."""
    taps = w[..., 0].permute(1, 2, 0).contiguous()
    return [list(row.unbind(0)) for row in taps.unbind(0)]


def _depthwise(xp: torch.Tensor, w: torch.Tensor, stride: Tuple[int, int], dilation: Tuple[int, int],
               out_hw: Tuple[int, int], taps: Optional[List[List[torch.Tensor]]] = None,
               bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, bool]:
    """xp [N, Hp, Wp, C] (padded), w [C·m, kh, kw, 1] (m output channels per input channel) -> ([N, Ho, Wo, C·m],
    whether `bias` was added); `taps`: `depthwise_taps(w)` when the caller has them already. A banded result gets
    `bias` ([C·m], xp's dtype) added band by band after its last tap, while the band is in cache: the same
    additions as one after the whole convolution."""
    out_c = int(w.shape[0])
    multiplier = out_c // int(xp.shape[3])
    if multiplier > 1:  # output channel o reads input channel o // m
        xp = xp.repeat_interleave(multiplier, dim=3)
    if taps is None:
        taps = depthwise_taps(w)
    ho, wo = out_hw
    n = int(xp.shape[0])
    band = max(1, DEPTHWISE_BAND_ELEMENTS // max(1, n * wo * out_c))
    # bands serve a CPU's caches; on a GPU each band's taps are kernel launches, so the output is one band there
    if band >= ho or xp.device.type != "cpu" or (torch.is_grad_enabled() and (xp.requires_grad
                                                                              or taps[0][0].requires_grad)):
        return _depthwise_rows(xp, taps, stride, dilation, (0, ho), wo), False
    with_bias = bias is not None and not _needs_grad(bias) and bias.dtype == xp.dtype and bias.device == xp.device
    out = torch.empty(n, ho, wo, out_c, dtype=xp.dtype, device=xp.device)
    for r0 in range(0, ho, band):
        r1 = min(ho, r0 + band)
        rows = _depthwise_rows(xp, taps, stride, dilation, (r0, r1), wo, out[:, r0:r1])
        if with_bias:
            rows.add_(bias)
    return out, with_bias


def _depthwise_rows(xp: torch.Tensor, taps: List[List[torch.Tensor]], stride: Tuple[int, int],
                    dilation: Tuple[int, int], rows: Tuple[int, int], wo: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Output rows [r0, r1) of `_depthwise`: the first tap's product, then the others added in (ky, kx) order;
    into `out` when given (no autograd), else into a new contiguous tensor (differentiable, for gradient-based
    methods)."""
    (sy, sx), (dy, dx), (r0, r1) = stride, dilation, rows
    y_end, x_end = sy * (r1 - r0 - 1) + 1, sx * (wo - 1) + 1
    for ky, row in enumerate(taps):
        y0 = ky * dy + r0 * sy
        band = xp[:, y0:y0 + y_end:sy]
        for kx, tap in enumerate(row):
            x0 = kx * dx
            view = band[:, :, x0:x0 + x_end:sx]
            if out is None:
                out = view * tap
            elif ky == 0 and kx == 0:
                torch.mul(view, tap, out=out)
            else:
                out.addcmul_(view, tap)
    return out


def _patches(xp: torch.Tensor, kernel: Tuple[int, int], stride: Tuple[int, int], dilation: Tuple[int, int],
             out_hw: Tuple[int, int]) -> torch.Tensor:
    """Strided view [N, Ho, Wo, kh, kw, C] of the padded input: the im2col patches, not yet copied."""
    n, _, _, c = (int(s) for s in xp.shape)
    s_n, s_h, s_w, s_c = xp.stride()
    (kh, kw), (sy, sx), (dy, dx), (ho, wo) = kernel, stride, dilation, out_hw
    return xp.as_strided((n, ho, wo, kh, kw, c), (s_n, s_h * sy, s_w * sx, s_h * dy, s_w * dx, s_c))


def _gemm_conv(xp: torch.Tensor, w: torch.Tensor, group: int, stride: Tuple[int, int], dilation: Tuple[int, int],
               out_hw: Tuple[int, int]) -> torch.Tensor:
    """Grouped convolution as one GEMM per group over the unfolded input; banded over output rows when the
    unfolded input would be large."""
    out_c, kh, kw, cin_g = (int(s) for s in w.shape)
    n, c = int(xp.shape[0]), int(xp.shape[3])
    ho, wo = out_hw
    out_g = out_c // group
    # [G, out_g, kh·kw·Cg]: the weights in the patches' (ky, kx, c) order, transposed for the GEMM
    wg = w.reshape(group, out_g, kh, kw, cin_g).reshape(group, out_g, kh * kw * cin_g).transpose(1, 2)
    if kh == kw == 1 and stride == (1, 1) and group == 1:  # a 1x1 unit-stride conv is a plain GEMM
        return torch.matmul(xp.reshape(n * ho * wo, c), wg[0]).reshape(n, ho, wo, out_c)
    rows = max(1, MAX_PATCH_ELEMENTS // max(1, n * wo * kh * kw * c))
    # one sample in several bands of a plain GEMM: each band's product goes straight into its rows of the output
    into = (torch.empty(ho * wo, out_c, dtype=w.dtype, device=xp.device)
            if n == 1 and group == 1 and rows < ho and not _needs_grad(xp, w) else None)
    bands = []
    for r0 in range(0, ho, rows):
        r1 = min(ho, r0 + rows)
        sy = stride[0]
        band = xp[:, r0 * sy:(r1 - 1) * sy + (kh - 1) * dilation[0] + 1]
        patches = _patches(band, (kh, kw), stride, dilation, (r1 - r0, wo))
        m = n * (r1 - r0) * wo
        if patches.dtype != w.dtype:  # unfolded and converted in one copy
            patches = torch.empty(patches.shape, dtype=w.dtype, device=w.device).copy_(patches)
        if into is not None:
            torch.matmul(patches.reshape(m, kh * kw * c), wg[0], out=into[r0 * wo:r1 * wo])
            continue
        if group == 1:
            y = torch.matmul(patches.reshape(m, kh * kw * c), wg[0])
        else:  # [G, M, kh·kw·Cg] @ [G, kh·kw·Cg, out_g] -> [G, M, out_g] -> [M, G·out_g]
            p = patches.reshape(m, kh * kw, group, cin_g).permute(2, 0, 1, 3).reshape(group, m, kh * kw * cin_g)
            y = torch.bmm(p, wg).permute(1, 0, 2).reshape(m, out_c)
        bands.append(y.reshape(n, r1 - r0, wo, out_c))
    if into is not None:
        return into.reshape(n, ho, wo, out_c)
    return bands[0] if len(bands) == 1 else torch.cat(bands, dim=1)


def _plain_gemm_bands(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The 1x1 unit-stride convolution of x [N, H, W, C] (float32) with w [out_c, 1, 1, C] (float64) plus `bias`,
    in float64 bands of rows (PLAIN_BAND_ELEMENTS); None when banding does not apply (a small layer, a CUDA
    device, a differentiable forward), for the caller's whole-tensor GEMM."""
    n, h, wd, c = (int(s) for s in x.shape)
    out_c = int(w.shape[0])
    m = n * h * wd
    widest = max(c, out_c)
    if (m * widest <= PLAIN_BAND_ELEMENTS or x.device.type != "cpu" or x.dtype != torch.float32
            or w.dtype != torch.float64 or w.device != x.device or _needs_grad(x, w)
            or (bias is not None and (_needs_grad(bias) or bias.device != x.device))):
        return None
    if bias is not None:
        bias = bias.to(torch.float64)
    rows = max(PLAIN_BAND_ROWS, PLAIN_BAND_ELEMENTS // widest // PLAIN_BAND_ROWS * PLAIN_BAND_ROWS)
    x2 = x.contiguous().reshape(m, c)
    wk = w.reshape(out_c, c).t()  # the same [C, out_c] view the whole-tensor GEMM multiplies by
    out = torch.empty(m, out_c, dtype=torch.float64)
    buf = torch.empty(min(rows, m), c, dtype=torch.float64)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        band = out[r0:r1]
        torch.matmul(buf[:r1 - r0].copy_(x2[r0:r1]), wk, out=band)
        if bias is not None:
            band.add_(bias)
    return out.reshape(n, h, wd, out_c)


INT8_PATCH_ELEMENTS = 1 << 21
"""Unfolded int8 input elements held at once (2 MiB) by `conv2d_nhwc_int8`; larger inputs go in bands of rows."""


def conv2d_nhwc_int8(x: torch.Tensor, w: torch.Tensor, stride: Tuple[int, int], dilation: Tuple[int, int],
                     pads: Tuple[int, int, int, int], pad_value: int, group: int = 1) -> torch.Tensor:
    """Exact integer convolution of int8 x [N, H, W, C], padded with the int8 `pad_value`, by int8 OHWI weights
    [out_c, kh, kw, C/group]: [N, Ho, Wo, out_c] int32, as int8 GEMMs over the unfolded input (bands of rows when
    it is large), one group after another. The caller checks kh·kw·C/group <= INT8_MAX_TERMS, that the operands
    are CPU int8 tensors and that `int8_gemm_exact()`."""
    if group > 1:
        out_g, cin_g = int(w.shape[0]) // group, int(w.shape[3])
        parts = [conv2d_nhwc_int8(x[..., g * cin_g:(g + 1) * cin_g], w[g * out_g:(g + 1) * out_g], stride,
                                  dilation, pads, pad_value) for g in range(group)]
        return torch.cat(parts, dim=3)
    out_c, kh, kw, c = (int(s) for s in w.shape)
    xp = pad_nhwc(x, pads, pad_value) if any(pads) else x.contiguous()
    n = int(xp.shape[0])
    ho = output_size(int(xp.shape[1]), kh, stride[0], dilation[0])
    wo = output_size(int(xp.shape[2]), kw, stride[1], dilation[1])
    wk = w.reshape(out_c, kh * kw * c).t()  # [K, out_c], a view: the GEMM reads it transposed
    if kh == kw == 1 and stride == (1, 1):
        return int8_gemm(xp.reshape(n * ho * wo, c), wk).reshape(n, ho, wo, out_c)
    out = torch.empty(n, ho, wo, out_c, dtype=torch.int32, device=x.device)
    rows = max(1, INT8_PATCH_ELEMENTS // max(1, n * wo * kh * kw * c))
    for r0 in range(0, ho, rows):
        r1 = min(ho, r0 + rows)
        band = xp[:, r0 * stride[0]:(r1 - 1) * stride[0] + (kh - 1) * dilation[0] + 1]
        patches = _patches(band, (kh, kw), stride, dilation, (r1 - r0, wo)).contiguous()
        y = int8_gemm(patches.reshape(n * (r1 - r0) * wo, kh * kw * c), wk)
        out[:, r0:r1] = y.reshape(n, r1 - r0, wo, out_c)
    return out


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """A gradient-based method's forward: results must then be new tensors, never written in place."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _same_dtype(taps: Optional[List[List[torch.Tensor]]], xp: torch.Tensor) -> bool:
    return bool(taps) and taps[0][0].dtype == xp.dtype and taps[0][0].device == xp.device


def conv2d_nhwc(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], stride: Tuple[int, int],
                dilation: Tuple[int, int], pads: Tuple[int, int, int, int], group: int,
                pad_value: float = 0.0, dtype: Optional[torch.dtype] = None,
                taps: Optional[List[List[torch.Tensor]]] = None) -> torch.Tensor:
    """Convolution of x [N, H, W, C] with OHWI weights [out_c, kh, kw, C/group] in `dtype` (default x's), plus
    `bias` [out_c] added last; pads are (left, right, top, bottom) filled with `pad_value`. Shapes are checked by
    the caller. `taps`: a depthwise convolution's `depthwise_taps(w)` in `dtype`, when the caller keeps them."""
    dtype = dtype or x.dtype
    out_c, kh, kw, cin_g = (int(s) for s in w.shape)
    depthwise = is_depthwise(int(x.shape[3]), cin_g, group)
    plain_gemm = kh == kw == 1 and stride == (1, 1) and group == 1
    if plain_gemm and not any(pads) and dtype == torch.float64:
        banded = _plain_gemm_bands(x, w, bias)
        if banded is not None:
            return banded
    # a float32 input unfolded for a float64 GEMM is converted while it is unfolded: its padded copy stays float32
    # (half the bytes to write and to read kh·kw times); the values are the same, float32 being exact in float64
    narrow = (not depthwise and not plain_gemm and x.dtype == torch.float32 and dtype == torch.float64
              and float(np.float32(pad_value)) == pad_value)
    xp = pad_nhwc(x, pads, pad_value, x.dtype if narrow else dtype)
    out_hw = (output_size(int(xp.shape[1]), kh, stride[0], dilation[0]),
              output_size(int(xp.shape[2]), kw, stride[1], dilation[1]))
    if w.dtype != dtype or w.device != xp.device:
        w = w.to(dtype=dtype, device=xp.device)
    if depthwise:
        b = None if bias is None else bias.to(dtype=xp.dtype, device=xp.device)
        y, biased = _depthwise(xp, w, stride, dilation, out_hw, taps if _same_dtype(taps, xp) else None, b)
        if biased:
            return y
    else:
        y = _gemm_conv(xp, w, group, stride, dilation, out_hw)
    if bias is not None:
        b = bias if bias.dtype == y.dtype and bias.device == y.device else bias.to(dtype=y.dtype, device=y.device)
        y = y + b if _needs_grad(y, b) else y.add_(b)  # y is a new tensor of this module's own
    return y
