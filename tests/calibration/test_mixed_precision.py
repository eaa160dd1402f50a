"""mixed_precision_auto_search: the per-layer search promotes the sensitive layer only (upstream's single cut
promotes everything after it), the result stays on the layers and in the JSON template, and a template fed back
reproduces the IR without searching."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quantopt.analysis.similarity import cosine, to_float
from quantopt.calibration.collect import collect_activation_statistics, collect_weight_statistics
from quantopt.cli import main
from quantopt.config.kinds_accuracy import AutoSearch, AutoSearchKind
from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.builder import GraphBuilder
from quantopt.tuning.mixed_precision import candidate_layers, cut_point_search, per_layer_search

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cli import example_cfg  # noqa: E402


def _chain(outlier_layer: str):
    """Four FC layers; the weights of `outlier_layer` have one huge entry, so 4-bit weights wipe out the rest."""
    rng = np.random.default_rng(11)
    b = GraphBuilder("chain")
    b.input("x", [1, 32])
    prev = "x"
    for name in ("fc1", "fc2", "fc3", "fc4"):
        w = rng.normal(0, 0.2, (32, 32)).astype(np.float32)
        if name == outlier_layer:
            w[0, 0] = 8.0
        b.layer("FullyConnected", [prev], [[1, 32]], name=name, params={"num_output": 32, "with_activation": "NONE"},
                constants={"weights": w, "biases": np.zeros(32, np.float32)})
        prev = name
    return b.build([prev])


def _prepared(outlier_layer: str):
    g = _chain(outlier_layer)
    for n in g.nodes:
        n.settings = LayerSettings(q_bits_weight=4, q_strategy_activation="extrema")
    gen = torch.Generator().manual_seed(5)
    batches = [[torch.randn(16, 32, generator=gen)] for _ in range(3)]
    collect_weight_statistics(g)
    collect_activation_statistics(g, batches)
    refs = [g.forward(b)[0].clone() for b in batches]

    def score(qgraph) -> float:
        total = 0.0
        for b, ref in zip(batches, refs):
            qgraph.forward(b)
            total += cosine(ref, to_float(qgraph.output_tensors[0]))
        return total / len(batches)
    return g, score


def test_auto_search_value_parses():
    a = AutoSearchKind().parse(" 4, 0.01 , g")
    assert a == AutoSearch(4, 0.01, "G") and a.enabled and a.satisfied(0.02) and not a.satisfied(0.0)
    assert not AutoSearchKind().parse("0,0,L").enabled
    for bad in ("1,2", "x,0.1,L", "1,nan,L", "1,0.1,Q"):
        with pytest.raises(ValueError):
            AutoSearchKind().parse(bad)


def test_per_layer_search_promotes_only_the_sensitive_layer():
    g, score = _prepared("fc2")
    auto = AutoSearch(3, 0.05, "L")
    result = per_layer_search(g, score, 1.0, auto)
    assert result.level == "16bit" and result.reached
    assert result.promoted == ["fc2"]
    assert max(result.sensitivity, key=result.sensitivity.get) == "fc2"
    assert result.base_score < 1.0 - 0.05 <= result.final_score
    assert list(result.settings) == ["fc2"]  # returned for the caller to assign; the graph keeps its own
    assert result.settings["fc2"].q_bits_activation == 16 and result.settings["fc2"].q_bits_weight == 16
    assert all(n.settings.q_bits_weight == 4 for n in g.nodes if n.name.startswith("fc"))
    assert [s.what for s in result.steps][:2] == ["configured precision", "every candidate at 16bit"]


def test_single_cut_promotes_everything_after_an_early_sensitive_layer():
    g, score = _prepared("fc1")
    auto = AutoSearch(3, 0.05, "L")
    cut = cut_point_search(g, score, 1.0, auto)
    assert cut.reached and cut.promoted[0] == "fc1" and len(cut.promoted) == 4
    assert all(n.settings.q_bits_weight == 4 for n in g.nodes if n.name.startswith("fc"))  # restored
    per_layer = per_layer_search(g, score, 1.0, auto)
    assert per_layer.promoted == ["fc1"]
    assert len(per_layer.promoted) < len(cut.promoted)


def test_already_satisfied_changes_nothing_and_unreachable_keeps_settings():
    g, score = _prepared("fc2")
    result = per_layer_search(g, score, 1.0, AutoSearch(3, 0.5, "L"))
    assert result.promoted == [] and result.level == "none" and result.evaluations == 1
    result = per_layer_search(g, score, 1.0, AutoSearch(3, 0.5, "G"))
    assert not result.reached and result.promoted == []
    assert all(n.settings.q_bits_weight == 4 for n in g.nodes if n.name.startswith("fc"))


def test_candidates_skip_data_movement_layers():
    b = GraphBuilder("m")
    b.input("x", [1, 4, 4])
    b.layer("Reshape", ["x"], [[1, 16]], name="flat", params={"shape": [1, 16]})
    g = b.build(["flat"])
    assert candidate_layers(g) == ["x"]


def test_cli_search_writes_result_and_template_reproduces_it(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    cfg = example_cfg(tmp_path / "a", weight_bits="4", mixed_precision_auto_search="3,0.0,L",
                      metric_batch_size="128", eval_original_model="false")
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "mixed precision search:" in err
    out = tmp_path / "a" / "out"
    report = json.loads((out / "digits_report.json").read_text())
    search = report["mixed_precision"]
    assert search["reached"] and search["promoted"] and search["steps"]
    template = json.loads((out / "digits_opt_template.json").read_text())
    for name in search["promoted"]:
        assert template[name]["q_bits_activation"] == 16 and template[name]["q_bits_weight"] == 16
    (tmp_path / "b").mkdir()
    cfg = example_cfg(tmp_path / "b", weight_bits="4", opt_config=str(out / "digits_opt_template.json"),
                      eval_original_model="false")
    assert main(["--cfg", str(cfg)]) == 0
    assert (tmp_path / "b" / "out" / "digits_o.txt").read_text() == (out / "digits_o.txt").read_text()


def test_cli_search_needs_a_metric(tmp_path, capsys):
    cfg = example_cfg(tmp_path, metric=None, mixed_precision_auto_search="2,0.0,L")
    assert main(["--cfg", str(cfg)]) == 2
    assert "mixed_precision_auto_search" in capsys.readouterr().err


def test_ranked_search_bisects_to_the_sensitive_layer_in_few_evaluations():
    """With a ranking (`mixed_precision_ranking = similarity` passes the layers' 1 - isolated cosine), the search
    bisects over the ranked order instead of probing every candidate: same promotion here, fewer evaluations."""
    g, score = _prepared("fc2")
    auto = AutoSearch(3, 0.05, "L")
    probed = per_layer_search(g, score, 1.0, auto)
    ranking = {"x": 0.0, "fc1": 0.01, "fc2": 0.6, "fc3": 0.02, "fc4": 0.03}
    ranked = per_layer_search(g, score, 1.0, auto, ranking=ranking)
    assert ranked.promoted == probed.promoted == ["fc2"]
    assert ranked.reached and ranked.final_score >= 1.0 - 0.05
    assert ranked.evaluations < probed.evaluations
    assert list(ranked.settings) == ["fc2"] and ranked.settings["fc2"].q_bits_weight == 16
    # a NaN sensitivity ranks first; with a misleading ranking the bisection promotes more layers and the pruning
    # demotes the ones that do not matter
    g, score = _prepared("fc2")
    wrong = per_layer_search(g, score, 1.0, auto, ranking={"fc1": float("nan"), "fc3": 0.5, "fc2": 0.0})
    assert wrong.reached and wrong.promoted == ["fc2"]
    assert any(s.what.startswith("demote") for s in wrong.steps)
    assert wrong.final_score >= 1.0 - 0.05


def test_cli_similarity_ranking(tmp_path, capsys):
    cfg = example_cfg(tmp_path, weight_bits="4", mixed_precision_auto_search="3,0.0,L",
                      mixed_precision_ranking="similarity", metric_batch_size="128", eval_original_model="false")
    assert main(["--log-level", "info", "--cfg", str(cfg)]) == 0
    assert "mixed precision search (similarity ranking):" in capsys.readouterr().err
    search = json.loads((tmp_path / "out" / "digits_report.json").read_text())["mixed_precision"]
    assert search["reached"] and search["promoted"] and search["sensitivity"]
