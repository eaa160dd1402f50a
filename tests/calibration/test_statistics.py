"""Streaming statistics: EMA semantics, extrema, histograms on common edges, per-channel, trimming."""
from __future__ import annotations

import math
from typing import List

import pytest
import torch

from quantopt.calibration import (
    STAT_INT_MAX,
    StatisticsConfig,
    Trim,
    apply_trim,
    histogram_range,
    parse_trim,
    rebin_histogram,
    update_statistics,
)
from quantopt.graph.tables import TensorStatistics


def _run(batches, cfg, stats=None):
    stats = stats if stats is not None else TensorStatistics()
    for i, b in enumerate(batches):
        update_statistics(stats, b, cfg, i)
    return stats


def _f(t):
    return float(t)


# --- EMA and extrema -------------------------------------------------------------------------------------------


def test_ema_hand_computed():
    b0 = torch.tensor([1.0, 2.0, 3.0])
    b1 = torch.tensor([0.0, 5.0])
    b2 = torch.tensor([-1.0, 2.0, 4.0])
    s = _run([b0, b1, b2], StatisticsConfig(momentum=0.9))
    assert _f(s.running_min) == pytest.approx(0.9 * (0.9 * 1 + 0.1 * 0) + 0.1 * -1)  # 0.71
    assert _f(s.running_max) == pytest.approx(0.9 * (0.9 * 3 + 0.1 * 5) + 0.1 * 4)  # 3.28
    m0, m1, m2 = 2.0, 2.5, 5.0 / 3.0
    assert _f(s.running_mean) == pytest.approx(0.9 * (0.9 * m0 + 0.1 * m1) + 0.1 * m2)
    sd = [float(torch.std(b)) for b in (b0, b1, b2)]  # unbiased
    assert sd[0] == pytest.approx(1.0)
    assert _f(s.running_std) == pytest.approx(0.9 * (0.9 * sd[0] + 0.1 * sd[1]) + 0.1 * sd[2])
    mad = [float((b - b.mean()).abs().mean()) for b in (b0, b1, b2)]
    assert mad[0] == pytest.approx(2.0 / 3.0)
    assert _f(s.running_mad) == pytest.approx(0.9 * (0.9 * mad[0] + 0.1 * mad[1]) + 0.1 * mad[2])
    assert _f(s.extrema_min) == -1.0 and _f(s.extrema_max) == 5.0
    assert s.batches == 3


def test_momentum_zero_and_one():
    batches = [torch.tensor([1.0, 3.0]), torch.tensor([-2.0, 7.0])]
    last = _run(batches, StatisticsConfig(momentum=0.0))
    assert (_f(last.running_min), _f(last.running_max)) == (-2.0, 7.0)
    first = _run(batches, StatisticsConfig(momentum=1.0))  # batch 0 still resets
    assert (_f(first.running_min), _f(first.running_max)) == (1.0, 3.0)


def test_batch_zero_resets():
    cfg = StatisticsConfig(need_histogram=True, histc_bins=16, key_axis=0)
    torch.manual_seed(0)
    s = _run([torch.randn(3, 10) * 5 for _ in range(4)], cfg)
    x = torch.randn(3, 10)
    update_statistics(s, x, cfg, 0)
    fresh = _run([x], cfg)
    for name in fresh.__dataclass_fields__:
        a, b = getattr(s, name), getattr(fresh, name)
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name
    assert _f(s.running_min) == _f(x.min()) and _f(s.running_mean) == pytest.approx(_f(x.mean()), abs=1e-6)


def test_extrema_over_batches_and_int32_clip():
    s = _run([torch.tensor([0.5, 1.0]), torch.tensor([-3.0, 0.0]), torch.tensor([2.0, 2.5])], StatisticsConfig())
    assert (_f(s.extrema_min), _f(s.extrema_max)) == (-3.0, 2.5)
    big = _run([torch.tensor([-1e12, 0.0, 1e12, math.inf])], StatisticsConfig(need_histogram=True, histc_bins=8))
    assert _f(big.extrema_max) == STAT_INT_MAX and _f(big.extrema_min) == -(2.0 ** 31)
    assert _f(big.running_max) == STAT_INT_MAX
    assert _f(big.running_histc.sum()) == 3.0  # out-of-range values are counted in the border bins; inf is a mask
    assert _f(big.inf_mask_high) == 1.0         # value, left out (tests/test_inf_mask.py)
    no_mask = _run([torch.tensor([-1e12, 0.0, 1e12, math.inf])],
                   StatisticsConfig(need_histogram=True, histc_bins=8, mask_threshold=math.inf))
    assert _f(no_mask.running_histc.sum()) == 4.0 and no_mask.inf_mask_high is None


