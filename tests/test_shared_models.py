"""Every reference IR in tests/data/shared_models loads, round-trips, and its float forward matches onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, shared_model_dir

from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir


def _labels(folder, graph):
    if (folder / "val_label.npz").is_file():
        data = np.load(folder / "val_label.npz", allow_pickle=False)
        # the npz keys are the ONNX output names, in the order of the IR's output_tensors
        return [data[k] for k in data.files]
    return [np.load(folder / "val_label.npy", allow_pickle=False)]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_float_forward_matches_reference_outputs(name):
    folder = shared_model_dir(name)
    graph = read_ir(str(folder / f"{name}.txt"))
    val = np.load(folder / "val.npy", allow_pickle=False)
    with torch.no_grad():
        outputs = graph.forward([torch.from_numpy(val)])
    labels = _labels(folder, graph)
    assert len(outputs) == len(labels)
    for out, ref in zip(outputs, labels):
        out = out.numpy().reshape(ref.shape)
        scale = max(float(ref.max() - ref.min()), 1e-12)
        err = float(np.abs(out - ref).max()) / scale
        assert err <= 1e-4, f"{name}: max abs error {err:.2e} of the output range"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_round_trip_is_identical(name, tmp_path):
    folder = shared_model_dir(name)
    src = folder / f"{name}.txt"
    graph = read_ir(str(src))
    out_txt, out_bin = write_ir(graph, str(tmp_path / f"{name}.txt"))
    assert open(out_bin, "rb").read() == (folder / f"{name}.bin").read_bytes()
    assert open(out_txt).read().strip() == src.read_text().strip()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_batch_of_one_matches_batch_of_eight(name):
    folder = shared_model_dir(name)
    graph = read_ir(str(folder / f"{name}.txt"))
    val = torch.from_numpy(np.load(folder / "val.npy", allow_pickle=False))
    with torch.no_grad():
        full = [o.clone() for o in graph.forward([val])]
        single = [o.clone() for o in graph.forward([val[3:4]])]
    for f, s in zip(full, single):
        assert torch.allclose(f[3:4], s, atol=1e-5, rtol=1e-5)
