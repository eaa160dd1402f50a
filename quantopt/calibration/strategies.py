"""Local calibration strategies (docs/user-guide.md): statistics of one tensor -> its calibrated range (min, max).

`parse_strategy(text)` turns a `calibration_strategy_for_weight/activation` value into a `Strategy`;
`apply_strategy(stats, strategy, qbits, signed, symmetric, ir_range)` returns the range, per tensor (Python floats)
or per channel (float32 tensors along the statistics' key axis), always with the final rule min <= 0 <= max.

Names and meanings are upstream's (the Zhouyi Compass Optimizer):

=========================================  =================================================================
`extrema`                                  min/max over all batches (`extrema_min/max`)
`mean`                                     EMA of per-batch min/max (`running_min/max`)
`in_ir`                                    the IR's range (`layer_top_range`, `weights_range`, ...; passed as
                                           `ir_range`), else the extrema
`Nstd`, e.g. `3std`, `2.5std`              [max(running_min, mean - N*std), min(running_max, mean + N*std)]
                                           (upstream accepts integers only; decimals are an extension)
`[R]percentile`, e.g. `0.9percentile`      **not a percentile**: extrema * R (R defaults to 1.0). The name is
                                           upstream's and is kept for compatibility.
`[N]kld`, e.g. `kld`, `5kld`               TensorRT-style KL-divergence threshold search on the histogram with
                                           2**qbits target bins; plain `kld` -> N = 10 (upstream's code; its
                                           tutorial says 1), `Nkld` -> N = max(2, N); the largest clip among the
                                           N lowest-KL candidates is taken.
`[R]aciq_laplace`, `[R]aciq_gauss`         ACIQ analytic clipping: alpha = table[qbits] * running_mad (Laplace)
                                           or * running_std (Gauss); symmetric: +-(|mean| + R*alpha);
                                           asymmetric: min = max(running_min, mean - alpha), max = min + 2*R*alpha
`weighted_scale_param[r1,r2,r3,r4]`        scale = a*q_range/pos + (1-a)*q_range/neg, range = +-q_range/scale
                                           (or [0, q_range/scale] unsigned), a = r1 if pos > neg else (r2 if
                                           running_std > r4 else r3); plain `weighted_scale_param` uses the
                                           upstream defaults [0.685, 0.875, 0.7175, 0.01965]. r1 > 1 (upstream's
                                           automatic search mode) is not supported: UnsupportedError.
`quantile[P]`, e.g. `quantile[99.99]`      quantopt's own: a true percentile on the accumulated histogram: the
                                           range holding P % of all calibration values (histogram_search.py)
`mse`                                      quantopt's own: the range of least expected squared quantization
                                           error on the histogram, searched over 256 shrinks of the extrema
=========================================  =================================================================

Differences from upstream, all deliberate: an unknown strategy is a `ValueError` listing the valid forms (upstream
warned and fell back to `mean`); a strategy whose statistics were not collected is a `ValueError` (upstream crashed
or used zeros); kld searches on the histogram's own range, `histogram_range(stats)` = the extrema (see
`statistics.py`: histograms of all batches share those edges), where upstream read its per-batch-range EMA
histogram as if it spanned [running_min, running_max] — for a single batch, and for constants, both agree.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

from ..config.calibration_values import (  # the torch-free grammar the cfg reader uses; re-exported here
    STRATEGY_FORMS,
    WEIGHTED_SCALE_PARAM_DEFAULTS,
    Strategy,
    parse_strategy,
)
from ..config.calibration_values import check_not_auto as _check_not_auto
from ..config.calibration_values import invalid_strategy as _invalid
from ..graph.tables import TensorStatistics
from ..threads import one_thread
from .histogram_search import mse_range, quantile_range
from .statistics import histogram_range

__all__ = [
    "ACIQ_GAUSS_ALPHA", "ACIQ_LAPLACE_ALPHA", "STRATEGY_FORMS", "Strategy", "WEIGHTED_SCALE_PARAM_DEFAULTS",
    "apply_strategy", "kld_threshold", "parse_strategy", "statistics_needs",
]

Range = Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]]

# ACIQ (Banner et al., arXiv:1810.05723) optimal clipping value in units of the Laplace b (mean absolute deviation)
# / Gauss sigma, per bit width: the minimum over alpha of clipping noise + alpha^2 / (3 * 4^bits). Values are
# upstream's tables (2 decimals); the tests re-derive them numerically. Bit widths not in the table use the 8-bit
# value, as upstream does.
ACIQ_LAPLACE_ALPHA = {0: 1.05, 1: 1.86, 2: 2.83, 3: 3.89, 4: 5.03, 5: 6.2, 6: 7.41, 7: 8.64, 8: 9.89, 9: 11.16,
                      10: 12.44, 11: 13.73, 12: 15.02, 13: 16.33, 14: 17.64, 15: 18.95, 16: 20.27}
ACIQ_GAUSS_ALPHA = {1: 1.24, 2: 1.71, 3: 2.15, 4: 2.55, 5: 2.93, 6: 3.28, 7: 3.61, 8: 3.92, 9: 4.21, 10: 4.49,
                    11: 4.75, 12: 4.99, 13: 5.24, 14: 5.47, 15: 5.69, 16: 5.89}

_F32_EPS = float(torch.finfo(torch.float32).eps)


def statistics_needs(strategy: Union[str, Strategy]) -> Tuple[bool, bool]:
    """(need_histogram, need_moments) for upstream's time-saving statistics mode."""
    st = parse_strategy(strategy)
    return st.needs_histogram, st.needs_moments