def test_nan_rules():
    s = _run([torch.tensor([4.0])], StatisticsConfig())
    assert _f(s.running_std) == 1.0  # unbiased std of one value is NaN -> 1
    s = _run([torch.tensor([1.0, math.nan, -2.0])], StatisticsConfig(need_histogram=True, histc_bins=4))
    assert (_f(s.extrema_min), _f(s.extrema_max)) == (-2.0, 1.0)  # NaN ignored for the range
    assert _f(s.running_mean) == 0.0 and _f(s.running_mad) == 0.0 and _f(s.running_std) == 1.0
    assert _f(s.running_histc.sum()) == 2.0
    s = _run([torch.full((3,), math.nan)], StatisticsConfig())
    assert (_f(s.extrema_min), _f(s.extrema_max)) == (0.0, 0.0)


def test_time_saving_switches_and_empty():
    s = _run([torch.randn(10)], StatisticsConfig(need_moments=False))
    assert s.running_mean is None and s.running_std is None and s.running_histc is None
    assert s.running_min is not None
    before = _run([torch.tensor([1.0, 2.0])], StatisticsConfig())
    update_statistics(before, torch.empty(0), StatisticsConfig(), 1)
    assert before.batches == 1 and _f(before.extrema_max) == 2.0


def test_state_size_independent_of_batch_count():
    torch.manual_seed(0)
    cfg = StatisticsConfig(need_histogram=True, histc_bins=64, key_axis=1)

    def sizes(n):
        s = _run([torch.randn(2, 3, 8) * (1 + i) for i in range(n)], cfg)
        return {k: getattr(s, k).numel() for k in s.__dataclass_fields__ if isinstance(getattr(s, k), torch.Tensor)}, s

    small, _ = sizes(2)
    large, s = sizes(40)
    assert small == large
    assert large["running_histc"] == 64 and large["running_histc_key_axis"] == 3 * 64
    assert _f(s.running_histc.sum()) == pytest.approx(40 * 48)
    assert torch.allclose(s.running_histc_key_axis.sum(dim=1), torch.full((3,), 40.0 * 16, dtype=torch.float64))


# --- histograms ------------------------------------------------------------------------------------------------


