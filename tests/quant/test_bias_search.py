"""`search_bias_clamp_bits` (`bias_effective_bits_auto_adaption`, upstream's search) against an independent numpy
reading of its description, and the cfg field end to end on a FullyConnected layer."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model
from quantopt.quant.requant import compress_bias, search_bias_clamp_bits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def _kl(log_q: np.ndarray, p_log: np.ndarray) -> float:
    """batchmean KL of target p (given as log-probabilities) from log-probabilities log_q, one vector."""
    p = np.exp(p_log)
    return float((p * (p_log - log_q)).sum() / len(p))


def _drop_low_bits(b: np.ndarray, eff: int) -> np.ndarray:
    lmin, lmax = -(2 ** (eff - 1)), 2 ** (eff - 1) - 1
    k = math.ceil(max(math.log2(max(int(b.max()), 1) / lmax), math.log2(min(int(b.min()), -1) / lmin)))
    return b if k <= 0 else (b >> k) << k


def reference(bias_float: np.ndarray, bias_q: np.ndarray, scale: np.ndarray, eff: int, bits: int) -> Optional[int]:
    fp = _log_softmax(bias_float)
    drift = _kl(_log_softmax(bias_q), fp) - _kl(_log_softmax(_drop_low_bits(bias_q, eff)), fp)
    if abs(drift) <= 0.05:
        return None
    scores = []
    for c in range(min(max(eff, 19), bits - 1), bits):
        clamped = np.clip(bias_q, -(2 ** (c - 1)), 2 ** (c - 1) - 1)
        packed = _drop_low_bits(clamped, eff)
        scores.append((abs(_kl(_log_softmax(packed / scale), _log_softmax(clamped / scale))), c))
    best = min(s for s, _ in scores)
    return next(c for s, c in scores if s == best)


@pytest.mark.parametrize("seed", range(12))
def test_search_matches_an_independent_reading(seed: int) -> None:
    r = np.random.default_rng(seed)
    n = int(r.integers(4, 40))
    scale = r.uniform(2e4, 2e6, n) if seed % 2 else np.full(n, r.uniform(2e4, 2e6))
    bias_float = r.normal(0, 0.2, n)
    bias_float[int(r.integers(n))] = r.choice([-1, 1]) * r.uniform(20, 2000)  # an outlier
    bias_q = np.clip(np.round(bias_float * scale), -2 ** 31, 2 ** 31 - 1).astype(np.int64)
    eff = int(r.choice([16, 20, 24]))
    got = search_bias_clamp_bits(torch.from_numpy(bias_float), torch.from_numpy(bias_q), torch.from_numpy(scale), eff,
                                 32)
    assert got == reference(bias_float, bias_q, scale, eff, 32)


def test_no_search_without_compression() -> None:
    b = torch.tensor([3, -5, 100], dtype=torch.int64)
    assert search_bias_clamp_bits(b.float(), b, 1.0, 32, 32) is None  # nothing to compress
    assert search_bias_clamp_bits(b.float(), b, 1.0, 16, 32) is None  # the compression drops no bit here
    assert torch.equal(compress_bias(b, 16)[0], b)


def _fc(biases: np.ndarray):
    r = np.random.default_rng(2)
    g = GraphBuilder("fc")
    x = g.input("x", [1, 16])
    y = g.layer("FullyConnected", [x], [[1, 8]], name="fc", params=dict(num_output=8, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (8, 16)).astype(np.float32), "biases": biases})
    return g.build([y])


def test_field_clamps_before_the_compression(caplog) -> None:
    r = np.random.default_rng(1)
    biases = r.normal(0, 0.05, 8).astype(np.float32)
    biases[3] = -400.0  # an outlier bias: with 16 effective bits every bias loses low bits
    data = [[torch.from_numpy(r.normal(0, 1, (4, 16)).astype(np.float32))]]

    def biases_of(**settings) -> torch.Tensor:
        return quantize_model(_fc(biases), data, settings=settings).node("fc").get_constant("biases").betensor

    exact = biases_of()
    plain = biases_of(bias_effective_bits=16)
    with caplog.at_level("INFO", logger="quantopt"):
        searched = biases_of(bias_effective_bits=16, bias_effective_bits_auto_adaption=True)
    lines = [rec.getMessage() for rec in caplog.records if "auto_adaption clamps" in rec.getMessage()]
    assert len(lines) == 1
    bits = int(lines[0].split("clamps the biases to ")[1].split(" bits")[0])
    assert 19 <= bits < 32
    clamped = torch.clamp(exact, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)  # zero points are 0 here
    assert torch.equal(searched, compress_bias(clamped, 16)[0])
    assert torch.equal(plain, compress_bias(exact, 16)[0]) and not torch.equal(searched, plain)