# ---------------------------------------------------------------------------------------------------------------
# KLD


def kld_threshold(hist: torch.Tensor, lo: float, hi: float, target_bins: int, topk: int = 10) -> Tuple[float, float]:
    """TensorRT-style KL threshold search (upstream `tune_min_max_by_kld_v1`) on one histogram over [lo, hi].

    A first window of `target_bins` bins is anchored at the histogram's argmax (at the low end when lo >= 0, at the
    high end when hi <= 0, otherwise centred on the argmax and shifted inside the histogram). Candidate r widens it
    by r bins on both sides (beyond the histogram there are only zeros) until it covers the histogram. For each
    candidate the window is P (the mass outside folded into its two border bins, normalised by the total); Q
    splits P into `target_bins` groups of `len // target_bins` bins (the last group takes the remainder) and gives
    every non-zero bin of a group the group's mean over its non-zero bins. KL(P||Q) is computed for all candidates
    (vectorized with prefix sums: O(candidates * target_bins)); the result is the widest among the `topk` lowest-KL
    candidates, converted back to values. Without enough bins (bins <= target_bins, target_bins < 2) or without
    mass, [lo, hi] itself is returned.
    """
    h = hist.detach().reshape(-1).to(torch.float64).cpu()
    hbins = h.numel()
    lo, hi = float(lo), float(hi)
    with one_thread():  # a full sum over more than 32768 bins would otherwise depend on the thread count
        total = float(h.sum())
    if hbins <= target_bins or target_bins < 2 or not total > 0.0:
        return lo, hi
    tb = int(target_bins)
    interval = (hi - lo) / hbins
    midx = int(torch.argmax(h))
    if lo >= 0:
        lidx, ridx = 0, tb - 1
    elif hi <= 0:
        lidx, ridx = hbins - tb, hbins - 1
    elif midx < hbins - 1 - midx:
        lidx = max(midx - tb // 2, 0)
        ridx = lidx + tb - 1
    else:
        ridx = min(midx + tb // 2, hbins - 1)
        lidx = ridx - (tb - 1)
    steps = max(lidx + 1, hbins - ridx)

    zero = torch.zeros(1, dtype=torch.float64)
    cnt = torch.cat([zero, torch.cumsum(h, 0)])  # cnt[i] = sum h[:i]
    nz = torch.cat([zero, torch.cumsum((h != 0).to(torch.float64), 0)])
    hlogh = torch.where(h > 0, h * torch.log(torch.where(h > 0, h, torch.ones_like(h))), torch.zeros_like(h))
    xlx = torch.cat([zero, torch.cumsum(hlogh, 0)])

    def at(prefix: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return prefix[idx.clamp(0, hbins)]

    r = torch.arange(steps, dtype=torch.long).reshape(-1, 1)  # candidate r: original bins [lidx - r, ridx + r]
    a = lidx - r
    b = ridx + r
    n = tb + 2 * r  # window length
    qi = n // tb  # bins per target group
    w_left = at(cnt, a + 1)  # border bin + everything left of it
    w_right = total - at(cnt, b)  # border bin + everything right of it

    def xlogx(v: torch.Tensor) -> torch.Tensor:
        return torch.where(v > 0, v * torch.log(torch.where(v > 0, v, torch.ones_like(v))), torch.zeros_like(v))

    plogp = xlogx(w_left) + xlogx(w_right) + at(xlx, b) - at(xlx, a + 1)  # sum over the window of w*log(w)

    j = torch.arange(tb, dtype=torch.long).reshape(1, -1)
    start = a + j * qi  # original index of each group's first window position
    end = torch.where(j == tb - 1, b + 1, a + (j + 1) * qi)  # exclusive
    qsum = at(cnt, end) - at(cnt, start)
    qnz = at(nz, end) - at(nz, start)
    # the first / last group hold the border bins, whose values include the outliers
    qsum[:, :1] = at(cnt, end[:, :1])
    qsum[:, -1:] = total - at(cnt, start[:, -1:])
    qnz[:, :1] += (w_left != 0).to(torch.float64) - (at(nz, a + 1) - at(nz, a))
    qnz[:, -1:] += (w_right != 0).to(torch.float64) - (at(nz, b + 1) - at(nz, b))
    eps = _F32_EPS
    qval = qsum / (qnz + eps)
    qlogq = torch.where(qsum > 0, qsum * torch.log(torch.where(qval > 0, qval, torch.ones_like(qval))),
                        torch.zeros_like(qsum)).sum(dim=1, keepdim=True)
    kl = ((plogp - qlogq) / total).reshape(-1)

    # KL values that differ only by float rounding (e.g. windows that only add empty bins) are ties; ties go to the
    # narrower candidate, so the choice is deterministic (upstream's unstable argsort broke them arbitrarily)
    order = torch.sort(torch.round(kl * 1e12), stable=True).indices
    best = int(order[:topk].max())
    lval = lo + max(lidx - best, 0) * interval
    rval = hi - (hbins - 1 - min(ridx + best, hbins - 1)) * interval
    return lval, rval


# ---------------------------------------------------------------------------------------------------------------
# apply


def _need(stats: TensorStatistics, strategy: Strategy, *names: str) -> Tuple[torch.Tensor, ...]:
    values = tuple(getattr(stats, name) for name in names)
    missing = [name for name, v in zip(names, values) if v is None]
    if missing:
        raise ValueError(f"calibration strategy '{strategy}' needs statistics {', '.join(missing)}, which were not "
                         "collected (update_statistics with need_moments / need_histogram / key_axis as required)")
    return values


def _f(v: Union[float, torch.Tensor]) -> float:
    return float(v)


def _aciq_alpha(strategy: Strategy, qbits: int) -> float:
    table = ACIQ_LAPLACE_ALPHA if strategy.name == "aciq_laplace" else ACIQ_GAUSS_ALPHA
    return table.get(int(qbits), table[8])


def _weighted_scale_range(running_min: float, running_max: float, running_std: float, qbits: int, signed: bool,
                          params: Sequence[float]) -> Tuple[float, float]:
    """Non-automatic `weighted_scale_param` (float32 arithmetic, as upstream)."""
    q_range = float(2 ** int(qbits) - 1)  # q_max - q_min for both signed and unsigned
    pos = torch.tensor(abs(max(0.0, running_max)), dtype=torch.float32)
    neg = torch.tensor(abs(min(0.0, running_min)), dtype=torch.float32)
    q_ranges = q_range * torch.ones_like(pos)
    f_pos = torch.where(pos < _F32_EPS, q_ranges, pos)
    f_neg = torch.where(neg < _F32_EPS, q_ranges, neg)
    s_pos, s_neg = q_ranges / f_pos, q_ranges / f_neg
    if bool(pos > neg):
        alpha = params[0]
    else:
        alpha = params[1] if running_std > params[3] else params[2]
    scale = alpha * s_pos + (1 - alpha) * s_neg
    fmax = q_ranges / scale
    fmin = -fmax if signed else fmax - fmax
    return fmin.item(), fmax.item()


def _histogram_search(st: Strategy, hist: torch.Tensor, lo: float, hi: float, qbits: int,
                      symmetric: bool) -> Tuple[float, float]:
    if st.name == "quantile":
        return quantile_range(hist, lo, hi, st.value, symmetric)
    return mse_range(hist, lo, hi, qbits, symmetric)


def _per_tensor(stats: TensorStatistics, st: Strategy, qbits: int, signed: Optional[bool], symmetric: bool,
                ir_range: Optional[Sequence[float]]) -> Tuple[float, float]:
    name = st.name
    if name == "extrema":
        lo, hi = _need(stats, st, "extrema_min", "extrema_max")
        return _f(lo), _f(hi)
    if name == "in_ir":
        if ir_range is not None:
            return _f(ir_range[0]), _f(ir_range[1])
        lo, hi = _need(stats, st, "extrema_min", "extrema_max")
        return _f(lo), _f(hi)
    if name == "mean":
        lo, hi = _need(stats, st, "running_min", "running_max")
        return _f(lo), _f(hi)
    if name == "percentile":
        lo, hi = _need(stats, st, "extrema_min", "extrema_max")
        return _f(lo) * st.value, _f(hi) * st.value
    if name == "std":
        rmin, rmax, mean, std = (_f(v) for v in _need(stats, st, "running_min", "running_max", "running_mean",
                                                      "running_std"))
        return max(rmin, mean - st.value * std), min(rmax, mean + st.value * std)
    if name == "kld":
        (hist,) = _need(stats, st, "running_histc")
        lo, hi = histogram_range(stats)
        return kld_threshold(hist, _f(lo), _f(hi), 2 ** int(qbits), int(st.value))
    if name in ("quantile", "mse"):
        (hist,) = _need(stats, st, "running_histc")
        lo, hi = histogram_range(stats)
        return _histogram_search(st, hist, _f(lo), _f(hi), qbits, symmetric)
    if name in ("aciq_laplace", "aciq_gauss"):
        spread = "running_mad" if name == "aciq_laplace" else "running_std"
        rmin, mean, dev = (_f(v) for v in _need(stats, st, "running_min", "running_mean", spread))
        alpha = _aciq_alpha(st, qbits) * dev
        if symmetric:
            c = abs(mean) + alpha * st.value
            return -c, c
        lo = max(rmin, mean - alpha)
        return lo, lo + 2.0 * alpha * st.value
    if name == "weighted_scale_param":
        _check_not_auto(st)
        rmin, rmax, std, emin = (_f(v) for v in _need(stats, st, "running_min", "running_max", "running_std",
                                                      "extrema_min"))
        is_signed = emin < 0.0 if signed is None else bool(signed)
        return _weighted_scale_range(rmin, rmax, std, qbits, is_signed, st.params)
    raise _invalid(st.text or name)


def _per_channel(stats: TensorStatistics, st: Strategy, qbits: int, symmetric: bool,
                 ir_range: Optional[Sequence[Union[float, torch.Tensor]]]) -> Tuple[torch.Tensor, torch.Tensor]:
    name = st.name
    if name == "in_ir" and ir_range is not None and isinstance(ir_range[0], torch.Tensor) and ir_range[0].dim() > 0:
        return ir_range[0].to(torch.float64), ir_range[1].to(torch.float64)
    if name in ("extrema", "in_ir"):
        return _need(stats, st, "extrema_min_key_axis", "extrema_max_key_axis")
    if name in ("mean", "weighted_scale_param"):
        # upstream's weighted_scale_param only computes the per-tensor range; per channel it uses running min/max
        if name == "weighted_scale_param":
            _check_not_auto(st)
        return _need(stats, st, "running_min_key_axis", "running_max_key_axis")
    if name == "percentile":
        lo, hi = _need(stats, st, "extrema_min_key_axis", "extrema_max_key_axis")
        return lo * st.value, hi * st.value
    if name == "std":
        rmin, rmax, mean, std = _need(stats, st, "running_min_key_axis", "running_max_key_axis",
                                      "running_mean_key_axis", "running_std_key_axis")
        return torch.maximum(rmin, mean - st.value * std), torch.minimum(rmax, mean + st.value * std)
    if name == "kld":
        if stats.running_histc_key_axis is None:
            # upstream: without per-channel histograms the per-channel range is the running range
            return _need(stats, st, "running_min_key_axis", "running_max_key_axis")
        lo, hi = histogram_range(stats, per_channel=True)
        hists = stats.running_histc_key_axis
        # one search per channel: each has its own window geometry; each search is vectorized inside
        pairs = [kld_threshold(hists[c], float(lo[c]), float(hi[c]), 2 ** int(qbits), int(st.value))
                 for c in range(hists.shape[0])]
        return (torch.tensor([p[0] for p in pairs], dtype=torch.float64, device=hists.device),
                torch.tensor([p[1] for p in pairs], dtype=torch.float64, device=hists.device))
    if name in ("quantile", "mse"):
        (hists,) = _need(stats, st, "running_histc_key_axis")
        lo, hi = histogram_range(stats, per_channel=True)
        pairs = [_histogram_search(st, hists[c], float(lo[c]), float(hi[c]), qbits, symmetric)
                 for c in range(hists.shape[0])]
        return (torch.tensor([p[0] for p in pairs], dtype=torch.float64, device=hists.device),
                torch.tensor([p[1] for p in pairs], dtype=torch.float64, device=hists.device))
    if name in ("aciq_laplace", "aciq_gauss"):
        spread = "running_mad_key_axis" if name == "aciq_laplace" else "running_std_key_axis"
        rmin, mean, dev = _need(stats, st, "running_min_key_axis", "running_mean_key_axis", spread)
        alpha = _aciq_alpha(st, qbits) * dev
        if symmetric:
            c = mean.abs() + alpha * st.value
            return -c, c
        lo = torch.maximum(rmin, mean - alpha)
        return lo, lo + 2.0 * alpha * st.value
    raise _invalid(st.text or name)


def apply_strategy(stats: TensorStatistics, strategy: Union[str, Strategy], qbits: int,
                   signed: Optional[bool] = None, symmetric: bool = False,
                   ir_range: Optional[Sequence[Union[float, torch.Tensor]]] = None, *,
                   per_channel: Optional[bool] = None) -> Range:
    """Calibrated range of one tensor from its statistics, with min <= 0 <= max.

    qbits: the tensor's bit width (kld target bins 2**qbits, ACIQ table row, weighted_scale_param q range).
    signed: only used by weighted_scale_param; None decides as upstream (signed iff extrema_min < 0).
    symmetric: the quantization mode is symmetric (ACIQ). ir_range: (min, max) from the IR for `in_ir`.
    per_channel: False -> per-tensor range as two floats; True -> per-channel ranges as float32 tensors (needs the
    `*_key_axis` statistics); None -> per channel exactly when per-channel statistics exist.
    """
    st = parse_strategy(strategy)
    if per_channel is None:
        per_channel = stats.extrema_min_key_axis is not None
    if per_channel:
        lo, hi = _per_channel(stats, st, qbits, symmetric, ir_range)
        lo = torch.minimum(lo.to(torch.float32), torch.zeros_like(lo, dtype=torch.float32))
        hi = torch.maximum(hi.to(torch.float32), torch.zeros_like(hi, dtype=torch.float32))
        return lo, hi
    lo_f, hi_f = _per_tensor(stats, st, qbits, signed, symmetric, ir_range)
    if math.isnan(lo_f) or math.isnan(hi_f):
        raise ValueError(f"calibration strategy '{st}' produced a NaN range ({lo_f}, {hi_f})")
    return min(lo_f, 0.0), max(hi_f, 0.0)
