"""Exact int64 helpers shared by the integer forwards of activations and Softmax (no float arithmetic).

`_quant.linear_requantize` works in float64 (exact below 2^53); these helpers stay in int64 so that the integer
semantics documented in docs/integer-semantics.md are what the code literally does.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple, Union

import torch

from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ._quant import int_value, out_range, tensor_zp

IntLike = Union[int, torch.Tensor]


def round_shift(v: torch.Tensor, shift: IntLike) -> torch.Tensor:
    """round_half_even(v / 2^shift) for int64 `v`; a shift <= 0 is an exact left shift.

    floor division by an arithmetic right shift, then +1 when the dropped remainder is above one half, or exactly
    one half and the floored quotient is odd. `shift` may be a python int or an int64 tensor broadcasting to `v`.
    """
    v = v.to(torch.int64)
    s = torch.as_tensor(shift, dtype=torch.int64)
    pos = torch.clamp(s, min=0)
    q = v >> pos
    rem = v - (q << pos)
    half = torch.where(pos > 0, torch.ones_like(pos) << torch.clamp(pos - 1, min=0), torch.zeros_like(pos))
    up = (pos > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    rounded = q + up.to(torch.int64)
    return torch.where(s >= 0, rounded, v << torch.clamp(-s, min=0))


def requantize(v: torch.Tensor, multiplier: IntLike, shift: IntLike, zp_out: int, qmin: int,
               qmax: int) -> torch.Tensor:
    """clamp(round_half_even(v * M / 2^shift) - zp_out, qmin, qmax), all in int64 (exact while |v*M| < 2^63)."""
    prod = v.to(torch.int64) * torch.as_tensor(multiplier, dtype=torch.int64)
    return torch.clamp(round_shift(prod, shift) - int(zp_out), int(qmin), int(qmax))


def range_bits(t: PyTensor) -> int:
    """Bits spanned by the integer range of a quantized tensor: bit length of qmax - qmin (8 for [-128, 127],
    [-127, 127] and [0, 255]). Read from the range the IR stores, so it survives a write/re-read."""
    qmin, qmax = out_range(t)
    return max(1, (qmax - qmin).bit_length())


def is_restricted(t: PyTensor) -> bool:
    """Signed symmetric restricted range ([-(2^(b-1)-1), 2^(b-1)-1])."""
    qmin, qmax = out_range(t)
    return qmin < 0 and qmin == -qmax


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
    return int_value(t), tensor_zp(t)
