"""Switch: the first non-empty input passes (float), output params copied from input 0, the integer forward equal to
a Python-Fraction re-expression of the selected input's integers in output 0's scale (exact rationals, round half
to even), and bad output counts."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from quant_helpers import params_of
from range_helpers import range_of

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model

SETTINGS = dict(q_bits_activation=8, q_mode_activation="per_tensor_asymmetric", q_strategy_activation="extrema")


def switch_graph(outputs: int = 1):
    b = GraphBuilder("t")
    a = b.input("a", [2, 4])
    c = b.input("c", [2, 4])
    d = b.layer("Abs", [c], [[2, 4]], name="abs")
    y = b.layer("Switch", [a, d], [[2, 4]] * outputs, name="op")
    return b.build([y] if outputs == 1 else y)


def feeds(seed: int, empty_first: bool = False):
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.normal(0, 1, size=(2, 4)).astype(np.float32))
    c = torch.from_numpy(rng.normal(0, 3, size=(2, 4)).astype(np.float32))
    return [a[:0] if empty_first else a, c]


def run_node(node, values):
    """The node's forward on given input values (an empty input cannot come from a fed model input)."""
    for t, v in zip(node.inputs, values):
        t.betensor = v
    node.forward()
    return node.outputs[0].betensor


def test_switch_float() -> None:
    g = switch_graph()
    f = feeds(1)
    assert torch.equal(g.forward(f)[0], f[0])
    node = g.node("op")
    assert torch.equal(run_node(node, [f[0][:0], f[1]]), f[1])
    assert run_node(node, [f[0][:0], f[1][:0]]).numel() == 0  # all empty: input 0


def test_switch_quantized() -> None:
    g = switch_graph()
    qg = quantize_model(g, [feeds(s) for s in (2, 3, 4)], SETTINGS)
    node = qg.node("op")
    a, qd, out = node.inputs[0], node.inputs[1], node.outputs[0]
    ap, dp, op = (params_of(node, t) for t in (a, qd, out))
    assert (op.scale, op.zerop, out.dtype) == (ap.scale, ap.zerop, a.dtype)
    f = feeds(5)
    np.testing.assert_array_equal(qg.forward(f)[0].numpy(), a.betensor.numpy())
    # input 0 empty: input 1 (Abs's uint8 integers, another scale and zero point) passes, re-expressed
    qd_val = torch.from_numpy(np.random.default_rng(6).integers(int(dp.qmin), int(dp.qmax) + 1, size=(2, 4)))
    got = run_node(node, [a.betensor[:0], qd_val]).numpy()
    qd_val = qd_val.numpy()
    assert dp.scale != op.scale
    sa, sd = Fraction(float(np.float32(op.scale))), Fraction(float(np.float32(dp.scale)))
    want = np.vectorize(lambda q: min(max(round((int(q) + int(dp.zerop)) * sa / sd) - int(op.zerop), int(op.qmin)),
                                      int(op.qmax)))(qd_val)
    np.testing.assert_array_equal(got, want)
    deq = (got + float(op.zerop)) / float(op.scale)
    flt = np.clip((qd_val + float(dp.zerop)) / float(dp.scale), range_of(node, out).min,
                  range_of(node, out).max)
    assert np.abs(deq - flt).max() <= 0.51 / float(op.scale) + 0.51 / float(dp.scale)


def test_switch_bad() -> None:
    g = switch_graph(outputs=2)
    with pytest.raises(IRError, match="2 outputs"):
        g.forward(feeds(1))
