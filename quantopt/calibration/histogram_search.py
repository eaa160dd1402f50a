"""Range searches on a tensor's calibration histogram: a true quantile and the range of least quantization error.

Both read the accumulated histogram that `statistics.update_statistics` keeps (counts of every calibration element
on `histc_bins` common bins spanning [lo, hi], the extrema), so they see all calibration data at once, in O(bins)
memory, whatever the number of samples. Within a bin the counts are taken as spread uniformly (the cumulative count
is piecewise linear between the bin edges), which is exact for the quantile up to one bin width.

* `quantile_range(hist, lo, hi, percent, symmetric)`: the smallest range holding `percent` % of the values:
  [q(1 - p), q(p)] for asymmetric ranges; for symmetric ones the smallest t with at least `percent` % of the
  values in [-t, t]. Unlike upstream's `percentile` (the extrema times a factor), this is a percentile.
* `mse_range(hist, lo, hi, qbits, symmetric)`: among `candidates` ranges shrunk from the extrema by a common
  factor (k / candidates, k = 1..candidates), the one minimising the expected squared quantization error:
  clipping error sum(n_i * (c_i - clamp(c_i))^2) over the bin centres c_i plus rounding noise step^2 / 12 for
  every value inside the range (step = range / (2^qbits - 1)). Ties go to the wider range.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..threads import one_thread

MSE_CANDIDATES = 256
"""Ranges tried by `mse_range`: one per 1/256 of the extrema (a finer step changes the error by < 0.5%)."""


def _prepare(hist: torch.Tensor) -> Tuple[torch.Tensor, float]:
    h = hist.detach().reshape(-1).to(torch.float64).cpu().clamp_min(0.0)
    with one_thread():  # the same total at any thread count
        total = float(h.sum())
    return h, total


def _cumulative(h: torch.Tensor) -> torch.Tensor:
    """Cumulative counts at the bin edges: F[0] = 0, F[i] = sum h[:i]."""
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(h, 0)])


def _value_at_count(cum: torch.Tensor, lo: float, width: float, count: float) -> float:
    """The value v with F(v) = count, F piecewise linear between the edges lo + i * width."""
    i = int(torch.searchsorted(cum, torch.tensor([count], dtype=torch.float64), right=False)[0])
    i = min(max(i, 1), cum.numel() - 1)
    below, above = float(cum[i - 1]), float(cum[i])
    frac = 0.0 if above <= below else (count - below) / (above - below)
    return lo + (i - 1 + min(max(frac, 0.0), 1.0)) * width


def _count_below(cum: torch.Tensor, lo: float, width: float, v: torch.Tensor) -> torch.Tensor:
    """F(v) for a tensor of values (0 below lo, the total above hi)."""
    pos = ((v - lo) / width).clamp(0.0, float(cum.numel() - 1))
    i = pos.floor().clamp(max=cum.numel() - 2).long()
    frac = pos - i.to(torch.float64)
    return cum[i] + frac * (cum[i + 1] - cum[i])


def quantile_range(hist: torch.Tensor, lo: float, hi: float, percent: float, symmetric: bool) -> Tuple[float, float]:
    """The range holding `percent` % of the histogram's values (see the module docstring); [lo, hi] itself when the
    histogram is empty or the range degenerate."""
    if not 0.0 < percent <= 100.0:
        raise ValueError(f"quantile percent must be in (0, 100], got {percent}")
    h, total = _prepare(hist)
    lo, hi = float(lo), float(hi)
    if not total > 0.0 or not hi > lo or percent == 100.0:
        return lo, hi
    width = (hi - lo) / h.numel()
    cum = _cumulative(h)
    outside = total * (1.0 - percent / 100.0)
    if not symmetric:
        return _value_at_count(cum, lo, width, outside / 2.0), _value_at_count(cum, lo, width, total - outside / 2.0)
    # smallest t whose [-t, t] leaves at most `outside` values out: bisection on the monotone mass outside
    t_lo, t_hi = 0.0, max(abs(lo), abs(hi))
    for _ in range(60):
        t = 0.5 * (t_lo + t_hi)
        v = torch.tensor([-t, t], dtype=torch.float64)
        f = _count_below(cum, lo, width, v)
        if float(f[0]) + (total - float(f[1])) > outside:
            t_lo = t
        else:
            t_hi = t
    return -t_hi, t_hi


def mse_range(hist: torch.Tensor, lo: float, hi: float, qbits: int, symmetric: bool,
              candidates: int = MSE_CANDIDATES) -> Tuple[float, float]:
    """The range of least expected squared quantization error (see the module docstring); [lo, hi] itself when the
    histogram is empty or the range degenerate."""
    h, total = _prepare(hist)
    lo, hi = float(lo), float(hi)
    if not total > 0.0 or not hi > lo:
        return lo, hi
    width = (hi - lo) / h.numel()
    centres = lo + (torch.arange(h.numel(), dtype=torch.float64) + 0.5) * width
    factors = torch.arange(1, candidates + 1, dtype=torch.float64) / candidates
    if symmetric:
        t = factors * max(abs(lo), abs(hi))
        c_lo, c_hi = -t, t
    else:
        c_lo, c_hi = factors * min(lo, 0.0), factors * max(hi, 0.0)
    levels = float(2 ** int(qbits) - 1)
    step = (c_hi - c_lo) / levels
    clipped = torch.minimum(torch.maximum(centres.reshape(1, -1), c_lo.reshape(-1, 1)), c_hi.reshape(-1, 1))
    inside = (centres.reshape(1, -1) >= c_lo.reshape(-1, 1)) & (centres.reshape(1, -1) <= c_hi.reshape(-1, 1))
    with one_thread():
        clip_error = ((centres.reshape(1, -1) - clipped) ** 2 * h.reshape(1, -1)).sum(dim=1)
        inside_count = (inside.to(torch.float64) * h.reshape(1, -1)).sum(dim=1)
    error = clip_error + inside_count * step ** 2 / 12.0
    # relative rounding: errors equal to 1e-12 are ties, and ties go to the widest candidate (the last minimum)
    rounded = torch.round(error / max(float(error.max()), 1e-300) * 1e12)
    best = int((rounded == rounded.min()).nonzero()[-1, 0])
    return float(c_lo[best]), float(c_hi[best])


def expected_sqnr_db(hist: torch.Tensor, lo: float, hi: float, range_lo: float, range_hi: float,
                     qbits: int) -> Optional[float]:
    """The expected signal-to-quantization-noise ratio, in dB, of quantizing the histogram's values (bins over
    [lo, hi], each taken at its centre) with `qbits` bits over [range_lo, range_hi]: the signal is the mean square
    of the values, the noise the clipping error plus step^2/12 per value inside the range (the model of
    `mse_range`). None when the histogram is empty or all zero."""
    h, total = _prepare(hist)
    lo, hi, a, b = float(lo), float(hi), float(range_lo), float(range_hi)
    if not total > 0.0 or not hi > lo:
        return None
    width = (hi - lo) / h.numel()
    centres = lo + (torch.arange(h.numel(), dtype=torch.float64) + 0.5) * width
    step = (b - a) / float(2 ** int(qbits) - 1) if b > a else 0.0
    inside = ((centres >= a) & (centres <= b)).to(torch.float64)
    with one_thread():
        signal = float((centres ** 2 * h).sum())
        noise = float(((centres - centres.clamp(a, b)) ** 2 * h).sum() + (inside * h).sum() * step ** 2 / 12.0)
    if signal <= 0.0:
        return None
    return math.inf if noise <= 0.0 else 10.0 * math.log10(signal / noise)
