"""Per-channel input scales absorbed into the float weights of MAC layers before they are quantized
(passes/absorb_scales.py): the weights of the quantized copy hold exactly the producer's scales, the float graph keeps
its weights, and the quantize function only checks the absorption (it neither divides weights nor calibrates)."""
from __future__ import annotations

from typing import Dict

import numpy as np
import pytest
import torch
from range_helpers import range_of

from quantopt.analysis.similarity import cosine
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.tables import statistics_of
from quantopt.graph.values import to_float
from quantopt.ops._per_channel import ABSORBED_SCALES, UnabsorbedInputScales, channel_scales
from quantopt.passes.absorb_scales import absorb_input_scales
from quantopt.pipeline import quantize_model
from quantopt.quantizer import quantize_graph

GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)
PER_CHANNEL = dict(q_mode_activation="per_channel_symmetric_full_range")


def _w(r: np.random.Generator, shape, std: float = 0.4) -> np.ndarray:
    return r.normal(0, std, shape).astype(np.float32)


def conv_bn_conv(mean_var: bool = False):
    """conv (channels of different ranges) -> BatchNorm -> grouped conv, 4 channels in between."""
    r = np.random.default_rng(5)
    b = GraphBuilder("absorb")
    x = b.input("x", [1, 6, 6, 3])
    wc = _w(r, [4, 3, 3, 3])
    wc[1] *= 0.05
    c = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="c", params=dict(num_output=4, group=1,
                                                                          with_activation="NONE", **GEO),
                constants={"weights": wc, "biases": _w(r, [4], 0.1)})
    constants = {"weights": np.array([2.0, 0.05, -1.0, 0.5], np.float32),
                 "biases": np.array([0.1, 0.0, -0.2, 0.3], np.float32)}
    params: Dict[str, object] = dict(axis=3, with_activation="NONE")
    if mean_var:
        constants["mean"] = np.array([0.3, -0.1, 0.2, 0.0], np.float32)
        constants["var"] = np.array([1.5, 0.2, 0.7, 2.0], np.float32)
        params["epsilon"] = 1e-5
    bn = b.layer("BatchNorm", [c], [[1, 6, 6, 4]], name="bn", params=params, constants=constants)
    c2 = b.layer("Convolution", [bn], [[1, 6, 6, 2]], name="c2", params=dict(num_output=2, group=2,
                                                                             with_activation="NONE", **GEO),
                 constants={"weights": _w(r, [2, 3, 3, 2]), "biases": _w(r, [2], 0.1)})
    return b.build([c2])


def calibration():
    return [torch.from_numpy(np.random.default_rng(s).normal(size=[2, 6, 6, 3]).astype(np.float32))
            for s in range(3)]


def quantized(mean_var: bool = False):
    graph = conv_bn_conv(mean_var)
    float_weights = {n.name: n.constants["weights"].betensor.clone() for n in graph.nodes if "weights" in n.constants}
    qg = quantize_model(graph, calibration(), dict(q_strategy_activation="extrema"),
                        per_layer={"c": PER_CHANNEL, "bn": PER_CHANNEL})
    return graph, qg, float_weights


def test_weights_hold_the_producers_scales_and_the_float_graph_keeps_its_own() -> None:
    graph, qg, float_weights = quantized()
    for name in ("bn", "c2"):  # both read a per-channel activation
        scales = channel_scales(qg.node(name), qg.node(name).inputs[0])
        assert scales is not None and scales.numel() == 4
        assert torch.equal(qg.node(name).attrs[ABSORBED_SCALES], scales)
    assert ABSORBED_SCALES not in qg.node("c").attrs  # its input is per tensor
    for n in graph.nodes:
        assert ABSORBED_SCALES not in n.attrs
        if n.name in float_weights:
            assert torch.equal(n.constants["weights"].betensor, float_weights[n.name])


