"""The accuracy advisor (quantopt/analysis/advisor.py) on small synthetic graphs: an inf mask, saturated biases, a
collapsed layer and per-tensor weights over channels of very different ranges, each named with cause and field."""
from __future__ import annotations

import math

import numpy as np
import torch
from test_inf_mask import feeds, masked_softmax_model

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.analysis.advisor import Advice, advice_lines, advise
from quantopt.analysis.report import build_report
from quantopt.analysis.similarity import LayerSimilarity, layer_similarity
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model


def fc_model(weights: np.ndarray, biases: np.ndarray):
    g = GraphBuilder("fc")
    x = g.input("x", [1, weights.shape[1]])
    y = g.layer("FullyConnected", [x], [[1, weights.shape[0]]], name="fc",
                params={"num_output": weights.shape[0], "with_activation": "NONE"},
                constants={"weights": weights.astype(np.float32), "biases": biases.astype(np.float32)})
    return g.build([y])


def batches(n: int, width: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy((rng.normal(0, 1, (1, width)) * scale).astype(np.float32)) for _ in range(n)]


def causes(advice, cause: str):
    return [a for a in advice if a.cause == cause]


def test_inf_mask_is_reported() -> None:
    graph = masked_softmax_model()
    q = quantize_model(graph, feeds(6, 0))
    advice = advise(graph, q, layer_similarity(graph, q, feeds(1, 1)))
    named = {a.layer for a in causes(advice, "inf_mask")}
    assert {"neg", "mask", "add"} <= named
    assert all(a.field for a in advice)


def test_huge_finite_mask_suggests_the_field() -> None:
    graph = masked_softmax_model(-1e9)
    q = quantize_model(graph, feeds(6, 0))
    hits = causes(advise(graph, q), "inf_mask")
    huge = [a for a in hits if "enable_pass_detect_inf_mask_nodes" in a.field]
    finite = [a for a in hits if a.field == "detect_finite_masks = true"]
    assert huge and len(finite) == 1 and finite[0].layer == "add" and len(huge) + 1 == len(hits)
    assert "-1e+09" in finite[0].message
    enabled = masked_softmax_model(-1e9)
    q = quantize_model(enabled, feeds(6, 0), settings={"detect_finite_masks": True})
    handled = causes(advise(enabled, q), "inf_mask")
    assert handled and all("handled automatically" in a.field for a in handled)
    assert all("|x| >= 5e+08: a finite attention mask" in a.message for a in handled)


def test_bias_saturation() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (4, 16))
    b = np.array([1e9, 0.1, -0.2, 0.3])  # b * s_in * s_w far beyond int32
    graph = fc_model(w, b)
    q = quantize_model(graph, batches(4, 16))
    hits = causes(advise(graph, q), "bias_saturation")
    assert len(hits) == 1 and hits[0].layer == "fc" and "1 of 4" in hits[0].message
    assert "bias_bits = 48" in hits[0].field
    assert "layer 'fc' (FullyConnected): bias_saturation:" in hits[0].line()


def test_weight_channels_and_collapsed_layer() -> None:
    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (8, 16))
    w[0] *= 1000.0  # one huge channel: per-tensor int8 leaves the others a few steps
    graph = fc_model(w, np.zeros(8))
    q = quantize_model(graph, batches(4, 16))
    spread = causes(advise(graph, q), "weight_channels")
    assert len(spread) == 1 and spread[0].layer == "fc" and "per_channel" in spread[0].field
    fine = [LayerSimilarity(1, "fc", "FullyConnected", "fc", 0.999, 0.0, 0.999, 0.0)]
    assert not causes(advise(graph, q, fine), "weight_channels")  # a layer that kept its accuracy is left alone
    low = [LayerSimilarity(1, "fc", "FullyConnected", "fc", 0.5, 1.0, 0.6, 1.0)]
    advice = advise(graph, q, low)
    assert causes(advice, "weight_channels")
    collapsed = causes(advice, "collapsed")
    assert len(collapsed) == 1 and "0.6000" in collapsed[0].message and "activation_bits" in collapsed[0].field


def test_cumulative_collapse_names_the_first_layer() -> None:
    sims = [LayerSimilarity(1, "a", "Conv", "a", 0.99, 0.0, 0.995, 0.0),
            LayerSimilarity(2, "b", "Conv", "b", 0.85, 0.0, 0.99, 0.0),
            LayerSimilarity(3, "c", "Conv", "c", 0.7, 0.0, 0.99, 0.0)]
    hits = causes(advise(fc_model(np.eye(2), np.zeros(2)), None, sims), "collapsed")
    assert [a.layer for a in hits] == ["b"] and "cumulative" in hits[0].message


