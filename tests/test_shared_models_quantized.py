"""Every reference IR in tests/data/shared_models quantizes with the default settings, its quantized IR re-loads and the
re-loaded integer forward is bit-identical; dequantized outputs stay close to the float outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, shared_model_dir

from quantopt.analysis.similarity import cosine, to_float
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_quantizes_with_defaults_and_reloads_bit_identical(model: str, tmp_path) -> None:
    folder = shared_model_dir(model)
    graph = read_ir(str(folder / f"{model}.txt"))
    calib = torch.from_numpy(np.load(folder / "calib.npy"))
    val = torch.from_numpy(np.load(folder / "val.npy"))
    qgraph = quantize_model(graph, [calib[i:i + 2] for i in range(0, len(calib), 2)])
    float_out = [t.clone() for t in graph.forward([val])]
    qgraph.forward([val])
    ints = [t.betensor.clone() for t in qgraph.output_tensors]
    deq = [to_float(t) for t in qgraph.output_tensors]
    txt, _ = write_ir(qgraph, str(tmp_path / f"{model}_o.txt"))
    again = read_ir(txt)
    assert all(n.quantized for n in again.nodes)
    again.forward([val])
    for a, b in zip(ints, again.output_tensors):
        assert torch.equal(a, b.betensor)
    for f, q in zip(float_out, deq):
        assert cosine(f, q) > 0.95, f"{model}: float vs quantized cosine {cosine(f, q):.4f}"
