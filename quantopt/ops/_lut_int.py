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
