"""The per-layer precision analysis reuses what it computed: its cosines/MSEs are those of the plain definition
(every layer's isolated step run on the float inputs quantized with its input params), its histograms those of a
separate forward of the first batch, and a cfg run's analysis costs one forward of the quantized graph per batch (the
float graph's outputs come from the statistics pass)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

from quantopt.analysis.report import collect_histograms, histograms_of, worst_tensors
from quantopt.analysis.similarity import (
    FirstBatch,
    LayerSimilarity,
    cosine,
    layer_similarity,
    mse,
    to_float,
    to_quantized,
)
from quantopt.config.reader import read_cfg
from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir
from quantopt.master import OptMaster
from quantopt.pipeline import quantize_model

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"


def reference_similarity(float_graph: PyGraph, quant_graph: PyGraph, batches: Sequence[Sequence[torch.Tensor]]
                         ) -> List[LayerSimilarity]:
    """The analysis by its definition, without any reuse (what quantopt computed before it reused values)."""
    sums: Dict[tuple, List[float]] = {}
    qnodes = {n.name: n for n in quant_graph.nodes}
    with torch.no_grad():
        for inputs in batches:
            float_graph.forward(inputs, keep_tensors=True)
            quant_graph.forward(inputs, keep_tensors=True)
            for fnode in float_graph.nodes:
                qnode = qnodes.get(fnode.name)
                if qnode is None:
                    continue
                cumulative = [(cosine(f.betensor, to_float(q)), mse(f.betensor, to_float(q)))
                              for f, q in zip(fnode.outputs, qnode.outputs)]
                if qnode.inputs:
                    saved_in = [t.betensor for t in qnode.inputs]
                    saved_out = [t.betensor for t in qnode.outputs]
                    for qt, ft in zip(qnode.inputs, fnode.inputs):
                        qt.betensor = to_quantized(ft.betensor, qt)
                    qnode.forward()
                    isolated = [(cosine(f.betensor, to_float(q)), mse(f.betensor, to_float(q)))
                                for f, q in zip(fnode.outputs, qnode.outputs)]
                    for t, v in zip(qnode.inputs, saved_in):
                        t.betensor = v
                    for t, v in zip(qnode.outputs, saved_out):
                        t.betensor = v
                else:
                    isolated = cumulative
                for f, c, i in zip(fnode.outputs, cumulative, isolated):
                    acc = sums.setdefault((fnode.name, f.name), [0.0, 0.0, 0.0, 0.0])
                    for k, v in enumerate(c + i):
                        acc[k] += v
    results = []
    for fnode in float_graph.nodes:
        for f in fnode.outputs:
            acc = sums.get((fnode.name, f.name))
            if acc is not None:
                results.append(LayerSimilarity(fnode.layer_id, fnode.name, str(fnode.type), f.name,
                                               *(v / len(batches) for v in acc)))
    return results


@pytest.fixture(scope="module")
def digits() -> tuple:
    graph = read_ir(str(DIGITS / "model" / "digits.txt"))
    calib = torch.from_numpy(np.load(DIGITS / "data" / "calib.npy", allow_pickle=False))
    qgraph = quantize_model(graph, [calib[i:i + 16] for i in range(0, 64, 16)])
    return graph, qgraph, [[calib[i:i + 8]] for i in range(0, 24, 8)]


def test_similarity_and_histograms_equal_the_plain_definition(digits: tuple) -> None:
    graph, qgraph, batches = digits
    want = reference_similarity(graph, qgraph, batches)
    first = FirstBatch()
    got = layer_similarity(graph, qgraph, iter(batches), first_batch=first)
    assert [s.as_dict() for s in got] == [s.as_dict() for s in want]
    names = [t.name for n in graph.nodes for t in n.outputs]
    assert histograms_of(first, names) == collect_histograms(graph, qgraph, batches[0], names)


def test_similarity_with_a_float_island_equals_the_plain_definition() -> None:
    """A float layer inside the quantized graph (trigger_float_op) and inserted Quantize/DeQuantize layers."""
    graph = read_ir(str(DIGITS / "model" / "digits.txt"))
    calib = torch.from_numpy(np.load(DIGITS / "data" / "calib.npy", allow_pickle=False))
    conv = next(n.name for n in graph.nodes if str(n.type) == "Convolution")
    qgraph = quantize_model(graph, [calib[:32]], per_layer={conv: {"trigger_float_op": "float16_preferred"}})
    batches = [[calib[32:40]]]
    want = reference_similarity(graph, qgraph, batches)
    assert [s.as_dict() for s in layer_similarity(graph, qgraph, batches)] == [s.as_dict() for s in want]


def _digits_master(tmp_path: Path, extra: str = "") -> tuple:
    cfg_path = tmp_path / "opt.cfg"
    cfg_path.write_text("[Common]\n"
                        f"graph = {DIGITS / 'model' / 'digits.txt'}\n"
                        "dataset = NumpyDataset\n"
                        f"calibration_data = {DIGITS / 'data' / 'calib.npy'}\n"
                        "calibration_batch_size = 16\n" + extra +
                        f"output_dir = {tmp_path / 'out'}\n", encoding="utf-8")
    cfg = read_cfg(str(cfg_path))
    graph = read_ir(cfg.graph)
    master = OptMaster(graph, cfg)
    master.prepare_statistics()
    return master, graph, master.quantize()


def _count_forwards(monkeypatch, graphs: Dict[str, PyGraph]) -> List[str]:
    calls: List[str] = []
    for name, g in graphs.items():
        forward = g.forward
        monkeypatch.setattr(g, "forward", lambda *a, _f=forward, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


@pytest.mark.parametrize("batches", [1, 2])
def test_a_cfg_run_analyses_with_one_quantized_forward_per_batch(tmp_path: Path, monkeypatch, batches: int) -> None:
    """The statistics pass recorded the float outputs of the analysis batches: the analysis runs only the quantized
    graph, and its results and histograms are those of running both graphs."""
    master, graph, qgraph = _digits_master(tmp_path, f"similarity_data_num = {batches}\n")
    assert master.float_record is not None and len(master.float_record.batches) == batches
    calls = _count_forwards(monkeypatch, {"float": graph, "quantized": qgraph})
    master.precision_analysis(qgraph)
    names = worst_tensors(master.similarities)
    if batches == 1:  # the first batch's worst outputs are the report's: no forward for the histograms
        assert calls == ["quantized"]
    else:  # and where two batches rank others worst, one forward of each graph histograms them
        assert sorted(calls) in (["quantized"] * 2, ["float", "quantized", "quantized", "quantized"])
    assert master.float_record is None  # freed
    inputs = list(master.calibration_batches(batches))
    monkeypatch.undo()
    want = reference_similarity(graph, qgraph, inputs)
    assert [s.as_dict() for s in master.similarities] == [s.as_dict() for s in want]
    assert list(master.histograms) == names
    assert master.histograms == collect_histograms(graph, qgraph, inputs[0], names)


def test_the_analysis_runs_the_float_forward_when_the_record_is_over_budget(tmp_path: Path, monkeypatch) -> None:
    import quantopt.graph.recorded as recorded

    monkeypatch.setattr(recorded, "RECORD_BUDGET_BYTES", 4096)
    master, graph, qgraph = _digits_master(tmp_path)
    assert master.float_record is not None and master.float_record.over_budget and not master.float_record.usable
    assert not master.float_record.batches  # what was recorded is freed at once
    calls = _count_forwards(monkeypatch, {"float": graph, "quantized": qgraph})
    master.precision_analysis(qgraph)
    assert sorted(calls) == ["float", "quantized"]
    inputs = list(master.calibration_batches(1))
    monkeypatch.undo()
    assert [s.as_dict() for s in master.similarities] == [s.as_dict() for s in reference_similarity(graph, qgraph,
                                                                                                     inputs)]


def test_the_histograms_come_from_a_forward_when_the_first_batch_kept_none_of_them(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    import quantopt.master as master_module

    monkeypatch.setattr(master_module, "HISTOGRAM_LAYERS", 0)  # the first batch keeps no values
    master, graph, qgraph = _digits_master(tmp_path)
    master.precision_analysis(qgraph)
    names = worst_tensors(master.similarities)
    assert len(names) == 5 and list(master.histograms) == names
    assert master.histograms == collect_histograms(graph, qgraph, list(master.calibration_batches(1))[0], names)


def test_the_first_batch_keeps_only_its_worst_outputs(digits: tuple) -> None:
    graph, qgraph, batches = digits
    everything = FirstBatch()
    results = layer_similarity(graph, qgraph, batches[:1], first_batch=everything)
    for count in (1, 3, 5):
        worst = FirstBatch(worst=count)
        assert layer_similarity(graph, qgraph, batches[:1], first_batch=worst) == results
        names = worst_tensors(results, count)
        assert sorted(worst) == sorted(names)
        assert histograms_of(worst, names) == histograms_of(everything, names)


def test_the_quantized_activations_are_freed_as_the_analysis_goes(digits: tuple, monkeypatch) -> None:
    """Each quantized layer is compared as the quantized forward runs it: when a layer is compared, the quantized
    graph holds only the activations later layers still read (not every layer's, as with keep_tensors), and at most
    the quantized copies of float tensors that a later layer still reads."""
    import quantopt.analysis.similarity as similarity

    graph, qgraph, batches = digits
    want = layer_similarity(graph, qgraph, iter(batches[:1]))
    readers: Dict[int, int] = {}
    for i, n in enumerate(qgraph.nodes):
        for t in n.inputs:
            readers[id(t)] = i
    position = {id(n): i for i, n in enumerate(qgraph.nodes)}
    keep = {id(t) for t in qgraph.input_tensors} | {id(t) for t in qgraph.output_tensors}
    seen: List[int] = []
    cached: List[int] = []
    original = similarity._isolated

    def watching(fnode, qnode, quantized, constant_feeds):
        here = position[id(qnode)]
        live = [t for n in qgraph.nodes for t in n.outputs if t.betensor.numel() and id(t) not in keep]
        # alive: produced at or before this layer and read at or after it
        assert all(readers.get(id(t), -1) >= here for t in live), [t.name for t in live]
        seen.append(len(live))
        cached.append(len(quantized))
        return original(fnode, qnode, quantized, constant_feeds)

    monkeypatch.setattr(similarity, "_isolated", watching)
    got = layer_similarity(graph, qgraph, iter(batches[:1]))
    assert [s.as_dict() for s in got] == [s.as_dict() for s in want]
    assert len(seen) == len(want) and len(seen) > 4
    assert max(seen) <= 2 < len(qgraph.nodes)  # a chain: the layer's input, at most one more
    assert max(cached) <= 2


def test_large_isolated_feeds_are_checked_step_by_step(digits: tuple, monkeypatch) -> None:
    """With steps small enough for the digits model, a quantized input equal to the quantized run's value is that
    value itself, a differing one is quantized whole, and the analysis equals its definition."""
    import quantopt.analysis.similarity as similarity

    graph, qgraph, batches = digits
    monkeypatch.setattr(similarity, "FEED_CHECK_FIRST", 8)
    monkeypatch.setattr(similarity, "FEED_CHECK_STEP", 32)
    seen = {"same": 0, "quantized": 0}
    original = similarity._quantized_feed

    def watching(x, qt, table):
        got = original(x, qt, table)
        want = to_quantized(x, qt, table)
        assert got.dtype == want.dtype and torch.equal(got, want)
        seen["same" if got is qt.betensor else "quantized"] += 1
        return got

    monkeypatch.setattr(similarity, "_quantized_feed", watching)
    got = layer_similarity(graph, qgraph, batches[:2])
    assert seen["same"] > 0 and seen["quantized"] > 0
    monkeypatch.undo()
    assert [s.as_dict() for s in got] == [s.as_dict() for s in reference_similarity(graph, qgraph, batches[:2])]


def test_constant_layers_are_compared_once_for_all_batches(monkeypatch) -> None:
    """A layer without inputs (here an embedding table and position embeddings) gives the same values in every
    batch: compared once, its similarity and the isolated feeds it gives are those of the plain definition."""
    import quantopt.analysis.similarity as similarity
    from quantopt.frontends.onnx import import_onnx

    graph = import_onnx(str(REPO / "tests" / "data" / "onnx_small" / "bert_encoder.onnx"),
                        {"input_ids": [1, 16], "attention_mask": [1, 16]})
    gen = torch.Generator().manual_seed(3)

    def batch() -> List[torch.Tensor]:
        mask = torch.ones(1, 16, dtype=torch.int64)
        mask[:, 12:] = 0
        return [torch.randint(0, 100, (1, 16), generator=gen), mask]

    qgraph = quantize_model(graph, [batch() for _ in range(2)])
    batches = [batch() for _ in range(3)]
    want = reference_similarity(graph, qgraph, batches)
    constants = {n.name for n in graph.nodes if str(n.type) == "Constant"}
    compared: List[str] = []
    plain = similarity._Comparison._results

    def counting(self, fnode, qnode, table):
        compared.append(fnode.name)
        return plain(self, fnode, qnode, table)

    monkeypatch.setattr(similarity._Comparison, "_results", counting)
    got = layer_similarity(graph, qgraph, iter(batches))
    assert [s.as_dict() for s in got] == [s.as_dict() for s in want]
    assert constants and all(compared.count(name) == 1 for name in constants)
    assert all(compared.count(n.name) == 3 for n in graph.nodes if n.inputs and n.name in compared)
