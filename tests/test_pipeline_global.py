"""quantize_model(global_calibration=...): the methods run between calibration and quantization, the float model
is restored afterwards, and the result differs from plain calibration."""
from __future__ import annotations

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model, run_quantized


def _model():
    rng = np.random.default_rng(2)
    b = GraphBuilder("m")
    b.input("x", [1, 16])
    b.layer("FullyConnected", ["x"], [[1, 16]], name="fc", params={"num_output": 16, "with_activation": "NONE"},
            constants={"weights": rng.normal(0, 0.4, (16, 16)).astype(np.float32),
                       "biases": rng.normal(0, 0.1, 16).astype(np.float32)})
    return b.build(["fc"])


def test_global_calibration_in_quantize_model_restores_the_float_model():
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(32, 16, generator=gen) + 0.5 for _ in range(2)]
    plain_graph, tuned_graph = _model(), _model()
    weights = tuned_graph.node("fc").constants["weights"].betensor.clone()
    plain = quantize_model(plain_graph, batches, settings={"q_bits_weight": 4})
    tuned = quantize_model(tuned_graph, batches, settings={"q_bits_weight": 4},
                           global_calibration="bias_correction[2]")
    assert torch.equal(tuned_graph.node("fc").constants["weights"].betensor, weights)
    x = batches[0]
    ref = tuned_graph.forward([x])[0].clone()
    err_plain = float(((run_quantized(plain, x)[0] - ref) ** 2).mean())
    err_tuned = float(((run_quantized(tuned, x)[0] - ref) ** 2).mean())
    assert not torch.equal(plain.node("fc").constants["biases"].betensor, tuned.node("fc").constants["biases"].betensor)
    assert err_tuned < err_plain