def test_nan_similarity_collapses_and_reaches_the_report() -> None:
    graph = fc_model(np.eye(4), np.zeros(4))
    sims = [LayerSimilarity(1, "fc", "FullyConnected", "fc", math.nan, math.nan, math.nan, math.nan,
                            "float output holds NaN")]
    advice = advise(graph, None, sims)
    hits = causes(advice, "collapsed")
    assert hits and "NaN" in hits[0].message and "float output holds NaN" in hits[0].message
    report = build_report({"model": "fc", "advice": [a.as_dict() for a in advice]}, sims)
    assert report["worst_layers"][0]["isolated_cos"] is None and report["worst_layers"][0]["note"]
    assert report["advice"][0]["cause"] == "collapsed"


def test_advice_lines_are_capped() -> None:
    advice = [Advice(f"l{i}", "Conv", "collapsed", "x", "f") for i in range(25)]
    lines = advice_lines(advice, 20)
    assert len(lines) == 21 and "5 more" in lines[-1]


def test_outputs_no_8_bit_range_holds_suggest_min_activation_sqnr_db() -> None:
    """A layer whose outputs are dominated by rare huge values (input feature 0 spikes to 1000 in one row of the
    calibration data) and which lost accuracy gets the `low_sqnr` advice naming the field; with the field set the
    layer is promoted and the advice is gone."""
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.2, (16, 16))
    w[:, 0] = 1.0
    data = []
    for i in range(8):
        x = rng.normal(0, 1, (64, 16)).astype(np.float32)
        x[:, 0] = 0.0
        if i == 0:
            x[0, 0] = 1000.0
        data.append(torch.from_numpy(x))

    def model():
        g = GraphBuilder("spiky")
        x = g.input("x", [64, 16])
        y = g.layer("FullyConnected", [x], [[64, 16]], name="fc", params={"num_output": 16, "with_activation": "NONE"},
                    constants={"weights": w.astype(np.float32), "biases": np.zeros(16, np.float32)})
        return g.build([y])

    settings = {"q_strategy_activation": "quantile[99.99]"}
    graph = model()
    q = quantize_model(graph, data, settings=settings)
    sims = layer_similarity(graph, q, [[data[1]]])
    assert sims[-1].isolated_cos < 0.99
    low = {a.layer: a for a in causes(advise(graph, q, sims), "low_sqnr")}
    assert set(low) == {"x", "fc"}  # the spiky input itself, and the layer it feeds
    assert "min_activation_sqnr_db = 30" in low["fc"].field and "dB" in low["fc"].message
    graph = model()
    q = quantize_model(graph, data, settings={**settings, "min_activation_sqnr_db": 30.0})
    assert q.node("fc").settings.q_bits_activation == 16
    left = causes(advise(graph, q, layer_similarity(graph, q, [[data[1]]])), "low_sqnr")
    assert [a.layer for a in left] in ([], ["x"])  # the input is never promoted (its dtype is the interface)


def test_recurrent_cell_in_upstream_form_suggests_the_q15_field() -> None:
    """A GRU whose gates do not saturate loses accuracy in upstream's form: the advice names gru_integer_form; in
    the q15 form there is none."""
    torch.manual_seed(10)
    m = torch.nn.GRU(3, 5, batch_first=True)
    w = torch.cat([m.weight_ih_l0, m.weight_hh_l0], 1).detach().numpy()
    b = torch.cat([m.bias_ih_l0[:10] + m.bias_hh_l0[:10], m.bias_ih_l0[10:], m.bias_hh_l0[10:]]).detach().numpy()
    g = GraphBuilder("gru")
    ins = [g.input("x", [1, 4, 3]), g.input("h", [1, 5])]
    y = g.layer("GRUv1", ins, [[1, 4, 5]], name="op",
                params=dict(time_steps=4, input_size=3, cell_size=5, direction="forward", out_sequence=["H"]),
                constants=dict(weights=w, biases=b))
    graph = g.build([y])
    rng = np.random.default_rng(11)
    data = [[torch.from_numpy(rng.normal(0.2, 1.0, (2, 4, 3)).astype(np.float32)),
             torch.from_numpy(rng.uniform(-0.5, 0.5, (2, 5)).astype(np.float32))] for _ in range(3)]
    q = quantize_model(graph, data)
    sims = layer_similarity(graph, q, data[:1])
    assert any(r.name == "op" and r.isolated_cos < 0.99 for r in sims)
    hits = causes(advise(graph, q, sims), "recurrent_form")
    assert [a.layer for a in hits] == ["op"] and hits[0].field.startswith("gru_integer_form = q15")
    q15 = quantize_model(graph, data, {"gru_integer_form": "q15"})
    assert not causes(advise(graph, q15, layer_similarity(graph, q15, data[:1])), "recurrent_form")


