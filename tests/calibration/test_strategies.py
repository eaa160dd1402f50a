"""Local calibration strategies: parsing, each rule on known statistics/distributions, kld, aciq, zero inclusion."""
from __future__ import annotations

import math

import pytest
import torch

from quantopt.calibration import (
    ACIQ_GAUSS_ALPHA,
    ACIQ_LAPLACE_ALPHA,
    StatisticsConfig,
    Strategy,
    apply_strategy,
    kld_threshold,
    parse_strategy,
    statistics_needs,
    update_statistics,
)
from quantopt.errors import UnsupportedError
from quantopt.graph.tables import TensorStatistics


def _stats(*batches, **cfg):
    cfg.setdefault("need_histogram", True)
    c = StatisticsConfig(**cfg)
    s = TensorStatistics()
    for i, b in enumerate(batches):
        update_statistics(s, b, c, i)
    return s


def _hand(**values):
    s = TensorStatistics()
    for k, v in values.items():
        setattr(s, k, torch.tensor(v, dtype=torch.float64))
    s.batches = 1
    return s


# --- parsing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, name, value", [
    ("extrema", "extrema", 1.0), ("MEAN", "mean", 1.0), (" in_ir ", "in_ir", 1.0),
    ("3std", "std", 3.0), ("2.5std", "std", 2.5), ("10std", "std", 10.0),
    ("percentile", "percentile", 1.0), ("0.9percentile", "percentile", 0.9), ("1.5percentile", "percentile", 1.5),
    ("kld", "kld", 10.0), ("5kld", "kld", 5.0), ("1kld", "kld", 2.0), ("0kld", "kld", 2.0), ("20KLD", "kld", 20.0),
    ("aciq_laplace", "aciq_laplace", 1.0), ("1.2aciq_laplace", "aciq_laplace", 1.2),
    ("aciq_gauss", "aciq_gauss", 1.0), ("0.8aciq_gauss", "aciq_gauss", 0.8),
])
def test_parse_names(text, name, value):
    st = parse_strategy(text)
    assert (st.name, st.value) == (name, value)
    assert parse_strategy(st) is st


def test_parse_weighted_scale_param():
    assert parse_strategy("weighted_scale_param").params == (0.685, 0.875, 0.7175, 0.01965)
    st = parse_strategy("weighted_scale_param[0.5, 0.6,0.7 ,0.02]")
    assert st.params == (0.5, 0.6, 0.7, 0.02) and st.name == "weighted_scale_param"
    assert parse_strategy("weighted_scale_param[1,1,1,0.1,]").params == (1.0, 1.0, 1.0, 0.1)
    with pytest.raises(UnsupportedError, match="automatic"):
        parse_strategy("weighted_scale_param[1.5,0.875,0.7175,0.01965]")
    with pytest.raises(UnsupportedError):
        apply_strategy(_hand(extrema_min=-1.0), Strategy("weighted_scale_param", params=(2.0, 0.5, 0.5, 0.1)), 8)


@pytest.mark.parametrize("text", ["", "max", "kld5", "3..std", "-1percentile", "1.2.3percentile", "std", "nstd",
                                  "weighted_scale_param[1,2,3]", "weighted_scale_param(0.5,0.5,0.5,0.5)",
                                  "aciq", "extrema2"])
def test_parse_errors_list_valid_forms(text):
    with pytest.raises(ValueError, match=r"valid forms: extrema, mean, in_ir, Nstd"):
        parse_strategy(text)


def test_statistics_needs():
    assert statistics_needs("kld") == (True, False)
    assert statistics_needs("3std") == (False, True)
    assert statistics_needs("aciq_gauss") == (False, True)
    assert statistics_needs("weighted_scale_param") == (False, True)
    for s in ("mean", "extrema", "in_ir", "0.9percentile"):
        assert statistics_needs(s) == (False, False)


# --- simple rules ----------------------------------------------------------------------------------------------


def test_extrema_mean_in_ir_percentile():
    s = _hand(extrema_min=-4.0, extrema_max=6.0, running_min=-2.0, running_max=3.0)
    assert apply_strategy(s, "extrema", 8) == (-4.0, 6.0)
    assert apply_strategy(s, "mean", 8) == (-2.0, 3.0)
    assert apply_strategy(s, "in_ir", 8) == (-4.0, 6.0)  # no IR range: the extrema
    assert apply_strategy(s, "in_ir", 8, ir_range=(-1.5, 2.5)) == (-1.5, 2.5)
    assert apply_strategy(s, "0.5percentile", 8) == (-2.0, 3.0)  # extrema * R, not a percentile
    assert apply_strategy(s, "percentile", 8) == (-4.0, 6.0)


