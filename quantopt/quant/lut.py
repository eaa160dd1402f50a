"""Lookup tables of nonlinear ops: construction and integer lookup (docs/integer-semantics.md, Lookup-table methods;
upstream `unknown_quantize` and `lookup_lut_powerof2`).

Construction reproduces upstream bit for bit (every `lut` constant of the golden IRs, 8-bit and 16-bit inputs, is
rebuilt exactly by tests/quant/test_golden_vectors.py): float32 `torch.linspace` samples of the input integer range,
dequantized with the float32 reciprocal of the scale, f evaluated in float32, quantized in float32.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch

from .hardware import DEFAULT_LUT_ITEMS_IN_BITS
from .params import dequantize, integer_range, quantize

Number = Union[int, float]


def lut_size(in_bits: int, lut_items_in_bits: int = DEFAULT_LUT_ITEMS_IN_BITS) -> int:
    """Number of table entries: 2^min(in_bits, lut_items_in_bits)."""
    return 2 ** min(int(in_bits), int(lut_items_in_bits))


def lut_sample_points(in_qmin: int, in_qmax: int, steps: int) -> torch.Tensor:
    """The float32 input codes the table is sampled at: `steps` points evenly spread over [qmin, qmax].

    For a signed restricted range (qmin == -qmax) only steps-1 points are spread and qmin is prepended, so that
    entry i still answers the full-range index i (the lookup subtracts qmin - 1). When steps - 1 does not divide
    qmax - qmin (16-bit inputs with a 2^10 table) the points are not integers; the lookup reads the table on the
    power-of-two grid instead, a small skew that upstream has too.
    """
    if in_qmin < 0 and in_qmin == -in_qmax:
        pts = torch.linspace(float(in_qmin), float(in_qmax), steps=steps - 1)
        return torch.cat([torch.tensor([float(in_qmin)]), pts])
    return torch.linspace(float(in_qmin), float(in_qmax), steps=steps)


def _host(v: Any) -> Any:
    """A tensor argument on the CPU (anything else as it is)."""
    return v.cpu() if isinstance(v, torch.Tensor) else v


def build_lut(fn: Callable[[torch.Tensor], torch.Tensor], in_scale: float, in_zp: Number, in_qmin: int,
              in_qmax: int, in_bits: int, out_scale: float, out_zp: Number, out_qmin: int, out_qmax: int,
              lut_items_in_bits: int = DEFAULT_LUT_ITEMS_IN_BITS, mirror_offset: float = 0.0) -> torch.Tensor:
    """Table of round(f(dequant(x)) * s_out - zp_out) clipped to [out_qmin, out_qmax], as int64.

    `fn` takes and returns float32 tensors. `mirror_offset` (used by the RNN sigmoid) is subtracted from f before
    quantization and added back as round(offset * s_out) afterwards, like upstream. Store the result with the
    output dtype; its length is `lut_size(in_bits, lut_items_in_bits)`. Built on the CPU (scales given as tensors
    are read there): a GPU's exp and tanh differ in the last bit, and the table must not.
    """
    in_scale, in_zp, out_scale, out_zp = _host(in_scale), _host(in_zp), _host(out_scale), _host(out_zp)
    steps = lut_size(in_bits, lut_items_in_bits)
    pts = lut_sample_points(in_qmin, in_qmax, steps)
    x = dequantize(pts, in_scale, in_zp)
    y = fn(x).to(torch.float32)
    if mirror_offset:
        y = y - torch.tensor(mirror_offset, dtype=torch.float32)
    q = quantize(y, out_scale, out_zp, out_qmin, out_qmax)
    if mirror_offset:
        q = q + int(torch.round(torch.tensor(mirror_offset, dtype=torch.float32)
                                * torch.tensor(out_scale, dtype=torch.float32)).item())
    return q


def lookup_lut(x_q: Union[torch.Tensor, np.ndarray], lut: torch.Tensor, in_qmin: int, in_bits: int, out_bits: int,
               out_signed: bool = False, in_restricted: bool = False) -> torch.Tensor:
    """Integer forward of a LUT op (upstream `lookup_lut_powerof2`); int64 result of the shape of `x_q`.

    index = x - qmin (x - (qmin - 1) for a signed restricted input range, matching the prepended entry), clipped to
    [0, 2^in_bits - 1]. If the table covers the input (2^in_bits entries) the value is lut[index]. Otherwise, with
    b = in_bits - log2(len(lut)): hi = index >> b, lo = index - (hi << b) and
        value = lut[hi] + (((lut[hi + 1] - lut[hi]) * lo) >> b)
    in int64, where lut[len] repeats the last entry and `>>` is an arithmetic shift: the interpolated part is
    floored (rounded toward -inf), never rounded to nearest. The result is clamped to the full range of the table
    dtype (out_bits, out_signed). A 2-D table `[C, 2^N]` holds one table per channel of the last axis of `x_q`.
    """
    table = torch.as_tensor(lut).to(torch.int64)
    if table.dim() == 2:
        return _lookup_per_channel(x_q, table, in_qmin, in_bits, out_bits, out_signed, in_restricted)
    return PreparedLut(table, in_qmin, in_bits, out_bits, out_signed, in_restricted)(x_q)


class PreparedLut:
    """`lookup_lut` with its table-side work (the padded int64 copy, its size and whether its entries need the
    output clamp) done once: for a loop that looks many small tensors up in the same tables (a recurrent cell's
    steps), where that work cost more than the lookup itself.

    A 2-D table [K, 2^N] holds K tables for K equal blocks of the last axis of the codes (block k: columns
    k·C/K .. (k+1)·C/K - 1): one table per channel when K is the channel count, or the four gate tables of an LSTM
    cell over its four gate blocks, looked up in one pass."""

    def __init__(self, lut: torch.Tensor, in_qmin: int, in_bits: int, out_bits: int, out_signed: bool = False,
                 in_restricted: bool = False, device: Optional[torch.device] = None) -> None:
        table = torch.as_tensor(lut).to(torch.int64)
        stacked = table.dim() == 2
        self.blocks, size = (int(table.shape[0]), int(table.shape[1])) if stacked else (1, table.numel())
        self.table_bits = int(round(math.log2(size))) if size > 0 else -1
        if size == 0 or 2 ** self.table_bits != size:
            raise ValueError(f"LUT lookup needs a table of 2^N entries, got {size}")
        self.size, self.in_bits = size, int(in_bits)
        self.offset = in_qmin - 1 if in_restricted and in_qmin < 0 else in_qmin
        # each table's last entry repeated (one table: the flat form, a quarter of the 2-D concatenation's cost)
        flat = table.reshape(-1)
        self.padded = torch.cat([table, table[:, -1:]], dim=1).reshape(-1) if stacked else torch.cat([flat, flat[-1:]])
        if device is not None:
            self.padded = self.padded.to(device)
        self.out_range = integer_range(out_bits, out_signed)
        # entries (and the floored interpolations between them) already in the output range need no clamp
        lo, hi = (int(v) for v in torch.aminmax(table))
        self.clamped = not (self.out_range[0] <= lo and hi <= self.out_range[1])
        # the largest |value| a lookup gives: interpolations lie between their entries, then the clamp
        self.absmax = min(max(-lo, hi), max(-self.out_range[0], self.out_range[1]))
        self._bases: Optional[Dict[Tuple[int, str], torch.Tensor]] = None
        self._typed: Optional[torch.Tensor] = None  # `take_indexed`'s table, in the dtype it was last read in

    def _base(self, columns: int, device: torch.device) -> torch.Tensor:
        """Where each column's table starts in the padded stack, for codes of `columns` columns."""
        key = (columns, str(device))
        if self._bases is None:
            self._bases = {}
        if key not in self._bases:
            if columns % self.blocks:
                raise ValueError(f"{self.blocks} tables need a last axis of a multiple of {self.blocks} columns, "
                                 f"got {columns}")
            block = torch.arange(self.blocks, dtype=torch.int64) * (self.size + 1)
            self._bases[key] = block.repeat_interleave(columns // self.blocks).to(device)
        return self._bases[key]

    @property
    def direct(self) -> bool:
        """Whether a lookup is one gather (2^in_bits <= the table size), with no interpolation between entries."""
        return self.in_bits <= self.table_bits

    def index_offset(self, columns: int, device: torch.device) -> Union[int, torch.Tensor]:
        """What to subtract from codes of `columns` columns to get their positions in the padded tables (the input
        offset, less each column's table start where there are several tables): with `take_indexed`, the lookup of
        codes a requantization already produced offset (`Requantizer.__call__`'s `minus`), one kernel call instead
        of three. The same tensor for the same columns and device, kept."""
        if self.blocks == 1:
            return self.offset
        key = (-columns, str(device))  # negative: apart from `_base`'s keys in the same cache
        if self._bases is None:
            self._bases = {}
        if key not in self._bases:
            self._bases[key] = self.offset - self._base(columns, device)
        return self._bases[key]

    def take_indexed(self, index: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The looked-up values at positions `index` (codes less `index_offset`, every code within the input range
        as `covers` shows) of a direct table (`direct`), as `dtype` (float64 holds every entry exactly: a caller
        whose next steps are float64 then converts nothing; the table is converted once and kept)."""
        typed = self._typed
        if typed is None or typed.dtype != dtype or typed.device != index.device:
            typed = self._typed = self.padded.to(device=index.device, dtype=dtype)
        value = torch.take(typed, index)
        return torch.clamp(value, *self.out_range) if self.clamped else value

    def covers(self, lo: int, hi: int) -> bool:
        """Whether codes in [lo, hi] are all within the tables' input range (their index needs no clamp)."""
        return self.offset <= lo and hi <= self.offset + 2 ** self.in_bits - 1

    def __call__(self, x_q: Union[torch.Tensor, np.ndarray], in_range: bool = False) -> torch.Tensor:
        """The looked-up values of codes `x_q`; `in_range`: the caller proved every code within the input range
        (`covers`), so the index is not clamped."""
        x = x_q if isinstance(x_q, torch.Tensor) else torch.as_tensor(np.asarray(x_q))
        x = torch.round(x.to(torch.float64)).to(torch.int64) if torch.is_floating_point(x) else x.to(torch.int64)
        padded = self.padded if self.padded.device == x.device else self.padded.to(x.device)
        if self.blocks > 1 and x.dim() == 0:
            raise ValueError(f"{self.blocks} tables need codes with a last axis of {self.blocks} blocks")
        base = self._base(int(x.shape[-1]), x.device) if self.blocks > 1 else None
        index = torch.sub(x, self.offset)
        if not in_range:
            index = index.clamp_(0, 2 ** self.in_bits - 1)
        if self.in_bits > self.table_bits:
            b = self.in_bits - self.table_bits
            hi = index >> b
            lo = index - (hi << b)
            if base is not None:
                hi = hi.add_(base)
            value = padded[hi] + (((padded[hi + 1] - padded[hi]) * lo) >> b)
        else:  # 2^in_bits <= size: the index is within the table
            value = torch.take(padded, index if base is None else index.add_(base))
        return torch.clamp(value, *self.out_range) if self.clamped else value


def _lookup_per_channel(x_q: Union[torch.Tensor, np.ndarray], table: torch.Tensor, in_qmin: int, in_bits: int,
                        out_bits: int, out_signed: bool, in_restricted: bool) -> torch.Tensor:
    """`lookup_lut` with the table of channel c (the last axis of x) for every element of that channel."""
    x = torch.as_tensor(np.asarray(x_q) if isinstance(x_q, np.ndarray) else x_q)
    channels, size = int(table.shape[0]), int(table.shape[1])
    if x.dim() == 0 or int(x.shape[-1]) != channels:
        raise ValueError(f"a per-channel table of {channels} channels needs inputs with {channels} channels on the "
                         f"last axis, got shape {list(x.shape)}")
    if not size:
        return x.to(torch.int64)
    return PreparedLut(table, in_qmin, in_bits, out_bits, out_signed, in_restricted)(x)


def lookup_float_lut(index: torch.Tensor, lut: torch.Tensor, in_bits: int) -> torch.Tensor:
    """Float32 lookup of a float table of 2^T entries (upstream `lookup_lut_powerof2` with a float table), for
    integer indices in [0, 2^in_bits - 1] (not clipped): the entry itself when T >= in_bits, else with
    b = in_bits - T, hi = index >> b, lo = index - (hi << b):
        value = lut[hi] + ((lut[hi + 1] - lut[hi]) * lo) / 2^b
    each operation rounded to float32 (lut[2^T] repeats the last entry). The difference times lo and the division
    by a power of two are written out because their float32 roundings are what the table's users reproduce."""
    table = torch.as_tensor(lut).to(torch.float32).flatten()
    size = table.numel()
    table_bits = size.bit_length() - 1
    if size == 0 or 2 ** table_bits != size:
        raise ValueError(f"LUT lookup needs a table of 2^N entries, got {size}")
    idx = torch.as_tensor(index).to(torch.int64)
    padded = torch.cat([table, table[-1:]]).to(idx.device)
    if int(in_bits) <= table_bits:
        return padded[idx]
    b = int(in_bits) - table_bits
    hi = idx >> b
    lo = (idx - (hi << b)).to(torch.float32)
    step = (padded[hi + 1] - padded[hi]) * lo
    return padded[hi] + step / torch.tensor(float(2 ** b), dtype=torch.float32)
