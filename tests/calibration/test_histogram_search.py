"""The histogram range searches: `quantile[P]` (a true percentile) and `mse` (least expected quantization error),
checked on hand-computed histograms and against numpy on the raw data they summarise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantopt.calibration.histogram_search import mse_range, quantile_range
from quantopt.calibration.statistics import StatisticsConfig, update_statistics
from quantopt.calibration.strategies import apply_strategy, parse_strategy, statistics_needs
from quantopt.graph.tables import TensorStatistics

BINS = 2048


def _hist(x: np.ndarray, bins: int = BINS):
    lo, hi = float(x.min()), float(x.max())
    h, _ = np.histogram(x, bins=bins, range=(lo, hi))
    return torch.from_numpy(h.astype(np.float64)), lo, hi


def _stats(batches, key_axis=None) -> TensorStatistics:
    cfg = StatisticsConfig(histc_bins=BINS, need_histogram=True, key_axis=key_axis)
    s = TensorStatistics()
    for i, b in enumerate(batches):
        update_statistics(s, torch.as_tensor(b), cfg, i)
    return s


# ---------------------------------------------------------------------------------------------- golden vectors
def test_quantile_golden_two_spikes():
    """10 values in bin [1, 2) and 10 in [9, 10): 90% leaves 1 value out on each side, 0.1 bin into each spike."""
    h = torch.tensor([0, 10, 0, 0, 0, 0, 0, 0, 0, 10], dtype=torch.float64)
    assert quantile_range(h, 0.0, 10.0, 90.0, symmetric=False) == pytest.approx((1.1, 9.9))
    assert quantile_range(h, 0.0, 10.0, 100.0, symmetric=False) == (0.0, 10.0)


def test_quantile_golden_symmetric():
    """Bins of width 1 on [-4, 4]: 2 values in [-4, -3), 8 in [0, 1), 10 in total. 80% leaves 2 out: t = 3 (the
    mass below -t reaches 2 exactly at t = 3)."""
    h = torch.tensor([2, 0, 0, 0, 8, 0, 0, 0], dtype=torch.float64)
    lo, hi = quantile_range(h, -4.0, 4.0, 80.0, symmetric=True)
    assert (lo, hi) == pytest.approx((-3.0, 3.0), abs=1e-9)


def test_empty_or_degenerate_histograms_keep_the_range():
    z = torch.zeros(16, dtype=torch.float64)
    assert quantile_range(z, -1.0, 2.0, 99.0, False) == (-1.0, 2.0)
    assert mse_range(z, -1.0, 2.0, 8, False) == (-1.0, 2.0)
    with pytest.raises(ValueError, match="percent"):
        quantile_range(z, -1.0, 2.0, 0.0, False)


# ---------------------------------------------------------------------------------------------- against numpy
@pytest.mark.parametrize("percent", [50.0, 99.0, 99.99])
def test_quantile_matches_numpy_within_a_bin(percent):
    x = np.random.default_rng(0).standard_normal(200_000) * 3 + 1
    h, lo, hi = _hist(x)
    width = (hi - lo) / BINS
    q_lo, q_hi = quantile_range(h, lo, hi, percent, symmetric=False)
    tail = (100 - percent) / 2
    assert q_lo == pytest.approx(np.percentile(x, tail), abs=width)
    assert q_hi == pytest.approx(np.percentile(x, 100 - tail), abs=width)
    s_lo, s_hi = quantile_range(h, lo, hi, percent, symmetric=True)
    assert s_hi == -s_lo == pytest.approx(np.percentile(np.abs(x), percent), abs=width)


def _quant_mse(x: np.ndarray, lo: float, hi: float, bits: int) -> float:
    step = (hi - lo) / (2 ** bits - 1)
    q = np.round((np.clip(x, lo, hi) - lo) / step) * step + lo
    return float(np.mean((x - q) ** 2))


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_range_is_near_the_brute_force_optimum(symmetric):
    """Laplace data (a heavy tail): the extrema waste the grid; the searched range's true error on the raw data is
    within 1% of the best of 400 ranges tried directly on the data, and well below the extrema's; symmetric, the
    clip lands near the analytic optimum for 8 bits (9.89 b, Banner et al.)."""
    rng = np.random.default_rng(1)
    x = rng.laplace(0.2, 1.0, 200_000)
    h, lo, hi = _hist(x)
    r_lo, r_hi = mse_range(h, lo, hi, 8, symmetric)
    amax = max(-lo, hi)
    tries = []
    for f in np.linspace(0.0025, 1.0, 400):
        c_lo, c_hi = (-f * amax, f * amax) if symmetric else (f * lo, f * hi)
        tries.append(_quant_mse(x, c_lo, c_hi, 8))
    found = _quant_mse(x, r_lo, r_hi, 8)
    assert found <= 1.01 * min(tries)
    assert found < 0.85 * _quant_mse(x, lo, hi, 8)
    if symmetric:
        assert r_lo == -r_hi and 9.0 < r_hi < 10.5


def test_mse_on_a_uniform_histogram_keeps_nearly_the_whole_range():
    """Uniform data: clipping more than a fraction of a grid step only adds error."""
    h = torch.full((BINS,), 10.0, dtype=torch.float64)
    assert mse_range(h, -1.0, 3.0, 8, symmetric=False) == pytest.approx((-1.0, 3.0), rel=0.01)


# ---------------------------------------------------------------------------------------------- as strategies
def test_strategies_parse_and_ask_for_the_histogram():
    assert str(parse_strategy("quantile")) == "quantile[99.99]"
    assert str(parse_strategy(" Quantile[ 99.9 ] ")) == "quantile[99.9]"
    assert statistics_needs("quantile[99]") == (True, False)
    assert statistics_needs("mse") == (True, False)
    with pytest.raises(ValueError, match=r"quantile percent must be in \(0, 100\]"):
        parse_strategy("quantile[120]")


def test_quantile_strategy_over_batches_per_tensor_and_per_channel():
    rng = np.random.default_rng(2)
    data = rng.standard_normal((8, 4, 5000)).astype(np.float32) * np.array([1, 2, 4, 8], np.float32).reshape(1, 4, 1)
    stats = _stats([data[i] for i in range(8)], key_axis=0)
    lo, hi = apply_strategy(stats, "quantile[99]", 8, per_channel=False)
    flat = data.reshape(-1)
    width = float(flat.max() - flat.min()) / BINS
    assert lo == pytest.approx(np.percentile(flat, 0.5), abs=2 * width)
    assert hi == pytest.approx(np.percentile(flat, 99.5), abs=2 * width)
    c_lo, c_hi = apply_strategy(stats, "quantile[99]", 8, per_channel=True)
    for c in range(4):
        ch = data[:, c].reshape(-1)
        w = float(ch.max() - ch.min()) / BINS
        assert float(c_hi[c]) == pytest.approx(np.percentile(ch, 99.5), abs=2 * w)
        assert float(c_lo[c]) == pytest.approx(np.percentile(ch, 0.5), abs=2 * w)


def test_mse_strategy_per_tensor_clips_the_tail():
    x = np.random.default_rng(3).laplace(0, 1, 200_000).astype(np.float32)
    stats = _stats([x[:100_000], x[100_000:]])
    lo, hi = apply_strategy(stats, "mse", 8, symmetric=True, per_channel=False)
    assert 8.5 < hi < 11 and lo == -hi < 0 and hi < float(np.abs(x).max())


def test_sample_order_moves_the_histogram_ranges_by_at_most_a_few_bins():
    """Extrema do not depend on the order of the calibration batches; the accumulated histogram does only through
    re-binning when a batch widens the range (mass moves by at most one old bin), so quantile and mse ranges move by
    a few bins at most (docs/statistics-and-dump.md, "Sample order")."""
    rng = np.random.default_rng(4)
    batches = [rng.laplace(0, s, 4000).astype(np.float32) for s in (0.5, 1, 2, 4, 8, 1, 3)]
    ranges = {}
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [4, 0, 6, 2, 1, 5, 3]):
        stats = _stats([batches[i] for i in order])
        width = float(stats.extrema_max - stats.extrema_min) / BINS
        ranges[tuple(order)] = (float(stats.extrema_min), float(stats.extrema_max),
                                apply_strategy(stats, "quantile[99.9]", 8, per_channel=False),
                                apply_strategy(stats, "mse", 8, symmetric=True, per_channel=False))
    first = next(iter(ranges.values()))
    for lo, hi, q, m in ranges.values():
        assert (lo, hi) == first[:2]
        assert q == pytest.approx(first[2], abs=3 * width)
        assert m == pytest.approx(first[3], abs=3 * width)
