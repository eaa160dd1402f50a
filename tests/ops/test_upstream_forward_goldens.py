"""Golden vectors of upstream's integer forward (tests/data/upstream_forward, made by
benchmarks/make_upstream_forward_goldens.py): the quantized IR of one layer, the input integers upstream fed it and
the output integers upstream computed. quantopt's integer forward of that layer must give the same integers
(docs/semantics/softmax.md#fast_exp, docs/integer-semantics.md#pooling-max-avg)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.ir.reader import read_ir

DATA = Path(__file__).resolve().parents[1] / "data" / "upstream_forward"
CASES = ["softmax_fast_exp_q8", "softmax_fast_exp_q11", "pooling_avg_pad", "pooling_avg_global"]


def _run_layer(case: str) -> tuple:
    golden = json.loads((DATA / f"{case}.json").read_text())
    graph = read_ir(str(DATA / f"{case}_o.txt"))
    node = graph.node("op")
    x = torch.tensor(golden["input"], dtype=torch.int64)
    node.inputs[0].betensor = x
    with torch.no_grad():
        node.forward()
    return node, x, np.asarray(golden["output"], dtype=np.int64)


@pytest.mark.parametrize("case", CASES)
def test_integer_forward_equals_upstreams(case: str) -> None:
    node, _, want = _run_layer(case)
    got = node.outputs[0].betensor.to(torch.int64).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 3  # the golden is not degenerate


def test_softmax_golden_is_a_probability_up_to_the_power_of_two_scale() -> None:
    """Sanity of the golden itself: upstream's FAST_EXP integers are about 2^8 · softmax (not s_out = 255)."""
    node, x, want = _run_layer("softmax_fast_exp_q8")
    inp = params_of(node, node.inputs[0])
    probs = torch.softmax((x.double() + float(inp.zerop)) / float(inp.scale), dim=-1).numpy()
    assert np.abs(want - np.clip(probs * 256.0, 0, 255)).max() <= 3


def test_avg_pool_golden_uses_the_8_bit_multiplier() -> None:
    """The global 2x96 window (count 192): 1/192 ≈ 171 / 2^15, not the exact average; some outputs show it."""
    node, x, want = _run_layer("pooling_avg_global")
    zp = int(params_of(node, node.inputs[0]).zerop)
    sums = (x + zp).sum(dim=(1, 2)).numpy()
    exact = np.round(sums / 192.0).astype(np.int64) - zp
    approx = np.round(sums * 171 / 2.0 ** 15).astype(np.int64) - zp
    np.testing.assert_array_equal(want.reshape(-1), approx.reshape(-1))
    assert np.abs(want.reshape(-1) - exact.reshape(-1)).max() <= 1
    assert (want.reshape(-1) != exact.reshape(-1)).any()  # the case tells the two rules apart
