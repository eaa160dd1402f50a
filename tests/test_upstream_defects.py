"""The cfg field `upstream_defects` (config/upstream_defects.py, docs/golden-differences.md "Reproducing upstream's
defects"): each name brings back one upstream behaviour quantopt does not copy by default, and with all of them the
committed goldens that differ by default are identical layer for layer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import FrozenSet

import numpy as np
import pytest
import torch
from golden_helpers import compare_with_golden, layer_kinds, machine_layers, run_golden_cfg

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.calibration.inf_mask import SOFTMAX_MASK_PARAM
from quantopt.config.reader import read_cfg
from quantopt.config.upstream_defects import DEFECTS, UpstreamDefectsKind
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.tables import quant_of
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"
FLOORS = json.loads((CORPUS / "floors.json").read_text())["models"]
FLT_MAX = float(torch.finfo(torch.float32).max)
SEQ = 8


# ------------------------------------------------------------------------------------------------ the field
def test_field_values() -> None:
    kind = UpstreamDefectsKind()
    assert kind.parse("") == frozenset()
    assert kind.parse("all") == frozenset(DEFECTS)
    assert kind.parse("[Mask_As_Data, count_input_zp]") == {"mask_as_data", "count_input_zp"}
    for bad, why in (("mask_as_dat", "unknown upstream defect 'mask_as_dat'"), ("all, count_input_zp", "alone"),
                     ("count_input_zp, count_input_zp", "named twice")):
        with pytest.raises(ValueError, match=why):
            kind.parse(bad)


def test_cfg_error_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "opt.cfg"
    (tmp_path / "m.txt").write_text("")
    cfg.write_text("[Common]\ngraph = m.txt\nupstream_defects = mask_as_data, wrong_zp\n")
    with pytest.raises(ConfigError, match="upstream_defects.*unknown upstream defect 'wrong_zp'"):
        read_cfg(str(cfg))
    cfg.write_text("[Common]\ngraph = m.txt\nupstream_defects = all\n")
    assert read_cfg(str(cfg)).upstream_defects == frozenset(DEFECTS)


# ------------------------------------------------------------------------------------------------ mask_as_data
def masked_softmax_model():
    """scores [1,2,8,8] + Where(keep, 0, -FLT_MAX) → Softmax."""
    g = GraphBuilder("masked")
    scores = g.input("scores", [1, 2, SEQ, SEQ])
    keep = g.input("keep", [1, 1, 1, SEQ])
    shape = [1, 1, 1, SEQ]
    zero = g.layer("Constant", [], [shape], name="zero", constants={"weights": np.zeros(shape, np.float32)})
    neg = g.layer("Constant", [], [shape], name="neg", constants={"weights": np.full(shape, -FLT_MAX, np.float32)})
    mask = g.layer("Where", [keep, zero, neg], [shape], name="mask")
    add = g.layer("Add", [scores, mask], [[1, 2, SEQ, SEQ]], name="add", params={"with_activation": "NONE"})
    out = g.layer("Softmax", [add], [[1, 2, SEQ, SEQ]], name="softmax", params={"axis": -1})
    return g.build([out])


def masked_feeds(n: int):
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        keep = np.zeros((1, 1, 1, SEQ), np.float32)
        keep[..., :3 + i % (SEQ - 2)] = 1.0
        out.append([torch.from_numpy(rng.normal(0, 2, (1, 2, SEQ, SEQ)).astype(np.float32)), torch.from_numpy(keep)])
    return out


def _layer(graph, name: str):
    return next(n for n in graph.nodes if n.name == name)


def test_mask_as_data_quantizes_the_mask_as_upstream() -> None:
    """By default the -FLT_MAX constant is a mask (saturating, probability 0 after Softmax); with mask_as_data it is
    an int32 of scale 1 as upstream writes it, the Softmax has no mask rule, and the scores lose their codes."""
    feeds = masked_feeds(8)
    ours = quantize_model(masked_softmax_model(), feeds)
    theirs = quantize_model(masked_softmax_model(), feeds, settings={"upstream_defects": frozenset({"mask_as_data"})})
    neg_ours, neg_theirs = _layer(ours, "neg"), _layer(theirs, "neg")
    q_ours, q_theirs = quant_of(neg_ours).get(neg_ours.outputs[0]), quant_of(neg_theirs).get(neg_theirs.outputs[0])
    assert not q_ours.qinvariant and q_theirs.qinvariant and q_theirs.scale == 1.0
    assert neg_theirs.outputs[0].dtype == Dtype.INT32
    assert _layer(ours, "softmax").params.get(SOFTMAX_MASK_PARAM) is True
    assert SOFTMAX_MASK_PARAM not in _layer(theirs, "softmax").params
    add = _layer(theirs, "add")
    assert quant_of(add).get(add.outputs[0]).scale < 1e-6  # the int32 bound sets the sum's range
    with torch.no_grad():
        ref = masked_softmax_model().forward(feeds[0])[0]
        p_ours, p_theirs = run_quantized(ours, feeds[0])[0], run_quantized(theirs, feeds[0])[0]
    kept = feeds[0][1].expand_as(ref) > 0  # run_quantized gives dequantized probabilities
    err_ours = float((p_ours - ref).abs()[kept].max())
    err_theirs = float((p_theirs - ref).abs()[kept].max())
    assert err_ours < 0.05 < err_theirs, (err_ours, err_theirs)


def detect_model(fill: float):
    """x [1,8] + Constant(fill at the last 3 positions) → output."""
    g = GraphBuilder("detect")
    x = g.input("x", [1, SEQ])
    values = np.zeros((1, SEQ), np.float32)
    values[0, -3:] = fill
    c = g.layer("Constant", [], [[1, SEQ]], name="c", constants={"weights": values})
    out = g.layer("Add", [x, c], [[1, SEQ]], name="add", params={"with_activation": "NONE"})
    return g.build([out])


@pytest.mark.parametrize(("defects", "expected"), [(frozenset(), -FLT_MAX),
                                                   (frozenset({"mask_as_data"}), -32768.0)])
def test_detect_inf_mask_nodes_forms(defects: FrozenSet[str], expected: float) -> None:
    """enable_pass_detect_inf_mask_nodes: -1e9 becomes quantopt's mask value -FLT_MAX, or upstream's -32768 with
    mask_as_data."""
    from quantopt.passes.inf_mask import detect_inf_mask_nodes
    from quantopt.pipeline import settings_from_arguments

    graph = detect_model(-1e9)
    settings_from_arguments(graph, {"detect_inf_mask_nodes": True, "upstream_defects": defects})
    assert detect_inf_mask_nodes(graph) == ["c"]
    w = _layer(graph, "c").constants["weights"].betensor
    assert w[0, -3:].tolist() == [expected] * 3 and w[0, :-3].abs().max() == 0


@pytest.mark.parametrize("defects", [frozenset(), frozenset({"mask_as_data"})])
def test_detect_rewrites_a_mask_batchnorm(defects: FrozenSet[str]) -> None:
    """A BatchNorm y = x·w + b with w + b summing to 0 and every b below -65536 (1 keeps, 0 masks) gets w = 32767,
    b = -32767, as upstream's pass writes it, with or without mask_as_data; any other BatchNorm is left alone."""
    from quantopt.passes.inf_mask import detect_inf_mask_nodes
    from quantopt.pipeline import settings_from_arguments

    def bn_model(bias: float):
        g = GraphBuilder("bn")
        x = g.input("x", [1, SEQ])
        out = g.layer("BatchNorm", [x], [[1, SEQ]], name="bn", params={"axis": -1, "with_activation": "NONE"},
                      constants={"weights": np.full(SEQ, -bias, np.float32), "biases": np.full(SEQ, bias, np.float32)})
        return g.build([out])

    settings = {"detect_inf_mask_nodes": True, "upstream_defects": defects}
    mask_bn = bn_model(-1e9)
    settings_from_arguments(mask_bn, settings)
    assert detect_inf_mask_nodes(mask_bn) == ["bn"]
    bn = _layer(mask_bn, "bn")
    assert bn.constants["weights"].betensor.tolist() == [32767.0] * SEQ
    assert bn.constants["biases"].betensor.tolist() == [-32767.0] * SEQ
    plain = bn_model(-100.0)
    settings_from_arguments(plain, settings)
    assert detect_inf_mask_nodes(plain) == []


