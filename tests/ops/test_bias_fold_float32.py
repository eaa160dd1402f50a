"""A MAC layer's input zero point is folded into its biases the way upstream holds them, in a float32 tensor: where
the folded bias exceeds 2^24 in magnitude (a tiny weight channel gives a huge bias scale) it lands on float32's grid,
as in upstream's PP-OCRv6 detector golden (docs/integer-semantics.md, "Convolution, DepthwiseConv,
FullyConnected")."""
from __future__ import annotations

import numpy as np
import torch
from quant_helpers import params_of

from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model


def test_folded_biases_beyond_2_24_are_float32_values() -> None:
    rng = np.random.default_rng(12)
    k, n = 64, 32
    w = rng.normal(0, 0.2, (n, k)).astype(np.float32)
    w[n // 2:] *= 1e-5  # half the channels: weight scales of about 1e7, bias scales of about 1e8
    b = rng.normal(0, 0.3, n).astype(np.float32)
    g = GraphBuilder("fc")
    x = g.input("x", [1, k])
    y = g.layer("FullyConnected", [x], [[1, n]], name="fc", params={"num_output": n},
                constants={"weights": w, "biases": b})
    graph = g.build([y])
    data = [[torch.from_numpy(rng.uniform(-0.5, 3.0, (1, k)).astype(np.float32))] for _ in range(3)]
    qg = quantize_model(graph, data, {"q_mode_weight": "per_channel_symmetric_restricted_range",
                                      "q_mode_activation": "per_tensor_asymmetric", "unify_shifts_for_aiff": False})
    node = qg.node("fc")
    assert int(params_of(node, node.inputs[0]).zerop) != 0
    biases = node.constants["biases"].betensor.to(torch.int64)
    big = biases.abs() > 2 ** 24
    assert int(big.sum()) >= 8
    assert torch.equal(biases, biases.to(torch.float32).to(torch.int64))  # every bias is a float32 value
    # exact integer sums would give odd values up there; some of them are rounded away
    scale = node.constants["biases_scale"].betensor.to(torch.float32)
    unfolded = torch.round(torch.from_numpy(b) * scale).to(torch.int64)
    w_q = node.constants["weights"].betensor.to(torch.int64)
    exact = unfolded + int(params_of(node, node.inputs[0]).zerop) * w_q.sum(dim=1)
    assert not torch.equal(biases, exact) and int((biases - exact).abs().max()) <= 2 ** 7