def test_rebin_exact_cases():
    h = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    lo, hi = torch.tensor(0.0), torch.tensor(4.0)
    assert torch.equal(rebin_histogram(h, lo, hi, torch.tensor(0.0), torch.tensor(8.0)),
                       torch.tensor([3.0, 7.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(rebin_histogram(h, lo, hi, torch.tensor(-4.0), torch.tensor(4.0)),
                       torch.tensor([0.0, 0.0, 3.0, 7.0], dtype=torch.float64))
    # not aligned: counts spread uniformly inside old bins: edges 0, .75, 1.5 over old bins [0,.5), [.5,1)
    out = rebin_histogram(torch.tensor([2.0, 2.0], dtype=torch.float64), torch.tensor(0.0), torch.tensor(1.0),
                          torch.tensor(0.0), torch.tensor(1.5))
    assert torch.allclose(out, torch.tensor([3.0, 1.0], dtype=torch.float64))
    # unchanged rows stay bit-identical, changed rows conserve their totals
    rows = torch.rand(3, 10, dtype=torch.float64)
    new = rebin_histogram(rows, torch.zeros(3), torch.ones(3), torch.tensor([0.0, -1.0, -0.3]),
                          torch.tensor([1.0, 1.0, 2.7]))
    assert torch.equal(new[0], rows[0])
    assert torch.allclose(new.sum(dim=1), rows.sum(dim=1))


def test_histogram_spans_extrema_and_matches_one_shot():
    torch.manual_seed(0)
    bins = 128
    batches = [torch.randn(5000) * (0.5 + 0.5 * i) + 0.1 * i for i in range(6)]
    s = _run(batches, StatisticsConfig(need_histogram=True, histc_bins=bins))
    allx = torch.cat(batches)
    lo, hi = histogram_range(s)
    assert (_f(lo), _f(hi)) == (_f(allx.min()), _f(allx.max()))
    assert _f(s.running_histc.sum()) == pytest.approx(allx.numel())  # counts conserved through re-binning
    ref = torch.histc(allx.double(), bins, _f(lo), _f(hi))
    cdf_err = (torch.cumsum(s.running_histc, 0) - torch.cumsum(ref, 0)).abs().max() / allx.numel()
    assert cdf_err < 0.01  # only within-bin redistribution of re-binned counts
    assert (s.running_histc - ref).abs().sum() / allx.numel() < 0.1


def test_histogram_without_range_growth_is_exact():
    torch.manual_seed(1)
    ends = torch.tensor([-3.0, 3.0])
    batches = [torch.cat([ends, torch.randn(3000).clamp(-2.9, 2.9)]) for _ in range(4)]
    s = _run(batches, StatisticsConfig(need_histogram=True, histc_bins=64))
    ref = torch.histc(torch.cat(batches).double(), 64, -3.0, 3.0)
    assert (s.running_histc - ref).abs().sum() <= 2  # same edges: at most float ties at bin edges


def test_histogram_ema_mode():
    cfg = StatisticsConfig(need_histogram=True, histc_bins=2, histogram_mode="ema", momentum=0.5)
    s = _run([torch.tensor([0.0, 0.1, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.0, 1.0])], cfg)
    assert torch.allclose(s.running_histc, torch.tensor([0.5 * 2 + 0.5 * 3, 0.5 * 2 + 0.5 * 1], dtype=torch.float64))


def test_degenerate_range_histogram():
    s = _run([torch.full((5,), 2.0)], StatisticsConfig(need_histogram=True, histc_bins=4))
    lo, hi = histogram_range(s)
    assert (_f(lo), _f(hi)) == (2.0, 2.0 + 1.0 + 1.0)  # upstream: [lo, lo + |lo|/2 + 1]
    assert s.running_histc.tolist() == [5.0, 0.0, 0.0, 0.0]
    update_statistics(s, torch.tensor([0.0, 1.0]), StatisticsConfig(need_histogram=True, histc_bins=4), 1)
    assert _f(s.running_histc.sum()) == pytest.approx(7.0)


# --- per channel -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_equals_per_tensor_on_slices(axis):
    torch.manual_seed(2)
    cfg = StatisticsConfig(need_histogram=True, histc_bins=32, key_axis=axis, momentum=0.8)
    batches = [torch.randn(4, 3, 6) * torch.arange(1, 7).float() * (1 + i) for i in range(3)]
    s = _run(batches, cfg)
    channels = batches[0].shape[axis]
    per = StatisticsConfig(need_histogram=True, histc_bins=32, momentum=0.8)
    for c in range(channels):
        ref = _run([b.select(axis, c) for b in batches], per)
        for name in ("extrema_min", "extrema_max", "running_min", "running_max"):
            assert _f(getattr(s, name + "_key_axis")[c]) == _f(getattr(ref, name)), name
        for name in ("running_mean", "running_std", "running_mad"):
            assert _f(getattr(s, name + "_key_axis")[c]) == pytest.approx(_f(getattr(ref, name)), rel=1e-5, abs=1e-6)
        assert torch.allclose(s.running_histc_key_axis[c], ref.running_histc, atol=1e-9)
    # the per-tensor statistics are kept alongside
    assert _f(s.extrema_max) == max(_f(b.max()) for b in batches)


def test_per_channel_errors():
    cfg = StatisticsConfig(key_axis=1)
    s = _run([torch.zeros(2, 3)], cfg)
    with pytest.raises(ValueError, match="channels"):
        update_statistics(s, torch.zeros(2, 4), cfg, 1)
    with pytest.raises(ValueError, match="key_axis"):
        update_statistics(TensorStatistics(), torch.zeros(2, 3), StatisticsConfig(key_axis=2), 0)
    scalar = _run([torch.tensor(3.0)], cfg)  # 0-dim tensors have no channels (as upstream)
    assert scalar.extrema_min_key_axis is None and _f(scalar.extrema_min) == 3.0


# --- trimming ---------------------------------------------------------------------------------------------------


def test_parse_trim():
    assert parse_trim("clip(-inf, inf)") == Trim("clip", -math.inf, math.inf)
    assert parse_trim(" SECOND( -65504 , 65504. ) ") == ("second", -65504.0, 65504.0)
    assert parse_trim("clip(-1e3,+2.5)") == ("clip", -1000.0, 2.5)
    assert parse_trim("") is None and parse_trim(None) is None
    for bad in ("clip(1, 2)", "clip(-2, -1)", "cut(-1, 1)", "clip(-1)", "second(min, max)", "clip(-1, 1) x"):
        with pytest.raises(ValueError):
            parse_trim(bad)
    assert StatisticsConfig(trim="clip(-1, 1)").trim == Trim("clip", -1.0, 1.0)
    assert StatisticsConfig(trim=("second", -5, 5)).trim == Trim("second", -5.0, 5.0)
    with pytest.raises(ValueError):
        StatisticsConfig(trim=("clip", 1, 2))


def test_trim_clip_and_second():
    x = torch.tensor([-100.0, -3.0, 0.0, 5.0, 200.0])
    assert apply_trim(x, Trim("clip", -10.0, 10.0)).tolist() == [-10.0, -3.0, 0.0, 5.0, 10.0]
    assert apply_trim(x, Trim("second", -10.0, 10.0)).tolist() == [-3.0, -3.0, 0.0, 5.0, 5.0]
    # values exactly at the bounds count as outliers for 'second'
    assert apply_trim(torch.tensor([-10.0, -1.0, 2.0, 10.0]), Trim("second", -10.0, 10.0)).tolist() == \
        [-1.0, -1.0, 2.0, 2.0]
    assert apply_trim(x, Trim("clip", -math.inf, math.inf)) is x
    s = _run([torch.tensor([-math.inf, 1.0, 2.0, math.inf])], StatisticsConfig(trim="second(-1e30, 1e30)"))
    assert (_f(s.extrema_min), _f(s.extrema_max)) == (0.0, 2.0)  # trimmed values first count as 0 (upstream)
    s = _run([x], StatisticsConfig(trim="clip(-10, 10)", key_axis=0))
    assert _f(s.extrema_max) == 10.0 and s.extrema_max_key_axis.tolist() == [-10.0, -3.0, 0.0, 5.0, 10.0]


def test_config_validation():
    with pytest.raises(ValueError):
        StatisticsConfig(momentum=1.5)
    with pytest.raises(ValueError):
        StatisticsConfig(histc_bins=0)
    with pytest.raises(ValueError):
        StatisticsConfig(histogram_mode="mean")
    with pytest.raises(TypeError):
        update_statistics(TensorStatistics(), torch.zeros(2), {"momentum": 0.9}, 0)


def test_mask_values_take_the_fast_path_with_the_general_paths_results() -> None:
    """A batch holding attention-mask values (-inf, finfo.min) under the default strategies is folded without
    building the tensor of its other values; extrema, running extrema, mask counts and batch counts are those of the
    general path (which moments force), over batches with and without mask values, NaN and all-mask batches."""
    from quantopt.calibration.statistics import StatisticsConfig, TensorStatistics, update_statistics

    g = torch.Generator().manual_seed(4)
    batches = []
    for i in range(6):
        x = torch.randn(2, 4, 8, 8, generator=g) * (i + 1)
        if i in (0, 2, 3):
            x[..., 5:] = torch.finfo(torch.float32).min if i != 2 else -math.inf
        if i == 3:
            x[0, 0, 0, 0] = math.inf
        if i == 4:  # mask values on the high side only
            x[..., :2] = math.inf
        if i == 5:
            x[1, :, :, 7] = torch.finfo(torch.float32).max
        batches.append(x)
    batches.append(torch.full((2, 3), -math.inf))
    batches.append(torch.tensor([[math.inf, -math.inf, 2.0, math.nan]]))  # NaN among the other values
    fast, general = TensorStatistics(), TensorStatistics()
    for i, x in enumerate(batches):
        update_statistics(fast, x, StatisticsConfig(need_moments=False), i)
        update_statistics(general, x, StatisticsConfig(need_moments=True), i)
        for name in ("extrema_min", "extrema_max", "running_min", "running_max", "inf_mask_low", "inf_mask_high"):
            a, b = getattr(fast, name), getattr(general, name)
            assert (a is None and b is None) or torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (i, name)
        assert fast.batches == general.batches
    assert float(fast.inf_mask_low) == 3 * (2 * 4 * 8 * 3) + 6 + 1
    assert float(fast.inf_mask_high) == 1 + 2 * 4 * 8 * 2 + 4 * 8 + 1


@pytest.mark.parametrize("case", ["normal", "edges", "constant", "clipped", "several_steps"])
def test_row_binning_gives_the_general_paths_counts(case: str) -> None:
    """One row without NaN is binned a cache-sized step at a time in a reused float64 buffer (`_bin_counts_row`):
    the same counts as the general path, whose float64 copy of the whole row it replaces; values on bin edges, at
    the range ends, beyond the range (clipped extrema), a constant row and a row of several steps included."""
    from quantopt.calibration import statistics as st

    g = torch.Generator().manual_seed(7)
    x = torch.randn(50_000, generator=g)
    lo, hi = torch.tensor([float(x.min())], dtype=torch.float64), torch.tensor([float(x.max())], dtype=torch.float64)
    if case == "edges":  # exactly on the edges of a 2048-bin grid over [-1, 1], and both ends
        x = torch.linspace(-1.0, 1.0, 2049).repeat(3)
        lo, hi = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    elif case == "constant":
        x = torch.full((1000,), 3.5)
        lo, hi = st._degenerate_fix(torch.tensor([3.5], dtype=torch.float64), torch.tensor([3.5], dtype=torch.float64))
    elif case == "clipped":  # values beyond the range go to the border bins
        lo, hi = torch.tensor([-0.5], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64)
    elif case == "several_steps":
        x = torch.randn(3 * st.BIN_STEP + 123, generator=g) * 1e4
        lo, hi = torch.tensor([float(x.min())], dtype=torch.float64), torch.tensor([float(x.max())],
                                                                                   dtype=torch.float64)
    general = st._bin_counts(x.reshape(1, -1), lo, hi, 2048)
    fast = st._bin_counts(x.reshape(1, -1), lo, hi, 2048, no_nan=True)
    assert torch.equal(fast, general) and float(fast.sum()) == x.numel()


def test_histogram_statistics_take_the_row_path_with_the_same_results(monkeypatch) -> None:
    """`update_statistics` with a histogram strategy: the per-tensor row path (the extrema found by the mask check,
    the streamed binning) gives every field the general path gives, batch after batch, a batch holding NaN
    included (that one takes the general path)."""
    from quantopt.calibration import statistics as st

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 33, 17, generator=g) * (i + 1) for i in range(3)]
    batches[1][0, 0, 0] = math.nan
    cfg = StatisticsConfig(need_histogram=True, need_moments=True, key_axis=-1)
    rows: List[int] = []
    row_path = st._bin_counts_row
    monkeypatch.setattr(st, "_bin_counts_row", lambda *a: rows.append(1) or row_path(*a))
    fast = TensorStatistics()
    for i, b in enumerate(batches):
        update_statistics(fast, b, cfg, i)
    assert len(rows) == 2  # the batches without NaN
    general_bins, drop = st._bin_counts, st._drop_mask_values
    monkeypatch.setattr(st, "_bin_counts", lambda v, lo, hi, bins, no_nan=False: general_bins(v, lo, hi, bins))
    monkeypatch.setattr(st, "_drop_mask_values", lambda stats, xf, thr: drop(stats, xf, thr)[:2] + (None,))
    slow = TensorStatistics()
    for i, b in enumerate(batches):
        update_statistics(slow, b, cfg, i)
    assert len(rows) == 2
    for name in TensorStatistics.__dataclass_fields__:
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None and b is None) or (isinstance(a, int) and a == b) or torch.equal(a, b), name