# ------------------------------------------------------------------------------------------------ Where
def where_model(const: float):
    """Where(cond, x, Constant(const)): one quantized and one integer-valued branch."""
    g = GraphBuilder("where")
    cond = g.input("cond", [1, SEQ])
    x = g.input("x", [1, SEQ])
    c = g.layer("Constant", [], [[1, SEQ]], name="c", constants={"weights": np.full((1, SEQ), const, np.float32)})
    out = g.layer("Where", [cond, x, c], [[1, SEQ]], name="where")
    return g.build([out])


def where_feeds():
    rng = np.random.default_rng(2)
    return [[torch.from_numpy((rng.random((1, SEQ)) > 0.5).astype(np.float32)),
             torch.from_numpy(rng.normal(0, 3, (1, SEQ)).astype(np.float32))] for _ in range(4)]


def test_where_integer_branch_requantized_or_passed_through() -> None:
    """An integer branch (3.0: an int of scale 1) is requantized to the output's scale by default; with
    where_integer_passthrough it passes through unscaled (M = 1, N = 0), as upstream writes it."""
    feeds = where_feeds()
    ours = _layer(quantize_model(where_model(3.0), feeds), "where")
    theirs = _layer(quantize_model(where_model(3.0), feeds,
                                   settings={"upstream_defects": frozenset({"where_integer_passthrough"})}), "where")
    assert (theirs.params["scale_value"][1], theirs.params["shift_value"][1]) == (1, 0)
    s_out = quant_of(ours).get(ours.outputs[0]).scale
    m, n = ours.params["scale_value"][1], ours.params["shift_value"][1]
    assert m / 2 ** n == pytest.approx(s_out, rel=1e-2)
    assert theirs.params["scale_value"][0] == ours.params["scale_value"][0]