def test_zero_inclusion():
    pos = _hand(extrema_min=1.0, extrema_max=6.0, running_min=2.0, running_max=3.0)
    assert apply_strategy(pos, "mean", 8) == (0.0, 3.0)
    neg = _hand(extrema_min=-6.0, extrema_max=-1.0, running_min=-3.0, running_max=-2.0)
    assert apply_strategy(neg, "extrema", 8) == (-6.0, 0.0)
    assert apply_strategy(neg, "in_ir", 8, ir_range=(-5.0, -4.0)) == (-5.0, 0.0)
    s = _stats(torch.rand(2, 3, 4) + 1.0, key_axis=1)
    lo, hi = apply_strategy(s, "mean", 8)
    assert lo.dtype == torch.float32 and torch.equal(lo, torch.zeros(3)) and bool((hi > 1.0).all())


def test_nstd_on_normal_sample():
    torch.manual_seed(0)
    s = _stats(torch.randn(200000), torch.randn(200000))
    lo, hi = apply_strategy(s, "3std", 8)
    assert lo == pytest.approx(-3.0, abs=0.05) and hi == pytest.approx(3.0, abs=0.05)
    lo, hi = apply_strategy(s, "2.5std", 8)
    assert hi == pytest.approx(2.5, abs=0.05)
    # N large: clipped to the running range
    assert apply_strategy(s, "10std", 8) == (float(s.running_min), float(s.running_max))


# --- aciq --------------------------------------------------------------------------------------------------------


def _bisect(f, a, b):
    for _ in range(200):
        m = 0.5 * (a + b)
        if (f(a) < 0) == (f(m) < 0):
            a = m
        else:
            b = m
    return 0.5 * (a + b)


def test_aciq_tables_match_mse_optimum():
    assert ACIQ_LAPLACE_ALPHA[8] == 9.89 and ACIQ_GAUSS_ALPHA[8] == 3.92
    for bits in range(1, 17):
        q = 3.0 * 4.0 ** bits
        # Laplace(b=1): d/da [2 e^-a + a^2/q] = 0
        lap = _bisect(lambda a, q=q: -2.0 * math.exp(-a) + 2.0 * a / q, 1e-6, 100.0)
        assert ACIQ_LAPLACE_ALPHA[bits] == pytest.approx(lap, abs=0.01)
        # Gauss(sigma=1): d/da [(a^2+1) erfc(a/sqrt2) - sqrt(2/pi) a e^(-a^2/2) + a^2/q] = 0
        gau = _bisect(lambda a, q=q: a * math.erfc(a / math.sqrt(2)) - math.sqrt(2 / math.pi) * math.exp(-a * a / 2)
                      + a / q, 1e-6, 20.0)
        # upstream's table drifts a little low above 11 bits; it is kept as is
        assert ACIQ_GAUSS_ALPHA[bits] == pytest.approx(gau, abs=0.01 if bits <= 11 else 0.06)


def test_aciq_formulas():
    s = _hand(running_min=-5.0, running_mean=0.5, running_std=2.0, running_mad=1.5, extrema_min=-6.0)
    a_l = 9.89 * 1.5
    assert apply_strategy(s, "aciq_laplace", 8, symmetric=True) == pytest.approx((-(0.5 + a_l), 0.5 + a_l))
    assert apply_strategy(s, "2aciq_laplace", 8, symmetric=True) == pytest.approx((-(0.5 + 2 * a_l), 0.5 + 2 * a_l))
    a_g = 3.92 * 2.0
    lo = max(-5.0, 0.5 - a_g)
    assert apply_strategy(s, "aciq_gauss", 8, symmetric=False) == pytest.approx((lo, lo + 2 * a_g))
    assert apply_strategy(s, "0.5aciq_gauss", 8, symmetric=False) == pytest.approx((lo, lo + 0.5 * 2 * a_g))
    a4 = 2.55 * 2.0
    assert apply_strategy(s, "aciq_gauss", 4, symmetric=True) == pytest.approx((-(0.5 + a4), 0.5 + a4))
    assert apply_strategy(s, "aciq_gauss", 32, symmetric=True) == pytest.approx((-(0.5 + a_g), 0.5 + a_g))


# --- weighted_scale_param ---------------------------------------------------------------------------------------