def test_one_row_rebin_in_numpy_gives_the_torch_form() -> None:
    """A single histogram is re-binned in numpy (`_rebin_row`), the same float64 operations as the torch form that
    several rows take (a number divided by a tensor being the tensor's reciprocal times it there): equal on random
    histograms, integer and fractional counts, grown, shrunk and unchanged ranges."""
    from quantopt.calibration import statistics as st

    g = torch.Generator().manual_seed(0)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    for trial in range(400):
        bins = [2048, 512, 7, 1][trial % 4]
        h = torch.rand(bins, generator=g, dtype=torch.float64) * float(torch.randint(1, 10 ** 6, (1,), generator=g))
        if trial % 3 == 0:
            h = torch.floor(h)
        olo = float(torch.randn(1, generator=g))
        ohi = olo + abs(float(torch.randn(1, generator=g))) * 10 + 1e-6
        nlo = olo - abs(float(torch.randn(1, generator=g))) * (trial % 5)
        nhi = ohi + abs(float(torch.randn(1, generator=g))) * (trial % 7)
        if trial % 11 == 0:
            nlo, nhi = olo + 0.1 * (ohi - olo), ohi - 0.2 * (ohi - olo)
        one = st.rebin_histogram(h, t(olo), t(ohi), t(nlo), t(nhi))
        two = st.rebin_histogram(h.reshape(1, -1).expand(2, -1).clone(), t(olo), t(ohi), t(nlo), t(nhi))
        assert torch.equal(one, two[0]) and torch.equal(two[0], two[1]), trial
