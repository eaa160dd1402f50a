"""Exact int64 helpers shared by the integer forwards of activations and Softmax (no float arithmetic).

`_quant.linear_requantize` works in float64 (exact below 2^53); these helpers stay in int64 so that the integer
semantics documented in docs/integer-semantics.md are what the code literally does.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple, Union

import torch

from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ._quant import int_value, out_range, tensor_zp

IntLike = Union[int, torch.Tensor]


def range_bits(node: PyNode, t: PyTensor) -> int:
    """Bits spanned by the integer range of a quantized tensor: bit length of qmax - qmin (8 for [-128, 127],
    [-127, 127] and [0, 255]). Read from the range the IR stores, so it survives a write/re-read."""
    qmin, qmax = out_range(node, t)
    return max(1, (qmax - qmin).bit_length())


def is_restricted(node: PyNode, t: PyTensor) -> bool:
    """Signed symmetric restricted range ([-(2^(b-1)-1), 2^(b-1)-1])."""
    qmin, qmax = out_range(node, t)
    return qmin < 0 and qmin == -qmax


CODE_TABLE_MAX_CODES = 1 << 16
"""An integer layer whose result for an input depends on that input's code alone (a Where or Concat branch's
requantization, a Div divisor's signed reciprocal) reads it from a memoized table of every code's result where the
input has at most this many codes (`take_codes`)."""


def take_codes(values: torch.Tensor, codes: torch.Tensor, lo: int, channels: int = 1) -> Optional[torch.Tensor]:
    """values[codes - lo]: integer codes looked up in a table of per-code results (codes lo, lo + 1, ...; with
    `channels` > 1, one table per channel of the last axis, interleaved: entry (code - lo) · channels + channel), or
    None where a code lies outside the table (a hand-fed input; the caller then computes). On the CPU index_select
    refuses such an index, so no pass over the codes' extrema comes first; another device checks the index range
    first (an index outside the table would assert there)."""
    if channels == 1 and codes.device.type == "cpu" and codes.numel() > 2 * TAKE_BAND_ELEMENTS and \
            codes.is_contiguous() and not codes.is_floating_point():
        return _take_in_bands(values, codes, lo)
    index = codes - lo
    if channels > 1:
        index = index.mul_(channels).add_(torch.arange(channels, dtype=index.dtype, device=index.device))
    index = index.reshape(-1)
    if codes.device.type == "cpu":
        try:
            return values.index_select(0, index).reshape(codes.shape)
        except IndexError:  # an index outside the table: the caller's arithmetic takes any code
            return None
    if bool(((index >= 0) & (index < values.numel())).all()):
        return values.index_select(0, index).reshape(codes.shape)
    return None


TAKE_BAND_ELEMENTS = 1 << 16
"""Codes `take_codes` looks up at once on a large CPU tensor, through one reused index buffer."""


def _take_in_bands(values: torch.Tensor, codes: torch.Tensor, lo: int) -> Optional[torch.Tensor]:
    """`take_codes` of one table, a band of codes at a time: the index of each band made in one reused buffer and
    gathered straight into the output, instead of a map-sized index tensor (a page-faulting allocation and a pass
    through memory on every forward); None where a code lies outside the table, as `take_codes`."""
    flat = codes.reshape(-1)
    n = int(flat.numel())
    out = torch.empty(n, dtype=values.dtype)
    index = torch.empty(TAKE_BAND_ELEMENTS, dtype=torch.int64)
    for s0 in range(0, n, TAKE_BAND_ELEMENTS):
        s1 = min(n, s0 + TAKE_BAND_ELEMENTS)
        band = torch.sub(flat[s0:s1], lo, out=index[:s1 - s0])
        try:
            torch.index_select(values, 0, band, out=out[s0:s1])
        except IndexError:  # a code outside the table: the caller's arithmetic takes any code
            return None
    return out.reshape(codes.shape)


def ceil_log2(v: int) -> int:
    """ceil(log2(v)) for an integer v >= 1, exactly (0 for 1)."""
    return max(0, (int(v) - 1).bit_length())


def constants_first(node: PyNode, keys: Iterable[str]) -> None:
    """Write `keys` (new constants) right after the layer_top_* keys, where upstream puts a layer's constants."""
    order: List[str] = node.attrs.setdefault("ir_key_order", [])
    keys = list(keys)
    rest = [k for k in order if k not in keys]
    tops = [k for k in rest if k.startswith("layer_top_")]
    order[:] = tops + keys + [k for k in rest if k not in tops]


def int_input(node: PyNode) -> Tuple[torch.Tensor, int]:
    """(int64 input values, input zero point as an int)."""
    t = node.inputs[0]
    return int_value(t), tensor_zp(node, t)