def _layernorm_model() -> tuple:
    """One LayerNorm over 64 features of transformer-like rows (a few outlier channels), and its data."""
    g = GraphBuilder("ln")
    x = g.input("x", [1, 16, 64])
    rng = np.random.default_rng(3)
    y = g.layer("LayerNorm", [x], [[1, 16, 64]], name="ln", params={"axis": [-1], "epsilon": 1e-5},
                constants={"weights": rng.uniform(0.5, 1.5, 64).astype(np.float32),
                           "biases": rng.normal(0, 0.1, 64).astype(np.float32)})
    scale = np.ones(64, np.float32)
    scale[[3, 40]] = 30.0
    data = [[torch.from_numpy((rng.normal(0, 1, (1, 16, 64)) * scale).astype(np.float32))] for _ in range(6)]
    return g.build([y]), data


def test_16_bit_layernorm_in_upstream_form_suggests_the_exact_form() -> None:
    """At 16 bits upstream's LayerNorm gain keeps a few significant bits: the advice names layernorm_integer_form;
    in the exact form, or at 8 bits, there is none."""
    graph, data = _layernorm_model()
    q16 = quantize_model(graph, data[:4], {"q_bits_activation": 16})
    sims = layer_similarity(graph, q16, data[4:])
    hits = causes(advise(graph, q16, sims), "integer_form")
    assert [a.layer for a in hits] == ["ln"] and "layernorm_integer_form = exact" in hits[0].field
    exact = quantize_model(graph, data[:4], {"q_bits_activation": 16, "layernorm_integer_form": "exact"})
    exact_sims = layer_similarity(graph, exact, data[4:])
    assert not causes(advise(graph, exact, exact_sims), "integer_form")
    assert {s.name: s.isolated_cos for s in exact_sims}["ln"] > {s.name: s.isolated_cos for s in sims}["ln"]
    q8 = quantize_model(graph, data[:4])
    assert not causes(advise(graph, q8, layer_similarity(graph, q8, data[4:])), "integer_form")


def test_16_bit_div_in_upstream_form_suggests_the_exact_form() -> None:
    """Div of two tensors: upstream's one-table form at 16 bits (isolated cosine about 0.995 here, 0.9996 at 8
    bits) gets the advice naming div_integer_form."""
    g = GraphBuilder("div")
    y = g.layer("Div", [g.input("a", [1, 16, 64]), g.input("b", [1, 16, 64])], [[1, 16, 64]], name="div")
    graph = g.build([y])
    rng = np.random.default_rng(4)
    data = [[torch.from_numpy(rng.normal(0, 1, (1, 16, 64)).astype(np.float32)),
             torch.from_numpy(rng.uniform(0.5, 4, (1, 16, 64)).astype(np.float32))] for _ in range(6)]
    results = {}
    for name, settings in (("upstream", {"q_bits_activation": 16}),
                           ("exact", {"q_bits_activation": 16, "div_integer_form": "exact"}), ("8 bits", {})):
        q = quantize_model(graph, data[:4], settings)
        results[name] = causes(advise(graph, q, layer_similarity(graph, q, data[4:])), "integer_form")
    assert [a.layer for a in results["upstream"]] == ["div"]
    assert "div_integer_form = exact" in results["upstream"][0].field
    assert not results["exact"] and not results["8 bits"]



def test_row_normalization_of_an_8_bit_input_suggests_16_bits_for_its_maker() -> None:
    """x + y -> LayerNorm where three tokens hardly vary (class tokens beside patch tokens): with one 8-bit
    range for all rows those tokens are rounding noise, the LayerNorm divides each by its own spread, and the advice
    names the Add with a per-layer rule; following it (with the exact form) recovers the layer."""
    g = GraphBuilder("rows")
    added = g.layer("Eltwise", [g.input("x", [1, 17, 64]), g.input("y", [1, 17, 64])], [[1, 17, 64]],
                    name="residual/add.0", params={"method": "ADD"})
    graph = g.build([g.layer("LayerNorm", [added], [[1, 17, 64]], name="ln", params={"axis": [-1], "epsilon": 1e-6})])
    rng = np.random.default_rng(5)

    def sample() -> list:
        x = rng.normal(0, 0.15, (1, 17, 64)).astype(np.float32)
        x[0, :3] = rng.normal(0, 0.0005, (3, 64))  # tokens of small spread
        return [torch.from_numpy(x), torch.from_numpy(np.zeros((1, 17, 64), np.float32))]

    data = [sample() for _ in range(6)]
    q = quantize_model(graph, data[:4])
    sims = layer_similarity(graph, q, data[4:])
    hits = causes(advise(graph, q, sims), "norm_input")
    assert [a.layer for a in hits] == ["ln"]
    assert "<{residual/add\\.0$}:16>" in hits[0].field and "layernorm_integer_form = exact" in hits[0].field
    fixed = quantize_model(graph, data[:4], {"layernorm_integer_form": "exact"},
                           per_layer={"residual/add.0": {"q_bits_activation": 16}})
    fixed_sims = layer_similarity(graph, fixed, data[4:])
    before, after = ({r.name: r.isolated_cos for r in run}["ln"] for run in (sims, fixed_sims))
    assert before < 0.99 < after
    assert not causes(advise(graph, fixed, fixed_sims), "norm_input")
