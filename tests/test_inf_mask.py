"""Attention masks of -inf / -FLT_MAX (calibration/inf_mask.py, docs/statistics-and-dump.md "Masks with infinite
values"):
statistics leave the mask values out, a -FLT_MAX constant is no int32 of scale 1, the mask saturates to the integer
minimum through Where and Add, and the quantized Softmax gives masked positions probability 0."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mask_models import padding_feeds, padding_mask_model

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.analysis.similarity import LayerSimilarity, cosine, layer_similarity, worst_layers_table
from quantopt.calibration.inf_mask import SOFTMAX_MASK_PARAM, is_mask_tensor
from quantopt.calibration.statistics import StatisticsConfig, update_statistics
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.tables import TensorStatistics
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized

FLT_MAX = float(torch.finfo(torch.float32).max)
HEADS = 4


def masked_softmax_model(fill: float = -FLT_MAX, mask_op: str = "Where"):
    """scores [1,4,8,8] + mask[1,1,1,8] → Softmax; the mask is Where(keep, 0, fill) or (1 - keep) * fill."""
    return padding_mask_model(fill, mask_op, HEADS)


def feeds(n: int, seed: int):
    """Scores of a few units, and masks keeping the first 3..8 positions."""
    return padding_feeds(n, seed, HEADS)


# ------------------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("huge", [-math.inf, -FLT_MAX, -1e30])
def test_statistics_leave_mask_values_out(huge: float) -> None:
    x = torch.tensor([[-2.0, 1.5, huge, 0.5], [huge, huge, 3.0, -1.0]])
    st = update_statistics(TensorStatistics(), x, StatisticsConfig(need_moments=True, need_histogram=True), 0)
    assert float(st.extrema_min) == -2.0 and float(st.extrema_max) == 3.0
    assert float(st.inf_mask_low) == 3.0 and st.inf_mask_high is None
    finite = x[x > -1e29]
    assert float(st.running_mean) == pytest.approx(float(finite.mean()))
    assert float(st.running_histc.sum()) == finite.numel()
    # a second batch without mask values keeps the count and widens only with its data
    update_statistics(st, torch.tensor([4.0, -0.5]), StatisticsConfig(), 1)
    assert float(st.extrema_max) == 4.0 and float(st.inf_mask_low) == 3.0


def test_statistics_without_mask_values_are_unchanged() -> None:
    rng = np.random.default_rng(3)
    for cfg in (StatisticsConfig(need_moments=False), StatisticsConfig(need_histogram=True, key_axis=-1)):
        a, b = TensorStatistics(), TensorStatistics()
        for i in range(3):
            x = torch.from_numpy(rng.normal(0, 5, (4, 6)).astype(np.float32))
            update_statistics(a, x, cfg, i)
            update_statistics(b, x, StatisticsConfig(**{**cfg.__dict__, "mask_threshold": math.inf}), i)
        for name in TensorStatistics.__dataclass_fields__:
            va, vb = getattr(a, name), getattr(b, name)
            assert (va is None and vb is None) or torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), name
        assert a.inf_mask_low is None and a.inf_mask_high is None


def test_all_mask_tensor_counts_as_zero() -> None:
    st = update_statistics(TensorStatistics(), torch.full((3,), -FLT_MAX), StatisticsConfig(), 0)
    assert float(st.extrema_min) == 0.0 and float(st.extrema_max) == 0.0 and float(st.inf_mask_low) == 3.0


# ------------------------------------------------------------------------------------------------ quantization
@pytest.mark.parametrize("fill", [-FLT_MAX, -math.inf])
def test_masked_positions_get_probability_zero(fill: float, tmp_path: Path) -> None:
    graph = masked_softmax_model(fill)
    q = quantize_model(graph, feeds(8, 0))
    assert all(is_mask_tensor(graph.statistics.get(t)) for n in graph.nodes if n.name in ("neg", "mask", "add")
               for t in n.outputs)
    nodes = {n.name: n for n in q.nodes}
    neg = q.quant.get(nodes["neg"].outputs[0])
    assert not neg.qinvariant and neg.qbits == 8, "a -FLT_MAX constant must not be an int32 of scale 1"
    assert nodes["softmax"].params[SOFTMAX_MASK_PARAM] is True
    # the Add output keeps the scores' range, not one of 1e38
    assert q.quant.get(nodes["add"].outputs[0]).scale > 5.0
    for batch in feeds(6, 1):
        want = graph.forward(batch)[0]
        got = run_quantized(q, batch)[0]
        keep = batch[1].reshape(-1) > 0
        assert float(got[..., ~keep].abs().max()) == 0.0 if bool((~keep).any()) else True
        assert cosine(got, want) > 0.99
        assert float((got.sum(-1) - 1).abs().max()) < 0.05
    # the IR keeps the semantics: written and read back, the integer forward is bit-identical
    path = tmp_path / "masked_o.txt"
    write_ir(q, str(path))
    again = read_ir(str(path))
    batch = feeds(2, 5)[1]
    q.forward(batch)
    first = q.output_tensors[0].betensor.clone()
    again.forward(batch)
    assert torch.equal(again.output_tensors[0].betensor, first)


def test_mul_mask_pattern() -> None:
    """(1 - keep) * -FLT_MAX, the other way models write the mask."""
    graph = masked_softmax_model(mask_op="Mul")
    q = quantize_model(graph, feeds(8, 0))
    for batch in feeds(4, 2):
        got = run_quantized(q, batch)[0]
        keep = batch[1].reshape(-1) > 0
        assert float(got[..., ~keep].abs().max()) == 0.0
        assert cosine(got, graph.forward(batch)[0]) > 0.99


@pytest.mark.parametrize("subtract", ["Sub", "Eltwise"])
@pytest.mark.parametrize("mask_op", ["Where", "Mul"])
@pytest.mark.parametrize("score_scale", [1.0, 100.0])
def test_subtracted_mask_pattern(subtract: str, mask_op: str, score_scale: float) -> None:
    """scores - 1e30 * (1 - keep) (XLNet's form): the subtracted mask holds +1e30, which saturates to its qmax and
    must still drive the Sub to its qmin. Its range is widened above for that; before, it kept the range floor's
    scale, enough for scores of a few units but not for scores of hundreds (masked positions then got
    probability up to 1)."""
    graph = padding_mask_model(1e30, mask_op, HEADS, subtract=subtract)
    q = quantize_model(graph, [[s * score_scale, k] for s, k in feeds(8, 0)])
    for scores, keep_flags in feeds(4, 2):
        batch = [scores * score_scale, keep_flags]
        got = run_quantized(q, batch)[0]
        keep = keep_flags.reshape(-1) > 0
        assert float(got[..., ~keep].abs().max()) == 0.0
        assert cosine(got[..., keep], graph.forward(batch)[0][..., keep]) > 0.99


def test_finite_mask_needs_a_field() -> None:
    """-1e9 is not a mask value by default; enable_pass_detect_inf_mask_nodes turns the constant into -FLT_MAX in
    the float graph, detect_finite_masks takes it as a finite mask and leaves the float graph as it is
    (calibration/finite_mask.py, tests/test_finite_mask.py)."""
    for name in ("enable_pass_detect_inf_mask_nodes", "detect_finite_masks"):
        assert FIELDS[name].default is False and name not in UPSTREAM_FIELDS
    plain = masked_softmax_model(-1e9)
    quantize_model(plain, feeds(8, 0))
    assert not any(is_mask_tensor(plain.statistics.get(t)) for n in plain.nodes for t in n.outputs)
    finite = masked_softmax_model(-1e9)
    quantize_model(finite, feeds(8, 0), settings={"detect_finite_masks": True})
    assert float(finite.nodes[[n.name for n in finite.nodes].index("neg")].constants["weights"].betensor.min()) \
        == -1e9
    assert all(is_mask_tensor(finite.statistics.get(t)) for n in finite.nodes if n.name in ("neg", "mask", "add")
               for t in n.outputs)
    graph = masked_softmax_model(-1e9)
    q = quantize_model(graph, feeds(8, 0), settings={"detect_inf_mask_nodes": True})
    assert float(graph.nodes[[n.name for n in graph.nodes].index("neg")].constants["weights"].betensor.min()) \
        == -FLT_MAX
    for batch in feeds(3, 4):
        keep = batch[1].reshape(-1) > 0
        assert float(run_quantized(q, batch)[0][..., ~keep].abs().max()) == 0.0


def test_mask_similarity_ignores_mask_positions() -> None:
    graph = masked_softmax_model()
    q = quantize_model(graph, feeds(8, 0))
    sims = {s.name: s for s in layer_similarity(graph, q, feeds(2, 3))}
    add = sims["add"]
    assert math.isfinite(add.cumulative_mse) and add.cumulative_mse < 1.0 and add.isolated_cos > 0.99
    assert "mask position" in add.note


def test_nan_similarity_is_listed_first() -> None:
    rows = [LayerSimilarity(1, "good", "Conv", "good_0", 0.99, 0.1, 0.98, 0.1),
            LayerSimilarity(2, "bad", "Add", "bad_0", 0.5, 1.0, 0.4, 1.0),
            LayerSimilarity(3, "nan", "Add", "nan_0", math.nan, math.nan, math.nan, math.nan, "float output holds NaN")]
    lines = worst_layers_table(rows, 2).splitlines()
    assert "nan" in lines[2] and "NaN" in lines[2] and "float output holds NaN" in lines[2]
    assert "bad" in lines[3] and len(lines) == 4


def test_export_keeps_the_masked_softmax() -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from quantopt.exporters.agreement import measure_agreement

    graph = masked_softmax_model(mask_op="Mul")  # Where has no QDQ mapping
    q = quantize_model(graph, feeds(8, 0))
    batch = feeds(1, 7)[0]
    assert bool((batch[1] == 0).any())
    agreement = measure_agreement(q, [b.numpy() for b in batch])
    assert agreement.identical == 1.0, agreement


def test_a_mask_read_by_a_comparison_keeps_a_code_of_its_own() -> None:
    """One -FLT_MAX constant feeds two Where layers: `flags` (0 or the mask) read only by a comparison, `mask` (0.25
    or the mask) by a Softmax. `flags` calibrates to [0, 0]; at its scale of 1 the constant's code, fine-scaled for
    `mask`, came back as 0 and `flags < 0` was false everywhere (Longformer's padding mask, shared so). A mask
    tensor without a negative end now gets one as large as its other end (at least 1)."""
    g = GraphBuilder("shared")
    keep = g.input("keep", [1, 1, 1, 8])
    shape = [1, 1, 1, 8]

    def const(name: str, value: float):
        return g.layer("Constant", [], [shape], name=name, constants={"weights": np.full(shape, value, np.float32)})

    neg = const("neg", -FLT_MAX)
    flags = g.layer("Where", [keep, const("zero", 0.0), neg], [shape], name="flags")
    zero = g.layer("Constant", [], [[1]], name="z0", constants={"weights": np.zeros(1, np.float32)})
    dropped = g.layer("Logical", [flags, zero], [shape], name="dropped", params={"method": "LESS"})
    mask = g.layer("Where", [keep, const("quarter", 0.25), neg], [shape], name="mask")
    graph = g.build([dropped, g.layer("Softmax", [mask], [shape], name="softmax", params={"axis": -1})])
    keeps = [[k] for _, k in feeds(8, 0)]
    q = quantize_model(graph, keeps)
    for batch in keeps[:4]:
        with torch.no_grad():
            want = [t.clone() for t in graph.forward(batch)]
        got = run_quantized(q, batch)
        assert torch.equal(got[0].to(want[0].dtype), want[0])
        keep_flags = batch[0].reshape(-1) > 0
        assert float(got[1][..., ~keep_flags].abs().max()) == 0.0
