"""Every golden-corpus model (one graph per operator type plus the transformer, recurrent, OCR, detection and U-Net
models) and every shared CNN model run by `quantopt run` on the CPU and on a CUDA device: the quantized IR's
outputs must be the same integers, and the float IR's outputs the same floats up to the summation order of the
GPU libraries.

The device is $QUANTOPT_TEST_DEVICE (cuda, cuda:N, or fake-cuda: the CPU emulation of tests/fake_cuda.py), else
`cuda` where torch sees one; on a machine without a GPU and without that variable these tests are skipped
(docs/performance.md, "Devices", records the runs on a GPU machine)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from golden_helpers import run_golden_cfg

from quantopt.runner import run_files

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "golden_corpus"
SHARED = DATA / "shared_models"
FLOORS = json.loads((CORPUS / "floors.json").read_text())["models"]
FOLDERS: Dict[str, Path] = {m: CORPUS / m for m, v in FLOORS.items() if "quantopt_failed" not in v["A"]}
FOLDERS.update({p.name: p for p in SHARED.iterdir() if (p / "golden" / "A" / "opt.cfg").is_file()})
MODELS: List[str] = sorted(FOLDERS)
_ASKED = os.environ.get("QUANTOPT_TEST_DEVICE", "").strip().lower()
DEVICE = "cuda" if _ASKED == "fake-cuda" else _ASKED if _ASKED.startswith("cuda") else \
    ("cuda" if torch.cuda.is_available() else "")
"""`fake-cuda` (conftest.py) checks only that every model runs there: its values are the CPU's."""

ON_DEVICE = MODELS if DEVICE else [pytest.param("", marks=pytest.mark.skip(
    reason="needs a CUDA device (torch sees none on this machine; QUANTOPT_TEST_DEVICE names one)"))]


def _outputs(ir: Path, inputs: List[Path], out: Path, device: str, quantized: bool) -> Dict[str, np.ndarray]:
    index = run_files(str(ir), [str(p) for p in inputs], str(out), quantize_inputs=quantized,
                      device=device)
    return {name: np.load(out / e["file"]) for name, e in index["outputs"].items()}


def _first_samples(model: str, folder: Path) -> List[Path]:
    """The first calibration sample as one .npy per input, in the order the cfg's dataset feeds them."""
    single = FOLDERS[model] / "calib.npy"
    if single.is_file():
        arrays = [np.load(single)[:1]]
    else:
        with np.load(FOLDERS[model] / "calib.npz") as z:
            arrays = [z[k][:1] for k in z.files]
    paths = []
    for i, a in enumerate(arrays):
        paths.append(folder / f"input{i}.npy")
        np.save(paths[-1], a)
    return paths


@pytest.mark.parametrize("model", ON_DEVICE)
def test_same_integers_on_cuda(model: str, tmp_path: Path) -> None:
    ir = run_golden_cfg(FOLDERS[model] / "golden" / "A", model, tmp_path / "opt", quiet=True)
    inputs = _first_samples(model, tmp_path)
    cpu = _outputs(ir, inputs, tmp_path / "cpu", "cpu", quantized=True)
    gpu = _outputs(ir, inputs, tmp_path / "gpu", DEVICE, quantized=True)
    assert cpu.keys() == gpu.keys()
    for name in cpu:
        assert cpu[name].dtype == gpu[name].dtype, name
        np.testing.assert_array_equal(cpu[name], gpu[name], err_msg=f"{model}: output {name}")


@pytest.mark.parametrize("model", ON_DEVICE)
def test_close_floats_on_cuda(model: str, tmp_path: Path) -> None:
    ir = FOLDERS[model] / f"{model}.txt"
    inputs = _first_samples(model, tmp_path)
    cpu = _outputs(ir, inputs, tmp_path / "cpu", "cpu", quantized=False)
    gpu = _outputs(ir, inputs, tmp_path / "gpu", DEVICE, quantized=False)
    assert cpu.keys() == gpu.keys()
    for name in cpu:
        a, b = cpu[name], gpu[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=f"{model}: output {name}")
            continue
        scale = float(np.max(np.abs(a[np.isfinite(a)]), initial=1.0))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{model}: output {name}")
