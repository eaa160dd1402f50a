"""compare_quantized_irs: identical graphs match; each kind of difference is reported per layer."""
from __future__ import annotations

import torch
from test_quant_workflow import batches, small_model

from quantopt.analysis.ir_compare import (
    INT32_MAX,
    INT32_MIN,
    compare_quantized_irs,
    forgive_upstream_bias_wrap,
    identical_fraction,
)
from quantopt.pipeline import quantize_model


def quantized():
    return quantize_model(small_model(), batches())


def test_identical_graphs_match() -> None:
    diffs = compare_quantized_irs(quantized(), quantized())
    assert identical_fraction(diffs) == 1.0 and len(diffs) == 6


def test_differences_are_named() -> None:
    a, b = quantized(), quantized()
    a.quant.of(a.node("c1").outputs[0]).scale *= 1.0 + 1e-7
    a.node("c2").constants["biases"].betensor[0] += 1
    a.node("fc").params["shift_value"] = 3
    diffs = {d.name: d for d in compare_quantized_irs(a, b)}
    assert "scale" in diffs["c1"].differences[0]
    assert diffs["c2"].differences == ["constant biases: 1 of 8 values differ"]
    assert "shift_value" in diffs["fc"].differences[0]
    assert diffs["c3"].identical
    assert compare_quantized_irs(a, b, rtol=1e-6)[1].identical  # c1's scale within tolerance
    del a.node("c3").constants["weights"]
    assert "missing" in {d.name: d for d in compare_quantized_irs(a, b)}["c3"].differences[0]
    assert torch.is_tensor(b.node("c3").constants["weights"].betensor)


def test_upstream_bias_wrap_is_forgiven_only_where_upstream_wrapped() -> None:
    """Upstream writes a bias saturating at +2^31-1 as -2^31: that layer's biases are left out, no other layer's."""
    mine, upstream = quantized(), quantized()
    for g in (mine, upstream):
        g.node("c2").constants["biases"].betensor[0] = INT32_MAX
    upstream.node("c2").constants["biases"].betensor[0] = INT32_MIN
    upstream.node("c3").constants["biases"].betensor[0] += 1
    diffs = compare_quantized_irs(mine, upstream)
    forgive_upstream_bias_wrap(diffs, mine, upstream)
    by_name = {d.name: d for d in diffs}
    assert by_name["c2"].identical
    assert by_name["c3"].differences[0].startswith("constant biases: 1 of")


def test_upstream_bias_wrap_with_cleared_low_bits_is_forgiven() -> None:
    """A BasicLSTM clears its biases' low k bits after saturating, so quantopt holds 2^31 - 2^k where upstream wrote
    -2^31; a negative saturation (-2^31 in both) is no wrap, and any other value there is a real difference."""
    for mine_value, forgiven in ((2 ** 31 - 2 ** 16, True), (2 ** 31 - 2 ** 16 - 1, False), (12345, False)):
        mine, upstream = quantized(), quantized()
        for g in (mine, upstream):
            g.node("c2").constants["biases"].betensor[1] = INT32_MIN  # saturated negative in both
        mine.node("c2").constants["biases"].betensor[0] = mine_value
        upstream.node("c2").constants["biases"].betensor[0] = INT32_MIN
        diffs = compare_quantized_irs(mine, upstream)
        forgive_upstream_bias_wrap(diffs, mine, upstream)
        assert {d.name: d for d in diffs}["c2"].identical is forgiven, mine_value


def test_negative_saturation_alone_is_no_wrap() -> None:
    """-2^31 in both graphs is equal, so there is nothing to forgive, and a difference elsewhere stays."""
    mine, upstream = quantized(), quantized()
    for g in (mine, upstream):
        g.node("c2").constants["biases"].betensor[0] = INT32_MIN
    mine.node("c2").constants["biases"].betensor[1] += 1
    diffs = compare_quantized_irs(mine, upstream)
    forgive_upstream_bias_wrap(diffs, mine, upstream)
    assert {d.name: d for d in diffs}["c2"].differences[0].startswith("constant biases: 1 of")
