"""The golden corpus (tests/data/golden_corpus) as tests of whole-graph properties read it: every model's float IR
and its committed calibration samples, one tensor per graph input."""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch

from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir

CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"
MODELS = sorted(p.name for p in CORPUS.iterdir() if (p / f"{p.name}.txt").exists())
"""Every model of the corpus, by name."""
ONE_IR_BATCH = {"op_filter", "op_if", "op_loop"}
"""Corpus models that cannot run several IR batches at once (tests/test_batches_corpus.py)."""


def corpus_model(model: str) -> Tuple[PyGraph, int, List[torch.Tensor]]:
    """(float graph, IR batch, calibration samples per graph input) of a corpus model (the .npz names its inputs by
    tensor or by layer)."""
    folder = CORPUS / model
    graph = read_ir(folder / f"{model}.txt", folder / f"{model}.bin")
    npz = folder / "calib.npz"
    data = dict(np.load(npz, allow_pickle=False)) if npz.exists() else {
        graph.input_tensors[0].name: np.load(folder / "calib.npy", allow_pickle=False)}
    arrays = [torch.from_numpy(data[t.name if t.name in data else t.pnode.name]) for t in graph.input_tensors]
    return graph, int(graph.input_tensors[0].ir_shape[0]), arrays


def ir_batches(arrays: List[torch.Tensor], size: int, count: int) -> List[List[torch.Tensor]]:
    """Up to `count` consecutive batches of `size` samples (as many as the samples hold)."""
    rows = min(int(a.shape[0]) for a in arrays)
    return [[a[i * size:(i + 1) * size] for a in arrays] for i in range(min(count, rows // size))]