def test_weighted_scale_param_non_auto():
    s = _hand(running_min=-1.0, running_max=2.0, running_std=0.5, extrema_min=-1.0)
    fmax = 255.0 / (0.685 * 255.0 / 2.0 + 0.315 * 255.0 / 1.0)  # positive extent dominates: alpha = r1
    lo, hi = apply_strategy(s, "weighted_scale_param", 8)
    assert hi == pytest.approx(fmax, rel=1e-6) and lo == pytest.approx(-fmax, rel=1e-6)
    s = _hand(running_min=-2.0, running_max=1.0, running_std=0.5, extrema_min=-2.0)
    fmax = 255.0 / (0.875 * 255.0 + 0.125 * 255.0 / 2.0)  # negative dominates, std > r4: alpha = r2
    assert apply_strategy(s, "weighted_scale_param", 8)[1] == pytest.approx(fmax, rel=1e-6)
    s = _hand(running_min=-2.0, running_max=1.0, running_std=0.01, extrema_min=-2.0)
    fmax = 255.0 / (0.7175 * 255.0 + 0.2825 * 255.0 / 2.0)  # std <= r4: alpha = r3
    assert apply_strategy(s, "weighted_scale_param", 8)[1] == pytest.approx(fmax, rel=1e-6)
    # unsigned (extrema_min >= 0): negative extent 0 is replaced by q_range, range [0, fmax]
    s = _hand(running_min=0.0, running_max=2.0, running_std=0.5, extrema_min=0.0)
    fmax = 255.0 / (0.685 * 255.0 / 2.0 + 0.315)
    assert apply_strategy(s, "weighted_scale_param", 8) == pytest.approx((0.0, fmax), rel=1e-6)
    assert apply_strategy(s, "weighted_scale_param", 8, signed=True) == pytest.approx((-fmax, fmax), rel=1e-6)


# --- kld ---------------------------------------------------------------------------------------------------------