def test_absorption_divides_each_weight_by_its_input_channel_and_recalibrates() -> None:
    graph, qg, _ = quantized()
    fnode = graph.node("c2")  # grouped: output channel o reads input channels 2 * o, 2 * o + 1
    m = fnode.detached_copy(inputs=list(qg.node("c2").inputs), input_quant=qg.quant)
    scales = channel_scales(m, m.inputs[0]).to(torch.float64)
    w = fnode.constants["weights"].betensor.to(torch.float64)
    want = torch.stack([w[o] / scales[2 * o: 2 * o + 2] for o in range(2)]).to(torch.float32)
    stats_before = statistics_of(m).get(m.constants["weights"])
    assert absorb_input_scales(m)
    got = m.constants["weights"]
    assert torch.equal(got.betensor, want)
    # statistics of the new values (extrema strategy: the values' range)
    assert statistics_of(m).get(got) is not stats_before
    r = range_of(m, got)
    assert r.min == min(float(want.min()), 0.0) and r.max == max(float(want.max()), 0.0)
    assert absorb_input_scales(m) and torch.equal(m.constants["weights"].betensor, want)  # done once only
    m.attrs[ABSORBED_SCALES] = m.attrs[ABSORBED_SCALES] * 2
    with pytest.raises(UnabsorbedInputScales, match="other input scales"):
        absorb_input_scales(m)
    assert not absorb_input_scales(graph.node("c"))  # a per-tensor input: nothing to absorb


def test_quantization_only_checks_the_absorption() -> None:
    graph, qg, _ = quantized()
    fnode = graph.node("c2")
    m = fnode.detached_copy(inputs=list(qg.node("c2").inputs), input_quant=qg.quant)
    with pytest.raises(UnabsorbedInputScales, match="hold no input scales"):
        m.quantize()  # the quantize function no longer divides the weights itself

    m = fnode.detached_copy(inputs=list(qg.node("c2").inputs), input_quant=qg.quant)
    absorb_input_scales(m)
    w = m.constants["weights"]
    stats, lo, hi = statistics_of(m).get(w), range_of(m, w).min, range_of(m, w).max
    m.quantize()
    assert statistics_of(m).get(w) is stats and \
        (range_of(m, w).min, range_of(m, w).max) == (lo, hi)  # no calibration inside quantization
    assert torch.equal(w.betensor, qg.node("c2").constants["weights"].betensor)
    for key in ("biases", "scale", "shift"):
        assert torch.equal(m.constants[key].betensor, qg.node("c2").constants[key].betensor)

    per_tensor = graph.node("c").detached_copy(inputs=list(qg.node("c").inputs), input_quant=qg.quant)
    per_tensor.attrs[ABSORBED_SCALES] = torch.ones(3)
    with pytest.raises(UnabsorbedInputScales, match="has none"):
        per_tensor.quantize()


def test_requantizing_a_calibrated_graph_gives_the_same_weights() -> None:
    """Each quantize_graph absorbs on its own copy: a second quantization of the same graph is bit-identical."""
    graph, qg, _ = quantized()
    again = quantize_graph(graph)
    for name in ("bn", "c2"):
        assert torch.equal(again.node(name).constants["weights"].betensor,
                           qg.node(name).constants["weights"].betensor)


def test_batchnorm_folds_mean_and_var_before_absorbing() -> None:
    """The scales go into the folded weights only (w / sqrt(var + eps) / s), never into the bias b - mean · w'."""
    graph, qg, _ = quantized(mean_var=True)
    bn = qg.node("bn")
    assert "mean" not in bn.constants and bn.constants["weights"].betensor.dim() == 1
    x = calibration()[0]
    graph.forward([x], keep_tensors=True)
    qg.forward([x], keep_tensors=True)
    # absorbing before the fold would shift the bias by mean · w' · (1 - 1 / s): cosine 0.989 here
    assert cosine(graph.node("bn").outputs[0].betensor, to_float(bn.outputs[0])) > 0.9995
