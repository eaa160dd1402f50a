"""The bundled digits example: its committed float IR must load and classify the held-out digits correctly."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quantopt.ir.reader import read_ir
from quantopt.registry import discover_plugins, forward_function

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits"


def test_digits_float_ir_accuracy() -> None:
    discover_plugins()
    graph = read_ir(str(EXAMPLE / "model" / "digits.txt"))
    missing = sorted({str(n.type) for n in graph.nodes if forward_function(str(n.type)) is None})
    assert not missing, f"no float forward registered for {missing}"
    assert [t.name for t in graph.input_tensors] == ["input_0"]
    assert list(graph.input_tensors[0].ir_shape) == [1, 1, 8, 8]
    val = np.load(EXAMPLE / "data" / "val.npy", allow_pickle=False)
    labels = np.load(EXAMPLE / "data" / "val_label.npy", allow_pickle=False)
    assert val.dtype == np.float32 and val.shape[1:] == (1, 8, 8)
    assert labels.dtype == np.int64 and labels.shape == (val.shape[0],)
    correct = 0
    for start in range(0, len(val), 64):
        with torch.no_grad():
            prob = graph.forward([torch.from_numpy(val[start:start + 64])])[0]
        assert prob.shape == (min(64, len(val) - start), 10)
        torch.testing.assert_close(prob.sum(dim=1), torch.ones(prob.shape[0]), rtol=0, atol=1e-5)
        correct += int((prob.argmax(dim=1).numpy() == labels[start:start + 64]).sum())
    assert correct / len(val) >= 0.95


def test_digits_calibration_data() -> None:
    calib = np.load(EXAMPLE / "data" / "calib.npy", allow_pickle=False)
    assert calib.dtype == np.float32 and calib.shape == (64, 1, 8, 8)
    assert calib.min() >= 0.0 and calib.max() <= 1.0