def _naive_kld(h, lo, hi, tb, topk):
    """Direct transcription of the search description, one candidate at a time."""
    h = [float(v) for v in h]
    nb = len(h)
    interval = (hi - lo) / nb
    midx = max(range(nb), key=lambda i: (h[i], -i))
    if lo >= 0:
        li, ri = 0, tb - 1
    elif hi <= 0:
        li, ri = nb - tb, nb - 1
    elif midx < nb - 1 - midx:
        li = max(midx - tb // 2, 0)
        ri = li + tb - 1
    else:
        ri = min(midx + tb // 2, nb - 1)
        li = ri - tb + 1
    total = sum(h)
    kls = []
    for r in range(max(li + 1, nb - ri)):
        a, b = li - r, ri + r
        w = [h[i] if 0 <= i < nb else 0.0 for i in range(a, b + 1)]
        w[0] = sum(h[: max(a + 1, 0)])
        w[-1] = sum(h[max(b, 0):])
        n = len(w)
        qi = n // tb
        kl = 0.0
        for j in range(tb):
            seg = w[j * qi: n if j == tb - 1 else (j + 1) * qi]
            q = sum(seg) / (sum(1 for v in seg if v) + torch.finfo(torch.float32).eps)
            kl += sum(v / total * math.log(v / q) for v in seg if v)
        kls.append(kl)
    best = max(sorted(range(len(kls)), key=lambda i: (round(kls[i] * 1e12), i))[:topk])  # ties: narrower first
    return lo + max(li - best, 0) * interval, hi - (nb - 1 - min(ri + best, nb - 1)) * interval


def test_kld_matches_direct_transcription():
    gen = torch.Generator().manual_seed(3)
    for trial in range(24):
        nb = int(torch.randint(12, 60, (1,), generator=gen))
        tb = int(torch.randint(2, nb, (1,), generator=gen))
        h = torch.floor(torch.rand(nb, generator=gen) * 20) * (torch.rand(nb, generator=gen) > 0.3)
        h[int(torch.randint(0, nb, (1,), generator=gen))] += 50  # a unique argmax
        lo = float(torch.randn(1, generator=gen)) * 3
        hi = lo + 0.5 + float(torch.rand(1, generator=gen)) * 5
        if trial % 3 == 1:
            lo, hi = abs(lo), abs(lo) + 2.0
        elif trial % 3 == 2:
            lo, hi = -abs(hi) - 2.0, -abs(hi)
        got = kld_threshold(h, lo, hi, tb, 3)
        assert got == pytest.approx(_naive_kld(h, lo, hi, tb, 3), abs=1e-9), trial


def test_kld_clips_heavy_tails_keeps_uniform():
    torch.manual_seed(0)
    heavy = torch.distributions.StudentT(2.0).sample((100000,))
    lo, hi = apply_strategy(_stats(heavy), "kld", 8)
    assert hi < 0.5 * float(heavy.max()) and lo > 0.5 * float(heavy.min())
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((100000,))
    lo, hi = apply_strategy(_stats(laplace), "kld", 8)
    assert 5.0 < hi < float(laplace.max()) and float(laplace.min()) < lo < -5.0
    uniform = torch.rand(100000) * 4 - 2
    lo, hi = apply_strategy(_stats(uniform), "kld", 8)
    assert lo == pytest.approx(float(uniform.min()), abs=0.01) and hi == pytest.approx(float(uniform.max()), abs=0.01)
    # one-signed data: window anchored at the zero side
    relu = heavy.clamp(min=0)
    lo, hi = apply_strategy(_stats(relu), "kld", 8)
    assert lo == 0.0 and 0.0 < hi < 0.5 * float(relu.max())
    lo, hi = apply_strategy(_stats(-relu), "kld", 8)
    assert hi == 0.0 and 0.5 * float(-relu.max()) < lo < 0.0
    # fewer N -> never wider than more N (largest among the N best)
    assert apply_strategy(_stats(heavy), "2kld", 8)[1] <= apply_strategy(_stats(heavy), "50kld", 8)[1]


def test_kld_too_few_bins_returns_histogram_range():
    x = torch.randn(1000)
    s = _stats(x, histc_bins=128)
    assert apply_strategy(s, "kld", 8) == (float(x.min()), float(x.max()))  # 256 target bins > 128 bins
    s = _stats(x)
    assert apply_strategy(s, "kld", 16) == (float(x.min()), float(x.max()))


def test_kld_needs_histogram():
    s = _stats(torch.randn(100), need_histogram=False)
    with pytest.raises(ValueError, match="running_histc"):
        apply_strategy(s, "kld", 8)
    s = _stats(torch.randn(100), need_moments=False)
    with pytest.raises(ValueError, match="running_mean"):
        apply_strategy(s, "3std", 8)


# --- per channel -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["extrema", "mean", "3std", "0.8percentile", "kld", "aciq_laplace",
                                      "2aciq_gauss", "in_ir"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_per_channel_equals_per_tensor_on_slices(strategy, symmetric):
    torch.manual_seed(4)
    batches = [torch.distributions.Laplace(0.0, 1.0).sample((3, 4000)) * torch.tensor([[0.5], [1.0], [3.0]]) + 0.2
               for _ in range(2)]
    s = _stats(*batches, key_axis=0)
    lo, hi = apply_strategy(s, strategy, 8, symmetric=symmetric)
    assert lo.shape == (3,) and hi.dtype == torch.float32
    for c in range(3):
        ref = _stats(*[b[c] for b in batches])
        rlo, rhi = apply_strategy(ref, strategy, 8, symmetric=symmetric)
        assert float(lo[c]) == pytest.approx(rlo, rel=1e-5, abs=1e-5)
        assert float(hi[c]) == pytest.approx(rhi, rel=1e-5, abs=1e-5)
    # the per-tensor range is still available
    plo, phi = apply_strategy(s, strategy, 8, symmetric=symmetric, per_channel=False)
    assert isinstance(plo, float) and isinstance(phi, float)


def test_per_channel_special_cases():
    torch.manual_seed(5)
    x = torch.randn(2, 500)
    s = _stats(x, key_axis=0, need_histogram=False)
    # kld without per-channel histograms: the running range per channel (upstream)
    lo, hi = apply_strategy(s, Strategy("kld", 10.0), 8)
    assert torch.equal(lo, s.running_min_key_axis.float().clamp(max=0))
    # weighted_scale_param per channel: upstream keeps the running range per channel
    lo, hi = apply_strategy(s, "weighted_scale_param", 8)
    assert torch.equal(hi, s.running_max_key_axis.float().clamp(min=0))
    # in_ir with per-channel IR ranges
    lo, hi = apply_strategy(s, "in_ir", 8, ir_range=(torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 2.0])))
    assert lo.tolist() == [-1.0, -2.0] and hi.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="extrema_min_key_axis"):
        apply_strategy(_stats(x), "extrema", 8, per_channel=True)
