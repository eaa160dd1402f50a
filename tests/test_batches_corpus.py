"""Batch sizes other than the IR's on every model of the golden corpus (tests/data/golden_corpus: transformers,
recurrent, OCR, detection and U-Net models and one-operator graphs): the float and the quantized forward of a batch
give every sample, tensor by tensor, the bits it gets at the IR batch (docs/user-guide.md, "Batch sizes";
tests/test_batches.py holds the rules' own cases). The models' committed calibration data are the samples."""
from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from test_batches import assert_same, run_in_batches

from quantopt.errors import UnsupportedError
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model

CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"


def _samples(folder: Path, graph) -> List[torch.Tensor]:
    """The model's calibration samples, one tensor per graph input (the .npz names its inputs by layer)."""
    npz = folder / "calib.npz"
    if npz.exists():
        data = dict(np.load(npz, allow_pickle=False))
        return [torch.from_numpy(data[t.name if t.name in data else t.pnode.name]) for t in graph.input_tensors]
    return [torch.from_numpy(np.load(folder / "calib.npy", allow_pickle=False))]


SCALAR_PER_BATCH = {"op_filter": "output 'count' is one value per IR batch",
                    "op_if": "the target shape is a scalar", "op_loop": "the target shape is a scalar"}
"""Models with a tensor of one value per sample (a Filter's count, an If/Loop condition reshaped to a scalar): a
batch of several samples cannot hold it, and running one is the one-line batch error naming the layer."""

MODELS = sorted(p.name for p in CORPUS.iterdir() if (p / f"{p.name}.txt").exists())
BATCHABLE = [m for m in MODELS if m not in SCALAR_PER_BATCH]


def _model(model: str):
    folder = CORPUS / model
    graph = read_ir(str(folder / f"{model}.txt"))
    ir_batch = int(graph.input_tensors[0].ir_shape[0])
    samples = _samples(folder, graph)
    rows = min(int(s.shape[0]) for s in samples) // ir_batch * ir_batch
    assert rows >= 3 * ir_batch
    return graph, ir_batch, [s[:rows] for s in samples]


def test_the_corpus_is_all_here() -> None:
    assert len(MODELS) > 100 and set(SCALAR_PER_BATCH) <= set(MODELS)


@pytest.mark.parametrize("model", sorted(SCALAR_PER_BATCH))
def test_a_scalar_per_sample_is_the_one_line_batch_error(model: str) -> None:
    graph, ir_batch, samples = _model(model)
    graph.forward([s[:ir_batch] for s in samples])
    with pytest.raises(UnsupportedError, match=f"cannot run at this batch size: .*{SCALAR_PER_BATCH[model]}"):
        graph.forward([s[:2 * ir_batch] for s in samples])


@pytest.mark.parametrize("model", BATCHABLE)
def test_every_sample_gets_its_ir_batch_bits_at_other_batches(model: str) -> None:
    graph, ir_batch, samples = _model(model)
    rows = int(samples[0].shape[0])
    calibration = [[s[i:i + ir_batch] for s in samples] for i in range(0, 2 * ir_batch, ir_batch)]
    qgraph = quantize_model(graph, calibration)  # the float graph as the quantized one was made from (passes run)
    float_reference = run_in_batches(graph, samples, ir_batch)
    quant_reference = run_in_batches(qgraph, samples, ir_batch)
    for batch in (2 * ir_batch, rows):
        assert_same(float_reference, run_in_batches(graph, samples, batch), f"{model} float at batch {batch}")
        assert_same(quant_reference, run_in_batches(qgraph, samples, batch), f"{model} quantized at batch {batch}")