def test_where_of_two_integers_is_written_as_upstream() -> None:
    """Two integer branches: an integer output, each branch passed through as `[1, 1]`, `[0, 0]` with uint8
    multipliers at any activation bits."""
    g = GraphBuilder("where2")
    cond = g.input("cond", [1, SEQ])
    a = g.layer("Constant", [], [[1, SEQ]], name="a", constants={"weights": np.full((1, SEQ), 2.0, np.float32)})
    b = g.layer("Constant", [], [[1, SEQ]], name="b", constants={"weights": np.full((1, SEQ), -5.0, np.float32)})
    out = g.layer("Where", [cond, a, b], [[1, SEQ]], name="where")
    graph = g.build([out])
    feeds = [[f[0]] for f in where_feeds()]
    q = quantize_model(graph, feeds, settings={"q_bits_activation": 16})
    w = _layer(q, "where")
    assert (w.params["scale_value"], w.params["shift_value"]) == ([1, 1], [0, 0])
    assert w.params["scale_type"] == [Dtype.UINT8, Dtype.UINT8]
    with torch.no_grad():
        got = run_quantized(q, feeds[0])[0]
    assert got.tolist() == torch.where(feeds[0][0] != 0, 2, -5).tolist()


# ------------------------------------------------------------------------------------------------ the goldens
AFFECTED = sorted(m for m, variants in FLOORS.items()
                  if any(v.get("differing") for v in variants.values()))
"""Corpus models with a layer differing from upstream's golden by default."""

ALONE = [("causal_sdpa", "A", "mask_as_data"), ("padding_mask", "C", "mask_as_data, where_integer_passthrough"),
         ("op_detect_inf_mask", "B", "mask_as_data"), ("pool_norm", "C", "eltwise_equal_scale_passthrough"),
         ("op_count", "B", "count_input_zp"), ("op_region", "B", "region_input_zp"),
         ("op_regionfuse", "B", "region_input_zp"), ("op_convinteger", "A", "convinteger_producer_zp")]


def test_every_default_difference_is_covered() -> None:
    """The models below are exactly those that differ by default, so a new difference needs a decision."""
    assert AFFECTED == sorted({m for m, _, _ in ALONE})


def _assert_as_upstream(model: str, letter: str, ours: Path) -> None:
    """Every layer of `ours` is the golden's, but for those upstream itself writes otherwise on this kind of CPU
    (tests/golden_helpers.py `machine_layers`), which must then differ as upstream's do."""
    result = compare_with_golden(ours, CORPUS / model / "golden" / letter / f"{model}_o.txt")
    machine = machine_layers(CORPUS, model, letter)
    differing = {name: layer_kinds(d) for name, d in result.differing.items()}
    assert all(machine.get(name) == kinds for name, kinds in differing.items()), differing


@pytest.mark.parametrize(("model", "letter"), [(m, v) for m in AFFECTED for v in "ABC"])
def test_all_defects_reproduce_the_golden(model: str, letter: str, tmp_path: Path) -> None:
    folder = CORPUS / model / "golden" / letter
    ours = run_golden_cfg(folder, model, tmp_path / "out", quiet=True, extra=["upstream_defects = all"])
    _assert_as_upstream(model, letter, ours)


@pytest.mark.parametrize(("model", "letter", "names"), ALONE, ids=[f"{m}-{v}" for m, v, _ in ALONE])
def test_each_defect_alone(model: str, letter: str, names: str, tmp_path: Path) -> None:
    """The named defects alone turn the layers that differ by default into upstream's."""
    assert FLOORS[model][letter]["differing"], f"{model}/{letter} differs by default"
    folder = CORPUS / model / "golden" / letter
    ours = run_golden_cfg(folder, model, tmp_path / "out", quiet=True, extra=[f"upstream_defects = {names}"])
    _assert_as_upstream(model, letter, ours)
