"""Streaming tensor statistics for calibration (upstream `PyTensor.statistic`), as pure functions.

`update_statistics(stats, x, cfg, batch_index)` folds one calibration batch `x` into a `TensorStatistics` in
O(x.numel()) time. The state it keeps has a fixed size (a few scalars, `histc_bins` histogram bins, and the same
per channel along `key_axis`): it never grows with the number of batches.

What is computed (per tensor, and additionally per channel along `cfg.key_axis`):

* `extrema_min/max`: min/max over all batches so far, clipped to the int32 range (as upstream). NaN values are
  ignored (upstream let a single NaN poison the range); a tensor (or channel) that is all NaN counts as 0.
* `running_min/max/mean/std/mad`: exponential moving averages `r = m*r + (1-m)*v` of the per-batch values with `m =
  cfg.momentum`, evaluated in float32 arithmetic like upstream (so calibrated ranges match it exactly); batch 0 (or
  the first batch these stats see) resets them: `r = v`. `std` is torch's unbiased std, `mad` the mean absolute
  deviation from the batch mean. Per-batch moments are clamped to the int32 range and then NaN std -> 1, NaN mean/mad
  -> 0 (so a one-element batch has std 1, as upstream). Moments are only kept when `cfg.need_moments` (upstream's
  time-saving mode).
* `running_histc` (only when `cfg.need_histogram`): `histc_bins` bins. **Deviation from upstream, on purpose**:
  upstream averaged (EMA) per-batch histograms whose bins spanned *each batch's own* [min, max], so bin i of two
  batches meant different values. Here every histogram always spans the current global range
  `histogram_range(stats)` = [extrema_min, extrema_max] (a degenerate range lo == hi becomes
  [lo, lo + |lo|/2 + 1], upstream's rule). When a batch widens the extrema, the accumulated histogram is
  **re-binned** onto the wider range before the batch's own histogram (computed directly on the new edges) is added:

    the old counts are treated as uniformly spread inside each old bin, so their cumulative count F(v) is the
    piecewise-linear interpolation of the cumulative counts at the old edges (0 below the old range, the total above
    it); new bin j receives F(e_{j+1}) - F(e_j) at the new edges e_j, with the first and last new bins also taking
    any mass left beyond the new range. Re-binning conserves the total count exactly (up to float rounding) and
    moves no mass by more than one old bin width.

  So the range is stored with the histogram without extra state: it is the extrema already kept in
  `TensorStatistics` (which `quantopt/graph/tensor.py` defines; it has no slot for extra state, and the extrema also
  travel with a saved statistic file). By default the histogram **accumulates counts** (every element of every batch
  weighs the same, the sum of bins = number of non-NaN elements seen); `cfg.histogram_mode = "ema"` instead blends
  the re-binned histogram with the batch histogram using the momentum, as upstream did, but on common edges.
  Values outside the int32-clipped range are counted in the border bins; NaN and mask values (below) are not.

Per-channel statistics are computed vectorized over a (channels, elements) view; per-channel histograms are
computed with one `bincount` per block of channels (blocks of about `_CHUNK` elements) only to bound the temporary
index tensor's memory, each block is fully vectorized.

`cfg.trim` (upstream `trim_infinity_before_statistic`) is applied to the whole tensor before anything else:
`('clip', a, b)` clamps values into [a, b]; `('second', a, b)` replaces values <= a or >= b by the min / max of the
remaining values (upstream semantics: the trimmed values first count as 0 while finding that min / max).

Mask values (after the trim): values with |x| >= `cfg.mask_threshold` (`INF_MASK_THRESHOLD`, 1e30, by default; ±inf
included) are what attention masks add before a Softmax (-inf, -FLT_MAX). They are left out of every statistic, as
NaN values are (the per-tensor moments are those of the other values; a channel or tensor holding nothing else
counts as 0), and counted in `inf_mask_low` / `inf_mask_high`, which tell the inf-mask pass (calibration/inf_mask.py)
that the tensor is a mask. A batch without such values takes exactly the path it took before this rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from ..config.calibration_values import Trim, parse_trim  # torch-free (the cfg reader's); re-exported
from ..graph.tables import TensorStatistics
from ..quant.hardware import STATISTICS_CLIP_RANGE
from ..quant.rounding import FLOAT32_STRUCT
from ..threads import one_thread

# Statistics are clipped to the int32 range as upstream (OPT_INT_MIN / OPT_INT_MAX).
STAT_INT_MIN, STAT_INT_MAX = (float(v) for v in STATISTICS_CLIP_RANGE)

INF_MASK_THRESHOLD = 1e30
"""Values at least this large in magnitude (±inf included) are mask values, not data (docs/statistics-and-dump.md,
"Masks with infinite values"): no real activation comes near it, and masks use -inf or -FLT_MAX (-3.4e38)."""

_STAT_DTYPE = torch.float64  # dtype of all kept statistics (EMA and histogram accumulation precision)
_CHUNK = 1 << 22  # elements per block when binning (bounds the temporary float64/int64 tensors)

__all__ = [
    "ExtremaState", "INF_MASK_THRESHOLD", "STAT_INT_MAX", "STAT_INT_MIN", "StatisticsConfig", "Trim", "apply_trim",
    "histogram_range", "parse_trim", "plain_extrema", "rebin_histogram", "starts_over", "update_statistics",
]


def _as_trim(trim: Union[None, str, Tuple[str, float, float], Trim]) -> Optional[Trim]:
    if trim is None or isinstance(trim, str):
        return parse_trim(trim)
    if len(trim) != 3:
        raise ValueError(f"trim must be (method, lo, hi), got {trim!r}")
    method, lo, hi = str(trim[0]).lower(), float(trim[1]), float(trim[2])
    if method not in ("clip", "second"):
        raise ValueError(f"trim method must be 'clip' or 'second', got {trim[0]!r}")
    if not lo <= 0.0 <= hi:
        raise ValueError(f"trim bounds must satisfy lo <= 0 <= hi, got {trim!r}")
    return Trim(method, lo, hi)


@dataclass(frozen=True)
class StatisticsConfig:
    """What `update_statistics` collects for one tensor.

    momentum: `running_statistic_momentum` (EMA weight of the old value). histc_bins: histogram bins.
    need_histogram / need_moments: upstream's time-saving switches (only kld needs the histogram; Nstd,
    aciq and weighted_scale_param need mean/std/mad; `strategies.statistics_needs` tells). key_axis: also
    collect per-channel statistics along this axis (None: per tensor only). trim: `Trim`, a
    ('clip'|'second', lo, hi) tuple, the upstream text, or None.
    histogram_mode: 'accumulate' (default, counts of all batches summed on common edges) or 'ema' (upstream-style
    momentum blend, on common edges).
    mask_threshold: values with |x| >= it are mask values, left out and counted (math.inf: none are).
    """

    momentum: float = 0.9
    histc_bins: int = 2048
    need_histogram: bool = False
    need_moments: bool = True
    key_axis: Optional[int] = None
    trim: Union[None, str, Tuple[str, float, float], Trim] = None
    histogram_mode: str = "accumulate"
    mask_threshold: float = INF_MASK_THRESHOLD

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.momentum) <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {self.momentum}")
        if int(self.histc_bins) < 1:
            raise ValueError(f"histc_bins must be >= 1, got {self.histc_bins}")
        if self.histogram_mode not in ("accumulate", "ema"):
            raise ValueError(f"histogram_mode must be 'accumulate' or 'ema', got {self.histogram_mode!r}")
        object.__setattr__(self, "trim", _as_trim(self.trim))

    @property
    def extrema_only(self) -> bool:
        """Whether only the extrema and running min/max are collected (the default strategies): the fast path."""
        return self.key_axis is None and not self.need_moments and not self.need_histogram and self.trim is None


# ---------------------------------------------------------------------------------------------------------------
# helpers


def apply_trim(x: torch.Tensor, trim: Optional[Trim]) -> torch.Tensor:
    """Upstream `trim_infinity_before_statistic` on a float tensor (returns a new tensor or `x` itself)."""
    if trim is None:
        return x
    if trim.method == "clip":
        if trim.lo == -math.inf and trim.hi == math.inf:
            return x
        return torch.clamp(x, trim.lo, trim.hi)
    lo, hi = min(trim.lo, 0.0), max(trim.hi, 0.0)
    outlier = (x <= lo) | (x >= hi)
    rest = torch.where(outlier, torch.zeros_like(x), x)
    if rest.numel() == 0:
        return x
    rmin, rmax = _nan_aminmax(rest.reshape(1, -1))
    return torch.clamp(x, float(rmin[0]), float(rmax[0]))


def _nan_aminmax(v2d: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-wise min/max ignoring NaN; an all-NaN row gives (0, 0). Returns float64 tensors."""
    return _nan_aminmax_flagged(v2d)[:2]


def _nan_aminmax_flagged(v2d: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """`_nan_aminmax`, and whether `v2d` holds a NaN (found by the same pass: min and max propagate NaN)."""
    mn, mx = torch.aminmax(v2d, dim=1)  # one pass; NaN propagates as with amin and amax
    bad = torch.isnan(mn) | torch.isnan(mx)
    has_nan = bool(bad.any())
    if has_nan:
        nan = torch.isnan(v2d)
        mn = torch.where(nan, torch.full_like(v2d, math.inf), v2d).amin(dim=1)
        mx = torch.where(nan, torch.full_like(v2d, -math.inf), v2d).amax(dim=1)
        empty = mn > mx
        mn = torch.where(empty, torch.zeros_like(mn), mn)
        mx = torch.where(empty, torch.zeros_like(mx), mx)
    return mn.to(_STAT_DTYPE), mx.to(_STAT_DTYPE), has_nan


def _degenerate_fix(lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Upstream's histogram range rule for an empty range: [lo, lo + |lo|/2 + 1]."""
    hi = torch.where(hi > lo, hi, lo + lo.abs() / 2.0 + 1.0)
    return lo, hi


def histogram_range(stats: TensorStatistics, per_channel: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The value range [lo, hi] spanned by `running_histc` (or by each row of `running_histc_key_axis`).

    It is the extrema range, widened as upstream when degenerate (see the module docstring).
    """
    lo = stats.extrema_min_key_axis if per_channel else stats.extrema_min
    hi = stats.extrema_max_key_axis if per_channel else stats.extrema_max
    if lo is None or hi is None:
        raise ValueError("no extrema statistics: run update_statistics first")
    return _degenerate_fix(lo.to(_STAT_DTYPE), hi.to(_STAT_DTYPE))


def rebin_histogram(hist: torch.Tensor, old_lo: torch.Tensor, old_hi: torch.Tensor, new_lo: torch.Tensor,
                    new_hi: torch.Tensor) -> torch.Tensor:
    """Re-bin histograms (shape (bins,) or (rows, bins)) from [old_lo, old_hi] onto [new_lo, new_hi], same bin count.

    Counts are taken as uniform inside each old bin (piecewise-linear cumulative count); mass beyond the new range
    goes to its border bins, so the total is conserved. Rows whose range did not change are returned unchanged.
    """
    squeeze = hist.dim() == 1
    h = hist.reshape(1, -1) if squeeze else hist
    h = h.to(_STAT_DTYPE)
    rows, bins = h.shape
    if rows == 1 and h.device.type == "cpu":
        one = _rebin_row(h.reshape(-1).numpy(), *(float(torch.as_tensor(v).reshape(-1)[0])
                                                  for v in (old_lo, old_hi, new_lo, new_hi)))
        if one is None:
            return hist.clone()
        out = torch.from_numpy(one)
        return out if squeeze else out.reshape(1, -1)
    old_lo, old_hi, new_lo, new_hi = (torch.as_tensor(v, dtype=_STAT_DTYPE, device=h.device).reshape(-1, 1)
                                      .expand(rows, 1) for v in (old_lo, old_hi, new_lo, new_hi))
    changed = ((old_lo != new_lo) | (old_hi != new_hi)).reshape(rows)
    if not bool(changed.any()):
        return hist.clone()
    zero = torch.zeros((rows, 1), dtype=_STAT_DTYPE, device=h.device)
    cum = torch.cat([zero, torch.cumsum(h, dim=1)], dim=1)  # cumulative count at the old edges, (rows, bins+1)
    total = cum[:, -1:]
    j = torch.arange(bins + 1, dtype=_STAT_DTYPE, device=h.device).reshape(1, -1)
    new_edges = new_lo + (new_hi - new_lo) * (j / bins)
    # position of each new edge in old-bin units, clamped to the old range
    u = ((new_edges - old_lo) * (bins / (old_hi - old_lo))).clamp(0.0, float(bins))
    k = torch.floor(u).clamp(max=bins - 1)
    frac = u - k
    k = k.long()
    f = torch.gather(cum, 1, k) + frac * torch.gather(h, 1, k)
    f[:, 0] = 0.0
    f[:, -1:] = total
    f = torch.cummax(f, dim=1).values  # guard against rounding making F decrease
    out = (f[:, 1:] - f[:, :-1]).clamp(min=0.0)
    out = torch.where(changed.reshape(rows, 1), out, h)
    return out.reshape(-1) if squeeze else out


def _rebin_row(h: np.ndarray, old_lo: float, old_hi: float, new_lo: float, new_hi: float) -> Optional[np.ndarray]:
    """`rebin_histogram` of one float64 histogram in numpy, the same operations in the same order (IEEE float64 on
    both sides, sequential cumulative sums and maxima), at a fraction of the per-call cost of twenty small torch
    calls, paid by every tensor on every batch whose range grew; None where the range did not change."""
    if old_lo == new_lo and old_hi == new_hi:
        return None
    bins = h.shape[0]
    cum = np.concatenate([np.zeros(1), np.cumsum(h)])  # cumulative count at the old edges
    total = cum[-1]
    j = np.arange(bins + 1, dtype=np.float64)
    new_edges = new_lo + (new_hi - new_lo) * (j / bins)
    # torch computes a number divided by a tensor as the tensor's reciprocal times the number: so here
    u = np.clip((new_edges - old_lo) * ((1.0 / (old_hi - old_lo)) * bins), 0.0, float(bins))
    k = np.minimum(np.floor(u), bins - 1)
    frac = u - k
    ki = k.astype(np.int64)
    f = cum[ki] + frac * h[ki]
    f[0] = 0.0
    f[-1] = total
    f = np.maximum.accumulate(f)  # guard against rounding making F decrease
    return np.maximum(f[1:] - f[:-1], 0.0)


BIN_STEP = 1 << 16
"""Elements binned at a time by `_bin_counts_row`: its float64 and int32 buffers (768 KiB together) stay in cache."""


def _bin_counts_row(v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """`_bin_counts` of one row without NaN, the same counts: each step of `BIN_STEP` values converted to float64
    into a reused buffer, binned there in place (the same operations in the same order: (x - lo) * factor, floor,
    clamp) and counted; the general path's float64 and int64 copies of the whole tensor and its NaN passes made the
    histogram strategies' statistics pass cost several float forwards. Returns (1, bins) float64."""
    n = v.numel()
    lo64 = lo.to(_STAT_DTYPE).reshape(())
    factor = float(bins) / (hi.to(_STAT_DTYPE).reshape(()) - lo64)
    step = min(n, BIN_STEP)
    buf = torch.empty(step, dtype=_STAT_DTYPE, device=v.device)
    index = torch.empty(step, dtype=torch.int32, device=v.device)  # bin numbers: int32 counts 1.6x faster
    counts = torch.zeros(bins, dtype=torch.int64, device=v.device)
    flat = v.reshape(-1)
    for start in range(0, n, step):
        m = min(step, n - start)
        b = buf[:m].copy_(flat[start:start + m])
        b.sub_(lo64).mul_(factor).floor_().clamp_(0.0, float(bins - 1))
        counts += torch.bincount(index[:m].copy_(b), minlength=bins)
    return counts.to(_STAT_DTYPE).reshape(1, bins)


def _bin_counts(v2d: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int,
                no_nan: bool = False) -> torch.Tensor:
    """Histogram of each row of `v2d` on [lo_r, hi_r] (hi > lo), values outside counted in the border bins, NaN
    dropped. Blocks of rows keep the temporary index tensor near `_CHUNK` elements. Returns (rows, bins) float64.
    `no_nan`: the caller knows `v2d` holds no NaN (one row on the CPU then takes `_bin_counts_row`; on a GPU, where
    caches do not decide and each step would cost kernel launches, the whole row is binned at once)."""
    rows, cols = v2d.shape
    if rows == 1 and no_nan and cols and v2d.device.type == "cpu":
        return _bin_counts_row(v2d, lo, hi, bins)
    out = torch.zeros((rows, bins), dtype=_STAT_DTYPE, device=v2d.device)
    lo = lo.to(_STAT_DTYPE).reshape(rows, 1)
    factor = float(bins) / (hi.to(_STAT_DTYPE).reshape(rows, 1) - lo)
    rows_per_block = max(1, _CHUNK // max(cols, 1))
    col_block = cols if cols <= _CHUNK else _CHUNK
    for r0 in range(0, rows, rows_per_block):
        r1 = min(rows, r0 + rows_per_block)
        for c0 in range(0, cols, col_block):
            c1 = min(cols, c0 + col_block)
            blk = v2d[r0:r1, c0:c1].to(_STAT_DTYPE)
            pos = torch.floor((blk - lo[r0:r1]) * factor[r0:r1]).clamp(0.0, float(bins - 1))
            nan = torch.isnan(pos)
            pos = torch.where(nan, torch.zeros_like(pos), pos).long()
            nrows = r1 - r0
            flat = pos + torch.arange(nrows, device=v2d.device).reshape(-1, 1) * bins
            flat = torch.where(nan, torch.full_like(flat, nrows * bins), flat)  # dump bin for NaN
            counts = torch.bincount(flat.reshape(-1), minlength=nrows * bins + 1)[: nrows * bins]
            out[r0:r1] += counts.reshape(nrows, bins).to(_STAT_DTYPE)
    return out


def _moments(v2d: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise (mean, unbiased std, mean absolute deviation), clamped to int32 range, NaN std -> 1, mean/mad -> 0.
    One row (per tensor) is summed on one thread (`threads.one_thread`): the same at any thread count."""
    with one_thread(v2d.shape[0] == 1):
        if v2d.shape[1] > 1:
            std, mean = torch.std_mean(v2d, dim=1)
        else:  # unbiased std of a single value is NaN (-> 1 below); avoid torch's degrees-of-freedom warning
            mean = v2d.mean(dim=1)
            std = torch.full_like(mean, math.nan)
        mad = torch.mean(torch.abs(v2d - mean.reshape(-1, 1)), dim=1)
    mean, std, mad = (t.to(_STAT_DTYPE).clamp(STAT_INT_MIN, STAT_INT_MAX) for t in (mean, std, mad))
    std = torch.where(torch.isnan(std), torch.ones_like(std), std)
    mean = torch.where(torch.isnan(mean), torch.zeros_like(mean), mean)
    mad = torch.where(torch.isnan(mad), torch.zeros_like(mad), mad)
    return mean, std, mad


def _ema(old: Optional[torch.Tensor], new: torch.Tensor, m: float) -> torch.Tensor:
    """m * old + (1 - m) * new, each product and the sum rounded to float32 as upstream computes it, so that the
    `mean` strategy gives upstream's ranges bit for bit (kept as float64 values)."""
    if old is None:
        return new.clone()
    return (m * old.to(torch.float32) + (1.0 - m) * new.to(torch.float32)).to(_STAT_DTYPE)


def _update_group(stats: TensorStatistics, v2d: torch.Tensor, cfg: StatisticsConfig, reset: bool,
                  suffix: str, squeeze: bool, extrema: Optional[Tuple[float, float]] = None) -> None:
    """Update one family of fields (per tensor: suffix '' with one row; per channel: '_key_axis', one row each).
    `extrema`: the one row's (min, max), known to hold no NaN (`_drop_mask_values`), instead of a pass of its own."""
    m = 0.0 if reset else float(cfg.momentum)

    def get(name: str) -> Optional[torch.Tensor]:
        return None if reset else getattr(stats, name + suffix)

    def put(name: str, value: torch.Tensor) -> None:
        setattr(stats, name + suffix, value.reshape(()) if squeeze else value)

    def rows(name: str) -> Optional[torch.Tensor]:
        t = get(name)
        if t is None:
            return None
        t = t.reshape(-1) if name != "running_histc" else t.reshape(-1, t.shape[-1])
        if t.shape[0] != v2d.shape[0]:
            raise ValueError(f"statistics have {t.shape[0]} channels but this batch has {v2d.shape[0]} "
                             f"(key_axis={cfg.key_axis})")
        return t

    if extrema is not None:
        bmin, bmax, has_nan = (torch.tensor([extrema[0]], dtype=_STAT_DTYPE, device=v2d.device),
                               torch.tensor([extrema[1]], dtype=_STAT_DTYPE, device=v2d.device), False)
    else:
        bmin, bmax, has_nan = _nan_aminmax_flagged(v2d)
    bmin = bmin.clamp(STAT_INT_MIN, STAT_INT_MAX)
    bmax = bmax.clamp(STAT_INT_MIN, STAT_INT_MAX)
    old_emin, old_emax = rows("extrema_min"), rows("extrema_max")
    emin = bmin if old_emin is None else torch.minimum(old_emin, bmin)
    emax = bmax if old_emax is None else torch.maximum(old_emax, bmax)
    put("extrema_min", emin)
    put("extrema_max", emax)
    put("running_min", _ema(rows("running_min"), bmin, m))
    put("running_max", _ema(rows("running_max"), bmax, m))

    if cfg.need_moments:
        mean, std, mad = _moments(v2d)
        put("running_mean", _ema(rows("running_mean"), mean, m))
        put("running_std", _ema(rows("running_std"), std, m))
        put("running_mad", _ema(rows("running_mad"), mad, m))

    if cfg.need_histogram:
        bins = int(cfg.histc_bins)
        lo, hi = _degenerate_fix(emin, emax)
        batch_hist = _bin_counts(v2d, lo, hi, bins, no_nan=not has_nan)
        old_hist = rows("running_histc")
        if old_hist is not None and old_hist.shape[-1] != bins:
            raise ValueError(f"histogram has {old_hist.shape[-1]} bins but histc_bins={bins}")
        if old_hist is None or old_emin is None or old_emax is None:
            hist = batch_hist
        else:
            olo, ohi = _degenerate_fix(old_emin, old_emax)
            hist = rebin_histogram(old_hist, olo, ohi, lo, hi)
            hist = hist + batch_hist if cfg.histogram_mode == "accumulate" else m * hist + (1.0 - m) * batch_hist
        setattr(stats, "running_histc" + suffix, hist.reshape(-1) if squeeze else hist)


# ---------------------------------------------------------------------------------------------------------------
# public entry point




def _ema32(old: float, new: float, m: float) -> float:
    """`_ema` on python floats: the float32 products and sum of `m * old + (1 - m) * new`. Each float32 operation is
    its float64 result rounded to float32: a product of two float32 values is exact in float64, and rounding a sum
    first to float64 and then to float32 gives the float32 sum (53 >= 2 * 24 + 2 bits). Twice as fast as numpy's
    float32 scalars (tests/calibration/test_pass_updates.py compares the two)."""
    pack, unpack = FLOAT32_STRUCT.pack, FLOAT32_STRUCT.unpack  # unpack(pack(v)) written out: calls cost
    product_old = unpack(pack(unpack(pack(m))[0] * unpack(pack(old))[0]))[0]
    product_new = unpack(pack(unpack(pack(1.0 - m))[0] * unpack(pack(new))[0]))[0]
    return unpack(pack(product_old + product_new))[0]


def starts_over(stats: TensorStatistics, batch_index: int) -> bool:
    """Whether batch `batch_index` starts `stats` afresh: the first batch of a pass, or statistics that hold none."""
    return int(batch_index) == 0 or stats.batches == 0 or stats.extrema_min is None


def plain_extrema(x: torch.Tensor, mask_threshold: float = INF_MASK_THRESHOLD) -> Optional[Tuple[float, float]]:
    """(min, max) of batch `x` clipped to the statistics range as the extrema path folds them, by one aminmax; None
    when the batch holds NaN or mask values (|x| >= `mask_threshold`), which only the other paths handle."""
    lo_f, hi_f = _batch_minmax(x)
    if lo_f <= -mask_threshold or hi_f >= mask_threshold:
        return None
    return _clipped(lo_f, hi_f)


def plain_extrema_rows(x: torch.Tensor,
                       mask_threshold: float = INF_MASK_THRESHOLD) -> List[Optional[Tuple[float, float]]]:
    """`plain_extrema` of each row of a 2-D `x`, by one amin and one amax over its rows (the same values: a minimum
    and a maximum do not depend on how the elements are grouped; torch's aminmax along an axis is ten times
    slower than the two)."""
    x = x if x.is_floating_point() else x.float()
    lo_t, hi_t = torch.amin(x, dim=1), torch.amax(x, dim=1)
    return [None if lo <= -mask_threshold or hi >= mask_threshold else _clipped(lo, hi)
            for lo, hi in zip(lo_t.tolist(), hi_t.tolist())]


def _batch_minmax(x: torch.Tensor) -> Tuple[float, float]:
    """(min, max) of `x` by one aminmax (NaN where it holds NaN)."""
    lo_t, hi_t = torch.aminmax(x if x.is_floating_point() else x.float())
    return float(lo_t), float(hi_t)


def _clipped(lo_f: float, hi_f: float) -> Optional[Tuple[float, float]]:
    lo = min(max(lo_f, STAT_INT_MIN), STAT_INT_MAX)
    hi = min(max(hi_f, STAT_INT_MIN), STAT_INT_MAX)
    if math.isnan(lo) or math.isnan(hi):
        return None
    return lo, hi


@dataclass
class ExtremaState:
    """A tensor's extrema statistics (extrema, running min/max, batch count) as Python floats: what the extrema path
    of `update_statistics` folds each batch into. A pass over many batches of small tensors keeps them so until it
    ends (calibration/collect.py): storing four 0-d tensors per batch cost as much as a small layer's forward.
    `store` writes the values the per-batch updates would have left."""

    extrema_min: float
    extrema_max: float
    running_min: float
    running_max: float
    batches: int = 1

    @classmethod
    def of(cls, stats: TensorStatistics) -> ExtremaState:
        """The state `stats` holds (it must hold extrema: a batch was folded in)."""
        assert stats.extrema_min is not None and stats.running_min is not None
        return cls(float(stats.extrema_min), float(stats.extrema_max), float(stats.running_min),
                   float(stats.running_max), stats.batches)

    def fold(self, lo: float, hi: float, m: float) -> None:
        """Fold one more batch's clipped extrema (`plain_extrema`) in, with momentum `m`."""
        self.extrema_min, self.extrema_max = min(self.extrema_min, lo), max(self.extrema_max, hi)
        self.running_min, self.running_max = _ema32(self.running_min, lo, m), _ema32(self.running_max, hi, m)
        self.batches += 1

    def store(self, stats: TensorStatistics) -> None:
        """Write the state into `stats` as 0-d float64 tensors (made at once: one small allocation instead of four
        torch.tensor calls)."""
        stats.extrema_min, stats.extrema_max, stats.running_min, stats.running_max = torch.from_numpy(np.array(
            [self.extrema_min, self.extrema_max, self.running_min, self.running_max], dtype=np.float64)).unbind()
        stats.batches = self.batches


def _update_extrema_only(stats: TensorStatistics, x: torch.Tensor, m: float, reset: bool,
                         mask_threshold: float = INF_MASK_THRESHOLD) -> bool:
    """Fast path of the default strategies (extrema/mean): one aminmax and scalar arithmetic, the same results as
    the general path (mask values through `_update_extrema_masked`). Returns False (nothing changed) when the batch
    holds NaN or only mask values, for the general path to handle."""
    lo_f, hi_f = _batch_minmax(x)
    if lo_f <= -mask_threshold or hi_f >= mask_threshold:
        return _update_extrema_masked(stats, x, m, reset, mask_threshold, lo_f, hi_f)
    return _apply_extrema(stats, lo_f, hi_f, m, reset)


def _update_extrema_masked(stats: TensorStatistics, x: torch.Tensor, m: float, reset: bool,
                           mask_threshold: float, lo_all: float, hi_all: float) -> bool:
    """The fast path for a batch holding mask values (attention masks): counted as `_drop_mask_values` counts them,
    the extrema taken over the other values, without building the tensor of those values. `lo_all`/`hi_all`: the
    batch's own min and max (NaN-free: a NaN would have made them NaN): a side without mask values needs no pass of
    its own, its extremum is the batch's (mask values are the largest in magnitude), so a mask of -inf or -FLT_MAX
    costs a comparison, a count and a masked min. Returns False (nothing changed) when every value is a mask value
    or the others hold NaN, for the general path to handle."""
    if math.isinf(mask_threshold):
        return False
    xf = x if x.is_floating_point() else x.float()
    below = xf <= -mask_threshold if lo_all <= -mask_threshold else None
    above = xf >= mask_threshold if hi_all >= mask_threshold else None
    low = int(below.sum()) if below is not None else 0
    high = int(above.sum()) if above is not None else 0
    total = low + high
    if total == 0 or total == xf.numel():
        return False
    huge = below if above is None else above if below is None else below | above
    lo_f = lo_all if below is None else float(torch.where(huge, math.inf, xf).min())
    hi_f = hi_all if above is None else float(torch.where(huge, -math.inf, xf).max())
    if math.isnan(lo_f) or math.isnan(hi_f):
        return False
    if reset:
        stats.reset()
    for name, count in (("inf_mask_low", low), ("inf_mask_high", high)):
        if count:
            old = getattr(stats, name)
            setattr(stats, name, torch.tensor((0.0 if old is None else float(old)) + count, dtype=_STAT_DTYPE))
    return _apply_extrema(stats, lo_f, hi_f, m, reset, already_reset=True)


def _apply_extrema(stats: TensorStatistics, lo_f: float, hi_f: float, m: float, reset: bool,
                   already_reset: bool = False) -> bool:
    """Fold one batch's extrema into `stats` (scalar arithmetic, as the general path's tensors compute it)."""
    clipped = _clipped(lo_f, hi_f)
    if clipped is None:
        return False
    if reset:
        if not already_reset:
            stats.reset()
        ExtremaState(*clipped, *clipped).store(stats)
    else:
        state = ExtremaState.of(stats)
        state.fold(*clipped, m)
        state.store(stats)
    return True


def _drop_mask_values(stats: TensorStatistics, xf: torch.Tensor,
                      threshold: float) -> Tuple[torch.Tensor, torch.Tensor, Optional[Tuple[float, float]]]:
    """(xf with mask values as NaN, the per-tensor values without them, xf's (min, max) where found without NaN or
    mask values, else None); counts the mask values in `stats`. Without mask values both tensors are `xf` itself. A
    tensor of mask values only keeps them as NaN (it then counts as 0). One min-max pass tells a tensor without mask
    values or NaN (the usual case), and its extrema serve the statistics (`_update_group`)."""
    if xf.numel() == 0:
        return xf, xf, None
    lo, hi = (float(v) for v in torch.aminmax(xf))
    if -threshold < lo and hi < threshold:  # False for NaN: the general checks below
        return xf, xf, (lo, hi)
    if math.isinf(threshold):
        return xf, xf, None
    huge = xf.abs() >= threshold
    if not bool(huge.any()):
        return xf, xf, None
    low = int((huge & (xf < 0)).sum())
    for name, count in (("inf_mask_low", low), ("inf_mask_high", int(huge.sum()) - low)):
        if not count:
            continue
        old = getattr(stats, name)
        setattr(stats, name, torch.tensor((0.0 if old is None else float(old)) + count, dtype=_STAT_DTYPE))
    masked = torch.where(huge, torch.full_like(xf, math.nan), xf)
    rest = xf[~huge]
    return masked, (rest if rest.numel() else masked), None


def update_statistics(stats: TensorStatistics, x: torch.Tensor, cfg: StatisticsConfig,
                      batch_index: int) -> TensorStatistics:
    """Fold batch `x` into `stats` (in place; also returned). `batch_index == 0` (or empty stats) resets them.

    Per-tensor fields are 0-dim float64 tensors, per-channel fields (when `cfg.key_axis` is set and `x` has at
    least one dimension) are (channels,) float64 tensors, histograms (bins,) / (channels, bins) float64 counts.
    An empty `x` leaves `stats` unchanged. The statistics depend on x's values only, not on its memory layout.
    """
    if not isinstance(cfg, StatisticsConfig):
        raise TypeError(f"cfg must be a StatisticsConfig, got {type(cfg).__name__}")
    if x.numel() == 0:
        return stats
    reset = starts_over(stats, batch_index)
    if cfg.extrema_only and _update_extrema_only(stats, x.detach(), cfg.momentum, reset, float(cfg.mask_threshold)):
        return stats  # the fast path: one aminmax and scalar arithmetic, nothing autograd could record
    with torch.no_grad():
        if reset:
            stats.reset()
        xf = apply_trim(x.detach().float(), cfg.trim)
        xf, rest, extrema = _drop_mask_values(stats, xf, float(cfg.mask_threshold))
        _update_group(stats, rest.reshape(1, -1), cfg, reset, "", squeeze=True, extrema=extrema)
        if cfg.key_axis is not None and xf.dim() > 0:
            axis = int(cfg.key_axis)
            if not -xf.dim() <= axis < xf.dim():
                raise ValueError(f"key_axis {axis} out of range for a tensor of shape {tuple(xf.shape)}")
            # from contiguous values: the channel rows' sums then run in one order whatever the layout of x (a
            # layer may return a permuted view at one batch size and not at another)
            per_channel = xf.contiguous().movedim(axis, 0).reshape(xf.shape[axis], -1)
            # a reset clears the per-channel fields too, so they always restart together with the per-tensor ones
            _update_group(stats, per_channel, cfg, reset or stats.extrema_min_key_axis is None, "_key_axis",
                          squeeze=False)
        stats.batches = 1 if reset else stats.batches + 1
    return stats
